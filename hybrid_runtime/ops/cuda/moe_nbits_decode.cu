// MoE of decode steps over int4 / int8 experts (W4A16 / W8A16) kept in onnxruntime's MatMulNBits layout: the same
// two launches, routing contract, grids, output layout and accumulation order as moe_decode.cu (read its header
// first), with the weight operand read PACKED from global memory. Host side: hybrid_runtime/cuda/moe_nbits_decode.py.
// Self-contained (no CUDA headers): NVRTC compiles it on a CPU.
//
// Compiled once per (dtype, bits) with -DDT=<1 float16 | 2 bfloat16> (T) and -DMN_BITS=<4 | 8>; knobs (-D) as
// moe_decode.cu's: MD_GU_COLS, MD_DN_ROWS, MD_GU_STAGES, MD_DN_STAGES, MD_BK, MD_GMAX, MD_WARPS (no L2 prefetch /
// dn_pre variants), MN_REG (0: the staged tile is dequantised into a T tile in shared memory, the first build; 1:
// each lane dequantises its own codes straight into its mma A fragments, see "MN_REG 1" below) and MN_EARLY (MN_REG
// builds: moe_decode's MD_EARLY, plus the scale loads).
//
// Weights: w_gu = E_all stacked MatMulNBits weights of [2I rows][K = H] (rows 0..I-1 gate, I..2I-1 up), w_d = E_all
// of [H rows][K = I]; the same bits and block size bs for all experts of a launch, K % bs == 0, no act order:
//   B      uint8 [E_all * R][K * BITS / 8]   codes along K; 4-bit two a byte, the low nibble first
//   scales float32 [E_all * R][nb]            nb = K / bs
//   zp     uint8 [E_all * R][zrow] or null    4-bit: zrow = ceil(nb / 2), two a byte, low nibble first; 8-bit:
//                                             zrow = nb; null: every zero-point 2^(BITS-1)
//   w[r, k] = T((q[r, k] - z[r, k / bs]) * s[r, k / bs])  computed in float32 and rounded once to T: the very T
//   weight nbits.cu's dequantise-at-load writes (q - z is exact as 2^23 + q minus 2^23 + z; the product is one
//   float32 rounding; then one cvt.rn).
//
// The pipeline: one CTA as moe_decode's, but each ring stage holds the CTA's RM weight rows PACKED (MD_BK * BITS / 8
// bytes a row, unswizzled: 64 bytes int4 / 128 bytes int8 per 128 k) plus the pass's B rows (as moe_decode). Per k
// tile kt:
//   wait for stage kt; __syncthreads  (every warp is done with the previous tile's bf16 weights and ring slot)
//   issue the copies of tile kt + STAGES - 1
//   dequantise stage kt's packed rows into WT, ONE bf16 / fp16 tile of RM rows x MD_BK (moe_decode's swizzled row
//   layout; each thread whole 8-code chunks: one 16-byte swizzled store each); __syncthreads
//   moe_decode's k16 steps on WT (A) and the stage's B rows, unchanged.
// Scales and zero-points: the CTA's rows' whole (scale, 2^23 + zero) table for its expert, float2 [RM][nb], read
// once per CTA right after the first pass's prologue copies go out (its latency overlaps them), visible from the
// main loop's first __syncthreads on.
//
// MN_REG 1 (dequantisation in registers): no T tile and one __syncthreads per k tile, as moe_decode's loop. The ring
// stages hold the packed rows with their 16-byte chunks XOR-swizzled (mn_pchunk: 8 rows' reads of one k16 step hit 8
// different bank groups). At k16 step ks of a tile, lane (g = lane / 4, t = lane % 4) builds the A fragment of
// m-tile mt from the packed codes of rows mt * 16 + g (a0, a2) and mt * 16 + g + 8 (a1, a3): a0 / a1 = k 2t, 2t + 1,
// a2 / a3 = k 2t + 8, 2t + 9 of the step - the very slots and the very T values ldmatrix.x4 gives moe_decode's loop
// (and MN_REG 0's) from the dequantised tile. int4: the step's 8 bytes of the row (one 8-byte shared load), byte t
// (codes 2t, 2t + 1, low nibble first) and byte t + 4 (codes 2t + 8, 2t + 9); int8: the step's 16 bytes, bytes 2t,
// 2t + 1 and 2t + 8, 2t + 9 (two 4-byte loads). Each code -> T((q - z) * s) as dequant8 (the same float32 operations
// and rounding); the step's (scale, zero) from the table, here laid out [block][row] (8 rows of a warp's load in 8
// banks). B fragments, MMAs, their order and the warps' sum are moe_decode's: the same bits as MN_REG 0. Depth: the
// ring keeps STAGES - 1 packed k tiles in flight per CTA (4x / 2x fewer bytes a stage than bf16: the builds give it
// more stages).
//
// Results: WT (MN_REG 0) / the A fragments (MN_REG 1) hold exactly the T weights of moe_decode's staged tile had the
// weights been dequantised at load, the k16 steps, warps, MMAs and the warps' sum are moe_decode's, so every act / y
// element has moe_decode's bits on the dequantised weights for the same MD_BK and MD_WARPS
// (tests/gpu/test_moe_nbits_decode_gpu.py checks it bit for bit), and moe_decode's batch-invariance argument holds
// unchanged (the accumulation order depends on K, MD_BK and MD_WARPS only).
// Shapes (the host checks): K % 64 == 0 (H and I), bs % 16 == 0, K % bs == 0, I % MD_GU_COLS == 0,
// H % MD_DN_ROWS == 0, ldh % 8 == 0, 16-byte aligned h / B, 4-byte aligned scales.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned char u8;

#ifndef DT
#define DT 2
#endif
#if DT != 1 && DT != 2
#error "moe_nbits_decode.cu is a tensor-core path: DT must be 1 (float16) or 2 (bfloat16)"
#endif
typedef u16 T;
#ifndef MN_BITS
#define MN_BITS 4
#endif
#if MN_BITS != 4 && MN_BITS != 8
#error "MN_BITS must be 4 or 8"
#endif

