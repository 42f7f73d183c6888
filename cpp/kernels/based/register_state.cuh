// The register-resident Based state shared by the forward, dq and dk/dv kernels, the
// normaliser's state (vector_state), and the operand builders around them.
//
// A block of 8 warps walks one (batch, head) for 64 value columns; warp w = (column group
// cg = w % 4, feature half fh = w / 4) owns columns [16 cg, 16 cg + 16) of 9 of the 18 feature
// tiles (273 Taylor features padded to 288, see features.cuh) as fp32 mma accumulators:
//   fh = 0: second-order tiles a = 0..7 (features x_a x_b, b = 0..15) and the first-order tile
//   fh = 1: second-order tiles a = 8..15 and the constant tile.
// The feature map's constants are powers of two (phi(q).phi(k) = 1 + q.k/4 + (q.k)^2/32), so
// the tiles hold plain sums and the constants are applied exactly.
#pragma once

#include "features.cuh"

namespace tk::based {

using namespace kittens;

constexpr int STATE_WARPS = 8;
constexpr int STATE_THREADS = STATE_WARPS * WARP_THREADS;
constexpr int ROW_TILES = CHUNK / 16;         // 16-row tiles of a chunk
constexpr int OWN_TILES = FEATURE_TILES / 2;  // feature tiles of S per warp
static_assert(STATE_WARPS == 2 * (V_BLOCK / 16), "warps = column groups x feature halves");

// Warp half fh owns feature tiles own = 0..8: second-order tile a = 8 fh + own for own < 8,
// then the first-order tile (fh = 0) or the constant tile (fh = 1). `own` is a compile-time
// index (it picks registers); fh is a run-time value, so that both halves run the same code.
// The second-order tiles hold sum_j k_ja k_jb v_j / 32, the first-order sum_j k_j v_j, the
// constant sum_j v_j. The factor between a tile and the external state (S of the API):
__device__ __forceinline__ float external_scale(int own, int fh) {
  return own < 8 ? 32 * SECOND_ORDER_SCALE : fh == 0 ? FIRST_ORDER_SCALE : 1.f;
}
// External feature index of column b of tile `own`, or -1 for padding.
__device__ __forceinline__ int external_feature(int own, int fh, int b) {
  return own < 8 ? 17 + 16 * (8 * fh + own) + b : fh == 0 ? 1 + b : (b == 0 ? 0 : -1);
}

// The backward's state tiles (not transposed: feature x column) from a [273, p.value_dim] state
// in the external order, `src` at this warp's first column, with the second order symmetrised
// (the state is only ever seen through phi(x), for which feature (a, b) is (b, a)), in the
// scale the tiles keep.
__device__ __forceinline__ void load_symmetrised_state(rt_base<float, layout::row> (&state)[OWN_TILES],
                                                       const float* src, const BackwardParams& p, int fh) {
#pragma unroll
  for (int i = 0; i < OWN_TILES; i++) {
    const float unscale = 1.f / external_scale(i, fh);
#pragma unroll
    for (int r = 0; r < 4; r++) {  // element (feature fragment_row(r), column fragment_col(r, j))
      float pair[2];
#pragma unroll
      for (int j = 0; j < 2; j++) {
        const int f = fragment_row(r), c = fragment_col(r, j);
        const int ext = external_feature(i, fh, f);
        float x = ext < 0 ? 0.f : src[int64_t(ext) * p.value_dim + c];
        if (i < 8) x = 0.5f * (x + src[int64_t(17 + 16 * f + 8 * fh + i) * p.value_dim + c]);  // [ba]
        pair[j] = x * unscale;
      }
      state[i].data[r] = make_float2(pair[0], pair[1]);
    }
  }
}

// The 4 row tiles of a chunk in the order a warp of feature half fh treats them: first the two
// it completes (the intra-chunk term costs in proportion to a tile's index, so each half takes
// one early and one late tile: fh = 0 tiles 0 and 3, fh = 1 tiles 1 and 2), then the other two.
__device__ __forceinline__ void row_tiles_of_half(int (&row_tile)[ROW_TILES], int fh) {
#pragma unroll
  for (int i = 0; i < ROW_TILES; i++) row_tile[i] = (fh == 0 ? 0x2130 : 0x3021) >> (4 * i) & 0xF;
}

// cp.async of the chunk's row statistics (4 bytes each: [B, H, T] rows need not be 16-byte
// aligned); rows past the sequence become 0, so they contribute nothing.
__device__ __forceinline__ void load_row_stats_async(float* dst, const float* src, int valid) {
  for (int t = threadIdx.x; t < CHUNK; t += STATE_THREADS)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_addr(dst + t)),
                 "l"(src + (t < valid ? t : 0)), "r"(t < valid ? 4 : 0));
}

