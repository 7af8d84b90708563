// The prefill MoE's two grouped GEMMs on Hopper warpgroup MMA, warp-specialised and persistent (impl "wgmma_ws",
// sm_90a only): the same launch contract (kernel names and arguments), tile list, outputs and epilogues as
// moe_wgmma.cu's default build (128 x 256 tiles, m64n256k16, the same 128B-swizzled K-major stage layout and
// matrix descriptors), scheduled differently:
//
// * 384 threads = two consumer warpgroups (0, 1: rows [64 w, 64 w + 64) of the tile, wgmma only) and one producer
//   warpgroup (2: cp.async copies only), synchronised per stage by mbarriers instead of __syncthreads:
//     full[s]  (128 arrivals: every producer thread) - stage s holds the k tile the consumers want next;
//     empty[s] (256 arrivals: every consumer thread) - the wgmmas that read stage s have completed.
//   A global stage counter g (continuous over the CTA's work items) picks stage g % WS_STAGES and round
//   g / WS_STAGES; the consumers wait full[s] for phase parity round & 1, the producer waits empty[s] for
//   parity (round & 1) ^ 1 (round 0: a fresh barrier's "previous phase" counts as complete: no wait).
// * Producer step g: wait empty, issue the 16-byte cp.async copies of stage g (zero-fill past the tile's rows),
//   commit (one group per stage), cp.async.wait_group WS_LAG (this thread's copies of stage g - WS_LAG have
//   landed), fence.proxy.async (generic-proxy writes -> visible to the async proxy, as moe_wgmma.cu does before
//   its barrier), mbarrier.arrive on full[(g - WS_LAG) % S] (release; the consumers' try_wait acquires). The
//   last WS_LAG stages are flushed the same way after the last item. No deadlock needs WS_LAG <= WS_STAGES - 2
//   (the consumers free stage g - S once they have issued the MMAs of g - S + 1).
// * Consumer step g: wait full, the 4 wgmmas of the k tile, commit, wgmma.wait_group 1 (the previous k tile's
//   MMAs have completed: consecutive k tiles overlap on the tensor cores), arrive on that previous tile's empty
//   barrier. After an item's last k tile: wait_group 0 and the epilogue, while the producer already fills the
//   other stages for the next item. Epilogue (WS_STAGED_EPI, the default; not for float32 y): a barrier of the
//   256 consumers (both warpgroups' MMAs have read the item's last stage), the fragments written into that stage
//   (padded rows: no bank conflicts), a barrier, 16-byte coalesced copies to the pairs' rows (down: two passes of
//   128 columns), a barrier, then the stage freed. The pair ids (and down's weights) are loaded at the item's
//   start, their latency hidden by its MMAs. (Stores straight from the accumulators, the float32 y path and
//   -DWS_STAGED_EPI=0, left down 17% slower at 8192 tokens, H200: each warp store wrote 16 bytes of 8 rows.)
// * Persistent: grid = min(#SMs, items bound) CTAs; CTA b runs work items b, b + gridDim.x, ... < tiles[0] * nx,
//   item = tile * nx + x (x fastest, the column blocks of a tile side by side: the order of the non-persistent
//   grid, so an expert's weight slab is read by its tiles at about the same time).
// * Deadlock guard: a wait that has not completed after ~2^34 cycles (seconds) traps (a launch error, never a
//   hang) - it never fires in a correct run.
// Each output element comes from one pair's row alone with a fixed k order (k tiles ascending, 4 k16 steps each):
// batch invariance holds; no atomics.
// Compiled by NVRTC for sm_90a with -DDT=<1 float16 | 2 bfloat16>. No CUDA headers (mbarrier.cuh: the mbarrier
// helpers). Host: cuda/moe_prefill.py.
//
// Packed experts (-DWS_NBITS=<4 | 8>: a GPTQ bundle's int4 / int8 expert stacks kept packed, `packed_weights`): the
// moe_wgmma_nb_* entry points take the stacks in MatMulNBits layout (hybrid_runtime/cuda/quant.py PackedLinear: codes
// [E, N, K * bits / 8] along K, low nibble first; float32 scales [E, N * nb]; zero-points as int32 [E, N * nb] or
// none = 2^(bits - 1); nb = K / bs, no act order) and the producer builds each stage's weight tile itself: its
// 16-byte code chunks (32 k of a row in int4, 16 in int8), their scale and zero-point go global -> a staging ring of
// WS_LAG + 1 slots by cp.async with the stage's activations; once its copies of stage g - WS_LAG have landed, the
// thread turns exactly the chunks it copied into bf16 / fp16, (float)(q - z) * s rounded once (cvt.rn), and stores
// them into the stage's 128B-swizzled weight tile, then signals the stage full. Those are nbits.cu nbits_dequant8's
// values bit for bit, and the consumers are unchanged: the packed GEMMs give the bits of dequantise-then-GEMM, while
// the weight stream reads 4x (int4) / 2x (int8) fewer bytes and nothing is written back.
// Shapes: H % 256 == 0, I % 128 == 0, H and I % 64 == 0, ldh % 8 == 0 (the host checks).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef DT
#define DT 2
#endif
#if DT != 1 && DT != 2
#error "moe_wgmma_ws.cu is the tensor-core path: DT must be 1 (float16) or 2 (bfloat16)"
#endif
#if DT == 1
#define WS_TY "f16"
#else
#define WS_TY "bf16"
#endif
typedef u16 T;