#ifndef MD_GU_COLS
#define MD_GU_COLS 16
#endif
#ifndef MD_DN_ROWS
#define MD_DN_ROWS 64
#endif
#ifndef MD_GU_STAGES
#define MD_GU_STAGES 6
#endif
#ifndef MD_DN_STAGES
#define MD_DN_STAGES 4
#endif
#ifndef MD_BK
#define MD_BK 128
#endif
#ifndef MD_GMAX
#define MD_GMAX 4
#endif
#ifndef MD_WARPS
#define MD_WARPS 4
#endif
#ifndef MD_MIN_CTAS
#define MD_MIN_CTAS 3
#endif
#ifndef MN_REG
#define MN_REG 0
#endif
#if MN_REG != 0 && MN_REG != 1
#error "MN_REG must be 0 or 1"
#endif
// MN_EARLY 1 (MN_REG builds): the first pass's prologue weight copies and the loads of this thread's first MN_TBR
// (scale, zero) table entries are issued as soon as the expert is known, before the pair lists are read (moe_decode's
// MD_EARLY for the weights: the copies join the first commit group). No result changes.
#ifndef MN_EARLY
#define MN_EARLY 0
#endif
#if MN_EARLY != 0 && MN_EARLY != 1
#error "MN_EARLY must be 0 or 1"
#endif
#if MN_EARLY && !MN_REG
#error "MN_EARLY needs MN_REG 1"
#endif
// MN_FMA 1 (int4 MN_REG builds; the host picks it only for experts whose every scale has at most 12 significant bits
// and |s| >= 2^-100 or s == 0: float16 / bfloat16-valued scales, as GPTQ checkpoints store them): each weight is one
// FFMA instead of FADD + FMUL, with the same bits. A code q at mantissa bit p of the float 2^23 + q 2^p (the
// exponent trick, p = 12 or 16: the nibble's own position after one byte permute, no shift) times s 2^-p is
// (2^(23-p) + q) s, and c_p = -(2^(23-p) + z) s is exact in float32 (at most 12 + 12 significant bits), so
// fma(2^23 + q 2^p, s 2^-p, c_p) = (q - z) s exactly, rounded once: the very float32 of (q - z) * s. The table then
// holds float4 (s 2^-16, c_16, s 2^-12, c_12) per (block, row).
#ifndef MN_FMA
#define MN_FMA 0
#endif
#if MN_FMA != 0 && MN_FMA != 1
#error "MN_FMA must be 0 or 1"
#endif
#if MN_FMA && (!MN_REG || MN_BITS != 4)
#error "MN_FMA needs MN_REG 1 and MN_BITS 4"
#endif
// MN_SACC 1 (int4 MN_REG builds, not with MN_FMA): the MMAs multiply the integer weights q - z (exact in T: |q - z| <=
// 15) by the activations, and the scale is applied to each warp's float32 partial of a k tile: acc += s * sum_k (q -
// z) x (one FFMA per accumulator element and tile, instead of one float32 dequantisation and rounding per weight). A
// lane's codes become T with the exponent trick, two per instruction: its four codes of a row and k16 step (k 2t,
// 2t + 1, 2t + 8, 2t + 9) are bytes t of the step's two packed words; one byte permute puts them in bytes 0 and 2,
// one LOP3 (mask 0x000F000F, the magic exponent bits: T 128 + q (bfloat16) / 1024 + q (float16)) gives the pair
// (2t, 2t + 8), the same after a 4-bit shift the pair (2t + 1, 2t + 9), and one HFMA2 (x 1 - (magic + z)) each the
// exact q - z. The A registers then hold k (2t, 2t + 8) and (2t + 1, 2t + 9) where mma.m16n8k16 expects (2t, 2t + 1)
// and (2t + 8, 2t + 9): the B fragments are permuted alike (two PRMT a group and k16 step), so every product pairs the
// weight and activation of one k. Results: sum_k (q - z) x exactly as the tensor cores sum it, times the float32
// scale - closer to the quantized model than T((q - z) s) weights, but NOT the bits of moe_decode on the dequantised
// weights (the other builds'); batch invariant all the same (the order depends on K, MD_BK and MD_WARPS only). Needs
// every warp's k16 steps of a k tile in one block: bs % (16 * MD_SPW) == 0 (the host checks).
#ifndef MN_SACC
#define MN_SACC 0
#endif
#if MN_SACC != 0 && MN_SACC != 1
#error "MN_SACC must be 0 or 1"
#endif
#if MN_SACC && (!MN_REG || MN_BITS != 4 || MN_FMA)
#error "MN_SACC needs MN_REG 1, MN_BITS 4 and no MN_FMA"
#endif
#define MN_SZB (MN_FMA ? 16 : 8)  // bytes of one (scale, zero) table entry
#define MN_TBR 4  // table entries per thread whose loads MN_REG builds issue together (registers), the rest one by one

#define MD_THREADS (MD_WARPS * 32)
#define MD_ROWB (MD_BK * 2)                 // bytes of one staged T row (WT and B rows)
#define MD_CPR (MD_BK / 8)                  // 16-byte T chunks (8 elements) per staged row
#define MD_SPW (MD_BK / 16 / MD_WARPS)      // k16 steps per warp per stage
#define MD_GU_RM (2 * MD_GU_COLS)           // weight rows per gate_up CTA
#define MN_PROWB (MD_BK * MN_BITS / 8)      // packed bytes of one weight row per stage (64 / 128)
#define MN_PCPR (MN_PROWB / 16)             // their 16-byte chunks (4 / 8)
#define MN_CB (8 * MN_BITS / 8)             // packed bytes of 8 codes (4 / 8)
#define MN_ZDEF (1u << (MN_BITS - 1))
#define MN_RPL (128 / MN_PROWB)             // packed rows per 128 bytes (1, 2 or 4)

