// Causal prefill attention over the paged KV cache on Hopper warpgroup MMA (wgmma.mma_async, sm_90a only).//
// The same launch contract as prefill_attention.cu (arguments, work list, grid (n_work, Hkv, 1), float32 output;
// host side hybrid_runtime/cuda/prefill_attention.py, impls "wgmma" and "wgmma_ws"); prefill_attention.cu stays
// the build for other GPUs and head dims. Compiled by NVRTC for sm_90a with
//   -DHD=<head_dim: 64, 128 or 256>  -DDT=<1 float16 | 2 bfloat16>  -DG=<GQA group Hq / Hkv, 1..128>
//   -DPV_SPLIT (optional): O += P V as HD / 64 wgmmas of n64 per 16 keys instead of one of n HD;
//   -DWS (optional): the warp-specialised build instead (entry prefill_attn_wgmma_ws, 384 threads; at the end of
//   this file; what the backend runs on compute capability 9.0).
// No CUDA headers; prefill_attention.cuh holds the helpers it shares with prefill_attention.cu (PDL, cp.async,
// page tables, packing, exp2).
//
// CTA: BM = 128 query rows (row = token * G + head_in_group, TOKB = 128 / G tokens of the work item, as the
// mma.sync build with 8 warps) x key tiles of BN = 64; 256 threads = two warpgroups, warpgroup w owns rows
// [64 w, 64 w + 64) (warp 4 w + i rows 16 i.., as warp i of the 8-warp mma.sync build).
//   S = Q K^T   wgmma m64n64k16, A = Q and B = K both K-major in shared memory, HD / 16 k-steps (scale-d 0 on
//               the first: no zeroing), float32 S in 32 registers a thread;
//   online softmax on S in registers (the mma.sync build's row math, log2 domain, exp2 on the MUFU);
//   O += P V    wgmma m64nHDk16 with A = P from registers (S rounded to T: the m16n8k16 A fragment layout, as
//               mma.sync) and B = V from shared memory, MN-major (imm-trans-b 1), 4 k-steps of 16 keys;
//               float32 O in HD / 2 registers a thread.
// Shared memory (1024-aligned): Q [HD / 64 slabs][128 rows][128 bytes], then two stages of (K, V), each
// [HD / 64 slabs][64 keys][128 bytes]. A slab row holds 64 columns (dims) of one row (token x head, or key); its
// 16-byte chunks are XOR-swizzled by (row & 7) inside 1024-byte 8-row atoms: the PTX ISA's canonical 128-byte
// swizzle layout, K-major for Q and K (descriptor SBO 1024 = one 8-row atom to the next, the k16 step s adds
// 32 (s % 4) bytes inside slab s / 4) and MN-major for V (keys are the k dimension: the 16 keys of step kk
// start 2048 kk bytes in, SBO 1024 = 8 keys to the next 8, LBO = one slab to the next along the dims).
// hd 256: 64 KB of Q + 2 x 64 KB of K/V + 1 KB alignment = 193 KB, one CTA per SM.
// Schedule (per key tile j): wait for tile j's cp.async copies, fence.proxy.async (generic-proxy writes ->
// visible to the async proxy), barrier, copy tile j + 1 into the other stage (its previous tile's wgmmas have
// completed in both warpgroups: each waited for them before the barrier), S wgmmas, wait, softmax, P V wgmmas,
// wait. No explicit ping-pong: the SM's schedulers interleave the two warpgroups' softmax and MMAs as they can.
// Semantics as prefill_attention.cu: causal over absolute positions, keys past the last query zero-filled and
// masked, fp32 accumulation. Every plan gives a row the same bits (the key tiles in the same order); on the H200
// they also equalled the mma.sync build's in every case measured (GPU-tested, not a documented property).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef HD
#error "HD (head_dim) must be defined"
#endif
#ifndef DT
#define DT 2
#endif
#ifndef G
#define G 1
#endif
#if DT == 1
#define WG_TY "f16"
#elif DT == 2
#define WG_TY "bf16"
#else
#error "DT must be 1 (float16) or 2 (bfloat16)"
#endif
typedef u16 T;

