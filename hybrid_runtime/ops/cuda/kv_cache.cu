// Paged KV write: token t's K and V rows ([Hkv * head_dim] elements each) go to pool row dst_rows[t]
// (= page * page_size + offset, computed and bounds-checked on the host from the page table).
// Dtype-agnostic: rows are copied as 16-, 4- or 1-byte words, whichever divides the row size.
// grid (T), any block size; pools [num_pages * page_size, row_words] as words.

template <typename W>
__device__ __forceinline__ void copy_rows(const W* __restrict__ k_new, const W* __restrict__ v_new,
                                          W* __restrict__ k_pool, W* __restrict__ v_pool,
                                          const long long* __restrict__ dst_rows, int T, int row_words) {
  const int t = blockIdx.x;
  if (t >= T) return;
  const long long d = dst_rows[t] * row_words;
  const long long s = (long long)t * row_words;
  for (int i = threadIdx.x; i < row_words; i += blockDim.x) {
    k_pool[d + i] = k_new[s + i];
    v_pool[d + i] = v_new[s + i];
  }
}

extern "C" __global__ void kv_write16(const uint4* k_new, const uint4* v_new, uint4* k_pool, uint4* v_pool,
                                      const long long* dst_rows, int T, int row_words) {
  copy_rows(k_new, v_new, k_pool, v_pool, dst_rows, T, row_words);
}
extern "C" __global__ void kv_write4(const unsigned int* k_new, const unsigned int* v_new, unsigned int* k_pool,
                                     unsigned int* v_pool, const long long* dst_rows, int T, int row_words) {
  copy_rows(k_new, v_new, k_pool, v_pool, dst_rows, T, row_words);
}
extern "C" __global__ void kv_write1(const unsigned char* k_new, const unsigned char* v_new, unsigned char* k_pool,
                                     unsigned char* v_pool, const long long* dst_rows, int T, int row_words) {
  copy_rows(k_new, v_new, k_pool, v_pool, dst_rows, T, row_words);
}