// What both backward sweeps stream chunk by chunk, double-buffered in shared memory: q, k,
// this block's value columns of v and dy, and the rows' 1/den and dden. Each sweep's shared
// layout starts with it.
template <typename T>
struct backward_chunks {
  st<T, CHUNK, FEATURE_DIM> q[2], k[2];
  st<T, CHUNK, V_BLOCK> v[2], dy[2];
  float inv_den[2][CHUNK], dden[2][CHUNK];
};

// The fragment of a 16 x 16 float tile into a shared slot [lane][2], for another warp of the
// block to read in the same order: (x, y) of row g and (z, w) of row g + 8, columns 2c, 2c + 1
// (slot 0) and 2c + 8, 2c + 9 (slot 1).
__device__ __forceinline__ void put_fragment(float4 (&slot)[WARP_THREADS][2], const rt_base<float, layout::row>& x) {
#pragma unroll
  for (int half = 0; half < 2; half++)
    slot[laneid()][half] = make_float4(x.data[2 * half].x, x.data[2 * half].y, x.data[2 * half + 1].x,
                                       x.data[2 * half + 1].y);
}

// A backward chunk's gradient rows (dq or dk: 64 rows x 16 features) summed from the 8 warps'
// parts and, for the block with the column of ones, the two normaliser parts (all in fragment
// order), to this column block's slice of `out` [B, T, H, Dv / 64, 16]. Thread i takes row tile
// i / 64, lane (i / 2) % 32, the half i % 2 of its fragment.
__device__ __forceinline__ void store_summed_parts(float* out, const float4 (&parts)[STATE_WARPS][ROW_TILES][WARP_THREADS][2],
                                                   const float4 (&vector_parts)[2][ROW_TILES][WARP_THREADS][2],
                                                   bool with_vector_parts, const BackwardParams& p, int b, int h,
                                                   int v_block, int t0) {
  const int m = threadIdx.x / 64, l = (threadIdx.x / 2) % 32, half = threadIdx.x % 2;
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  const auto add = [&](const float4& x) { sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w; };
#pragma unroll
  for (int w = 0; w < STATE_WARPS; w++) add(parts[w][m][l][half]);
  if (with_vector_parts) {
    add(vector_parts[0][m][l][half]);
    add(vector_parts[1][m][l][half]);
  }
  // (x, y) at row g, (z, w) at row g + 8, columns 2c + 8 half + {0, 1}.
  const int g = l >> 2, col = 2 * (l & 3) + 8 * half;
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int t = t0 + 16 * m + g + 8 * hh;
    if (t < p.seq)
      *reinterpret_cast<float2*>(out + grad_part_index(p, b, t, h, v_block) + col) =
          hh ? make_float2(sum.z, sum.w) : make_float2(sum.x, sum.y);
  }
}

// A packed 16-bit pair as the 32 bits a shuffle moves, and back.
template <typename T2>
__device__ __forceinline__ uint32_t bits(T2 x) {
  return *reinterpret_cast<uint32_t*>(&x);
}
template <typename T2>
__device__ __forceinline__ T2 from_bits(uint32_t x) {
  return *reinterpret_cast<T2*>(&x);
}

