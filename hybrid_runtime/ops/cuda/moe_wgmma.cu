// The prefill MoE's two grouped GEMMs on Hopper warpgroup MMA (wgmma.mma_async, sm_90a only): the same launch
// contract, tile list, outputs and epilogues as moe_gemm.cu's mma.sync kernels (moe_gemm_gate_up / moe_gemm_down),
// which stay the fallback (other GPUs, shapes these tiles do not divide). Routing stays in moe_gemm.cu.
//
// Compiled by NVRTC (hybrid_runtime/cuda/kernels.py) for sm_90a with -DDT=<1 float16 | 2 bfloat16> (T).
// Self-contained (no CUDA headers). Host side: hybrid_runtime/cuda/moe_prefill.py (impl "wgmma").
//
// CTA (x, tile): WG_BM = 128 rows (the tile's pairs, gathered) x WG_BN weight rows (256, or 128 with -DWG_BN=128),
// 256 threads = two warpgroups; warpgroup w computes rows [64 w, 64 w + 64) x all WG_BN columns with wgmma
// m64nWG_BNk16 (A and B both from shared memory, float32 accumulators: WG_BN / 2 registers a thread).
// -DWG_BM=64: tiles of up to 64 rows (moe_group's bm 64), one warpgroup (128 threads) per CTA: steps with few
// pairs per expert waste half as many MMA rows on their experts' last, partly filled tiles (1024 tokens of the
// 35B-A3B shape: ~32 pairs per expert, 4x the rows computed with 128-row tiles, 2x with 64). A row goes through
// the same m64nWG_BNk16 instructions in the same k order as in the 128-row build: the same bits.
//   gate_up: B rows [0, BN/2) = gate rows [x*BN/2, +BN/2) of expert e, rows [BN/2, BN) = its up rows
//            [I + x*BN/2, +BN/2);  act[p, x*BN/2 + c] = silu(acc[:, c]) * acc[:, BN/2 + c]   (thread-local)
//   down:    B rows = w_d[e] rows [x*BN, +BN);  y[t, slot, x*BN + c] = pair_w[p] * acc[:, c]  (float32)
// Shared memory: WG_STAGES stages of (A 128 x 64 | B WG_BN x 64) T, each row 128 bytes, its 16-byte chunks
// XOR-swizzled by (row & 7) inside 1024-byte-aligned 8-row atoms: exactly the PTX ISA's canonical K-major
// 128-byte-swizzle layout, so the matrix descriptors are (start >> 4, LBO 16 bytes (unused for this layout),
// SBO 1024 bytes (8-row atom to the next), base offset 0, swizzle mode 1 = 128B) and the k16 step s of a k tile
// adds 32 s bytes to the start address. Copies: cp.async 16-byte (zero-fill for rows past the tile's), one commit
// group per k tile; consumer = producer (no warp specialisation). Per k tile kt: wait for tile kt's copies,
// fence.proxy.async (generic-proxy writes -> visible to the async proxy), barrier, issue the copies of tile
// kt + LEAD (LEAD = WG_STAGES - 1 - WG_INFLIGHT) into the stage tile kt - 1 - WG_INFLIGHT used (its wgmmas have
// completed in every warpgroup: each thread waited for them (wgmma.wait_group WG_INFLIGHT) before the barrier),
// then the 4 wgmmas of tile kt, commit, and wait until at most WG_INFLIGHT groups are in flight.
//   default  (WG_BN 256, WG_STAGES 4, WG_INFLIGHT 1): 193 KB, one CTA per SM, tile kt's MMAs overlap the issue
//            of tile kt + 1's;
//   -DWG_BN=128 -DWG_STAGES=3 -DWG_INFLIGHT=0: 97 KB, two CTAs per SM (one's epilogue under the other's MMAs).
// Both warpgroups always run their MMAs (a warpgroup-divergent branch around wgmma makes ptxas serialise them):
// rows past the tile's are zeros in shared memory and are never stored.
// Each output element comes from one pair's row alone with a fixed k order: batch invariance holds.
// Shapes: H % WG_BN == 0, I % (WG_BN / 2) == 0, H and I % 64 == 0, ldh % 8 == 0 (the host checks).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef DT
#define DT 2
#endif
#if DT != 1 && DT != 2
#error "moe_wgmma.cu is the tensor-core path: DT must be 1 (float16) or 2 (bfloat16)"
#endif
#if DT == 1
#define WG_TY "f16"
#else
#define WG_TY "bf16"
#endif
typedef u16 T;

