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

// A map over a contiguous [batch, seq, heads, dim] tensor whose box is `box_rows` x
// `box_cols` at one (batch, head): described as (panel columns, rows, box_cols / panel
// columns panels), a panel being 128 bytes of a row (64 16-bit or 32 fp32 values), so that it
// lands panel by panel: the shared tile layout of st<T, box_rows, box_cols>. Rows past `seq`
// read as zeros and are not written. dim and box_cols must be multiples of the panel width.
// With box_heads > 1 (box_cols one panel) a box spans that many heads from its head
// coordinate: it lands as box_heads runs of box_rows rows, one a head.
inline bool make_bshd_map(CUtensorMap* map, const void* ptr, CUtensorMapDataType type, int element_bytes,
                          int batch, int seq, int heads, int dim, int box_rows, int box_cols, int box_heads = 1) {
  auto encode = encoder();
  const int panel = 128 / element_bytes;
  if (!encode || dim % panel != 0 || box_cols % panel != 0 || box_cols > dim || box_heads > heads ||
      (box_heads > 1 && box_cols != panel))
    return false;
  const uint64_t e = uint64_t(element_bytes);
  const cuuint64_t dims[5] = {cuuint64_t(panel), cuuint64_t(seq), cuuint64_t(dim / panel), cuuint64_t(heads),
                              cuuint64_t(batch)};
  const cuuint64_t strides[4] = {uint64_t(heads) * dim * e, panel * e, uint64_t(dim) * e,
                                 uint64_t(seq) * heads * dim * e};
  const cuuint32_t box[5] = {cuuint32_t(panel), cuuint32_t(box_rows), cuuint32_t(box_cols / panel),
                             cuuint32_t(box_heads), 1};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode(map, type, 5, const_cast<void*>(ptr), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// A map over a contiguous [batch, seq, heads, dim] tensor (seq a multiple of 8) whose box is
// `box_rows` rows (a multiple of 8, not crossing a batch row) of every column at one head,
// landing in 8-row groups of all panels: the shared layout of st<T, rows, dim,
// atoms::grouped_rows>. Described as (panel columns, 8 rows, panels, 8-row groups of the whole
// tensor, heads); a box's coordinates are (0, 0, 0, (b seq + row) / 8, head).
inline bool make_grouped_rows_map(CUtensorMap* map, const void* ptr, CUtensorMapDataType type, int element_bytes,
                                  int batch, int seq, int heads, int dim, int box_rows) {
  auto encode = encoder();
  const int panel = 128 / element_bytes;
  const uint64_t groups = uint64_t(batch) * seq / 8;
  if (!encode || dim % panel != 0 || seq % 8 != 0 || box_rows % 8 != 0 || box_rows > seq || box_rows / 8 > 256 ||
      groups >= (uint64_t(1) << 31))
    return false;
  const uint64_t e = uint64_t(element_bytes), row = uint64_t(heads) * dim * e;
  const cuuint64_t dims[5] = {cuuint64_t(panel), 8, cuuint64_t(dim / panel), groups, cuuint64_t(heads)};
  const cuuint64_t strides[4] = {row, panel * e, 8 * row, uint64_t(dim) * e};
  const cuuint32_t box[5] = {cuuint32_t(panel), 8, cuuint32_t(dim / panel), cuuint32_t(box_rows / 8), 1};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode(map, type, 5, const_cast<void*>(ptr), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// The 16-bit case with the whole row in the box (Q, K, V, dO tiles).
inline bool make_bshd_map(CUtensorMap* map, const void* ptr, bool bf16, int batch, int seq, int heads, int dim,
                          int box_rows) {
  return make_bshd_map(map, ptr, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                       batch, seq, heads, dim, box_rows, dim);
}

// fp32 tensors (e.g. a gradient accumulator), a box of `box_cols` columns.
inline bool make_bshd_map_f32(CUtensorMap* map, const float* ptr, int batch, int seq, int heads, int dim,
                              int box_rows, int box_cols) {
  return make_bshd_map(map, ptr, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, batch, seq, heads, dim, box_rows, box_cols);
}

}  // namespace kittens::tma
