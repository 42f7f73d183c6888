// Flash attention launchers: plain C++ entry points that know nothing of XLA or JAX.
// Tensors are contiguous [batch, seq, heads, head_dim]; lse is [batch, heads_q, seq_q] float32.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace tk::attention {

enum class DType { bf16, fp16 };

struct ForwardParams {
  const void* q;  // [batch, seq_q, heads_q, head_dim]
  const void* k;  // [batch, seq_k, heads_kv, head_dim]
  const void* v;  // [batch, seq_k, heads_kv, head_dim]
  void* o;        // [batch, seq_q, heads_q, head_dim], q's dtype
  float* lse;     // [batch, heads_q, seq_q], natural log; -inf for rows that see no key
  int batch, seq_q, seq_k, heads_q, heads_kv, head_dim;
  float scale;
  // Query i sees key j iff  i + (seq_k - seq_q) - window_left <= j <= i + (seq_k - seq_q) + window_right;
  // a negative bound is unbounded. Causal attention is window_right = 0.
  int window_left, window_right;
  DType dtype;
};

// nullptr when the kernel supports `p`, else a sentence saying what is wrong.
const char* forward_unsupported(const ForwardParams& p);

// Launches on `stream` only; never synchronises. Returns the launch status.
cudaError_t forward(const ForwardParams& p, cudaStream_t stream);

struct BackwardParams {
  const void* q;      // [batch, seq_q, heads_q, head_dim]
  const void* k;      // [batch, seq_k, heads_kv, head_dim]
  const void* v;      // [batch, seq_k, heads_kv, head_dim]
  const void* dout;   // [batch, seq_q, heads_q, head_dim], gradient of the output
  const float* lse;   // [batch, heads_q, seq_q_padded]: lse * log2(e); +inf marks rows that saw no key and padding
  const float* delta; // [batch, heads_q, seq_q_padded]: scale * (rowsum(dout * o) - dlse), 0 on padding
  float* dq_accum;    // float32, zeroed and accumulated here; layout: dq_accum_floats below
  void* dk;           // [batch, seq_k, heads_kv, head_dim], k's dtype (summed over the GQA group)
  void* dv;           // [batch, seq_k, heads_kv, head_dim]
  int batch, seq_q, seq_k, heads_q, heads_kv, head_dim;
  int seq_q_padded;   // seq_q rounded up to a multiple of BACKWARD_Q_TILE
  float scale;
  int window_left, window_right;  // as in ForwardParams
  DType dtype;
};

// lse and delta rows are padded to a multiple of this many queries.
constexpr int BACKWARD_Q_TILE = 64;

// The dQ accumulator's layout: [batch, heads_q, seq_q_padded / 64, head_dim / 64, 64 x 64], each
// 64-query x 64-column chunk in the fragment order of four warps' kittens store_fragments (warp
// w holds rows 16 w ..; element (w, j, half, g, t, down, bit) is row 16 w + 8 down + g, column
// 16 j + 8 half + 2 t + bit), so that a chunk is added with one contiguous bulk reduction
// (head_dim <= 128) or with vector reductions of whole 128-byte lines (head_dim 256), and its
// stores are conflict-free.
inline size_t dq_accum_floats(const BackwardParams& p) {
  return size_t(p.batch) * p.heads_q * p.seq_q_padded * p.head_dim;
}

const char* backward_unsupported(const BackwardParams& p);

// dq_accum is zeroed on `stream` first; the launches never synchronise.
cudaError_t backward(const BackwardParams& p, cudaStream_t stream);

}  // namespace tk::attention
