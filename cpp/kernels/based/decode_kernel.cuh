// One Based generation step, bound by moving the fp32 state: one block per (batch, head) row
// reads S once and writes S' once, in place, with 16-byte accesses.
//
// Threads are laid out as (feature lane, column group): a column group is 4 value columns
// (one float4), and the Dv / 4 groups of a row are covered by consecutive threads, so a warp
// reads whole contiguous state rows. Each thread walks the features f = lane, lane + LANES, ...
// keeping phi(q)[f] S'[f] for its 4 columns; the lanes' partial sums meet in shared memory.
#pragma once

#include "../../kittens/kittens.cuh"
#include "features.cuh"

namespace tk::based {

using namespace kittens;

constexpr int DECODE_THREADS = 256;

// Feature f of phi(x), in the external order of the state (features.cuh).
__device__ __forceinline__ float taylor_feature(const float* x, int f) {
  if (f == CONSTANT_FEATURE) return 1.f;
  if (f < second_order_feature(0, 0)) return FIRST_ORDER_SCALE * x[f - first_order_feature(0)];
  const int ab = f - second_order_feature(0, 0);
  return SECOND_ORDER_SCALE * x[ab / FEATURE_DIM] * x[ab % FEATURE_DIM];
}

template <typename T, int ValueDim>
__global__ void __launch_bounds__(DECODE_THREADS) decode_kernel(const __grid_constant__ DecodeParams p) {
  constexpr int groups = ValueDim / 4;                 // float4 column groups per state row
  constexpr int lanes = DECODE_THREADS / groups;       // feature lanes
  __shared__ float q[FEATURE_DIM], k[FEATURE_DIM], v[ValueDim];
  __shared__ float4 partial[lanes][groups];
  __shared__ float den_partial[DECODE_THREADS / WARP_THREADS];

  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x, group = tid % groups, lane = tid / groups;
  if (tid < FEATURE_DIM) {
    q[tid] = to_float(static_cast<const T*>(p.q)[row * FEATURE_DIM + tid]);
    k[tid] = to_float(static_cast<const T*>(p.k)[row * FEATURE_DIM + tid]);
  }
  for (int c = tid; c < ValueDim; c += DECODE_THREADS) v[c] = to_float(static_cast<const T*>(p.v)[row * ValueDim + c]);
  __syncthreads();

  // S' = S + phi(k) v^T and phi(q) S', 4 columns per thread.
  const float4 v4 = *reinterpret_cast<const float4*>(&v[4 * group]);
  const float4* src = reinterpret_cast<const float4*>(p.state + row * NUM_FEATURES * ValueDim) + group;
  float4* dst = reinterpret_cast<float4*>(p.state_out + row * NUM_FEATURES * ValueDim) + group;
  float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
  // Loads first, a batch at a time: src and dst may be the same buffer, so the compiler may
  // not move a load above an earlier store; without the batch one load per thread would be in
  // flight and the step would be latency-bound instead of bandwidth-bound.
  constexpr int batch = 8;
  for (int f0 = lane; f0 < NUM_FEATURES; f0 += batch * lanes) {
    float4 s[batch];
#pragma unroll
    for (int j = 0; j < batch; j++)
      if (f0 + j * lanes < NUM_FEATURES) s[j] = src[(f0 + j * lanes) * groups];
#pragma unroll
    for (int j = 0; j < batch; j++) {
      const int f = f0 + j * lanes;
      if (f >= NUM_FEATURES) break;
      const float pk = taylor_feature(k, f), pq = taylor_feature(q, f);
      s[j].x += pk * v4.x;
      s[j].y += pk * v4.y;
      s[j].z += pk * v4.z;
      s[j].w += pk * v4.w;
      dst[f * groups] = s[j];
      num.x += pq * s[j].x;
      num.y += pq * s[j].y;
      num.z += pq * s[j].z;
      num.w += pq * s[j].w;
    }
  }
  partial[lane][group] = num;

  // z' = z + phi(k) and phi(q) . z'.
  float den = 0.f;
  for (int f = tid; f < NUM_FEATURES; f += DECODE_THREADS) {
    const float zf = p.z[row * NUM_FEATURES + f] + taylor_feature(k, f);
    p.z_out[row * NUM_FEATURES + f] = zf;
    den += taylor_feature(q, f) * zf;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) den += __shfl_xor_sync(0xffffffff, den, offset);
  if (laneid() == 0) den_partial[warpid()] = den;
  __syncthreads();

  if (tid < ValueDim) {  // column tid: add up the lanes
    float y = 0.f;
    const float* parts = reinterpret_cast<const float*>(&partial[0][0]);
    for (int l = 0; l < lanes; l++) y += parts[l * ValueDim + tid];
    if (p.normalize) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < DECODE_THREADS / WARP_THREADS; w++) total += den_partial[w];
      y /= total + p.eps;
    }
    static_cast<T*>(p.y)[row * ValueDim + tid] = from_float<T>(y);
  }
}

template <typename T>
cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned(p.rows));
  if (p.value_dim == 64)
    decode_kernel<T, 64><<<grid, DECODE_THREADS, 0, stream>>>(p);
  else
    decode_kernel<T, 128><<<grid, DECODE_THREADS, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace tk::based
