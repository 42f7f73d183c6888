// Bulk tensor copies (TMA) and the mbarriers they complete on.
//
// One thread issues a copy of a whole tile; the barrier's transaction count says how many
// bytes to expect, and waiters spin on the barrier's phase bit (0, 1, 0, ...), one phase per
// completed use.
#pragma once

#include <cuda.h>

#include "../../common/base.cuh"

namespace kittens::tma {

struct barrier {
  alignas(8) uint64_t word;
};

__device__ __forceinline__ void init(barrier& b, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_addr(&b)), "r"(arrivals));
}
// Make barrier initialisation visible to the copy engine before any copy uses it.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrive once and announce `bytes` of copies that will complete on this phase.
__device__ __forceinline__ void expect_bytes(barrier& b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_addr(&b)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void arrive(barrier& b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_addr(&b)) : "memory");
}
// Block until the phase with parity `phase` has completed.
__device__ __forceinline__ void wait(barrier& b, int phase) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(shared_addr(&b)), "r"(phase)
        : "memory");
  } while (!done);
}

// Copy the box at coordinates (c0..c4) of the 5-d tensor `map` into shared memory `dst`.
__device__ __forceinline__ void load_async(void* dst, const CUtensorMap& map, barrier& b, int c0, int c1, int c2,
                                          int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5, %6}], [%7];\n" ::"r"(shared_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(shared_addr(&b))
      : "memory");
}

// Store the shared tile `src` to the box at (c0..c4) of the global tensor `map` (rows outside
// the tensor skipped). Asynchronous and grouped like store_add_async below.
__device__ __forceinline__ void store_async(const CUtensorMap& map, const void* src, int c0, int c1, int c2, int c3,
                                            int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4, %5}], [%6];\n" ::"l"(
          reinterpret_cast<uint64_t>(&map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(shared_addr(src))
      : "memory");
}

// Add the shared tile `src` into the box at (c0..c4) of the global tensor `map` (fp32 add in
// L2, rows outside the tensor skipped). Asynchronous: commit_group() closes a group of these,
// wait_group_read<N>() waits until all but the newest N groups have read their shared source,
// wait_group<N>() until they have also completed in global memory.
__device__ __forceinline__ void store_add_async(const CUtensorMap& map, const void* src, int c0, int c1, int c2,
                                                int c3, int c4) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.5d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4, %5}], [%6];\n" ::"l"(
          reinterpret_cast<uint64_t>(&map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(shared_addr(src))
      : "memory");
}
// Add `bytes` of fp32 values from shared `src` into global `dst`, element by element (fp32 add
// in L2): a 1-D bulk reduction, no tensor map. Addresses and size are multiples of 16 bytes.
// Grouped like store_add_async.
__device__ __forceinline__ void add_bulk_async(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(shared_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(Pending) : "memory");
}
template <int Pending>
__device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(Pending) : "memory");
}

}  // namespace kittens::tma
