// Gated delta rule, prefill in the chunked WY / UT-transform form: fully parallel intra-chunk work, then
// one sequential pass over chunks (O(T/64) steps of small matmuls instead of T token steps). float32
// throughout (SIMT, no tensor cores), so it matches the CPU's float32 chunked form to float32 rounding.
// The float64 numpy model of exactly this decomposition is tests/unit/test_gdn_chunk_math.py (prep,
// state_pass); the token recurrence it equals is MODEL_MATH.md "Gated DeltaNet mixer" step 5.
//
// Compiled by NVRTC with -DDK=<key head dim, multiple of 4> -DDV=<value head dim, multiple of 4> and
// -DTC=<0 | 1 | 2 | 3> (precision): TC=0 is the float32 SIMT form above. TC=1 ("tf32_v1") runs every matrix
// product of both kernels except the forward substitution on tensor cores (mma.sync m16n8k8 .tf32, operands
// rounded to tf32 with cvt.rna, float32 accumulation; the state and every accumulator stay float32): ~1e-3
// relative to float64, for bf16/fp16 bundles; needs DK % 16 == 0. TC=2 ("tf32_v2") replaces the forward
// substitution by T = (I + A)^-1 (float32 SIMT, blockwise) and u = T diag(beta) v,
// w = T diag(beta e^G) k on tensor cores, stores w and Aqk tf32-rounded (their only use is as tf32 operands),
// and computes Q S with W S in step a of the state pass (shared S fragments, Q in W's cp.async stage).
// TC=3 ("tf32", the default tensor-core build) is TC=2's prep and numerics with a state pass of 64 value
// columns per CTA (grid (ceil(DV/64), NV, S)): half the W / Q / K reloads, ldmatrix B fragments, 3 barriers
// per chunk (gdn_chunk_state, TC == 3, below).
// TC=4 ("bf16") keeps TC=2's prep (w, Aqk stored bf16, plus bf16 raw q / k rows) and replaces gdn_chunk_state by
// gdn_chunk_h + gdn_chunk_o (bf16 tensor cores; see "Build 4" below: its own workspace layout and arguments).
// Same workspace and launch arguments in builds 0-3; the state grid's x (ceil(DV/32), TC=3: ceil(DV/64)) and
// the shared-memory sizes differ (PREP_SMEM, STATE_SMEM; TC=1 and TC=2 share STATE_SMEM, TC=2 and TC=3
// PREP_SMEM).
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
// Kernel 2 gdn_chunk_state: grid (ceil(DV/32), NV, S) (TC=3: ceil(DV/64)), 256 threads, dynamic smem STATE_SMEM.
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
#error "the tensor-core builds (TC=1, 2, 3, 4) need DK % 16 == 0"
#endif
#if TC == 4 && (DV % 32)
#error "the bf16 build (TC=4) needs DV % 32 == 0"
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
__device__ __forceinline__ void cp16(void* dst, const void* src, bool valid) {
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
__device__ __forceinline__ void cp_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ float rnd_tf32(float v) { return __uint_as_float(tf32(v)); }
// ldmatrix .x4 of 32-bit data: matrix q (addresses from lanes 8q .. 8q+7, one 16-byte row each) gives lane l
// the word (row l >> 2, word l & 3) = (g, t4), the tf32 fragment element. The m16n8k8 A fragment of the
// 16 x 8 tile at p (row-major, stride st floats, 16-byte aligned rows) is {rows 0-7 | 8-15} x {cols 0-3 | 4-7}:
// lane l points at row (l & 7) + 8 ((l >> 3) & 1), column 4 (l >> 4) -> a0 (g, t) a1 (g+8, t) a2 (g, t+4)
// a3 (g+8, t+4). Operands loaded this way must already be tf32-rounded.
__device__ __forceinline__ void ldsm_a(u32* a, const float* p, int st, int lane) {
  const float* q = p + ((lane & 7) + 8 * ((lane >> 3) & 1)) * st + 4 * (lane >> 4);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(smem_u32(q))
               : "memory");
}
// B fragments of two n-tiles (n0, n0 + 8) from an [n][k] row-major array (B(k, n) = p[n][k]): b0 (k=t, n=g)
// and b1 (k=t+4, n=g) of tile 0 in b[0], b[1], of tile 1 in b[2], b[3]; lane l points at row
// (l & 7) + 8 (l >> 4), column 4 ((l >> 3) & 1).
__device__ __forceinline__ void ldsm_b2(u32* b, const float* p, int st, int lane) {
  const float* q = p + ((lane & 7) + 8 * (lane >> 4)) * st + 4 * ((lane >> 3) & 1);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(smem_u32(q))
               : "memory");
}
// bf16 helpers (build 4). Two floats -> one word of bf16 (lo at the lower address), round to nearest even.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// ------------------------------------------------------------------------------------------------
// Kernel 1: one CTA per (chunk c, value head h, sequence s). Shared memory (floats):
//   qs [64][DKP] normalised q (x 1/sqrt(DK)),  ks [64][DKP] normalised k,  am [64][64] A^T (am[j][i] = A_ij, j < i)
//   gd [64] doubles: G (cumulative log decay, in float64),  bt [64] beta,  eg [64] e^G,  rq/rk [64]
// ------------------------------------------------------------------------------------------------
#if TC >= 2
// tf32 builds 2 and 3: shared memory (floats) qv [64][PQV] (q rows of stride PKS, later v rows of stride PVS),
// ks [64][PKS], am [64][PAS], tm [64][PAS], then G (float64), beta, e^G, rq, rk [64].
#define DVP (((DV + 7) / 8) * 8)  // v columns padded to whole n-tiles (zero-filled)
#define PKS (DK + 4)              // q / k rows: A fragments and [n][k] B fragments conflict-free (ldmatrix)
#define PVS (DVP + 8)             // v rows: B fragments (rows t, columns g) conflict-free when DV % 32 == 0
#define PQV (PKS > PVS ? PKS : PVS)
#define PAS (CH + 4)              // A, T rows (A fragments by ldmatrix)
#define PREP_FLOATS (CH * PQV + CH * PKS + 2 * CH * PAS + 2 * CH + 4 * CH)
#else
#define PREP_FLOATS (2 * CH * DKP + CH * CH + 2 * CH + 4 * CH)
#endif
#define PREP_SMEM (PREP_FLOATS * 4)

#if TC >= 2
// ------------------------------------------------------------------------------------------------
// Kernel 1, tf32 builds 2 and 3 (precisions "tf32_v2", "tf32"): the forward substitution replaced by
// T = (I + A)^-1 (float32 SIMT, blockwise: tests/unit/test_gdn_chunk_math.py unit_lower_inverse) and two
// tensor-core products,
// u = tf32(T diag(beta)) tf32(v), w = tf32(T diag(beta e^G)) tf32(k) (w stored tf32-rounded, as Aqk: both
// are only ever tf32 A operands of gdn_chunk_state). q / k / v arrive by cp.async; q, k are normalised and
// rounded to tf32 in shared memory once. Same grid, arguments and workspace as the other builds.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NT, 2) gdn_chunk_prep(const float* __restrict__ x,
                                                                   const float* __restrict__ gdec,
                                                                   const float* __restrict__ beta,
                                                                   const int* __restrict__ seq_start,
                                                                   float* __restrict__ ws_w, float* __restrict__ ws_u,
                                                                   float* __restrict__ ws_a, float* __restrict__ ws_s,
                                                                   int S, int NK, int NV
