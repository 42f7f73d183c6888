// Based linear attention forward on mma.sync tensor cores (the first, simple version).
//
// One block = 8 warps walks the whole sequence of one (batch, head) for 64 of its value
// columns (Dv = 128 takes two blocks, which share nothing but recompute the cheap parts), in
// chunks of 64 tokens. The running state lives in shared memory in float32 for the whole walk:
//   S^T [64 value columns x 288 features]   (273 Taylor features padded with zeros to 18 x 16)
//   z   [288 features]
// Per chunk (t0 = first token of the chunk):
//   1. phi(K) [64 x 288] is written to shared memory (16-bit; rows past the sequence are zero:
//      phi(0) = [1, 0, ...] is not zero, so padded keys must not count).
//   2. each warp takes 16 query rows and 32 value columns:
//        A     = tril(1 + s + s^2 / 2), s = Q K^T / 4, keys past the sequence masked out
//        num   = A V + phi(Q) S_prev          den = rowsum(A) + phi(Q) . z_prev   (fp32)
//        y     = num / (den + eps)  (or num)  straight to global memory; den to global too
//   3. S^T += V^T phi(K) (each warp owns a 16 x 144 piece of S^T) and z += colsum(phi(K)),
//      the latter from K^T K, colsum(K) and the token count, which are exact in fp32.
// phi(Q) is never stored: a warp builds each 16-feature tile of it in registers as mma's A
// operand. The state operand of phi(Q) S is converted to bf16 on its way to the tensor cores
// (bf16, not fp16, even for fp16 inputs: state entries grow with the sequence length and would
// overflow fp16's range); every sum stays fp32.
//
// Parallelism: batch * heads * (Dv / 64) blocks of 140 KB shared memory each, one per SM; when
// that is below the 132 SMs of an H100 the GPU is not filled. A later version can split the
// sequence across blocks (a two-pass scan of chunk states); this one keeps the simple walk.
#pragma once

#include "features.cuh"

namespace tk::based {

using namespace kittens;

constexpr int FWD_WARPS = 8;
constexpr int FWD_THREADS = FWD_WARPS * WARP_THREADS;
constexpr int V_BLOCK = 64;                       // value columns per block
constexpr int ROW_STRIPS = CHUNK / 16;            // 16-row query strips per chunk
constexpr int V_SPLIT = FWD_WARPS / ROW_STRIPS;   // warps sharing a strip split its columns
constexpr int V_WARP = V_BLOCK / V_SPLIT;         // value columns of y per warp
constexpr int V_TILES = V_BLOCK / 16;             // 16-row tiles of S^T
constexpr int UPDATE_TILES = FEATURE_TILES / (FWD_WARPS / V_TILES);  // feature tiles of S^T per warp
// Floats per row of S^T in shared memory. The 8 extra floats put the 8 rows a fragment touches
// in different banks (row r starts at bank 8 r mod 32), so float2 accesses are conflict-free.
constexpr int STATE_STRIDE = PADDED_FEATURES + 8;
static_assert(FWD_WARPS % ROW_STRIPS == 0 && V_BLOCK % (16 * V_SPLIT) == 0, "warp split of y");
static_assert(FWD_WARPS % V_TILES == 0 && FEATURE_TILES % (FWD_WARPS / V_TILES) == 0, "warp split of S");

template <typename T>
struct forward_shared {
  st<T, CHUNK, FEATURE_DIM> q[2], k[2];  // double-buffered chunks
  st<T, CHUNK, V_BLOCK> v[2];
  st<T, CHUNK, PADDED_FEATURES> phi_k;   // phi(K) of the current chunk
  float state[V_BLOCK * STATE_STRIDE];   // S^T: state[v * STATE_STRIDE + f]
  float z[PADDED_FEATURES];
};

// Rows [f0, f0 + 16) x columns [n0, n0 + N) of S (stored transposed, float32) as a bf16 B
// operand: data[0] = (f 2c..2c+1, n g), data[1] = (f 2c.., n g + 8), data[2] / data[3] the
// same at f + 8; each pair is one float2 of a row of S^T.
template <int N>
__device__ __forceinline__ void load_state_operand(rt<bf16, 16, N, layout::col>& dst, const float* state, int f0,
                                                   int n0) {
  const int g = laneid() >> 2, c = laneid() & 3;
#pragma unroll
  for (int j = 0; j < dst.width; j++)
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int n = n0 + 16 * j + g + 8 * (r & 1), f = f0 + 2 * c + 8 * (r >> 1);
      const float2 x = *reinterpret_cast<const float2*>(state + n * STATE_STRIDE + f);
      dst.tiles[0][j].data[r] = pack<bf16>(x.x, x.y);
    }
}

