// The segment-range prologue (segment_ranges.cuh): small memory-bound launches. The first takes
// each chunk's id range, the second each chunk's hull on the other side, which needs every range
// of that side (one warp a chunk in both). For the forward, the second also finds the keys' run
// ends and the queries' anchors, a third lays each batch row's query tiles out from the anchors
// (one block a row), and a fourth finds each tile's key hull (one warp a tile).
#include "segment_ranges.cuh"

namespace tk::attention {

size_t mask_workspace_bytes(int64_t batch, int64_t seq_q, int64_t seq_k, bool segment_ids) {
  if (batch < 1 || seq_q < 1 || seq_k < 1) return 0;
  if (!segment_ids) return size_t(batch) * sizeof(int4);
  return size_t(batch * segment_ranges::row_bytes(int(seq_q), int(seq_k)));
}

const char* mask_unsupported(const MaskParams& mask) {
  if ((mask.q_segment_ids == nullptr) != (mask.kv_segment_ids == nullptr))
    return "segment ids come in pairs: for the queries and the keys, or neither";
  if ((mask.q_lengths == nullptr) != (mask.kv_lengths == nullptr))
    return "sequence lengths come in pairs: for the queries and the keys, or neither";
  if (mask.has_segment_ids() && (!mask.workspace || reinterpret_cast<uintptr_t>(mask.workspace) % 16 != 0))
    return "with segment ids the mask workspace must be given, 16-byte aligned";
  return nullptr;
}

namespace {

constexpr int RANGE_WARPS = 8;  // chunks per block

// One side of a batch row: its ids, its summaries and its length.
struct chunk_side {
  const int32_t* ids;
  int4* chunks;
  int count, length, seq;
};

struct range_args {
  MaskParams mask;
  segment_ranges layout;  // the whole workspace
  bool query_tiles;       // also the key run ends and the query anchors