// Rows of X scaled by columns a and a + 1 (a = 8 fh + 2 j) of Q, as bf16 A operands:
// out0 = X * q_a and out1 = X * q_{a+1} per row, for row-layout fragments of 16-row tiles X and
// Q of the same rows. With X = Q these are phi(Q)'s second-order tiles a and a + 1 (x_a x_b).
// The pair (q_a, q_{a+1}) of rows g and g + 8 sits in data[0] / data[1] (a < 8) or data[2] /
// data[3] of quad lane j.
template <typename T>
__device__ __forceinline__ void scale_by_column_pair(rt_base<bf16, layout::row>& out0, rt_base<bf16, layout::row>& out1,
                                                     const rt_base<T, layout::row>& x, const rt_base<T, layout::row>& q,
                                                     int j, int fh) {
  const int src = (laneid() & ~3) | j;
  const auto top = from_bits<packed_t<T>>(__shfl_sync(0xffffffff, fh ? bits(q.data[2]) : bits(q.data[0]), src));
  const auto bottom = from_bits<packed_t<T>>(__shfl_sync(0xffffffff, fh ? bits(q.data[3]) : bits(q.data[1]), src));
  if constexpr (std::is_same_v<T, bf16>) {  // straight in bf16 (one rounding, as from fp32)
#pragma unroll
    for (int r = 0; r < 4; r++) {
      out0.data[r] = __hmul2(x.data[r], __low2bfloat162((r & 1) ? bottom : top));
      out1.data[r] = __hmul2(x.data[r], __high2bfloat162((r & 1) ? bottom : top));
    }
  } else {  // bf16 operands from fp16 inputs, through fp32
    const float2 t = unpack(top), u = unpack(bottom);
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const float2 v = unpack(x.data[r]);
      const float2 qa = (r & 1) ? u : t;
      out0.data[r] = pack<bf16>(v.x * qa.x, v.y * qa.x);
      out1.data[r] = pack<bf16>(v.x * qa.y, v.y * qa.y);
    }
  }
}

// A fragment in bf16 (the same registers when it already is).
template <typename T, typename L>
__device__ __forceinline__ rt_base<bf16, L> to_bf16(const rt_base<T, L>& x) {
  if constexpr (std::is_same_v<T, bf16>) {
    return x;
  } else {
    rt_base<bf16, L> out;
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const float2 v = unpack(x.data[r]);
      out.data[r] = pack<bf16>(v.x, v.y);
    }
    return out;
  }
}

// x * scale + shift per row of a 16 x 16 fragment: .x for row g, .y for row g + 8.
__device__ __forceinline__ void scale_shift_rows(rt_base<float, layout::row>& x, float2 scale, float2 shift) {
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const float a = (r & 1) ? scale.y : scale.x, c = (r & 1) ? shift.y : shift.x;
    x.data[r] = make_float2(fmaf(x.data[r].x, a, c), fmaf(x.data[r].y, a, c));
  }
}
// x * scale + shift per column: lo for columns 2c, 2c + 1, hi for 2c + 8, 2c + 9 (the factors
// of a lane's columns, read as two float2 from a 16-entry row vector at 2c and 2c + 8).
__device__ __forceinline__ void scale_shift_columns(rt_base<float, layout::row>& x, float2 scale_lo, float2 scale_hi,
                                                    float2 shift_lo, float2 shift_hi) {
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const float2 a = r < 2 ? scale_lo : scale_hi, c = r < 2 ? shift_lo : shift_hi;
    x.data[r] = make_float2(fmaf(x.data[r].x, a.x, c.x), fmaf(x.data[r].y, a.y, c.y));
  }
}

