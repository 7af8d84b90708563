// MoE for many tokens (prefill) on tensor cores: routing in many CTAs, a tile list built on the device, and
// two grouped GEMMs (gate_up with the SwiGLU fused in its epilogue, down with the routing weight in its
// epilogue). No host synchronisation: the GEMM grids are launched with an upper bound of the tile count and
// CTAs past the count the device wrote exit at once.
//
// Compiled by NVRTC (hybrid_runtime/cuda/kernels.py) once per dtype with -DDT=<1 float16 | 2 bfloat16> (T):
// bf16/fp16 inputs, float32 accumulation (mma.sync m16n8k16). float32 bundles keep fused.cu's CUDA-core MoE.
// Self-contained (no CUDA headers). Host side: hybrid_runtime/cuda/moe_prefill.py.
//
// Every kernel waits for the kernel before it (griddepcontrol.wait) before it touches global memory, then
// lets its dependent launch (griddepcontrol.launch_dependents): the backend launches them as programmatic
// dependents (PDL), as it does fused.cu's kernels.
//
// Data contract (the same as fused.cu's moe_route, so the rest of the backend is unchanged):
//   logits   [n, ld] float32: the router's E logits, then (fold_shared) the shared gate's logit at column E
//   pair_w[p], pair_e[p]               p = t * kk + slot, kk = k + fold_shared
//   expert_off[e] .. expert_off[e+1]   the slice of pair_list holding expert e's pairs (ascending p here)
//   active[0 .. n_active-1]            experts with at least one pair, ascending; active[E_all] = n_active
// plus the tile list of the grouped GEMMs (bm rows per tile, moe_group's argument: GEMM_BM = 128, or 64 for
// moe_wgmma.cu's 64-row build; every GEMM kernel takes tiles of up to 128 rows):
//   tiles[0] = the tile count; tile j at tiles[4 + 4j ..]: (expert, first slot in pair_list, rows 1..bm)
//   expert e contributes ceil(count_e / bm) tiles, experts ascending, an expert's tiles in slot order.
// Routing works in chunks of `chunk` tokens, one CTA per chunk (ncta = ceil(n / chunk) <= the host's cap):
//   moe_topk  (grid ncta, 1024 threads): per token (one warp) softmax + top-k exactly as moe_route, and the
//             CTA's per-expert pair counts -> cta_counts [ncta, E_all] (no atomics in global memory)
//   moe_group (grid ncta, 1024 threads): every CTA sums the counts (its own prefix and the totals), scans
//             them; CTA 0 writes expert_off, active and the tile list; each CTA places its chunk's pairs
//             (warp by warp in pair order: pair_list is sorted within each expert, whatever the chunking).
// Every output element of the GEMMs comes from one pair's row alone with a fixed k order, so a token's
// results never depend on the other tokens of the step (batch invariance).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef DT
#define DT 2
#endif
#if DT != 1 && DT != 2
#error "moe_gemm.cu is the tensor-core path: DT must be 1 (float16) or 2 (bfloat16)"
#endif
typedef u16 T;

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }
// The fast intrinsics, as moe_wgmma_ws.cu (every prefill build gives the same act bits).
__device__ __forceinline__ float siluf_(float x) { return __fdividef(x, 1.f + __expf(-x)); }

__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ================================================================================================
// Routing
// ================================================================================================
#define TOPK_THREADS 1024
#define GROUP_THREADS 1024
#ifndef GEMM_BM
#define GEMM_BM 128
#endif

#include "moe_route.cuh"