#ifndef WG_BM
#define WG_BM 128  // rows per tile: 128, or 64 (one warpgroup) for tile lists of 64-row tiles (moe_group's bm)
#endif
#if WG_BM != 128 && WG_BM != 64
#error "WG_BM must be 128 or 64"
#endif
#ifndef WG_BN
#define WG_BN 256  // weight rows per CTA: 256 or 128
#endif
#ifndef WG_STAGES
#define WG_STAGES 4
#endif
#ifndef WG_INFLIGHT
#define WG_INFLIGHT 1  // wgmma groups left in flight at the end of a k tile: 1 or 0
#endif
#if WG_BN != 256 && WG_BN != 128
#error "WG_BN must be 256 or 128"
#endif
#if WG_INFLIGHT != 0 && WG_INFLIGHT != 1
#error "WG_INFLIGHT must be 0 or 1"
#endif
#define WG_LEAD (WG_STAGES - 1 - WG_INFLIGHT)  // k tiles copied ahead of the one multiplied
#if WG_LEAD < 1
#error "WG_STAGES too small for WG_INFLIGHT"
#endif
#define WG_ACC (WG_BN / 2)  // accumulator registers a thread (64 x WG_BN float32 over 128 threads)
#define WG_MINB (WG_BN == 256 ? 1 : 2)  // CTAs per SM (__launch_bounds__)
#define WG_BK 64   // k per stage: one 128-byte swizzle row
#define WG_THREADS (2 * WG_BM)  // one warpgroup per 64 rows
#define WG_RPP (WG_THREADS / 8)  // rows one copy pass covers (8 threads x 16 bytes per 128-byte row)
#define WG_ROWB (WG_BK * 2)
#define WG_A_BYTES (WG_BM * WG_ROWB)
#define WG_B_BYTES (WG_BN * WG_ROWB)
#define WG_STAGE_BYTES (WG_A_BYTES + WG_B_BYTES)
// the stages + 1 KB to align the ring to 1024 bytes (the 128B-swizzle atom)
#define WG_SMEM (WG_STAGES * WG_STAGE_BYTES + 1024)
#define WG_SBO 1024       // bytes from one 8-row atom to the next (M / N direction)
#define WG_LBO 16         // K direction: unused by K-major 128B-swizzle layouts (one atom spans the k tile)
#define WG_SWIZZLE_128B 1 // descriptor bits 62-63
#define MODE_GATE_UP 0
#define MODE_DOWN 1

// The fast intrinsics, as moe_wgmma_ws.cu (every prefill build gives the same act bits).
__device__ __forceinline__ float siluf_(float x) { return __fdividef(x, 1.f + __expf(-x)); }

__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

extern __shared__ __align__(1024) unsigned char wg_smem[];

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
// Byte offset of 16-byte chunk c (k elements 8c .. 8c + 7) of row `row` in a 1024-aligned operand tile.
__device__ __forceinline__ u32 wg_off(int row, int c) { return (u32)(row * WG_ROWB + ((c ^ (row & 7)) << 4)); }
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ u32 pack2(float lo, float hi) {  // lo -> low 16 bits
  u32 r;
#if DT == 1
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
// Two adjacent y elements of the down epilogue: float32, or (the _t entry point) rounded once to T (round to nearest
// even, cvt.rn: the only rounding the T slots add to the float32 products).
__device__ __forceinline__ void store_y2(float* dst, float a, float b) { *(float2*)dst = make_float2(a, b); }
__device__ __forceinline__ void store_y2(T* dst, float a, float b) { *(u32*)dst = pack2(a, b); }

// Matrix descriptor of a K-major, 128B-swizzled operand tile starting at shared address `saddr` (1024-aligned
// for base offset 0; + 32 s for the k16 step s).
__device__ __forceinline__ u64 wg_desc(u32 saddr) {
  return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)(WG_LBO >> 4) << 16) | ((u64)(WG_SBO >> 4) << 32) |
         ((u64)WG_SWIZZLE_128B << 62);
}

#define ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                "+f"(d[i + 6]), "+f"(d[i + 7])
#define ACC64(o) ACC8(o), ACC8(o + 8), ACC8(o + 16), ACC8(o + 24), ACC8(o + 32), ACC8(o + 40), ACC8(o + 48), \
                 ACC8(o + 56)
#if WG_BN == 256
#define ACC_ALL ACC64(0), ACC64(64)
#else
#define ACC_ALL ACC64(0)
#endif

