// Attention of a few query tokens against a KV cache, bound by reading the cache: every K/V
// byte is read once, at the speed of the card's memory.
//
// Query heads that share a KV head, and the query tokens, are packed into the rows of one tile:
// packed row r = t group + g is token t of query head kv_head group + g (group = heads_q /
// heads_kv), so one pass over a KV head's keys serves all of them. A block owns 64 packed rows of
// one (batch row, KV head) and one split of its keys (several splits when batch x heads_kv
// cannot fill the card; the combine pass merges them), or 128 packed rows where a KV head has
// more than 64 (MQA with several tokens; block_shape_of): then two consumer warpgroups share
// the K/V tiles, read once for all 128. It has two roles:
//   - a producer warp streams key tiles of K and V into rings of shared-memory stages with TMA,
//     as boxes of a few rows of one 64-column panel (at most a page), a box a lane, or of a
//     page's rows of every panel (one KV head a block on pages under 64 keys at D >= 128:
//     grouped_rows_of); a paged cache's page ids are read 32 at a time across the warp; where
//     boxes are of 16 keys, a second warp takes V's;
//   - one consumer warpgroup per 64 rows (Q in registers, or in shared memory at D = 256) runs
//     the online softmax over the tiles, as the attention forward does:
//       S = Q K^T;  m' = max(m, rowmax S);  P = 2^(c S - c m');  l = 2^(c m - c m') l + rowsum P
//       O = 2^(c m - c m') O + P V
//     with c = scale log2(e); the next tile's scores are issued before this tile's P V.
// Paged caches with pages under 64 keys, where a KV head's packed rows fit 16 or 32: a block
// owns several KV heads (block_shape_of), its boxes a page of all of them, and each consumer
// warp 16 of one head's rows, on that head's rows of the tiles only (attend_own_head; with two
// consumer warpgroups, two warps a head).
// Out: O / l and lse = ln 2 (c m + log2 l), straight into o and lse with one split, else as the
// split's partial result into the workspace (split_workspace.cuh).
// One block an SM (decode_config says why, and how many stages a block has).
#pragma once

#include <algorithm>
#include <climits>
#include <type_traits>

#include "../../kittens/kittens.cuh"
#include "../attention/softmax_band.cuh"  // online_softmax_step
#include "kvcache.h"
#include "split_workspace.cuh"

