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
//
// Documents rarely start on a multiple of 64, and a tile that holds the end of one document and
// the start of the next walks the keys of both. So for the forward the prologue also cuts each
// row's queries into tiles that start where documents start (query_tile): a new tile where
// each run of one id at least ANCHOR_RUN rows long starts, then every QUERY_TILE_ROWS rows,
// shorter runs sharing tiles. It records each tile's exact key hull (the first and last key whose id
// lies in the tile's id range), so that its key tiles start on the document's first key, and
// every key's run end (where its run of one id stops), which makes a key tile's "one id" test
// exact wherever it starts.
#pragma once

#include <climits>
#include <cstdint>

#include "../../kittens/kittens.cuh"
#include "attention.h"

namespace tk::attention {

using namespace kittens;

// Rows per chunk of the summaries: the smallest tile side of any kernel (the backward's query
// tile), so that the backward's tiles are whole chunks (the forward's query and key tiles with
// segment ids start anywhere, and overlap one chunk more).
constexpr int SEGMENT_CHUNK = 64;
// Query tiles of the forward with segment ids: at most this many rows (its blocks' rows), and a
// new one wherever a run of one id at least ANCHOR_RUN long starts (one consumer's rows: a
// shorter document shares a tile with its neighbours).
constexpr int QUERY_TILE_ROWS = 128;
constexpr int ANCHOR_RUN = 64;

__host__ __device__ inline int segment_chunks(int seq) { return (seq + SEGMENT_CHUNK - 1) / SEGMENT_CHUNK; }
// Tiles a row of seq queries may be cut into: a tile ends QUERY_TILE_ROWS rows after its start or
// at an anchor, and anchors (the row's start, the query length, runs of >= ANCHOR_RUN) are at
// most seq / ANCHOR_RUN + 2.
__host__ __device__ inline int max_anchors(int seq) { return seq / ANCHOR_RUN + 2; }
__host__ __device__ inline int max_query_tiles(int seq) {
  return (seq + QUERY_TILE_ROWS - 1) / QUERY_TILE_ROWS + max_anchors(seq);
}

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

// A tile of the forward's queries: rows [q0, q_end) of a batch row, and the hull [k_lo, k_hi) of
// the keys whose ids lie in the id range of its rows (empty, k_lo >= k_hi, for rows past the
// query length). One int4 of the workspace.
struct query_tile {
  int q0, q_end, k_lo, k_hi;
};

// The mask workspace with segment ids, per batch row:
//   int4  query chunk summaries [segment_chunks(seq_q)], key chunk summaries [segment_chunks(seq_k)],
//         query tiles [max_query_tiles(seq_q)]
//   int   key run ends [seq_k], anchor bits [2 segment_chunks(seq_q)], anchors [max_anchors(seq_q)],
//         tile count and claim counter [2] (the counter is one int for the whole call, at
//         tile_counts[batch])
// each array for all batch rows before the next (int4 arrays first, for their alignment).
struct segment_ranges {
  int4* q;   // written by the prologue, read by the kernels
  int4* kv;
  int q_chunks, kv_chunks;
  int4* tiles;
  int* kv_run_end;         // [batch, seq_k]: the first position past j's run of one id (cut at the length)
  uint32_t* anchor_bits;   // [batch, q_chunks, 2]: which rows of each query chunk are anchors
  int* anchors;            // [batch, max_anchors(seq_q)]: those rows in order
  int* tile_counts;        // [batch], then the forward's next unclaimed item
  int seq_q, seq_k;

