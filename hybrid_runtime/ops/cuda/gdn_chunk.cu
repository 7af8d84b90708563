// Gated delta rule, prefill in the chunked WY / UT-transform form: fully parallel intra-chunk work, then
// one sequential pass over chunks (O(T/64) steps of small matmuls instead of T token steps). float32
// throughout (SIMT, no tensor cores), so it matches the CPU's float32 chunked form to float32 rounding.
// The float64 numpy model of exactly this decomposition is tests/unit/test_gdn_chunk_math.py (prep,
// state_pass); the token recurrence it equals is MODEL_MATH.md "Gated DeltaNet mixer" step 5.
//
// Compiled by NVRTC with -DDK=<key head dim, multiple of 4> -DDV=<value head dim, multiple of 4>.
// Inputs: x float32 [N, C] post-conv channels (q | k | v, C = 2*NK*DK + NV*DV), g / beta float32 [N, NV],
// seq_start int32 [S+1], slots int32 [S] (distinct), state rec float32 [rows, NV, DK, DV] (row stride rec_row
// elements), o [N, NV*DV] (activation dtype DT, as gdn.cu). Chunks of CH = 64 tokens aligned to each
// sequence's own token 0; the last chunk of a sequence may be partial (n < 64 rows, the rest zero).
//
// Workspace (float32, rows = token rows of the packed batch, N <= the capacity it was sized for):
//   w   [N, NV, DK]  T (beta e^G k)            u  [N, NV, DV]  T (beta v)       (T = (I + A)^-1)
//   aqk [N, NV, 64]  row i of its chunk's lower(q_i.k_j e^{G_i-G_j}) (zeros above the diagonal)
//   sc  [N, NV, 4]   (rq e^{G_i}, rk e^{G_last-G_i}, e^{G_last}, 0)
//
// Kernel 1 gdn_chunk_prep:  grid (max_chunks, NV, S), 256 threads, dynamic smem PREP_SMEM bytes.
// Kernel 2 gdn_chunk_state: grid (ceil(DV/32), NV, S), 256 threads, dynamic smem STATE_SMEM bytes.
// Both wait on griddepcontrol.wait before touching global memory (programmatic dependent launch).

typedef unsigned short u16;
typedef unsigned int u32;

#ifndef DT
#define DT 0
#endif
#ifndef DK
#define DK 128
#endif
#ifndef DV
#define DV 128
#endif

#if DT == 0
typedef float T;
#else
typedef u16 T;
#endif

#define CH 64          // chunk length
#define NT 256         // threads of both kernels
#define DKP (DK + 1)   // padded row of q/k in the prep kernel (conflict-free column reads)
#define BV 32          // value columns per state CTA (lane = column)
#define RD (((DK + 31) / 32) * 4)  // state rows per warp in step c (8 warps x RD >= DK, RD % 4 == 0)

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

__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
// 16 bytes global -> shared; src_bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp16(float* dst, const float* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait2() { asm volatile("cp.async.wait_group 2;\n" ::); }

// ------------------------------------------------------------------------------------------------
// Kernel 1: one CTA per (chunk c, value head h, sequence s). Shared memory (floats):
//   qs [64][DKP] normalised q (x 1/sqrt(DK)),  ks [64][DKP] normalised k,  am [64][64] A^T (am[j][i] = A_ij, j < i)
//   gd [64] doubles: G (cumulative log decay, in float64),  bt [64] beta,  eg [64] e^G,  rq/rk [64]
// ------------------------------------------------------------------------------------------------
#define PREP_FLOATS (2 * CH * DKP + CH * CH + 2 * CH + 4 * CH)
#define PREP_SMEM (PREP_FLOATS * 4)

