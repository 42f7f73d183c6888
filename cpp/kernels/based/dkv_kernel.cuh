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
// gives); the dv product needs R_f, which movmatrix makes from the rounded tile. The
// second-order R is symmetric (phi_ab = phi_ba): dS is symmetrised when read and its
// antisymmetric part added back to dS0 at the end. Tiles hold sums / 32 (second order) as in
// register_state.cuh, so dv needs no constants and dk_j = 2 sum_a (v_j k_j[a]) R_a^T + ...
#pragma once

#include "register_state.cuh"

namespace tk::based {

using namespace kittens;

template <typename T>
struct dkv_shared : backward_chunks<T> {
  // dk parts [warp][row tile] and the r term's [feature half][row tile]; dv partials handed
  // from one feature half to the other [warp][finished tile]. All in fragment order.
  float4 parts[STATE_WARPS][ROW_TILES][WARP_THREADS][2];
  float4 vector_parts[2][ROW_TILES][WARP_THREADS][2];
  float4 dv_partial[STATE_WARPS][2][WARP_THREADS][2];
};

// The 16 x 16 transpose of a row-layout bf16 fragment (movmatrix per 8 x 8 block): the
// row-layout fragment of X^T, i.e. the col-layout fragment of X.
__device__ __forceinline__ rt_base<bf16, layout::col> transposed(const rt_base<bf16, layout::row>& x) {
  const auto trans = [](bf16_2 v) {
    uint32_t in = bits(v), out;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(out) : "r"(in));
    return from_bits<bf16_2>(out);
  };
  rt_base<bf16, layout::col> out;
  out.data[0] = trans(x.data[0]);
  out.data[1] = trans(x.data[2]);
  out.data[2] = trans(x.data[1]);
  out.data[3] = trans(x.data[3]);
  return out;
}

// A col-layout fragment of 16 tokens (k) x 16 columns, each token's row times its factor (tokens
// 2c, 2c + 1 in data[0] / data[1] with factors lo, tokens 2c + 8, 2c + 9 in data[2] / data[3]
// with factors hi), in bf16.
template <typename T>
__device__ __forceinline__ rt_base<bf16, layout::col> rows_scaled(const rt_base<T, layout::col>& x, float2 lo, float2 hi) {
  rt_base<bf16, layout::col> out;
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const float2 v = unpack(x.data[r]), f = r < 2 ? lo : hi;
    out.data[r] = pack<bf16>(v.x * f.x, v.y * f.y);
  }
  return out;
}