namespace tk::kvcache {

using namespace kittens;

// Packed query rows per consumer warpgroup: the M of its products.
constexpr int PACKED_ROWS = 64;
// Key tiles are loaded as boxes of this many keys (of each of the block's KV heads) of one
// 64-column panel, a box a lane of a producer warp; tile_keys: a tile's keys of each head.
// A contiguous cache's: at D = 64 (a tile of 128 rows of 128 bytes, rows a KV head apart) one
// box a tile read 2.33-2.58 TB/s where 16-row boxes read 2.67-2.87 (B 1 and 8, 128k keys, 32/8
// and 64/8; 32-row boxes 2.47-2.64, 8-row 2.34-2.60; H100, same runs). At D = 128 the 64-key
// tiles read within noise at 16 and 32 rows (H100), and the 128-key tiles of two warpgroups
// read 3.48 TB/s in 16-row boxes where 64-row pages read 4.00 (H200, B64 S128k MQA).
// A paged cache's: a page, at most 64 rows (a box never crosses a page). Each box looks its
// page up, and tiles of fewer boxes read faster: at D = 64, 64-row boxes read 3.57 TB/s for
// 64-key pages and 3.56 for 256-key pages where 16-row boxes read 2.67 and 2.77 (contiguous
// 3.54-3.60; H200, B8 S32k 32/8, one token, same run). But not one box of all panels: pages of
// a tile or more loaded that way read 3.2 TB/s at D = 128 where these boxes read 4.1 (H200);
// smaller pages of one KV head do (grouped_rows_of).
constexpr int box_keys(int head_dim, bool paged, int page_size, int tile_keys) {
  if (!paged) return head_dim == 64 ? 16 : 64;
  const int page_box = page_size < 64 ? page_size : 64;
  return page_box < tile_keys ? page_box : tile_keys;
}

// The shape of a block: the KV heads it reads together and its consumer warpgroups.
// Consumer warpgroups: two where a KV head has more than 64 packed rows (MQA with several
// tokens), so that its keys are read once for 128 of them (decode_launch.cuh's shape_of says
// what was measured), or where four KV heads take two warps each; else one.
// KV heads: pages smaller than 64 keys, read in boxes of one KV head, a page each with its
// lookup (2 KB boxes at 16 keys), ran at ~0.74x of contiguous caches. A block of several KV
// heads loads each page of all of them at once (one lookup, boxes of heads x page_size rows),
// and its consumer warps are dealt out to the heads, each running its head's rows on that
// head's rows of the tile, with D <= 128 (its O, D fp32 a row, beside Q in registers): four
// heads, a warp each, where a head's query heads x tokens fit a warp's 16 rows; where they fit
// 32, four heads of two warps each (two consumer warpgroups) at D = 128, else two heads of two
// warps each (one warpgroup); else one head (the warpgroup's wgmma over its rows). H200,
// mirrored rounds of one run each:
// - four heads a warp each (B8 S32k 32/8 and 64/8, 16-key pages): 2.86 -> 3.78-3.81 TB/s at
//   D = 128 and 2.63 -> 3.66-3.74 at D = 64 (contiguous 3.83-3.88 and 3.55-3.59); 32-key pages
//   3.70 -> 3.76-3.82 and 3.33 -> 3.61-3.69;
// - two heads of two warps each (64/8 x 4 tokens, 16-key pages): 2.85 -> 3.16-3.18 at D = 128
//   and 2.62 -> 2.91-2.94 at D = 64, bound by the warps' products (without them, timing only:
//   +13..+25%), one warp a scheduler;
// - four heads of two warps each, two warps a scheduler (64/8 x 4 tokens, B8 and B64 S32k):
//   at D = 128 16-key pages 3.16-3.24 -> 3.84-4.10 TB/s and 32-key pages 3.51-3.63 -> 3.88-4.07
//   (contiguous 3.86-4.08); at D = 64 mixed (16-key pages B8 2.92 -> 3.21 but B64 3.90 ->
//   3.46; 32-key pages 3.22 -> 3.39 and 3.94 -> 3.67), so D = 64 keeps two heads a block.
struct block_shape {
  int heads, groups;
};
constexpr block_shape block_shape_of(int heads_q, int heads_kv, int seq_q, int head_dim, bool paged, int page_size) {
  const int rows = heads_kv > 0 ? heads_q / heads_kv * seq_q : 0;
  if (paged && page_size < 64 && head_dim <= 128) {
    if (rows <= 16 && heads_kv % 4 == 0) return {4, 1};
    if (rows <= 32 && heads_kv % 4 == 0 && head_dim == 128) return {4, 2};
    if (rows <= 32 && heads_kv % 2 == 0) return {2, 1};
  }
  return {1, rows > PACKED_ROWS ? 2 : 1};
}

template <int D, int GROUPS>
struct decode_config {
  static constexpr int KV = keys_per_tile(D, GROUPS);  // keys per tile
  static constexpr int ROWS = PACKED_ROWS * GROUPS;  // packed rows per block
  // One block an SM (ncu: its registers and shared memory leave no room for a second; the
  // register file's four sub-partitions hold 16K registers each). K/V tiles in flight: three
  // for one consumer warpgroup (stages of 32 KB, 64 KB at D = 256), for two as many as 192 KB
  // hold (six stages of 32 KB at D = 64, three of 64 KB at D = 128; at D = 256 two of 64 KB,
  // beside Q's 64 KB).
  static constexpr int BLOCKS_PER_SM = 1;
  static constexpr int STAGE_BYTES = 2 * KV * D * 2;  // K and V tiles of 2-byte elements
  // Q stays in registers for the whole walk, except at D = 256 where O alone takes 128
  // registers a thread: there it is read from shared memory by each product (a 64-row tile a
  // consumer warpgroup, 64 KB for two, which leaves two stages of 64 KB beside them).
  static constexpr bool Q_IN_SHARED = D == 256;
  static constexpr int STAGES = GROUPS == 1 ? 3 : (Q_IN_SHARED ? 128 : 192) * 1024 / STAGE_BYTES;
  static constexpr int CONSUMER_THREADS = 128 * GROUPS;  // warpgroups 0 (and 1): the consumers
  // The producer, after the consumers: two warps (load_tiles says which of them load), or with
  // two consumer warpgroups a whole warpgroup (two warps of it load) that hands its registers
  // to the consumers (setmaxnreg moves them per warpgroup; a ninth warp alone would cap every
  // thread at 168).
  static constexpr int PRODUCER_THREADS = GROUPS == 2 ? 128 : 64;
  static constexpr int THREADS = CONSUMER_THREADS + PRODUCER_THREADS;
  // At D = 256 the consumers keep the 240 registers one warpgroup uses there.
  static constexpr int PRODUCER_REGS = D == 256 ? 32 : 40;
  static constexpr int CONSUMER_REGS = warpgroup::consumer_registers(1, PRODUCER_REGS, GROUPS);
  // Registers a thread may use at launch: one consumer warpgroup at D <= 128 is capped at 200
  // (a few bytes spill; six stages and no cap, where ptxas takes ~220, ran up to 7% slower at
  // D = 64, same run).
  static constexpr int MAX_REGISTERS = GROUPS == 1 && D <= 128 ? 200 : std::min(255, 65536 / THREADS / 8 * 8);
};

// How a block's K and V tiles are laid out in shared memory: panel by panel, or, where a block
// reads one KV head of a paged cache with pages under 64 keys at D >= 128, in 8-row groups of
// all panels, so that a page's rows of every panel are one box (fewer, larger boxes: a 16-key
// page at D = 128 is one 4 KB box, not two of 2 KB; MQA on 16-key pages at D = 128 read
// 0.75-0.86x of contiguous in panels, 0.92-0.96x so, H200). Not past 2^31 8-row groups of pages
// (TMA coordinates are int).
inline bool grouped_rows_of(int head_dim, bool paged, int page_size, int64_t pages, block_shape shape) {
  return paged && page_size < 64 && head_dim >= 128 && shape.heads == 1 && pages * page_size / 8 < (int64_t(1) << 31);
}

struct no_tile {};

template <typename T, int D, int GROUPS, atoms ORDER = atoms::panel_major>
struct decode_shared {
  using config = decode_config<D, GROUPS>;
  st<T, config::KV, D, ORDER> k[config::STAGES], v[config::STAGES];
  std::conditional_t<config::Q_IN_SHARED, st<T, PACKED_ROWS, D>[GROUPS], no_tile> q;  // a tile a warpgroup
  ring<config::STAGES> k_ring, v_ring;
};

struct DecodeArgs {
  CUtensorMap k, v;  // boxes of box_keys(...) keys of the block's KV heads, of one 64-column
                     // panel (of every panel in grouped rows)
  Params p;
};

// A window bound as wide as any cache: keeps the arithmetic on key positions inside int.
constexpr int UNBOUNDED = 1 << 30;

// What one block does: packed rows [row0, row0 + rows) of (batch row b, KV heads [kv_h, kv_h +
// heads)), and key tiles [first_tile, end_tile), its split's share of the tiles any of its rows
// can see. A tile of KV rows holds `keys` = KV / heads keys of each of its heads. Packed row r
// is token r / group of query head kv_h group + r % group; with several heads, the consumer
// warps are dealt out to them, head_warps warps of 16 rows a head (all tokens): lane_rows.
struct block_work {
  int b, kv_h, heads, head_warps, keys, split, row0, rows, seqlen, first_tile, end_tile;
  // A tile whose first key k0 is below mask_below or above mask_above holds keys that some of
  // the block's rows must not see: it gets element masks.
  int mask_below, mask_above;

