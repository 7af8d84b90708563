// Fused kernels of the `cuda` backend: the segment programs' ops (hybrid_runtime/program.py) between the
// cuBLASLt GEMMs, and the MoE on the device. Self-contained (no CUDA headers): NVRTC compiles it on a CPU.
//
// Compiled once per weight/activation dtype with -DDT=<0 float32 | 1 float16 | 2 bfloat16> (T below). The
// residual stream is always float32; T is what GEMMs read (normed activations, projections, weights) and
// what the KV pool holds. Every reduction has a fixed order (per row, lanes then warps), so a row's result
// never depends on the other rows of the batch.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef DT
#define DT 2
#endif

#if DT == 0
typedef float T;
#define VEC 4
#else
typedef u16 T;
#define VEC 8
#endif

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(u16 x) {
#if DT == 1
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
#else
  return __uint_as_float(((u32)x) << 16);
#endif
}
__device__ __forceinline__ T from_f32(float v) {
#if DT == 0
  return v;
#else
  u16 h;
#if DT == 1
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  return h;
#endif
}
__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float softplusf_(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// VEC elements of T as 16 bytes.
struct Vec {
  uint4 raw;
  __device__ __forceinline__ float get(int i) const {
#if DT == 0
    return __uint_as_float(((const u32*)&raw)[i]);
#else
    return to_f32(((const u16*)&raw)[i]);
#endif
  }
};
__device__ __forceinline__ Vec load_vec(const T* p) {
  Vec v;
  v.raw = *(const uint4*)p;
  return v;
}

// Programmatic dependent launch (sm_90+): every pipeline kernel here first waits for the kernel before it to
// finish and flush (griddepcontrol.wait: a no-op when not launched as a dependent), then lets the next one be
// scheduled, so its launch latency hides behind this kernel's run. Nothing reads global memory before the wait.
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

// ------------------------------------------------------------------------------------------------
// embed: x[r, :] = table[ids[r], :] (float32 out). grid (n), any block size.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void embed_rows(const int* __restrict__ ids, const T* __restrict__ table, float* __restrict__ x,
                                      int n, int H) {
  pdl_enter();
  const int r = blockIdx.x;
  if (r >= n) return;
  const T* src = table + (size_t)ids[r] * H;
  for (int c = threadIdx.x; c < H; c += blockDim.x) x[(size_t)r * H + c] = to_f32(src[c]);
}

// ------------------------------------------------------------------------------------------------
// (add +) rmsnorm. Output row r reads input row s = rows ? rows[r] : r:
//   v = x[s] + y[s, 0] + y[s, 1] + ... + y[s, ny-1]   (float32, added left to right in slot order; when sg != 0 the
//       last slot is a shared expert run as GEMMs, added as fmaf(y[s, ny-1], sigmoid(sg[s * sg_stride]), v))
//   x_out[r] = v (float32; may be x itself), h[r] = v / sqrt(mean(v^2) + eps) * w   (T)
// Two entry points of one body: rmsnorm_rows reads y [n_in, ny, H] float32 (decode MoE slots; a dense FFN output
// or any float32 tensor with ny = 1), rmsnorm_rows_t reads y [n_in, ny, H] in T (the prefill MoE's slots, bf16 /
// fp16: each slot value was rounded once to T by the epilogue that wrote it; the sum here is float32 all the same,
// so on slot values that T holds exactly both entry points give the same bits).
//
// grid (n), blockDim P = a power of two in 32 .. NORM_MAX_THREADS with 4 * NORM_KMAX * P >= H. P only sets the
// speed (the host picks it by row count: norm_block in cuda/backend.py): a row's bits depend neither on P nor on n
// nor on which load path ran (16-byte vectors when H % 4 == 0 and the pointers allow, else scalar), because the sum
// of squares is one fixed tree over the row:
//   groups g = 0 .. G-1 of 4 columns (4g .. 4g+3; columns past H count 0), group partial
//   p_g = fma(v3, v3, fma(v2, v2, fma(v1, v1, v0 * v0))); over the partials, zero-padded to N = a power of two,
//   halving strides: q_g = p_g + p_(g + N/2) for g < N/2, then the same over q, ... down to one value.
// Thread t holds groups t + k P (k < NORM_KMAX: coalesced), so strides >= P are its own (the same halving tree over
// k, in registers) and strides < P are between threads: warp 0 folds the warps' values (strides P/2 .. 32, read
// from shared memory) and warp_sum does 16 .. 1 (its xor order). Padding with zeros never changes a sum (p + 0 ==
// p), so the tree over N leaves is the tree over 2N and every P computes the same tree (modelled in numpy:
// tests/unit/test_norm_tree.py). Only the rounding of v * rs * w to T is added after the sum, as before.
// ------------------------------------------------------------------------------------------------
#ifndef NORM_KMAX
#define NORM_KMAX 4  // groups of 4 columns per thread at most: H <= 4 * NORM_KMAX * P (a power of two)
#endif
#define NORM_MAX_THREADS 512  // launch bound
#if NORM_KMAX <= 4
#define NORM_MIN_BLOCKS 2  // <= 64 registers a thread: 4 CTAs of 256 threads per SM (the prefill block)
#else
#define NORM_MIN_BLOCKS 1  // the wide builds hold 4 * NORM_KMAX columns a thread: up to 128 registers
#endif

