// The attention backward's last pass: dq in q's dtype, read out of the fp32 accumulator
// (backward_workspace.cuh).
//
// Memory-bound: a block of four warps takes one query tile of one (batch, head) (heads first:
// head_tile). Warp w loads its 16 rows of each 64-column chunk in the accumulator's fragment
// order (load_global_fragments: each 16-byte load of a warp reads 512 contiguous bytes) and
// stores them in row order, converting (kittens store: 16-byte stores that fill whole 32-byte
// sectors); rows past seq_q are skipped.
#pragma once

#include "../../kittens/kittens.cuh"
#include "attention.h"
#include "backward_workspace.cuh"

namespace tk::attention {

using namespace kittens;

template <typename T, int D>
__global__ void __launch_bounds__(4 * WARP_THREADS) dq_output_kernel(const __grid_constant__ BackwardParams p,
                                                                      const __grid_constant__ backward_workspace ws) {
  const head_tile block = head_tile::of_block(p.heads_q);
  const int q0 = block.tile * BACKWARD_Q_TILE, h = block.h, b = block.b, warp = warpid();
  rt_fl<16, D> dq;  // this warp's 16 rows
#pragma unroll
  for (int chunk = 0; chunk < D / 64; chunk++)  // columns 64 chunk ..: base tiles 4 chunk ..
    load_global_fragments(dq.template col_slice<64>(4 * chunk), ws.dq_chunk<D>(b, h, q0, chunk) + 16 * 64 * warp);
  store(gl<T>::contiguous((T*)p.dq, p.batch, p.seq_q, p.heads_q, D), dq, {b, h, q0 + 16 * warp});
}

template <typename T, int D>
cudaError_t launch_dq_output(const BackwardParams& p, const backward_workspace& ws, cudaStream_t stream) {
  static_assert(BACKWARD_Q_TILE == 4 * 16, "four warps of 16 rows");
  dim3 grid;
  if (!head_tile::grid(grid, ws.seq_q_padded / BACKWARD_Q_TILE, p.heads_q, p.batch)) return cudaErrorInvalidValue;
  dq_output_kernel<T, D><<<grid, 4 * WARP_THREADS, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace tk::attention
