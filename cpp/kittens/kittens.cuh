// kittens: a small tile library for Hopper kernels, in the spirit of ThunderKittens.
// Levels: warp (register tiles, mma.sync, maps, reductions), warpgroup (wgmma, TMA and
// mbarriers, the producer/consumer ring), block (cooperative copies, clusters).
#pragma once

#include "common/base.cuh"
#include "common/launch.cuh"
#include "common/tma_host.cuh"
#include "ops/block/cluster.cuh"
#include "ops/block/memory.cuh"
#include "ops/warp/conversions.cuh"
#include "ops/warp/maps.cuh"
#include "ops/warp/memory.cuh"
#include "ops/warp/mma.cuh"
#include "ops/warpgroup/ring.cuh"
#include "ops/warpgroup/tma.cuh"
#include "ops/warpgroup/wgmma.cuh"
#include "types/global_layout.cuh"
#include "types/register_tile.cuh"
#include "types/shared_tile.cuh"