extern "C" __global__ void __launch_bounds__(NT) gdn_chunk_prep(const float* __restrict__ x,
                                                                const float* __restrict__ gdec,
                                                                const float* __restrict__ beta,
                                                                const int* __restrict__ seq_start,
                                                                float* __restrict__ ws_w, float* __restrict__ ws_u,
                                                                float* __restrict__ ws_a, float* __restrict__ ws_s,
                                                                int S, int NK, int NV) {
  extern __shared__ __align__(16) float sm[];
  const int c = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
  if (s >= S || h >= NV) return;
  pdl_wait();
  const int start = seq_start[s], T_len = seq_start[s + 1] - start;
  if (c * CH >= T_len) return;
  const int t0 = start + c * CH, n = min(CH, T_len - c * CH);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kh = h / (NV / NK);
  const int C = 2 * NK * DK + NV * DV;

  float* qs = sm;                 // [CH][DKP]
  float* ks = qs + CH * DKP;      // [CH][DKP]
  float* am = ks + CH * DKP;      // [CH][CH]
  double* gd = (double*)(am + CH * CH);  // [CH] (offset is a multiple of 8 bytes: CH*CH floats even)
  float* bt = (float*)(gd + CH);  // [CH]
  float* eg = bt + CH;            // [CH]
  float* rq = eg + CH;            // [CH]
  float* rk = rq + CH;            // [CH]

  // q/k rows, raw then scaled in place by the same lane; rows >= n are zero.
  for (int i = warp; i < CH; i += NT / 32) {
    float sq = 0.f, sk = 0.f;
    const float* xr = x + (size_t)(t0 + i) * C;
    for (int d = lane; d < DK; d += 32) {
      const float qv = i < n ? xr[kh * DK + d] : 0.f, kv = i < n ? xr[NK * DK + kh * DK + d] : 0.f;
      qs[i * DKP + d] = qv;
      ks[i * DKP + d] = kv;
      sq += qv * qv;
      sk += kv * kv;
    }
    for (int o = 16; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    const float a = 1.f / sqrtf(sq + 1e-6f) / sqrtf((float)DK), b = 1.f / sqrtf(sk + 1e-6f);
    for (int d = lane; d < DK; d += 32) {
      qs[i * DKP + d] *= a;
      ks[i * DKP + d] *= b;
    }
    if (lane == 0) {
      rq[i] = a;
      rk[i] = b;
    }
  }
  if (tid < CH) {
    const size_t gi = (size_t)(t0 + tid) * NV + h;
    gd[tid] = tid < n ? (double)gdec[gi] : 0.0;  // padding: g = 0 (no decay), beta = 0 (no write)
    bt[tid] = tid < n ? beta[gi] : 0.f;
  }
  __syncthreads();
  if (tid == 0) {  // 64 float64 adds: the cumulative decay, exact enough that G_i - G_j keeps small g's
    double acc = 0.0;
    for (int i = 0; i < CH; ++i) {
      acc += gd[i];
      gd[i] = acc;
    }
  }
  __syncthreads();
  const double Glast = gd[CH - 1];  // = G_{n-1}: padding adds 0
  if (tid < CH) {
    eg[tid] = (float)exp(gd[tid]);
    if (tid < n) {
      float4 v;
      v.x = rq[tid] * eg[tid];
      v.y = rk[tid] * (float)exp(Glast - gd[tid]);
      v.z = (float)exp(Glast);
      v.w = 0.f;
      *(float4*)(ws_s + ((size_t)(t0 + tid) * NV + h) * 4) = v;
    }
  }

  // A and Aqk: 4 x 4 register tile per thread, rows ti + 16a, columns tj + 16b.
  {
    const int ti = tid >> 4, tj = tid & 15;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) kk[a][b] = qk[a][b] = 0.f;
#pragma unroll 4
    for (int d = 0; d < DK; ++d) {
      float ki[4], qi[4], kj[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        ki[a] = ks[(ti + 16 * a) * DKP + d];
        qi[a] = qs[(ti + 16 * a) * DKP + d];
        kj[a] = ks[(tj + 16 * a) * DKP + d];
      }
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          kk[a][b] += ki[a] * kj[b];
          qk[a][b] += qi[a] * kj[b];
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int i = ti + 16 * a;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int j = tj + 16 * b;
        const float dec = j <= i ? (float)exp(gd[i] - gd[j]) : 0.f;  // exponent <= 0: never overflows
        am[j * CH + i] = j < i ? bt[i] * kk[a][b] * dec : 0.f;  // transposed: am[j][i] = A_ij
        if (i < n) ws_a[((size_t)(t0 + i) * NV + h) * CH + j] = qk[a][b] * dec;
      }
    }
  }
  __syncthreads();

  // Forward substitution (I + A) X = [beta v | beta e^G k], one column of X per thread, all 64 rows in
  // registers (fully unrolled: constant indices). No barrier: each thread owns its column.
  for (int col = tid; col < DV + DK; col += NT) {
    float X[CH];
    if (col < DV) {
      const float* vp = x + (size_t)t0 * C + 2 * NK * DK + h * DV + col;
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        X[i] = i < n ? bt[i] * *vp : 0.f;
        vp += C;  // running pointer: 64 precomputed 64-bit addresses would not fit the registers
      }
    } else {
#pragma unroll
      for (int i = 0; i < CH; ++i) X[i] = bt[i] * eg[i] * ks[i * DKP + (col - DV)];
    }
    // right-looking: once X[j] is final, subtract its column of A from the rows below (am is A transposed,
    // so the 4 rows i..i+3 of column j are one broadcast float4)
