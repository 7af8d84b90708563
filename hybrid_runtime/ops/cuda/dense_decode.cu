// Dense projections of decode steps (1..16 rows) on tensor cores, "swap AB" as moe_decode.cu: the WEIGHT rows
// are the mma.sync M operand (16 rows per m-tile) and the step's rows (tokens) the N operand (8 per n-group), so a
// one-token step wastes 7 of 8 mma columns instead of 127 of 128 rows. Host side: hybrid_runtime/cuda/dense_decode.py.
// Self-contained (no CUDA headers): NVRTC compiles it on a CPU.
//
//   out[j, r] = sum_k W[r, k] * X[j, k]  (+ bias[r])  (+ R[j, r])      j < n <= 16, r < N
//   X [n, ldx] T, W [N, K] T (row-major, K contiguous), bias float32 [N] or null, R float32 [n, ldr] or null (may
//   alias out: D = C in place), out float32 or T [n, ldo].
//
// Compiled once per dtype with -DDT=<1 float16 | 2 bfloat16> (T): float32 accumulation (mma m16n8k16). Knobs (-D):
//   DD_U    k super-steps per register batch (a super-step is 32 k: two mma k16 steps); two batches in flight
//   DD_PF   further super-steps of the warp's weight stream prefetched into L2 before griddepcontrol.wait
//   DD_SYNC how a CTA waits for the kernel before it (benchmarks.gpu_kernel_boundary measures the three; the
//           backend builds 0 only): 0 griddepcontrol.wait (programmatic dependent launch, the default); 1 no
//           wait at all (a benchmark's lower bound, never correct in a step); 2 a counter in global memory
//           (two more kernel parameters: thread 0 spins with ld.acquire.gpu until *sync_ctr >= sync_target, and
//           after its stores each CTA adds 1 with release semantics)
//   DD_PREWAIT register batches of weight loads issued before the wait: 1 (the default) or 2 (both batches: with
//           DD_U = 8 a whole warp's 16 super-steps, e.g. all of a 2048-k row slice over 4 warps)
//   DD_TRIGGER where griddepcontrol.launch_dependents runs: 0 after the wait (the default), 1 at the kernel's entry
//           (the dependent grid may then be scheduled while this one still waits for its own predecessor: the
//           launches run ahead of the data; each kernel's wait still waits for its predecessor's completion)
//
// No shared-memory staging: a lane loads 16 bytes of weight row g and of row g + 8 (g = lane / 4, t = lane % 4) at
// k = 32 s + 8 t of super-step s, straight into mma A-fragment registers. The dot product does not care in which
// order the k of a step are paired as long as A and B agree: the lane loads its B fragment (16 bytes of X row g of
// the n-group, the same k) the same way, so logical k (2t, 2t+1) of mma step 0 is physical k 32 s + 8 t + (0, 1),
// logical (2t + 8, 2t + 9) is + (2, 3), and mma step 1 takes + (4..7). Every load is a full 16-byte vector and a
// warp reads 16 rows x 64 contiguous bytes per super-step.
//
// CTA = blockDim.x / 32 warps (1..8, chosen by the host from K) over RM = 16 MT weight rows; warp w takes the
// super-steps [S w / nw, S (w + 1) / nw) of S = K / 32 (split K). Before griddepcontrol.wait (programmatic
// dependent launch: the kernel before it may still be running) each warp issues its first register batch of
// weight loads (weights are never written by a step) and, with DD_PF, L2 prefetches of the next DD_PF
// super-steps; X, R and out are touched only after the wait. The warps' partial sums meet in shared memory and
// are added in warp order 0, 1, ..., nw - 1, then bias, then R.
//
// Batch invariance by construction: an output element is the dot product of weight row r with X row j accumulated
// in one fixed order - per warp its super-steps in order, each two m16n8k16 MMAs, then the warps' sums in warp
// order - which depends on (K, nw, DD_U) only, never on n or on which n-group or column j lands in (columns past
// n are zero rows and never written). tests/gpu/test_dense_decode_gpu.py checks it bit for bit.
// Shapes: K % 32 == 0, ldx % 8 == 0 and X, W 16-byte aligned (the host checks); any N (rows past N are clamped
// loads, never written); 1 <= n <= 16.

typedef unsigned short u16;
typedef unsigned int u32;

