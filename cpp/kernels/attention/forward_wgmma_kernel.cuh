// Flash attention forward for Hopper: TMA loads, wgmma, warp specialisation.
//
// A block has three warpgroups. Warpgroup 0 is the producer: one thread streams Q once and
// then K and V tiles of 128 keys through a ring of shared-memory stages with TMA, each stage
// guarded by "full" barriers (the copy engine completes them) and an "empty" barrier (the
// consumers release it). Warpgroups 1 and 2 are consumers, 64 query rows each:
//   S = Q K^T                                   (wgmma, Q and K from shared memory)
//   m' = max(m, rowmax S);  P = 2^(c S - c m');  l = 2^(c m - c m') l + rowsum P
//   O = 2^(c m - c m') O + P V                  (wgmma, P from registers, V from shared)
// with c = scale * log2(e); finally O /= l and lse = ln 2 (c m + log2 l). The next key tile's
// scores are issued before this tile's P V, so that one tile's softmax runs while the tensor
// cores work on the other's product. Registers move from the producer (which needs few) to
// the consumers with setmaxnreg. Tiles outside the causal / window band are never loaded;
// only tiles crossing its edges or the end of the keys are masked.
#pragma once

#include "../../kittens/kittens.cuh"
#include "attention.h"
#include "softmax_band.cuh"

