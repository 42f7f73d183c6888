// XLA FFI handlers for flash attention: decode the buffers, check them, call one launcher.
#include <cuda_runtime.h>

#include <string>
#include <vector>

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

ffi::Error invalid_bwd(const char* target, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + msg);
}

tk::attention::DType dtype_of(ffi::DataType t) {
  return t == ffi::BF16 ? tk::attention::DType::bf16 : tk::attention::DType::fp16;
}

// The checks every backward pass shares: rows [..., seq_q, heads_q, head_dim] (q, o, dout or dq)
// and, where given, their lse and dlse [..., heads_q, seq_q]. Fills batch, seq_q, heads_q,
// head_dim, dtype. Returns an empty string, or what is wrong.
std::string decode_rows(const std::vector<const ffi::AnyBuffer*>& rows, const std::vector<ffi::Buffer<ffi::F32>*>& stats,
                        tk::attention::BackwardParams& p) {
  const auto qd = rows[0]->dimensions();
  if (qd.size() < 4) return "the query-side arrays must have rank >= 4, got " + shape_str(*rows[0]);
  const size_t r = qd.size();
  const auto dtype = rows[0]->element_type();
  if (dtype != ffi::BF16 && dtype != ffi::F16) return "the query-side arrays must be bf16 or fp16";
  for (const ffi::AnyBuffer* x : rows) {
    if (x->element_type() != dtype) return "q, k, v, o, dout and dq must share one dtype";
    if (!same_dims(x->dimensions(), qd)) return "q, o, dout and dq must share one shape";
  }
  for (const auto* x : stats) {
    const auto d = x->dimensions();
    if (d.size() != r - 1 || d[r - 3] != qd[r - 2] || d[r - 2] != qd[r - 3] || !same_dims(leading(d, r - 3), leading(qd, r - 3)))
      return "lse and dlse must be [..., heads_q, seq_q] with q's batch dimensions";
  }
  const int64_t batch = leading_product(qd, 3);
  for (const int64_t n : {batch, qd[r - 3], qd[r - 2], qd[r - 1]})
    if (n > INT32_MAX) return "dimensions too large";
  p.batch = int(batch);
  p.seq_q = int(qd[r - 3]);
  p.heads_q = int(qd[r - 2]);
  p.head_dim = int(qd[r - 1]);
  p.dtype = dtype_of(dtype);
  return "";
}

// The keys' checks of the KEYS pass: k, v [..., seq_k, heads_kv, head_dim] like q's batch, dk
// and dv of their shape and dtype. Fills seq_k, heads_kv.
std::string decode_keys(ffi::Span<const int64_t> qd, ffi::DataType dtype, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        const ffi::AnyBuffer& dk, const ffi::AnyBuffer& dv, tk::attention::BackwardParams& p) {
  const auto kd = k.dimensions();
  const size_t r = qd.size();
  if (kd.size() != r) return "q and k must have the same rank";
  for (const ffi::AnyBuffer* x : std::initializer_list<const ffi::AnyBuffer*>{&k, &v, &dk, &dv})
    if (x->element_type() != dtype) return "q, k, v, dk and dv must share one dtype";
  if (!same_dims(v.dimensions(), kd) || !same_dims(dk.dimensions(), kd) || !same_dims(dv.dimensions(), kd))
    return "k, v, dk and dv must share one shape";
  if (!same_dims(leading(kd, r - 3), leading(qd, r - 3))) return "q and k batch dimensions differ";
  if (kd[r - 1] != qd[r - 1]) return "q and k head_dim differ";
  if (kd[r - 3] > INT32_MAX) return "dimensions too large";
  p.seq_k = int(kd[r - 3]);
  p.heads_kv = int(kd[r - 2]);
  return "";
}

std::string check_window(int64_t window_left, int64_t window_right, tk::attention::BackwardParams& p) {
  if (window_left < -1 || window_right < -1 || window_left > INT32_MAX || window_right > INT32_MAX)
    return "window bounds must be in [-1, 2^31)";
  p.window_left = int(window_left);
  p.window_right = int(window_right);
  return "";
}

// A workspace buffer must have exactly the size the launcher's function gives.
std::string check_size(size_t actual, size_t bytes, const char* what) {
  if (actual == bytes) return "";
  return std::string("the ") + what + " must hold " + std::to_string(bytes) + " bytes, got " + std::to_string(actual);
}

