// Based linear attention backward, the dk/dv sweep, on mma.sync tensor cores (the dq sweep is
// dq_kernel.cuh).
//
// The math is in based.h: with v' = [v, 1] and dnum'_t = [dy_t inv_den_t, dden_t],
//   dk, dv: dphi(k_j) = R'_j v'_j, dv_j = R_j^T phi(k_j)
//                                           R'_j = [dS, dz] + sum_{t>=j} phi(q_t) dnum'_t^T  (reverse sweep)
// and dk from dphi(k) through the Taylor map (see feature_map_grad). Inside a chunk of 64 tokens
// the terms with j and t in the same chunk come from the quadratic form instead:
//   dA_tj = dnum'_t . v'_j,  ds_tj = dA_tj (1 + s_tj) / 4 (t >= j),
//   dk_j += sum_t ds_tj q_t,  dv_j += sum_{t>=j} A_tj dnum_t.
//
// One block of 8 warps runs the sweep over the whole sequence of one (batch, head) for 64 value
// columns. The state R lives in shared memory in float32, stored [feature][column]. The column
// of v' that is 1 (the normaliser's) is handled by the blocks of the first 64 columns only,
// with a vector state r of 288 floats. dk is linear in dnum, so each column block writes its
// partial sum (float32) and the caller adds them; R'_0 is the gradient of the initial state.
//
// All tensor-core operands are bf16, also for fp16 inputs: dnum = dy / (den + eps) is far below
// fp16's normal range for long sequences, and the states would overflow it.
#pragma once

#include "features.cuh"

namespace tk::based {

using namespace kittens;

constexpr int BWD_WARPS = 8;
constexpr int BWD_THREADS = BWD_WARPS * WARP_THREADS;
constexpr int BWD_COLS = 64;          // value columns per block
constexpr int STRIPS = CHUNK / 16;    // 16-row strips per chunk; two warps share a strip
constexpr int GRAD_TILES = 17;        // feature tiles with a gradient (not the constant tile)
constexpr int HALF_GRAD_TILES = 9;    // the first warp of a strip takes tiles [0, 9), the second the rest
// Floats per state row: with a stride of 8 mod 32 the 8 rows of a fragment start 8 banks apart,
// so float2 accesses along a row are conflict-free.
constexpr int BWD_STATE_STRIDE = BWD_COLS + 8;
static_assert(BWD_WARPS == 2 * STRIPS, "two warps per 16-row strip");
static_assert(FEATURE_TILES % (BWD_WARPS / (BWD_COLS / 16)) == 0, "warp split of the state update");

template <typename T>
struct backward_shared {
  st<T, CHUNK, FEATURE_DIM> q_in[2], k_in[2];  // chunks as they arrive (double-buffered)
  st<T, CHUNK, BWD_COLS> v_in[2], dy_in[2];
  st<bf16, CHUNK, FEATURE_DIM> q, k;           // the current chunk in bf16
  st<bf16, CHUNK, BWD_COLS> v, dy, dnum;       // v, dy, and dnum = dy * inv_den
  st<bf16, CHUNK, PADDED_FEATURES> phi;        // phi(K) in the dq sweep, phi(Q) in the dk/dv sweep
  float state[PADDED_FEATURES * BWD_STATE_STRIDE];  // S or R: state[f * BWD_STATE_STRIDE + c]
  float vec_state[PADDED_FEATURES];            // z or r (the column of v' that is 1)
  float inv_den[CHUNK], dden[CHUNK];
  float grad[CHUNK * FEATURE_DIM];             // dq or dk of the chunk, summed over warps
};

// Rows [f0, f0 + 16) of the state, all 64 columns, as a bf16 row-layout tile: the B operand
// of G = X state_rows^T (the mma's k runs over value columns).
__device__ __forceinline__ void load_state_rows(rt<bf16, 16, BWD_COLS>& dst, const float* state, int f0) {
#pragma unroll
  for (int j = 0; j < dst.width; j++)
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const float2 x = *reinterpret_cast<const float2*>(state + (f0 + fragment_row(r)) * BWD_STATE_STRIDE +
                                                        16 * j + fragment_col(r, 0));
      dst.tiles[0][j].data[r] = pack<bf16>(x.x, x.y);
    }
}

