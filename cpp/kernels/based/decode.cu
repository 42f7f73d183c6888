// Checks and dispatch for the Based decode-step launcher.
#include <cmath>

#include "based.h"
#include "decode_kernel.cuh"

namespace tk::based {

const char* decode_unsupported(const DecodeParams& p) {
  if (!p.q || !p.k || !p.v || !p.state || !p.z || !p.y || !p.state_out || !p.z_out) return "a buffer pointer is null";
  if (p.rows < 1) return "there must be at least one (batch, head) row";
  if (p.rows > 0x7fffffff) return "too many (batch, head) rows for one grid";
  if (!is_value_dim(p.value_dim)) return VALUE_DIM_SENTENCE;
  if (!(std::isfinite(p.eps) && p.eps >= 0.f)) return "eps must be finite and >= 0";
  return nullptr;
}

cudaError_t decode(const DecodeParams& p, cudaStream_t stream) {
  if (decode_unsupported(p)) return cudaErrorInvalidValue;
  return p.dtype == DType::bf16 ? launch_decode<bf16>(p, stream) : launch_decode<half>(p, stream);
}

}  // namespace tk::based