#if TC == 4
                                                                   , u16* __restrict__ ws_qk
#endif
) {
  extern __shared__ __align__(16) float sm[];
  const int c = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
  if (s >= S || h >= NV) return;
  pdl_wait();
  const int start = seq_start[s], T_len = seq_start[s + 1] - start;
  if (c * CH >= T_len) return;
  const int t0 = start + c * CH, n = min(CH, T_len - c * CH);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int kh = h / (NV / NK);
  const int C = 2 * NK * DK + NV * DV;

  float* qv = sm;                  // [CH][PQV]
  float* ks = qv + CH * PQV;       // [CH][PKS]
  float* am = ks + CH * PKS;       // [CH][PAS] A (row-major), then tf32(T diag(beta e^G))
  float* tm = am + CH * PAS;       // [CH][PAS] T, then tf32(T diag(beta))
  double* gd = (double*)(tm + CH * PAS);  // [CH] (float offset even: 8-byte aligned)
  float* bt = (float*)(gd + CH);   // [CH]
  float* eg = bt + CH;             // [CH]

  // raw q / k rows (rows >= n zero-filled)
  for (int e = tid; e < CH * (DK / 4); e += NT) {
    const int i = e / (DK / 4), q4 = (e % (DK / 4)) * 4;
    const bool ok = i < n;
    const float* xr = x + (size_t)(t0 + (ok ? i : 0)) * C + kh * DK + q4;
    cp16(qv + i * PKS + q4, xr, ok);
    cp16(ks + i * PKS + q4, xr + NK * DK, ok);
  }
  cp_commit();
  if (warp == 0) {  // G = cumsum(g) in float64 (warp scan; lane owns rows 2 lane, 2 lane + 1), beta, e^G
    const int i0 = 2 * lane;
    const size_t gi = (size_t)(t0 + i0) * NV + h;
    const double ga = i0 < n ? (double)gdec[gi] : 0.0, gb = i0 + 1 < n ? (double)gdec[gi + NV] : 0.0;
    double incl = ga + gb;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const double y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    double excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = 0.0;
    const double G0 = excl + ga, G1 = G0 + gb;
    gd[i0] = G0;
    gd[i0 + 1] = G1;
    bt[i0] = i0 < n ? beta[gi] : 0.f;  // padding: g = 0 (no decay), beta = 0 (no write)
    bt[i0 + 1] = i0 + 1 < n ? beta[gi + NV] : 0.f;
    eg[i0] = (float)exp(G0);
    eg[i0 + 1] = (float)exp(G1);
  }
  cp_wait0();
  __syncthreads();
  const double Glast = gd[CH - 1];  // = G_{n-1}: padding adds 0
  // l2 norms; q, k scaled and rounded to tf32 in place; the per-token scales
  for (int i = warp; i < CH; i += NT / 32) {
#if TC == 4
    // the raw q, k row in bf16 for gdn_chunk_h / gdn_chunk_o (one CTA of each key head's group writes it), read by
    // the warp that scales the row in place below, before it does (__syncwarp)
    if (h % (NV / NK) == 0 && i < n) {
      u16* qr = ws_qk + (size_t)(t0 + i) * 2 * NK * DK + kh * DK;
      for (int d2 = 2 * lane; d2 < DK; d2 += 64) {
        *(u32*)(qr + d2) = pack_bf16(qv[i * PKS + d2], qv[i * PKS + d2 + 1]);
        *(u32*)(qr + NK * DK + d2) = pack_bf16(ks[i * PKS + d2], ks[i * PKS + d2 + 1]);
      }
    }
    __syncwarp();
#endif
    float sq = 0.f, sk = 0.f;
    for (int d = lane; d < DK; d += 32) {
      const float qx = qv[i * PKS + d], kx = ks[i * PKS + d];
      sq += qx * qx;
      sk += kx * kx;
    }
    for (int o = 16; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    const float a = 1.f / sqrtf(sq + 1e-6f) / sqrtf((float)DK), b = 1.f / sqrtf(sk + 1e-6f);
    for (int d = lane; d < DK; d += 32) {
      qv[i * PKS + d] = rnd_tf32(qv[i * PKS + d] * a);
      ks[i * PKS + d] = rnd_tf32(ks[i * PKS + d] * b);
    }
    if (lane == 0 && i < n) {
      float4 v;
      v.x = a * eg[i];
      v.y = b * (float)exp(Glast - gd[i]);
      v.z = (float)exp(Glast);
      v.w = 0.f;
      *(float4*)(ws_s + ((size_t)(t0 + i) * NV + h) * 4) = v;
    }
  }
  __syncthreads();

  // A and Aqk on tensor cores (as build 1, fragments by ldmatrix): warp w owns rows 16 (w & 3) .. +15 and
  // columns 32 (w >> 2) .. +31 (4 n-tiles) of both 64 x 64 products; K^T is the B operand (ks is [n][k]).
  {
    const int mt = warp & 3, nq = warp >> 2;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int r = 0; r < 4; ++r) kk[a][r] = qk[a][r] = 0.f;
#pragma unroll 2
    for (int d = 0; d < DK; d += 8) {
      u32 ka[4], qa[4], b01[4], b23[4];
      ldsm_a(ka, ks + 16 * mt * PKS + d, PKS, lane);
      ldsm_a(qa, qv + 16 * mt * PKS + d, PKS, lane);
      ldsm_b2(b01, ks + 32 * nq * PKS + d, PKS, lane);
      ldsm_b2(b23, ks + (32 * nq + 16) * PKS + d, PKS, lane);
      mma_tf32(kk[0], ka[0], ka[1], ka[2], ka[3], b01[0], b01[1]);
      mma_tf32(qk[0], qa[0], qa[1], qa[2], qa[3], b01[0], b01[1]);
      mma_tf32(kk[1], ka[0], ka[1], ka[2], ka[3], b01[2], b01[3]);
      mma_tf32(qk[1], qa[0], qa[1], qa[2], qa[3], b01[2], b01[3]);
      mma_tf32(kk[2], ka[0], ka[1], ka[2], ka[3], b23[0], b23[1]);
      mma_tf32(qk[2], qa[0], qa[1], qa[2], qa[3], b23[0], b23[1]);
      mma_tf32(kk[3], ka[0], ka[1], ka[2], ka[3], b23[2], b23[3]);
      mma_tf32(qk[3], qa[0], qa[1], qa[2], qa[3], b23[2], b23[3]);
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = 16 * mt + g + 8 * hf, j = 32 * nq + 8 * nt + 2 * t4;
        const double gi = gd[i];
        const float d0 = j <= i ? expf((float)(gi - gd[j])) : 0.f;  // exponent <= 0: never overflows
        const float d1 = j + 1 <= i ? expf((float)(gi - gd[j + 1])) : 0.f;
        am[i * PAS + j] = j < i ? bt[i] * kk[nt][2 * hf] * d0 : 0.f;
        am[i * PAS + j + 1] = j + 1 < i ? bt[i] * kk[nt][2 * hf + 1] * d1 : 0.f;
        if (i < n) {
#if TC == 4
          *(u32*)((u16*)ws_a + ((size_t)(t0 + i) * NV + h) * CH + j) =
              pack_bf16(qk[nt][2 * hf] * d0, qk[nt][2 * hf + 1] * d1);
#else
          *(float2*)(ws_a + ((size_t)(t0 + i) * NV + h) * CH + j) =
              make_float2(rnd_tf32(qk[nt][2 * hf] * d0), rnd_tf32(qk[nt][2 * hf + 1] * d1));
#endif
        }
      }
  }
  __syncthreads();  // q reads done (qv free for v), A complete

  // raw v rows into qv (stride PVS; rows >= n and columns DV .. DVP-1 zero), landing during the inverse
  for (int e = tid; e < CH * (DVP / 4); e += NT) {
    const int i = e / (DVP / 4), q4 = (e % (DVP / 4)) * 4;
    const bool ok = i < n && q4 < DV;
    cp16(qv + i * PVS + q4, ok ? x + (size_t)(t0 + i) * C + 2 * NK * DK + h * DV + q4 : x, ok);
  }
  cp_commit();

  // T = (I + A)^-1, level 0: the diagonal 16 x 16 blocks, thread = (block b, column cc), forward
  // substitution on the identity column: X_r = delta_{r,cc} - sum_{m<r} A_rm X_m (zeros above cc).
  if (tid < CH) {
    const int b = tid >> 4, cc = tid & 15;
    const float* ab = am + 16 * b * PAS + 16 * b;
    float X[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float acc = r == cc ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < r; ++m) acc -= ab[r * PAS + m] * X[m];
      X[r] = acc;
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) tm[(16 * b + r) * PAS + 16 * b + cc] = X[r];
  }
  __syncthreads();
  // levels d = 1..3: T_ij = -T_ii P, P = sum_{k=j}^{i-1} A_ik T_kj (j = i - d), thread = element (r, cc) of
  // every block of the level; P goes to the unused upper block (j, i) of tm.
  {
    const int r = tid >> 4, cc = tid & 15;
#pragma unroll
    for (int d = 1; d < 4; ++d) {
#pragma unroll
      for (int i = d; i < 4; ++i) {
        const int j = i - d;
        float p = 0.f;
#pragma unroll
        for (int k = j; k < i; ++k) {
          const float* ar = am + (16 * i + r) * PAS + 16 * k;
          const float* tc = tm + 16 * k * PAS + 16 * j + cc;
#pragma unroll
          for (int m = 0; m < 16; ++m) p += ar[m] * tc[m * PAS];
        }
        tm[(16 * j + r) * PAS + 16 * i + cc] = p;
      }
      __syncthreads();
#pragma unroll
      for (int i = d; i < 4; ++i) {
        const int j = i - d;
        const float* tr = tm + (16 * i + r) * PAS + 16 * i;
        const float* pc = tm + 16 * j * PAS + 16 * i + cc;
        float t = 0.f;
#pragma unroll
        for (int m = 0; m < 16; ++m) t += tr[m] * pc[m * PAS];
        tm[(16 * i + r) * PAS + 16 * j + cc] = -t;
      }
      __syncthreads();
    }
  }
  // the two A operands: tm <- tf32(T diag(beta)), am <- tf32(T diag(beta e^G)) (blocks on / below the diagonal)
  for (int e = tid; e < CH * CH; e += NT) {
    const int i = e >> 6, j = e & 63;
    if ((j >> 4) <= (i >> 4)) {
      const float t = tm[i * PAS + j];
      tm[i * PAS + j] = rnd_tf32(t * bt[j]);
      am[i * PAS + j] = rnd_tf32(t * (bt[j] * eg[j]));
    }
  }
  cp_wait0();
  __syncthreads();  // v landed, both operands complete

  // u = Tu v, w = Tw k: groups of 4 n-tiles (32 columns) of [u | w], all 64 rows (4 m-tiles, k-blocks <= m-tile:
  // T is block lower triangular) per warp.
  constexpr int NTU = DVP / 8, NTW = DK / 8, NGU = (NTU + 3) / 4, NGW = (NTW + 3) / 4;
  for (int grp = warp; grp < NGU + NGW; grp += NT / 32) {
    const bool isw = grp >= NGU;
    const int nt0 = isw ? 4 * (grp - NGU) : 4 * grp, ntn = isw ? NTW : NTU;
    const float* Am = isw ? am : tm;
    const float* Bm = isw ? ks : qv;
    const int bst = isw ? PKS : PVS;
    float acc[4][4][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mt][q][r] = 0.f;
#pragma unroll
    for (int kb = 0; kb < 4; ++kb)
#pragma unroll
      for (int k8 = 0; k8 < 16; k8 += 8) {
        const int kk = 16 * kb + k8;
        u32 b0[4], b1[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          b0[q] = b1[q] = 0u;
          if (nt0 + q < ntn) {
            const float* br = Bm + (kk + t4) * bst + 8 * (nt0 + q) + g;
            b0[q] = tf32(br[0]);
            b1[q] = tf32(br[4 * bst]);
          }
        }
#pragma unroll
        for (int mt = kb; mt < 4; ++mt) {
          u32 a[4];
          ldsm_a(a, Am + 16 * mt * PAS + kk, PAS, lane);
#pragma unroll
          for (int q = 0; q < 4; ++q)
            if (nt0 + q < ntn) mma_tf32(acc[mt][q], a[0], a[1], a[2], a[3], b0[q], b1[q]);
        }
      }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = 16 * mt + g + 8 * hf, col = 8 * (nt0 + q) + 2 * t4;
          if (i < n && nt0 + q < ntn) {
            if (isw)
#if TC == 4
              *(u32*)((u16*)ws_w + ((size_t)(t0 + i) * NV + h) * DK + col) =
                  pack_bf16(acc[mt][q][2 * hf], acc[mt][q][2 * hf + 1]);
#else
              *(float2*)(ws_w + ((size_t)(t0 + i) * NV + h) * DK + col) =
                  make_float2(rnd_tf32(acc[mt][q][2 * hf]), rnd_tf32(acc[mt][q][2 * hf + 1]));
#endif
            else if (col < DV)
              *(float2*)(ws_u + ((size_t)(t0 + i) * NV + h) * DV + col) =
                  make_float2(acc[mt][q][2 * hf], acc[mt][q][2 * hf + 1]);
          }
        }
  }
}
#else  // TC < 2

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

