// Based linear attention forward, v2: the running state lives in registers.
//
// One block = 8 warps walks the sequence of one (batch, head) for 64 of its value columns
// (Dv = 128 takes two blocks), in chunks of 64 tokens. The state S [288 features x 64 columns]
// (273 Taylor features padded to 18 tiles of 16, see features.cuh) is split over the warps so
// that no warp ever needs another's state: warp w = (column group cg = w % 4, feature half
// fh = w / 4) owns columns C = [16 cg, 16 cg + 16) of 9 feature tiles,
//   fh = 0: second-order tiles a = 0..7 (features x_a x_b, b = 0..15) and the first-order tile
//   fh = 1: second-order tiles a = 8..15 and the constant tile,
// each held transposed, S_f^T [16 columns x 16 features], as an fp32 mma accumulator (72
// registers a lane). Transposed because then both products with the state need no shuffle:
//   update   S_f^T += V_C^T Phi_f(K)    A = V_C^T is V's col-layout fragment, reinterpreted
//   output   y_C   += Phi_f(Q) S_f      B = S_f is S_f^T's accumulator, rounded to bf16
// The feature map's constants are powers of two (phi(q).phi(k) = 1 + q.k/4 + (q.k)^2/32), so
// the tiles hold plain sums (sum_j k_ja k_jb v_j / 32, sum_j k_j v_j, sum_j v_j) and the
// constants are applied exactly: the 1/32 with k_a in the update, the 1/4 when rounding.
//
// Per chunk (t0 = its first token), with Q, K, V in shared memory:
//   1. each warp: its partial y_C over its 9 feature tiles for all 64 rows (4 row tiles);
//      the partial of the row tiles the other feature half finishes goes to shared memory.
//      Each warp also computes one of two parts of phi(q) . z (the normaliser's state term) of
//      one row tile, with one mma (vector_state in register_state.cuh).
//   2. each warp finishes 2 row tiles (fh = 0: rows 0-15 and 48-63, fh = 1: rows 16-47) of its columns:
//      the intra-chunk term tril(1 + s + s^2/2) V_C with s = Q K^T / 4, the other half's
//      partial, the normaliser, then y straight to global memory.
//   3. each warp folds the chunk into its state tiles and its copy of z (exact, from K^T K).
// 16-bit operands: phi(Q) and the rounded state are bf16 even for fp16 inputs (state entries
// grow with the sequence and would overflow fp16); everything else is in the input type, every
// sum fp32.
//
// Parallelism: batch * heads * (Dv / 64) blocks of 8 warps; the state takes most of the
// registers, so one block per SM (the Python side splits long sequences of few heads into
// groups, see tk_jax/_sequence_split.py).
#pragma once

#include "register_state.cuh"

namespace tk::based {

using namespace kittens;

constexpr int FWD_WARPS = STATE_WARPS;
constexpr int FWD_THREADS = STATE_THREADS;

template <typename T>
struct forward_shared {
  st<T, CHUNK, FEATURE_DIM> q[2], k[2];  // double-buffered chunks
  st<T, CHUNK, V_BLOCK> v[2];
  float den_state[2][CHUNK];             // phi(q_t) . z of the chunk's rows, in two parts
  // Partial y handed from one feature half to the other: [warp][row tile][lane][8 floats],
  // written and read in fragment order (same lane both sides), so with 16-byte accesses.
  float4 partial[FWD_WARPS][2][WARP_THREADS][2];
};

// The forward's power of two that turns a tile into the one phi(q) multiplies.
__device__ __forceinline__ float tile_scale(int own, int fh) { return own < 8 ? 1.f : fh == 0 ? 0.25f : 1.f; }

template <typename T>
__global__ void __launch_bounds__(FWD_THREADS, 1) forward_kernel(const __grid_constant__ ForwardParams p) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<forward_shared<T>>(smem_raw);

  const int v_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int v0 = v_block * V_BLOCK;  // this block's first value column
  const int warp = warpid(), lane = laneid();
  const int cg = warp % 4, fh = warp / 4;
  const int c0 = 16 * cg;            // this warp's first column inside the block
  const int64_t head = int64_t(b) * p.heads + h;

  const auto Q = gl<T>::contiguous((T*)p.q, p.batch, p.seq, p.heads, FEATURE_DIM);
  const auto K = gl<T>::contiguous((T*)p.k, p.batch, p.seq, p.heads, FEATURE_DIM);
  // Views of this block's 64 columns (V) and this warp's 16 columns (Y) of [batch, seq, heads, Dv].
  const int64_t seq_stride = int64_t(p.heads) * p.value_dim, batch_stride = int64_t(p.seq) * seq_stride;
  const gl<T> V{(T*)p.v + v0, p.batch, p.seq, p.heads, V_BLOCK, batch_stride, seq_stride, p.value_dim};
  const gl<T> Y{(T*)p.y + v0 + c0, p.batch, p.seq, p.heads, 16, batch_stride, seq_stride, p.value_dim};

