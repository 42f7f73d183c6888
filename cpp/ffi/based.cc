// XLA FFI handlers for Based linear attention (forward, backward, decode step): decode the
// buffers, check them, call the launchers.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "../kernels/based/based.h"
#include "ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using tk::ffi_util::leading_product;
using tk::ffi_util::shape_str;

namespace {

ffi::Error invalid(const std::string& msg) { return ffi::Error::InvalidArgument("tk_based_fwd: " + msg); }
ffi::Error invalid_bwd(const std::string& msg) { return ffi::Error::InvalidArgument("tk_based_bwd: " + msg); }

// dims == the first `num_lead` dims of q (the folded batch) followed by `tail`.
bool has_shape(ffi::Span<const int64_t> dims, ffi::Span<const int64_t> q_dims, size_t num_lead,
               std::initializer_list<int64_t> tail) {
  if (dims.size() != num_lead + tail.size()) return false;
  for (size_t i = 0; i < num_lead; i++)
    if (dims[i] != q_dims[i]) return false;
  size_t i = num_lead;
  for (int64_t t : tail)
    if (dims[i++] != t) return false;
  return true;
}

// Inputs q, k [..., T, H, 16], v [..., T, H, Dv], S0 [..., H, 273, Dv] f32, z0 [..., H, 273] f32
// (leading dims, e.g. from vmap, fold into the batch); outputs y like v, S like S0, z like z0,
// den [..., H, T] f32 (the normaliser without eps, a residual of the backward).
ffi::Error BasedForward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Buffer<ffi::F32> state0, ffi::Buffer<ffi::F32> z0, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::Buffer<ffi::F32>> state, ffi::Result<ffi::Buffer<ffi::F32>> z,
                        ffi::Result<ffi::Buffer<ffi::F32>> den, int64_t normalize, float eps) {
  using tk::based::FEATURE_DIM;
  using tk::based::NUM_FEATURES;
  const auto qd = q.dimensions(), vd = v.dimensions();
  if (qd.size() < 4) return invalid("q must have rank >= 4 ([..., T, H, 16]), got " + shape_str(q));
  const size_t r = qd.size();
  const size_t lead = r - 3;  // leading dims, folded into the batch
  const int64_t seq = qd[r - 3], heads = qd[r - 2];
  if (qd[r - 1] != FEATURE_DIM) return invalid("q must have feature dim 16, got " + shape_str(q));
  if (!has_shape(k.dimensions(), qd, lead, {seq, heads, FEATURE_DIM}))
    return invalid("k must have q's shape, got q " + shape_str(q) + ", k " + shape_str(k));
  if (vd.size() != r || !has_shape(vd, qd, lead, {seq, heads, vd[r - 1]}))
    return invalid("v must be [..., T, H, Dv] with q's [..., T, H], got q " + shape_str(q) + ", v " + shape_str(v));
  const int64_t value_dim = vd[r - 1];

  const auto dtype = q.element_type();
  if (dtype != ffi::BF16 && dtype != ffi::F16) return invalid("q must be bf16 or fp16");
  if (k.element_type() != dtype || v.element_type() != dtype || y->element_type() != dtype)
    return invalid("q, k, v and y must share one dtype");
  if (!has_shape(y->dimensions(), qd, lead, {seq, heads, value_dim})) return invalid("y must have v's shape");
  if (!has_shape(state0.dimensions(), qd, lead, {heads, NUM_FEATURES, value_dim}) ||
      !has_shape(state->dimensions(), qd, lead, {heads, NUM_FEATURES, value_dim}))
    return invalid("S0 and S must be [..., H, 273, Dv] with the leading dims of q");
  if (!has_shape(z0.dimensions(), qd, lead, {heads, NUM_FEATURES}) ||
      !has_shape(z->dimensions(), qd, lead, {heads, NUM_FEATURES}))
    return invalid("z0 and z must be [..., H, 273] with the leading dims of q");
  if (!has_shape(den->dimensions(), qd, lead, {heads, seq})) return invalid("den must be [..., H, T]");

  const int64_t batch = leading_product(qd, 3);
  if (batch > INT32_MAX || seq > INT32_MAX || heads > INT32_MAX || value_dim > INT32_MAX)
    return invalid("dimensions too large");
  if (normalize != 0 && normalize != 1) return invalid("normalize must be 0 or 1, got " + std::to_string(normalize));
  if (!(std::isfinite(eps) && eps >= 0.f)) return invalid("eps must be finite and >= 0");

  tk::based::ForwardParams p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.state0 = state0.typed_data();
  p.z0 = z0.typed_data();
  p.y = y->untyped_data();
  p.state = state->typed_data();
  p.z = z->typed_data();
  p.den = den->typed_data();
  p.batch = int(batch);
  p.seq = int(seq);
  p.heads = int(heads);
  p.value_dim = int(value_dim);
  p.normalize = normalize == 1;
  p.eps = eps;
  p.dtype = dtype == ffi::BF16 ? tk::based::DType::bf16 : tk::based::DType::fp16;
  if (const char* why = tk::based::forward_unsupported(p)) return invalid(why);

  const cudaError_t err = tk::based::forward(p, stream);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("tk_based_fwd launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Inputs q, k [..., T, H, 16], v and dy [..., T, H, Dv], inv_den and dden [..., H, T] f32, S0 and
// dS [..., H, 273, Dv] f32, z0 and dz [..., H, 273] f32; outputs the partial sums dq_parts and
// dk_parts [..., T, H, Dv / 64, 16] f32, dv like v, dS0 like S0, dz0 like z0. Attribute
// with_dq = 0 skips the dq sweep (dq_parts come back zero).
ffi::Error BasedBackward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dy,
                         ffi::Buffer<ffi::F32> inv_den, ffi::Buffer<ffi::F32> dden, ffi::Buffer<ffi::F32> state0,
                         ffi::Buffer<ffi::F32> z0, ffi::Buffer<ffi::F32> d_state, ffi::Buffer<ffi::F32> d_z,
                         ffi::Result<ffi::Buffer<ffi::F32>> dq_parts, ffi::Result<ffi::Buffer<ffi::F32>> dk_parts,
                         ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> d_state0,
                         ffi::Result<ffi::Buffer<ffi::F32>> d_z0, int64_t with_dq) {
  using tk::based::FEATURE_DIM;
  using tk::based::NUM_FEATURES;
  const auto qd = q.dimensions(), vd = v.dimensions();
  if (qd.size() < 4) return invalid_bwd("q must have rank >= 4 ([..., T, H, 16]), got " + shape_str(q));
  const size_t r = qd.size(), lead = r - 3;
  const int64_t seq = qd[r - 3], heads = qd[r - 2];
  if (qd[r - 1] != FEATURE_DIM) return invalid_bwd("q must have feature dim 16, got " + shape_str(q));
  if (!has_shape(k.dimensions(), qd, lead, {seq, heads, FEATURE_DIM})) return invalid_bwd("k must have q's shape");
  if (vd.size() != r || !has_shape(vd, qd, lead, {seq, heads, vd[r - 1]}))
    return invalid_bwd("v must be [..., T, H, Dv] with q's [..., T, H], got " + shape_str(v));
  const int64_t value_dim = vd[r - 1];
  if (!tk::based::is_value_dim(value_dim)) return invalid_bwd(tk::based::VALUE_DIM_SENTENCE);
  const auto dtype = q.element_type();
  if (dtype != ffi::BF16 && dtype != ffi::F16) return invalid_bwd("q must be bf16 or fp16");
  if (k.element_type() != dtype || v.element_type() != dtype || dy.element_type() != dtype ||
      dv->element_type() != dtype)
    return invalid_bwd("q, k, v, dy and dv must share one dtype");
  if (!has_shape(dy.dimensions(), qd, lead, {seq, heads, value_dim}) ||
      !has_shape(dv->dimensions(), qd, lead, {seq, heads, value_dim}))
    return invalid_bwd("dy and dv must have v's shape");
  if (!has_shape(inv_den.dimensions(), qd, lead, {heads, seq}) || !has_shape(dden.dimensions(), qd, lead, {heads, seq}))
    return invalid_bwd("inv_den and dden must be [..., H, T]");
  for (auto dims : {state0.dimensions(), d_state.dimensions(), d_state0->dimensions()})
    if (!has_shape(dims, qd, lead, {heads, NUM_FEATURES, value_dim}))
      return invalid_bwd("S0, dS and dS0 must be [..., H, 273, Dv]");
  for (auto dims : {z0.dimensions(), d_z.dimensions(), d_z0->dimensions()})
    if (!has_shape(dims, qd, lead, {heads, NUM_FEATURES})) return invalid_bwd("z0, dz and dz0 must be [..., H, 273]");
  const int64_t column_blocks = value_dim / tk::based::V_BLOCK;
  if (!has_shape(dq_parts->dimensions(), qd, lead, {seq, heads, column_blocks, FEATURE_DIM}) ||
      !has_shape(dk_parts->dimensions(), qd, lead, {seq, heads, column_blocks, FEATURE_DIM}))
    return invalid_bwd("dq_parts and dk_parts must be [..., T, H, Dv / 64, 16]");
  const int64_t batch = leading_product(qd, 3);
  if (batch > INT32_MAX || seq > INT32_MAX || heads > INT32_MAX) return invalid_bwd("dimensions too large");

  tk::based::BackwardParams p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.dy = dy.untyped_data();
  p.inv_den = inv_den.typed_data();
  p.dden = dden.typed_data();
  p.state0 = state0.typed_data();
  p.z0 = z0.typed_data();
  p.d_state = d_state.typed_data();
  p.d_z = d_z.typed_data();
  p.dq_parts = dq_parts->typed_data();
  p.dk_parts = dk_parts->typed_data();
  p.dv = dv->untyped_data();
  p.d_state0 = d_state0->typed_data();
  p.d_z0 = d_z0->typed_data();
  p.batch = int(batch);
  p.seq = int(seq);
  p.heads = int(heads);
  p.value_dim = int(value_dim);
  p.with_dq = with_dq != 0;
  p.dtype = dtype == ffi::BF16 ? tk::based::DType::bf16 : tk::based::DType::fp16;
  if (const char* why = tk::based::backward_unsupported(p)) return invalid_bwd(why);

  const cudaError_t err = tk::based::backward(p, stream);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("tk_based_bwd launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Inputs q_t, k_t [..., 16], v_t [..., Dv], S [..., 273, Dv] f32, z [..., 273] f32 (all leading
// dims, e.g. batch and heads, are independent rows); outputs y like v_t, S' like S, z' like z
// (S' and z' may alias S and z: each element is read before it is written, by one thread).
ffi::Error BasedDecode(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::F32> state, ffi::Buffer<ffi::F32> z, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::Buffer<ffi::F32>> state_out, ffi::Result<ffi::Buffer<ffi::F32>> z_out,
                       int64_t normalize, float eps) {
  using tk::based::FEATURE_DIM;
  using tk::based::NUM_FEATURES;
  auto invalid = [](const std::string& msg) { return ffi::Error::InvalidArgument("tk_based_decode: " + msg); };
  const auto qd = q.dimensions(), vd = v.dimensions();
  if (qd.size() < 1 || qd[qd.size() - 1] != FEATURE_DIM) return invalid("q_t must be [..., 16], got " + shape_str(q));
  const size_t lead = qd.size() - 1;
  if (!has_shape(k.dimensions(), qd, lead, {FEATURE_DIM})) return invalid("k_t must have q_t's shape");
  if (vd.size() != qd.size() || !has_shape(vd, qd, lead, {vd[vd.size() - 1]}))
    return invalid("v_t must be [..., Dv] with q_t's leading dims, got " + shape_str(v));
  const int64_t value_dim = vd[vd.size() - 1];
  const auto dtype = q.element_type();
  if (dtype != ffi::BF16 && dtype != ffi::F16) return invalid("q_t must be bf16 or fp16");
  if (k.element_type() != dtype || v.element_type() != dtype || y->element_type() != dtype)
    return invalid("q_t, k_t, v_t and y must share one dtype");
  if (!has_shape(y->dimensions(), qd, lead, {value_dim})) return invalid("y must have v_t's shape");
  if (!has_shape(state.dimensions(), qd, lead, {NUM_FEATURES, value_dim}) ||
      !has_shape(state_out->dimensions(), qd, lead, {NUM_FEATURES, value_dim}))
    return invalid("S and S' must be [..., 273, Dv] with the leading dims of q_t");
  if (!has_shape(z.dimensions(), qd, lead, {NUM_FEATURES}) || !has_shape(z_out->dimensions(), qd, lead, {NUM_FEATURES}))
    return invalid("z and z' must be [..., 273] with the leading dims of q_t");
  if (normalize != 0 && normalize != 1) return invalid("normalize must be 0 or 1, got " + std::to_string(normalize));

  tk::based::DecodeParams p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.state = state.typed_data();
  p.z = z.typed_data();
  p.y = y->untyped_data();
  p.state_out = state_out->typed_data();
  p.z_out = z_out->typed_data();
  p.rows = leading_product(qd, 1);
  p.value_dim = int(value_dim);
  p.normalize = normalize == 1;
  p.eps = eps;
  p.dtype = dtype == ffi::BF16 ? tk::based::DType::bf16 : tk::based::DType::fp16;
  if (const char* why = tk::based::decode_unsupported(p)) return invalid(why);
  const cudaError_t err = tk::based::decode(p, stream);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("tk_based_decode launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

// kCmdBufferCompatible: XLA may record these calls into a CUDA graph and replay it. Safe: the
// handlers only check shapes and enqueue kernels / cudaMemsetAsync on the given stream; no host
// sync, no allocation, no host reads of device data (the dq/dk partial sums are explicit
// outputs). tests/test_command_buffer_gpu.py.
XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_based_fwd, BasedForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k
                                  .Arg<ffi::AnyBuffer>()          // v
                                  .Arg<ffi::Buffer<ffi::F32>>()   // S0
                                  .Arg<ffi::Buffer<ffi::F32>>()   // z0
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Ret<ffi::Buffer<ffi::F32>>()   // S
                                  .Ret<ffi::Buffer<ffi::F32>>()   // z
                                  .Ret<ffi::Buffer<ffi::F32>>()   // den
                                  .Attr<int64_t>("normalize")     // 0 or 1
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_based_bwd, BasedBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k
                                  .Arg<ffi::AnyBuffer>()          // v
                                  .Arg<ffi::AnyBuffer>()          // dy
                                  .Arg<ffi::Buffer<ffi::F32>>()   // inv_den
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dden
                                  .Arg<ffi::Buffer<ffi::F32>>()   // S0
                                  .Arg<ffi::Buffer<ffi::F32>>()   // z0
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dS
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dz
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dq_parts
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dk_parts
                                  .Ret<ffi::AnyBuffer>()          // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dS0
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dz0
                                  .Attr<int64_t>("with_dq"),      // 0: skip the dq sweep, dq_parts = 0
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_based_decode, BasedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // q_t
                                  .Arg<ffi::AnyBuffer>()          // k_t
                                  .Arg<ffi::AnyBuffer>()          // v_t
                                  .Arg<ffi::Buffer<ffi::F32>>()   // S
                                  .Arg<ffi::Buffer<ffi::F32>>()   // z
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Ret<ffi::Buffer<ffi::F32>>()   // S'
                                  .Ret<ffi::Buffer<ffi::F32>>()   // z'
                                  .Attr<int64_t>("normalize")     // 0 or 1
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});
