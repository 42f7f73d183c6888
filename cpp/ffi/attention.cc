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

ffi::Error AttentionForward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale,
                            int64_t window_left, int64_t window_right, int64_t variant) {
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
  if (variant != 0 && variant != 1) return invalid("variant must be 0 (wgmma) or 1 (mma.sync)");
  p.version = variant == 0 ? tk::attention::ForwardVersion::wgmma : tk::attention::ForwardVersion::mma_sync;
  if (const char* why = tk::attention::forward_unsupported(p)) return invalid(why);

  const cudaError_t err = tk::attention::forward(p, stream);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("tk_attention_fwd launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(tk_attention_fwd, AttentionForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Ret<ffi::AnyBuffer>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<int64_t>("variant"),  // 0: TMA + wgmma, 1: mma.sync
                              {xla::ffi::Traits::kCmdBufferCompatible});