static_assert(MD_BK == 64 || MD_BK == 128 || (MD_BK == 256 && MN_SACC), "MD_BK must be 64 or 128 (256: sacc builds)");
static_assert(MD_SPW >= 1 && (MD_BK / 16) % MD_WARPS == 0, "(MD_BK / 16) must be a multiple of MD_WARPS");
static_assert(MD_GMAX >= 1 && MD_GMAX <= 4, "MD_GMAX must be 1..4");
static_assert(MD_GU_COLS % 8 == 0 && MD_GU_COLS >= 8, "MD_GU_COLS must be a multiple of 8");
static_assert(MD_DN_ROWS % 16 == 0 && MD_DN_ROWS >= 16, "MD_DN_ROWS must be a multiple of 16");
static_assert(MD_GU_STAGES >= 2 && MD_DN_STAGES >= 2, "a ring needs at least 2 stages");

__device__ __forceinline__ float siluf_(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ T from_f32(float v) {
  u16 h;
#if DT == 1
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  return h;
}
// Two float32 values rounded (each once) to one T pair: hi in the upper half, lo in the lower (the first in k order).
__device__ __forceinline__ u32 pack2(float hi, float lo) {
  u32 d;
#if DT == 1
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#endif
  return d;
}
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
  float d;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
// T pair a * b + c, each half rounded once (exact here: the operands are small integers)
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 d;
#if DT == 1
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
  return d;
}
__device__ __forceinline__ u32 f2u(float f) {
  u32 u;
  asm("mov.b32 %0, %1;" : "=r"(u) : "f"(f));
  return u;
}
__device__ __forceinline__ float u2f(u32 u) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(u));
  return f;
}

__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

extern __shared__ __align__(128) unsigned char mn_smem[];

