// Helpers shared by the two causal prefill attention kernels, prefill_attention.cu (mma.sync) and
// prefill_attention_wgmma.cu (Hopper wgmma), #included by both (hybrid_runtime/cuda/kernels.py inlines it).
// The includer defines u32 (unsigned int), T (the 16-bit element type), DT (1 float16, 2 bfloat16) and NGRP (16-key
// groups of a 64-key tile, 4) first.

#define NEG_INF (__int_as_float(0xff800000))

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

__device__ __forceinline__ float fast_exp2(float x) {  // exp2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ u32 pack2(float lo, float hi) {  // lo -> low 16 bits
  u32 r;
#if DT == 1
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

// A copy the compiler cannot hoist out of the key loop. Addresses are built from such copies (made once per
// tile) plus compile-time offsets, so they fold into [reg + imm] operands. Without it, every loop-invariant
// address of the unrolled steps (144 ldmatrix addresses at HD 256) was hoisted into a register of its own
// and the kernel spilled.
__device__ __forceinline__ u32 opaque(u32 x) {
  u32 y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Page of the first key of each 16-key group of the tile at key n0 (-1: the group starts at or past kv_len).
// One division per tile: the groups are 16 keys apart and page_size >= 16, so each step crosses at most one
// page boundary.
__device__ __forceinline__ void tile_pages(int (&pg)[NGRP], const int* __restrict__ table, int n0, int kv_len,
                                           int page_size) {
  int pi = n0 / page_size, off = n0 - pi * page_size;
#pragma unroll
  for (int gi = 0; gi < NGRP; ++gi) {
    if (gi > 0) {
      off += 16;
      if (off >= page_size) off -= page_size, ++pi;
    }
    pg[gi] = n0 + 16 * gi < kv_len ? __ldg(table + pi) : -1;
  }
}
// Pool row of the first key of each 16-key group of the tile at key n0, from its pages (-1 stays -1). A group
// never crosses a page (n0 % 16 == 0, page_size % 16 == 0), so key n0 + r is pool row base[r >> 4] + (r & 15)
// * Hkv. 32-bit: the host checks that the pool has fewer than 2^31 rows.
__device__ __forceinline__ void bases_from_pages(int (&base)[NGRP], const int (&pg)[NGRP], int n0, int page_size,
                                                 int Hkv, int kvh) {
  int off = n0 % page_size;
#pragma unroll
  for (int gi = 0; gi < NGRP; ++gi) {
    if (gi > 0) {
      off += 16;
      if (off >= page_size) off -= page_size;
    }
    base[gi] = pg[gi] < 0 ? -1 : (pg[gi] * page_size + off) * Hkv + kvh;
  }
}