__device__ __forceinline__ float ld1(const float* p) { return *p; }
__device__ __forceinline__ float ld1(const u16* p) { return to_f32(*p); }
__device__ __forceinline__ float4 ld4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ float4 ld4(const u16* p) {  // 4 bf16 / fp16 values: one 8-byte load
  const uint2 r = *(const uint2*)p;
  return make_float4(to_f32((u16)(r.x & 0xffffu)), to_f32((u16)(r.x >> 16)), to_f32((u16)(r.y & 0xffffu)),
                     to_f32((u16)(r.y >> 16)));
}
__device__ __forceinline__ bool aligned_to(const void* p, unsigned int bytes) {
  return ((unsigned long long)p & (bytes - 1)) == 0;
}
// columns c .. c+3 of a row of H (c < H; columns past H read as 0)
template <typename E>
__device__ __forceinline__ float4 load_group(const E* row, int c, int H, bool vec) {
  if (vec) return ld4(row + c);
  return make_float4(ld1(row + c), c + 1 < H ? ld1(row + c + 1) : 0.f, c + 2 < H ? ld1(row + c + 2) : 0.f,
                     c + 3 < H ? ld1(row + c + 3) : 0.f);
}
__device__ __forceinline__ void store_group(float* row, int c, int H, bool vec, float4 a) {
  if (vec) {
    *(float4*)(row + c) = a;
    return;
  }
  row[c] = a.x;
  if (c + 1 < H) row[c + 1] = a.y;
  if (c + 2 < H) row[c + 2] = a.z;
  if (c + 3 < H) row[c + 3] = a.w;
}
__device__ __forceinline__ void store_group_t(T* row, int c, int H, bool vec, float4 a) {
#if DT == 0
  store_group(row, c, H, vec, a);
#else
  if (vec) {
    *(uint2*)(row + c) = make_uint2((u32)from_f32(a.x) | ((u32)from_f32(a.y) << 16),
                                    (u32)from_f32(a.z) | ((u32)from_f32(a.w) << 16));
    return;
  }
  row[c] = from_f32(a.x);
  if (c + 1 < H) row[c + 1] = from_f32(a.y);
  if (c + 2 < H) row[c + 2] = from_f32(a.z);
  if (c + 3 < H) row[c + 3] = from_f32(a.w);
#endif
}

// a[0] = the halving-stride tree over a[0 .. N-1] (N a power of two): a[i] += a[i + N/2] for i < N/2, then the
// same with N/4, ... (S: the stride of this level)
template <int N, int S = N / 2>
__device__ __forceinline__ void tree_sum(float (&a)[N]) {
#pragma unroll
  for (int i = 0; i < S; ++i) a[i] = __fadd_rn(a[i], a[i + S]);
  if constexpr (S > 1) tree_sum<N, S / 2>(a);
}

