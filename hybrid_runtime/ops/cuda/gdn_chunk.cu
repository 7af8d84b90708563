// Gated delta rule, prefill in the chunked WY / UT-transform form: fully parallel intra-chunk work, then
// one sequential pass over chunks (O(T/64) steps of small matmuls instead of T token steps). float32
// throughout (SIMT, no tensor cores), so it matches the CPU's float32 chunked form to float32 rounding.
// The float64 numpy model of exactly this decomposition is tests/unit/test_gdn_chunk_math.py (prep,
// state_pass); the token recurrence it equals is MODEL_MATH.md "Gated DeltaNet mixer" step 5.
//
// Compiled by NVRTC with -DDK=<key head dim, multiple of 4> -DDV=<value head dim, multiple of 4> and
// -DTC=<0 | 1> (precision): TC=0 is the float32 SIMT form above. TC=1 ("tf32") runs every matrix product of
// both kernels except the forward substitution on tensor cores (mma.sync m16n8k8 .tf32, operands rounded
// to tf32 with cvt.rna, float32 accumulation; the state and every accumulator stay float32): ~1e-3
// relative to float64, for bf16/fp16 bundles; needs DK % 16 == 0. Same grids, workspace and launch
// arguments in both builds; only the shared-memory sizes differ (PREP_SMEM, STATE_SMEM).
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
#ifndef TC
#define TC 0
#endif
#if TC && (DK % 16)
#error "the tf32 build (TC=1) needs DK % 16 == 0"
#endif

#if DT == 0
typedef float T;
#else
typedef u16 T;
#endif

#define CH 64          // chunk length
#define NT 256         // threads of both kernels
#define DKP (DK + 1 + 3 * TC)  // padded row of q/k in the prep kernel: conflict-free column reads (SIMT),
                                // conflict-free mma fragments (TC: DKP % 32 == 4 when DK % 32 == 0)
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
// tf32 tensor-core helpers. m16n8k8 fragments (PTX ISA, mma .tf32; g = lane >> 2, t = lane & 3):
//   A 16x8 row-major: a0 (g, t)  a1 (g+8, t)  a2 (g, t+4)  a3 (g+8, t+4)
//   B 8x8 (k x n):    b0 (k=t, n=g)  b1 (k=t+4, n=g)
//   C 16x8:           c0 (g, 2t)  c1 (g, 2t+1)  c2 (g+8, 2t)  c3 (g+8, 2t+1)
__device__ __forceinline__ u32 tf32(float v) {
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}
__device__ __forceinline__ void mma_tf32(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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

#if TC
  // A and Aqk on tensor cores: warp w owns rows 16 (w & 3) .. +15 and columns 32 (w >> 2) .. +31 (4 n-tiles)
  // of both 64 x 64 products; K^T is the B operand (b0 = k row j = 8nt + g, dim d + t: ks[j][d + t]).
  {
    const int g = lane >> 2, t4 = lane & 3, mt = warp & 3, nq = warp >> 2;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int r = 0; r < 4; ++r) kk[a][r] = qk[a][r] = 0.f;
#pragma unroll 2
    for (int d = 0; d < DK; d += 8) {
      const float* kr = ks + (16 * mt + g) * DKP + d + t4;
      const float* qr = qs + (16 * mt + g) * DKP + d + t4;
      const u32 k0 = tf32(kr[0]), k1 = tf32(kr[8 * DKP]), k2 = tf32(kr[4]), k3 = tf32(kr[8 * DKP + 4]);
      const u32 q0 = tf32(qr[0]), q1 = tf32(qr[8 * DKP]), q2 = tf32(qr[4]), q3 = tf32(qr[8 * DKP + 4]);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float* br = ks + (32 * nq + 8 * nt + g) * DKP + d + t4;
        const u32 b0 = tf32(br[0]), b1 = tf32(br[4]);
        mma_tf32(kk[nt], k0, k1, k2, k3, b0, b1);
        mma_tf32(qk[nt], q0, q1, q2, q3, b0, b1);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = 16 * mt + g + 8 * (r >> 1), j = 32 * nq + 8 * nt + 2 * t4 + (r & 1);
        const float dec = j <= i ? (float)exp(gd[i] - gd[j]) : 0.f;  // exponent <= 0: never overflows
        am[j * CH + i] = j < i ? bt[i] * kk[nt][r] * dec : 0.f;  // transposed: am[j][i] = A_ij
        if (i < n) ws_a[((size_t)(t0 + i) * NV + h) * CH + j] = qk[nt][r] * dec;
      }
  }