  __host__ __device__ static segment_ranges at(void* workspace, int64_t batch, int seq_q, int seq_k) {
    int4* base = static_cast<int4*>(workspace);
    const int qc = segment_chunks(seq_q), kc = segment_chunks(seq_k);
    segment_ranges r{};
    r.q = base;
    r.kv = base + batch * qc;
    r.q_chunks = qc;
    r.kv_chunks = kc;
    r.tiles = base + batch * (qc + kc);
    r.kv_run_end = reinterpret_cast<int*>(r.tiles + batch * max_query_tiles(seq_q));
    r.anchor_bits = reinterpret_cast<uint32_t*>(r.kv_run_end + batch * seq_k);
    r.anchors = reinterpret_cast<int*>(r.anchor_bits + batch * 2 * qc);
    r.tile_counts = r.anchors + batch * max_anchors(seq_q);
    r.seq_q = seq_q;
    r.seq_k = seq_k;
    return r;
  }
  // Bytes per batch row, a multiple of 16 (so the workspace stays linear in batch).
  __host__ __device__ static int64_t row_bytes(int seq_q, int seq_k) {
    const int64_t int4s = segment_chunks(seq_q) + int64_t(segment_chunks(seq_k)) + max_query_tiles(seq_q);
    const int64_t ints = int64_t(seq_k) + 2 * segment_chunks(seq_q) + max_anchors(seq_q) + 2;
    return int4s * 16 + (ints + 3) / 4 * 16;
  }
  template <typename Params>
  __host__ __device__ static segment_ranges of(const Params& p) {
    return at(p.mask.workspace, p.batch, p.seq_q, p.seq_k);
  }
  // The ROWS rows from `first` (rows past the end count as empty) of the queries, or of the
  // keys, of batch row b: the summaries of the chunks they overlap.
  template <int ROWS>
  __device__ segment_span queries(int b, int first) const { return span<ROWS>(q, q_chunks, b, first); }
  template <int ROWS>
  __device__ segment_span keys(int b, int first) const { return span<ROWS>(kv, kv_chunks, b, first); }
  __device__ query_tile tile(int b, int i) const {
    const int4 t = __ldg(tiles + int64_t(b) * max_query_tiles(seq_q) + i);
    return {t.x, t.y, t.z, t.w};
  }

 private:
  template <int ROWS>
  __device__ static segment_span span(const int4* chunks, int n, int b, int first) {
    static_assert(ROWS % SEGMENT_CHUNK == 0, "tiles are whole chunks");
    const int4* row = chunks + int64_t(b) * n;
    segment_span s = segment_span::none();
    const int c0 = first / SEGMENT_CHUNK;
    // A tile from a multiple of the chunk covers ROWS / SEGMENT_CHUNK chunks; from elsewhere,
    // one more.
#pragma unroll
    for (int i = 0; i <= ROWS / SEGMENT_CHUNK; i++) {
      const int c = c0 + i;
      if (c < n && (i < ROWS / SEGMENT_CHUNK || first % SEGMENT_CHUNK != 0)) s.add(__ldg(row + c));
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
  // Every row of the warp holds `id`.
  __device__ bool holds_only(int id) const { return lo == hi && lo == id; }
  // Masks the pairs of the tile (of column ids `tile`) whose ids differ, unless all of them hold
  // one id. Columns from col_end on are not read (the band masks them).
  template <int C>
  __device__ void mask(rt_fl<16, C>& scores, const segment_span& tile, const int32_t* row_ids, int row0, int row_end,
                       const int32_t* col_ids, int col0, int col_end) const {
    if (tile.one_segment_with(lo, hi)) return;
    mask_all(scores, row_ids, row0, row_end, col_ids, col0, col_end);
  }
  // Masks the pairs of the tile whose ids differ.
  template <int C>
  __device__ void mask_all(rt_fl<16, C>& scores, const int32_t* row_ids, int row0, int row_end,
                           const int32_t* col_ids, int col0, int col_end) const {
    int ids[2];
    row_ids_of(ids, row_ids, row0, row_end);
    mask_segments(scores, ids, col_ids + col0, col_end - col0);
  }
};

// Whether keys [k0, min(k0 + n, k_end)) of one batch row all hold one id, and which: exact
// wherever the tile starts, from the run end of its first key (segment_ranges::kv_run_end).
struct key_tile_id {
  int id;
  bool single;
  __device__ static key_tile_id of(const int32_t* ids, const int* run_end, int k0, int n, int k_end) {
    if (k0 >= k_end) return {0, false};
    return {__ldg(ids + k0), __ldg(run_end + k0) >= min(k0 + n, k_end)};
  }
};

// nullptr when the kernels can take `mask`, else a sentence saying what is wrong.
const char* mask_unsupported(const MaskParams& mask);

// The prologue: the chunk summaries of the queries and keys of every batch row, into the mask
// workspace (two small launches on `stream`; a no-op without segment ids), and with query_tiles
// (for the forward) a third: the query tiles, run ends and tile counts.
cudaError_t launch_segment_ranges(const MaskParams& mask, int batch, int seq_q, int seq_k, cudaStream_t stream,
                                  bool query_tiles = false);

}  // namespace tk::attention
