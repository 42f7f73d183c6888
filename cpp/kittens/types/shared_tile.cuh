// Shared-memory tiles in the hardware swizzle layouts that TMA and wgmma understand.
//
// A tile of Rows x Cols 16-bit values is stored as column panels `panel_cols` wide (one
// swizzle span: 128, 64 or 32 bytes). Inside a panel, row r starts at r * swizzle_bytes and the
// 16-byte chunks of a row are permuted by XOR with the row's position in the swizzle atom, so
// that the 8 row addresses an ldmatrix (or a column walk) touches fall in different banks.
// The base must be aligned to the atom (8 rows x swizzle_bytes).
// Two orders of the atoms (8 rows of one panel each):
//   panel_major: panel by panel, each panel all its rows (a panel is Rows x swizzle_bytes);
//   grouped_rows: 8-row group by group, each group all its panels, so that a TMA box of a few
//     rows of every panel lands in one piece (wgmma reads either: its descriptors take the
//     panels' and the groups' distances, panel_bytes and group_bytes).
#pragma once

#include "../common/base.cuh"

namespace kittens {

enum class atoms { panel_major, grouped_rows };

template <typename T, int Rows, int Cols, atoms Order = atoms::panel_major>
struct st {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "shared tiles hold 16-bit or fp32 values");
  static_assert(Rows % 8 == 0 && Cols % 16 == 0, "shared tiles are 8-row, 16-column multiples");
  using dtype = T;
  static constexpr int rows = Rows, cols = Cols;
  static constexpr int row_bytes = Cols * int(sizeof(T));
  static constexpr int swizzle_bytes = row_bytes % 128 == 0 ? 128 : row_bytes % 64 == 0 ? 64 : 32;
  static constexpr int panel_cols = swizzle_bytes / int(sizeof(T));
  static constexpr int panels = Cols / panel_cols;
  static constexpr int atom_bytes = 8 * swizzle_bytes;
  static constexpr int bytes = Rows * Cols * int(sizeof(T));
  static constexpr bool grouped = Order == atoms::grouped_rows;
  // From a panel to the next, and from an 8-row group to the next, in bytes.
  static constexpr int panel_bytes = grouped ? atom_bytes : Rows * swizzle_bytes;
  static constexpr int group_bytes = grouped ? panels * atom_bytes : atom_bytes;

  alignas(1024) T data[Rows * Cols];

  // Byte offset of row r's span in panel `panel` (the swizzle permutes chunks only inside it).
  __device__ static __forceinline__ uint32_t row_offset(int r, int panel) {
    return grouped ? panel * panel_bytes + (r / 8) * group_bytes + (r % 8) * swizzle_bytes
                   : (panel * Rows + r) * swizzle_bytes;
  }
  // Byte offset of element (r, c) from the tile's start, after swizzling.
  __device__ static __forceinline__ uint32_t offset(int r, int c) {
    const uint32_t linear = row_offset(r, c / panel_cols) + (c % panel_cols) * sizeof(T);
    const uint32_t chunk_xor = ((linear % atom_bytes) >> 7) << 4;
    return linear ^ chunk_xor;
  }
  __device__ __forceinline__ T* ptr(int r, int c) {
    return reinterpret_cast<T*>(reinterpret_cast<char*>(data) + offset(r, c));
  }
  __device__ __forceinline__ const T* ptr(int r, int c) const {
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(data) + offset(r, c));
  }
  __device__ __forceinline__ uint32_t addr(int r, int c) const { return shared_addr(data) + offset(r, c); }
};

// A shared vector of floats (e.g. a row of statistics shared by warps).
template <int N>
struct sv_fl {
  float data[N];
};

}  // namespace kittens
