// The KV-cache attention's kernels at head dim 64 (decode_launch.cuh).
#include "decode_launch.cuh"

namespace tk::kvcache {

template cudaError_t decode_head_dim<bf16, 64>(const Params&, cudaStream_t);
template cudaError_t decode_head_dim<half, 64>(const Params&, cudaStream_t);

}  // namespace tk::kvcache
