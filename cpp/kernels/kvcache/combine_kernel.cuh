// The combine pass of a split call: each output row merges its splits' partial results
// (split_workspace.cuh) by their logsumexp,
//   lse = log sum_s e^{lse_s},   o = sum_s e^{lse_s - lse} o_s,
// by one to four warps a row (combine_warps_per_row). Splits that saw no key of the row
// (lse_s = -inf) are skipped; a row no split saw gets o = 0, lse = -inf; a NaN among the lse_s
// makes the row NaN.
// The pass is latency-bound (a few KB a row): lane l loads the lse of splits l, l + 32, ...
// at once, and the partial rows are loaded LOADS_IN_FLIGHT splits at a time before any is
// added. With many splits a row's warps each add a share of them, summed in shared memory:
// one warp walking 126 splits of 128 rows took 21 us (ncu, H200), for a 32-35 us split kernel;
// four warps a row read MQA B1 S128k at 1.77 TB/s where one warp read 1.33 (4 tokens; one
// token 1.91 -> 2.22; same run).
#pragma once

#include "../../kittens/kittens.cuh"
#include "decode_kernel.cuh"  // wait_for_prerequisite_grid
#include "kvcache.h"
#include "split_workspace.cuh"

namespace tk::kvcache {

using namespace kittens;

constexpr int COMBINE_THREADS = 128;  // four warps a block
constexpr int LSE_PER_LANE = MAX_SPLITS / 32;
constexpr int LOADS_IN_FLIGHT = 8;     // splits whose partial rows are requested together

// Warps that merge one row: one up to 16 splits, two up to 32, else all four of the block's.
__host__ __device__ constexpr int combine_warps_per_row(int splits) {
  return splits <= 16 ? 1 : splits <= 32 ? 2 : COMBINE_THREADS / 32;
}

// max that keeps a NaN: once either side is NaN, so is the result.
__device__ __forceinline__ float max_keeping_nan(float a, float b) { return (a > b || a != a) ? a : b; }

template <typename T, int D>
__global__ void __launch_bounds__(COMBINE_THREADS) combine_kernel(const Params p) {
  constexpr int E = D / 32;  // output columns per lane: [E lane, E lane + E)
  constexpr int WARPS = COMBINE_THREADS / 32;
  __shared__ float shared_acc[WARPS][E][32];  // the partial sums of a row's other warps
  wait_for_prerequisite_grid();  // the split kernel's partial results are complete
  const int64_t rows = split_workspace::rows(p.batch, p.heads_q, p.seq_q);
  const int splits = p.num_splits, per_row = combine_warps_per_row(splits);
  const int part = warpid() % per_row;  // which share of the row's splits this warp adds
  const int64_t row = int64_t(blockIdx.x) * (WARPS / per_row) + warpid() / per_row;
  const bool valid = row < rows;  // (no early return: the warps of a row meet at a barrier)
  const split_workspace ws = split_workspace::of(p.workspace, rows, splits, D);
  const int lane = laneid();
  // This warp's splits [first, last), in whole LOADS_IN_FLIGHT groups.
  const int share = ((splits + per_row - 1) / per_row + LOADS_IN_FLIGHT - 1) / LOADS_IN_FLIGHT * LOADS_IN_FLIGHT;
  const int first = part * share, last = min(splits, first + share);

  float lse_s[LSE_PER_LANE];  // lse of split 32 i + lane
#pragma unroll
  for (int i = 0; i < LSE_PER_LANE; i++) {
    const int s = 32 * i + lane;
    lse_s[i] = valid && s < splits ? ws.lse_of(row)[s] : NEG_INF;
  }
  float m = NEG_INF;
#pragma unroll
  for (int i = 0; i < LSE_PER_LANE; i++) m = max_keeping_nan(m, lse_s[i]);
#pragma unroll
  for (int x = 16; x > 0; x /= 2) m = max_keeping_nan(m, __shfl_xor_sync(0xffffffffu, m, x));

  float acc[E] = {};
  float lse = NEG_INF;
  if (m != NEG_INF) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < LSE_PER_LANE; i++) sum += expf(lse_s[i] - m);  // a split without keys adds 0
#pragma unroll
    for (int x = 16; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
    lse = m + logf(sum);
#pragma unroll
    for (int i = 0; i < LSE_PER_LANE; i++) {
      if (32 * i >= last) break;
      const float weight = expf(lse_s[i] - lse);  // of split 32 i + lane
      for (int j0 = 0; j0 < 32 && 32 * i + j0 < last; j0 += LOADS_IN_FLIGHT) {
        if (32 * i + j0 < first) continue;  // another warp's share
        float w[LOADS_IN_FLIGHT];
        float2 x[LOADS_IN_FLIGHT][E / 2];
#pragma unroll
        for (int j = 0; j < LOADS_IN_FLIGHT; j++) {
          const int s = 32 * i + j0 + j;
          const float ls = __shfl_sync(0xffffffffu, lse_s[i], j0 + j);
          w[j] = __shfl_sync(0xffffffffu, weight, j0 + j);
          // A split that saw no key of the row left its o unset: it adds nothing. Every other
          // split is added even where its weight underflows, so a NaN in its o reaches the row.
          const bool saw_keys = s < last && ls != NEG_INF;
          const float* part_o = ws.o_of(row, saw_keys ? s : 0) + E * lane;
#pragma unroll
          for (int e = 0; e < E / 2; e++)
            x[j][e] = saw_keys ? *reinterpret_cast<const float2*>(part_o + 2 * e) : make_float2(0.f, 0.f);
          if (!saw_keys) w[j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < LOADS_IN_FLIGHT; j++)
#pragma unroll
          for (int e = 0; e < E / 2; e++) {
            acc[2 * e] += w[j] * x[j][e].x;
            acc[2 * e + 1] += w[j] * x[j][e].y;
          }
      }
    }
  }

  if (per_row > 1) {  // the row's first warp adds the others' sums
#pragma unroll
    for (int e = 0; e < E; e++) shared_acc[warpid()][e][lane] = acc[e];
    __syncthreads();
    for (int other = 1; part == 0 && other < per_row; other++)
#pragma unroll
      for (int e = 0; e < E; e++) acc[e] += shared_acc[warpid() + other][e][lane];
  }
  if (!valid || part != 0) return;

  // row = (b heads_q + h) seq_q + t  ->  o[b, t, h, :]
  const int64_t t = row % p.seq_q, h = row / p.seq_q % p.heads_q, b = row / (int64_t(p.seq_q) * p.heads_q);
  T* out = static_cast<T*>(p.o) + ((b * p.seq_q + t) * p.heads_q + h) * D + E * lane;
#pragma unroll
  for (int e = 0; e < E; e += 2) *reinterpret_cast<packed_t<T>*>(out + e) = pack<T>(acc[e], acc[e + 1]);
  if (lane == 0) p.lse[row] = lse;
}

}  // namespace tk::kvcache