__device__ __forceinline__ float ld_nc_f32(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 ld_nc_u8(const u8* p) {
  unsigned short v;
  asm volatile("ld.global.nc.u8 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
// Byte offset of 16-byte chunk c of a staged T row (chunks XOR-swizzled by row & 7), as moe_decode.cu.
__device__ __forceinline__ u32 soff(int row, int c) { return (u32)(row * MD_ROWB + ((c ^ (row & 7)) << 4)); }
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(u32 (&r)[2], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
#if DT == 1
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Physical 16-byte chunk of packed chunk ch of staged weight row `row`: MN_REG 1 XOR-swizzles it by (row / MN_RPL)
// mod MN_PCPR, so that rows g = 0..7 of a k16 step's reads sit in 8 different 16-byte bank groups (mod 128 bytes);
// MN_REG 0 keeps the rows unswizzled (its dequantisation reads whole rows by thread).
__device__ __forceinline__ int mn_pchunk(int row, int ch) {
#if MN_REG
  return ch ^ ((row / MN_RPL) & (MN_PCPR - 1));
#else
  return ch;
#endif
}

// 8 codes (4-bit: one word, code i at bits 4 i; 8-bit: two words, code i at byte i % 4 of word i / 4) -> 8 T weights
// (q - z) * s, 4 pairs in k order. zf = 2^23 + z.
__device__ __forceinline__ uint4 dequant8(u32 w0, u32 w1, float s, float zf) {
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#if MN_BITS == 4
    const u32 q = (w0 >> (4 * i)) & 15u;
#else
    const u32 q = ((i < 4 ? w0 : w1) >> (8 * (i & 3))) & 255u;
#endif
    v[i] = (u2f(0x4B000000u | q) - zf) * s;  // 2^23 + q - (2^23 + z) = q - z exactly, then one float32 rounding
  }
  return make_uint4(pack2(v[1], v[0]), pack2(v[3], v[2]), pack2(v[5], v[4]), pack2(v[7], v[6]));
}

#define MODE_GATE_UP 0
#define MODE_DOWN 1

// Global row (in the stacked [E_all * R] weight) of staged weight row `row` of CTA column block bx, expert e.
// gate_up's staged row r: m-tile r / 16, rows 0..7 gate, 8..15 up of act columns bx * MD_GU_COLS + 8 (r / 16) + r % 8.
template <int MODE, int RM>
__device__ __forceinline__ size_t global_row(int row, int e, int bx, int H, int I) {
  if (MODE == MODE_GATE_UP)
    return (size_t)e * 2 * I + ((row & 15) < 8 ? 0 : I) + bx * MD_GU_COLS + (row >> 4) * 8 + (row & 7);
  return (size_t)e * H + (size_t)bx * RM + row;
}

// One CTA of either kernel. RM weight rows (RM / 16 m-tiles), STAGES-deep ring; X = h ([n, ldx], a pair's row at
// (p / kk) * ldx) or act ([pairs, I], row p at p * ldx); B / scales / zp = the stacked packed weights; K = the
// reduction length.
template <int MODE, int RM, int STAGES>
__device__ __forceinline__ void dec_cta(const T* __restrict__ X, long long ldx, const u8* __restrict__ B,
                                        const float* __restrict__ scales, const u8* __restrict__ zp, int bs,
                                        int bs_shift, int K, int H, int I, int kk, int ny, int E_all, int gcap,
                                        const int* __restrict__ expert_off, const int* __restrict__ pair_list,
                                        const int* __restrict__ active, const float* __restrict__ pair_w,
                                        T* __restrict__ act, float* __restrict__ y) {
  constexpr int MT = RM / 16;
  constexpr int NPC = (RM * MN_PCPR + MD_THREADS - 1) / MD_THREADS;  // packed chunks per thread per stage (at most)
  constexpr int NDQ = (RM * MD_CPR + MD_THREADS - 1) / MD_THREADS;   // 8-code chunks per thread to dequantise
  __shared__ long long s_src[8 * MD_GMAX];  // element offset of each B row's source in X (-1: zero row)
  __shared__ int s_pair[8 * MD_GMAX];
  const int j = blockIdx.y;  // < gridDim.y <= E_all: active[j] is in bounds even past n_active
  pdl_enter();
  const int n_active = active[E_all];
  if (j >= n_active) return;  // past the experts with pairs: nothing to do, nothing written
  const int e = active[j];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  gcap = min(max(gcap, 1), MD_GMAX);
  const int cap = 8 * gcap;  // pairs per pass
  const int nb = K / bs;     // blocks per row (the host checks K % bs == 0)
  const int zrow = MN_BITS == 4 ? (nb + 1) >> 1 : nb;
  const size_t prow = (size_t)K * MN_BITS / 8;  // packed bytes of a whole row
  // shared memory: WT [RM][MD_ROWB] (MN_REG 0 only) | SZ float2 [RM][nb] (MN_REG 0) or [nb][RM] (MN_REG 1) | ring
  // (STAGES x (RM packed rows, cap B rows)) or the warps' partial sums after the last k tile (moe_nbits_decode.py
  // smem_bytes)
  constexpr int WT_BYTES = MN_REG ? 0 : RM * MD_ROWB;
  const u32 sbase = smem_u32(mn_smem);
  const u32 sWT = sbase;
#if MN_FMA
  float4* s_sz = reinterpret_cast<float4*>(mn_smem + WT_BYTES);
#else
  float2* s_sz = reinterpret_cast<float2*>(mn_smem + WT_BYTES);
#endif
  const u32 ring_off = (u32)(WT_BYTES + RM * nb * MN_SZB);
  const u32 sRing = sbase + ring_off;
  const u32 stage_bytes = (u32)(RM * MN_PROWB + cap * MD_ROWB);
  const int KT = (K + MD_BK - 1) / MD_BK;
  const int tail = K - (KT - 1) * MD_BK;  // k of the last tile: MD_BK, or 64 when MD_BK is 128 and K % 128 == 64
  const int tail_ch = tail >> 3;          // its 8-element chunks
  const int tail_pch = tail * MN_BITS / 128;  // its 16-byte packed chunks

  // This thread's packed chunks of every stage: chunk c = tid + i * MD_THREADS (< RM * MN_PCPR) is (row c / MN_PCPR,
  // packed chunk c % MN_PCPR).
  const u8* psrc[NPC];
  u32 pdst[NPC];
  int pch[NPC];
#pragma unroll
  for (int i = 0; i < NPC; ++i) {
    const int c = tid + i * MD_THREADS, row = c / MN_PCPR, ch = c % MN_PCPR;
    const bool ok = c < RM * MN_PCPR;
    psrc[i] = B + (ok ? global_row<MODE, RM>(row, e, blockIdx.x, H, I) * prow : 0) + ch * 16;
    pdst[i] = (u32)(row * MN_PROWB + mn_pchunk(row, ch) * 16);
    pch[i] = ok ? ch : MN_PCPR;  // MN_PCPR: never copied
  }
  // k tile kt's packed weight rows into ring slot `slot` (no commit)
  auto load_w = [&](int slot, int kt) {
    const u32 sP = sRing + slot * stage_bytes;
    const size_t b0 = (size_t)kt * MN_PROWB;  // packed byte offset of the tile in a row
    const int nch = kt == KT - 1 ? tail_pch : MN_PCPR;
#pragma unroll
    for (int i = 0; i < NPC; ++i)
      if (pch[i] < nch) cp_async16(sP + pdst[i], psrc[i] + b0, 16);
  };
#if !MN_REG
  // stage kt's packed rows (ring slot `slot`) -> WT: chunk c = tid + i * MD_THREADS is (row c / MD_CPR, 8-code chunk
  // c % MD_CPR), k = kt * MD_BK + 8 (c % MD_CPR), its block k / bs (bs % 16 == 0: the 8 codes share one block)
  auto dequant = [&](int slot, int kt) {
    const unsigned char* sP = mn_smem + ring_off + slot * stage_bytes;
    const int nch = kt == KT - 1 ? tail_ch : MD_CPR;
#pragma unroll
    for (int i = 0; i < NDQ; ++i) {
      const int c = tid + i * MD_THREADS, row = c / MD_CPR, ch = c % MD_CPR;
      if (c < RM * MD_CPR && ch < nch) {
        const int k = kt * MD_BK + ch * 8;
        const int b = bs_shift >= 0 ? k >> bs_shift : k / bs;
        const float2 sz = s_sz[row * nb + b];
        const unsigned char* src = sP + row * MN_PROWB + ch * MN_CB;
#if MN_BITS == 4
        const u32 w0 = *reinterpret_cast<const u32*>(src), w1 = 0u;
#else
        const uint2 ww = *reinterpret_cast<const uint2*>(src);
        const u32 w0 = ww.x, w1 = ww.y;
#endif
        *reinterpret_cast<uint4*>(mn_smem + soff(row, ch)) = dequant8(w0, w1, sz.x, sz.y);
      }
    }
  };
#else
  (void)sWT;
  const int fg = lane >> 2, ft = lane & 3;  // the lane's fragment row (g) and k pair (t)
  // The lane's A fragment of m-tile mt at k16 step ks of the packed stage sP, block blk (module header, MN_REG 1).
  // mag: the exponent bits of 2^23 in a register whose value the compiler cannot fold (K > 0: the sign bit of K is
  // 0), so that each LOP3 takes its mask as the immediate and this register (two constants otherwise, one of them
  // re-materialised by an IMAD.MOV before each LOP3 under register pressure), and int8's PRMT its bytes 0x00 / 0x4B.
  const u32 mag = 0x4B000000u | ((u32)K >> 31);
#if MN_SACC
  // bytes t of w.x (codes 2t, 2t + 1) and of w.y (2t + 8, 2t + 9) into bytes 0 and 2 (1 and 3 repeat them)
  const u32 sel_s = (u32)ft | ((u32)ft << 4) | ((u32)(4 + ft) << 8) | ((u32)(4 + ft) << 12);
  // magp: the T pair (magic, magic) (128 bfloat16 / 1024 float16), in a register the compiler cannot fold (as mag)
  const u32 magp = (DT == 2 ? 0x43004300u : 0x64006400u) | ((u32)K >> 31);
  const u32 one2 = DT == 2 ? 0x3F803F80u : 0x3C003C00u;  // the T pair (1, 1)
  // The lane's A fragment of m-tile mt at k16 step ks (module header, MN_SACC): q - z as T, k (2t, 2t + 8) in a[h],
  // (2t + 1, 2t + 9) in a[2 + h]; nz[h] = the T pair -(magic + z) of row mt * 16 + g + 8 h.
  // aoff[mt][h][ss]: byte offset in a ring stage of the lane's 8 packed bytes of row mt * 16 + g + 8 h at its warp's
  // k16 step ss of a tile (loop invariant: worked out once)
  u32 aoff[MT][2][MD_SPW];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int ss = 0; ss < MD_SPW; ++ss) {
        const int row = mt * 16 + fg + 8 * h, ks = warp * MD_SPW + ss;
        aoff[mt][h][ss] = (u32)(row * MN_PROWB + (mn_pchunk(row, ks >> 1) << 4) + ((ks & 1) << 3));
      }
  auto a_frag_s = [&](u32(&a)[4], const unsigned char* sP, int mt, int ss, const u32 (&nz)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint2 w = *reinterpret_cast<const uint2*>(sP + aoff[mt][h][ss]);
      const u32 u = prmt(w.x, w.y, sel_s);
      const u32 p0 = (u & 0x000F000Fu) | magp, p1 = ((u >> 4) & 0x000F000Fu) | magp;
      a[h] = hfma2(p0, one2, nz[h]);
      a[2 + h] = hfma2(p1, one2, nz[h]);
    }
  };
#elif MN_FMA
  // byte t of w.x (codes 2t, 2t + 1) and byte t of w.y (codes 2t + 8, 2t + 9) permuted to bytes 1 / 2 (u) and 2 / 1
  // (v): code 2t at bits 16-19 of v, 2t + 1 at 12-15 of u, 2t + 8 at 16-19 of u, 2t + 9 at 12-15 of v
  const u32 sel_u = ((u32)ft << 4) | ((u32)(4 + ft) << 8), sel_v = ((u32)(4 + ft) << 4) | ((u32)ft << 8);
  auto a_frag = [&](u32(&a)[4], const unsigned char* sP, int mt, int ks, int blk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = mt * 16 + fg + 8 * h;
      const float4 sz = s_sz[blk * RM + row];  // (s 2^-16, c_16, s 2^-12, c_12)
      const uint2 w = *reinterpret_cast<const uint2*>(sP + row * MN_PROWB + (mn_pchunk(row, ks >> 1) << 4) +
                                                      ((ks & 1) << 3));
      const u32 u = prmt(w.x, w.y, sel_u), v = prmt(w.x, w.y, sel_v);
      const float d0 = fma_rn(u2f((v & 0x000F0000u) | mag), sz.x, sz.y);
      const float d1 = fma_rn(u2f((u & 0x0000F000u) | mag), sz.z, sz.w);
      const float d2 = fma_rn(u2f((u & 0x000F0000u) | mag), sz.x, sz.y);
      const float d3 = fma_rn(u2f((v & 0x0000F000u) | mag), sz.z, sz.w);
      a[h] = pack2(d1, d0);      // a0 (row g) / a1 (row g + 8): k 2t, 2t + 1
      a[2 + h] = pack2(d3, d2);  // a2 / a3: k 2t + 8, 2t + 9
    }
  };
#else
#if MN_BITS == 8
  // PRMT selectors: byte 2 (t % 2) (sel_lo) or 2 (t % 2) + 1 (sel_hi) of a word into byte 0, mag's 0x00 0x00 0x4B
  // above it: 2^23 + the code's float bits in one instruction
  const u32 sel_lo = (u32)(2 * (ft & 1)) | 0x7540u, sel_hi = (u32)(2 * (ft & 1) + 1) | 0x7540u;
#endif
  auto a_frag = [&](u32(&a)[4], const unsigned char* sP, int mt, int ks, int blk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = mt * 16 + fg + 8 * h;
      const float2 sz = s_sz[blk * RM + row];
      u32 q0, q1, q2, q3;  // 2^23 + the codes of k 2t, 2t + 1, 2t + 8, 2t + 9 of the step, as float32 bits
#if MN_BITS == 4
      // the step's 8 bytes: 16-byte chunk ks / 2, half ks % 2
      const uint2 w = *reinterpret_cast<const uint2*>(sP + row * MN_PROWB + (mn_pchunk(row, ks >> 1) << 4) +
                                                      ((ks & 1) << 3));
      const int sh = 8 * ft;  // byte t (codes 2t, 2t + 1) of w.x; byte t + 4 (codes 2t + 8, 2t + 9) = byte t of w.y
      q0 = ((w.x >> sh) & 15u) | mag;
      q1 = ((w.x >> (sh + 4)) & 15u) | mag;
      q2 = ((w.y >> sh) & 15u) | mag;
      q3 = ((w.y >> (sh + 4)) & 15u) | mag;
#else
      // the step's 16 bytes: chunk ks; bytes 2t, 2t + 1 in word t / 2, bytes 2t + 8, 2t + 9 in word 2 + t / 2
      const unsigned char* p = sP + row * MN_PROWB + (mn_pchunk(row, ks) << 4) + 4 * (ft >> 1);
      const u32 w0 = *reinterpret_cast<const u32*>(p), w1 = *reinterpret_cast<const u32*>(p + 8);
      q0 = prmt(w0, mag, sel_lo);
      q1 = prmt(w0, mag, sel_hi);
      q2 = prmt(w1, mag, sel_lo);
      q3 = prmt(w1, mag, sel_hi);
#endif
      // (2^23 + q) - (2^23 + z) = q - z exactly, times s: one float32 rounding (as dequant8)
      a[h] = pack2((u2f(q1) - sz.y) * sz.x, (u2f(q0) - sz.y) * sz.x);      // a0 (row g) / a1 (row g + 8): k 2t, 2t + 1
      a[2 + h] = pack2((u2f(q3) - sz.y) * sz.x, (u2f(q2) - sz.y) * sz.x);  // a2 / a3: k 2t + 8, 2t + 9
    }
  };
