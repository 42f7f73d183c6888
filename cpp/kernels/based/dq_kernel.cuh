// Based backward, the dq sweep, with the state in registers (the forward's organisation, see
// state_tiles.cuh and forward_kernel.cuh).
//
// With v' = [v, 1], dnum'_t = [dy_t inv_den_t, dden_t] and S'_t = S'0 + sum_{j<=t} phi(k_j) v'_j^T
// (based.h), dphi(q_t) = S'_t dnum'_t and dq_t = J_phi(q_t)^T dphi(q_t). Per 64-token chunk:
//   inter   G_t = S'_prev dnum'_t; the state part S dnum goes through the tensor cores, the
//           normaliser column z dden through vector_state (z exact in registers, multiplied as
//           bf16 high + low parts: the two terms nearly cancel where y_t hardly depends on q_t).
//   intra   ds_tj = (dnum'_t . v'_j) (1 + s_tj) / 4 for j <= t, dq_t += sum_j ds_tj k_j.
// The second-order part of the state is symmetric (feature (a, b) and (b, a) are the same
// product), so J^T contracts it with one term: dq_t[b] += 2 c2 sum_a q_t[a] G_t[a, b]
// (c2 = 1/(4 sqrt 2)), i.e. with the tiles holding sums / 32 (c2^2 = 1/32):
//   dq_t += 2 inv_den_t sum_a (dy_t q_t[a]) P_a^T + inv_den_t / 4 * dy_t P_lin^T.
// The initial state S0 is symmetrised when it is read (phi(q) sees only S0[ab] + S0[ba]).
//
// Warp w = (column group cg, feature half fh) holds S_f [16 features x 16 columns] for its 9
// tiles (not transposed: the accumulator of S_f rounded is the B operand S_f^T of dy S^T; the
// constant tile has no dq and is not kept). Each warp thus sees 16 of the 64 columns: it adds
// its part of dq for all 64 rows, and the 8 parts (plus the normaliser's, plus the intra-chunk
// term, which each warp computes for two row tiles and its columns) meet in shared memory.
#pragma once

#include "backward_io.cuh"
#include "feature_tiles.cuh"
#include "vector_state.cuh"

