// Sampling on the device: greedy, temperature, top-k, top-p, per-request seeds; logprobs of the chosen
// token and of the top-N (N <= 20) tokens. Self-contained (no CUDA headers); the numpy twin of the
// semantics is hybrid_runtime/cuda/sampler.py (philox, reference_sample), which the tests compare.
//
// logits: float32 [n, V] (rows of ld). Per row, 8 int32 words of parameters (see sampler.py, ROW_WORDS):
//   0 flags (bit 0: greedy)  1 top_k (0: off)  2 temperature (f32 bits)  3 top_p (f32 bits)
//   4 seed low  5 seed high  6 counter (the position of the token being drawn)  7 top-N logprobs (-1: none)
// Semantics (one row, x = its logits):
//   lse = log(sum exp x); greedy rows take the first maximum. Sampled rows: keys x/T; top-k keeps every
//   token whose logit is >= the k-th largest logit (ties at the cut are all kept); top-p then keeps the
//   smallest set of most likely of those whose softmax(x/T) mass reaches top_p (ties at the cut kept; mass
//   summed in 2^-32 fixed point, so the cut is exact and order-free); the token is the arg-max over kept
//   tokens of x/T + Gumbel(u), u from Philox4x32-10 keyed by the seed at counter (i / 4, counter) — one
//   exact draw from the renormalised distribution that depends only on (seed, counter, logits).
//   logprob = x[token] - lse; top-N = the N largest logits (ties by lower id) with x - lse.
// Two kernels: sample_partials (grid (NCH, n), 256 threads) reduces chunks of each row to (max, sum exp,
// first arg-max); sample_finish (grid (n), 1024 threads) merges them in chunk order and does the rest.

typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_BIG (-3.0e38f)
#define FIN_THREADS 1024
#define PART_THREADS 256
#define MAX_TOPN 20
#define CAND_CAP 64

