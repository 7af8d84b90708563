// MoE of decode steps on tensor cores, "swap AB": the expert's WEIGHT rows are the M operand (16 rows per
// m-tile) and the step's pairs are the N operand (8 pairs per n-tile, a "group"), so an expert with one pair
// wastes 7 of 8 columns instead of 127 of 128 rows (moe_gemm.cu's prefill tiles). Host side:
// hybrid_runtime/cuda/moe_decode.py. Self-contained (no CUDA headers): NVRTC compiles it on a CPU.
//
// Compiled once per dtype with -DDT=<1 float16 | 2 bfloat16> (T): bf16/fp16 inputs, float32 accumulation
// (mma.sync.aligned.m16n8k16). Build knobs (-D, defaults below):
//   MD_GU_COLS    act columns per moe_dec_gate_up CTA (multiple of 8; its MD_GU_COLS gate + MD_GU_COLS up rows)
//   MD_DN_ROWS    y rows (rows of w_d) per moe_dec_down CTA (multiple of 16)
//   MD_GU_STAGES, MD_DN_STAGES   depth of each kernel's cp.async ring (>= 2)
//   MD_BK         k elements per ring stage (64 or 128)
//   MD_GMAX       groups of 8 pairs a CTA holds in registers per pass (1..4: up to 32 pairs)
//   MD_WARPS      warps per CTA; (MD_BK / 16) % MD_WARPS == 0
//
// Data contract: fused.cu's moe_route (or moe_gemm.cu's moe_topk + moe_group, the same buffers and bits):
//   pair_w[p]                          float32 routing weight of pair p = t * kk + slot
//   expert_off[e] .. expert_off[e+1]   the slice of pair_list holding expert e's pairs (any order)
//   active[0 .. n_active-1]            experts with at least one pair, ascending; active[E_all] = n_active
//   moe_dec_gate_up: act[p, i] = T(silu(Wg[e] . h_t) * (Wu[e] . h_t)), h_t = h + t * ldh, w_gu [E_all, 2I, H]
//                    (rows 0..I-1 gate, I..2I-1 up), act [n*kk, I] T
//   moe_dec_down:    y[t, slot, r] = pair_w[p] * (Wd[e] . act_p)[r], w_d [E_all, H, I], y [n, ny, H] float32
// Grids: (I / MD_GU_COLS, ny_grid) and (H / MD_DN_ROWS, ny_grid), ny_grid = min(E_all, n * kk); CTA (x, j)
// serves expert active[j] (exits at once when j >= active[E_all]), block MD_WARPS * 32 threads.
//
// One CTA, one pass: up to 8 * gcap of the expert's pairs (gcap = the launch's groups per pass, 1..MD_GMAX,
// a kernel argument: it sizes the shared memory; experts with more pairs take more passes, re-streaming
// their weights). Each k tile of MD_BK columns goes global -> shared with 16-byte cp.async into a ring
// stage holding the CTA's weight rows (RM) and the pass's B rows (8 per group in use: the pairs' h rows or
// act rows; rows past the pass's pairs are zero-filled, columns that a zero contributes nothing to). Shared
// rows are MD_BK * 2 bytes, their 16-byte chunks XOR-swizzled by (row & 7). Warp w takes k16 steps
// [w * SPW, (w + 1) * SPW) of every stage (split K, SPW = MD_BK / 16 / MD_WARPS): per step one ldmatrix.x2
// per group (B [pair][k] non-transposed = the col-major B fragment), one ldmatrix.x4 per m-tile (A) and an
// mma per (m-tile, group). After the last k tile the warps' accumulators meet in shared memory (the drained
// ring) and are summed in warp order 0, 1, ..., MD_WARPS-1, then the epilogue: gate_up's m-tile j holds the
// gate rows of act columns x * MD_GU_COLS + 8j .. +7 in its rows 0..7 and the up rows of the same columns in
// rows 8..15, so the accumulator fragment (rows g, g + 8) gives one column's gate and up in one thread
// (SwiGLU in registers, rounded to T); down multiplies by pair_w and writes float32 y.
//
// Batch invariance by construction: an output element (pair p, row r) is the dot product of weight row r with
// p's B row, accumulated in one fixed order - per warp, its k16 steps in k-tile order, each an m16n8k16 MMA
// (the tensor core computes every element of D from its own row of A and column of B, in an order that does
// not depend on the element's position), then the warps' partial sums added in warp order - which depends on
// the shape (H, I) and the build knobs only: never on how many pairs the expert has, which pass or group or
// column the pair lands in, or gcap. Zero columns and other pairs' columns never enter it. So a token gets the
// same bits whatever else shares the step (tests/gpu/test_moe_decode_gpu.py checks it bit for bit).
//
// Every kernel waits for the kernel before it (griddepcontrol.wait) before it reads any routing buffer, then
// lets its dependent launch (PDL), as fused.cu's kernels do.
// Shapes: K (H for gate_up, I for down) % 64 == 0 (a last k tile of 64 when MD_BK is 128 and K % 128 == 64),
// I % MD_GU_COLS == 0, H % MD_DN_ROWS == 0, ldh % 8 == 0, 16-byte aligned rows (the host checks).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef DT
#define DT 2
#endif
#if DT != 1 && DT != 2
#error "moe_decode.cu is a tensor-core path: DT must be 1 (float16) or 2 (bfloat16)"
#endif
typedef u16 T;

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
// MD_EARLY 1: the first pass issues its prologue weight copies as soon as the expert is known (before reading
// expert_off and pair_list). MD_PF_DOWN 1: gate_up prefetches the step's down weights into L2 (bulk prefetch)
// when they fit the launch's pf_limit. Neither changes any result. (An L2 evict-first policy on the weight copies,
// cp.async.cg...L2::cache_hint with createpolicy.fractional, raised CUDA_ERROR_ILLEGAL_INSTRUCTION on the H200 with
// driver 580 / NVRTC 13.0 and was dropped.)
#ifndef MD_EARLY
#define MD_EARLY 0
#endif
#ifndef MD_PF_DOWN
#define MD_PF_DOWN 0
#endif
// MD_DN_PRE 1: moe_dec_down reads its expert and issues its prologue weight copies BEFORE griddepcontrol.wait, so
// its weight stream overlaps the end of moe_dec_gate_up. Legal because down always runs right after gate_up of
// the same routing: gate_up's CTAs let down launch only after their own wait, so the routing kernel before them
// has completed and its writes are visible; they are read from L2 (ld.global.cg: an SM's L1 may hold the previous
// layer's routing). act, expert_off, pair_list and y are touched after the wait. Results unchanged.
#ifndef MD_DN_PRE
#define MD_DN_PRE 0
#endif
// CTAs per SM the register allocation must allow (__launch_bounds__): 3 keeps a batch-1 step's 288 CTAs resident
// on 132 SMs, and stops ptxas from picking 64 registers (and spilling) for the small-tile builds.
#ifndef MD_MIN_CTAS
#define MD_MIN_CTAS 3
#endif

