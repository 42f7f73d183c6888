// The attention backward's first pass: per query row, the lse2 and delta its kernels read
// (backward_workspace.cuh), from the forward's lse and output O, the output's gradient dO and
// lse's gradient dlse:
//   lse2 = log2(e) lse   (+inf where lse = -inf)      delta = scale (rowsum(dO o O) - dlse)
// and +inf / 0 on the padding rows up to a whole query tile.
//
// Memory-bound: a block takes one query tile of one (batch, head) (heads first: head_tile),
// D / 8 threads a row, each loading 16 bytes of dO and of O (a row's 2 D bytes in whole
// 128-byte lines). A thread issues the loads of up to four rows before it sums them, so that
// 16-32 KB are in flight a block.
#pragma once

#include "../../kittens/kittens.cuh"
#include "attention.h"
#include "backward_workspace.cuh"

namespace tk::attention {

using namespace kittens;

constexpr int ROW_STATS_THREADS = 256;

// The dot product of 8 elements of type T held in two 16-byte words.
template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const auto* x = reinterpret_cast<const packed_t<T>*>(&a);
  const auto* y = reinterpret_cast<const packed_t<T>*>(&b);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 u = unpack(x[i]), v = unpack(y[i]);
    sum = fmaf(u.x, v.x, fmaf(u.y, v.y, sum));
  }
  return sum;
}

template <typename T, int D>
__global__ void __launch_bounds__(ROW_STATS_THREADS, 2) row_stats_kernel(const __grid_constant__ BackwardParams p,
                                                                          const __grid_constant__ backward_workspace ws) {
  constexpr int ROW_THREADS = D / 8;  // threads that share a row, 8 elements each
  constexpr int ROWS_AT_ONCE = ROW_STATS_THREADS / ROW_THREADS, PASSES = BACKWARD_Q_TILE / ROWS_AT_ONCE;
  constexpr int LOADS_AHEAD = PASSES < 4 ? PASSES : 4;  // passes whose loads are in flight together
  static_assert(ROW_THREADS <= WARP_THREADS && PASSES * ROWS_AT_ONCE == BACKWARD_Q_TILE && PASSES % LOADS_AHEAD == 0);
  const head_tile block = head_tile::of_block(p.heads_q);
  const int h = block.h, b = block.b, part = threadIdx.x % ROW_THREADS;
  const int q0 = block.tile * BACKWARD_Q_TILE, q_first = q0 + threadIdx.x / ROW_THREADS;  // this thread's first row
  const int64_t tile_row = ws.row(b, h, q0);
  const auto dO = gl<T>::contiguous((T*)p.dout, p.batch, p.seq_q, p.heads_q, D);
  const auto O = gl<T>::contiguous((T*)p.o, p.batch, p.seq_q, p.heads_q, D);

#pragma unroll
  for (int pass0 = 0; pass0 < PASSES; pass0 += LOADS_AHEAD) {
    // Every load of these passes is issued before any is used, lse and dlse with dO and O: a
    // block whose statistics were loaded after its sums spent two memory round trips.
    uint4 dout[LOADS_AHEAD], out[LOADS_AHEAD];
    float lse[LOADS_AHEAD], dlse[LOADS_AHEAD];
#pragma unroll
    for (int i = 0; i < LOADS_AHEAD; i++) {
      const int q = q_first + (pass0 + i) * ROWS_AT_ONCE;
      dout[i] = out[i] = make_uint4(0, 0, 0, 0);
      lse[i] = NEG_INF;
      dlse[i] = 0.f;
      if (q < p.seq_q) {
        dout[i] = *reinterpret_cast<const uint4*>(dO.row(b, q, h) + 8 * part);
        out[i] = *reinterpret_cast<const uint4*>(O.row(b, q, h) + 8 * part);
        if (part == 0) {
          const int64_t in = (int64_t(b) * p.heads_q + h) * p.seq_q + q;
          lse[i] = p.lse[in];
          dlse[i] = p.dlse[in];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < LOADS_AHEAD; i++) {
      float dot = dot8<T>(dout[i], out[i]);
#pragma unroll
      for (int lanes = ROW_THREADS / 2; lanes > 0; lanes /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, lanes);
      const int q = q_first + (pass0 + i) * ROWS_AT_ONCE;
      if (part == 0) {  // padding rows: lse = -inf gives +inf, dO = 0 and dlse = 0 give 0
        const int64_t at = tile_row + (q - q0);
        ws.lse2[at] = lse[i] == NEG_INF ? -NEG_INF : lse[i] * LOG2E;
        ws.delta[at] = p.scale * (dot - dlse[i]);
      }
    }
  }
}

template <typename T, int D>
cudaError_t launch_row_stats(const BackwardParams& p, const backward_workspace& ws, cudaStream_t stream) {
  dim3 grid;
  if (!head_tile::grid(grid, ws.seq_q_padded / BACKWARD_Q_TILE, p.heads_q, p.batch)) return cudaErrorInvalidValue;
  row_stats_kernel<T, D><<<grid, ROW_STATS_THREADS, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace tk::attention