ffi::Error launch_bwd(const char* target, const tk::attention::BackwardParams& p, cudaStream_t stream,
                      unsigned passes) {
  if (const char* why = tk::attention::backward_unsupported(p, passes)) return invalid_bwd(target, why);
  const cudaError_t err = tk::attention::backward(p, stream, passes);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string(target) + " launch: " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// What the KEYS pass reads and writes beyond the query rows (decode_rows first): k, v, dk, dv,
// the window, the key workspace and the masks, checked and set in p with q, dout and the scale.
std::string decode_keys_pass(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dout,
                             ffi::Buffer<ffi::S32> q_segment_ids, ffi::Buffer<ffi::S32> kv_segment_ids,
                             ffi::Buffer<ffi::S32> q_lengths, ffi::Buffer<ffi::S32> kv_lengths,
                             ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv,
                             ffi::Result<ffi::Buffer<ffi::U8>>& key_workspace,
                             ffi::Result<ffi::Buffer<ffi::U8>>& mask_workspace, float scale, int64_t window_left,
                             int64_t window_right, bool has_segment_ids, bool has_seq_lengths, bool bottom_right,
                             tk::attention::BackwardParams& p) {
  std::string why = decode_keys(q.dimensions(), q.element_type(), k, v, *dk, *dv, p);
  if (why.empty()) why = check_window(window_left, window_right, p);
  if (why.empty())
    why = check_size(key_workspace->size_bytes(),
                     tk::attention::backward_key_workspace_bytes(p.batch, p.heads_q, p.heads_kv, p.seq_k, p.head_dim),
                     "key workspace (attention_backward_key_workspace_bytes(batch, heads_q, heads_kv, seq_k, "
                     "head_dim))");
  if (why.empty())
    why = decode_mask(q.dimensions(), k.dimensions(), q_segment_ids, kv_segment_ids, q_lengths, kv_lengths,
                      mask_workspace, has_segment_ids, has_seq_lengths, bottom_right, p.batch, p.mask);
  if (!why.empty()) return why;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.dout = dout.untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.key_workspace = key_workspace->size_bytes() ? key_workspace->untyped_data() : nullptr;
  p.scale = scale;
  return "";
}

// The whole backward of one call.
ffi::Error AttentionBackward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::AnyBuffer o, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse,
                             ffi::Buffer<ffi::F32> dlse, ffi::Buffer<ffi::S32> q_segment_ids,
                             ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::S32> q_lengths,
                             ffi::Buffer<ffi::S32> kv_lengths, ffi::Result<ffi::AnyBuffer> dq,
                             ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                             ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                             ffi::Result<ffi::Buffer<ffi::U8>> key_workspace,
                             ffi::Result<ffi::Buffer<ffi::U8>> mask_workspace, float scale, int64_t window_left,
                             int64_t window_right, bool has_segment_ids, bool has_seq_lengths, bool bottom_right) {
  constexpr const char* target = "tk_attention_bwd";
  tk::attention::BackwardParams p{};
  std::string why = decode_rows({&q, &o, &dout, &*dq}, {&lse, &dlse}, p);
  if (why.empty())
    why = check_size(workspace->size_bytes(), tk::attention::backward_dq_state_bytes(p.batch, p.heads_q, p.seq_q, p.head_dim),
                     "workspace (attention_backward_dq_state_bytes(batch, heads_q, seq_q, head_dim))");
  if (why.empty())
    why = decode_keys_pass(q, k, v, dout, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, dk, dv, key_workspace,
                           mask_workspace, scale, window_left, window_right, has_segment_ids, has_seq_lengths,
                           bottom_right, p);
  if (!why.empty()) return invalid_bwd(target, why);
  p.o = o.untyped_data();
  p.lse = lse.typed_data();
  p.dlse = dlse.typed_data();
  p.dq = dq->untyped_data();
  p.workspace = workspace->untyped_data();
  return launch_bwd(target, p, stream, tk::attention::ALL_PASSES);
}

// The backward in three calls, for a caller that sums dQ over several calls with different keys
// (context parallelism): the row statistics once, the kernel per call, dq once; the dQ state
// passes from one to the next (the kernel call's state is an input aliased to its output).

ffi::Error AttentionBackwardRowStats(cudaStream_t stream, ffi::AnyBuffer o, ffi::AnyBuffer dout,
                                     ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dlse,
                                     ffi::Result<ffi::Buffer<ffi::U8>> state, float scale) {
  constexpr const char* target = "tk_attention_bwd_row_stats";
  tk::attention::BackwardParams p{};
  std::string why = decode_rows({&o, &dout}, {&lse, &dlse}, p);
  if (why.empty())
    why = check_size(state->size_bytes(), tk::attention::backward_dq_state_bytes(p.batch, p.heads_q, p.seq_q, p.head_dim),
                     "dQ state (attention_backward_dq_state_bytes(batch, heads_q, seq_q, head_dim))");
  if (!why.empty()) return invalid_bwd(target, why);
  p.o = o.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = lse.typed_data();
  p.dlse = dlse.typed_data();
  p.workspace = state->untyped_data();
  p.scale = scale;
  return launch_bwd(target, p, stream, tk::attention::ROW_STATS);
}