// Rows [f0, f0 + 16) x columns [n0, n0 + N) of the state as a bf16 B operand (k = feature):
// the pair (f 2c..2c+1, column g) of data[0] lies in two rows, so it takes two loads.
template <int N>
__device__ __forceinline__ void load_state_cols(rt<bf16, 16, N, layout::col>& dst, const float* state, int f0,
                                                int n0) {
  const int g = laneid() >> 2, c = laneid() & 3;
#pragma unroll
  for (int j = 0; j < dst.width; j++)
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const float* p = state + (f0 + 2 * c + 8 * (r >> 1)) * BWD_STATE_STRIDE + n0 + 16 * j + g + 8 * (r & 1);
      dst.tiles[0][j].data[r] = pack<bf16>(p[0], p[BWD_STATE_STRIDE]);
    }
}

// The gradient of sum_f G[t, f] phi_f(x_t) with respect to x_t for a warp's 16 rows, where
// G = dphi(X) arrives one 16-feature tile at a time (accumulator layout). With c2 the
// second-order scale, tile a < 16 holds G[t, 16 a + b] for the feature c2 x_a x_b, so
//   dx_t[a] += c2 sum_b G[t, 16a+b] x_t[b]      and      dx_t[b] += c2 G[t, 16a+b] x_t[a];
// tile 16 holds the first-order features x_b / 2: dx_t[b] += G[t, 256 + b] / 2.
// The second kind lands in this lane's own columns b directly; the first is a sum over b that
// each lane holds a quarter of (by_row), finished by the quad in finish().
struct feature_map_grad {
  rt_fl<16, 16> dx;      // dx [16 rows x 16 features], accumulator layout
  float by_row[2][16];   // this lane's part of sum_b G[t, 16a+b] x_t[b], rows g and g + 8, per a

  __device__ __forceinline__ feature_map_grad() {
    zero(dx);
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
      for (int a = 0; a < FEATURE_DIM; a++) by_row[h][a] = 0.f;
  }

  // x: the rows as a row-layout fragment (the same positions as G's); x_rows: all 16 values
  // of this lane's rows g and g + 8. `a` must be a compile-time constant after unrolling.
  __device__ __forceinline__ void add_tile(int a, const rt_fl<16, 16>& G, const rt<bf16, 16, FEATURE_DIM>& x,
                                           const float (&x_rows)[2][FEATURE_DIM]) {
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int h = r & 1;
      const float2 gv = G.tiles[0][0].data[r];
      float2& d = dx.tiles[0][0].data[r];
      if (a < FEATURE_DIM) {
        const float2 xb = unpack(x.tiles[0][0].data[r]);
        by_row[h][a] += gv.x * xb.x + gv.y * xb.y;
        d.x += SECOND_ORDER_SCALE * gv.x * x_rows[h][a];
        d.y += SECOND_ORDER_SCALE * gv.y * x_rows[h][a];
      } else {
        d.x += FIRST_ORDER_SCALE * gv.x;
        d.y += FIRST_ORDER_SCALE * gv.y;
      }
    }
  }

  // The vector-state term w_t J(x_t)^T z for a state column z (in the internal feature order):
  //   dx_t[b] += w_t (c2 sum_a (z[16a+b] + z[16b+a]) x_t[a] + z[256 + b] / 2).
  __device__ __forceinline__ void add_vector_state(const float* z, const float (&x_rows)[2][FEATURE_DIM],
                                                   const float (&w)[2]) {
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int h = r & 1;
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int b = fragment_col(r, e);
        float sum = 0.f;
#pragma unroll
        for (int a = 0; a < FEATURE_DIM; a++) sum += (z[16 * a + b] + z[16 * b + a]) * x_rows[h][a];
        const float add = w[h] * (SECOND_ORDER_SCALE * sum + FIRST_ORDER_SCALE * z[LINEAR_FEATURES + b]);
        if (e == 0) dx.tiles[0][0].data[r].x += add;
        else dx.tiles[0][0].data[r].y += add;
      }
    }
  }

  // Adds the quad's by_row sums into the columns they belong to. Column a sits in lane
  // c = (a % 8) / 2, register 2 (a / 8) + h, element a % 2.
  __device__ __forceinline__ void finish() {
#pragma unroll
    for (int a = 0; a < FEATURE_DIM; a++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        float v = by_row[h][a];
        v += __shfl_xor_sync(0xffffffff, v, 1);
        v += __shfl_xor_sync(0xffffffff, v, 2);
        if ((laneid() & 3) == (a & 7) >> 1) {
          float2& d = dx.tiles[0][0].data[2 * (a >> 3) + h];
          if (a & 1) d.y += SECOND_ORDER_SCALE * v;
          else d.x += SECOND_ORDER_SCALE * v;
        }
      }
  }

  // Adds dx into the block's [64 x 16] float accumulator at rows row0.. (shared atomics: the
  // two warps of a strip both contribute).
  __device__ __forceinline__ void add_to(float* grad, int row0) const {
#pragma unroll
    for (int r = 0; r < 4; r++) {
      float* p = grad + (row0 + fragment_row(r)) * FEATURE_DIM + fragment_col(r, 0);
      atomicAdd(p, dx.tiles[0][0].data[r].x);
      atomicAdd(p + 1, dx.tiles[0][0].data[r].y);
    }
  }
};

