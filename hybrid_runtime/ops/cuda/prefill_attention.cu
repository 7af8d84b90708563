// Causal prefill attention over the paged KV cache (FlashAttention-2 style, mma.sync tensor cores).
//
// Compiled by NVRTC (hybrid_runtime/cuda/kernels.py, host side hybrid_runtime/cuda/prefill_attention.py) once
// per variant with
//   -DHD=<head_dim, multiple of 16, <= 256>  -DDT=<1 float16 | 2 bfloat16>  -DG=<GQA group Hq / Hkv, 1..BM>
//   -DMT=<16-row m-tiles per warp: 1 or 2>   -DNWARPS=<warps per CTA: 4 or 8>   -DSTAGES=<K/V buffers: 1 or 2>
// No CUDA headers (only prefill_attention.cuh, helpers shared with the wgmma kernel), so it compiles the same
// with any NVRTC (on a CPU too). float32 is not supported (tensor cores only): the host refuses it.
//
// Semantics (varlen; several sequences in one launch):
//   q   [n_tokens, Hq, HD] T, packed: sequence s owns rows [cu[s], cu[s+1]); its token i is at absolute
//       position start_pos[s] + i.
//   k,v [num_pages, page_size, Hkv, HD] T: key/value of absolute position p of sequence s is row
//       (table_s[p / page_size] * page_size + p % page_size) * Hkv + kvh. Every key 0 .. start_pos + len - 1
//       is already in the pools (the chunk's own tokens were written before the launch).
//   tables int32: table_s = tables + s * table_stride.
//   out [n_tokens, Hq, HD] float32, dense. Query at position p attends keys 0..p (causal), softmax scale
//       1/sqrt(HD) given as scale_log2 = log2(e)/sqrt(HD); fp32 accumulation, online softmax (log2 domain).
//   work int4 [n_work]: one CTA tile each = (sequence, first packed q row, tokens in the tile (1..TOKB),
//       absolute position of the first token). Built on the host (plan_prefill), heaviest tiles first.
// Grid (n_work, Hkv, 1), NWARPS * 32 threads, (BM + 2 * BN * STAGES) * HD * 2 bytes of dynamic shared memory.
//
// Tile: BM = NWARPS * 16 * MT rows x BN = 64 keys. The GQA group is packed into the rows, row = token * G +
// head_in_group (TOKB = BM / G tokens; rows >= TOKB * G are padding), so each K/V tile read from the pool
// serves all G query heads of the kv head. Warp w owns rows [w * 16 * MT, (w + 1) * 16 * MT).
//   S = Q K^T   A = Q (shared, ldmatrix, re-read every key tile), B = K rows (ldmatrix)
//   O += P V    A = P (the S accumulators, rounded to T, kept in registers), B = V (ldmatrix.trans)
// Key tiles are visited from 0 upwards (tile 0 gives every row a finite max at once); only tiles that reach
// past the first query's position are masked; a warp whose rows all precede a tile skips its math. K and V
// are single-buffered (STAGES 1, FA2's schedule): V_j is copied while S_j is computed, K_{j+1} while O += P V_j;
// two CTAs per SM (HD 256: 96 KB of shared memory each) fill each other's bubbles. STAGES 2 (the 8-warp,
// 128-row build): K/V tile j + 1 is copied into the other buffer while tile j is computed, one barrier per
// tile, and the page-table entries of tile j + 2 are read one tile ahead (HD 256: 192 KB, one CTA per SM).
// Each K/V tile copied then feeds 128 rows (16 tokens x 8 heads at G 8): half the L2 -> SM traffic and half
// the cp.async instructions per FLOP of the 64-row build. A row's arithmetic (key tiles in the same order, the
// same fragments and softmax) is the same in every build, so they give the same bits.
// Launched as a programmatic dependent (PDL, sm_90+) it waits for the previous kernel (griddepcontrol.wait)
// before touching global memory and lets its dependent be scheduled once its results are stored.

typedef unsigned short u16;
typedef unsigned int u32;

