// Flash attention forward for Hopper: TMA loads, wgmma, warp specialisation.
//
// The work comes in items: a block of 64 C query rows of one (batch, head), C = 2 or 3, and
// the key tiles its band can see. A block has C + 1 warpgroups. Warpgroup 0 is the producer:
// one thread loads an item's Q and streams its K and V tiles (128 keys; 64 at D = 256)
// through rings of shared-memory stages with TMA, each stage guarded by a "full" barrier (the
// copy engine completes it) and an "empty" barrier (the consumers release it). Warpgroups
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
// load while the current one finishes. Under a band with few query blocks a (batch, head)
// pair, the persistent kernel runs two items a block instead: a query block and its mirror.
#pragma once

#include <algorithm>

#include "../../kittens/kittens.cuh"
#include "attention.h"
#include "segment_ranges.cuh"
#include "softmax_band.cuh"

namespace tk::attention {

using namespace kittens;

// C consumer warpgroups of 64 query rows each. The launcher picks C per call (see
// forward_consumers below).
template <int D, int C>
struct forward_config {
  static constexpr int CONSUMERS = C;
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  static constexpr int Q_ROWS = 64 * CONSUMERS;
  // Key tiles of 128 rows; 64 at D = 256, where the output takes 128 registers a thread and
  // two stages of 128-row K and V tiles would not fit in shared memory.
  static constexpr int KV_ROWS = D <= 128 ? 128 : 64;
  // As many K/V stages as fit beside Q in 227 KB of shared memory, up to 4: with the next
  // tile's scores computed early, K_{i+1} must land a step ahead. (D = 128: 3; D = 256: 2.)
  static constexpr int STAGE_BYTES = 2 * KV_ROWS * D * 2, Q_BYTES = Q_ROWS * D * 2;
  static constexpr int STAGES = std::min(4, (227 * 1024 - 2048 - Q_BYTES) / STAGE_BYTES);
  static_assert(STAGES >= 2);
  static constexpr int PRODUCER_REGS = 24;
  static constexpr int CONSUMER_REGS = warpgroup::consumer_registers(1, PRODUCER_REGS, CONSUMERS);
  // Up to this many keys the persistent grid runs. Same-card A/Bs on an H100 (docs/DESIGN.md):
  // +4-30% up to 2048 keys; at 4096 +4-10% except D=256 unmasked (-3%); at 8k-16k
  // its static walk falls behind the hardware's scheduling of causal blocks (up to -36%).
  static constexpr int PERSISTENT_MAX_KEYS = 4096;
};

struct ForwardArgs {
  CUtensorMap q, k, v;  // boxes: 64 query rows, KV_ROWS key rows
  ForwardParams p;
};

// Query blocks of Q_ROWS rows per (batch, head).
template <int Q_ROWS>
__host__ __device__ inline int query_blocks(const ForwardParams& p) {
  return (p.seq_q + Q_ROWS - 1) / Q_ROWS;
}

// An item: query block q_block of (batch b, head h), counted from the end under a causal or
// right window so that the heaviest blocks start first, and the key tiles it visits: those of
// [first_tile, end_tile) that its band (and lengths) can see, less, with segment ids (SEG), the
// tiles that share no segment with its queries (segment_ranges.cuh). The producer and the
// consumers walk the same tiles with next_tile; first_tile is always visited when the range is
// not empty. The producer works items out (their lengths and segment ranges are loads from
// global memory) and hands them to the consumers beside their Q (forward_shared::item), so
// that the consumers never wait for those loads.
struct forward_item {
  int q0, h, b, kv_h, first_tile, end_tile;
  band mask_band;           // of batch row b
  int seg_lo, seg_hi;       // SEG: the id range of the item's queries
  segment_span first_ids;   // SEG: the ids of key tile first_tile