// grid (ncta), block 1024: CTA c routes tokens [c * chunk, min(n, (c + 1) * chunk)), one warp per token, and
// writes its per-expert pair counts to cta_counts[c, 0 .. E_all-1]. k <= 31, E_all = E + fold_shared <= 1024.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    moe_topk(const float* __restrict__ logits, int ld, int n, int E, int k, int renorm, int fold_shared, int chunk,
             float* __restrict__ pair_w, int* __restrict__ pair_e, int* __restrict__ cta_counts) {
  pdl_enter();
  __shared__ int cnt[1024];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kk = k + fold_shared, E_all = E + fold_shared;
  for (int e = tid; e < E_all; e += TOPK_THREADS) cnt[e] = 0;
  __syncthreads();
  const int t0 = blockIdx.x * chunk, t1 = min(n, t0 + chunk);
  for (int t = t0 + warp; t < t1; t += TOPK_THREADS / 32) {
    int e;
    float w;
    route_token(logits + (size_t)t * ld, E, k, renorm, fold_shared, lane, e, w);
    if (e >= 0) {
      pair_e[t * kk + lane] = e;
      pair_w[t * kk + lane] = w;
      atomicAdd(&cnt[e], 1);  // counts only: the same whatever the order
    }
  }
  __syncthreads();
  for (int e = tid; e < E_all; e += TOPK_THREADS) cta_counts[(size_t)blockIdx.x * E_all + e] = cnt[e];
}

// Exclusive scan of one int per thread over a 1024-thread block (fixed order); *total = the sum. `scratch`:
// 33 ints of shared memory, free on entry (the function starts and ends with a barrier).
__device__ __forceinline__ int block_scan_excl(int v, int* scratch, int* total) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int a = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += a;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int s = scratch[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += a;
    }
    scratch[lane] = s;  // inclusive scan of the warp totals
  }
  __syncthreads();
  const int r = (warp ? scratch[warp - 1] : 0) + incl - v;
  *total = scratch[31];
  __syncthreads();
  return r;
}

// grid (ncta), block 1024 (thread e = expert e). After moe_topk: offsets, active list, tile list (CTA 0) and
// pair_list (every CTA its own chunk's pairs). `max_tiles`: the tile list's capacity (the GEMM grids' bound);
// `bm`: rows per tile, 1 .. GEMM_BM.
extern "C" __global__ void __launch_bounds__(GROUP_THREADS)
    moe_group(const int* __restrict__ pair_e, int n, int kk, int E_all, int chunk, int ncta,
              const int* __restrict__ cta_counts, int* __restrict__ expert_off, int* __restrict__ pair_list,
              int* __restrict__ active, int* __restrict__ tiles, int max_tiles, int bm) {
  pdl_enter();
  __shared__ int cursor[1024];
  __shared__ int scratch[33];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = blockIdx.x;
  int total = 0, before = 0;
  if (tid < E_all) {
#pragma unroll 8
    for (int j = 0; j < ncta; ++j) {  // integer sums: the same in every CTA (8 loads in flight)
      const int v = cta_counts[(size_t)j * E_all + tid];
      total += v;
      before += j < c ? v : 0;
    }
  }
  int all, n_active, n_tiles;
  const int off = block_scan_excl(total, scratch, &all);
  const int f = total > 0 ? 1 : 0;
  const int act_pos = block_scan_excl(f, scratch, &n_active);
  const int nt = (total + bm - 1) / bm;
  const int tile0 = block_scan_excl(nt, scratch, &n_tiles);
  if (c == 0) {
    if (tid < E_all) {
      expert_off[tid] = off;
      if (f) active[act_pos] = tid;
      for (int j = 0; j < nt && tile0 + j < max_tiles; ++j) {
        int4* tp = (int4*)(tiles + 4 + 4 * (size_t)(tile0 + j));
        *tp = make_int4(tid, off + j * bm, min(bm, total - j * bm), 0);
      }
    }
    if (tid == 0) {
      expert_off[E_all] = all;
      active[E_all] = n_active;
      tiles[0] = min(n_tiles, max_tiles);  // never past the capacity (the host's bound makes it exact)
    }
  }
  if (tid < E_all) cursor[tid] = off + before;
  __syncthreads();
  // This chunk's pairs in pair order, 1024 at a time; within a round the warps take turns (one barrier each)
  // and each warp ranks its 32 pairs by expert with one match.
  const int p0 = c * chunk * kk, p1 = min(n, (c + 1) * chunk) * kk;
  for (int base = p0; base < p1; base += GROUP_THREADS) {
    const int q = base + tid;
    const bool ok = q < p1;
    const int e = ok ? pair_e[q] : -1;
    const int warps = (min(GROUP_THREADS, p1 - base) + 31) >> 5;
    for (int w = 0; w < warps; ++w) {
      if (warp == w) {
        const u32 same = __match_any_sync(0xffffffffu, e);
        const int rank = __popc(same & ((1u << lane) - 1u));
        int pos = 0;
        if (ok) pos = cursor[e] + rank;
        __syncwarp();
        if (ok) {
          pair_list[pos] = q;
          if (lane == 31 - __clz(same)) cursor[e] += __popc(same);  // the group's last lane moves the cursor
        }
      }
      __syncthreads();
    }
  }
}

