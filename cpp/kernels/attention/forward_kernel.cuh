// Flash attention forward for Hopper: TMA loads, wgmma, warp specialisation.
//
// The work comes in items: a block of 64 C query rows of one (batch, head), C = 2 or 3, and
// the key tiles its band can see; with segment ids, a tile of up to 128 query rows that starts
// where a document starts, and key tiles from its documents' first key. A block has C + 1
// warpgroups. Warpgroup 0 is the producer: one thread loads an item's Q and streams its K and
// V tiles (128 keys; 64 at D = 256) through rings of shared-memory stages with TMA, each stage
// guarded by a "full" barrier (the copy engine completes it) and an "empty" barrier (the
// consumers release it). Warpgroups
// 1 .. C are consumers, 64 query rows each:
//   S = Q K^T                                   (wgmma, Q and K from shared memory)
//   m' = max(m, rowmax S);  P = 2^(c S - c m');  l = 2^(c m - c m') l + rowsum P
//   O = 2^(c m - c m') O + P V                  (wgmma, P from registers, V from shared)
// with c = scale * log2(e); finally O /= l and lse = ln 2 (c m + log2 l). (m may lag the true
// max while P stays below 2^8, which skips most rescales of O: see online_softmax_step.) The
// next key tile's scores are issued before this tile's P V, so that one tile's softmax runs
// while the tensor cores work on the other's product. Registers move from the producer (which
// needs few) to the consumers with setmaxnreg. Key tiles outside the causal / window band, past
// the lengths, or (with segment ids) sharing no segment with the item's queries are never
// loaded; only tiles crossing the band's edges or the lengths, or holding more than one segment
// id, are masked element by element (segment_ranges.cuh).
//
// Two grids share that code. Where the keys are many, a plain grid runs one item per block.
// Where they are few, an item is short next to a block's start-up and write-out, so a
// persistent grid of one block per SM walks the items, and the next item's Q and first tiles
// load while the current one finishes (where items are shortest, with segment ids or few keys,
// the next Q loads during the whole current item: two Q slots). Under a band with few query
// blocks a (batch, head) pair, the persistent kernel runs two items a block instead: a query
// block and its mirror. With segment ids the persistent grid always runs, its blocks claiming
// items as they go.
#pragma once

#include <algorithm>

#include "../../kittens/kittens.cuh"
#include "attention.h"
#include "segment_ranges.cuh"
#include "softmax_band.cuh"