#endif
#endif
#if MN_REG
  // The (scale, 2^23 + zero) table entry i = row * nb + b of the CTA's rows (its value; stored at s_sz[b * RM + row]).
  auto tbl_load = [&](int i, float& s, u32& z) {
    const int row = i / nb, b = i - row * nb;
    const size_t gr = global_row<MODE, RM>(row, e, blockIdx.x, H, I);
    s = ld_nc_f32(scales + gr * nb + b);
    z = MN_ZDEF;
    if (zp != nullptr) {
      if (MN_BITS == 4)
        z = (ld_nc_u8(zp + gr * zrow + (b >> 1)) >> (4 * (b & 1))) & 15u;
      else
        z = ld_nc_u8(zp + gr * zrow + b);
    }
  };
  auto tbl_store = [&](int i, float s, u32 z) {
    const int row = i / nb, b = i - row * nb;
#if MN_SACC
    // (s, the T pair -(magic + z): bfloat16 0xC300 | z = -(128 + z), float16 0xE400 | z = -(1024 + z))
    s_sz[b * RM + row] = make_float2(s, u2f(((DT == 2 ? 0xC300u : 0xE400u) | z) * 0x10001u));
#elif MN_FMA
    // s 2^-16 and s 2^-12 exact (|s| >= 2^-100 or 0); c_p = -(2^(23-p) + z) s exact (<= 12 significant bits in s)
    s_sz[b * RM + row] = make_float4(s * 0x1p-16f, -(128.f + (float)z) * s, s * 0x1p-12f, -(2048.f + (float)z) * s);
#else
    s_sz[b * RM + row] = make_float2(s, 8388608.f + (float)z);
#endif
  };
