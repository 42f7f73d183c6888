// The one Python extension module, tk_jax._tk: hands XLA the FFI handler capsules, and tells
// Python the kernels' facts it needs to call them (supported shapes, workspace sizes, the Based
// conventions, the KV-cache kernel's splits) and the device facts it plans launches with.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/attention/attention.h"
#include "kernels/based/based.h"
#include "kernels/kvcache/kvcache.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" XLA_FFI_Error* tk_attention_fwd(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_attention_bwd(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_attention_bwd_row_stats(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_attention_bwd_keys(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_attention_bwd_dq(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_based_fwd(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_based_bwd(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_based_decode(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* tk_attention_kvcache(XLA_FFI_CallFrame* call_frame);

namespace {
template <typename Fn>
nb::capsule handler_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// The Based kernels' conventions (cpp/kernels/based/based.h) that Python needs to shape their
// calls: the inputs they take, the dq/dk partial sums per column block, the sequence chunk.
nb::dict based_conventions() {
  namespace based = tk::based;
  nb::dict c;
  c["feature_dim"] = based::FEATURE_DIM;
  c["num_features"] = based::NUM_FEATURES;
  c["chunk"] = based::CHUNK;
  c["column_block"] = based::V_BLOCK;
  nb::list value_dims;
  for (int d : based::VALUE_DIMS) value_dims.append(d);
  c["value_dims"] = nb::tuple(value_dims);
  c["max_batch"] = based::MAX_BATCH;
  c["max_heads"] = based::MAX_HEADS;
  return c;
}

// Multiprocessors of CUDA device `ordinal`, from the runtime (Python sizes the Based sequence
// split by it).
int multiprocessor_count(int ordinal) {
  int count = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, ordinal);
  if (err != cudaSuccess)
    throw std::runtime_error("multiprocessor_count(" + std::to_string(ordinal) + "): " + cudaGetErrorString(err));
  return count;
}
}  // namespace

NB_MODULE(_tk, m) {
  m.doc() = "tk_jax compiled kernels (XLA FFI handlers for CUDA)";
  m.def("registrations", []() {
    nb::dict targets;
    targets["tk_attention_fwd"] = handler_capsule(tk_attention_fwd);
    targets["tk_attention_bwd"] = handler_capsule(tk_attention_bwd);
    targets["tk_attention_bwd_row_stats"] = handler_capsule(tk_attention_bwd_row_stats);
    targets["tk_attention_bwd_keys"] = handler_capsule(tk_attention_bwd_keys);
    targets["tk_attention_bwd_dq"] = handler_capsule(tk_attention_bwd_dq);
    targets["tk_based_fwd"] = handler_capsule(tk_based_fwd);
    targets["tk_based_bwd"] = handler_capsule(tk_based_bwd);
    targets["tk_based_decode"] = handler_capsule(tk_based_decode);
    targets["tk_attention_kvcache"] = handler_capsule(tk_attention_kvcache);
    return targets;
  });
  nb::list head_dims;
  for (int d : tk::attention::HEAD_DIMS) head_dims.append(d);
  m.attr("attention_head_dims") = nb::tuple(head_dims);
  m.def("attention_backward_dq_state_bytes", &tk::attention::backward_dq_state_bytes, nb::arg("batch"),
        nb::arg("heads_q"), nb::arg("dq_rows"), nb::arg("head_dim"),
        "Bytes of the dQ state of the attention backward (its workspace output; linear in batch).");
  m.def("attention_backward_key_workspace_bytes", &tk::attention::backward_key_workspace_bytes, nb::arg("batch"),
        nb::arg("heads_q"), nb::arg("heads_kv"), nb::arg("seq_k"), nb::arg("head_dim"),
        "Bytes of the key workspace output of tk_attention_bwd and tk_attention_bwd_keys (linear in batch).");
  m.def("attention_mask_workspace_bytes", &tk::attention::mask_workspace_bytes, nb::arg("batch"), nb::arg("seq_q"),
        nb::arg("seq_k"), nb::arg("segment_ids"),
        "Bytes of the mask workspace output of tk_attention_fwd and tk_attention_bwd (linear in batch).");
  nb::list kvcache_head_dims, kvcache_page_sizes;
  for (int d : tk::kvcache::HEAD_DIMS) kvcache_head_dims.append(d);
  for (int s : tk::kvcache::PAGE_SIZES) kvcache_page_sizes.append(s);
  m.attr("kvcache_head_dims") = nb::tuple(kvcache_head_dims);
  m.attr("kvcache_page_sizes") = nb::tuple(kvcache_page_sizes);
  m.attr("kvcache_max_splits") = tk::kvcache::MAX_SPLITS;
  m.def("kvcache_num_splits", &tk::kvcache::num_splits, nb::arg("batch"), nb::arg("heads_q"), nb::arg("heads_kv"),
        nb::arg("seq_q"), nb::arg("head_dim"), nb::arg("capacity"), nb::arg("page_size"), nb::arg("multiprocessors"),
        nb::arg("requested"),
        "Key splits of tk_attention_kvcache: `requested` (> 0) capped at what the cache allows, or for 0 the "
        "kernel's own choice for this many multiprocessors.");
  m.def("kvcache_workspace_bytes", &tk::kvcache::workspace_bytes, nb::arg("batch"), nb::arg("heads_q"),
        nb::arg("seq_q"), nb::arg("head_dim"), nb::arg("num_splits"),
        "Bytes of the workspace output of tk_attention_kvcache (linear in batch; 0 for one split).");
  m.def("based_conventions", &based_conventions);
  m.def("multiprocessor_count", &multiprocessor_count, nb::arg("device_ordinal"));
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("cuda_archs") = "sm_90a";
}