#ifndef HD
#error "HD (head_dim) must be defined"
#endif
#ifndef DT
#define DT 2
#endif
#ifndef G
#define G 1
#endif
#ifndef MT
#define MT 1
#endif
#ifndef NWARPS
#define NWARPS 4
#endif
#ifndef STAGES
#define STAGES 1
#endif

#if DT != 1 && DT != 2
#error "prefill attention supports float16 (DT=1) and bfloat16 (DT=2) only"
#endif
typedef u16 T;

#define NTHREADS (NWARPS * 32)
#define BM (NWARPS * 16 * MT)  // query rows (token x head) per CTA
#define BN 64                  // keys per tile
#define TOKB (BM / G)          // query tokens per CTA
#define RUSED (TOKB * G)       // rows in use (the rest is padding when G does not divide BM)
#define ROWB (HD * 2)          // bytes of one row (token x head) in shared memory
#define CPR (HD / 8)           // 16-byte chunks per row
#define NKS (HD / 16)          // k-steps of S = Q K^T == 16-dim pairs of O
#define NDT (HD / 8)           // 8-wide dim tiles of O
#define NNT (BN / 8)           // 8-wide key tiles of S
#define NGRP (BN / 16)         // 16-key groups of a tile (each inside one page: page_size % 16 == 0)
#define STAGE_BYTES (2 * BN * ROWB)  // one K tile then one V tile

static_assert(HD % 16 == 0 && HD >= 16 && HD <= 256, "HD must be a multiple of 16 in 16..256");
static_assert(G >= 1 && G <= BM, "G must be in 1..BM");
static_assert(MT == 1 || MT == 2, "MT must be 1 or 2");
static_assert(NWARPS == 4 || NWARPS == 8, "NWARPS must be 4 or 8");
static_assert(STAGES == 1 || STAGES == 2, "STAGES must be 1 or 2");
static_assert(NGRP == 4, "tile_bases assumes 4 groups of 16 keys");

#include "prefill_attention.cuh"

// XOR swizzle of 16-byte chunks inside aligned groups of 8, so the 8 row addresses of an ldmatrix hit 8
// different bank groups. A trailing group of fewer than 8 chunks (HD = 80, 208, ...) is left as is.
__device__ __forceinline__ int swz(int row, int c) { return c < (CPR & ~7) ? (c ^ (row & 7)) : c; }

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// D (16x8 f32) += A (16x16, row) . B (16x8, col). Fragments (g = lane >> 2, t4 = lane & 3):
//   a0 (row g, k 2t4..+1) a1 (row g+8, k 2t4..) a2 (row g, k 2t4+8..) a3 (row g+8, k 2t4+8..)
//   b0 (k 2t4..+1, col g) b1 (k 2t4+8..+9, col g);  d0,d1 (row g, cols 2t4, 2t4+1) d2,d3 (row g+8, same)
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

extern __shared__ __align__(128) unsigned char smem[];

// ldmatrix addresses of one lane: the lane reads 16-byte chunk 2 * step + lo of a row with (row & 7) ==
// (lane & 7) (every ldmatrix row here: tile rows start at multiples of 8). x[k] = row + ((2k + lo) ^ (lane &
// 7)) * 16 covers step % 4 == k of the swizzled groups of 8 chunks; plain the trailing partial group.
struct LdsmBase {
  u32 x[4];
  u32 plain;
};
__device__ __forceinline__ LdsmBase ldsm_base(u32 row_addr, int lo, int lane) {
  LdsmBase b;
#pragma unroll
  for (int k = 0; k < 4; ++k) b.x[k] = opaque(row_addr + ((2 * k + lo) ^ (lane & 7)) * 16);
  b.plain = opaque(row_addr + lo * 16);
  return b;
}
// `step` and `extra` (bytes) are compile-time constants in every (unrolled) use.
__device__ __forceinline__ u32 ldsm_addr(const LdsmBase& b, int step, int extra) {
  const int c = 2 * step;
  if ((c & ~7) + 8 <= CPR) return b.x[step & 3] + (c & ~7) * 16 + extra;  // swizzled group of 8 chunks
  return b.plain + c * 16 + extra;                                         // trailing group: not swizzled
}