#define WS_BM 128  // rows per tile: moe_gemm.cu's GEMM_BM (the tile list's)
#define WS_BN 256  // weight rows per work item (gate_up: 128 gate + 128 up rows)
#ifndef WS_STAGES
#define WS_STAGES 4
#endif
#ifndef WS_LAG
#define WS_LAG 1  // stages a producer thread keeps in flight before it waits for its oldest copies
#endif
#if WS_LAG < 1 || WS_LAG > WS_STAGES - 2
#error "WS_LAG must be in [1, WS_STAGES - 2]"
#endif
#define WS_ACC (WS_BN / 2)  // accumulator registers a consumer thread (64 x 256 float32 over 128 threads)
#define WS_BK 64            // k per stage: one 128-byte swizzle row
#define WS_CONSUMERS 256    // two consumer warpgroups
#define WS_PRODUCERS 128    // one producer warpgroup
#define WS_THREADS 384
#define WS_ROWB (WS_BK * 2)
#define WS_A_BYTES (WS_BM * WS_ROWB)
#define WS_B_BYTES (WS_BN * WS_ROWB)
#define WS_STAGE_BYTES (WS_A_BYTES + WS_B_BYTES)
// the stages + 1 KB to align the ring to 1024 bytes (the 128B-swizzle atom)
#define WS_SMEM (WS_STAGES * WS_STAGE_BYTES + 1024)  // + WS_NB_BYTES in the packed builds
#define WS_SBO 1024        // bytes from one 8-row atom to the next (M / N direction)
#define WS_LBO 16          // K direction: unused by K-major 128B-swizzle layouts
#define WS_SWIZZLE_128B 1  // descriptor bits 62-63
#define WS_PROD_ROWS 16    // rows a producer pass covers: 128 threads = 16 rows x 8 chunks
#define WS_EPI_ROWB 272            // staged epilogue row: 128 bf16 / fp16 columns + 16 bytes of pad
#define WS_EPI_COPIES (WS_BM * 16 / WS_CONSUMERS)  // 16-byte copies per consumer thread and pass (staged)
#ifndef WS_STAGED_EPI
#define WS_STAGED_EPI 1  // 0: the epilogue stores straight from the accumulators (down 17% slower at 8192 tokens)
#endif
#if WS_BM * WS_EPI_ROWB > WS_A_BYTES + WS_B_BYTES
#error "the staged epilogue must fit in one stage"
#endif
#define MODE_GATE_UP 0
#define MODE_DOWN 1
#ifndef WS_NBITS
#define WS_NBITS 0  // 0: T weights; 4 / 8: packed experts (the moe_wgmma_nb_* entry points)
#endif
#if WS_NBITS != 0 && WS_NBITS != 4 && WS_NBITS != 8
#error "WS_NBITS must be 0, 4 or 8"
#endif
#if WS_NBITS
#define WS_NB_CPR (WS_NBITS / 2)                // 16-byte code chunks per weight row and stage (64 k * bits / 8 / 16)
#define WS_NB_KPC (128 / WS_NBITS)              // k per code chunk: 32 (int4) / 16 (int8)
#define WS_NB_RPP (WS_PRODUCERS / WS_NB_CPR)    // weight rows per producer pass: 64 / 32
#define WS_NB_J (WS_BN / WS_NB_RPP)             // code chunks per producer thread and stage: 4 / 8
#define WS_NB_SLOTS (WS_LAG + 1)                // staging slots (a stage's copies wait WS_LAG stages)
#define WS_NB_CHUNKS (WS_PRODUCERS * WS_NB_J)   // code chunks per stage
#define WS_NB_SLOT_BYTES (WS_NB_CHUNKS * 24)    // per chunk: 16 bytes of codes, a float32 scale, an int32 zero-point
#define WS_NB_BYTES (WS_NB_SLOTS * WS_NB_SLOT_BYTES)
#else
#define WS_NB_BYTES 0
#endif

