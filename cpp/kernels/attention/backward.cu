// Checks and dispatch for the attention backward launcher.
#include <cmath>

#include "attention.h"
#include "backward_kernel.cuh"
#include "backward_split_kernel.cuh"

namespace tk::attention {

const char* backward_unsupported(const BackwardParams& p) {
  if (!p.q || !p.k || !p.v || !p.dout || !p.lse || !p.delta || !p.dq_accum || !p.dk || !p.dv)
    return "a buffer pointer is null";
  if (p.batch < 1 || p.seq_q < 1 || p.seq_k < 1 || p.heads_q < 1 || p.heads_kv < 1)
    return "batch, sequence lengths and head counts must be >= 1";
  if (p.heads_q % p.heads_kv != 0) return "heads_q must be a multiple of heads_kv";
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return "head_dim must be 64, 128 or 256";
  if (p.seq_q_padded != (p.seq_q + BACKWARD_Q_TILE - 1) / BACKWARD_Q_TILE * BACKWARD_Q_TILE)
    return "seq_q_padded must be seq_q rounded up to a multiple of 64";
  if (!(std::isfinite(p.scale) && p.scale > 0.f)) return "scale must be finite and > 0";
  if (p.window_left < -1 || p.window_right < -1) return "window bounds must be >= -1";
  if (p.batch > 65535 || p.heads_kv > 65535) return "batch and heads_kv must be <= 65535";
  return nullptr;
}

template <typename T>
static cudaError_t backward_typed(const BackwardParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_backward<T, 64>(p, stream);
    case 128: return launch_backward<T, 128>(p, stream);
    case 256: return launch_split_backward<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t backward(const BackwardParams& p, cudaStream_t stream) {
  if (backward_unsupported(p)) return cudaErrorInvalidValue;
  return p.dtype == DType::bf16 ? backward_typed<bf16>(p, stream) : backward_typed<half>(p, stream);
}

}  // namespace tk::attention