  template <int KV, int ROWS, int HEADS>
  __device__ static block_work of(const Params& p, int block) {
    block_work w;
    w.heads = HEADS;
    w.head_warps = ROWS / 16 / HEADS;
    w.keys = KV / HEADS;
    const int group = p.heads_q / p.heads_kv, packed = group * p.seq_q;
    const int row_tiles = HEADS > 1 ? 1 : (packed + ROWS - 1) / ROWS;
    w.row0 = block % row_tiles * ROWS;
    block /= row_tiles;
    w.split = block % p.num_splits;
    block /= p.num_splits;
    const int head_blocks = p.heads_kv / w.heads;
    w.kv_h = block % head_blocks * w.heads;
    w.b = block / head_blocks;
    w.rows = min(ROWS, packed - w.row0);  // of each head
    w.seqlen = int(min(int64_t(max(p.seqlens[w.b], 0)), p.capacity));
    // Token t sits at position off + t. Keys [lo, hi) are those the first and last tokens of
    // the block's rows reach.
    const int off = w.seqlen - p.seq_q, t_first = w.row0 / group, t_last = (w.row0 + w.rows - 1) / group;
    const int lo = p.window_left >= 0 ? max(0, off + t_first - p.window_left) : 0;
    const int hi = p.window_right >= 0 ? min(w.seqlen, off + t_last + p.window_right + 1) : w.seqlen;
    const int first = lo / w.keys, end = hi > lo ? (hi + w.keys - 1) / w.keys : first;
    const int per_split = (end - first + p.num_splits - 1) / p.num_splits;
    w.first_tile = min(end, first + w.split * per_split);
    w.end_tile = min(end, w.first_tile + per_split);
    // Every row sees keys [off + t_last - window_left, min(seqlen - 1, off + t_first + window_right)].
    w.mask_below = p.window_left >= 0 ? off + t_last - p.window_left : -UNBOUNDED;
    w.mask_above = min(w.seqlen - 1, p.window_right >= 0 ? off + t_first + p.window_right : UNBOUNDED) - (w.keys - 1);
    return w;
  }
  __device__ int tiles() const { return end_tile - first_tile; }
  __device__ int first_key(int i) const { return (first_tile + i) * keys; }  // of use i's tile
  __device__ bool masked(int k0) const { return k0 < mask_below || k0 > mask_above; }
};

// The tile row of the tile's key `key` of the block's head h, where the tile is loaded in
// boxes of `box` keys of the block's `heads` heads: a box lands as `heads` runs of `box` rows,
// one a head. (One head: row `key`.)
__device__ __forceinline__ int tile_row(int key, int h, int box, int heads) {
  return key / box * box * heads + h * box + key % box;
}

// ---------------------------------------------------------------------------------------------
// Producer

// The page-table entries of one batch row, read 32 at a time across a producer warp (lane l
// holds entry base + l, and the next 32 are already on their way), turned into page indices
// of the cache: clamped into the row's pool. Entries from `readable` on are never read.
struct page_window {
  const int32_t* entries;
  int readable, pool_first_page, pool_pages;
  int base, current, next;

