// The producer/consumer ring: STAGES shared-memory slots that a producer fills and consumer
// warps drain. Each slot has a "full" barrier and an "empty" barrier (one arrival per consumer
// warp, or per consumer thread for slots read with plain loads: see release_each_lane). A
// producer fills a slot either with TMA copies (one thread: its arrival announces the bytes to
// expect and the copy engine completes the phase) or with ordinary stores (every lane of a
// warp stores, then arrives: the arrivals release the stores to the consumers). Uses are
// numbered i = 0, 1, 2, ... over the kernel's life: use i takes slot i % STAGES at phase
// (i / STAGES) & 1.
// The tiles themselves live beside the ring; this holds only the synchronisation.
#pragma once

#include "tma.cuh"

namespace kittens {

template <int STAGES>
struct ring {
  tma::barrier full[STAGES], empty[STAGES];

  // One thread, before tma::fence_barrier_init() and the block's first __syncthreads.
  // `releasers`: the arrivals that free a slot (consumer warps, or threads with
  // release_each_lane); `fillers`: those that fill it (1 for copies, 32 for a warp's stores).
  __device__ void init(int releasers, int fillers = 1) {
    for (int s = 0; s < STAGES; s++) {
      tma::init(full[s], fillers);
      tma::init(empty[s], releasers);
    }
  }
  __device__ static int slot(int i) { return i % STAGES; }

  // Producer: wait until use i's slot is free (use i - STAGES released it), announce `bytes`
  // of copies, and return the barrier those copies must complete on.
  __device__ tma::barrier& fill(int i, uint32_t bytes) {
    tma::expect_bytes(full[wait_free(i)], bytes);
    return full[i % STAGES];
  }
  // Producer warp that stores: every lane waits until use i's slot is free (returns the slot),
  // stores its part, then publishes.
  __device__ int wait_free(int i) {
    if (i >= STAGES) tma::wait(empty[i % STAGES], ((i / STAGES) - 1) & 1);
    return i % STAGES;
  }
  __device__ void publish(int i) { tma::arrive(full[i % STAGES]); }
  // Consumers: wait for use i's contents (returns its slot); release the slot when done with it
  // (lane 0 arrives for its warp, after the warp's last read).
  __device__ int acquire(int i) {
    tma::wait(full[i % STAGES], (i / STAGES) & 1);
    return i % STAGES;
  }
  __device__ void release(int i) {
    __syncwarp();
    if (laneid() == 0) tma::arrive(empty[i % STAGES]);
  }
  // Release by every lane, each after its own reads: for slots read with plain loads, since an
  // arrival releases only the arriving thread's accesses (and the producer overwrites them).
  __device__ void release_each_lane(int i) { tma::arrive(empty[i % STAGES]); }
};

}  // namespace kittens
