// Checks and dispatch for the Based forward launcher.
#include <cmath>

#include "based.h"
#include "forward_kernel.cuh"

namespace tk::based {

const char* forward_unsupported(const ForwardParams& p) {
  if (!p.q || !p.k || !p.v || !p.state0 || !p.z0 || !p.y || !p.state || !p.z || !p.den) return "a buffer pointer is null";
  if (p.batch < 1 || p.seq < 1 || p.heads < 1) return "batch, sequence length and heads must be >= 1";
  if (!is_value_dim(p.value_dim)) return VALUE_DIM_SENTENCE;
  if (p.batch > MAX_BATCH || p.heads > MAX_HEADS) return GRID_SENTENCE;
  if (!(std::isfinite(p.eps) && p.eps >= 0.f)) return "eps must be finite and >= 0";
  return nullptr;
}

cudaError_t forward(const ForwardParams& p, cudaStream_t stream) {
  if (forward_unsupported(p)) return cudaErrorInvalidValue;
  return p.dtype == DType::bf16 ? launch_forward<bf16>(p, stream) : launch_forward<half>(p, stream);
}

}  // namespace tk::based
