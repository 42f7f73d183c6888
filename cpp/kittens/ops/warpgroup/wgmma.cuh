// Warpgroup matrix multiply (wgmma) on shared tiles and register tiles.
//
// A warpgroup (4 consecutive warps) computes a 64 x N product; warp w of the group owns rows
// 16w..16w+15 of it, held as an rt_fl<16, N> in exactly the register order wgmma uses (see
// register_tile.cuh), so the softmax code that works on mma.sync tiles works on these too.
//
// Shared operands are described by 64-bit descriptors over 128-byte-swizzled tiles (st's
// panel_bytes and group_bytes: `rows * 128` and 1024 B in panel-major tiles):
//   K-major (the reduction dim is contiguous, e.g. Q and K in Q K^T): 8-row groups group_bytes
//   apart (stride byte offset); a k slice in another panel starts panel_bytes on.
//   MN-major (the output dim is contiguous, e.g. V in P V): 64-column panels panel_bytes apart
//   (leading byte offset), 8-row groups group_bytes apart (stride byte offset).
// Every call is asynchronous: fence, issue, commit here; the caller waits with wait<N>().
#pragma once

#include "../../types/register_tile.cuh"
#include "../../types/shared_tile.cuh"
#include "wgmma_instructions.cuh"

namespace kittens::warpgroup {

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most `Pending` committed wgmma groups of this warp are in flight.
template <int Pending>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
// Index of this thread's warpgroup, and of its warp inside the group. groupid() is broadcast
// from lane 0 so the compiler knows it is warp-uniform and keeps what derives from it (tile
// addresses, wgmma descriptors) in uniform registers. Call it with the whole warp converged.
__device__ __forceinline__ int groupid() { return __shfl_sync(0xffffffff, threadIdx.x / 128, 0); }
__device__ __forceinline__ int warp_in_group() { return (threadIdx.x / 32) % 4; }

// Register reallocation between warpgroups (needs __launch_bounds__(threads, 1)).
// setmaxnreg only moves registers inside the block's launch allocation: each thread starts
// with 65536 / threads rounded down to a multiple of 8, and an increase the freed registers
// cannot cover waits forever. So kernels take their consumers' count from
// consumer_registers: the most each consumer thread can have (a multiple of 8) once the
// producers have dropped to producer_regs.
// Call each role's setmaxnreg inside that role's own branch and do not let the roles' paths
// merge again afterwards: ptxas then compiles the merged code for the launch allocation and
// spills.
constexpr int consumer_registers(int producer_groups, int producer_regs, int consumer_groups) {
  const int groups = producer_groups + consumer_groups;
  const int at_launch = 65536 / (128 * groups) / 8 * 8;
  return (groups * at_launch - producer_groups * producer_regs) / consumer_groups / 8 * 8;
}
template <int Regs>
__device__ __forceinline__ void increase_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
}
template <int Regs>
__device__ __forceinline__ void decrease_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
}

namespace detail {
constexpr uint64_t SWIZZLE_128B = 1ull << 62;

// The descriptor's low word holds the start address >> 4 (14 bits: shared memory is under
// 256 KB) and the leading byte offset; the high word the stride and swizzle mode.
__device__ __forceinline__ uint64_t descriptor(uint32_t start, uint32_t leading, uint32_t stride) {
  return uint64_t((start & 0x3FFFF) >> 4) | (uint64_t(leading >> 4) << 16) | (uint64_t(stride >> 4) << 32) |
         SWIZZLE_128B;
}
// The descriptor of a slice `offset` bytes past a tile's start: one 32-bit add to the tile's
// descriptor (the start field cannot carry), so the compiler builds each tile's descriptor once
// and every slice of an unrolled k loop costs a single add.
__device__ __forceinline__ uint64_t advance(uint64_t tile_descriptor, uint32_t offset) {
  const uint32_t lo = uint32_t(tile_descriptor) + (offset >> 4), hi = uint32_t(tile_descriptor >> 32);
  return (uint64_t(hi) << 32) | lo;
}

// Columns [16k, 16k + 16) of every row: K-major slice `k`.
template <typename T, int R, int C, atoms O>
__device__ __forceinline__ uint64_t k_major(const st<T, R, C, O>& t, int k) {
  using tile = st<T, R, C, O>;
  static_assert(tile::swizzle_bytes == 128, "wgmma operands use the 128-byte swizzle");
  const uint32_t col = 16 * k;
  return advance(descriptor(shared_addr(t.data), 16, tile::group_bytes),
                 (col / 64) * tile::panel_bytes + (col % 64) * sizeof(T));
}
// Rows [16k, 16k + 16), columns from `col0` (a multiple of 64) on: MN-major slice `k`.
template <typename T, int R, int C, atoms O>
__device__ __forceinline__ uint64_t mn_major(const st<T, R, C, O>& t, int k, int col0 = 0) {
  using tile = st<T, R, C, O>;
  static_assert(tile::swizzle_bytes == 128, "wgmma operands use the 128-byte swizzle");
  return advance(descriptor(shared_addr(t.data), tile::panel_bytes, tile::group_bytes),
                 (col0 / 64) * tile::panel_bytes + 2 * k * tile::group_bytes);
}

template <typename T, int N, int TransA, int TransB>
__device__ __forceinline__ void ss(float* d, uint64_t a, uint64_t b, int accumulate) {
  using namespace kittens::detail;
  constexpr bool bf = std::is_same_v<T, bf16>;
  if constexpr (N == 64) bf ? wgmma_ss_bf16_n64<TransA, TransB>(d, a, b, accumulate) : wgmma_ss_f16_n64<TransA, TransB>(d, a, b, accumulate);
  else if constexpr (N == 128) bf ? wgmma_ss_bf16_n128<TransA, TransB>(d, a, b, accumulate) : wgmma_ss_f16_n128<TransA, TransB>(d, a, b, accumulate);
  else if constexpr (N == 256) bf ? wgmma_ss_bf16_n256<TransA, TransB>(d, a, b, accumulate) : wgmma_ss_f16_n256<TransA, TransB>(d, a, b, accumulate);
  else static_assert(N == 64, "wgmma width must be 64, 128 or 256");
}
template <typename T, int N, int TransB>
__device__ __forceinline__ void rs(float* d, const uint32_t* a, uint64_t b, int accumulate) {
  constexpr bool bf = std::is_same_v<T, bf16>;
  if constexpr (N == 64) bf ? kittens::detail::wgmma_rs_bf16_n64<TransB>(d, a, b, accumulate) : kittens::detail::wgmma_rs_f16_n64<TransB>(d, a, b, accumulate);
  else if constexpr (N == 128) bf ? kittens::detail::wgmma_rs_bf16_n128<TransB>(d, a, b, accumulate) : kittens::detail::wgmma_rs_f16_n128<TransB>(d, a, b, accumulate);
  else if constexpr (N == 256) bf ? kittens::detail::wgmma_rs_bf16_n256<TransB>(d, a, b, accumulate) : kittens::detail::wgmma_rs_f16_n256<TransB>(d, a, b, accumulate);
  else static_assert(N == 64, "wgmma width must be 64, 128 or 256");
}
}  // namespace detail

