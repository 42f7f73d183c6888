// Warp-level moves between shared tiles and register tiles, and from register tiles to global.
#pragma once

#include "../../types/global_layout.cuh"
#include "../../types/register_tile.cuh"
#include "../../types/shared_tile.cuh"

namespace kittens {

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// Row layout: rows [row0, row0+R) and cols [col0, col0+C) of `src`.
// ldmatrix's four 8x8 matrices are (rows 0-7 | 8-15) x (cols 0-7 | 8-15); lane l points at
// row l % 16 of column half l / 16, which yields data[0..3] in the order of register_tile.cuh.
template <typename T, int R, int C, int SR, int SC>
__device__ __forceinline__ void load(rt<T, R, C, layout::row>& dst, const st<T, SR, SC>& src, int row0 = 0,
                                     int col0 = 0) {
  const int lane = laneid();
  const int r_in = lane % 16, c_in = (lane / 16) * 8;
#pragma unroll
  for (int i = 0; i < dst.height; i++)
#pragma unroll
    for (int j = 0; j < dst.width; j++) {
      auto& t = dst.tiles[i][j];
      ldmatrix_x4(src.addr(row0 + 16 * i + r_in, col0 + 16 * j + c_in), as_u32(t.data[0]), as_u32(t.data[1]),
                  as_u32(t.data[2]), as_u32(t.data[3]));
    }
}

// Col layout: the tile of `src` at (row0, col0) held transposed, as mma's B operand wants a
// row-major K x N matrix. Matrices: data[0] = (k 0-7, n 0-7), data[1] = (k 0-7, n 8-15),
// data[2] = (k 8-15, n 0-7), data[3] = (k 8-15, n 8-15).
template <typename T, int R, int C, int SR, int SC>
__device__ __forceinline__ void load(rt<T, R, C, layout::col>& dst, const st<T, SR, SC>& src, int row0 = 0,
                                     int col0 = 0) {
  const int lane = laneid();
  const int r_in = (lane % 8) + 8 * (lane / 16), c_in = 8 * ((lane / 8) % 2);
#pragma unroll
  for (int i = 0; i < dst.height; i++)
#pragma unroll
    for (int j = 0; j < dst.width; j++) {
      auto& t = dst.tiles[i][j];
      ldmatrix_x4_trans(src.addr(row0 + 16 * i + r_in, col0 + 16 * j + c_in), as_u32(t.data[0]),
                        as_u32(t.data[1]), as_u32(t.data[2]), as_u32(t.data[3]));
    }
}

// A lane's columns of the vector v[0 .. Cols) (shared or global memory, 8-byte aligned).
template <int Cols>
__device__ __forceinline__ void load(col_vec<Cols>& dst, const float* v) {
#pragma unroll
  for (int j = 0; j < dst.width; j++)
#pragma unroll
    for (int h = 0; h < 2; h++) dst.data[j][h] = *reinterpret_cast<const float2*>(v + 16 * j + fragment_col(2 * h, 0));
}

// A lane's rows of the vector v[0 .. Rows) (shared or global memory).
template <int Rows>
__device__ __forceinline__ void load(row_vec<Rows>& dst, const float* v) {
#pragma unroll
  for (int i = 0; i < dst.height; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) dst.data[i][h] = v[row_vec_row(i, h)];
}

// A lane's rows of v to the vector dst[0 .. rows) (shared or global memory), rows from `rows`
// on skipped: the four lanes of a row hold the same value, and the first of them writes it.
template <int Rows>
__device__ __forceinline__ void store(float* dst, const row_vec<Rows>& v, int rows = Rows) {
  if ((laneid() & 3) != 0) return;
#pragma unroll
  for (int i = 0; i < v.height; i++)
#pragma unroll
    for (int h = 0; h < 2; h++)
      if (row_vec_row(i, h) < rows) dst[row_vec_row(i, h)] = v.data[i][h];
}

__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                                  uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// The transpose of a 16-bit register tile (row layout) into a shared tile of the same type:
// dst(row0 + c, col0 + r) = src(r, c), row0 and col0 multiples of 16. Register data[q] holds the
// 8 x 8 block at src rows 8 (q & 1), columns 8 (q >> 1); stmatrix .trans writes each block
// transposed, and lane l gives the address of row l % 8 of block l / 8's destination.
template <typename T, int R, int C, int SR, int SC>
__device__ __forceinline__ void store_transposed(st<T, SR, SC>& dst, const rt<T, R, C, layout::row>& src,
                                                 int row0 = 0, int col0 = 0) {
  static_assert(sizeof(T) == 2, "stmatrix moves 16-bit values");
  const int lane = laneid(), q = lane / 8;
  const int r_in = 8 * (q >> 1) + lane % 8, c_in = 8 * (q & 1);
#pragma unroll
  for (int i = 0; i < src.height; i++)
#pragma unroll
    for (int j = 0; j < src.width; j++) {
      const auto& t = src.tiles[i][j];
      stmatrix_x4_trans(dst.addr(row0 + 16 * j + r_in, col0 + 16 * i + c_in), as_u32(t.data[0]), as_u32(t.data[1]),
                        as_u32(t.data[2]), as_u32(t.data[3]));
    }
}

// Register tile (row layout) into a shared tile, converting to the tile's type (16-bit or
// fp32 values); row0 must be a multiple of 8 and col0 of 16. Swizzling permutes 16-byte chunks
// within an 8-row atom of one panel, so moving down 8 rows or across whole panels adds a
// constant to an element's offset: a lane computes the swizzled offsets of the few columns it
// touches within a panel and adds the rest, instead of swizzling every element's address.
template <typename T, typename U, int R, int C, int SR, int SC>
__device__ __forceinline__ void store(st<T, SR, SC>& dst, const rt<U, R, C, layout::row>& src, int row0 = 0,
                                      int col0 = 0) {
  using tile = st<T, SR, SC>;
  const uint32_t base = shared_addr(dst.data) + uint32_t(row0) * tile::swizzle_bytes;
  // Offset of (lane_row, c16 + lane_col), lane_row < 16, lane_col < 16, c16 a multiple of 16.
  // Within a panel, the swizzle XORs a row's chunk bits with a constant of its row, and
  // (c16 % panel_cols) * sizeof(T) sets chunk bits that lane_col * sizeof(T) leaves clear, so
  // offset(r, c16 + c) = offset(r, c) ^ (c16 % panel_cols) * sizeof(T): a lane swizzles once
  // and every further 16-column step is one XOR.
  auto offset = [](int lane_row, int c16, int lane_col) {
    return (tile::offset(lane_row, lane_col) ^ uint32_t(c16 % tile::panel_cols) * uint32_t(sizeof(T))) +
           uint32_t(c16 / tile::panel_cols) * (SR * tile::swizzle_bytes);
  };
  if constexpr (std::is_same_v<T, U> && sizeof(T) == 2) {
    // Same 16-bit type: one stmatrix per 16x16 base tile, the inverse of load()'s ldmatrix
    // (lane l gives the address of row l % 16 of column half l / 16).
    const int lane = laneid();
#pragma unroll
    for (int j = 0; j < src.width; j++) {
      const uint32_t col_base = base + offset(lane % 16, col0 + 16 * j, (lane / 16) * 8);
#pragma unroll
      for (int i = 0; i < src.height; i++) {
        const auto& t = src.tiles[i][j];
        stmatrix_x4(col_base + 16 * i * tile::swizzle_bytes, as_u32(t.data[0]), as_u32(t.data[1]),
                    as_u32(t.data[2]), as_u32(t.data[3]));
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < src.width; j++)
#pragma unroll
      for (int half = 0; half < 2; half++) {  // registers 2 * half (rows g) and 2 * half + 1 (rows g + 8)
        const uint32_t col_base = base + offset(fragment_row(0), col0 + 16 * j, fragment_col(2 * half, 0));
#pragma unroll
        for (int i = 0; i < src.height; i++)
#pragma unroll
          for (int down = 0; down < 2; down++) {
            const float2 v = unpack(src.tiles[i][j].data[2 * half + down]);
            const uint32_t addr = col_base + (16 * i + 8 * down) * tile::swizzle_bytes;
            if constexpr (sizeof(T) == 2)
              asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(as_u32(pack<T>(v.x, v.y))) : "memory");
            else
              asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
          }
      }
  }
}

// "Fragment order" is a warp's own register order for an fp32 register tile, for data that is
// put in row order later: lane l's quad n (the two pairs of registers 2 half and 2 half + 1)
// goes to floats 4 (32 n + l), so each 16-byte access of a warp covers 512 contiguous bytes.
// Quad n = (i * width + j) * 2 + half holds, in order, rows 16 i + g and 16 i + 8 + g
// (down = 0, 1), columns 16 j + 8 half + 2 t and + 1 of the tile, where l = 4 g + t.
//
// A tile into shared memory in fragment order, for data that leaves by bulk copy: no bank
// conflicts, no address arithmetic. dst: 16-byte aligned, R * C floats.
template <int R, int C>
__device__ __forceinline__ void store_fragments(float* dst, const rt_fl<R, C>& src) {
  const uint32_t base = shared_addr(dst) + 16 * laneid();
#pragma unroll
  for (int i = 0; i < src.height; i++)
#pragma unroll
    for (int j = 0; j < src.width; j++)
#pragma unroll
      for (int half = 0; half < 2; half++) {  // registers 2 half + down: rows g + 8 down
        const int n = (i * src.width + j) * 2 + half;
        const float2 top = unpack(src.tiles[i][j].data[2 * half]), bottom = unpack(src.tiles[i][j].data[2 * half + 1]);
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(base + 512 * n), "f"(top.x), "f"(top.y),
                     "f"(bottom.x), "f"(bottom.y)
                     : "memory");
      }
}

