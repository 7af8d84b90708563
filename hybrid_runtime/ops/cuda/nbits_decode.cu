// Weight-only int4 / int8 decode GEMMs (W4A16 / W8A16, 1..16 rows) straight from the packed MatMulNBits weights
// (hybrid_runtime/quant.py), on tensor cores as dense_decode.cu: the WEIGHT rows are the mma.sync M operand (16 per
// m-tile), the step's rows (tokens) the N operand (8 per n-group). Host side: hybrid_runtime/cuda/nbits_decode.py.
// Self-contained (no CUDA headers): NVRTC compiles it on a CPU.
//
//   out[j, r] = sum_k w[r, k] * xp[j, k]  (+ bias[r])  (+ R[j, r])          j < n <= 16, r < N, k < K
//   w[r, k]   = (q[r, k] - z[r, k / bs]) * scales[r, k / bs]
//   xp[j, k]  = X[j, perm[k]] (0 where perm[k] == k_in), or X[j, k] without perm (then K == k_in)
//
//   B uint8 [N, K * BITS / 8] (= [N, nb, bs * BITS / 8]; 4-bit: two codes per byte, the low nibble first along K),
//   scales float32 [N, nb], zp uint8 [N, ceil(nb / 2)] (4-bit, low nibble first along the blocks) or [N, nb]
//   (8-bit) or null (every zero-point 2^(BITS-1)), perm int32 [K] or null, nb = K / bs. X [n, ldx] T, bias float32
//   [N] or null, R float32 [n, ldr] or null (may alias out: D = C in place), out float32 or T [n, ldo].
//
// Compiled once per (dtype, bits) with -DDT=<1 float16 | 2 bfloat16> (T), -DNB_BITS=<4 | 8>. Knobs (-D):
//   NB_U      super-steps per register batch of weight loads (the 32-row kernels: NB_U / 2, at least 1); two
//             batches in flight per warp
//   NB_EXACT  4-bit only. 1: the weight is dequantised in float32, (q - z) * s, and rounded once to T, i.e. the
//             very T weight a dequantise-at-load path would hold. 0: (q - z) is made exactly in T (the 1024.0 /
//             128.0 magic-exponent trick) and multiplied by the scale rounded to T in packed T arithmetic: the same
//             bits for float16 whenever the scale is a float16 value (GPTQ's are), the scale rounded to bfloat16
//             first for bfloat16 (the host's default: ~2/3 of the instructions per code). 8-bit always runs the
//             float32 path.
//   NB_SACC   4-bit with NB_EXACT 0 only (scale on the accumulator). The MMAs multiply the integer weights q - z
//             (exact in T: |q - z| <= 15), made as NB_EXACT 0 makes them, by the activations; each super-step's
//             float32 partial of an output element is scaled once: acc += s * sum_k (q - z) x. No T rounding of the
//             weight or of the scale (closer to the quantized model than either dequantisation) and one packed
//             multiply fewer per pair of codes. A super-step's MMAs add the k of its 4 lanes' chunks, 128 codes,
//             so every one of them must lie in one block: the host runs it only for block sizes that are a
//             multiple of 128 (GPTQ's 128 and whole-row groups), a chunk's scale loaded once (NB_HALVES 1).
//
// Chunks. A lane's unit is a 16-byte CHUNK of one weight row: 32 codes (4-bit) or 16 (8-bit), one wide load
// (ld.global.nc, no L1 allocation). Super-step s of a warp: lane (g = lane / 4, t = lane % 4) loads chunk c = 4 s + t
// of rows g and g + 8 of each m-tile, so a warp reads 16 rows x 64 contiguous bytes. Chunks past the row's end
// (C = K * BITS / 128 chunks per row) load nothing and count as zero weights and zero inputs. Scales and zero-points
// of the chunk's block(s) are loaded with it (one block per chunk, except 4-bit with bs == 16: two, one per half).
//
// Fragments. A chunk is 4 32-bit words. 4-bit word i holds codes 8 i + p at bits 4 p (p = 0..7); the pair
// P_p = (code p, code p + 4) (p = 0..3) is (word >> 4 p) & 0x000f000f: two T values per pair. 8-bit word i holds
// codes 4 i + b at byte b; pairs P_0 = (code 0, code 1), P_1 = (code 2, code 3). One mma m16n8k16 takes two pairs
// of a word (P_2m, P_2m+1): a0 = P_2m of row g, a1 = of row g + 8, a2 / a3 = P_2m+1; so logical k (2t, 2t + 1) is
// P_2m's codes and (2t + 8, 2t + 9) P_2m+1's. A dot product does not care how the k of one mma are paired as long
// as A and B agree: the lane's B fragment is the same physical k of X row g of the n-group (b0 = X at P_2m's
// codes, b1 = at P_2m+1's): the chunk's X values are read once per n-group as 16-byte vectors (the _perm kernels
// gather them through perm instead) and, for 4-bit, byte-permuted into the (p, p + 4) pairs (prmt). 4-bit: 2 mmas
// per word, 8 per chunk; 8-bit: 1 per word, 4 per chunk. Steps of <= 8 rows run a loop without the second n-group.
//
// CTA = blockDim.x / 32 warps (1..8, chosen by the host from the row length) over RM = 16 MT weight rows; warp w
// takes the super-steps [S w / nw, S (w + 1) / nw) of S = ceil(C / 4) (split K). Before griddepcontrol.wait
// (programmatic dependent launch) each warp issues its first register batch of weight, scale and zero-point loads
// (never written by a step); X, perm, R and out are touched only after the wait. The warps' partial sums meet in
// shared memory and are added in warp order 0, 1, ..., nw - 1, then bias, then R.
//
// Batch invariance by construction: an output element is accumulated in one fixed order - per warp its
// super-steps in order, in each the chunk's words in order, each one or two m16n8k16 MMAs, then the warps' sums in
// warp order - which depends on (K, BITS, nw) only, never on n or on which n-group or column a token lands in
// (NB_SACC: each super-step's MMAs into a zeroed partial, then one FFMA of it into the accumulator: the same).
// Shapes (the host checks): bs % 16 == 0, K % bs == 0, K * BITS / 8 % 16 == 0, B 16-byte aligned; without perm
// K == k_in, ldx % 8 == 0 and X 16-byte aligned; any N (rows past N are clamped loads, never written); 1 <= n <= 16.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned char u8;

