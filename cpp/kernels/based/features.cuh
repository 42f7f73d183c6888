// The Taylor feature map of Based as the kernels use it, and the warp/block helpers that build
// feature tiles; shared by the forward and backward kernels.
//
// phi(x) = [1, x / 2, vec(x x^T) / (4 sqrt 2)] for x in R^16 (273 features), so that
// phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / 4.
#pragma once

#include "../../kittens/kittens.cuh"
#include "based.h"

namespace tk::based {

using namespace kittens;

constexpr int CHUNK = 64;                         // tokens per step of a sweep over the sequence
constexpr int FEATURE_TILES = 18;                 // 273 features padded to 288
constexpr int PADDED_FEATURES = 16 * FEATURE_TILES;

// Feature order inside the kernel (chosen so that every 16-feature tile has one formula):
//   [0, 256)   second order x_a x_b / (4 sqrt 2) at 16 a + b     (external 17 + 16 a + b)
//   [256, 272) first order x_i / 2 at 256 + i                    (external 1 + i)
//   272        the constant 1                                     (external 0)
//   [273, 288) zero padding
// The global S and z use the external order of tk_jax/reference/based.py.
constexpr int LINEAR_FEATURES = 256, CONST_FEATURE = 272;
constexpr float SECOND_ORDER_SCALE = 0.17677669529663687f;  // 1 / (sqrt(2) sqrt(16))
constexpr float FIRST_ORDER_SCALE = 0.5f;                    // 1 / 16^(1/4)

__device__ __forceinline__ int internal_feature(int external) {
  return external == 0 ? CONST_FEATURE : external < 17 ? LINEAR_FEATURES + external - 1 : external - 17;
}

// Columns [col0, col0 + 8) of row r of a [rows x 16] tile, as floats (one 16-byte piece).
template <typename T, int R>
__device__ __forceinline__ void load_row_piece(float (&out)[8], const st<T, R, FEATURE_DIM>& tile, int r, int col0) {
  const int4 raw = *reinterpret_cast<const int4*>(tile.ptr(r, col0));
  const packed_t<T>* pairs = reinterpret_cast<const packed_t<T>*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const float2 f = unpack(pairs[j]);
    out[2 * j] = f.x;
    out[2 * j + 1] = f.y;
  }
}

// The 16 values of row r of a [rows x 16] tile, as floats.
template <typename T, int R>
__device__ __forceinline__ void load_row(float (&out)[FEATURE_DIM], const st<T, R, FEATURE_DIM>& tile, int r) {
  load_row_piece(reinterpret_cast<float(&)[8]>(out[0]), tile, r, 0);
  load_row_piece(reinterpret_cast<float(&)[8]>(out[8]), tile, r, 8);
}

// Where row (b, t, h) of value-column block v_block starts in the backward's
// [batch, seq, heads, value_dim / 64, 16] partial sums of dq and dk.
__device__ __forceinline__ int64_t grad_part_index(const BackwardParams& p, int b, int t, int h, int v_block) {
  const int num_blocks = p.value_dim / 64;
  return (((int64_t(b) * p.seq + t) * p.heads + h) * num_blocks + v_block) * FEATURE_DIM;
}

// The 16 x 16 tile of `src` at (row0, col0), transposed, as a row-layout tile (an A operand
// X^T). ldmatrix.trans into the col layout already puts exactly those values in each lane:
// a col-layout tile of X holds the pairs (k = 2c..2c+1, n = g) that a row-layout tile of X^T
// holds as (row g, cols 2c..2c+1), in the same register order.
template <typename T, int SR, int SC>
__device__ __forceinline__ void load_transposed(rt_base<T, layout::row>& dst, const st<T, SR, SC>& src, int row0,
                                                int col0) {
  rt<T, 16, 16, layout::col> t;
  load(t, src, row0, col0);
#pragma unroll
  for (int r = 0; r < 4; r++) dst.data[r] = t.tiles[0][0].data[r];
}