namespace tk::attention {

using namespace kittens;

// C consumer warpgroups of 64 query rows each. The launcher picks C per call (see
// forward_consumers below). QS: slots for an item's Q (forward_shared).
template <int D, int C, int QS = 1>
struct forward_config {
  static constexpr int CONSUMERS = C, Q_SLOTS = QS;
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  static constexpr int Q_ROWS = 64 * CONSUMERS;
  // Key tiles of 128 rows; 64 at D = 256, where the output takes 128 registers a thread and
  // two stages of 128-row K and V tiles would not fit in shared memory.
  static constexpr int KV_ROWS = D <= 128 ? 128 : 64;
  // As many K/V stages as fit beside Q in 227 KB of shared memory, up to 4: with the next
  // tile's scores computed early, K_{i+1} must land a step ahead. (D = 128: 3, 2 with two Q
  // slots; D = 256: 2.)
  static constexpr int STAGE_BYTES = 2 * KV_ROWS * D * 2, Q_BYTES = QS * Q_ROWS * D * 2;
  static constexpr int STAGES = std::min(4, (227 * 1024 - 2048 - Q_BYTES) / STAGE_BYTES);
  static_assert(STAGES >= 2);
  // Registers a producer thread keeps (the rest go to the consumers), with and without segment
  // ids: with them it claims items and works out each key tile's ids, which spills below 56.
  template <bool SEG>
  static constexpr int PRODUCER_REGS = SEG ? 56 : 24;
  template <bool SEG>
  static constexpr int CONSUMER_REGS = warpgroup::consumer_registers(1, PRODUCER_REGS<SEG>, CONSUMERS);
  // Up to this many keys the persistent grid runs. Same-card A/Bs on an H100 (docs/DESIGN.md):
  // +4-30% up to 2048 keys; at 4096 +4-10% except D=256 unmasked (-3%); at 8k-16k
  // its static walk falls behind the hardware's scheduling of causal blocks (up to -36%).
  static constexpr int PERSISTENT_MAX_KEYS = 4096;
};

// The persistent grid holds two Q slots where an item is short and two K/V stages still fit
// beside them (D <= 128): with segment ids (a document's query tile and its few key tiles), and
// at up to this many keys. An item's Q then loads while the previous item runs. (At 4096 keys
// two slots lost 1.8-4.7%: docs/DESIGN.md, "Where a short forward item's time goes".)
constexpr int TWO_Q_SLOTS_MAX_KEYS = 2048;

struct ForwardArgs {
  CUtensorMap q, k, v;  // boxes: 64 query rows, KV_ROWS key rows
  ForwardParams p;
};

// Query blocks of Q_ROWS rows per (batch, head).
template <int Q_ROWS>
__host__ __device__ inline int query_blocks(const ForwardParams& p) {
  return (p.seq_q + Q_ROWS - 1) / Q_ROWS;
}

// An item: rows [q0, rows_end) of head h, batch row b, and the key tiles it visits. Key tile t
// is keys [k_origin + t KV, k_origin + (t + 1) KV); the item visits those of [first_tile,
// end_tile) that its band (and lengths) can see, less, with segment ids (SEG), the tiles that
// share no segment with its queries (segment_ranges.cuh). Without segment ids an item is a
// query block of Q_ROWS rows, counted from the end under a causal or right window so that the
// heaviest blocks start first, and its key tiles are aligned (k_origin = 0). With them, it is a
// query tile of the prologue (query_tile): rows from a document's start, and key tiles from the
// first key of the tile's documents. The producer walks the tiles with next_tile (first_tile is
// always visited when the range is not empty) and publishes each beside its K
// (key_tile_info); it works items out (their lengths and segment ranges are loads from global
// memory) and hands them to the consumers beside their Q (forward_shared::item), so that the
// consumers never wait for those loads. A `done` item ends a persistent block's walk.
struct forward_item {
  int q0, rows_end, h, b, kv_h, k_origin, first_tile, end_tile;
  band mask_band;           // of batch row b
  int seg_lo, seg_hi;       // SEG: a range that holds the ids of the item's queries
  bool done;

