// Gated DeltaNet stateful kernels: causal conv window + SiLU, and the gated delta rule (decode and
// prefill). Math: MODEL_MATH.md "Gated DeltaNet mixer"; the CPU twin is hybrid_runtime/ops/gdn.py.
//
// Compiled by NVRTC once per variant with
//   -DDT=<0 float32 | 1 float16 | 2 bfloat16>  (activations u and the output o)
//   -DOT=<0 | 1 | 2>  (the gated-norm output of gdn_decode_norm; default DT)
//   -DDK=<key head dim> -DDV=<value head dim, multiple of 4> -DKW=<conv kernel width K >= 1>
// The conv inputs u are rows of u_stride elements (>= C: u may be the first C columns of a wider projection).
// State is float32 and laid out as hybrid_runtime.state_cache.StateLayout says:
//   conv  [rows, K-1, C]     (row stride conv_row elements, passed in from the layout)
//   rec   [rows, nv, DK, DV] (row stride rec_row elements)
// rows = num_slots + 1; the last row is the padding sink. Slot indices were bounds-checked on the host;
// live slots are distinct, padding rows may all name the sink (their writes race only on the sink).
//
// Decode runs either as gdn_conv_decode + gdn_decode (no programmatic-dependent wait: launched normally), or
// as the fused pair gdn_conv_gates_decode + gdn_decode_norm (the cuda backend's decode steps), which also do
// fused.cu's gdn_gates and gated_rmsnorm and wait for the previous kernel first (launched with PDL).

typedef unsigned short u16;
typedef unsigned int u32;

#ifndef DT
#define DT 2
#endif
#ifndef OT
#define OT DT
#endif
#ifndef KW
#define KW 4
#endif

#if DT == 0
typedef float T;
#else
typedef u16 T;
#endif
#if OT == 0
typedef float TO;
#else
typedef u16 TO;
#endif

#include "gdn_gates.cuh"

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
__device__ __forceinline__ void store_act(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_act(u16* p, float v) {
  u16 h;
#if DT == 1
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  *p = h;
}
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// The gated-norm output in OT, rounded as fused.cu's from_f32 rounds it.
__device__ __forceinline__ void store_out(TO* p, float v) {
#if OT == 0
  *p = v;
#else
  u16 h;
#if OT == 1
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  *p = h;
#endif
}

// Programmatic dependent launch (sm_90+), as fused.cu's pdl_enter: wait for the kernel before this one to
// finish and flush (a no-op when not launched as a dependent), then let the next one be scheduled. The fused
// decode kernels call it before they touch global memory.
__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// fused.cu's warp_sum: the same xor order (16, 8, 4, 2, 1).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ------------------------------------------------------------------------------------------------
// Conv, decode: one token per sequence. grid (ceil(C/blockDim), B); thread = one channel of one row.
// x_out[b, c] = silu(sum_j w[c, j] * [window ++ u_b][j]); window <- last K-1 inputs.
// ------------------------------------------------------------------------------------------------
// The channel's window (its last KW-1 inputs) and conv weights: what conv_decode_finish needs besides u.
struct ConvChannel {
  float* win;
  float xs[KW];
  float w[KW];
};
__device__ __forceinline__ void conv_decode_load(const float* __restrict__ conv_w, float* __restrict__ conv,
                                                 long long conv_row, const int* __restrict__ slots, int b, int c,
                                                 int C, ConvChannel& ch) {
  ch.win = conv + (long long)slots[b] * conv_row + c;
#pragma unroll
  for (int j = 0; j < KW - 1; ++j) ch.xs[j] = ch.win[(long long)j * C];
#pragma unroll
  for (int j = 0; j < KW; ++j) ch.w[j] = conv_w[(size_t)c * KW + j];
}
__device__ __forceinline__ void conv_decode_finish(const T* __restrict__ u, float* __restrict__ x_out, int b, int c,
                                                   int C, long long u_stride, ConvChannel& ch) {
  ch.xs[KW - 1] = to_f32(u[(size_t)b * u_stride + c]);
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < KW; ++j) acc += ch.w[j] * ch.xs[j];
  x_out[(size_t)b * C + c] = silu(acc);
#pragma unroll
  for (int j = 0; j < KW - 1; ++j) ch.win[(long long)j * C] = ch.xs[j + 1];
}
__device__ __forceinline__ void conv_decode_channel(const T* __restrict__ u, const float* __restrict__ conv_w,
                                                    float* __restrict__ conv, long long conv_row,
                                                    const int* __restrict__ slots, float* __restrict__ x_out,
                                                    int b, int c, int C, long long u_stride) {
  ConvChannel ch;
  conv_decode_load(conv_w, conv, conv_row, slots, b, c, C, ch);
  conv_decode_finish(u, x_out, b, c, C, u_stride, ch);
}