// phi(X) [64 x 288] of a chunk X [64 x 16] into shared memory, by all `Threads` threads of the
// block, 8 features (one 16-byte piece) per thread and iteration. Rows past `real_tokens` are
// zero (phi(0) = [1, 0, ...] is not zero, so padded tokens must be cleared explicitly).
template <int Threads, typename T>
__device__ __forceinline__ void build_features(st<T, CHUNK, PADDED_FEATURES>& phi, const st<T, CHUNK, FEATURE_DIM>& k,
                                               int real_tokens) {
  constexpr int pieces_per_row = PADDED_FEATURES / 8;
  for (int i = threadIdx.x; i < CHUNK * pieces_per_row; i += Threads) {
    const int t = i / pieces_per_row, f0 = (i % pieces_per_row) * 8;
    float out[8];
    if (t >= real_tokens) {  // past the end of the sequence: no key at all
#pragma unroll
      for (int j = 0; j < 8; j++) out[j] = 0.f;
    } else if (f0 < LINEAR_FEATURES) {  // k_a k_b for b = b0 .. b0 + 7
      const int a = f0 / 16, b0 = f0 % 16;
      const float ka = to_float(*k.ptr(t, a)) * SECOND_ORDER_SCALE;
      const int4 raw = *reinterpret_cast<const int4*>(k.ptr(t, b0));
      const packed_t<T>* pairs = reinterpret_cast<const packed_t<T>*>(&raw);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float2 kb = unpack(pairs[j]);
        out[2 * j] = ka * kb.x;
        out[2 * j + 1] = ka * kb.y;
      }
    } else if (f0 < CONST_FEATURE) {  // k_i / 2 for i = f0 - 256 .. + 7
      const int4 raw = *reinterpret_cast<const int4*>(k.ptr(t, f0 - LINEAR_FEATURES));
      const packed_t<T>* pairs = reinterpret_cast<const packed_t<T>*>(&raw);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float2 ki = unpack(pairs[j]);
        out[2 * j] = ki.x * FIRST_ORDER_SCALE;
        out[2 * j + 1] = ki.y * FIRST_ORDER_SCALE;
      }
    } else {  // the constant feature, then zero padding
#pragma unroll
      for (int j = 0; j < 8; j++) out[j] = f0 + j == CONST_FEATURE ? 1.f : 0.f;
    }
    int4 packed_out;
    packed_t<T>* dst = reinterpret_cast<packed_t<T>*>(&packed_out);
#pragma unroll
    for (int j = 0; j < 4; j++) dst[j] = pack<T>(out[2 * j], out[2 * j + 1]);
    *reinterpret_cast<int4*>(phi.ptr(t, f0)) = packed_out;
  }
}

// The 16-feature tiles of phi(Q) for a warp's 16 query rows, as bf16 A operands, built from
// the row-layout fragment q of Q (row g + 8 (r & 1), columns 2c + 8 (r >> 1) + {0, 1} in
// data[r]): those columns are the x_b of every tile.
// Second-order tile a: x_a x_b / (4 sqrt 2); xa[h] is x_a of this lane's row g + 8 h.
template <typename T>
__device__ __forceinline__ rt<bf16, 16, 16> second_order_tile(const float (&xa)[2], const rt<T, 16, FEATURE_DIM>& q) {
  rt<bf16, 16, 16> phi;
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const float2 xb = unpack(q.tiles[0][0].data[r]);
    const float scaled_xa = xa[r & 1] * SECOND_ORDER_SCALE;
    phi.tiles[0][0].data[r] = pack<bf16>(scaled_xa * xb.x, scaled_xa * xb.y);
  }
  return phi;
}
// First-order tile: x_b / 2.
template <typename T>
__device__ __forceinline__ rt<bf16, 16, 16> first_order_tile(const rt<T, 16, FEATURE_DIM>& q) {
  rt<bf16, 16, 16> phi;
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const float2 xb = unpack(q.tiles[0][0].data[r]);
    phi.tiles[0][0].data[r] = pack<bf16>(xb.x * FIRST_ORDER_SCALE, xb.y * FIRST_ORDER_SCALE);
  }
  return phi;
}
// Last tile: feature 272 = 1 in column 0 (lanes with c = 0, data[0] and data[1]), then padding.
__device__ __forceinline__ rt<bf16, 16, 16> constant_tile() {
  rt<bf16, 16, 16> phi;
  const float one = (laneid() & 3) == 0 ? 1.f : 0.f;
#pragma unroll
  for (int r = 0; r < 4; r++) phi.tiles[0][0].data[r] = pack<bf16>(r < 2 ? one : 0.f, 0.f);
  return phi;
}