__device__ __forceinline__ void pdl_enter() {  // see fused.cu: wait for the kernel before, then let the next in
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ u32 ordered(float v) {
  const u32 u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ void philox_round(u32& c0, u32& c1, u32& c2, u32& c3, u32 k0, u32 k1) {
  const u64 p0 = (u64)0xD2511F53u * c0, p1 = (u64)0xCD9E8D57u * c2;
  const u32 hi0 = (u32)(p0 >> 32), lo0 = (u32)p0, hi1 = (u32)(p1 >> 32), lo1 = (u32)p1;
  const u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
  c0 = n0;
  c1 = lo1;
  c2 = n2;
  c3 = lo0;
}

// Word (i & 3) of Philox4x32-10((i >> 2, counter, 0x5EED, 0), (seed_lo, seed_hi)) as a uniform in (0, 1).
__device__ __forceinline__ float philox_uniform(u32 seed_lo, u32 seed_hi, u32 counter, u32 i) {
  u32 c0 = i >> 2, c1 = counter, c2 = 0x5EEDu, c3 = 0u, k0 = seed_lo, k1 = seed_hi;
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    philox_round(c0, c1, c2, c3, k0, k1);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  const u32 w = (i & 3) == 0 ? c0 : (i & 3) == 1 ? c1 : (i & 3) == 2 ? c2 : c3;
  return ((float)(w >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(PART_THREADS)
    sample_partials(const float* __restrict__ logits, long long ld, int V, int nch, float* __restrict__ pm,
                    float* __restrict__ ps, int* __restrict__ pi) {
  pdl_enter();
  __shared__ float sm[PART_THREADS];
  __shared__ int si[PART_THREADS];
  const int c = blockIdx.x, r = blockIdx.y, tid = threadIdx.x;
  const int len = (V + nch - 1) / nch;
  const int a = c * len, b = min(V, a + len);
  const float* x = logits + (size_t)r * ld;
  float mx = NEG_BIG;
  int arg = 0x7fffffff;
  for (int i = a + tid; i < b; i += PART_THREADS) {
    const float v = x[i];
    if (v > mx) {  // strided per thread: the first index of its maximum
      mx = v;
      arg = i;
    }
  }
  sm[tid] = mx;
  si[tid] = arg;
  __syncthreads();
  for (int o = PART_THREADS / 2; o > 0; o >>= 1) {
    if (tid < o) {
      const float ov = sm[tid + o];
      const int oi = si[tid + o];
      if (ov > sm[tid] || (ov == sm[tid] && oi < si[tid])) {
        sm[tid] = ov;
        si[tid] = oi;
      }
    }
    __syncthreads();
  }
  const float cmax = sm[0];
  const int carg = si[0];
  __syncthreads();
  float s = 0.f;
  for (int i = a + tid; i < b; i += PART_THREADS) s += expf(x[i] - cmax);
  sm[tid] = s;
  __syncthreads();
  for (int o = PART_THREADS / 2; o > 0; o >>= 1) {
    if (tid < o) sm[tid] += sm[tid + o];
    __syncthreads();
  }
  if (tid == 0) {
    pm[r * nch + c] = cmax;
    ps[r * nch + c] = sm[0];
    pi[r * nch + c] = carg;
  }
}

struct FinShared {
  u32 hist[256];
  u64 mass[256];
  float red_v[FIN_THREADS / 32];
  int red_i[FIN_THREADS / 32];
  u32 prefix, mask;
  u64 target;
  int kr;
  int ncand;
  float cand_v[CAND_CAP];
  int cand_i[CAND_CAP];
  float row_max, lse;
  int row_arg;
};

// Key of the k-th largest logit (by count). All threads return it.
__device__ u32 radix_kth(const float* x, int V, int k, FinShared& s) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    s.prefix = 0u;
    s.mask = 0u;
    s.kr = k;
  }
  __syncthreads();
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (tid < 256) s.hist[tid] = 0u;
    __syncthreads();
    const u32 prefix = s.prefix, mask = s.mask;
    for (int i = tid; i < V; i += FIN_THREADS) {
      const u32 key = ordered(x[i]);
      if ((key & mask) == prefix) atomicAdd(&s.hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      u32 acc = 0;
      int d = 255;
      for (; d > 0; --d) {
        if (acc + s.hist[d] >= (u32)s.kr) break;
        acc += s.hist[d];
      }
      s.kr -= (int)acc;
      s.prefix |= (u32)d << shift;
      s.mask |= 255u << shift;
    }
    __syncthreads();
  }
  return s.prefix;
}

// Key cut of top-p: the largest key tau with mass(keys >= tau, keys >= lo) >= target. All threads return it.
__device__ u32 radix_mass(const float* x, int V, u32 lo, float mx, float inv_t, u64 target, FinShared& s) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    s.prefix = 0u;
    s.mask = 0u;
    s.target = target;
  }
  __syncthreads();
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (tid < 256) s.mass[tid] = 0ull;
    __syncthreads();
    const u32 prefix = s.prefix, mask = s.mask;
    for (int i = tid; i < V; i += FIN_THREADS) {
      const float v = x[i];
      const u32 key = ordered(v);
      if (key >= lo && (key & mask) == prefix)
        atomicAdd(&s.mass[(key >> shift) & 255u], (u64)(expf((v - mx) * inv_t) * 4294967296.0f));
    }
    __syncthreads();
    if (tid == 0) {
      u64 acc = 0;
      int d = 255;
      for (; d > 0; --d) {
        if (acc + s.mass[d] >= s.target) break;
        acc += s.mass[d];
      }
      s.target -= acc;
      s.prefix |= (u32)d << shift;
      s.mask |= 255u << shift;
    }
    __syncthreads();
  }
  return s.prefix;
}

__device__ void block_argmax(float& v, int& i, FinShared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
  __syncthreads();
  if (lane == 0) {
    s.red_v[warp] = v;
    s.red_i[warp] = i;
  }
  __syncthreads();
  if (warp == 0) {
    v = s.red_v[lane];
    i = s.red_i[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
      }
    }
    if (lane == 0) {
      s.red_v[0] = v;
      s.red_i[0] = i;
    }
  }
  __syncthreads();
  v = s.red_v[0];
  i = s.red_i[0];
}

// u64 sum over the block (a fixed-point total), returned to every thread.
__device__ u64 block_sum_u64(u64 v, FinShared& s) {
  if (threadIdx.x == 0) s.mass[0] = 0ull;
  __syncthreads();
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(&s.mass[0], v);  // integer: order-free
  __syncthreads();
  const u64 t = s.mass[0];
  __syncthreads();
  return t;
}