#define MD_THREADS (MD_WARPS * 32)
#define MD_ROWB (MD_BK * 2)             // bytes of one staged row
#define MD_CPR (MD_BK / 8)              // 16-byte chunks per staged row
#define MD_SPW (MD_BK / 16 / MD_WARPS)  // k16 steps per warp per stage
#define MD_GU_RM (2 * MD_GU_COLS)       // weight rows per gate_up CTA

static_assert(MD_BK == 64 || MD_BK == 128, "MD_BK must be 64 or 128");
static_assert(MD_SPW >= 1 && (MD_BK / 16) % MD_WARPS == 0, "(MD_BK / 16) must be a multiple of MD_WARPS");
static_assert(MD_GMAX >= 1 && MD_GMAX <= 4, "MD_GMAX must be 1..4");
static_assert(MD_GU_COLS % 8 == 0 && MD_GU_COLS >= 8, "MD_GU_COLS must be a multiple of 8");
static_assert(MD_DN_ROWS % 16 == 0 && MD_DN_ROWS >= 16, "MD_DN_ROWS must be a multiple of 16");
static_assert(MD_GU_STAGES >= 2 && MD_DN_STAGES >= 2, "a ring needs at least 2 stages");
static_assert((MD_GU_RM * MD_CPR) % MD_THREADS == 0 && (MD_DN_ROWS * MD_CPR) % MD_THREADS == 0,
              "the weight chunks of a stage must divide evenly among the threads");

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

__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

extern __shared__ __align__(128) unsigned char md_smem[];

