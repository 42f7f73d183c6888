// Checks and dispatch for the attention backward launcher: the row statistics, the zeroed dQ
// accumulator (and dK / dV ones when a KV head's query heads are split over blocks), the
// backward kernel for the head dim, then dq (and dk, dv) out of the accumulators.
#include <cmath>
#include <cstdint>

#include "attention.h"
#include "backward_dkv_output_kernel.cuh"
#include "backward_dq_output_kernel.cuh"
#include "backward_kernel.cuh"
#include "backward_row_stats_kernel.cuh"
#include "backward_split_kernel.cuh"
#include "backward_workspace.cuh"

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
  return nullptr;
}

template <typename T, int D>
static cudaError_t backward_with(const BackwardParams& p, cudaStream_t stream) {
  const backward_workspace ws = backward_workspace::of(p);
  int sms = 0;
  cudaError_t err = multiprocessor_count(&sms);
  constexpr int key_rows = D == 256 ? split_backward_config<D>::KV_ROWS : backward_config<D>::KV_ROWS;
  const int head_splits = err == cudaSuccess ? backward_head_splits(p, key_rows, sms) : 1;
  if (err == cudaSuccess) err = launch_row_stats<T, D>(p, ws, stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(ws.dq_accum, 0, ws.dq_accum_floats * sizeof(float), stream);
  if (err == cudaSuccess && head_splits > 1)  // dK then dV: adjacent in the workspace
    err = cudaMemsetAsync(ws.dk_accum, 0, 2 * ws.dkv_accum_floats * sizeof(float), stream);
  if (err == cudaSuccess) {
    if constexpr (D == 256) err = launch_split_backward<T, D>(p, ws, head_splits, stream);
    else err = launch_backward<T, D>(p, ws, head_splits, stream);
  }
  if (err == cudaSuccess) err = launch_dq_output<T, D>(p, ws, stream);
  if (err == cudaSuccess && head_splits > 1) err = launch_dkv_output<T, D>(p, ws, stream);
  return err;
}

template <typename T>
static cudaError_t backward_typed(const BackwardParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return backward_with<T, 64>(p, stream);
    case 128: return backward_with<T, 128>(p, stream);
    case 256: return backward_with<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t backward(const BackwardParams& p, cudaStream_t stream) {
  if (backward_unsupported(p)) return cudaErrorInvalidValue;
  return p.dtype == DType::bf16 ? backward_typed<bf16>(p, stream) : backward_typed<half>(p, stream);
}

}  // namespace tk::attention
