// Test-only kernels for the warpgroup level: TMA tile loads completing on an mbarrier, then
// wgmma with both operands in shared memory (A B^T, K-major) and with A in registers and B
// MN-major (A C), on panel-major tiles and on grouped-rows tiles gathered from pages; fp32
// shared tiles added to global memory by TMA bulk reductions. Compared with numpy by
// tests/test_kittens_gpu.py.
#include <cuda_runtime.h>

#include <string>

#include "../kittens/kittens.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace kittens;

namespace {

// The two products the wgmma tests check, by the warpgroup, each stored row-major into global
// memory: x y^T (x and y K-major in shared memory) and r z, r being this warp's 16 rows of w
// loaded into registers and z MN-major in shared memory.
template <typename X, typename Y, typename W, typename Z>
__device__ void store_products(const X& x, const Y& y, const W& w, const Z& z, float* xyt, float* rz) {
  const int row0 = 16 * warpgroup::warp_in_group();
  rt_fl<16, Y::rows> xy;
  warpgroup::mma_ABt(xy, x, y, false);
  warpgroup::wait<0>();
  store(gl<float>::contiguous(xyt, 1, 64, 1, Y::rows), xy, {0, 0, row0});

  rt<bf16, 16, W::cols> r;
  load(r, w, row0, 0);
  rt_fl<16, Z::cols> product;
  zero(product);
  warpgroup::mma_AB(product, r, z, true);
  warpgroup::wait<0>();
  store(gl<float>::contiguous(rz, 1, 64, 1, Z::cols), product, {0, 0, row0});
}

struct WgmmaTestArgs {
  CUtensorMap a, b, c;  // a [64, 64], b [64, 64], c [64, 128], all bf16
  float* abt;           // [64, 64]  = a b^T
  float* ac;            // [64, 128] = a c
};

struct wgmma_test_shared {
  st<bf16, 64, 64> a, b;
  st<bf16, 64, 128> c;
  tma::barrier loaded;
};

// The block's one TMA barrier, set up by thread 0 and visible to every thread after.
__device__ __forceinline__ void init_loaded_barrier(tma::barrier& loaded) {
  if (threadIdx.x == 0) {
    tma::init(loaded, 1);
    tma::fence_barrier_init();
  }
  __syncthreads();
}

__global__ void __launch_bounds__(128) wgmma_test_kernel(const __grid_constant__ WgmmaTestArgs args) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<wgmma_test_shared>(smem_raw);
  init_loaded_barrier(s.loaded);
  if (threadIdx.x == 0) {
    tma::expect_bytes(s.loaded, sizeof(s.a) + sizeof(s.b) + sizeof(s.c));
    tma::load_async(&s.a, args.a, s.loaded, 0, 0, 0, 0, 0);
    tma::load_async(&s.b, args.b, s.loaded, 0, 0, 0, 0, 0);
    tma::load_async(&s.c, args.c, s.loaded, 0, 0, 0, 0, 0);
  }
  tma::wait(s.loaded, 0);
  store_products(s.a, s.b, s.a, s.c, args.abt, args.ac);
}