__device__ __forceinline__ int ld_cg_i32(const int* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
// Byte offset of 16-byte chunk c of staged row `row` (chunks XOR-swizzled by row & 7: ldmatrix's 8 rows of one
// logical chunk land in 8 different bank groups).
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

#define MODE_GATE_UP 0
#define MODE_DOWN 1

// One CTA of either kernel. RM weight rows (RM / 16 m-tiles), STAGES-deep ring; X = h ([n, ldx], a pair's row
// at (p / kk) * ldx) or act ([pairs, I], row p at p * ldx); W = the stacked weights; K = the reduction length.
template <int MODE, int RM, int STAGES>
__device__ __forceinline__ void dec_cta(const T* __restrict__ X, long long ldx, const T* __restrict__ W, int K, int H,
                                        int I, int kk, int ny, int E_all, int gcap, const int* __restrict__ expert_off,
                                        const int* __restrict__ pair_list, const int* __restrict__ active,
                                        const float* __restrict__ pair_w, T* __restrict__ act, float* __restrict__ y,
                                        const T* __restrict__ w_pf, long long pf_limit) {
  constexpr int MT = RM / 16;
  constexpr int NCH = RM * MD_CPR / MD_THREADS;  // weight chunks per thread per stage
  __shared__ long long s_src[8 * MD_GMAX];      // element offset of each B row's source in X (-1: zero row)
  __shared__ int s_pair[8 * MD_GMAX];
  constexpr bool PRE = MODE == MODE_DOWN && MD_DN_PRE;
  const int j = blockIdx.y;  // < gridDim.y <= E_all: active[j] is in bounds even past n_active
  int n_active, e;
  if (PRE) {
    n_active = ld_cg_i32(active + E_all);
    e = ld_cg_i32(active + j);
  } else {
    pdl_enter();
    n_active = active[E_all];
    e = active[j];
  }
  if (j >= n_active) {  // past the experts with pairs: nothing to do, nothing written
    if (PRE) pdl_enter();  // every CTA waits: the grid completes only after the one before it
    return;
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  gcap = min(max(gcap, 1), MD_GMAX);
  const int cap = 8 * gcap;                            // pairs per pass
  const u32 stage_bytes = (u32)((RM + cap) * MD_ROWB);  // RM weight rows, then cap B rows
  const int KT = (K + MD_BK - 1) / MD_BK;
  const int tail_ch = (K - (KT - 1) * MD_BK) >> 3;  // 16-byte chunks of the last k tile (MD_CPR or MD_CPR / 2)
  const u32 sbase = smem_u32(md_smem);

  // This thread's weight chunks of every stage: chunk c = tid + i * MD_THREADS is (row c / MD_CPR, chunk c %
  // MD_CPR). gate_up's staged row r: m-tile r / 16, rows 0..7 gate, 8..15 up of act columns col0 + 8 (r / 16) + r % 8.
  const T* wsrc[NCH];
  u32 wdst[NCH];
  int wch[NCH];
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    const int c = tid + i * MD_THREADS, row = c / MD_CPR, ch = c % MD_CPR;
    size_t grow;
    if (MODE == MODE_GATE_UP)
      grow = (size_t)e * 2 * I + ((row & 15) < 8 ? 0 : I) + blockIdx.x * MD_GU_COLS + (row >> 4) * 8 + (row & 7);
    else
      grow = (size_t)e * H + blockIdx.x * RM + row;
    wsrc[i] = W + grow * K + ch * 8;
    wdst[i] = soff(row, ch);
    wch[i] = ch;
  }
  // k tile kt's weight rows into ring slot `slot` (no commit)
  auto load_w = [&](int slot, int kt) {
    const u32 sW = sbase + slot * stage_bytes;
    const int k0 = kt * MD_BK;
    const int nch = kt == KT - 1 ? tail_ch : MD_CPR;
#pragma unroll
    for (int i = 0; i < NCH; ++i)
      if (wch[i] < nch) cp_async16(sW + wdst[i], wsrc[i] + k0, 16);
  };
  if (MD_EARLY || PRE) {
    // The first pass's prologue weights go out now: their addresses need e alone, so the stream starts before the
    // pair lists are read (two dependent loads fewer ahead of it); with PRE, before the wait for gate_up.
    // Committed with the pass's B rows below.
#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s)
      if (s < KT) load_w(s, s);
  }
  if (PRE) pdl_enter();
#if MD_PF_DOWN
  // gate_up: while this kernel streams its weights, bring expert e's down weights (w_pf [E_all, H, I]) into L2 -
  // this CTA its 1/gridDim.x share, in 4 KB bulk prefetches - when the whole step's down weights fit pf_limit bytes
  // (the L2 would evict them again otherwise). A hint: results never depend on it.
  if (MODE == MODE_GATE_UP && w_pf != nullptr && (long long)n_active * H * I * 2 <= pf_limit) {
    const size_t share = (size_t)H * I * 2 / gridDim.x;  // a multiple of 16 (H % 64 == 0, I / gridDim.x % 8 == 0)
    const char* src = reinterpret_cast<const char*>(w_pf) + (size_t)e * H * I * 2 + (size_t)blockIdx.x * share;
    for (size_t o = (size_t)tid * 4096; o < share; o += (size_t)MD_THREADS * 4096)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src + o), "r"((u32)min((size_t)4096, share - o))
                   : "memory");
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

    // k tile kt's B rows (the pass's pairs; zero rows up to 8 ng) into ring slot `slot` (no commit)
    auto load_b = [&](int slot, int kt) {
      const u32 sB = sbase + slot * stage_bytes + RM * MD_ROWB;
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

    float acc[MT][MD_GMAX][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int g = 0; g < MD_GMAX; ++g)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mt][g][q] = 0.f;

    // Prologue: stages 0 .. STAGES-2, one commit group each. With MD_EARLY the first pass's weights went out
    // above, uncommitted: they join the first group committed here, with every prologue stage's B rows, and
    // STAGES-2 empty groups follow. The main loop's wait for stage kt (every group but the newest STAGES-2 done)
    // then still covers it: stages 0 .. STAGES-2 are all in the first group.
    const bool early = (MD_EARLY || PRE) && base == p0;
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

#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      cp_wait<STAGES - 2>();  // k tile kt has landed (this thread's copies) ...
      __syncthreads();        // ... everyone's, and every warp is done with the slot refilled below
      const int nk = kt + STAGES - 1;
      if (nk < KT) {
        load_w(nk % STAGES, nk);
        load_b(nk % STAGES, nk);
      }
      cp_commit();  // one group per iteration (possibly empty) keeps the wait count uniform
      const u32 sW = sbase + (kt % STAGES) * stage_bytes, sB = sW + RM * MD_ROWB;
      const int nsteps = (kt == KT - 1 ? tail_ch : MD_CPR) >> 1;  // k16 steps of this tile
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
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          u32 a[4];  // A [row][k]: lanes 0-15 rows 0..15 at chunk 2ks, lanes 16-31 at 2ks + 1
          const int row = mt * 16 + (lane & 15);
          ldsm_x4(a, sW + soff(row, 2 * ks + (lane >> 4)));
#pragma unroll
          for (int g = 0; g < MD_GMAX; ++g)
            if (g < ng) mma16816(acc[mt][g], a, b[g]);
        }
      }
    }
    cp_wait<0>();
    __syncthreads();  // the ring is drained and read: it becomes the warps' partial sums

    // red[((w * MT + mt) * gcap + g) * 32 + lane]: warp w's fragment (mt, g) (RM * gcap * MD_WARPS * 32 bytes)
    float4* red = reinterpret_cast<float4*>(md_smem);
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