// x as bf16 high and low parts (hi + lo = x to ~2^-16 relative): for sums that nearly cancel,
// whose terms would otherwise each be rounded to 2^-9 of themselves on their way to the mma.
__device__ __forceinline__ void split_bf16(const rt_base<float, layout::row>& x, rt_base<bf16, layout::row>& hi,
                                           rt_base<bf16, layout::row>& lo) {
#pragma unroll
  for (int r = 0; r < 4; r++) {
    hi.data[r] = pack<bf16>(x.data[r].x, x.data[r].y);
    const float2 h = unpack(hi.data[r]);
    lo.data[r] = pack<bf16>(x.data[r].x - h.x, x.data[r].y - h.y);
  }
}

// The A operand of phi(Q) for the last tile: x_b (fh = 0) or the constant 1 in column 0.
template <typename T>
__device__ __forceinline__ rt_base<bf16, layout::row> phi_q_last(const rt_base<T, layout::row>& q, int fh) {
  return fh == 1 ? constant_tile().tiles[0][0] : to_bf16(q);
}

// Phi(K) [16 tokens x 16 features] of tile `own` for the state update, in the input type, from
// K's col-layout fragment kc of 16 tokens and kc32 = kc / 32 (the second-order tiles hold
// sums / 32). The same registers are the B operand Phi(K) (col layout: k = token, n = feature)
// and the A operand Phi(K)^T (row layout: row = feature, column = token).
template <typename T>
__device__ __forceinline__ rt_base<T, layout::col> phi_k_tile(const rt_base<T, layout::col>& kc,
                                                              const rt_base<T, layout::col>& kc32, int own, int fh) {
  rt_base<T, layout::col> out = kc;  // the first-order tile
  if (own < 8) {
    // data[0], data[1] hold tokens 2c, 2c+1 and data[2], data[3] tokens 2c+8, 2c+9; each is
    // scaled by k_a / 32 of its tokens, which the lane with g = a % 8 holds in the same
    // positions (data[0] / data[2] for a < 8, data[1] / data[3] for a >= 8).
    const int src = 4 * own + (laneid() & 3);
    const auto lo = from_bits<packed_t<T>>(__shfl_sync(0xffffffff, fh ? bits(kc32.data[1]) : bits(kc32.data[0]), src));
    const auto hi = from_bits<packed_t<T>>(__shfl_sync(0xffffffff, fh ? bits(kc32.data[3]) : bits(kc32.data[2]), src));
    out.data[0] = __hmul2(kc.data[0], lo);
    out.data[1] = __hmul2(kc.data[1], lo);
    out.data[2] = __hmul2(kc.data[2], hi);
    out.data[3] = __hmul2(kc.data[3], hi);
  } else if (fh == 1) {  // the constant feature (column n = g = 0) is 1 for every token
    const float one = laneid() < 4 ? 1.f : 0.f;
    out.data[0] = out.data[2] = pack<T>(one, one);
    out.data[1] = out.data[3] = pack<T>(0.f, 0.f);
  }
  return out;
}

// The normaliser's state z = sum_j phi(k_j) in registers, in the three pieces the feature map
// makes of it: the Gram matrix M = sum_j k_j k_j^T (z's second order is c2 M, c2 = 1/(4 sqrt 2)),
// the key sum u = sum_j k_j (first order u / 2) and the token count n (constant feature). Every
// warp keeps its own copy (13 registers) and updates it with two mma per 16 tokens, exactly
// (products of 16-bit values are exact in fp32, as are the sums of small integers), so that
//   phi(q) . z = q^T M q / 32 + q . u / 4 + n        (c2^2 = 1/32)
// costs one mma per 16 rows: Q M / 32, then a row-wise dot with q.
struct vector_state {
  rt_base<float, layout::row> gram;    // M [a, b] as an accumulator (row a, column b)
  float2 keysum[2];                    // u [b] of this lane's columns b = 2c, 2c + 1 and 2c + 8, 2c + 9
  float count;

