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
//
// nbits_dequant8: the same values for weights without act order, eight consecutive codes of a row per thread (one
// 4- / 8-byte load of codes, one scale and zero-point, one 16-byte store of bf16 / fp16, two of float32): the
// expert stacks that prefill steps dequantise every step (packed_experts) at the copy rate rather than one
// thread's index arithmetic per code. The host picks it when K % 8 == 0, bs % 8 == 0, ldo % 8 == 0,
// out_estride % 8 == 0 and out is 16-byte aligned (quant.py NBitsDequant.launch).

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

// The zero-point of row n, block b of one expert's zp (``ze`` elements in): 2^(bits - 1) when zp is null.
__device__ __forceinline__ int zero_point(const u8* __restrict__ zp, long long ze, int n, int nb, int b, int bits) {
  if (zp == nullptr) return 1 << (bits - 1);
  const u8* Ze = zp + ze;
  if (bits == 4) {
    const u8 zb = Ze[(long long)n * ((nb + 1) / 2) + (b >> 1)];
    return (b & 1) ? (zb >> 4) : (zb & 15);
  }
  return Ze[(long long)n * nb + b];
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
  const int z = zero_point(zp, e * z_estride, n, nb, b, bits);
  const float s = scales[e * s_estride + (long long)n * nb + b];
  const int col = perm != nullptr ? perm[e * p_estride + j] : j;
  if (col < 0 || col >= k_in) return;  // a padding column (k_in); never negative in a checked bundle
  out[e * out_estride + (long long)n * ldo + col] = from_f32((float)(q - z) * s);
}

extern "C" __global__ void __launch_bounds__(256) nbits_dequant8(
    const u8* __restrict__ B, const float* __restrict__ scales, const u8* __restrict__ zp, T* __restrict__ out,
    int N, int K, int bits, int bs, long long ldo, long long out_estride, long long b_estride, long long s_estride,
    long long z_estride) {
  const long long e = blockIdx.y;
  const u32 c = blockIdx.x * blockDim.x + threadIdx.x;  // chunk of 8 codes within the expert
  const u32 K8 = (u32)K >> 3;
  if (c >= (u32)N * K8) return;
  const int n = (int)(c / K8);
  const int j = (int)(c - (u32)n * K8) * 8;
  const int nb = (K + bs - 1) / bs;
  const int b = j / bs;  // bs % 8 == 0: the 8 codes share one block
  const long long row_bytes = (long long)nb * bs * bits / 8;
  const u8* Be = B + e * b_estride + (long long)n * row_bytes;
  u32 w0, w1 = 0u;
  if (bits == 4) {
    w0 = *reinterpret_cast<const u32*>(Be + (j >> 1));  // codes j..j+7, low nibble first
  } else {
    const uint2 ww = *reinterpret_cast<const uint2*>(Be + j);
    w0 = ww.x;
    w1 = ww.y;
  }
  const int z = zero_point(zp, e * z_estride, n, nb, b, bits);
  const float s = scales[e * s_estride + (long long)n * nb + b];
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int q = bits == 4 ? (int)((w0 >> (4 * i)) & 15u) : (int)(((i < 4 ? w0 : w1) >> (8 * (i & 3))) & 255u);
    v[i] = (float)(q - z) * s;
  }
  T* o = out + e * out_estride + (long long)n * ldo + j;
#if DT == 0
  reinterpret_cast<float4*>(o)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(o)[1] = make_float4(v[4], v[5], v[6], v[7]);
#else
  u32 r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) r[i] = (u32)from_f32(v[2 * i]) | ((u32)from_f32(v[2 * i + 1]) << 16);
  *reinterpret_cast<uint4*>(o) = make_uint4(r[0], r[1], r[2], r[3]);
#endif
}
