// The GDN gates of one projection row, for kernels outside fused.cu (gdn.cu's gdn_conv_gates_decode):
//   g = neg_exp_a * softplus(a + dt_bias),  beta = sigmoid(b)      (float32, one value head j)
// The same expressions, in the same order, as fused.cu's gdn_gates with its softplusf_ / sigmoidf_, so both
// produce the same bits (tests/gpu/test_gdn_decode_fused_compile.py compares the texts; the GPU test the bits).
// Self-contained: no CUDA headers.

#ifndef GDN_GATES_CUH
#define GDN_GATES_CUH

__device__ __forceinline__ float gdn_sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gdn_softplusf(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// row: the projection row [u | z | b | a] (float32); b at row[off_b + j], a at row[off_a + j]; g, beta: this row's
// [nv] outputs.
__device__ __forceinline__ void gdn_gate(const float* __restrict__ row, int off_b, int off_a,
                                         const float* __restrict__ neg_exp_a, const float* __restrict__ dt_bias,
                                         float* __restrict__ g, float* __restrict__ beta, int j) {
  g[j] = neg_exp_a[j] * gdn_softplusf(row[off_a + j] + dt_bias[j]);
  beta[j] = gdn_sigmoidf(row[off_b + j]);
}

#endif  // GDN_GATES_CUH