  template <int Q_ROWS, int KV, bool SEG>
  __device__ static forward_item of(int q_block, int h, int b, const ForwardParams& p) {
    const band mask_band = band::of(p, b);
    if (p.window_right >= 0) q_block = query_blocks<Q_ROWS>(p) - 1 - q_block;
    const int q0 = q_block * Q_ROWS, q_last = min(q0 + Q_ROWS, p.seq_q) - 1;
    key_range keys = mask_band.keys_of(q0, q_last);
    forward_item w{q0, h, b, h / (p.heads_q / p.heads_kv), 0, 0, mask_band, 0, 0, {}};
    if constexpr (SEG) {  // within the hull of the keys that share the queries' segments
      const segment_span ids = segment_ranges::of(p).queries<Q_ROWS>(b, q0);
      keys = {max(keys.lo, ids.other_lo), min(keys.hi, ids.other_hi)};
      w.seg_lo = ids.seg_lo;
      w.seg_hi = ids.seg_hi;
    }
    w.first_tile = keys.hi > keys.lo ? keys.lo / KV : 0;
    w.end_tile = keys.hi > keys.lo ? (keys.hi + KV - 1) / KV : 0;
    if constexpr (SEG) w.first_tile = w.template next_tile<KV, SEG>(p, w.first_tile - 1, w.first_ids);
    return w;
  }
  __device__ bool empty() const { return first_tile >= end_tile; }
  // The visited tile after t (end_tile when none is left), and with SEG its ids.
  template <int KV, bool SEG>
  __device__ int next_tile(const ForwardParams& p, int t, segment_span& ids) const {
    t++;
    if constexpr (SEG) {
#pragma unroll 1
      for (; t < end_tile; t++) {
        ids = segment_ranges::of(p).keys<KV>(b, t * KV);
        if (ids.seg_lo <= seg_hi && seg_lo <= ids.seg_hi) break;
      }
    }
    return t;
  }
};

template <typename T, int D, int C>
struct forward_shared {
  using config = forward_config<D, C>;
  st<T, 64, D> q[C];
  st<T, config::KV_ROWS, D> k[config::STAGES], v[config::STAGES];
  // Q has a one-slot ring: in a persistent walk the consumers release it once an item's last
  // scores have landed, so the next item's Q loads under the last P V and the write-out.
  ring<1> q_ring;
  forward_item item;  // the item whose Q is in the Q slot, published with it
  // K and V have rings of their own: K_i is released as soon as its scores have landed, well
  // before V_i is done, so the next K tile can load early.
  ring<config::STAGES> k_ring, v_ring;
};

// Producer (one thread): item w and its Q as use q_use of the Q ring, and its key tiles as uses
// kv_use, kv_use + 1, ... of the K and V rings; returns how many. A block's first Q goes first;
// a later one goes after its item's first K tile, which may then load while the consumers still
// read the previous item's Q. (The consumers read an item when they acquire its Q, and are done
// with it when they release that Q.)
template <bool SEG, typename T, int D, int C>
__device__ __forceinline__ int load_item(forward_shared<T, D, C>& s, const ForwardArgs& args, const forward_item& w,
                                         int q_use, int kv_use) {
  constexpr int KV = forward_config<D, C>::KV_ROWS;
  auto publish = [&](uint32_t q_bytes) -> tma::barrier& {
    s.q_ring.wait_free(q_use);
    s.item = w;
    return s.q_ring.fill(q_use, q_bytes);  // the arrival releases the item to the consumers
  };
  auto load_q = [&] {
    tma::barrier& q_full = publish(C * sizeof(s.q[0]));
    for (int c = 0; c < C; c++) tma::load_async(&s.q[c], args.q, q_full, 0, w.q0 + 64 * c, 0, w.h, w.b);
  };
  if (w.empty()) publish(0);  // rows that see no key: no Q to wait for
  else if (q_use == 0) load_q();
  int n = 0;
  segment_span ids;
  for (int t = w.first_tile; t < w.end_tile; t = w.template next_tile<KV, SEG>(args.p, t, ids), n++) {
    const int use = kv_use + n, stage = s.k_ring.slot(use), k0 = t * KV;
    tma::load_async(&s.k[stage], args.k, s.k_ring.fill(use, sizeof(s.k[0])), 0, k0, 0, w.kv_h, w.b);
    if (n == 0 && q_use > 0) load_q();
    tma::load_async(&s.v[stage], args.v, s.v_ring.fill(use, sizeof(s.v[0])), 0, k0, 0, w.kv_h, w.b);
  }
  return n;
}

// Consumer warpgroup `consumer`: attention of its 64 rows of item w, whose key tiles are uses
// kv_use, kv_use + 1, ... of the K and V rings; writes O and lse and returns how many tiles it
// read. release_q() runs once Q is no longer read.
template <bool SEG, typename T, int D, int C, typename ReleaseQ>
__device__ __forceinline__ int attend_item(forward_shared<T, D, C>& s, const ForwardParams& p, const forward_item& w,
                                           int consumer, int kv_use, ReleaseQ release_q) {
  constexpr int KV = forward_config<D, C>::KV_ROWS;
  const int row0 = w.q0 + 64 * consumer + 16 * warpgroup::warp_in_group();  // this warp's first row
  const float c = p.scale * LOG2E;
  const band& mask_band = w.mask_band;
  const auto masked_tile = mask_band.cuts_for_queries(row0, 16, KV);  // which key tiles need band masks
  // SEG: rows are queries, columns keys.
  const int32_t* const query_ids = p.mask.q_segment_ids + int64_t(w.b) * p.seq_q;
  const int32_t* const key_ids = p.mask.kv_segment_ids + int64_t(w.b) * p.seq_k;
  warp_segments segments;
  if constexpr (SEG) segments = warp_segments::of(query_ids, row0, mask_band.q_end);

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
  auto scores_of = [&](int i) {  // S_i = Q K_i^T, issued asynchronously
    warpgroup::mma_ABt(scores, s.q[consumer], s.k[s.k_ring.acquire(kv_use + i)], false);
  };
  // S_i (key tile t, of ids `ids`) has landed: release K_i, then scores -> P_i.
  auto softmax_of = [&](int i, int t, const segment_span& ids) {
    s.k_ring.release(kv_use + i);
    const int k0 = t * KV;
    if constexpr (SEG) segments.mask(scores, ids, query_ids, row0, mask_band.q_end, key_ids, k0, mask_band.k_end);
    if (masked_tile.cuts(k0)) mask_band.mask(scores, row0, k0);
    return online_softmax_step(scores, m, l, rescale, c);  // whether O needs the rescale
  };
  auto add_pv = [&](int i, const rt<T, 16, KV>& probs) {  // O += P_i V_i, issued asynchronously
    warpgroup::mma_AB(o, probs, s.v[s.v_ring.acquire(kv_use + i)], true);
  };
  auto release_v = [&](int i) {  // P_i V_i has landed
    s.v_ring.release(kv_use + i);
  };
  int t = w.first_tile, i = 0;
  segment_span ids = w.first_ids;  // of tile t, then of the next one (loaded a step early)
  if (!w.empty()) {
    scores_of(0);
    warpgroup::wait<0>();
    softmax_of(0, t, ids);  // O is still zero: no rescale
  } else {
    release_q();
  }
  for (int next = w.template next_tile<KV, SEG>(p, t, ids); next < w.end_tile;
       t = next, next = w.template next_tile<KV, SEG>(p, next, ids), i++) {
    rt<T, 16, KV> probs;  // P_i leaves the scores before S_{i+1} overwrites them
    copy(probs, scores);
    scores_of(i + 1);
    add_pv(i, probs);
    warpgroup::wait<1>();  // S_{i+1} has landed; P_i V_i may still run
    const bool rescaled = softmax_of(i + 1, next, ids);
    warpgroup::wait<0>();
    release_v(i);
    if (rescaled) mul_row(o, rescale);
  }
  if (!w.empty()) {  // the last tile: nothing left to overlap
    release_q();  // its scores have landed
    rt<T, 16, KV> probs;
    copy(probs, scores);
    add_pv(i, probs);
    warpgroup::wait<0>();
    release_v(i);
  }

  store_output<T, D>(o, m, l, c, p, w.b, w.h, row0);
  return w.empty() ? 0 : i + 1;
}

// One thread initialises the rings, before any warp uses them.
template <typename T, int D, int C>
__device__ __forceinline__ void init_rings(forward_shared<T, D, C>& s) {
  constexpr int CONSUMER_WARPS = C * 4;  // one arrival per consumer warp
  if (threadIdx.x == 0) {
    // The Q slot also carries the item, which every consumer thread reads with plain loads:
    // each thread releases it after its own read (one arrival per consumer thread).
    s.q_ring.init(CONSUMER_WARPS * 32);
    s.k_ring.init(CONSUMER_WARPS);
    s.v_ring.init(CONSUMER_WARPS);
    tma::fence_barrier_init();
  }
  __syncthreads();
}

// Plain grid: block (x, y, z) runs query block x of head y, batch z.
template <typename T, int D, int C, bool SEG>
__global__ void __launch_bounds__(forward_config<D, C>::THREADS, 1)
    forward_kernel(const __grid_constant__ ForwardArgs args) {
  using config = forward_config<D, C>;
  const ForwardParams& p = args.p;
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<forward_shared<T, D, C>>(smem_raw);
  init_rings(s);
  if (warpgroup::groupid() == 0) {
    warpgroup::decrease_registers<config::PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      const forward_item w =
          forward_item::of<config::Q_ROWS, config::KV_ROWS, SEG>(blockIdx.x, blockIdx.y, blockIdx.z, p);
      load_item<SEG>(s, args, w, 0, 0);
    }
  } else {
    warpgroup::increase_registers<config::CONSUMER_REGS>();
    s.q_ring.acquire(0);
    const forward_item w = s.item;
    attend_item<SEG>(s, p, w, warpgroup::groupid() - 1, 0, [] {});  // Q is read once: never released
  }
}