  __device__ static page_window of(const Params& p, const block_work& w, int first_page) {
    page_window pw;
    pw.entries = p.page_table + int64_t(w.b) * p.max_pages;
    pw.readable = min(p.max_pages, (w.seqlen + p.page_size - 1) / p.page_size);
    pw.pool_first_page = w.b / p.rows_per_pool * p.pages_per_pool;
    pw.pool_pages = p.pages_per_pool;
    pw.base = first_page & ~31;
    pw.current = pw.read(pw.base);
    pw.next = pw.read(pw.base + 32);
    return pw;
  }
  __device__ int read(int at) const {
    const int e = at + laneid();
    return e < readable ? entries[e] : 0;
  }
  // Moves on so that logical pages [first, first + 8) are in reach (pages only grow).
  __device__ void advance_to(int first) {
    while (first >= base + 32) {
      base += 32;
      current = next;
      next = read(base + 32);
    }
  }
  // The cache page of this lane's logical page `page` (in [base, base + 64); the whole warp calls).
  __device__ int page_of(int page) const {
    const int i = page - base;
    const int from_current = __shfl_sync(0xffffffffu, current, i & 31);
    const int from_next = __shfl_sync(0xffffffffu, next, i & 31);
    const int id = i < 32 ? from_current : from_next;
    return pool_first_page + min(max(id, 0), pool_pages - 1);
  }
};

// K (tensor 0) and/or V (tensor 1), tensors FIRST..LAST, of tiles first_tile, first_tile + 1,
// ... as uses 0, 1, ... of their rings, by one producer warp.
template <int FIRST, int LAST, typename T, int D, int GROUPS, atoms ORDER>
__device__ __forceinline__ void load_tensors(decode_shared<T, D, GROUPS, ORDER>& s, const DecodeArgs& args,
                                             const block_work& w) {
  constexpr int KV = decode_config<D, GROUPS>::KV;
  constexpr bool GROUPED = ORDER == atoms::grouped_rows;  // a box holds every panel
  const Params& p = args.p;
  const int lane = laneid();
  const int box = box_keys(D, p.paged, p.page_size, w.keys);
  // This warp's K and/or V of tile i into `stage`: lane 0 waits until the stage is free and sets
  // the bytes to expect, then load(tile, map, full) issues the lanes' boxes.
  auto k_and_v = [&](int i, int stage, uint32_t bytes, auto load) {
#pragma unroll
    for (int kv = FIRST; kv <= LAST; kv++) {
      auto& ring = kv == 0 ? s.k_ring : s.v_ring;
      if (lane == 0) ring.fill(i, bytes);
      __syncwarp();
      load(kv == 0 ? s.k[stage] : s.v[stage], kv == 0 ? args.k : args.v, ring.full[stage]);
    }
  };
  // Every tile is loaded as boxes of `box` keys of the block's heads in one 64-column panel (in
  // grouped rows: of one head in every panel), a box a lane: lane j loads keys [j % key_boxes *
  // box, + box) of the tile's, panel j / key_boxes (tile_row says where they land). A box never
  // crosses a page.
  const int key_boxes = w.keys / box, panel = lane / key_boxes, row = lane % key_boxes * box;
  const bool boxed = lane < key_boxes * (GROUPED ? 1 : D / 64);
  static_assert(KV / 16 * (D / 64) <= WARP_THREADS, "a box a lane, pages of 16 keys included");
  auto box_of = [&](auto& tile) {
    return reinterpret_cast<char*>(tile.data) + tile.row_offset(tile_row(row, 0, box, w.heads), panel);
  };
  if (!p.paged) {
    for (int i = 0; i < w.tiles(); i++) {
      const int key = w.first_key(i) + row;
      k_and_v(i, s.k_ring.slot(i), sizeof(s.k[0]), [&](auto& tile, const CUtensorMap& map, tma::barrier& full) {
        if (boxed) tma::load_async(box_of(tile), map, full, 0, key, panel, w.kv_h, w.b);
      });
    }
    return;
  }
  // Boxes of pages that hold no key below seqlen are not loaded (their table entries may be
  // anything); the consumers zero those rows of V.
  if (w.tiles() == 0) return;
  page_window pages = page_window::of(p, w, w.first_key(0) / p.page_size);
  const uint32_t box_bytes = uint32_t(box) * w.heads * (GROUPED ? D : 64) * sizeof(T);
  for (int i = 0; i < w.tiles(); i++) {
    const int k0 = w.first_key(i), key = k0 + row, logical_page = key / p.page_size;
    pages.advance_to(k0 / p.page_size);
    const int page = pages.page_of(logical_page);
    const bool load = boxed && logical_page * p.page_size < w.seqlen;
    const uint32_t bytes = __popc(__ballot_sync(0xffffffffu, load)) * box_bytes;
    k_and_v(i, s.k_ring.slot(i), bytes, [&](auto& tile, const CUtensorMap& map, tma::barrier& full) {
      if (!load) return;
      if constexpr (GROUPED)  // 8-row groups of the whole cache (the host checked they fit an int)
        tma::load_async(box_of(tile), map, full, 0, 0, 0, page * (p.page_size / 8) + key % p.page_size / 8, w.kv_h);
      else
        tma::load_async(box_of(tile), map, full, 0, key % p.page_size, panel, w.kv_h, page);
    });
  }
}

// Producer warp `warp` (0 or 1) of a block. Where tiles come in 16-key boxes (pages of 16 keys,
// or a contiguous cache at D = 64) the producer's time is in issuing boxes, so warp 0 loads K and
// warp 1 V, each issuing half of them; with larger boxes a second issuing warp gained nothing,
// and warp 0 loads both. (Both warps always splitting, MQA, H200, same run: 16-key pages
// -2..+22%, D = 64 contiguous -4..+9%; 32-key pages -5..+5%, contiguous D = 128 within noise.)
template <typename T, int D, int GROUPS, atoms ORDER>
__device__ __forceinline__ void load_tiles(decode_shared<T, D, GROUPS, ORDER>& s, const DecodeArgs& args,
                                           const block_work& w, int warp) {
  const bool split = box_keys(D, args.p.paged, args.p.page_size, w.keys) == 16;
  if (!split) {
    if (warp == 0) load_tensors<0, 1>(s, args, w);
  } else if (warp == 0) {
    load_tensors<0, 0>(s, args, w);
  } else {
    load_tensors<1, 1>(s, args, w);
  }
}

// ---------------------------------------------------------------------------------------------
// Consumers

// The two packed rows of a lane (rows g and g + 8 of its warp's 16; g = lane / 4; the warps of
// the second consumer warpgroup hold rows 64-127): the token and query head each stands for,
// and whether it is one of the block's rows.
struct lane_rows {
  bool valid[2];
  int token[2], head[2];

