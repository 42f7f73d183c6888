// phi's tiles in registers, built where a product needs them from fragments of q or k (16
// tokens x 16 features), in the tile layout of features.cuh.
//   second order  tile a of phi(X) is X scaled per row by column a of X: kittens' mul_by_column,
//                 or mul_by_columns for tiles a and a + 1 at once (row layout, A operands)
//   first order   X itself
//   constant      ones in feature column 0
// The tiles are the plain ones (x_a x_b, x_b, 1) or, for phi(K) in the state updates, x_a x_b / 32:
// the feature map's constants are applied where the kernels meet them (state_tiles.cuh).
#pragma once

#include "state_tiles.cuh"

namespace tk::based {

using namespace kittens;

// The constant feature's tile for 16 tokens, [tokens x features] with feature 0 = 1 and zeros
// elsewhere, in the layout of an A operand (row) or a B operand (col; its registers are also
// the row-layout tile of the transpose, an A operand).
template <typename T, typename L>
__device__ __forceinline__ rt<T, 16, 16, L> constant_feature_tile() {
  rt_fl<16, 16> ones;  // row layout: [tokens x features], or [features x tokens] for col
  for_each(ones, [](float& x, int r, int c) { x = (std::is_same_v<L, layout::row> ? c : r) == 0 ? 1.f : 0.f; });
  rt<T, 16, 16> rounded;
  copy(rounded, ones);
  if constexpr (std::is_same_v<L, layout::row>)
    return rounded;
  else
    return as_transpose(rounded);
}

// Own tile 8 of phi(Q) as a bf16 A operand: the first-order tile q (fh = 0) or the constant tile.
template <typename T>
__device__ __forceinline__ rt_bf<16, 16> phi_q_low_order(const rt<T, 16, 16>& q, int fh) {
  const auto first_order = [&] {
    rt_bf<16, 16> t;
    copy(t, q);
    return t;
  };
  return fh == 1 ? constant_feature_tile<bf16, layout::row>() : first_order();
}

// Phi(K) [16 tokens x 16 features] of own tile `own` for the state updates, in the input type,
// from K's col-layout fragment kc and kc32 = kc / 32 (the second-order tiles hold sums / 32).
// The same registers are the B operand Phi(K) and, through as_transpose, the A operand Phi(K)^T.
template <typename T>
__device__ __forceinline__ rt<T, 16, 16, layout::col> phi_k_tile(const rt<T, 16, 16, layout::col>& kc,
                                                                  const rt<T, 16, 16, layout::col>& kc32, int own,
                                                                  int fh) {
  rt<T, 16, 16, layout::col> out;
  copy(out, kc);
  if (own < SECOND_ORDER_OWN)
    mul_by_column(out, kc, kc32, second_order_row(own, fh));  // k_a k_b / 32
  else if (fh == 1)
    copy(out, constant_feature_tile<T, layout::col>());
  return out;
}

}  // namespace tk::based
