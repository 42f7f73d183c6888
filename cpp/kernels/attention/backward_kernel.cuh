// Flash attention backward for Hopper (TMA + wgmma + warp specialisation).
//
// A block owns 128 keys of one KV head (64 per consumer warpgroup) and walks every query tile
// (64 rows) of every query head of its GQA group that can see those keys; dK and dV stay in
// registers for the whole walk. Per query tile, with c = scale * log2(e):
//   S^T  = K Q^T                       P^T = 2^(c S^T - lse2)     (lse2 = log2(e) lse, per column)
//   dV  += P^T dO                      dP^T = V dO^T
//   dS^T = P^T o (scale dP^T - delta)  (delta = scale (rowsum(dO o O) - dlse), per column)
//   dK  += dS^T Q                      dQ  += dS K   (dS^T of all 128 keys staged in shared
//                                                    memory; the dQ tile staged there too, in
//                                                    fragment order, and added to the
//                                                    accumulator by one 1-D bulk reduction)
// The producer warpgroup's first warp streams Q and dO tiles through a ring of stages, its
// second issues the dQ adds, its third copies each step's lse2 and delta rows into a ring of
// its own with plain loads and stores, a few steps ahead of the consumers.
#pragma once

#include "../../kittens/kittens.cuh"
#include "attention.h"
#include "backward_walk.cuh"