#endif  // TC < 2

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
// TC=3 build: 64 value columns per CTA, S^T / V^T / (sk V)^T stored tf32-rounded as [n][k] (ldmatrix B fragments).
#define BW 64         // value columns per state CTA of build 3
#define SST (DK + 4)  // S^T rows [BW][SST] (B operand [n][k] by ldmatrix: SST % 32 == 4 when DK % 32 == 0)
#define UST (BW + 8)  // U rows [CH][UST] (read in the C fragment layout)
#define VTS (CH + 4)  // V^T, (sk V)^T rows [BW][VTS] (B operands [n][k] by ldmatrix)
#define STATE_FLOATS_TC3 (BW * SST + 2 * CH * WST + CH * KST + CH * AST + CH * UST + 2 * BW * VTS + 2 * CH * 4)
#define MTC ((DK / 16 + 7) / 8)  // 16-row state tiles per warp in step c (tensor-core builds)
#if TC
// The tensor-core state passes' final write-back: st[m][nt][r] = S[16 (warp + 8 m) + g + 8 (r >> 1)]
// [col0 + 8 nt + 2 t4 + (r & 1)] (step c's C layout, NTL n-tiles) into the slot's state S (columns < DV).
template <int NTL>
__device__ __forceinline__ void store_state(float* __restrict__ St, const float (&st)[MTC][NTL][4], int col0,
                                            int warp, int g, int t4) {
#pragma unroll
  for (int m = 0; m < MTC; ++m) {
    const int tile = warp + 8 * m;
    if (tile < DK / 16) {
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int d = 16 * tile + g + 8 * (r >> 1), col = col0 + 8 * nt + 2 * t4 + (r & 1);
          if (col < DV) St[(size_t)d * DV + col] = st[m][nt][r];
        }
    }
  }
}
#endif
// TC=4 build (bf16 operands): W, K [2][64][HKS] bf16, U [2][64][HUS] float32, sc [2][64][4], S [DK][HSS] and
// (sk V) [64][HSS] bf16 (gdn_chunk_h); Q [64][HKS], H [DK][HOS], Aqk [64][HAS], V [64][HOS] bf16 (gdn_chunk_o).
// Row strides are 16 bytes mod 128 (ldmatrix rows conflict-free) and U rows 8 floats mod 32 (float2 C-layout).
#define HB 32          // value columns per gdn_chunk_h CTA (16-column CTAs, 256 of them for one 8192-token prompt of
                       // Qwen3.5-35B-A3B, were measured slower on the H200: 540 vs 296 us, each reloads all of W, K)
