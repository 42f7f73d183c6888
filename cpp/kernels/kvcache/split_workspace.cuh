// The workspace in which the blocks of a split call leave their partial results for the
// combine pass. Its layout is defined here only; Python knows only its size.
//
// Output rows are numbered as lse is laid out, row = (b heads_q + h) seq_q + t. Each row has
// one partial result per split s:
//   o[row][s][0 .. head_dim)   fp32, already divided by the split's own softmax sum
//   lse[row][s]                fp32, natural log of that sum (with the max added back);
//                              -inf where the split saw no key of the row (its o is then unset)
#pragma once

#include <cstddef>
#include <cstdint>

namespace tk::kvcache {

struct split_workspace {
  float* o;
  float* lse;
  int splits, head_dim;

  __host__ __device__ static int64_t rows(int64_t batch, int64_t heads_q, int64_t seq_q) {
    return batch * heads_q * seq_q;
  }
  // o's bytes, then lse's: linear in rows (so in batch), and o stays 16-byte aligned (it
  // comes first, at the buffer's start).
  __host__ __device__ static size_t o_bytes(int64_t rows, int64_t splits, int64_t head_dim) {
    return size_t(rows * splits * head_dim) * sizeof(float);
  }
  __host__ __device__ static size_t lse_bytes(int64_t rows, int64_t splits) {
    return size_t(rows * splits) * sizeof(float);
  }
  __host__ __device__ static split_workspace of(void* base, int64_t rows, int splits, int head_dim) {
    char* bytes = static_cast<char*>(base);
    return {reinterpret_cast<float*>(bytes), reinterpret_cast<float*>(bytes + o_bytes(rows, splits, head_dim)),
            splits, head_dim};
  }

  __device__ float* o_of(int64_t row, int split) const { return o + (row * splits + split) * head_dim; }
  __device__ float* lse_of(int64_t row) const { return lse + row * splits; }  // the row's splits
};

}  // namespace tk::kvcache
