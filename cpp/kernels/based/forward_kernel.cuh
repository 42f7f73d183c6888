// Based linear attention forward: the running state lives in registers.
//
// One block = 8 warps walks the sequence of one (batch, head) for 64 of its value columns
// (Dv = 128 takes two blocks), in chunks of 64 tokens, with the state split over the warps as
// state_tiles.cuh describes. Each warp holds its 9 tiles transposed, S_f^T [16 columns x 16
// features] (72 registers a lane), because then both products with the state need no shuffle:
//   update   S_f^T += V_C^T Phi_f(K)    A = V_C^T is V's col-layout fragment, as_transpose'd
//   output   y_C   += Phi_f(Q) S_f      B = S_f is S_f^T's accumulator, rounded to bf16
// The constants of phi are applied exactly: the 1/32 with k_a in the update, the 1/4 when
// rounding.
//
// Per chunk (t0 = its first token), with Q, K, V in shared memory:
//   1. each warp: its partial y_C over its 9 feature tiles for all 64 rows (4 row tiles);
//      the partial of the row tiles the other feature half finishes goes to shared memory.
//      Each warp also computes one of two parts of phi(q) . z (the normaliser's state term) of
//      one row tile, with one mma (vector_state.cuh).
//   2. each warp finishes 2 row tiles (fh = 0: rows 0-15 and 48-63, fh = 1: rows 16-47) of its
//      columns: the intra-chunk term tril(1 + s + s^2/2) V_C with s = Q K^T / 4, the other
//      half's partial, the normaliser, then y straight to global memory.
//   3. each warp folds the chunk into its state tiles and its copy of z (exact, from K^T K).
// 16-bit operands: phi(Q) and the rounded state are bf16 even for fp16 inputs (state entries
// grow with the sequence and would overflow fp16); everything else is in the input type, every
// sum fp32.
//
// Parallelism: batch * heads * (Dv / 64) blocks of 8 warps; the state takes most of the
// registers, so one block per SM (the Python side splits long sequences of few heads into
// groups, see tk_jax/_sequence_split.py).
#pragma once

#include "feature_tiles.cuh"
#include "state_tiles.cuh"
#include "vector_state.cuh"

