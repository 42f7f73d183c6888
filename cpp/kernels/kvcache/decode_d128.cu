// The KV-cache attention's kernels at head dim 128 (decode_launch.cuh).
#include "decode_launch.cuh"

namespace tk::kvcache {

template cudaError_t decode_head_dim<bf16, 128>(const Params&, cudaStream_t);
template cudaError_t decode_head_dim<half, 128>(const Params&, cudaStream_t);

}  // namespace tk::kvcache