#define NTHREADS 256
#define BM 128                       // query rows per CTA (two warpgroups of 64)
#define BN 64                        // keys per tile
#define TOKB (BM / G)                // query tokens per CTA
#define RUSED (TOKB * G)             // rows in use
#define CPR (HD / 8)                 // 16-byte chunks per row
#define NSLAB (HD / 64)              // 64-column slabs (one 128-byte swizzle row each)
#define Q_SLAB (BM * 128)            // bytes of one Q slab
#define KV_SLAB (BN * 128)           // bytes of one K (or V) slab
#define KV_BYTES (NSLAB * KV_SLAB)   // one K (or V) tile
#define STAGE_BYTES (2 * KV_BYTES)   // K tile then V tile
#define Q_BYTES (NSLAB * Q_SLAB)
#define NKS (HD / 16)                // k16 steps of S = Q K^T
#define NDT (HD / 8)                 // 8-wide dim tiles of O
#define NNT (BN / 8)                 // 8-wide key tiles of S
#define NGRP (BN / 16)               // 16-key groups of a tile (each inside one page)
#define RSTEP (NTHREADS / CPR)       // rows between a thread's chunks in a K/V tile copy
#ifdef PV_SPLIT
#define PVN 64
#else
#define PVN HD
#endif
#define NPV (HD / PVN)               // P V wgmmas per 16 keys

static_assert(HD == 64 || HD == 128 || HD == 256, "HD must be 64, 128 or 256");
static_assert(G >= 1 && G <= BM, "G must be in 1..128");
static_assert(RSTEP % 8 == 0 && BN % RSTEP == 0, "copy rows: a thread's rows share (row & 7)");

