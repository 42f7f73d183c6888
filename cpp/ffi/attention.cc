// XLA FFI handlers for flash attention: decode the buffers, check them, call one launcher.
#include <cuda_runtime.h>

#include <string>

#include "../kernels/attention/attention.h"
#include "ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using tk::ffi_util::leading_product;
using tk::ffi_util::shape_str;

namespace {

ffi::Error invalid(const std::string& msg) { return ffi::Error::InvalidArgument("tk_attention_fwd: " + msg); }

bool same_dims(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); i++)
    if (a[i] != b[i]) return false;
  return true;
}

// The leading `n` dimensions of `dims`.
ffi::Span<const int64_t> leading(ffi::Span<const int64_t> dims, size_t n) { return {dims.begin(), n}; }

std::string dims_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); i++) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// The optional masks of both handlers. The four int32 arrays are always passed; without segment
// ids (lengths) the attribute says so and their buffers are placeholders, never read. Segment ids
// have the shape of q's (k's) leading dims and sequence, [..., seq], lengths that of the leading
// dims, [...] (vmap's leading axes fold into the batch like q's). The mask workspace is
// mask_workspace_bytes(batch, seq_q, seq_k, has_segment_ids) bytes. Returns an empty string, or
// what is wrong.
std::string decode_mask(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd, ffi::Buffer<ffi::S32> q_segment_ids,
                        ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::S32> q_lengths,
                        ffi::Buffer<ffi::S32> kv_lengths, ffi::Result<ffi::Buffer<ffi::U8>>& workspace,
                        bool has_segment_ids, bool has_seq_lengths, bool bottom_right, int64_t batch,
                        tk::attention::MaskParams& mask) {
  const size_t r = qd.size();
  if (has_segment_ids) {
    if (!same_dims(q_segment_ids.dimensions(), leading(qd, r - 2)))
      return "q_segment_ids must be " + dims_str(leading(qd, r - 2)) + " (q's batch and sequence), got " +
             dims_str(q_segment_ids.dimensions());
    if (!same_dims(kv_segment_ids.dimensions(), leading(kd, r - 2)))
      return "kv_segment_ids must be " + dims_str(leading(kd, r - 2)) + " (k's batch and sequence), got " +
             dims_str(kv_segment_ids.dimensions());
    mask.q_segment_ids = q_segment_ids.typed_data();
    mask.kv_segment_ids = kv_segment_ids.typed_data();
  }
  if (has_seq_lengths) {
    for (const auto* x : {&q_lengths, &kv_lengths})
      if (!same_dims(x->dimensions(), leading(qd, r - 3)))
        return "q_seq_lengths and kv_seq_lengths must be " + dims_str(leading(qd, r - 3)) + " (the batch), got " +
               dims_str(q_lengths.dimensions()) + " and " + dims_str(kv_lengths.dimensions());
    mask.q_lengths = q_lengths.typed_data();
    mask.kv_lengths = kv_lengths.typed_data();
  }
  const size_t bytes = tk::attention::mask_workspace_bytes(batch, qd[r - 3], kd[r - 3], has_segment_ids);
  if (workspace->size_bytes() != bytes)
    return "the mask workspace must hold attention_mask_workspace_bytes(batch, seq_q, seq_k, has_segment_ids) = " +
           std::to_string(bytes) + " bytes, got " + std::to_string(workspace->size_bytes());
  mask.workspace = workspace->untyped_data();
  mask.bottom_right = bottom_right;
  return "";
}

