// Flash attention forward on mma.sync tensor cores (the portable first version; the Hopper
// wgmma/TMA kernel replaces it for speed).
//
// One block = 4 warps = 64 query rows of one (batch, head); each warp owns 16 rows. The block
// walks the key/value tiles its rows can see, 64 keys at a time, double-buffered with cp.async:
//   S = Q K^T                       (fp32, raw scores)
//   m' = max(m, rowmax(S));  P = 2^(c S - c m');  l = 2^(c m - c m') l + rowsum(P)
//   O = 2^(c m - c m') O + P V      with c = softmax_scale * log2(e)
// and finally O /= l, lse = ln 2 * (c m + log2 l). Tiles wholly outside the causal/window band
// are never visited; only tiles crossing its edges or the end of the keys are masked.
#pragma once

#include "../../kittens/kittens.cuh"
#include "attention.h"
#include "softmax_band.cuh"

namespace tk::attention {

using namespace kittens;

constexpr int FWD_WARPS = 4;
constexpr int FWD_THREADS = FWD_WARPS * WARP_THREADS;
constexpr int FWD_Q_ROWS = 16 * FWD_WARPS;
constexpr int FWD_KV_ROWS = 64;

template <typename T, int D>
struct forward_shared {
  st<T, FWD_Q_ROWS, D> q;
  st<T, FWD_KV_ROWS, D> k[2], v[2];
};


template <typename T, int D>
__global__ void __launch_bounds__(FWD_THREADS) forward_kernel(const __grid_constant__ ForwardParams p) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<forward_shared<T, D>>(smem_raw);

  const int num_q_blocks = gridDim.x;
  // Under a causal or window band the last query blocks do the most work: start them first.
  const int q_block = p.window_right >= 0 ? num_q_blocks - 1 - blockIdx.x : blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int kv_h = h / (p.heads_q / p.heads_kv);
  const int q0 = q_block * FWD_Q_ROWS;
  const int warp = warpid(), row0 = q0 + 16 * warp;  // this warp's first query row

  const auto Q = gl<T>::contiguous((T*)p.q, p.batch, p.seq_q, p.heads_q, D);
  const auto K = gl<T>::contiguous((T*)p.k, p.batch, p.seq_k, p.heads_kv, D);
  const auto V = gl<T>::contiguous((T*)p.v, p.batch, p.seq_k, p.heads_kv, D);
  const band mask_band = band::of(p);
  const key_range keys = mask_band.keys_of(q0, min(q0 + FWD_Q_ROWS, p.seq_q) - 1);
  const int first_tile = keys.lo / FWD_KV_ROWS;
  const int end_tile = keys.hi > keys.lo ? (keys.hi + FWD_KV_ROWS - 1) / FWD_KV_ROWS : first_tile;
  const auto masked_tile = mask_band.cuts_for_queries(row0, 16, FWD_KV_ROWS);  // which key tiles need masks

  rt<T, 16, D> q;        // this warp's 16 query rows
  rt_fl<16, D> o;        // running numerator
  row_vec<16> m, l;      // running max (raw score units) and denominator
  zero(o);
  map(m, [](float) { return NEG_INF; });
  map(l, [](float) { return 0.f; });
  const float c = p.scale * LOG2E;

  load_async<FWD_THREADS>(s.q, Q, {b, h, q0});
  if (first_tile < end_tile) {
    load_async<FWD_THREADS>(s.k[0], K, {b, kv_h, first_tile * FWD_KV_ROWS});
    load_async<FWD_THREADS>(s.v[0], V, {b, kv_h, first_tile * FWD_KV_ROWS});
  }
  cp_async_commit();

  for (int tile = first_tile; tile < end_tile; tile++) {
    const int stage = (tile - first_tile) & 1;
    if (tile + 1 < end_tile) {  // prefetch the next tile into the other stage
      load_async<FWD_THREADS>(s.k[stage ^ 1], K, {b, kv_h, (tile + 1) * FWD_KV_ROWS});
      load_async<FWD_THREADS>(s.v[stage ^ 1], V, {b, kv_h, (tile + 1) * FWD_KV_ROWS});
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (tile == first_tile) load(q, s.q, 16 * warp, 0);

    // S = Q K^T, 16 columns of head_dim at a time.
    rt_fl<16, FWD_KV_ROWS> scores;
    zero(scores);
#pragma unroll
    for (int d = 0; d < D / 16; d++) {
      rt<T, FWD_KV_ROWS, 16> k;
      load(k, s.k[stage], 0, 16 * d);
      mma_ABt(scores, q.template col_slice<16>(d), k, scores);
    }

    const int k0 = tile * FWD_KV_ROWS;
    if (masked_tile.cuts(k0)) mask_band.mask(scores, row0, k0);
    row_vec<16> rescale;
    if (online_softmax_step(scores, m, l, rescale, c)) mul_row(o, rescale);

    // O += P V, 16 columns of head_dim at a time.
    rt<T, 16, FWD_KV_ROWS> probs;
    copy(probs, scores);
#pragma unroll
    for (int d = 0; d < D / 16; d++) {
      rt<T, FWD_KV_ROWS, 16, layout::col> v;
      load(v, s.v[stage], 0, 16 * d);
      mma_AB(o.template col_slice<16>(d), probs, v, o.template col_slice<16>(d));
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  cp_async_wait<0>();

  store_output<T, D>(o, m, l, c, p, b, h, row0);
}

template <typename T, int D>
cudaError_t launch_forward(const ForwardParams& p, cudaStream_t stream) {
  const int smem = int(sizeof(forward_shared<T, D>)) + 1024;
  const dim3 grid((p.seq_q + FWD_Q_ROWS - 1) / FWD_Q_ROWS, p.heads_q, p.batch);
  return launch_with_shared<forward_kernel<T, D>>(grid, FWD_THREADS, smem, stream, p);
}

}  // namespace tk::attention
