// Paged decode attention: single-block, split-KV ("multi-block") and the log-sum-exp reduction.
//
// Compiled by NVRTC (hybrid_runtime/cuda/kernels.py) once per variant with
//   -DHD=<head_dim, multiple of 16, <= 256>  -DDT=<0 float32 | 1 float16 | 2 bfloat16>
//   -DIMPL=<0 simt | 1 mma>  -DNT=<mma only: 8-wide tiles of query heads per kv head>
// Self-contained: no CUDA headers, so it compiles the same with any NVRTC (on a CPU too).
//
// Launch geometry is the dispatcher's LaunchPlan, unchanged: grid (blocks_per_seq, Hkv, B),
// block_threads threads, smem_bytes of dynamic shared memory; reduction grid (B, Hq, ceil(HD / 64)),
// reduce_threads threads (128: decode_attn_reduce, 256: decode_attn_reduce_wide). One CTA owns the whole
// GQA group of its kv head, so K/V are read from HBM exactly once.
// Every kernel here may be launched as a programmatic dependent (PDL, sm_90+) of the kernel before it:
// it waits for the kernel before it to finish and flush (griddepcontrol.wait) before it touches global
// memory, and lets its own dependent be scheduled (griddepcontrol.launch_dependents): the tensor-core
// attention kernel once its results are stored, the SIMT one at its start, the reduction once its inputs
// are complete. So a launch overlaps the tail of the previous kernel and nothing else. Launched
// normally, both instructions are no-ops.
//
// Pools: k/v [num_pages, page_size, Hkv, HD]; tables int32 [B, table_stride]; lens int32 [B] (counting
// the new token); q [B, Hq, HD]; out float32 [B, Hq, HD]. Workspace (multi-block), float32:
//   o[B][Hq][nblk][HD] (unnormalised) | (m, l)[B][Hq][nblk] (max in the log2 domain, sum; one float2 each).
// Chunk c of sequence b covers tokens [c*chunk_len, min((c+1)*chunk_len, len_b)); it may be empty for
// sequences shorter than the longest one (m = -inf, l = 0 then). chunk_len 0 means "read it from lens[B]":
// a captured CUDA graph keeps its grid (the plan class) while each replay's chunk length is step data.
// chunk_len -1: each sequence's own chunk length, lens[B + 1 + b] (the batch-invariant split: a sequence's
// chunks, hence its bits, follow its own length only; empty trailing chunks add exact zeros in the merge).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef HD
#error "HD (head_dim) must be defined"
#endif
#ifndef DT
#define DT 2
#endif
#ifndef IMPL
#define IMPL 0
#endif
#ifndef NT
#define NT 1
#endif

#if DT == 0
typedef float T;
#define ES 4
#else
typedef u16 T;
#define ES 2
#endif

#define NEG_INF (__int_as_float(0xff800000))

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

__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait_primary() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Start of the SIMT attention kernel: let the reduction be scheduled, then wait for the previous kernel.
__device__ __forceinline__ void pdl_enter() {
  pdl_launch_dependents();
  pdl_wait_primary();
}

