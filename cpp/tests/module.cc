// tk_jax._tk_tests: FFI handlers of the test-only kittens kernels (kittens_ops.cu,
// kittens_warpgroup_ops.cu, kittens_fragment_ops.cu).
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* tk_test_roundtrip(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_transpose(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_mma_bf16(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_mma_f16(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_rowops(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_wgmma(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_grouped_rows(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_ring(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_bulk_add(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_fragment_add(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_mailbox(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_layouts(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_broadcasts_bf16(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_broadcasts_f16(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_vectors(XLA_FFI_CallFrame*);
XLA_FFI_Error* tk_test_sums(XLA_FFI_CallFrame*);
}

NB_MODULE(_tk_tests, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["tk_test_roundtrip"] = nb::capsule(reinterpret_cast<void*>(tk_test_roundtrip));
    targets["tk_test_transpose"] = nb::capsule(reinterpret_cast<void*>(tk_test_transpose));
    targets["tk_test_mma_bf16"] = nb::capsule(reinterpret_cast<void*>(tk_test_mma_bf16));
    targets["tk_test_mma_f16"] = nb::capsule(reinterpret_cast<void*>(tk_test_mma_f16));
    targets["tk_test_rowops"] = nb::capsule(reinterpret_cast<void*>(tk_test_rowops));
    targets["tk_test_wgmma"] = nb::capsule(reinterpret_cast<void*>(tk_test_wgmma));
    targets["tk_test_grouped_rows"] = nb::capsule(reinterpret_cast<void*>(tk_test_grouped_rows));
    targets["tk_test_ring"] = nb::capsule(reinterpret_cast<void*>(tk_test_ring));
    targets["tk_test_bulk_add"] = nb::capsule(reinterpret_cast<void*>(tk_test_bulk_add));
    targets["tk_test_fragment_add"] = nb::capsule(reinterpret_cast<void*>(tk_test_fragment_add));
    targets["tk_test_mailbox"] = nb::capsule(reinterpret_cast<void*>(tk_test_mailbox));
    targets["tk_test_layouts"] = nb::capsule(reinterpret_cast<void*>(tk_test_layouts));
    targets["tk_test_broadcasts_bf16"] = nb::capsule(reinterpret_cast<void*>(tk_test_broadcasts_bf16));
    targets["tk_test_broadcasts_f16"] = nb::capsule(reinterpret_cast<void*>(tk_test_broadcasts_f16));
    targets["tk_test_vectors"] = nb::capsule(reinterpret_cast<void*>(tk_test_vectors));
    targets["tk_test_sums"] = nb::capsule(reinterpret_cast<void*>(tk_test_sums));
    return targets;
  });
}