// phi(q) . z for this lane's rows g and g + 8 (all four lanes of a quad get the full sum):
// lane c takes the columns b in {2c, 2c+1, 2c+8, 2c+9} that its fragment of q holds,
//   sum_a x_a sum_b x_b z[16 a + b] / (4 sqrt 2) + sum_b x_b z[256 + b] / 2,
// then the quad adds its four parts and the constant feature z[272].
template <typename T>
__device__ __forceinline__ void normaliser_from_state(row_vec<16>& den, const float (&q_rows)[2][FEATURE_DIM],
                                                      const rt<T, 16, FEATURE_DIM>& q, const float* z) {
  const int c = laneid() & 3;
  float xb[2][4];  // [row h][b = 2c, 2c+1, 2c+8, 2c+9]
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const float2 lo = unpack(q.tiles[0][0].data[h]), hi = unpack(q.tiles[0][0].data[h + 2]);
    xb[h][0] = lo.x, xb[h][1] = lo.y, xb[h][2] = hi.x, xb[h][3] = hi.y;
  }
  float second[2] = {0.f, 0.f};
#pragma unroll
  for (int a = 0; a < FEATURE_DIM; a++) {
    const float2 z_lo = *reinterpret_cast<const float2*>(z + 16 * a + 2 * c);
    const float2 z_hi = *reinterpret_cast<const float2*>(z + 16 * a + 2 * c + 8);
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const float inner = xb[h][0] * z_lo.x + xb[h][1] * z_lo.y + xb[h][2] * z_hi.x + xb[h][3] * z_hi.y;
      second[h] += q_rows[h][a] * inner;
    }
  }
  const float2 zl_lo = *reinterpret_cast<const float2*>(z + LINEAR_FEATURES + 2 * c);
  const float2 zl_hi = *reinterpret_cast<const float2*>(z + LINEAR_FEATURES + 2 * c + 8);
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const float first = xb[h][0] * zl_lo.x + xb[h][1] * zl_lo.y + xb[h][2] * zl_hi.x + xb[h][3] * zl_hi.y;
    float part = second[h] * SECOND_ORDER_SCALE + first * FIRST_ORDER_SCALE;
    part += __shfl_xor_sync(0xffffffff, part, 1);
    part += __shfl_xor_sync(0xffffffff, part, 2);
    den.data[0][h] += part + z[CONST_FEATURE];
  }
}

// Step 3a: S^T[v0 .. v0 + 16, f0 .. f0 + 16] += acc (acc in the accumulator layout).
__device__ __forceinline__ void add_to_state(float* state, const rt_fl<16, 16>& acc, int v0, int f0) {
#pragma unroll
  for (int r = 0; r < 4; r++) {
    float2* p = reinterpret_cast<float2*>(state + (v0 + fragment_row(r)) * STATE_STRIDE + f0 + fragment_col(r, 0));
    const float2 x = acc.tiles[0][0].data[r];
    float2 cur = *p;
    cur.x += x.x;
    cur.y += x.y;
    *p = cur;
  }
}

