// The Taylor feature map of Based: its constants, the order of its features in the state
// (S, z) in global memory, and the padded tile layout the kernels hold them in.
//
// phi(x) = [1, x / 2, vec(x x^T) / (4 sqrt 2)] for x in R^16 (NUM_FEATURES = 273 features),
// so that phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / 4.
#pragma once

#include "based.h"

namespace tk::based {

constexpr float SECOND_ORDER_SCALE = 0.17677669529663687f;  // 1 / (sqrt(2) sqrt(16))
constexpr float FIRST_ORDER_SCALE = 0.5f;                    // 1 / 16^(1/4)

// The external feature order (global S [..., 273, Dv] and z [..., 273], as in
// tk_jax/reference/based.py): the constant, then x_b / 2, then x_a x_b / (4 sqrt 2) row-major.
constexpr int CONSTANT_FEATURE = 0;
__host__ __device__ constexpr int first_order_feature(int b) { return 1 + b; }
__host__ __device__ constexpr int second_order_feature(int a, int b) { return 1 + FEATURE_DIM + FEATURE_DIM * a + b; }
static_assert(second_order_feature(FEATURE_DIM - 1, FEATURE_DIM - 1) + 1 == NUM_FEATURES, "the three orders fill phi");

// The kernels' feature tiles: 273 features padded to 18 tiles of 16 (one formula per tile).
//   tiles 0..15  second order: tile a holds feature (a, b) in column b
//   tile 16      first order: feature b in column b
//   tile 17      the constant in column 0, then zero padding
// The tiles hold plain sums: the feature map's constants are powers of two apart
// (phi(q) . phi(k) = 1 + q.k / 4 + (q.k)^2 / 32), so the kernels apply them exactly, where the
// two sides of a product meet.
constexpr int SECOND_ORDER_TILES = FEATURE_DIM;
constexpr int FIRST_ORDER_TILE = SECOND_ORDER_TILES;
constexpr int CONSTANT_TILE = FIRST_ORDER_TILE + 1;
constexpr int FEATURE_TILES = CONSTANT_TILE + 1;
static_assert(FEATURE_TILES * 16 >= NUM_FEATURES, "the tiles cover phi");

}  // namespace tk::based