  __device__ static lane_rows of(const Params& p, const block_work& w) {
    const int group = p.heads_q / p.heads_kv;
    lane_rows r;
#pragma unroll
    for (int down = 0; down < 2; down++) {
      // Warp i holds rows [16 (i % head_warps), + 16) of head kv_h + i / head_warps
      const int warp_rows = 16 * (warpid() % w.head_warps);
      const int local = warp_rows + fragment_row(down);
      const int packed = w.row0 + local, kv_head = w.kv_h + warpid() / w.head_warps;
      r.valid[down] = local < w.rows;
      r.token[down] = packed / group;
      r.head[down] = kv_head * group + packed % group;
    }
    return r;
  }
};

// The keys each of the lane's rows sees: [key_lo[down], key_hi[down]].
__device__ __forceinline__ void visible_keys(const Params& p, const block_work& w, const lane_rows& rows,
                                             int (&key_lo)[2], int (&key_hi)[2]) {
#pragma unroll
  for (int down = 0; down < 2; down++) {
    const int pos = w.seqlen - p.seq_q + rows.token[down];
    key_lo[down] = p.window_left >= 0 ? pos - p.window_left : -UNBOUNDED;
    key_hi[down] = min(w.seqlen - 1, p.window_right >= 0 ? pos + p.window_right : UNBOUNDED);
  }
}

// Q of the lane's rows, straight from global memory into mma fragment order (rows of other
// blocks or past the end: zeros).
template <typename T, int D>
__device__ __forceinline__ void load_q(rt<T, 16, D>& q, const Params& p, const block_work& w, const lane_rows& rows) {
  const T* row_ptr[2];
#pragma unroll
  for (int down = 0; down < 2; down++)
    row_ptr[down] = static_cast<const T*>(p.q) +
                    ((int64_t(w.b) * p.seq_q + rows.token[down]) * p.heads_q + rows.head[down]) * D;
  const packed_t<T> zero = pack<T>(0.f, 0.f);
#pragma unroll
  for (int j = 0; j < D / 16; j++)
#pragma unroll
    for (int reg = 0; reg < 4; reg++) {
      const int down = reg & 1, col = 16 * j + fragment_col(reg, 0);
      q.tiles[0][j].data[reg] =
          rows.valid[down] ? *reinterpret_cast<const packed_t<T>*>(row_ptr[down] + col) : zero;
    }
}

// Scores of keys the lane's rows must not see become -inf: row `down` keeps keys
// [key_lo[down], key_hi[down]]; the tile's first key is k0.
template <int KV>
__device__ __forceinline__ void mask_keys(rt_fl<16, KV>& scores, const int (&key_lo)[2], const int (&key_hi)[2],
                                          int k0) {
  const int col = fragment_col(0, 0);
#pragma unroll
  for (int down = 0; down < 2; down++) {
    const int lo = key_lo[down] - k0 - col, hi = key_hi[down] - k0 - col;  // bounds on the column offset d
#pragma unroll
    for (int j = 0; j < KV / 16; j++)
#pragma unroll
      for (int right = 0; right < 2; right++) {
        float2& x = scores.tiles[0][j].data[2 * right + down];
        const int d = 16 * j + 8 * right;
        x.x = d >= lo && d <= hi ? x.x : NEG_INF;
        x.y = d + 1 >= lo && d + 1 <= hi ? x.y : NEG_INF;
      }
  }
}

// Rows [valid_rows, KV) of a V stage become zeros (the consumer warpgroup's threads share the
// work), visible to the tensor cores' next read. Those keys get probability 0, but whatever
// the cache holds there (NaN included, or an older tile where pages were not loaded) would
// still reach O through 0 x V. Whole 128-byte rows of each panel: the swizzle only permutes
// chunks inside a row.
template <int CONSUMER_THREADS, typename Tile>
__device__ __forceinline__ void zero_rows_from(Tile& tile, int valid_rows) {
  constexpr int CHUNKS = 8;  // 16-byte chunks per 128-byte panel row
  const int rows = Tile::rows - valid_rows, n = rows * Tile::panels * CHUNKS;
  char* base = reinterpret_cast<char*>(tile.data);
  for (int i = threadIdx.x; i < n; i += CONSUMER_THREADS) {
    const int chunk = i % CHUNKS, rest = i / CHUNKS, row = valid_rows + rest % rows, panel = rest / rows;
    *reinterpret_cast<uint4*>(base + Tile::row_offset(row, panel) + chunk * 16) = make_uint4(0, 0, 0, 0);
  }
  warpgroup::fence_shared_to_async();
  named_barrier_sync(1, CONSUMER_THREADS);  // every consumer warpgroup reads the tile next
}

// O / l and lse of the lane's rows: into o and lse with one split, else the split's partial
// result into the workspace.
template <typename T, int D>
__device__ __forceinline__ void store_rows(rt_fl<16, D>& o, const row_vec<16>& m, row_vec<16> l, float c,
                                           const Params& p, const block_work& w, const lane_rows& rows) {
  reduce_across_lanes(l, sum_op{});
  const bool split = p.num_splits > 1;
  const split_workspace ws =
      split ? split_workspace::of(p.workspace, split_workspace::rows(p.batch, p.heads_q, p.seq_q), p.num_splits, D)
            : split_workspace{};
#pragma unroll
  for (int down = 0; down < 2; down++) {
    if (!rows.valid[down]) continue;
    // As the attention forward's store_output: a row that saw no key (l = 0) gets exactly 0
    // (a masked key's V times P = 0 may be NaN) and -inf; a NaN the row saw reaches o and lse.
    const float lv = l.data[0][down], inv_l = lv != 0.f ? 1.f / lv : 0.f;
    const float lse = lv != 0.f ? (c * m.data[0][down] + __log2f(lv)) * LN2 : NEG_INF;
    auto scaled = [=](float x) { return inv_l != 0.f ? x * inv_l : 0.f; };
    const int64_t row = (int64_t(w.b) * p.heads_q + rows.head[down]) * p.seq_q + rows.token[down];
    T* out = static_cast<T*>(p.o) + ((int64_t(w.b) * p.seq_q + rows.token[down]) * p.heads_q + rows.head[down]) * D;
    float* partial = split ? ws.o_of(row, w.split) : nullptr;
#pragma unroll
    for (int j = 0; j < D / 16; j++)
#pragma unroll
      for (int right = 0; right < 2; right++) {
        const float2 x = o.tiles[0][j].data[2 * right + down];
        const int col = 16 * j + 8 * right + fragment_col(0, 0);
        if (split)
          *reinterpret_cast<float2*>(partial + col) = make_float2(scaled(x.x), scaled(x.y));
        else
          *reinterpret_cast<packed_t<T>*>(out + col) = pack<T>(scaled(x.x), scaled(x.y));
      }
    if ((laneid() & 3) == 0) {
      if (split) ws.lse_of(row)[w.split] = lse;
      else p.lse[row] = lse;
    }
  }
}

// A consumer warpgroup: attention of its 64 of the block's rows over the block's key tiles.
template <typename T, int D, int GROUPS, atoms ORDER>
__device__ __forceinline__ void attend(decode_shared<T, D, GROUPS, ORDER>& s, const Params& p, const block_work& w) {
  using config = decode_config<D, GROUPS>;
  constexpr int KV = config::KV;
  const float c = p.scale * LOG2E;
  const int tiles = w.tiles();
  const lane_rows rows = lane_rows::of(p, w);
  int key_lo[2], key_hi[2];
  visible_keys(p, w, rows, key_lo, key_hi);

  rt<T, 16, D> q;
  load_q(q, p, w, rows);
  const int group = GROUPS == 1 ? 0 : warpgroup::groupid();  // this warpgroup: rows [64 group, + 64)
  if constexpr (config::Q_IN_SHARED) {
    store(s.q[group], q, 16 * (warpid() - 4 * group), 0);
    warpgroup::fence_shared_to_async();
    named_barrier_sync(1, config::CONSUMER_THREADS);
  }

  rt_fl<16, D> o;
  row_vec<16> m, l, rescale;
  zero(o);
  map(m, [](float) { return NEG_INF; });
  map(l, [](float) { return 0.f; });

  rt_fl<16, KV> scores;
  auto scores_of = [&](int i) {  // S_i = Q K_i^T, issued asynchronously
    const int stage = s.k_ring.acquire(i);
    if constexpr (config::Q_IN_SHARED) warpgroup::mma_ABt(scores, s.q[group], s.k[stage], false);
    else warpgroup::mma_ABt(scores, q, s.k[stage], false);
  };
  auto softmax_of = [&](int i) {  // S_i has landed: release K_i, then scores -> P_i
    s.k_ring.release(i);
    const int k0 = (w.first_tile + i) * KV;
    if (w.masked(k0)) mask_keys(scores, key_lo, key_hi, k0);
    return attention::online_softmax_step(scores, m, l, rescale, c);  // whether O needs the rescale
  };
  auto add_pv = [&](int i, const rt<T, 16, KV>& probs) {  // O += P_i V_i, issued asynchronously
    const int stage = s.v_ring.acquire(i);
    const int k0 = (w.first_tile + i) * KV;
    if (k0 + KV > w.seqlen)  // the last tile of the keys
      zero_rows_from<config::CONSUMER_THREADS>(s.v[stage], w.seqlen - k0);
    warpgroup::mma_AB(o, probs, s.v[stage], true);
  };

  if (tiles > 0) {
    scores_of(0);
    warpgroup::wait<0>();
    softmax_of(0);  // O is still zero: no rescale
  }
  for (int i = 0; i + 1 < tiles; i++) {
    rt<T, 16, KV> probs;  // P_i leaves the scores before S_{i+1} overwrites them
    copy(probs, scores);
    scores_of(i + 1);
    add_pv(i, probs);
    warpgroup::wait<1>();  // S_{i+1} has landed; P_i V_i may still run
    const bool rescaled = softmax_of(i + 1);
    warpgroup::wait<0>();
    s.v_ring.release(i);
    if (rescaled) mul_row(o, rescale);
  }
  if (tiles > 0) {
    rt<T, 16, KV> probs;
    copy(probs, scores);
    add_pv(tiles - 1, probs);
    warpgroup::wait<0>();
    s.v_ring.release(tiles - 1);
  }
  store_rows<T, D>(o, m, l, c, p, w, rows);
}

// Keys [n, 16) of a 16-key tile of V in mma's B order become zeros: lane l holds keys 2 (l % 4)
// and + 1 of each 8x8 matrix (data[0..1]: keys 0-7, data[2..3]: keys 8-15), as packed pairs.
template <typename T, int C>
__device__ __forceinline__ void zero_keys_from(rt<T, 16, C, layout::col>& v, int n) {
  const int key = 2 * (laneid() % 4);
#pragma unroll
  for (int j = 0; j < C / 16; j++)
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int k = key + (r >= 2 ? 8 : 0);
      uint32_t& x = as_u32(v.tiles[0][j].data[r]);
      if (k >= n) x &= 0xffff0000u;  // the first of the pair is the low half
      if (k + 1 >= n) x &= 0x0000ffffu;
    }
}