ffi::Error AttentionBackwardKeys(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                 ffi::AnyBuffer dout, ffi::Buffer<ffi::S32> q_segment_ids,
                                 ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::S32> q_lengths,
                                 ffi::Buffer<ffi::S32> kv_lengths, ffi::Buffer<ffi::U8> state_in,
                                 ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                 ffi::Result<ffi::Buffer<ffi::U8>> state,
                                 ffi::Result<ffi::Buffer<ffi::U8>> key_workspace,
                                 ffi::Result<ffi::Buffer<ffi::U8>> mask_workspace, float scale, int64_t window_left,
                                 int64_t window_right, bool has_segment_ids, bool has_seq_lengths, bool bottom_right,
                                 int64_t dq_rows, int64_t dq_row_shift) {
  constexpr const char* target = "tk_attention_bwd_keys";
  tk::attention::BackwardParams p{};
  std::string why = decode_rows({&q, &dout}, {}, p);
  if (why.empty() && (dq_rows < 1 || dq_rows > INT32_MAX || dq_row_shift < 0 || dq_row_shift >= dq_rows))
    why = "dq_rows must be in [1, 2^31) and dq_row_shift in [0, dq_rows)";
  if (why.empty()) {
    p.dq_rows = int(dq_rows);
    p.dq_row_shift = int(dq_row_shift);
    why = check_size(state->size_bytes(), tk::attention::backward_dq_state_bytes(p.batch, p.heads_q, dq_rows, p.head_dim),
                     "dQ state (attention_backward_dq_state_bytes(batch, heads_q, dq_rows, head_dim))");
  }
  if (why.empty() && (state_in.size_bytes() != state->size_bytes() || state_in.untyped_data() != state->untyped_data()))
    why = "the dQ state must be passed in and aliased to the dQ state out";
  if (why.empty())
    why = decode_keys_pass(q, k, v, dout, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, dk, dv, key_workspace,
                           mask_workspace, scale, window_left, window_right, has_segment_ids, has_seq_lengths,
                           bottom_right, p);
  if (!why.empty()) return invalid_bwd(target, why);
  p.workspace = state->untyped_data();
  return launch_bwd(target, p, stream, tk::attention::KEYS);
}

ffi::Error AttentionBackwardDq(cudaStream_t stream, ffi::Buffer<ffi::U8> state, ffi::Result<ffi::AnyBuffer> dq) {
  constexpr const char* target = "tk_attention_bwd_dq";
  tk::attention::BackwardParams p{};
  std::string why = decode_rows({&*dq}, {}, p);
  if (why.empty() &&
      state.size_bytes() != tk::attention::backward_dq_state_bytes(p.batch, p.heads_q, p.seq_q, p.head_dim))
    why = "the dQ state must hold attention_backward_dq_state_bytes(batch, heads_q, seq_q, head_dim) = " +
          std::to_string(tk::attention::backward_dq_state_bytes(p.batch, p.heads_q, p.seq_q, p.head_dim)) +
          " bytes for dq " + shape_str(*dq) + ", got " + std::to_string(state.size_bytes());
  if (!why.empty()) return invalid_bwd(target, why);
  p.dq = dq->untyped_data();
  p.workspace = state.untyped_data();
  return launch_bwd(target, p, stream, tk::attention::DQ_OUT);
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
                                  .Ret<ffi::Buffer<ffi::U8>>()      // workspace: the dQ state
                                  .Ret<ffi::Buffer<ffi::U8>>()      // key workspace
                                  .Ret<ffi::Buffer<ffi::U8>>()      // mask workspace
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<bool>("has_segment_ids")
                                  .Attr<bool>("has_seq_lengths")
                                  .Attr<bool>("bottom_right"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_attention_bwd_row_stats, AttentionBackwardRowStats,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // o
                                  .Arg<ffi::AnyBuffer>()            // dout
                                  .Arg<ffi::Buffer<ffi::F32>>()     // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()     // dlse (or zeros)
                                  .Ret<ffi::Buffer<ffi::U8>>()      // the dQ state
                                  .Attr<float>("scale"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_attention_bwd_keys, AttentionBackwardKeys,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // q (this call's rows)
                                  .Arg<ffi::AnyBuffer>()            // k
                                  .Arg<ffi::AnyBuffer>()            // v
                                  .Arg<ffi::AnyBuffer>()            // dout (this call's rows)
                                  .Arg<ffi::Buffer<ffi::S32>>()     // q_segment_ids (placeholder without)
                                  .Arg<ffi::Buffer<ffi::S32>>()     // kv_segment_ids
                                  .Arg<ffi::Buffer<ffi::S32>>()     // q_seq_lengths (placeholder without)
                                  .Arg<ffi::Buffer<ffi::S32>>()     // kv_seq_lengths
                                  .Arg<ffi::Buffer<ffi::U8>>()      // the dQ state, aliased to the one out
                                  .Ret<ffi::AnyBuffer>()            // dk
                                  .Ret<ffi::AnyBuffer>()            // dv
                                  .Ret<ffi::Buffer<ffi::U8>>()      // the dQ state, this call's dQ added
                                  .Ret<ffi::Buffer<ffi::U8>>()      // key workspace
                                  .Ret<ffi::Buffer<ffi::U8>>()      // mask workspace
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<bool>("has_segment_ids")
                                  .Attr<bool>("has_seq_lengths")
                                  .Attr<bool>("bottom_right")
                                  .Attr<int64_t>("dq_rows")
                                  .Attr<int64_t>("dq_row_shift"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_attention_bwd_dq, AttentionBackwardDq,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()      // the dQ state
                                  .Ret<ffi::AnyBuffer>(),           // dq
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