template <typename YT, bool VECTOR>
__device__ __forceinline__ void rmsnorm_body(const float* x, const YT* __restrict__ y, int ny,
                                             const float* __restrict__ sg, long long sg_stride,
                                             const float* __restrict__ w, float* x_out, T* __restrict__ h,
                                             const int* __restrict__ rows, int n, int H, float eps, float* red) {
  const int r = blockIdx.x;
  const int s = rows ? rows[r] : r;
  const float* xs = x + (size_t)s * H;
  const YT* ys = y ? y + (size_t)s * ny * H : nullptr;
  const int nslots = y ? ny : 0;
  const bool gated = sg && nslots > 0;
  const int nplain = gated ? nslots - 1 : nslots;  // slots added as they are; then the gated one
  const float gate = gated ? sigmoidf_(sg[(size_t)s * sg_stride]) : 1.f;
  float* xo = x_out ? x_out + (size_t)r * H : nullptr;
  T* ho = h ? h + (size_t)r * H : nullptr;
  const int P = blockDim.x, t = threadIdx.x, G = (H + 3) >> 2;
  constexpr bool vec = VECTOR;
  float4 v[NORM_KMAX];
  float p[NORM_KMAX];
#pragma unroll
  for (int k = 0; k < NORM_KMAX; ++k) {
    const int g = t + k * P;
    p[k] = 0.f;
    v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (g < G) {
      const int c = 4 * g;
      float4 a = load_group(xs, c, H, vec);
      const float4 b = gated ? load_group(ys + (size_t)nplain * H, c, H, vec) : a;  // issued with the others
#pragma unroll 8
      for (int j = 0; j < nplain; ++j) {  // independent loads, added in slot order
        const float4 u = load_group(ys + (size_t)j * H, c, H, vec);
        a.x += u.x;
        a.y += u.y;
        a.z += u.z;
        a.w += u.w;
      }
      if (gated) {
        a.x = fmaf(b.x, gate, a.x);
        a.y = fmaf(b.y, gate, a.y);
        a.z = fmaf(b.z, gate, a.z);
        a.w = fmaf(b.w, gate, a.w);
      }
      if (xo) store_group(xo, c, H, vec, a);
      p[k] = fmaf(a.w, a.w, fmaf(a.z, a.z, fmaf(a.y, a.y, __fmul_rn(a.x, a.x))));
      v[k] = a;
    }
  }
  if (!h) return;  // "add" only (the whole block returns together: no barrier is skipped by some threads)
  tree_sum<NORM_KMAX>(p);  // this thread's strides (k P apart), halving
  float tot;
  if (P > 32) {
    red[t] = p[0];
    __syncthreads();
    if (t < 32) {  // lane l folds threads l + 32 w over the warps w (halving strides W/2 .. 1), in place
      for (int st = P >> 6; st >= 1; st >>= 1)
        for (int i = 0; i < st; ++i) red[t + 32 * i] = __fadd_rn(red[t + 32 * i], red[t + 32 * (i + st)]);
      const float s2 = warp_sum(red[t]);
      if (t == 0) red[NORM_MAX_THREADS] = s2;
    }
    __syncthreads();
    tot = red[NORM_MAX_THREADS];
  } else {
    tot = warp_sum(p[0]);  // every lane holds the same sum (a + b == b + a)
  }
  const float rs = rsqrtf(tot / (float)H + eps);
#pragma unroll
  for (int k = 0; k < NORM_KMAX; ++k) {
    const int g = t + k * P;
    if (g < G) {
      const int c = 4 * g;
      const float4 wv = load_group(w, c, H, vec);
      store_group_t(ho, c, H, vec, make_float4(v[k].x * rs * wv.x, v[k].y * rs * wv.y, v[k].z * rs * wv.z,
                                                v[k].w * rs * wv.w));
    }
  }
}

// 16-byte loads and stores when H % 4 == 0 and every row start is aligned for them (true of the backend's arena),
// else scalar ones: the same arithmetic on the same groups either way.
template <typename YT>
__device__ __forceinline__ void rmsnorm_rows_any(const float* x, const YT* __restrict__ y, int ny,
                                                 const float* __restrict__ sg, long long sg_stride,
                                                 const float* __restrict__ w, float* x_out, T* __restrict__ h,
                                                 const int* __restrict__ rows, int n, int H, float eps) {
  __shared__ float red[NORM_MAX_THREADS + 1];  // the threads' partial sums, then the row's sum
  pdl_enter();
  if (blockIdx.x >= n) return;
  if ((H & 3) == 0 && aligned_to(x, 16) && aligned_to(y, 4 * sizeof(YT)) && aligned_to(x_out, 16) &&
      aligned_to(h, 4 * sizeof(T)) && aligned_to(w, 16))
    rmsnorm_body<YT, true>(x, y, ny, sg, sg_stride, w, x_out, h, rows, n, H, eps, red);
  else
    rmsnorm_body<YT, false>(x, y, ny, sg, sg_stride, w, x_out, h, rows, n, H, eps, red);
}

extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS, NORM_MIN_BLOCKS)
    rmsnorm_rows(const float* x, const float* __restrict__ y, int ny, const float* __restrict__ sg,
                 long long sg_stride, const float* __restrict__ w, float* x_out, T* __restrict__ h,
                 const int* __restrict__ rows, int n, int H, float eps) {
  rmsnorm_rows_any(x, y, ny, sg, sg_stride, w, x_out, h, rows, n, H, eps);
}

extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS, NORM_MIN_BLOCKS)
    rmsnorm_rows_t(const float* x, const T* __restrict__ y, int ny, const float* __restrict__ sg,
                   long long sg_stride, const float* __restrict__ w, float* x_out, T* __restrict__ h,
                   const int* __restrict__ rows, int n, int H, float eps) {
  rmsnorm_rows_any(x, y, ny, sg, sg_stride, w, x_out, h, rows, n, H, eps);
}

// ------------------------------------------------------------------------------------------------
// Projections (the GEMM outputs that feed these kernels: p, z, gate, gu, the GDN core) are float32; what a
// GEMM reads next (h, o, act) is T.
// GDN gates from the fused projection p = [u | z | b | a] (rows of p_stride):
//   g = neg_exp_a * softplus(a + dt_bias),  beta = sigmoid(b)      (float32 [n, nv])
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void gdn_gates(const float* __restrict__ p, long long p_stride, int off_b, int off_a,
                                     const float* __restrict__ neg_exp_a, const float* __restrict__ dt_bias,
                                     float* __restrict__ g, float* __restrict__ beta, int n, int nv) {
  pdl_enter();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n * nv) return;
  const int t = i / nv, j = i % nv;
  const float* row = p + (size_t)t * p_stride;
  g[i] = neg_exp_a[j] * softplusf_(row[off_a + j] + dt_bias[j]);
  beta[i] = sigmoidf_(row[off_b + j]);
}

