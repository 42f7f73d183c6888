// Thread-block clusters (sm_90): blocks launched together on neighbouring SMs that can write
// each other's shared memory and arrive on each other's mbarriers. A kernel opts in with
// __cluster_dims__; blocks blockIdx.x = 2c and 2c + 1 then form cluster c when the dims are (2, 1, 1).
//
// The pattern used here is a mailbox: a block stores a tile straight into a buffer in its
// partner's shared memory with asynchronous stores that complete on the partner's "full"
// barrier; the partner waits on that barrier, reads the buffer, and arrives on the sender's
// "empty" barrier so that the sender may write the next tile.
#pragma once

#include "../../common/base.cuh"
#include "../../types/register_tile.cuh"
#include "../warpgroup/tma.cuh"

namespace kittens::cluster {

// This block's rank in its cluster (0 .. cluster size - 1).
__device__ __forceinline__ int rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return int(r);
}

// Every (non-exited) thread of every block of the cluster meets here; memory written before
// is visible after. Needed after barrier init (before a partner may arrive remotely) and
// before exit (a block's shared memory must outlive the partner's last remote access).
__device__ __forceinline__ void sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// The cluster-wide address of `ptr` (this block's shared memory) as seen in block `block`.
__device__ __forceinline__ uint32_t map(const void* ptr, int block) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(shared_addr(ptr)), "r"(block));
  return out;
}

// Store to a cluster-wide shared address (from map) asynchronously: the bytes count towards
// the transactions of the barrier at `barrier_addr` in the same block (from map), so the
// receiver sees them once that barrier's phase completes, with no fence on the sender's side.
__device__ __forceinline__ void store_async(uint32_t addr, float4 v, uint32_t barrier_addr) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   addr),
               "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(barrier_addr)
               : "memory");
}

// Arrive on a barrier at a cluster-wide address (from map) without ordering earlier memory
// operations: for a receiver handing a buffer back after its loads have returned (a release
// would also wait for the thread's outstanding global reductions to complete).
__device__ __forceinline__ void arrive_relaxed(uint32_t barrier_addr) {
  asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(barrier_addr) : "memory");
}

// A mailbox between the two blocks of a cluster of two that run the same code: a warpgroup
// sends R x C of a float register tile (per warp; C columns of a wider tile) into one of SLOTS
// slots of the partner's mailbox, and the partner's matching warpgroup adds it into its own
// tile. The stores are asynchronous and complete on the slot's "full" barrier (bytes counted
// by the barrier), so a sender never waits on its own stores; with several slots it runs
// ahead of the receiver. Values sit in fragment order (registers 2m, 2m + 1 of thread t at
// slot[s][m][t]): a warp's stores and loads are 512 contiguous bytes each, with no bank
// conflicts and no swizzle. Uses n = 0, 1, 2, ... go to slot n % SLOTS.
//   full[s]:  in the receiver's block; armed by the receiver (one arrival announcing the slot's
//             bytes), completed by the sender's stores.
//   empty[s]: in the sender's block; each receiving warp arrives once after its loads.
template <int R, int C, int SLOTS>
struct mailbox {
  static constexpr int PAIRS = (R / 16) * (C / 16) * 2;  // float4 per thread per use
  static constexpr uint32_t BYTES = PAIRS * 128 * sizeof(float4);
  float4 slot[SLOTS][PAIRS][128];
  tma::barrier full[SLOTS], empty[SLOTS];

  // f(m, a, b) for the register pairs (a, b) = (2m, 2m + 1) of the mailbox's columns
  // [16 col_tile, 16 col_tile + C) of `tile`, m numbering them in slot order.
  template <typename Tile, typename F>
  __device__ static void for_each_pair(Tile& tile, int col_tile, F&& f) {
#pragma unroll
    for (int i = 0; i < R / 16; i++)
#pragma unroll
      for (int j = 0; j < C / 16; j++)
#pragma unroll
        for (int k = 0; k < 4; k += 2) {
          auto& t = tile.tiles[i][col_tile + j];
          f((i * (C / 16) + j) * 2 + k / 2, t.data[k], t.data[k + 1]);
        }
  }

  __device__ void init() {  // one thread, before cluster::sync(); arms every slot's first use
    for (int i = 0; i < SLOTS; i++) {
      tma::init(full[i], 1);
      tma::init(empty[i], 4);
      tma::expect_bytes(full[i], BYTES);
    }
  }
  // Store columns [16 col_tile, 16 col_tile + C) of `tile` into the partner's slot for use n,
  // once the partner has read that slot's previous use (n - SLOTS).
  template <int W>
  __device__ void send(const rt_fl<R, W>& tile, int col_tile, int partner, int n) {
    static_assert(W % C == 0, "the tile is whole mailbox loads wide");
    const int at = n % SLOTS;
    if (n >= SLOTS) tma::wait(empty[at], (n / SLOTS - 1) & 1);  // nothing to acquire: the slot is free
    const uint32_t base = cluster::map(&slot[at][0][threadIdx.x % 128], partner);
    const uint32_t bar = cluster::map(&full[at], partner);
    for_each_pair(tile, col_tile, [&](int m, const float2& a, const float2& b) {
      cluster::store_async(base + sizeof(slot[0][0]) * m, make_float4(a.x, a.y, b.x, b.y), bar);
    });
  }
  // Add use n of this block's mailbox into columns [16 col_tile, 16 col_tile + C) of `tile`,
  // then hand the slot back to the partner.
  template <int W>
  __device__ void receive_add(rt_fl<R, W>& tile, int col_tile, int partner, int n) {
    static_assert(W % C == 0, "the tile is whole mailbox loads wide");
    const int at = n % SLOTS;
    tma::wait(full[at], (n / SLOTS) & 1);
    const int t = threadIdx.x % 128;
    for_each_pair(tile, col_tile, [&](int m, float2& a, float2& b) {
      const float4 v = slot[at][m][t];
      a.x += v.x;
      a.y += v.y;
      b.x += v.z;
      b.y += v.w;
    });
    // Arm the slot's next use (its phase n has completed; use n + SLOTS cannot start before
    // every warp hands the slot back below).
    if (t == 0) tma::expect_bytes(full[at], BYTES);
    // The slot's loads must be done before the partner may overwrite it, and a relaxed arrive
    // orders nothing (the compiler once issued it before the adds, and dQ came out wrong): a
    // CTA-scope fence completes this warp's loads of its own shared memory without waiting for
    // its global reductions as a release at cluster scope would.
    __threadfence_block();
    __syncwarp();
    if (laneid() == 0) cluster::arrive_relaxed(cluster::map(&empty[at], partner));
  }
};

}  // namespace kittens::cluster