#ifndef DT
#define DT 2
#endif
#if DT != 1 && DT != 2
#error "dense_decode.cu is a tensor-core path: DT must be 1 (float16) or 2 (bfloat16)"
#endif
#ifndef DD_U
#define DD_U 4
#endif
#ifndef DD_PF
#define DD_PF 0
#endif
#ifndef DD_SYNC
#define DD_SYNC 0
#endif
#define DD_MAXW 8
static_assert(DD_SYNC >= 0 && DD_SYNC <= 2, "DD_SYNC must be 0, 1 or 2");
#ifndef DD_TRIGGER
#define DD_TRIGGER 0
#endif
#ifndef DD_PREWAIT
#define DD_PREWAIT 1
#endif
static_assert(DD_PREWAIT == 1 || DD_PREWAIT == 2, "DD_PREWAIT must be 1 or 2");
static_assert(DD_TRIGGER == 0 || DD_TRIGGER == 1, "DD_TRIGGER must be 0 or 1");
#if DD_SYNC == 2
#define DD_SYNC_PARAMS , unsigned int *sync_ctr, unsigned int sync_target
#define DD_SYNC_ARGS , sync_ctr, sync_target
#else
#define DD_SYNC_PARAMS
#define DD_SYNC_ARGS
#endif
static_assert(DD_U >= 1 && DD_U <= 8, "DD_U must be 1..8");
static_assert(DD_PF >= 0 && DD_PF <= 64, "DD_PF must be 0..64");

__device__ __forceinline__ u16 from_f32(float v) {
  u16 h;
#if DT == 1
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  return h;
}

__device__ __forceinline__ void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if DT == 1
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// A weight vector: read once per step, never written by it (no L1 allocation; legal before griddepcontrol.wait).
__device__ __forceinline__ uint4 ld_weights(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// One batch of DD_U super-steps of weight loads: b[i][mt][h] = rows (g + 8 h) of m-tile mt at super-step s + i.
template <int MT>
__device__ __forceinline__ void load_batch(uint4 (&b)[DD_U][MT][2], const uint4* const (&wp)[MT][2], int s, int s1) {
#pragma unroll
  for (int i = 0; i < DD_U; ++i)
    if (s + i < s1)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) b[i][mt][h] = ld_weights(wp[mt][h] + 4 * (s + i));
}

// The MMAs of one batch: X fragments of n-groups 0 .. ng-1 (zero for rows past n) against the batch's weights.
template <int MT>
__device__ __forceinline__ void mma_batch(float (&acc)[MT][2][4], const uint4 (&b)[DD_U][MT][2],
                                          const uint4* const (&xp)[2], const bool (&xr)[2], int ng, int s, int s1) {
  uint4 xv[DD_U][2];
#pragma unroll
  for (int i = 0; i < DD_U; ++i)
#pragma unroll
    for (int q = 0; q < 2; ++q)
      xv[i][q] = (s + i < s1 && q < ng && xr[q]) ? xp[q][4 * (s + i)] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int i = 0; i < DD_U; ++i) {
    if (s + i >= s1) break;  // warp-uniform
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint4 lo = b[i][mt][0], hi = b[i][mt][1];  // rows g, g + 8
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (q >= ng) break;
        mma16816(acc[mt][q], lo.x, hi.x, lo.y, hi.y, xv[i][q].x, xv[i][q].y);  // physical k + 0..3
        mma16816(acc[mt][q], lo.z, hi.z, lo.w, hi.w, xv[i][q].z, xv[i][q].w);  // physical k + 4..7
      }
    }
  }
}

template <int MT>
__device__ __forceinline__ void dd_cta(const u16* __restrict__ X, long long ldx, const u16* __restrict__ W, int N,
                                       int K, int n, const float* __restrict__ bias, const float* R, long long ldr,
                                       void* out, long long ldo, int out_f32 DD_SYNC_PARAMS) {
  constexpr int RM = 16 * MT;
  __shared__ float4 red[DD_MAXW][MT][2][32];
#if DD_TRIGGER == 1 && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * RM;
  const int S = K >> 5;
  const int s0 = (int)((long long)S * warp / nw), s1 = (int)((long long)S * (warp + 1) / nw);
  const uint4* wp[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = min(row0 + mt * 16 + g + 8 * h, N - 1);  // rows past N: clamped loads, never written
      wp[mt][h] = reinterpret_cast<const uint4*>(W + (size_t)r * K) + t;
    }
  uint4 ba[DD_U][MT][2], bb[DD_U][MT][2];
  load_batch<MT>(ba, wp, s0, s1);  // before the wait: the weights do not depend on the kernel before this one
#if DD_PREWAIT == 2
  load_batch<MT>(bb, wp, s0 + DD_U, s1);
#endif
#if DD_PF > 0
#pragma unroll 1
  for (int i = 0; i < DD_PF; ++i) {  // lane t == 0 of each row: the 64 bytes of a super-step share one line
    const int s = s0 + DD_U + i;
    if (s >= s1) break;
    if (t == 0)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(wp[mt][h] + 4 * s) : "memory");
  }
#endif
#if DD_SYNC == 2
  if (threadIdx.x == 0) {
    unsigned int seen;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(sync_ctr) : "memory");
      if (seen >= sync_target) break;
      __nanosleep(32);
    }
  }
  __syncthreads();
