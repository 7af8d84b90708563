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
#define WS_SMEM (WS_STAGES * WS_STAGE_BYTES + 1024)
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

// One CTA of the persistent grid. nx: column blocks per tile (gate_up I / 128, down H / 256).
template <int MODE, typename YT = float>
__device__ __forceinline__ void ws_grouped_gemm(const T* __restrict__ A, long long lda, const T* __restrict__ W,
                                                int K, int I, int kk, int ny, int H, int nx,
                                                const int* __restrict__ tiles, const int* __restrict__ pair_list,
                                                const float* __restrict__ pair_w, T* __restrict__ act,
                                                YT* __restrict__ y) {
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
      const T* Wb;
      size_t up_jump = 0;  // gate_up: extra weight rows from staged row 128 on (the up rows)
      if (MODE == MODE_GATE_UP) {
        Wb = W + (size_t)e * 2 * I * K + (size_t)(x * (WS_BN / 2) + r0) * K + ch * 8;
        up_jump = (size_t)(I - WS_BN / 2) * K;
      } else {
        Wb = W + (size_t)e * H * K + (size_t)(x * WS_BN + r0) * K + ch * 8;
      }
#pragma unroll 1
      for (int kt = 0; kt < KT; ++kt, ++g) {
        const u32 stage = g % WS_STAGES, round = g / WS_STAGES;
        mbar_wait_guarded(empty0 + 8 * stage, (round & 1u) ^ 1u);  // the MMAs of round - 1 on this stage completed
        const u32 sA = sbase + stage * WS_STAGE_BYTES, sB = sA + WS_A_BYTES;
        const int k0 = kt * WS_BK;
#pragma unroll
        for (int i = 0; i < WS_BM / WS_PROD_ROWS; ++i) {
          const int row = r0 + WS_PROD_ROWS * i;
          cp_async16(sA + ws_off(row, ch), asrc[i] ? asrc[i] + k0 : A, asrc[i] ? 16 : 0);
        }
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
      }
    }
    cp_wait<0>();
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