#ifndef DT
#define DT 2
#endif
#if DT != 1 && DT != 2
#error "nbits_decode.cu is a tensor-core path: DT must be 1 (float16) or 2 (bfloat16)"
#endif
#ifndef NB_BITS
#define NB_BITS 4
#endif
#if NB_BITS != 4 && NB_BITS != 8
#error "NB_BITS must be 4 or 8"
#endif
#ifndef NB_U
#define NB_U 2
#endif
#ifndef NB_EXACT
#define NB_EXACT 1
#endif
#ifndef NB_XPRE
#define NB_XPRE 0
#endif
#ifndef NB_PF
#define NB_PF 0
#endif
#ifndef NB_SACC
#define NB_SACC 0
#endif
#if NB_SACC != 0 && NB_SACC != 1
#error "NB_SACC must be 0 or 1"
#endif
#if NB_SACC && (NB_BITS != 4 || NB_EXACT != 0)
#error "NB_SACC needs NB_BITS 4 and NB_EXACT 0"
#endif
static_assert(NB_PF >= 0 && NB_PF <= 64, "NB_PF must be 0..64");
static_assert(NB_U >= 1 && NB_U <= 8, "NB_U must be 1..8");
#define NB_U32 (NB_U > 1 ? NB_U / 2 : 1)  // the 32-row kernels: half the batch (the same chunks in flight per lane)
#define NB_MAXW 8
#define NB_CC (128 / NB_BITS)         // codes per 16-byte chunk
#define NB_CW (NB_CC / 4)             // codes per 32-bit word
#define NB_PAIRS (NB_CW / 2)          // T pairs per word
// blocks a chunk may span (4-bit with bs == 16: two; NB_SACC runs bs % 128 == 0 only: one)
#define NB_HALVES (NB_BITS == 4 && !NB_SACC ? 2 : 1)
#define NB_ZDEF (1u << (NB_BITS - 1))

__device__ __forceinline__ float u2f(u32 u) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(u));
  return f;
}

// Two float32 values rounded to one T pair: hi in the upper half, lo in the lower (the first in k order).
__device__ __forceinline__ u32 pack2(float hi, float lo) {
  u32 d;
#if DT == 1
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#endif
  return d;
}

// (a & b) | c in one LOP3. The nibble mask comes from an opaque move, so that it stays in a register: with both
// constants as immediates ptxas re-materialised the mask before every LOP3 (one IMAD.MOV per pair of codes).
__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ u32 opaque(u32 v) {
  u32 m;
  asm volatile("mov.b32 %0, %1;" : "=r"(m) : "r"(v));
  return m;
}
__device__ __forceinline__ u16 from_f32(float v) {
  u16 h;
#if DT == 1
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  return h;
}

