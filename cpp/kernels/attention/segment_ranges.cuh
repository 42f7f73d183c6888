// Segment ids, tile by tile: what lets the attention kernels skip the key (or query) tiles that
// share no segment with the tile they fix, instead of masking them element by element.
//
// A prologue (launch_segment_ranges) summarises every chunk of 64 rows, of the queries and of the
// keys of each batch row, in the mask workspace:
//   seg_lo, seg_hi     the smallest and largest segment id in the chunk (rows past the length
//                      left out; a chunk with no row in the length gets the empty range
//                      seg_lo > seg_hi)
//   other_lo, other_hi the positions of the other side (keys for a query chunk, queries for a
//                      key chunk) whose chunks' id ranges meet [seg_lo, seg_hi], as one
//                      half-open hull, chunk-aligned and cut at the other side's length
// A kernel's tile covers one or more chunks: it combines their summaries (min / max), so a tile
// pair is
//   empty    when the id ranges do not meet (no pair can share a segment: never loaded),
//   full     when both hold one and the same id (no segment mask),
//   partial  otherwise (ids compared element by element).
// The hull of a tile bounds the tiles it is walked against: with sorted ids (the packed rows of
// training) every tile inside it meets the tile's ids, so a walk costs the tiles of the tile's
// own documents; with unsorted ids the walk skips the empty tiles inside the hull, one check a
// tile.
#pragma once

#include <climits>
#include <cstdint>

#include "../../kittens/kittens.cuh"
#include "attention.h"

namespace tk::attention {

using namespace kittens;

// Rows per chunk of the summaries: the smallest tile side of any kernel (the backward's query
// tile), so that every tile is a whole number of chunks.
constexpr int SEGMENT_CHUNK = 64;

__host__ __device__ inline int segment_chunks(int seq) { return (seq + SEGMENT_CHUNK - 1) / SEGMENT_CHUNK; }

// A length clamped to [0, seq], or seq without lengths.
__device__ __forceinline__ int clamped_length(const int32_t* lengths, int b, int seq) {
  return lengths ? min(max(lengths[b], 0), seq) : seq;
}

// The summary of a run of chunks (the struct is the workspace's int4 per chunk).
struct segment_span {
  int seg_lo, seg_hi;      // id range, inclusive; seg_lo > seg_hi when empty
  int other_lo, other_hi;  // hull of the other side's positions; other_lo >= other_hi when empty

  __device__ static segment_span none() { return {INT_MAX, INT_MIN, INT_MAX, INT_MIN}; }
  __device__ void add(const int4& c) {
    seg_lo = min(seg_lo, c.x);
    seg_hi = max(seg_hi, c.y);
    other_lo = min(other_lo, c.z);
    other_hi = max(other_hi, c.w);
  }
  // Some id of one may equal some id of the other.
  __device__ bool meets(const segment_span& o) const { return seg_lo <= o.seg_hi && o.seg_lo <= seg_hi; }
  // Every id of both is one and the same: no pair needs the segment mask.
  __device__ bool one_segment_with(int lo, int hi) const { return seg_lo == seg_hi && lo == hi && lo == seg_lo; }
};

// The workspace's summaries: [batch, chunks] int4 for the queries, then for the keys.
struct segment_ranges {
  const int4* q;
  const int4* kv;
  int q_chunks, kv_chunks;

  template <typename Params>
  __host__ __device__ static segment_ranges of(const Params& p) {
    const int4* base = static_cast<const int4*>(p.mask.workspace);
    const int qc = segment_chunks(p.seq_q), kc = segment_chunks(p.seq_k);
    return {base, base + int64_t(p.batch) * qc, qc, kc};
  }
  // The ROWS rows from `first` (a multiple of SEGMENT_CHUNK; rows past the end count as
  // empty) of the queries, or of the keys, of batch row b.
  template <int ROWS>
  __device__ segment_span queries(int b, int first) const { return span<ROWS>(q, q_chunks, b, first); }
  template <int ROWS>
  __device__ segment_span keys(int b, int first) const { return span<ROWS>(kv, kv_chunks, b, first); }