// ------------------------------------------------------------------------------------------------
// Attention inputs from the fused projection p = [q|gate per head (H x 2hd) | k (Hkv x hd) | v (Hkv x hd)]:
// q and k get RMSNorm1p per head (weights qn / kn = 1 + w) and rotate-half RoPE on their first rd dims
// (cos/sin tables [positions, rd], float32). q -> q_out [n, H*hd] (T). k and v -> the paged pools at row
// kv_rows[t] ([rows, Hkv*hd]) when kpool != 0, and/or to k_out / v_out [n, Hkv*hd] when given.
// The gate stays in p (sigmoid_mul reads it there). grid (n, ceil((H + 2 Hkv) / 4)), block 128: one warp
// per head. hd <= 256.
// ------------------------------------------------------------------------------------------------
#define QKV_WARPS 4
extern "C" __global__ void attn_qkv(const float* __restrict__ p, long long p_stride, const int* __restrict__ positions,
                                    const float* __restrict__ qn, const float* __restrict__ kn,
                                    const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                    T* __restrict__ q_out, T* __restrict__ kpool, T* __restrict__ vpool,
                                    const long long* __restrict__ kv_rows, T* __restrict__ k_out,
                                    T* __restrict__ v_out, int n, int H, int Hkv, int hd, int rd, float eps) {
  pdl_enter();
  __shared__ float stage[QKV_WARPS][256];
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int hi = blockIdx.y * QKV_WARPS + warp;
  if (t >= n || hi >= H + 2 * Hkv) return;
  const float* row = p + (size_t)t * p_stride;
  const long long kvrow = kv_rows ? kv_rows[t] : 0;
  if (hi >= H + Hkv) {  // v head: copy
    const int vh = hi - H - Hkv;
    const float* src = row + 2 * H * hd + Hkv * hd + vh * hd;
    for (int d = lane; d < hd; d += 32) {
      const T v = from_f32(src[d]);
      if (vpool) vpool[kvrow * Hkv * hd + vh * hd + d] = v;
      if (v_out) v_out[(size_t)t * Hkv * hd + vh * hd + d] = v;
    }
    return;
  }
  const bool is_q = hi < H;
  const int head = is_q ? hi : hi - H;
  const float* src = is_q ? row + head * 2 * hd : row + 2 * H * hd + head * hd;
  const float* nw = is_q ? qn : kn;
  float* st = stage[warp];
  float ss = 0.f;
  for (int d = lane; d < hd; d += 32) {
    const float v = src[d];
    st[d] = v;
    ss += v * v;
  }
  const float rs = rsqrtf(warp_sum(ss) / (float)hd + eps);
  __syncwarp();
  for (int d = lane; d < hd; d += 32) st[d] = st[d] * rs * nw[d];
  __syncwarp();
  const int pos = positions[t], half = rd >> 1;
  for (int d = lane; d < hd; d += 32) {
    float v = st[d];
    if (d < rd) {
      const float c = cos_t[(size_t)pos * rd + d], s = sin_t[(size_t)pos * rd + d];
      const float rot = d < half ? -st[d + half] : st[d - half];
      v = v * c + rot * s;
    }
    const T o = from_f32(v);
    if (is_q) {
      q_out[(size_t)t * H * hd + head * hd + d] = o;
    } else {
      if (kpool) kpool[kvrow * Hkv * hd + head * hd + d] = o;
      if (k_out) k_out[(size_t)t * Hkv * hd + head * hd + d] = o;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// GDN output: per value head, o = core / sqrt(mean(core^2) + eps) * w * silu(z). z rows of z_stride.
// grid (n, ceil(nv / 4)), block 128: one warp per head. dv <= 1024.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void gated_rmsnorm(const float* __restrict__ core, const float* __restrict__ z, long long z_stride,
                                         const float* __restrict__ w, T* __restrict__ o, int n, int nv, int dv,
                                         float eps) {
  pdl_enter();
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.y * 4 + warp;
  if (t >= n || h >= nv) return;
  const float* c = core + (size_t)t * nv * dv + h * dv;
  float ss = 0.f;
  for (int d = lane; d < dv; d += 32) {
    const float v = c[d];
    ss += v * v;
  }
  const float rs = rsqrtf(warp_sum(ss) / (float)dv + eps);
  const float* zr = z + (size_t)t * z_stride + h * dv;
  for (int d = lane; d < dv; d += 32)
    o[(size_t)t * nv * dv + h * dv + d] = from_f32(c[d] * rs * w[d] * siluf_(zr[d]));
}

// ------------------------------------------------------------------------------------------------
// Attention output gate: o[t, h*hd + d] = a[t, h*hd + d] * sigmoid(gate[t * gate_stride + h * 2hd + d]).
// a float32 [n, H*hd] (the attention kernels' output); gate points at p + hd (its rows of p_stride).
// ------------------------------------------------------------------------------------------------
// grid (n, ceil(H * hd / 256)), block 256: row t = blockIdx.x, no 64-bit division per element (the flat grid with
// one: 199 us for 8192 x 4096 elements on an H200, this grid 181 us).
extern "C" __global__ void sigmoid_mul(const float* __restrict__ a, const float* __restrict__ gate, long long gate_stride,
                                       int hd, T* __restrict__ o, int n, int H) {
  pdl_enter();
  const int t = blockIdx.x, j = blockIdx.y * blockDim.x + threadIdx.x, width = H * hd;
  if (t >= n || j >= width) return;
  const int h = j / hd, d = j - h * hd;
  const size_t i = (size_t)t * width + j;
  o[i] = from_f32(a[i] * sigmoidf_(gate[t * gate_stride + (long long)h * 2 * hd + d]));
}

// SwiGLU: act[t, i] = silu(gu[t, i]) * gu[t, I + i]   (gu rows of stride elements).
// grid (n, ceil(I / 256)), block 256: row t = blockIdx.x (no 64-bit division per element).
extern "C" __global__ void swiglu(const float* __restrict__ gu, long long stride, T* __restrict__ act, int n, int I) {
  pdl_enter();
  const int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
  if (t >= n || c >= I) return;
  act[(size_t)t * I + c] = from_f32(siluf_(gu[t * stride + c]) * gu[t * stride + I + c]);
}

// ================================================================================================
// MoE on the device.
//
// moe_route: one CTA of 1024 threads for the whole batch. Per token (one warp each): softmax over the E
// router logits (float32, rows of ld), top-k by repeated arg-max (ties: the lower expert id), weights
// renormalised when renorm != 0. With fold_shared != 0 the shared expert is expert E of the weight arrays
// and slot k of every token, weighted sigmoid(logits[t, E]) (the shared gate's row is appended to the
// router). k <= 31. Then the pairs (t, slot), kk = k + fold_shared per token, are grouped by expert:
//   pair_w[p], pair_e[p]        p = t * kk + slot
//   expert_off[e] .. expert_off[e+1]   the slice of pair_list holding expert e's pairs
//   active[0 .. n_active-1]            the experts with at least one pair, ascending; active[E_all] = n_active
// E_all = E + fold_shared <= 1024. Within an expert the pairs' order may vary run to run; every output
// element is computed from one pair alone, so results do not.
// ================================================================================================
#include "moe_route.cuh"

#define ROUTE_THREADS 1024
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_route(const float* __restrict__ logits, int ld, int n, int E, int k, int renorm, int fold_shared,
              float* __restrict__ pair_w, int* __restrict__ pair_e, int* __restrict__ expert_off,
              int* __restrict__ pair_list, int* __restrict__ active) {
  pdl_enter();
  __shared__ int cnt[1025];
  __shared__ int scan[1025];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kk = k + fold_shared, E_all = E + fold_shared;
  for (int t = warp; t < n; t += ROUTE_THREADS / 32) {
    int e;
    float w;
    route_token(logits + (size_t)t * ld, E, k, renorm, fold_shared, lane, e, w);
    if (e >= 0) {
      pair_e[t * kk + lane] = e;
      pair_w[t * kk + lane] = w;
    }
  }
  for (int e = tid; e < E_all + 1; e += ROUTE_THREADS) cnt[e] = 0;
  __syncthreads();  // also orders the pair writes above before the reads below (same CTA)
  const int np = n * kk;
  for (int q = tid; q < np; q += ROUTE_THREADS) atomicAdd(&cnt[pair_e[q]], 1);
  __syncthreads();
  // exclusive scans of the counts (E_all <= 1024 entries) and of the "has pairs" flags: shuffles within each
  // warp, then warp 0 over the 32 warp totals (4 barriers in all)
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
  scan[tid] = flag_incl;  // what the active-list writes below read
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
  for (int q = tid; q < np; q += ROUTE_THREADS) pair_list[atomicAdd(&cnt[pair_e[q]], 1)] = q;
}

// ------------------------------------------------------------------------------------------------
// Routed experts, first half: act[p, i] = silu(Wg[e] h_t . ) * (Wu[e] h_t . ) for every pair p = (t, slot) of
// expert e, i in this CTA's rows. w_gu [E_all, 2I, H] (gate rows, then up rows). grid (ceil(I / 8),
// <= E_all), block 256 (8 warps x 1 row); CTA y serves active[y] (exits past n_active). The pairs' h rows
// are staged tg at a time in shared memory (dynamic smem = tg * H * sizeof(T)); each weight row is read
// once per group of tg pairs (once per step at decode batch sizes). H % VEC == 0.
// ------------------------------------------------------------------------------------------------
#define MOE_WARPS 8
#ifndef MOE_RPW
#define MOE_RPW 2
#endif
#ifndef MOE_UNROLL
#define MOE_UNROLL 2
#endif
#define MOE_TG_MAX 8
extern "C" __global__ void __launch_bounds__(256)
    moe_gate_up(const T* __restrict__ h, const T* __restrict__ w_gu, int H, int I, int kk, int E_all,
                const int* __restrict__ expert_off, const int* __restrict__ pair_list,
                const int* __restrict__ active, T* __restrict__ act, int tg) {
  pdl_enter();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* hs = (T*)smem_raw;
  const int j = blockIdx.y;
  if (j >= active[E_all]) return;
  const int e = active[j];
  const int p0 = expert_off[e], p1 = expert_off[e + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i0 = blockIdx.x * (MOE_WARPS * MOE_RPW) + warp * MOE_RPW;
  const T* W = w_gu + (size_t)e * 2 * I * H;
  for (int g0 = p0; g0 < p1; g0 += tg) {
    const int m = min(tg, p1 - g0);
    __syncthreads();
    for (int q = 0; q < m; ++q) {
      const T* src = h + (size_t)(pair_list[g0 + q] / kk) * H;
      for (int c = threadIdx.x * VEC; c < H; c += blockDim.x * VEC) *(uint4*)(hs + q * H + c) = *(const uint4*)(src + c);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < MOE_RPW; ++r) {
      const int i = i0 + r;
      if (i >= I) break;
      float ag[MOE_TG_MAX], au[MOE_TG_MAX];
#pragma unroll
      for (int q = 0; q < MOE_TG_MAX; ++q) ag[q] = au[q] = 0.f;
      const T* wg = W + (size_t)i * H;
      const T* wu = W + (size_t)(I + i) * H;
      for (int c0 = lane * VEC; c0 < H; c0 += 32 * VEC * MOE_UNROLL) {
        Vec a[MOE_UNROLL], b[MOE_UNROLL];
#pragma unroll
        for (int u = 0; u < MOE_UNROLL; ++u) {  // this lane's weight loads of 4 steps in flight together
          const int c = c0 + u * 32 * VEC;
          if (c < H) {
            a[u] = load_vec(wg + c);
            b[u] = load_vec(wu + c);
          }
        }
#pragma unroll
        for (int u = 0; u < MOE_UNROLL; ++u) {
          const int c = c0 + u * 32 * VEC;
          if (c >= H) break;
#pragma unroll
          for (int q = 0; q < MOE_TG_MAX; ++q) {
            if (q < m) {
              const Vec x = load_vec(hs + q * H + c);
#pragma unroll
              for (int v = 0; v < VEC; ++v) {
                ag[q] += a[u].get(v) * x.get(v);
                au[q] += b[u].get(v) * x.get(v);
              }
            }
          }
        }
      }
#pragma unroll
      for (int q = 0; q < MOE_TG_MAX; ++q) {
        if (q < m) {
          const float gs = warp_sum(ag[q]), us = warp_sum(au[q]);
          if (lane == 0) act[(size_t)pair_list[g0 + q] * I + i] = from_f32(siluf_(gs) * us);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Routed experts, second half: y[t, slot, r] = pair_w[p] * (Wd[e] act_p)[r] for rows r of this CTA, with
// p = t * kk + slot; y is [n, ny, H] float32 (ny >= kk: a non-folded shared expert fills slot kk). w_d
// [E_all, H, I]. Same grid scheme as moe_gate_up over H rows; dynamic smem = tg * I * sizeof(T). I % VEC == 0.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
    moe_down(const T* __restrict__ act, const T* __restrict__ w_d, const float* __restrict__ pair_w, int H, int I,
             int kk, int ny, int E_all, const int* __restrict__ expert_off, const int* __restrict__ pair_list,
             const int* __restrict__ active, float* __restrict__ y, int tg) {
  pdl_enter();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* as = (T*)smem_raw;
  const int j = blockIdx.y;
  if (j >= active[E_all]) return;
  const int e = active[j];
  const int p0 = expert_off[e], p1 = expert_off[e + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = blockIdx.x * (MOE_WARPS * MOE_RPW) + warp * MOE_RPW;
  const T* W = w_d + (size_t)e * H * I;
  for (int g0 = p0; g0 < p1; g0 += tg) {
    const int m = min(tg, p1 - g0);
    __syncthreads();
    for (int q = 0; q < m; ++q) {
      const T* src = act + (size_t)pair_list[g0 + q] * I;
      for (int c = threadIdx.x * VEC; c < I; c += blockDim.x * VEC) *(uint4*)(as + q * I + c) = *(const uint4*)(src + c);
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < MOE_RPW; ++rr) {
      const int r = r0 + rr;
      if (r >= H) break;
      float acc[MOE_TG_MAX];
#pragma unroll
      for (int q = 0; q < MOE_TG_MAX; ++q) acc[q] = 0.f;
      const T* wr = W + (size_t)r * I;
      for (int c0 = lane * VEC; c0 < I; c0 += 32 * VEC * MOE_UNROLL) {
        Vec a[MOE_UNROLL];
#pragma unroll
        for (int u = 0; u < MOE_UNROLL; ++u) {
          const int c = c0 + u * 32 * VEC;
          if (c < I) a[u] = load_vec(wr + c);
        }
#pragma unroll
        for (int u = 0; u < MOE_UNROLL; ++u) {
          const int c = c0 + u * 32 * VEC;
          if (c >= I) break;
#pragma unroll
          for (int q = 0; q < MOE_TG_MAX; ++q) {
            if (q < m) {
              const Vec x = load_vec(as + q * I + c);
#pragma unroll
              for (int v = 0; v < VEC; ++v) acc[q] += a[u].get(v) * x.get(v);
            }
          }
        }
      }
#pragma unroll
      for (int q = 0; q < MOE_TG_MAX; ++q) {
        if (q < m) {
          const float s = warp_sum(acc[q]);
          if (lane == 0) {
            const int pr = pair_list[g0 + q];
            const int t = pr / kk, slot = pr % kk;
            y[((size_t)t * ny + slot) * H + r] = pair_w[pr] * s;
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Decode-sized GEMM ("GEMV"): y[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) (+ c[m, n]) for M <= a few dozen
// rows. Memory-bound: each warp streams GEMV_RW weight rows once per group of GEMV_TG tokens with 16-byte
// loads; x rows are read through L1. Every output element is one lane-strided sum over k reduced in a
// fixed shuffle order, so a row's result never depends on M or on the other rows (batch invariance).
// grid (ceil(N / (4 * GEMV_RW)) = ceil(N / 8)), block 128 (4 warps x 2 rows). K % VEC == 0, rows 16-byte
// aligned (checked on the host).
// y is float32 when out_f32, else T; bias and c are float32 (c may equal y).
// ------------------------------------------------------------------------------------------------
#ifndef GEMV_RW
#define GEMV_RW 2
#endif
#define GEMV_TG 8
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 4
#endif
extern "C" __global__ void __launch_bounds__(128)
    gemv(const T* __restrict__ x, long long ldx, const T* __restrict__ W, int N, int K,
         const float* __restrict__ bias, const float* c, long long ldc, void* y, long long ldy, int out_f32, int M) {
  pdl_enter();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * 4 + warp) * GEMV_RW;
  if (n0 >= N) return;
  const int nr = min(GEMV_RW, N - n0);
  for (int m0 = 0; m0 < M; m0 += GEMV_TG) {
    const int mg = min(GEMV_TG, M - m0);
    float acc[GEMV_RW][GEMV_TG];
#pragma unroll
    for (int r = 0; r < GEMV_RW; ++r)
#pragma unroll
      for (int q = 0; q < GEMV_TG; ++q) acc[r][q] = 0.f;
    for (int k0 = lane * VEC; k0 < K; k0 += 32 * VEC * GEMV_UNROLL) {
      Vec w[GEMV_RW][GEMV_UNROLL];
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u) {  // every weight load of 4 steps in flight together
        const int k = k0 + u * 32 * VEC;
#pragma unroll
        for (int r = 0; r < GEMV_RW; ++r)
          if (r < nr && k < K) w[r][u] = load_vec(W + (size_t)(n0 + r) * K + k);
      }
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u) {
        const int k = k0 + u * 32 * VEC;
        if (k >= K) break;
#pragma unroll
        for (int q = 0; q < GEMV_TG; ++q) {
          if (q < mg) {
            const Vec xv = load_vec(x + (size_t)(m0 + q) * ldx + k);
#pragma unroll
            for (int r = 0; r < GEMV_RW; ++r)
              if (r < nr) {
#pragma unroll
                for (int v = 0; v < VEC; ++v) acc[r][q] += w[r][u].get(v) * xv.get(v);
              }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < GEMV_RW; ++r)
#pragma unroll
      for (int q = 0; q < GEMV_TG; ++q) acc[r][q] = warp_sum(acc[r][q]);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < GEMV_RW; ++r) {
        if (r >= nr) continue;
        const int n = n0 + r;
#pragma unroll
        for (int q = 0; q < GEMV_TG; ++q) {
          if (q >= mg) continue;
          const int m = m0 + q;
          float v = acc[r][q];
          if (bias) v += bias[n];
          if (c) v += c[(size_t)m * ldc + n];
          if (out_f32)
            ((float*)y)[(size_t)m * ldy + n] = v;
          else
            ((T*)y)[(size_t)m * ldy + n] = from_f32(v);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Small helpers: copy rows of one buffer into another (strided), fill with a value.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void fill_f32(float* __restrict__ dst, float v, long long n) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = v;
}

// Deterministic pseudo-random weights for benchmarks: dst[i] = offset + (u - 0.5) * 2 * scale, u from a hash
// of (seed, i) (splitmix64); written straight on the device so 70 GB of weights need no host copy.
__device__ __forceinline__ u64 hash64(u64 seed, long long i) {
  u64 z = seed + 0x9E3779B97F4A7C15ull * (u64)(i + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float hash_uniform(u64 seed, long long i) {
  return (float)(hash64(seed, i) >> 40) * (1.0f / 16777216.0f);
}
extern "C" __global__ void fill_random(T* __restrict__ dst, long long n, u64 seed, float scale, float offset) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = from_f32(offset + (hash_uniform(seed, i) - 0.5f) * 2.f * scale);
}
extern "C" __global__ void fill_random_f32(float* __restrict__ dst, long long n, u64 seed, float scale,
                                           float offset) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = offset + (hash_uniform(seed, i) - 0.5f) * 2.f * scale;
}

// Deterministic pseudo-random packed weight codes for benchmarks (a GPTQ checkpoint's layout, no checkpoint): n
// 32-bit words, each from hash64 of (seed, i) (hash_uniform's splitmix64, all 64 bits). bits 4: 8 codes a word,
// code j = 1 + (16-bit chunk j % 4 of the hash of (seed, 2i + j / 4)) % 15, in 1..15; bits 8: 4 codes, code j =
// 1 + (16-bit chunk j of the hash of (seed, i)) % 255, in 1..255. Both are symmetric around the zero-point
// 2^(bits-1), so (q - z) has mean ~0 as a real checkpoint's: codes with a common bias (random float bits read as
// bytes) give every output row the same component, and a random model whose hidden states share one direction
// routes all its tokens to the same few experts. (The % leaves a bias of 2^-16 between codes.)
extern "C" __global__ void fill_random_codes(u32* __restrict__ dst, long long n, u64 seed, int bits) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    u32 w = 0;
    if (bits == 4) {
      const u64 z0 = hash64(seed, 2 * i), z1 = hash64(seed, 2 * i + 1);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const u32 chunk = (u32)(((j < 4 ? z0 : z1) >> (16 * (j & 3))) & 0xffffu);
        w |= (1u + chunk % 15u) << (4 * j);
      }
    } else {
      const u64 z = hash64(seed, i);
#pragma unroll
      for (int j = 0; j < 4; ++j) w |= (1u + (u32)((z >> (16 * j)) & 0xffffu) % 255u) << (8 * j);
    }
    dst[i] = w;
  }
}