namespace tk::attention {

using namespace kittens;

template <int D>
struct wgmma_forward_config {
  static constexpr int CONSUMERS = 2;
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  static constexpr int Q_ROWS = 64 * CONSUMERS;
  // Key tiles of 128 rows; 64 at D = 256, where the output takes 128 registers a thread and
  // two stages of 128-row K and V tiles would not fit in shared memory.
  static constexpr int KV_ROWS = D <= 128 ? 128 : 64;
  // Three stages where they fit (at D = 128: 32 KB of Q + 3 x 64 KB of K and V, 226 KB in all):
  // with the next tile's scores computed early, K_{i+1} must have landed one step sooner.
  static constexpr int STAGES = D <= 128 ? 3 : 2;
  static constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
  static_assert(warpgroup::registers_fit(1, PRODUCER_REGS, CONSUMERS, CONSUMER_REGS));
};

template <typename T, int D>
struct wgmma_forward_shared {
  using config = wgmma_forward_config<D>;
  st<T, 64, D> q[config::CONSUMERS];
  st<T, config::KV_ROWS, D> k[config::STAGES], v[config::STAGES];
  tma::barrier q_full;
  // K and V have rings of their own: K_i is released as soon as its scores have landed, well
  // before V_i is done, so the next K tile can load early.
  ring<config::STAGES> k_ring, v_ring;
};

struct WgmmaForwardArgs {
  CUtensorMap q, k, v;  // boxes: 64 query rows, KV_ROWS key rows
  ForwardParams p;
};

template <typename T, int D>
__global__ void __launch_bounds__(wgmma_forward_config<D>::THREADS, 1)
    wgmma_forward_kernel(const __grid_constant__ WgmmaForwardArgs args) {
  using config = wgmma_forward_config<D>;
  constexpr int KV = config::KV_ROWS;
  const ForwardParams& p = args.p;
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<wgmma_forward_shared<T, D>>(smem_raw);

  const int q_block = p.window_right >= 0 ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int kv_h = h / (p.heads_q / p.heads_kv);
  const int q0 = q_block * config::Q_ROWS;
  const band mask_band = band::of(p);
  const key_range keys = mask_band.keys_of(q0, min(q0 + config::Q_ROWS, p.seq_q) - 1);
  const int first_tile = keys.lo / KV;
  const int end_tile = keys.hi > keys.lo ? (keys.hi + KV - 1) / KV : first_tile;

  if (threadIdx.x == 0) {
    tma::init(s.q_full, 1);
    s.k_ring.init(config::CONSUMERS * 4);  // one arrival per consumer warp
    s.v_ring.init(config::CONSUMERS * 4);
    tma::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup::groupid() == 0) {  // ---------------- producer ----------------
    warpgroup::decrease_registers<config::PRODUCER_REGS>();
    if (threadIdx.x == 0 && first_tile < end_tile) {
      tma::expect_bytes(s.q_full, config::CONSUMERS * sizeof(s.q[0]));
      for (int c = 0; c < config::CONSUMERS; c++) tma::load_async(&s.q[c], args.q, s.q_full, 0, q0 + 64 * c, 0, h, b);
      for (int tile = first_tile, i = 0; tile < end_tile; tile++, i++) {
        const int stage = s.k_ring.slot(i);  // V's ring has the same slots
        tma::load_async(&s.k[stage], args.k, s.k_ring.fill(i, sizeof(s.k[0])), 0, tile * KV, 0, kv_h, b);
        tma::load_async(&s.v[stage], args.v, s.v_ring.fill(i, sizeof(s.v[0])), 0, tile * KV, 0, kv_h, b);
      }
    }
  } else {  // ---------------- consumers ----------------
    warpgroup::increase_registers<config::CONSUMER_REGS>();
    const int consumer = warpgroup::groupid() - 1;
    const int row0 = q0 + 64 * consumer + 16 * warpgroup::warp_in_group();  // this warp's first row
    const float c = p.scale * LOG2E;

    rt_fl<16, D> o;
    row_vec<16> m, l;
    zero(o);
    map(m, [](float) { return NEG_INF; });
    map(l, [](float) { return 0.f; });
    if (first_tile < end_tile) tma::wait(s.q_full, 0);

    // Scores of key tile i + 1 are computed while P_i V_i runs: S_{i+1} and then O += P_i V_i are
    // issued back to back, the softmax of S_{i+1} overlaps the second product, and O is
    // rescaled once that product has landed.
    const int tiles = end_tile - first_tile;
    rt_fl<16, KV> scores;
    row_vec<16> rescale;
    auto scores_of = [&](int i) {  // S_i = Q K_i^T, issued asynchronously
      warpgroup::mma_ABt(scores, s.q[consumer], s.k[s.k_ring.acquire(i)], false);
    };
    auto softmax_of = [&](int i) {  // S_i has landed: release K_i, then scores -> P_i
      s.k_ring.release(i);
      const int k0 = (first_tile + i) * KV;
      if (mask_band.cuts(row0, 16, k0, KV))
        mask(scores, row0, k0, [&](int r, int j) { return mask_band.visible(r, j); });
      online_softmax_step(scores, m, l, rescale, c);
    };
    auto add_pv = [&](int i, const rt<T, 16, KV>& probs) {  // O += P_i V_i, issued asynchronously
      warpgroup::mma_AB(o, probs, s.v[s.v_ring.acquire(i)], true);
    };
    auto release_v = [&](int i) {  // P_i V_i has landed
      s.v_ring.release(i);
    };
    if (tiles > 0) {
      scores_of(0);
      warpgroup::wait<0>();
      softmax_of(0);  // O is still zero: no rescale
    }
    for (int i = 0; i + 1 < tiles; i++) {
      rt<T, 16, KV> probs;  // P_i leaves the scores before S_{i+1} overwrites them
      copy(probs, scores);
      scores_of(i + 1);
      add_pv(i, probs);
      warpgroup::wait<1>();  // S_{i+1} has landed; P_i V_i may still run
      softmax_of(i + 1);
      warpgroup::wait<0>();
      release_v(i);
      mul_row(o, rescale);
    }
    if (tiles > 0) {  // the last tile: nothing left to overlap
      rt<T, 16, KV> probs;
      copy(probs, scores);
      add_pv(tiles - 1, probs);
      warpgroup::wait<0>();
      release_v(tiles - 1);
    }

    store_output<T, D>(o, m, l, c, p, b, h, row0);
  }
}

template <typename T, int D>
cudaError_t launch_wgmma_forward(const ForwardParams& p, cudaStream_t stream) {
  using config = wgmma_forward_config<D>;
  WgmmaForwardArgs args{};
  args.p = p;
  const bool bf = std::is_same_v<T, bf16>;
  if (!tma::make_bshd_map(&args.q, p.q, bf, p.batch, p.seq_q, p.heads_q, D, 64) ||
      !tma::make_bshd_map(&args.k, p.k, bf, p.batch, p.seq_k, p.heads_kv, D, config::KV_ROWS) ||
      !tma::make_bshd_map(&args.v, p.v, bf, p.batch, p.seq_k, p.heads_kv, D, config::KV_ROWS))
    return cudaErrorInvalidValue;
  const int smem = int(sizeof(wgmma_forward_shared<T, D>)) + 1024;
  const dim3 grid((p.seq_q + config::Q_ROWS - 1) / config::Q_ROWS, p.heads_q, p.batch);
  return launch_with_shared<wgmma_forward_kernel<T, D>>(grid, config::THREADS, smem, stream, args);
}

}  // namespace tk::attention