// state [288 x 64] += X^T Y for X [64 tokens x 288 features] and Y [64 tokens x 64 columns]:
// the state update of a chunk. Warp w owns columns 16 (w % 4).. and feature tiles 9 (w / 4)...
__device__ __forceinline__ void add_outer_products(float* state, const st<bf16, CHUNK, PADDED_FEATURES>& x,
                                                   const st<bf16, CHUNK, BWD_COLS>& y) {
  constexpr int col_tiles = BWD_COLS / 16, tiles_per_warp = FEATURE_TILES / (BWD_WARPS / col_tiles);
  const int c0 = 16 * (warpid() % col_tiles), tile0 = tiles_per_warp * (warpid() / col_tiles);
  rt<bf16, CHUNK, 16, layout::col> y_b;
  load(y_b, y, 0, c0);
#pragma unroll 3
  for (int i = 0; i < tiles_per_warp; i++) {
    const int f0 = 16 * (tile0 + i);
    rt<bf16, 16, CHUNK> x_t;  // X^T: 16 features x 64 tokens
#pragma unroll
    for (int kt = 0; kt < CHUNK / 16; kt++) load_transposed(x_t.tiles[0][kt], x, 16 * kt, f0);
    rt_fl<16, 16> acc;
    zero(acc);
    mma_AB(acc, x_t, y_b, acc);
#pragma unroll
    for (int r = 0; r < 4; r++) {
      float2* p = reinterpret_cast<float2*>(state + (f0 + fragment_row(r)) * BWD_STATE_STRIDE + c0 + fragment_col(r, 0));
      const float2 add = acc.tiles[0][0].data[r];
      float2 cur = *p;
      cur.x += add.x;
      cur.y += add.y;
      *p = cur;
    }
  }
}

// The views of one block's inputs and outputs.
template <typename T>
struct backward_views {
  gl<T> q, k, v, dy;
  int64_t head;  // b * heads + h: index of the [batch, heads, ...] statistics and states
  int b, h, v_block, v0;

  __device__ backward_views(const BackwardParams& p, int v_block_, int h_, int b_)
      : q(gl<T>::contiguous((T*)p.q, p.batch, p.seq, p.heads, FEATURE_DIM)),
        k(gl<T>::contiguous((T*)p.k, p.batch, p.seq, p.heads, FEATURE_DIM)),
        v(column_view((T*)p.v, p, v_block_ * BWD_COLS, BWD_COLS)),
        dy(column_view((T*)p.dy, p, v_block_ * BWD_COLS, BWD_COLS)),
        head(int64_t(b_) * p.heads + h_), b(b_), h(h_), v_block(v_block_), v0(v_block_ * BWD_COLS) {}

  // Columns [col0, col0 + cols) of a [batch, seq, heads, value_dim] tensor.
  __device__ static gl<T> column_view(T* base, const BackwardParams& p, int col0, int cols) {
    const int64_t seq_stride = int64_t(p.heads) * p.value_dim;
    return gl<T>{base + col0, p.batch, p.seq, p.heads, cols, int64_t(p.seq) * seq_stride, seq_stride, p.value_dim};
  }
};

