// Host side of TMA: tensor maps (descriptors) over [batch, seq, heads, dim] tensors whose
// boxes land in shared memory as kittens' 128-byte-swizzled tiles.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

namespace kittens::tma {

// The driver's encoder, found once through the runtime (no link against libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A map over a contiguous [batch, seq, heads, dim] tensor of 16-bit values (dim a multiple
// of 64) whose box is `box_rows` x dim at one (batch, head). The box is described as
// (64 columns, rows, dim / 64 panels) so that it lands panel by panel, which is the shared
// tile layout of st<T, box_rows, dim>. Rows past `seq` read as zeros.
inline bool make_bshd_map(CUtensorMap* map, const void* ptr, bool bf16, int batch, int seq, int heads, int dim,
                          int box_rows) {
  auto encode = encoder();
  if (!encode || dim % 64 != 0) return false;
  const uint64_t e = 2;  // bytes per element
  const cuuint64_t dims[5] = {64, cuuint64_t(seq), cuuint64_t(dim / 64), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[4] = {uint64_t(heads) * dim * e, 64 * e, uint64_t(dim) * e,
                                 uint64_t(seq) * heads * dim * e};
  const cuuint32_t box[5] = {64, cuuint32_t(box_rows), cuuint32_t(dim / 64), 1, 1};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 5,
                            const_cast<void*>(ptr), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

}  // namespace kittens::tma