template <typename T>
__global__ void __launch_bounds__(STATE_THREADS, 1) dkv_kernel(const __grid_constant__ BackwardParams p) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<dkv_shared<T>>(smem_raw);

  const int v_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int v0 = v_block * V_BLOCK;
  const int warp = warpid(), lane = laneid();
  const int cg = warp % 4, fh = warp / 4;
  const int c0 = 16 * cg;
  const int64_t head = int64_t(b) * p.heads + h;
  const bool ones_column = v_block == 0;

  const auto Q = gl<T>::contiguous((T*)p.q, p.batch, p.seq, p.heads, FEATURE_DIM);
  const auto K = gl<T>::contiguous((T*)p.k, p.batch, p.seq, p.heads, FEATURE_DIM);
  const int64_t seq_stride = int64_t(p.heads) * p.value_dim, batch_stride = int64_t(p.seq) * seq_stride;
  const gl<T> V{(T*)p.v + v0, p.batch, p.seq, p.heads, V_BLOCK, batch_stride, seq_stride, p.value_dim};
  const gl<T> DY{(T*)p.dy + v0, p.batch, p.seq, p.heads, V_BLOCK, batch_stride, seq_stride, p.value_dim};
  const gl<T> DV{(T*)p.dv + v0 + c0, p.batch, p.seq, p.heads, 16, batch_stride, seq_stride, p.value_dim};
  const auto load_chunk = [&](int stage, int t0) {
    load_async<STATE_THREADS>(s.q[stage], Q, {b, h, t0});
    load_async<STATE_THREADS>(s.k[stage], K, {b, h, t0});
    load_async<STATE_THREADS>(s.v[stage], V, {b, h, t0});
    load_async<STATE_THREADS>(s.dy[stage], DY, {b, h, t0});
    load_row_stats_async(s.inv_den[stage], p.inv_den + head * p.seq + t0, p.seq - t0);
    load_row_stats_async(s.dden[stage], p.dden + head * p.seq + t0, p.seq - t0);
    cp_async_commit();
  };
  const int num_chunks = (p.seq + CHUNK - 1) / CHUNK;
  load_chunk(0, (num_chunks - 1) * CHUNK);

  // R from dS, the second order symmetrised, in the scale the tiles keep.
  rt_base<float, layout::row> state[OWN_TILES];
  const float* d_state = p.d_state + head * NUM_FEATURES * p.value_dim + v0 + c0;
  load_symmetrised_state(state, d_state, p, fh);

  // The column of ones of R' (used by ones_column blocks): r = dz + sum_{t >= j} phi(q_t) dden_t
  // as a vector_state (a copy per warp), its second order symmetrised like dS.
  vector_state r;
  if (ones_column) r.load(p.d_z + head * NUM_FEATURES, true);

  int row_tile[ROW_TILES];  // key tiles; the causal work of tile m is 4 - m query tiles
  row_tiles_of_half(row_tile, fh);

  for (int step = 0; step < num_chunks; step++) {
    const int chunk = num_chunks - 1 - step;
    const int stage = step & 1, t0 = chunk * CHUNK;
    const int real_tokens = min(CHUNK, p.seq - t0);
    cp_async_wait<0>();
    __syncthreads();  // the chunk is visible to all, and every warp is done with the last one
    if (chunk > 0) load_chunk(stage ^ 1, t0 - CHUNK);
    const float* inv_den = s.inv_den[stage];
    const float* dden = s.dden[stage];

    // 1. Through the later chunks, for all row tiles (keys) j:
    //    dv_i = sum_f phi_f(K_i) R_f (this warp's feature tiles: a partial over features),
    //    dk_i = 2 sum_a (V_i k_a) R_a^T + V_i R_lin^T / 4 (this warp's columns: a partial).
    rt_fl<16, 16> dv[ROW_TILES], dk[ROW_TILES];
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) zero(dv[i]), zero(dk[i]);
    {
      // K and V tiles are reloaded per use (ldmatrix is cheap; registers are not).
      const auto k_tile = [&](int i) {
        rt<T, 16, FEATURE_DIM> x;
        load(x, s.k[stage], 16 * row_tile[i], 0);
        return x.tiles[0][0];
      };
      const auto v_tile = [&](int i) {
        rt<T, 16, FEATURE_DIM> x;
        load(x, s.v[stage], 16 * row_tile[i], c0);
        return x.tiles[0][0];
      };
#pragma unroll
      for (int j = 0; j < 4; j++) {  // second-order tiles in pairs
        rt_base<bf16, layout::row> r0, r1;  // R_a, R_{a+1} rounded (row layout: feature x column)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          r0.data[e] = pack<bf16>(state[2 * j].data[e].x, state[2 * j].data[e].y);
          r1.data[e] = pack<bf16>(state[2 * j + 1].data[e].x, state[2 * j + 1].data[e].y);
        }
        const auto dv_op0 = transposed(r0), dv_op1 = transposed(r1);  // R_a as (k = feature, n = column)
        const auto dk_op0 = reinterpret_cast<const rt_base<bf16, layout::col>&>(r0);  // R_a^T
        const auto dk_op1 = reinterpret_cast<const rt_base<bf16, layout::col>&>(r1);
#pragma unroll
        for (int i = 0; i < ROW_TILES; i++) {
          rt_base<bf16, layout::row> a0, a1;
          const auto k = k_tile(i);
          scale_by_column_pair(a0, a1, k, k, j, fh);  // phi(K) tiles
          detail::mma_base(dv[i].tiles[0][0], a0, dv_op0);
          detail::mma_base(dv[i].tiles[0][0], a1, dv_op1);
          scale_by_column_pair(a0, a1, v_tile(i), k, j, fh);  // V k_a
          detail::mma_base(dk[i].tiles[0][0], a0, dk_op0);
          detail::mma_base(dk[i].tiles[0][0], a1, dk_op1);
        }
      }
      {  // the last tile: first order (dv and dk) or constant (dv only)
        rt_base<bf16, layout::row> r8;  // (k/2) . (R_lin / 2) for the first order, 1 . R_const
        const float dv_scale = fh == 0 ? 0.25f : 1.f;
#pragma unroll
        for (int e = 0; e < 4; e++) r8.data[e] = pack<bf16>(state[8].data[e].x * dv_scale, state[8].data[e].y * dv_scale);
        const auto dv_op = transposed(r8);
        const auto dk_op = state_operand(state[8], 1.f / 8);
#pragma unroll
        for (int i = 0; i < ROW_TILES; i++) {
          detail::mma_base(dv[i].tiles[0][0], phi_q_last(k_tile(i), fh), dv_op);
          if (fh == 0) detail::mma_base(dk[i].tiles[0][0], to_bf16(v_tile(i)), dk_op);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) mul(dk[i], 2.f);
#pragma unroll
    for (int i = 2; i < ROW_TILES; i++) put_fragment(s.dv_partial[warp][i - 2], dv[i].tiles[0][0]);

    // 2. The column of ones: dk_j += J_phi(k_j)^T r, one of its two parts
    //    (vector_state::gradient_part) per warp: row tile cg, part fh.
    if (ones_column) {
      rt<T, 16, FEATURE_DIM> k;
      load(k, s.k[stage], 16 * cg, 0);
      put_fragment(s.vector_parts[fh][cg], r.gradient_part(k.tiles[0][0], fh));
    }

    // 3. Inside the chunk, for this warp's two key tiles m and the query tiles qt >= m:
    //    x = k . q, A^T = 1 + x/4 + x^2/32 and (1 + s) / 4 = 1/4 + x/16 on t >= j. Only the
    //    diagonal tile and a tail need masks.
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int m = row_tile[i];
      rt<T, 16, FEATURE_DIM> k, v;
      load(k, s.k[stage], 16 * m, 0);
      load(v, s.v[stage], 16 * m, c0);
#pragma unroll
      for (int qt = 0; qt < ROW_TILES; qt++)
        if (qt >= m) {
          rt<T, 16, FEATURE_DIM> q, dy;
          load(q, s.q[stage], 16 * qt, 0);
          load(dy, s.dy[stage], 16 * qt, c0);
          rt_fl<16, 16> x, ds;
          zero(x);
          zero(ds);
          detail::mma_base(x.tiles[0][0], k.tiles[0][0], q.tiles[0][0]);    // K Q^T [key x query]
          detail::mma_base(ds.tiles[0][0], v.tiles[0][0], dy.tiles[0][0]);  // V dy^T, this warp's columns
          const bool masked = qt == m || real_tokens < CHUNK;
          const auto mask = [&](rt_fl<16, 16>& t) {
            for_each(t, [&](float& a, int r, int query) {
              if (16 * qt + query < 16 * m + r || 16 * qt + query >= real_tokens) a = 0.f;
            });
          };
          // The factors of this lane's query columns 2c, 2c + 1 (lo) and 2c + 8, 2c + 9 (hi).
          const float* col_inv = inv_den + 16 * qt + 2 * (lane & 3);
          const float2 inv_lo = *reinterpret_cast<const float2*>(col_inv);
          const float2 inv_hi = *reinterpret_cast<const float2*>(col_inv + 8);
          // dv += A^T dnum (dnum = dy inv_den, rounded to bf16 like the weights).
          rt_fl<16, 16> w = x;
          map(w, [](float a) { return fmaf(a, fmaf(a, 1.f / 32, 0.25f), 1.f); });
          if (masked) mask(w);
          rt<bf16, 16, 16> w16;
          copy(w16, w);
          rt<T, 16, FEATURE_DIM, layout::col> dy_col;
          load(dy_col, s.dy[stage], 16 * qt, c0);
          detail::mma_base(dv[i].tiles[0][0], w16.tiles[0][0], rows_scaled(dy_col.tiles[0][0], inv_lo, inv_hi));
          // dk += ds^T Q, ds^T a per-column-group part of a cancelling sum: bf16 high + low.
          float2 dden_lo = make_float2(0.f, 0.f), dden_hi = dden_lo;
          if (ones_column && cg == 0) {
            const float* col_dden = dden + 16 * qt + 2 * (lane & 3);
            dden_lo = *reinterpret_cast<const float2*>(col_dden);
            dden_hi = *reinterpret_cast<const float2*>(col_dden + 8);
          }
          scale_shift_columns(ds.tiles[0][0], inv_lo, inv_hi, dden_lo, dden_hi);
          map(x, [](float a) { return 0.25f + a / 16; });
          mul(ds, x);
          if (masked) mask(ds);
          rt_base<bf16, layout::row> ds_hi, ds_lo;
          split_bf16(ds.tiles[0][0], ds_hi, ds_lo);
          rt<T, 16, FEATURE_DIM, layout::col> q_col;  // Q [16 queries x 16 features] as a B operand
          load(q_col, s.q[stage], 16 * qt, 0);
          const auto qb = to_bf16(q_col.tiles[0][0]);
          detail::mma_base(dk[i].tiles[0][0], ds_hi, qb);
          detail::mma_base(dk[i].tiles[0][0], ds_lo, qb);
        }
    }
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) put_fragment(s.parts[warp][row_tile[i]], dk[i].tiles[0][0]);
    __syncthreads();  // dk parts, the r term and dv partials are in shared memory; r was read

    // 4. dv of this warp's two key tiles: add the other half's partial, store.
    const int partner = warp ^ 4;
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
      for (int half = 0; half < 2; half++) {
        const float4 x = s.dv_partial[partner][i][lane][half];
        float2& lo = dv[i].tiles[0][0].data[2 * half];
        float2& hi = dv[i].tiles[0][0].data[2 * half + 1];
        lo.x += x.x, lo.y += x.y, hi.x += x.z, hi.y += x.w;
      }
      store(DV, dv[i], {b, h, t0 + 16 * row_tile[i]});
    }

    // 5. dk of the chunk: the parts summed, to this column block's slice of dk_parts.
    store_summed_parts(p.dk_parts, s.parts, s.vector_parts, ones_column, p, b, h, v_block, t0);

    // 6. R += Phi(Q)^T dnum_C, 16 queries at a time (bf16: dnum is far below fp16's range).
