// Checks and dispatch for the attention backward's passes (attention.h, BackwardPasses): the
// row statistics and the zeroed dQ accumulator, the backward kernel, dq out of the accumulator.
#include <cmath>
#include <cstdint>

#include "attention.h"
#include "backward_launch.cuh"
#include "backward_workspace.cuh"
#include "segment_ranges.cuh"

namespace tk::attention {

size_t backward_dq_state_bytes(int64_t batch, int64_t heads_q, int64_t dq_rows, int64_t head_dim) {
  if (batch < 1 || heads_q < 1 || dq_rows < 1 || head_dim < 1) return 0;
  return backward_workspace::state_floats(batch, heads_q, dq_rows, head_dim) * sizeof(float);
}

size_t backward_key_workspace_bytes(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_k,
                                    int64_t head_dim) {
  if (batch < 1 || heads_q < 1 || heads_kv < 1 || seq_k < 1 || head_dim < 1) return 0;
  return 2 * backward_workspace::dkv_floats(batch, heads_q, heads_kv, seq_k, head_dim) * sizeof(float);
}

const char* backward_unsupported(const BackwardParams& p, unsigned passes) {
  if (passes == 0 || (passes & ~unsigned(ALL_PASSES))) return "unknown backward passes";
  const bool keys = passes & KEYS;  // only the kernel's pass reads keys and the mask
  if (p.batch < 1 || p.seq_q < 1 || p.heads_q < 1) return "batch, seq_q and heads_q must be >= 1";
  if (keys && (p.seq_k < 1 || p.heads_kv < 1)) return "seq_k and heads_kv must be >= 1";
  if (!p.workspace) return "the dQ state's pointer is null";
  if ((passes & ROW_STATS) && (!p.o || !p.dout || !p.lse || !p.dlse)) return "a buffer pointer is null";
  if (keys && (!p.q || !p.k || !p.v || !p.dout || !p.dk || !p.dv)) return "a buffer pointer is null";
  if ((passes & DQ_OUT) && !p.dq) return "a buffer pointer is null";
  if (keys && p.heads_q > p.heads_kv && !p.key_workspace) return "the key workspace's pointer is null";
  for (const void* w : {p.workspace, p.key_workspace})
    if (reinterpret_cast<uintptr_t>(w) % 16 != 0) return "the workspaces must be 16-byte aligned";
  if (keys && p.heads_q % p.heads_kv != 0) return "heads_q must be a multiple of heads_kv";
  if (!head_dim_supported(p.head_dim)) return "head_dim must be 64, 128 or 256";
  if ((passes & (ROW_STATS | KEYS)) && !(std::isfinite(p.scale) && p.scale > 0.f)) return "scale must be finite and > 0";
  if (keys && (p.window_left < -1 || p.window_right < -1)) return "window bounds must be >= -1";
  if (p.batch > 65535 || p.heads_q > 65535) return "batch and heads_q must be <= 65535";
  if (p.dq_rows < 0 || backward_workspace::padded(p.state_rows()) > INT32_MAX) return "seq_q or dq_rows is out of range";
  const bool whole_state = p.state_rows() == p.seq_q && p.dq_row_shift == 0;
  if ((passes & (ROW_STATS | DQ_OUT)) && !whole_state)
    return "the row statistics and dq passes take the dQ state's rows, unshifted (seq_q = dq_rows, dq_row_shift = 0)";
  if (!whole_state && (p.seq_q % BACKWARD_Q_TILE || p.dq_row_shift % BACKWARD_Q_TILE || p.state_rows() % BACKWARD_Q_TILE ||
                       p.dq_row_shift < 0 || p.dq_row_shift >= p.state_rows() || p.seq_q > p.state_rows()))
    return "a call on part of the dQ state's rows needs seq_q, dq_rows and dq_row_shift multiples of 64, "
           "seq_q <= dq_rows and 0 <= dq_row_shift < dq_rows";
  if (keys) {
    if (const char* why = mask_unsupported(p.mask)) return why;
  }
  return nullptr;
}

cudaError_t backward(const BackwardParams& p, cudaStream_t stream, unsigned passes) {
  if (backward_unsupported(p, passes)) return cudaErrorInvalidValue;
  if (p.mask.has_segment_ids()) return backward_with_segment_ids(p, passes, stream);
  return launch_backward_kernels<false>(p, passes, stream);
}

}  // namespace tk::attention
