// Flash attention backward for head_dim 256 (TMA + wgmma + warp specialisation).
//
// At D = 256 one warpgroup cannot keep both dK and dV of its 64 keys in registers (2 x 128
// floats a thread), so the two consumer warpgroups of a block share 64 keys and split the
// step by role, each keeping one of the two gradients. Per query tile (64 rows), with
// c = scale * log2(e), lse2 = log2(e) lse and delta = scale (rowsum(dO o O) - dlse) per column:
//   P warpgroup:   S^T = K Q^T      P^T = 2^(c S^T - lse2)                 dV += P^T dO
//   dS warpgroup:  dP^T = V dO^T    dS^T = P^T o (scale dP^T - delta)     dK += dS^T Q
//   both:          dQ += dS K, 128 of the 256 columns each
// P^T reaches the dS warpgroup through shared memory, warp w to warp w (the same 16 keys), and
// dS^T reaches both for dQ the same way. Each product is 64 x 64 x 256 or 64 x 256 x 64, so the
// two roles do equal work and no product is computed twice.
//
// The fp32 atomic adds into dQ are what bound this kernel: every key block adds a full 64 x 256
// tile per step into L2 (ncu: L2 86% busy; skipping half of them: +36%). So blocks
// run in clusters of two over neighbouring key blocks that walk the same query tiles: block r
// adds the pair's sum for half of the columns, receiving the partner's part through a
// shared-memory mailbox (DSMEM), which halves the traffic into L2: fwd+bwd +7-15%.
// Each warpgroup owns one chunk and sends one, so both do the same work: +1-6% more.
// The adds go into the accumulator's fragment order (backward_workspace.cuh), so that each
// reduction request carries whole 128-byte lines.
#pragma once

#include "../../kittens/kittens.cuh"
#include "attention.h"
#include "backward_walk.cuh"