#include "prefill_attention.cuh"

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Matrix descriptor of a 128-byte-swizzled operand at shared address `saddr` (start >> 4 in bits 0-13, LBO >> 4
// in 16-29, SBO >> 4 in 32-45, swizzle mode 1 = 128B in 62-63, base offset 0). Adding (bytes >> 4) to a
// descriptor moves its start (no carry: shared addresses are < 256 KB).
__device__ __forceinline__ u64 sw128_desc(u32 saddr, u32 lbo, u32 sbo) {
  return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

#define RF8(a, i) "+f"(a[i]), "+f"(a[i + 1]), "+f"(a[i + 2]), "+f"(a[i + 3]), "+f"(a[i + 4]), "+f"(a[i + 5]), \
                  "+f"(a[i + 6]), "+f"(a[i + 7])
#define RF32(a, i) RF8(a, i), RF8(a, i + 8), RF8(a, i + 16), RF8(a, i + 24)
#define RF64(a, i) RF32(a, i), RF32(a, i + 32)
#define RF128(a, i) RF64(a, i), RF64(a, i + 64)

// S[64 x 64] = (acc ? S : 0) + Q[64 x 16] . K[64 x 16]^T; da / db: K-major descriptors of the k16 step.
__device__ __forceinline__ void wgmma_s(float (&s)[32], u64 da, u64 db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_TY "." WG_TY " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : RF32(s, 0)
      : "l"(da), "l"(db), "r"(acc));
}

// O[64 x PVN] (accumulators o[OFF .. OFF + PVN / 2)) += P[64 x 16] (registers a) . V[16 x PVN] (MN-major, db).
template <int OFF>
__device__ __forceinline__ void wgmma_pv(float (&o)[HD / 2], const u32 (&a)[4], u64 db) {
#if PVN == 64
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_TY "." WG_TY " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : RF32(o, OFF)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
#elif PVN == 128
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_TY "." WG_TY " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : RF64(o, OFF)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
#else
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." WG_TY "." WG_TY " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : RF128(o, OFF)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
#endif
}

// Register fences: the compiler must not read wgmma accumulators before the wait, nor reuse the P registers
// while the asynchronous MMAs still read them.
__device__ __forceinline__ void fence_s(float (&s)[32]) { asm volatile("" : RF32(s, 0)::"memory"); }
__device__ __forceinline__ void fence_o(float (&o)[HD / 2]) {
#if HD == 64
  asm volatile("" : RF32(o, 0)::"memory");
#elif HD == 128
  asm volatile("" : RF64(o, 0)::"memory");
#else
  asm volatile("" : RF128(o, 0)::"memory");
#endif
}
__device__ __forceinline__ void fence_p(u32 (&p)[NGRP][4]) {
  asm volatile("" : "+r"(p[0][0]), "+r"(p[0][1]), "+r"(p[0][2]), "+r"(p[0][3]), "+r"(p[1][0]), "+r"(p[1][1]),
               "+r"(p[1][2]), "+r"(p[1][3]), "+r"(p[2][0]), "+r"(p[2][1]), "+r"(p[2][2]), "+r"(p[2][3]),
               "+r"(p[3][0]), "+r"(p[3][1]), "+r"(p[3][2]), "+r"(p[3][3])::"memory");
}

extern __shared__ __align__(1024) unsigned char smem[];


// cp.async of one BN-key tile of K or V to shared address dst (its slab 0, 1024-aligned): thread (r0, c) copies
// chunk c of rows r0 + RSTEP i; keys past nvalid are zero-filled (masked anyway; zeros keep P V finite).
__device__ __forceinline__ void load_kv_tile(u32 dst, const T* __restrict__ pool, const int (&base)[NGRP],
                                             int nvalid, int Hkv, int r0, int c) {
  const u32 d0 = dst + (c >> 3) * KV_SLAB + r0 * 128 + (((c & 7) ^ (r0 & 7)) << 4);
#pragma unroll
  for (int i = 0; i < BN / RSTEP; ++i) {
    const int ga = (RSTEP * i) >> 4;  // the group of row RSTEP i; + 1 for r0 >= 16 (RSTEP 32 only)
    const int b = (RSTEP > 16 && (r0 & 16)) ? base[(ga + 1) & (NGRP - 1)] : base[ga];
    const int r = r0 + RSTEP * i;
    const bool ok = r < nvalid;
    const T* src = ok ? pool + ((size_t)b + (r & 15) * Hkv) * HD + c * 8 : pool;
    cp_async16(d0 + i * RSTEP * 128, src, ok ? 16 : 0);
  }
}

// Causal mask (when `mask`: the tile reaches past the first query) and the online softmax of one key tile for the
// thread's rows g, g + 8 (the 4 lanes of a quad hold a row's 64 keys): s becomes P (unnormalised, log2 domain),
// m_run / l_run move on, alpha[hi] is the factor O must be rescaled by (exactly 1 when the row max is unchanged).
__device__ __forceinline__ void tile_softmax(float (&s)[32], float (&m_run)[2], float (&l_run)[2], float (&alpha)[2],
                                             bool mask, int n0, const int (&rpos)[2], int t4, float scale_log2) {
  if (mask) {
#pragma unroll
    for (int nt = 0; nt < NNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = n0 + nt * 8 + 2 * t4 + (e & 1);
        if (key > rpos[e >> 1]) s[4 * nt + e] = NEG_INF;
      }
  }
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    float mx = NEG_INF;
#pragma unroll
    for (int nt = 0; nt < NNT; ++nt) mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * hi], s[4 * nt + 2 * hi + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run[hi], mx * scale_log2);  // finite: tile 0 holds key 0 for every row
    alpha[hi] = fast_exp2(m_run[hi] - m_new);
    m_run[hi] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NNT; ++nt) {
      const float p0 = fast_exp2(fmaf(s[4 * nt + 2 * hi], scale_log2, -m_new));
      const float p1 = fast_exp2(fmaf(s[4 * nt + 2 * hi + 1], scale_log2, -m_new));
      s[4 * nt + 2 * hi] = p0;
      s[4 * nt + 2 * hi + 1] = p1;
      sum += p0 + p1;
    }
    l_run[hi] = l_run[hi] * alpha[hi] + sum;
  }
}
// O *= alpha per row; skipped for the warp's 8 rows g (or g + 8) when none has a new maximum (alpha exactly 1).
__device__ __forceinline__ void rescale_o(float (&o)[HD / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int hi = 0; hi < 2; ++hi)
    if (!__all_sync(0xffffffffu, alpha[hi] == 1.f)) {
#pragma unroll
      for (int dt = 0; dt < NDT; ++dt) {
        o[4 * dt + 2 * hi] *= alpha[hi];
        o[4 * dt + 2 * hi + 1] *= alpha[hi];
      }
    }
}
// P (keys 16 kk .. 16 kk + 15 = S key tiles 2 kk, 2 kk + 1) rounded to T as the A fragments of the P V wgmmas.
__device__ __forceinline__ void pack_p(u32 (&pa)[NGRP][4], const float (&s)[32]) {
#pragma unroll
  for (int kk = 0; kk < NGRP; ++kk) {
    pa[kk][0] = pack2(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = pack2(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack2(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack2(s[8 * kk + 6], s[8 * kk + 7]);
  }
}
// O += P V of one key tile (V MN-major at descriptor dv): NGRP k16 steps, NPV products each.
__device__ __forceinline__ void issue_pv(float (&o)[HD / 2], const u32 (&pa)[NGRP][4], u64 dv) {
#pragma unroll
  for (int kk = 0; kk < NGRP; ++kk) {
    wgmma_pv<0>(o, pa[kk], dv + ((kk * 2048) >> 4));
#if NPV > 1
    wgmma_pv<32>(o, pa[kk], dv + ((kk * 2048 + KV_SLAB) >> 4));
#endif
#if NPV > 2
    wgmma_pv<64>(o, pa[kk], dv + ((kk * 2048 + 2 * KV_SLAB) >> 4));
    wgmma_pv<96>(o, pa[kk], dv + ((kk * 2048 + 3 * KV_SLAB) >> 4));
#endif
  }
}
// S = Q K^T of one key tile: HD / 16 k16 steps (the first with scale-d 0).
__device__ __forceinline__ void issue_s(float (&s)[32], u64 dq, u64 dk) {
#pragma unroll
  for (int ks = 0; ks < NKS; ++ks)
    wgmma_s(s, dq + (((ks >> 2) * Q_SLAB + (ks & 3) * 32) >> 4), dk + (((ks >> 2) * KV_SLAB + (ks & 3) * 32) >> 4),
            ks > 0);
}

// Normalise by the full row sums (over the quad) and store the thread's rows as float32.
__device__ __forceinline__ void store_rows(float* __restrict__ out, const float (&o)[HD / 2], const float (&l_run)[2],
                                           int wrow0, int g, int t4, int ntok, int qrow0, int Hq, int h0) {
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    float l = l_run[hi];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = 1.f / l;  // > 0: every row has its key 0
    const int r = wrow0 + g + 8 * hi;
    const int tok = r / G, hg = r - tok * G;
    if (r < RUSED && tok < ntok) {
      float* dst = out + ((size_t)(qrow0 + tok) * Hq + h0 + hg) * HD + 2 * t4;
#pragma unroll
      for (int dt = 0; dt < NDT; ++dt)
        *(float2*)(dst + dt * 8) = make_float2(o[4 * dt + 2 * hi] * inv, o[4 * dt + 2 * hi + 1] * inv);
    }
  }
}

#ifndef WS
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) prefill_attn_wgmma(
    const T* __restrict__ q, const T* __restrict__ kpool, const T* __restrict__ vpool,
    const int* __restrict__ tables, int table_stride, const int4* __restrict__ work, float* __restrict__ out,
    int Hq, int Hkv, int page_size, int n_work, float scale_log2) {
  const int item = blockIdx.x, kvh = blockIdx.y;
  if (item >= n_work || kvh >= Hkv) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int g = lane >> 2, t4 = lane & 3;
  const u32 sQ = (smem_u32(smem) + 1023u) & ~1023u, sKV = sQ + Q_BYTES;

  pdl_wait_primary();  // nothing below reads or writes global memory before the previous kernel is done
  const int4 w = work[item];
  const int seq = w.x, qrow0 = w.y, ntok = w.z, qpos0 = w.w;
  const int* table = tables + (size_t)seq * table_stride;
  const int kv_len = qpos0 + ntok;
  const int nkt = (kv_len + BN - 1) / BN;
  const int h0 = kvh * G;

  // ---- prologue: Q tile (padding rows zero-filled) and K/V tile 0, one commit group ----
#pragma unroll 4
  for (int i = 0; i < (BM * CPR) / NTHREADS; ++i) {
    const int idx = tid + NTHREADS * i;
    const int r = idx / CPR, c = idx - r * CPR;
    const int tok = r / G, hg = r - tok * G;
    const bool ok = r < RUSED && tok < ntok;
    const T* src = q + ((size_t)(qrow0 + (ok ? tok : 0)) * Hq + h0 + (ok ? hg : 0)) * HD + c * 8;
    cp_async16(sQ + (c >> 3) * Q_SLAB + r * 128 + (((c & 7) ^ (r & 7)) << 4), src, ok ? 16 : 0);
  }
  const int cr0 = tid / CPR, cc = tid - cr0 * CPR;  // this thread's rows / chunk of a K/V tile copy
  int pg[NGRP], base[NGRP];
  tile_pages(pg, table, 0, kv_len, page_size);
  bases_from_pages(base, pg, 0, page_size, Hkv, kvh);
  load_kv_tile(sKV, kpool, base, min(BN, kv_len), Hkv, cr0, cc);
  load_kv_tile(sKV + KV_BYTES, vpool, base, min(BN, kv_len), Hkv, cr0, cc);
  cp_commit();
  tile_pages(pg, table, BN, kv_len, page_size);

  // Positions of this thread's rows (16 warp + g and + 8); padding rows take the last token's.
  const int wrow0 = warp * 16;
  int rpos[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) rpos[hi] = qpos0 + min((wrow0 + g + 8 * hi) / G, ntok - 1);

  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};

  // Descriptors: Q rows of this warpgroup (K-major), K and V of stage 0 (K K-major, V MN-major).
  const u64 dq = sw128_desc(sQ + wg * 64 * 128, 16, 1024);
  const u64 dk0 = sw128_desc(sKV, 16, 1024);
  const u64 dv0 = sw128_desc(sKV + KV_BYTES, KV_SLAB, 1024);

#pragma unroll 1
  for (int j = 0; j < nkt; ++j) {
    const int n0 = j * BN;
    const u32 cur = (u32)(j & 1) * STAGE_BYTES;
    cp_wait0();
    fence_proxy_async();
    __syncthreads();  // tile j (and Q) landed for every thread; both warpgroups are done with tile j - 1
    if (j + 1 < nkt) {  // tile j + 1 into the stage tile j - 1 used
      bases_from_pages(base, pg, n0 + BN, page_size, Hkv, kvh);
      const u32 nxt = sKV + (STAGE_BYTES - cur);
      const int nv = min(BN, kv_len - n0 - BN);
      load_kv_tile(nxt, kpool, base, nv, Hkv, cr0, cc);
      load_kv_tile(nxt + KV_BYTES, vpool, base, nv, Hkv, cr0, cc);
      cp_commit();
      tile_pages(pg, table, n0 + 2 * BN, kv_len, page_size);
    }

    // ---- S = Q K_j^T ----
    float s[32];
    const u64 dk = dk0 + (opaque(cur) >> 4);
    wgmma_fence();
    issue_s(s, dq, dk);
    wgmma_commit();
    wgmma_wait0();
    fence_s(s);

    // ---- causal mask (tiles reaching past the first query), online softmax: s becomes P; O rescaled ----
    float alpha[2];
    tile_softmax(s, m_run, l_run, alpha, n0 + BN - 1 > qpos0, n0, rpos, t4, scale_log2);
    rescale_o(o, alpha);

    // ---- O += P V_j ----
    u32 pa[NGRP][4];
    pack_p(pa, s);
    const u64 dv = dv0 + (opaque(cur) >> 4);
    wgmma_fence();
    issue_pv(o, pa, dv);
    wgmma_commit();
    wgmma_wait0();
    fence_o(o);
    fence_p(pa);
  }

  store_rows(out, o, l_run, wrow0, g, t4, ntok, qrow0, Hq, h0);
  pdl_launch_dependents();  // this CTA's results are stored: the next kernel may be scheduled
}
#endif  // !WS