// The fast intrinsics (ex2.approx, a reciprocal): the precise expf and IEEE division made gate_up 7% slower (H200,
// 8192 tokens). moe_wgmma.cu and moe_gemm.cu use the same, so every prefill build gives the same act bits. For
// x < -87 the sum is inf and the quotient -0 (silu's limit).
__device__ __forceinline__ float siluf_(float x) { return __fdividef(x, 1.f + __expf(-x)); }

__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

extern __shared__ __align__(1024) unsigned char ws_smem[];

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
// Byte offset of 16-byte chunk c (k elements 8c .. 8c + 7) of row `row` in a 1024-aligned operand tile.
__device__ __forceinline__ u32 ws_off(int row, int c) { return (u32)(row * WS_ROWB + ((c ^ (row & 7)) << 4)); }
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#include "mbarrier.cuh"

__device__ __forceinline__ u32 pack2(float lo, float hi) {  // lo -> low 16 bits
  u32 r;
#if DT == 1
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
// Two adjacent y elements of the down epilogue: float32, or (the _t entry point) rounded once to T (round to nearest
// even, cvt.rn: the only rounding the T slots add to the float32 products).
__device__ __forceinline__ void store_y2(float* dst, float a, float b) { *(float2*)dst = make_float2(a, b); }
__device__ __forceinline__ void store_y2(T* dst, float a, float b) { *(u32*)dst = pack2(a, b); }

template <typename Y>
struct is_t {  // whether Y is the bundle dtype T (the down_t kernel), i.e. not float32
  static constexpr bool value = false;
};
template <>
struct is_t<T> {
  static constexpr bool value = true;
};
__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}
// The two consumer warpgroups only (named barrier 1; the producer warpgroup never waits on it).
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(WS_CONSUMERS) : "memory"); }

// Matrix descriptor of a K-major, 128B-swizzled operand tile at shared address `saddr` (1024-aligned; + 32 s for
// the k16 step s): moe_wgmma.cu's wg_desc.
__device__ __forceinline__ u64 ws_desc(u32 saddr) {
  return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)(WS_LBO >> 4) << 16) | ((u64)(WS_SBO >> 4) << 32) |
         ((u64)WS_SWIZZLE_128B << 62);
}

#define ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                "+f"(d[i + 6]), "+f"(d[i + 7])
#define ACC64(o) ACC8(o), ACC8(o + 8), ACC8(o + 16), ACC8(o + 24), ACC8(o + 32), ACC8(o + 40), ACC8(o + 48), \
                 ACC8(o + 56)
#define ACC_ALL ACC64(0), ACC64(64)

// Keeps the compiler from moving accumulator register accesses across the asynchronous MMAs.
__device__ __forceinline__ void acc_fence(float (&d)[WS_ACC]) { asm volatile("" : ACC_ALL::"memory"); }

// D[64 x 256] += A[64 x 16] B[256 x 16]^T, both K-major in shared memory (descriptors da, db).
__device__ __forceinline__ void wgmma_k16(float (&d)[WS_ACC], u64 da, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." WS_TY "." WS_TY " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : ACC_ALL
      : "l"(da), "l"(db), "r"(1));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

