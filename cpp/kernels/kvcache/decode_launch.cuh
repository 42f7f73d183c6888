// The launch of the KV-cache attention for one dtype and head dim: the cache's tensor maps, the
// kernel of the call's block shape, then the combine pass when the keys are split. Each head
// dim is built in a translation unit of its own (decode_d64.cu, decode_d128.cu,
// decode_d256.cu), so they compile in parallel; kvcache.cu checks calls and dispatches.
#pragma once

#include <algorithm>

#include "combine_kernel.cuh"
#include "decode_kernel.cuh"
#include "kvcache.h"

namespace tk::kvcache {

inline int64_t packed_rows(int64_t heads_q, int64_t heads_kv, int64_t seq_q) {
  return heads_q / std::max<int64_t>(heads_kv, 1) * seq_q;
}

// The shape of a block (block_shape_of in decode_kernel.cuh); page_size 0 for a contiguous
// cache. Two consumer warpgroups where a KV head has more than 64 packed rows, measured with MQA
// x 4 tokens: on an H100, blocks of 64 rows that read the same keys ran paged at 0.56-0.67x of
// contiguous, two warpgroups at 0.88-0.99x; at D = 64 (128-key tiles: twice the softmax work a
// byte) two warpgroups were the faster contiguous too (2.3-2.6 TB/s against 1.9-2.05 in the >=
// 256 MiB cells). At D = 128 the H100 once had contiguous blocks of 64 rows 5-17% faster; on an
// H200 (same runs, 128 MiB-1 GiB cells) they read 1.71-1.97 TB/s, bound by their products (each
// block multiplies every key tile), and two warpgroups 2.49-3.09 (then with 128-key tiles,
// keys_per_tile, and 64-row boxes, 2.51-3.76 in the 128 MiB-4 GiB cells). At D = 256 (H200,
// MQA x 4 tokens, S32k, same run) two warpgroups read B64 at 3.51 TB/s on 16-key pages (3.02 as
// two blocks of 64 rows), 3.55 on 64-key pages (3.12), 3.79 contiguous (3.61); B8 paged within
// 1%, B8 contiguous 2.98 against 3.23 (two stages of 64 KB a block beside Q, not three).
inline block_shape shape_of(int64_t heads_q, int64_t heads_kv, int64_t seq_q, int64_t head_dim, int64_t page_size) {
  return block_shape_of(int(heads_q), int(heads_kv), int(seq_q), int(head_dim), page_size > 0, int(page_size));
}
inline block_shape shape_of(const Params& p) {
  return shape_of(p.heads_q, p.heads_kv, p.seq_q, p.head_dim, p.paged ? p.page_size : 0);
}

// Blocks of one key split: one per (batch row, block of `heads` KV heads, tile of a block's
// packed rows; with several heads a block holds every row of its heads).
inline int64_t split_blocks(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_q, block_shape shape) {
  const int64_t rows = PACKED_ROWS * shape.groups;
  const int64_t row_tiles = shape.heads > 1 ? 1 : (packed_rows(heads_q, heads_kv, seq_q) + rows - 1) / rows;
  return batch * (heads_kv / shape.heads) * row_tiles;
}

template <typename T, int D, int GROUPS, int HEADS = 1, atoms ORDER = atoms::panel_major>
cudaError_t decode_typed(Params p, cudaStream_t stream) {
  using config = decode_config<D, GROUPS>;
  // Window bounds beyond any cache are unbounded; clamped, key positions stay inside int.
  p.window_left = std::min(p.window_left, UNBOUNDED);
  p.window_right = std::min(p.window_right, UNBOUNDED);
  if (p.paged && p.pages_per_pool == 0) p.capacity = 0;  // no page to read: every row sees no key
  DecodeArgs args{};
  const bool bf = std::is_same_v<T, bf16>;
  const auto type = bf ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  if (p.capacity > 0) {  // else no block loads anything
    // Boxes of box_keys(...) keys of the block's heads in one 64-column panel: decode_kernel.cuh
    // says why.
    const int box = box_keys(D, p.paged, p.page_size, config::KV / HEADS);
    bool ok;
    if (!p.paged) {
      const int capacity = int(p.capacity);
      ok = tma::make_bshd_map(&args.k, p.k, type, 2, p.batch, capacity, p.heads_kv, D, box, 64, HEADS) &&
           tma::make_bshd_map(&args.v, p.v, type, 2, p.batch, capacity, p.heads_kv, D, box, 64, HEADS);
    } else if constexpr (ORDER == atoms::grouped_rows) {  // a page's rows of every panel a box
      const int pages = p.batch / p.rows_per_pool * p.pages_per_pool;
      ok = tma::make_grouped_rows_map(&args.k, p.k, type, 2, pages, p.page_size, p.heads_kv, D, box) &&
           tma::make_grouped_rows_map(&args.v, p.v, type, 2, pages, p.page_size, p.heads_kv, D, box);
    } else {  // pages as the batch axis of a [pages, page_size, heads_kv, D] tensor
      const int pages = p.batch / p.rows_per_pool * p.pages_per_pool;
      ok = tma::make_bshd_map(&args.k, p.k, type, 2, pages, p.page_size, p.heads_kv, D, box, 64, HEADS) &&
           tma::make_bshd_map(&args.v, p.v, type, 2, pages, p.page_size, p.heads_kv, D, box, 64, HEADS);
    }
    if (!ok) return cudaErrorInvalidValue;
  }
  args.p = p;
  const int blocks =
      int(split_blocks(p.batch, p.heads_q, p.heads_kv, p.seq_q, block_shape{HEADS, GROUPS}) * p.num_splits);
  const int smem = int(sizeof(decode_shared<T, D, GROUPS, ORDER>)) + 1024;
  static_assert(sizeof(decode_shared<T, D, GROUPS, ORDER>) + 1024 <= 227 * 1024 / config::BLOCKS_PER_SM - 1024,
                "the blocks of an SM must fit its shared memory");
  if (cudaError_t err = launch_with_shared<decode_kernel<T, D, GROUPS, HEADS, ORDER>>(dim3(blocks), config::THREADS,
                                                                                      smem, stream, args);
      err != cudaSuccess)
    return err;
  if (p.num_splits == 1) return cudaSuccess;

  // The combine pass, launched so that it may be scheduled while the split kernel runs (it
  // waits for that kernel's results first thing).
  const int64_t rows = split_workspace::rows(p.batch, p.heads_q, p.seq_q);
  cudaLaunchConfig_t launch{};
  const int64_t rows_per_block = COMBINE_THREADS / 32 / combine_warps_per_row(p.num_splits);
  launch.gridDim = dim3(unsigned((rows + rows_per_block - 1) / rows_per_block));
  launch.blockDim = dim3(COMBINE_THREADS);
  launch.stream = stream;
  cudaLaunchAttribute overlap{};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  launch.attrs = &overlap;
  launch.numAttrs = 1;
  return cudaLaunchKernelEx(&launch, combine_kernel<T, D>, p);
}

// Whether a call's K/V tiles are in grouped rows (grouped_rows_of).
inline bool grouped_rows(const Params& p, block_shape shape) {
  const int64_t pages = p.paged ? int64_t(p.batch / p.rows_per_pool) * p.pages_per_pool : 0;
  return grouped_rows_of(p.head_dim, p.paged, p.page_size, pages, shape);
}

// The call's kernel at head dim D: the one of its block shape (block_shape_of).
template <typename T, int D>
cudaError_t decode_head_dim(const Params& p, cudaStream_t stream) {
  constexpr atoms GROUPED = atoms::grouped_rows;
  const block_shape shape = shape_of(p);
  if constexpr (D >= 128)
    if (grouped_rows(p, shape))
      return shape.groups == 2 ? decode_typed<T, D, 2, 1, GROUPED>(p, stream) : decode_typed<T, D, 1, 1, GROUPED>(p, stream);
  if constexpr (D <= 128) {  // several KV heads a block (D <= 128 only)
    if constexpr (D == 128)
      if (shape.heads == 4 && shape.groups == 2) return decode_typed<T, D, 2, 4>(p, stream);
    if (shape.heads == 4) return decode_typed<T, D, 1, 4>(p, stream);
    if (shape.heads == 2) return decode_typed<T, D, 1, 2>(p, stream);
  }
  return shape.groups == 2 ? decode_typed<T, D, 2>(p, stream) : decode_typed<T, D, 1>(p, stream);
}

// Built in decode_d64.cu, decode_d128.cu and decode_d256.cu.
extern template cudaError_t decode_head_dim<bf16, 64>(const Params&, cudaStream_t);
extern template cudaError_t decode_head_dim<half, 64>(const Params&, cudaStream_t);
extern template cudaError_t decode_head_dim<bf16, 128>(const Params&, cudaStream_t);
extern template cudaError_t decode_head_dim<half, 128>(const Params&, cudaStream_t);
extern template cudaError_t decode_head_dim<bf16, 256>(const Params&, cudaStream_t);
extern template cudaError_t decode_head_dim<half, 256>(const Params&, cudaStream_t);

}  // namespace tk::kvcache