// A consumer warp of a block of HEADS KV heads: attention of its 16 of its head's rows over
// the block's key tiles, on that head's rows of each tile only (so a NaN in another head's K or
// V never meets these rows), with the warp's own mma.sync products, 16 keys at a time:
//   S = Q K_h^T;  m' = max(m, rowmax S);  P = 2^(c S - c m');  l = 2^(c m - c m') l + rowsum P
//   O = 2^(c m - c m') O + P V_h
template <typename T, int D, int GROUPS, int HEADS>
__device__ __forceinline__ void attend_own_head(decode_shared<T, D, GROUPS>& s, const Params& p, const block_work& w) {
  constexpr int KEYS = decode_config<D, GROUPS>::KV / HEADS;  // of each head in a tile
  const float c = p.scale * LOG2E;
  const int h = warpid() / w.head_warps, box = box_keys(D, true, p.page_size, KEYS);
  auto row_of = [&](int key) { return tile_row(key, h, box, HEADS); };
  const lane_rows rows = lane_rows::of(p, w);
  int key_lo[2], key_hi[2];
  visible_keys(p, w, rows, key_lo, key_hi);
  rt<T, 16, D> q;
  load_q(q, p, w, rows);
  rt_fl<16, D> o;
  row_vec<16> m, l, rescale;
  zero(o);
  map(m, [](float) { return NEG_INF; });
  map(l, [](float) { return 0.f; });

  for (int i = 0; i < w.tiles(); i++) {
    const int k0 = w.first_key(i);
    rt_fl<16, KEYS> scores;
    zero(scores);
    int stage = s.k_ring.acquire(i);
#pragma unroll
    for (int j = 0; j < KEYS / 16; j++) {
      rt<T, 16, D> k;
      load(k, s.k[stage], row_of(16 * j), 0);
#pragma unroll
      for (int d = 0; d < D / 16; d++) detail::mma_base(scores.tiles[0][j], q.tiles[0][d], k.tiles[0][d]);
    }
    s.k_ring.release(i);
    if (w.masked(k0)) mask_keys(scores, key_lo, key_hi, k0);
    const bool rescaled = attention::online_softmax_step(scores, m, l, rescale, c);
    if (rescaled && i > 0) mul_row(o, rescale);
    rt<T, 16, KEYS> probs;
    copy(probs, scores);
    stage = s.v_ring.acquire(i);
#pragma unroll
    for (int j = 0; j < KEYS / 16; j++) {
      rt<T, 16, D, layout::col> v;
      load(v, s.v[stage], row_of(16 * j), 0);
      // Keys past seqlen (not loaded, or another row's cache) must not reach O through 0 x V
      if (k0 + 16 * j + 16 > w.seqlen) zero_keys_from(v, w.seqlen - k0 - 16 * j);
#pragma unroll
      for (int d = 0; d < D / 16; d++) detail::mma_base(o.tiles[0][d], probs.tiles[0][j], v.tiles[0][d]);
    }
    s.v_ring.release(i);
  }
  store_rows<T, D>(o, m, l, c, p, w, rows);
}

