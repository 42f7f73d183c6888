// What the attention kernels share: the causal / sliding-window band, one step of the online
// softmax for a warp's 16 query rows, and the final O / lse write-out.
#pragma once

#include "../../kittens/kittens.cuh"
#include "attention.h"

namespace tk::attention {

using namespace kittens;

// A half-open range [lo, hi) of sequence positions.
struct key_range {
  int lo, hi;
};

// The band of one batch row (attention.h's mask rule, less the segment ids): query i sees key j
// iff i < q_end and j < k_end (the lengths) and
//   (window_left < 0 or j >= i + offset - window_left) and (window_right < 0 or j <= i + offset + window_right),
// offset = k_end - q_end (bottom-right alignment) or 0 (top-left).
struct band {
  int q_end, k_end, offset, window_left, window_right;
  // The queries in memory: rows in [q_end, seq_q) are padding, written as O = 0, lse = -inf, so
  // tiles holding them are masked; rows past seq_q are never written.
  int seq_q;

  template <typename Params>
  __device__ static band of(const Params& p, int b) {
    const int q_end = p.mask.q_lengths ? min(max(p.mask.q_lengths[b], 0), p.seq_q) : p.seq_q;
    const int k_end = p.mask.kv_lengths ? min(max(p.mask.kv_lengths[b], 0), p.seq_k) : p.seq_k;
    return {q_end, k_end, p.mask.bottom_right ? k_end - q_end : 0, p.window_left, p.window_right, p.seq_q};
  }
  // Keys that queries [first, last] may see (empty: hi <= lo).
  __device__ key_range keys_of(int first, int last) const {
    if (first >= q_end) return {0, 0};
    last = min(last, q_end - 1);
    return {window_left >= 0 ? max(0, first + offset - window_left) : 0,
            window_right >= 0 ? min(k_end, last + offset + window_right + 1) : k_end};
  }
  // Queries that may see keys [first, last] (empty: hi <= lo).
  __device__ key_range queries_of(int first, int last) const {
    if (first >= k_end) return {0, 0};
    last = min(last, k_end - 1);
    return {window_right >= 0 ? max(0, first - offset - window_right) : 0,
            window_left >= 0 ? min(q_end, last - offset + window_left + 1) : q_end};
  }
  // Masks a tile of scores whose element (r, c) pairs query q0 + r with key k0 + c, or (with
  // keys_down) key k0 + r with query q0 + c: invisible pairs become -inf. Query i sees key j
  // when j - i lies in [offset - window_left, offset + window_right], i < q_end and j < k_end.
  template <bool keys_down = false, int R, int C>
  __device__ void mask(rt_fl<R, C>& scores, int q0, int k0) const {
    constexpr int unbounded = 1 << 29;
    const int lo = window_left >= 0 ? offset - window_left - (k0 - q0) : -unbounded;  // bounds on j - i,
    const int hi = window_right >= 0 ? offset + window_right - (k0 - q0) : unbounded; // tile-relative
    if constexpr (keys_down)  // col - row = i - j
      mask_band(scores, -hi, -lo, k_end - k0, q_end - q0);
    else  // col - row = j - i
      mask_band(scores, lo, hi, q_end - q0, k_end - k0);
  }
  // A tile of queries [q0, q0 + nq) x keys [k0, k0 + nk) needs element masks when some pair in it
  // is invisible (tiles wholly outside the band are never visited), that is when
  //   k0 + nk > k_end,  or  q0 + nq > q_end (with q_end < seq_q: rows past seq_q are never
  //   written, so they need no mask),  or  k0 + nk - 1 > q0 + offset + window_right,
  //   or  k0 < q0 + nq - 1 + offset - window_left.
  // A kernel fixes one side of its tiles (a warp's queries, or its keys) and walks the other, so
  // the test becomes two thresholds on the walked side's first position x, worked out once: the
  // tile at x needs masks exactly when x < below or x > above.
  struct cut_thresholds {
    int below, above;
    __device__ bool cuts(int x) const { return x < below || x > above; }
  };
  static constexpr int NEVER = 1 << 30;
  __device__ bool pads(int q0, int nq) const { return q0 + nq > q_end && q_end < seq_q; }
  // Keys [k0, k0 + nk) fixed, thresholds on the first query q0 of a tile of nq.
  __device__ cut_thresholds cuts_for_keys(int nq, int k0, int nk) const {
    if (k0 + nk > k_end) return {NEVER, NEVER};  // keys past the end: every tile is masked
    const int above = window_left >= 0 ? k0 - nq + 1 - offset + window_left : NEVER;
    return {window_right >= 0 ? k0 + nk - 1 - offset - window_right : -NEVER,
            q_end < seq_q ? min(above, q_end - nq) : above};
  }
  // Queries [q0, q0 + nq) fixed, thresholds on the first key k0 of a tile of nk.
  __device__ cut_thresholds cuts_for_queries(int q0, int nq, int nk) const {
    if (pads(q0, nq)) return {NEVER, NEVER};  // rows past the length: every tile is masked
    return {window_left >= 0 ? q0 + nq - 1 + offset - window_left : -NEVER,
            window_right >= 0 ? min(k_end - nk, q0 + offset + window_right - nk + 1) : k_end - nk};
  }
};

// How far (in log2 units) a row's running max may stay below its true max before the output
// is rescaled: P = 2^(c S - c m) then stays below 2^8, well inside the range of P's 16-bit
// copy, and O / l and lse are unchanged, since l and O are summed against the same m.
constexpr float STALE_MAX_LOG2 = 8.f;

// One key tile of the online softmax for a warp's 16 rows, with c = scale * log2(e):
//   m' = max(m, rowmax S);  P = 2^(c S - c m');  l = 2^(c m - c m') l + rowsum P
// where each lane keeps l over its own columns only (store_output sums the row's four lanes),
// so the sum costs no shuffles per tile.
// `scores` becomes P, and `rescale` = 2^(c m - c m') is what the output accumulated so far must
// be multiplied by (left to the caller, whose O may still be in flight in a wgmma). A row that
// has seen no key yet keeps max -inf: 0 stands in for it so that 2^(-inf - 0) = 0 instead of
// NaN (its l and O are 0, so rescaling them is harmless).
// While no row of the warp has outgrown its max by STALE_MAX_LOG2, m is kept (m' = m) and the
// step returns false: `rescale` is left unset and the caller skips its D multiplies a lane.
// The test is warp-uniform, so the skip is a branch, not a select per element.
template <int KV>
__device__ __forceinline__ bool online_softmax_step(rt_fl<16, KV>& scores, row_vec<16>& m, row_vec<16>& l,
                                                    row_vec<16>& rescale, float c) {
  row_vec<16> m_new;
  row_max(m_new, scores);
  map(m_new, m_new, m, [](float a, float b) { return fmaxf(a, b); });
  bool grows = false;  // a row with no key yet (m = -inf) always counts as growing
#pragma unroll
  for (int h = 0; h < 2; h++) grows |= !(c * (m_new.data[0][h] - m.data[0][h]) <= STALE_MAX_LOG2);
  const bool rescaled = __any_sync(0xffffffffu, grows);
  if (rescaled) {
    map(m_new, [](float x) { return x == NEG_INF ? 0.f : x; });
    map(rescale, m, m_new, [=](float old_m, float new_m) { return fast_exp2(c * (old_m - new_m)); });
    map(l, l, rescale, [](float a, float b) { return a * b; });
    m = m_new;
  }
  map_rows(scores, m, [=](float x, float mx) { return fast_exp2(c * x - c * mx); });
  row_reduce(l, scores, sum_op{}, /*accumulate=*/true, /*across_lanes=*/false);
  return rescaled;
}

// O /= l, written to p.o, and lse = ln 2 (c m + log2 l) to p.lse, for the warp's 16 rows from
// row0 (rows from row_end on, which belong to other items or lie past seq_q, are skipped). `l`
// holds each lane's partial row sums (online_softmax_step); they are summed across the row
// here. A row that saw no key (l = 0) gets O = 0 and lse = -inf, whatever its O holds (a
// masked key's V times P = 0 may be NaN); a NaN the row saw (l or O NaN) reaches both O and
// lse.
template <typename T, int D>
__device__ __forceinline__ void store_output(rt_fl<16, D>& o, const row_vec<16>& m, row_vec<16> l, float c,
                                             const ForwardParams& p, int b, int h, int row0, int row_end) {
  reduce_across_lanes(l, sum_op{});
  row_vec<16> inv_l;  // 0 exactly for the rows that saw nothing
  map(inv_l, l, l, [](float x, float) { return x != 0.f ? 1.f / x : 0.f; });
  map_rows(o, inv_l, [](float x, float r) { return r != 0.f ? x * r : 0.f; });
  gl<T> out = gl<T>::contiguous((T*)p.o, p.batch, p.seq_q, p.heads_q, D);
  out.seq = min(row_end, p.seq_q);  // the rows store() may write
  store(out, o, {b, h, row0});
  if ((laneid() & 3) == 0) {
#pragma unroll
    for (int half_idx = 0; half_idx < 2; half_idx++) {
      const int row = row0 + row_vec_row(0, half_idx);
      if (row < out.seq) {
        const float lv = l.data[0][half_idx];
        p.lse[(int64_t(b) * p.heads_q + h) * p.seq_q + row] =
            lv != 0.f ? (c * m.data[0][half_idx] + __log2f(lv)) * LN2 : NEG_INF;
      }
    }
  }
}

}  // namespace tk::attention
