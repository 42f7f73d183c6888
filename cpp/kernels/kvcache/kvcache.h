// Decode against a KV cache (flash-decoding): plain C++ entry points that know nothing of XLA.
//
// A few query tokens per batch row attend to that row's keys in a cache, which is either
// contiguous [batch, capacity, heads_kv, head_dim] or paged [num_pages, page_size, heads_kv,
// head_dim] with a page table [batch, max_pages] (logical key j of row b lives in page
// page_table[b][j / page_size] at offset j % page_size). Row b holds seqlens[b] valid keys; its
// query t sits at position seqlens[b] - seq_q + t (bottom-right alignment), and sees key j iff
//   j < seqlens[b]  and  (window_left < 0 or j >= pos - window_left)
//                   and  (window_right < 0 or j <= pos + window_right)
// (causal is window_right = 0). Rows that see no key get o = 0, lse = -inf.
//
// Inputs the kernel cannot trust, handled without reading out of bounds:
//   - seqlens[b] outside [0, capacity] is clamped into it;
//   - a page id outside [0, pages_per_pool) is clamped into it (the row's result is then
//     meaningless, but every read stays inside the cache);
//   - page-table entries past ceil(seqlens[b] / page_size) are never read, and cache rows at or
//     past seqlens[b] never reach the output (their values, NaN included, are masked out).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tk::kvcache {

enum class DType { bf16, fp16 };

// The head dims and page sizes the kernel is built for (page sizes: powers of two, so that a
// key tile holds whole pages or lies inside one).
constexpr int HEAD_DIMS[] = {64, 128, 256};
constexpr int PAGE_SIZES[] = {16, 32, 64, 128, 256};
// Most key splits a call may use (the combine pass loops over them).
constexpr int MAX_SPLITS = 256;

constexpr bool head_dim_supported(int64_t d) {
  for (int x : HEAD_DIMS)
    if (x == d) return true;
  return false;
}
constexpr bool page_size_supported(int64_t s) {
  for (int x : PAGE_SIZES)
    if (x == s) return true;
  return false;
}

// Keys per tile of the kernel's walk over the cache, for a head dim and the consumer warpgroups
// of a block (block_shape_of in decode_kernel.cuh): 128 at D = 64, and at D = 128 for two warpgroups
// (their softmax and product steps amortised over twice the keys: MQA x 4 tokens on an H200,
// +10..+14% in the 512 MiB-4 GiB cells against 64-key tiles, same run), else 64.
constexpr int keys_per_tile(int head_dim, int groups) {
  return head_dim == 64 || (head_dim == 128 && groups == 2) ? 128 : 64;
}

struct Params {
  const void* q;            // [batch, seq_q, heads_q, head_dim]
  const void* k;            // contiguous [batch, capacity, heads_kv, head_dim] or paged
  const void* v;            //   [pools * pages_per_pool, page_size, heads_kv, head_dim]
  const int32_t* seqlens;   // [batch]
  const int32_t* page_table;  // paged: [batch, max_pages]; row b's ids index pool b / rows_per_pool
  void* o;                  // [batch, seq_q, heads_q, head_dim], q's dtype
  float* lse;               // [batch, heads_q, seq_q], natural log
  void* workspace;          // workspace_bytes(...) bytes (16-byte aligned) when num_splits > 1
  int batch, seq_q, heads_q, heads_kv, head_dim;
  bool paged;
  int64_t capacity;         // contiguous: the cache's length; paged: max_pages * page_size
  // Paged caches only. A call may hold several independent caches ("pools", e.g. from vmap):
  // rows [n rows_per_pool, (n + 1) rows_per_pool) use pool n, pages [n pages_per_pool, ...).
  int page_size, max_pages, pages_per_pool, rows_per_pool;
  float scale;
  int window_left, window_right;  // -1: unbounded
  int num_splits;           // >= 1, as num_splits() resolved it (the workspace is sized for it)
  DType dtype;
};

// The key splits a call uses: `requested` (> 0) capped at what the cache's key tiles allow, or
// for 0 a choice from the grid's size and the card's multiprocessors (one split while the
// blocks of one split fill the card, else enough to fill it). page_size: a paged cache's, 0 for
// a contiguous one.
int num_splits(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_q, int64_t head_dim,
               int64_t capacity, int64_t page_size, int multiprocessors, int64_t requested);

// Bytes of the workspace output: the partial results of each split (fp32 o and lse), or 0 for
// one split. Linear in batch.
size_t workspace_bytes(int64_t batch, int64_t heads_q, int64_t seq_q, int64_t head_dim, int64_t num_splits);

// nullptr when the kernel supports `p`, else a sentence saying what is wrong.
const char* unsupported(const Params& p);

// Launches on `stream` only (the split kernel, then the combine pass when num_splits > 1);
// never synchronises or allocates. Returns the launch status.
cudaError_t decode(const Params& p, cudaStream_t stream);

}  // namespace tk::kvcache