#ifdef WS
// ---------------------------------------------------------------------------------------------------------------
// -DWS: the warp-specialised build (entry prefill_attn_wgmma_ws): 384 threads = two consumer warpgroups (warps 0-7,
// the rows as above, wgmma and softmax only; setmaxnreg 232) + one producer warpgroup (warps 8-11: every cp.async
// copy; setmaxnreg 40), synchronised by mbarriers instead of a CTA barrier per key tile, with
//   * K and V in separate two-stage rings: full_k[s] / full_v[s] (128 arrivals: the producer's threads, each after
//     cp.async.wait_group + fence.proxy.async on its own copies) and empty_k[s] / empty_v[s] (256 arrivals: every
//     consumer thread once the wgmmas reading the stage have completed). Tile j uses stage j & 1 in round j >> 1;
//     consumers wait for parity round & 1, the producer for (round & 1) ^ 1 (round 0 passes at once). Shared
//     memory: Q, then K stages 0 and 1, then V stages 0 and 1 (the same bytes as the plain build);
//     K_j's stage is freed once S_j is done, V_j's once P V_j is: the producer refills K while the softmax runs;
//   * ping-pong between the consumer warpgroups (named barriers 1 and 2, 256 threads: one warpgroup's bar.sync,
//     the other's bar.arrive) around the issue of S = Q K^T: the warpgroups take turns, so one's softmax tends to
//     run under the other's MMAs. Warpgroup 1 arrives once first (warpgroup 0 starts); warpgroup 0 takes the
//     last arrival at the end.
// (Deferring P V_{j-1} under the softmax of tile j, FlashAttention-3's intra-warpgroup overlap: with the P V issue
// conditional on j > 0, ptxas 13 serialises the wgmmas ("non wgmma instructions reading accumulator registers");
// with tile 0 peeled off the loop it compiles clean, gives the same bits and measured the same time on the H200
// (hd 256, 8k: 1.119 vs 1.096 ms; 32k: 17.85 vs 18.16 ms; 8 x 4k: 2.471 vs 2.461 ms), so it is not kept.)
// The math per row is the non-WS build's: the same products in the same order, the same softmax.
#define WS_THREADS (NTHREADS + 128)
#define PT 128  // producer threads
#define PR (PT / CPR)  // rows per pass of the producer's copies (thread = (row r0 < PR, chunk c))
static_assert(PT % CPR == 0 && 16 % PR == 0, "producer copy layout");

