// Flash attention launchers: plain C++ entry points that know nothing of XLA or JAX.
// Tensors are contiguous [batch, seq, heads, head_dim]; lse is [batch, heads_q, seq_q] float32.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tk::attention {

enum class DType { bf16, fp16 };

// The head dims the forward and backward kernels are built for.
constexpr int HEAD_DIMS[] = {64, 128, 256};
constexpr bool head_dim_supported(int d) {
  for (int x : HEAD_DIMS)
    if (x == d) return true;
  return false;
}

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
  const void* q;       // [batch, seq_q, heads_q, head_dim]
  const void* k;       // [batch, seq_k, heads_kv, head_dim]
  const void* v;       // [batch, seq_k, heads_kv, head_dim]
  const void* o;       // [batch, seq_q, heads_q, head_dim], the forward's output
  const void* dout;    // [batch, seq_q, heads_q, head_dim], gradient of the output
  const float* lse;    // [batch, heads_q, seq_q], the forward's (natural log, -inf for rows that see no key)
  const float* dlse;   // [batch, heads_q, seq_q], gradient of lse (zeros when lse is not differentiated)
  void* dq;            // [batch, seq_q, heads_q, head_dim], q's dtype
  void* dk;            // [batch, seq_k, heads_kv, head_dim], k's dtype (summed over the GQA group)
  void* dv;            // [batch, seq_k, heads_kv, head_dim]
  void* workspace;     // backward_workspace_bytes(...) bytes, 16-byte aligned; its contents need no setting
  int batch, seq_q, seq_k, heads_q, heads_kv, head_dim;
  float scale;
  int window_left, window_right;  // as in ForwardParams
  DType dtype;
};

// Bytes of scratch memory the backward needs (what its passes hand each other). Linear in batch:
// callers that fold extra leading axes into the batch may size it per batch and multiply.
size_t backward_workspace_bytes(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_q, int64_t seq_k,
                                int64_t head_dim);

const char* backward_unsupported(const BackwardParams& p);

// Launches on `stream` only, never synchronises: the row statistics (lse and delta in the
// kernels' units), the zeroing of the dQ accumulator, the backward kernel, then dq from the
// accumulator, all in the workspace.
cudaError_t backward(const BackwardParams& p, cudaStream_t stream);

}  // namespace tk::attention