ffi::Error AttentionForward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::S32> q_segment_ids, ffi::Buffer<ffi::S32> kv_segment_ids,
                            ffi::Buffer<ffi::S32> q_lengths, ffi::Buffer<ffi::S32> kv_lengths,
                            ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                            ffi::Result<ffi::Buffer<ffi::U8>> mask_workspace, float scale, int64_t window_left,
                            int64_t window_right, bool has_segment_ids, bool has_seq_lengths, bool bottom_right) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() < 4 || kd.size() != qd.size() || vd.size() != qd.size())
    return invalid("q, k, v must have the same rank >= 4, got q " + shape_str(q) + ", k " + shape_str(k) +
                   ", v " + shape_str(v));
  const size_t r = qd.size();
  const auto dtype = q.element_type();
  if (dtype != ffi::BF16 && dtype != ffi::F16) return invalid("q must be bf16 or fp16");
  if (k.element_type() != dtype || v.element_type() != dtype || o->element_type() != dtype)
    return invalid("q, k, v and o must share one dtype");
  for (size_t i = 0; i + 3 < r; i++)
    if (kd[i] != qd[i] || vd[i] != qd[i]) return invalid("q, k, v batch dimensions differ");
  for (size_t i = r - 3; i < r; i++)
    if (vd[i] != kd[i]) return invalid("k and v shapes differ: " + shape_str(k) + " vs " + shape_str(v));
  if (kd[r - 1] != qd[r - 1]) return invalid("q and k head_dim differ");
  if (o->dimensions().size() != r) return invalid("o must have q's shape");
  for (size_t i = 0; i < r; i++)
    if (o->dimensions()[i] != qd[i]) return invalid("o must have q's shape");
  const auto ld = lse->dimensions();
  if (ld.size() != r - 1 || ld[r - 3] != qd[r - 2] || ld[r - 2] != qd[r - 3])
    return invalid("lse must be [..., heads_q, seq_q]");
  const int64_t batch = leading_product(qd, 3);
  if (batch > INT32_MAX || qd[r - 3] > INT32_MAX || kd[r - 3] > INT32_MAX)
    return invalid("dimensions too large");
  if (window_left < -1 || window_right < -1 || window_left > INT32_MAX || window_right > INT32_MAX)
    return invalid("window bounds must be in [-1, 2^31)");

  tk::attention::ForwardParams p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  p.batch = int(batch);
  p.seq_q = int(qd[r - 3]);
  p.seq_k = int(kd[r - 3]);
  p.heads_q = int(qd[r - 2]);
  p.heads_kv = int(kd[r - 2]);
  p.head_dim = int(qd[r - 1]);
  p.scale = scale;
  p.window_left = int(window_left);
  p.window_right = int(window_right);
  p.dtype = dtype == ffi::BF16 ? tk::attention::DType::bf16 : tk::attention::DType::fp16;
  if (const std::string why = decode_mask(qd, kd, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, mask_workspace,
                                          has_segment_ids, has_seq_lengths, bottom_right, batch, p.mask);
      !why.empty())
    return invalid(why);
  if (const char* why = tk::attention::forward_unsupported(p)) return invalid(why);

  const cudaError_t err = tk::attention::forward(p, stream);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("tk_attention_fwd launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error invalid_bwd(const std::string& msg) {
  return ffi::Error::InvalidArgument("tk_attention_bwd: " + msg);
}

