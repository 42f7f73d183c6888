// Small helpers shared by the FFI handlers: buffer shapes and dtype decoding.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace tk::ffi_util {

namespace ffi = xla::ffi;

inline std::string shape_str(const ffi::AnyBuffer& x) {
  std::string s = "[";
  auto dims = x.dimensions();
  for (size_t i = 0; i < dims.size(); i++) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Product of all dimensions before the last `trailing` ones (vmap's broadcast_all batching
// adds leading dimensions; they fold into the batch).
inline int64_t leading_product(ffi::Span<const int64_t> dims, size_t trailing) {
  int64_t n = 1;
  for (size_t i = 0; i + trailing < dims.size(); i++) n *= dims[i];
  return n;
}

}  // namespace tk::ffi_util