// ================================================================================================
// Grouped GEMMs: CTA (x, tile) computes GEMM_BM rows (the tile's pairs) x one column block.
//   gate_up: A = h rows of the pairs' tokens ([n, ldh] T), B = expert e's gate rows [x*64, +64) and up rows
//            [I + x*64, +64) of w_gu [E_all, 2I, H]; act[p, x*64 + i] = silu(gate) * up   (T, [pairs, I])
//   down:    A = act rows of the pairs, B = rows [x*128, +128) of w_d [E_all, H, I];
//            y[t, slot, x*128 + j] = pair_w[p] * acc   (float32, or T from moe_gemm_down_t; y [n, ny, H]; no atomics:
//            one slot per pair)
// 128 threads = 4 warps (2 x 2), warp tile 64 rows x 64 columns (8 n-tiles of 8; gate_up: 4 gate n-tiles
// and the 4 up n-tiles of the same columns, so SwiGLU is thread-local). BK = 64: shared rows of 128 bytes,
// 16-byte chunks XOR-swizzled by (row & 7); GEMM_STAGES-deep cp.async ring, one commit group per k tile.
// Dynamic shared memory GEMM_SMEM (96 KB: two CTAs per SM). m-tiles wholly past the tile's rows are skipped.
// Shapes: H % 128 == 0, I % 64 == 0, ldh % 8 == 0 (the host checks).
// ================================================================================================
#define GEMM_THREADS 128
#define BN 128  // B rows staged per CTA
#define BK 64
#define GEMM_STAGES 3
#define ROWB (BK * 2)
#define A_BYTES (GEMM_BM * ROWB)
#define B_BYTES (BN * ROWB)
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define GEMM_SMEM (GEMM_STAGES * STAGE_BYTES)
#define MODE_GATE_UP 0
#define MODE_DOWN 1

extern __shared__ __align__(128) unsigned char smem[];

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ int swz(int row, int c) { return c ^ (row & 7); }
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ u32 pack2(float lo, float hi) {  // lo -> low 16 bits
  u32 r;
#if DT == 1
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if DT == 1
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two adjacent y elements of the down epilogue: float32, or (the _t entry points) rounded once to T (round to nearest
// even, cvt.rn: the only rounding the T slots add to the float32 products).
__device__ __forceinline__ void store_y2(float* dst, float a, float b) { *(float2*)dst = make_float2(a, b); }
__device__ __forceinline__ void store_y2(T* dst, float a, float b) { *(u32*)dst = pack2(a, b); }

// Shared row of the B tile that n-tile pair np (n-tiles 2np, 2np+1) of warp column wn starts at.
template <int MODE>
__device__ __forceinline__ int b_smem_row(int wn, int np) {
  if (MODE == MODE_GATE_UP) return np < 2 ? wn * 32 + np * 16 : 64 + wn * 32 + (np - 2) * 16;
  return wn * 64 + np * 16;
}

// One BK-deep stage of the warp's 64 x 64 tile: per k16 step, 4 ldmatrix.x4 of B (8 n-tiles), then per m-tile
// one ldmatrix.x4 of A and 8 MMAs. FULL: all 4 m-tiles hold rows (no branches in the hot loop); otherwise only
// the m-tiles with a row of the tile (mrows = the tile's rows from this warp's first row on, > 0) are computed.
template <int MODE, bool FULL>
__device__ __forceinline__ void mma_stage(float (&acc)[4][8][4], u32 sA, u32 sB, int wm, int wn, int mrows,
                                          int lane) {
  const int a_row = lane & 15, a_ch = lane >> 4;                              // ldmatrix lanes: A [m][k]
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_ch = (lane >> 3) & 1;  // B [n][k] (non-trans)
#pragma unroll
  for (int ks = 0; ks < BK / 16; ++ks) {
    u32 b[8][2];
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      u32 r[4];
      const int row = b_smem_row<MODE>(wn, np) + b_row;
      ldsm_x4(r, sB + row * ROWB + swz(row, 2 * ks + b_ch) * 16);
      b[2 * np][0] = r[0];
      b[2 * np][1] = r[1];
      b[2 * np + 1][0] = r[2];
      b[2 * np + 1][1] = r[3];
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      if (FULL || mt * 16 < mrows) {
        u32 a[4];
        const int row = wm * 64 + mt * 16 + a_row;
        ldsm_x4(a, sA + row * ROWB + swz(row, 2 * ks + a_ch) * 16);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) mma16816(acc[mt][nt], a, b[nt][0], b[nt][1]);
      }
    }
  }
}

