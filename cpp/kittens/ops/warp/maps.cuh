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
// 16-bit tiles of either layout, in 16-bit arithmetic (each product rounded to T; exact for a
// power of two that stays in range).
template <typename T, int R, int C, typename L>
  requires is_16bit<T>
__device__ __forceinline__ void mul(rt<T, R, C, L>& t, float s) {
  const packed_t<T> f = pack<T>(s, s);
#pragma unroll
  for (int i = 0; i < t.height; i++)
#pragma unroll
    for (int j = 0; j < t.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) t.tiles[i][j].data[k] = __hmul2(t.tiles[i][j].data[k], f);
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

// dst = pick_a ? a : b for a run-time condition, register by register. (A ternary on the tiles
// themselves selects between their addresses, which puts both into local memory.)
template <typename T, int R, int C, typename L>
__device__ __forceinline__ void select(rt<T, R, C, L>& dst, bool pick_a, const rt<T, R, C, L>& a,
                                       const rt<T, R, C, L>& b) {
#pragma unroll
  for (int i = 0; i < dst.height; i++)
#pragma unroll
    for (int j = 0; j < dst.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++)
        dst.tiles[i][j].data[k] = select_pair(pick_a, a.tiles[i][j].data[k], b.tiles[i][j].data[k]);
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

// Row-wise dot products v[r] = sum_c a[r][c] b[r][c] of an fp32 tile and a tile of any type
// (e.g. a product Q M and Q itself: the quadratic forms q^T M q), with fused multiply-adds.
template <typename T, int R, int C>
__device__ __forceinline__ void row_dot(row_vec<R>& v, const rt_fl<R, C>& a, const rt<T, R, C>& b) {
#pragma unroll
  for (int i = 0; i < a.height; i++) {
    float sum[2] = {0.f, 0.f};  // rows g, g + 8: registers k with k % 2 == 0, 1
#pragma unroll
    for (int j = 0; j < a.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float2 x = a.tiles[i][j].data[k], y = unpack(b.tiles[i][j].data[k]);
        sum[k & 1] = fmaf(x.x, y.x, fmaf(x.y, y.y, sum[k & 1]));
      }
#pragma unroll
    for (int h = 0; h < 2; h++) v.data[i][h] = reduce_quad(sum[h], sum_op{});
  }
}

// Row broadcasts: t[r][c] = f(t[r][c], v[r]), or f(t[r][c], v[r], w[r]) with two vectors
// (e.g. a scale and a shift per row).
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
template <int R, int C, typename F>
__device__ __forceinline__ void map_rows(rt_fl<R, C>& t, const row_vec<R>& v, const row_vec<R>& w, F&& f) {
#pragma unroll
  for (int i = 0; i < t.height; i++)
#pragma unroll
    for (int j = 0; j < t.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float r = v.data[i][k & 1], s = w.data[i][k & 1];
        float2& p = t.tiles[i][j].data[k];
        p.x = f(p.x, r, s);
        p.y = f(p.y, r, s);
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

// Column broadcasts: t[r][c] = f(t[r][c], v[c]), or f(t[r][c], v[c], w[c]) with two vectors.
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
template <int R, int C, typename F>
__device__ __forceinline__ void map_cols(rt_fl<R, C>& t, const col_vec<C>& v, const col_vec<C>& w, F&& f) {
#pragma unroll
  for (int j = 0; j < t.width; j++)
#pragma unroll
    for (int half_cols = 0; half_cols < 2; half_cols++)
#pragma unroll
      for (int i = 0; i < t.height; i++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
          float2& p = t.tiles[i][j].data[2 * half_cols + r];
          p.x = f(p.x, v.data[j][half_cols].x, w.data[j][half_cols].x);
          p.y = f(p.y, v.data[j][half_cols].y, w.data[j][half_cols].y);
        }
}

// Rows scaled by a column of another 16-bit tile of the same rows: dst[r][c] = x[r][c] * y[r][col]
// (y one tile wide, 0 <= col < 16; col may be a run-time value). The factors come from the
// lanes holding y's column with one shuffle per register they sit in, and multiply in 16 bits
// when dst has x's type (rounded once, like the fp32 product rounded) or else through fp32.
//   Row layout: lane (g, c) needs y[g][col] and y[g + 8][col]: the pair holding columns col & ~1
//   and col | 1 of rows g and g + 8 sits in registers 0, 1 (col < 8) or 2, 3 of lane (g, col/2 % 4).
//   Col layout (x [K x N] as mma's B operand): lane (g, c) holds rows k = 2c, 2c + 1 (+ 8) and
//   needs y[k][col] of those rows: the pairs of registers 0, 2 (col < 8) or 1, 3 of lane
//   (col % 8, c), which hold the same rows.
// The register half is chosen by col >> 3, which for col = 8 h + (a constant below 8) the
// compiler reduces to h, so that callers looping over columns of one run-time half share it.
template <typename U, typename T, int R, int C>
__device__ __forceinline__ void mul_by_column(rt<U, R, C>& dst, const rt<T, R, C>& x, const rt<T, R, TILE_DIM>& y,
                                              int col) {
  const int src = (laneid() & ~3) | ((col >> 1) & 3), right = col >> 3;
#pragma unroll
  for (int i = 0; i < x.height; i++) {
    const auto& f = y.tiles[i][0];
    const auto top = shfl_sync(select_pair(right != 0, f.data[2], f.data[0]), src);     // rows g
    const auto bottom = shfl_sync(select_pair(right != 0, f.data[3], f.data[1]), src);  // rows g + 8
#pragma unroll
    for (int j = 0; j < x.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const auto pair = (k & 1) ? bottom : top;  // k is a compile-time index
        if constexpr (std::is_same_v<U, T>) {
          dst.tiles[i][j].data[k] = __hmul2(x.tiles[i][j].data[k], select_pair(col & 1, dup_high(pair), dup_low(pair)));
        } else {
          const float2 v = unpack(x.tiles[i][j].data[k]), p = unpack(pair);
          const float a = (col & 1) ? p.y : p.x;
          dst.tiles[i][j].data[k] = pack<U>(v.x * a, v.y * a);
        }
      }
  }
}
template <typename U, typename T, int R, int C>
__device__ __forceinline__ void mul_by_column(rt<U, R, C, layout::col>& dst, const rt<T, R, C, layout::col>& x,
                                              const rt<T, R, TILE_DIM, layout::col>& y, int col) {
  const int src = 4 * (col & 7) + (laneid() & 3), right = col >> 3;
#pragma unroll
  for (int i = 0; i < x.height; i++) {
    const auto& f = y.tiles[i][0];
    const auto lo = shfl_sync(select_pair(right != 0, f.data[1], f.data[0]), src);  // rows 2c, 2c + 1
    const auto hi = shfl_sync(select_pair(right != 0, f.data[3], f.data[2]), src);  // rows 2c + 8, 2c + 9
#pragma unroll
    for (int j = 0; j < x.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const auto pair = k < 2 ? lo : hi;
        if constexpr (std::is_same_v<U, T>) {
          dst.tiles[i][j].data[k] = __hmul2(x.tiles[i][j].data[k], pair);
        } else {
          const float2 v = unpack(x.tiles[i][j].data[k]), p = unpack(pair);
          dst.tiles[i][j].data[k] = pack<U>(v.x * p.x, v.y * p.y);
        }
      }
  }
}
// Row layout, two columns for the price of one shuffle: dst0 = x scaled by y's column col,
// dst1 by column col + 1 (col even), e.g. the second-order features x_a x_b for a and a + 1.
template <typename U, typename T, int R, int C>
__device__ __forceinline__ void mul_by_columns(rt<U, R, C>& dst0, rt<U, R, C>& dst1, const rt<T, R, C>& x,
                                               const rt<T, R, TILE_DIM>& y, int col) {
  const int src = (laneid() & ~3) | ((col >> 1) & 3), right = col >> 3;
#pragma unroll
  for (int i = 0; i < x.height; i++) {
    const auto& f = y.tiles[i][0];
    const auto top = shfl_sync(select_pair(right != 0, f.data[2], f.data[0]), src);
    const auto bottom = shfl_sync(select_pair(right != 0, f.data[3], f.data[1]), src);
    if constexpr (std::is_same_v<U, T>) {
#pragma unroll
      for (int j = 0; j < x.width; j++)
#pragma unroll
        for (int k = 0; k < 4; k++) {
          const auto pair = (k & 1) ? bottom : top;
          dst0.tiles[i][j].data[k] = __hmul2(x.tiles[i][j].data[k], dup_low(pair));
          dst1.tiles[i][j].data[k] = __hmul2(x.tiles[i][j].data[k], dup_high(pair));
        }
    } else {
      const float2 t = unpack(top), b = unpack(bottom);
#pragma unroll
      for (int j = 0; j < x.width; j++)
#pragma unroll
        for (int k = 0; k < 4; k++) {
          const float2 v = unpack(x.tiles[i][j].data[k]), a = (k & 1) ? b : t;
          dst0.tiles[i][j].data[k] = pack<U>(v.x * a.x, v.y * a.x);
          dst1.tiles[i][j].data[k] = pack<U>(v.x * a.y, v.y * a.y);
        }
    }
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

// The sum of all entries of a column vector (every lane gets it): a lane's columns, then the
// four lanes of a row group.
template <int C>
__device__ __forceinline__ float sum(const col_vec<C>& v) {
  float acc = v.data[0][0].x + v.data[0][0].y;
#pragma unroll
  for (int j = 0; j < v.width; j++)
#pragma unroll
    for (int h = j == 0 ? 1 : 0; h < 2; h++) acc = acc + v.data[j][h].x + v.data[j][h].y;
  return reduce_quad(acc, sum_op{});
}

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
