// Warp-level matrix multiply-accumulate on register tiles with mma.sync.m16n8k16 (fp32 accum).
//   mma_AB (d, a, b, c):  d = a @ b   + c,  a row-layout [M, K], b col-layout [K, N]
//   mma_ABt(d, a, b, c):  d = a @ b^T + c,  a row-layout [M, K], b row-layout [N, K]
// (d may be c: d += a @ b.) Sums along rows or columns through the tensor cores:
//   mma_row_sum(v, a):     v[r] += sum_k a[r][k]             a row-layout, 16-bit
//   mma_col_sum(v, x, w):  v[n] += sum_k w[k] x[k][n]        x col-layout [K, N], 16-bit
// Both B layouts put the pair (k = 2c..2c+1, n = g) in data[0] and (k + 8, n) in data[2] for
// the first 8 columns of n, data[1] / data[3] for the next 8, so one helper serves both.
#pragma once

#include "../../types/register_tile.cuh"

namespace kittens {

namespace detail {
template <typename T>
__device__ __forceinline__ void mma_16816(float2& d0, float2& d1, const rt_base<T, layout::row>& a, uint32_t b0,
                                          uint32_t b1) {
  const uint32_t* A = reinterpret_cast<const uint32_t*>(a.data);
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d0.x), "+f"(d0.y), "+f"(d1.x), "+f"(d1.y)
        : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d0.x), "+f"(d0.y), "+f"(d1.x), "+f"(d1.y)
        : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(b0), "r"(b1));
  }
}

// d(16x16) += a(16x16) * B(16x16) where b holds B in the B-operand order described above.
template <typename T, typename BL>
__device__ __forceinline__ void mma_base(rt_base<float, layout::row>& d, const rt_base<T, layout::row>& a,
                                         const rt_base<T, BL>& b) {
  const uint32_t* B = reinterpret_cast<const uint32_t*>(b.data);
  mma_16816(d.data[0], d.data[1], a, B[0], B[2]);  // output columns 0-7
  mma_16816(d.data[2], d.data[3], a, B[1], B[3]);  // output columns 8-15
}
}  // namespace detail

template <typename T, int M, int N, int K>
__device__ __forceinline__ void mma_AB(rt_fl<M, N>& d, const rt<T, M, K, layout::row>& a,
                                       const rt<T, K, N, layout::col>& b, const rt_fl<M, N>& c) {
  if (&d != &c) d = c;
#pragma unroll
  for (int i = 0; i < d.height; i++)
#pragma unroll
    for (int j = 0; j < d.width; j++)
#pragma unroll
      for (int k = 0; k < a.width; k++) detail::mma_base(d.tiles[i][j], a.tiles[i][k], b.tiles[k][j]);
}

template <typename T, int M, int N, int K>
__device__ __forceinline__ void mma_ABt(rt_fl<M, N>& d, const rt<T, M, K, layout::row>& a,
                                        const rt<T, N, K, layout::row>& b, const rt_fl<M, N>& c) {
  if (&d != &c) d = c;
#pragma unroll
  for (int i = 0; i < d.height; i++)
#pragma unroll
    for (int j = 0; j < d.width; j++)
#pragma unroll
      for (int k = 0; k < a.width; k++) detail::mma_base(d.tiles[i][j], a.tiles[i][k], b.tiles[j][k]);
}

// Row sums of a 16-bit tile as the tensor cores add them (in fp32): the mma of a with columns
// of ones. v[r] += sum_k a[r][k]. E.g. a softmax-like normaliser that sums exactly the rounded
// weights the product with V used.
template <typename T, int R, int K>
__device__ __forceinline__ void mma_row_sum(row_vec<R>& v, const rt<T, R, K, layout::row>& a) {
  const uint32_t ones = as_u32(pack<T>(1.f, 1.f));
#pragma unroll
  for (int i = 0; i < a.height; i++) {
    float2 top = make_float2(v.data[i][0], 0.f), bottom = make_float2(v.data[i][1], 0.f);  // rows g, g + 8
#pragma unroll
    for (int k = 0; k < a.width; k++) detail::mma_16816(top, bottom, a.tiles[i][k], ones, ones);  // 8 columns alike
    v.data[i][0] = top.x;
    v.data[i][1] = bottom.x;
  }
}

// Weighted column sums through the tensor cores: v[n] += sum_k w[k] x[k][n], w rounded to T
// (or all ones without w), as the product of a [16, K] tile whose rows all are w with x (every
// row of the product is the same sum; a lane keeps its row g).
template <typename T, int K, int N>
__device__ __forceinline__ void mma_col_sum(col_vec<N>& v, const rt<T, K, N, layout::col>& x, const col_vec<K>& w) {
  rt<T, TILE_DIM, K> rows_w;
#pragma unroll
  for (int k = 0; k < rows_w.width; k++)
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const float2 f = w.data[k][q >> 1];  // registers 0, 1: columns 2c, 2c + 1; 2, 3: 2c + 8, 2c + 9
      rows_w.tiles[0][k].data[q] = pack<T>(f.x, f.y);
    }
  rt_fl<TILE_DIM, N> sums;
#pragma unroll
  for (int j = 0; j < sums.width; j++)
#pragma unroll
    for (int q = 0; q < 4; q++) sums.tiles[0][j].data[q] = make_float2(0.f, 0.f);
  mma_AB(sums, rows_w, x, sums);
#pragma unroll
  for (int j = 0; j < sums.width; j++)
#pragma unroll
    for (int h = 0; h < 2; h++) {  // register 2 h: row g, columns 2c + 8 h, + 1
      v.data[j][h].x += sums.tiles[0][j].data[2 * h].x;
      v.data[j][h].y += sums.tiles[0][j].data[2 * h].y;
    }
}
template <typename T, int K, int N>
__device__ __forceinline__ void mma_col_sum(col_vec<N>& v, const rt<T, K, N, layout::col>& x) {
  col_vec<K> ones;
#pragma unroll
  for (int k = 0; k < ones.width; k++) ones.data[k][0] = ones.data[k][1] = make_float2(1.f, 1.f);
  mma_col_sum(v, x, ones);
}

}  // namespace kittens