#else
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
#endif
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
// TC build: padded rows so that every mma fragment read is conflict-free (see gdn_chunk_state below).
#define WST (DK + 4)  // W, Q rows (A operand, rows g: WST % 32 == 4 when DK % 32 == 0)
#define KST (DK + 8)  // K rows (read transposed as the A operand of K^T Vk: rows t, KST % 32 == 8)
#define AST (CH + 4)  // Aqk rows (A operand)
#define VST (BV + 8)  // S, U, V, sk V rows (B operand: rows t, columns g)
#define STATE_FLOATS_TC (DK * VST + 2 * CH * WST + CH * KST + CH * AST + 3 * CH * VST + 2 * CH * 4)
#if TC
#define STATE_SMEM (STATE_FLOATS_TC * 4)
#else
#define STATE_SMEM (STATE_FLOATS * 4)
#endif

#if !TC

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

#else  // TC
// ------------------------------------------------------------------------------------------------
// Kernel 2, tf32 tensor cores: the same CTA, stages and schedule as the SIMT kernel above (one CTA per
// (32 value columns, value head, sequence), sequential over chunks, three cp.async groups in flight),
// the three steps as m16n8k8 tf32 mma with float32 accumulators:
//   a: V = U - W S       warp w: rows 16 (w & 3) .. +15, columns 16 (w >> 2) .. +15 (2 n-tiles), k = DK
//   b: o = sq (Q S) + Aqk V   same tile; Aqk V only over k < 16 ((w & 3) + 1) (Aqk is lower triangular)
//   c: S = e^{G_last} S + K^T Vk   warp w: state rows 16 (w + 8 m) .. +15 (m < MTC), all 32 columns
//      (4 n-tiles); K^T is read from K [64][KST] as the A operand: a0 = (d = g, i = t) = km[t][d].
// The state lives in step c's accumulators (float32, the master copy) and is mirrored into ss for the
// B operands of steps a and b. Operands are rounded to tf32 (cvt.rna) as they are read from shared memory.
// Shared memory (floats): ss [DK][VST], wm/qm [64][WST], km [64][KST], am [64][AST], um/vm/vk [64][VST],
// sc [2][64][4].
// ------------------------------------------------------------------------------------------------
#define MTC ((DK / 16 + 7) / 8)  // 16-row state tiles per warp in step c

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
  const int g = lane >> 2, t4 = lane & 3, mt = warp & 3, nh = warp >> 2;
  const int col0 = blockIdx.x * BV;
  const int kh = h / (NV / NK);
  const int C = 2 * NK * DK + NV * DV;
  const int start = seq_start[s], T_len = seq_start[s + 1] - start;
  const int nc = (T_len + CH - 1) / CH;
  float* St = rec + (long long)slots[s] * rec_row + (long long)h * DK * DV;

  float* ss = sm;               // [DK][VST]
  float* wm = ss + DK * VST;    // [CH][WST]
  float* qm = wm + CH * WST;    // [CH][WST]
  float* km = qm + CH * WST;    // [CH][KST]
  float* am = km + CH * KST;    // [CH][AST]
  float* um = am + CH * AST;    // [CH][VST]
  float* vm = um + CH * VST;    // [CH][VST]
  float* vk = vm + CH * VST;    // [CH][VST]
  float* scm = vk + CH * VST;   // [2][CH][4]

  // Stage issuers (as the SIMT kernel, padded rows). Row i of chunk cc is token start + CH*cc + i; rows >= n
  // and columns >= DV are zero-filled; the pad columns of each row are never read.
  auto issue_wu = [&](int cc) {
    if (cc < nc) {
      const int t0 = start + cc * CH, n = min(CH, T_len - cc * CH);
      for (int e = tid; e < CH * (DK / 4); e += NT) {
        const int i = e / (DK / 4), q4 = (e % (DK / 4)) * 4;
        const bool ok = i < n;
        cp16(wm + i * WST + q4, ok ? ws_w + ((size_t)(t0 + i) * NV + h) * DK + q4 : ws_w, ok);
      }
      for (int e = tid; e < CH * (BV / 4); e += NT) {
        const int i = e / (BV / 4), q4 = (e % (BV / 4)) * 4;
        const bool ok = i < n && col0 + q4 < DV;
        cp16(um + i * VST + q4, ok ? ws_u + ((size_t)(t0 + i) * NV + h) * DV + col0 + q4 : ws_u, ok);
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
        cp16(qm + i * WST + q4, ok ? x + (size_t)(t0 + i) * C + kh * DK + q4 : x, ok);
      }
      for (int e = tid; e < CH * (CH / 4); e += NT) {
        const int i = e / (CH / 4), q4 = (e % (CH / 4)) * 4;
        const bool ok = i < n;
        cp16(am + i * AST + q4, ok ? ws_a + ((size_t)(t0 + i) * NV + h) * CH + q4 : ws_a, ok);
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
        cp16(km + i * KST + q4, ok ? x + (size_t)(t0 + i) * C + NK * DK + kh * DK + q4 : x, ok);
      }
    }
    cp_commit();
  };

  issue_wu(0);
  issue_qa(0);
  issue_k(0);

  // state: st[m][nt][r] = S[16 (warp + 8m) + g + 8 (r >> 1)][col0 + 8 nt + 2 t4 + (r & 1)] (step c's C layout);
  // columns >= DV stay zero, tiles past DK do not exist (warp-uniform).
  float st[MTC][4][4];
