// Based backward, the dq sweep, with the state in registers (the forward's organisation, see
// register_state.cuh and forward_kernel.cuh).
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

#include "register_state.cuh"

namespace tk::based {

using namespace kittens;

template <typename T>
struct dq_shared : backward_chunks<T> {
  // dq parts: [warp][row tile][lane][8 floats] from the state and intra-chunk terms, and
  // [feature half][row tile][lane][8 floats] from the normaliser column, in fragment order.
  float4 parts[STATE_WARPS][ROW_TILES][WARP_THREADS][2];
  float4 normaliser_parts[2][ROW_TILES][WARP_THREADS][2];
};

template <typename T>
__global__ void __launch_bounds__(STATE_THREADS, 1) dq_kernel(const __grid_constant__ BackwardParams p) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<dq_shared<T>>(smem_raw);

  const int v_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int v0 = v_block * V_BLOCK;
  const int warp = warpid(), lane = laneid();
  const int cg = warp % 4, fh = warp / 4;
  const int c0 = 16 * cg;
  const int64_t head = int64_t(b) * p.heads + h;
  const bool ones_column = v_block == 0;  // this block also handles the column of v' that is 1

  const auto Q = gl<T>::contiguous((T*)p.q, p.batch, p.seq, p.heads, FEATURE_DIM);
  const auto K = gl<T>::contiguous((T*)p.k, p.batch, p.seq, p.heads, FEATURE_DIM);
  const int64_t seq_stride = int64_t(p.heads) * p.value_dim, batch_stride = int64_t(p.seq) * seq_stride;
  const gl<T> V{(T*)p.v + v0, p.batch, p.seq, p.heads, V_BLOCK, batch_stride, seq_stride, p.value_dim};
  const gl<T> DY{(T*)p.dy + v0, p.batch, p.seq, p.heads, V_BLOCK, batch_stride, seq_stride, p.value_dim};
  const auto load_chunk = [&](int stage, int t0) {
    load_async<STATE_THREADS>(s.q[stage], Q, {b, h, t0});
    load_async<STATE_THREADS>(s.k[stage], K, {b, h, t0});
    load_async<STATE_THREADS>(s.v[stage], V, {b, h, t0});
    load_async<STATE_THREADS>(s.dy[stage], DY, {b, h, t0});
    load_row_stats_async(s.inv_den[stage], p.inv_den + head * p.seq + t0, p.seq - t0);
    load_row_stats_async(s.dden[stage], p.dden + head * p.seq + t0, p.seq - t0);
    cp_async_commit();
  };
  load_chunk(0, 0);

  // The state tiles from S0, symmetrised, in the scale the tiles keep (see register_state.cuh).
  rt_base<float, layout::row> state[OWN_TILES];
  load_symmetrised_state(state, p.state0 + head * NUM_FEATURES * p.value_dim + v0 + c0, p, fh);
  vector_state z;  // the normaliser's state column, symmetrised like S0 (used by ones_column blocks)
  if (ones_column) z.load(p.z0 + head * NUM_FEATURES, true);

  // Row tiles in this warp's order: the two whose intra-chunk term it adds, then the others.
  int row_tile[ROW_TILES];
  row_tiles_of_half(row_tile, fh);

  const int num_chunks = (p.seq + CHUNK - 1) / CHUNK;
  for (int chunk = 0; chunk < num_chunks; chunk++) {
    const int stage = chunk & 1, t0 = chunk * CHUNK;
    const int real_tokens = min(CHUNK, p.seq - t0);
    cp_async_wait<0>();
    __syncthreads();  // the chunk is visible to all, and every warp is done with the last one
    if (chunk + 1 < num_chunks) load_chunk(stage ^ 1, t0 + CHUNK);
    const float* inv_den = s.inv_den[stage];
    const float* dden = s.dden[stage];

    // 1. Through the state: acc_i = sum_a (dy q_a) P_a^T + dy P_lin^T / 8, for all row tiles,
    //    then times 2 inv_den per row.
    rt_fl<16, 16> acc[ROW_TILES];
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) zero(acc[i]);
    {
      rt<T, 16, FEATURE_DIM> q[ROW_TILES], dy[ROW_TILES];
#pragma unroll
      for (int i = 0; i < ROW_TILES; i++) {
        load(q[i], s.q[stage], 16 * row_tile[i], 0);
        load(dy[i], s.dy[stage], 16 * row_tile[i], c0);
      }
#pragma unroll
      for (int j = 0; j < 4; j++) {  // second-order tiles in pairs (one shuffle serves both)
        const auto s_op0 = state_operand(state[2 * j], 1.f), s_op1 = state_operand(state[2 * j + 1], 1.f);
#pragma unroll
        for (int i = 0; i < ROW_TILES; i++) {
          rt_base<bf16, layout::row> a0, a1;
          scale_by_column_pair(a0, a1, dy[i].tiles[0][0], q[i].tiles[0][0], j, fh);
          detail::mma_base(acc[i].tiles[0][0], a0, s_op0);
          detail::mma_base(acc[i].tiles[0][0], a1, s_op1);
        }
      }
      if (fh == 0) {  // the first-order tile (the constant tile has no gradient)
        const auto s_op = state_operand(state[8], 1.f / 8);
#pragma unroll
        for (int i = 0; i < ROW_TILES; i++) detail::mma_base(acc[i].tiles[0][0], to_bf16(dy[i].tiles[0][0]), s_op);
      }
    }
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) {
      row_vec<16> scale;
#pragma unroll
      for (int hh = 0; hh < 2; hh++) scale.data[0][hh] = 2.f * inv_den[16 * row_tile[i] + (lane >> 2) + 8 * hh];
      mul_row(acc[i], scale);
    }

    // 2. The normaliser column: dq_t += dden_t d(phi(q_t) . z)/dq_t, one of its two parts
    //    (vector_state::gradient_part) per warp: row tile cg, part fh.
    if (ones_column) {
      rt<T, 16, FEATURE_DIM> q;
      load(q, s.q[stage], 16 * cg, 0);
      auto out = z.gradient_part(q.tiles[0][0], fh);
      const int row = 16 * cg + (lane >> 2);
      scale_shift_rows(out, make_float2(dden[row], dden[row + 8]), make_float2(0.f, 0.f));
      put_fragment(s.normaliser_parts[fh][cg], out);
    }

    // 3. Inside the chunk, for this warp's two row tiles: ds = (dy v^T inv_den + dden) (1 + s) / 4
    //    over the causal keys (dy v^T over this warp's columns; dden once, by column group 0).
    //    Key tiles past the diagonal are skipped; only the diagonal tile and a tail need masks.
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int m = row_tile[i];
      rt<T, 16, FEATURE_DIM> q, dy;
      load(q, s.q[stage], 16 * m, 0);
      load(dy, s.dy[stage], 16 * m, c0);
      const int row = 16 * m + (lane >> 2);  // this lane's rows: row and row + 8
      const float2 row_scale = make_float2(inv_den[row], inv_den[row + 8]);
      const float2 row_shift = ones_column && cg == 0 ? make_float2(dden[row], dden[row + 8]) : make_float2(0.f, 0.f);
