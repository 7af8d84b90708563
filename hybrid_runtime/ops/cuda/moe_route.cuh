// The MoE's per-token routing (softmax over the router logits, top-k, renormalisation, the folded shared
// expert), one function for fused.cu's moe_route (decode) and moe_gemm.cu's moe_topk (prefill), so both pick
// the same experts with the same weights, bit for bit. Included textually (hybrid_runtime/cuda/kernels.py
// `source`): the including file defines warp_sum and sigmoidf_ first.
// An order-preserving key of a float (larger value -> larger key; -0 and +0 equal, NaN below everything), so the
// warp's arg-max is two redux.sync reductions (the key, then the lowest id holding it) instead of shuffle rounds.
__device__ __forceinline__ unsigned route_key(float v) {
  if (v != v) return 0u;
  const unsigned u = __float_as_uint(v + 0.0f);  // -0 -> +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float route_value(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}
__device__ __forceinline__ unsigned warp_max_u32(unsigned v) {
#if __CUDA_ARCH__ >= 800
  unsigned r;
  asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
#else
  for (int o = 16; o > 0; o >>= 1) v = max(v, (unsigned)__shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}
__device__ __forceinline__ unsigned warp_min_u32(unsigned v) {
#if __CUDA_ARCH__ >= 800
  unsigned r;
  asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
#else
  for (int o = 16; o > 0; o >>= 1) v = min(v, (unsigned)__shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}

// route_token for E <= 32 NV: the softmax's max and sum as before (per lane over e = lane + 32 i, then the xor
// butterfly: the weights keep their bits), then the lane's logits as keys in registers: each top-k round takes the
// largest unpicked (key, lowest id) of the warp by redux.sync, and only the lane that owned the pick rescans its
// registers (the memory version re-read all E logits and ran 10 shuffles per round: 6.5 us of a batch-1 router).
template <int NV>
__device__ __forceinline__ void route_token_regs(const float* __restrict__ lg, int E, int k, int renorm,
                                                 int fold_shared, int lane, int& out_e, float& out_w) {
  float v[NV];  // all loads in flight at once
#pragma unroll
  for (int i = 0; i < NV; ++i) v[i] = lane + 32 * i < E ? lg[lane + 32 * i] : -3.0e38f;
  float mx = -3.0e38f;
#pragma unroll
  for (int i = 0; i < NV; ++i)
    if (lane + 32 * i < E) mx = fmaxf(mx, v[i]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float se = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i)
    if (lane + 32 * i < E) se += expf(v[i] - mx);
  se = warp_sum(se);
  unsigned key[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) key[i] = lane + 32 * i < E ? route_key(v[i]) : 0u;
  // this lane's best unpicked entry: the largest key, the lowest id among equal keys (ascending i = ascending id)
  unsigned bk = 0u;
  int bi = -1;
#pragma unroll
  for (int i = 0; i < NV; ++i)
    if (lane + 32 * i < E && (bi < 0 || key[i] > bk)) {
      bk = key[i];
      bi = i;
    }
  float wsum = 0.f, my_w = 0.f;
  int my_e = 0;
  unsigned picked = 0u;  // bit i: entry i of this lane was chosen
  for (int j = 0; j < k; ++j) {
    const unsigned wk = warp_max_u32(bi >= 0 ? bk : 0u);
    const unsigned cand = (bi >= 0 && bk == wk) ? (unsigned)(lane + 32 * bi) : 0xffffffffu;
    int be = (int)warp_min_u32(cand);
    if (be < 0 || be >= E) be = j;  // nothing left (k > E) or NaN: any valid expert, never a bad index
    if (cand == (unsigned)be) {  // this lane owned the pick: rescan
      picked |= 1u << bi;
      bk = 0u;
      bi = -1;
#pragma unroll
      for (int i = 0; i < NV; ++i)
        if (lane + 32 * i < E && !((picked >> i) & 1u) && (bi < 0 || key[i] > bk)) {
          bk = key[i];
          bi = i;
        }
    }
    const float bv = wk == 0u ? __int_as_float(0x7fc00000) : route_value(wk);  // the pick's logit (NaN: NaN)
    const float pw = expf(bv - mx) / se;
    if (lane == j) {  // lane j keeps round j's choice (k <= 32)
      my_e = be;
      my_w = pw;
    }
    wsum += pw;
  }
  out_e = -1;
  out_w = 0.f;
  if (lane < k) {
    out_e = my_e;
    out_w = renorm ? my_w / wsum : my_w;
  } else if (lane == k && fold_shared) {
    out_e = E;
    out_w = sigmoidf_(lg[E]);
  }
}

// route_token for any E (more than 512 experts: 32 keys per lane would not fit the 64 registers of a 1024-thread
// CTA): the logits re-read from memory every round. The same experts and weights as route_token_regs.
__device__ __forceinline__ void route_token_mem(const float* __restrict__ lg, int E, int k, int renorm, int fold_shared,
                                            int lane, int& out_e, float& out_w) {
  float mx = -3.0e38f;
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, lg[e]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float se = 0.f;
  for (int e = lane; e < E; e += 32) se += expf(lg[e] - mx);
  se = warp_sum(se);
  float wsum = 0.f, my_w = 0.f;
  int prev = -1, my_e = 0;
  float prev_v = 3.0e38f;
  for (int j = 0; j < k; ++j) {
    // the largest logit strictly after (prev_v, prev) in (value desc, id asc) order
    float bv = -3.0e38f;
    int be = 0x7fffffff;
    for (int e = lane; e < E; e += 32) {
      const float v = lg[e];
      const bool after = v < prev_v || (v == prev_v && e > prev);
      if (after && (v > bv || (v == bv && e < be))) {
        bv = v;
        be = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (ov > bv || (ov == bv && oe < be)) {
        bv = ov;
        be = oe;
      }
    }
    if (be < 0 || be >= E) be = j;  // NaN logits: any valid expert (the output is NaN anyway), never a bad index
    const float pw = expf(bv - mx) / se;
    if (lane == j) {  // lane j keeps round j's choice (k <= 32)
      my_e = be;
      my_w = pw;
    }
    wsum += pw;
    prev = be;
    prev_v = bv;
  }
  out_e = -1;
  out_w = 0.f;
  if (lane < k) {
    out_e = my_e;
    out_w = renorm ? my_w / wsum : my_w;
  } else if (lane == k && fold_shared) {
    out_e = E;
    out_w = sigmoidf_(lg[E]);
  }
}


// One token's softmax + top-k over E <= 1024 router logits `lg`, by the 32 lanes of a warp (ties: the lower expert
// id; weights renormalised when renorm != 0). Lane j < k returns round j's expert and weight; lane k the shared
// expert's (E, sigmoid(lg[E])) when fold_shared != 0; the other lanes return e = -1. k <= 31. (E is warp-uniform.)
__device__ __forceinline__ void route_token(const float* __restrict__ lg, int E, int k, int renorm, int fold_shared,
                                            int lane, int& out_e, float& out_w) {
#ifdef ROUTE_MEM_ONLY  // tests: the memory version at every E, to check both give the same bits
  route_token_mem(lg, E, k, renorm, fold_shared, lane, out_e, out_w);
  return;
#endif
  if (E <= 64)
    route_token_regs<2>(lg, E, k, renorm, fold_shared, lane, out_e, out_w);
  else if (E <= 128)
    route_token_regs<4>(lg, E, k, renorm, fold_shared, lane, out_e, out_w);
  else if (E <= 256)
    route_token_regs<8>(lg, E, k, renorm, fold_shared, lane, out_e, out_w);
  else if (E <= 512)
    route_token_regs<16>(lg, E, k, renorm, fold_shared, lane, out_e, out_w);
  else
    route_token_mem(lg, E, k, renorm, fold_shared, lane, out_e, out_w);
}
