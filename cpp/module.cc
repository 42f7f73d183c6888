// The one Python extension module, tk_jax._tk: hands XLA the FFI handler capsules, and tells
// Python the kernels' facts it needs to call them (supported head dims, workspace sizes).
#include <nanobind/nanobind.h>

#include <cstdint>

#include "kernels/attention/attention.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" XLA_FFI_Error* tk_attention_fwd(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_attention_bwd(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_based_fwd(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_based_bwd(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_based_decode(XLA_FFI_CallFrame* call_frame);

namespace {
template <typename Fn>
nb::capsule handler_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_tk, m) {
  m.doc() = "tk_jax compiled kernels (XLA FFI handlers for CUDA)";
  m.def("registrations", []() {
    nb::dict targets;
    targets["tk_attention_fwd"] = handler_capsule(tk_attention_fwd);
    targets["tk_attention_bwd"] = handler_capsule(tk_attention_bwd);
    targets["tk_based_fwd"] = handler_capsule(tk_based_fwd);
    targets["tk_based_bwd"] = handler_capsule(tk_based_bwd);
    targets["tk_based_decode"] = handler_capsule(tk_based_decode);
    return targets;
  });
  nb::list head_dims;
  for (int d : tk::attention::HEAD_DIMS) head_dims.append(d);
  m.attr("attention_head_dims") = nb::steal<nb::tuple>(PySequence_Tuple(head_dims.ptr()));
  m.def("attention_backward_workspace_bytes", &tk::attention::backward_workspace_bytes, nb::arg("batch"),
        nb::arg("heads_q"), nb::arg("seq_q"), nb::arg("head_dim"),
        "Bytes of the workspace output of tk_attention_bwd (linear in batch).");
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("cuda_archs") = "sm_90a";
}