// The inverse of store_fragments: a tile from shared memory in fragment order (e.g. one that
// another warp of the block stored), with the same conflict-free 16-byte accesses.
template <int R, int C>
__device__ __forceinline__ void load_fragments(rt_fl<R, C>& dst, const float* src) {
  const uint32_t base = shared_addr(src) + 16 * laneid();
#pragma unroll
  for (int i = 0; i < dst.height; i++)
#pragma unroll
    for (int j = 0; j < dst.width; j++)
#pragma unroll
      for (int half = 0; half < 2; half++) {
        const int n = (i * dst.width + j) * 2 + half;
        float2 &top = dst.tiles[i][j].data[2 * half], &bottom = dst.tiles[i][j].data[2 * half + 1];
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(top.x), "=f"(top.y), "=f"(bottom.x), "=f"(bottom.y)
                     : "r"(base + 512 * n)
                     : "memory");
      }
}

// The same from global memory: the inverse of atomic_add_fragments, each 16-byte load of a
// warp reading 512 contiguous bytes. src: 16-byte aligned, R * C floats.
template <int R, int C>
__device__ __forceinline__ void load_global_fragments(rt_fl<R, C>& dst, const float* src) {
  const float4* lane_src = reinterpret_cast<const float4*>(src) + laneid();
#pragma unroll
  for (int i = 0; i < dst.height; i++)
#pragma unroll
    for (int j = 0; j < dst.width; j++)
#pragma unroll
      for (int half = 0; half < 2; half++) {  // quad n: registers 2 half (row g) and 2 half + 1 (row g + 8)
        const float4 quad = lane_src[32 * ((i * dst.width + j) * 2 + half)];
        dst.tiles[i][j].data[2 * half] = make_float2(quad.x, quad.y);
        dst.tiles[i][j].data[2 * half + 1] = make_float2(quad.z, quad.w);
      }
}

