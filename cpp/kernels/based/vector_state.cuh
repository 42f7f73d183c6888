// A state vector of Based in registers: the normaliser's z = sum_j phi(k_j) in the forward and
// dq sweeps, and the column of ones of R' in the dk/dv sweep.
//
// The feature map makes three pieces of it: the Gram matrix M = sum_j k_j k_j^T (the second
// order is c2 M, c2 = 1/(4 sqrt 2)), the key sum u = sum_j k_j (first order u / 2) and the token
// count n (the constant feature). Every warp keeps its own copy (13 registers) and updates it
// with two mma per 16 tokens, exactly (products of 16-bit values are exact in fp32, as are
// the sums of small integers), so that
//   phi(q) . z = q^T M q / 32 + q . u / 4 + n        (c2^2 = 1/32)
// costs one mma per 16 rows: Q M / 32, then a row-wise dot with q.
#pragma once

#include "../../kittens/kittens.cuh"
#include "features.cuh"

namespace tk::based {

using namespace kittens;

struct vector_state {
  rt_fl<16, 16> gram;  // M [a, b] as an accumulator (row a, column b)
  col_vec<16> keysum;  // u [b] of this lane's columns b
  float count;

  // From z0 [NUM_FEATURES] (external order) of this head; with `symmetrise`, M becomes (M + M^T) / 2
  // (for callers that only see q^T M q, whose gradient then is M q / 16).
  __device__ __forceinline__ void load(const float* z0, bool symmetrise = false) {
    for_each(gram, [&](float& m, int a, int b) {
      float x = z0[second_order_feature(a, b)];
      if (symmetrise) x = 0.5f * (x + z0[second_order_feature(b, a)]);
      m = x / SECOND_ORDER_SCALE;
    });
#pragma unroll
    for (int h = 0; h < 2; h++) {  // z0's first order is at odd offsets: no float2 loads
      const int b = col_vec_col(0, h);
      keysum.data[0][h] = make_float2(z0[first_order_feature(b)] / FIRST_ORDER_SCALE,
                                      z0[first_order_feature(b + 1)] / FIRST_ORDER_SCALE);
    }
    count = z0[CONSTANT_FEATURE];
  }

  // Add 16 tokens from K's col-layout fragment (rows past the sequence are zero); `tokens` of
  // them are real.
  template <typename T>
  __device__ __forceinline__ void add(const rt<T, 16, 16, layout::col>& kc, int tokens) {
    mma_AB(gram, as_transpose(kc), kc, gram);  // M += K^T K
    mma_col_sum(keysum, kc);                   // u += K^T 1
    count += float(tokens);
  }

  // Add 16 tokens x_t with weights w_t: M += X^T diag(w) X, u += X^T w, n += sum w (padded
  // tokens have w = 0). w is a column vector over the tokens; the products x w are rounded to
  // the input type on their way to the tensor cores.
  template <typename T>
  __device__ __forceinline__ void add_weighted(const rt<T, 16, 16, layout::col>& xc, const col_vec<16>& w) {
    rt_fl<16, 16> xw;  // X^T diag(w) (rows: features; columns: tokens)
    copy(xw, as_transpose(xc));
    map_cols(xw, w, [](float x, float f) { return x * f; });
    rt<T, 16, 16> xw16;
    copy(xw16, xw);
    mma_AB(gram, xw16, xc, gram);
    mma_col_sum(keysum, xc, w);
    count += sum(w);
  }

  // Q M^T scale + (u / 4 in every row when part = 0) for the 16 rows of q, M on its way to the
  // tensor cores as bf16 high (part 0) or low (part 1) parts, so that the two parts add up to
  // as exact a product as M itself.
  template <typename T>
  __device__ __forceinline__ rt_fl<16, 16> times_gram(const rt<T, 16, 16>& q, float scale, int part) const {
    rt_fl<16, 16> scaled = gram;
    mul(scaled, scale);
    rt_bf<16, 16> m_part;
    split(m_part, scaled, part);
    const rt_bf<16, 16, layout::col> m = as_transpose(m_part);  // M^T as a B operand
    rt_fl<16, 16> out;
    zero(out);
    map_cols(out, keysum, [=](float, float u) { return part == 0 ? u * 0.25f : 0.f; });
    rt_bf<16, 16> q16;
    copy(q16, q);
    mma_AB(out, q16, m, out);
    return out;
  }

  // Part `part` (0 or 1) of phi(q) . z for the 16 rows of q; the two parts add up to phi(q) . z.
  template <typename T>
  __device__ __forceinline__ row_vec<16> normaliser_part(const rt<T, 16, 16>& q, int part) const {
    row_vec<16> dot;
    row_dot(dot, times_gram(q, 1.f / 32, part), q);  // q^T M^T q = q^T M q
    const float n = count;
    if (part == 0) map(dot, [=](float x) { return x + n; });
    return dot;
  }

  // Part `part` of the gradient of phi(q) . z by q, M q / 16 + u / 4, for the 16 rows of q
  // (row t, feature b): M must be symmetric (load with `symmetrise`; sums of k k^T are).
  template <typename T>
  __device__ __forceinline__ rt_fl<16, 16> gradient_part(const rt<T, 16, 16>& q, int part) const {
    return times_gram(q, 1.f / 16, part);
  }

  // To z [NUM_FEATURES] (external order) of this head, by one warp. `antisymmetric` (optional, a
  // [NUM_FEATURES] vector): add back the antisymmetric part of its second order that `symmetrise` dropped.
  __device__ __forceinline__ void store(float* z, const float* antisymmetric = nullptr) const {
    rt_fl<16, 16> m = gram;
    for_each(m, [&](float& x, int a, int b) {
      float zab = x * SECOND_ORDER_SCALE;
      if (antisymmetric)
        zab += 0.5f * (antisymmetric[second_order_feature(a, b)] - antisymmetric[second_order_feature(b, a)]);
      z[second_order_feature(a, b)] = zab;
    });
    if (laneid() < 4)  // the lanes of row group 0 hold every column of u once
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int b = col_vec_col(0, h);
        z[first_order_feature(b)] = keysum.data[0][h].x * FIRST_ORDER_SCALE;
        z[first_order_feature(b + 1)] = keysum.data[0][h].y * FIRST_ORDER_SCALE;
      }
    if (laneid() == 0) z[CONSTANT_FEATURE] = count;
  }
};

}  // namespace tk::based