#pragma unroll
    for (int j = 0; j < CH - 1; ++j) {
      const float xj = X[j];
#pragma unroll
      for (int i = (j + 1) & ~3; i < CH; i += 4) {
        const float4 a4 = *(const float4*)(am + j * CH + i);
        if (i > j) X[i] -= a4.x * xj;
        if (i + 1 > j) X[i + 1] -= a4.y * xj;
        if (i + 2 > j) X[i + 2] -= a4.z * xj;
        if (i + 3 > j) X[i + 3] -= a4.w * xj;
      }
    }
    const size_t rstride = col < DV ? (size_t)NV * DV : (size_t)NV * DK;
    float* dst = (col < DV ? ws_u + (size_t)h * DV + col : ws_w + (size_t)h * DK + (col - DV)) + (size_t)t0 * rstride;
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      if (i < n) *dst = X[i];
      dst += rstride;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Kernel 2: one CTA per (32 value columns, value head h, sequence s), sequential over the sequence's
// chunks. The state block S[DK][32] lives in registers (thread: rows warp*RD + r, column lane) with a
// copy in shared memory for the matmuls. Per chunk (rows i = warp + 8m, column lane in steps a and b):
//   a: V = U - W S,  Vk = sk * V          b: o = sq * (Q S) + Aqk V          c: S = e^{G_last} S + K^T Vk
// cp.async stages, one commit group each, always three in flight: {W, U, sc} of chunk c+1 is issued
// after step a of chunk c, {Q, Aqk} after step b, {K} after step c; each step first waits until at most
// the two newest groups are pending (cp.async.wait_group 2), which is exactly its own group landed.
// Shared memory (floats): ss [DK][32], wm/qm/km [64][DK], am [64][64], um/vm/vk [64][32], sc [2][64][4].
// ------------------------------------------------------------------------------------------------
#define STATE_FLOATS (DK * BV + 3 * CH * DK + CH * CH + 3 * CH * BV + 2 * CH * 4)
#define STATE_SMEM (STATE_FLOATS * 4)