namespace tk::based {

using namespace kittens;

constexpr int FWD_WARPS = STATE_WARPS;
constexpr int FWD_THREADS = STATE_THREADS;

template <typename T>
struct forward_shared {
  st<T, CHUNK, FEATURE_DIM> q[2], k[2];  // double-buffered chunks
  st<T, CHUNK, V_BLOCK> v[2];
  float den_state[2][CHUNK];             // phi(q_t) . z of the chunk's rows, in two parts
  // Partial y handed from one feature half to the other, [warp][row tile][16 x 16], in
  // kittens' fragment order (store_fragments): the same lane writes and reads each value.
  alignas(16) float partial[FWD_WARPS][2][16 * 16];
};

namespace fwd_step {

// The global tensors the forward streams: q, k and this block's V_BLOCK columns of v.
template <typename T>
struct forward_views {
  gl<T> q, k, v;
};

template <typename T>
__device__ __forceinline__ void load_chunk_async(forward_shared<T>& s, const forward_views<T>& g, int b, int h,
                                                 int stage, int t0) {
  load_async<FWD_THREADS>(s.q[stage], g.q, {b, h, t0});
  load_async<FWD_THREADS>(s.k[stage], g.k, {b, h, t0});
  load_async<FWD_THREADS>(s.v[stage], g.v, {b, h, t0});
  cp_async_commit();
}

// The forward's power of two that turns own tile `own` into the one phi(q) multiplies:
// phi(q)'s first order q / 2 meets a tile of sums k v that is 2 S.
__device__ __forceinline__ float tile_scale(int own, int fh) {
  return own < SECOND_ORDER_OWN ? 1.f : fh == 0 ? 0.25f : 1.f;
}

// This warp's S_f^T (column x feature) from S0 [NUM_FEATURES, value_dim] in the external order (`src` at
// the warp's first column), scaled back to the tiles' plain sums; and back at the end.
__device__ __forceinline__ void load_state_transposed(rt_fl<16, 16> (&state)[OWN_TILES], const float* src,
                                                      int value_dim, int fh) {
#pragma unroll
  for (int own = 0; own < OWN_TILES; own++) {
    const float unscale = 1.f / external_scale(own, fh);
    for_each(state[own], [&](float& x, int c, int b) {
      const int f = external_feature(own, fh, b);
      x = f < 0 ? 0.f : src[int64_t(f) * value_dim + c] * unscale;
    });
  }
}
__device__ __forceinline__ void store_state_transposed(float* dst, rt_fl<16, 16> (&state)[OWN_TILES], int value_dim,
                                                       int fh) {
#pragma unroll
  for (int own = 0; own < OWN_TILES; own++) {
    const float scale = external_scale(own, fh);
    for_each(state[own], [&](float& x, int c, int b) {
      const int f = external_feature(own, fh, b);
      if (f >= 0) dst[int64_t(f) * value_dim + c] = x * scale;
    });
  }
}

// 1. y_i += Phi_f(Q_i) S_f over this warp's feature tiles, for all row tiles i (phi(Q)'s
// second-order tiles in pairs: one shuffle serves both).
template <typename T>
__device__ __forceinline__ void add_state_term(rt_fl<16, 16> (&y)[ROW_TILES], const rt<T, 16, 16> (&q)[ROW_TILES],
                                               const rt_fl<16, 16> (&state)[OWN_TILES], int fh) {
#pragma unroll
  for (int j = 0; j < SECOND_ORDER_OWN / 2; j++) {
    const auto s_op0 = state_operand(state[2 * j], 1.f), s_op1 = state_operand(state[2 * j + 1], 1.f);
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) {
      rt_bf<16, 16> phi0, phi1;
      mul_by_columns(phi0, phi1, q[i], q[i], second_order_row(2 * j, fh));
      mma_AB(y[i], phi0, s_op0, y[i]);
      mma_AB(y[i], phi1, s_op1, y[i]);
    }
  }
  const auto s_op = state_operand(state[LOW_ORDER_OWN], tile_scale(LOW_ORDER_OWN, fh));
#pragma unroll
  for (int i = 0; i < ROW_TILES; i++) mma_AB(y[i], phi_q_low_order(q[i], fh), s_op, y[i]);
}

// 1. Part cg >> 1 of phi(q) . z for this warp's finished row tile cg & 1, into den_state.
template <typename T>
__device__ __forceinline__ void put_normaliser_state_term(forward_shared<T>& s, const vector_state& z,
                                                          const rt<T, 16, 16> (&q)[ROW_TILES], const state_warp& w,
                                                          const int (&row_tile)[ROW_TILES]) {
  rt<T, 16, 16> q_tile;
  select(q_tile, w.cg & 1, q[1], q[0]);
  const int part = w.cg >> 1, row0 = 16 * ((w.cg & 1) ? row_tile[1] : row_tile[0]);
  store(s.den_state[part] + row0, z.normaliser_part(q_tile, part));
}

// 2a. The intra-chunk term of this warp's two row tiles: weights 1 + s + s^2/2 with s = q.k / 4,
// i.e. 1 + x/4 + x^2/32 for x = q.k, over the keys up to the row (key tiles past the diagonal
// are skipped; only the diagonal tile and a sequence tail need masks). den gets the rows' sums
// of the weights.
template <typename T>
__device__ __forceinline__ void add_intra_chunk_term(rt_fl<16, 16> (&y)[ROW_TILES], row_vec<16> (&den)[2],
                                                     const rt<T, 16, 16> (&q)[ROW_TILES],
                                                     const rt<T, 16, 16, layout::col> (&v_c)[ROW_TILES],
                                                     const st<T, CHUNK, FEATURE_DIM>& k_chunk, const state_warp& w,
                                                     const int (&row_tile)[ROW_TILES],
                                                     int real_tokens) {
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const int m = row_tile[i];
    map(den[i], [](float) { return 0.f; });
#pragma unroll
    for (int kt = 0; kt < ROW_TILES; kt++)
      if (kt <= m) {
        rt<T, 16, 16> k;
        load(k, k_chunk, 16 * kt, 0);
        rt_fl<16, 16> weights;
        zero(weights);
        mma_ABt(weights, q[i], k, weights);
        map(weights, [](float x) { return fmaf(x, fmaf(x, 1.f / 32, 0.25f), 1.f); });
        if (kt == m || real_tokens < CHUNK)
          for_each(weights, [&](float& x, int r, int key) {
            if (16 * kt + key > 16 * m + r || 16 * kt + key >= real_tokens) x = 0.f;
          });
        // The tensor cores see the weights rounded to 16 bits; the normaliser sums the same
        // rounded values, so that y is exactly a weighted mean (y = v when one key is visible).
        rt<T, 16, 16> weights16;
        copy(weights16, weights);
        mma_AB(y[i], weights16, v_c[kt], y[i]);
        mma_row_sum(den[i], weights16);
      }
  }
}

