// XLA FFI handler for attention against a KV cache: decode the buffers, check them, call the
// launcher.
//
// Buffers (leading dims L..., e.g. from vmap, fold into the batch; paged caches then hold one
// page pool per leading index):
//   q           [L..., B, Tq, Hq, D]       bf16 / fp16
//   k, v cache  [L..., B, S, Hkv, D]       contiguous (paged = 0), or
//               [L..., P, page, Hkv, D]    paged (paged = 1)
//   seqlens     [L..., B] int32
//   page_table  [L..., B, max_pages] int32 (contiguous: any last dim, not read)
// Results: o like q, lse [L..., B, Hq, Tq] f32, workspace u8 [workspace_bytes] (any leading dims).
#include <cuda_runtime.h>

#include <initializer_list>
#include <string>

#include "../kernels/kvcache/kvcache.h"
#include "ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using tk::ffi_util::shape_str;

namespace {

ffi::Error invalid(const std::string& msg) { return ffi::Error::InvalidArgument("tk_attention_kvcache: " + msg); }

// dims == `lead` followed by `tail`.
bool has_shape(ffi::Span<const int64_t> dims, ffi::Span<const int64_t> lead, std::initializer_list<int64_t> tail) {
  if (dims.size() != lead.size() + tail.size()) return false;
  for (size_t i = 0; i < lead.size(); i++)
    if (dims[i] != lead[i]) return false;
  size_t i = lead.size();
  for (int64_t t : tail)
    if (dims[i++] != t) return false;
  return true;
}

std::string dims_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); i++) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ffi::Error AttentionKvCache(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                            ffi::Buffer<ffi::S32> seqlens, ffi::Buffer<ffi::S32> page_table,
                            ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                            ffi::Result<ffi::Buffer<ffi::U8>> workspace, float scale, int64_t window_left,
                            int64_t window_right, int64_t num_splits, int64_t paged) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions();
  if (qd.size() < 4) return invalid("q must be [..., batch, seq_q, heads_q, head_dim], got " + shape_str(q));
  const size_t r = qd.size();
  const ffi::Span<const int64_t> lead = qd.first(r - 4);  // folded into the batch
  const int64_t batch = qd[r - 4], seq_q = qd[r - 3], heads_q = qd[r - 2], head_dim = qd[r - 1];
  int64_t pools = 1;
  for (int64_t d : lead) pools *= d;
  if (paged != 0 && paged != 1) return invalid("paged must be 0 or 1");

  const auto dtype = q.element_type();
  if (dtype != ffi::BF16 && dtype != ffi::F16) return invalid("q must be bf16 or fp16");
  if (k_cache.element_type() != dtype || v_cache.element_type() != dtype || o->element_type() != dtype)
    return invalid("q, k_cache, v_cache and o must share one dtype");
  if (!tk::kvcache::head_dim_supported(head_dim)) return invalid("head_dim must be 64, 128 or 256, got " + shape_str(q));
  if (kd.size() != r || !has_shape(kd, lead, {kd[r - 4], kd[r - 3], kd[r - 2], head_dim}))
    return invalid("k_cache must be [..., rows or pages, seq or page_size, heads_kv, head_dim] with q's leading dims "
                   "and head_dim, got q " + shape_str(q) + ", k_cache " + shape_str(k_cache));
  if (!has_shape(v_cache.dimensions(), kd, {}))
    return invalid("v_cache must have k_cache's shape, got " + shape_str(k_cache) + " and " + shape_str(v_cache));
  const int64_t heads_kv = kd[r - 2];
  if (heads_kv < 1 || heads_q % heads_kv != 0)
    return invalid("heads_q must be a multiple of heads_kv >= 1, got " + shape_str(q) + " and " + shape_str(k_cache));
  if (!paged && kd[r - 4] != batch)
    return invalid("a contiguous cache must have q's batch, got q " + shape_str(q) + ", k_cache " + shape_str(k_cache));
  if (!has_shape(seqlens.dimensions(), lead, {batch}))
    return invalid("seqlens must be [..., batch], got " + dims_str(seqlens.dimensions()) + " for q " + shape_str(q));
  const auto pd = page_table.dimensions();
  if (pd.size() != r - 2 || !has_shape(pd, lead, {batch, pd[r - 3]}))
    return invalid("page_table must be [..., batch, max_pages], got " + dims_str(pd) + " for q " + shape_str(q));
  if (!has_shape(o->dimensions(), qd, {})) return invalid("o must have q's shape");
  if (!has_shape(lse->dimensions(), lead, {batch, heads_q, seq_q}))
    return invalid("lse must be [..., batch, heads_q, seq_q], got " + dims_str(lse->dimensions()));
  if (window_left < -1 || window_right < -1 || window_left > INT32_MAX || window_right > INT32_MAX)
    return invalid("window bounds must be in [-1, 2^31)");
  if (num_splits < 1 || num_splits > tk::kvcache::MAX_SPLITS)
    return invalid("num_splits must be in [1, " + std::to_string(tk::kvcache::MAX_SPLITS) + "], got " +
                   std::to_string(num_splits));
  const int64_t total_batch = pools * batch;
  for (const int64_t n : {total_batch, seq_q, heads_q, kd[r - 4], kd[r - 3], pd[r - 3]})
    if (n > INT32_MAX) return invalid("dimensions too large");
  if (total_batch == 0 || seq_q == 0 || heads_q == 0) return ffi::Error::Success();  // nothing to compute

  tk::kvcache::Params p{};
  p.q = q.untyped_data();
  p.k = k_cache.untyped_data();
  p.v = v_cache.untyped_data();
  p.seqlens = seqlens.typed_data();
  p.page_table = paged ? page_table.typed_data() : nullptr;
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  p.workspace = workspace->untyped_data();
  p.batch = int(total_batch);
  p.seq_q = int(seq_q);
  p.heads_q = int(heads_q);
  p.heads_kv = int(heads_kv);
  p.head_dim = int(head_dim);
  p.paged = paged == 1;
  if (p.paged) {
    p.page_size = int(kd[r - 3]);
    if (!tk::kvcache::page_size_supported(p.page_size))
      return invalid("page_size (k_cache's dim -3 of a paged cache) must be 16, 32, 64, 128 or 256, got " +
                     shape_str(k_cache));
    p.max_pages = int(pd[r - 3]);
    p.pages_per_pool = int(kd[r - 4]);
    p.rows_per_pool = int(batch);
    p.capacity = int64_t(p.max_pages) * p.page_size;
  } else {
    p.capacity = kd[r - 3];
  }
  p.scale = scale;
  p.window_left = int(window_left);
  p.window_right = int(window_right);
  p.num_splits = int(num_splits);
  p.dtype = dtype == ffi::BF16 ? tk::kvcache::DType::bf16 : tk::kvcache::DType::fp16;
  const size_t want = tk::kvcache::workspace_bytes(total_batch, heads_q, seq_q, head_dim, num_splits);
  if (workspace->size_bytes() != want)
    return invalid("the workspace must hold kvcache_workspace_bytes(batch, heads_q, seq_q, head_dim, num_splits) = " +
                   std::to_string(want) + " bytes, got " + std::to_string(workspace->size_bytes()));
  if (const char* why = tk::kvcache::unsupported(p)) return invalid(why);

  const cudaError_t err = tk::kvcache::decode(p, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("tk_attention_kvcache launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

// kCmdBufferCompatible: the handler only checks shapes, builds TMA tensor maps on the host and
// enqueues kernels on the given stream (the combine pass with programmatic dependent launch);
// no host sync, no allocation (the split partials live in the workspace output), no host read
// of device data (seqlens and the page table are read by the kernel).
XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_attention_kvcache, AttentionKvCache,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k_cache
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seqlens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table
                                  .Ret<ffi::AnyBuffer>()          // o
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<int64_t>("num_splits")
                                  .Attr<int64_t>("paged"),
                              {ffi::Traits::kCmdBufferCompatible});
