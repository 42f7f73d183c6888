// Based linear attention launchers: plain C++ entry points that know nothing of XLA or JAX.
//
// Per (batch, head), with the Taylor feature map phi (273 features, see tk_jax/reference/based.py):
//   num_t = phi(q_t) . S0 + sum_{j<=t} (1 + s_tj + s_tj^2 / 2) v_j,     s_tj = q_t . k_j / 4
//   den_t = phi(q_t) . z0 + sum_{j<=t} (1 + s_tj + s_tj^2 / 2)
//   y_t   = num_t / (den_t + eps) if normalize else num_t
//   S     = S0 + sum_j phi(k_j) v_j^T,    z = z0 + sum_j phi(k_j)       (the final state)
#pragma once

#include <cuda_runtime.h>

namespace tk::based {

enum class DType { bf16, fp16 };

constexpr int FEATURE_DIM = 16;   // q and k have 16 features in Based
constexpr int NUM_FEATURES = 273; // 1 + 16 + 16 * 16 Taylor features

struct ForwardParams {
  const void* q;        // [batch, seq, heads, 16]
  const void* k;        // [batch, seq, heads, 16]
  const void* v;        // [batch, seq, heads, value_dim]
  const float* state0;  // [batch, heads, 273, value_dim]: S0 (zeros for no initial state)
  const float* z0;      // [batch, heads, 273]
  void* y;              // [batch, seq, heads, value_dim], v's dtype
  float* state;         // [batch, heads, 273, value_dim]: S after the last token
  float* z;             // [batch, heads, 273]
  int batch, seq, heads, value_dim;
  bool normalize;
  float eps;            // added to the normaliser when normalize
  DType dtype;          // of q, k, v and y
};

// nullptr when the kernel supports `p`, else a sentence saying what is wrong.
const char* forward_unsupported(const ForwardParams& p);

// Launches on `stream` only; never synchronises. Returns the launch status.
cudaError_t forward(const ForwardParams& p, cudaStream_t stream);

}  // namespace tk::based