template <typename T>
__device__ __forceinline__ void load_chunk_async(backward_shared<T>& s, int stage, const backward_views<T>& in,
                                                 int t0) {
  load_async<BWD_THREADS>(s.q_in[stage], in.q, {in.b, in.h, t0});
  load_async<BWD_THREADS>(s.k_in[stage], in.k, {in.b, in.h, t0});
  load_async<BWD_THREADS>(s.v_in[stage], in.v, {in.b, in.h, t0});
  load_async<BWD_THREADS>(s.dy_in[stage], in.dy, {in.b, in.h, t0});
  cp_async_commit();
}

// The arrived chunk in bf16 (dnum = dy * inv_den), and its row statistics; rows past the
// sequence get inv_den = dden = 0, so they contribute nothing. All threads.
template <typename T>
__device__ __forceinline__ void prepare_chunk(backward_shared<T>& s, int stage, const BackwardParams& p,
                                              int64_t head, int t0, int real_tokens) {
  const float* inv_den = p.inv_den + head * p.seq + t0;
  const float* dden = p.dden + head * p.seq + t0;
  for (int t = threadIdx.x; t < CHUNK; t += BWD_THREADS) {
    s.inv_den[t] = t < real_tokens ? inv_den[t] : 0.f;
    s.dden[t] = t < real_tokens ? dden[t] : 0.f;
  }
  constexpr int feature_pairs = FEATURE_DIM / 2, column_pairs = BWD_COLS / 2;
  for (int i = threadIdx.x; i < CHUNK * feature_pairs; i += BWD_THREADS) {
    const int t = i / feature_pairs, c = 2 * (i % feature_pairs);
    const float2 qv = unpack(*reinterpret_cast<const packed_t<T>*>(s.q_in[stage].ptr(t, c)));
    const float2 kv = unpack(*reinterpret_cast<const packed_t<T>*>(s.k_in[stage].ptr(t, c)));
    *reinterpret_cast<bf16_2*>(s.q.ptr(t, c)) = pack<bf16>(qv.x, qv.y);
    *reinterpret_cast<bf16_2*>(s.k.ptr(t, c)) = pack<bf16>(kv.x, kv.y);
  }
  for (int i = threadIdx.x; i < CHUNK * column_pairs; i += BWD_THREADS) {
    const int t = i / column_pairs, c = 2 * (i % column_pairs);
    const float scale = t < real_tokens ? inv_den[t] : 0.f;
    const float2 vv = unpack(*reinterpret_cast<const packed_t<T>*>(s.v_in[stage].ptr(t, c)));
    const float2 dv = unpack(*reinterpret_cast<const packed_t<T>*>(s.dy_in[stage].ptr(t, c)));
    *reinterpret_cast<bf16_2*>(s.v.ptr(t, c)) = pack<bf16>(vv.x, vv.y);
    *reinterpret_cast<bf16_2*>(s.dy.ptr(t, c)) = pack<bf16>(dv.x, dv.y);
    *reinterpret_cast<bf16_2*>(s.dnum.ptr(t, c)) = pack<bf16>(dv.x * scale, dv.y * scale);
  }
}

// Reads a [batch, heads, 273, value_dim] state (and its [batch, heads, 273] column of ones)
// into shared memory in the internal feature order; padding features are zero.
__device__ __forceinline__ void read_state(float* state, float* vec_state, const float* global_state,
                                           const float* global_vec, const BackwardParams& p, int64_t head, int v0) {
  const float* src = global_state + head * NUM_FEATURES * p.value_dim + v0;
  for (int i = threadIdx.x; i < PADDED_FEATURES * BWD_COLS; i += BWD_THREADS) {
    const int f = i / BWD_COLS, c = i % BWD_COLS;
    if (f < NUM_FEATURES)
      state[internal_feature(f) * BWD_STATE_STRIDE + c] = src[int64_t(f) * p.value_dim + c];
    else
      state[f * BWD_STATE_STRIDE + c] = 0.f;
  }
  for (int f = threadIdx.x; f < PADDED_FEATURES; f += BWD_THREADS)
    vec_state[f < NUM_FEATURES ? internal_feature(f) : f] = f < NUM_FEATURES ? global_vec[head * NUM_FEATURES + f] : 0.f;
}