// Half of phi(q) . z for this lane's rows g and g + 8 (all four lanes of a quad get the sum):
// the second-order features with a in [8 half, 8 half + 8), plus the first-order and constant
// ones when half = 0, so that two warps share a row tile's normaliser evenly. x_a comes from
// q_rows (columns 8 half .. 8 half + 7 of rows g and g + 8); lane c takes the columns b in
// {2c, 2c+1, 2c+8, 2c+9} that its fragment of q holds,
//   sum_a x_a sum_b x_b z[16 a + b] / (4 sqrt 2) + sum_b x_b z[256 + b] / 2 + z[272],
// and the quad adds its four parts.
template <typename T>
__device__ __forceinline__ row_vec<16> normaliser_from_state(const float (&q_rows)[2][8], const rt<T, 16, FEATURE_DIM>& q,
                                                             const float* z, int half) {
  const int c = laneid() & 3;
  float xb[2][4];  // [row h][b = 2c, 2c+1, 2c+8, 2c+9]
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const float2 lo = unpack(q.tiles[0][0].data[h]), hi = unpack(q.tiles[0][0].data[h + 2]);
    xb[h][0] = lo.x, xb[h][1] = lo.y, xb[h][2] = hi.x, xb[h][3] = hi.y;
  }
  const auto dot_xb = [&](int h, const float* zb) {  // sum_b x_b zb[b] over this lane's b
    const float2 lo = *reinterpret_cast<const float2*>(zb + 2 * c), hi = *reinterpret_cast<const float2*>(zb + 2 * c + 8);
    return xb[h][0] * lo.x + xb[h][1] * lo.y + xb[h][2] * hi.x + xb[h][3] * hi.y;
  };
  row_vec<16> den;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float second = 0.f;
#pragma unroll
    for (int a = 0; a < 8; a++) second += q_rows[h][a] * dot_xb(h, z + 16 * (8 * half + a));
    float part = second * SECOND_ORDER_SCALE;
    if (half == 0) part += dot_xb(h, z + LINEAR_FEATURES) * FIRST_ORDER_SCALE + (c == 0 ? z[CONST_FEATURE] : 0.f);
    part += __shfl_xor_sync(0xffffffff, part, 1);
    part += __shfl_xor_sync(0xffffffff, part, 2);
    den.data[0][h] = part;
  }
  return den;
}

// One warp: z += sum_t w_t phi(x_t) over the chunk's real tokens (w_t = 1 when `weights` is
// null), computed from the rows x_t themselves: the second-order part is the weighted Gram
// matrix X^T diag(w) X, the first-order part X^T w, the constant part sum_t w_t. With unit
// weights this is exact in fp32 (products of 16-bit values are exact; padded rows of X are
// zero); weights are rounded to bf16 with X on their way to the tensor cores.
template <typename T>
__device__ __forceinline__ void accumulate_feature_sums(float* z, const st<T, CHUNK, FEATURE_DIM>& x,
                                                        const float* weights, int real_tokens) {
  rt<T, 16, CHUNK> x_t;                        // X^T [16 features x 64 tokens], columns scaled by w
  rt<T, CHUNK, 16, layout::col> ones;          // all ones: X^T w in every column
  rt<T, CHUNK, FEATURE_DIM, layout::col> x_b;  // X as the B operand
#pragma unroll
  for (int kt = 0; kt < CHUNK / 16; kt++) {
    load_transposed(x_t.tiles[0][kt], x, 16 * kt, 0);
#pragma unroll
    for (int r = 0; r < 4; r++) {
      ones.tiles[kt][0].data[r] = pack<T>(1.f, 1.f);
      if (weights) {  // x_t holds tokens 16 kt + fragment_col(r, 0..1)
        const float2 v = unpack(x_t.tiles[0][kt].data[r]);
        const int t = 16 * kt + fragment_col(r, 0);
        x_t.tiles[0][kt].data[r] = pack<T>(v.x * weights[t], v.y * weights[t + 1]);
      }
    }
  }
  load(x_b, x, 0, 0);
  rt_fl<16, 16> gram, colsum;
  zero(gram);
  zero(colsum);
  mma_AB(gram, x_t, x_b, gram);
  mma_AB(colsum, x_t, ones, colsum);
  for_each(gram, [&](float& v, int a, int b) { z[16 * a + b] += v * SECOND_ORDER_SCALE; });
  for_each(colsum, [&](float& v, int a, int col) {
    if (col == 0) z[LINEAR_FEATURES + a] += v * FIRST_ORDER_SCALE;
  });
  float total = 0.f;  // sum of the weights of the real tokens
  for (int t = laneid(); t < real_tokens; t += WARP_THREADS) total += weights ? weights[t] : 1.f;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffff, total, offset);
  if (laneid() == 0) z[CONST_FEATURE] += total;
}

}  // namespace tk::based