template <int MODE, typename YT = float>
__device__ __forceinline__ void grouped_gemm(const T* __restrict__ A, long long lda, const T* __restrict__ W,
                                             int K, int I, int kk, int ny, int H, const int* __restrict__ tiles,
                                             const int* __restrict__ pair_list, const float* __restrict__ pair_w,
                                             T* __restrict__ act, YT* __restrict__ y) {
  __shared__ long long s_src[GEMM_BM];  // element offset of each tile row's A row in A (-1: past the rows)
  __shared__ int s_pair[GEMM_BM];
  pdl_enter();
  const int tile = blockIdx.y;
  if (tile >= tiles[0]) return;  // past the device's tile count: nothing to do, nothing written
  const int4 tl = *(const int4*)(tiles + 4 + 4 * (size_t)tile);
  const int e = tl.x, start = tl.y, rows = tl.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  const int g = lane >> 2, t4 = lane & 3;  // mma fragments: row g (+8), columns 2 t4, 2 t4 + 1
  for (int r = tid; r < GEMM_BM; r += GEMM_THREADS) {
    const int p = r < rows ? pair_list[start + r] : -1;
    s_pair[r] = p;
    s_src[r] = p < 0 ? -1ll : (MODE == MODE_GATE_UP ? (long long)(p / kk) * lda : (long long)p * lda);
  }
  __syncthreads();

  // B: this thread's 16-byte chunk (tid & 7) of rows (tid >> 3) + 16 i, i < 8, of the stage's B tile.
  const int ch = tid & 7, r0 = tid >> 3;
  const T* Wb;
  size_t up_jump = 0;  // gate_up: extra rows from staged row 64 on (the up rows)
  if (MODE == MODE_GATE_UP) {
    Wb = W + (size_t)e * 2 * I * K + (size_t)(blockIdx.x * 64 + r0) * K + ch * 8;
    up_jump = (size_t)(I - 64) * K;
  } else {
    Wb = W + (size_t)e * H * K + (size_t)(blockIdx.x * BN + r0) * K + ch * 8;
  }
  const u32 sbase = smem_u32(smem);
  const int KT = K / BK;

  auto load_stage = [&](int stage, int kt) {
    const u32 sA = sbase + stage * STAGE_BYTES, sB = sA + A_BYTES;
    const int k0 = kt * BK;
#pragma unroll
    for (int i = 0; i < GEMM_BM / 16; ++i) {
      const int row = r0 + 16 * i;
      const long long src = s_src[row];
      cp_async16(sA + row * ROWB + swz(row, ch) * 16, A + (src < 0 ? 0 : src) + k0 + ch * 8, src < 0 ? 0 : 16);
    }
#pragma unroll
    for (int i = 0; i < BN / 16; ++i) {
      const int row = r0 + 16 * i;
      const T* src = Wb + (size_t)(16 * i) * K + (i >= 4 ? up_jump : 0) + k0;
      cp_async16(sB + row * ROWB + swz(row, ch) * 16, src, 16);
    }
  };

  float acc[4][8][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][nt][r] = 0.f;

  const int mrows = rows - wm * 64;  // the tile's rows from this warp's first row on (warp-uniform)

#pragma unroll 1
  for (int s = 0; s < GEMM_STAGES - 1; ++s) {
    if (s < KT) load_stage(s, s);
    cp_commit();
  }
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    cp_wait<GEMM_STAGES - 2>();  // k tile kt has landed (this thread's copies) ...
    __syncthreads();             // ... everyone's, and every warp is done with the stage refilled below
    const int nk = kt + GEMM_STAGES - 1;
    if (nk < KT) load_stage(nk % GEMM_STAGES, nk);
    cp_commit();  // one group per iteration (possibly empty) keeps the wait count uniform
    const u32 sA = sbase + (kt % GEMM_STAGES) * STAGE_BYTES, sB = sA + A_BYTES;
    if (mrows >= 64)
      mma_stage<MODE, true>(acc, sA, sB, wm, wn, mrows, lane);
    else if (mrows > 0)
      mma_stage<MODE, false>(acc, sA, sB, wm, wn, mrows, lane);
  }
  cp_wait<0>();

  // Epilogue: thread holds rows wm*64 + mt*16 + g (+8) and columns 2 t4, 2 t4 + 1 of each n-tile.
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int r = wm * 64 + mt * 16 + g + hi * 8;
      if (r >= rows) continue;
      const int p = s_pair[r];
      if (MODE == MODE_GATE_UP) {
        T* dst = act + (size_t)p * I + blockIdx.x * 64 + wn * 32 + 2 * t4;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const float v0 = siluf_(acc[mt][nt][2 * hi]) * acc[mt][nt + 4][2 * hi];
          const float v1 = siluf_(acc[mt][nt][2 * hi + 1]) * acc[mt][nt + 4][2 * hi + 1];
          *(u32*)(dst + nt * 8) = pack2(v0, v1);
        }
      } else {
        const int t = p / kk, slot = p - t * kk;
        const float w = pair_w[p];
        YT* dst = y + ((size_t)t * ny + slot) * H + blockIdx.x * BN + wn * 64 + 2 * t4;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) store_y2(dst + nt * 8, w * acc[mt][nt][2 * hi], w * acc[mt][nt][2 * hi + 1]);
      }
    }
  }
}