// 2b. Finish this warp's two row tiles: the other half's partial, the normaliser's state term,
// then y to global memory (and den, the backward's residual, once per row).
template <typename T>
__device__ __forceinline__ void finish_rows(rt_fl<16, 16> (&y)[ROW_TILES], row_vec<16> (&den)[2],
                                            const forward_shared<T>& s, const gl<T>& Y,
                                            const ForwardParams& p, const state_warp& w,
                                            const int (&row_tile)[ROW_TILES], int v_block, int b, int h,
                                            int t0) {
  const int partner = w.warp ^ 4;  // same columns, other feature half
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const int row0 = 16 * row_tile[i];
    rt_fl<16, 16> other_half;
    load_fragments(other_half, s.partial[partner][i]);
    add(y[i], other_half);
    row_vec<16> state_term, part1;
    load(state_term, s.den_state[0] + row0);
    load(part1, s.den_state[1] + row0);
    map(state_term, state_term, part1, [](float a, float c) { return a + c; });
    map(den[i], den[i], state_term, [](float a, float c) { return a + c; });
    if (v_block == 0 && w.cg == 0)
      store(p.den + (int64_t(b) * p.heads + h) * p.seq + t0 + row0, den[i], p.seq - t0 - row0);
    if (p.normalize) {
      const float eps = p.eps;
      map(den[i], [=](float d) { return 1.f / (d + eps); });
      mul_row(y[i], den[i]);
    }
    store(Y, y[i], {b, h, t0 + row0});
  }
}

// 3. Fold the chunk into the state, S_f^T += V_C^T Phi_f(K), and into z, 16 tokens at a time.
template <typename T>
__device__ __forceinline__ void fold_chunk(rt_fl<16, 16> (&state)[OWN_TILES], vector_state& z,
                                           const rt<T, 16, 16, layout::col> (&v_c)[ROW_TILES],
                                           const st<T, CHUNK, FEATURE_DIM>& k_chunk, int fh, int real_tokens) {
#pragma unroll
  for (int kt = 0; kt < ROW_TILES; kt++) {
    rt<T, 16, 16, layout::col> kc;
    load(kc, k_chunk, 16 * kt, 0);
    rt<T, 16, 16, layout::col> kc32;
    copy(kc32, kc);
    mul(kc32, 1.f / 32);
    const rt<T, 16, 16> v_t = as_transpose(v_c[kt]);  // V_C^T
    z.add(kc, min(16, max(0, real_tokens - 16 * kt)));
#pragma unroll
    for (int own = 0; own < OWN_TILES; own++) mma_AB(state[own], v_t, phi_k_tile(kc, kc32, own, fh), state[own]);
  }
}

}  // namespace fwd_step