  load_async<FWD_THREADS>(s.q[0], Q, {b, h, 0});
  load_async<FWD_THREADS>(s.k[0], K, {b, h, 0});
  load_async<FWD_THREADS>(s.v[0], V, {b, h, 0});
  cp_async_commit();

  // The state tiles from S0 (external order, scaled back to unscaled sums).
  rt_base<float, layout::row> state[OWN_TILES];
  const float* state0 = p.state0 + head * NUM_FEATURES * p.value_dim + v0 + c0;
#pragma unroll
  for (int i = 0; i < OWN_TILES; i++) {
    const float unscale = 1.f / external_scale(i, fh);
#pragma unroll
    for (int r = 0; r < 4; r++) {  // element (column fragment_row(r), feature fragment_col(r, j))
      float pair[2];
#pragma unroll
      for (int j = 0; j < 2; j++) {
        const int f = external_feature(i, fh, fragment_col(r, j));
        pair[j] = f < 0 ? 0.f : state0[int64_t(f) * p.value_dim + fragment_row(r)] * unscale;
      }
      state[i].data[r] = make_float2(pair[0], pair[1]);
    }
  }
  vector_state z;  // the normaliser's state, a copy per warp
  z.load(p.z0 + head * NUM_FEATURES);

  // Row tiles in this warp's order: the two it finishes, then the two it hands over.
  int row_tile[ROW_TILES];
  row_tiles_of_half(row_tile, fh);

  const int num_chunks = (p.seq + CHUNK - 1) / CHUNK;
  for (int chunk = 0; chunk < num_chunks; chunk++) {
    const int stage = chunk & 1, t0 = chunk * CHUNK;
    const int real_tokens = min(CHUNK, p.seq - t0);
    cp_async_wait<0>();
    __syncthreads();  // the chunk is visible to all, and every warp is done with the last one
    if (chunk + 1 < num_chunks) {  // prefetch into the stage the last chunk used
      load_async<FWD_THREADS>(s.q[stage ^ 1], Q, {b, h, t0 + CHUNK});
      load_async<FWD_THREADS>(s.k[stage ^ 1], K, {b, h, t0 + CHUNK});
      load_async<FWD_THREADS>(s.v[stage ^ 1], V, {b, h, t0 + CHUNK});
      cp_async_commit();
    }

    // 1. Partial y over this warp's feature tiles, all four row tiles.
    rt<T, 16, FEATURE_DIM> q[ROW_TILES];
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) load(q[i], s.q[stage], 16 * row_tile[i], 0);
    rt_fl<16, 16> y[ROW_TILES];
#pragma unroll
    for (int i = 0; i < ROW_TILES; i++) zero(y[i]);
#pragma unroll
    for (int j = 0; j < 4; j++) {  // second-order tiles in pairs (one shuffle serves both)
      const auto s_op0 = state_operand(state[2 * j], 1.f), s_op1 = state_operand(state[2 * j + 1], 1.f);
#pragma unroll
      for (int i = 0; i < ROW_TILES; i++) {
        rt_base<bf16, layout::row> phi0, phi1;
        scale_by_column_pair(phi0, phi1, q[i].tiles[0][0], q[i].tiles[0][0], j, fh);
        detail::mma_base(y[i].tiles[0][0], phi0, s_op0);
        detail::mma_base(y[i].tiles[0][0], phi1, s_op1);
      }
    }
    {
      const auto s_op = state_operand(state[8], tile_scale(8, fh));
#pragma unroll
      for (int i = 0; i < ROW_TILES; i++) detail::mma_base(y[i].tiles[0][0], phi_q_last(q[i].tiles[0][0], fh), s_op);
    }
#pragma unroll
    for (int i = 2; i < ROW_TILES; i++) put_fragment(s.partial[warp][i - 2], y[i].tiles[0][0]);
    // phi(q) . z for finished row tile cg & 1, part cg >> 1 (vector_state::normaliser_part).
    {
      rt_base<T, layout::row> q_tile;
#pragma unroll
      for (int r = 0; r < 4; r++) q_tile.data[r] = (cg & 1) ? q[1].tiles[0][0].data[r] : q[0].tiles[0][0].data[r];
      const float2 den = z.normaliser_part(q_tile, cg >> 1);
      const int row = 16 * ((cg & 1) ? row_tile[1] : row_tile[0]) + (lane >> 2);
      if ((lane & 3) == 0) {
        s.den_state[cg >> 1][row] = den.x;
        s.den_state[cg >> 1][row + 8] = den.y;
      }
    }