// The chunk's summed dq or dk rows into the [batch, seq, heads, value_dim / 64, 16] partial
// sums (row (b, t, h) of column block v_block starts at grad_part_index); the accumulator is
// cleared for the next chunk.
__device__ __forceinline__ void write_grad_parts(float* parts, float* grad, const BackwardParams& p, int b, int h,
                                                 int v_block, int t0) {
  for (int i = threadIdx.x; i < CHUNK * FEATURE_DIM; i += BWD_THREADS) {
    const int t = t0 + i / FEATURE_DIM;
    if (t < p.seq) parts[grad_part_index(p, b, t, h, v_block) + i % FEATURE_DIM] = grad[i];
    grad[i] = 0.f;
  }
}

// All 16 features of this lane's rows g and g + 8 of a strip starting at row0.
__device__ __forceinline__ void load_lane_rows(float (&rows)[2][FEATURE_DIM], const st<bf16, CHUNK, FEATURE_DIM>& x,
                                               int row0) {
  load_row(rows[0], x, row0 + (laneid() >> 2));
  load_row(rows[1], x, row0 + (laneid() >> 2) + 8);
}

// The dk/dv sweep: chunks in reverse, state R' = [dS, dz] + everything after the chunk.
template <typename T>
__device__ __forceinline__ void dkv_sweep(const BackwardParams& p, backward_shared<T>& s, const backward_views<T>& in) {
  const int warp = warpid(), half = warp / STRIPS, row0 = 16 * (warp % STRIPS);
  const bool ones_column = in.v_block == 0;
  // dv of this warp: its strip's keys, 32 of the block's columns.
  const gl<T> DV = backward_views<T>::column_view((T*)p.dv, p, in.v0 + 32 * half, 32);

  const int num_chunks = (p.seq + CHUNK - 1) / CHUNK;
  load_chunk_async(s, 0, in, (num_chunks - 1) * CHUNK);
  read_state(s.state, s.vec_state, p.d_state, p.d_z, p, in.head, in.v0);
  for (int i = threadIdx.x; i < CHUNK * FEATURE_DIM; i += BWD_THREADS) s.grad[i] = 0.f;

  for (int step = 0; step < num_chunks; step++) {
    const int chunk = num_chunks - 1 - step;
    const int stage = step & 1, t0 = chunk * CHUNK, real_tokens = min(CHUNK, p.seq - t0);
    cp_async_wait<0>();
    __syncthreads();
    if (chunk > 0) load_chunk_async(s, stage ^ 1, in, t0 - CHUNK);
    prepare_chunk(s, stage, p, in.head, t0, real_tokens);
    __syncthreads();
    build_features<BWD_THREADS>(s.phi, s.q, real_tokens);  // for the state update below

    {  // this warp's 16 keys
      rt<bf16, 16, FEATURE_DIM> k;
      load(k, s.k, row0, 0);
      float k_rows[2][FEATURE_DIM];
      load_lane_rows(k_rows, s.k, row0);
      rt<bf16, 16, BWD_COLS> v;
      load(v, s.v, row0, 0);
      feature_map_grad grad;

      // dv inside the chunk (columns 32 half..): A^T dnum, A^T[j, t] = 1 + s + s^2 / 2 for t >= j.
      rt<bf16, CHUNK, FEATURE_DIM> q_all;
      load(q_all, s.q, 0, 0);
      rt_fl<16, CHUNK> weights;
      zero(weights);
      mma_ABt(weights, k, q_all, weights);
      for_each(weights, [&](float& x, int r, int query) {
        const float sc = 0.25f * x;
        x = (query >= row0 + r && query < real_tokens) ? 1.f + sc + 0.5f * sc * sc : 0.f;
      });
      rt<bf16, 16, CHUNK> weights16;
      copy(weights16, weights);
      rt<bf16, CHUNK, 32, layout::col> dnum_b;
      load(dnum_b, s.dnum, 0, 32 * half);
      rt_fl<16, 32> dv;
      zero(dv);
      mma_AB(dv, weights16, dnum_b, dv);

      // dk inside the chunk from the queries [32 half, +32): ds^T = (v dnum^T + dden) (1 + s) / 4.
      rt<bf16, 32, FEATURE_DIM> q;
      load(q, s.q, 32 * half, 0);
      rt_fl<16, 32> factor;
      zero(factor);
      mma_ABt(factor, k, q, factor);
      for_each(factor, [&](float& x, int r, int query) {
        query += 32 * half;
        x = (query >= row0 + r && query < real_tokens) ? 0.25f * (1.f + 0.25f * x) : 0.f;
      });
      rt<bf16, 32, BWD_COLS> dy;
      load(dy, s.dy, 32 * half, 0);
      rt_fl<16, 32> ds;
      zero(ds);
      mma_ABt(ds, v, dy, ds);  // dnum = dy inv_den applied in fp32, as in the dq sweep
      for_each(ds, [&](float& x, int, int query) {
        query += 32 * half;
        x = x * s.inv_den[query] + (ones_column ? s.dden[query] : 0.f);
      });
      mul(ds, factor);
      rt<bf16, 16, 32> ds16;
      copy(ds16, ds);
      rt<bf16, 32, FEATURE_DIM, layout::col> q_b;
      load(q_b, s.q, 32 * half, 0);
      mma_AB(grad.dx, ds16, q_b, grad.dx);

      // Through the later chunks: dphi(k) = v R^T -> dk (feature tiles of this half) and
      // dv += phi(k) R (all feature tiles, this warp's columns).
#pragma unroll
      for (int a = 0; a < GRAD_TILES; a++) {
        if ((a < HALF_GRAD_TILES) != (half == 0)) continue;
        rt<bf16, 16, BWD_COLS> state_rows;
        load_state_rows(state_rows, s.state, 16 * a);
        rt_fl<16, 16> G;
        zero(G);
        mma_ABt(G, v, state_rows, G);
        grad.add_tile(a, G, k, k_rows);
      }
      const auto add_state_term = [&](int tile, const rt<bf16, 16, 16>& phi_k) {
        rt<bf16, 16, 32, layout::col> state_cols;
        load_state_cols(state_cols, s.state, 16 * tile, 32 * half);
        mma_AB(dv, phi_k, state_cols, dv);
      };
#pragma unroll 2
      for (int a = 0; a < FEATURE_DIM; a++) {
        const float xa[2] = {k_rows[0][a], k_rows[1][a]};
        add_state_term(a, second_order_tile(xa, k));
      }
      add_state_term(16, first_order_tile(k));
      add_state_term(17, constant_tile());

      if (ones_column && half == 0) {
        const float w[2] = {1.f, 1.f};
        grad.add_vector_state(s.vec_state, k_rows, w);
      }
      grad.finish();
      grad.add_to(s.grad, row0);
      store(DV, dv, {in.b, in.h, t0 + row0});
    }
    __syncthreads();  // dk complete; every warp has read R

    write_grad_parts(p.dk_parts, s.grad, p, in.b, in.h, in.v_block, t0);
    add_outer_products(s.state, s.phi, s.dnum);  // R += phi(Q)^T dnum
    if (ones_column && warp == BWD_WARPS - 1) accumulate_feature_sums(s.vec_state, s.q, s.dden, real_tokens);
  }
  __syncthreads();  // the last update is complete

  // dS0 = R and dz0 = r, in the external feature order.
  float* d_state0 = p.d_state0 + in.head * NUM_FEATURES * p.value_dim + in.v0;
  for (int i = threadIdx.x; i < NUM_FEATURES * BWD_COLS; i += BWD_THREADS) {
    const int f = i / BWD_COLS, c = i % BWD_COLS;
    d_state0[int64_t(f) * p.value_dim + c] = s.state[internal_feature(f) * BWD_STATE_STRIDE + c];
  }
  if (ones_column)
    for (int f = threadIdx.x; f < NUM_FEATURES; f += BWD_THREADS)
      p.d_z0[in.head * NUM_FEATURES + f] = s.vec_state[internal_feature(f)];
}

template <typename T>
__global__ void __launch_bounds__(BWD_THREADS, 1) dkv_kernel(const __grid_constant__ BackwardParams p) {
  extern __shared__ char smem_raw[];
  // Swizzled tiles need 1024-byte alignment; the dynamic shared base only promises 16.
  auto& s = *reinterpret_cast<backward_shared<T>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  dkv_sweep(p, s, backward_views<T>(p, blockIdx.x, blockIdx.y, blockIdx.z));
}

template <typename T>
cudaError_t launch_dkv(const BackwardParams& p, cudaStream_t stream) {
  const int smem = int(sizeof(backward_shared<T>)) + 1024;
  const dim3 grid(p.value_dim / BWD_COLS, p.heads, p.batch);
  return launch_with_shared<dkv_kernel<T>>(grid, BWD_THREADS, smem, stream, p);
}

}  // namespace tk::based