// Programmatic dependent launch: this grid lets the combine pass be scheduled while it runs;
// the combine pass waits for it to finish (and its writes to be visible) before reading.
__device__ __forceinline__ void allow_dependent_launch() { asm volatile("griddepcontrol.launch_dependents;\n" ::); }
__device__ __forceinline__ void wait_for_prerequisite_grid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// Block i: packed row tile i % row_tiles, then split, KV head (or HEADS of them:
// block_shape_of) and batch row (block_work::of).
template <typename T, int D, int GROUPS, int HEADS, atoms ORDER, typename config = decode_config<D, GROUPS>>
__global__ void __launch_bounds__(config::THREADS, 1) __maxnreg__(config::MAX_REGISTERS)
    decode_kernel(const __grid_constant__ DecodeArgs args) {
  allow_dependent_launch();
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<decode_shared<T, D, GROUPS, ORDER>>(smem_raw);
  const block_work w = block_work::of<config::KV, config::ROWS, HEADS>(args.p, blockIdx.x);
  if (threadIdx.x == 0) {
    s.k_ring.init(config::CONSUMER_THREADS / 32);  // one release per consumer warp
    s.v_ring.init(config::CONSUMER_THREADS / 32);
    tma::fence_barrier_init();
  }
  __syncthreads();
  auto consume = [&] {
    if constexpr (HEADS > 1) attend_own_head<T, D, GROUPS, HEADS>(s, args.p, w);
    else attend(s, args.p, w);
  };
  const int producer_warp = (int(threadIdx.x) - config::CONSUMER_THREADS) / 32;
  if constexpr (GROUPS == 1) {
    if (threadIdx.x >= config::CONSUMER_THREADS) load_tiles(s, args, w, producer_warp);
    else consume();
  } else if (threadIdx.x >= config::CONSUMER_THREADS) {
    warpgroup::decrease_registers<config::PRODUCER_REGS>();
    if (producer_warp < 2) load_tiles(s, args, w, producer_warp);
  } else {
    warpgroup::increase_registers<config::CONSUMER_REGS>();
    consume();
  }
}

}  // namespace tk::kvcache
