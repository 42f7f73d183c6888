// Based linear attention launchers: plain C++ entry points that know nothing of XLA or JAX.
//
// Per (batch, head), with the Taylor feature map phi (273 features, see tk_jax/reference/based.py):
//   num_t = phi(q_t) . S0 + sum_{j<=t} (1 + s_tj + s_tj^2 / 2) v_j,     s_tj = q_t . k_j / 4
//   den_t = phi(q_t) . z0 + sum_{j<=t} (1 + s_tj + s_tj^2 / 2)
//   y_t   = num_t / (den_t + eps) if normalize else num_t
//   S     = S0 + sum_j phi(k_j) v_j^T,    z = z0 + sum_j phi(k_j)       (the final state)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tk::based {

enum class DType { bf16, fp16 };

// The kernels' conventions, defined here only: the launchers check against them, and the
// extension hands them to Python (tk_jax._tk.based_conventions(), cpp/module.cc).
constexpr int FEATURE_DIM = 16;   // q and k have 16 features in Based
constexpr int NUM_FEATURES = 1 + FEATURE_DIM + FEATURE_DIM * FEATURE_DIM;  // 273 Taylor features
constexpr int CHUNK = 64;         // tokens per step of the kernels' sweep over the sequence
constexpr int V_BLOCK = 64;       // value columns per thread block (dq/dk come in partial sums per block)
constexpr int VALUE_DIMS[] = {V_BLOCK, 2 * V_BLOCK};  // v's last axis: one or two column blocks
constexpr int MAX_BATCH = 65535;  // batch and heads are grid dimensions z and y of the sequence kernels
constexpr int MAX_HEADS = 65535;

constexpr bool is_value_dim(int64_t value_dim) {
  for (int d : VALUE_DIMS)
    if (value_dim == d) return true;
  return false;
}

// What the launchers' *_unsupported() say when a call breaks the two limits above.
static_assert(VALUE_DIMS[0] == 64 && VALUE_DIMS[1] == 128 && MAX_BATCH == 65535 && MAX_HEADS == 65535,
              "the sentences below name these numbers");
constexpr const char* VALUE_DIM_SENTENCE = "value_dim (v's last axis) must be 64 or 128";
constexpr const char* GRID_SENTENCE = "batch and heads must be <= 65535 (grid limits)";

struct ForwardParams {
  const void* q;        // [batch, seq, heads, 16]
  const void* k;        // [batch, seq, heads, 16]
  const void* v;        // [batch, seq, heads, value_dim]
  const float* state0;  // [batch, heads, 273, value_dim]: S0 (zeros for no initial state)
  const float* z0;      // [batch, heads, 273]
  void* y;              // [batch, seq, heads, value_dim], v's dtype
  float* state;         // [batch, heads, 273, value_dim]: S after the last token
  float* z;             // [batch, heads, 273]
  float* den;           // [batch, heads, seq]: den_t (without eps), kept for the backward
  int batch, seq, heads, value_dim;
  bool normalize;
  float eps;            // added to the normaliser when normalize
  DType dtype;          // of q, k, v and y
};

// nullptr when the kernel supports `p`, else a sentence saying what is wrong.
const char* forward_unsupported(const ForwardParams& p);

// Launches on `stream` only; never synchronises. Returns the launch status.
cudaError_t forward(const ForwardParams& p, cudaStream_t stream);

// The backward, given dy and the cotangents dS, dz of the final state. Write v' = [v, 1] and
// S' = [S, z], so that [num_t, den_t] = phi(q_t) . S'_t with S'_t = S'0 + sum_{j<=t} phi(k_j) v'_j^T.
// With dnum'_t = [dy_t, 0] * inv_den_t + [0, dden_t] (inv_den = 1 / (den + eps) and
// dden = -(dy . y) inv_den when normalised; 1 and 0 otherwise, prepared by the caller):
//   dphi(q_t) = S'_t dnum'_t                                    -> dq (a forward sweep)
//   R'_j      = [dS, dz] + sum_{t>=j} phi(q_t) dnum'_t^T
//   dphi(k_j) = R'_j v'_j,  dv_j = R_j^T phi(k_j)               -> dk, dv (a reverse sweep)
//   dS0, dz0  = R'_0
// dq and dk come out as float32 partial sums, one per 64-column block of v; the caller adds
// them up (a single block when Dv = 64).
struct BackwardParams {
  const void* q;          // [batch, seq, heads, 16]
  const void* k;          // [batch, seq, heads, 16]
  const void* v;          // [batch, seq, heads, value_dim]
  const void* dy;         // [batch, seq, heads, value_dim], v's dtype
  const float* inv_den;   // [batch, heads, seq]
  const float* dden;      // [batch, heads, seq]
  const float* state0;    // [batch, heads, 273, value_dim]: S0 of the forward
  const float* z0;        // [batch, heads, 273]
  const float* d_state;   // [batch, heads, 273, value_dim]: cotangent of the final S
  const float* d_z;       // [batch, heads, 273]
  float* dq_parts;        // [batch, seq, heads, value_dim / 64, 16]
  float* dk_parts;        // [batch, seq, heads, value_dim / 64, 16]
  void* dv;               // [batch, seq, heads, value_dim], v's dtype
  float* d_state0;        // [batch, heads, 273, value_dim]
  float* d_z0;            // [batch, heads, 273]
  int batch, seq, heads, value_dim;
  bool with_dq;           // false: skip the dq sweep (dq_parts come back zero)
  DType dtype;
};

const char* backward_unsupported(const BackwardParams& p);
cudaError_t backward(const BackwardParams& p, cudaStream_t stream);

// One generation step for `rows` independent (batch, head) rows: the new token attends to
// itself, so the state is updated first, in place (state and z may alias state_out, z_out):
//   S' = S + phi(k) v^T,  z' = z + phi(k),  y = phi(q) S' / (phi(q) . z' + eps)  (or without /).
struct DecodeParams {
  const void* q;      // [rows, 16]
  const void* k;      // [rows, 16]
  const void* v;      // [rows, value_dim]
  const float* state; // [rows, 273, value_dim]
  const float* z;     // [rows, 273]
  void* y;            // [rows, value_dim], v's dtype
  float* state_out;   // [rows, 273, value_dim]
  float* z_out;       // [rows, 273]
  int64_t rows;
  int value_dim;
  bool normalize;
  float eps;
  DType dtype;
};

const char* decode_unsupported(const DecodeParams& p);
cudaError_t decode(const DecodeParams& p, cudaStream_t stream);

}  // namespace tk::based
