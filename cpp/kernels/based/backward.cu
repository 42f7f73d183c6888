// Checks and dispatch for the Based backward launcher.
#include "based.h"
#include "dkv_kernel.cuh"
#include "dq_kernel.cuh"

namespace tk::based {

const char* backward_unsupported(const BackwardParams& p) {
  if (!p.q || !p.k || !p.v || !p.dy || !p.inv_den || !p.dden || !p.state0 || !p.z0 || !p.d_state || !p.d_z ||
      !p.dq_parts || !p.dk_parts || !p.dv || !p.d_state0 || !p.d_z0)
    return "a buffer pointer is null";
  if (p.batch < 1 || p.seq < 1 || p.heads < 1) return "batch, sequence length and heads must be >= 1";
  if (!is_value_dim(p.value_dim)) return VALUE_DIM_SENTENCE;
  if (p.batch > MAX_BATCH || p.heads > MAX_HEADS) return GRID_SENTENCE;
  return nullptr;
}

// Two kernels on the stream: the dq sweep (or zeros for dq when not asked for), then the dk/dv
// sweep.
cudaError_t backward(const BackwardParams& p, cudaStream_t stream) {
  if (backward_unsupported(p)) return cudaErrorInvalidValue;
  const bool bf = p.dtype == DType::bf16;
  const size_t dq_bytes = sizeof(float) * size_t(p.batch) * p.seq * p.heads * (p.value_dim / V_BLOCK) * FEATURE_DIM;
  cudaError_t err = !p.with_dq ? cudaMemsetAsync(p.dq_parts, 0, dq_bytes, stream)
                    : bf       ? launch_dq<bf16>(p, stream)
                               : launch_dq<half>(p, stream);
  if (err != cudaSuccess) return err;
  return bf ? launch_dkv<bf16>(p, stream) : launch_dkv<half>(p, stream);
}

}  // namespace tk::based