// Keeps the compiler from moving accumulator register accesses across the asynchronous MMAs.
__device__ __forceinline__ void acc_fence(float (&d)[WG_ACC]) { asm volatile("" : ACC_ALL::"memory"); }

// D[64 x WG_BN] += A[64 x 16] B[WG_BN x 16]^T, both K-major in shared memory (descriptors da, db).
__device__ __forceinline__ void wgmma_k16(float (&d)[WG_ACC], u64 da, u64 db) {
#if WG_BN == 256
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." WG_TY "." WG_TY " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : ACC_ALL
      : "l"(da), "l"(db), "r"(1));
#else
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_TY "." WG_TY " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : ACC_ALL
      : "l"(da), "l"(db), "r"(1));
#endif
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

template <int MODE, typename YT = float>
__device__ __forceinline__ void wg_grouped_gemm(const T* __restrict__ A, long long lda, const T* __restrict__ W,
                                                int K, int I, int kk, int ny, int H, const int* __restrict__ tiles,
                                                const int* __restrict__ pair_list, const float* __restrict__ pair_w,
                                                T* __restrict__ act, YT* __restrict__ y) {
  __shared__ long long s_src[WG_BM];  // element offset of each tile row's A row in A (-1: past the rows)
  __shared__ int s_pair[WG_BM];
  pdl_enter();
  const int tile = blockIdx.y;
  if (tile >= tiles[0]) return;  // past the device's tile count: nothing to do, nothing written
  const int4 tl = *(const int4*)(tiles + 4 + 4 * (size_t)tile);
  const int e = tl.x, start = tl.y, rows = tl.z;
  const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wq = (tid >> 5) & 3;
  const int g = lane >> 2, t4 = lane & 3;  // accumulator fragment: rows g (+8), columns 8 j + 2 t4 (+1)
  for (int r = tid; r < WG_BM; r += WG_THREADS) {
    const int p = r < rows ? pair_list[start + r] : -1;
    s_pair[r] = p;
    s_src[r] = p < 0 ? -1ll : (MODE == MODE_GATE_UP ? (long long)(p / kk) * lda : (long long)p * lda);
  }
  __syncthreads();

  // Copies: this thread's 16-byte chunk ch of rows r0 + WG_RPP i (A: i < WG_BM / WG_RPP = 4, B: i < WG_BN / WG_RPP)
  // of each stage.
  const int ch = tid & 7, r0 = tid >> 3;
  const T* Wb;
  size_t up_jump = 0;  // gate_up: extra weight rows from staged row 128 on (the up rows)
  if (MODE == MODE_GATE_UP) {
    Wb = W + (size_t)e * 2 * I * K + (size_t)(blockIdx.x * (WG_BN / 2) + r0) * K + ch * 8;
    up_jump = (size_t)(I - WG_BN / 2) * K;
  } else {
    Wb = W + (size_t)e * H * K + (size_t)(blockIdx.x * WG_BN + r0) * K + ch * 8;
  }
  const u32 sbase = (smem_u32(wg_smem) + 1023u) & ~1023u;
  const int KT = K / WG_BK;

  auto load_stage = [&](int stage, int kt) {
    const u32 sA = sbase + stage * WG_STAGE_BYTES, sB = sA + WG_A_BYTES;
    const int k0 = kt * WG_BK;
#pragma unroll
    for (int i = 0; i < WG_BM / WG_RPP; ++i) {
      const int row = r0 + WG_RPP * i;
      const long long src = s_src[row];
      cp_async16(sA + wg_off(row, ch), A + (src < 0 ? 0 : src) + k0 + ch * 8, src < 0 ? 0 : 16);
    }
#pragma unroll
    for (int i = 0; i < WG_BN / WG_RPP; ++i) {
      const int row = r0 + WG_RPP * i;
      const T* src = Wb + (size_t)(WG_RPP * i) * K + (WG_RPP * i >= WG_BN / 2 ? up_jump : 0) + k0;
      cp_async16(sB + wg_off(row, ch), src, 16);
    }
  };

  float acc[WG_ACC];
#pragma unroll
  for (int i = 0; i < WG_ACC; ++i) acc[i] = 0.f;

#pragma unroll 1
  for (int s = 0; s < WG_LEAD; ++s) {
    if (s < KT) load_stage(s, s);
    cp_commit();
  }
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    cp_wait<WG_LEAD - 1>();  // this thread's copies of k tile kt have landed
    fence_proxy_async();     // ... and are visible to the async proxy (wgmma)
    __syncthreads();         // everyone's; and every wgmma of tile kt - 1 - WG_INFLIGHT has completed
    const int nk = kt + WG_LEAD;
    if (nk < KT) load_stage(nk % WG_STAGES, nk);
    cp_commit();  // one group per iteration (possibly empty) keeps the wait count uniform
    const u32 sA = sbase + (kt % WG_STAGES) * WG_STAGE_BYTES;
    const u64 da = wg_desc(sA + wg * (64 * WG_ROWB)), db = wg_desc(sA + WG_A_BYTES);
    acc_fence(acc);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < WG_BK / 16; ++s) wgmma_k16(acc, da + 2 * s, db + 2 * s);  // start address + 32 bytes
    wgmma_commit();
    acc_fence(acc);
    wgmma_wait<WG_INFLIGHT>();
    acc_fence(acc);
  }
  wgmma_wait<0>();
  acc_fence(acc);
  cp_wait<0>();

  // Epilogue: acc[4 j + 2 hi + b] = D[row 16 wq + g + 8 hi][column 8 j + 2 t4 + b] of this warpgroup's 64 rows.
  constexpr int NJ = WG_BN / 8;  // n-tiles of 8 columns
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int r = wg * 64 + wq * 16 + g + hi * 8;
    if (r >= rows) continue;
    const int p = s_pair[r];
    if (MODE == MODE_GATE_UP) {
      T* dst = act + (size_t)p * I + blockIdx.x * (WG_BN / 2) + 2 * t4;
#pragma unroll
      for (int j = 0; j < NJ / 2; ++j) {  // gate n-tile j and the up n-tile of the same columns, j + NJ / 2
        const float v0 = siluf_(acc[4 * j + 2 * hi]) * acc[4 * (j + NJ / 2) + 2 * hi];
        const float v1 = siluf_(acc[4 * j + 2 * hi + 1]) * acc[4 * (j + NJ / 2) + 2 * hi + 1];
        *(u32*)(dst + j * 8) = pack2(v0, v1);
      }
    } else {
      const int t = p / kk, slot = p - t * kk;
      const float w = pair_w[p];
      YT* dst = y + ((size_t)t * ny + slot) * H + blockIdx.x * WG_BN + 2 * t4;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        store_y2(dst + j * 8, w * acc[4 * j + 2 * hi], w * acc[4 * j + 2 * hi + 1]);
    }
  }
}