extern "C" __global__ void __launch_bounds__(FIN_THREADS)
    sample_finish(const float* __restrict__ logits, long long ld, int V, int nch, const float* __restrict__ pm,
                  const float* __restrict__ ps, const int* __restrict__ pi, const int* __restrict__ params,
                  int* __restrict__ out_tok, float* __restrict__ out_lp, int* __restrict__ top_ids,
                  float* __restrict__ top_lp) {
  pdl_enter();
  __shared__ FinShared s;
  const int r = blockIdx.x, tid = threadIdx.x;
  const int* P = params + r * 8;
  const bool greedy = (P[0] & 1) != 0;
  const int top_k = P[1];
  const float temp = __int_as_float(P[2]), top_p = __int_as_float(P[3]);
  const u32 seed_lo = (u32)P[4], seed_hi = (u32)P[5], counter = (u32)P[6];
  const int ntop = P[7];
  const float* x = logits + (size_t)r * ld;
  if (tid == 0) {  // merge the chunk partials in chunk order
    float mx = NEG_BIG;
    int arg = 0x7fffffff;
    for (int c = 0; c < nch; ++c) {
      const float m = pm[r * nch + c];
      if (m > mx) {
        mx = m;
        arg = pi[r * nch + c];
      }
    }
    float se = 0.f;
    for (int c = 0; c < nch; ++c) se += ps[r * nch + c] * expf(pm[r * nch + c] - mx);
    s.row_max = mx;
    s.row_arg = arg;
    s.lse = mx + logf(se);
  }
  __syncthreads();
  const float mx = s.row_max, lse = s.lse;
  int tok = s.row_arg;
  if (!greedy) {
    const float inv_t = 1.f / temp;
    u32 lo = 0u;
    if (top_k > 0 && top_k < V) lo = radix_kth(x, V, top_k, s);
    if (top_p < 1.f) {
      u64 part = 0ull;
      for (int i = tid; i < V; i += FIN_THREADS) {
        const float v = x[i];
        if (ordered(v) >= lo) part += (u64)(expf((v - mx) * inv_t) * 4294967296.0f);
      }
      const u64 Z = block_sum_u64(part, s);
      u64 target = (u64)ceil((double)top_p * (double)Z);
      target = target < 1ull ? 1ull : (target > Z ? Z : target);
      const u32 tau = radix_mass(x, V, lo, mx, inv_t, target, s);
      lo = tau > lo ? tau : lo;
    }
    float best = NEG_BIG;
    int bi = 0x7fffffff;
    for (int i = tid; i < V; i += FIN_THREADS) {
      const float v = x[i];
      if (ordered(v) < lo) continue;
      const float u = philox_uniform(seed_lo, seed_hi, counter, (u32)i);
      const float sc = v * inv_t - logf(-logf(u));
      if (sc > best || (sc == best && i < bi)) {
        best = sc;
        bi = i;
      }
    }
    block_argmax(best, bi, s);
    tok = bi;
  }
  if (tok < 0 || tok >= V) tok = (s.row_arg >= 0 && s.row_arg < V) ? s.row_arg : 0;  // NaN logits: a valid id
  if (tid == 0) {
    out_tok[r] = tok;
    out_lp[r] = x[tok] - lse;
  }
  if (ntop <= 0) return;
  const int N = ntop > MAX_TOPN ? MAX_TOPN : ntop;
  const u32 cut = radix_kth(x, V, N < V ? N : V, s);
  if (tid == 0) s.ncand = 0;
  __syncthreads();
  for (int i = tid; i < V; i += FIN_THREADS) {
    const float v = x[i];
    if (ordered(v) >= cut) {
      const int slot = atomicAdd(&s.ncand, 1);
      if (slot < CAND_CAP) {
        s.cand_v[slot] = v;
        s.cand_i[slot] = i;
      }
    }
  }
  __syncthreads();
  if (tid == 0) {  // insertion sort of <= 64 candidates: value desc, id asc
    const int m = s.ncand < CAND_CAP ? s.ncand : CAND_CAP;
    for (int a = 1; a < m; ++a) {
      const float v = s.cand_v[a];
      const int id = s.cand_i[a];
      int b = a - 1;
      while (b >= 0 && (s.cand_v[b] < v || (s.cand_v[b] == v && s.cand_i[b] > id))) {
        s.cand_v[b + 1] = s.cand_v[b];
        s.cand_i[b + 1] = s.cand_i[b];
        --b;
      }
      s.cand_v[b + 1] = v;
      s.cand_i[b + 1] = id;
    }
    for (int j = 0; j < MAX_TOPN; ++j) {
      const bool ok = j < N && j < m;
      top_ids[r * MAX_TOPN + j] = ok ? s.cand_i[j] : -1;
      top_lp[r * MAX_TOPN + j] = ok ? s.cand_v[j] - lse : 0.f;
    }
  }
}
