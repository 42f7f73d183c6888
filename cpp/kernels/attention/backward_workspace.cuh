// The attention backward's workspace: what its passes hand each other through global memory,
// in the two buffers the caller provides. The dQ state (backward_dq_state_bytes), in order:
//   dq_accum  [batch, heads_q, dq_rows_padded / 64, head_dim / 64, 64 x 64] float32: dQ summed
//             over the key blocks. Each 64-query x 64-column chunk holds four warps' 16 x 64
//             register tiles (warp w's rows 16 w .. at float 1024 w) in kittens' fragment order
//             (store_fragments), so that a chunk is added with one contiguous bulk reduction
//             (head_dim <= 128) or with vector reductions of whole 128-byte lines (head_dim 256),
//             its staging stores are conflict-free, and it is read back with 512-byte loads a
//             warp (load_global_fragments).
//   lse2      [batch, heads_q, dq_rows_padded] float32: log2(e) lse; +inf for rows that saw no
//             key (so that their P = 2^(c S - lse2) is 0) and on padding.
//   delta     [batch, heads_q, dq_rows_padded] float32: scale (rowsum(dO o O) - dlse); 0 on
//             padding.
// The key workspace (backward_key_workspace_bytes), only under GQA (heads_q > heads_kv):
//   dk_accum, dv_accum  [batch, heads_kv, seq_k / 16 (rounded up), 16 x head_dim] float32: dK
//             and dV summed over the blocks that split a KV head's query heads among them
//             (backward_head_splits). Each group of 16 key rows is one warp's register tile in
//             fragment order (atomic_add_fragments), read back by load_global_fragments.
// lse2 and delta are in the units the backward kernels use, so that they spend no multiply on
// them, and rows are padded to whole query tiles. The dQ state may outlive one call: several
// calls with different keys add into it (BackwardParams::dq_rows, dq_row_shift), so a call's
// query tile q0 sits at tile (q0 + row_shift) mod dq_rows_padded of it.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

#include "attention.h"

namespace tk::attention {

// Query rows per step of the backward's walk: the rows of a dQ chunk, a tile of lse2 and delta.
constexpr int BACKWARD_Q_TILE = 64;

// Key rows per group of the dK / dV accumulators: one warp's register tile.
constexpr int BACKWARD_KEY_GROUP = 16;

// The passes around the backward kernel (row statistics, dq and dk / dv out of the
// accumulators) are memory-bound, a block for one tile of rows of one (batch, head). In
// [batch, seq, heads, D] tensors the rows of one head lie heads x D elements apart, so blocks
// that run together should take the heads of one tile, not the tiles of one head: together
// they then read or write whole runs of neighbouring rows. A grid of (tiles x heads, batch),
// heads first.
struct head_tile {
  int tile, h, b;
  __device__ static head_tile of_block(int heads) {
    return {int(blockIdx.x) / heads, int(blockIdx.x) % heads, int(blockIdx.y)};
  }
  // false where tiles x heads blocks do not fit the grid's x.
  static bool grid(dim3& g, int64_t tiles, int heads, int batch) {
    if (tiles * heads > INT32_MAX || batch > 65535) return false;
    g = dim3(unsigned(tiles * heads), unsigned(batch), 1);
    return true;
  }
};

struct backward_workspace {
  float* dq_accum;
  float* lse2;
  float* delta;
  float* dk_accum;  // nullptr without GQA
  float* dv_accum;
  int heads_q, seq_q_padded, heads_kv, seq_k_padded;  // seq_q_padded: the dQ state's rows
  int row_shift;  // where the call's row 0 sits in the dQ state; a multiple of BACKWARD_Q_TILE
  size_t dq_accum_floats, dkv_accum_floats;  // the latter for each of dk_accum and dv_accum

  __host__ __device__ static int64_t padded(int64_t seq_q) {
    return (seq_q + BACKWARD_Q_TILE - 1) / BACKWARD_Q_TILE * BACKWARD_Q_TILE;
  }
  __host__ __device__ static int64_t padded_keys(int64_t seq_k) {
    return (seq_k + BACKWARD_KEY_GROUP - 1) / BACKWARD_KEY_GROUP * BACKWARD_KEY_GROUP;
  }
  static size_t dkv_floats(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_k, int64_t head_dim) {
    return heads_q > heads_kv ? size_t(batch * heads_kv * padded_keys(seq_k) * head_dim) : 0;
  }
  // Floats of the dQ state: the dQ accumulator, lse2, delta.
  static size_t state_floats(int64_t batch, int64_t heads_q, int64_t dq_rows, int64_t head_dim) {
    return size_t(batch * heads_q * padded(dq_rows)) * size_t(head_dim + 2);
  }
  static backward_workspace of(const BackwardParams& p) {
    const int64_t state_rows = padded(p.state_rows());
    const size_t rows = size_t(p.batch) * p.heads_q * state_rows, dq_floats = rows * p.head_dim;
    const size_t dkv = dkv_floats(p.batch, p.heads_q, p.heads_kv, p.seq_k, p.head_dim);
    float* base = static_cast<float*>(p.workspace);
    float* dk = dkv ? static_cast<float*>(p.key_workspace) : nullptr;
    return {base, base + dq_floats, base + dq_floats + rows, dk, dk ? dk + dkv : nullptr,
            p.heads_q, int(state_rows), p.heads_kv, int(padded_keys(p.seq_k)), p.dq_row_shift, dq_floats, dkv};
  }

  // Where the call's query tile that starts at q0 sits in the dQ state.
  __device__ __forceinline__ int state_row(int q0) const {
    const int row = q0 + row_shift;
    return row >= seq_q_padded ? row - seq_q_padded : row;
  }
  // Where query q0 + i (q0 the start of its tile, 0 <= i < 64) of (batch b, head h) sits in
  // lse2 and delta: row(b, h, q0) + i.
  __device__ __forceinline__ int64_t row(int b, int h, int q0) const {
    return (int64_t(b) * heads_q + h) * seq_q_padded + state_row(q0);
  }
  // The accumulator's chunk `chunk` (64 columns) of the query tile that starts at row q0.
  template <int D>
  __device__ __forceinline__ float* dq_chunk(int b, int h, int q0, int chunk) const {
    const int64_t tile =
        (int64_t(b) * heads_q + h) * (seq_q_padded / BACKWARD_Q_TILE) + state_row(q0) / BACKWARD_Q_TILE;
    return dq_accum + (tile * (D / 64) + chunk) * (BACKWARD_Q_TILE * 64);
  }
  // The 16 x D group of dK or dV accumulator rows that starts at key0 (a multiple of 16).
  template <int D>
  __device__ __forceinline__ float* key_group(float* accum, int b, int kv_h, int key0) const {
    return accum + ((int64_t(b) * heads_kv + kv_h) * seq_k_padded + key0) * D;
  }
};

}  // namespace tk::attention
