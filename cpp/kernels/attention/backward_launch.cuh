// The attention backward's passes (attention.h, BackwardPasses), in order, for one dtype and
// head dim, with (SEG) or without segment ids: the row statistics and the zeroed dQ
// accumulator; the backward kernel for the head dim (with zeroed dK / dV accumulators and dk, dv
// out of them when a KV head's query heads are split over blocks); then dq out of its
// accumulator. Each SEG is built in a translation unit of its own (backward.cu,
// backward_segment_ids.cu), so they compile in parallel.
#pragma once

#include "attention.h"
#include "backward_dkv_output_kernel.cuh"
#include "backward_dq_output_kernel.cuh"
#include "backward_kernel.cuh"
#include "backward_row_stats_kernel.cuh"
#include "backward_split_kernel.cuh"
#include "backward_workspace.cuh"

namespace tk::attention {

template <typename T, int D, bool SEG>
cudaError_t backward_with(const BackwardParams& p, unsigned passes, cudaStream_t stream) {
  const backward_workspace ws = backward_workspace::of(p);
  cudaError_t err = cudaSuccess;
  if (passes & ROW_STATS) {
    err = launch_row_stats<T, D>(p, ws, stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(ws.dq_accum, 0, ws.dq_accum_floats * sizeof(float), stream);
  }
  if (err == cudaSuccess && (passes & KEYS)) {
    int sms = 0;
    err = multiprocessor_count(&sms);
    constexpr int key_rows = D == 256 ? split_backward_config<D>::KV_ROWS : backward_config<D>::KV_ROWS;
    const int head_splits = err == cudaSuccess ? backward_head_splits(p, key_rows, sms) : 1;
    if (err == cudaSuccess && head_splits > 1)  // dK then dV: adjacent in the key workspace
      err = cudaMemsetAsync(ws.dk_accum, 0, 2 * ws.dkv_accum_floats * sizeof(float), stream);
    if (err == cudaSuccess) {
      if constexpr (D == 256) err = launch_split_backward<T, D, SEG>(p, ws, head_splits, stream);
      else err = launch_backward<T, D, SEG>(p, ws, head_splits, stream);
    }
    if (err == cudaSuccess && head_splits > 1) err = launch_dkv_output<T, D>(p, ws, stream);
  }
  if (err == cudaSuccess && (passes & DQ_OUT)) err = launch_dq_output<T, D>(p, ws, stream);
  return err;
}

template <bool SEG>
cudaError_t launch_backward_kernels(const BackwardParams& p, unsigned passes, cudaStream_t stream) {
  const bool bf = p.dtype == DType::bf16;
  switch (p.head_dim) {
    case 64: return bf ? backward_with<bf16, 64, SEG>(p, passes, stream) : backward_with<half, 64, SEG>(p, passes, stream);
    case 128:
      return bf ? backward_with<bf16, 128, SEG>(p, passes, stream) : backward_with<half, 128, SEG>(p, passes, stream);
    case 256:
      return bf ? backward_with<bf16, 256, SEG>(p, passes, stream) : backward_with<half, 256, SEG>(p, passes, stream);
    default: return cudaErrorInvalidValue;
  }
}

// With segment ids: the segment-range prologue, then the SEG passes (backward_segment_ids.cu).
cudaError_t backward_with_segment_ids(const BackwardParams& p, unsigned passes, cudaStream_t stream);

}  // namespace tk::attention
