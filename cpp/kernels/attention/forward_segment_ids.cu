// The attention forward with segment ids: the segment-range prologue, then the kernels that
// skip the key tiles sharing no segment with an item's queries (forward_kernel.cuh, SEG).
#include "attention.h"
#include "forward_kernel.cuh"
#include "segment_ranges.cuh"

namespace tk::attention {

cudaError_t forward_with_segment_ids(const ForwardParams& p, cudaStream_t stream) {
  const bool query_tiles = true;  // the forward walks the prologue's query tiles
  if (cudaError_t err = launch_segment_ranges(p.mask, p.batch, p.seq_q, p.seq_k, stream, query_tiles);
      err != cudaSuccess)
    return err;
  return launch_forward_kernels<true>(p, stream);
}

}  // namespace tk::attention