#define HNT (HB / 8)   // n-tiles of the state per warp in step c (step a: two per warp, the CTA's columns halved)
#define HKS (DK + 8)   // W, K, Q rows (bf16)
#define HUS (HB + 8)   // U rows (float32)
#define HSS (HB + 8)   // S, sk V rows (bf16)
#define HOS (DV + 8)   // H, V rows of gdn_chunk_o (bf16)
#define HAS (CH + 8)   // Aqk rows (bf16)
#define H_SMEM (2 * (4 * CH * HKS + 4 * CH * HUS + 4 * CH * 4 + DK * HSS + CH * HSS))
#define O_SMEM (2 * (CH * HKS + DK * HOS + CH * HAS + CH * HOS) + 4 * CH * 4)
#if TC == 4
#define STATE_SMEM H_SMEM
#elif TC == 3
#define STATE_SMEM (STATE_FLOATS_TC3 * 4)
#elif TC
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

#elif TC < 3
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
#if TC == 2  // Q S moved into step a: Q travels with W
      for (int e = tid; e < CH * (DK / 4); e += NT) {
        const int i = e / (DK / 4), q4 = (e % (DK / 4)) * 4;
        const bool ok = i < n;
        cp16(qm + i * WST + q4, ok ? x + (size_t)(t0 + i) * C + kh * DK + q4 : x, ok);
      }
