// Cooperative copies between global and shared memory, done by all `Threads` threads of a
// block (or of a contiguous thread group starting at `first_thread`).
//
// Rows past `valid_rows` are zero-filled on load and skipped on store, so tiles may overhang
// the end of a sequence: kernels never ask the caller to pad.
#pragma once

#include "../../types/global_layout.cuh"
#include "../../types/shared_tile.cuh"

namespace kittens {

// Start an asynchronous copy of tile `coord` of `src` into `dst` (rows beyond src.seq or
// beyond row0 + valid_rows become zeros). Completes at cp_async_wait.
template <int Threads, typename T, int R, int C>
__device__ __forceinline__ void load_async(st<T, R, C>& dst, const gl<T>& src, tile_coord coord,
                                           int thread = threadIdx.x) {
  constexpr int chunks_per_row = C * int(sizeof(T)) / 16;
  constexpr int elems_per_chunk = 16 / int(sizeof(T));
  const int valid_rows = min(R, src.seq - coord.row0);
#pragma unroll
  for (int i = thread; i < R * chunks_per_row; i += Threads) {
    const int r = i / chunks_per_row, c = (i % chunks_per_row) * elems_per_chunk;
    const bool in_bounds = r < valid_rows;
    const T* g = src.row(coord.b, in_bounds ? coord.row0 + r : 0, coord.h) + c;
    cp_async_16(dst.addr(r, c), g, in_bounds ? 16 : 0);
  }
}

// Start an asynchronous copy of src[0 .. N) into the shared vector `dst`, 4 bytes at a time (src
// need only be float-aligned, e.g. a row of per-token statistics); elements from `valid` on
// become zeros. Completes at cp_async_wait.
template <int Threads, int N>
__device__ __forceinline__ void load_async(sv_fl<N>& dst, const float* src, int valid, int thread = threadIdx.x) {
  for (int t = thread; t < N; t += Threads)
    cp_async_4(shared_addr(dst.data + t), src + (t < valid ? t : 0), t < valid ? 4 : 0);
}

// Synchronous store of a shared tile to global, skipping rows past the end of the sequence.
template <int Threads, typename T, int R, int C>
__device__ __forceinline__ void store(const gl<T>& dst, const st<T, R, C>& src, tile_coord coord,
                                      int thread = threadIdx.x) {
  constexpr int chunks_per_row = C * int(sizeof(T)) / 16;
  constexpr int elems_per_chunk = 16 / int(sizeof(T));
  const int valid_rows = min(R, dst.seq - coord.row0);
#pragma unroll
  for (int i = thread; i < R * chunks_per_row; i += Threads) {
    const int r = i / chunks_per_row, c = (i % chunks_per_row) * elems_per_chunk;
    if (r < valid_rows) {
      *reinterpret_cast<int4*>(dst.row(coord.b, coord.row0 + r, coord.h) + c) =
          *reinterpret_cast<const int4*>(src.ptr(r, c));
    }
  }
}

}  // namespace kittens