#if MN_EARLY
  // The first pass's prologue weight copies go out now (their addresses need e alone), uncommitted: committed with
  // the pass's B rows below, as moe_decode's MD_EARLY.
#pragma unroll 1
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < KT) load_w(s, s);
#endif
  // This thread's first MN_TBR table entries i = tid + u * MD_THREADS: loads issued together (into registers; with
  // MN_EARLY before the pair lists are read), stored after the first pass's prologue copies.
  float tb_s[MN_TBR];
  u32 tb_z[MN_TBR];
  if (MN_EARLY) {
#pragma unroll
    for (int u = 0; u < MN_TBR; ++u)
      if (tid + u * MD_THREADS < RM * nb) tbl_load(tid + u * MD_THREADS, tb_s[u], tb_z[u]);
  }
#endif
  const int p0 = expert_off[e], p1 = expert_off[e + 1];

#pragma unroll 1
  for (int base = p0; base < p1; base += cap) {
    const int m = min(cap, p1 - base);  // this pass's pairs
    const int ng = (m + 7) >> 3;        // groups in use
    __syncthreads();                    // the previous pass is done with s_pair and with the ring
    for (int r = tid; r < 8 * ng; r += MD_THREADS) {
      const int p = r < m ? pair_list[base + r] : -1;
      s_pair[r] = p;
      s_src[r] = p < 0 ? -1ll : (MODE == MODE_GATE_UP ? (long long)(p / kk) * ldx : (long long)p * ldx);
    }
    __syncthreads();

    // k tile kt's B rows (the pass's pairs; zero rows up to 8 ng) into ring slot `slot` (no commit). Builds whose
    // B rows are at most 2 chunks a thread (8 MD_GMAX MD_CPR <= 2 MD_THREADS: gmax 1) work out each chunk's source,
    // size and place once per pass (a thread's chunks are the same (row, chunk) in every k tile); the others per tile.
    constexpr int NBC = (8 * MD_GMAX * MD_CPR + MD_THREADS - 1) / MD_THREADS;  // B chunks per thread per stage (max)
#if 8 * MD_GMAX * MD_CPR <= 2 * MD_THREADS
    const T* bsrc[NBC];
    u32 bdst[NBC];
    int bsz[NBC], bch[NBC];
#pragma unroll
    for (int i = 0; i < NBC; ++i) {
      const int c = tid + i * MD_THREADS, row = c / MD_CPR, ch = c % MD_CPR;
      const bool ok = c < 8 * ng * MD_CPR;
      const long long src = ok ? s_src[row] : -1ll;  // zero rows: src-size 0 fills 16 zero bytes, reads nothing
      bsrc[i] = X + (src < 0 ? 0ll : src) + ch * 8;
      bsz[i] = src < 0 ? 0 : 16;
      bdst[i] = (u32)(RM * MN_PROWB) + soff(row, ch);
      bch[i] = ok ? ch : MD_CPR;  // MD_CPR: never copied
    }
    auto load_b = [&](int slot, int kt) {
      const u32 sS = sRing + slot * stage_bytes;
      const int nch = kt == KT - 1 ? tail_ch : MD_CPR;
#pragma unroll
      for (int i = 0; i < NBC; ++i)
        if (bch[i] < nch) cp_async16(sS + bdst[i], bsrc[i] + kt * MD_BK, bsz[i]);
    };
#else
    (void)NBC;
    auto load_b = [&](int slot, int kt) {
      const u32 sB = sRing + slot * stage_bytes + RM * MN_PROWB;
      const int k0 = kt * MD_BK;
      const int nch = kt == KT - 1 ? tail_ch : MD_CPR;
      for (int c = tid; c < 8 * ng * MD_CPR; c += MD_THREADS) {
        const int row = c / MD_CPR, ch = c % MD_CPR;
        if (ch < nch) {
          const long long src = s_src[row];  // zero rows: src-size 0 fills 16 zero bytes, reads nothing
          cp_async16(sB + soff(row, ch), X + (src < 0 ? 0ll : src) + k0 + ch * 8, src < 0 ? 0 : 16);
        }
      }
    };
#endif

    float acc[MT][MD_GMAX][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int g = 0; g < MD_GMAX; ++g)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mt][g][q] = 0.f;

    // Prologue: stages 0 .. STAGES-2, one commit group each. With MN_EARLY the first pass's weights went out above,
    // uncommitted: they join the first group committed here with every prologue stage's B rows, and STAGES-2 empty
    // groups follow; the main loop's wait for stage kt (every group but the newest STAGES-2 done) still covers it.
    const bool early = MN_EARLY && base == p0;
