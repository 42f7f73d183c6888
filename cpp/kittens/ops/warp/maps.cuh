// Element-wise maps, row reductions, row broadcasts and masks on register tiles.
// Each op visits every element a lane holds together with its (row, col) inside the tile, so
// masks and reductions read like the math: "for every element with col > row ...".
#pragma once

#include "../../types/register_tile.cuh"

namespace kittens {

// Calls f(float& x, int row, int col) for every element of a row-layout float tile.
template <int R, int C, typename F>
__device__ __forceinline__ void for_each(rt_fl<R, C>& t, F&& f) {
#pragma unroll
  for (int i = 0; i < t.height; i++)
#pragma unroll
    for (int j = 0; j < t.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        float2& p = t.tiles[i][j].data[k];
        f(p.x, 16 * i + fragment_row(k), 16 * j + fragment_col(k, 0));
        f(p.y, 16 * i + fragment_row(k), 16 * j + fragment_col(k, 1));
      }
}

template <int R, int C, typename F>
__device__ __forceinline__ void map(rt_fl<R, C>& t, F&& f) {
  for_each(t, [&](float& x, int, int) { x = f(x); });
}
template <int R, int C>
__device__ __forceinline__ void fill(rt_fl<R, C>& t, float value) {
  map(t, [=](float) { return value; });
}
template <int R, int C>
__device__ __forceinline__ void zero(rt_fl<R, C>& t) { fill(t, 0.f); }
template <int R, int C>
__device__ __forceinline__ void mul(rt_fl<R, C>& t, float s) {
  map(t, [=](float x) { return x * s; });
}
template <int R, int C>
__device__ __forceinline__ void exp2(rt_fl<R, C>& t) {
  map(t, [](float x) { return fast_exp2(x); });
}
template <int R, int C>
__device__ __forceinline__ void add(rt_fl<R, C>& dst, const rt_fl<R, C>& a) {
#pragma unroll
  for (int i = 0; i < dst.height; i++)
#pragma unroll
    for (int j = 0; j < dst.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        dst.tiles[i][j].data[k].x += a.tiles[i][j].data[k].x;
        dst.tiles[i][j].data[k].y += a.tiles[i][j].data[k].y;
      }
}

// Element-wise product dst *= a.
template <int R, int C>
__device__ __forceinline__ void mul(rt_fl<R, C>& dst, const rt_fl<R, C>& a) {
#pragma unroll
  for (int i = 0; i < dst.height; i++)
#pragma unroll
    for (int j = 0; j < dst.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        dst.tiles[i][j].data[k].x *= a.tiles[i][j].data[k].x;
        dst.tiles[i][j].data[k].y *= a.tiles[i][j].data[k].y;
      }
}

// Element type conversion between row-layout tiles (e.g. fp32 scores -> bf16 probabilities,
// which are then directly the A operand of the next mma).
template <typename U, typename V, int R, int C>
__device__ __forceinline__ void copy(rt<U, R, C, layout::row>& dst, const rt<V, R, C, layout::row>& src) {
#pragma unroll
  for (int i = 0; i < dst.height; i++)
#pragma unroll
    for (int j = 0; j < dst.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float2 v = unpack(src.tiles[i][j].data[k]);
        dst.tiles[i][j].data[k] = pack<U>(v.x, v.y);
      }
}

// Row reductions: v[row] = reduce over the row's columns (combined with v's old value when
// `accumulate`). A lane holds 2 columns of each 8-column group; the 4 lanes of a row share
// g = lane / 4, so two xor-shuffles over lane bits 0 and 1 finish the reduction. With
// `across_lanes` false a lane keeps its own partial result (reduce_across_lanes finishes it
// later: a running sum then needs the shuffles once, not at every step).
template <typename Op>
__device__ __forceinline__ float reduce_quad(float x, Op op) {  // op over the row's four lanes
  x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
  return op(x, __shfl_xor_sync(0xffffffff, x, 2));
}
template <int R, typename Op>
__device__ __forceinline__ void reduce_across_lanes(row_vec<R>& v, Op op) {
#pragma unroll
  for (int i = 0; i < R / 16; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) v.data[i][h] = reduce_quad(v.data[i][h], op);
}
template <int R, int C, typename Op>
__device__ __forceinline__ void row_reduce(row_vec<R>& v, const rt_fl<R, C>& t, Op op, bool accumulate,
                                           bool across_lanes = true) {
#pragma unroll
  for (int i = 0; i < t.height; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) {  // h = 0: row g, h = 1: row g + 8
      float acc = op(t.tiles[i][0].data[h].x, t.tiles[i][0].data[h].y);
      acc = op(acc, op(t.tiles[i][0].data[h + 2].x, t.tiles[i][0].data[h + 2].y));
#pragma unroll
      for (int j = 1; j < t.width; j++) {
        acc = op(acc, op(t.tiles[i][j].data[h].x, t.tiles[i][j].data[h].y));
        acc = op(acc, op(t.tiles[i][j].data[h + 2].x, t.tiles[i][j].data[h + 2].y));
      }
      if (across_lanes) acc = reduce_quad(acc, op);
      v.data[i][h] = accumulate ? op(v.data[i][h], acc) : acc;
    }
}
struct max_op {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct sum_op {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
template <int R, int C>
__device__ __forceinline__ void row_max(row_vec<R>& v, const rt_fl<R, C>& t, bool accumulate = false) {
  row_reduce(v, t, max_op{}, accumulate);
}
template <int R, int C>
__device__ __forceinline__ void row_sum(row_vec<R>& v, const rt_fl<R, C>& t, bool accumulate = false) {
  row_reduce(v, t, sum_op{}, accumulate);
}

// Row broadcasts: t[r][c] = f(t[r][c], v[r]).
template <int R, int C, typename F>
__device__ __forceinline__ void map_rows(rt_fl<R, C>& t, const row_vec<R>& v, F&& f) {
#pragma unroll
  for (int i = 0; i < t.height; i++)
#pragma unroll
    for (int j = 0; j < t.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float r = v.data[i][k & 1];
        float2& p = t.tiles[i][j].data[k];
        p.x = f(p.x, r);
        p.y = f(p.y, r);
      }
}
template <int R, int C>
__device__ __forceinline__ void mul_row(rt_fl<R, C>& t, const row_vec<R>& v) {
  map_rows(t, v, [](float x, float r) { return x * r; });
}
template <int R, int C>
__device__ __forceinline__ void sub_row(rt_fl<R, C>& t, const row_vec<R>& v) {
  map_rows(t, v, [](float x, float r) { return x - r; });
}
template <int R, int C>
__device__ __forceinline__ void div_row(rt_fl<R, C>& t, const row_vec<R>& v) {
  map_rows(t, v, [](float x, float r) { return x / r; });
}

// Column broadcasts: t[r][c] = f(t[r][c], v[c]).
template <int R, int C, typename F>
__device__ __forceinline__ void map_cols(rt_fl<R, C>& t, const col_vec<C>& v, F&& f) {
#pragma unroll
  for (int j = 0; j < t.width; j++)
#pragma unroll
    for (int half_cols = 0; half_cols < 2; half_cols++)  // columns 2c, 2c+1 then 2c+8, 2c+9
#pragma unroll
      for (int i = 0; i < t.height; i++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
          float2& p = t.tiles[i][j].data[2 * half_cols + r];
          p.x = f(p.x, v.data[j][half_cols].x);
          p.y = f(p.y, v.data[j][half_cols].y);
        }
}

// Row-vector maps: v[r] = f(v[r]) or f(a[r], b[r]).
template <int R, typename F>
__device__ __forceinline__ void map(row_vec<R>& v, F&& f) {
#pragma unroll
  for (int i = 0; i < v.height; i++) {
    v.data[i][0] = f(v.data[i][0]);
    v.data[i][1] = f(v.data[i][1]);
  }
}
template <int R, typename F>
__device__ __forceinline__ void map(row_vec<R>& dst, const row_vec<R>& a, const row_vec<R>& b, F&& f) {
#pragma unroll
  for (int i = 0; i < dst.height; i++) {
    dst.data[i][0] = f(a.data[i][0], b.data[i][0]);
    dst.data[i][1] = f(a.data[i][1], b.data[i][1]);
  }
}
// Row index (within the tile) of v.data[i][h] for this lane.
__device__ __forceinline__ int row_vec_row(int i, int h) { return 16 * i + (laneid() >> 2) + 8 * h; }

// Masks: every element whose (row0 + row, col0 + col) fails `keep` becomes `fill`.
// Used for causal / window diagonals and for tails past the end of a sequence.
template <int R, int C, typename Keep>
__device__ __forceinline__ void mask(rt_fl<R, C>& t, int row0, int col0, Keep&& keep, float fill = NEG_INF) {
  for_each(t, [&](float& x, int r, int c) {
    if (!keep(row0 + r, col0 + c)) x = fill;
  });
}

// Band mask: keeps the elements with lo <= col - row <= hi, row < rows and col < cols (rows and
// columns counted from the tile's first element) and sets the rest to `fill`. The same keep set
// as a mask() over a causal or sliding-window band, but cheap: a lane's elements sit at fixed
// offsets from its first one, and on one row the column limit is one more bound on col - row,
// so each element costs two compares of a constant with per-row bounds.
template <int R, int C>
__device__ __forceinline__ void mask_band(rt_fl<R, C>& t, int lo, int hi, int rows, int cols, float fill = NEG_INF) {
  const int row = fragment_row(0), col = fragment_col(0, 0);  // the lane's first element
  const int lo_lane = lo - (col - row), hi_lane = hi - (col - row), rows_lane = rows - row, cols_lane = cols - col;
#pragma unroll
  for (int i = 0; i < t.height; i++)
#pragma unroll
    for (int down = 0; down < 2; down++) {  // registers k with k % 2 == down sit 8 rows lower
      const int dr = 16 * i + 8 * down;  // row offset from the lane's first element
      // On this row: col < cols means (col - row) - (dr offset) <= cols_lane - 1 - dr.
      const int hi_row = dr < rows_lane ? min(hi_lane, cols_lane - 1 - dr) : lo_lane - 1;
#pragma unroll
      for (int j = 0; j < t.width; j++)
#pragma unroll
        for (int right = 0; right < 2; right++) {  // register 2 * right + down
          float2& p = t.tiles[i][j].data[2 * right + down];
          const int d = 16 * j + 8 * right - dr;  // (col - row) offset of p.x; p.y is d + 1
          p.x = d >= lo_lane && d <= hi_row ? p.x : fill;
          p.y = d + 1 >= lo_lane && d + 1 <= hi_row ? p.y : fill;
        }
    }
}

}  // namespace kittens
