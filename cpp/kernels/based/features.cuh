// The Taylor feature map of Based as the kernels use it: constants, the feature order, and the
// small helpers the forward and backward kernels share.
//
// phi(x) = [1, x / 2, vec(x x^T) / (4 sqrt 2)] for x in R^16 (273 features), so that
// phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / 4.
#pragma once

#include "../../kittens/kittens.cuh"
#include "based.h"

namespace tk::based {

using namespace kittens;

constexpr int FEATURE_TILES = 18;                 // 273 features padded to 18 tiles of 16

// The kernels' feature tiles (register_state.cuh; one formula per 16-feature tile):
//   tiles 0..15  second order x_a x_b / (4 sqrt 2), tile a, column b  (external 17 + 16 a + b)
//   tile 16      first order x_b / 2                                   (external 1 + b)
//   tile 17      the constant 1 in column 0, then zero padding          (external 0)
// The global S and z use the external order of tk_jax/reference/based.py.
constexpr float SECOND_ORDER_SCALE = 0.17677669529663687f;  // 1 / (sqrt(2) sqrt(16))
constexpr float FIRST_ORDER_SCALE = 0.5f;                    // 1 / 16^(1/4)

// Where row (b, t, h) of value-column block v_block starts in the backward's
// [batch, seq, heads, value_dim / 64, 16] partial sums of dq and dk.
__device__ __forceinline__ int64_t grad_part_index(const BackwardParams& p, int b, int t, int h, int v_block) {
  const int num_blocks = p.value_dim / 64;
  return (((int64_t(b) * p.seq + t) * p.heads + h) * num_blocks + v_block) * FEATURE_DIM;
}

// phi(Q)'s constant tile: feature 272 = 1 in column 0 (lanes with c = 0, data[0] and data[1]),
// then padding.
__device__ __forceinline__ rt<bf16, 16, 16> constant_tile() {
  rt<bf16, 16, 16> phi;
  const float one = (laneid() & 3) == 0 ? 1.f : 0.f;
#pragma unroll
  for (int r = 0; r < 4; r++) phi.tiles[0][0].data[r] = pack<bf16>(r < 2 ? one : 0.f, 0.f);
  return phi;
}

}  // namespace tk::based