__device__ __forceinline__ float fast_exp2(float x) {  // exp2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ------------------------------------------------------------------------------------------------
// Workspace / output stores shared by both implementations
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ void store_result(bool multi, float* __restrict__ out, float* __restrict__ ws,
                                             int B, int Hq, int nblk, int b, int h, int blk, int d,
                                             float acc, float m, float l) {
  if (!multi) {
    out[((size_t)b * Hq + h) * HD + d] = acc / l;
  } else {
    size_t row = (size_t)b * Hq + h;
    ws[(row * nblk + blk) * HD + d] = acc;
    if (d == 0) {
      float2* ml = (float2*)(ws + (size_t)B * Hq * nblk * HD);
      ml[row * nblk + blk] = make_float2(m, l);
    }
  }
}

// The same for 4 consecutive dims d..d+3 (d a multiple of 4: 16-byte aligned rows since HD % 16 == 0).
__device__ __forceinline__ void store_result4(bool multi, float* __restrict__ out, float* __restrict__ ws,
                                              int B, int Hq, int nblk, int b, int h, int blk, int d,
                                              float4 acc, float m, float l) {
  size_t row = (size_t)b * Hq + h;
  if (!multi) {
    const float inv = 1.f / l;
    *(float4*)(out + row * HD + d) = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  } else {
    *(float4*)(ws + (row * nblk + blk) * HD + d) = acc;
    if (d == 0) {
      float2* ml = (float2*)(ws + (size_t)B * Hq * nblk * HD);
      ml[row * nblk + blk] = make_float2(m, l);
    }
  }
}

extern __shared__ __align__(16) unsigned char smem[];

#if IMPL == 1
// ================================================================================================
// Tensor-core implementation (fp16/bf16): mma.sync m16n8k16, 16 tokens x 8 query heads per MMA.
//   S^T[tok, head] = K[tok, :] . Q[head, :]        A = K tile (ldmatrix),    B = Q^T (registers)
//   O^T[dim, head] += V^T[dim, tok] . P^T[tok, head] A = V tile (ldmatrix.trans), B = P^T (movmatrix)
// Each warp streams its own 16-token blocks through a private ring of ST stages (one K slot + one V slot
// each, swizzled; cp.async, one commit group per block), so ST blocks per warp are in flight while it
// computes: ST = min(MAXST, slots / warps) from the dynamic shared memory the plan gives. Each warp keeps
// a running max / sum per head; warps are merged through shared memory at the end.
// ================================================================================================

#define NWARPS 4            // warps per CTA: the plan's block_threads (MMA_THREADS) is NWARPS * 32
#define ROWB (HD * 2)       // bytes of one token row of one kv head
#define CPR (HD / 8)        // 16-byte chunks per row
#define SLOT (16 * ROWB)    // one 16-token block of K (or of V)
#define NKS (HD / 16)       // k-steps of the QK product == m-tiles of the PV product

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// XOR swizzle of 16-byte chunks inside aligned groups of 8, so the 8 row addresses of an ldmatrix
// hit 8 different bank groups. A trailing group of fewer than 8 chunks (HD = 80, 208, ...) is left as is.
__device__ __forceinline__ int swz(int row, int c) {
  return c < (CPR & ~7) ? (c ^ (row & 7)) : c;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait0() { asm volatile("cp.async.wait_group 0;\n" ::); }
#define MAXST 4  // stages per warp at most (cp_wait_pending covers 0..MAXST-1)
__device__ __forceinline__ void cp_wait_pending(int n) {  // wait until at most n groups are in flight
  if (n >= 3) asm volatile("cp.async.wait_group 3;\n" ::);
  else if (n == 2) asm volatile("cp.async.wait_group 2;\n" ::);
  else if (n == 1) asm volatile("cp.async.wait_group 1;\n" ::);
  else asm volatile("cp.async.wait_group 0;\n" ::);
}

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ u32 movmatrix_t(u32 x) {
  u32 r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ u32 pack2(float lo, float hi) {  // lo -> low 16 bits
  u32 r;
#if DT == 1
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
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

// Pool row (token x kv head, HD elements each) of token `tok` of kv head `kvh`; lanes 0..15 each compute
// one row of a 16-token block and the others fetch it with one shuffle. -1 marks a row past the chunk
// end. 32-bit: the host checks that the pool has fewer than 2^31 rows.
__device__ __forceinline__ int row_index(const int* __restrict__ table, int tok, int t1, int page_size, int Hkv,
                                         int kvh) {
  if (tok >= t1) return -1;
  const int pi = tok / page_size;
  return (table[pi] * page_size + (tok - pi * page_size)) * Hkv + kvh;
}

// Issue the cp.async copies of one 16-token block (rows past the chunk end are zero-filled).
__device__ __forceinline__ void load_block(u32 sdst, const T* __restrict__ pool, int my_row, int lane) {
#pragma unroll
  for (int i = 0; i < (16 * CPR) / 32; ++i) {
    const int qd = lane + 32 * i;
    const int row = qd / CPR;
    const int c = qd - row * CPR;
    const int r = __shfl_sync(0xffffffffu, my_row, row);
    const T* src = pool + (size_t)(r < 0 ? 0 : r) * HD + c * 8;
    cp_async16(sdst + row * ROWB + swz(row, c) * 16, src, r < 0 ? 0 : 16);
  }
}

// Warp-level weights of the merge: for each query head, the weight 2^(m_w - M) of every warp's partial and the
// merged max M and sum L, into wsc[head][NWARPS + 2] (weights, M, L). Run by one warp: lane = head x warp.
__device__ __forceinline__ void merge_weights(const float* wm, const float* wl, float* wsc, int G, int lane) {
  constexpr int per = 32 / NWARPS;  // heads per pass
#pragma unroll 1
  for (int base = 0; base < G; base += per) {
    const int head = base + lane / NWARPS, w = lane % NWARPS;
    const bool ok = head < G;
    const float mw = ok ? wm[w * NT * 8 + head] : NEG_INF;
    const float lw = ok ? wl[w * NT * 8 + head] : 0.f;
    float M = lw > 0.f ? mw : NEG_INF;
#pragma unroll
    for (int o = 1; o < NWARPS; o <<= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    const float sc = lw > 0.f ? fast_exp2(mw - M) : 0.f;
    float L = lw * sc;
#pragma unroll
    for (int o = 1; o < NWARPS; o <<= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    if (ok) {
      wsc[head * (NWARPS + 2) + w] = sc;
      if (w == 0) {
        wsc[head * (NWARPS + 2) + NWARPS] = M;
        wsc[head * (NWARPS + 2) + NWARPS + 1] = L;
      }
    }
  }
}

// This warp's accumulators into a merge slice [G][HD + 4]: raw (weights == nullptr), or times the warp's
// per-head weight weights[head * (NWARPS + 2)] and stored (add = false) or added to what is there.
__device__ __forceinline__ void warp_to_slice(float* slice, const float (&acc)[NKS][NT][4], const float* weights,
                                              bool add, int G, int g, int t4) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int head = nt * 8 + 2 * t4 + c;
      if (head < G) {
        const float sc = weights ? weights[head * (NWARPS + 2)] : 1.f;
#pragma unroll
        for (int mt = 0; mt < NKS; ++mt)
#pragma unroll
          for (int hi = 0; hi < 2; ++hi) {
            float* dst = slice + head * (HD + 4) + mt * 16 + g + hi * 8;
            const float v = weights ? acc[mt][nt][c + 2 * hi] * sc : acc[mt][nt][c + 2 * hi];
            *dst = add ? *dst + v : v;
          }
      }
    }
}

__device__ __forceinline__ void attn_mma(bool multi, const T* __restrict__ q, const T* __restrict__ kpool,
                                         const T* __restrict__ vpool, const int* __restrict__ tables,
                                         int table_stride, const int* __restrict__ lens, float* __restrict__ out,
                                         float* __restrict__ ws, int B, int Hq, int Hkv, int page_size,
                                         int chunk_len, int nblk, int smem_bytes, float scale_log2) {
  const int blk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  if (b >= B || kvh >= Hkv) return;
  const int G = Hq / Hkv, h0 = kvh * G;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int nslots = smem_bytes / (2 * SLOT);
  const int nact = min(NWARPS, nslots);  // warps that stream K/V (>= 1: smem holds >= one K+V block)
  const int st = min(MAXST, nslots / nact);  // ring stages per streaming warp (>= 1)
  // CTA blk owns tokens [t0, t1) = [blk*chunk_len, +chunk_len) cut at the length; warp w takes its 16-token
  // blocks w, w + nact, w + 2 nact, ...
  const int* table = tables + (size_t)b * table_stride;
  pdl_wait_primary();  // nothing below reads or writes global memory before the previous kernel is done
  const int len = lens[b];
  // 0: the plan's chunk is stored after the lengths; -1: one per sequence after that
  const int chunk = chunk_len > 0 ? chunk_len : lens[chunk_len == 0 ? B : B + 1 + b];
  const int t0 = blk * chunk;
  const int t1 = min(t0 + chunk, len);
  if (t0 >= t1) {  // an empty chunk of a shorter sequence (multi-block only)
    for (int i = tid; i < G * HD; i += blockDim.x)
      store_result(multi, out, ws, B, Hq, nblk, b, h0 + i / HD, blk, i % HD, 0.f, NEG_INF, 0.f);
    pdl_launch_dependents();
    return;
  }
  const int nb16 = (t1 - t0 + 15) >> 4;

  float acc[NKS][NT][4];
  float m_run[NT][2], l_run[NT][2];
#pragma unroll
  for (int mt = 0; mt < NKS; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][nt][r] = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    m_run[nt][0] = m_run[nt][1] = NEG_INF;
    l_run[nt][0] = l_run[nt][1] = 0.f;
  }

  if (warp < nact && warp < nb16) {
    const u32 ring = smem_u32(smem) + warp * st * 2 * SLOT;  // stage s: K at ring + 2s SLOT, V right after
    // Prologue: blocks warp + s*nact into stages 0..st-1, one commit group each (empty past the end).
    // One loop, not unrolled: one copy of the load code.
#pragma unroll 1
    for (int s = 0; s < st; ++s) {
      const int j = warp + s * nact;
      if (j < nb16) {
        const int off = lane < 16 ? row_index(table, t0 + j * 16 + lane, t1, page_size, Hkv, kvh) : -1;
        load_block(ring + s * 2 * SLOT, kpool, off, lane);
        load_block(ring + s * 2 * SLOT + SLOT, vpool, off, lane);
      }
      cp_commit();
    }
    // Q^T as B fragments: b0b1 = Q[head g][k 2t, 2t+1], b2b3 = Q[head g][k 2t+8, 2t+9] per k-step.
    u32 qf[NKS][NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int head = nt * 8 + g;
      const u32* qrow = (const u32*)(q + ((size_t)b * Hq + h0 + (head < G ? head : 0)) * HD);
#pragma unroll
      for (int ks = 0; ks < NKS; ++ks) {
        qf[ks][nt][0] = head < G ? qrow[ks * 8 + t4] : 0u;
        qf[ks][nt][1] = head < G ? qrow[ks * 8 + 4 + t4] : 0u;
      }
    }
    // ldmatrix lane addressing (row, chunk-in-k-step) for K (A = K[tok, dim]) and V (A = V^T via .trans)
    const int k_row = (lane & 7) + ((lane >> 3) & 1) * 8, k_c = lane >> 4;
    const int v_row = (lane & 7) + (lane >> 4) * 8, v_c = (lane >> 3) & 1;

    int s = 0;
    for (int j = warp; j < nb16; j += nact) {
      // Consume block j (commit group of stage s) and refill stage s with block jr.
      const int jr = j + st * nact < nb16 ? j + st * nact : -1;
      int off_n = -1;  // jr's rows, looked up now so the page-table load overlaps the wait and the math
      if (jr >= 0 && lane < 16) off_n = row_index(table, t0 + jr * 16 + lane, t1, page_size, Hkv, kvh);
      const u32 sK = ring + s * 2 * SLOT, sV = sK + SLOT;

      cp_wait_pending(st - 1);  // block j (K and V) has landed; the next st-1 blocks may be in flight
      __syncwarp();
      float sc[NT][4], s2[NT][4];  // two independent MMA chains (even / odd k-steps), summed after
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) sc[nt][r] = s2[nt][r] = 0.f;
#pragma unroll
      for (int ks = 0; ks < NKS; ++ks) {
        u32 a[4];
        const int c = 2 * ks + k_c;
        ldsm_x4(a, sK + k_row * ROWB + swz(k_row, c) * 16);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma16816((ks & 1) ? s2[nt] : sc[nt], a, qf[ks][nt][0], qf[ks][nt][1]);
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) sc[nt][r] += s2[nt][r];

      // Online softmax per head (column of S^T): this thread holds tokens g, g+8 of heads 2t, 2t+1.
      const int tok_a = t0 + j * 16 + g, tok_b = tok_a + 8;
      u32 pb[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float p[4];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float sa = tok_a < t1 ? sc[nt][c] * scale_log2 : NEG_INF;
          float sb = tok_b < t1 ? sc[nt][c + 2] * scale_log2 : NEG_INF;
          float mx = fmaxf(sa, sb);
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
          const float m_new = fmaxf(m_run[nt][c], mx);  // finite: the block has a valid token
          const float alpha = fast_exp2(m_run[nt][c] - m_new);
          p[c] = fast_exp2(sa - m_new);
          p[c + 2] = fast_exp2(sb - m_new);
          l_run[nt][c] = l_run[nt][c] * alpha + p[c] + p[c + 2];
          m_run[nt][c] = m_new;
#pragma unroll
          for (int mt = 0; mt < NKS; ++mt) {
            acc[mt][nt][c] *= alpha;
            acc[mt][nt][c + 2] *= alpha;
          }
        }
        pb[nt][0] = movmatrix_t(pack2(p[0], p[1]));  // tokens 0..7 of the block
        pb[nt][1] = movmatrix_t(pack2(p[2], p[3]));  // tokens 8..15
      }

#pragma unroll
      for (int mt = 0; mt < NKS; ++mt) {
        u32 a[4];
        const int c = 2 * mt + v_c;
        ldsm_x4_t(a, sV + v_row * ROWB + swz(v_row, c) * 16);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma16816(acc[mt][nt], a, pb[nt][0], pb[nt][1]);
      }
      __syncwarp();  // every lane is done reading stage s: refill it
      if (jr >= 0) {
        load_block(sK, kpool, off_n, lane);
        load_block(sV, vpool, off_n, lane);
      }
      cp_commit();  // exactly one group per iteration (possibly empty) keeps the wait count uniform
      s = (s + 1 == st) ? 0 : s + 1;
    }
    cp_wait0();
  }
  // Full column sums of this warp.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float l = l_run[nt][c];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      l_run[nt][c] = l;
    }

  // ---- merge the warps through shared memory (the staging area is free after the barrier) ----
  // Wide path: every warp stores its raw accumulators into its own slice [G][OS] (OS = HD + 4 puts the 32
  // lanes of each store in 32 banks) and the output loop sums the slices with their weights. Serial path
  // (shared memory too small for NWARPS slices): the warps add their weighted accumulators into one slice
  // in turn. Weights (wsc) first come from the per-warp max / sum (wm, wl).
  const int OS = HD + 4;
  const bool wide = (NWARPS * G * OS + 2 * NWARPS * NT * 8 + G * (NWARPS + 2)) * 4 <= smem_bytes;
  float* obuf = (float*)smem;                     // [NWARPS or 1][G][OS]
  float* wm = obuf + (wide ? NWARPS : 1) * G * OS;  // [NWARPS][NT*8] per-warp max (log2 domain)
  float* wl = wm + NWARPS * NT * 8;              // [NWARPS][NT*8] per-warp sum
  float* wsc = wl + NWARPS * NT * 8;             // [G][NWARPS + 2] per-warp weight, then M, L
  __syncthreads();
  if (g == 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        wm[warp * NT * 8 + nt * 8 + 2 * t4 + c] = m_run[nt][c];
        wl[warp * NT * 8 + nt * 8 + 2 * t4 + c] = l_run[nt][c];
      }
  }
  if (wide) warp_to_slice(obuf + warp * G * OS, acc, nullptr, false, G, g, t4);
  __syncthreads();
  if (warp == NWARPS - 1) merge_weights(wm, wl, wsc, G, lane);
  __syncthreads();
  if (!wide) {
#pragma unroll 1
    for (int w = 0; w < NWARPS; ++w) {
      if (warp == w) warp_to_slice(obuf, acc, wsc + w, w > 0, G, g, t4);
      __syncthreads();
    }
  }
  // Output: 4 consecutive dims per thread (16-byte loads and stores); a plain loop keeps the code short.