  __device__ int chunks() const { return layout.q_chunks + layout.kv_chunks; }
  // Chunk `chunk` of batch row b: a query chunk below q_chunks, then the key chunks. `mine` is
  // its own side, `other` the opposite one.
  __device__ int locate(int b, int chunk, chunk_side& mine, chunk_side& other) const {
    const segment_ranges& r = layout;
    const chunk_side q{mask.q_segment_ids + int64_t(b) * r.seq_q, r.q + int64_t(b) * r.q_chunks, r.q_chunks,
                       clamped_length(mask.q_lengths, b, r.seq_q), r.seq_q};
    const chunk_side kv{mask.kv_segment_ids + int64_t(b) * r.seq_k, r.kv + int64_t(b) * r.kv_chunks, r.kv_chunks,
                        clamped_length(mask.kv_lengths, b, r.seq_k), r.seq_k};
    const bool is_q = chunk < r.q_chunks;
    mine = is_q ? q : kv;
    other = is_q ? kv : q;
    return is_q ? chunk : chunk - r.q_chunks;
  }
};

__global__ void __launch_bounds__(RANGE_WARPS * WARP_THREADS) chunk_ids_kernel(const __grid_constant__ range_args a) {
  const int b = blockIdx.y, chunk = blockIdx.x * RANGE_WARPS + warpid();
  if (chunk >= a.chunks()) return;  // the whole warp
  chunk_side mine, other;
  const int c = a.locate(b, chunk, mine, other);
  int lo = INT_MAX, hi = INT_MIN;
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const int i = c * SEGMENT_CHUNK + half * WARP_THREADS + laneid();
    if (i < mine.length) {
      const int id = mine.ids[i];
      lo = min(lo, id);
      hi = max(hi, id);
    }
  }
  static_assert(SEGMENT_CHUNK == 2 * WARP_THREADS);
  const int2 range = warp_id_range(lo, hi);
  if (laneid() == 0) mine.chunks[c] = make_int4(range.x, range.y, INT_MAX, INT_MIN);  // the hull: next launch
}

// The run ends of chunk c's positions (within the length; the first position past each one's run
// of one id), by lane: positions c 64 + lane and c 64 + 32 + lane. A run that reaches the
// chunk's end is followed through the chunks that hold its id alone (their summaries, 32 at a
// time), then to the first other id.
// Bit i: pred(base + i), for the 64 positions of the chunk that starts at base (a warp's ballots).
template <typename Pred>
__device__ uint64_t chunk_ballot(int base, Pred pred) {
  static_assert(SEGMENT_CHUNK == 2 * WARP_THREADS);
  return uint64_t(__ballot_sync(0xffffffffu, pred(base + laneid()))) |
         uint64_t(__ballot_sync(0xffffffffu, pred(base + WARP_THREADS + laneid()))) << 32;
}

__device__ int2 chunk_run_ends(const chunk_side& side, int c) {
  const int n = side.length, base = c * SEGMENT_CHUNK;
  auto changes_after = [&](int p) { return p < n && (p + 1 == n || side.ids[p + 1] != side.ids[p]); };
  const uint64_t changes = chunk_ballot(base, changes_after);
  const int last = min(n, base + SEGMENT_CHUNK) - 1;  // the chunk's last position in the length
  int beyond = n;  // where the run through the chunk's end stops
  if (last >= base && !((changes >> (last - base)) & 1)) {
    const int id = side.ids[last];
    int stop = side.count;  // the first later chunk not wholly of this id
    for (int from = c + 1; from < side.count; from += WARP_THREADS) {
      const int k = from + laneid();
      bool ends = false;
      if (k < side.count) {
        const int4 o = side.chunks[k];
        ends = !(o.x == id && o.y == id && (k + 1) * SEGMENT_CHUNK <= n);
      }
      const unsigned hits = __ballot_sync(0xffffffffu, ends);
      if (hits) {
        stop = from + __ffs(hits) - 1;
        break;
      }
    }
    if (stop < side.count) {
      auto differs = [&](int p) { return p >= n || side.ids[p] != id; };
      const int p0 = stop * SEGMENT_CHUNK;
      const uint64_t d = chunk_ballot(p0, differs);
      beyond = min(n, p0 + __ffsll(d) - 1);  // d is not 0: the chunk is not wholly of this id
    }
  }
  auto run_end = [&](int i) {
    const uint64_t later = changes >> i;
    return later ? base + i + __ffsll(later) : beyond;
  };
  return {run_end(laneid()), run_end(WARP_THREADS + laneid())};
}

// The other side's chunks whose ranges meet this chunk's, 32 at a time with a ballot: the first
// and last give the hull. With query tiles, also the key run ends and the query anchors (the
// row's start, the query length, and each start of a run of at least ANCHOR_RUN ids).
__global__ void __launch_bounds__(RANGE_WARPS * WARP_THREADS) chunk_hulls_kernel(const __grid_constant__ range_args a) {
  const int b = blockIdx.y, chunk = blockIdx.x * RANGE_WARPS + warpid();
  if (chunk >= a.chunks()) return;
  chunk_side mine, other;
  const int c = a.locate(b, chunk, mine, other);
  const bool is_q = chunk < a.layout.q_chunks;
  if (a.query_tiles) {
    const int2 ends = chunk_run_ends(mine, c);
    const int p[2] = {c * SEGMENT_CHUNK + laneid(), c * SEGMENT_CHUNK + WARP_THREADS + laneid()};
    const int end[2] = {ends.x, ends.y};
    if (is_q) {
      uint32_t bits[2];
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int s = p[h], n = mine.length;
        const bool anchor = s < mine.seq && (s == 0 || s == n ||
                                             (s < n && mine.ids[s] != mine.ids[s - 1] && end[h] - s >= ANCHOR_RUN));
        bits[h] = __ballot_sync(0xffffffffu, anchor);
      }
      if (laneid() < 2) a.layout.anchor_bits[(int64_t(b) * a.layout.q_chunks + c) * 2 + laneid()] = bits[laneid()];
    } else {
      int* run_end = a.layout.kv_run_end + int64_t(b) * a.layout.seq_k;
#pragma unroll
      for (int h = 0; h < 2; h++)
        if (p[h] < mine.length) run_end[p[h]] = end[h];
    }
  }
  const int4 own = mine.chunks[c];
  if (own.x > own.y) return;  // no row in the length: the empty hull stays
  int first = -1, last = -1;
  for (int base = 0; base < other.count; base += WARP_THREADS) {
    const int i = base + laneid();
    bool meets = false;
    if (i < other.count) {
      const int4 o = other.chunks[i];
      meets = o.x <= own.y && own.x <= o.y;
    }
    const unsigned hits = __ballot_sync(0xffffffffu, meets);
    if (hits) {
      if (first < 0) first = base + __ffs(hits) - 1;
      last = base + 31 - __clz(hits);
    }
  }
  if (laneid() == 0 && first >= 0)
    reinterpret_cast<int2*>(&mine.chunks[c])[1] =
        make_int2(first * SEGMENT_CHUNK, min((last + 1) * SEGMENT_CHUNK, other.length));
}

// ---------------------------------------------------------------------------------------------
// Query tiles at document starts: one block a batch row lays them out from the anchors; then a
// warp a tile finds its key hull.

constexpr int TILE_THREADS = 1024;