// grid (I / (WG_BN / 2), max_tiles), block WG_THREADS, dynamic smem WG_SMEM. h [n, ldh] T; w_gu [E_all, 2I, H]; act [pairs, I].
extern "C" __global__ void __launch_bounds__(WG_THREADS, WG_MINB)
    moe_wgmma_gate_up(const T* __restrict__ h, long long ldh, const T* __restrict__ w_gu, int H, int I, int kk,
                      const int* __restrict__ tiles, const int* __restrict__ pair_list, T* __restrict__ act) {
  wg_grouped_gemm<MODE_GATE_UP, float>(h, ldh, w_gu, H, I, kk, 0, H, tiles, pair_list, nullptr, act, nullptr);
}

// grid (H / WG_BN, max_tiles), block WG_THREADS, dynamic smem WG_SMEM. act [pairs, I] T; w_d [E_all, H, I];
// y [n, ny, H] float32 (ny >= kk; moe_*_down_t below: in T).
extern "C" __global__ void __launch_bounds__(WG_THREADS, WG_MINB)
    moe_wgmma_down(const T* __restrict__ act, const T* __restrict__ w_d, const float* __restrict__ pair_w, int H,
                   int I, int kk, int ny, const int* __restrict__ tiles, const int* __restrict__ pair_list,
                   float* __restrict__ y) {
  wg_grouped_gemm<MODE_DOWN, float>(act, I, w_d, I, I, kk, ny, H, tiles, pair_list, pair_w, nullptr, y);
}

// The same with y [n, ny, H] in T (prefill of bf16 / fp16 bundles: half the slot traffic of float32).
extern "C" __global__ void __launch_bounds__(WG_THREADS, WG_MINB)
    moe_wgmma_down_t(const T* __restrict__ act, const T* __restrict__ w_d, const float* __restrict__ pair_w, int H,
                     int I, int kk, int ny, const int* __restrict__ tiles, const int* __restrict__ pair_list,
                     T* __restrict__ y) {
  wg_grouped_gemm<MODE_DOWN, T>(act, I, w_d, I, I, kk, ny, H, tiles, pair_list, pair_w, nullptr, y);
}
