// Dequantisation of MatMulNBits-layout weights (hybrid_runtime/quant.py: NBitsWeight) on the device, at load:
// a GPTQ cuda bundle stores its quantized weights packed and DeviceWeights.load turns them into the runtime's
// float layout in the bundle dtype with this kernel (hybrid_runtime/cuda/quant.py), so every other kernel runs
// unchanged. Self-contained (no CUDA headers): NVRTC compiles it on a CPU.
//
// Compiled once per output dtype with -DDT=<0 float32 | 1 float16 | 2 bfloat16> (T below).
//
// One thread per code (expert e = blockIdx.y, i = n * K + j over the op's columns j < K):
//   q = code j of row n      B[e][n][j / bs][(j % bs) * bits / 8]: 4-bit two a byte, low nibble first
//   z = zero-point of block  zp[e][n * zrow + b / 2] nibble b % 2 (4-bit, zrow = ceil(nb / 2)) | zp[e][n * nb + b]
//                            (8-bit) | 2^(bits - 1) when zp is null;   b = j / bs, nb = ceil(K / bs)
//   s = scales[e][n * nb + b]
//   w = (q - z) * s in float32 (exact: a <= 9-bit integer times a float16 scale), rounded once to T (cvt.rn:
//   round to nearest even, as the host's to_dtype), written to out[e * out_estride + n * ldo + col] with
//   col = perm[e][j] (act order; perm == k_in names a padding column: nothing written) or col = j (perm null).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#ifndef DT
#define DT 2
#endif

#if DT == 0
typedef float T;
#else
typedef u16 T;
#endif

__device__ __forceinline__ T from_f32(float v) {
#if DT == 0
  return v;
#else
  u16 h;
#if DT == 1
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  return h;
#endif
}

extern "C" __global__ void __launch_bounds__(256) nbits_dequant(
    const u8* __restrict__ B, const float* __restrict__ scales, const u8* __restrict__ zp,
    const int* __restrict__ perm, T* __restrict__ out, int N, int K, int k_in, int bits, int bs, long long ldo,
    long long out_estride, long long b_estride, long long s_estride, long long z_estride, long long p_estride) {
  // one expert's N * K < 2^31 (the host checks): 32-bit index math within an expert, 64-bit offsets across them
  const long long e = blockIdx.y;
  const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (u32)N * (u32)K) return;
  const int n = (int)(i / (u32)K);
  const int j = (int)(i - (u32)n * (u32)K);
  const int nb = (K + bs - 1) / bs;
  const int b = j / bs;
  const long long row_bytes = (long long)nb * bs * bits / 8;
  const u8* Be = B + e * b_estride + (long long)n * row_bytes;
  int q;
  if (bits == 4) {
    const u8 byte = Be[j >> 1];
    q = (j & 1) ? (byte >> 4) : (byte & 15);
  } else {
    q = Be[j];
  }
  int z = 1 << (bits - 1);
  if (zp != nullptr) {
    const u8* Ze = zp + e * z_estride;
    if (bits == 4) {
      const u8 zb = Ze[(long long)n * ((nb + 1) / 2) + (b >> 1)];
      z = (b & 1) ? (zb >> 4) : (zb & 15);
    } else {
      z = Ze[(long long)n * nb + b];
    }
  }
  const float s = scales[e * s_estride + (long long)n * nb + b];
  const int col = perm != nullptr ? perm[e * p_estride + j] : j;
  if (col < 0 || col >= k_in) return;  // a padding column (k_in); never negative in a checked bundle
  out[e * out_estride + (long long)n * ldo + col] = from_f32((float)(q - z) * s);
}