ffi::Error AttentionBackward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::AnyBuffer o, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse,
                             ffi::Buffer<ffi::F32> dlse, ffi::Buffer<ffi::S32> q_segment_ids,
                             ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::S32> q_lengths,
                             ffi::Buffer<ffi::S32> kv_lengths, ffi::Result<ffi::AnyBuffer> dq,
                             ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                             ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                             ffi::Result<ffi::Buffer<ffi::U8>> mask_workspace, float scale, int64_t window_left,
                             int64_t window_right, bool has_segment_ids, bool has_seq_lengths, bool bottom_right) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() < 4 || kd.size() != qd.size()) return invalid_bwd("q and k must have the same rank >= 4");
  const size_t r = qd.size();
  const auto dtype = q.element_type();
  if (dtype != ffi::BF16 && dtype != ffi::F16) return invalid_bwd("q must be bf16 or fp16");
  for (const ffi::AnyBuffer* x : {&k, &v, &o, &dout})
    if (x->element_type() != dtype) return invalid_bwd("q, k, v, o and dout must share one dtype");
  if (dq->element_type() != dtype || dk->element_type() != dtype || dv->element_type() != dtype)
    return invalid_bwd("dq, dk and dv take q's dtype");
  if (!same_dims(v.dimensions(), kd) || !same_dims(dk->dimensions(), kd) || !same_dims(dv->dimensions(), kd))
    return invalid_bwd("k, v, dk and dv must share one shape");
  if (!same_dims(o.dimensions(), qd) || !same_dims(dout.dimensions(), qd) || !same_dims(dq->dimensions(), qd))
    return invalid_bwd("q, o, dout and dq must share one shape");
  for (size_t i = 0; i + 3 < r; i++)
    if (kd[i] != qd[i]) return invalid_bwd("q and k batch dimensions differ");
  if (kd[r - 1] != qd[r - 1]) return invalid_bwd("q and k head_dim differ");
  for (const auto* x : {&lse, &dlse}) {
    const auto d = x->dimensions();
    if (d.size() != r - 1 || d[r - 3] != qd[r - 2] || d[r - 2] != qd[r - 3])
      return invalid_bwd("lse and dlse must be [..., heads_q, seq_q]");
    for (size_t i = 0; i + 3 < r; i++)
      if (d[i] != qd[i]) return invalid_bwd("lse and dlse batch dimensions differ from q's");
  }
  const int64_t batch = leading_product(qd, 3);
  for (const int64_t n : {batch, qd[r - 3], qd[r - 2], qd[r - 1], kd[r - 3]})
    if (n > INT32_MAX) return invalid_bwd("dimensions too large");
  if (window_left < -1 || window_right < -1 || window_left > INT32_MAX || window_right > INT32_MAX)
    return invalid_bwd("window bounds must be in [-1, 2^31)");

  tk::attention::BackwardParams p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.o = o.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = lse.typed_data();
  p.dlse = dlse.typed_data();
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.workspace = workspace->untyped_data();
  p.batch = int(batch);
  p.seq_q = int(qd[r - 3]);
  p.seq_k = int(kd[r - 3]);
  p.heads_q = int(qd[r - 2]);
  p.heads_kv = int(kd[r - 2]);
  p.head_dim = int(qd[r - 1]);
  p.scale = scale;
  p.window_left = int(window_left);
  p.window_right = int(window_right);
  p.dtype = dtype == ffi::BF16 ? tk::attention::DType::bf16 : tk::attention::DType::fp16;
  const size_t workspace_bytes =
      tk::attention::backward_workspace_bytes(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim);
  if (workspace->size_bytes() != workspace_bytes)
    return invalid_bwd("the workspace must hold attention_backward_workspace_bytes(batch, heads_q, heads_kv, seq_q, "
                       "seq_k, head_dim) = " +
                       std::to_string(workspace_bytes) + " bytes, got " + std::to_string(workspace->size_bytes()));
  if (const std::string why = decode_mask(qd, kd, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, mask_workspace,
                                          has_segment_ids, has_seq_lengths, bottom_right, batch, p.mask);
      !why.empty())
    return invalid_bwd(why);
  if (const char* why = tk::attention::backward_unsupported(p)) return invalid_bwd(why);

  const cudaError_t err = tk::attention::backward(p, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("tk_attention_bwd launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

// kCmdBufferCompatible: XLA may record these calls into a CUDA graph and replay it. Safe: the
// handlers only check shapes, build TMA tensor maps on the host (no stream work) and enqueue
// kernels / cudaMemsetAsync on the given stream; no host sync, no allocation, no host reads of
// device data (the scratch memory of the backward and of the segment ranges is an explicit
// output, a workspace).
// tests/test_command_buffer_gpu.py.
XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_attention_bwd, AttentionBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // q
                                  .Arg<ffi::AnyBuffer>()            // k
                                  .Arg<ffi::AnyBuffer>()            // v
                                  .Arg<ffi::AnyBuffer>()            // o
                                  .Arg<ffi::AnyBuffer>()            // dout
                                  .Arg<ffi::Buffer<ffi::F32>>()     // lse, as the forward returns it
                                  .Arg<ffi::Buffer<ffi::F32>>()     // dlse, the gradient of lse (or zeros)
                                  .Arg<ffi::Buffer<ffi::S32>>()     // q_segment_ids (placeholder without)
                                  .Arg<ffi::Buffer<ffi::S32>>()     // kv_segment_ids
                                  .Arg<ffi::Buffer<ffi::S32>>()     // q_seq_lengths (placeholder without)
                                  .Arg<ffi::Buffer<ffi::S32>>()     // kv_seq_lengths
                                  .Ret<ffi::AnyBuffer>()            // dq
                                  .Ret<ffi::AnyBuffer>()            // dk
                                  .Ret<ffi::AnyBuffer>()            // dv
                                  .Ret<ffi::Buffer<ffi::U8>>()      // workspace
                                  .Ret<ffi::Buffer<ffi::U8>>()      // mask workspace
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<bool>("has_segment_ids")
                                  .Attr<bool>("has_seq_lengths")
                                  .Attr<bool>("bottom_right"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_attention_fwd, AttentionForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_segment_ids (placeholder without)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_segment_ids
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_seq_lengths (placeholder without)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_seq_lengths
                                  .Ret<ffi::AnyBuffer>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Ret<ffi::Buffer<ffi::U8>>()   // mask workspace
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<bool>("has_segment_ids")
                                  .Attr<bool>("has_seq_lengths")
                                  .Attr<bool>("bottom_right"),
                              {ffi::Traits::kCmdBufferCompatible});