 private:
  template <int ROWS>
  __device__ static segment_span span(const int4* chunks, int n, int b, int first) {
    static_assert(ROWS % SEGMENT_CHUNK == 0, "tiles are whole chunks");
    const int4* row = chunks + int64_t(b) * n;
    segment_span s = segment_span::none();
#pragma unroll
    for (int i = 0; i < ROWS / SEGMENT_CHUNK; i++) {
      const int c = first / SEGMENT_CHUNK + i;
      if (c < n) s.add(__ldg(row + c));
    }
    return s;
  }
};

// The id range of a warp from each lane's [lo, hi] (INT_MAX, INT_MIN: a lane with no id).
__device__ __forceinline__ int2 warp_id_range(int lo, int hi) {
  return {__reduce_min_sync(0xffffffffu, lo), __reduce_max_sync(0xffffffffu, hi)};
}

// Sets the elements of a warp's 16-row tile whose row and column segment ids differ to -inf.
// row_ids: the ids of the lane's rows g and g + 8 (fragment_row); col_ids: the ids of the
// columns from the tile's first, of which the first n_cols may be read (the rest are masked by
// the band: they lie past the length).
template <int C>
__device__ __forceinline__ void mask_segments(rt_fl<16, C>& t, const int (&row_ids)[2], const int32_t* col_ids,
                                              int n_cols) {
#pragma unroll
  for (int j = 0; j < t.width; j++)
#pragma unroll
    for (int right = 0; right < 2; right++) {
      const int col = 16 * j + fragment_col(2 * right, 0);
      const int a = col < n_cols ? __ldg(col_ids + col) : INT_MIN;
      const int b = col + 1 < n_cols ? __ldg(col_ids + col + 1) : INT_MIN;
#pragma unroll
      for (int down = 0; down < 2; down++) {  // register 2 * right + down: row g + 8 down
        float2& x = t.tiles[0][j].data[2 * right + down];
        x.x = row_ids[down] == a ? x.x : NEG_INF;
        x.y = row_ids[down] == b ? x.y : NEG_INF;
      }
    }
}

// The segment ids of a warp's 16-row tile (a consumer's queries, or its keys) against the tiles
// of the other side it meets: rows [row0, row0 + 16) of this side's ids `row_ids` (those from
// row_end on are masked by the band, and not read), columns from col0 of the other side's
// `col_ids`. The warp keeps only its id range (two registers); a tile that needs the element
// mask reads the ids again (from L1).
struct warp_segments {
  int lo, hi;

  // The lane's rows g and g + 8 (fragment_row): their ids, INT_MAX from row_end on.
  __device__ static void row_ids_of(int (&ids)[2], const int32_t* row_ids, int row0, int row_end) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int row = row0 + row_vec_row(0, h);
      ids[h] = row < row_end ? __ldg(row_ids + row) : INT_MAX;
    }
  }
  __device__ static warp_segments of(const int32_t* row_ids, int row0, int row_end) {
    int ids[2];
    row_ids_of(ids, row_ids, row0, row_end);
    const bool valid0 = row0 + row_vec_row(0, 0) < row_end, valid1 = row0 + row_vec_row(0, 1) < row_end;
    const int lo = min(valid0 ? ids[0] : INT_MAX, valid1 ? ids[1] : INT_MAX);
    const int hi = max(valid0 ? ids[0] : INT_MIN, valid1 ? ids[1] : INT_MIN);
    const int2 range = warp_id_range(lo, hi);
    return {range.x, range.y};
  }
  // Masks the pairs of the tile (of column ids `tile`) whose ids differ, unless all of them hold
  // one id. Columns from col_end on are not read (the band masks them).
  template <int C>
  __device__ void mask(rt_fl<16, C>& scores, const segment_span& tile, const int32_t* row_ids, int row0, int row_end,
                       const int32_t* col_ids, int col0, int col_end) const {
    if (tile.one_segment_with(lo, hi)) return;
    int ids[2];
    row_ids_of(ids, row_ids, row0, row_end);
    mask_segments(scores, ids, col_ids + col0, col_end - col0);
  }
};

// nullptr when the kernels can take `mask`, else a sentence saying what is wrong.
const char* mask_unsupported(const MaskParams& mask);

// The prologue: the chunk summaries of the queries and keys of every batch row, into the mask
// workspace (two small launches on `stream`; a no-op without segment ids).
cudaError_t launch_segment_ranges(const MaskParams& mask, int batch, int seq_q, int seq_k, cudaStream_t stream);

}  // namespace tk::attention