template <int Q_ROWS>
__host__ __device__ inline int forward_items(const ForwardParams& p) {
  return query_blocks<Q_ROWS>(p) * p.heads_q * p.batch;
}

// This block's items in a persistent grid of G = gridDim.x blocks: round n covers items
// [n G, (n + 1) G), walked forwards in even rounds and backwards in odd ones, so that under the
// heaviest-first order of causal items the blocks' sums of item lengths come out close. Item t
// is query block t % q_blocks, head (t / q_blocks) % heads_q, batch t / (q_blocks heads_q), the
// plain grid's order. Calls visit(t, n) for the n-th item, t.
template <int Q_ROWS, typename Visit>
__device__ __forceinline__ void walk_items(const ForwardParams& p, Visit visit) {
  const int items = forward_items<Q_ROWS>(p);
  const int G = gridDim.x;
  for (int n = 0;; n++) {
    const int t = n * G + (n % 2 == 0 ? blockIdx.x : G - 1 - blockIdx.x);
    if (t >= items) break;
    visit(t, n);
  }
}

// Persistent grid: each block walks its items; the producer works out the n-th item and loads
// its Q as use n of the Q ring, which the consumers release once they no longer read it. An
// item's key tiles are uses kv_use, kv_use + 1, ... of the K and V rings: the rings run on from
// item to item.
template <typename T, int D, int C, bool SEG>
__global__ void __launch_bounds__(forward_config<D, C>::THREADS, 1)
    persistent_forward_kernel(const __grid_constant__ ForwardArgs args) {
  using config = forward_config<D, C>;
  constexpr int Q_ROWS = config::Q_ROWS, KV = config::KV_ROWS;
  const ForwardParams& p = args.p;
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<forward_shared<T, D, C>>(smem_raw);

  init_rings(s);
  int kv_use = 0;
  if (warpgroup::groupid() == 0) {
    warpgroup::decrease_registers<config::PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      const int q_blocks = query_blocks<Q_ROWS>(p);
      walk_items<Q_ROWS>(p, [&](int t, int n) {
        const forward_item w =
            forward_item::of<Q_ROWS, KV, SEG>(t % q_blocks, t / q_blocks % p.heads_q, t / q_blocks / p.heads_q, p);
        kv_use += load_item<SEG>(s, args, w, n, kv_use);
      });
    }
  } else {
    warpgroup::increase_registers<config::CONSUMER_REGS>();
    const int consumer = warpgroup::groupid() - 1;
    walk_items<Q_ROWS>(p, [&](int, int n) {
      s.q_ring.acquire(n);
      const forward_item w = s.item;
      kv_use += attend_item<SEG>(s, p, w, consumer, kv_use, [&] { s.q_ring.release_each_lane(n); });
    });
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
  int sms = 0;
  if (cudaError_t err = multiprocessor_count(&sms); err != cudaSuccess) return err;
  const int items = forward_items<config::Q_ROWS>(p);
  // With segment ids the items are a document's few tiles, short next to a block's start-up
  // and write-out: the persistent grid at any length.
  if (p.seq_k <= config::PERSISTENT_MAX_KEYS || SEG) {
    const dim3 grid(std::min(items, sms));
    return launch_with_shared<persistent_forward_kernel<T, D, C, SEG>>(grid, config::THREADS, smem, stream, args);
  }
  // Under a band, where a (batch, head) pair has at most half as many query blocks as the card
  // has SMs, one block a query block ends unevenly: the next pairs' heaviest blocks start while
  // the last pairs' lightest run (5.6% at D=128 causal 8k in scripts/balance_model.py, 5.7% in
  // a per-block trace), and each block pays ~3 tiles of start-up and write-out. The
  // persistent kernel on half as many blocks as items gives block b items b and
  // items - 1 - b (walk_items): a heavy query block and its mirror, so every block has the same
  // work, the second item's loads start while the first is computed, and the hardware still
  // hands blocks to SMs as they free up. Longer pairs: the plain grid (pairing them costs more
  // in the last wave than it saves, in the model). Causal forward 8k, mirrored same-card
  // rounds: D=256 +6.4%, D=128 +0.5%, D=64 -1.1% (within the rounds' spread).
  if (p.window_right >= 0 && 2 * query_blocks<config::Q_ROWS>(p) <= sms) {
    const dim3 grid((items + 1) / 2);
    return launch_with_shared<persistent_forward_kernel<T, D, C, SEG>>(grid, config::THREADS, smem, stream, args);
  }
  const dim3 grid(query_blocks<config::Q_ROWS>(p), p.heads_q, p.batch);
  return launch_with_shared<forward_kernel<T, D, C, SEG>>(grid, config::THREADS, smem, stream, args);
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