#pragma unroll 1
  for (int i = tid; i < G * (HD / 4); i += NWARPS * 32) {
    const int head = i / (HD / 4), d = 4 * (i - head * (HD / 4));
    const float* hs = wsc + head * (NWARPS + 2);
    float4 v = *(const float4*)(obuf + head * OS + d);
    if (wide) {
      const float s0 = hs[0];
      v.x *= s0; v.y *= s0; v.z *= s0; v.w *= s0;
#pragma unroll
      for (int w = 1; w < NWARPS; ++w) {
        const float sc = hs[w];
        const float4 o = *(const float4*)(obuf + (w * G + head) * OS + d);
        v.x += sc * o.x; v.y += sc * o.y; v.z += sc * o.z; v.w += sc * o.w;
      }
    }
    store_result4(multi, out, ws, B, Hq, nblk, b, h0 + head, blk, d, v, hs[NWARPS], hs[NWARPS + 1]);
  }
  pdl_launch_dependents();  // this CTA's results are stored: the next kernel may be scheduled
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32, 1) decode_attn_single(
    const T* __restrict__ q, const T* __restrict__ kpool, const T* __restrict__ vpool,
    const int* __restrict__ tables, int table_stride, const int* __restrict__ lens, float* __restrict__ out,
    float* __restrict__ ws, int B, int Hq, int Hkv, int page_size, int chunk_len, int nblk, int kv_tile,
    int smem_bytes, float scale_log2) {
  attn_mma(false, q, kpool, vpool, tables, table_stride, lens, out, ws, B, Hq, Hkv, page_size, chunk_len, nblk,
           smem_bytes, scale_log2);
}
extern "C" __global__ void __launch_bounds__(NWARPS * 32, 1) decode_attn_multi(
    const T* __restrict__ q, const T* __restrict__ kpool, const T* __restrict__ vpool,
    const int* __restrict__ tables, int table_stride, const int* __restrict__ lens, float* __restrict__ out,
    float* __restrict__ ws, int B, int Hq, int Hkv, int page_size, int chunk_len, int nblk, int kv_tile,
    int smem_bytes, float scale_log2) {
  attn_mma(true, q, kpool, vpool, tables, table_stride, lens, out, ws, B, Hq, Hkv, page_size, chunk_len, nblk,
           smem_bytes, scale_log2);
}

