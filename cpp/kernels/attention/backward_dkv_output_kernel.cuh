// Under GQA with split query heads (backward_head_splits): dk and dv in k's dtype, read out of
// the fp32 accumulators the backward kernel added them into (backward_workspace.cuh).
//
// Memory-bound: a block of four warps takes 64 key rows of one (batch, KV head) (heads first:
// head_tile); warp w loads its 16 rows of dK and of dV in fragment order
// (load_global_fragments) and stores them in row order, converting; rows past seq_k are
// skipped.
#pragma once

#include "../../kittens/kittens.cuh"
#include "attention.h"
#include "backward_workspace.cuh"

namespace tk::attention {

using namespace kittens;

template <typename T, int D>
__global__ void __launch_bounds__(4 * WARP_THREADS) dkv_output_kernel(const __grid_constant__ BackwardParams p,
                                                                       const __grid_constant__ backward_workspace ws) {
  const head_tile block = head_tile::of_block(p.heads_kv);
  const int key0 = (block.tile * 4 + warpid()) * BACKWARD_KEY_GROUP, h = block.h, b = block.b;
  if (key0 >= p.seq_k) return;
  rt_fl<16, D> grad;
  load_global_fragments(grad, ws.key_group<D>(ws.dk_accum, b, h, key0));
  store(gl<T>::contiguous((T*)p.dk, p.batch, p.seq_k, p.heads_kv, D), grad, {b, h, key0});
  load_global_fragments(grad, ws.key_group<D>(ws.dv_accum, b, h, key0));
  store(gl<T>::contiguous((T*)p.dv, p.batch, p.seq_k, p.heads_kv, D), grad, {b, h, key0});
}

template <typename T, int D>
cudaError_t launch_dkv_output(const BackwardParams& p, const backward_workspace& ws, cudaStream_t stream) {
  static_assert(BACKWARD_KEY_GROUP == 16, "a warp's register tile of 16 rows");
  dim3 grid;
  const int tiles = (ws.seq_k_padded + 4 * BACKWARD_KEY_GROUP - 1) / (4 * BACKWARD_KEY_GROUP);
  if (!head_tile::grid(grid, tiles, p.heads_kv, p.batch)) return cudaErrorInvalidValue;
  dkv_output_kernel<T, D><<<grid, 4 * WARP_THREADS, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace tk::attention