#include "mbarrier.cuh"

// The consumers' wait. No hang guard here (mbarrier.cuh's mbar_wait_guarded): a trap (or clock64) in the consumer
// path makes ptxas drop the setmaxnreg budget (the hd-256 build then spills ~460 bytes and serialises its wgmmas).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// The producer's waits are mbarrier.cuh's mbar_wait_guarded (a trap ends the whole grid, consumers included).
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
__device__ __forceinline__ void pp_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void pp_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

// The producer warpgroup's copy of one BN-key tile of K or V (rows r0 + PR i, chunk c; keys past nvalid zero-filled).
__device__ __forceinline__ void prod_load_tile(u32 dst, const T* __restrict__ pool, const int (&base)[NGRP],
                                               int nvalid, int Hkv, int r0, int c) {
  const u32 d0 = dst + (c >> 3) * KV_SLAB + (c & 7) * 16;
#pragma unroll 8
  for (int i = 0; i < BN / PR; ++i) {
    const int r = r0 + PR * i;  // its 16-key group is (PR i) >> 4: r0 < PR and PR divides 16
    const bool ok = r < nvalid;
    const T* src = ok ? pool + ((size_t)base[(PR * i) >> 4] + (r & 15) * Hkv) * HD + c * 8 : pool;
    cp_async16((d0 + r * 128) ^ ((r & 7) << 4), src, ok ? 16 : 0);
  }
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) prefill_attn_wgmma_ws(
    const T* __restrict__ q, const T* __restrict__ kpool, const T* __restrict__ vpool,
    const int* __restrict__ tables, int table_stride, const int4* __restrict__ work, float* __restrict__ out,
    int Hq, int Hkv, int page_size, int n_work, float scale_log2) {
  __shared__ __align__(8) u64 bars[8];  // full_k[2], full_v[2], empty_k[2], empty_v[2]
  const int item = blockIdx.x, kvh = blockIdx.y;
  if (item >= n_work || kvh >= Hkv) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const u32 sQ = (smem_u32(smem) + 1023u) & ~1023u, sK = sQ + Q_BYTES, sV = sK + 2 * KV_BYTES;
  const u32 full_k = smem_u32(bars), full_v = full_k + 16, empty_k = full_k + 32, empty_v = full_k + 48;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      mbar_init(full_k + 8 * s, PT);
      mbar_init(full_v + 8 * s, PT);
      mbar_init(empty_k + 8 * s, NTHREADS);
      mbar_init(empty_v + 8 * s, NTHREADS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the only CTA-wide barrier

  pdl_wait_primary();  // nothing below reads or writes global memory before the previous kernel is done
  const int4 w = work[item];
  const int seq = w.x, qrow0 = w.y, ntok = w.z, qpos0 = w.w;
  const int kv_len = qpos0 + ntok;
  const int nkt = (kv_len + BN - 1) / BN;
  const int h0 = kvh * G;

  if (warp >= NTHREADS / 32) {
    // ------------------------------------------------------------------ producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    const int* table = tables + (size_t)seq * table_stride;
    const int ptid = tid - NTHREADS, r0 = ptid / CPR, c = ptid - r0 * CPR;
#pragma unroll 4
    for (int i = 0; i < BM / PR; ++i) {  // Q rows r0 + PR i (padding rows zero-filled): with K_0 (full_k[0])
      const int r = r0 + PR * i;
      const int tok = r / G, hg = r - tok * G;
      const bool ok = r < RUSED && tok < ntok;
      const T* src = q + ((size_t)(qrow0 + (ok ? tok : 0)) * Hq + h0 + (ok ? hg : 0)) * HD + c * 8;
      cp_async16(sQ + (c >> 3) * Q_SLAB + r * 128 + (((c & 7) ^ (r & 7)) << 4), src, ok ? 16 : 0);
    }
    int pg[NGRP], base[NGRP];
    tile_pages(pg, table, 0, kv_len, page_size);
#pragma unroll 1
    for (int j = 0; j < nkt; ++j) {
      const int n0 = j * BN, nv = min(BN, kv_len - n0);
      const u32 st = (u32)(j & 1), par = ((u32)(j >> 1) & 1u) ^ 1u;
      bases_from_pages(base, pg, n0, page_size, Hkv, kvh);
      if (j + 1 < nkt) tile_pages(pg, table, n0 + BN, kv_len, page_size);  // the next tile's pages, early
      mbar_wait_guarded(empty_k + 8 * st, par);  // K_{j-2} read by both warpgroups
      prod_load_tile(sK + st * KV_BYTES, kpool, base, nv, Hkv, r0, c);
      cp_commit();
      if (j > 0) {  // V_{j-1} (the group before K_j) landed
        cp_wait1();
        fence_proxy_async();
        mbar_arrive(full_v + 8 * ((j - 1) & 1));
      }
      mbar_wait_guarded(empty_v + 8 * st, par);  // V_{j-2} read by both warpgroups
      prod_load_tile(sV + st * KV_BYTES, vpool, base, nv, Hkv, r0, c);
      cp_commit();
      cp_wait1();  // K_j (and Q with K_0) landed
      fence_proxy_async();
      mbar_arrive(full_k + 8 * st);
    }
    cp_wait0();
    fence_proxy_async();
    mbar_arrive(full_v + 8 * ((nkt - 1) & 1));
    return;
  }

  // -------------------------------------------------------------------- consumer warpgroups
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int wg = warp >> 2, g = lane >> 2, t4 = lane & 3;
  const int wrow0 = warp * 16;
  int rpos[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) rpos[hi] = qpos0 + min((wrow0 + g + 8 * hi) / G, ntok - 1);
  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
  const u64 dq = sw128_desc(sQ + wg * 64 * 128, 16, 1024);
  const u64 dk0 = sw128_desc(sK, 16, 1024);
  const u64 dv0 = sw128_desc(sV, KV_SLAB, 1024);
  u32 pa[NGRP][4];
  float s[32];
  if (wg == 1) pp_arrive(1);  // warpgroup 0 issues first

#pragma unroll 1
  for (int j = 0; j < nkt; ++j) {
    const u32 st = (u32)(j & 1), par = (u32)(j >> 1) & 1u;
    mbar_wait(full_k + 8 * st, par);  // K_j (and Q) in shared memory
    pp_sync(1 + wg);  // this warpgroup's turn to issue
    wgmma_fence();
    issue_s(s, dq, dk0 + (opaque(st * KV_BYTES) >> 4));
    wgmma_commit();
    pp_arrive(2 - wg);  // the other warpgroup's turn
    wgmma_wait0();
    fence_s(s);
    mbar_arrive(empty_k + 8 * st);  // K_j read
    float alpha[2];
    tile_softmax(s, m_run, l_run, alpha, j * BN + BN - 1 > qpos0, j * BN, rpos, t4, scale_log2);
    rescale_o(o, alpha);
    pack_p(pa, s);
    mbar_wait(full_v + 8 * st, par);  // V_j
    wgmma_fence();
    issue_pv(o, pa, dv0 + (opaque(st * KV_BYTES) >> 4));
    wgmma_commit();
    wgmma_wait0();
    fence_o(o);
    fence_p(pa);
    mbar_arrive(empty_v + 8 * st);  // V_j read
  }
  if (wg == 0) pp_sync(1);  // warpgroup 1's last arrival
  store_rows(out, o, l_run, wrow0, g, t4, ntok, qrow0, Hq, h0);
  pdl_launch_dependents();
}
#endif  // WS