#if NB_EXACT == 0
// a * b + c on T pairs, rounded once.
__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
  u32 d;
#if DT == 1
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
  return d;
}
#if DT == 1
#define NB_MAGIC 0x6400u  // 1024.0: 1024 + c for c < 1024 (step 1)
#define NB_ONE 0x3C00u
#else
#define NB_MAGIC 0x4300u  // 128.0: 128 + c for c < 128 (step 1)
#define NB_ONE 0x3F80u
#endif
#endif

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

// Weights, scales, zero-points and perm: never written by a step (no L1 allocation for the streamed weights;
// legal before griddepcontrol.wait).
__device__ __forceinline__ uint4 ld_weights(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ float ld_f32(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 ld_u8(const u8* p) {
  unsigned short v;
  asm volatile("ld.global.nc.u8 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ int ld_i32(const int* p) {
  int v;
  asm volatile("ld.global.nc.s32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Everything a launch reads, in one place.
struct NbArgs {
  const u16* X;
  long long ldx;
  const u8* B;
  const float* scales;
  const u8* zp;
  const int* perm;
  int N, K, k_in, bs, bs_shift, n;
};

__device__ __forceinline__ int block_of(const NbArgs& a, int k) { return a.bs_shift >= 0 ? k >> a.bs_shift : k / a.bs; }

// One row's chunk: its 16 bytes and the scale / zero-point of the block of each half.
struct Chunk {
  uint4 w;
  float s[NB_HALVES];
  u32 z[NB_HALVES];
};

// A weight row's base pointers (computed once per CTA).
struct Row {
  const uint4* w;
  const float* s;
  const u8* z;
};

__device__ __forceinline__ Row row_ptrs(const NbArgs& a, int r) {
  const int nb = a.K / a.bs;
  Row row;
  row.w = reinterpret_cast<const uint4*>(a.B + (size_t)r * (a.K * NB_BITS / 8));
  row.s = a.scales + (size_t)r * nb;
  row.z = a.zp == nullptr ? nullptr : a.zp + (size_t)r * (NB_BITS == 4 ? (nb + 1) >> 1 : nb);
  return row;
}

// bi: the block of each half of chunk c (the same for every row).
__device__ __forceinline__ void load_chunk(Chunk& ch, const Row& row, int c, const int (&bi)[NB_HALVES], bool ok) {
  if (!ok) {  // past the row's end: a zero weight (scale 0) that reads nothing
    ch.w = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int h = 0; h < NB_HALVES; ++h) ch.s[h] = 0.f, ch.z[h] = 0u;
    return;
  }
  ch.w = ld_weights(row.w + c);
#pragma unroll
  for (int h = 0; h < NB_HALVES; ++h) {
    const int b = bi[h];
    if (h > 0 && b == bi[0]) {  // the chunk in one block (4-bit, bs >= 32): no second load
      ch.s[h] = ch.s[0], ch.z[h] = ch.z[0];
      continue;
    }
    ch.s[h] = ld_f32(row.s + b);
    if (row.z == nullptr) {
      ch.z[h] = NB_ZDEF;
    } else if (NB_BITS == 4) {
      ch.z[h] = (ld_u8(row.z + (b >> 1)) >> (4 * (b & 1))) & 15u;
    } else {
      ch.z[h] = ld_u8(row.z + b);
    }
  }
}

// The T pairs of word wi of a row's chunk (see the header: 4-bit (p, p + 4), 8-bit (0, 1), (2, 3)).
__device__ __forceinline__ void dequant_word(u32 (&P)[NB_PAIRS], const Chunk& ch, int wi) {
  const u32 w = wi == 0 ? ch.w.x : wi == 1 ? ch.w.y : wi == 2 ? ch.w.z : ch.w.w;
  const int h = NB_HALVES == 2 ? (wi >> 1) : 0;  // 4-bit: words 0, 1 are the chunk's first 16 codes
  const float s = ch.s[h];
  const u32 z = ch.z[h];
#if NB_BITS == 4 && NB_EXACT == 0
  const u32 negz = ((NB_MAGIC | z) | 0x8000u) * 0x00010001u;  // -(magic + z) in both halves, exact
#if NB_SACC
  (void)s;  // the scale goes on the super-step's partial sums (mma_batch)
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const u32 hm = lop3_and_or(w >> (4 * p), opaque(0x000f000fu), NB_MAGIC * 0x00010001u);  // magic + code, exact
    P[p] = fma2(hm, NB_ONE * 0x00010001u, negz);                               // code - z, exact
  }
#else
  const u32 s2 = pack2(s, s);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const u32 hm = lop3_and_or(w >> (4 * p), opaque(0x000f000fu), NB_MAGIC * 0x00010001u);  // magic + code, exact
    const u32 d = fma2(hm, NB_ONE * 0x00010001u, negz);                        // code - z, exact
    P[p] = fma2(d, s2, 0x80008000u);                                            // * s, rounded once
  }
#endif
#else
  const float zf = 8388608.f + (float)z;  // 2^23 + z: 2^23 + code - (2^23 + z) is exact
#if NB_BITS == 4
  const u32 m15 = opaque(15u);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const float lo = (u2f(lop3_and_or(w >> (4 * p), m15, 0x4B000000u)) - zf) * s;
    const float hi = (u2f(lop3_and_or(w >> (4 * p + 16), m15, 0x4B000000u)) - zf) * s;
    P[p] = pack2(hi, lo);
  }
#else
#pragma unroll
  for (int p = 0; p < 2; ++p) {  // prmt: bytes (code, 0, 0, 0x4B) = the float 2^23 + code, one instruction
    const float lo = (u2f(prmt(w, 0x4B000000u, 0x7440u | (2 * p))) - zf) * s;
    const float hi = (u2f(prmt(w, 0x4B000000u, 0x7440u | (2 * p + 1))) - zf) * s;
    P[p] = pack2(hi, lo);
  }
#endif
#endif
}

// The X values of a lane's chunk (op columns k0 .. k0 + NB_CC - 1 of X row xr; zero when the row or the chunk
// does not exist), 8 per uint4 in k order. PERM: gathered through perm (a build of its own).
template <bool PERM>
__device__ __forceinline__ void x_chunk(uint4 (&xv)[NB_CC / 8], const NbArgs& a, const u16* xr, int k0, bool ok) {
  if (!PERM) {
#pragma unroll
    for (int i = 0; i < NB_CC / 8; ++i)
      xv[i] = ok ? *reinterpret_cast<const uint4*>(xr + k0 + 8 * i) : make_uint4(0u, 0u, 0u, 0u);
  } else {
    u32 v[NB_CC / 2];
#pragma unroll
    for (int i = 0; i < NB_CC / 2; ++i) v[i] = 0u;
    if (ok) {
#pragma unroll
      for (int e = 0; e < NB_CC; ++e) {
        const int kk = ld_i32(a.perm + k0 + e);
        const u32 x = kk < a.k_in ? (u32)xr[kk] : 0u;  // perm[k] == k_in: the zero column
        v[e >> 1] |= x << (16 * (e & 1));
      }
    }
#pragma unroll
    for (int i = 0; i < NB_CC / 8; ++i) xv[i] = make_uint4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  }
}

// The B fragments of word wi of the chunk: the same physical k as dequant_word's pairs.
__device__ __forceinline__ void x_pairs(u32 (&xp)[NB_PAIRS], const uint4 (&xv)[NB_CC / 8], int wi) {
#if NB_BITS == 4
  const uint4 u = xv[wi];  // x0 .. x7 of the word's 8 codes
  xp[0] = prmt(u.x, u.z, 0x5410u);  // (x0, x4)
  xp[1] = prmt(u.x, u.z, 0x7632u);  // (x1, x5)
  xp[2] = prmt(u.y, u.w, 0x5410u);  // (x2, x6)
  xp[3] = prmt(u.y, u.w, 0x7632u);  // (x3, x7)
#else
  const uint4 u = xv[wi >> 1];  // x0 .. x3 of the word's 4 codes: the low or the high half
  xp[0] = (wi & 1) ? u.z : u.x;  // (x0, x1)
  xp[1] = (wi & 1) ? u.w : u.y;  // (x2, x3)
#endif
}

template <int MT, int U>
struct Batch {
  Chunk ch[U][MT][2];
};

// One batch of U super-steps of loads: ch[i][mt][h] = rows (g + 8 h) of m-tile mt, chunk 4 (s + i) + t.
template <int MT, int U>
__device__ __forceinline__ void load_batch(Batch<MT, U>& b, const NbArgs& a, const Row (&rows)[MT][2], int t, int C,
                                           int s, int s1) {
#pragma unroll
  for (int i = 0; i < U; ++i)
    if (s + i < s1) {
      const int c = 4 * (s + i) + t;
      int bi[NB_HALVES];
#pragma unroll
      for (int h = 0; h < NB_HALVES; ++h) bi[h] = block_of(a, c * NB_CC + h * (NB_CC / 2));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) load_chunk(b.ch[i][mt][h], rows[mt][h], c, bi, c < C);
    }
}

