// Test-only kernels for the kittens unit tests: each runs one op family on a small input so
// tests/test_kittens_gpu.py can compare it with numpy. Exposed as XLA FFI handlers.
#include <cuda_runtime.h>

#include <string>

#include "../kittens/kittens.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace kittens;

namespace {

constexpr int ROWS = 64;  // every test tile is 64 rows; one block of 4 warps, 16 rows each

ffi::Error launched(const char* name) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(name) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// This warp's 16 rows of x [64, C], through the swizzled shared tile `tile` (cp.async, ldmatrix).
template <int C>
__device__ rt<bf16, 16, C> load_via_shared(st<bf16, ROWS, C>& tile, const gl<bf16>& x) {
  load_async<128>(tile, x, {0, 0, 0});
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  rt<bf16, 16, C> r;
  load(r, tile, 16 * warpid(), 0);
  return r;
}

// ---- global -> shared (swizzled) -> registers -> global, for each swizzle width ----
template <int C>
__global__ void roundtrip_kernel(gl<bf16> x, gl<bf16> y, gl<bf16> y_via_shared) {
  __shared__ st<bf16, ROWS, C> tile, back;
  const rt<bf16, 16, C> r = load_via_shared(tile, x);
  store(y, r, {0, 0, 16 * warpid()});
  store(back, r, 16 * warpid(), 0);  // registers -> swizzled shared -> global
  __syncthreads();
  store<128>(y_via_shared, back, {0, 0, 0});
}

template <int C>
void launch_roundtrip(cudaStream_t s, const bf16* x, int valid_rows, bf16* y, bf16* y2) {
  roundtrip_kernel<C><<<1, 128, 0, s>>>(gl<bf16>::contiguous(const_cast<bf16*>(x), 1, valid_rows, 1, C),
                                        gl<bf16>::contiguous(y, 1, ROWS, 1, C),
                                        gl<bf16>::contiguous(y2, 1, ROWS, 1, C));
}

// x: [valid_rows, C] with valid_rows <= 64; y, y2: [64, C] (rows past x's end must read 0).
ffi::Error Roundtrip(cudaStream_t s, ffi::Buffer<ffi::BF16> x, ffi::Result<ffi::Buffer<ffi::BF16>> y,
                     ffi::Result<ffi::Buffer<ffi::BF16>> y2) {
  const auto d = x.dimensions();
  if (d.size() != 2 || d[0] < 1 || d[0] > ROWS) return ffi::Error::InvalidArgument("x must be [1..64, C]");
  if (y->dimensions()[0] != ROWS || y->dimensions()[1] != d[1]) return ffi::Error::InvalidArgument("y must be [64, C]");
  auto* xp = reinterpret_cast<const bf16*>(x.typed_data());
  auto* yp = reinterpret_cast<bf16*>(y->typed_data());
  auto* y2p = reinterpret_cast<bf16*>(y2->typed_data());
  switch (d[1]) {
    case 16: launch_roundtrip<16>(s, xp, int(d[0]), yp, y2p); break;
    case 32: launch_roundtrip<32>(s, xp, int(d[0]), yp, y2p); break;
    case 64: launch_roundtrip<64>(s, xp, int(d[0]), yp, y2p); break;
    case 128: launch_roundtrip<128>(s, xp, int(d[0]), yp, y2p); break;
    default: return ffi::Error::InvalidArgument("C must be 16, 32, 64 or 128");
  }
  return launched("tk_test_roundtrip");
}

// ---- registers -> shared, transposed (stmatrix .trans): y = x^T, x [64, C], y [C, 64] ----
template <int C>
__global__ void transpose_kernel(gl<bf16> x, gl<bf16> y) {
  __shared__ st<bf16, ROWS, C> tile;
  __shared__ st<bf16, C, ROWS> transposed;
  const rt<bf16, 16, C> r = load_via_shared(tile, x);
  store_transposed(transposed, r, 0, 16 * warpid());
  __syncthreads();
  store<128>(y, transposed, {0, 0, 0});
}

ffi::Error Transpose(cudaStream_t s, ffi::Buffer<ffi::BF16> x, ffi::Result<ffi::Buffer<ffi::BF16>> y) {
  const auto d = x.dimensions();
  if (d.size() != 2 || d[0] != ROWS) return ffi::Error::InvalidArgument("x must be [64, C]");
  if (y->dimensions()[0] != d[1] || y->dimensions()[1] != ROWS) return ffi::Error::InvalidArgument("y must be [C, 64]");
  const int cols = int(d[1]);
  auto xv = gl<bf16>::contiguous(reinterpret_cast<bf16*>(const_cast<void*>(x.untyped_data())), 1, ROWS, 1, cols);
  auto yv = gl<bf16>::contiguous(reinterpret_cast<bf16*>(y->untyped_data()), 1, cols, 1, ROWS);
  switch (cols) {
    case 16: transpose_kernel<16><<<1, 128, 0, s>>>(xv, yv); break;
    case 32: transpose_kernel<32><<<1, 128, 0, s>>>(xv, yv); break;
    case 64: transpose_kernel<64><<<1, 128, 0, s>>>(xv, yv); break;
    case 128: transpose_kernel<128><<<1, 128, 0, s>>>(xv, yv); break;
    default: return ffi::Error::InvalidArgument("C must be 16, 32, 64 or 128");
  }
  return launched("tk_test_transpose");
}

// ---- mma: a @ b (b through the col layout) and a @ c^T, all 64x64 ----
template <typename T>
__global__ void mma_kernel(gl<T> a, gl<T> b, gl<T> c, gl<float> ab, gl<float> abt) {
  __shared__ st<T, ROWS, 64> sa, sb, sc;
  load_async<128>(sa, a, {0, 0, 0});
  load_async<128>(sb, b, {0, 0, 0});
  load_async<128>(sc, c, {0, 0, 0});
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  rt<T, 16, 64> ra;
  rt<T, 64, 64, layout::col> rb;
  rt<T, 64, 64> rc;
  load(ra, sa, 16 * warpid(), 0);
  load(rb, sb);
  load(rc, sc);
  rt_fl<16, 64> out;
  zero(out);
  mma_AB(out, ra, rb, out);
  store(ab, out, {0, 0, 16 * warpid()});
  zero(out);
  mma_ABt(out, ra, rc, out);
  store(abt, out, {0, 0, 16 * warpid()});
}

template <ffi::DataType DT, typename T>
ffi::Error Mma(cudaStream_t s, ffi::Buffer<DT> a, ffi::Buffer<DT> b, ffi::Buffer<DT> c,
               ffi::Result<ffi::Buffer<ffi::F32>> ab, ffi::Result<ffi::Buffer<ffi::F32>> abt) {
  for (auto* buf : {&a, &b, &c})
    if (buf->element_count() != ROWS * 64) return ffi::Error::InvalidArgument("a, b, c must be [64, 64]");
  auto view = [](auto* p) { return gl<T>::contiguous(reinterpret_cast<T*>(p), 1, ROWS, 1, 64); };
  mma_kernel<T><<<1, 128, 0, s>>>(view(a.typed_data()), view(b.typed_data()), view(c.typed_data()),
                                  gl<float>::contiguous(ab->typed_data(), 1, ROWS, 1, 64),
                                  gl<float>::contiguous(abt->typed_data(), 1, ROWS, 1, 64));
  return launched("tk_test_mma");
}

// ---- maps, row reductions, row and column broadcasts, masks on a 64x64 fp32 register tile ----
// The band kept by mask_band in rowops_kernel, in whole-tile coordinates.
constexpr int BAND_LO = -5, BAND_HI = 3, BAND_ROWS = 50, BAND_COLS = 61;

__global__ void rowops_kernel(gl<bf16> x, const float* col, gl<float> softmax, gl<float> masked,
                              gl<float> banded, gl<float> col_mapped, float* row_max_out, float* row_sum_out) {
  __shared__ st<bf16, ROWS, 64> sx;
  load_async<128>(sx, x, {0, 0, 0});
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  rt<bf16, 16, 64> xb;
  load(xb, sx, 16 * warpid(), 0);
  rt_fl<16, 64> t;
  copy(t, xb);
  row_vec<16> mx, sum;
  row_max(mx, t);
  row_sum(sum, t);
  const int row0 = 16 * warpid();
  if ((laneid() & 3) == 0)
    for (int h = 0; h < 2; h++) {
      row_max_out[row0 + row_vec_row(0, h)] = mx.data[0][h];
      row_sum_out[row0 + row_vec_row(0, h)] = sum.data[0][h];
    }
  rt_fl<16, 64> p = t;  // softmax in base 2: 2^(x - max) / sum
  sub_row(p, mx);
  exp2(p);
  row_vec<16> denom;
  row_sum(denom, p);
  div_row(p, denom);
  store(softmax, p, {0, 0, row0});
  col_vec<64> c;  // column broadcast: x * c[j] - c[j]
  load(c, col);
  rt_fl<16, 64> by_col = t;
  map_cols(by_col, c, [](float x, float cj) { return x * cj - cj; });
  store(col_mapped, by_col, {0, 0, row0});
  rt_fl<16, 64> band = t;  // BAND_LO <= col - row <= BAND_HI, row < BAND_ROWS, col < BAND_COLS
  mask_band(band, BAND_LO + row0, BAND_HI + row0, BAND_ROWS - row0, BAND_COLS, -1e30f);
  store(banded, band, {0, 0, row0});
  mask(t, row0, 0, [](int i, int j) { return j <= i; }, -1e30f);  // causal
  mul(t, 2.f);
  store(masked, t, {0, 0, row0});
}

ffi::Error RowOps(cudaStream_t s, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::F32> col,
                  ffi::Result<ffi::Buffer<ffi::F32>> softmax, ffi::Result<ffi::Buffer<ffi::F32>> masked,
                  ffi::Result<ffi::Buffer<ffi::F32>> banded, ffi::Result<ffi::Buffer<ffi::F32>> col_mapped,
                  ffi::Result<ffi::Buffer<ffi::F32>> row_max_out, ffi::Result<ffi::Buffer<ffi::F32>> row_sum_out) {
  if (x.element_count() != ROWS * 64) return ffi::Error::InvalidArgument("x must be [64, 64]");
  if (col.element_count() != 64) return ffi::Error::InvalidArgument("col must be [64]");
  rowops_kernel<<<1, 128, 0, s>>>(
      gl<bf16>::contiguous(reinterpret_cast<bf16*>(x.typed_data()), 1, ROWS, 1, 64), col.typed_data(),
      gl<float>::contiguous(softmax->typed_data(), 1, ROWS, 1, 64),
      gl<float>::contiguous(masked->typed_data(), 1, ROWS, 1, 64),
      gl<float>::contiguous(banded->typed_data(), 1, ROWS, 1, 64),
      gl<float>::contiguous(col_mapped->typed_data(), 1, ROWS, 1, 64), row_max_out->typed_data(),
      row_sum_out->typed_data());
  return launched("tk_test_rowops");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_roundtrip, Roundtrip,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_transpose, Transpose,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

#define TK_MMA_BINDING(DT)                                \
  ffi::Ffi::Bind()                                        \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()           \
      .Arg<ffi::Buffer<DT>>()                             \
      .Arg<ffi::Buffer<DT>>()                             \
      .Arg<ffi::Buffer<DT>>()                             \
      .Ret<ffi::Buffer<ffi::F32>>()                       \
      .Ret<ffi::Buffer<ffi::F32>>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_mma_bf16, (Mma<ffi::BF16, bf16>), TK_MMA_BINDING(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_mma_f16, (Mma<ffi::F16, half>), TK_MMA_BINDING(ffi::F16));

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_rowops, RowOps,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