// Register tile (row layout) straight to global, converting to T; rows past dst.seq skipped.
// 16-bit T: the four lanes of a quad hold 16 columns of rows g and g + 8 of a base tile, 4 bytes
// per lane per 8-column chunk. Two rounds of shuffles transpose that 4 x 4 block of words, so
// each lane writes one whole 16-byte chunk: a quarter of the store instructions, and full
// 32-byte sectors. Other T: each lane writes its pairs, finding each row's address once.
template <typename T, typename U, int R, int C>
__device__ __forceinline__ void store(const gl<T>& dst, const rt<U, R, C, layout::row>& src, tile_coord coord) {
  if constexpr (sizeof(T) == 2) {
    const int t = laneid() & 3;  // this lane writes chunk t: rows g + 8 (t >> 1), columns 8 (t & 1) ..
#pragma unroll
    for (int i = 0; i < src.height; i++) {
      const int r = coord.row0 + 16 * i + fragment_row(0) + 8 * (t >> 1);
      T* row = dst.row(coord.b, min(r, dst.seq - 1), coord.h) + 8 * (t & 1);
#pragma unroll
      for (int j = 0; j < src.width; j++) {
        uint32_t x[4];  // x[c]: this lane's word of chunk c = 2 * down + half (register 2 * half + down)
#pragma unroll
        for (int c = 0; c < 4; c++) {
          const float2 v = unpack(src.tiles[i][j].data[2 * (c & 1) + (c >> 1)]);
          x[c] = as_u32(pack<T>(v.x, v.y));
        }
#pragma unroll
        for (int m = 1; m <= 2; m *= 2)  // swap the words whose chunk bit m differs from the lane's
#pragma unroll
          for (int c0 = 0; c0 < 4; c0++) {
            if (c0 & m) continue;
            const bool hi = t & m;
            const uint32_t got = __shfl_xor_sync(0xffffffffu, hi ? x[c0] : x[c0 | m], m);
            if (hi) x[c0] = got;
            else x[c0 | m] = got;
          }
        if (r < dst.seq) *reinterpret_cast<uint4*>(row + 16 * j) = make_uint4(x[0], x[1], x[2], x[3]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < src.height; i++)
#pragma unroll
      for (int down = 0; down < 2; down++) {  // registers 2 * half + down sit 8 rows lower
        const int r = coord.row0 + 16 * i + fragment_row(down);
        if (r >= dst.seq) continue;
        T* row = dst.row(coord.b, r, coord.h) + fragment_col(0, 0);
#pragma unroll
        for (int j = 0; j < src.width; j++)
#pragma unroll
          for (int half = 0; half < 2; half++) {
            const float2 v = unpack(src.tiles[i][j].data[2 * half + down]);
            *reinterpret_cast<packed_t<T>*>(row + 16 * j + 8 * half) = pack<T>(v.x, v.y);
          }
      }
  }
}

// Atomically add a tile into global memory laid out in fragment order (above):
// each vector reduction instruction (red.global.add.v4.f32, sm_90) covers four whole 128-byte
// lines, where row-order adds from a fragment reach one 32-byte sector per row. dst: 16-byte
// aligned, R * C floats.
template <int R, int C>
__device__ __forceinline__ void atomic_add_fragments(float* dst, const rt_fl<R, C>& src) {
  float* lane_dst = dst + 4 * laneid();
#pragma unroll
  for (int i = 0; i < src.height; i++)
#pragma unroll
    for (int j = 0; j < src.width; j++)
#pragma unroll
      for (int half = 0; half < 2; half++) {
        const int n = (i * src.width + j) * 2 + half;
        const float2 top = unpack(src.tiles[i][j].data[2 * half]), bottom = unpack(src.tiles[i][j].data[2 * half + 1]);
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(lane_dst + 128 * n), "f"(top.x),
                     "f"(top.y), "f"(bottom.x), "f"(bottom.y)
                     : "memory");
      }
}

}  // namespace kittens