// The MMAs of one batch: X fragments of the NG n-groups (zero for rows past n) against the batch's weights.
template <int MT, int U, bool PERM, int NG>
__device__ __forceinline__ void mma_batch(float (&acc)[MT][2][4], const Batch<MT, U>& b, const NbArgs& a,
                                          const u16* const (&xr)[2], const bool (&xok)[2], int t, int C, int s, int s1) {
#if NB_XPRE
  uint4 xb[U][NG][NB_CC / 8];  // the whole batch's X fragments first
#pragma unroll
  for (int i = 0; i < U; ++i) {
    const int c = 4 * (s + i) + t;
#pragma unroll
    for (int q = 0; q < NG; ++q) x_chunk<PERM>(xb[i][q], a, xr[q], c * NB_CC, s + i < s1 && c < C && xok[q]);
  }
#endif
#pragma unroll
  for (int i = 0; i < U; ++i) {
    if (s + i >= s1) break;  // warp-uniform
#if NB_XPRE
    const uint4(&xv)[NG][NB_CC / 8] = xb[i];
#else
    const int c = 4 * (s + i) + t;
    const bool ok = c < C;
    uint4 xv[NG][NB_CC / 8];
#pragma unroll
    for (int q = 0; q < NG; ++q) x_chunk<PERM>(xv[q], a, xr[q], c * NB_CC, ok && xok[q]);
#endif
#if NB_SACC
    float part[MT][NG][4];  // the super-step's sums of (q - z) x, scaled into acc below
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int q = 0; q < NG; ++q)
#pragma unroll
        for (int c = 0; c < 4; ++c) part[mt][q][c] = 0.f;
#else
    float(&part)[MT][2][4] = acc;
#endif
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
      u32 xp[NG][NB_PAIRS];
#pragma unroll
      for (int q = 0; q < NG; ++q) x_pairs(xp[q], xv[q], wi);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        u32 lo[NB_PAIRS], hi[NB_PAIRS];  // rows g, g + 8
        dequant_word(lo, b.ch[i][mt][0], wi);
        dequant_word(hi, b.ch[i][mt][1], wi);
#pragma unroll
        for (int q = 0; q < NG; ++q) {
#pragma unroll
          for (int m = 0; m < NB_PAIRS / 2; ++m)
            mma16816(part[mt][q], lo[2 * m], hi[2 * m], lo[2 * m + 1], hi[2 * m + 1], xp[q][2 * m], xp[q][2 * m + 1]);
        }
      }
    }