    // 2a. The intra-chunk term of this warp's two row tiles: weights 1 + s + s^2/2 with
    // s = q.k / 4, i.e. 1 + x/4 + x^2/32 for x = q.k, over the keys up to the row (key tiles
    // past the diagonal are skipped; only the diagonal tile and a sequence tail need masks).
    rt<T, CHUNK, 16, layout::col> v_c;  // V_C [64 tokens x 16 columns] as a B operand
    load(v_c, s.v[stage], 0, c0);
    const uint32_t ones = bits(pack<T>(1.f, 1.f));
    row_vec<16> den[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int m = row_tile[i];
      float2 weight_sum[2] = {{0.f, 0.f}, {0.f, 0.f}};  // rows g, g + 8 (every column the same)
#pragma unroll
      for (int kt = 0; kt < ROW_TILES; kt++)
        if (kt <= m) {
          rt<T, 16, FEATURE_DIM> k;
          load(k, s.k[stage], 16 * kt, 0);
          rt_fl<16, 16> w;
          zero(w);
          detail::mma_base(w.tiles[0][0], q[i].tiles[0][0], k.tiles[0][0]);
          map(w, [](float x) { return fmaf(x, fmaf(x, 1.f / 32, 0.25f), 1.f); });
          if (kt == m || real_tokens < CHUNK)
            for_each(w, [&](float& x, int r, int key) {
              if (16 * kt + key > 16 * m + r || 16 * kt + key >= real_tokens) x = 0.f;
            });
          // The tensor cores see the weights rounded to 16 bits; the normaliser sums the same
          // rounded values (an mma with a column of ones), so that y is exactly a weighted
          // mean (y = v when one key is visible).
          rt<T, 16, 16> w16;
          copy(w16, w);
          detail::mma_base(y[i].tiles[0][0], w16.tiles[0][0], v_c.tiles[kt][0]);
          detail::mma_16816(weight_sum[0], weight_sum[1], w16.tiles[0][0], ones, ones);
        }
      den[i].data[0][0] = weight_sum[0].x;
      den[i].data[0][1] = weight_sum[1].x;
    }
    __syncthreads();  // partials and phi(q) . z are in shared memory

    // 2b. Finish rows: add the other half's partial, normalise, store.
    const int partner = warp ^ 4;  // same columns, other feature half
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int row0 = 16 * row_tile[i];
#pragma unroll
      for (int half = 0; half < 2; half++) {
        const float4 x = s.partial[partner][i][lane][half];
        float2& lo = y[i].tiles[0][0].data[2 * half];
        float2& hi = y[i].tiles[0][0].data[2 * half + 1];
        lo.x += x.x, lo.y += x.y, hi.x += x.z, hi.y += x.w;
      }
#pragma unroll
      for (int hh = 0; hh < 2; hh++) {
        const int r = row0 + (lane >> 2) + 8 * hh;
        den[i].data[0][hh] += s.den_state[0][r] + s.den_state[1][r];
      }
      if (v_block == 0 && cg == 0 && (lane & 3) == 0)  // the backward's residual
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
          const int t = t0 + row0 + (lane >> 2) + 8 * hh;
          if (t < p.seq) p.den[head * p.seq + t] = den[i].data[0][hh];
        }
      if (p.normalize) {
        const float eps = p.eps;
        map(den[i], [=](float d) { return 1.f / (d + eps); });
        mul_row(y[i], den[i]);
      }
      store(Y, y[i], {b, h, t0 + row0});
    }

    // 3. Fold the chunk into the state: S_f^T += V_C^T Phi_f(K), 16 tokens at a time.
#pragma unroll
    for (int kt = 0; kt < ROW_TILES; kt++) {
      rt<T, 16, FEATURE_DIM, layout::col> kc;
      load(kc, s.k[stage], 16 * kt, 0);
      rt_base<T, layout::col> kc32;
#pragma unroll
      for (int r = 0; r < 4; r++) kc32.data[r] = __hmul2(kc.tiles[0][0].data[r], pack<T>(1.f / 32, 1.f / 32));
      const auto& v_t = reinterpret_cast<const rt_base<T, layout::row>&>(v_c.tiles[kt][0]);  // V_C^T
      z.add(kc.tiles[0][0], min(16, max(0, real_tokens - 16 * kt)));
#pragma unroll
      for (int own = 0; own < OWN_TILES; own++)
        detail::mma_base(state[own], v_t, phi_k_tile(kc.tiles[0][0], kc32, own, fh));
    }
  }

  // The final state, back in the external order and scale.
  float* state_out = p.state + head * NUM_FEATURES * p.value_dim + v0 + c0;
#pragma unroll
  for (int i = 0; i < OWN_TILES; i++) {
    const float scale = external_scale(i, fh);
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int j = 0; j < 2; j++) {
        const int f = external_feature(i, fh, fragment_col(r, j));
        if (f >= 0) state_out[int64_t(f) * p.value_dim + fragment_row(r)] = (j ? state[i].data[r].y : state[i].data[r].x) * scale;
      }
  }
  if (v_block == 0 && warp == 0) z.store(p.z + head * NUM_FEATURES);  // z is the same for every block and warp
}

template <typename T>
cudaError_t launch_forward(const ForwardParams& p, cudaStream_t stream) {
  const int smem = int(sizeof(forward_shared<T>)) + 1024;
  const dim3 grid(p.value_dim / V_BLOCK, p.heads, p.batch);
  return launch_with_shared<forward_kernel<T>>(grid, FWD_THREADS, smem, stream, p);
}

}  // namespace tk::based