// grid (I / MD_GU_COLS, ny_grid), block MD_THREADS, dynamic smem (moe_decode.py smem_bytes). h [n, ldh] T;
// w_gu [E_all, 2I, H]; act [n*kk, I] T. w_d / pf_limit: the down weights to prefetch into L2 when the step's fit
// pf_limit bytes (MD_PF_DOWN builds; else unused).
extern "C" __global__ void __launch_bounds__(MD_THREADS, MD_MIN_CTAS)
    moe_dec_gate_up(const T* __restrict__ h, long long ldh, const T* __restrict__ w_gu, int H, int I, int kk,
                    int E_all, int gcap, const int* __restrict__ expert_off, const int* __restrict__ pair_list,
                    const int* __restrict__ active, T* __restrict__ act, const T* __restrict__ w_d,
                    long long pf_limit) {
  dec_cta<MODE_GATE_UP, MD_GU_RM, MD_GU_STAGES>(h, ldh, w_gu, H, H, I, kk, 0, E_all, gcap, expert_off, pair_list,
                                               active, nullptr, act, nullptr, w_d, pf_limit);
}

// grid (H / MD_DN_ROWS, ny_grid), block MD_THREADS, dynamic smem (moe_decode.py smem_bytes). act [n*kk, I] T;
// w_d [E_all, H, I]; y [n, ny, H] float32 (ny >= kk).
extern "C" __global__ void __launch_bounds__(MD_THREADS, MD_MIN_CTAS)
    moe_dec_down(const T* __restrict__ act, const T* __restrict__ w_d, const float* __restrict__ pair_w, int H, int I,
                 int kk, int ny, int E_all, int gcap, const int* __restrict__ expert_off,
                 const int* __restrict__ pair_list, const int* __restrict__ active, float* __restrict__ y) {
  dec_cta<MODE_DOWN, MD_DN_ROWS, MD_DN_STAGES>(act, I, w_d, I, H, I, kk, ny, E_all, gcap, expert_off, pair_list,
                                              active, pair_w, nullptr, y, nullptr, 0);
}
