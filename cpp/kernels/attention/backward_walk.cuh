// What the attention backward kernels share: their arguments and host-side preparation, the
// walk of a key block over the query tiles that can see it, and the producer that streams
// those Q / dO tiles through a ring of stages.
#pragma once

#include <algorithm>

#include "../../kittens/kittens.cuh"
#include "attention.h"
#include "backward_workspace.cuh"
#include "segment_ranges.cuh"
#include "softmax_band.cuh"

namespace tk::attention {

using namespace kittens;

struct BackwardArgs {
  CUtensorMap q, k, v, dout;  // boxes: BACKWARD_Q_TILE query rows, the kernel's key rows
  BackwardParams p;
  backward_workspace ws;      // the accumulator to add dQ into; lse2 and delta
  int pairs_per_group;        // (batch, KV head) pairs whose blocks interleave; see key_block_of
  int head_splits;            // blocks that share a key block's query heads (backward_head_splits)
};

// How many blocks share the query heads of one key block and KV head: 1 (dK and dV summed in
// registers over the whole GQA group, then stored) or a divisor s of the group (each block walks
// group / s query heads and adds its dK and dV into the workspace's fp32 accumulators). The
// backward keeps whole key blocks per thread block, so under GQA it has heads_q / heads_kv
// times fewer blocks, each that much longer, than MHA of the same shape: at MQA, B2 T2k gives
// 32 blocks for 132 SMs (fwd+bwd 109 TFLOP/s on an H100), and a few waves of long causal blocks
// end unevenly (32/4 heads B4 T4k: 399). So the smallest s that gives a few blocks an SM, each
// extra split costing one fp32 add of the block's dK and dV: 8 under a band, whose blocks
// differ in length, 4 otherwise (same-card A/B in docs/DESIGN.md: MQA 109 -> 421, 32/4
// 399 -> 548; unmasked 32/4 T16k 618 with one split, 621 at 4 an SM, 592 at 8).
inline int backward_head_splits(const BackwardParams& p, int key_rows, int sms) {
  const int group = p.heads_q / p.heads_kv;
  const int64_t blocks = int64_t((p.seq_k + key_rows - 1) / key_rows) * p.heads_kv * p.batch;
  const bool banded = p.window_left >= 0 || p.window_right >= 0;
  const int64_t wanted = int64_t(banded ? 8 : 4) * sms;
  for (int s = 1; s < group; s++)
    if (group % s == 0 && blocks * s >= wanted) return s;
  return group;
}

// The L2 budget of a group of (batch, KV head) pairs whose blocks interleave (key_block_of):
// their Q, dO and dQ accumulator fill at most 32 MB of the 50 MB L2.
constexpr size_t BACKWARD_GROUP_L2_BYTES = size_t(32) << 20;

// The arguments of a backward kernel for element type T: its tensor maps and the size of its
// groups of (batch, KV head) pairs (key_block_of), which hold at most `group_l2_bytes` of Q, dO
// and dQ accumulator; 0 makes every group one pair. head_splits: backward_head_splits.
template <typename T, int D>
cudaError_t prepare_backward(BackwardArgs& args, const BackwardParams& p, const backward_workspace& ws, int kv_rows,
                             size_t group_l2_bytes, int head_splits) {
  args.p = p;
  args.ws = ws;
  args.head_splits = head_splits;
  const bool bf = std::is_same_v<T, bf16>;
  if (!tma::make_bshd_map(&args.q, p.q, bf, p.batch, p.seq_q, p.heads_q, D, BACKWARD_Q_TILE) ||
      !tma::make_bshd_map(&args.dout, p.dout, bf, p.batch, p.seq_q, p.heads_q, D, BACKWARD_Q_TILE) ||
      !tma::make_bshd_map(&args.k, p.k, bf, p.batch, p.seq_k, p.heads_kv, D, kv_rows) ||
      !tma::make_bshd_map(&args.v, p.v, bf, p.batch, p.seq_k, p.heads_kv, D, kv_rows))
    return cudaErrorInvalidValue;
  // A pair here is (batch, KV head and head split): its query heads' Q, dO and dQ accumulator.
  const size_t pair_bytes =
      size_t(p.seq_q) * (p.heads_q / p.heads_kv / head_splits) * D * (2 * sizeof(T) + sizeof(float));
  const int pairs = p.batch * p.heads_kv * head_splits;
  args.pairs_per_group = int(std::clamp<size_t>(group_l2_bytes / pair_bytes, 1, size_t(pairs)));
  return cudaSuccess;
}

// The key block, KV head and batch a thread block owns, for a grid of (key blocks, KV heads,
// batch). Blocks start roughly in launch order, so the order sets the balance at the end:
// under a causal mask a key block's work shrinks as its index grows, and the lightest blocks
// should start last. The (batch, KV head) pairs go in groups of args.pairs_per_group (set by
// prepare_backward from an L2 budget); inside a group, key block 0 of every pair comes first,
// then key block 1, and so on. Groups of one pair give the plain order, pair after pair.
// With clusters of `cluster` blocks along x, the unit is a run of `cluster` neighbouring key
// blocks, so that a cluster's blocks share the batch and KV head.
// The grid's y axis counts (KV head, head split) pairs: y = kv_h * head_splits + split.
struct key_block_of {
  int index, kv_h, split, b;