extern "C" __global__ void __launch_bounds__(NT, 1) gdn_chunk_state(const float* __restrict__ x,
                                                                 const int* __restrict__ seq_start,
                                                                 const int* __restrict__ slots,
                                                                 float* __restrict__ rec, long long rec_row,
                                                                 const float* __restrict__ ws_w,
                                                                 const float* __restrict__ ws_u,
                                                                 const float* __restrict__ ws_a,
                                                                 const float* __restrict__ ws_s,
                                                                 T* __restrict__ out, int S, int NK, int NV) {
  extern __shared__ __align__(16) float sm[];
  const int h = blockIdx.y, s = blockIdx.z;
  if (s >= S || h >= NV) return;
  pdl_wait();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int col0 = blockIdx.x * BV, col = col0 + lane;
  const bool cv = col < DV;
  const int kh = h / (NV / NK);
  const int C = 2 * NK * DK + NV * DV;
  const int start = seq_start[s], T_len = seq_start[s + 1] - start;
  const int nc = (T_len + CH - 1) / CH;
  float* St = rec + (long long)slots[s] * rec_row + (long long)h * DK * DV;

  float* ss = sm;               // [DK][BV]
  float* wm = ss + DK * BV;     // [CH][DK]
  float* qm = wm + CH * DK;     // [CH][DK]
  float* km = qm + CH * DK;     // [CH][DK]
  float* am = km + CH * DK;     // [CH][CH]
  float* um = am + CH * CH;     // [CH][BV]
  float* vm = um + CH * BV;     // [CH][BV]
  float* vk = vm + CH * BV;     // [CH][BV]
  float* scm = vk + CH * BV;    // [2][CH][4]

  // Stage issuers. Row i of chunk cc is token start + CH*cc + i; rows >= n are zero-filled.
  auto issue_wu = [&](int cc) {
    if (cc < nc) {
      const int t0 = start + cc * CH, n = min(CH, T_len - cc * CH);
      for (int e = tid; e < CH * (DK / 4); e += NT) {
        const int i = e / (DK / 4), q4 = (e % (DK / 4)) * 4;
        const bool ok = i < n;
        cp16(wm + i * DK + q4, ok ? ws_w + ((size_t)(t0 + i) * NV + h) * DK + q4 : ws_w, ok);
      }
      for (int e = tid; e < CH * (BV / 4); e += NT) {
        const int i = e / (BV / 4), q4 = (e % (BV / 4)) * 4;
        const bool ok = i < n && col0 + q4 < DV;
        cp16(um + i * BV + q4, ok ? ws_u + ((size_t)(t0 + i) * NV + h) * DV + col0 + q4 : ws_u, ok);
      }
      for (int i = tid; i < CH; i += NT) {
        const bool ok = i < n;
        cp16(scm + ((cc & 1) * CH + i) * 4, ok ? ws_s + ((size_t)(t0 + i) * NV + h) * 4 : ws_s, ok);
      }
    }
    cp_commit();  // always a group (possibly empty): the wait_group 2 count stays exact
  };
  auto issue_qa = [&](int cc) {
    if (cc < nc) {
      const int t0 = start + cc * CH, n = min(CH, T_len - cc * CH);
      for (int e = tid; e < CH * (DK / 4); e += NT) {
        const int i = e / (DK / 4), q4 = (e % (DK / 4)) * 4;
        const bool ok = i < n;
        cp16(qm + i * DK + q4, ok ? x + (size_t)(t0 + i) * C + kh * DK + q4 : x, ok);
      }
      for (int e = tid; e < CH * (CH / 4); e += NT) {
        const int i = e / (CH / 4), q4 = (e % (CH / 4)) * 4;
        const bool ok = i < n;
        cp16(am + i * CH + q4, ok ? ws_a + ((size_t)(t0 + i) * NV + h) * CH + q4 : ws_a, ok);
      }
    }
    cp_commit();
  };
  auto issue_k = [&](int cc) {
    if (cc < nc) {
      const int t0 = start + cc * CH, n = min(CH, T_len - cc * CH);
      for (int e = tid; e < CH * (DK / 4); e += NT) {
        const int i = e / (DK / 4), q4 = (e % (DK / 4)) * 4;
        const bool ok = i < n;
        cp16(km + i * DK + q4, ok ? x + (size_t)(t0 + i) * C + NK * DK + kh * DK + q4 : x, ok);
      }
    }
    cp_commit();
  };

  issue_wu(0);
  issue_qa(0);
  issue_k(0);

  // state block: registers (master) and the shared copy; columns >= DV stay zero
  float st[RD];
#pragma unroll
  for (int r = 0; r < RD; ++r) {
    const int d = warp * RD + r;
    st[r] = (cv && d < DK) ? St[(size_t)d * DV + col] : 0.f;
    if (d < DK) ss[d * BV + lane] = st[r];
  }

  for (int c = 0; c < nc; ++c) {
    const int t0 = start + c * CH, n = min(CH, T_len - c * CH);
    const float* sc = scm + (c & 1) * CH * 4;

    // ---- step a: V = U - W S, Vk = sk V
    cp_wait2();
    __syncthreads();  // {W, U, sc} of chunk c landed for every thread; ss holds the state of chunk c
    {
      float acc[CH / 8];
#pragma unroll
      for (int m = 0; m < CH / 8; ++m) acc[m] = 0.f;
#pragma unroll 2
      for (int d = 0; d < DK; d += 4) {
        const float s0 = ss[d * BV + lane], s1 = ss[(d + 1) * BV + lane], s2 = ss[(d + 2) * BV + lane],
                    s3 = ss[(d + 3) * BV + lane];
#pragma unroll
        for (int m = 0; m < CH / 8; ++m) {
          const float4 wv = *(const float4*)(wm + (warp + 8 * m) * DK + d);
          acc[m] += wv.x * s0 + wv.y * s1 + wv.z * s2 + wv.w * s3;
        }
      }
#pragma unroll
      for (int m = 0; m < CH / 8; ++m) {
        const int i = warp + 8 * m;
        const float v = um[i * BV + lane] - acc[m];
        vm[i * BV + lane] = v;
        vk[i * BV + lane] = sc[i * 4 + 1] * v;
      }
    }
    __syncthreads();  // wm, um free; vm, vk visible
    issue_wu(c + 1);

    // ---- step b: o = sq (Q S) + Aqk V
    cp_wait2();
    __syncthreads();  // {Q, Aqk} of chunk c landed
    {
      float acc[CH / 8], acv[CH / 8];
#pragma unroll
      for (int m = 0; m < CH / 8; ++m) acc[m] = acv[m] = 0.f;
#pragma unroll 2
      for (int d = 0; d < DK; d += 4) {
        const float s0 = ss[d * BV + lane], s1 = ss[(d + 1) * BV + lane], s2 = ss[(d + 2) * BV + lane],
                    s3 = ss[(d + 3) * BV + lane];
#pragma unroll
        for (int m = 0; m < CH / 8; ++m) {
          const float4 qv = *(const float4*)(qm + (warp + 8 * m) * DK + d);
          acc[m] += qv.x * s0 + qv.y * s1 + qv.z * s2 + qv.w * s3;
        }
      }
#pragma unroll 2
      for (int j = 0; j < CH; j += 4) {
        const float v0 = vm[j * BV + lane], v1 = vm[(j + 1) * BV + lane], v2 = vm[(j + 2) * BV + lane],
                    v3 = vm[(j + 3) * BV + lane];
#pragma unroll
        for (int m = 0; m < CH / 8; ++m) {
          const float4 av = *(const float4*)(am + (warp + 8 * m) * CH + j);
          acv[m] += av.x * v0 + av.y * v1 + av.z * v2 + av.w * v3;
        }
      }
#pragma unroll
      for (int m = 0; m < CH / 8; ++m) {
        const int i = warp + 8 * m;
        if (i < n && cv) store_act(out + (size_t)(t0 + i) * NV * DV + (size_t)h * DV + col, sc[i * 4] * acc[m] + acv[m]);
      }
    }
    __syncthreads();  // qm, am free (and ss reads of this chunk done)
    issue_qa(c + 1);

    // ---- step c: S = e^{G_last} S + K^T Vk
    cp_wait2();
    __syncthreads();  // {K} of chunk c landed
    {
      const float el = sc[2];  // row 0 always exists (n >= 1)
#pragma unroll
      for (int r = 0; r < RD; ++r) st[r] *= el;
#pragma unroll 4
      for (int i = 0; i < CH; ++i) {
        const float vv = vk[i * BV + lane];
#pragma unroll
        for (int r = 0; r < RD; r += 4) {
          const int d = warp * RD + r;
          if (d < DK) {
            const float4 kv = *(const float4*)(km + i * DK + d);
            st[r] += kv.x * vv;
            st[r + 1] += kv.y * vv;
            st[r + 2] += kv.z * vv;
            st[r + 3] += kv.w * vv;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < RD; ++r) {
        const int d = warp * RD + r;
        if (d < DK) ss[d * BV + lane] = st[r];
      }
    }
    __syncthreads();  // km, vm, vk free; ss holds the next chunk's state
    issue_k(c + 1);
  }
  asm volatile("cp.async.wait_group 0;\n" ::);  // the trailing (empty) groups

#pragma unroll
  for (int r = 0; r < RD; ++r) {
    const int d = warp * RD + r;
    if (cv && d < DK) St[(size_t)d * DV + col] = st[r];
  }
}
