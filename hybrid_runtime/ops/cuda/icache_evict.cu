// An instruction-cache evictor for timing kernels with their code cold, as a decode step runs them
// (benchmarks/gpu_common.py cold_graph_seconds, benchmarks/gpu_cold_code.py). In a captured decode step about ten
// other kernels run between two launches of one layer's GEMM and the step's weight stream passes through L2, so
// every launch fetches its code cold; a benchmark that launches one kernel back to back runs it with its code hot.
// Measured on an H100 (stop 43, benchmarks/results/gpu_cold_code_h100.md): the router loses ~1 us a call,
// dense_decode's L2-prefetching builds 0.7-3.2 us, the others <= 0.82 us. Not used by the runtime.
//
// One straight run of dependent FMAs, fully unrolled: at EVICT_FMAS 8192, 4096 FFMA of 16 bytes in NVRTC 13's SASS
// (64 KB; tests/gpu/test_dense_decode_compile.py checks it), enough to evict the code of the kernel timed after it
// (the measurements above were made with it). No memory traffic: the only store is never taken (it keeps the
// chain alive).
// Self-contained (no CUDA headers).
#ifndef EVICT_FMAS
#define EVICT_FMAS 8192
#endif

extern "C" __global__ void __launch_bounds__(128) icache_evict(float* out) {
  float a = threadIdx.x * 1e-3f;
#pragma unroll
  for (int i = 0; i < EVICT_FMAS; ++i) a = fmaf(a, 1.0001f, (float)(i & 7));
  if (a == 12345.0f) out[0] = a;
}
