// Checks, the choice of key splits, and the dispatch of the KV-cache attention to its head
// dim's launch (decode_launch.cuh).
#include <algorithm>
#include <cmath>

#include "decode_launch.cuh"
#include "kvcache.h"

namespace tk::kvcache {

// A split should stream at least this many key tiles, so that a block's start (its first
// loads, Q) stays small next to its work.
constexpr int64_t MIN_TILES_PER_SPLIT = 4;

template <int GROUPS>
static int64_t blocks_per_sm(int64_t head_dim) {
  switch (head_dim) {
    case 64: return decode_config<64, GROUPS>::BLOCKS_PER_SM;
    case 128: return decode_config<128, GROUPS>::BLOCKS_PER_SM;
    default: return decode_config<256, GROUPS>::BLOCKS_PER_SM;
  }
}
static int64_t blocks_per_sm(int64_t head_dim, int groups) {
  return groups == 2 ? blocks_per_sm<2>(head_dim) : blocks_per_sm<1>(head_dim);
}

int num_splits(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_q, int64_t head_dim, int64_t capacity,
               int64_t page_size, int multiprocessors, int64_t requested) {
  const block_shape shape = shape_of(heads_q, heads_kv, seq_q, head_dim, page_size);
  const int64_t kv = keys_per_tile(int(head_dim), shape.groups) / shape.heads;
  const int64_t tiles = std::max<int64_t>((capacity + kv - 1) / kv, 1);
  const int64_t most = std::min<int64_t>(MAX_SPLITS, tiles);
  if (requested > 0) return int(std::min(requested, most));
  // When the blocks of one split fill the card, splitting only adds work.
  const int64_t blocks = split_blocks(batch, heads_q, heads_kv, seq_q, shape);
  if (multiprocessors < 1 || blocks < 1 || blocks >= multiprocessors) return 1;
  // Else split the keys, so that the blocks keep every multiprocessor streaming to the end:
  // with n = blocks x splits spread evenly, the busy fraction of the last round is
  // (n / SMs) / ceil(n / SMs). Take the fewest splits within 5% of the best such fraction,
  // among counts that still start every block at once (no second round), give each split
  // MIN_TILES_PER_SPLIT tiles, and keep the partial results (2 x 4 bytes per query row and
  // column per split, written then read) under the K/V bytes they summarise.
  const int64_t group = heads_q / std::max<int64_t>(heads_kv, 1);
  const int64_t resident = multiprocessors * blocks_per_sm(head_dim, shape.groups);
  int64_t limit = std::min({most, std::max<int64_t>(1, tiles / MIN_TILES_PER_SPLIT),
                            std::max<int64_t>(1, capacity / (2 * group * seq_q)),
                            std::max<int64_t>(1, resident / blocks)});
  auto busy = [&](int64_t s) {
    const double rounds = double(blocks * s) / multiprocessors;
    return rounds / std::ceil(rounds);
  };
  double best = 0.;
  for (int64_t s = 1; s <= limit; s++) best = std::max(best, busy(s));
  for (int64_t s = 1; s <= limit; s++)
    if (busy(s) >= 0.95 * best) return int(s);
  return 1;
}

size_t workspace_bytes(int64_t batch, int64_t heads_q, int64_t seq_q, int64_t head_dim, int64_t splits) {
  if (splits <= 1) return 0;
  const int64_t rows = split_workspace::rows(batch, heads_q, seq_q);
  return split_workspace::o_bytes(rows, splits, head_dim) + split_workspace::lse_bytes(rows, splits);
}

const char* unsupported(const Params& p) {
  if (!p.q || !p.k || !p.v || !p.seqlens || !p.o || !p.lse) return "a buffer pointer is null";
  if (p.batch < 1 || p.seq_q < 1 || p.heads_q < 1 || p.heads_kv < 1)
    return "batch, seq_q and head counts must be >= 1";
  if (p.heads_q % p.heads_kv != 0) return "heads_q must be a multiple of heads_kv";
  if (!head_dim_supported(p.head_dim)) return "head_dim must be 64, 128 or 256";
  if (!(std::isfinite(p.scale) && p.scale > 0.f)) return "scale must be finite and > 0";
  if (p.window_left < -1 || p.window_right < -1) return "window bounds must be >= -1";
  if (p.capacity < 0 || p.capacity >= (int64_t(1) << 30)) return "the cache must hold fewer than 2^30 keys a row";
  if (int64_t(p.seq_q) >= (int64_t(1) << 30)) return "seq_q must be below 2^30";
  if (p.num_splits < 1 || p.num_splits > MAX_SPLITS) return "num_splits must be in [1, 256]";
  if (p.num_splits > 1 && !p.workspace) return "a split call needs its workspace";
  if (p.paged) {
    if (!p.page_table) return "a paged cache needs a page table";
    if (!page_size_supported(p.page_size)) return "page_size must be 16, 32, 64, 128 or 256";
    if (p.max_pages < 0 || p.pages_per_pool < 0 || p.rows_per_pool < 1 || p.batch % p.rows_per_pool != 0)
      return "inconsistent page-table dimensions";
    if (p.capacity != int64_t(p.max_pages) * p.page_size) return "a paged cache's capacity is max_pages * page_size";
    if (int64_t(p.batch / p.rows_per_pool) * p.pages_per_pool >= (int64_t(1) << 31))
      return "too many pages (2^31 or more)";
  }
  const block_shape shape = shape_of(p);
  const int64_t blocks = split_blocks(p.batch, p.heads_q, p.heads_kv, p.seq_q, shape) * p.num_splits;
  if (blocks >= (int64_t(1) << 31)) return "too many blocks for one grid";
  return nullptr;
}

template <typename T>
static cudaError_t decode_dim(const Params& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return decode_head_dim<T, 64>(p, stream);
    case 128: return decode_head_dim<T, 128>(p, stream);
    case 256: return decode_head_dim<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t decode(const Params& p, cudaStream_t stream) {
  if (unsupported(p)) return cudaErrorInvalidValue;
  return p.dtype == DType::bf16 ? decode_dim<bf16>(p, stream) : decode_dim<half>(p, stream);
}

}  // namespace tk::kvcache