ffi::Error Wgmma(cudaStream_t stream, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b, ffi::Buffer<ffi::BF16> c,
                 ffi::Result<ffi::Buffer<ffi::F32>> abt, ffi::Result<ffi::Buffer<ffi::F32>> ac) {
  if (a.element_count() != 64 * 64 || b.element_count() != 64 * 64 || c.element_count() != 64 * 128)
    return ffi::Error::InvalidArgument("a, b must be [64, 64], c [64, 128]");
  WgmmaTestArgs args{};
  if (!tma::make_bshd_map(&args.a, a.untyped_data(), true, 1, 64, 1, 64, 64) ||
      !tma::make_bshd_map(&args.b, b.untyped_data(), true, 1, 64, 1, 64, 64) ||
      !tma::make_bshd_map(&args.c, c.untyped_data(), true, 1, 64, 1, 128, 64))
    return ffi::Error::Internal("tk_test_wgmma: tensor map encoding failed");
  args.abt = abt->typed_data();
  args.ac = ac->typed_data();
  const int smem = int(sizeof(wgmma_test_shared)) + 1024;
  const cudaError_t err = launch_with_shared<wgmma_test_kernel>(1, 128, smem, stream, args);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("tk_test_wgmma: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// ---- grouped rows: a 64-row tile gathered from GATHER_PAGES pages of GATHER_PAGE_ROWS rows of a
// paged [pages, page rows, heads, D] cache (one head), a page's rows of every 64-column panel one
// TMA box (make_grouped_rows_map), landing in 8-row groups of all panels; then wgmma reads it
// K-major (a K^T, both operands in shared memory) and MN-major (p K, p in registers) ----
constexpr int GATHER_PAGES = 4, GATHER_PAGE_ROWS = 16, GATHER_HEAD = 1;

struct GatherTestArgs {
  CUtensorMap a, p, cache;  // a [64, D], p [64, 64] (panel by panel); the cache in grouped rows
  const int32_t* pages;     // [GATHER_PAGES]: the tile's pages, in order
  float* abt;               // [64, 64] = a K^T
  float* pk;                // [64, D]  = p K
};

template <int D>
struct gather_test_shared {
  st<bf16, 64, D> a;
  st<bf16, 64, 64> p;
  st<bf16, 64, D, atoms::grouped_rows> k;
  tma::barrier loaded;
};

template <int D>
__global__ void __launch_bounds__(128) gather_test_kernel(const __grid_constant__ GatherTestArgs args) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<gather_test_shared<D>>(smem_raw);
  init_loaded_barrier(s.loaded);
  if (threadIdx.x == 0) {
    tma::expect_bytes(s.loaded, sizeof(s.a) + sizeof(s.p) + sizeof(s.k));
    tma::load_async(&s.a, args.a, s.loaded, 0, 0, 0, 0, 0);
    tma::load_async(&s.p, args.p, s.loaded, 0, 0, 0, 0, 0);
    for (int i = 0; i < GATHER_PAGES; i++) {  // coordinates: (0, 0, 0, 8-row group, head)
      char* dst = reinterpret_cast<char*>(s.k.data) + s.k.row_offset(i * GATHER_PAGE_ROWS, 0);
      tma::load_async(dst, args.cache, s.loaded, 0, 0, 0, args.pages[i] * (GATHER_PAGE_ROWS / 8), GATHER_HEAD);
    }
  }
  tma::wait(s.loaded, 0);
  store_products(s.a, s.k, s.p, s.k, args.abt, args.pk);
}

template <int D>
ffi::Error launch_gather_test(cudaStream_t stream, GatherTestArgs& args, const void* a, const void* p,
                              const void* cache, int pages, int heads) {
  if (!tma::make_bshd_map(&args.a, a, true, 1, 64, 1, D, 64) ||
      !tma::make_bshd_map(&args.p, p, true, 1, 64, 1, 64, 64) ||
      !tma::make_grouped_rows_map(&args.cache, cache, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, pages, GATHER_PAGE_ROWS,
                                  heads, D, GATHER_PAGE_ROWS))
    return ffi::Error::Internal("tk_test_grouped_rows: tensor map encoding failed");
  const int smem = int(sizeof(gather_test_shared<D>)) + 1024;
  const cudaError_t err = launch_with_shared<gather_test_kernel<D>>(1, 128, smem, stream, args);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("tk_test_grouped_rows: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error GroupedRows(cudaStream_t stream, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> p,
                       ffi::Buffer<ffi::BF16> cache, ffi::Buffer<ffi::S32> pages,
                       ffi::Result<ffi::Buffer<ffi::F32>> abt, ffi::Result<ffi::Buffer<ffi::F32>> pk) {
  const auto c = cache.dimensions();
  if (c.size() != 4 || c[1] != GATHER_PAGE_ROWS || c[2] <= GATHER_HEAD || (c[3] != 128 && c[3] != 256))
    return ffi::Error::InvalidArgument("cache must be [pages, 16, heads > 1, 128 or 256]");
  const int64_t d = c[3];
  if (a.element_count() != 64 * d || p.element_count() != 64 * 64 || pages.element_count() != GATHER_PAGES ||
      abt->element_count() != 64 * 64 || pk->element_count() != 64 * d)
    return ffi::Error::InvalidArgument("a must be [64, D], p [64, 64], pages [4]; abt [64, 64], pk [64, D]");
  GatherTestArgs args{};
  args.pages = pages.typed_data();
  args.abt = abt->typed_data();
  args.pk = pk->typed_data();
  const void *a_ptr = a.untyped_data(), *p_ptr = p.untyped_data(), *cache_ptr = cache.untyped_data();
  return d == 128 ? launch_gather_test<128>(stream, args, a_ptr, p_ptr, cache_ptr, int(c[0]), int(c[2]))
                  : launch_gather_test<256>(stream, args, a_ptr, p_ptr, cache_ptr, int(c[0]), int(c[2]));
}

// ---- the producer/consumer ring, filled both ways: 5 tiles through 2 slots by TMA, and 5 rows
// of column weights through 2 more slots by a warp's plain stores; out = sum_i x_i * w_i ----
constexpr int RING_TILES = 5;

struct RingTestArgs {
  CUtensorMap x;    // bf16 [RING_TILES * 64, 64], boxes of 64 rows
  const float* w;   // [RING_TILES, 64]: use i's weight for each column
  float* out;       // [64, 64]
};

struct ring_test_shared {
  st<bf16, 64, 64> tile[2];
  float weights[2][64];
  ring<2> tile_slots, weight_slots;
};

__global__ void __launch_bounds__(256) ring_test_kernel(const __grid_constant__ RingTestArgs args) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<ring_test_shared>(smem_raw);
  if (threadIdx.x == 0) {
    s.tile_slots.init(4);  // the consumer warpgroup's 4 warps
    s.weight_slots.init(128, 32);  // freed by each consumer thread, filled by a warp's 32 lanes
    tma::fence_barrier_init();
  }
  __syncthreads();
  if (warpgroup::groupid() == 0) {  // producer: one thread copies, warp 1 stores
    if (threadIdx.x == 0)
      for (int i = 0; i < RING_TILES; i++)
        tma::load_async(&s.tile[s.tile_slots.slot(i)], args.x, s.tile_slots.fill(i, sizeof(s.tile[0])), 0, 64 * i, 0, 0,
                        0);
    if (warpgroup::warp_in_group() == 1)
      for (int i = 0; i < RING_TILES; i++) {
        const float2 w = reinterpret_cast<const float2*>(args.w + 64 * i)[laneid()];
        reinterpret_cast<float2*>(s.weights[s.weight_slots.wait_free(i)])[laneid()] = w;
        s.weight_slots.publish(i);
      }
    return;
  }
  const int row0 = 16 * warpgroup::warp_in_group();
  rt_fl<16, 64> sum;
  zero(sum);
  for (int i = 0; i < RING_TILES; i++) {  // each use must see its own tile and its own weights
    rt<bf16, 16, 64> t;
    load(t, s.tile[s.tile_slots.acquire(i)], row0, 0);
    s.tile_slots.release(i);
    col_vec<64> w;
    load(w, s.weights[s.weight_slots.acquire(i)]);
    s.weight_slots.release_each_lane(i);  // read with plain loads
    rt_fl<16, 64> f;
    copy(f, t);
    map_cols(f, w, [](float x, float w) { return x * w; });
    add(sum, f);
  }
  store(gl<float>::contiguous(args.out, 1, 64, 1, 64), sum, {0, 0, row0});
}

ffi::Error Ring(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::F32> w,
                ffi::Result<ffi::Buffer<ffi::F32>> out) {
  if (x.element_count() != RING_TILES * 64 * 64) return ffi::Error::InvalidArgument("x must be [320, 64]");
  if (w.element_count() != RING_TILES * 64) return ffi::Error::InvalidArgument("w must be [5, 64]");
  RingTestArgs args{};
  args.w = w.typed_data();
  if (!tma::make_bshd_map(&args.x, x.untyped_data(), true, 1, RING_TILES * 64, 1, 64, 64))
    return ffi::Error::Internal("tk_test_ring: tensor map encoding failed");
  args.out = out->typed_data();
  const int smem = int(sizeof(ring_test_shared)) + 1024;
  const cudaError_t err = launch_with_shared<ring_test_kernel>(1, 256, smem, stream, args);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("tk_test_ring: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// ---- fp32 shared tiles and TMA bulk stores / adds: copy = x[:50]; out = base + 2 x[:50], added
// twice in two groups ----
constexpr int BULK_ROWS = 50, BULK_COLS = 128;  // the global tensor; boxes of 64 rows x 64 columns

struct BulkAddArgs {
  CUtensorMap out;   // fp32 [BULK_ROWS, BULK_COLS]
  CUtensorMap copy;  // fp32 [BULK_ROWS, BULK_COLS]
  const float* x;   // fp32 [64, BULK_COLS]: rows past BULK_ROWS must be clipped by the copy engine
};

struct bulk_add_shared {
  st<float, 64, 64> tile[BULK_COLS / 64];
};

__global__ void __launch_bounds__(128) bulk_add_kernel(const __grid_constant__ BulkAddArgs args) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<bulk_add_shared>(smem_raw);
  const int row0 = 16 * warpgroup::warp_in_group();
  for (int chunk = 0; chunk < BULK_COLS / 64; chunk++) {  // registers -> swizzled fp32 tile
    rt_fl<16, 64> t;
    for_each(t, [&](float& v, int r, int c) { v = args.x[(row0 + r) * BULK_COLS + 64 * chunk + c]; });
    store(s.tile[chunk], t, row0, 0);
  }
  warpgroup::fence_shared_to_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int chunk = 0; chunk < BULK_COLS / 64; chunk++) tma::store_async(args.copy, &s.tile[chunk], 0, 0, 2 * chunk, 0, 0);
    tma::commit_group();
    for (int round = 0; round < 2; round++) {
      for (int chunk = 0; chunk < BULK_COLS / 64; chunk++)
        tma::store_add_async(args.out, &s.tile[chunk], 0, 0, 2 * chunk, 0, 0);
      tma::commit_group();
    }
    tma::wait_group<0>();
  }
}