#pragma unroll
  for (int m = 0; m < MTC; ++m)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int tile = warp + 8 * m, d = 16 * tile + g + 8 * (r >> 1), n = 8 * nt + 2 * t4 + (r & 1);
        const bool ok = tile < DK / 16;
        st[m][nt][r] = (ok && col0 + n < DV) ? St[(size_t)d * DV + col0 + n] : 0.f;
        if (ok) ss[d * VST + n] = st[m][nt][r];
      }

  for (int c = 0; c < nc; ++c) {
    const int t0 = start + c * CH, n = min(CH, T_len - c * CH);
    const float* sc = scm + (c & 1) * CH * 4;

    // ---- step a: V = U - W S, Vk = sk V
    cp_wait2();
    __syncthreads();  // {W, U, sc} of chunk c landed for every thread; ss holds the state of chunk c
    {
      float acc[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = 0.f;
#pragma unroll 4
      for (int kk = 0; kk < DK; kk += 8) {
        const float* ar = wm + (16 * mt + g) * WST + kk + t4;
        const u32 a0 = tf32(ar[0]), a1 = tf32(ar[8 * WST]), a2 = tf32(ar[4]), a3 = tf32(ar[8 * WST + 4]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* br = ss + (kk + t4) * VST + 16 * nh + 8 * nt + g;
          mma_tf32(acc[nt], a0, a1, a2, a3, tf32(br[0]), tf32(br[4 * VST]));
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 16 * mt + g + 8 * (r >> 1), j = 16 * nh + 8 * nt + 2 * t4 + (r & 1);
          const float v = um[i * VST + j] - acc[nt][r];
          vm[i * VST + j] = v;
          vk[i * VST + j] = sc[i * 4 + 1] * v;
        }
    }
    __syncthreads();  // wm, um free; vm, vk visible
    issue_wu(c + 1);

    // ---- step b: o = sq (Q S) + Aqk V
    cp_wait2();
    __syncthreads();  // {Q, Aqk} of chunk c landed
    {
      float acc[2][4], acv[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = acv[nt][r] = 0.f;
#pragma unroll 4
      for (int kk = 0; kk < DK; kk += 8) {
        const float* ar = qm + (16 * mt + g) * WST + kk + t4;
        const u32 a0 = tf32(ar[0]), a1 = tf32(ar[8 * WST]), a2 = tf32(ar[4]), a3 = tf32(ar[8 * WST + 4]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* br = ss + (kk + t4) * VST + 16 * nh + 8 * nt + g;
          mma_tf32(acc[nt], a0, a1, a2, a3, tf32(br[0]), tf32(br[4 * VST]));
        }
      }
      for (int kk = 0; kk < 16 * (mt + 1); kk += 8) {  // Aqk[i][j] = 0 for j > i
        const float* ar = am + (16 * mt + g) * AST + kk + t4;
        const u32 a0 = tf32(ar[0]), a1 = tf32(ar[8 * AST]), a2 = tf32(ar[4]), a3 = tf32(ar[8 * AST + 4]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* br = vm + (kk + t4) * VST + 16 * nh + 8 * nt + g;
          mma_tf32(acv[nt], a0, a1, a2, a3, tf32(br[0]), tf32(br[4 * VST]));
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 16 * mt + g + 8 * (r >> 1), col = col0 + 16 * nh + 8 * nt + 2 * t4 + (r & 1);
          if (i < n && col < DV)
            store_act(out + (size_t)(t0 + i) * NV * DV + (size_t)h * DV + col, sc[i * 4] * acc[nt][r] + acv[nt][r]);
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
      for (int m = 0; m < MTC; ++m)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) st[m][nt][r] *= el;
#pragma unroll 2
      for (int kk = 0; kk < CH; kk += 8) {
        u32 b0[4], b1[4];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const float* br = vk + (kk + t4) * VST + 8 * nt + g;
          b0[nt] = tf32(br[0]);
          b1[nt] = tf32(br[4 * VST]);
        }
#pragma unroll
        for (int m = 0; m < MTC; ++m) {
          const int tile = warp + 8 * m;
          if (tile < DK / 16) {
            const float* ar = km + (kk + t4) * KST + 16 * tile + g;  // A(d, i) = K[i][d]
            const u32 a0 = tf32(ar[0]), a1 = tf32(ar[8]), a2 = tf32(ar[4 * KST]), a3 = tf32(ar[4 * KST + 8]);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) mma_tf32(st[m][nt], a0, a1, a2, a3, b0[nt], b1[nt]);
          }
        }
      }
#pragma unroll
      for (int m = 0; m < MTC; ++m) {
        const int tile = warp + 8 * m;
        if (tile < DK / 16) {
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r)
              ss[(16 * tile + g + 8 * (r >> 1)) * VST + 8 * nt + 2 * t4 + (r & 1)] = st[m][nt][r];
        }
      }
    }
    __syncthreads();  // km, vm, vk free; ss holds the next chunk's state
    issue_k(c + 1);
  }
  asm volatile("cp.async.wait_group 0;\n" ::);  // the trailing (empty) groups

#pragma unroll
  for (int m = 0; m < MTC; ++m) {
    const int tile = warp + 8 * m;
    if (tile < DK / 16) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int d = 16 * tile + g + 8 * (r >> 1), col = col0 + 8 * nt + 2 * t4 + (r & 1);
          if (col < DV) St[(size_t)d * DV + col] = st[m][nt][r];
        }
    }
  }
}
#endif  // TC