// Prefix sums of x over the block's threads: the sum over the threads before this one, and over
// all of them. `scratch`: 32 ints of shared memory.
struct block_sum {
  int before, total;
};
__device__ block_sum block_exclusive_sum(int x, int* scratch) {
  const int lane = laneid(), warp = warpid(), warps = blockDim.x / WARP_THREADS;
  int v = x;  // inclusive within the warp
#pragma unroll
  for (int d = 1; d < WARP_THREADS; d *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += y;
  }
  if (lane == WARP_THREADS - 1) scratch[warp] = v;  // the warp's total
  __syncthreads();
  block_sum sum{v - x, 0};
  for (int w = 0; w < warps; w++) {
    if (w < warp) sum.before += scratch[w];
    sum.total += scratch[w];
  }
  __syncthreads();  // scratch may be reused
  return sum;
}

struct tile_args {
  MaskParams mask;
  segment_ranges ranges;
};

__global__ void __launch_bounds__(TILE_THREADS) query_tiles_kernel(const __grid_constant__ tile_args a) {
  __shared__ int scratch[32];
  const int b = blockIdx.x;
  const segment_ranges& r = a.ranges;
  const int seq_q = r.seq_q;
  int* anchors = r.anchors + int64_t(b) * max_anchors(seq_q);
  int4* tiles = r.tiles + int64_t(b) * max_query_tiles(seq_q);

  // The anchors in order: a thread a chunk, placed by a prefix sum of the chunks' counts.
  int n_anchors = 0;
  for (int from = 0; from < r.q_chunks; from += blockDim.x) {  // block-uniform rounds
    const int c = from + threadIdx.x;
    uint32_t bits[2] = {0, 0};
    if (c < r.q_chunks)
      for (int h = 0; h < 2; h++) bits[h] = r.anchor_bits[(int64_t(b) * r.q_chunks + c) * 2 + h];
    const block_sum placed = block_exclusive_sum(__popc(bits[0]) + __popc(bits[1]), scratch);
    int at = n_anchors + placed.before;
    for (int h = 0; h < 2; h++)
      for (uint32_t x = bits[h]; x; x &= x - 1) anchors[at++] = c * SEGMENT_CHUNK + h * WARP_THREADS + __ffs(x) - 1;
    n_anchors += placed.total;
  }
  __syncthreads();  // the anchors are read across threads below

  // Tiles: from each anchor to the next, every QUERY_TILE_ROWS rows.
  int n_tiles = 0;
  for (int from = 0; from < n_anchors; from += blockDim.x) {  // block-uniform rounds
    const int i = from + threadIdx.x;
    const int start = i < n_anchors ? anchors[i] : 0;
    const int stop = i + 1 < n_anchors ? anchors[i + 1] : seq_q;
    const int n = i < n_anchors ? (stop - start + QUERY_TILE_ROWS - 1) / QUERY_TILE_ROWS : 0;
    const block_sum placed = block_exclusive_sum(n, scratch);
    for (int j = 0; j < n; j++) {
      const int q0 = start + j * QUERY_TILE_ROWS;
      tiles[n_tiles + placed.before + j] = make_int4(q0, min(q0 + QUERY_TILE_ROWS, stop), 0, 0);
    }
    n_tiles += placed.total;
  }
  if (threadIdx.x == 0) r.tile_counts[b] = n_tiles;
  if (b == 0 && threadIdx.x == 0) r.tile_counts[gridDim.x] = 0;  // no item claimed yet
}

constexpr int HULL_WARPS = 8;  // tiles per block

// The first (FROM_RIGHT: the last) key of [from, to) of one batch row whose id lies in [lo, hi],
// by a warp: the key chunks whose id ranges cannot hold one are skipped 32 at a time, the others
// searched 32 keys at a time. Returns its position (FROM_RIGHT: position + 1), or -1 if none.
template <bool FROM_RIGHT>
__device__ int matching_key(const int4* chunks, const int32_t* ids, int lo, int hi, int from, int to) {
  if (from >= to) return -1;
  const int first_chunk = from / SEGMENT_CHUNK, last_chunk = (to - 1) / SEGMENT_CHUNK;
  for (int done = 0; first_chunk + done <= last_chunk; done += WARP_THREADS) {
    const int c = FROM_RIGHT ? last_chunk - done - laneid() : first_chunk + done + laneid();
    bool meets = false;
    if (c >= first_chunk && c <= last_chunk) {
      const int4 chunk = chunks[c];
      meets = chunk.x <= hi && lo <= chunk.y;
    }
    for (unsigned candidates = __ballot_sync(0xffffffffu, meets); candidates; candidates &= candidates - 1) {
      const int k = __ffs(candidates) - 1;  // the nearest candidate chunk left
      const int chunk = FROM_RIGHT ? last_chunk - done - k : first_chunk + done + k;
      for (int part = 0; part < SEGMENT_CHUNK / WARP_THREADS; part++) {
        const int half = FROM_RIGHT ? SEGMENT_CHUNK / WARP_THREADS - 1 - part : part;
        const int lane = FROM_RIGHT ? WARP_THREADS - 1 - laneid() : laneid();
        const int j = chunk * SEGMENT_CHUNK + half * WARP_THREADS + lane;
        const bool hit = j >= from && j < to && ids[j] >= lo && ids[j] <= hi;
        const unsigned hits = __ballot_sync(0xffffffffu, hit);
        if (hits) {
          const int at = chunk * SEGMENT_CHUNK + half * WARP_THREADS;
          return FROM_RIGHT ? at + WARP_THREADS - (__ffs(hits) - 1) : at + __ffs(hits) - 1;
        }
      }
    }
  }
  return -1;
}