template <typename T>
__global__ void __launch_bounds__(FWD_THREADS, 1) forward_kernel(const __grid_constant__ ForwardParams p) {
  extern __shared__ char smem_raw[];
  // Swizzled tiles need 1024-byte alignment; the dynamic shared base only promises 16.
  auto& s = *reinterpret_cast<forward_shared<T>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  const int v_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int v0 = v_block * V_BLOCK;  // this block's first value column
  const int warp = warpid();
  const int strip = warp % ROW_STRIPS, v_part = warp / ROW_STRIPS;  // y: rows 16 strip.., cols V_WARP v_part..
  const int state_rows = 16 * (warp % V_TILES);                     // S^T rows this warp updates
  const int state_tile0 = UPDATE_TILES * (warp / V_TILES);          // ... and its first feature tile
  const int64_t head = int64_t(b) * p.heads + h;

  const auto Q = gl<T>::contiguous((T*)p.q, p.batch, p.seq, p.heads, FEATURE_DIM);
  const auto K = gl<T>::contiguous((T*)p.k, p.batch, p.seq, p.heads, FEATURE_DIM);
  // Views of 64 (V) and V_WARP (Y) columns of the full [batch, seq, heads, value_dim] rows.
  const int64_t seq_stride = int64_t(p.heads) * p.value_dim, batch_stride = int64_t(p.seq) * seq_stride;
  const gl<T> V{(T*)p.v + v0, p.batch, p.seq, p.heads, V_BLOCK, batch_stride, seq_stride, p.value_dim};
  const gl<T> Y{(T*)p.y + v0 + V_WARP * v_part, p.batch, p.seq, p.heads, V_WARP, batch_stride, seq_stride,
                p.value_dim};

  // The first chunk starts loading while the initial state is read.
  load_async<FWD_THREADS>(s.q[0], Q, {b, h, 0});
  load_async<FWD_THREADS>(s.k[0], K, {b, h, 0});
  load_async<FWD_THREADS>(s.v[0], V, {b, h, 0});
  cp_async_commit();

  // S^T and z from S0 and z0 (read in the external feature order, so reads are coalesced).
  const float* state0 = p.state0 + head * NUM_FEATURES * p.value_dim + v0;
  for (int i = threadIdx.x; i < PADDED_FEATURES * V_BLOCK; i += FWD_THREADS) {
    const int f = i / V_BLOCK, v = i % V_BLOCK;
    if (f < NUM_FEATURES)
      s.state[v * STATE_STRIDE + internal_feature(f)] = state0[int64_t(f) * p.value_dim + v];
    else
      s.state[v * STATE_STRIDE + f] = 0.f;  // padding features stay zero
  }
  for (int f = threadIdx.x; f < PADDED_FEATURES; f += FWD_THREADS) {
    if (f < NUM_FEATURES)
      s.z[internal_feature(f)] = p.z0[head * NUM_FEATURES + f];
    else
      s.z[f] = 0.f;
  }

  const int num_chunks = (p.seq + CHUNK - 1) / CHUNK;
  for (int chunk = 0; chunk < num_chunks; chunk++) {
    const int stage = chunk & 1, t0 = chunk * CHUNK;
    const int real_tokens = min(CHUNK, p.seq - t0);
    cp_async_wait<0>();
    __syncthreads();  // the chunk is visible to all, and every warp is done with the last one
    if (chunk + 1 < num_chunks) {  // prefetch into the stage the last chunk used
      load_async<FWD_THREADS>(s.q[stage ^ 1], Q, {b, h, t0 + CHUNK});
      load_async<FWD_THREADS>(s.k[stage ^ 1], K, {b, h, t0 + CHUNK});
      load_async<FWD_THREADS>(s.v[stage ^ 1], V, {b, h, t0 + CHUNK});
      cp_async_commit();
    }

    // 1. phi(K) for the state update.
    build_features<FWD_THREADS>(s.phi_k, s.k[stage], real_tokens);

    // 2. y for this warp's 16 rows and V_WARP columns.
    {
      const int row0 = 16 * strip;
      rt<T, 16, FEATURE_DIM> q;
      load(q, s.q[stage], row0, 0);

      // Inside the chunk: A = tril(1 + s + s^2/2) over the real keys.
      rt<T, CHUNK, FEATURE_DIM> k;
      load(k, s.k[stage], 0, 0);
      rt_fl<16, CHUNK> weights;
      zero(weights);
      mma_ABt(weights, q, k, weights);
      for_each(weights, [&](float& x, int r, int key) {
        const float sc = 0.25f * x;
        x = (key <= row0 + r && key < real_tokens) ? 1.f + sc + 0.5f * sc * sc : 0.f;
      });
      // The tensor cores see the weights rounded to 16 bits; the normaliser sums the same
      // rounded values, so that y is exactly a weighted mean (y = v when one key is visible).
      rt<T, 16, CHUNK> weights16;
      copy(weights16, weights);
      copy(weights, weights16);
      row_vec<16> den;
      row_sum(den, weights);
      rt<T, CHUNK, V_WARP, layout::col> v;
      load(v, s.v[stage], 0, V_WARP * v_part);
      rt_fl<16, V_WARP> y;
      zero(y);
      mma_AB(y, weights16, v, y);

      // Everything before the chunk, through the state.
      float q_rows[2][FEATURE_DIM];  // all 16 features of this lane's rows g and g + 8
      load_row(q_rows[0], s.q[stage], row0 + (laneid() >> 2));
      load_row(q_rows[1], s.q[stage], row0 + (laneid() >> 2) + 8);
      normaliser_from_state(den, q_rows, q, s.z);
      const auto add_state_term = [&](int tile, const rt<bf16, 16, 16>& phi_q) {
        rt<bf16, 16, V_WARP, layout::col> state_op;
        load_state_operand(state_op, s.state, 16 * tile, V_WARP * v_part);
        mma_AB(y, phi_q, state_op, y);
      };
#pragma unroll 2
      for (int a = 0; a < FEATURE_DIM; a++) {
        const float xa[2] = {to_float(*s.q[stage].ptr(row0 + (laneid() >> 2), a)),
                             to_float(*s.q[stage].ptr(row0 + (laneid() >> 2) + 8, a))};
        add_state_term(a, second_order_tile(xa, q));
      }
      add_state_term(16, first_order_tile(q));
      add_state_term(17, constant_tile());

      // The normaliser is a residual of the backward (y = num / (den + eps)); one warp per
      // row strip writes it, lane c = 0 of each quad for rows g and g + 8.
      if (v_block == 0 && v_part == 0 && (laneid() & 3) == 0)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
          const int t = t0 + row0 + (laneid() >> 2) + 8 * hh;
          if (t < p.seq) p.den[head * p.seq + t] = den.data[0][hh];
        }
      if (p.normalize) {
        const float eps = p.eps;
        map(den, [=](float d) { return 1.f / (d + eps); });
        mul_row(y, den);
      }
      store(Y, y, {b, h, t0 + row0});
    }
    __syncthreads();  // every warp has read S and z of the previous chunks

    // 3. Fold this chunk into the state.
    {
      rt<T, 16, CHUNK> v_t;  // V^T: this warp's 16 value columns as rows, all 64 tokens
#pragma unroll
      for (int kt = 0; kt < CHUNK / 16; kt++) load_transposed(v_t.tiles[0][kt], s.v[stage], 16 * kt, state_rows);
#pragma unroll 3
      for (int i = 0; i < UPDATE_TILES; i++) {
        const int f0 = 16 * (state_tile0 + i);
        rt<T, CHUNK, 16, layout::col> phi;
        load(phi, s.phi_k, 0, f0);
        rt_fl<16, 16> acc;
        zero(acc);
        mma_AB(acc, v_t, phi, acc);
        add_to_state(s.state, acc, state_rows, f0);
      }
      if (warp == FWD_WARPS - 1) accumulate_feature_sums(s.z, s.k[stage], nullptr, real_tokens);
    }
  }
  __syncthreads();  // the last update is complete

  // The final state, back in the external feature order (writes coalesced along v).
  float* state = p.state + head * NUM_FEATURES * p.value_dim + v0;
  for (int i = threadIdx.x; i < NUM_FEATURES * V_BLOCK; i += FWD_THREADS) {
    const int f = i / V_BLOCK, v = i % V_BLOCK;
    state[int64_t(f) * p.value_dim + v] = s.state[v * STATE_STRIDE + internal_feature(f)];
  }
  if (v_block == 0)  // z is the same for every block of the head
    for (int f = threadIdx.x; f < NUM_FEATURES; f += FWD_THREADS) p.z[head * NUM_FEATURES + f] = s.z[internal_feature(f)];
}

template <typename T>
cudaError_t launch_forward(const ForwardParams& p, cudaStream_t stream) {
  const int smem = int(sizeof(forward_shared<T>)) + 1024;
  if (cudaError_t err = allow_dynamic_shared<forward_kernel<T>>(smem); err != cudaSuccess) return err;
  const dim3 grid(p.value_dim / V_BLOCK, p.heads, p.batch);
  forward_kernel<T><<<grid, FWD_THREADS, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace tk::based
