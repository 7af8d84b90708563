// The MoE router of decode steps (n <= 16 token rows) in ONE launch: the router GEMM (float32 logits of every
// router row) spread over ceil(E_pad / MR_ROWS) CTAs, then, in the last CTA to finish ("last block done"),
// exactly fused.cu's moe_route (per-token softmax + top-k through moe_route.cuh's route_token, counting,
// scans, grouping by expert). It replaces the cuBLASLt router GEMM + moe_route pair of the `cuda` backend's
// decode steps (hybrid_runtime/cuda/moe_router.py; backend.py moe()).
//
// Compiled by NVRTC once per dtype and knob set: -DDT=<1 float16 | 2 bfloat16> (h and the router weights),
// -DMR_ROWS=<4 | 8 | 16> (router rows per CTA: 4 -> 66 CTAs, 8 -> 33, 16 -> 17 for E_pad = 264). Self-contained
// (no CUDA headers).
//
// Phase 1, every CTA: logits[t, row] = sum_k h[t, k] * w[row, k] (float32) for its rows row0 .. row0+MR_ROWS-1
// (< E_pad; the router's zero padding rows give 0) and all n tokens, on the tensor cores: one m16n8k16 tile
// per 8 rows (tokens are the M = 16 side; rows t >= n are zeros in the A fragments and never written).
// H is cut in blocks of 32 k; block b belongs to warp b % 32, which adds it to its accumulators in ascending
// b; the 32 warps' accumulators are then summed in warp order 0..31 through shared memory. The k order of
// every logit is thus fixed by H alone: a token's logits have the same bits whatever else shares the step,
// whatever its row (each row of an MMA is computed from that row of A alone). Each lane loads, per block,
// 16 bytes (8 consecutive k) of its weight row and 16 bytes of tokens g and g+8: the 8 k of a lane's 16-byte
// chunk are the MMA's k slots {2q, 2q+1, 2q+8, 2q+9} of one k16 step and the same slots of the next (the
// same permutation of k on both operands, so the dot product is unchanged). h is not staged in shared
// memory: each h element is read by exactly one warp of a CTA, straight into its A fragment.
//
// PDL: the weights do not depend on the previous kernel, so each lane issues its first MR_PF blocks of weight
// loads BEFORE griddepcontrol.wait (then launch_dependents, as fused.cu's pdl_enter): when launched as a
// programmatic dependent, the weight read (the kernel's DRAM traffic) overlaps the previous kernel's tail.
// h, the workspace and every output are touched only after the wait.
//
// Phase 2, the last CTA: every CTA writes its logits, fences (__threadfence) and counts itself on
// workspace[0] (atomicAdd); the CTA that brings the count to gridDim.x resets it to 0 for the next launch
// (stream-ordered launches and CUDA graph replays see 0: the next launch reads it only after its own
// griddepcontrol.wait / the stream order), copies the n x (E + fold_shared) logits from L2 (ld.global.cg)
// into shared memory and routes: the outputs are moe_route's, bit for bit, given the same logits:
//   pair_w[p], pair_e[p]               p = t * kk + slot, kk = k + fold_shared
//   expert_off[e] .. expert_off[e+1]   the slice of pair_list holding expert e's pairs
//   active[0 .. n_active-1]            the experts with at least one pair, ascending; active[E_all] = n_active
// (within an expert the pairs' order may vary run to run, as moe_route's). One workspace per stream: two
// launches that share one must be ordered.
//
// Block: 1024 threads in every CTA (any CTA may be the last): one warp per token routes all n <= 16 tokens at
// once (route_token is a latency chain of ~k arg-max rounds; one token per warp keeps it at one chain), and the
// counting / scans are moe_route's 1024-thread code unchanged (E_all + 1 <= 1025 entries). 1024 threads cap
// registers at 64: the grid is one CTA per SM (<= 66 CTAs on 132 SMs). Phase 1 spreads its loads over all
// 32 warps (H = 2048: per lane 2 x 16 bytes of weights per 8 rows, 4 x 16 bytes of h), all in flight at once.
//
// Shapes (the host checks, hybrid_runtime/cuda/moe_router.py shape_problems): 1 <= n <= 16, H % 32 == 0,
// ldh % 8 == 0, 16-byte aligned h and w, E_pad <= ld, E + fold_shared <= min(E_pad, 1024), 1 <= k <= 31,
// k <= E; dynamic shared memory max(32 * tiles * 512, n * (E + fold_shared) * 4) bytes.

