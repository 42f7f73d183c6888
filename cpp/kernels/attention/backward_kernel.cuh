// Flash attention backward for Hopper (TMA + wgmma + warp specialisation).
//
// A block owns 128 keys of one KV head (64 per consumer warpgroup) and walks every query tile
// (64 rows) of every query head of its GQA group that can see those keys; dK and dV stay in
// registers for the whole walk. Per query tile, with c = scale * log2(e):
//   S^T  = K Q^T                       P^T = 2^(c S^T - log2(e) lse)       (lse per column)
//   dV  += P^T dO                      dP^T = V dO^T
//   dS^T = scale * P^T o (dP^T - delta)                                    (delta per column)
//   dK  += dS^T Q                      dQ  += dS K   (dS^T of all 128 keys staged in shared
//                                                    memory; one fp32 atomic add per element)
// The producer warpgroup streams Q, dO, lse and delta tiles through a ring of stages.
#pragma once

#include "../../kittens/kittens.cuh"
#include "attention.h"
#include "softmax_band.cuh"

namespace tk::attention {

using namespace kittens;

template <int D>
struct backward_config {
  static constexpr int CONSUMERS = 2;
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  static constexpr int KV_ROWS = 64 * CONSUMERS;
  static constexpr int Q_ROWS = BACKWARD_Q_TILE;
  static constexpr int STAGES = 2;
  static constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
};

template <typename T, int D>
struct backward_shared {
  using config = backward_config<D>;
  st<T, 64, D> k[config::CONSUMERS], v[config::CONSUMERS];
  st<T, config::Q_ROWS, D> q[config::STAGES], dout[config::STAGES];
  st<T, 64, config::Q_ROWS> ds[2][config::CONSUMERS];  // dS^T per step parity and consumer: keys x queries
  alignas(16) float lse[config::STAGES][config::Q_ROWS];
  alignas(16) float delta[config::STAGES][config::Q_ROWS];
  tma::barrier kv_full, q_full[config::STAGES], q_empty[config::STAGES];
};

struct BackwardArgs {
  CUtensorMap q, k, v, dout;  // boxes of 64 rows
  BackwardParams p;
};

template <typename T, int D>
__global__ void __launch_bounds__(backward_config<D>::THREADS, 1)
    backward_kernel(const __grid_constant__ BackwardArgs args) {
  using config = backward_config<D>;
  constexpr int QT = config::Q_ROWS, STAGES = config::STAGES;
  const BackwardParams& p = args.p;
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<backward_shared<T, D>>(smem_raw);

  const int kv_h = blockIdx.y, b = blockIdx.z;
  const int k0 = blockIdx.x * config::KV_ROWS;
  const int group = p.heads_q / p.heads_kv;
  const band mask_band = band::of(p);
  const key_range queries = mask_band.queries_of(k0, min(k0 + config::KV_ROWS, p.seq_k) - 1);
  const int first_tile = queries.lo / QT;
  const int tiles_per_head = queries.hi > queries.lo ? (queries.hi + QT - 1) / QT - first_tile : 0;
  const int steps = tiles_per_head * group;

  if (threadIdx.x == 0) {
    tma::init(s.kv_full, 1);
    for (int i = 0; i < STAGES; i++) {
      tma::init(s.q_full[i], 1);
      tma::init(s.q_empty[i], config::CONSUMERS * 4);
    }
    tma::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup::groupid() == 0) {  // ---------------- producer ----------------
    warpgroup::decrease_registers<config::PRODUCER_REGS>();
    if (threadIdx.x == 0 && steps > 0) {
      tma::expect_bytes(s.kv_full, config::CONSUMERS * (sizeof(s.k[0]) + sizeof(s.v[0])));
      for (int c = 0; c < config::CONSUMERS; c++) {
        tma::load_async(&s.k[c], args.k, s.kv_full, 0, k0 + 64 * c, 0, kv_h, b);
        tma::load_async(&s.v[c], args.v, s.kv_full, 0, k0 + 64 * c, 0, kv_h, b);
      }
      for (int i = 0; i < steps; i++) {
        const int stage = i % STAGES;
        const int h = kv_h * group + i / tiles_per_head, q0 = (first_tile + i % tiles_per_head) * QT;
        if (i >= STAGES) tma::wait(s.q_empty[stage], ((i / STAGES) - 1) & 1);
        tma::expect_bytes(s.q_full[stage], sizeof(s.q[0]) + sizeof(s.dout[0]) + 2 * QT * sizeof(float));
        tma::load_async(&s.q[stage], args.q, s.q_full[stage], 0, q0, 0, h, b);
        tma::load_async(&s.dout[stage], args.dout, s.q_full[stage], 0, q0, 0, h, b);
        const int64_t row = (int64_t(b) * p.heads_q + h) * p.seq_q_padded + q0;
        tma::load_bytes_async(s.lse[stage], p.lse + row, QT * sizeof(float), s.q_full[stage]);
        tma::load_bytes_async(s.delta[stage], p.delta + row, QT * sizeof(float), s.q_full[stage]);
      }
    }
  } else {  // ---------------- consumers ----------------
    warpgroup::increase_registers<config::CONSUMER_REGS>();
    const int consumer = warpgroup::groupid() - 1, warp = warpgroup::warp_in_group();
    const int key0 = k0 + 64 * consumer + 16 * warp;  // this warp's first key row
    const float c = p.scale * LOG2E;
    const auto dq_accum = gl<float>::contiguous(p.dq_accum, p.batch, p.seq_q, p.heads_q, D);

    rt_fl<16, D> dk, dv;
    zero(dk);
    zero(dv);
    if (steps > 0) tma::wait(s.kv_full, 0);

    for (int i = 0; i < steps; i++) {
      const int stage = i % STAGES, phase = (i / STAGES) & 1;
      const int h = kv_h * group + i / tiles_per_head, q0 = (first_tile + i % tiles_per_head) * QT;
      tma::wait(s.q_full[stage], phase);

      // P^T from the recomputed scores; lse is +inf on rows that saw nothing, giving P = 0.
      rt_fl<16, QT> probs;
      warpgroup::mma_ABt(probs, s.k[consumer], s.q[stage], false);
      warpgroup::wait<0>();
      if (mask_band.cuts(q0, QT, key0, 16))  // rows are keys, columns queries
        mask(probs, key0, q0, [&](int kj, int qi) { return mask_band.visible(qi, kj); });
      map_cols(probs, s.lse[stage], [=](float x, float lse) { return fast_exp2(c * x - LOG2E * lse); });
      rt<T, 16, QT> probs_16;
      copy(probs_16, probs);

      rt_fl<16, QT> dprobs;
      warpgroup::mma_AB(dv, probs_16, s.dout[stage], true);        // dV += P^T dO
      warpgroup::mma_ABt(dprobs, s.v[consumer], s.dout[stage], false);  // dP^T = V dO^T
      warpgroup::wait<0>();

      map_cols(dprobs, s.delta[stage], [=](float dp, float delta) { return (dp - delta) * p.scale; });
      mul(dprobs, probs);  // dS^T (scaled)
      rt<T, 16, QT> ds_16;
      copy(ds_16, dprobs);
      warpgroup::mma_AB(dk, ds_16, s.q[stage], true);  // dK += dS^T Q

      // dQ += dS K over all 128 keys of the block, so each dQ element gets one atomic add per
      // block: both consumers publish dS^T, then each takes 64-column chunks of dQ in turn.
      // dS^T is double-buffered by step parity: a buffer is rewritten two steps later, when
      // both consumers have passed the barrier after their last product that read it.
      const int buf = i & 1;
      store(s.ds[buf][consumer], ds_16, 16 * warp, 0);
      warpgroup::fence_shared_to_async();
      named_barrier_sync(1, 128 * config::CONSUMERS);
#pragma unroll
      for (int chunk = consumer; chunk < D / 64; chunk += config::CONSUMERS) {
        rt_fl<16, 64> dq;
#pragma unroll
        for (int half = 0; half < config::CONSUMERS; half++)
          warpgroup::mma_AtB(dq, s.ds[buf][half], s.k[half], 64 * chunk, half > 0);
        warpgroup::wait<0>();
        atomic_add(dq_accum, dq, {b, h, q0 + 16 * warp}, 64 * chunk);
      }
      warpgroup::wait<0>();  // dK's product has read this stage's Q
      if (laneid() == 0) tma::arrive(s.q_empty[stage]);
    }

    const auto dK = gl<T>::contiguous((T*)p.dk, p.batch, p.seq_k, p.heads_kv, D);
    const auto dV = gl<T>::contiguous((T*)p.dv, p.batch, p.seq_k, p.heads_kv, D);
    store(dK, dk, {b, kv_h, key0});
    store(dV, dv, {b, kv_h, key0});
  }
}

template <typename T, int D>
cudaError_t launch_backward(const BackwardParams& p, cudaStream_t stream) {
  using config = backward_config<D>;
  BackwardArgs args{};
  args.p = p;
  const bool bf = std::is_same_v<T, bf16>;
  if (!tma::make_bshd_map(&args.q, p.q, bf, p.batch, p.seq_q, p.heads_q, D, config::Q_ROWS) ||
      !tma::make_bshd_map(&args.dout, p.dout, bf, p.batch, p.seq_q, p.heads_q, D, config::Q_ROWS) ||
      !tma::make_bshd_map(&args.k, p.k, bf, p.batch, p.seq_k, p.heads_kv, D, 64) ||
      !tma::make_bshd_map(&args.v, p.v, bf, p.batch, p.seq_k, p.heads_kv, D, 64))
    return cudaErrorInvalidValue;
  const size_t dq_bytes = size_t(p.batch) * p.seq_q * p.heads_q * D * sizeof(float);
  if (cudaError_t err = cudaMemsetAsync(p.dq_accum, 0, dq_bytes, stream); err != cudaSuccess) return err;
  const int smem = int(sizeof(backward_shared<T, D>)) + 1024;
  const dim3 grid((p.seq_k + config::KV_ROWS - 1) / config::KV_ROWS, p.heads_kv, p.batch);
  return launch_with_shared<backward_kernel<T, D>>(grid, config::THREADS, smem, stream, args);
}

}  // namespace tk::attention