namespace tk::attention {

using namespace kittens;

template <int D>
struct split_backward_config {
  static constexpr int THREADS = 128 * 3;  // producer, P warpgroup, dS warpgroup
  static constexpr int KV_ROWS = 64;
  static constexpr int Q_ROWS = BACKWARD_Q_TILE;
  static constexpr int STAGES = 2;
  static constexpr int PRODUCER_REGS = 24;
  static constexpr int CONSUMER_REGS = warpgroup::consumer_registers(1, PRODUCER_REGS, THREADS / 128 - 1);  // 240
  static constexpr int CONSUMER_WARPS = 8;
  static constexpr int CLUSTER = 2;  // blocks over neighbouring key blocks that share dQ adds
};

template <typename T, int D>
struct split_backward_shared {
  using config = split_backward_config<D>;
  st<T, config::KV_ROWS, D> k, v;
  query_stages<T, D, config::STAGES> stages;
  // By step parity, P^T (keys x queries) and then, in place, dS^T: dS warp w reads P^T rows of
  // warp w and overwrites them with dS^T; dQ's products read it asynchronously after the dS
  // barrier. A buffer is rewritten two steps later, after both roles' products of its step.
  st<T, config::KV_ROWS, config::Q_ROWS> ds[2];
  // The partner block's dQ contribution to the chunk each role owns here, 64 x 32 at a time, one
  // mailbox per role (16 KB: the block's shared memory is then at the 227 KB limit).
  cluster::mailbox<16, 32, 1> dq_mail[2];
  ring<config::STAGES> stage_slots;  // the stages' barriers
  tma::barrier kv_full;
};

// Named barriers (0 is __syncthreads): P rows of warp w handed to its partner (64 threads),
// then dS^T of all keys published to both warpgroups (256 threads).
constexpr int PROBS_READY_BARRIER = 1;  // + warp (1..4)
constexpr int DS_READY_BARRIER = 5;

// This block's dQ[q0 .., col0 .. col0 + 128) contribution dS K[:, col0 .. col0 + 128), in two
// 64-column chunks: block r owns chunk r (it adds the partner's part to its own and the sum to
// global memory) and sends chunk r ^ 1, so every warpgroup of both blocks does the same work.
// The sent chunk's product comes first and its halves go out around the owned chunk's product,
// so that neither block waits a whole product for the other. `issue_late` issues LATE_GROUPS
// more products (a role's gradient product, which nothing here waits for) behind the owned
// chunk's, so that they run while the halves travel rather than delay the first send.
// dq_rows: where this warp's rows of the query tile's first chunk start in the accumulator
// (chunk c follows at c * 64 * 64 floats).
template <int LATE_GROUPS, typename T, int D, typename IssueLate>
__device__ __forceinline__ void add_dq_half(float* dq_rows, const st<T, 64, 64>& ds, const st<T, 64, D>& k,
                                            int col0, cluster::mailbox<16, 32, 1>& mail, int rank, int step,
                                            IssueLate&& issue_late) {
  const int partner = rank ^ 1;
  rt_fl<16, 64> sent, owned;
  warpgroup::mma_AtB(sent, ds, k, col0 + 64 * partner, false);
  warpgroup::wait<0>();
  mail.send(sent, 0, partner, 2 * step);
  warpgroup::mma_AtB(owned, ds, k, col0 + 64 * rank, false);
  issue_late();
  warpgroup::wait<LATE_GROUPS>();
  mail.receive_add(owned, 0, partner, 2 * step);
  mail.send(sent, 2, partner, 2 * step + 1);
  mail.receive_add(owned, 2, partner, 2 * step + 1);
  atomic_add_fragments(dq_rows + (col0 / 64 + rank) * (BACKWARD_Q_TILE * 64), owned);
}

// SEG: with segment ids (the walk cut to the query tiles that share the pair's segments, pairs
// of different segments masked).
template <typename T, int D, bool SEG>
__global__ void __cluster_dims__(split_backward_config<D>::CLUSTER, 1, 1)
    __launch_bounds__(split_backward_config<D>::THREADS, 1)
        split_backward_kernel(const __grid_constant__ BackwardArgs args) {
  using config = split_backward_config<D>;
  constexpr int QT = config::Q_ROWS;
  static_assert(D == 256, "the role-split backward is built for head_dim 256");
  const BackwardParams& p = args.p;
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<split_backward_shared<T, D>>(smem_raw);

  const key_block_of block = key_block_of::this_block(args, config::CLUSTER);
  const int kv_h = block.kv_h, b = block.b;
  const int k0 = block.index * config::KV_ROWS;
  const band mask_band = band::of(p, b);
  // Both blocks of the cluster walk the query tiles that see either's keys (the partner may
  // own no keys at all when the key blocks are odd in number: its masks then zero every step).
  const int rank = cluster::rank();
  const int pair_k0 = k0 - rank * config::KV_ROWS;
  query_walk walk =
      query_walk::of(p, mask_band, kv_h, pair_k0, config::CLUSTER * config::KV_ROWS, block.split, args.head_splits);
  if constexpr (SEG) walk.keep_segments<config::CLUSTER * config::KV_ROWS>(p, b, pair_k0);

  if (threadIdx.x == 0) {
    tma::init(s.kv_full, 1);
    s.stage_slots.init(config::CONSUMER_WARPS);
    s.dq_mail[0].init();
    s.dq_mail[1].init();
    tma::fence_barrier_init();
  }
  cluster::sync();  // the partner's barriers are initialised before any remote arrive

  if (warpgroup::groupid() == 0) {  // ---------------- producer ----------------
    warpgroup::decrease_registers<config::PRODUCER_REGS>();
    if (threadIdx.x == 0 && walk.steps > 0) {
      tma::expect_bytes(s.kv_full, sizeof(s.k) + sizeof(s.v));
      tma::load_async(&s.k, args.k, s.kv_full, 0, k0, 0, kv_h, b);
      tma::load_async(&s.v, args.v, s.kv_full, 0, k0, 0, kv_h, b);
      s.stages.produce(s.stage_slots, walk, args.q, args.dout, b);
    }
    cluster::sync();  // matches the consumers' final sync
    return;
  }

  warpgroup::increase_registers<config::CONSUMER_REGS>();
  const bool p_role = warpgroup::groupid() == 1;
  const int warp = warpgroup::warp_in_group();
  const int key0 = k0 + 16 * warp;  // this warp's first key row (in both roles)
  const auto masked_tile = mask_band.cuts_for_keys(QT, key0, 16);  // rows are keys, columns queries
  // SEG, P role: rows are keys, columns queries.
  const int32_t* const key_ids = p.mask.kv_segment_ids + int64_t(b) * p.seq_k;
  const int32_t* const query_ids = p.mask.q_segment_ids + int64_t(b) * p.seq_q;
  warp_segments segments;
  if constexpr (SEG) segments = warp_segments::of(key_ids, key0, mask_band.k_end);
  rt_fl<16, D> grad;  // dV in the P role, dK in the dS role
  zero(grad);
  if (walk.steps > 0) tma::wait(s.kv_full, 0);

  query_walk::tile tile = walk.first();
  for (int i = 0; i < walk.steps; i++, walk.advance(tile)) {
    const int q0 = tile.q0, buf = i & 1;
    const int stage = s.stage_slots.acquire(i);
    const auto& q_tile = s.stages.q[stage];
    const auto& dout_tile = s.stages.dout[stage];
    float* const dq_rows = args.ws.dq_chunk<D>(b, tile.head, tile.q0, 0) + 16 * 64 * warp;

    if (p_role) {
      // P^T from the recomputed scores; lse2 is +inf on rows that saw nothing, giving P = 0.
      const float c = p.scale * LOG2E;
      [[maybe_unused]] segment_span tile_ids;  // SEG: of this query tile, loaded before the scores are waited for
      if constexpr (SEG) tile_ids = segment_ranges::of(p).queries<QT>(b, q0);
      rt_fl<16, QT> probs;
      warpgroup::mma_ABt(probs, s.k, q_tile, false);
      col_vec<QT> lse2;
      load(lse2, args.ws.lse2 + args.ws.row(b, tile.head, tile.q0));
      warpgroup::wait<0>();
      if constexpr (SEG) segments.mask(probs, tile_ids, key_ids, key0, mask_band.k_end, query_ids, q0, mask_band.q_end);
      if (masked_tile.cuts(q0)) mask_band.mask<true>(probs, q0, key0);
      map_cols(probs, lse2, [=](float x, float lse2) { return fast_exp2(c * x - lse2); });
      rt<T, 16, QT> probs_16;
      copy(probs_16, probs);
      store(s.ds[buf], probs_16, 16 * warp, 0);
      named_barrier_arrive(PROBS_READY_BARRIER + warp, 64);
      warpgroup::mma_AB(grad, probs_16, dout_tile, true);  // dV += P^T dO
      named_barrier_sync(DS_READY_BARRIER, 256);
      add_dq_half<0>(dq_rows, s.ds[buf], s.k, 0, s.dq_mail[0], rank, i, [] {});
    } else {
      rt_fl<16, QT> dprobs;
      warpgroup::mma_ABt(dprobs, s.v, dout_tile, false);  // dP^T = V dO^T
      col_vec<QT> delta;
      load(delta, args.ws.delta + args.ws.row(b, tile.head, tile.q0));
      warpgroup::wait<0>();
      named_barrier_sync(PROBS_READY_BARRIER + warp, 64);
      rt<T, 16, QT> probs_16;
      load(probs_16, s.ds[buf], 16 * warp, 0);
      rt_fl<16, QT> probs;
      copy(probs, probs_16);
      map_cols(dprobs, delta, [=](float dp, float delta) { return fmaf(dp, p.scale, -delta); });
      mul(dprobs, probs);  // dS^T (scaled)
      rt<T, 16, QT> ds_16;
      copy(ds_16, dprobs);
      __syncwarp();  // every lane has read its P^T before the warp overwrites the rows
      store(s.ds[buf], ds_16, 16 * warp, 0);
      warpgroup::fence_shared_to_async();
      named_barrier_sync(DS_READY_BARRIER, 256);
      // dK's product goes behind dQ's owned chunk: the P warpgroup and the partner block wait
      // for this role's first send, which then does not wait for dK (+3-5%).
      add_dq_half<1>(dq_rows, s.ds[buf], s.k, D / 2, s.dq_mail[1], rank, i,
                     [&] { warpgroup::mma_AB(grad, ds_16, q_tile, true); });  // dK += dS^T Q
    }
    warpgroup::wait<0>();  // this role's gradient product has read the stage
    s.stage_slots.release(i);
  }

  store_key_gradient<T, D>(args, grad, p_role ? p.dv : p.dk, p_role ? args.ws.dv_accum : args.ws.dk_accum, b, kv_h,
                           key0);
  cluster::sync();  // the partner's last remote arrive on this block's barriers has landed
}

template <typename T, int D, bool SEG>
cudaError_t launch_split_backward(const BackwardParams& p, const backward_workspace& ws, int head_splits,
                                  cudaStream_t stream) {
  using config = split_backward_config<D>;
  BackwardArgs args{};
  // Pairs interleave in L2-sized groups (BACKWARD_GROUP_L2_BYTES), masked or not: +3-5% fwd+bwd
  // at 2k-4k over one pair at a time (docs/DESIGN.md).
  if (cudaError_t err = prepare_backward<T, D>(args, p, ws, config::KV_ROWS, BACKWARD_GROUP_L2_BYTES, head_splits);
      err != cudaSuccess)
    return err;
  static_assert(sizeof(split_backward_shared<T, D>) + 1024 <= 227 * 1024,
                "over the 227 KB of shared memory a block may use");
  const int smem = int(sizeof(split_backward_shared<T, D>)) + 1024;
  const int key_blocks = (p.seq_k + config::KV_ROWS - 1) / config::KV_ROWS;
  const dim3 grid((key_blocks + config::CLUSTER - 1) / config::CLUSTER * config::CLUSTER, p.heads_kv * head_splits,
                  p.batch);
  return launch_with_shared<split_backward_kernel<T, D, SEG>>(grid, config::THREADS, smem, stream, args);
}

}  // namespace tk::attention