extern "C" __global__ void gdn_conv_decode(const T* __restrict__ u, const float* __restrict__ conv_w,
                                           float* __restrict__ conv, long long conv_row,
                                           const int* __restrict__ slots, float* __restrict__ x_out, int B,
                                           int C, long long u_stride) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
  if (c >= C || b >= B) return;
  conv_decode_channel(u, conv_w, conv, conv_row, slots, x_out, b, c, C, u_stride);
}

// Conv + gates, decode (fused.cu's gdn_gates folded in). grid (ceil(C/blockDim) + 1, B): CTAs x <
// ceil(C/blockDim) are gdn_conv_decode's (the same per-channel code); CTA x = ceil(C/blockDim) computes row b's
// gates from its projection row p + b * p_stride (gdn_gates.cuh: fused.cu's expressions):
//   g[b, j] = neg_exp_a[j] * softplus(a + dt_bias[j]),  beta[b, j] = sigmoid(b)   (float32 [B, NV])
// with b = p_row[off_b + j], a = p_row[off_a + j]. Reads the conv windows and weights before griddepcontrol.wait
// (PDL), everything else after it.
extern "C" __global__ void gdn_conv_gates_decode(const T* __restrict__ u, const float* __restrict__ conv_w,
                                                 float* __restrict__ conv, long long conv_row,
                                                 const int* __restrict__ slots, float* __restrict__ x_out, int B,
                                                 int C, long long u_stride, const float* __restrict__ p,
                                                 long long p_stride, int off_b, int off_a,
                                                 const float* __restrict__ neg_exp_a,
                                                 const float* __restrict__ dt_bias, float* __restrict__ g,
                                                 float* __restrict__ beta, int NV) {
  const int b = blockIdx.y;
  const int conv_ctas = (C + blockDim.x - 1) / blockDim.x;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const bool conv_thread = b < B && (int)blockIdx.x < conv_ctas && c < C;
  // The conv window and weights go out before griddepcontrol.wait: the window's last writer is this layer's conv of
  // the previous step, the weights are static, `slots` is a step input (as gdn_decode_norm's state loads).
  ConvChannel ch;
  if (conv_thread) conv_decode_load(conv_w, conv, conv_row, slots, b, c, C, ch);
  pdl_enter();
  if (b >= B) return;
  if ((int)blockIdx.x >= conv_ctas) {
    if ((int)blockIdx.x == conv_ctas) {
      const float* row = p + (size_t)b * p_stride;
      for (int j = threadIdx.x; j < NV; j += blockDim.x)
        gdn_gate(row, off_b, off_a, neg_exp_a, dt_bias, g + (size_t)b * NV, beta + (size_t)b * NV, j);
    }
    return;
  }
  if (conv_thread) conv_decode_finish(u, x_out, b, c, C, u_stride, ch);
}