#if WS_NBITS
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void st_shared_v4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// Two codes -> two T (round to nearest even), as nbits.cu: (float)(q - z) * s, one rounding. q - z without I2F (16
// conversions a clock per SM; 1k-token TTFT 61.0 ms with it, 43.7 without, consecutive runs): the float with bits
// 0x4B000000 | q is 2^23 + q exactly, and subtracting zf = 2^23 + z is exact, so the product and its rounding are
// nbits.cu's bit for bit.
__device__ __forceinline__ u32 nb_pair(u32 q0, u32 q1, float zf, float s) {
  return pack2((__uint_as_float(q0 | 0x4B000000u) - zf) * s, (__uint_as_float(q1 | 0x4B000000u) - zf) * s);
}
// The code chunks this producer thread copied into staging slot sQ, dequantised into the stage's weight tile sB
// (128B-swizzled, K-major: ws_off). Chunk c = j * WS_PRODUCERS + ptid is weight row rr + WS_NB_RPP * j, k
// [part * WS_NB_KPC, +WS_NB_KPC) of the stage (part = ptid % WS_NB_CPR, rr = ptid / WS_NB_CPR).
__device__ __forceinline__ void nb_convert(u32 sQ, u32 sB, int ptid, bool has_zp) {
  const int part = ptid % WS_NB_CPR, rr = ptid / WS_NB_CPR;
#pragma unroll
  for (int j = 0; j < WS_NB_J; ++j) {
    const int c = j * WS_PRODUCERS + ptid;
    const uint4 q = ld_shared_v4(sQ + 16 * c);
    const float s = __uint_as_float(ld_shared_u32(sQ + WS_NB_CHUNKS * 16 + 4 * c));
    const int z = has_zp ? (int)ld_shared_u32(sQ + WS_NB_CHUNKS * 20 + 4 * c) : (1 << (WS_NBITS - 1));
    const float zf = 8388608.f + (float)z;  // 2^23 + z, exact (z < 256)
    const int row = rr + WS_NB_RPP * j;
    const u32 w[4] = {q.x, q.y, q.z, q.w};
#if WS_NBITS == 4
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // word i: k 8i .. 8i + 7 of the chunk (low nibble first) -> 16-byte chunk 4 part + i
      u32 o[4];
#pragma unroll
      for (int h = 0; h < 4; ++h) o[h] = nb_pair((w[i] >> (8 * h)) & 15u, (w[i] >> (8 * h + 4)) & 15u, zf, s);
      st_shared_v4(sB + ws_off(row, 4 * part + i), o[0], o[1], o[2], o[3]);
    }
#else
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // words 2i, 2i + 1: k 8i .. 8i + 7 of the chunk -> 16-byte chunk 2 part + i
      u32 o[4];
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const u32 ww = w[2 * i + (h >> 1)], sh = 16 * (h & 1);
        o[h] = nb_pair((ww >> sh) & 255u, (ww >> (sh + 8)) & 255u, zf, s);
      }
      st_shared_v4(sB + ws_off(row, 2 * part + i), o[0], o[1], o[2], o[3]);
    }
#endif
  }
}
#endif