__device__ __forceinline__ void tile_bases(int (&base)[NGRP], const int* __restrict__ table, int n0, int kv_len,
                                           int page_size, int Hkv, int kvh) {
  int pg[NGRP];
  tile_pages(pg, table, n0, kv_len, page_size);
  bases_from_pages(base, pg, n0, page_size, Hkv, kvh);
}

// cp.async of one BN-key tile of K or V into shared memory at dst0 + dst_off (dst_off a compile-time constant)
// from the pool rows base[] (keys past nvalid are zero-filled: they are masked anyway, the zeros keep them
// finite). BN * CPR = 8 * HD chunks: a multiple of NTHREADS on the fast path.
#define RSTEP (NTHREADS / CPR)  // rows between a thread's chunks (fast path: CPR divides NTHREADS)
#define FASTLOAD (NTHREADS % CPR == 0 && RSTEP <= 16 && 16 % RSTEP == 0)
#define NPAT (RSTEP >= 8 ? 1 : 8 / RSTEP)  // swizzle patterns of a thread's rows r0 + i * RSTEP
struct LoadBase {
  u32 dst[NPAT];  // shared address of rows r0 + k * RSTEP, chunk c (swizzled), k < NPAT
  u32 soff[16 / (RSTEP < 16 ? RSTEP : 16)];  // element offset of row r0 + k * RSTEP inside its 16-key group
  u32 c8;         // c * 8 + r0 * Hkv * HD: the thread's chunk in its first row
};
__device__ __forceinline__ LoadBase load_base(u32 sdst, int Hkv, int tid) {
  LoadBase lb;
#if FASTLOAD
  const int r0 = tid / CPR, c = tid - r0 * CPR;
#pragma unroll
  for (int k = 0; k < NPAT; ++k) {
    const int r = r0 + k * RSTEP;
    lb.dst[k] = opaque(sdst + r * ROWB + swz(r, c) * 16);
  }
#pragma unroll
  for (int k = 0; k < 16 / RSTEP; ++k) lb.soff[k] = opaque((u32)(k * RSTEP * Hkv * HD));
  lb.c8 = opaque((u32)(c * 8 + r0 * Hkv * HD));
#else
  lb.dst[0] = sdst;
#endif
  return lb;
}
__device__ __forceinline__ void load_kv_tile(const LoadBase& lb, int dst_off, const T* __restrict__ pool,
                                             const int (&base)[NGRP], int nvalid, int Hkv, int tid) {
#if FASTLOAD
  static_assert((BN * CPR) % NTHREADS == 0, "K/V tile chunks must divide among the threads");
  const int r0 = tid / CPR;
  const T* gp[NGRP];  // the thread's chunk in the first row of each 16-key group
#pragma unroll
  for (int gi = 0; gi < NGRP; ++gi) gp[gi] = pool + (size_t)(base[gi] < 0 ? 0 : base[gi]) * HD + lb.c8;
#pragma unroll
  for (int i = 0; i < (BN * CPR) / NTHREADS; ++i) {
    const int rr = i * RSTEP;  // + r0: the row of this chunk
    const bool ok = r0 + rr < nvalid;
    const T* src = ok ? gp[rr >> 4] + lb.soff[(rr & 15) / RSTEP] : pool;
    cp_async16(lb.dst[i % NPAT] + (i / NPAT) * NPAT * RSTEP * ROWB + dst_off, src, ok ? 16 : 0);
  }
#else
#pragma unroll
  for (int i = 0; i < (BN * CPR + NTHREADS - 1) / NTHREADS; ++i) {
    const int idx = tid + NTHREADS * i;
    if ((BN * CPR) % NTHREADS != 0 && idx >= BN * CPR) break;  // 8 warps, HD % 32 == 16: a partial last round
    const int r = idx / CPR, c = idx - r * CPR;
    const int gi = r >> 4;
    const int b = gi == 0 ? base[0] : gi == 1 ? base[1] : gi == 2 ? base[2] : base[3];
    const bool ok = r < nvalid;
    const T* src = pool + (size_t)(ok ? b + (r & 15) * Hkv : 0) * HD + c * 8;
    cp_async16(lb.dst[0] + dst_off + r * ROWB + swz(r, c) * 16, src, ok ? 16 : 0);
  }
#endif
}