namespace tk::attention {

using namespace kittens;

template <int D>
struct backward_config {
  static constexpr int CONSUMERS = 2;
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  static constexpr int KV_ROWS = 64 * CONSUMERS;
  static constexpr int Q_ROWS = BACKWARD_Q_TILE;
  // Q/dO stages. A stage is freed only once its step's last product (dK += dS^T Q) has read it,
  // so with two the next load had one step's time to land, and consumers waited for it (5% of
  // the D=128 kernel's stall samples). Three fit beside three stats slots at D = 128:
  // 227 KB exactly.
  static constexpr int STAGES = 3;
  static constexpr int STATS_STAGES = 3;  // 512 bytes each: the stats warp may run this far ahead
  static constexpr int PRODUCER_REGS = 24;
  static constexpr int CONSUMER_REGS = warpgroup::consumer_registers(1, PRODUCER_REGS, CONSUMERS);  // 240
};

template <typename T, int D>
struct backward_shared {
  using config = backward_config<D>;
  st<T, 64, D> k[config::CONSUMERS], v[config::CONSUMERS];
  query_stages<T, D, config::STAGES> stages;
  st<T, 64, config::Q_ROWS> ds[2][config::CONSUMERS];  // dS^T per step parity and consumer: keys x queries
  // A consumer's 64-column chunk of dQ on its way out, in fragment order (kittens
  // store_fragments: conflict-free 16-byte stores; the accumulator keeps that order). One
  // buffer per consumer, so that only the same threads ever write a buffer.
  alignas(128) float dq[config::CONSUMERS][config::Q_ROWS * 64];
  struct query_stats {
    float lse2[config::Q_ROWS], delta[config::Q_ROWS];
  } stats[config::STATS_STAGES];
  ring<config::STATS_STAGES> stats_slots;
  ring<config::STAGES> stage_slots;  // the stages' barriers
  tma::barrier kv_full;
};

// SEG: with segment ids (the walk cut to the query tiles that share the block's segments, pairs
// of different segments masked).
template <typename T, int D, bool SEG>
__global__ void __launch_bounds__(backward_config<D>::THREADS, 1)
    backward_kernel(const __grid_constant__ BackwardArgs args) {
  using config = backward_config<D>;
  constexpr int QT = config::Q_ROWS;
  const BackwardParams& p = args.p;
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<backward_shared<T, D>>(smem_raw);

  const key_block_of block = key_block_of::this_block(args);
  const int kv_h = block.kv_h, b = block.b;
  const int k0 = block.index * config::KV_ROWS;
  const band mask_band = band::of(p, b);
  query_walk walk = query_walk::of(p, mask_band, kv_h, k0, config::KV_ROWS, block.split, args.head_splits);
  if constexpr (SEG) walk.keep_segments<config::KV_ROWS>(p, b, k0);
  const int steps = walk.steps;

  if (threadIdx.x == 0) {
    tma::init(s.kv_full, 1);
    s.stage_slots.init(config::CONSUMERS * 4);
    s.stats_slots.init(config::CONSUMERS * 128, 32);  // every consumer thread reads the rows
    tma::fence_barrier_init();
  }
  __syncthreads();

  // dQ += dS K over all 128 keys of the block, so each dQ element gets one add per block: both
  // consumers publish dS^T (named barrier ds_ready), then consumer c takes dQ's 64-column
  // chunk c. At D = 64 there is one chunk, and the consumers take turns: consumer i % 2
  // computes step i's, and the other only arrives at ds_ready and goes on, so both do the same
  // work over two steps. Then ds_ready alternates between two barriers by step parity, so that
  // a consumer that only arrived cannot run a whole barrier ahead of the other. The product
  // over a consumer's own 64 keys needs only its own warps' dS^T (barrier own_ds_ready), so it
  // starts before ds_ready: a consumer that is ahead waits there with work in flight.
  // A chunk leaves through shared memory and one TMA bulk add, issued by a writer warp of the
  // producer warpgroup, so a consumer hands it over and moves on (the accumulator's layout:
  // backward_workspace.cuh):
  //   consumer: sync dq_empty(c), write the rows, fence, arrive dq_full(c)
  //   writer:   sync dq_full(c), issue the add, wait until it has read the rows, arrive dq_empty(c)
  constexpr int DQ_CHUNKS = D / 64;
  constexpr bool TAKE_TURNS = DQ_CHUNKS < config::CONSUMERS;
  static_assert(DQ_CHUNKS == config::CONSUMERS || (TAKE_TURNS && DQ_CHUNKS == 1), "one chunk each, or turns on one");
  static_assert(config::CONSUMERS == 2, "a dQ chunk is the consumer's own half, then the other's");
  auto ds_ready = [](int step) { return TAKE_TURNS ? 1 + (step & 1) : 1; };
  auto dq_empty = [](int chunk) { return 3 + chunk; };
  auto dq_full = [](int chunk) { return 3 + DQ_CHUNKS + chunk; };
  auto own_ds_ready = [](int consumer) { return 3 + 2 * DQ_CHUNKS + consumer; };  // one warpgroup's dS^T
  static_assert(3 + 2 * DQ_CHUNKS + config::CONSUMERS <= 16, "the 16 named barriers run out");
  constexpr int DQ_HANDOFF_THREADS = 128 + 32;  // a consumer warpgroup and the writer warp

  if (warpgroup::groupid() == 0) {  // ---------------- producer ----------------
    warpgroup::decrease_registers<config::PRODUCER_REGS>();
    const int warp = warpgroup::warp_in_group();
    if (warp == 0 && laneid() == 0 && steps > 0) {  // loads
      tma::expect_bytes(s.kv_full, config::CONSUMERS * (sizeof(s.k[0]) + sizeof(s.v[0])));
      for (int c = 0; c < config::CONSUMERS; c++) {
        tma::load_async(&s.k[c], args.k, s.kv_full, 0, k0 + 64 * c, 0, kv_h, b);
        tma::load_async(&s.v[c], args.v, s.kv_full, 0, k0 + 64 * c, 0, kv_h, b);
      }
      s.stages.produce(s.stage_slots, walk, args.q, args.dout, b);
    } else if (warp == 1 && steps > 0) {  // dQ writer
      const bool lane0 = laneid() == 0;
#pragma unroll
      for (int chunk = 0; chunk < DQ_CHUNKS; chunk++) named_barrier_arrive(dq_empty(chunk), DQ_HANDOFF_THREADS);
      query_walk::tile tile = walk.first();
      for (int i = 0; i < steps; i++, walk.advance(tile)) {
#pragma unroll
        for (int chunk = 0; chunk < DQ_CHUNKS; chunk++) {
          named_barrier_sync(dq_full(chunk), DQ_HANDOFF_THREADS);
          if (lane0) {
            const int producer = TAKE_TURNS ? i & 1 : chunk;  // the consumer that computed this chunk
            tma::add_bulk_async(args.ws.dq_chunk<D>(b, tile.head, tile.q0, chunk), s.dq[producer], sizeof(s.dq[0]));
            tma::commit_group();
          }
        }
        if (i + 1 == steps) break;  // no consumer waits for the last step's buffers
        if (lane0) tma::wait_group_read<DQ_CHUNKS - 1>();
        __syncwarp();
        named_barrier_arrive(dq_empty(0), DQ_HANDOFF_THREADS);
        if constexpr (DQ_CHUNKS == 2) {
          if (lane0) tma::wait_group_read<0>();
          __syncwarp();
          named_barrier_arrive(dq_empty(1), DQ_HANDOFF_THREADS);
        }
      }
      if (lane0) tma::wait_group<0>();  // the last adds have landed before the block exits
    } else if (warp == 2 && steps > 0) {  // lse2 and delta rows: two floats of each per lane
      static_assert(QT == 2 * 32, "a lane copies two columns");
      const int col = 2 * laneid();
      query_walk::tile tile = walk.first();
      for (int i = 0; i < steps; i++, walk.advance(tile)) {
        const int64_t row = args.ws.row(b, tile.head, tile.q0) + col;
        const float2 lse2 = *reinterpret_cast<const float2*>(args.ws.lse2 + row);
        const float2 delta = *reinterpret_cast<const float2*>(args.ws.delta + row);
        auto& rows = s.stats[s.stats_slots.wait_free(i)];
        *reinterpret_cast<float2*>(&rows.lse2[col]) = lse2;
        *reinterpret_cast<float2*>(&rows.delta[col]) = delta;
        s.stats_slots.publish(i);
      }
    }
  } else {  // ---------------- consumers ----------------
    warpgroup::increase_registers<config::CONSUMER_REGS>();
    const int consumer = warpgroup::groupid() - 1, warp = warpgroup::warp_in_group();
    const int key0 = k0 + 64 * consumer + 16 * warp;  // this warp's first key row
    const auto masked_tile = mask_band.cuts_for_keys(QT, key0, 16);  // rows are keys, columns queries
    const float c = p.scale * LOG2E;
    // SEG: rows are keys, columns queries.
    const int32_t* const key_ids = p.mask.kv_segment_ids + int64_t(b) * p.seq_k;
    const int32_t* const query_ids = p.mask.q_segment_ids + int64_t(b) * p.seq_q;
    warp_segments segments;
    if constexpr (SEG) segments = warp_segments::of(key_ids, key0, mask_band.k_end);

    rt_fl<16, D> dk, dv;
    zero(dk);
    zero(dv);
    if (steps > 0) tma::wait(s.kv_full, 0);

    // One step of the walk, compiled apart for steps without a dQ chunk (every other step of
    // each consumer at D = 64), so that every wgmma wait counts a fixed set of products.
    auto step = [&]<bool has_chunk>(int i, int q0) {
      [[maybe_unused]] segment_span tile_ids;  // SEG: of this query tile, loaded before the scores are waited for
      if constexpr (SEG) tile_ids = segment_ranges::of(p).queries<QT>(b, q0);
      const auto& rows = s.stats[s.stats_slots.acquire(i)];
      col_vec<QT> lse2, delta;
      load(lse2, rows.lse2);
      const int stage = s.stage_slots.acquire(i);
      const auto& q_tile = s.stages.q[stage];
      const auto& dout_tile = s.stages.dout[stage];

      // S^T and dP^T = V dO^T issued together; P^T from the scores while dP^T is in flight.
      // lse2 is +inf on rows that saw nothing, giving P = 0.
      rt_fl<16, QT> probs, dprobs;
      warpgroup::mma_ABt(probs, s.k[consumer], q_tile, false);
      warpgroup::mma_ABt(dprobs, s.v[consumer], dout_tile, false);
      warpgroup::wait<1>();  // S^T is ready
      if constexpr (SEG) segments.mask(probs, tile_ids, key_ids, key0, mask_band.k_end, query_ids, q0, mask_band.q_end);
      if (masked_tile.cuts(q0)) mask_band.mask<true>(probs, q0, key0);
      map_cols(probs, lse2, [=](float x, float lse2) { return fast_exp2(c * x - lse2); });
      rt<T, 16, QT> probs_16;
      copy(probs_16, probs);
      warpgroup::mma_AB(dv, probs_16, dout_tile, true);  // dV += P^T dO
      load(delta, rows.delta);
      s.stats_slots.release_each_lane(i);
      warpgroup::wait<1>();  // dP^T is ready (groups complete in order)

      map_cols(dprobs, delta, [=](float dp, float delta) { return fmaf(dp, p.scale, -delta); });
      mul(dprobs, probs);  // dS^T (scaled)
      rt<T, 16, QT> ds_16;
      copy(ds_16, dprobs);

      // dS^T is double-buffered by step parity: a buffer is rewritten two steps later. A
      // consumer that read it for dQ at step i finished that product before it reached
      // ds_ready of step i + 1, and the other consumer syncs there (it owns step i + 1).
      // dQ's product over this consumer's own keys needs only its own warps' dS^T, so it is
      // issued before the barrier; the other consumer's half follows it, then dK's product,
      // so dQ's rows are handed to the writer while dK's runs.
      const int buf = i & 1;
      store(s.ds[buf][consumer], ds_16, 16 * warp, 0);
      warpgroup::fence_shared_to_async();
      if constexpr (has_chunk) {
        const int chunk = TAKE_TURNS ? 0 : consumer, other = 1 - consumer;
        rt_fl<16, 64> dq;
        named_barrier_sync(own_ds_ready(consumer), 128);
        warpgroup::mma_AtB(dq, s.ds[buf][consumer], s.k[consumer], 64 * chunk, false);
        named_barrier_sync(ds_ready(i), 128 * config::CONSUMERS);
        warpgroup::mma_AtB(dq, s.ds[buf][other], s.k[other], 64 * chunk, true);
        warpgroup::mma_AB(dk, ds_16, q_tile, true);  // dK += dS^T Q
        warpgroup::wait<1>();  // dQ is ready
        named_barrier_sync(dq_empty(chunk), DQ_HANDOFF_THREADS);  // the writer has read the last chunk
        store_fragments(s.dq[consumer] + 16 * 64 * warp, dq);
        warpgroup::fence_shared_to_async();
        named_barrier_arrive(dq_full(chunk), DQ_HANDOFF_THREADS);
      } else {
        named_barrier_arrive(ds_ready(i), 128 * config::CONSUMERS);
        warpgroup::mma_AB(dk, ds_16, q_tile, true);  // dK += dS^T Q
      }
      warpgroup::wait<0>();  // dK's product has read this stage's Q
      s.stage_slots.release(i);
    };
    query_walk::tile tile = walk.first();
    for (int i = 0; i < steps; i++, walk.advance(tile)) {
      if (!TAKE_TURNS || (i & 1) == consumer) step.template operator()<true>(i, tile.q0);
      else step.template operator()<false>(i, tile.q0);
    }

    store_key_gradients<T, D>(args, dk, dv, b, kv_h, key0);
  }
}

template <typename T, int D, bool SEG>
cudaError_t launch_backward(const BackwardParams& p, const backward_workspace& ws, int head_splits,
                            cudaStream_t stream) {
  using config = backward_config<D>;
  BackwardArgs args{};
  // Under a band the key blocks differ in length, and pairs interleave heaviest first in
  // L2-sized groups (BACKWARD_GROUP_L2_BYTES), so that the last blocks to start are light:
  // causal fwd+bwd +1-2% at 2k-8k (docs/DESIGN.md). Otherwise one pair per group:
  // interleaving lost 2-9% on unmasked D = 64.
  const size_t group_l2_bytes = p.window_right >= 0 ? BACKWARD_GROUP_L2_BYTES : 0;
  if (cudaError_t err = prepare_backward<T, D>(args, p, ws, 64, group_l2_bytes, head_splits); err != cudaSuccess)
    return err;
  constexpr int smem = int(sizeof(backward_shared<T, D>)) + 1024;
  static_assert(smem <= 227 * 1024, "the backward's shared memory exceeds the H100's 227 KB");
  const dim3 grid((p.seq_k + config::KV_ROWS - 1) / config::KV_ROWS, p.heads_kv * head_splits, p.batch);
  return launch_with_shared<backward_kernel<T, D, SEG>>(grid, config::THREADS, smem, stream, args);
}

}  // namespace tk::attention