// One CTA of the persistent grid. nx: column blocks per tile (gate_up I / 128, down H / 256).
template <int MODE, typename YT = float>
__device__ __forceinline__ void ws_grouped_gemm(const T* __restrict__ A, long long lda, const T* __restrict__ W,
                                                int K, int I, int kk, int ny, int H, int nx,
                                                const int* __restrict__ tiles, const int* __restrict__ pair_list,
                                                const float* __restrict__ pair_w, T* __restrict__ act,
                                                YT* __restrict__ y, const unsigned char* __restrict__ Wq = nullptr,
                                                const float* __restrict__ Wsc = nullptr,
                                                const int* __restrict__ Wz = nullptr, int bs = 0) {
  __shared__ __align__(8) u64 full_bar[WS_STAGES], empty_bar[WS_STAGES];
  pdl_enter();
  const int tid = threadIdx.x;
  const u32 full0 = smem_u32(full_bar), empty0 = smem_u32(empty_bar);
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < WS_STAGES; ++s) {
      mbar_init(full0 + 8 * s, WS_PRODUCERS);
      mbar_init(empty0 + 8 * s, WS_CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the only CTA-wide barrier: the roles never meet again
  const int n_items = tiles[0] * nx;
  const u32 sbase = (smem_u32(ws_smem) + 1023u) & ~1023u;
#if WS_NBITS
  const u32 nbase = sbase + WS_STAGES * WS_STAGE_BYTES;  // the packed build's staging ring
#endif
  const int KT = K / WS_BK;

  if (tid >= WS_CONSUMERS) {
    // ---------------------------------------------------------------- producer warpgroup
    // This thread's 16-byte chunk ch of rows r0 + 16 i of each stage (A: i < 8, B: i < 16).
    const int ptid = tid - WS_CONSUMERS, ch = ptid & 7, r0 = ptid >> 3;
    u32 g = 0;  // stages issued so far
#pragma unroll 1
    for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
      const int tile = item / nx, x = item - tile * nx;
      const int4 tl = *(const int4*)(tiles + 4 + 4 * (size_t)tile);
      const int e = tl.x, start = tl.y, rows = tl.z;
      const T* asrc[WS_BM / WS_PROD_ROWS];  // this thread's A rows (k 8 ch) or nullptr past the tile's rows
#pragma unroll
      for (int i = 0; i < WS_BM / WS_PROD_ROWS; ++i) {
        const int row = r0 + WS_PROD_ROWS * i;
        const int p = row < rows ? pair_list[start + row] : -1;
        asrc[i] = p < 0 ? nullptr
                        : A + (MODE == MODE_GATE_UP ? (long long)(p / kk) * lda : (long long)p * lda) + ch * 8;
      }
#if WS_NBITS
      // This thread's code chunks: weight rows rr + WS_NB_RPP j of the item (gate_up: staged rows 0..127 are gate
      // rows x * 128 + r, 128..255 the up rows I + x * 128 + r - 128), k part * WS_NB_KPC of each stage
      const int part = ptid % WS_NB_CPR, rr = ptid / WS_NB_CPR;
      const int N = MODE == MODE_GATE_UP ? 2 * I : H, nbk = K / bs;
      const size_t rowbytes = (size_t)K * WS_NBITS / 8;
      size_t ridx[WS_NB_J];  // e * N + the weight row
#pragma unroll
      for (int j = 0; j < WS_NB_J; ++j) {
        const int r = rr + WS_NB_RPP * j;
        const int wrow = MODE == MODE_GATE_UP
                             ? (r < WS_BN / 2 ? x * (WS_BN / 2) + r : I + x * (WS_BN / 2) + r - WS_BN / 2)
                             : x * WS_BN + r;
        ridx[j] = (size_t)e * N + wrow;
      }
#else
      const T* Wb;
      size_t up_jump = 0;  // gate_up: extra weight rows from staged row 128 on (the up rows)
      if (MODE == MODE_GATE_UP) {
        Wb = W + (size_t)e * 2 * I * K + (size_t)(x * (WS_BN / 2) + r0) * K + ch * 8;
        up_jump = (size_t)(I - WS_BN / 2) * K;
      } else {
        Wb = W + (size_t)e * H * K + (size_t)(x * WS_BN + r0) * K + ch * 8;
      }
#endif
#pragma unroll 1
      for (int kt = 0; kt < KT; ++kt, ++g) {
        const u32 stage = g % WS_STAGES, round = g / WS_STAGES;
        mbar_wait_guarded(empty0 + 8 * stage, (round & 1u) ^ 1u);  // the MMAs of round - 1 on this stage completed
        const u32 sA = sbase + stage * WS_STAGE_BYTES;
        const int k0 = kt * WS_BK;
#pragma unroll
        for (int i = 0; i < WS_BM / WS_PROD_ROWS; ++i) {
          const int row = r0 + WS_PROD_ROWS * i;
          cp_async16(sA + ws_off(row, ch), asrc[i] ? asrc[i] + k0 : A, asrc[i] ? 16 : 0);
        }
#if WS_NBITS
        {
          const int kc = k0 + part * WS_NB_KPC, b = kc / bs;  // bs % WS_NB_KPC == 0: a chunk is in one block
          const u32 sQ = nbase + (g % WS_NB_SLOTS) * WS_NB_SLOT_BYTES;
#pragma unroll
          for (int j = 0; j < WS_NB_J; ++j) {
            const int c = j * WS_PRODUCERS + ptid;
            cp_async16(sQ + 16 * c, Wq + ridx[j] * rowbytes + (size_t)kc * WS_NBITS / 8, 16);
            cp_async4(sQ + WS_NB_CHUNKS * 16 + 4 * c, Wsc + ridx[j] * nbk + b);
            if (Wz != nullptr) cp_async4(sQ + WS_NB_CHUNKS * 20 + 4 * c, Wz + ridx[j] * nbk + b);
          }
        }
        cp_commit();
        cp_wait<WS_LAG>();  // this thread's copies of stage g - WS_LAG have landed: its weight chunks, dequantised
        if (g >= WS_LAG) {
          const u32 gl = g - WS_LAG;
          nb_convert(nbase + (gl % WS_NB_SLOTS) * WS_NB_SLOT_BYTES,
                     sbase + (gl % WS_STAGES) * WS_STAGE_BYTES + WS_A_BYTES, ptid, Wz != nullptr);
        }
        fence_proxy_async();  // the copies and the tile's stores are visible to the async proxy (wgmma)
        if (g >= WS_LAG) mbar_arrive(full0 + 8 * ((g - WS_LAG) % WS_STAGES));
#else
        const u32 sB = sA + WS_A_BYTES;
#pragma unroll
        for (int i = 0; i < WS_BN / WS_PROD_ROWS; ++i) {
          const int row = r0 + WS_PROD_ROWS * i;
          const T* src = Wb + (size_t)(WS_PROD_ROWS * i) * K + (i >= WS_BN / (2 * WS_PROD_ROWS) ? up_jump : 0) + k0;
          cp_async16(sB + ws_off(row, ch), src, 16);
        }
        cp_commit();
        cp_wait<WS_LAG>();  // this thread's copies of stage g - WS_LAG have landed ...
        fence_proxy_async();  // ... and are visible to the async proxy (wgmma)
        if (g >= WS_LAG) mbar_arrive(full0 + 8 * ((g - WS_LAG) % WS_STAGES));
#endif
      }
    }
    cp_wait<0>();
#if WS_NBITS
#pragma unroll 1
    for (u32 j = g >= WS_LAG ? g - WS_LAG : 0; j < g; ++j)
      nb_convert(nbase + (j % WS_NB_SLOTS) * WS_NB_SLOT_BYTES, sbase + (j % WS_STAGES) * WS_STAGE_BYTES + WS_A_BYTES,
                 ptid, Wz != nullptr);
#endif
    fence_proxy_async();
#pragma unroll 1
    for (u32 j = g >= WS_LAG ? g - WS_LAG : 0; j < g; ++j) mbar_arrive(full0 + 8 * (j % WS_STAGES));
    return;
  }

  // ------------------------------------------------------------------ consumer warpgroups
  const int lane = tid & 31, wg = tid >> 7, wq = (tid >> 5) & 3;
  const int g8 = lane >> 2, t4 = lane & 3;  // accumulator fragment: rows g8 (+8), columns 8 j + 2 t4 (+1)
  float acc[WS_ACC];
  u32 g = 0;  // stages consumed so far
#pragma unroll 1
  for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
    const int tile = item / nx, x = item - tile * nx;
    // The epilogue's pair ids (and down's weights), loaded before the mainloop: three dependent global loads
    // (tile list -> pair_list -> pair_w) whose latency the item's MMAs now hide.
    const int4 tl = *(const int4*)(tiles + 4 + 4 * (size_t)tile);
    const int start = tl.y, rows = tl.z;
    int ep[2];
    float ew[2];
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int r = wg * 64 + wq * 16 + g8 + hi * 8;
      ep[hi] = r < rows ? pair_list[start + r] : -1;
      ew[hi] = MODE == MODE_DOWN && ep[hi] >= 0 ? pair_w[ep[hi]] : 1.f;
    }
