// Register tiles: a warp's share of a matrix, held in the mma.sync fragment layout.
//
// A 16x16 base tile is spread over the 32 lanes of a warp. With g = lane / 4 and c = lane % 4,
// a lane holds four packed pairs:
//   row layout:  data[0] = (g,   2c..2c+1)   data[1] = (g+8, 2c..2c+1)
//                data[2] = (g, 2c+8..2c+9)   data[3] = (g+8, 2c+8..2c+9)      (row, col)
//   col layout:  the same positions of the transposed tile, so a K x N tile in col layout
//                is what mma's B operand wants when B is stored row-major (e.g. V in P.V).
// Row layout is both mma's A operand and its accumulator, so P = softmax(S) feeds P.V directly.
#pragma once

#include "../common/base.cuh"

namespace kittens {

namespace layout {
struct row {};
struct col {};
}  // namespace layout

template <typename T, typename Layout = layout::row>
struct rt_base {
  using dtype = T;
  using T2 = packed_t<T>;
  T2 data[4];
};

template <typename T, int Rows, int Cols, typename Layout = layout::row>
struct rt {
  static_assert(Rows % TILE_DIM == 0 && Cols % TILE_DIM == 0, "register tiles are 16x16 multiples");
  using dtype = T;
  using layout_t = Layout;
  static constexpr int rows = Rows, cols = Cols;
  static constexpr int height = Rows / TILE_DIM, width = Cols / TILE_DIM;
  rt_base<T, Layout> tiles[height][width];

  // Columns [16 * first_tile, 16 * first_tile + SubCols) of a one-strip tile, as a tile of its
  // own (the base tiles of a 16-row strip are contiguous). Index with compile-time values.
  template <int SubCols>
  __device__ __forceinline__ rt<T, Rows, SubCols, Layout>& col_slice(int first_tile) {
    static_assert(height == 1 && SubCols % TILE_DIM == 0 && SubCols <= Cols, "slices of 16-row strips only");
    return *reinterpret_cast<rt<T, Rows, SubCols, Layout>*>(&tiles[0][first_tile]);
  }
  template <int SubCols>
  __device__ __forceinline__ const rt<T, Rows, SubCols, Layout>& col_slice(int first_tile) const {
    static_assert(height == 1 && SubCols % TILE_DIM == 0 && SubCols <= Cols, "slices of 16-row strips only");
    return *reinterpret_cast<const rt<T, Rows, SubCols, Layout>*>(&tiles[0][first_tile]);
  }
};

template <int Rows, int Cols> using rt_fl = rt<float, Rows, Cols, layout::row>;
template <int Rows, int Cols, typename L = layout::row> using rt_bf = rt<bf16, Rows, Cols, L>;
template <int Rows, int Cols, typename L = layout::row> using rt_hf = rt<half, Rows, Cols, L>;

// The transpose for free: a col-layout tile of X holds the same registers, in the same order,
// as a row-layout tile of X^T (only the base tiles' indices swap). So a tile of K loaded in col
// layout (the B operand of P K) is also K^T as an A operand (of K^T V), and an fp32 accumulator
// of X, rounded to 16 bits, is X^T as a B operand. The copy costs no instructions.
template <typename Layout>
using transposed_layout = std::conditional_t<std::is_same_v<Layout, layout::row>, layout::col, layout::row>;
template <typename T, int R, int C, typename Layout>
__device__ __forceinline__ rt<T, C, R, transposed_layout<Layout>> as_transpose(const rt<T, R, C, Layout>& x) {
  rt<T, C, R, transposed_layout<Layout>> t;
#pragma unroll
  for (int i = 0; i < x.height; i++)
#pragma unroll
    for (int j = 0; j < x.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) t.tiles[j][i].data[k] = x.tiles[i][j].data[k];
  return t;
}

// One float per row of a row-layout tile of `Rows` rows: a lane keeps the rows it touches,
// g and g+8 of each 16-row block (the four lanes sharing g hold the same values).
template <int Rows>
struct row_vec {
  static constexpr int rows = Rows, height = Rows / TILE_DIM;
  float data[height][2];
};

// Row index (within the tile) of v.data[i][h] for this lane.
__device__ __forceinline__ int row_vec_row(int i, int h) { return 16 * i + (laneid() >> 2) + 8 * h; }

// One float per column of a row-layout tile of `Cols` columns: a lane keeps the columns it
// touches, 2c, 2c+1 (data[j][0]) and 2c+8, 2c+9 (data[j][1]) of each 16-column block j (the
// eight lanes sharing c hold the same values).
template <int Cols>
struct col_vec {
  static constexpr int cols = Cols, width = Cols / TILE_DIM;
  float2 data[width][2];
};
// Column index (within the tile) of v.data[j][h].x for this lane (.y is the next column).
__device__ __forceinline__ int col_vec_col(int j, int h) { return 16 * j + 2 * (laneid() & 3) + 8 * h; }

// Where element `half_idx` (0/1) of packed register `reg` (0..3) of a row-layout base tile sits.
__device__ __forceinline__ int fragment_row(int reg) { return (laneid() >> 2) + 8 * (reg & 1); }
__device__ __forceinline__ int fragment_col(int reg, int half_idx) {
  return 2 * (laneid() & 3) + half_idx + 8 * (reg >> 1);
}

}  // namespace kittens
