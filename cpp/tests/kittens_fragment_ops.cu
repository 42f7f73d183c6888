// Test-only kernels for kittens' fragment-level ops (the ones the Based kernels build on):
// layout changes and free transposes, broadcasts of another tile's column, per-register
// selects, row dot products, two-vector row and column maps, sums through the tensor cores,
// the hi + lo split, row and column vectors to and from memory, and the fragment-order round
// trip between warps. One block of 4 warps, each on a 16-row strip of a 64-row input; compared
// with numpy by tests/test_kittens_gpu.py.
#include <cuda_runtime.h>

#include <string>

#include "../kittens/kittens.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace kittens;

namespace {

constexpr int ROWS = 64, COLS = 64;  // every input is [64, 64] (vectors [64]); 4 warps x 16 rows

ffi::Error launched(const char* name) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(name) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

template <typename T>
gl<T> matrix(T* p, int cols = COLS) {
  return gl<T>::contiguous(p, 1, ROWS, 1, cols);
}
// Columns [col0, col0 + 16) of a [64, 64] matrix, as a view of its own (for strips stored
// transposed).
template <typename T>
__device__ gl<T> column_strip(T* p, int col0) {
  return gl<T>{p + col0, 1, ROWS, 1, 16, ROWS * COLS, COLS, 0};
}

template <typename T, int C>
__device__ void load_all(st<T, ROWS, C>& tile, const gl<T>& x) {
  load_async<128>(tile, x, {0, 0, 0});
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
}

// ---- transposes: swap_layout (movmatrix) and as_transpose, both ways to x^T ----
// out_swap = as_transpose(swap_layout(x)), out_free = as_transpose(x loaded in col layout),
// out_back = swap_layout(swap_layout(x)) (x again), all [64, 64].
__global__ void layouts_kernel(gl<bf16> x, float* out_swap, float* out_free, gl<float> out_back) {
  __shared__ st<bf16, ROWS, COLS> sx;
  load_all(sx, x);
  const int row0 = 16 * warpid();
  rt_bf<16, COLS> rows;
  load(rows, sx, row0, 0);
  rt_bf<16, COLS, layout::col> swapped, loaded_col;
  swap_layout(swapped, rows);
  load(loaded_col, sx, row0, 0);
  rt_fl<COLS, 16> t;  // x^T's columns row0 .. row0 + 15
  copy(t, as_transpose(swapped));
  store(column_strip(out_swap, row0), t, {0, 0, 0});
  copy(t, as_transpose(loaded_col));
  store(column_strip(out_free, row0), t, {0, 0, 0});
  rt_bf<16, COLS> back;
  swap_layout(back, swapped);
  rt_fl<16, COLS> back_f;
  copy(back_f, back);
  store(out_back, back_f, {0, 0, row0});
}

ffi::Error Layouts(cudaStream_t s, ffi::Buffer<ffi::BF16> x, ffi::Result<ffi::Buffer<ffi::F32>> out_swap,
                   ffi::Result<ffi::Buffer<ffi::F32>> out_free, ffi::Result<ffi::Buffer<ffi::F32>> out_back) {
  if (x.element_count() != ROWS * COLS) return ffi::Error::InvalidArgument("x must be [64, 64]");
  layouts_kernel<<<1, 128, 0, s>>>(matrix(reinterpret_cast<bf16*>(x.typed_data())), out_swap->typed_data(),
                                   out_free->typed_data(), matrix(out_back->typed_data()));
  return launched("tk_test_layouts");
}

// ---- broadcasts of a column of another tile, 16-bit scalar products, selects ----
// Columns of y used (run-time values): COL_PAIR (even) for mul_by_columns, COL_ROW for the
// row-layout mul_by_column, COL_COL for the col-layout one.
struct BroadcastCols {
  int pair, row, col;
};

// by_pair0/1 = x * y[:, pair] and x * y[:, pair + 1] (bf16 products), by_row = x * y[:, row]
// (in T), by_col = x * y[:, col] through col-layout tiles (in T), quarter = x * 0.25 in T,
// selected = x on odd warps' rows, 2 x on even ones'. x [64, 64], y [64, 16].
template <typename T>
__global__ void broadcasts_kernel(gl<T> x, gl<T> y, BroadcastCols cols, gl<float> by_pair0, gl<float> by_pair1,
                                  gl<float> by_row, float* by_col, gl<float> quarter, gl<float> selected) {
  __shared__ st<T, ROWS, COLS> sx;
  __shared__ st<T, ROWS, 16> sy;
  load_async<128>(sy, y, {0, 0, 0});
  load_all(sx, x);
  const int row0 = 16 * warpid();
  rt<T, 16, COLS> xr;
  rt<T, 16, 16> yr;
  load(xr, sx, row0, 0);
  load(yr, sy, row0, 0);
  rt_fl<16, COLS> out;

  rt_bf<16, COLS> p0, p1;
  mul_by_columns(p0, p1, xr, yr, cols.pair);
  copy(out, p0);
  store(by_pair0, out, {0, 0, row0});
  copy(out, p1);
  store(by_pair1, out, {0, 0, row0});

  rt<T, 16, COLS> r;
  mul_by_column(r, xr, yr, cols.row);
  copy(out, r);
  store(by_row, out, {0, 0, row0});

  rt<T, 16, COLS, layout::col> xc, c;  // x [16 rows (k) x 64] and y as col-layout tiles
  rt<T, 16, 16, layout::col> yc;
  load(xc, sx, row0, 0);
  load(yc, sy, row0, 0);
  mul_by_column(c, xc, yc, cols.col);
  rt_fl<COLS, 16> ct;
  copy(ct, as_transpose(c));
  store(column_strip(by_col, row0), ct, {0, 0, 0});

  rt<T, 16, COLS> q;
  copy(q, xr);
  mul(q, 0.25f);
  copy(out, q);
  store(quarter, out, {0, 0, row0});

  rt<T, 16, COLS> twice, picked;
  copy(out, xr);
  mul(out, 2.f);
  copy(twice, out);
  select(picked, warpid() & 1, xr, twice);
  copy(out, picked);
  store(selected, out, {0, 0, row0});
}

template <ffi::DataType DT, typename T>
ffi::Error Broadcasts(cudaStream_t s, ffi::Buffer<DT> x, ffi::Buffer<DT> y, ffi::Result<ffi::Buffer<ffi::F32>> by_pair0,
                      ffi::Result<ffi::Buffer<ffi::F32>> by_pair1, ffi::Result<ffi::Buffer<ffi::F32>> by_row,
                      ffi::Result<ffi::Buffer<ffi::F32>> by_col, ffi::Result<ffi::Buffer<ffi::F32>> quarter,
                      ffi::Result<ffi::Buffer<ffi::F32>> selected, int64_t pair, int64_t row, int64_t col) {
  if (x.element_count() != ROWS * COLS || y.element_count() != ROWS * 16)
    return ffi::Error::InvalidArgument("x must be [64, 64], y [64, 16]");
  if (pair < 0 || pair > 14 || pair % 2 || row < 0 || row > 15 || col < 0 || col > 15)
    return ffi::Error::InvalidArgument("pair must be even and < 15, row and col < 16");
  broadcasts_kernel<T><<<1, 128, 0, s>>>(
      matrix(reinterpret_cast<T*>(x.typed_data())), matrix(reinterpret_cast<T*>(y.typed_data()), 16),
      BroadcastCols{int(pair), int(row), int(col)}, matrix(by_pair0->typed_data()), matrix(by_pair1->typed_data()),
      matrix(by_row->typed_data()), by_col->typed_data(), matrix(quarter->typed_data()),
      matrix(selected->typed_data()));
  return launched("tk_test_broadcasts");
}

// ---- row and column vectors: row_dot, two-vector maps, sums, loads and stores ----
// From x [64, 64] (bf16) and the vectors u, v [64] (f32):
//   dots[r] = sum_c (x[r][c] / 2) x[r][c]                                   (row_dot)
//   affine_rows = x * u[r] + v[r], affine_cols = x * u[c] + v[c]             (map_rows / map_cols)
//   sums[0] = sum_c u[c] for a lane's col_vec (every lane agrees)           (sum of a col_vec)
//   rows_out[r] = u[r] for r < 50, untouched (zeros) past                    (load, bounded store)
//   staged = u[0 .. valid) then zeros (load_async of a shared vector, valid = 37)
//   handed = x with each warp's strip from the other warp of its pair (store/load_fragments)
constexpr int VALID = 37, STORED_ROWS = 50;

__global__ void vectors_kernel(gl<bf16> x, const float* u, const float* v, float* dots, gl<float> affine_rows,
                               gl<float> affine_cols, float* sums, float* rows_out, float* staged, gl<float> handed) {
  __shared__ st<bf16, ROWS, COLS> sx;
  __shared__ sv_fl<ROWS> su;
  __shared__ alignas(16) float fragments[4][16 * COLS];
  load_async<128>(su, u, VALID);
  load_all(sx, x);
  const int row0 = 16 * warpid();
  rt_bf<16, COLS> xb;
  load(xb, sx, row0, 0);
  rt_fl<16, COLS> xf, half_x;
  copy(xf, xb);
  half_x = xf;
  mul(half_x, 0.5f);

  row_vec<16> dot;
  row_dot(dot, half_x, xb);
  store(dots + row0, dot);

  row_vec<16> ru, rv;
  load(ru, u + row0);
  load(rv, v + row0);
  rt_fl<16, COLS> t = xf;
  map_rows(t, ru, rv, [](float a, float scale, float shift) { return fmaf(a, scale, shift); });
  store(affine_rows, t, {0, 0, row0});
  col_vec<COLS> cu, cv;
  load(cu, u);
  load(cv, v);
  t = xf;
  map_cols(t, cu, cv, [](float a, float scale, float shift) { return fmaf(a, scale, shift); });
  store(affine_cols, t, {0, 0, row0});
  const float total = sum(cu);
  if (threadIdx.x == 0) sums[0] = total;
  if (threadIdx.x == 127) sums[1] = total;

  store(rows_out + row0, ru, STORED_ROWS - row0);
  if (threadIdx.x < ROWS) staged[threadIdx.x] = su.data[threadIdx.x];

  store_fragments(fragments[warpid()], xf);
  __syncthreads();
  rt_fl<16, COLS> other;
  load_fragments(other, fragments[warpid() ^ 1]);
  store(handed, other, {0, 0, row0});
}

ffi::Error Vectors(cudaStream_t s, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> v,
                   ffi::Result<ffi::Buffer<ffi::F32>> dots, ffi::Result<ffi::Buffer<ffi::F32>> affine_rows,
                   ffi::Result<ffi::Buffer<ffi::F32>> affine_cols, ffi::Result<ffi::Buffer<ffi::F32>> sums,
                   ffi::Result<ffi::Buffer<ffi::F32>> rows_out, ffi::Result<ffi::Buffer<ffi::F32>> staged,
                   ffi::Result<ffi::Buffer<ffi::F32>> handed) {
  if (x.element_count() != ROWS * COLS || u.element_count() != ROWS || v.element_count() != ROWS)
    return ffi::Error::InvalidArgument("x must be [64, 64], u and v [64]");
  cudaMemsetAsync(rows_out->typed_data(), 0, ROWS * sizeof(float), s);
  vectors_kernel<<<1, 128, 0, s>>>(matrix(reinterpret_cast<bf16*>(x.typed_data())), u.typed_data(), v.typed_data(),
                                   dots->typed_data(), matrix(affine_rows->typed_data()),
                                   matrix(affine_cols->typed_data()), sums->typed_data(), rows_out->typed_data(),
                                   staged->typed_data(), matrix(handed->typed_data()));
  return launched("tk_test_vectors");
}

// ---- sums through the tensor cores and the hi + lo split ----
// row_sums[r] = sum_c x[r][c]; col_sums[b][c] = sum over rows r of block b (16 rows) of
// u[r] x[r][c], and plain[b][c] without u; hi, lo = the split of x * 3.3 (fp32), lo_part =
// split part 1 alone (must equal lo).
__global__ void sums_kernel(gl<bf16> x, const float* u, float* row_sums, float* col_sums, float* plain_sums,
                            gl<float> hi_out, gl<float> lo_out, gl<float> lo_part_out) {
  __shared__ st<bf16, ROWS, COLS> sx;
  load_all(sx, x);
  const int warp = warpid(), row0 = 16 * warp;
  rt_bf<16, COLS> xr;
  load(xr, sx, row0, 0);
  row_vec<16> rows;
  map(rows, [](float) { return 0.f; });
  mma_row_sum(rows, xr);
  store(row_sums + row0, rows);

  rt_bf<16, COLS, layout::col> xc;  // this warp's 16 rows are the reduction dim
  load(xc, sx, row0, 0);
  col_vec<16> w;
  load(w, u + row0);
  col_vec<COLS> weighted, plain;
#pragma unroll
  for (int j = 0; j < weighted.width; j++)
    weighted.data[j][0] = weighted.data[j][1] = plain.data[j][0] = plain.data[j][1] = make_float2(0.f, 0.f);
  mma_col_sum(weighted, xc, w);
  mma_col_sum(plain, xc);
  if (laneid() < 4)  // row group 0 holds every column once
#pragma unroll
    for (int j = 0; j < weighted.width; j++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int c = col_vec_col(j, h);
        reinterpret_cast<float2*>(col_sums + warp * COLS + c)[0] = weighted.data[j][h];
        reinterpret_cast<float2*>(plain_sums + warp * COLS + c)[0] = plain.data[j][h];
      }

  rt_fl<16, COLS> scaled;
  copy(scaled, xr);
  mul(scaled, 3.3f);
  rt_bf<16, COLS> hi, lo, lo_part;
  split(hi, lo, scaled);
  split(lo_part, scaled, 1);
  rt_fl<16, COLS> f;
  copy(f, hi);
  store(hi_out, f, {0, 0, row0});
  copy(f, lo);
  store(lo_out, f, {0, 0, row0});
  copy(f, lo_part);
  store(lo_part_out, f, {0, 0, row0});
}

ffi::Error Sums(cudaStream_t s, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::F32> u,
                ffi::Result<ffi::Buffer<ffi::F32>> row_sums, ffi::Result<ffi::Buffer<ffi::F32>> col_sums,
                ffi::Result<ffi::Buffer<ffi::F32>> plain_sums, ffi::Result<ffi::Buffer<ffi::F32>> hi,
                ffi::Result<ffi::Buffer<ffi::F32>> lo, ffi::Result<ffi::Buffer<ffi::F32>> lo_part) {
  if (x.element_count() != ROWS * COLS || u.element_count() != ROWS)
    return ffi::Error::InvalidArgument("x must be [64, 64], u [64]");
  sums_kernel<<<1, 128, 0, s>>>(matrix(reinterpret_cast<bf16*>(x.typed_data())), u.typed_data(),
                                row_sums->typed_data(), col_sums->typed_data(), plain_sums->typed_data(),
                                matrix(hi->typed_data()), matrix(lo->typed_data()), matrix(lo_part->typed_data()));
  return launched("tk_test_sums");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_layouts, Layouts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#define TK_BROADCASTS_BINDING(DT)               \
  ffi::Ffi::Bind()                              \
      .Ctx<ffi::PlatformStream<cudaStream_t>>() \
      .Arg<ffi::Buffer<DT>>()                   \
      .Arg<ffi::Buffer<DT>>()                   \
      .Ret<ffi::Buffer<ffi::F32>>()             \
      .Ret<ffi::Buffer<ffi::F32>>()             \
      .Ret<ffi::Buffer<ffi::F32>>()             \
      .Ret<ffi::Buffer<ffi::F32>>()             \
      .Ret<ffi::Buffer<ffi::F32>>()             \
      .Ret<ffi::Buffer<ffi::F32>>()             \
      .Attr<int64_t>("pair")                    \
      .Attr<int64_t>("row")                     \
      .Attr<int64_t>("col")
XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_broadcasts_bf16, (Broadcasts<ffi::BF16, bf16>),
                              TK_BROADCASTS_BINDING(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_broadcasts_f16, (Broadcasts<ffi::F16, half>), TK_BROADCASTS_BINDING(ffi::F16));

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_vectors, Vectors,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_test_sums, Sums,
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
