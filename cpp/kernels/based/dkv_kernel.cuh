// Based backward, the dk/dv sweep, with the state in registers (the organisation of the forward
// and of dq_kernel.cuh).
//
// With dnum'_t = [dy_t inv_den_t, dden_t] and R'_j = [dS, dz] + sum_{t>=j} phi(q_t) dnum'_t^T:
//   dv_j = R_j^T phi(k_j)                      (a contraction over features, like the forward's y)
//   dk_j = J_phi(k_j)^T (R_j v_j + r_j)        (over columns, like dq; r = the column of ones)
//   dS0 = R'_0 (external order)
// Chunks run in reverse; R is the state after the chunk while the chunk's rows use it, then
// R += phi(Q)^T dnum. Inside a chunk (t >= j): A^T_jt = 1 + s + s^2/2 gives dv_j += A^T dnum,
// ds^T_jt = (v_j . dnum_t + dden_t) (1 + s_jt) / 4 gives dk_j += ds^T Q; both come from K Q^T,
// so nothing is transposed.
//
// Warp w = (column group cg, feature half fh) holds R_f [16 features x 16 columns] for its 9
// tiles, not transposed (the dk product needs R_f^T as its B operand, which the accumulator
// gives); the dv product needs R_f, which swap_layout (movmatrix) makes from the rounded tile.
// The second-order R is symmetric (phi_ab = phi_ba): dS is symmetrised when read and its
// antisymmetric part added back to dS0 at the end. Tiles hold sums / 32 (second order) as in
// state_tiles.cuh, so dv needs no constants and dk_j = 2 sum_a (v_j k_j[a]) R_a^T + ...
#pragma once

#include "backward_io.cuh"
#include "feature_tiles.cuh"
#include "vector_state.cuh"