#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < KT) {
        if (!early) load_w(s, s);
        load_b(s, s);
      }
      if (!early) cp_commit();
    }
    if (early)
      for (int s = 0; s < STAGES - 1; ++s) cp_commit();  // the one real group, then STAGES-2 empty ones
#if MN_REG
    if (base == p0) {
      // The table, once per CTA, while the prologue copies are in flight (the main loop's first __syncthreads
      // publishes it): the first MN_TBR entries of each thread loaded together (MN_EARLY: already in registers),
      // then stored; any further ones one by one.
#if !MN_EARLY
#pragma unroll
      for (int u = 0; u < MN_TBR; ++u)
        if (tid + u * MD_THREADS < RM * nb) tbl_load(tid + u * MD_THREADS, tb_s[u], tb_z[u]);
#endif
#pragma unroll
      for (int u = 0; u < MN_TBR; ++u)
        if (tid + u * MD_THREADS < RM * nb) tbl_store(tid + u * MD_THREADS, tb_s[u], tb_z[u]);
      for (int i = tid + MN_TBR * MD_THREADS; i < RM * nb; i += MD_THREADS) {
        float s;
        u32 z;
        tbl_load(i, s, z);
        tbl_store(i, s, z);
      }
    }
#else
    if (base == p0) {
      // The (scale, 2^23 + zero) table of the CTA's rows, once per CTA, while the prologue copies are in flight;
      // the main loop's first __syncthreads publishes it.
      for (int i = tid; i < RM * nb; i += MD_THREADS) {
        const int row = i / nb, b = i - row * nb;
        const size_t gr = global_row<MODE, RM>(row, e, blockIdx.x, H, I);
        const float s = ld_nc_f32(scales + gr * nb + b);
        u32 z = MN_ZDEF;
        if (zp != nullptr) {
          if (MN_BITS == 4)
            z = (ld_nc_u8(zp + gr * zrow + (b >> 1)) >> (4 * (b & 1))) & 15u;
          else
            z = ld_nc_u8(zp + gr * zrow + b);
        }
        s_sz[i] = make_float2(s, 8388608.f + (float)z);
      }
    }
#endif

#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      cp_wait<STAGES - 2>();  // k tile kt has landed (this thread's copies) ...
      __syncthreads();        // ... everyone's; every warp is done with WT and with the slot refilled below
      const int nk = kt + STAGES - 1;
      if (nk < KT) {
        load_w(nk % STAGES, nk);
        load_b(nk % STAGES, nk);
      }
      cp_commit();  // one group per iteration (possibly empty) keeps the wait count uniform
#if !MN_REG
      dequant(kt % STAGES, kt);
      __syncthreads();  // WT holds tile kt's T weights
#else
      const unsigned char* sP = mn_smem + ring_off + (kt % STAGES) * stage_bytes;
#endif
      const u32 sB = sRing + (kt % STAGES) * stage_bytes + RM * MN_PROWB;
      const int nsteps = (kt == KT - 1 ? tail_ch : MD_CPR) >> 1;  // k16 steps of this tile
#if MN_SACC
      // The warp's k16 steps of this tile (all in one block: bs % (16 MD_SPW) == 0) into tacc, then acc += s tacc.
      const int ks0 = warp * MD_SPW;
      if (ks0 < nsteps) {  // warp-uniform (a short last tile leaves some warps none)
        const int k16 = kt * MD_BK + ks0 * 16;
        const int blk = bs_shift >= 0 ? k16 >> bs_shift : k16 / bs;
        float sc[MT][2];
        u32 nz[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float2 e2 = s_sz[blk * RM + mt * 16 + fg + 8 * h];
            sc[mt][h] = e2.x;
            nz[mt][h] = f2u(e2.y);
          }
        float tacc[MT][MD_GMAX][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int g = 0; g < MD_GMAX; ++g)
#pragma unroll
            for (int q = 0; q < 4; ++q) tacc[mt][g][q] = 0.f;
#pragma unroll
        for (int ss = 0; ss < MD_SPW; ++ss) {
          const int ks = ks0 + ss;
          if (ks >= nsteps) break;  // warp-uniform
          u32 b[MD_GMAX][2];
#pragma unroll
          for (int g = 0; g < MD_GMAX; ++g) {
            if (g < ng) {  // as below, then k (2t, 2t + 8) in b[g][0] and (2t + 1, 2t + 9) in b[g][1]
              const int row = 8 * g + (lane & 7);
              u32 bb[2];
              ldsm_x2(bb, sB + soff(row, 2 * ks + ((lane >> 3) & 1)));
              b[g][0] = prmt(bb[0], bb[1], 0x5410u);
              b[g][1] = prmt(bb[0], bb[1], 0x7632u);
            }
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            u32 a[4];
            a_frag_s(a, sP, mt, ss, nz[mt]);
#pragma unroll
            for (int g = 0; g < MD_GMAX; ++g)
              if (g < ng) mma16816(tacc[mt][g], a, b[g]);
          }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int g = 0; g < MD_GMAX; ++g)
            if (g < ng) {  // d0, d1: row g; d2, d3: row g + 8
              acc[mt][g][0] = fma_rn(sc[mt][0], tacc[mt][g][0], acc[mt][g][0]);
              acc[mt][g][1] = fma_rn(sc[mt][0], tacc[mt][g][1], acc[mt][g][1]);
              acc[mt][g][2] = fma_rn(sc[mt][1], tacc[mt][g][2], acc[mt][g][2]);
              acc[mt][g][3] = fma_rn(sc[mt][1], tacc[mt][g][3], acc[mt][g][3]);
            }
      }