#pragma unroll 1
    for (int qt = 0; qt < ROW_TILES; qt++) {
      rt<T, 16, FEATURE_DIM, layout::col> qc, dy_col;
      load(qc, s.q[stage], 16 * qt, 0);
      load(dy_col, s.dy[stage], 16 * qt, c0);
      const float* col_inv = inv_den + 16 * qt + 2 * (lane & 3);
      const auto dnum = rows_scaled(dy_col.tiles[0][0], *reinterpret_cast<const float2*>(col_inv),
                                    *reinterpret_cast<const float2*>(col_inv + 8));
      if (ones_column) {
        const float* col_dden = dden + 16 * qt + 2 * (lane & 3);
        r.add_weighted(qc.tiles[0][0], *reinterpret_cast<const float2*>(col_dden),
                       *reinterpret_cast<const float2*>(col_dden + 8));
      }
      rt_base<T, layout::col> qc32;
#pragma unroll
      for (int e = 0; e < 4; e++) qc32.data[e] = __hmul2(qc.tiles[0][0].data[e], pack<T>(1.f / 32, 1.f / 32));
#pragma unroll
      for (int own = 0; own < OWN_TILES; own++) {
        const auto phi_t = phi_k_tile(qc.tiles[0][0], qc32, own, fh);  // Phi(Q)^T as a row-layout A
        detail::mma_base(state[own], to_bf16(reinterpret_cast<const rt_base<T, layout::row>&>(phi_t)), dnum);
      }
    }
  }

  // dS0 = R'_0 in the external order: the tiles, plus dS's antisymmetric part (second order).
  float* d_state0 = p.d_state0 + head * NUM_FEATURES * p.value_dim + v0 + c0;
#pragma unroll
  for (int i = 0; i < OWN_TILES; i++) {
    const float scale = external_scale(i, fh);
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int j = 0; j < 2; j++) {
        const int f = fragment_row(r), c = fragment_col(r, j);
        const int ext = external_feature(i, fh, f);
        if (ext < 0) continue;
        float x = (j ? state[i].data[r].y : state[i].data[r].x) * scale;
        if (i < 8)
          x += 0.5f * (d_state[int64_t(ext) * p.value_dim + c] -
                       d_state[int64_t(17 + 16 * f + 8 * fh + i) * p.value_dim + c]);
        d_state0[int64_t(ext) * p.value_dim + c] = x;
      }
  }
  if (ones_column && warp == 0) r.store(p.d_z0 + head * NUM_FEATURES, p.d_z + head * NUM_FEATURES);
}

template <typename T>
cudaError_t launch_dkv(const BackwardParams& p, cudaStream_t stream) {
  const int smem = int(sizeof(dkv_shared<T>)) + 1024;
  const dim3 grid(p.value_dim / V_BLOCK, p.heads, p.batch);
  return launch_with_shared<dkv_kernel<T>>(grid, STATE_THREADS, smem, stream, p);
}

}  // namespace tk::based