#pragma unroll
      for (int kt = 0; kt < ROW_TILES; kt++)
        if (kt <= m) {
          rt<T, 16, FEATURE_DIM> k, v;
          load(k, s.k[stage], 16 * kt, 0);
          load(v, s.v[stage], 16 * kt, c0);
          rt_fl<16, 16> qk, ds;
          zero(qk);
          zero(ds);
          detail::mma_base(qk.tiles[0][0], q.tiles[0][0], k.tiles[0][0]);
          detail::mma_base(ds.tiles[0][0], dy.tiles[0][0], v.tiles[0][0]);
          scale_shift_rows(ds.tiles[0][0], row_scale, row_shift);
          map(qk, [](float x) { return 0.25f + x / 16; });  // (1 + s) / 4 with s = q.k / 4
          mul(ds, qk);
          if (kt == m || real_tokens < CHUNK)
            for_each(ds, [&](float& x, int r, int key) {
              if (16 * kt + key > 16 * m + r || 16 * kt + key >= real_tokens) x = 0.f;
            });
          // ds is this warp's part of a sum over column groups that nearly cancels where y_t
          // hardly depends on q_t: it goes to the tensor cores as bf16 high and low parts, so
          // that its rounding (not the sum's) stays ~2^-16 of it.
          rt_base<bf16, layout::row> ds_hi, ds_lo;
          split_bf16(ds.tiles[0][0], ds_hi, ds_lo);
          rt<T, 16, FEATURE_DIM, layout::col> kc;  // K [16 keys x 16 features] as a B operand
          load(kc, s.k[stage], 16 * kt, 0);
          const auto kb = to_bf16(kc.tiles[0][0]);
          detail::mma_base(acc[i].tiles[0][0], ds_hi, kb);
          detail::mma_base(acc[i].tiles[0][0], ds_lo, kb);
        }
    }
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) put_fragment(s.parts[warp][row_tile[i]], acc[i].tiles[0][0]);
    __syncthreads();  // every part is in shared memory

    // 4. dq of the chunk: the parts summed, to this column block's [B, T, H, Dv/64, 16] slice.
    store_summed_parts(p.dq_parts, s.parts, s.normaliser_parts, ones_column, p, b, h, v_block, t0);

    // 5. Fold the chunk into the state: S_f += Phi_f(K)^T V_C, 16 tokens at a time.
#pragma unroll 1
    for (int kt = 0; kt < ROW_TILES; kt++) {
      rt<T, 16, FEATURE_DIM, layout::col> kc, v_col;
      load(kc, s.k[stage], 16 * kt, 0);
      load(v_col, s.v[stage], 16 * kt, c0);
      if (ones_column) z.add(kc.tiles[0][0], min(16, max(0, real_tokens - 16 * kt)));
      rt_base<T, layout::col> kc32;
#pragma unroll
      for (int r = 0; r < 4; r++) kc32.data[r] = __hmul2(kc.tiles[0][0].data[r], pack<T>(1.f / 32, 1.f / 32));
#pragma unroll
      for (int own = 0; own < OWN_TILES; own++) {
        if (own == 8 && fh == 1) continue;  // the constant tile: no gradient, not kept
        const auto phi_t = phi_k_tile(kc.tiles[0][0], kc32, own, fh);  // Phi(K)^T as a row-layout A
        detail::mma_base(state[own], reinterpret_cast<const rt_base<T, layout::row>&>(phi_t), v_col.tiles[0][0]);
      }
    }
  }
}

template <typename T>
cudaError_t launch_dq(const BackwardParams& p, cudaStream_t stream) {
  const int smem = int(sizeof(dq_shared<T>)) + 1024;
  const dim3 grid(p.value_dim / V_BLOCK, p.heads, p.batch);
  return launch_with_shared<dq_kernel<T>>(grid, STATE_THREADS, smem, stream, p);
}

}  // namespace tk::based
