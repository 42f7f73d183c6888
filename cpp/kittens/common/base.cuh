// Basic types and constants shared by every part of kittens.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

namespace kittens {

using bf16 = __nv_bfloat16;
using half = __half;
using bf16_2 = __nv_bfloat162;
using half_2 = __half2;

constexpr int WARP_THREADS = 32;
constexpr int TILE_DIM = 16;  // every register tile is built from 16x16 base tiles

__device__ __forceinline__ int laneid() { return threadIdx.x & 31; }
__device__ __forceinline__ int warpid() { return threadIdx.x >> 5; }

// The packed pair type each thread holds in a register fragment.
template <typename T> struct packed;
template <> struct packed<float> { using type = float2; };
template <> struct packed<bf16> { using type = bf16_2; };
template <> struct packed<half> { using type = half_2; };
template <typename T> using packed_t = typename packed<T>::type;

template <typename T> constexpr bool is_16bit = sizeof(T) == 2;

// Conversions between float pairs and the packed 16-bit types.
template <typename T> __device__ __forceinline__ packed_t<T> pack(float a, float b);
template <> __device__ __forceinline__ float2 pack<float>(float a, float b) { return {a, b}; }
template <> __device__ __forceinline__ bf16_2 pack<bf16>(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}
template <> __device__ __forceinline__ half_2 pack<half>(float a, float b) {
  return __floats2half2_rn(a, b);
}
__device__ __forceinline__ float2 unpack(float2 x) { return x; }
__device__ __forceinline__ float2 unpack(bf16_2 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 unpack(half_2 x) { return __half22float2(x); }

// A packed 16-bit pair as the 32 bits that registers, shuffles and ldmatrix move, and back.
template <typename T2>
__device__ __forceinline__ uint32_t& as_u32(T2& x) {
  static_assert(sizeof(T2) == 4, "16-bit pairs only");
  return *reinterpret_cast<uint32_t*>(&x);
}
template <typename T2>
__device__ __forceinline__ uint32_t as_u32(const T2& x) {
  static_assert(sizeof(T2) == 4, "16-bit pairs only");
  return *reinterpret_cast<const uint32_t*>(&x);
}
template <typename T2>
__device__ __forceinline__ T2 from_u32(uint32_t x) {
  static_assert(sizeof(T2) == 4, "16-bit pairs only");
  return *reinterpret_cast<const T2*>(&x);
}
// The packed pair `x` of lane `src_lane` (every lane of the warp takes part).
template <typename T2>
__device__ __forceinline__ T2 shfl_sync(const T2& x, int src_lane) {
  return from_u32<T2>(__shfl_sync(0xffffffffu, as_u32(x), src_lane));
}

// c ? a : b for packed pairs, as a select of their bits (taken by value: a ternary on the pair
// objects themselves selects between their addresses, which can keep whole register tiles in
// local memory).
template <typename T2>
__device__ __forceinline__ T2 select_pair(bool c, T2 a, T2 b) {
  return from_u32<T2>(c ? as_u32(a) : as_u32(b));
}
__device__ __forceinline__ float2 select_pair(bool c, const float2& a, const float2& b) {
  return make_float2(c ? a.x : b.x, c ? a.y : b.y);
}

// (x.x, x.x) and (x.y, x.y) of a packed 16-bit pair: one factor for both elements of a pair.
__device__ __forceinline__ bf16_2 dup_low(bf16_2 x) { return __low2bfloat162(x); }
__device__ __forceinline__ half_2 dup_low(half_2 x) { return __low2half2(x); }
__device__ __forceinline__ bf16_2 dup_high(bf16_2 x) { return __high2bfloat162(x); }
__device__ __forceinline__ half_2 dup_high(half_2 x) { return __high2half2(x); }

template <typename T> __device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ half from_float<half>(float x) { return __float2half_rn(x); }

constexpr float NEG_INF = -__builtin_huge_valf();
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// 2^x on the special-function unit (what softmax kernels use instead of expf).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Synchronise `threads` threads (a multiple of 32) on named barrier `id` (1..15; 0 is
// __syncthreads), e.g. the consumer warpgroups of a warp-specialised block. The non-.aligned
// form: the warps meeting on one barrier may reach it from different instructions (roles, or
// loops compiled apart), which bar.sync (= barrier.sync.aligned) leaves undefined.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrive on named barrier `id` without waiting: the signalling side of a producer/consumer
// hand-off, where the other side calls named_barrier_sync with the same thread count.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ uint32_t shared_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async of 16 bytes; src_bytes = 0 writes zeros without reading global memory.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// cp.async of 4 bytes (e.g. one float of a row that need not be 16-byte aligned), through L1;
// src_bytes = 0 writes zeros without reading global memory.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most `Pending` committed groups of this thread are still in flight (a compiler
// memory barrier too: no shared-memory read moves above it).
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

// The dynamic shared memory `raw` as a struct S at the next 1024-byte boundary (swizzled tiles
// need it; the base only promises 16 bytes). The offset is added to the pointer, not computed
// through an integer address, so the compiler still knows every access is to shared memory
// (ld.shared, not generic loads that check the address window first).
template <typename S>
__device__ __forceinline__ S& aligned_shared(char* raw) {
  const uint32_t pad = (1024u - (shared_addr(raw) & 1023u)) & 1023u;
  return *reinterpret_cast<S*>(raw + pad);
}

}  // namespace kittens
