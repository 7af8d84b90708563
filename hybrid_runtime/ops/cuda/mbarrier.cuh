// mbarrier helpers of the warp-specialised kernels (moe_wgmma_ws.cu, prefill_attention_wgmma.cu -DWS), #included by
// them (hybrid_runtime/cuda/kernels.py inlines it). The includer defines u32 (unsigned int) first. Barriers live in
// shared memory; `bar` is their 32-bit shared address.

#define MBAR_HANG_CYCLES (1ll << 34)  // a wait this long (seconds) is a broken handshake: trap

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {  // release at CTA scope
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ u32 mbar_try_wait(u32 bar, u32 parity) {  // acquire at CTA scope
  u32 ok;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok;
}
// Until the phase of parity `parity` of the barrier at `bar` has completed; traps past MBAR_HANG_CYCLES (a launch
// error, never a hang).
__device__ __forceinline__ void mbar_wait_guarded(u32 bar, u32 parity) {
  if (mbar_try_wait(bar, parity)) return;
  const long long t0 = clock64();
  while (!mbar_try_wait(bar, parity)) {
    if (clock64() - t0 > MBAR_HANG_CYCLES) __trap();
  }
}
