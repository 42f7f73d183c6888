// Short fp32 rows that one warp fetches for its own use ahead of time (a query tile's
// per-column statistics, say). Its lanes copy 16-byte pieces with cp.async into a buffer that
// only this warp touches, so the loads' latency passes while the warp works and no other warp
// has to be told when they land.
#pragma once

#include "../../common/base.cuh"

namespace kittens {

template <int Rows, int Cols>
struct warp_rows {
  static_assert(Cols % 4 == 0, "rows are copied in 16-byte pieces");
  alignas(16) float row[Rows][Cols];
};

// Start copying src[r][0 .. Cols) (16-byte aligned) into dst.row[r] for every r, as one
// cp.async group of this warp. The rows may be read once wait_rows has returned.
template <int Rows, int Cols>
__device__ __forceinline__ void load_rows_async(warp_rows<Rows, Cols>& dst, const float* const (&src)[Rows]) {
  constexpr int pieces = Cols / 4, total = Rows * pieces;
#pragma unroll
  for (int k = 0; k < (total + 31) / 32; k++) {
    const int i = laneid() + 32 * k, r = i / pieces, c = 4 * (i % pieces);
    const float* from = src[0];  // src[r] by selects: a runtime index would put src on the stack
#pragma unroll
    for (int j = 1; j < Rows; j++) from = r == j ? src[j] : from;
    if (total % 32 == 0 || i < total) cp_async_16(shared_addr(&dst.row[r][c]), from + c, 16);
  }
  cp_async_commit();
}

// Wait until at most `Pending` of this warp's later row groups are in flight; the landed rows
// are then visible to every lane (a lane reads pieces that other lanes copied).
template <int Pending>
__device__ __forceinline__ void wait_rows() {
  cp_async_wait<Pending>();
  __syncwarp();
}

}  // namespace kittens
