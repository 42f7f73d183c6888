// Global tensors in the [batch, seq, heads, dim] layout the public API uses.
// Tiles span `seq` (rows) x `dim` (columns) at one (batch, head); strides are in elements, so
// a view of any strided tensor works, but the innermost dimension must be contiguous.
#pragma once

#include "../common/base.cuh"

namespace kittens {

template <typename T>
struct gl {
  T* ptr;
  int batch, seq, heads, dim;
  int64_t batch_stride, seq_stride, head_stride;

  // A contiguous [batch, seq, heads, dim] tensor.
  __host__ __device__ static gl contiguous(T* p, int b, int s, int h, int d) {
    return gl{p, b, s, h, d, int64_t(s) * h * d, int64_t(h) * d, int64_t(d)};
  }
  __host__ __device__ __forceinline__ T* row(int b, int s, int h) const {
    return ptr + b * batch_stride + s * seq_stride + h * head_stride;
  }
};

// Which tile: batch b, head h, rows [row0, row0 + tile rows), all of `dim`.
struct tile_coord {
  int b, h, row0;
};

}  // namespace kittens
