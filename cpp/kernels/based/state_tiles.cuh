// How a block of 8 warps holds the Based state in registers: the organisation the forward,
// dq and dk/dv kernels share.
//
// A block walks one (batch, head) for V_BLOCK = 64 value columns, CHUNK = 64 tokens at a step.
// The state [FEATURE_TILES x 16 features, 64 columns] (the padded tiles of features.cuh) is
// split so that no warp ever needs another's state: warp w = (column group cg = w % 4, feature
// half fh = w / 4) owns columns [16 cg, 16 cg + 16) of OWN_TILES = 9 feature tiles, each an
// fp32 mma accumulator (16 x 16):
//   own 0..7  second-order tile a = 8 fh + own (features x_a x_b, b = 0..15)
//   own 8     the first-order tile (fh = 0) or the constant tile (fh = 1)
// `own` is a compile-time index (it picks registers); fh is a run-time value, so that both
// halves run the same code. The tiles hold plain sums: sum_j k_ja k_jb v_j / 32 (second
// order), sum_j k_j v_j (first), sum_j v_j (constant); external_scale turns them into S.
#pragma once

#include "../../kittens/kittens.cuh"
#include "features.cuh"

namespace tk::based {

using namespace kittens;

constexpr int STATE_WARPS = 8;
constexpr int STATE_THREADS = STATE_WARPS * WARP_THREADS;
constexpr int ROW_TILES = CHUNK / 16;                      // 16-row tiles of a chunk
constexpr int OWN_TILES = FEATURE_TILES / 2;               // feature tiles of the state per warp
constexpr int SECOND_ORDER_OWN = SECOND_ORDER_TILES / 2;   // own tiles 0..7: second order
constexpr int LOW_ORDER_OWN = SECOND_ORDER_OWN;            // own tile 8: first order or constant
static_assert(STATE_WARPS == 2 * (V_BLOCK / 16), "warps = column groups x feature halves");
static_assert(LOW_ORDER_OWN + 1 == OWN_TILES, "each half: 8 second-order tiles and one more");

// The row a of second-order own tile `own` (its features are x_a x_b).
__device__ __forceinline__ int second_order_row(int own, int fh) { return SECOND_ORDER_OWN * fh + own; }

// The factor from own tile `own` to the external state S.
__device__ __forceinline__ float external_scale(int own, int fh) {
  return own < SECOND_ORDER_OWN ? 32 * SECOND_ORDER_SCALE : fh == 0 ? FIRST_ORDER_SCALE : 1.f;
}
// The external feature of column b of own tile `own`, or -1 for padding.
__device__ __forceinline__ int external_feature(int own, int fh, int b) {
  return own < SECOND_ORDER_OWN ? second_order_feature(second_order_row(own, fh), b)
         : fh == 0              ? first_order_feature(b)
                                : (b == 0 ? CONSTANT_FEATURE : -1);
}

// This warp's place in the block.
struct state_warp {
  int warp, cg, fh;
  int c0;  // first value column inside the block's 64
};
__device__ __forceinline__ state_warp this_state_warp() {
  const int warp = warpid();
  return {warp, warp % 4, warp / 4, 16 * (warp % 4)};
}

// The order in which a warp of feature half fh treats the chunk's 4 row tiles: first the two it
// completes (the intra-chunk term costs in proportion to a tile's index, so each half takes
// one early and one late tile: fh = 0 tiles 0 and 3, fh = 1 tiles 1 and 2), then the other two.
// (An array of its own, not a member of state_warp: with it inside the struct, the dk/dv
// sweep's chunk loop compiled to ~100 more instructions, with more spills.)
__device__ __forceinline__ void row_tiles_of_half(int (&row_tile)[ROW_TILES], int fh) {
#pragma unroll
  for (int i = 0; i < ROW_TILES; i++) row_tile[i] = (fh == 0 ? 0x2130 : 0x3021) >> (4 * i) & 0xF;
}

// A state tile as a bf16 B operand: an accumulator of X, scaled and rounded, is the col-layout
// fragment of X^T (the forward holds S_f^T and multiplies by S_f; the dq kernel holds S_f and
// multiplies by S_f^T).
__device__ __forceinline__ rt_bf<16, 16, layout::col> state_operand(const rt_fl<16, 16>& s, float scale) {
  rt_fl<16, 16> scaled = s;
  mul(scaled, scale);
  rt_bf<16, 16> rounded;
  copy(rounded, scaled);
  return as_transpose(rounded);
}

// Global views: q or k [batch, seq, heads, 16], and blocks of columns of the [batch, seq, heads,
// value_dim] tensors (v, y, dy, dv), which share one layout. P: ForwardParams or BackwardParams.
template <typename T, typename P>
__device__ __forceinline__ gl<T> feature_view(const void* x, const P& p) {
  return gl<T>::contiguous((T*)x, p.batch, p.seq, p.heads, FEATURE_DIM);
}
struct value_layout {
  int batch, seq, heads, value_dim;
  int64_t seq_stride, batch_stride;
  // Columns [col0, col0 + cols) of x.
  template <typename T>
  __device__ __forceinline__ gl<T> columns(const void* x, int col0, int cols) const {
    return gl<T>{(T*)x + col0, batch, seq, heads, cols, batch_stride, seq_stride, value_dim};
  }
};
template <typename P>
__device__ __forceinline__ value_layout value_layout_of(const P& p) {
  const int64_t seq_stride = int64_t(p.heads) * p.value_dim;
  return {p.batch, p.seq, p.heads, p.value_dim, seq_stride, int64_t(p.seq) * seq_stride};
}

}  // namespace tk::based