  template <int Q_ROWS, int KV>
  __device__ static forward_item of_block(int q_block, int h, int b, const ForwardParams& p) {
    const band mask_band = band::of(p, b);
    if (p.window_right >= 0) q_block = query_blocks<Q_ROWS>(p) - 1 - q_block;
    const int q0 = q_block * Q_ROWS, rows_end = min(q0 + Q_ROWS, p.seq_q);
    const key_range keys = mask_band.keys_of(q0, rows_end - 1);
    forward_item w{q0, rows_end, h, b, h / (p.heads_q / p.heads_kv), 0, 0, 0, mask_band, 0, 0, false};
    w.first_tile = keys.hi > keys.lo ? keys.lo / KV : 0;
    w.end_tile = keys.hi > keys.lo ? (keys.hi + KV - 1) / KV : 0;
    return w;
  }
  template <int Q_ROWS, int KV>
  __device__ static forward_item of_tile(const query_tile& tile, int h, int b, const ForwardParams& p) {
    const band mask_band = band::of(p, b);
    key_range keys = mask_band.keys_of(tile.q0, tile.q_end - 1);
    keys = {max(keys.lo, tile.k_lo), min(keys.hi, tile.k_hi)};
    const segment_span ids = segment_ranges::of(p).queries<Q_ROWS>(b, tile.q0);
    forward_item w{tile.q0, tile.q_end, h, b, h / (p.heads_q / p.heads_kv), 0, 0, 0, mask_band,
                   ids.seg_lo, ids.seg_hi, false};
    if (keys.hi > keys.lo) {
      w.k_origin = keys.lo;
      w.end_tile = (keys.hi - keys.lo + KV - 1) / KV;
      w.first_tile = w.template next_tile<KV, true>(p, -1);
    }
    return w;
  }
  __device__ static forward_item finished() {
    forward_item w{};
    w.done = true;
    return w;
  }
  __device__ bool empty() const { return first_tile >= end_tile; }
  template <int KV>
  __device__ int key0(int t) const { return k_origin + t * KV; }
  // The visited tile after t (end_tile when none is left).
  template <int KV, bool SEG>
  __device__ int next_tile(const ForwardParams& p, int t) const {
    t++;
    if constexpr (SEG) {
#pragma unroll 1
      for (; t < end_tile; t++) {
        const segment_span ids = segment_ranges::of(p).keys<KV>(b, key0<KV>(t));
        if (ids.seg_lo <= seg_hi && seg_lo <= ids.seg_hi) break;
      }
    }
    return t;
  }
};

// What the consumers need of a key tile besides K and V, published by the producer with K (in
// the slot's own entry of forward_shared::tiles), so that they never load it from global memory.
struct key_tile_info {
  int k0;      // its first key
  int id;      // SEG: the id all its keys hold, where `single`
  int single;  // SEG: they hold one id (key_tile_id)
  int last;    // the item's last tile
};

template <typename T, int D, int C, int QS = 1>
struct forward_shared {
  using config = forward_config<D, C, QS>;
  using dtype = T;
  static constexpr int DIM = D;
  st<T, 64, D> q[QS][C];
  st<T, config::KV_ROWS, D> k[config::STAGES], v[config::STAGES];
  // Q has a ring of QS slots: in a persistent walk the consumers release an item's Q once its
  // last scores have landed, so with one slot the next item's Q loads under the last P V and
  // the write-out, with two under the whole item.
  ring<QS> q_ring;
  forward_item item[QS];  // the item whose Q is in each Q slot, published with it
  key_tile_info tiles[config::STAGES];  // of the key tile in each K slot, published with it
  // K and V have rings of their own: K_i is released as soon as its scores have landed, well
  // before V_i is done, so the next K tile can load early. K's slot also carries the tile's
  // info, which every consumer lane reads with plain loads, so every lane releases K (an
  // arrival releases only the arriving thread's reads: racecheck reported the lanes' reads
  // against the producer's next write of the entry when lane 0 released K for its warp).
  ring<config::STAGES> k_ring, v_ring;
};

// Producer (one thread): item w and its Q as use q_use of the Q ring, and its key tiles as uses
// kv_use, kv_use + 1, ... of the K and V rings; returns how many. A block's first Q goes first,
// and every Q with two slots; with one, a later Q goes after its item's first K tile, which may
// then load while the consumers still read the previous item's Q. (The consumers read an item
// when they acquire its Q, and are done with it when they release that Q.)
template <bool SEG, typename Shared>
__device__ __forceinline__ int load_item(Shared& s, const ForwardArgs& args, const forward_item& w, int q_use,
                                         int kv_use) {
  constexpr int C = Shared::config::CONSUMERS, QS = Shared::config::Q_SLOTS, KV = Shared::config::KV_ROWS;
  const int slot = q_use % QS;
  auto publish = [&](uint32_t q_bytes) -> tma::barrier& {
    s.q_ring.wait_free(q_use);
    s.item[slot] = w;
    return s.q_ring.fill(q_use, q_bytes);  // the arrival releases the item to the consumers
  };
  auto load_q = [&] {
    tma::barrier& q_full = publish(C * sizeof(s.q[0][0]));
    for (int c = 0; c < C; c++)
      tma::load_async(&s.q[slot][c], args.q, q_full, 0, w.q0 + 64 * c, 0, w.h, w.b);
  };
  const bool q_first = q_use == 0 || QS > 1;
  if (w.empty()) publish(0);  // rows that see no key: no Q to wait for
  else if (q_first) load_q();
  int n = 0;
  for (int t = w.first_tile; t < w.end_tile; n++) {
    const int next = w.template next_tile<KV, SEG>(args.p, t);
    const int use = kv_use + n, stage = s.k_ring.wait_free(use), k0 = w.template key0<KV>(t);
    key_tile_info info{k0, 0, 0, next >= w.end_tile};
    if constexpr (SEG) {
      const int64_t row = int64_t(w.b) * args.p.seq_k;
      const key_tile_id ids = key_tile_id::of(args.p.mask.kv_segment_ids + row,
                                              segment_ranges::of(args.p).kv_run_end + row, k0, KV, w.mask_band.k_end);
      info.id = ids.id;
      info.single = ids.single;
    }
    s.tiles[stage] = info;  // published by the K slot's fill below
    tma::load_async(&s.k[stage], args.k, s.k_ring.fill(use, sizeof(s.k[0])), 0, k0, 0, w.kv_h, w.b);
    if (n == 0 && !q_first) load_q();
    tma::load_async(&s.v[stage], args.v, s.v_ring.fill(use, sizeof(s.v[0])), 0, k0, 0, w.kv_h, w.b);
    t = next;
  }
  return n;
}

// Consumer warpgroup `consumer`: attention of its 64 rows of item w, whose Q is in slot q_slot
// and whose key tiles are uses kv_use, kv_use + 1, ... of the K and V rings; writes O and lse
// of the rows before w.rows_end and returns how many tiles it read. release_q() runs once Q is
// no longer read. A consumer with no row before rows_end (a short query tile) only hands the
// tiles back.
template <bool SEG, typename Shared, typename ReleaseQ>
__device__ __forceinline__ int attend_item(Shared& s, const ForwardParams& p, const forward_item& w, int q_slot,
                                           int consumer, int kv_use, ReleaseQ release_q) {
  using T = typename Shared::dtype;
  constexpr int D = Shared::DIM, KV = Shared::config::KV_ROWS;
  if (w.q0 + 64 * consumer >= w.rows_end) {
    release_q();
    for (int i = 0; !w.empty(); i++) {
      const bool last = s.tiles[s.k_ring.acquire(kv_use + i)].last;
      s.k_ring.release_each_lane(kv_use + i);
      s.v_ring.acquire(kv_use + i);
      s.v_ring.release(kv_use + i);
      if (last) return i + 1;
    }
    return 0;
  }
  const int row0 = w.q0 + 64 * consumer + 16 * warpgroup::warp_in_group();  // this warp's first row
  const float c = p.scale * LOG2E;
  const band& mask_band = w.mask_band;
  const auto masked_tile = mask_band.cuts_for_queries(row0, 16, KV);  // which key tiles need band masks
  // SEG: rows are queries, columns keys. Rows from rows_end on belong to other items: their ids
  // count as none, so that a warp whose own rows hold one document needs no segment mask.
  const int32_t* const query_ids = p.mask.q_segment_ids + int64_t(w.b) * p.seq_q;
  const int32_t* const key_ids = p.mask.kv_segment_ids + int64_t(w.b) * p.seq_k;
  const int rows_seen = min(mask_band.q_end, w.rows_end);
  warp_segments segments;
  if constexpr (SEG) segments = warp_segments::of(query_ids, row0, rows_seen);

  rt_fl<16, D> o;
  row_vec<16> m, l;
  zero(o);
  map(m, [](float) { return NEG_INF; });
  map(l, [](float) { return 0.f; });

  // Scores of the next key tile are computed while P V of this one runs: S_{i+1} and then
  // O += P_i V_i are issued back to back, the softmax of S_{i+1} overlaps the second product, and
  // O is rescaled once that product has landed. Tile i of the walk is use kv_use + i.
  rt_fl<16, KV> scores;
  row_vec<16> rescale;
  auto scores_of = [&](int i) {  // S_i = Q K_i^T, issued asynchronously; returns tile i's info
    const int stage = s.k_ring.acquire(kv_use + i);
    warpgroup::mma_ABt(scores, s.q[q_slot][consumer], s.k[stage], false);
    return s.tiles[stage];
  };
  // S_i has landed: release K_i, then scores -> P_i.
  auto softmax_of = [&](int i, const key_tile_info& tile) {
    s.k_ring.release_each_lane(kv_use + i);
    if constexpr (SEG)
      if (!(tile.single && segments.holds_only(tile.id)))
        segments.mask_all(scores, query_ids, row0, rows_seen, key_ids, tile.k0, mask_band.k_end);
    if (masked_tile.cuts(tile.k0)) mask_band.mask(scores, row0, tile.k0);
    return online_softmax_step(scores, m, l, rescale, c);  // whether O needs the rescale
  };
  auto add_pv = [&](int i, const rt<T, 16, KV>& probs) {  // O += P_i V_i, issued asynchronously
    warpgroup::mma_AB(o, probs, s.v[s.v_ring.acquire(kv_use + i)], true);
  };
  auto release_v = [&](int i) {  // P_i V_i has landed
    s.v_ring.release(kv_use + i);
  };
  key_tile_info tile{};
  if (!w.empty()) {
    tile = scores_of(0);
    warpgroup::wait<0>();
    softmax_of(0, tile);  // O is still zero: no rescale
  } else {
    release_q();
  }
  int i = 0;
  for (; !w.empty() && !tile.last; i++) {
    rt<T, 16, KV> probs;  // P_i leaves the scores before S_{i+1} overwrites them
    copy(probs, scores);
    const key_tile_info next = scores_of(i + 1);
    add_pv(i, probs);
    warpgroup::wait<1>();  // S_{i+1} has landed; P_i V_i may still run
    const bool rescaled = softmax_of(i + 1, next);
    warpgroup::wait<0>();
    release_v(i);
    if (rescaled) mul_row(o, rescale);
    tile = next;
  }
  if (!w.empty()) {  // the last tile: nothing left to overlap
    release_q();  // its scores have landed
    rt<T, 16, KV> probs;
    copy(probs, scores);
    add_pv(i, probs);
    warpgroup::wait<0>();
    release_v(i);
  }

  store_output<T, D>(o, m, l, c, p, w.b, w.h, row0, w.rows_end);
  return w.empty() ? 0 : i + 1;
}

// One thread initialises the rings, before any warp uses them.
template <typename Shared>
__device__ __forceinline__ void init_rings(Shared& s) {
  constexpr int CONSUMER_WARPS = Shared::config::CONSUMERS * 4;  // one arrival per consumer warp
  if (threadIdx.x == 0) {
    // A Q slot also carries the item, which every consumer thread reads with plain loads:
    // each thread releases it after its own read (one arrival per consumer thread).
    s.q_ring.init(CONSUMER_WARPS * 32);
    s.k_ring.init(CONSUMER_WARPS * 32);  // every consumer thread releases K (forward_shared)
    s.v_ring.init(CONSUMER_WARPS);
    tma::fence_barrier_init();
  }
  __syncthreads();
}

// Plain grid (no segment ids): block (x, y, z) runs query block x of head y, batch z.
template <typename T, int D, int C>
__global__ void __launch_bounds__(forward_config<D, C>::THREADS, 1)
    forward_kernel(const __grid_constant__ ForwardArgs args) {
  using config = forward_config<D, C>;
  const ForwardParams& p = args.p;
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<forward_shared<T, D, C>>(smem_raw);
  init_rings(s);
  if (warpgroup::groupid() == 0) {
    warpgroup::decrease_registers<config::template PRODUCER_REGS<false>>();
    if (threadIdx.x == 0) {
      const forward_item w =
          forward_item::of_block<config::Q_ROWS, config::KV_ROWS>(blockIdx.x, blockIdx.y, blockIdx.z, p);
      load_item<false>(s, args, w, 0, 0);
    }
  } else {
    warpgroup::increase_registers<config::template CONSUMER_REGS<false>>();
    s.q_ring.acquire(0);
    const forward_item w = s.item[0];
    attend_item<false>(s, p, w, 0, warpgroup::groupid() - 1, 0, [] {});  // Q is read once: never released
  }
}

template <int Q_ROWS>
__host__ __device__ inline int forward_items(const ForwardParams& p) {
  return query_blocks<Q_ROWS>(p) * p.heads_q * p.batch;
}

// Item numbers t = 0, 1, ... of a persistent grid of G = gridDim.x blocks: round n covers
// [n G, (n + 1) G), walked forwards in even rounds and backwards in odd ones, so that under the
// heaviest-first order of causal items the blocks' sums of item lengths come out close. Calls
// visit(t) with this block's numbers in increasing order until it returns false.
template <typename Visit>
__device__ __forceinline__ void walk_item_numbers(Visit visit) {
  const int G = gridDim.x;
  for (int n = 0;; n++)
    if (!visit(n * G + (n % 2 == 0 ? blockIdx.x : G - 1 - blockIdx.x))) return;
}

// The producer's walk: this block's items in turn (visit(w)), then a `done` item. Without
// segment ids item t is query block t % q_blocks, head (t / q_blocks) % heads_q, batch
// t / (q_blocks heads_q), the plain grid's order, dealt out by walk_item_numbers. With them,
// the batch rows' query tiles (segment_ranges.cuh) are numbered row after row, each tile's heads
// together (they share K and V in L2), and blocks claim the next unclaimed number as they go:
// the tiles of a packed row differ too much in length for a fixed deal (modelled on the bench's
// documents of mean 512 tokens, scripts/experiments/packed_balance_model.py: 17% over the ideal
// spread dealt, 1.6% claimed in turn).
template <int Q_ROWS, int KV, bool SEG, typename Visit>
__device__ __forceinline__ void walk_items(const ForwardParams& p, Visit visit) {
  if constexpr (SEG) {
    const segment_ranges ranges = segment_ranges::of(p);
    int* const claim = ranges.tile_counts + p.batch;
    int b = 0, row_first = 0, row_items = ranges.tile_counts[0] * p.heads_q;
    for (int t = atomicAdd(claim, 1);;) {
      const int next = atomicAdd(claim, 1);  // claimed early: ready when item t is out
      for (; t >= row_first + row_items; row_items = ranges.tile_counts[b] * p.heads_q) {
        row_first += row_items;
        if (++b == p.batch) {
          visit(forward_item::finished());
          return;
        }
      }
      const int local = t - row_first;
      visit(forward_item::of_tile<Q_ROWS, KV>(ranges.tile(b, local / p.heads_q), local % p.heads_q, b, p));
      t = next;
    }
  } else {
    const int items = forward_items<Q_ROWS>(p), q_blocks = query_blocks<Q_ROWS>(p);
    walk_item_numbers([&](int t) {
      if (t >= items) return false;
      visit(forward_item::of_block<Q_ROWS, KV>(t % q_blocks, t / q_blocks % p.heads_q, t / q_blocks / p.heads_q, p));
      return true;
    });
    visit(forward_item::finished());
  }
}

// Persistent grid: the producer walks the block's items and publishes the n-th with its Q as use
// n of the Q ring, which the consumers release once they no longer read it; the consumers take
// items until a `done` one. An item's key tiles are uses kv_use, kv_use + 1, ... of the K and V
// rings: the rings run on from item to item.
template <typename T, int D, int C, bool SEG, int QS>
__global__ void __launch_bounds__(forward_config<D, C>::THREADS, 1)
    persistent_forward_kernel(const __grid_constant__ ForwardArgs args) {
  using Shared = forward_shared<T, D, C, QS>;
  using config = typename Shared::config;
  constexpr int Q_ROWS = config::Q_ROWS, KV = config::KV_ROWS;
  const ForwardParams& p = args.p;
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<Shared>(smem_raw);

  init_rings(s);
  int kv_use = 0;
  if (warpgroup::groupid() == 0) {
    warpgroup::decrease_registers<config::template PRODUCER_REGS<SEG>>();
    if (threadIdx.x == 0) {
      int n = 0;
      walk_items<Q_ROWS, KV, SEG>(p, [&](const forward_item& w) { kv_use += load_item<SEG>(s, args, w, n++, kv_use); });
    }
  } else {
    warpgroup::increase_registers<config::template CONSUMER_REGS<SEG>>();
    const int consumer = warpgroup::groupid() - 1;
    for (int n = 0;; n++) {
      const int q_slot = s.q_ring.acquire(n);
      const forward_item w = s.item[q_slot];
      if (w.done) break;
      kv_use += attend_item<SEG>(s, p, w, q_slot, consumer, kv_use, [&] { s.q_ring.release_each_lane(n); });
    }
  }
}

// Consumers per block: 3 at D = 64 (192 query rows), where their registers allow it, except
// for causal or windowed attention over at most 2048 keys, where a 192-row block's masked
// work at the band's edge outweighs it, and with segment ids, whose documents' edges cut blocks
// the same way; else 2. (Same-card A/Bs in docs/DESIGN.md: burst-timed rounds set the limit at
// 4096 keys; at sustained clocks three consumers gain 2.9% at causal 4k.)
inline int forward_consumers(const ForwardParams& p) {
  const bool banded = p.window_left >= 0 || p.window_right >= 0;
  return p.head_dim == 64 && !(banded && p.seq_k <= 2048) && !p.mask.has_segment_ids() ? 3 : 2;
}

template <typename T, int D, int C, bool SEG, int QS>
cudaError_t launch_persistent(int blocks, const ForwardArgs& args, cudaStream_t stream) {
  return launch_with_shared<persistent_forward_kernel<T, D, C, SEG, QS>>(
      dim3(blocks), forward_config<D, C>::THREADS, int(sizeof(forward_shared<T, D, C, QS>)) + 1024, stream, args);
}

template <typename T, int D, int C, bool SEG>
cudaError_t launch_forward_with(const ForwardParams& p, cudaStream_t stream) {
  using config = forward_config<D, C>;
  ForwardArgs args{};
  args.p = p;
  const bool bf = std::is_same_v<T, bf16>;
  if (!tma::make_bshd_map(&args.q, p.q, bf, p.batch, p.seq_q, p.heads_q, D, 64) ||
      !tma::make_bshd_map(&args.k, p.k, bf, p.batch, p.seq_k, p.heads_kv, D, config::KV_ROWS) ||
      !tma::make_bshd_map(&args.v, p.v, bf, p.batch, p.seq_k, p.heads_kv, D, config::KV_ROWS))
    return cudaErrorInvalidValue;
  const int smem = int(sizeof(forward_shared<T, D, C>)) + 1024;
  auto persistent = [&](int blocks) {  // with one or two Q slots (TWO_Q_SLOTS_MAX_KEYS)
    if constexpr (D > 128) return launch_persistent<T, D, C, SEG, 1>(blocks, args, stream);
    else if constexpr (SEG) return launch_persistent<T, D, C, SEG, 2>(blocks, args, stream);
    else if (p.seq_k <= TWO_Q_SLOTS_MAX_KEYS) return launch_persistent<T, D, C, SEG, 2>(blocks, args, stream);
    else return launch_persistent<T, D, C, SEG, 1>(blocks, args, stream);
  };
  int sms = 0;
  if (cudaError_t err = multiprocessor_count(&sms); err != cudaSuccess) return err;
  // With segment ids the items are the prologue's query tiles (at most max_query_tiles a row),
  // a document's few key tiles each, short next to a block's start-up and write-out: the
  // persistent grid at any length.
  if constexpr (SEG) {
    static_assert(config::Q_ROWS == QUERY_TILE_ROWS, "a block takes one query tile");
    const int64_t bound = int64_t(p.batch) * max_query_tiles(p.seq_q) * p.heads_q;
    return persistent(int(std::min<int64_t>(bound, sms)));
  } else {
    const int items = forward_items<config::Q_ROWS>(p);
    if (p.seq_k <= config::PERSISTENT_MAX_KEYS) {
      return persistent(std::min(items, sms));
    }
    // Under a band, where a (batch, head) pair has at most half as many query blocks as the card
    // has SMs, one block a query block ends unevenly: the next pairs' heaviest blocks start while
    // the last pairs' lightest run (5.6% at D=128 causal 8k in scripts/balance_model.py, 5.7% in
    // a per-block trace), and each block pays ~3 tiles of start-up and write-out. The
    // persistent kernel on half as many blocks as items gives block b items b and
    // items - 1 - b (walk_item_numbers): a heavy query block and its mirror, so every block has
    // the same work, the second item's loads start while the first is computed, and the
    // hardware still hands blocks to SMs as they free up. Longer pairs: the plain grid (pairing them costs more
    // in the last wave than it saves, in the model). Causal forward 8k, mirrored same-card
    // rounds: D=256 +6.4%, D=128 +0.5%, D=64 -1.1% (within the rounds' spread).
    if (p.window_right >= 0 && 2 * query_blocks<config::Q_ROWS>(p) <= sms) {
      return persistent((items + 1) / 2);
    }
    const dim3 grid(query_blocks<config::Q_ROWS>(p), p.heads_q, p.batch);
    return launch_with_shared<forward_kernel<T, D, C>>(grid, config::THREADS, smem, stream, args);
  }
}

template <typename T, int D, bool SEG>
cudaError_t launch_forward(const ForwardParams& p, cudaStream_t stream) {
  if constexpr (D == 64 && !SEG) {
    if (forward_consumers(p) == 3) return launch_forward_with<T, D, 3, SEG>(p, stream);
  }
  return launch_forward_with<T, D, 2, SEG>(p, stream);
}

// The kernels for p's dtype and head dim, with (SEG) or without segment ids. Each SEG is built
// in a translation unit of its own (forward.cu, forward_segment_ids.cu), so they compile in
// parallel.
template <bool SEG>
cudaError_t launch_forward_kernels(const ForwardParams& p, cudaStream_t stream) {
  const bool bf = p.dtype == DType::bf16;
  switch (p.head_dim) {
    case 64: return bf ? launch_forward<bf16, 64, SEG>(p, stream) : launch_forward<half, 64, SEG>(p, stream);
    case 128: return bf ? launch_forward<bf16, 128, SEG>(p, stream) : launch_forward<half, 128, SEG>(p, stream);
    case 256: return bf ? launch_forward<bf16, 256, SEG>(p, stream) : launch_forward<half, 256, SEG>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

// With segment ids: the segment-range prologue, then the SEG kernels (forward_segment_ids.cu).
cudaError_t forward_with_segment_ids(const ForwardParams& p, cudaStream_t stream);

}  // namespace tk::attention