#endif
    }
    cp_commit();  // always a group (possibly empty): the wait_group 2 count stays exact
  };
  auto issue_qa = [&](int cc) {
    if (cc < nc) {
      const int t0 = start + cc * CH, n = min(CH, T_len - cc * CH);
#if TC == 2
      // Aqk: only the 16-column blocks on / below each row's diagonal block (all that step b reads)
      for (int e = tid; e < CH * (CH / 4); e += NT) {
        const int i = e / (CH / 4), q4 = (e % (CH / 4)) * 4;
        const bool ok = i < n;
        if (q4 < 16 * ((i >> 4) + 1))
          cp16(am + i * AST + q4, ok ? ws_a + ((size_t)(t0 + i) * NV + h) * CH + q4 : ws_a, ok);
      }
#else
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
#endif
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

    // ---- step a: V = U - W S, Vk = sk V (build 2: and Q S, sharing the S fragments)
    cp_wait2();
    __syncthreads();  // {W, U, sc} of chunk c landed for every thread; ss holds the state of chunk c
#if TC == 2
    float accq[2][4];
#endif
    {
      float acc[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = 0.f;
#if TC == 2
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) accq[nt][r] = 0.f;
#pragma unroll 4
      for (int kk = 0; kk < DK; kk += 8) {
        u32 wa[4], qa[4];
        ldsm_a(wa, wm + 16 * mt * WST + kk, WST, lane);  // W: stored tf32-rounded by the prep
        ldsm_a(qa, qm + 16 * mt * WST + kk, WST, lane);  // Q: raw x
#pragma unroll
        for (int r = 0; r < 4; ++r) qa[r] = tf32(__uint_as_float(qa[r]));
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* br = ss + (kk + t4) * VST + 16 * nh + 8 * nt + g;
          const u32 b0 = tf32(br[0]), b1 = tf32(br[4 * VST]);
          mma_tf32(acc[nt], wa[0], wa[1], wa[2], wa[3], b0, b1);
          mma_tf32(accq[nt], qa[0], qa[1], qa[2], qa[3], b0, b1);
        }
      }
#else
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
#endif
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
    __syncthreads();  // {Q, Aqk} of chunk c landed (build 2: {Aqk})
#if TC == 2
    {
      float acv[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acv[nt][r] = 0.f;
      for (int kk = 0; kk < 16 * (mt + 1); kk += 8) {  // Aqk[i][j] = 0 for j > i
        u32 a[4];
        ldsm_a(a, am + 16 * mt * AST + kk, AST, lane);  // stored tf32-rounded by the prep
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* br = vm + (kk + t4) * VST + 16 * nh + 8 * nt + g;
          mma_tf32(acv[nt], a[0], a[1], a[2], a[3], tf32(br[0]), tf32(br[4 * VST]));
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 16 * mt + g + 8 * (r >> 1), col = col0 + 16 * nh + 8 * nt + 2 * t4 + (r & 1);
          if (i < n && col < DV)
            store_act(out + (size_t)(t0 + i) * NV * DV + (size_t)h * DV + col, sc[i * 4] * accq[nt][r] + acv[nt][r]);
        }
    }
#else
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
#endif
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

  store_state(St, st, col0, warp, g, t4);
}
#elif TC == 3
// ------------------------------------------------------------------------------------------------
// Kernel 2, tf32 build 3 (precision "tf32"): the numerics of build 2 (same operands rounded the same way, same
// k order in every accumulator chain) in a CTA of BW = 64 value columns (grid (ceil(DV/64), NV, S)): W, Q and
// K, which every column CTA of a head loads whole, now serve 64 columns instead of 32, halving the L2 -> SM
// traffic of the pass (build 2 moves ~115 KB per CTA per chunk: 14.7 MB per step at 128 CTAs, ~2.5 TB/s at
// the measured 5.9 us per step, at batch 1 and at 8 x 4096 alike), with twice the independent mma per warp
// (latency hiding). Per chunk, 8 warps:
//   a: V = U - W S and Q S   warp w: rows 16 (w & 3) .. +15, columns 32 (w >> 2) .. +31 (4 n-tiles), k = DK;
//      V^T and (sk V)^T are written tf32-rounded as [column][token] rows (ldmatrix B fragments for b and c)
//   b: o = sq (Q S) + Aqk V   same tile, k < 16 ((w & 3) + 1) (Aqk lower triangular); o stored in pairs
//   c: S = e^{G_last} S + K^T Vk   warp w: state rows 16 (w + 8 m) .. +15 (m < MTC), all 64 columns (8 n-tiles);
//      K^T read from K [64][KST] as the A operand (scalar loads: a0 = km[t][g]); S^T then rewritten
//      tf32-rounded into sT [64][SST] (the B operand of step a, by ldmatrix)
// Rounding S, V, sk V once when they are written instead of at every fragment read (build 2) gives the same
// bits. Three cp.async groups stay in flight as in build 2 ({W, U, sc, Q} after step a, {Aqk} after step b,
// {K} after step c), but each step ends with one wait_group 1 + barrier that both frees the stage it read and
// publishes the next step's group (3 barriers per chunk instead of 6).
// Shared memory (floats): sT [64][SST], wm/qm [64][WST], km [64][KST], am [64][AST], um [64][UST],
// vT/vkT [64][VTS], sc [2][64][4] (STATE_FLOATS_TC3: 208,896 bytes at DK = 128).
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
__device__ __forceinline__ void store_act2(float* p, float a, float b) { *(float2*)p = make_float2(a, b); }
__device__ __forceinline__ void store_act2(u16* p, float a, float b) {
  store_act(p, a);
  store_act(p + 1, b);
}

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
  const int col0 = blockIdx.x * BW;
  const int kh = h / (NV / NK);
  const int C = 2 * NK * DK + NV * DV;
  const int start = seq_start[s], T_len = seq_start[s + 1] - start;
  const int nc = (T_len + CH - 1) / CH;
  float* St = rec + (long long)slots[s] * rec_row + (long long)h * DK * DV;

  float* sT = sm;               // [BW][SST]  tf32(S)^T
  float* wm = sT + BW * SST;    // [CH][WST]
  float* qm = wm + CH * WST;    // [CH][WST]
  float* km = qm + CH * WST;    // [CH][KST]
  float* am = km + CH * KST;    // [CH][AST]
  float* um = am + CH * AST;    // [CH][UST]
  float* vT = um + CH * UST;    // [BW][VTS]  tf32(V)^T
  float* vkT = vT + BW * VTS;   // [BW][VTS]  tf32(sk V)^T
  float* scm = vkT + BW * VTS;  // [2][CH][4]

  // Stage issuers (as build 2). Row i of chunk cc is token start + CH*cc + i; rows >= n and columns >= DV are
  // zero-filled; the pad columns of each row are never read.
  auto issue_wu = [&](int cc) {
    if (cc < nc) {
      const int t0 = start + cc * CH, n = min(CH, T_len - cc * CH);
      for (int e = tid; e < CH * (DK / 4); e += NT) {
        const int i = e / (DK / 4), q4 = (e % (DK / 4)) * 4;
        const bool ok = i < n;
        cp16(wm + i * WST + q4, ok ? ws_w + ((size_t)(t0 + i) * NV + h) * DK + q4 : ws_w, ok);
        cp16(qm + i * WST + q4, ok ? x + (size_t)(t0 + i) * C + kh * DK + q4 : x, ok);
      }
      for (int e = tid; e < CH * (BW / 4); e += NT) {
        const int i = e / (BW / 4), q4 = (e % (BW / 4)) * 4;
        const bool ok = i < n && col0 + q4 < DV;
        cp16(um + i * UST + q4, ok ? ws_u + ((size_t)(t0 + i) * NV + h) * DV + col0 + q4 : ws_u, ok);
      }
      for (int i = tid; i < CH; i += NT) {
        const bool ok = i < n;
        cp16(scm + ((cc & 1) * CH + i) * 4, ok ? ws_s + ((size_t)(t0 + i) * NV + h) * 4 : ws_s, ok);
      }
    }
    cp_commit();  // always a group (possibly empty): the wait_group counts stay exact
  };
  auto issue_qa = [&](int cc) {
    if (cc < nc) {
      const int t0 = start + cc * CH, n = min(CH, T_len - cc * CH);
      // Aqk: only the 16-column blocks on / below each row's diagonal block (all that step b reads)
      for (int e = tid; e < CH * (CH / 4); e += NT) {
        const int i = e / (CH / 4), q4 = (e % (CH / 4)) * 4;
        const bool ok = i < n;
        if (q4 < 16 * ((i >> 4) + 1))
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

  // state: st[m][nt][r] = S[16 (warp + 8m) + g + 8 (r >> 1)][col0 + 8 nt + 2 t4 + (r & 1)] (step c's C layout,
  // the float32 master copy); columns >= DV stay zero, tiles past DK do not exist (warp-uniform).
  float st[MTC][8][4];
#pragma unroll
  for (int m = 0; m < MTC; ++m)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int tile = warp + 8 * m, d = 16 * tile + g + 8 * (r >> 1), n = 8 * nt + 2 * t4 + (r & 1);
        const bool ok = tile < DK / 16;
        st[m][nt][r] = (ok && col0 + n < DV) ? St[(size_t)d * DV + col0 + n] : 0.f;
        if (ok) sT[n * SST + d] = rnd_tf32(st[m][nt][r]);
      }
  cp_wait2();
  __syncthreads();  // {W, Q, U, sc} of chunk 0 landed; sT complete

  for (int c = 0; c < nc; ++c) {
    const int t0 = start + c * CH, n = min(CH, T_len - c * CH);
    const float* sc = scm + (c & 1) * CH * 4;

    // ---- step a: V = U - W S, Q S (shared S fragments); V^T, (sk V)^T to shared memory
    float accq[4][4];
    {
      float acc[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = accq[nt][r] = 0.f;
#pragma unroll 2
      for (int kk = 0; kk < DK; kk += 8) {
        u32 wa[4], qa[4], b01[4], b23[4];
        ldsm_a(wa, wm + 16 * mt * WST + kk, WST, lane);  // W: stored tf32-rounded by the prep
        ldsm_a(qa, qm + 16 * mt * WST + kk, WST, lane);  // Q: raw x
#pragma unroll
        for (int r = 0; r < 4; ++r) qa[r] = tf32(__uint_as_float(qa[r]));
        ldsm_b2(b01, sT + 32 * nh * SST + kk, SST, lane);         // n-tiles 0, 1
        ldsm_b2(b23, sT + (32 * nh + 16) * SST + kk, SST, lane);  // n-tiles 2, 3
        mma_tf32(acc[0], wa[0], wa[1], wa[2], wa[3], b01[0], b01[1]);
        mma_tf32(accq[0], qa[0], qa[1], qa[2], qa[3], b01[0], b01[1]);
        mma_tf32(acc[1], wa[0], wa[1], wa[2], wa[3], b01[2], b01[3]);
        mma_tf32(accq[1], qa[0], qa[1], qa[2], qa[3], b01[2], b01[3]);
        mma_tf32(acc[2], wa[0], wa[1], wa[2], wa[3], b23[0], b23[1]);
        mma_tf32(accq[2], qa[0], qa[1], qa[2], qa[3], b23[0], b23[1]);
        mma_tf32(acc[3], wa[0], wa[1], wa[2], wa[3], b23[2], b23[3]);
        mma_tf32(accq[3], qa[0], qa[1], qa[2], qa[3], b23[2], b23[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = 16 * mt + g + 8 * hf, j = 32 * nh + 8 * nt + 2 * t4;
          const float2 uu = *(const float2*)(um + i * UST + j);
          const float v0 = uu.x - acc[nt][2 * hf], v1 = uu.y - acc[nt][2 * hf + 1], sk = sc[i * 4 + 1];
          vT[j * VTS + i] = rnd_tf32(v0);
          vT[(j + 1) * VTS + i] = rnd_tf32(v1);
          vkT[j * VTS + i] = rnd_tf32(sk * v0);
          vkT[(j + 1) * VTS + i] = rnd_tf32(sk * v1);
        }
    }
    cp_wait1();       // pending were {Aqk}(c), {K}(c): {Aqk}(c) landed
    __syncthreads();  // wm, qm, um free; vT, vkT and Aqk(c) visible
    issue_wu(c + 1);

    // ---- step b: o = sq (Q S) + Aqk V
    {
      float acv[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acv[nt][r] = 0.f;
      for (int kk = 0; kk < 16 * (mt + 1); kk += 8) {  // Aqk[i][j] = 0 for j > i
        u32 a[4], b01[4], b23[4];
        ldsm_a(a, am + 16 * mt * AST + kk, AST, lane);  // stored tf32-rounded by the prep
        ldsm_b2(b01, vT + 32 * nh * VTS + kk, VTS, lane);
        ldsm_b2(b23, vT + (32 * nh + 16) * VTS + kk, VTS, lane);
        mma_tf32(acv[0], a[0], a[1], a[2], a[3], b01[0], b01[1]);
        mma_tf32(acv[1], a[0], a[1], a[2], a[3], b01[2], b01[3]);
        mma_tf32(acv[2], a[0], a[1], a[2], a[3], b23[0], b23[1]);
        mma_tf32(acv[3], a[0], a[1], a[2], a[3], b23[2], b23[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = 16 * mt + g + 8 * hf, col = col0 + 32 * nh + 8 * nt + 2 * t4;  // even; DV % 4 == 0
          if (i < n && col < DV) {
            const float sq = sc[i * 4];
            store_act2(out + (size_t)(t0 + i) * NV * DV + (size_t)h * DV + col,
                       sq * accq[nt][2 * hf] + acv[nt][2 * hf], sq * accq[nt][2 * hf + 1] + acv[nt][2 * hf + 1]);
          }
        }
    }
    cp_wait1();       // pending were {K}(c), {W, Q, U, sc}(c+1): {K}(c) landed
    __syncthreads();  // am free; K(c) visible
    issue_qa(c + 1);

    // ---- step c: S = e^{G_last} S + K^T Vk
    {
      const float el = sc[2];  // row 0 always exists (n >= 1)
#pragma unroll
      for (int m = 0; m < MTC; ++m)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) st[m][nt][r] *= el;
#pragma unroll 2
      for (int kk = 0; kk < CH; kk += 8) {
        u32 b[4][4];
#pragma unroll
        for (int q = 0; q < 4; ++q) ldsm_b2(b[q], vkT + 16 * q * VTS + kk, VTS, lane);  // n-tiles 2q, 2q+1
#pragma unroll
        for (int m = 0; m < MTC; ++m) {
          const int tile = warp + 8 * m;
          if (tile < DK / 16) {
            const float* ar = km + (kk + t4) * KST + 16 * tile + g;  // A(d, i) = K[i][d]
            const u32 a0 = tf32(ar[0]), a1 = tf32(ar[8]), a2 = tf32(ar[4 * KST]), a3 = tf32(ar[4 * KST + 8]);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              mma_tf32(st[m][2 * q], a0, a1, a2, a3, b[q][0], b[q][1]);
              mma_tf32(st[m][2 * q + 1], a0, a1, a2, a3, b[q][2], b[q][3]);
            }
          }
        }
      }
#pragma unroll
      for (int m = 0; m < MTC; ++m) {
        const int tile = warp + 8 * m;
        if (tile < DK / 16) {
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r)
              sT[(8 * nt + 2 * t4 + (r & 1)) * SST + 16 * tile + g + 8 * (r >> 1)] = rnd_tf32(st[m][nt][r]);
        }
      }
    }
    cp_wait1();       // pending were {W, Q, U, sc}(c+1), {Aqk}(c+1): the first landed
    __syncthreads();  // km, vkT free; sT (the next chunk's state) and W, Q, U, sc of chunk c+1 visible
    issue_k(c + 1);
  }
  cp_wait0();  // the trailing (empty) groups

  store_state(St, st, col0, warp, g, t4);
}
#else  // TC == 4
// ------------------------------------------------------------------------------------------------
// Build 4 (precision "bf16"): the state pass split in two, as in flash-linear-attention's chunked kernels.
// gdn_chunk_h carries the state only: per chunk two products on bf16 tensor cores (mma.sync m16n8k16, float32
// accumulators, float32 master state in registers)
//   a: V = U - W S        warp w: rows 16 (w & 3) .. +15, columns 16 (w >> 2) .. +15 (2 n-tiles), k = DK
//   c: S = e^{G_last} S + K^T (sk V)   warp w: state rows 16 (w + 8 m) .. +15, all HB = 32 columns, k = 64
// and writes, for gdn_chunk_o, every chunk's starting state H_c (bf16) and V (bf16). gdn_chunk_o then forms
// o = sq (Q H_c) + Aqk V for every chunk in parallel (grid (chunks, NV, S)). Operands are bf16 (W, Aqk, V, S, sk V
// rounded to nearest even once, q / k raw rows in bf16 written by the prep); ~2.3e-3 relative to float64.
// Workspace (bytes, N = token capacity, CB = chunk capacity N / 64 + S):
//   w bf16 [N, NV, DK] | u f32 [N, NV, DV] | aqk bf16 [N, NV, 64] | sc f32 [N, NV, 4] | qk bf16 [N, 2, NK, DK]
//   | vn bf16 [N, NV, DV] | hb bf16 [CB, NV, DK, DV]
// The chunk c of sequence s is H slot (seq_start[s] + 64 c) / 64 + s: distinct for distinct chunks, < N / 64 + S.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// ldmatrix x4 of bf16 16 x 16 tiles (lane l names row l & 7 of matrix l >> 3):
//   A [m][k] row-major (non-trans): matrices (m 0-7, k 0-7) (m 8-15, k 0-7) (m 0-7, k 8-15) (m 8-15, k 8-15)
//     -> a0a1 a2a3 a4a5 a6a7; lane row m = (l & 7) + 8 ((l >> 3) & 1), column k = 8 (l >> 4).
//   A from [k][m] storage (A = stored^T, .trans): matrices (k 0-7, m 0-7) (k 0-7, m 8-15) (k 8-15, m 0-7)
//     (k 8-15, m 8-15); lane stored row k = (l & 7) + 8 (l >> 4), column m = 8 ((l >> 3) & 1).
//   B [k][n] row-major (.trans): two n-tiles, matrices (k 0-7, n 0-7) (k 8-15, n 0-7) (k 0-7, n 8-15)
//     (k 8-15, n 8-15) -> b0b1, b2b3 of n-tile 0 then of n-tile 1; lane row k = (l & 7) + 8 ((l >> 3) & 1),
//     column n = 8 (l >> 4).
// p points at the tile's (0, 0) element, st is the row stride in bf16 elements.
__device__ __forceinline__ void ldsm16_a(u32* a, const u16* p, int st, int lane) {
  const u16* q = p + ((lane & 7) + 8 * ((lane >> 3) & 1)) * st + 8 * (lane >> 4);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(smem_u32(q)) : "memory");
}
__device__ __forceinline__ void ldsm16_at(u32* a, const u16* p, int st, int lane) {
  const u16* q = p + ((lane & 7) + 8 * (lane >> 4)) * st + 8 * ((lane >> 3) & 1);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(smem_u32(q)) : "memory");
}
__device__ __forceinline__ void ldsm16_bt(u32* b, const u16* p, int st, int lane) {
  const u16* q = p + ((lane & 7) + 8 * ((lane >> 3) & 1)) * st + 8 * (lane >> 4);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(smem_u32(q)) : "memory");
}
__device__ __forceinline__ int h_slot(const int* seq_start, int s, int c) { return (seq_start[s] + CH * c) / CH + s; }

// Kernel 2 of build 4: grid (ceil(DV / HB), NV, S), 256 threads, H_SMEM bytes. Per chunk: one wait + barrier
// (chunk c landed everywhere, the previous step c done), the next chunk's loads issued, step a, barrier, step c.
extern "C" __global__ void __launch_bounds__(NT, 2) gdn_chunk_h(const int* __restrict__ seq_start,
                                                                const int* __restrict__ slots,
                                                                float* __restrict__ rec, long long rec_row,
                                                                const u16* __restrict__ ws_w,
                                                                const float* __restrict__ ws_u,
                                                                const float* __restrict__ ws_s,
                                                                const u16* __restrict__ ws_qk,
                                                                u16* __restrict__ ws_vn, u16* __restrict__ ws_hb,
                                                                int S, int NK, int NV) {
  extern __shared__ __align__(16) float sm[];
  const int h = blockIdx.y, s = blockIdx.z;
  if (s >= S || h >= NV) return;
  pdl_wait();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3, mt = warp & 3, nh = warp >> 2;
  const int col0 = blockIdx.x * HB;
  const int kh = h / (NV / NK);
  const int start = seq_start[s], T_len = seq_start[s + 1] - start;
  const int nc = (T_len + CH - 1) / CH;
  float* St = rec + (long long)slots[s] * rec_row + (long long)h * DK * DV;

  u16* wm = (u16*)sm;               // [2][CH][HKS]
  u16* km = wm + 2 * CH * HKS;      // [2][CH][HKS]
  float* um = (float*)(km + 2 * CH * HKS);  // [2][CH][HUS]
  float* scm = um + 2 * CH * HUS;   // [2][CH][4]
  u16* ss = (u16*)(scm + 2 * CH * 4);  // [DK][HSS]
  u16* vk = ss + DK * HSS;          // [CH][HSS]

  auto issue = [&](int cc) {
    if (cc < nc) {
      const int t0 = start + cc * CH, n = min(CH, T_len - cc * CH), b = cc & 1;
      for (int e = tid; e < CH * (DK / 8); e += NT) {
        const int i = e / (DK / 8), q8 = (e % (DK / 8)) * 8;
        const bool ok = i < n;
        cp16(wm + (b * CH + i) * HKS + q8, ok ? ws_w + ((size_t)(t0 + i) * NV + h) * DK + q8 : ws_w, ok);
        cp16(km + (b * CH + i) * HKS + q8,
              ok ? ws_qk + (size_t)(t0 + i) * 2 * NK * DK + NK * DK + kh * DK + q8 : ws_qk, ok);
      }
      for (int e = tid; e < CH * (HB / 4); e += NT) {
        const int i = e / (HB / 4), q4 = (e % (HB / 4)) * 4;
        const bool ok = i < n && col0 + q4 < DV;
        cp16(um + (b * CH + i) * HUS + q4, ok ? ws_u + ((size_t)(t0 + i) * NV + h) * DV + col0 + q4 : ws_u, ok);
      }
      for (int i = tid; i < CH; i += NT) {
        const bool ok = i < n;
        cp16(scm + (b * CH + i) * 4, ok ? ws_s + ((size_t)(t0 + i) * NV + h) * 4 : ws_s, ok);
      }
    }
    cp_commit();
  };

  issue(0);
  // state: st[m][nt][r] = S[16 (warp + 8 m) + g + 8 (r >> 1)][col0 + 8 nt + 2 t4 + (r & 1)]; columns >= DV zero
  float st[MTC][HNT][4];
  auto publish = [&](int cc) {  // S (bf16) into ss and, for gdn_chunk_o, into chunk cc's H slot
    u16* hb = ws_hb + ((size_t)h_slot(seq_start, s, cc) * NV + h) * DK * DV;
#pragma unroll
    for (int m = 0; m < MTC; ++m) {
      const int tile = warp + 8 * m;
      if (tile < DK / 16) {
#pragma unroll
        for (int nt = 0; nt < HNT; ++nt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int d = 16 * tile + g + 8 * hf, n = 8 * nt + 2 * t4;
            const u32 v = pack_bf16(st[m][nt][2 * hf], st[m][nt][2 * hf + 1]);
            *(u32*)(ss + d * HSS + n) = v;
            if (col0 + n < DV) *(u32*)(hb + (size_t)d * DV + col0 + n) = v;
          }
      }
    }
  };
#pragma unroll
  for (int m = 0; m < MTC; ++m)
#pragma unroll
    for (int nt = 0; nt < HNT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int tile = warp + 8 * m, d = 16 * tile + g + 8 * (r >> 1), n = 8 * nt + 2 * t4 + (r & 1);
        st[m][nt][r] = (tile < DK / 16 && col0 + n < DV) ? St[(size_t)d * DV + col0 + n] : 0.f;
      }
  publish(0);

  for (int c = 0; c < nc; ++c) {
    const int t0 = start + c * CH, n = min(CH, T_len - c * CH), b = c & 1;
    cp_wait0();
    __syncthreads();  // chunk c's W, K, U, sc and the state S_c visible; step c of chunk c-1 done everywhere
    issue(c + 1);
    const u16* wb = wm + b * CH * HKS;
    const u16* kb = km + b * CH * HKS;
    const float* ub = um + b * CH * HUS;
    const float* sc = scm + b * CH * 4;
    // ---- step a: V = U - W S (rows 16 mt .., columns 16 nh ..), V -> vn (bf16), sk V -> vk (bf16)
    {
      float acc[2][4];
#pragma unroll
      for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[q][r] = 0.f;
#pragma unroll
      for (int kk = 0; kk < DK; kk += 16) {
        u32 a[4], bf[4];
        ldsm16_a(a, wb + 16 * mt * HKS + kk, HKS, lane);
        ldsm16_bt(bf, ss + kk * HSS + 16 * nh, HSS, lane);
        mma_bf16(acc[0], a, bf[0], bf[1]);
        mma_bf16(acc[1], a, bf[2], bf[3]);
      }
#pragma unroll
      for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = 16 * mt + g + 8 * hf, n2 = 16 * nh + 8 * q + 2 * t4;
          const float2 uu = *(const float2*)(ub + i * HUS + n2);
          const float v0 = uu.x - acc[q][2 * hf], v1 = uu.y - acc[q][2 * hf + 1];
          const float sk = sc[i * 4 + 1];
          *(u32*)(vk + i * HSS + n2) = pack_bf16(sk * v0, sk * v1);
          if (i < n && col0 + n2 < DV)
            *(u32*)(ws_vn + ((size_t)(t0 + i) * NV + h) * DV + col0 + n2) = pack_bf16(v0, v1);
        }
    }
    __syncthreads();  // vk complete; every read of ss done
    // ---- step c: S = e^{G_last} S + K^T (sk V)
    {
      const float el = sc[2];  // row 0 always exists (n >= 1)
#pragma unroll
      for (int m = 0; m < MTC; ++m)
#pragma unroll
        for (int nt = 0; nt < HNT; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) st[m][nt][r] *= el;
#pragma unroll
      for (int kt = 0; kt < CH; kt += 16) {
        u32 bv[HNT / 2][4];
#pragma unroll
        for (int p = 0; p < HNT / 2; ++p) ldsm16_bt(bv[p], vk + kt * HSS + 16 * p, HSS, lane);
#pragma unroll
        for (int m = 0; m < MTC; ++m) {
          const int tile = warp + 8 * m;
          if (tile < DK / 16) {
            u32 a[4];
            ldsm16_at(a, kb + kt * HKS + 16 * tile, HKS, lane);
#pragma unroll
            for (int p = 0; p < HNT / 2; ++p) {
              mma_bf16(st[m][2 * p], a, bv[p][0], bv[p][1]);
              mma_bf16(st[m][2 * p + 1], a, bv[p][2], bv[p][3]);
            }
          }
        }
      }
    }
    if (c + 1 < nc) publish(c + 1);  // ss is free (barrier above); read after the next chunk's barrier
  }
  cp_wait0();  // the trailing (empty) group

  store_state(St, st, col0, warp, g, t4);
}

// Kernel 3 of build 4: grid (max chunks, NV, S), 256 threads, O_SMEM bytes. o = sq (Q H_c) + Aqk V for the 64 rows
// of one chunk of one value head: warp w rows 16 (w & 3) .., columns (DV / 2) (w >> 2) .. (DV / 16 n-tiles).
#define ONT (DV / 16)  // n-tiles per warp
extern "C" __global__ void __launch_bounds__(NT, 2) gdn_chunk_o(const int* __restrict__ seq_start,
                                                                const u16* __restrict__ ws_a,
                                                                const float* __restrict__ ws_s,
                                                                const u16* __restrict__ ws_qk,
                                                                const u16* __restrict__ ws_vn,
                                                                const u16* __restrict__ ws_hb,
                                                                T* __restrict__ out, int S, int NK, int NV) {
  extern __shared__ __align__(16) float sm[];
  const int c = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
  if (s >= S || h >= NV) return;
  pdl_wait();
  const int start = seq_start[s], T_len = seq_start[s + 1] - start;
  if (c * CH >= T_len) return;
  const int t0 = start + c * CH, n = min(CH, T_len - c * CH);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3, mt = warp & 3, nh = warp >> 2;
  const int kh = h / (NV / NK);

  u16* qm = (u16*)sm;          // [CH][HKS]
  u16* hm = qm + CH * HKS;     // [DK][HOS]
  u16* am = hm + DK * HOS;     // [CH][HAS]
  u16* vm = am + CH * HAS;     // [CH][HOS]
  float* scm = (float*)(vm + CH * HOS);  // [CH][4]
  const u16* hb = ws_hb + ((size_t)h_slot(seq_start, s, c) * NV + h) * DK * DV;
  for (int e = tid; e < CH * (DK / 8); e += NT) {
    const int i = e / (DK / 8), q8 = (e % (DK / 8)) * 8;
    const bool ok = i < n;
    cp16(qm + i * HKS + q8, ok ? ws_qk + (size_t)(t0 + i) * 2 * NK * DK + kh * DK + q8 : ws_qk, ok);
  }
  for (int e = tid; e < DK * (DV / 8); e += NT) {
    const int d = e / (DV / 8), q8 = (e % (DV / 8)) * 8;
    cp16(hm + d * HOS + q8, hb + (size_t)d * DV + q8, true);
  }
  for (int e = tid; e < CH * (CH / 8); e += NT) {
    const int i = e / (CH / 8), q8 = (e % (CH / 8)) * 8;
    const bool ok = i < n;
    cp16(am + i * HAS + q8, ok ? ws_a + ((size_t)(t0 + i) * NV + h) * CH + q8 : ws_a, ok);
  }
  for (int e = tid; e < CH * (DV / 8); e += NT) {
    const int i = e / (DV / 8), q8 = (e % (DV / 8)) * 8;
    const bool ok = i < n;
    cp16(vm + i * HOS + q8, ok ? ws_vn + ((size_t)(t0 + i) * NV + h) * DV + q8 : ws_vn, ok);
  }
  for (int i = tid; i < CH; i += NT) {
    const bool ok = i < n;
    cp16(scm + i * 4, ok ? ws_s + ((size_t)(t0 + i) * NV + h) * 4 : ws_s, ok);
  }
  cp_commit();
  cp_wait0();
  __syncthreads();

  const int n0 = (DV / 2) * nh;
  float acc[ONT][4];
#pragma unroll
  for (int q = 0; q < ONT; ++q)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[q][r] = 0.f;
#pragma unroll 2
  for (int kk = 0; kk < DK; kk += 16) {
    u32 a[4];
    ldsm16_a(a, qm + 16 * mt * HKS + kk, HKS, lane);
#pragma unroll
    for (int q = 0; q < ONT; q += 2) {
      u32 bf[4];
      ldsm16_bt(bf, hm + kk * HOS + n0 + 8 * q, HOS, lane);
      mma_bf16(acc[q], a, bf[0], bf[1]);
      mma_bf16(acc[q + 1], a, bf[2], bf[3]);
    }
  }
  const float sq0 = scm[(16 * mt + g) * 4], sq1 = scm[(16 * mt + g + 8) * 4];
#pragma unroll
  for (int q = 0; q < ONT; ++q) {
    acc[q][0] *= sq0;
    acc[q][1] *= sq0;
    acc[q][2] *= sq1;
    acc[q][3] *= sq1;
  }
  for (int kk = 0; kk <= 16 * mt; kk += 16) {  // Aqk is lower triangular: blocks past the diagonal are zero
    u32 a[4];
    ldsm16_a(a, am + 16 * mt * HAS + kk, HAS, lane);
#pragma unroll
    for (int q = 0; q < ONT; q += 2) {
      u32 bf[4];
      ldsm16_bt(bf, vm + kk * HOS + n0 + 8 * q, HOS, lane);
      mma_bf16(acc[q], a, bf[0], bf[1]);
      mma_bf16(acc[q + 1], a, bf[2], bf[3]);
    }
  }
#pragma unroll
  for (int q = 0; q < ONT; ++q)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = 16 * mt + g + 8 * hf, col = n0 + 8 * q + 2 * t4;
      if (i < n) {
        T* op = out + (size_t)(t0 + i) * NV * DV + (size_t)h * DV + col;
        store_act(op, acc[q][2 * hf]);
        store_act(op + 1, acc[q][2 * hf + 1]);
      }
    }
}
#endif  // TC
