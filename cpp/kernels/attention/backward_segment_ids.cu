// The attention backward with segment ids: the segment-range prologue, then the passes whose
// kernels walk only the query tiles that share a segment with their keys (backward_launch.cuh,
// SEG).
#include "attention.h"
#include "backward_launch.cuh"
#include "segment_ranges.cuh"

namespace tk::attention {

cudaError_t backward_with_segment_ids(const BackwardParams& p, unsigned passes, cudaStream_t stream) {
  if (passes & KEYS)  // the only pass that reads the masks
    if (cudaError_t err = launch_segment_ranges(p.mask, p.batch, p.seq_q, p.seq_k, stream); err != cudaSuccess)
      return err;
  return launch_backward_kernels<true>(p, passes, stream);
}

}  // namespace tk::attention