// Tile blockIdx.x HULL_WARPS + warp of batch row blockIdx.y: its key hull, the first and last
// key whose id lies in the tile's id range, searched within the union of its chunks' hulls.
__global__ void __launch_bounds__(HULL_WARPS * WARP_THREADS) tile_hulls_kernel(const __grid_constant__ tile_args a) {
  const int b = blockIdx.y, i = blockIdx.x * HULL_WARPS + warpid();
  const segment_ranges& r = a.ranges;
  if (i >= r.tile_counts[b]) return;  // the whole warp
  const int seq_q = r.seq_q, seq_k = r.seq_k;
  const int32_t* q_ids = a.mask.q_segment_ids + int64_t(b) * seq_q;
  const int32_t* kv_ids = a.mask.kv_segment_ids + int64_t(b) * seq_k;
  const int q_len = clamped_length(a.mask.q_lengths, b, seq_q);
  int4* tile = r.tiles + int64_t(b) * max_query_tiles(seq_q) + i;
  const int4 t = *tile;
  const int q0 = t.x, q_end = min(t.y, q_len);
  int k_lo = 0, k_hi = 0;
  if (q0 < q_end) {
    int lo = INT_MAX, hi = INT_MIN;
    for (int row = q0 + laneid(); row < q_end; row += WARP_THREADS) {
      lo = min(lo, q_ids[row]);
      hi = max(hi, q_ids[row]);
    }
    const int2 range = warp_id_range(lo, hi);
    int hull_lo = INT_MAX, hull_hi = INT_MIN;
    for (int c = q0 / SEGMENT_CHUNK; c * SEGMENT_CHUNK < q_end; c++) {
      const int4 chunk = r.q[int64_t(b) * r.q_chunks + c];
      hull_lo = min(hull_lo, chunk.z);
      hull_hi = max(hull_hi, chunk.w);
    }
    const int4* key_chunks = r.kv + int64_t(b) * r.kv_chunks;
    const int first = matching_key<false>(key_chunks, kv_ids, range.x, range.y, hull_lo, hull_hi);
    if (first >= 0) {
      k_lo = first;
      k_hi = matching_key<true>(key_chunks, kv_ids, range.x, range.y, first, hull_hi);
    }
  }
  if (laneid() == 0) *tile = make_int4(t.x, t.y, k_lo, k_hi);
}

}  // namespace

cudaError_t launch_segment_ranges(const MaskParams& mask, int batch, int seq_q, int seq_k, cudaStream_t stream,
                                  bool query_tiles) {
  if (!mask.has_segment_ids()) return cudaSuccess;
  range_args a{mask, segment_ranges::at(mask.workspace, batch, seq_q, seq_k), query_tiles};
  const dim3 grid((segment_chunks(seq_q) + segment_chunks(seq_k) + RANGE_WARPS - 1) / RANGE_WARPS, batch);
  chunk_ids_kernel<<<grid, RANGE_WARPS * WARP_THREADS, 0, stream>>>(a);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  chunk_hulls_kernel<<<grid, RANGE_WARPS * WARP_THREADS, 0, stream>>>(a);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess || !query_tiles) return err;
  const tile_args t{mask, a.layout};
  query_tiles_kernel<<<batch, TILE_THREADS, 0, stream>>>(t);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  const dim3 hull_grid((max_query_tiles(seq_q) + HULL_WARPS - 1) / HULL_WARPS, batch);
  tile_hulls_kernel<<<hull_grid, HULL_WARPS * WARP_THREADS, 0, stream>>>(t);
  return cudaGetLastError();
}

}  // namespace tk::attention
