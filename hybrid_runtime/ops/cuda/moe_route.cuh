// The MoE's per-token routing (softmax over the router logits, top-k, renormalisation, the folded shared
// expert), one function for fused.cu's moe_route (decode) and moe_gemm.cu's moe_topk (prefill), so both pick
// the same experts with the same weights, bit for bit. Included textually (hybrid_runtime/cuda/kernels.py
// `source`): the including file defines warp_sum and sigmoidf_ first.
// One token's softmax + top-k over E router logits `lg`, by the 32 lanes of a warp (ties: the lower expert id;
// weights renormalised when renorm != 0). Lane j < k returns round j's expert and weight; lane k the shared
// expert's (E, sigmoid(lg[E])) when fold_shared != 0; the other lanes return e = -1. k <= 31.
__device__ __forceinline__ void route_token(const float* __restrict__ lg, int E, int k, int renorm, int fold_shared,
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