typedef unsigned short u16;
typedef unsigned int u32;

#ifndef DT
#define DT 2
#endif
#if DT != 1 && DT != 2
#error "moe_router.cu runs on the tensor cores: DT must be 1 (float16) or 2 (bfloat16)"
#endif
typedef u16 T;

#ifndef MR_ROWS
#define MR_ROWS 8
#endif
#if MR_ROWS != 4 && MR_ROWS != 8 && MR_ROWS != 16
#error "MR_ROWS (router rows per CTA) must be 4, 8 or 16"
#endif
#define MR_TILES ((MR_ROWS + 7) / 8)  // m16n8k16 tiles (8 router rows each) per CTA
#ifndef MR_PF
#define MR_PF 2  // 32-k blocks per warp loaded per round (the first round before griddepcontrol.wait)
#endif
// MR_TIMING 1 (diagnostics, benchmarks/gpu_router_timing.py): clock64 marks of every CTA's phases into
// ((long long*)workspace)[2 + 8 * blockIdx.x + i] (the workspace must hold 16 + 64 * (grid + 1) bytes); the last CTA
// adds its phase-2 marks at [2 + 8 * gridDim.x + i]. Off by default: no extra work, no extra bytes.
#ifndef MR_TIMING
#define MR_TIMING 0
#endif
#if MR_TIMING
#define MR_MARK(slot, i) \
  if (threadIdx.x == 0) reinterpret_cast<long long*>(workspace)[2 + 8 * (slot) + (i)] = clock64()
#else
#define MR_MARK(slot, i)
#endif
#define MR_THREADS 1024
#define MR_WARPS 32
#define MR_KB 32  // k per block: two k16 MMA steps
#define MR_MAX_TOKENS 16
#define MR_MAX_KK 32

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

#include "moe_route.cuh"