  // From z0 [273] (external order) of this head; with `symmetrise`, M becomes (M + M^T) / 2
  // (for callers that only see q^T M q, whose gradient then is M q / 16).
  __device__ __forceinline__ void load(const float* z0, bool symmetrise = false) {
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int a = fragment_row(r), b0 = fragment_col(r, 0);
      float m[2];
#pragma unroll
      for (int j = 0; j < 2; j++) {
        m[j] = z0[17 + 16 * a + b0 + j];
        if (symmetrise) m[j] = 0.5f * (m[j] + z0[17 + 16 * (b0 + j) + a]);
      }
      gram.data[r] = make_float2(m[0] / SECOND_ORDER_SCALE, m[1] / SECOND_ORDER_SCALE);
      if (r % 2 == 0) keysum[r / 2] = make_float2(z0[1 + b0] / FIRST_ORDER_SCALE, z0[1 + b0 + 1] / FIRST_ORDER_SCALE);
    }
    count = z0[0];
  }

  // Add 16 tokens, from K's col-layout fragment (rows past the sequence are zero); `tokens` of
  // them are real.
  template <typename T>
  __device__ __forceinline__ void add(const rt_base<T, layout::col>& kc, int tokens) {
    // The same registers are K^T as a row-layout A operand (see phi_k_tile).
    detail::mma_base(gram, reinterpret_cast<const rt_base<T, layout::row>&>(kc), kc);
    rt_base<T, layout::row> ones;
#pragma unroll
    for (int r = 0; r < 4; r++) ones.data[r] = pack<T>(1.f, 1.f);
    add_keysum(ones, kc);
    count += float(tokens);
  }

  // u += W X for a row-layout W [16 x 16 tokens] whose rows are all alike (ones or weights):
  // every row of the product is the same sum, of which this lane keeps row g.
  template <typename T>
  __device__ __forceinline__ void add_keysum(const rt_base<T, layout::row>& w, const rt_base<T, layout::col>& xc) {
    rt_base<float, layout::row> sums;
#pragma unroll
    for (int r = 0; r < 4; r++) sums.data[r] = make_float2(0.f, 0.f);
    detail::mma_base(sums, w, xc);
#pragma unroll
    for (int h = 0; h < 2; h++) keysum[h].x += sums.data[2 * h].x, keysum[h].y += sums.data[2 * h].y;
  }

  // Add 16 tokens x_t with weights w_t: M += X^T diag(w) X, u += X^T w, n += sum w (padded
  // tokens have w = 0). w of this lane's tokens 2c, 2c + 1 (lo) and 2c + 8, 2c + 9 (hi); the
  // products x w are rounded to the input type on their way to the tensor cores.
  template <typename T>
  __device__ __forceinline__ void add_weighted(const rt_base<T, layout::col>& xc, float2 w_lo, float2 w_hi) {
    rt_base<T, layout::row> xw, w;  // X^T diag(w) and 1 diag(w) (rows: features; columns: tokens)
    const auto& xt = reinterpret_cast<const rt_base<T, layout::row>&>(xc);
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const float2 f = r < 2 ? w_lo : w_hi, x = unpack(xt.data[r]);
      xw.data[r] = pack<T>(x.x * f.x, x.y * f.y);
      w.data[r] = pack<T>(f.x, f.y);
    }
    detail::mma_base(gram, xw, xc);
    add_keysum(w, xc);
    float total = w_lo.x + w_lo.y + w_hi.x + w_hi.y;
    total += __shfl_xor_sync(0xffffffff, total, 1);
    total += __shfl_xor_sync(0xffffffff, total, 2);
    count += total;
  }

  // Q M^T scale + (u / 4 in every row when part = 0) for the 16 rows of q (row-layout
  // fragment), M on its way to the tensor cores as bf16 high (part 0) or low (part 1) parts,
  // so that the two parts add up to as exact a product as M itself.
  template <typename T>
  __device__ __forceinline__ rt_base<float, layout::row> times_gram(const rt_base<T, layout::row>& q, float scale,
                                                                    int part) const {
    rt_base<bf16, layout::col> m;  // the accumulator of M rounded: M^T as a B operand
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const float x = gram.data[r].x * scale, y = gram.data[r].y * scale;
      const auto hi = pack<bf16>(x, y);
      const float2 h = unpack(hi);
      m.data[r] = part == 0 ? hi : pack<bf16>(x - h.x, y - h.y);
    }
    rt_base<float, layout::row> out;
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const float2 u = keysum[r / 2];
      out.data[r] = part == 0 ? make_float2(u.x * 0.25f, u.y * 0.25f) : make_float2(0.f, 0.f);
    }
    detail::mma_base(out, to_bf16(q), m);
    return out;
  }

  // Part `part` (0 or 1) of phi(q) . z for the 16 rows of q: .x for row g, .y for row g + 8,
  // in every lane of the quad; the two parts add up to phi(q) . z.
  template <typename T>
  __device__ __forceinline__ float2 normaliser_part(const rt_base<T, layout::row>& q, int part) const {
    const auto qm = times_gram(q, 1.f / 32, part);  // q^T M^T q = q^T M q
    float sum[2] = {0.f, 0.f};                      // rows g, g + 8
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const float2 x = unpack(q.data[r]);
      sum[r & 1] = fmaf(qm.data[r].x, x.x, fmaf(qm.data[r].y, x.y, sum[r & 1]));
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
      sum[h] += __shfl_xor_sync(0xffffffff, sum[h], 1);
      sum[h] += __shfl_xor_sync(0xffffffff, sum[h], 2);
      if (part == 0) sum[h] += count;
    }
    return make_float2(sum[0], sum[1]);
  }

  // Part `part` of the gradient of phi(q) . z by q, M q / 16 + u / 4, for the 16 rows of q
  // (row t, feature b): M must be symmetric (load with `symmetrise`; sums of k k^T are).
  template <typename T>
  __device__ __forceinline__ rt_base<float, layout::row> gradient_part(const rt_base<T, layout::row>& q, int part) const {
    return times_gram(q, 1.f / 16, part);
  }

  // To z [273] (external order) of this head, by one warp. `antisymmetric` (optional, a
  // [273] vector): add back the antisymmetric part of its second order that `symmetrise` dropped.
  __device__ __forceinline__ void store(float* z, const float* antisymmetric = nullptr) const {
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int a = fragment_row(r), b0 = fragment_col(r, 0);
#pragma unroll
      for (int j = 0; j < 2; j++) {
        const int b = b0 + j;
        float m = (j ? gram.data[r].y : gram.data[r].x) * SECOND_ORDER_SCALE;
        if (antisymmetric) m += 0.5f * (antisymmetric[17 + 16 * a + b] - antisymmetric[17 + 16 * b + a]);
        z[17 + 16 * a + b] = m;
      }
      if (a == 0) {  // lanes 0-3, r = 0 and 2
        z[1 + b0] = keysum[r / 2].x * FIRST_ORDER_SCALE;
        z[1 + b0 + 1] = keysum[r / 2].y * FIRST_ORDER_SCALE;
      }
    }
    if (laneid() == 0) z[0] = count;
  }
};

// A state tile as a bf16 B operand: an accumulator of X, scaled and rounded, is exactly the
// col-layout fragment of X^T (the forward holds S_f^T and multiplies by S_f; the dq kernel
// holds S_f and multiplies by S_f^T).
__device__ __forceinline__ rt_base<bf16, layout::col> state_operand(const rt_base<float, layout::row>& s, float scale) {
  rt_base<bf16, layout::col> out;
#pragma unroll
  for (int r = 0; r < 4; r++) out.data[r] = pack<bf16>(s.data[r].x * scale, s.data[r].y * scale);
  return out;
}

}  // namespace tk::based
