// The combine pass of a split call: each output row merges its splits' partial results
// (split_workspace.cuh) by their logsumexp,
//   lse = log sum_s e^{lse_s},   o = sum_s e^{lse_s - lse} o_s,
// one warp a row. Splits that saw no key of the row (lse_s = -inf) are skipped; a row no split
// saw gets o = 0, lse = -inf; a NaN among the lse_s makes the row NaN.
#pragma once

#include "../../kittens/kittens.cuh"
#include "decode_kernel.cuh"  // wait_for_prerequisite_grid
#include "kvcache.h"
#include "split_workspace.cuh"

namespace tk::kvcache {

using namespace kittens;

constexpr int COMBINE_THREADS = 128;  // four rows a block

// max that keeps a NaN: once either side is NaN, so is the result.
__device__ __forceinline__ float max_keeping_nan(float a, float b) { return (a > b || a != a) ? a : b; }

template <typename T, int D>
__global__ void __launch_bounds__(COMBINE_THREADS) combine_kernel(const Params p) {
  constexpr int E = D / 32;  // output columns per lane: [E lane, E lane + E)
  wait_for_prerequisite_grid();  // the split kernel's partial results are complete
  const int64_t rows = split_workspace::rows(p.batch, p.heads_q, p.seq_q);
  const int64_t row = int64_t(blockIdx.x) * (COMBINE_THREADS / 32) + warpid();
  if (row >= rows) return;
  const split_workspace ws = split_workspace::of(p.workspace, rows, p.num_splits, D);
  const float* lse_s = ws.lse_of(row);
  const int lane = laneid();

  float m = NEG_INF;
  for (int s = lane; s < p.num_splits; s += 32) m = max_keeping_nan(m, lse_s[s]);
#pragma unroll
  for (int x = 16; x > 0; x /= 2) m = max_keeping_nan(m, __shfl_xor_sync(0xffffffffu, m, x));

  float acc[E] = {};
  float lse = NEG_INF;
  if (m != NEG_INF) {
    float sum = 0.f;
    for (int s = lane; s < p.num_splits; s += 32) sum += expf(lse_s[s] - m);
#pragma unroll
    for (int x = 16; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
    lse = m + logf(sum);
    for (int s = 0; s < p.num_splits; s++) {
      const float ls = lse_s[s];
      if (ls == NEG_INF) continue;  // no key of this row in split s: its o is not written
      const float weight = expf(ls - lse);
      const float* part = ws.o_of(row, s) + E * lane;
#pragma unroll
      for (int e = 0; e < E; e += 2) {
        const float2 x = *reinterpret_cast<const float2*>(part + e);
        acc[e] += weight * x.x;
        acc[e + 1] += weight * x.y;
      }
    }
  }

  // row = (b heads_q + h) seq_q + t  ->  o[b, t, h, :]
  const int64_t t = row % p.seq_q, h = row / p.seq_q % p.heads_q, b = row / (int64_t(p.seq_q) * p.heads_q);
  T* out = static_cast<T*>(p.o) + ((b * p.seq_q + t) * p.heads_q + h) * D + E * lane;
#pragma unroll
  for (int e = 0; e < E; e += 2) *reinterpret_cast<packed_t<T>*>(out + e) = pack<T>(acc[e], acc[e + 1]);
  if (lane == 0) p.lse[row] = lse;
}

}  // namespace tk::kvcache