__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// 16 bytes of weights, read once (no L1 allocation). volatile: issued where written, i.e. the first round
// before griddepcontrol.wait. Not ld.global.nc: ptxas (NVRTC 13) hoists griddepcontrol.wait (ACQBULK) above
// non-coherent loads, which would serialise the weight read behind the previous kernel again; it keeps plain
// ld.global where it is (tests/gpu/test_moe_router_compile.py checks the SASS order where nvdisasm exists).
__device__ __forceinline__ uint4 ld_weights(const T* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// A float written by another CTA of this launch (after its __threadfence): read from L2, never from L1.
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if DT == 1
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Loads round `i0` (blocks warp + MR_WARPS * (i0 + i), i < MR_PF) of this lane's weights: tile j's row
// row0 + 8j + g, k [32b + 8q, +8). Rows past the CTA's MR_ROWS or past E_pad, and blocks past H, are zeros.
__device__ __forceinline__ void load_weight_round(uint4 (&wr)[MR_PF][MR_TILES], const T* __restrict__ w, int H,
                                                  int e_pad, int row0, int warp, int g, int q, int i0, int nkb) {
#pragma unroll
  for (int i = 0; i < MR_PF; ++i) {
    const int b = warp + MR_WARPS * (i0 + i);
#pragma unroll
    for (int j = 0; j < MR_TILES; ++j) {
      const int r = 8 * j + g, row = row0 + r;
      if (b < nkb && r < MR_ROWS && row < e_pad)
        wr[i][j] = ld_weights(w + (size_t)row * H + b * MR_KB + 8 * q);
      else
        wr[i][j] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// grid (ceil(E_pad / MR_ROWS)), block MR_THREADS, dynamic shared memory (see the header). h [n, ldh] T,
// w [E_pad, H] T, logits [n, ld] float32 (columns 0 .. E_pad-1 written), workspace: >= 1 int, 0 between
// launches (zero it once at allocation).
extern "C" __global__ void __launch_bounds__(MR_THREADS)
    moe_router_route(const T* __restrict__ h, long long ldh, const T* __restrict__ w, int H, int e_pad,
                     float* __restrict__ logits, int ld, int n, int E, int k, int renorm, int fold_shared,
                     float* __restrict__ pair_w, int* __restrict__ pair_e, int* __restrict__ expert_off,
                     int* __restrict__ pair_list, int* __restrict__ active, int* __restrict__ workspace) {
  extern __shared__ __align__(16) float smem[];
  __shared__ int cnt[1025];
  __shared__ int scan[1025];
  __shared__ int pe_s[MR_MAX_TOKENS * MR_MAX_KK];
  __shared__ int s_last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int row0 = blockIdx.x * MR_ROWS;
  const int nkb = H / MR_KB;

  // ---- phase 1: this CTA's router rows for all n tokens
  MR_MARK(blockIdx.x, 0);
  uint4 wr[MR_PF][MR_TILES];
  load_weight_round(wr, w, H, e_pad, row0, warp, g, q, 0, nkb);  // before the wait: weights are static
  pdl_wait();
  MR_MARK(blockIdx.x, 1);
  pdl_launch_dependents();
  float acc[MR_TILES][4];
#pragma unroll
  for (int j = 0; j < MR_TILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const bool lo_ok = g < n, hi_ok = g + 8 < n;  // A rows g and g + 8: tokens past n are zeros
  const T* h_lo = h + (size_t)g * ldh + 8 * q;
  const T* h_hi = h + (size_t)(g + 8) * ldh + 8 * q;
  for (int i0 = 0; warp + MR_WARPS * i0 < nkb; i0 += MR_PF) {
    if (i0) load_weight_round(wr, w, H, e_pad, row0, warp, g, q, i0, nkb);
    uint4 ha[MR_PF], hb[MR_PF];
#pragma unroll
    for (int i = 0; i < MR_PF; ++i) {
      const int b = warp + MR_WARPS * (i0 + i);
      const uint4 z = make_uint4(0u, 0u, 0u, 0u);
      ha[i] = b < nkb && lo_ok ? *(const uint4*)(h_lo + b * MR_KB) : z;
      hb[i] = b < nkb && hi_ok ? *(const uint4*)(h_hi + b * MR_KB) : z;
    }
#pragma unroll
    for (int i = 0; i < MR_PF; ++i) {
      if (warp + MR_WARPS * (i0 + i) < nkb) {
#pragma unroll
        for (int j = 0; j < MR_TILES; ++j) {
          // k slots {2q, 2q+1 | 2q+8, 2q+9} of step 1 = k 8q + {0,1 | 2,3} of the block; step 2: 8q + {4,5 | 6,7}
          mma16816(acc[j], ha[i].x, hb[i].x, ha[i].y, hb[i].y, wr[i][j].x, wr[i][j].y);
          mma16816(acc[j], ha[i].z, hb[i].z, ha[i].w, hb[i].w, wr[i][j].z, wr[i][j].w);
        }
      }
    }
  }
  // accumulators -> red[warp][tile][t * 8 + r] (lane: rows g, g + 8, columns 2q, 2q + 1)
  float* red = smem;
#pragma unroll
  for (int j = 0; j < MR_TILES; ++j) {
    float* rj = red + (warp * MR_TILES + j) * 128;
    *(float2*)(rj + g * 8 + 2 * q) = make_float2(acc[j][0], acc[j][1]);
    *(float2*)(rj + (g + 8) * 8 + 2 * q) = make_float2(acc[j][2], acc[j][3]);
  }
  __syncthreads();
  if (tid < MR_TILES * 128) {
    const int j = tid >> 7, e = tid & 127, t = e >> 3, r = 8 * j + (e & 7), row = row0 + r;
    if (t < n && r < MR_ROWS && row < e_pad) {
      float s = red[j * 128 + e];
#pragma unroll 8
      for (int v = 1; v < MR_WARPS; ++v) s += red[(v * MR_TILES + j) * 128 + e];  // warp order: fixed
      logits[(size_t)t * ld + row] = s;
    }
  }

  MR_MARK(blockIdx.x, 2);
  // ---- last block done: the CTA that counts last routes
  __threadfence();  // this thread's logits are visible device-wide before the CTA counts itself
  __syncthreads();
  if (tid == 0) {
    const int last = atomicAdd(workspace, 1) == (int)gridDim.x - 1;
    if (last) {
      __threadfence();  // acquire: every CTA's logits (each fenced before its count) are visible below
      workspace[0] = 0;  // every CTA has counted: ready for the next launch
    }
    s_last = last;
  }
  __syncthreads();
  MR_MARK(blockIdx.x, 3);
  if (!s_last) return;

  // ---- phase 2: moe_route over the logits (staged in shared memory: route_token reads each many times)
  const int kk = k + fold_shared, E_all = E + fold_shared, Ew = E + fold_shared;
  float* lg = smem;  // red is dead: its last reads were before the barrier above
  for (int i = tid; i < n * Ew; i += MR_THREADS) {
    const int t = i / Ew, e = i - t * Ew;
    lg[i] = ld_cg(logits + (size_t)t * ld + e);
  }
  __syncthreads();
  MR_MARK(gridDim.x, 0);
#if MR_TIMING
  if (tid == 0) reinterpret_cast<long long*>(workspace)[2 + 8 * gridDim.x + 7] = blockIdx.x;
#endif
  for (int t = warp; t < n; t += MR_WARPS) {
    int e;
    float wt;
    route_token(lg + t * Ew, E, k, renorm, fold_shared, lane, e, wt);
    if (e >= 0) {
      pair_e[t * kk + lane] = e;
      pair_w[t * kk + lane] = wt;
      pe_s[t * kk + lane] = e;
    }
  }
  __syncwarp();
  MR_MARK(gridDim.x, 1);
  // From here on: fused.cu moe_route's counting, scans and grouping (1024 threads), reading the pairs' experts
  // from shared memory (the same values it reads back from pair_e).
  for (int e = tid; e < E_all + 1; e += MR_THREADS) cnt[e] = 0;
  __syncthreads();
  const int np = n * kk;
  for (int p = tid; p < np; p += MR_THREADS) atomicAdd(&cnt[pe_s[p]], 1);
  __syncthreads();
  int c = tid < E_all ? cnt[tid] : 0;
  int f = c > 0 ? 1 : 0;
  int ic = c, jf = f;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int a = __shfl_up_sync(0xffffffffu, ic, o), b = __shfl_up_sync(0xffffffffu, jf, o);
    if (lane >= o) {
      ic += a;
      jf += b;
    }
  }
  if (lane == 31) {
    scan[warp] = ic;
    scan[32 + warp] = jf;
  }
  __syncthreads();
  if (warp == 0) {
    int tc = scan[lane], tf = scan[32 + lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(0xffffffffu, tc, o), b = __shfl_up_sync(0xffffffffu, tf, o);
      if (lane >= o) {
        tc += a;
        tf += b;
      }
    }
    scan[lane] = tc;
    scan[32 + lane] = tf;
  }
  __syncthreads();
  const int excl = (warp ? scan[warp - 1] : 0) + ic - c;
  const int flag_incl = (warp ? scan[32 + warp - 1] : 0) + jf;
  __syncthreads();
  scan[tid] = flag_incl;
  __syncthreads();
  if (tid < E_all) {
    expert_off[tid] = excl;
    if (f) active[scan[tid] - 1] = tid;
    cnt[tid] = excl;  // becomes the fill cursor
  }
  if (tid == E_all - 1) {
    expert_off[E_all] = excl + c;
    active[E_all] = scan[tid];
  }
  __syncthreads();
  for (int p = tid; p < np; p += MR_THREADS) pair_list[atomicAdd(&cnt[pe_s[p]], 1)] = p;
  MR_MARK(gridDim.x, 2);
}
