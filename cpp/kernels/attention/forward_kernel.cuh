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

// Which keys rows [first_row, last_row] may see, as [lo, hi).
struct key_range {
  int lo, hi;
};
__device__ __forceinline__ key_range visible_keys(const ForwardParams& p, int first_row, int last_row) {
  const int offset = p.seq_k - p.seq_q;
  const int lo = p.window_left >= 0 ? max(0, first_row + offset - p.window_left) : 0;
  const int hi = p.window_right >= 0 ? min(p.seq_k, last_row + offset + p.window_right + 1) : p.seq_k;
  return {lo, hi};
}

template <typename T, int D>
__global__ void __launch_bounds__(FWD_THREADS) forward_kernel(const __grid_constant__ ForwardParams p) {
  extern __shared__ char smem_raw[];
  // Swizzled tiles need 1024-byte alignment; the dynamic shared base only promises 16.
  auto& s = *reinterpret_cast<forward_shared<T, D>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  const int num_q_blocks = gridDim.x;
  // Under a causal or window band the last query blocks do the most work: start them first.
  const int q_block = p.window_right >= 0 ? num_q_blocks - 1 - blockIdx.x : blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int kv_h = h / (p.heads_q / p.heads_kv);
  const int q0 = q_block * FWD_Q_ROWS;
  const int warp = warpid();

  const auto Q = gl<T>::contiguous((T*)p.q, p.batch, p.seq_q, p.heads_q, D);
  const auto K = gl<T>::contiguous((T*)p.k, p.batch, p.seq_k, p.heads_kv, D);
  const auto V = gl<T>::contiguous((T*)p.v, p.batch, p.seq_k, p.heads_kv, D);
  const auto O = gl<T>::contiguous((T*)p.o, p.batch, p.seq_q, p.heads_q, D);

  const key_range keys = visible_keys(p, q0, min(q0 + FWD_Q_ROWS, p.seq_q) - 1);
  const int first_tile = keys.lo / FWD_KV_ROWS;
  const int end_tile = keys.hi > keys.lo ? (keys.hi + FWD_KV_ROWS - 1) / FWD_KV_ROWS : first_tile;

  rt<T, 16, D> q;        // this warp's 16 query rows
  rt_fl<16, D> o;        // running numerator
  row_vec<16> m, l;      // running max (raw score units) and denominator
  zero(o);
  map(m, [](float) { return NEG_INF; });
  map(l, [](float) { return 0.f; });
  const float c = p.scale * LOG2E;
  const int offset = p.seq_k - p.seq_q;

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
    const int row0 = q0 + 16 * warp;
    const bool crosses_edge =
        k0 + FWD_KV_ROWS > p.seq_k ||
        (p.window_right >= 0 && k0 + FWD_KV_ROWS - 1 > row0 + offset + p.window_right) ||
        (p.window_left >= 0 && k0 < row0 + 15 + offset - p.window_left);
    if (crosses_edge) {
      mask(scores, row0, k0, [&](int i, int j) {
        return j < p.seq_k && (p.window_right < 0 || j <= i + offset + p.window_right) &&
               (p.window_left < 0 || j >= i + offset - p.window_left);
      });
    }

    // Online softmax. A row that has seen no key yet keeps max -inf: use 0 in its place so
    // that 2^(-inf - 0) = 0 instead of NaN.
    row_vec<16> m_new, rescale;
    row_max(m_new, scores);
    map(m_new, m_new, m, [](float a, float b) { return fmaxf(a, b); });
    map(m_new, [](float x) { return x == NEG_INF ? 0.f : x; });
    map(rescale, m, m_new, [=](float old_m, float new_m) { return fast_exp2(c * (old_m - new_m)); });
    map_rows(scores, m_new, [=](float x, float mx) { return fast_exp2(c * x - c * mx); });
    row_vec<16> tile_sum;
    row_sum(tile_sum, scores);
    map(l, l, rescale, [](float a, float b) { return a * b; });
    map(l, l, tile_sum, [](float a, float b) { return a + b; });
    mul_row(o, rescale);
    m = m_new;  // rows still empty carry 0 here; their l and O are 0, so rescaling them is harmless

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

  // O /= l and the log-sum-exp; rows that saw nothing get O = 0, lse = -inf.
  row_vec<16> inv_l;
  map(inv_l, l, l, [](float x, float) { return x > 0.f ? 1.f / x : 0.f; });
  mul_row(o, inv_l);
  store(O, o, {b, h, q0 + 16 * warp});
  if ((laneid() & 3) == 0) {
#pragma unroll
    for (int half_idx = 0; half_idx < 2; half_idx++) {
      const int row = q0 + 16 * warp + row_vec_row(0, half_idx);
      if (row < p.seq_q) {
        const float lv = l.data[0][half_idx];
        p.lse[(int64_t(b) * p.heads_q + h) * p.seq_q + row] =
            lv > 0.f ? (c * m.data[0][half_idx] + __log2f(lv)) * LN2 : NEG_INF;
      }
    }
  }
}

template <typename T, int D>
cudaError_t launch_forward(const ForwardParams& p, cudaStream_t stream) {
  const int smem = int(sizeof(forward_shared<T, D>)) + 1024;
  if (cudaError_t err = allow_dynamic_shared<forward_kernel<T, D>>(smem); err != cudaSuccess) return err;
  const dim3 grid((p.seq_q + FWD_Q_ROWS - 1) / FWD_Q_ROWS, p.heads_q, p.batch);
  forward_kernel<T, D><<<grid, FWD_THREADS, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace tk::attention