#else
// ================================================================================================
// Portable implementation (float32 inputs, or GQA groups too wide for the tensor-core kernel).
// Uses exactly the dispatcher's shared-memory layout:
//   Q [G][HD] | K tile [kv_tile][HD] | V tile [kv_tile][HD] | logits f32 [G][kv_tile] | acc f32 [G][HD+2]
// (acc row: HD accumulators, running max, running sum).
// ================================================================================================

__device__ __forceinline__ void attn_simt(bool multi, const T* __restrict__ q, const T* __restrict__ kpool,
                                          const T* __restrict__ vpool, const int* __restrict__ tables,
                                          int table_stride, const int* __restrict__ lens, float* __restrict__ out,
                                          float* __restrict__ ws, int B, int Hq, int Hkv, int page_size,
                                          int chunk_len, int nblk, int tile, float scale_log2) {
  pdl_enter();
  const int blk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  if (b >= B || kvh >= Hkv) return;
  const int G = Hq / Hkv, h0 = kvh * G;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int nth = blockDim.x;
  const int len = lens[b];
  // 0: the plan's chunk is stored after the lengths; -1: one per sequence after that
  const int chunk = chunk_len > 0 ? chunk_len : lens[chunk_len == 0 ? B : B + 1 + b];
  const int t0 = blk * chunk;
  const int t1 = min(t0 + chunk, len);
  const int* table = tables + (size_t)b * table_stride;

  T* Qs = (T*)smem;
  T* Ks = Qs + G * HD;
  T* Vs = Ks + tile * HD;
  float* Ss = (float*)(Vs + tile * HD);
  float* As = Ss + G * tile;
  const int AW = HD + 2;

  for (int i = tid; i < G * HD; i += nth) Qs[i] = q[((size_t)b * Hq + h0) * HD + i];
  for (int i = tid; i < G * AW; i += nth) As[i] = (i % AW == HD) ? NEG_INF : 0.f;
  __syncthreads();

  for (int ts = t0; ts < t1; ts += tile) {
    const int n = min(tile, t1 - ts);
    for (int i = tid; i < n * HD; i += nth) {
      const int r = i / HD, d = i - r * HD;
      const int tok = ts + r, pi = tok / page_size;
      const long long page = table[pi];
      const long long off = ((page * page_size + (tok - pi * page_size)) * Hkv + kvh) * (long long)HD + d;
      Ks[i] = kpool[off];
      Vs[i] = vpool[off];
    }
    __syncthreads();
    for (int i = tid; i < G * n; i += nth) {
      const int gi = i / n, r = i - gi * n;
      float dot = 0.f;
      for (int d = 0; d < HD; ++d) dot += to_f32(Qs[gi * HD + d]) * to_f32(Ks[r * HD + d]);
      Ss[gi * tile + r] = dot * scale_log2;
    }
    __syncthreads();
    for (int gi = warp; gi < G; gi += nwarps) {
      float* srow = Ss + gi * tile;
      float* arow = As + gi * AW;
      float mx = NEG_INF;
      for (int r = lane; r < n; r += 32) mx = fmaxf(mx, srow[r]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = arow[HD];
      const float m_new = fmaxf(m_old, mx);
      const float alpha = fast_exp2(m_old - m_new);
      float sum = 0.f;
      for (int r = lane; r < n; r += 32) {
        const float p = fast_exp2(srow[r] - m_new);
        srow[r] = p;
        sum += p;
      }
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      for (int d = lane; d < HD; d += 32) arow[d] *= alpha;
      const float l_old = arow[HD + 1];
      __syncwarp();
      if (lane == 0) {
        arow[HD] = m_new;
        arow[HD + 1] = l_old * alpha + sum;
      }
    }
    __syncthreads();
    for (int i = tid; i < G * HD; i += nth) {
      const int gi = i / HD, d = i - gi * HD;
      float a = As[gi * AW + d];
      const float* srow = Ss + gi * tile;
      for (int r = 0; r < n; ++r) a += srow[r] * to_f32(Vs[r * HD + d]);
      As[gi * AW + d] = a;
    }
    __syncthreads();
  }
  for (int i = tid; i < G * HD; i += nth) {
    const int gi = i / HD, d = i - gi * HD;
    store_result(multi, out, ws, B, Hq, nblk, b, h0 + gi, blk, d, As[gi * AW + d], As[gi * AW + HD],
                 As[gi * AW + HD + 1]);
  }
}

extern "C" __global__ void __launch_bounds__(1024) decode_attn_single(
    const T* __restrict__ q, const T* __restrict__ kpool, const T* __restrict__ vpool,
    const int* __restrict__ tables, int table_stride, const int* __restrict__ lens, float* __restrict__ out,
    float* __restrict__ ws, int B, int Hq, int Hkv, int page_size, int chunk_len, int nblk, int kv_tile,
    int smem_bytes, float scale_log2) {
  attn_simt(false, q, kpool, vpool, tables, table_stride, lens, out, ws, B, Hq, Hkv, page_size, chunk_len, nblk,
            kv_tile, scale_log2);
}
extern "C" __global__ void __launch_bounds__(1024) decode_attn_multi(
    const T* __restrict__ q, const T* __restrict__ kpool, const T* __restrict__ vpool,
    const int* __restrict__ tables, int table_stride, const int* __restrict__ lens, float* __restrict__ out,
    float* __restrict__ ws, int B, int Hq, int Hkv, int page_size, int chunk_len, int nblk, int kv_tile,
    int smem_bytes, float scale_log2) {
  attn_simt(true, q, kpool, vpool, tables, table_stride, lens, out, ws, B, Hq, Hkv, page_size, chunk_len, nblk,
            kv_tile, scale_log2);
}
#endif

// Log-sum-exp merge of the chunks: out = sum_c 2^(m_c - M) o_c / sum_c 2^(m_c - M) l_c.
// Grid (B, Hq, ceil(DV / RLANES)), RGRP * RLANES threads: each CTA owns RLANES float4 columns (64 dims) of
// one (sequence, query head); its RGRP groups of RLANES threads take every RGRP-th chunk, RBATCH chunks of
// loads in flight per thread, so up to RGRP * RBATCH chunks cost one round trip to L2. Two entry points:
// decode_attn_reduce (8 groups, 128 threads) for up to 64 chunks and decode_attn_reduce_wide (16 groups) for
// up to 128 (MAX_BLOCKS_PER_SEQ). On the H200 the 8-group build merges 64 chunks 0.1-0.2 us sooner than the
// 16-group one; one build with the group count read at run time (three times the code) took 1.9 us longer.
// Each group keeps a running max (no separate max pass); the groups are merged through shared memory.
#define RLANES 16
#define RBATCH 8
#define DV (HD / 4)
template <int RGRP>
__device__ __forceinline__ void reduce_chunks(const float* __restrict__ ws, float* __restrict__ out, int B, int Hq,
                                              int nblk) {
  __shared__ float gm[RGRP], gl[RGRP];
  __shared__ __align__(16) float4 go[RGRP][RLANES];
  pdl_wait_primary();       // the attention grid is complete and its partials are visible
  pdl_launch_dependents();  // the next kernel may be scheduled now (it waits for this one in turn)
  const int b = blockIdx.x, h = blockIdx.y;
  if (b >= B || h >= Hq) return;
  const int tid = threadIdx.x, lane = tid % RLANES, grp = tid / RLANES;
  const int dv = blockIdx.z * RLANES + lane;
  const bool dok = dv < DV;
  const size_t row = (size_t)b * Hq + h;
  const float4* po = (const float4*)(ws + row * nblk * HD);
  const float2* pml = (const float2*)(ws + (size_t)B * Hq * nblk * HD) + row * nblk;
  float m_run = NEG_INF, l_run = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int c0 = grp; c0 < nblk; c0 += RGRP * RBATCH) {
    float4 o[RBATCH];
    float m[RBATCH], l[RBATCH];
#pragma unroll
    for (int i = 0; i < RBATCH; ++i) {  // all loads first: RBATCH independent requests in flight
      const int c = c0 + i * RGRP;
      const bool ok = c < nblk;
      const float2 ml = ok ? pml[c] : make_float2(NEG_INF, 0.f);
      m[i] = ml.x;
      l[i] = ml.y;
      o[i] = ok && dok ? po[(size_t)c * DV + dv] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float mb = m_run;
#pragma unroll
    for (int i = 0; i < RBATCH; ++i) mb = l[i] > 0.f ? fmaxf(mb, m[i]) : mb;
    if (mb == NEG_INF) continue;  // nothing but empty chunks so far
    const float alpha = fast_exp2(m_run - mb);  // 0 when m_run is -inf
    acc.x *= alpha; acc.y *= alpha; acc.z *= alpha; acc.w *= alpha;
    l_run *= alpha;
#pragma unroll
    for (int i = 0; i < RBATCH; ++i) {
      const float w = l[i] > 0.f ? fast_exp2(m[i] - mb) : 0.f;
      acc.x += w * o[i].x; acc.y += w * o[i].y; acc.z += w * o[i].z; acc.w += w * o[i].w;
      l_run += w * l[i];
    }
    m_run = mb;
  }
  if (lane == 0) {
    gm[grp] = m_run;
    gl[grp] = l_run;
  }
  __syncthreads();
  // Every thread finds the overall max itself (RGRP shared loads) and scales its group's sum by it.
  float M = NEG_INF;
#pragma unroll
  for (int i = 0; i < RGRP; ++i) M = fmaxf(M, gm[i]);
  const float sc = m_run == NEG_INF ? 0.f : fast_exp2(m_run - M);
  go[grp][lane] = make_float4(acc.x * sc, acc.y * sc, acc.z * sc, acc.w * sc);
  __syncthreads();
  if (tid < RLANES && dok) {
    float4 v = go[0][tid];
    float L = gm[0] == NEG_INF ? 0.f : gl[0] * fast_exp2(gm[0] - M);
#pragma unroll
    for (int i = 1; i < RGRP; ++i) {
      const float4 u = go[i][tid];
      v.x += u.x; v.y += u.y; v.z += u.z; v.w += u.w;
      L += gm[i] == NEG_INF ? 0.f : gl[i] * fast_exp2(gm[i] - M);
    }
    const float inv = 1.f / L;  // every row has a non-empty chunk 0 (lengths >= 1), so L > 0
    *(float4*)(out + row * HD + 4 * dv) = make_float4(v.x * inv, v.y * inv, v.z * inv, v.w * inv);
  }
}
extern "C" __global__ void __launch_bounds__(8 * RLANES) decode_attn_reduce(const float* __restrict__ ws,
                                                                         float* __restrict__ out, int B, int Hq,
                                                                         int nblk) {
  reduce_chunks<8>(ws, out, B, Hq, nblk);
}
extern "C" __global__ void __launch_bounds__(16 * RLANES) decode_attn_reduce_wide(const float* __restrict__ ws,
                                                                               float* __restrict__ out, int B,
                                                                               int Hq, int nblk) {
  reduce_chunks<16>(ws, out, B, Hq, nblk);
}