template <typename T>
__global__ void __launch_bounds__(FWD_THREADS, 1) forward_kernel(const __grid_constant__ ForwardParams p) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<forward_shared<T>>(smem_raw);
  const int v_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t head = int64_t(b) * p.heads + h;
  const state_warp w = this_state_warp();
  int row_tile[ROW_TILES];  // the chunk's row tiles in this warp's order
  row_tiles_of_half(row_tile, w.fh);
  const int v0 = v_block * V_BLOCK;  // this block's first value column
  const gl<T> Q = feature_view<T>(p.q, p), K = feature_view<T>(p.k, p);
  const value_layout values = value_layout_of(p);
  const gl<T> V = values.columns<T>(p.v, v0, V_BLOCK);
  const gl<T> Y = values.columns<T>(p.y, v0 + w.c0, 16);  // this warp's columns

  rt_fl<16, 16> state[OWN_TILES];  // S_f^T of this warp's tiles
  vector_state z;                  // the normaliser's state, a copy per warp
  rt<T, 16, 16> q[ROW_TILES];      // the chunk's rows, in this warp's order
  rt<T, 16, 16, layout::col> v_c[ROW_TILES];  // V_C [64 tokens x this warp's 16 columns] as B operands
  rt_fl<16, 16> y[ROW_TILES];
  row_vec<16> den[2];              // of the two row tiles this warp finishes

  fwd_step::load_chunk_async(s, {Q, K, V}, b, h, 0, 0);
  fwd_step::load_state_transposed(state, p.state0 + head * NUM_FEATURES * p.value_dim + v0 + w.c0, p.value_dim, w.fh);
  z.load(p.z0 + head * NUM_FEATURES);

  const int num_chunks = (p.seq + CHUNK - 1) / CHUNK;
  for (int chunk = 0; chunk < num_chunks; chunk++) {
    const int stage = chunk & 1, t0 = chunk * CHUNK;
    const int real_tokens = min(CHUNK, p.seq - t0);
    cp_async_wait<0>();
    __syncthreads();  // the chunk is visible to all, and every warp is done with stage ^ 1
    if (chunk + 1 < num_chunks) fwd_step::load_chunk_async(s, {Q, K, V}, b, h, stage ^ 1, t0 + CHUNK);

#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) {
      load(q[i], s.q[stage], 16 * row_tile[i], 0);
      zero(y[i]);
    }
    fwd_step::add_state_term(y, q, state, w.fh);
#pragma unroll
    for (int i = 2; i < ROW_TILES; i++) store_fragments(s.partial[w.warp][i - 2], y[i]);  // the partner's rows
    fwd_step::put_normaliser_state_term(s, z, q, w, row_tile);

#pragma unroll
    for (int kt = 0; kt < ROW_TILES; kt++) load(v_c[kt], s.v[stage], 16 * kt, w.c0);
    fwd_step::add_intra_chunk_term(y, den, q, v_c, s.k[stage], w, row_tile, real_tokens);
    __syncthreads();  // partials and phi(q) . z are in shared memory
    fwd_step::finish_rows(y, den, s, Y, p, w, row_tile, v_block, b, h, t0);

    fwd_step::fold_chunk(state, z, v_c, s.k[stage], w.fh, real_tokens);
  }

  fwd_step::store_state_transposed(p.state + head * NUM_FEATURES * p.value_dim + v0 + w.c0, state, p.value_dim, w.fh);
  if (v_block == 0 && w.warp == 0) z.store(p.z + head * NUM_FEATURES);  // z is the same for every block and warp
}

template <typename T>
cudaError_t launch_forward(const ForwardParams& p, cudaStream_t stream) {
  const int smem = int(sizeof(forward_shared<T>)) + 1024;
  const dim3 grid(p.value_dim / V_BLOCK, p.heads, p.batch);
  return launch_with_shared<forward_kernel<T>>(grid, FWD_THREADS, smem, stream, p);
}

}  // namespace tk::based
