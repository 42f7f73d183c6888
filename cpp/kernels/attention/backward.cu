// Checks and dispatch for the attention backward launcher: the row statistics, the zeroed dQ
// accumulator (and dK / dV ones when a KV head's query heads are split over blocks), the
// backward kernel for the head dim, then dq (and dk, dv) out of the accumulators.
#include <cmath>
#include <cstdint>

#include "attention.h"
#include "backward_launch.cuh"
#include "backward_workspace.cuh"
#include "segment_ranges.cuh"

namespace tk::attention {

size_t backward_workspace_bytes(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_q, int64_t seq_k,
                                int64_t head_dim) {
  if (batch < 1 || heads_q < 1 || heads_kv < 1 || seq_q < 1 || seq_k < 1 || head_dim < 1) return 0;
  return backward_workspace::floats(batch, heads_q, heads_kv, seq_q, seq_k, head_dim) * sizeof(float);
}

const char* backward_unsupported(const BackwardParams& p) {
  if (!p.q || !p.k || !p.v || !p.o || !p.dout || !p.lse || !p.dlse || !p.dq || !p.dk || !p.dv || !p.workspace)
    return "a buffer pointer is null";
  if (reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) return "the workspace must be 16-byte aligned";
  if (p.batch < 1 || p.seq_q < 1 || p.seq_k < 1 || p.heads_q < 1 || p.heads_kv < 1)
    return "batch, sequence lengths and head counts must be >= 1";
  if (p.heads_q % p.heads_kv != 0) return "heads_q must be a multiple of heads_kv";
  if (!head_dim_supported(p.head_dim)) return "head_dim must be 64, 128 or 256";
  if (!(std::isfinite(p.scale) && p.scale > 0.f)) return "scale must be finite and > 0";
  if (p.window_left < -1 || p.window_right < -1) return "window bounds must be >= -1";
  if (p.batch > 65535 || p.heads_q > 65535) return "batch and heads_q must be <= 65535";
  if (backward_workspace::padded(p.seq_q) > INT32_MAX) return "seq_q is too large";
  if (const char* why = mask_unsupported(p.mask)) return why;
  return nullptr;
}

cudaError_t backward(const BackwardParams& p, cudaStream_t stream) {
  if (backward_unsupported(p)) return cudaErrorInvalidValue;
  if (p.mask.has_segment_ids()) return backward_with_segment_ids(p, stream);
  return launch_backward_kernels<false>(p, stream);
}

}  // namespace tk::attention