  __device__ static key_block_of this_block(const BackwardArgs& args, int cluster = 1) {
    const int runs = gridDim.x / cluster, pairs = gridDim.y * gridDim.z;
    const int linear = blockIdx.x / cluster + runs * (blockIdx.y + gridDim.y * blockIdx.z);
    const int first_pair = linear / (runs * args.pairs_per_group) * args.pairs_per_group;
    const int group = min(args.pairs_per_group, pairs - first_pair);
    const int in_group = linear - first_pair * runs;
    const int pair = first_pair + in_group % group;
    const int y = pair % int(gridDim.y);
    return {in_group / group * cluster + int(blockIdx.x) % cluster, y / args.head_splits, y % args.head_splits,
            pair / int(gridDim.y)};
  }
};

// A warp's 16 rows of dK or dV from key0 on, `out` in the output's dtype when its block walked
// the whole GQA group (head_splits 1); else the block's share, added into the fp32 accumulator
// `accum` (backward_workspace.cuh), which the dK / dV output pass converts.
template <typename T, int D>
__device__ __forceinline__ void store_key_gradient(const BackwardArgs& args, rt_fl<16, D>& grad, void* out,
                                                   float* accum, int b, int kv_h, int key0) {
  const BackwardParams& p = args.p;
  if (args.head_splits == 1) store(gl<T>::contiguous((T*)out, p.batch, p.seq_k, p.heads_kv, D), grad, {b, kv_h, key0});
  else if (key0 < p.seq_k) atomic_add_fragments(args.ws.key_group<D>(accum, b, kv_h, key0), grad);
}

template <typename T, int D>
__device__ __forceinline__ void store_key_gradients(const BackwardArgs& args, rt_fl<16, D>& dk, rt_fl<16, D>& dv,
                                                    int b, int kv_h, int key0) {
  store_key_gradient<T, D>(args, dk, args.p.dk, args.ws.dk_accum, b, kv_h, key0);
  store_key_gradient<T, D>(args, dv, args.p.dv, args.ws.dv_accum, b, kv_h, key0);
}

// A block owning keys [k0, k0 + rows) of KV head kv_h visits, step by step, every query tile
// (BACKWARD_Q_TILE rows) that can see one of those keys, of its share of the query heads of
// the GQA group: the group's heads split into `splits` equal shares, of which it takes `split`.
struct query_walk {
  int first_head, first_tile, tiles_per_head, steps;

  __device__ static query_walk of(const BackwardParams& p, const band& mask_band, int kv_h, int k0, int rows,
                                  int split, int splits) {
    const int heads = p.heads_q / p.heads_kv / splits;
    const key_range queries = mask_band.queries_of(k0, min(k0 + rows, p.seq_k) - 1);
    const int first_tile = queries.lo / BACKWARD_Q_TILE;
    const int tiles = queries.hi > queries.lo ? (queries.hi + BACKWARD_Q_TILE - 1) / BACKWARD_Q_TILE - first_tile : 0;
    return {(kv_h * splits + split) * heads, first_tile, tiles, tiles * heads};
  }
  // With segment ids: the walk cut to the query tiles from the first to the last that share a
  // segment with keys [k0, k0 + ROWS) of batch row b (segment_ranges.cuh). With sorted ids
  // every tile between them shares one too; tiles that do not (unsorted ids only) are walked,
  // their pairs all masked.
  template <int ROWS>
  __device__ void keep_segments(const BackwardParams& p, int b, int k0) {
    const segment_ranges ranges = segment_ranges::of(p);
    const segment_span keys = ranges.keys<ROWS>(b, k0);
    const int heads = tiles_per_head > 0 ? steps / tiles_per_head : 0;
    constexpr int QT = BACKWARD_Q_TILE;
    int lo = max(first_tile, keys.other_lo / QT);
    int hi = min(first_tile + tiles_per_head, keys.other_hi > 0 ? (keys.other_hi + QT - 1) / QT : 0);
#pragma unroll 1
    while (lo < hi && !ranges.queries<QT>(b, lo * QT).meets(keys)) lo++;
#pragma unroll 1
    while (hi > lo && !ranges.queries<QT>(b, (hi - 1) * QT).meets(keys)) hi--;
    first_tile = lo;
    tiles_per_head = max(hi - lo, 0);
    steps = tiles_per_head * heads;
  }
  // The walk's steps in order: the query tiles of one head, then the next head's. Kernels
  // advance a cursor step by step instead of dividing the step index.
  struct tile {
    int head, q0;  // query head and first query row
  };
  __device__ tile first() const { return {first_head, first_tile * BACKWARD_Q_TILE}; }
  __device__ void advance(tile& t) const {
    t.q0 += BACKWARD_Q_TILE;
    if (t.q0 == (first_tile + tiles_per_head) * BACKWARD_Q_TILE) {
      t.q0 = first_tile * BACKWARD_Q_TILE;
      t.head++;
    }
  }
};

// The Q and dO tiles of each step, STAGES at a time, through a ring (one use per step). The
// ring's barriers are a member of the kernel's shared memory apart from the tiles, so that the
// tiles' 1024-byte alignment pads nothing after them. Consumers acquire step i's tiles from the
// ring and release them once the step's last product has read them.
template <typename T, int D, int STAGES>
struct query_stages {
  st<T, BACKWARD_Q_TILE, D> q[STAGES], dout[STAGES];

  // One thread of the producer issues every copy of the walk.
  __device__ void produce(ring<STAGES>& slots, const query_walk& walk, const CUtensorMap& q_map,
                          const CUtensorMap& dout_map, int b) {
    query_walk::tile t = walk.first();
    for (int i = 0; i < walk.steps; i++, walk.advance(t)) {
      const int stage = slots.slot(i);
      tma::barrier& full = slots.fill(i, sizeof(q[0]) + sizeof(dout[0]));
      tma::load_async(&q[stage], q_map, full, 0, t.q0, 0, t.head, b);
      tma::load_async(&dout[stage], dout_map, full, 0, t.q0, 0, t.head, b);
    }
  }
};

}  // namespace tk::attention