#if NB_SACC
    // fragment c: row g (c < 2) or g + 8, whose chunk's scale this lane loaded: the 4 lanes of a row hold the 4
    // chunks of the super-step, all in one block (bs % 128 == 0), so each applies the same scale; past the row's
    // end the scale is 0 (and so is the partial)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int q = 0; q < NG; ++q)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mt][q][c] = fmaf(b.ch[i][mt][c >> 1].s[0], part[mt][q][c], acc[mt][q][c]);
#endif
  }
}

// The K loop of a warp: two register batches in flight, ba already loaded.
template <int MT, int U, bool PERM, int NG>
__device__ __forceinline__ void k_loop(float (&acc)[MT][2][4], Batch<MT, U>& ba, Batch<MT, U>& bb, const NbArgs& a,
                                       const Row (&rows)[MT][2], const u16* const (&xr)[2], const bool (&xok)[2],
                                       int t, int C, int s0, int s1) {
#pragma unroll 1
  for (int s = s0; s < s1; s += 2 * U) {
    load_batch<MT, U>(bb, a, rows, t, C, s + U, s1);
    mma_batch<MT, U, PERM, NG>(acc, ba, a, xr, xok, t, C, s, s1);
    load_batch<MT, U>(ba, a, rows, t, C, s + 2 * U, s1);
    mma_batch<MT, U, PERM, NG>(acc, bb, a, xr, xok, t, C, s + U, s1);
  }
}