namespace tk::based {

using namespace kittens;

template <typename T>
struct dkv_shared : backward_chunks<T> {
  // dk parts [warp][row tile] and the r term's [feature half][row tile]; dv partials handed
  // from one feature half to the other [warp][finished tile]. All 16 x 16 tiles in kittens'
  // fragment order.
  alignas(16) float parts[STATE_WARPS][ROW_TILES][16 * 16];
  alignas(16) float vector_parts[2][ROW_TILES][16 * 16];
  alignas(16) float dv_partial[STATE_WARPS][2][16 * 16];
};

namespace dkv_step {

// A col-layout tile of 16 tokens x 16 columns with each token's row scaled by its factor in
// `w` (a vector over the tokens), in bf16: e.g. dnum = dy inv_den.
template <typename T>
__device__ __forceinline__ rt_bf<16, 16, layout::col> rows_scaled(const rt<T, 16, 16, layout::col>& x,
                                                                  const col_vec<16>& w) {
  rt_fl<16, 16> xt;  // x^T: tokens are its columns
  copy(xt, as_transpose(x));
  map_cols(xt, w, [](float a, float f) { return a * f; });
  rt_bf<16, 16> rounded;
  copy(rounded, xt);
  return as_transpose(rounded);
}

// 1. Through the later chunks, for all row tiles (keys) i:
//    dv_i = sum_f phi_f(K_i) R_f (this warp's feature tiles: a partial over features),
//    dk_i = 2 sum_a (V_i k_a) R_a^T + V_i R_lin^T / 4 (this warp's columns: a partial).
template <typename T>
__device__ __forceinline__ void add_state_terms(rt_fl<16, 16> (&dv)[ROW_TILES], rt_fl<16, 16> (&dk)[ROW_TILES],
                                                const backward_chunks<T>& s, int stage,
                                                const rt_fl<16, 16> (&state)[OWN_TILES], const state_warp& w,
                                                const int (&row_tile)[ROW_TILES]) {
  // K and V tiles are reloaded per use (ldmatrix is cheap; registers are not).
  const auto k_tile = [&](int i) {
    rt<T, 16, 16> x;
    load(x, s.k[stage], 16 * row_tile[i], 0);
    return x;
  };
  const auto v_tile = [&](int i) {
    rt<T, 16, 16> x;
    load(x, s.v[stage], 16 * row_tile[i], w.c0);
    return x;
  };
#pragma unroll
  for (int j = 0; j < SECOND_ORDER_OWN / 2; j++) {  // second-order tiles in pairs
    rt_bf<16, 16> r0, r1;  // R_a, R_{a+1} rounded (row layout: feature x column)
    copy(r0, state[2 * j]);
    copy(r1, state[2 * j + 1]);
    rt_bf<16, 16, layout::col> dv_op0, dv_op1;  // R_a as (k = feature, n = column)
    swap_layout(dv_op0, r0);
    swap_layout(dv_op1, r1);
    const auto dk_op0 = as_transpose(r0), dk_op1 = as_transpose(r1);  // R_a^T
    const int a = second_order_row(2 * j, w.fh);
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) {
      rt_bf<16, 16> a0, a1;
      const auto k = k_tile(i);
      mul_by_columns(a0, a1, k, k, a);  // phi(K) tiles
      mma_AB(dv[i], a0, dv_op0, dv[i]);
      mma_AB(dv[i], a1, dv_op1, dv[i]);
      mul_by_columns(a0, a1, v_tile(i), k, a);  // V k_a
      mma_AB(dk[i], a0, dk_op0, dk[i]);
      mma_AB(dk[i], a1, dk_op1, dk[i]);
    }
  }
  {  // the last tile: first order (dv and dk) or constant (dv only)
    rt_fl<16, 16> r8 = state[LOW_ORDER_OWN];  // (k/2) . (R_lin / 2) for the first order, 1 . R_const
    mul(r8, w.fh == 0 ? 0.25f : 1.f);
    rt_bf<16, 16> r8_16;
    copy(r8_16, r8);
    rt_bf<16, 16, layout::col> dv_op;
    swap_layout(dv_op, r8_16);
    const auto dk_op = state_operand(state[LOW_ORDER_OWN], 1.f / 8);
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) {
      mma_AB(dv[i], phi_q_low_order(k_tile(i), w.fh), dv_op, dv[i]);
      if (w.fh == 0) {
        rt_bf<16, 16> v16;
        copy(v16, v_tile(i));
        mma_AB(dk[i], v16, dk_op, dk[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < ROW_TILES; i++) mul(dk[i], 2.f);
}

// 2. The column of ones, dk_j += J_phi(k_j)^T r: one of its two parts (vector_state::
// gradient_part) per warp, row tile cg, part fh, into shared memory.
template <typename T>
__device__ __forceinline__ void put_ones_column_term(dkv_shared<T>& s, int stage, const vector_state& r,
                                                     const state_warp& w) {
  rt<T, 16, 16> k;
  load(k, s.k[stage], 16 * w.cg, 0);
  store_fragments(s.vector_parts[w.fh][w.cg], r.gradient_part(k, w.fh));
}

// 3. Inside the chunk, for this warp's two key tiles m and the query tiles qt >= m:
//    x = k . q, A^T = 1 + x/4 + x^2/32 and (1 + s) / 4 = 1/4 + x/16 on t >= j; dv += A^T dnum,
//    dk += ds^T Q. Only the diagonal tile and a tail need masks.
template <typename T>
__device__ __forceinline__ void add_intra_chunk_terms(rt_fl<16, 16> (&dv)[ROW_TILES], rt_fl<16, 16> (&dk)[ROW_TILES],
                                                      const backward_chunks<T>& s, int stage, const state_warp& w,
                                                      const int (&row_tile)[ROW_TILES],
                                                      bool ones_column, int real_tokens) {
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const int m = row_tile[i];
    rt<T, 16, 16> k, v;
    load(k, s.k[stage], 16 * m, 0);
    load(v, s.v[stage], 16 * m, w.c0);
#pragma unroll
    for (int qt = 0; qt < ROW_TILES; qt++)
      if (qt >= m) {
        rt<T, 16, 16> q, dy;
        load(q, s.q[stage], 16 * qt, 0);
        load(dy, s.dy[stage], 16 * qt, w.c0);
        rt_fl<16, 16> x, ds;
        zero(x);
        zero(ds);
        mma_ABt(x, k, q, x);    // K Q^T [key x query]
        mma_ABt(ds, v, dy, ds);  // V dy^T, this warp's columns
        const bool masked = qt == m || real_tokens < CHUNK;
        const auto mask = [&](rt_fl<16, 16>& t) {
          for_each(t, [&](float& a, int r, int query) {
            if (16 * qt + query < 16 * m + r || 16 * qt + query >= real_tokens) a = 0.f;
          });
        };
        col_vec<16> inv_den;  // of this lane's query columns
        load(inv_den, s.inv_den[stage].data + 16 * qt);
        // dv += A^T dnum (dnum = dy inv_den, rounded to bf16 like the weights).
        rt_fl<16, 16> weights = x;
        map(weights, [](float a) { return fmaf(a, fmaf(a, 1.f / 32, 0.25f), 1.f); });
        if (masked) mask(weights);
        rt_bf<16, 16> weights16;
        copy(weights16, weights);
        rt<T, 16, 16, layout::col> dy_col;
        load(dy_col, s.dy[stage], 16 * qt, w.c0);
        mma_AB(dv[i], weights16, rows_scaled(dy_col, inv_den), dv[i]);
        // dk += ds^T Q, ds^T a per-column-group part of a cancelling sum: bf16 high + low.
        col_vec<16> dden{};
        if (ones_column && w.cg == 0) load(dden, s.dden[stage].data + 16 * qt);
        map_cols(ds, inv_den, dden, [](float a, float scale, float shift) { return fmaf(a, scale, shift); });
        map(x, [](float a) { return 0.25f + a / 16; });
        mul(ds, x);
        if (masked) mask(ds);
        add_split_product(dk[i], ds, s.q[stage], 16 * qt);
      }
  }
}

// 4. dv of this warp's two key tiles: add the other half's partial, store.
template <typename T>
__device__ __forceinline__ void finish_dv(rt_fl<16, 16> (&dv)[ROW_TILES], const dkv_shared<T>& s, const gl<T>& DV,
                                          const state_warp& w, const int (&row_tile)[ROW_TILES], int b, int h, int t0) {
  const int partner = w.warp ^ 4;
#pragma unroll
  for (int i = 0; i < 2; i++) {
    rt_fl<16, 16> other_half;
    load_fragments(other_half, s.dv_partial[partner][i]);
    add(dv[i], other_half);
    store(DV, dv[i], {b, h, t0 + 16 * row_tile[i]});
  }
}

// 6. R += Phi(Q)^T dnum_C, and the column of ones r += phi(Q)^T dden, 16 queries at a time
// (bf16: dnum is far below fp16's range).
template <typename T>
__device__ __forceinline__ void fold_chunk(rt_fl<16, 16> (&state)[OWN_TILES], vector_state& r,
                                           const backward_chunks<T>& s, int stage, const state_warp& w,
                                           bool ones_column) {
#pragma unroll 1
  for (int qt = 0; qt < ROW_TILES; qt++) {
    rt<T, 16, 16, layout::col> qc, dy_col, qc32;
    load(qc, s.q[stage], 16 * qt, 0);
    load(dy_col, s.dy[stage], 16 * qt, w.c0);
    col_vec<16> inv_den;
    load(inv_den, s.inv_den[stage].data + 16 * qt);
    const auto dnum = rows_scaled(dy_col, inv_den);
    if (ones_column) {
      col_vec<16> dden;
      load(dden, s.dden[stage].data + 16 * qt);
      r.add_weighted(qc, dden);
    }
    copy(qc32, qc);
    mul(qc32, 1.f / 32);
#pragma unroll
    for (int own = 0; own < OWN_TILES; own++) {
      rt_bf<16, 16> phi_t;  // Phi(Q)^T as an A operand
      copy(phi_t, as_transpose(phi_k_tile(qc, qc32, own, w.fh)));
      mma_AB(state[own], phi_t, dnum, state[own]);
    }
  }
}

// dS0 = R'_0 in the external order: the tiles, plus dS's antisymmetric part (second order).
__device__ __forceinline__ void store_d_state0(float* d_state0, const float* d_state, rt_fl<16, 16> (&state)[OWN_TILES],
                                               int value_dim, int fh) {
#pragma unroll
  for (int own = 0; own < OWN_TILES; own++) {
    const float scale = external_scale(own, fh);
    for_each(state[own], [&](float& x, int f, int c) {
      const int ext = external_feature(own, fh, f);
      if (ext < 0) return;
      float d = x * scale;
      if (own < SECOND_ORDER_OWN) {
        const int transposed = second_order_feature(f, second_order_row(own, fh));
        d += 0.5f * (d_state[int64_t(ext) * value_dim + c] - d_state[int64_t(transposed) * value_dim + c]);
      }
      d_state0[int64_t(ext) * value_dim + c] = d;
    });
  }
}

}  // namespace dkv_step

template <typename T>
__global__ void __launch_bounds__(STATE_THREADS, 1) dkv_kernel(const __grid_constant__ BackwardParams p) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<dkv_shared<T>>(smem_raw);
  const int v_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t head = int64_t(b) * p.heads + h;
  const state_warp w = this_state_warp();
  int row_tile[ROW_TILES];  // the chunk's key tiles in this warp's order
  row_tiles_of_half(row_tile, w.fh);
  const int v0 = v_block * V_BLOCK;
  const bool ones_column = v_block == 0;
  const gl<T> Q = feature_view<T>(p.q, p), K = feature_view<T>(p.k, p);
  const value_layout values = value_layout_of(p);
  const gl<T> V = values.columns<T>(p.v, v0, V_BLOCK), DY = values.columns<T>(p.dy, v0, V_BLOCK);
  const gl<T> DV = values.columns<T>(p.dv, v0 + w.c0, 16);  // this warp's columns
  const int64_t state_offset = head * NUM_FEATURES * p.value_dim + v0 + w.c0;  // of this warp's columns

