// The segment-range prologue (segment_ranges.cuh): two small memory-bound launches, one warp a
// chunk. The first takes each chunk's id range, the second each chunk's hull on the other side,
// which needs every range of that side: hence two launches.
#include "segment_ranges.cuh"

namespace tk::attention {

size_t mask_workspace_bytes(int64_t batch, int64_t seq_q, int64_t seq_k, bool segment_ids) {
  if (batch < 1 || seq_q < 1 || seq_k < 1) return 0;
  const int64_t chunks = segment_ids ? segment_chunks(int(seq_q)) + int64_t(segment_chunks(int(seq_k))) : 1;
  return size_t(batch * chunks) * sizeof(int4);
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
  int count, length;
};

struct range_args {
  MaskParams mask;
  int4 *q_chunks, *kv_chunks;
  int seq_q, seq_k, q_count, kv_count;

  // Chunk `chunk` of batch row b: a query chunk below q_count, then the key chunks. `mine` is
  // its own side, `other` the opposite one.
  __device__ int locate(int b, int chunk, chunk_side& mine, chunk_side& other) const {
    const chunk_side q{mask.q_segment_ids + int64_t(b) * seq_q, q_chunks + int64_t(b) * q_count, q_count,
                       clamped_length(mask.q_lengths, b, seq_q)};
    const chunk_side kv{mask.kv_segment_ids + int64_t(b) * seq_k, kv_chunks + int64_t(b) * kv_count, kv_count,
                        clamped_length(mask.kv_lengths, b, seq_k)};
    const bool is_q = chunk < q_count;
    mine = is_q ? q : kv;
    other = is_q ? kv : q;
    return is_q ? chunk : chunk - q_count;
  }
};

__global__ void __launch_bounds__(RANGE_WARPS * WARP_THREADS) chunk_ids_kernel(const __grid_constant__ range_args a) {
  const int b = blockIdx.y, chunk = blockIdx.x * RANGE_WARPS + warpid();
  if (chunk >= a.q_count + a.kv_count) return;  // the whole warp
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
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if (laneid() == 0) mine.chunks[c] = make_int4(lo, hi, INT_MAX, INT_MIN);  // the hull: next launch
}

// The other side's chunks whose ranges meet this chunk's, 32 at a time with a ballot: the first
// and last give the hull.
__global__ void __launch_bounds__(RANGE_WARPS * WARP_THREADS) chunk_hulls_kernel(const __grid_constant__ range_args a) {
  const int b = blockIdx.y, chunk = blockIdx.x * RANGE_WARPS + warpid();
  if (chunk >= a.q_count + a.kv_count) return;
  chunk_side mine, other;
  const int c = a.locate(b, chunk, mine, other);
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

}  // namespace

cudaError_t launch_segment_ranges(const MaskParams& mask, int batch, int seq_q, int seq_k, cudaStream_t stream) {
  if (!mask.has_segment_ids()) return cudaSuccess;
  range_args a{};
  a.mask = mask;
  a.seq_q = seq_q;
  a.seq_k = seq_k;
  a.q_count = segment_chunks(seq_q);
  a.kv_count = segment_chunks(seq_k);
  a.q_chunks = static_cast<int4*>(mask.workspace);
  a.kv_chunks = a.q_chunks + int64_t(batch) * a.q_count;
  const dim3 grid((a.q_count + a.kv_count + RANGE_WARPS - 1) / RANGE_WARPS, batch);
  chunk_ids_kernel<<<grid, RANGE_WARPS * WARP_THREADS, 0, stream>>>(a);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  chunk_hulls_kernel<<<grid, RANGE_WARPS * WARP_THREADS, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace tk::attention