template <int MT, int U, bool PERM>
__device__ __forceinline__ void nb_cta(const NbArgs& a, const float* __restrict__ bias, const float* R, long long ldr,
                                       void* out, long long ldo, int out_f32) {
  constexpr int RM = 16 * MT;
  __shared__ float4 red[NB_MAXW][MT][2][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * RM;
  const int C = a.K / NB_CC;  // chunks per row (the host checks K * BITS / 8 % 16 == 0)
  const int S = (C + 3) >> 2;
  // 32-bit unsigned division (S * nw < 2^22: the host keeps K < 2^24), not a 64-bit one: the weight addresses wait
  // on this split, so it is the prologue's critical path
  const int s0 = (int)((unsigned)(S * warp) / (unsigned)nw), s1 = (int)((unsigned)(S * (warp + 1)) / (unsigned)nw);
  Row rows[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) rows[mt][h] = row_ptrs(a, min(row0 + mt * 16 + g + 8 * h, a.N - 1));  // clamped
  Batch<MT, U> ba, bb;
  load_batch<MT, U>(ba, a, rows, t, C, s0, s1);  // before the wait: weights do not depend on the kernel before this one
#if NB_PF > 0
  // the next NB_PF super-steps of the warp's share into L2, also before the wait (lane t == 0 of each row: a
  // super-step's 64 bytes of a row lie in one 128-byte line); the register batches then load them from L2. The
  // 16-row kernels without act order only (the 32-row and the act-order 8-bit ones spilled at 128 registers with
  // it, NVRTC 13)
#pragma unroll 1
  for (int i = 0; i < (MT == 1 && !PERM ? NB_PF : 0); ++i) {
    const int s = s0 + U + i;
    if (s >= s1) break;
    if (t == 0)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(rows[mt][h].w + 4 * s) : "memory");
  }
#endif
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const int ng = (a.n + 7) >> 3;
  const u16* xr[2];
  bool xok[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int j = 8 * q + g;
    xok[q] = j < a.n;  // rows past n (and so n-groups past ng): zero B fragments, no loads
    xr[q] = a.X + (size_t)(j < a.n ? j : 0) * a.ldx;
  }
  float acc[MT][2][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][q][c] = 0.f;
  if (ng == 1)  // block-uniform: steps of <= 8 rows skip the second n-group's loads and MMAs entirely
    k_loop<MT, U, PERM, 1>(acc, ba, bb, a, rows, xr, xok, t, C, s0, s1);
  else
    k_loop<MT, U, PERM, 2>(acc, ba, bb, a, rows, xr, xok, t, C, s0, s1);
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
      if (j >= a.n || r >= a.N) continue;
      float o = vals[c];
      if (bias) o += bias[r];
      if (R) o += R[(size_t)j * ldr + r];
      if (out_f32)
        reinterpret_cast<float*>(out)[(size_t)j * ldo + r] = o;
      else
        reinterpret_cast<u16*>(out)[(size_t)j * ldo + r] = from_f32(o);
    }
  }
}

#define NB_PARAMS                                                                                                  \
  const u16 *__restrict__ X, long long ldx, const u8 *__restrict__ B, const float *__restrict__ scales,             \
      const u8 *__restrict__ zp, const int *__restrict__ perm, int N, int K, int k_in, int bs, int bs_shift, int n, \
      const float *__restrict__ bias, const float *R, long long ldr, void *out, long long ldo, int out_f32
#define NB_ARGS {X, ldx, B, scales, zp, perm, N, K, k_in, bs, bs_shift, n}

// grid (ceil(N / 16), 1, 1), block 32 * nw (nw 1..8); _perm: with an act-order permutation (perm not null).
extern "C" __global__ void __launch_bounds__(256) nb_gemm_m16(NB_PARAMS) {
  const NbArgs a = NB_ARGS;
  nb_cta<1, NB_U, false>(a, bias, R, ldr, out, ldo, out_f32);
}
extern "C" __global__ void __launch_bounds__(256) nb_gemm_m16_perm(NB_PARAMS) {
  const NbArgs a = NB_ARGS;
  nb_cta<1, NB_U, true>(a, bias, R, ldr, out, ldo, out_f32);
}

// grid (ceil(N / 32), 1, 1), block 32 * nw (nw 1..8).
extern "C" __global__ void __launch_bounds__(256) nb_gemm_m32(NB_PARAMS) {
  const NbArgs a = NB_ARGS;
  nb_cta<2, NB_U32, false>(a, bias, R, ldr, out, ldo, out_f32);
}
extern "C" __global__ void __launch_bounds__(256) nb_gemm_m32_perm(NB_PARAMS) {
  const NbArgs a = NB_ARGS;
  nb_cta<2, NB_U32, true>(a, bias, R, ldr, out, ldo, out_f32);
}