// acc (+)= A B^T:  A is 64 x K (shared), B is N x K (shared), both K-major.
template <typename T, int K, int N, atoms OA, atoms OB>
__device__ __forceinline__ void mma_ABt(rt_fl<16, N>& acc, const st<T, 64, K, OA>& a, const st<T, N, K, OB>& b,
                                        bool accumulate) {
  float* d = reinterpret_cast<float*>(&acc.tiles[0][0]);
  fence();
#pragma unroll
  for (int k = 0; k < K / 16; k++)
    detail::ss<T, N, 0, 0>(d, detail::k_major(a, k), detail::k_major(b, k), (k > 0 || accumulate) ? 1 : 0);
  commit_group();
}

// acc (+)= A^T B[:, b_col0 : b_col0 + N]:  A is stored K x 64 and B is K x BC (shared, both
// MN-major), e.g. the gradient dQ = dS K computed from dS^T held row by row of keys.
template <typename T, int K, int N, int BC>
__device__ __forceinline__ void mma_AtB(rt_fl<16, N>& acc, const st<T, K, 64>& a, const st<T, K, BC>& b,
                                        int b_col0, bool accumulate) {
  float* d = reinterpret_cast<float*>(&acc.tiles[0][0]);
  fence();
#pragma unroll
  for (int k = 0; k < K / 16; k++)
    detail::ss<T, N, 1, 1>(d, detail::mn_major(a, k), detail::mn_major(b, k, b_col0),
                           (k > 0 || accumulate) ? 1 : 0);
  commit_group();
}

// Make ordinary shared-memory stores visible to wgmma and TMA (the async proxy).
__device__ __forceinline__ void fence_shared_to_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// acc (+)= A B^T:  A is 64 x K in registers (this warp's 16 rows), B is N x K (shared,
// K-major), e.g. scores Q K^T with Q held in registers for a whole walk over key tiles.
template <typename T, int K, int N, atoms O>
__device__ __forceinline__ void mma_ABt(rt_fl<16, N>& acc, const rt<T, 16, K>& a, const st<T, N, K, O>& b,
                                        bool accumulate) {
  float* d = reinterpret_cast<float*>(&acc.tiles[0][0]);
  fence();
#pragma unroll
  for (int k = 0; k < K / 16; k++)
    detail::rs<T, N, 0>(d, reinterpret_cast<const uint32_t*>(a.tiles[0][k].data), detail::k_major(b, k),
                        (k > 0 || accumulate) ? 1 : 0);
  commit_group();
}

// acc (+)= A B:  A is 64 x K in registers (this warp's 16 rows), B is K x N (shared, MN-major).
template <typename T, int K, int N, atoms O>
__device__ __forceinline__ void mma_AB(rt_fl<16, N>& acc, const rt<T, 16, K>& a, const st<T, K, N, O>& b,
                                       bool accumulate) {
  float* d = reinterpret_cast<float*>(&acc.tiles[0][0]);
  fence();
#pragma unroll
  for (int k = 0; k < K / 16; k++)
    detail::rs<T, N, 1>(d, reinterpret_cast<const uint32_t*>(a.tiles[0][k].data), detail::mn_major(b, k),
                        (k > 0 || accumulate) ? 1 : 0);
  commit_group();
}

}  // namespace kittens::warpgroup