namespace tk::based {

using namespace kittens;

template <typename T>
struct dq_shared : backward_chunks<T> {
  // dq parts, [warp][row tile][16 x 16] from the state and intra-chunk terms and [feature
  // half][row tile][16 x 16] from the normaliser column, in kittens' fragment order.
  alignas(16) float parts[STATE_WARPS][ROW_TILES][16 * 16];
  alignas(16) float normaliser_parts[2][ROW_TILES][16 * 16];
};

namespace dq_step {

// 1. Through the state, for all row tiles i: acc_i = 2 inv_den (sum_a (dy q_a) P_a^T +
// dy P_lin^T / 8) over this warp's feature tiles (the constant tile has no gradient).
template <typename T>
__device__ __forceinline__ void add_state_term(rt_fl<16, 16> (&acc)[ROW_TILES], const backward_chunks<T>& s, int stage,
                                               const rt_fl<16, 16> (&state)[OWN_TILES], const state_warp& w,
                                               const int (&row_tile)[ROW_TILES]) {
  rt<T, 16, 16> q[ROW_TILES], dy[ROW_TILES];
#pragma unroll
  for (int i = 0; i < ROW_TILES; i++) {
    load(q[i], s.q[stage], 16 * row_tile[i], 0);
    load(dy[i], s.dy[stage], 16 * row_tile[i], w.c0);
  }
#pragma unroll
  for (int j = 0; j < SECOND_ORDER_OWN / 2; j++) {  // second-order tiles in pairs (one shuffle serves both)
    const auto s_op0 = state_operand(state[2 * j], 1.f), s_op1 = state_operand(state[2 * j + 1], 1.f);
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) {
      rt_bf<16, 16> a0, a1;
      mul_by_columns(a0, a1, dy[i], q[i], second_order_row(2 * j, w.fh));
      mma_AB(acc[i], a0, s_op0, acc[i]);
      mma_AB(acc[i], a1, s_op1, acc[i]);
    }
  }
  if (w.fh == 0) {  // the first-order tile
    const auto s_op = state_operand(state[LOW_ORDER_OWN], 1.f / 8);
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) {
      rt_bf<16, 16> dy16;
      copy(dy16, dy[i]);
      mma_AB(acc[i], dy16, s_op, acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < ROW_TILES; i++) {
    row_vec<16> scale;
    load(scale, s.inv_den[stage].data + 16 * row_tile[i]);
    map(scale, [](float x) { return 2.f * x; });
    mul_row(acc[i], scale);
  }
}

// 2. The normaliser column, dq_t += dden_t d(phi(q_t) . z)/dq_t: one of its two parts
// (vector_state::gradient_part) per warp, row tile cg, part fh, into shared memory.
template <typename T>
__device__ __forceinline__ void put_normaliser_term(dq_shared<T>& s, int stage, const vector_state& z,
                                                    const state_warp& w) {
  rt<T, 16, 16> q;
  load(q, s.q[stage], 16 * w.cg, 0);
  rt_fl<16, 16> part = z.gradient_part(q, w.fh);
  row_vec<16> dden;
  load(dden, s.dden[stage].data + 16 * w.cg);
  mul_row(part, dden);
  store_fragments(s.normaliser_parts[w.fh][w.cg], part);
}

// 3. Inside the chunk, for this warp's two row tiles: ds = (dy v^T inv_den + dden) (1 + s) / 4
// over the causal keys (dy v^T over this warp's columns; dden once, by column group 0), then
// dq += ds K. Key tiles past the diagonal are skipped; only the diagonal tile and a tail need
// masks.
template <typename T>
__device__ __forceinline__ void add_intra_chunk_term(rt_fl<16, 16> (&acc)[ROW_TILES], const backward_chunks<T>& s,
                                                     int stage, const state_warp& w, const int (&row_tile)[ROW_TILES],
                                                     bool ones_column,
                                                     int real_tokens) {
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const int m = row_tile[i];
    rt<T, 16, 16> q, dy;
    load(q, s.q[stage], 16 * m, 0);
    load(dy, s.dy[stage], 16 * m, w.c0);
    row_vec<16> row_scale, row_shift{};
    load(row_scale, s.inv_den[stage].data + 16 * m);
    if (ones_column && w.cg == 0) load(row_shift, s.dden[stage].data + 16 * m);
#pragma unroll
    for (int kt = 0; kt < ROW_TILES; kt++)
      if (kt <= m) {
        rt<T, 16, 16> k, v;
        load(k, s.k[stage], 16 * kt, 0);
        load(v, s.v[stage], 16 * kt, w.c0);
        rt_fl<16, 16> qk, ds;
        zero(qk);
        zero(ds);
        mma_ABt(qk, q, k, qk);
        mma_ABt(ds, dy, v, ds);
        map_rows(ds, row_scale, row_shift, [](float x, float a, float c) { return fmaf(x, a, c); });
        map(qk, [](float x) { return 0.25f + x / 16; });  // (1 + s) / 4 with s = q.k / 4
        mul(ds, qk);
        if (kt == m || real_tokens < CHUNK)
          for_each(ds, [&](float& x, int r, int key) {
            if (16 * kt + key > 16 * m + r || 16 * kt + key >= real_tokens) x = 0.f;
          });
        add_split_product(acc[i], ds, s.k[stage], 16 * kt);  // dq += ds K
      }
  }
}

// 5. Fold the chunk into the state, S_f += Phi_f(K)^T V_C, and z, 16 tokens at a time.
template <typename T>
__device__ __forceinline__ void fold_chunk(rt_fl<16, 16> (&state)[OWN_TILES], vector_state& z,
                                           const backward_chunks<T>& s, int stage, const state_warp& w,
                                           bool ones_column, int real_tokens) {
#pragma unroll 1
  for (int kt = 0; kt < ROW_TILES; kt++) {
    rt<T, 16, 16, layout::col> kc, v_col, kc32;
    load(kc, s.k[stage], 16 * kt, 0);
    load(v_col, s.v[stage], 16 * kt, w.c0);
    if (ones_column) z.add(kc, min(16, max(0, real_tokens - 16 * kt)));
    copy(kc32, kc);
    mul(kc32, 1.f / 32);
#pragma unroll
    for (int own = 0; own < OWN_TILES; own++) {
      if (own == LOW_ORDER_OWN && w.fh == 1) continue;  // the constant tile: no gradient, not kept
      const auto phi_t = as_transpose(phi_k_tile(kc, kc32, own, w.fh));  // Phi(K)^T as an A operand
      mma_AB(state[own], phi_t, v_col, state[own]);
    }
  }
}

}  // namespace dq_step