ffi::Error BulkAdd(cudaStream_t stream, ffi::Buffer<ffi::F32> base, ffi::Buffer<ffi::F32> x,
                   ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> copy) {
  if (base.element_count() != BULK_ROWS * BULK_COLS || x.element_count() != 64 * BULK_COLS)
    return ffi::Error::InvalidArgument("base must be [50, 128], x [64, 128]");
  const size_t bytes = size_t(BULK_ROWS) * BULK_COLS * sizeof(float);
  if (cudaMemcpyAsync(out->typed_data(), base.typed_data(), bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
    return ffi::Error::Internal("tk_test_bulk_add: copy failed");
  BulkAddArgs args{};
  if (!tma::make_bshd_map_f32(&args.out, out->typed_data(), 1, BULK_ROWS, 1, BULK_COLS, 64, 64) ||
      !tma::make_bshd_map_f32(&args.copy, copy->typed_data(), 1, BULK_ROWS, 1, BULK_COLS, 64, 64))
    return ffi::Error::Internal("tk_test_bulk_add: tensor map encoding failed");
  args.x = x.typed_data();
  const int smem = int(sizeof(bulk_add_shared)) + 1024;
  const cudaError_t err = launch_with_shared<bulk_add_kernel>(1, 128, smem, stream, args);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("tk_test_bulk_add: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// ---- fragment order: out = base + 3 x, x [64, 64] staged by four warps in their register order
// and added twice by 1-D bulk reductions (the D <= 128 attention backward's dQ path), then once
// more from the registers by atomic_add_fragments (the D = 256 path) ----
__global__ void __launch_bounds__(128) fragment_add_kernel(const float* x, float* out) {
  __shared__ __align__(128) float staged[64 * 64];
  const int row0 = 16 * warpgroup::warp_in_group();
  rt_fl<16, 64> t;
  for_each(t, [&](float& v, int r, int c) { v = x[(row0 + r) * 64 + c]; });
  store_fragments(staged + 64 * row0, t);
  warpgroup::fence_shared_to_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int round = 0; round < 2; round++) {
      tma::add_bulk_async(out, staged, sizeof(staged));
      tma::commit_group();
    }
    tma::wait_group<0>();
  }
  atomic_add_fragments(out + 64 * row0, t);
}

ffi::Error FragmentAdd(cudaStream_t stream, ffi::Buffer<ffi::F32> base, ffi::Buffer<ffi::F32> x,
                       ffi::Result<ffi::Buffer<ffi::F32>> out) {
  if (base.element_count() != 64 * 64 || x.element_count() != 64 * 64 || out->element_count() != 64 * 64)
    return ffi::Error::InvalidArgument("base, x and out must hold 64 x 64 floats");
  if (cudaMemcpyAsync(out->typed_data(), base.typed_data(), 64 * 64 * sizeof(float), cudaMemcpyDeviceToDevice,
                      stream) != cudaSuccess)
    return ffi::Error::Internal("tk_test_fragment_add: copy failed");
  fragment_add_kernel<<<1, 128, 0, stream>>>(x.typed_data(), out->typed_data());
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("tk_test_fragment_add: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// ---- cluster mailbox: two blocks of a cluster swap 64 x 64 fp32 tiles, 32 columns per use
// through two slots, three rounds (six uses: each slot's barrier phases wrap); block r's tile
// in round n is x[r] + n, so out[r] = x[r] + sum_n (x[1 - r] + n) = x[r] + 3 x[1 - r] + 3 ----
constexpr int MAIL_ROUNDS = 3;

struct mail_test_shared {
  cluster::mailbox<16, 32, 2> mail;
};

__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(128) mail_test_kernel(const float* x, float* out) {
  extern __shared__ char smem_raw[];
  auto& s = aligned_shared<mail_test_shared>(smem_raw);
  const int rank = cluster::rank(), partner = rank ^ 1, row0 = 16 * warpgroup::warp_in_group();
  if (threadIdx.x == 0) {
    s.mail.init();
    tma::fence_barrier_init();
  }
  cluster::sync();
  rt_fl<16, 64> mine;
  for_each(mine, [&](float& v, int r, int c) { v = x[(rank * 64 + row0 + r) * 64 + c]; });
  rt_fl<16, 64> sum = mine;
  for (int round = 0; round < MAIL_ROUNDS; round++) {
    for (int half = 0; half < 2; half++) {
      const int use = 2 * round + half;
      s.mail.send(mine, 2 * half, partner, use);
      s.mail.receive_add(sum, 2 * half, partner, use);
    }
    map(mine, [](float v) { return v + 1.f; });
  }
  store(gl<float>::contiguous(out + rank * 64 * 64, 1, 64, 1, 64), sum, {0, 0, row0});
  cluster::sync();  // the partner's last arrive on this block's barrier has landed
}

ffi::Error Mailbox(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  if (x.element_count() != 2 * 64 * 64) return ffi::Error::InvalidArgument("x must be [2, 64, 64]");
  const int smem = int(sizeof(mail_test_shared)) + 1024;
  const cudaError_t err =
      launch_with_shared<mail_test_kernel>(2, 128, smem, stream, x.typed_data(), out->typed_data());
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("tk_test_mailbox: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_ring, Ring,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_fragment_add, FragmentAdd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_bulk_add, BulkAdd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_wgmma, Wgmma,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_grouped_rows, GroupedRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // a
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // p
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pages
                                  .Ret<ffi::Buffer<ffi::F32>>()   // abt
                                  .Ret<ffi::Buffer<ffi::F32>>());  // pk

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_mailbox, Mailbox,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