#if WS_STAGED_EPI
    int cpr[WS_EPI_COPIES];  // the pair of each row this thread copies out (row (tid >> 4) + 16 i)
#pragma unroll
    for (int i = 0; i < WS_EPI_COPIES; ++i) {
      const int r = (tid >> 4) + (WS_CONSUMERS / 16) * i;
      cpr[i] = r < rows ? pair_list[start + r] : -1;
    }
#endif
#pragma unroll
    for (int i = 0; i < WS_ACC; ++i) acc[i] = 0.f;
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt, ++g) {
      const u32 stage = g % WS_STAGES;
      mbar_wait_guarded(full0 + 8 * stage, (g / WS_STAGES) & 1u);  // the stage's copies landed (every producer thread)
      __syncwarp();  // converged for the .aligned wgmma instructions
      const u32 sA = sbase + stage * WS_STAGE_BYTES;
      const u64 da = ws_desc(sA + wg * (64 * WS_ROWB)), db = ws_desc(sA + WS_A_BYTES);
      acc_fence(acc);
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < WS_BK / 16; ++s) wgmma_k16(acc, da + 2 * s, db + 2 * s);  // start address + 32 bytes
      wgmma_commit();
      acc_fence(acc);
      wgmma_wait<1>();  // the previous k tile's MMAs (this thread's share) have completed
      acc_fence(acc);
      if (kt > 0) mbar_arrive(empty0 + 8 * ((g - 1) % WS_STAGES));
    }
    wgmma_wait<0>();
    acc_fence(acc);
    const u32 held = (g - 1) % WS_STAGES;  // KT >= 1: g >= 1. The item's last stage
    constexpr int NJ = WS_BN / 8;  // n-tiles of 8 columns
    // Epilogue: acc[4 j + 2 hi + b] = D[row 16 wq + g8 + 8 hi][column 8 j + 2 t4 + b] of this warpgroup's rows.
