// Flash attention launchers: plain C++ entry points that know nothing of XLA or JAX.
// Tensors are contiguous [batch, seq, heads, head_dim]; lse is [batch, heads_q, seq_q] float32.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tk::attention {

enum class DType { bf16, fp16 };

// The head dims the forward and backward kernels are built for.
constexpr int HEAD_DIMS[] = {64, 128, 256};
constexpr bool head_dim_supported(int d) {
  for (int x : HEAD_DIMS)
    if (x == d) return true;
  return false;
}

// Segment ids and lengths, which combine with the causal / window band of the launch params.
// Per batch row b, query i sees key j iff
//   i < q_len[b] and j < kv_len[b]                      (seq_q, seq_k without lengths)
//   and q_segment_ids[b, i] == kv_segment_ids[b, j]     (only with segment ids)
//   and (window_left  < 0 or j >= i + offset_b - window_left)
//   and (window_right < 0 or j <= i + offset_b + window_right)
// with offset_b = kv_len[b] - q_len[b] when bottom_right (FlashAttention's alignment) and 0
// otherwise (top-left, jax.nn.dot_product_attention's). Causal attention is window_right = 0.
// Lengths outside [0, seq] are clamped to it. A row that sees no key gets O = 0, lse = -inf
// and zero gradients; work past the lengths is skipped, not masked.
struct MaskParams {
  const int32_t* q_segment_ids = nullptr;   // [batch, seq_q], or null (then kv_segment_ids too)
  const int32_t* kv_segment_ids = nullptr;  // [batch, seq_k]
  const int32_t* q_lengths = nullptr;       // [batch], or null (then kv_lengths too)
  const int32_t* kv_lengths = nullptr;      // [batch]
  // mask_workspace_bytes(...) bytes, 16-byte aligned, contents need no setting: with segment
  // ids, the segment ranges of every chunk of rows and the forward's query tiles
  // (segment_ranges.cuh).
  void* workspace = nullptr;
  bool bottom_right = true;

  bool has_segment_ids() const { return q_segment_ids != nullptr; }
};

// Bytes of the mask workspace a call needs: with segment ids, the ranges of every 64-row chunk
// of the queries and of the keys, and the forward's query tiles (a few bytes a position);
// without, a 16-byte token per batch row. Linear in batch:
// callers that fold extra leading axes into the batch may size it per batch and multiply.
size_t mask_workspace_bytes(int64_t batch, int64_t seq_q, int64_t seq_k, bool segment_ids);

struct ForwardParams {
  const void* q;  // [batch, seq_q, heads_q, head_dim]
  const void* k;  // [batch, seq_k, heads_kv, head_dim]
  const void* v;  // [batch, seq_k, heads_kv, head_dim]
  void* o;        // [batch, seq_q, heads_q, head_dim], q's dtype
  float* lse;     // [batch, heads_q, seq_q], natural log; -inf for rows that see no key
  int batch, seq_q, seq_k, heads_q, heads_kv, head_dim;
  float scale;
  // The band: query i sees key j iff  i + offset - window_left <= j <= i + offset + window_right
  // (a negative bound is unbounded; offset as in MaskParams), with the masks of `mask`.
  int window_left, window_right;
  MaskParams mask;
  DType dtype;
};

// nullptr when the kernel supports `p`, else a sentence saying what is wrong.
const char* forward_unsupported(const ForwardParams& p);

// Launches on `stream` only; never synchronises. Returns the launch status.
cudaError_t forward(const ForwardParams& p, cudaStream_t stream);

struct BackwardParams {
  const void* q;       // [batch, seq_q, heads_q, head_dim]
  const void* k;       // [batch, seq_k, heads_kv, head_dim]
  const void* v;       // [batch, seq_k, heads_kv, head_dim]
  const void* o;       // [batch, seq_q, heads_q, head_dim], the forward's output
  const void* dout;    // [batch, seq_q, heads_q, head_dim], gradient of the output
  const float* lse;    // [batch, heads_q, seq_q], the forward's (natural log, -inf for rows that see no key)
  const float* dlse;   // [batch, heads_q, seq_q], gradient of lse (zeros when lse is not differentiated)
  void* dq;            // [batch, seq_q, heads_q, head_dim], q's dtype
  void* dk;            // [batch, seq_k, heads_kv, head_dim], k's dtype (summed over the GQA group)
  void* dv;            // [batch, seq_k, heads_kv, head_dim]
  // Scratch memory, 16-byte aligned, contents need no setting: the dQ state (the dQ accumulator
  // and the row statistics, backward_dq_state_bytes) and the dK / dV accumulators of GQA
  // (backward_key_workspace_bytes; may be null where that is 0).
  void* workspace;
  void* key_workspace;
  int batch, seq_q, seq_k, heads_q, heads_kv, head_dim;
  float scale;
  int window_left, window_right;  // as in ForwardParams
  MaskParams mask;                // the forward's
  DType dtype;
  // Several calls may sum their dQ into one dQ state (the three passes below; context
  // parallelism: one call per block of keys). The state then holds dq_rows query rows, and row
  // i of this call is row (i + dq_row_shift) mod dq_rows of it. 0, 0: the call's own seq_q
  // rows, unshifted. A call on part of the rows must have seq_q and dq_row_shift multiples of
  // BACKWARD_Q_TILE (64): its tiles then are whole tiles of the state.
  int dq_rows = 0, dq_row_shift = 0;

  int state_rows() const { return dq_rows ? dq_rows : seq_q; }
};

// Bytes of the backward's scratch memory (what its passes hand each other), in two buffers.
// Linear in batch: callers that fold extra leading axes into the batch may size them per batch
// and multiply. dq_rows: the query rows of the dQ state (a lone call: seq_q).
size_t backward_dq_state_bytes(int64_t batch, int64_t heads_q, int64_t dq_rows, int64_t head_dim);
size_t backward_key_workspace_bytes(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_k,
                                    int64_t head_dim);

// The backward's passes, each on `stream` only, never synchronising:
//   ROW_STATS  the row statistics (lse and delta in the kernels' units) into the dQ state, and
//              its dQ accumulator zeroed. Reads o, dout, lse, dlse; seq_q = the state's rows.
//   KEYS       the backward kernel: dk and dv out, dQ added into the state. Reads q, k, v, dout
//              and the masks; writes the key workspace.
//   DQ_OUT     dq out of the state. Writes dq; seq_q = the state's rows.
// A lone call runs all three. A caller that sums dQ over several calls with different keys
// runs ROW_STATS once, KEYS per call (dq_rows, dq_row_shift placing its rows), DQ_OUT once.
enum BackwardPasses : unsigned { ROW_STATS = 1u, KEYS = 2u, DQ_OUT = 4u, ALL_PASSES = 7u };

// nullptr when the kernels support `p` for `passes`, else a sentence saying what is wrong.
const char* backward_unsupported(const BackwardParams& p, unsigned passes = ALL_PASSES);

// Launches the `passes` of the backward, in the order above. Returns the launch status.
cudaError_t backward(const BackwardParams& p, cudaStream_t stream, unsigned passes = ALL_PASSES);

}  // namespace tk::attention