// grid (I / 64, max_tiles), block 128, dynamic smem GEMM_SMEM. h [n, ldh] T; w_gu [E_all, 2I, H]; act [pairs, I].
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    moe_gemm_gate_up(const T* __restrict__ h, long long ldh, const T* __restrict__ w_gu, int H, int I, int kk,
                     const int* __restrict__ tiles, const int* __restrict__ pair_list, T* __restrict__ act) {
  grouped_gemm<MODE_GATE_UP, float>(h, ldh, w_gu, H, I, kk, 0, H, tiles, pair_list, nullptr, act, nullptr);
}

// grid (H / 128, max_tiles), block 128, dynamic smem GEMM_SMEM. act [pairs, I] T; w_d [E_all, H, I];
// y [n, ny, H] float32 (ny >= kk; moe_*_down_t below: in T).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    moe_gemm_down(const T* __restrict__ act, const T* __restrict__ w_d, const float* __restrict__ pair_w, int H,
                  int I, int kk, int ny, const int* __restrict__ tiles, const int* __restrict__ pair_list,
                  float* __restrict__ y) {
  grouped_gemm<MODE_DOWN, float>(act, I, w_d, I, I, kk, ny, H, tiles, pair_list, pair_w, nullptr, y);
}

// The same with y [n, ny, H] in T (prefill of bf16 / fp16 bundles: half the slot traffic of float32).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    moe_gemm_down_t(const T* __restrict__ act, const T* __restrict__ w_d, const float* __restrict__ pair_w, int H,
                    int I, int kk, int ny, const int* __restrict__ tiles, const int* __restrict__ pair_list,
                    T* __restrict__ y) {
  grouped_gemm<MODE_DOWN, T>(act, I, w_d, I, I, kk, ny, H, tiles, pair_list, pair_w, nullptr, y);
}