#if WS_STAGED_EPI
    if constexpr (MODE == MODE_GATE_UP || is_t<YT>::value) {
      // Staged through the held stage (rows of WS_EPI_ROWB bytes: 128 columns + a 16-byte pad, so the fragment
      // writes of a warp hit 32 different banks), then copied out 16 bytes per thread, a row's 256 bytes by 16
      // consecutive threads. gate_up: one pass (128 act columns); down: two passes of 128 of its 256 columns.
      const u32 sE = sbase + held * WS_STAGE_BYTES;
      constexpr int PASSES = MODE == MODE_GATE_UP ? 1 : 2;
      consumers_sync();  // both warpgroups' MMAs have finished reading the held stage
#pragma unroll
      for (int pass = 0; pass < PASSES; ++pass) {
        if (pass > 0) consumers_sync();  // the previous pass's copies have read the buffer
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          if (ep[hi] < 0) continue;
          const u32 srow = sE + (wg * 64 + wq * 16 + g8 + hi * 8) * WS_EPI_ROWB + 4 * t4;
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            u32 v;
            if (MODE == MODE_GATE_UP)  // gate n-tile j and the up n-tile of the same columns, j + NJ / 2
              v = pack2(siluf_(acc[4 * j + 2 * hi]) * acc[4 * (j + NJ / 2) + 2 * hi],
                        siluf_(acc[4 * j + 2 * hi + 1]) * acc[4 * (j + NJ / 2) + 2 * hi + 1]);
            else
              v = pack2(ew[hi] * acc[4 * (j + 16 * pass) + 2 * hi], ew[hi] * acc[4 * (j + 16 * pass) + 2 * hi + 1]);
            st_shared_u32(srow + 16 * j, v);
          }
        }
        consumers_sync();  // the staged rows are complete
#pragma unroll
        for (int i = 0; i < WS_EPI_COPIES; ++i) {
          const int r = (tid >> 4) + (WS_CONSUMERS / 16) * i, c = tid & 15, p = cpr[i];
          if (p < 0) continue;
          T* dst;
          if (MODE == MODE_GATE_UP) {
            dst = act + (size_t)p * I + x * (WS_BN / 2) + 8 * c;
          } else {
            const int t = p / kk, slot = p - t * kk;
            dst = (T*)y + ((size_t)t * ny + slot) * H + x * WS_BN + 128 * pass + 8 * c;
          }
          *(uint4*)dst = ld_shared_v4(sE + r * WS_EPI_ROWB + 16 * c);
        }
      }
      consumers_sync();  // every copy has read the buffer: the producer may refill it
      mbar_arrive(empty0 + 8 * held);
      continue;
    }
#endif
    mbar_arrive(empty0 + 8 * held);  // stored straight from the accumulators
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int p = ep[hi];
      if (p < 0) continue;
      if (MODE == MODE_GATE_UP) {
        T* dst = act + (size_t)p * I + x * (WS_BN / 2) + 2 * t4;
#pragma unroll
        for (int j = 0; j < NJ / 2; ++j) {  // gate n-tile j and the up n-tile of the same columns, j + NJ / 2
          const float v0 = siluf_(acc[4 * j + 2 * hi]) * acc[4 * (j + NJ / 2) + 2 * hi];
          const float v1 = siluf_(acc[4 * j + 2 * hi + 1]) * acc[4 * (j + NJ / 2) + 2 * hi + 1];
          *(u32*)(dst + j * 8) = pack2(v0, v1);
        }
      } else {
        const int t = p / kk, slot = p - t * kk;
        YT* dst = y + ((size_t)t * ny + slot) * H + x * WS_BN + 2 * t4;
#pragma unroll
        for (int j = 0; j < NJ; ++j)
          store_y2(dst + j * 8, ew[hi] * acc[4 * j + 2 * hi], ew[hi] * acc[4 * j + 2 * hi + 1]);
      }
    }
  }
}

