// What the two backward sweeps (dq_kernel.cuh, dkv_kernel.cuh) load and store alike: the chunks
// they stream, the symmetrised state they start from, and the gradient rows they sum up.
#pragma once

#include "state_tiles.cuh"

namespace tk::based {

using namespace kittens;

// Streamed chunk by chunk, double-buffered in shared memory: q, k, this block's value columns
// of v and dy, and the rows' 1/den and dden. Each sweep's shared layout starts with it.
template <typename T>
struct backward_chunks {
  st<T, CHUNK, FEATURE_DIM> q[2], k[2];
  st<T, CHUNK, V_BLOCK> v[2], dy[2];
  sv_fl<CHUNK> inv_den[2], dden[2];
};

// The global tensors a backward block streams: q, k and this block's V_BLOCK columns of v
// and dy.
template <typename T>
struct backward_views {
  gl<T> q, k, v, dy;
};

// Start loading the chunk at token t0 of (b, h) into `stage`, with the rows' 1/den and dden
// (rows past the sequence become zeros, so they contribute nothing).
template <typename T>
__device__ __forceinline__ void load_chunk_async(backward_chunks<T>& s, const backward_views<T>& g,
                                                 const BackwardParams& p, int b, int h, int stage, int t0) {
  const int64_t row0 = (int64_t(b) * p.heads + h) * p.seq + t0;
  load_async<STATE_THREADS>(s.q[stage], g.q, {b, h, t0});
  load_async<STATE_THREADS>(s.k[stage], g.k, {b, h, t0});
  load_async<STATE_THREADS>(s.v[stage], g.v, {b, h, t0});
  load_async<STATE_THREADS>(s.dy[stage], g.dy, {b, h, t0});
  load_async<STATE_THREADS>(s.inv_den[stage], p.inv_den + row0, p.seq - t0);
  load_async<STATE_THREADS>(s.dden[stage], p.dden + row0, p.seq - t0);
  cp_async_commit();
}

// This warp's state tiles (not transposed: feature x column) from a [NUM_FEATURES, value_dim] state in
// the external order, `src` at this warp's first column, with the second order symmetrised
// (the state is only ever seen through phi(x), for which feature (a, b) is (b, a)), in the
// scale the tiles keep.
__device__ __forceinline__ void load_symmetrised_state(rt_fl<16, 16> (&state)[OWN_TILES], const float* src,
                                                       int value_dim, int fh) {
#pragma unroll
  for (int own = 0; own < OWN_TILES; own++) {
    const float unscale = 1.f / external_scale(own, fh);
    for_each(state[own], [&](float& x, int f, int c) {
      const int ext = external_feature(own, fh, f);
      float s = ext < 0 ? 0.f : src[int64_t(ext) * value_dim + c];
      if (own < SECOND_ORDER_OWN)  // (a, b) and (b, a) averaged
        s = 0.5f * (s + src[int64_t(second_order_feature(f, second_order_row(own, fh))) * value_dim + c]);
      x = s * unscale;
    });
  }
}

// acc += ds X for the 16 rows of a streamed chunk `x` (q or k) from row0, X as a bf16 B operand.
// ds is this warp's part of a sum over column groups that nearly cancels where the gradient's
// row hardly depends on its input: it goes to the tensor cores as bf16 high and low parts, so
// that its rounding (not the sum's) stays ~2^-16 of it.
template <typename T>
__device__ __forceinline__ void add_split_product(rt_fl<16, 16>& acc, const rt_fl<16, 16>& ds,
                                                  const st<T, CHUNK, FEATURE_DIM>& x, int row0) {
  rt_bf<16, 16> ds_hi, ds_lo;
  split(ds_hi, ds_lo, ds);
  rt<T, 16, 16, layout::col> x_col;  // [16 rows x 16 features] as a B operand
  load(x_col, x, row0, 0);
  rt_bf<16, 16, layout::col> xb;
  copy(xb, x_col);
  mma_AB(acc, ds_hi, xb, acc);
  mma_AB(acc, ds_lo, xb, acc);
}

// Where row (b, t, h) of value-column block v_block starts in the backward's
// [batch, seq, heads, value_dim / 64, 16] partial sums of dq and dk.
__device__ __forceinline__ int64_t grad_part_index(const BackwardParams& p, int b, int t, int h, int v_block) {
  const int num_blocks = p.value_dim / V_BLOCK;
  return (((int64_t(b) * p.seq + t) * p.heads + h) * num_blocks + v_block) * FEATURE_DIM;
}

// A backward chunk's gradient rows (dq or dk: 64 rows x 16 features) summed from the 8 warps'
// parts and, for the block with the column of ones, the two vector-state parts (all 16 x 16
// tiles in kittens' fragment order, see store_fragments), to this column block's slice of `out`
// [B, T, H, Dv / 64, 16]. Thread i takes row tile i / 64 and the float4 (i % 64) of each part:
// quad n = i / 32 % 2 of lane l = i % 32, so that a warp reads 512 contiguous bytes.
template <int Tiles>
__device__ __forceinline__ void store_summed_parts(float* out, const float (&parts)[STATE_WARPS][Tiles][16 * 16],
                                                   const float (&vector_parts)[2][Tiles][16 * 16],
                                                   bool with_vector_parts, const BackwardParams& p, int b, int h,
                                                   int v_block, int t0) {
  const int m = threadIdx.x / 64, quad = threadIdx.x % 64;
  const auto part = [&](const float* tile) { return reinterpret_cast<const float4*>(tile)[quad]; };
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  const auto add = [&](const float4& x) { sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w; };
#pragma unroll
  for (int w = 0; w < STATE_WARPS; w++) add(part(parts[w][m]));
  if (with_vector_parts) {
    add(part(vector_parts[0][m]));
    add(part(vector_parts[1][m]));
  }
  // Quad n of lane l = 4 g + c: (x, y) at row g, (z, w) at row g + 8, columns 8 n + 2 c + {0, 1}.
  const int n = quad / 32, l = quad % 32;
  const int g = l >> 2, col = 8 * n + 2 * (l & 3);
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int t = t0 + 16 * m + g + 8 * hh;
    if (t < p.seq)
      *reinterpret_cast<float2*>(out + grad_part_index(p, b, t, h, v_block) + col) =
          hh ? make_float2(sum.z, sum.w) : make_float2(sum.x, sum.y);
  }
}

}  // namespace tk::based