#else
#pragma unroll
      for (int ss = 0; ss < MD_SPW; ++ss) {
        const int ks = warp * MD_SPW + ss;
        if (ks >= nsteps) break;  // warp-uniform (a short last tile)
        u32 b[MD_GMAX][2];
#pragma unroll
        for (int g = 0; g < MD_GMAX; ++g) {
          if (g < ng) {  // B [pair][k]: lanes 0-7 rows 8g.. at chunk 2ks (k 0..7), lanes 8-15 at 2ks + 1
            const int row = 8 * g + (lane & 7);
            ldsm_x2(b[g], sB + soff(row, 2 * ks + ((lane >> 3) & 1)));
          }
        }
#if MN_REG
        const int k16 = kt * MD_BK + ks * 16;  // bs % 16 == 0: the step lies in one block
        const int blk = bs_shift >= 0 ? k16 >> bs_shift : k16 / bs;
#endif
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          u32 a[4];
#if !MN_REG
          // A [row][k]: lanes 0-15 rows 0..15 at chunk 2ks, lanes 16-31 at 2ks + 1
          const int row = mt * 16 + (lane & 15);
          ldsm_x4(a, sWT + soff(row, 2 * ks + (lane >> 4)));
#else
          a_frag(a, sP, mt, ks, blk);
#endif
#pragma unroll
          for (int g = 0; g < MD_GMAX; ++g)
            if (g < ng) mma16816(acc[mt][g], a, b[g]);
        }
      }
#endif
    }
    cp_wait<0>();
    __syncthreads();  // the ring is drained and read: it becomes the warps' partial sums

    // red[((w * MT + mt) * gcap + g) * 32 + lane]: warp w's fragment (mt, g) (RM * gcap * MD_WARPS * 32 bytes)
    float4* red = reinterpret_cast<float4*>(mn_smem + ring_off);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int g = 0; g < MD_GMAX; ++g)
        if (g < ng)
          red[((warp * MT + mt) * gcap + g) * 32 + lane] =
              make_float4(acc[mt][g][0], acc[mt][g][1], acc[mt][g][2], acc[mt][g][3]);
    __syncthreads();
    const int gl = lane >> 2, t4 = lane & 3;  // fragment rows gl, gl + 8; columns (pairs) 2 t4, 2 t4 + 1
    for (int f = warp; f < MT * ng; f += MD_WARPS) {
      const int mt = f / ng, g = f - mt * ng;
      float4 v = red[(mt * gcap + g) * 32 + lane];
#pragma unroll
      for (int w = 1; w < MD_WARPS; ++w) {  // fixed order: warp 0 + warp 1 + ...
        const float4 u = red[((w * MT + mt) * gcap + g) * 32 + lane];
        v.x += u.x;
        v.y += u.y;
        v.z += u.z;
        v.w += u.w;
      }
      const float lo[2] = {v.x, v.y}, hi[2] = {v.z, v.w};  // rows gl / gl + 8 of columns 2 t4, 2 t4 + 1
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int q = 8 * g + 2 * t4 + c;
        if (q >= m) continue;
        const int p = s_pair[q];
        if (MODE == MODE_GATE_UP) {
          const int i = blockIdx.x * MD_GU_COLS + mt * 8 + gl;  // rows gl: gate of column i, gl + 8: its up
          act[(size_t)p * I + i] = from_f32(siluf_(lo[c]) * hi[c]);
        } else {
          const int t = p / kk, slot = p - t * kk;
          const float w = pair_w[p];
          float* dst = y + ((size_t)t * ny + slot) * H + blockIdx.x * RM + mt * 16 + gl;
          dst[0] = w * lo[c];
          dst[8] = w * hi[c];
        }
      }
    }
  }
}

// grid (I / MD_GU_COLS, ny_grid), block MD_THREADS, dynamic smem (moe_nbits_decode.py smem_bytes). h [n, ldh] T;
// w_gu packed [E_all * 2I][H * BITS / 8] (+ scales, zp); act [n*kk, I] T.
extern "C" __global__ void __launch_bounds__(MD_THREADS, MD_MIN_CTAS)
    moe_nb_gate_up(const T* __restrict__ h, long long ldh, const u8* __restrict__ B, const float* __restrict__ scales,
                   const u8* __restrict__ zp, int bs, int bs_shift, int H, int I, int kk, int E_all, int gcap,
                   const int* __restrict__ expert_off, const int* __restrict__ pair_list,
                   const int* __restrict__ active, T* __restrict__ act) {
  dec_cta<MODE_GATE_UP, MD_GU_RM, MD_GU_STAGES>(h, ldh, B, scales, zp, bs, bs_shift, H, H, I, kk, 0, E_all, gcap,
                                               expert_off, pair_list, active, nullptr, act, nullptr);
}

// grid (H / MD_DN_ROWS, ny_grid), block MD_THREADS, dynamic smem (moe_nbits_decode.py smem_bytes). act [n*kk, I] T;
// w_d packed [E_all * H][I * BITS / 8] (+ scales, zp); y [n, ny, H] float32 (ny >= kk).
extern "C" __global__ void __launch_bounds__(MD_THREADS, MD_MIN_CTAS)
    moe_nb_down(const T* __restrict__ act, const u8* __restrict__ B, const float* __restrict__ scales,
                const u8* __restrict__ zp, int bs, int bs_shift, const float* __restrict__ pair_w, int H, int I,
                int kk, int ny, int E_all, int gcap, const int* __restrict__ expert_off,
                const int* __restrict__ pair_list, const int* __restrict__ active, float* __restrict__ y) {
  dec_cta<MODE_DOWN, MD_DN_ROWS, MD_DN_STAGES>(act, I, B, scales, zp, bs, bs_shift, I, H, I, kk, ny, E_all, gcap,
                                              expert_off, pair_list, active, pair_w, nullptr, y);
}