template <typename T>
__global__ void __launch_bounds__(STATE_THREADS, 1) dq_kernel(const __grid_constant__ BackwardParams p) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<dq_shared<T>>(smem_raw);
  const int v_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t head = int64_t(b) * p.heads + h;
  const state_warp w = this_state_warp();
  int row_tile[ROW_TILES];  // the chunk's row tiles in this warp's order
  row_tiles_of_half(row_tile, w.fh);
  const int v0 = v_block * V_BLOCK;
  const bool ones_column = v_block == 0;  // this block also handles the column of v' that is 1
  const gl<T> Q = feature_view<T>(p.q, p), K = feature_view<T>(p.k, p);
  const value_layout values = value_layout_of(p);
  const gl<T> V = values.columns<T>(p.v, v0, V_BLOCK), DY = values.columns<T>(p.dy, v0, V_BLOCK);

  rt_fl<16, 16> state[OWN_TILES];  // S_f, symmetrised, in the scale the tiles keep
  vector_state z;                  // the normaliser's state column, symmetrised like S0 (ones_column blocks)
  rt_fl<16, 16> acc[ROW_TILES];    // this warp's part of dq for the chunk's row tiles, in its order

  load_chunk_async(s, {Q, K, V, DY}, p, b, h, 0, 0);
  load_symmetrised_state(state, p.state0 + head * NUM_FEATURES * p.value_dim + v0 + w.c0, p.value_dim, w.fh);
  if (ones_column) z.load(p.z0 + head * NUM_FEATURES, true);

  const int num_chunks = (p.seq + CHUNK - 1) / CHUNK;
  for (int chunk = 0; chunk < num_chunks; chunk++) {
    const int stage = chunk & 1, t0 = chunk * CHUNK;
    const int real_tokens = min(CHUNK, p.seq - t0);
    cp_async_wait<0>();
    __syncthreads();  // the chunk is visible to all, and every warp is done with the last one
    if (chunk + 1 < num_chunks) load_chunk_async(s, {Q, K, V, DY}, p, b, h, stage ^ 1, t0 + CHUNK);

#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) zero(acc[i]);
    dq_step::add_state_term(acc, s, stage, state, w, row_tile);
    if (ones_column) dq_step::put_normaliser_term(s, stage, z, w);
    dq_step::add_intra_chunk_term(acc, s, stage, w, row_tile, ones_column, real_tokens);
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) store_fragments(s.parts[w.warp][row_tile[i]], acc[i]);
    __syncthreads();  // every part is in shared memory

    // 4. dq of the chunk: the parts summed, to this column block's [B, T, H, Dv/64, 16] slice.
    store_summed_parts(p.dq_parts, s.parts, s.normaliser_parts, ones_column, p, b, h, v_block, t0);
    dq_step::fold_chunk(state, z, s, stage, w, ones_column, real_tokens);
  }
}

template <typename T>
cudaError_t launch_dq(const BackwardParams& p, cudaStream_t stream) {
  const int smem = int(sizeof(dq_shared<T>)) + 1024;
  const dim3 grid(p.value_dim / V_BLOCK, p.heads, p.batch);
  return launch_with_shared<dq_kernel<T>>(grid, STATE_THREADS, smem, stream, p);
}

}  // namespace tk::based