#endif
#if __CUDA_ARCH__ >= 900
#if DD_SYNC == 0
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
#if DD_TRIGGER == 0
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
#endif
  const int ng = (n + 7) >> 3;
  const uint4* xp[2];
  bool xr[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int j = 8 * q + g;
    xr[q] = j < n;
    xp[q] = reinterpret_cast<const uint4*>(X + (size_t)(j < n ? j : 0) * ldx) + t;
  }
  float acc[MT][2][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][q][c] = 0.f;
#pragma unroll 1
  for (int s = s0; s < s1; s += 2 * DD_U) {
#if DD_PREWAIT == 2
    if (s != s0)  // the first iteration's bb went out before the wait
#endif
      load_batch<MT>(bb, wp, s + DD_U, s1);
    mma_batch<MT>(acc, ba, xp, xr, ng, s, s1);
    load_batch<MT>(ba, wp, s + 2 * DD_U, s1);
    mma_batch<MT>(acc, bb, xp, xr, ng, s + DD_U, s1);
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int q = 0; q < 2; ++q)
      if (q < ng) red[warp][mt][q][lane] = make_float4(acc[mt][q][0], acc[mt][q][1], acc[mt][q][2], acc[mt][q][3]);
  __syncthreads();
  for (int f = warp; f < MT * ng; f += nw) {
    const int mt = f / ng, q = f - mt * ng;
    float4 v = red[0][mt][q][lane];
    for (int w = 1; w < nw; ++w) {  // fixed order: warp 0 + warp 1 + ...
      const float4 u = red[w][mt][q][lane];
      v.x += u.x;
      v.y += u.y;
      v.z += u.z;
      v.w += u.w;
    }
    // fragment: v.x (row g, col 2t), v.y (row g, col 2t + 1), v.z (row g + 8, col 2t), v.w (row g + 8, col 2t + 1)
    const float vals[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = 8 * q + 2 * t + (c & 1), r = row0 + mt * 16 + g + 8 * (c >> 1);
      if (j >= n || r >= N) continue;
      float o = vals[c];
      if (bias) o += bias[r];
      if (R) o += R[(size_t)j * ldr + r];
      if (out_f32)
        reinterpret_cast<float*>(out)[(size_t)j * ldo + r] = o;
      else
        reinterpret_cast<u16*>(out)[(size_t)j * ldo + r] = from_f32(o);
    }
  }
#if DD_SYNC == 2
  __syncthreads();  // every store of this CTA precedes the release below
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(sync_ctr) : "memory");
#endif
}

// grid (ceil(N / 16), 1, 1), block 32 * nw (nw 1..8).
extern "C" __global__ void __launch_bounds__(256) dd_gemm_m16(const u16* __restrict__ X, long long ldx,
                                                              const u16* __restrict__ W, int N, int K, int n,
                                                              const float* __restrict__ bias, const float* R,
                                                              long long ldr, void* out, long long ldo, int out_f32
                                                              DD_SYNC_PARAMS) {
  dd_cta<1>(X, ldx, W, N, K, n, bias, R, ldr, out, ldo, out_f32 DD_SYNC_ARGS);
}

// grid (ceil(N / 32), 1, 1), block 32 * nw (nw 1..8).
extern "C" __global__ void __launch_bounds__(256) dd_gemm_m32(const u16* __restrict__ X, long long ldx,
                                                              const u16* __restrict__ W, int N, int K, int n,
                                                              const float* __restrict__ bias, const float* R,
                                                              long long ldr, void* out, long long ldo, int out_f32
                                                              DD_SYNC_PARAMS) {
  dd_cta<2>(X, ldx, W, N, K, n, bias, R, ldr, out, ldo, out_f32 DD_SYNC_ARGS);
}

#if DD_SYNC == 2
// benchmarks.gpu_kernel_boundary only: `phases` products in ONE launch, CTA b taking the same 16 rows of each
// (W + j N K into columns j N .. of out, float32), the phases ordered by the counter alone (phase j waits for
// *sync_ctr >= j * gridDim.x): the chain with no kernel boundary at all, only a grid-wide flag between products
// (what a persistent kernel pays per phase). Every CTA must be resident at once: the host launches it only with
// gridDim.x <= the SM count. grid (ceil(N / 16), 1, 1), block 32 * nw.
extern "C" __global__ void __launch_bounds__(256) dd_gemm_m16_phases(const u16* __restrict__ X, long long ldx,
                                                                     const u16* __restrict__ W, int N, int K,
                                                                     int n, void* out, long long ldo, int phases,
                                                                     unsigned int* sync_ctr) {
  for (int j = 0; j < phases; ++j)
    dd_cta<1>(X, ldx, W + (size_t)j * N * K, N, K, n, nullptr, nullptr, 0, reinterpret_cast<float*>(out) + (size_t)j * N,
              ldo, 1, sync_ctr, (unsigned int)(j * gridDim.x));
}
#endif