// ------------------------------------------------------------------------------------------------
// Conv, prefill (packed variable-length sequences). grid (ceil(C/blockDim), ceil(max_T/tok_tile), S).
// Reads the windows, never writes them: gdn_conv_window runs after it (same stream).
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void gdn_conv_prefill(const T* __restrict__ u, const float* __restrict__ conv_w,
                                            const float* __restrict__ conv, long long conv_row,
                                            const int* __restrict__ seq_start, const int* __restrict__ slots,
                                            float* __restrict__ x_out, int S, int C, int tok_tile,
                                            long long u_stride) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.z;
  if (c >= C || s >= S) return;
  const int start = seq_start[s], T_len = seq_start[s + 1] - start;
  const int p0 = blockIdx.y * tok_tile;
  if (p0 >= T_len) return;
  const int p1 = min(p0 + tok_tile, T_len);
  const float* win = conv + (long long)slots[s] * conv_row + c;
  float w[KW];
#pragma unroll
  for (int j = 0; j < KW; ++j) w[j] = conv_w[(size_t)c * KW + j];
  float xs[KW];  // xs[KW-1] is the current token; xs[j] the input KW-1-j positions earlier
#pragma unroll
  for (int j = 0; j < KW - 1; ++j) {
    const int p = p0 - (KW - 1) + j;  // position of xs[j] for the first token
    xs[j] = p >= 0 ? to_f32(u[(size_t)(start + p) * u_stride + c]) : win[(long long)(KW - 1 + p) * C];
  }
  for (int p = p0; p < p1; ++p) {
    xs[KW - 1] = to_f32(u[(size_t)(start + p) * u_stride + c]);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < KW; ++j) acc += w[j] * xs[j];
    x_out[(size_t)(start + p) * C + c] = silu(acc);
#pragma unroll
    for (int j = 0; j < KW - 1; ++j) xs[j] = xs[j + 1];
  }
}

// New window of each prefilled sequence: the last K-1 of (old window ++ its T inputs).
// grid (ceil(C/blockDim), S); each thread reads all it needs before it writes.
extern "C" __global__ void gdn_conv_window(const T* __restrict__ u, float* __restrict__ conv, long long conv_row,
                                           const int* __restrict__ seq_start, const int* __restrict__ slots, int S,
                                           int C, long long u_stride) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
  if (c >= C || s >= S) return;
  const int start = seq_start[s], T_len = seq_start[s + 1] - start;
  float* win = conv + (long long)slots[s] * conv_row + c;
  float nw[KW > 1 ? KW - 1 : 1];
#pragma unroll
  for (int j = 0; j < KW - 1; ++j) {
    const int p = T_len - (KW - 1) + j;
    nw[j] = p >= 0 ? to_f32(u[(size_t)(start + p) * u_stride + c]) : win[(long long)(KW - 1 + p) * C];
  }
#pragma unroll
  for (int j = 0; j < KW - 1; ++j) win[(long long)j * C] = nw[j];
}

// ------------------------------------------------------------------------------------------------
// Gated delta rule, decode. grid (ceil(DV/32), NV, B), 128 threads. A CTA owns 32 state columns of one
// value head of one sequence: 8 threads per row (float4 each) x 16 row groups. The state is read once
// (loads issued first) and written once; q/k are l2-normalised here (q also scaled by 1/sqrt(DK)).
//   o = e^g S^T q + (q.k) delta,  delta = beta (v - e^g S^T k),  S <- e^g S + k delta^T
// delta_cols is that CTA's work for 128 threads; gdn_decode_norm runs it once per 32 columns of a head
// (every expression and reduction order the same, so the state it writes has the same bits).
// ------------------------------------------------------------------------------------------------
#define RM ((DK + 15) / 16)

struct DeltaSmem {
  float qs[DK], ks[DK];
  float red[4][3];
  float part[4][32][2];
};