#if !WS_NBITS
// grid (min(#SMs, max_tiles * I / 128)), block 384, dynamic smem WS_SMEM. h [n, ldh] T; w_gu [E_all, 2I, H];
// act [pairs, I].
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    moe_wgmma_gate_up(const T* __restrict__ h, long long ldh, const T* __restrict__ w_gu, int H, int I, int kk,
                      const int* __restrict__ tiles, const int* __restrict__ pair_list, T* __restrict__ act) {
  ws_grouped_gemm<MODE_GATE_UP, float>(h, ldh, w_gu, H, I, kk, 0, H, I / (WS_BN / 2), tiles, pair_list, nullptr, act,
                                nullptr);
}

// grid (min(#SMs, max_tiles * H / 256)), block 384, dynamic smem WS_SMEM. act [pairs, I] T; w_d [E_all, H, I];
// y [n, ny, H] float32 (ny >= kk; moe_*_down_t below: in T).
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    moe_wgmma_down(const T* __restrict__ act, const T* __restrict__ w_d, const float* __restrict__ pair_w, int H,
                   int I, int kk, int ny, const int* __restrict__ tiles, const int* __restrict__ pair_list,
                   float* __restrict__ y) {
  ws_grouped_gemm<MODE_DOWN, float>(act, I, w_d, I, I, kk, ny, H, H / WS_BN, tiles, pair_list, pair_w, nullptr, y);
}

// The same with y [n, ny, H] in T (prefill of bf16 / fp16 bundles: half the slot traffic of float32).
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    moe_wgmma_down_t(const T* __restrict__ act, const T* __restrict__ w_d, const float* __restrict__ pair_w, int H,
                     int I, int kk, int ny, const int* __restrict__ tiles, const int* __restrict__ pair_list,
                     T* __restrict__ y) {
  ws_grouped_gemm<MODE_DOWN, T>(act, I, w_d, I, I, kk, ny, H, H / WS_BN, tiles, pair_list, pair_w, nullptr, y);
}
#else
// The packed builds: grid, block and outputs as above; dynamic smem WS_STAGES * WS_STAGE_BYTES + WS_NB_BYTES + 1024.
// q_* uint8 codes, s_* float32 scales, z_* int32 zero-points or null (2^(bits - 1)), bs the block size
// (bs % WS_NB_KPC == 0, K % bs == 0): quant.py PackedLinear's stacked arrays (gate_up [E_all, 2I, H], down
// [E_all, H, I]); the host checks (cuda/moe_prefill.py packed_problems).
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    moe_wgmma_nb_gate_up(const T* __restrict__ h, long long ldh, const unsigned char* __restrict__ q_gu,
                         const float* __restrict__ s_gu, const int* __restrict__ z_gu, int bs, int H, int I, int kk,
                         const int* __restrict__ tiles, const int* __restrict__ pair_list, T* __restrict__ act) {
  ws_grouped_gemm<MODE_GATE_UP, float>(h, ldh, nullptr, H, I, kk, 0, H, I / (WS_BN / 2), tiles, pair_list, nullptr,
                                       act, nullptr, q_gu, s_gu, z_gu, bs);
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    moe_wgmma_nb_down(const T* __restrict__ act, const unsigned char* __restrict__ q_d, const float* __restrict__ s_d,
                      const int* __restrict__ z_d, int bs, const float* __restrict__ pair_w, int H, int I, int kk,
                      int ny, const int* __restrict__ tiles, const int* __restrict__ pair_list,
                      float* __restrict__ y) {
  ws_grouped_gemm<MODE_DOWN, float>(act, I, nullptr, I, I, kk, ny, H, H / WS_BN, tiles, pair_list, pair_w, nullptr, y,
                                    q_d, s_d, z_d, bs);
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    moe_wgmma_nb_down_t(const T* __restrict__ act, const unsigned char* __restrict__ q_d,
                        const float* __restrict__ s_d, const int* __restrict__ z_d, int bs,
                        const float* __restrict__ pair_w, int H, int I, int kk, int ny, const int* __restrict__ tiles,
                        const int* __restrict__ pair_list, T* __restrict__ y) {
  ws_grouped_gemm<MODE_DOWN, T>(act, I, nullptr, I, I, kk, ny, H, H / WS_BN, tiles, pair_list, pair_w, nullptr, y, q_d,
                                s_d, z_d, bs);
}
#endif
