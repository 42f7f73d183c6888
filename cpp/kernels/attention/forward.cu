// Checks and dispatch for the attention forward launcher.
#include <cmath>

#include "attention.h"
#include "forward_kernel.cuh"

namespace tk::attention {

const char* forward_unsupported(const ForwardParams& p) {
  if (!p.q || !p.k || !p.v || !p.o || !p.lse) return "a buffer pointer is null";
  if (p.batch < 1 || p.seq_q < 1 || p.seq_k < 1 || p.heads_q < 1 || p.heads_kv < 1)
    return "batch, sequence lengths and head counts must be >= 1";
  if (p.heads_q % p.heads_kv != 0) return "heads_q must be a multiple of heads_kv";
  if (!head_dim_supported(p.head_dim)) return "head_dim must be 64, 128 or 256";
  if (!(std::isfinite(p.scale) && p.scale > 0.f)) return "scale must be finite and > 0";
  if (p.window_left < -1 || p.window_right < -1) return "window bounds must be >= -1";
  if (p.batch > 65535 || p.heads_q > 65535) return "batch and heads_q must be <= 65535";
  if (const char* why = mask_unsupported(p.mask)) return why;
  if (int64_t(p.seq_q + 127) / 128 * p.heads_q * p.batch > INT32_MAX / 2)
    return "too many query blocks for the persistent walk's item numbers";
  return nullptr;
}

cudaError_t forward(const ForwardParams& p, cudaStream_t stream) {
  if (forward_unsupported(p)) return cudaErrorInvalidValue;
  if (p.mask.has_segment_ids()) return forward_with_segment_ids(p, stream);
  return launch_forward_kernels<false>(p, stream);
}

}  // namespace tk::attention