// Columns j0 .. j0+31 of value head h of sequence b, by the 128 threads t = 0..127 of one group (t = the thread's
// index in its group: 4 whole warps; sm: the group's own shared memory). S: the head's state [DK, DV]; xb: row b
// of x; out: the head's o [DV] (T). Has block-wide barriers: every thread of the CTA calls it, the same number of
// times. Row group 0 writes o of its 4 columns j .. j+3 (j = j0 + (t & 7) * 4, where j < DV): to out (TO_SMEM
// false: gdn_decode), or to cs [DV] in shared memory and, when out != 0, to out as well (TO_SMEM: gdn_decode_norm).
// This thread's share of the state columns j0 .. j0+31 (rows rg + 16 m, columns j .. j+3): delta_cols' loads, a
// function of their own so that gdn_decode_norm can issue them before its griddepcontrol.wait.
__device__ __forceinline__ void delta_state_load(const float* __restrict__ S, int j0, int t, float4 (&st)[RM]) {
  const int rg = t >> 3, j = j0 + (t & 7) * 4;
  const bool jv = j < DV;
#pragma unroll
  for (int m = 0; m < RM; ++m) {
    const int i = rg + 16 * m;
    st[m] = (jv && i < DK) ? *(const float4*)(S + (size_t)i * DV + j) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

template <bool TO_SMEM>
__device__ __forceinline__ void delta_cols(const float* __restrict__ xb, const float* __restrict__ gdec,
                                           const float* __restrict__ beta, float* __restrict__ S, int b, int h,
                                           int kh, int NK, int NV, int j0, int t, DeltaSmem& sm,
                                           T* __restrict__ out, float* cs, float4 (&st)[RM]) {
  const int tid = t, tc = tid & 7, rg = tid >> 3, lane = tid & 31, warp = tid >> 5;
  const int j = j0 + tc * 4;
  const bool jv = j < DV;

  float sq = 0.f, sk = 0.f, sqk = 0.f;
  for (int i = tid; i < DK; i += 128) {
    const float qv = xb[kh * DK + i], kv = xb[NK * DK + kh * DK + i];
    sm.qs[i] = qv;
    sm.ks[i] = kv;
    sq += qv * qv;
    sk += kv * kv;
    sqk += qv * kv;
  }
  for (int o = 16; o > 0; o >>= 1) {
    sq += __shfl_xor_sync(0xffffffffu, sq, o);
    sk += __shfl_xor_sync(0xffffffffu, sk, o);
    sqk += __shfl_xor_sync(0xffffffffu, sqk, o);
  }
  if (lane == 0) {
    sm.red[warp][0] = sq;
    sm.red[warp][1] = sk;
    sm.red[warp][2] = sqk;
  }
  __syncthreads();
  sq = sm.red[0][0] + sm.red[1][0] + sm.red[2][0] + sm.red[3][0];
  sk = sm.red[0][1] + sm.red[1][1] + sm.red[2][1] + sm.red[3][1];
  sqk = sm.red[0][2] + sm.red[1][2] + sm.red[2][2] + sm.red[3][2];
  const float rq = 1.f / sqrtf(sq + 1e-6f) / sqrtf((float)DK);
  const float rk = 1.f / sqrtf(sk + 1e-6f);
  const float qk = sqk * rq * rk;

  float pk[4] = {0.f, 0.f, 0.f, 0.f}, pq[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int m = 0; m < RM; ++m) {
    const int i = rg + 16 * m;
    if (i < DK) {
      const float kv = sm.ks[i] * rk, qv = sm.qs[i] * rq;
      pk[0] += st[m].x * kv; pk[1] += st[m].y * kv; pk[2] += st[m].z * kv; pk[3] += st[m].w * kv;
      pq[0] += st[m].x * qv; pq[1] += st[m].y * qv; pq[2] += st[m].z * qv; pq[3] += st[m].w * qv;
    }
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    pk[c] += __shfl_xor_sync(0xffffffffu, pk[c], 8);
    pk[c] += __shfl_xor_sync(0xffffffffu, pk[c], 16);
    pq[c] += __shfl_xor_sync(0xffffffffu, pq[c], 8);
    pq[c] += __shfl_xor_sync(0xffffffffu, pq[c], 16);
  }
  if (lane < 8) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      sm.part[warp][tc * 4 + c][0] = pk[c];
      sm.part[warp][tc * 4 + c][1] = pq[c];
    }
  }
  __syncthreads();
  const float eg = expf(gdec[(size_t)b * NV + h]), bt = beta[(size_t)b * NV + h];
  float delta[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float tk = sm.part[0][tc * 4 + c][0] + sm.part[1][tc * 4 + c][0] + sm.part[2][tc * 4 + c][0] +
                     sm.part[3][tc * 4 + c][0];
    const float tq = sm.part[0][tc * 4 + c][1] + sm.part[1][tc * 4 + c][1] + sm.part[2][tc * 4 + c][1] +
                     sm.part[3][tc * 4 + c][1];
    const float v = jv ? xb[2 * NK * DK + h * DV + j + c] : 0.f;
    // v - e^g tk as one explicit fma: NVVM leaves mul + sub here, which ptxas may or may not contract; pinned, the
    // rounding is the same in every kernel that inlines this (gdn_decode_norm's state bits are gdn_decode's)
    delta[c] = bt * __fmaf_rn(-eg, tk, v);
    if (rg == 0 && jv) {
      if (!TO_SMEM) {
        store_act(out + j + c, eg * tq + qk * delta[c]);
      } else {
        const float ov = eg * tq + qk * delta[c];
        cs[j + c] = ov;
        if (out) store_act(out + j + c, ov);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < RM; ++m) {
    const int i = rg + 16 * m;
    if (jv && i < DK) {
      const float kv = sm.ks[i] * rk;
      float4 v = st[m];
      v.x = eg * v.x + kv * delta[0];
      v.y = eg * v.y + kv * delta[1];
      v.z = eg * v.z + kv * delta[2];
      v.w = eg * v.w + kv * delta[3];
      *(float4*)(S + (size_t)i * DV + j) = v;
    }
  }
}

extern "C" __global__ void __launch_bounds__(128) gdn_decode(const float* __restrict__ x,
                                                             const float* __restrict__ gdec,
                                                             const float* __restrict__ beta,
                                                             const int* __restrict__ slots,
                                                             float* __restrict__ rec, long long rec_row,
                                                             T* __restrict__ out, int B, int NK, int NV) {
  const int b = blockIdx.z, h = blockIdx.y;
  if (b >= B || h >= NV) return;
  const int kh = h / (NV / NK);
  const int C = 2 * NK * DK + NV * DV;
  float* S = rec + (long long)slots[b] * rec_row + (long long)h * DK * DV;
  __shared__ DeltaSmem sm;
  float4 st[RM];
  delta_state_load(S, blockIdx.x * 32, threadIdx.x, st);
  delta_cols<false>(x + (size_t)b * C, gdec, beta, S, b, h, kh, NK, NV, blockIdx.x * 32, threadIdx.x, sm,
                    out + ((size_t)b * NV + h) * DV, nullptr, st);
}

// ------------------------------------------------------------------------------------------------
// Gated delta rule + gated RMSNorm, decode (fused.cu's gated_rmsnorm folded in). grid (1, NV, B), NTF = FCG * 128
// threads (FCG = ceil(DV/32) groups of 128): one CTA owns a whole value head of one sequence; group cg runs
// delta_cols on columns 32 cg .. 32 cg + 31 (gdn_decode's CTA, so the state bits are gdn_decode's), the head's
// core goes to shared memory (and to core [B, NV*DV] in T when core != 0), then, per value head,
//   o = core / sqrt(mean(core^2) + eps) * w * silu(z)        (TO [B, NV*DV]; w [DV] float32)
// with gated_rmsnorm's expressions and reduction order (each warp sums the squares lane-strided and reduces
// them with warp_sum, so every warp holds gated_rmsnorm's rs). z rows of z_stride elements (float32).
// Compiled where FUSED_OK: DV <= 128 (<= 512 threads) and DK <= 128 (its registers at 512 threads); the host
// runs gdn_decode + gated_rmsnorm otherwise (hybrid_runtime/cuda/gdn.py fused_decode_fits). Reads the recurrent
// state and the norm weight before griddepcontrol.wait (PDL: nothing earlier in the step writes them) and waits
// for the previous kernel before any other access.
// ------------------------------------------------------------------------------------------------
#define FCG ((DV + 31) / 32)
#define NTF (FCG * 128)
#define FUSED_OK (DV <= 128 && DK <= 128)

#if FUSED_OK
extern "C" __global__ void __launch_bounds__(NTF) gdn_decode_norm(const float* __restrict__ x,
                                                                  const float* __restrict__ gdec,
                                                                  const float* __restrict__ beta,
                                                                  const int* __restrict__ slots,
                                                                  float* __restrict__ rec, long long rec_row,
                                                                  const float* __restrict__ z, long long z_stride,
                                                                  const float* __restrict__ norm_w, float eps,
                                                                  TO* __restrict__ o, T* __restrict__ core, int B,
                                                                  int NK, int NV) {
  const int b = blockIdx.z, h = blockIdx.y;
  if (b >= B || h >= NV) {
    pdl_enter();
    return;
  }
  const int tid = threadIdx.x, cg = tid >> 7, t = tid & 127, lane = tid & 31;
  const int kh = h / (NV / NK);
  const int C = 2 * NK * DK + NV * DV;
  // The recurrent state (the step's largest read) goes out BEFORE griddepcontrol.wait, so that it streams while
  // the conv + gates kernel runs. Legal: no kernel of this step writes it before this one - its last writer is this
  // layer's gdn_decode_norm of the previous step (or the slot zeroing at admission), complete before the kernel
  // before this one passed its own wait - and `slots` is a step input the host uploads before the step starts.
  float* S = rec + (long long)slots[b] * rec_row + (long long)h * DK * DV;
  float4 st[RM];
  delta_state_load(S, cg * 32, t, st);
  const float wv = tid < DV ? norm_w[tid] : 0.f;  // a weight: static
  pdl_enter();
  // this thread's output column tid (tid < DV): z loaded early (used at the end)
  const float zv = tid < DV ? z[(size_t)b * z_stride + h * DV + tid] : 0.f;
  __shared__ DeltaSmem sm[FCG];
  __shared__ float cs[FCG * 32];
  delta_cols<true>(x + (size_t)b * C, gdec, beta, S, b, h, kh, NK, NV, cg * 32, t, sm[cg],
                   core ? core + ((size_t)b * NV + h) * DV : nullptr, cs, st);
  __syncthreads();
  float ss = 0.f;
  for (int d = lane; d < DV; d += 32) {
    const float v = cs[d];
    ss += v * v;
  }
  // an explicit IEEE division, as gated_rmsnorm's by its run-time dv (a constant divisor would become a multiply
  // that ptxas fuses with + eps)
  const float rs = rsqrtf(__fdiv_rn(warp_sum(ss), (float)DV) + eps);
  if (tid < DV) store_out(o + ((size_t)b * NV + h) * DV + tid, cs[tid] * rs * wv * silu(zv));
}
#endif

// ------------------------------------------------------------------------------------------------
// Gated delta rule, prefill: a per-chunk scan. grid (ceil(DV/32), NV, S), 128 threads; the state of 32
// columns stays in registers for the whole prompt (warp w: 8 columns x 4 row groups, DK/4 rows each).
// Per chunk of `chunk` tokens the CTA stages normalised q/k, v, e^g, beta and q.k in shared memory
// (parallel over tokens), then scans the chunk token by token with no block-wide barrier.
// Dynamic shared memory: chunk * (2*DK + 32 + 3) floats.
// ------------------------------------------------------------------------------------------------
#define RP ((DK + 3) / 4)

extern "C" __global__ void __launch_bounds__(128) gdn_prefill(const float* __restrict__ x,
                                                              const float* __restrict__ gdec,
                                                              const float* __restrict__ beta,
                                                              const int* __restrict__ seq_start,
                                                              const int* __restrict__ slots,
                                                              float* __restrict__ rec, long long rec_row,
                                                              T* __restrict__ out, int S, int NK, int NV,
                                                              int chunk) {
  extern __shared__ __align__(16) float sm[];
  const int s = blockIdx.z, h = blockIdx.y;
  if (s >= S || h >= NV) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int cl = warp * 8 + (lane & 7);  // column inside the CTA's 32
  const int col = blockIdx.x * 32 + cl, rg = lane >> 3;
  const bool cv = col < DV;
  const int kh = h / (NV / NK);
  const int C = 2 * NK * DK + NV * DV;
  const int start = seq_start[s], T_len = seq_start[s + 1] - start;
  float* St = rec + (long long)slots[s] * rec_row + (long long)h * DK * DV;

  float st[RP];
#pragma unroll
  for (int m = 0; m < RP; ++m) {
    const int i = rg + 4 * m;
    st[m] = (cv && i < DK) ? St[(size_t)i * DV + col] : 0.f;
  }
  float* kn = sm;                 // [chunk][DK]
  float* qn = kn + chunk * DK;    // [chunk][DK]
  float* vv = qn + chunk * DK;    // [chunk][32]
  float* eg = vv + chunk * 32;    // [chunk]
  float* bt = eg + chunk;         // [chunk]
  float* qk = bt + chunk;         // [chunk]

  for (int c0 = 0; c0 < T_len; c0 += chunk) {
    const int n = min(chunk, T_len - c0);
    __syncthreads();  // the previous chunk is fully consumed
    for (int tt = warp; tt < n; tt += 4) {
      const float* xr = x + (size_t)(start + c0 + tt) * C;
      float sq = 0.f, sk = 0.f, sqk = 0.f;
      for (int i = lane; i < DK; i += 32) {
        const float qv = xr[kh * DK + i], kv = xr[NK * DK + kh * DK + i];
        qn[tt * DK + i] = qv;
        kn[tt * DK + i] = kv;
        sq += qv * qv;
        sk += kv * kv;
        sqk += qv * kv;
      }
      for (int o = 16; o > 0; o >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
        sqk += __shfl_xor_sync(0xffffffffu, sqk, o);
      }
      const float rq = 1.f / sqrtf(sq + 1e-6f) / sqrtf((float)DK);
      const float rk = 1.f / sqrtf(sk + 1e-6f);
      __syncwarp();
      for (int i = lane; i < DK; i += 32) {
        qn[tt * DK + i] *= rq;
        kn[tt * DK + i] *= rk;
      }
      if (lane == 0) {
        const size_t gi = (size_t)(start + c0 + tt) * NV + h;
        eg[tt] = expf(gdec[gi]);
        bt[tt] = beta[gi];
        qk[tt] = sqk * rq * rk;
      }
    }
    for (int idx = tid; idx < n * 32; idx += 128) {
      const int tt = idx >> 5, cc = idx & 31, cg = blockIdx.x * 32 + cc;
      vv[idx] = cg < DV ? x[(size_t)(start + c0 + tt) * C + 2 * NK * DK + h * DV + cg] : 0.f;
    }
    __syncthreads();
    for (int tt = 0; tt < n; ++tt) {
      const float* kr = kn + tt * DK;
      const float* qr = qn + tt * DK;
      float pk = 0.f, pq = 0.f;
#pragma unroll
      for (int m = 0; m < RP; ++m) {
        const int i = rg + 4 * m;
        if (i < DK) {
          pk += st[m] * kr[i];
          pq += st[m] * qr[i];
        }
      }
      pk += __shfl_xor_sync(0xffffffffu, pk, 8);
      pk += __shfl_xor_sync(0xffffffffu, pk, 16);
      pq += __shfl_xor_sync(0xffffffffu, pq, 8);
      pq += __shfl_xor_sync(0xffffffffu, pq, 16);
      const float e = eg[tt];
      const float d = bt[tt] * (vv[tt * 32 + cl] - e * pk);
      if (rg == 0 && cv) store_act(out + (size_t)(start + c0 + tt) * NV * DV + h * DV + col, e * pq + qk[tt] * d);
#pragma unroll
      for (int m = 0; m < RP; ++m) {
        const int i = rg + 4 * m;
        if (i < DK) st[m] = e * st[m] + kr[i] * d;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < RP; ++m) {
    const int i = rg + 4 * m;
    if (cv && i < DK) St[(size_t)i * DV + col] = st[m];
  }
}