// ---- the math of one key tile (the same in every build: a row's result does not depend on the schedule) ----

// S = Q K^T of the warp's rows and the tile's BN keys: A = Q (ldmatrix from aQ), B = K rows (from aK).
__device__ __forceinline__ void tile_scores(float (&s)[MT][NNT][4], u32 aQ, u32 aK, int a_c, int b_c, int lane) {
  const LdsmBase bq = ldsm_base(aQ, a_c, lane), bk = ldsm_base(aK, b_c, lane);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < NKS; ++ks) {
    u32 a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      ldsm_x4(a[mt], ldsm_addr(bq, ks, mt * 16 * ROWB));
    }
#pragma unroll
    for (int np = 0; np < NNT / 2; ++np) {
      u32 b[4];
      ldsm_x4(b, ldsm_addr(bk, ks, np * 16 * ROWB));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816(s[mt][2 * np], a[mt], b[0], b[1]);
        mma16816(s[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Causal mask (when `mask`), online softmax per row (g, g + 8; the 4 lanes of a quad hold a row's BN keys):
// s becomes P, o and the running sums are rescaled. The rescale of o (HD / 2 multiplies per row and thread) is
// skipped for the warp's 8 rows g (or g + 8) of an m-tile when none has a new maximum: alpha is then exactly 1
// (ex2(+0) = 1) for each, so the skip changes no bit. Past the first few tiles a row's maximum rarely moves.
__device__ __forceinline__ void tile_softmax(float (&s)[MT][NNT][4], float (&o)[MT][NDT][4], float (&m_run)[MT][2],
                                             float (&l_run)[MT][2], bool mask, int n0, const int (&rpos)[MT][2],
                                             int t4, float scale_log2) {
  if (mask) {  // the tile reaches past the first query (covers keys >= kv_len)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + nt * 8 + 2 * t4 + (e & 1);
          if (key > rpos[mt][e >> 1]) s[mt][nt][e] = NEG_INF;
        }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float mx = NEG_INF;
#pragma unroll
      for (int nt = 0; nt < NNT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hi], s[mt][nt][2 * hi + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // Finite: tile 0 (always visited first) holds key 0 for every row, and -inf * scale stays -inf.
      const float m_new = fmaxf(m_run[mt][hi], mx * scale_log2);
      const float alpha = fast_exp2(m_run[mt][hi] - m_new);  // 0 on the first tile, exactly 1 if m is unchanged
      m_run[mt][hi] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NNT; ++nt) {
        const float p0 = fast_exp2(fmaf(s[mt][nt][2 * hi], scale_log2, -m_new));
        const float p1 = fast_exp2(fmaf(s[mt][nt][2 * hi + 1], scale_log2, -m_new));
        s[mt][nt][2 * hi] = p0;
        s[mt][nt][2 * hi + 1] = p1;
        sum += p0 + p1;
      }
      l_run[mt][hi] = l_run[mt][hi] * alpha + sum;
      if (!__all_sync(0xffffffffu, alpha == 1.f)) {  // warp-uniform: some row of these 8 has a new maximum
#pragma unroll
        for (int dt = 0; dt < NDT; ++dt) {
          o[mt][dt][2 * hi] *= alpha;
          o[mt][dt][2 * hi + 1] *= alpha;
        }
      }
    }
}

// O += P V: A = P (the S accumulators rounded to T), B = V (ldmatrix.trans from aV).
__device__ __forceinline__ void tile_pv(float (&o)[MT][NDT][4], const float (&s)[MT][NNT][4], u32 aV, int a_c,
                                        int lane) {
  const LdsmBase bv = ldsm_base(aV, a_c, lane);
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    u32 pa[MT][4];  // P as the A operand: keys 16 kk .. 16 kk + 15 are S key tiles 2 kk and 2 kk + 1
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      pa[mt][0] = pack2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      pa[mt][1] = pack2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      pa[mt][2] = pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      pa[mt][3] = pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < NKS; ++dp) {
      u32 b[4];  // V^T: r[0], r[1] = b0, b1 of dim tile 2 dp; r[2], r[3] those of dim tile 2 dp + 1
      ldsm_x4_t(b, ldsm_addr(bv, dp, kk * 16 * ROWB));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816(o[mt][2 * dp], pa[mt], b[0], b[1]);
        mma16816(o[mt][2 * dp + 1], pa[mt], b[2], b[3]);
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) prefill_attn(
    const T* __restrict__ q, const T* __restrict__ kpool, const T* __restrict__ vpool,
    const int* __restrict__ tables, int table_stride, const int4* __restrict__ work, float* __restrict__ out,
    int Hq, int Hkv, int page_size, int n_work, float scale_log2) {
  const int item = blockIdx.x, kvh = blockIdx.y;
  if (item >= n_work || kvh >= Hkv) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const u32 sQ = smem_u32(smem), sK = sQ + BM * ROWB;  // stage st: K at sK + st * STAGE_BYTES, V BN rows on

  pdl_wait_primary();  // nothing below reads or writes global memory before the previous kernel is done
  const int4 w = work[item];
  const int seq = w.x, qrow0 = w.y, ntok = w.z, qpos0 = w.w;
  const int* table = tables + (size_t)seq * table_stride;
  const int kv_len = qpos0 + ntok;  // keys 0 .. last query's position
  const int nkt = (kv_len + BN - 1) / BN;
  const int h0 = kvh * G;

  // ---- prologue: Q tile (rows past the tile's tokens zero-filled) and K tile 0 (and V tile 0 with two
  // stages), one commit group ----
#pragma unroll 4
  for (int i = 0; i < (BM * CPR) / NTHREADS; ++i) {
    const int idx = tid + NTHREADS * i;
    const int r = idx / CPR, c = idx - r * CPR;
    const int tok = r / G, hg = r - tok * G;
    const bool ok = r < RUSED && tok < ntok;
    const T* src = q + ((size_t)(qrow0 + (ok ? tok : 0)) * Hq + h0 + (ok ? hg : 0)) * HD + c * 8;
    cp_async16(sQ + r * ROWB + swz(r, c) * 16, src, ok ? 16 : 0);
  }
  int base[NGRP];
  tile_bases(base, table, 0, kv_len, page_size, Hkv, kvh);
  {
    const LoadBase lb0 = load_base(sK, Hkv, tid);
    load_kv_tile(lb0, 0, kpool, base, min(BN, kv_len), Hkv, tid);
#if STAGES == 2
    load_kv_tile(lb0, BN * ROWB, vpool, base, min(BN, kv_len), Hkv, tid);
#endif
  }
  cp_commit();

  // Positions of this thread's rows (g and g + 8 of each m-tile); padding rows take the last token's.
  const int wrow0 = warp * 16 * MT;
  int rpos[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) rpos[mt][hi] = qpos0 + min((wrow0 + mt * 16 + g + 8 * hi) / G, ntok - 1);
  const int warp_maxpos = qpos0 + min((wrow0 + 16 * MT - 1) / G, ntok - 1);
  const bool warp_live = wrow0 < ntok * G;  // otherwise every row of the warp is padding

  float o[MT][NDT][4];
  float m_run[MT][2], l_run[MT][2];  // running max (log2 domain, scaled) and this thread's partial sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < NDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
    m_run[mt][0] = m_run[mt][1] = NEG_INF;
    l_run[mt][0] = l_run[mt][1] = 0.f;
  }

  // ldmatrix lane addressing. Q (A, non-trans) and V (B, trans): row (lane & 7) + 8 * ((lane >> 3) & 1),
  // 16-byte chunk lane >> 4 of the 16-wide step. K (B, non-trans): row (lane & 7) + 8 * (lane >> 4), chunk
  // (lane >> 3) & 1, so r[0], r[1] are b0, b1 of key tile 2np and r[2], r[3] those of key tile 2np + 1.
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_c = lane >> 4;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_c = (lane >> 3) & 1;
  const u32 aQ = sQ + (wrow0 + a_row) * ROWB, aK = sK + b_row * ROWB, aV = sK + BN * ROWB + a_row * ROWB;

#if STAGES == 1
#pragma unroll 1
  for (int j = 0; j < nkt; ++j) {
    const int n0 = j * BN;
    const int nvalid = min(BN, kv_len - n0);
    cp_wait0();
    __syncthreads();  // K_j (and Q) landed for every thread; every warp is done with V_{j-1}
    const LoadBase lb = load_base(sK, Hkv, tid);  // V_j below, K_{j+1} at the second barrier
    load_kv_tile(lb, BN * ROWB, vpool, base, nvalid, Hkv, tid);
    cp_commit();

    // warp-uniform: the warp holds a real row and some row of it sees a key of the tile
    const bool active = warp_live && n0 <= warp_maxpos;
    float s[MT][NNT][4];
    if (active) {
      tile_scores(s, aQ, aK, a_c, b_c, lane);
      tile_softmax(s, o, m_run, l_run, n0 + BN - 1 > qpos0, n0, rpos, t4, scale_log2);
    }
    // The next tile's pool rows (their page-table loads overlap the wait for V_j).
    const bool more = j + 1 < nkt;
    if (more) tile_bases(base, table, n0 + BN, kv_len, page_size, Hkv, kvh);
    cp_wait0();
    __syncthreads();  // V_j landed; every warp is done with K_j
    if (more) {
      load_kv_tile(lb, 0, kpool, base, min(BN, kv_len - n0 - BN), Hkv, tid);
      cp_commit();
    }
    if (active) tile_pv(o, s, aV, a_c, lane);
  }
#else
  // Pages of tile j + 1, read one tile before they are needed (no stall on the table load).
  int pg[NGRP];
  tile_pages(pg, table, BN, kv_len, page_size);
#pragma unroll 1
  for (int j = 0; j < nkt; ++j) {
    const int n0 = j * BN;
    const u32 cur = (u32)(j & 1) * STAGE_BYTES;
    cp_wait0();
    __syncthreads();  // tile j (and Q) landed for every thread; every warp is done with tile j - 1
    if (j + 1 < nkt) {  // tile j + 1 into the buffer tile j - 1 used, copied while tile j is computed
      bases_from_pages(base, pg, n0 + BN, page_size, Hkv, kvh);
      const LoadBase lb = load_base(sK + (STAGE_BYTES - cur), Hkv, tid);
      const int nv = min(BN, kv_len - n0 - BN);
      load_kv_tile(lb, 0, kpool, base, nv, Hkv, tid);
      load_kv_tile(lb, BN * ROWB, vpool, base, nv, Hkv, tid);
      cp_commit();
      tile_pages(pg, table, n0 + 2 * BN, kv_len, page_size);
    }
    // warp-uniform: the warp holds a real row and some row of it sees a key of the tile
    if (warp_live && n0 <= warp_maxpos) {
      float s[MT][NNT][4];
      tile_scores(s, aQ, aK + cur, a_c, b_c, lane);
      tile_softmax(s, o, m_run, l_run, n0 + BN - 1 > qpos0, n0, rpos, t4, scale_log2);
      tile_pv(o, s, aV + cur, a_c, lane);
    }
  }
#endif

  // ---- epilogue: full row sums over the quad, normalise, store float32 (8 rows x 32 bytes per store) ----
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float l = l_run[mt][hi];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = 1.f / l;  // > 0: every row has its key 0
      const int r = wrow0 + mt * 16 + g + 8 * hi;
      const int tok = r / G, hg = r - tok * G;
      if (r < RUSED && tok < ntok) {
        float* dst = out + ((size_t)(qrow0 + tok) * Hq + h0 + hg) * HD + 2 * t4;
#pragma unroll
        for (int dt = 0; dt < NDT; ++dt)
          *(float2*)(dst + dt * 8) = make_float2(o[mt][dt][2 * hi] * inv, o[mt][dt][2 * hi + 1] * inv);
      }
    }
  pdl_launch_dependents();  // this CTA's results are stored: the next kernel may be scheduled
}
