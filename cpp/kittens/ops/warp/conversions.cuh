// Conversions of register tiles: element types, a float tile as two 16-bit tiles, layouts.
// (The free transpose, a tile of X in one layout read as X^T in the other, is as_transpose in
// register_tile.cuh.)
#pragma once

#include "../../types/register_tile.cuh"

namespace kittens {

// Element type conversion between tiles of one layout (e.g. fp32 scores -> bf16 probabilities,
// which are then directly the A operand of the next mma). To the same type it is a plain copy.
// (Register by register: the tiles' own assignment copies the 16-bit pair arrays in a loop,
// which can leave them in local memory.)
template <typename U, typename V, int R, int C, typename L>
__device__ __forceinline__ void copy(rt<U, R, C, L>& dst, const rt<V, R, C, L>& src) {
#pragma unroll
  for (int i = 0; i < dst.height; i++)
#pragma unroll
    for (int j = 0; j < dst.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        if constexpr (std::is_same_v<U, V>) {
          dst.tiles[i][j].data[k] = src.tiles[i][j].data[k];
        } else {
          const float2 v = unpack(src.tiles[i][j].data[k]);
          dst.tiles[i][j].data[k] = pack<U>(v.x, v.y);
        }
      }
}

// An fp32 tile as the sum of two 16-bit tiles: hi = src rounded, lo = (src - hi) rounded, so
// that hi + lo is src to about 2^-16 of itself in bf16. For sums that nearly cancel: fed to the
// tensor cores as hi and lo (two mma), each term keeps that accuracy instead of 2^-8.
template <typename T, int R, int C>
__device__ __forceinline__ void split(rt<T, R, C>& hi, rt<T, R, C>& lo, const rt_fl<R, C>& src) {
  static_assert(is_16bit<T>, "split makes 16-bit tiles");
#pragma unroll
  for (int i = 0; i < src.height; i++)
#pragma unroll
    for (int j = 0; j < src.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float2 x = src.tiles[i][j].data[k];
        hi.tiles[i][j].data[k] = pack<T>(x.x, x.y);
        const float2 h = unpack(hi.tiles[i][j].data[k]);
        lo.tiles[i][j].data[k] = pack<T>(x.x - h.x, x.y - h.y);
      }
}

// One of the two parts: hi (part 0) or lo (part 1), for a product that different warps each
// take one part of.
template <typename T, int R, int C>
__device__ __forceinline__ void split(rt<T, R, C>& dst, const rt_fl<R, C>& src, int part) {
  static_assert(is_16bit<T>, "split makes 16-bit tiles");
#pragma unroll
  for (int i = 0; i < src.height; i++)
#pragma unroll
    for (int j = 0; j < src.width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float2 x = src.tiles[i][j].data[k];
        const packed_t<T> hi = pack<T>(x.x, x.y);
        const float2 h = unpack(hi);
        dst.tiles[i][j].data[k] = part == 0 ? hi : pack<T>(x.x - h.x, x.y - h.y);
      }
}

// The same matrix in the other layout (16-bit tiles), in registers: movmatrix transposes each
// 8 x 8 block of a base tile across the warp's lanes, and the two off-diagonal blocks trade
// registers (row layout holds (rows 8-15, cols 0-7) in data[1], col layout in data[2]).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
template <typename T, int R, int C, typename L, typename M>
__device__ __forceinline__ void swap_layout(rt<T, R, C, L>& dst, const rt<T, R, C, M>& src) {
  static_assert(is_16bit<T> && !std::is_same_v<L, M>, "swap_layout moves 16-bit tiles to the other layout");
#pragma unroll
  for (int i = 0; i < src.height; i++)
#pragma unroll
    for (int j = 0; j < src.width; j++) {
      const auto& s = src.tiles[i][j];
      auto& d = dst.tiles[i][j];
      d.data[0] = from_u32<packed_t<T>>(movmatrix_trans(as_u32(s.data[0])));
      d.data[1] = from_u32<packed_t<T>>(movmatrix_trans(as_u32(s.data[2])));
      d.data[2] = from_u32<packed_t<T>>(movmatrix_trans(as_u32(s.data[1])));
      d.data[3] = from_u32<packed_t<T>>(movmatrix_trans(as_u32(s.data[3])));
    }
}

}  // namespace kittens