  rt_fl<16, 16> state[OWN_TILES];   // R_f from dS, the second order symmetrised, in the scale the tiles keep
  vector_state r;                   // the column of ones of R', dz + sum_{t >= j} phi(q_t) dden_t (ones_column)
  rt_fl<16, 16> dv[ROW_TILES], dk[ROW_TILES];  // for the chunk's key tiles, in this warp's order

  const int num_chunks = (p.seq + CHUNK - 1) / CHUNK;
  load_chunk_async(s, {Q, K, V, DY}, p, b, h, 0, (num_chunks - 1) * CHUNK);
  load_symmetrised_state(state, p.d_state + state_offset, p.value_dim, w.fh);
  if (ones_column) r.load(p.d_z + head * NUM_FEATURES, true);

  for (int step = 0; step < num_chunks; step++) {
    const int chunk = num_chunks - 1 - step;
    const int stage = step & 1, t0 = chunk * CHUNK;
    const int real_tokens = min(CHUNK, p.seq - t0);
    cp_async_wait<0>();
    __syncthreads();  // the chunk is visible to all, and every warp is done with the last one
    if (chunk > 0) load_chunk_async(s, {Q, K, V, DY}, p, b, h, stage ^ 1, t0 - CHUNK);

#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) zero(dv[i]), zero(dk[i]);
    dkv_step::add_state_terms(dv, dk, s, stage, state, w, row_tile);
#pragma unroll
    for (int i = 2; i < ROW_TILES; i++) store_fragments(s.dv_partial[w.warp][i - 2], dv[i]);  // the partner's rows
    if (ones_column) dkv_step::put_ones_column_term(s, stage, r, w);
    dkv_step::add_intra_chunk_terms(dv, dk, s, stage, w, row_tile, ones_column, real_tokens);
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) store_fragments(s.parts[w.warp][row_tile[i]], dk[i]);
    __syncthreads();  // dk parts, the r term and dv partials are in shared memory; r was read

    dkv_step::finish_dv(dv, s, DV, w, row_tile, b, h, t0);
    // 5. dk of the chunk: the parts summed, to this column block's slice of dk_parts.
    store_summed_parts(p.dk_parts, s.parts, s.vector_parts, ones_column, p, b, h, v_block, t0);
    dkv_step::fold_chunk(state, r, s, stage, w, ones_column);
  }

  dkv_step::store_d_state0(p.d_state0 + state_offset, p.d_state + state_offset, state, p.value_dim, w.fh);
  if (ones_column && w.warp == 0) r.store(p.d_z0 + head * NUM_FEATURES, p.d_z + head * NUM_FEATURES);
}

template <typename T>
cudaError_t launch_dkv(const BackwardParams& p, cudaStream_t stream) {
  const int smem = int(sizeof(dkv_shared<T>)) + 1024;
  const dim3 grid(p.value_dim / V_BLOCK, p.heads, p.batch);
  return launch_with_shared<dkv_kernel<T>>(grid, STATE_THREADS, smem, stream, p);
}

}  // namespace tk::based
