"""Ring attention: sequence-parallel softmax attention inside `shard_map` (or `pmap`).

`ring_attention(q, k, v, axis_name=...)`, with the sequence split over the mesh axis
`axis_name`: the K/V blocks travel around the ring of devices (lax.ppermute) while each device
computes its queries against the block it holds; partial results are merged by their
logsumexp. `to_load_balanced` / `from_load_balanced` reorder a sequence so that causal
attention gives every device the same amount of work.
"""
from __future__ import annotations

import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tk_jax._checks import (check_attention_qkv, check_backend_name, check_bool, check_window,
                            is_int, resolve_softmax_scale)
from tk_jax._context_parallel import ring_backward, ring_forward, steps_by_lengths
from tk_jax._ring_plan import CONTIGUOUS, LOAD_BALANCED, ring_plan
from tk_jax.attention import (AttentionMasks, attention_bwd_impl, attention_bwd_state_calls,
                              attention_fwd_impl, check_flash_masks, choose_backend,
                              fold_batch_dims)

# Device r holds the queries and keys of its part of the sequence. In step s it holds the K/V
# block that started on device (r - s) mod n and computes its queries against it, merging the
# result by logsumexp, while the block moves on to device r + 1 (tk_jax/_context_parallel.py
# runs the steps; tk_jax/_ring_plan.py decides statically which pairs of chunks a step
# computes on which device). Under a causal mask:
#
#   contiguous layout (device r holds chunk r):
#       step 0: the diagonal block (causal)   src < r: fully visible   src > r: invisible
#   load-balanced layout (device r holds chunks r and 2n-1-r, as halves of its block):
#       step 0: causal on the local block (the chunk order is kept)
#       src <  r: all local queries see the first half of the keys (chunk src), not the second
#       src >  r: only the second half of the queries (chunk 2n-1-r) sees keys, all of them
#   so with load balancing every device does the same work in every step; without it, device
#   n-1 works in every step while device 0 idles after the first.
#
# Invisible work is skipped, and a window also ends the ring early: the keys travel only as far
# as some query still sees them. Where the devices' work in a step differs, a switch on the
# device index picks each device's blocks, or, in the load-balanced causal ring, one call with
# the queries' two chunks swapped takes each device's rectangle as sequence lengths (looked up
# by the device index): rows [0, 2c) x keys [0, c) for src < r, rows [0, c) x keys [0, 2c) for
# src > r (c = half a block).

RING_OP = "ring_attention"
AxisName = Hashable  # a mesh axis name, or a tuple of them


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: AxisName,
                   causal: bool = False, softmax_scale: float | None = None,
                   window_size: tuple[int, int] = (-1, -1), backend: str = "auto",
                   load_balanced: bool = True, q_segment_ids: jax.Array | None = None,
                   kv_segment_ids: jax.Array | None = None) -> jax.Array:
    """Sequence-parallel softmax attention; call it inside `shard_map` (or `pmap`).

    The sequence axis of q, k and v is split over the mesh axis (or tuple of axes) `axis_name`;
    each argument is this device's part. K/V blocks travel around the ring of devices with
    lax.ppermute while each device works on the block it holds; nothing is gathered, so the
    memory per device stays that of the local part.

    Args:
      q: [..., T, Hq, D] local queries (T = the global length / number of devices).
      k, v: [..., T, Hkv, D] local keys and values (Hq % Hkv == 0), same dtype as q.
      axis_name: the shard_map / pmap axis name(s) the sequence is split over.
      causal: causal self-attention over the global sequence (window_right = 0).
      softmax_scale: a positive Python number; None means 1 / sqrt(D).
      window_size: (window_left, window_right) over global positions, as in flash_attention:
        query i sees key j iff i - window_left <= j <= i + window_right (-1: unbounded). Steps
        whose blocks share no visible pair are skipped; with a window the ring stops as soon
        as no query sees the passing keys.
      backend: "auto" | "kernel" | "reference", as for flash_attention.
      load_balanced: the sequence is in the load-balanced layout (see to_load_balanced), so
        that causal attention costs every device the same. Only matters with a mask (causal or
        a window; T must then be even); without one the layout does not change the result.
        A window much shorter than T balances itself: pass load_balanced=False (the natural
        order) and the ring stops after the few devices the window reaches.
      q_segment_ids: [..., T] integers, this device's part, in the same layout as q (packed
        sequences: query i sees key j only where their segment ids are equal, as in
        flash_attention). The keys' ids travel around the ring with K and V. For padding,
        give queries and keys past the end ids that match nothing.
      kv_segment_ids: [..., T] integers; defaults to q_segment_ids.

    Returns:
      o [..., T, Hq, D] in q's dtype, this device's part of the output, in the input's layout.
    """
    check_attention_qkv(q, k, v, RING_OP)
    scale = resolve_softmax_scale(softmax_scale, head_dim=q.shape[-1], op=RING_OP)
    window_left, window_right = check_window(window_size, causal, RING_OP)
    check_bool(load_balanced, "load_balanced", RING_OP)
    check_backend_name(backend, RING_OP)
    if q.shape[-3] != k.shape[-3]:
        raise ValueError(
            f"{RING_OP}: q and k must hold the same part of one sequence (self-attention): got "
            f"{q.shape[-3]} query and {k.shape[-3]} key positions on this device (axis -3)")
    num_devices = _ring_size(axis_name)
    masked = window_left >= 0 or window_right >= 0
    layout = LOAD_BALANCED if load_balanced and masked and num_devices > 1 else CONTIGUOUS
    if layout == LOAD_BALANCED and q.shape[-3] % 2:
        raise ValueError(
            f"{RING_OP}: with a mask (causal or window_size) and load_balanced=True each "
            f"device holds two equal chunks, so its sequence length must be even; got "
            f"{q.shape[-3]} (axis -3 of q). Pad the sequence or pass load_balanced=False")

    masks = check_flash_masks(q, k, q_segment_ids, kv_segment_ids, None, None, op=RING_OP)
    segments = None
    if masks.q_segment_ids is not None:
        segments = tuple(x.reshape((-1, x.shape[-1])) for x in masks[:2])

    batch_shape = q.shape[:-3]
    q4, k4, v4 = (fold_batch_dims(x) for x in (q, k, v))
    resolved = choose_backend(q4, k4, v4, backend, op=RING_OP)
    length = q4.shape[1]
    plan = ring_plan(num_devices, layout, length, length, 0, window_left, window_right,
                     by_lengths=steps_by_lengths())
    o = _ring(q4, k4, v4, segments, axis_name, scale, plan, resolved)
    return o.reshape(batch_shape + o.shape[1:])



def _ring_size(axis_name: AxisName) -> int:
    try:
        return int(lax.axis_size(axis_name))
    except NameError as err:
        raise ValueError(
            f"{RING_OP}: axis_name={axis_name!r} is not a bound mesh axis: call ring_attention "
            f"inside shard_map or pmap over that axis ({err})") from None


def _block_calls(scale, backend):
    """The kernels (or the reference) on one block of local shards, called directly (not
    through the partitioning rule: the blocks are local already)."""
    def attend(q, k, v, window_left, window_right, **masks):
        return attention_fwd_impl(q, k, v, scale=scale, window_left=window_left,
                                  window_right=window_right, backend=backend, local=True,
                                  masks=AttentionMasks(**masks))

    def attend_bwd(q, k, v, o, lse, do, dlse, window_left, window_right, **masks):
        return attention_bwd_impl(q, k, v, o, lse, do, scale=scale, window_left=window_left,
                                  window_right=window_right, backend=backend, dlse=dlse,
                                  local=True, masks=AttentionMasks(**masks))
    return attend, attend_bwd


def _segment_kwargs(segments) -> dict:
    if segments is None:
        return {}
    return {"q_segment_ids": segments[0], "kv_segment_ids": segments[1]}


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ring(q, k, v, segments, axis_name, scale, plan, backend):
    """segments: None or (q_segment_ids, kv_segment_ids) [B, T] int32: inputs, not
    differentiated (their cotangent is None)."""
    attend, _ = _block_calls(scale, backend)
    return ring_forward(q, k, v, plan=plan, axis_name=axis_name, attend=attend,
                        **_segment_kwargs(segments))[0]


def _ring_forward_rule(q, k, v, segments, axis_name, scale, plan, backend):
    """The forward, keeping the previous device's keys for the backward's first step: sent
    again, that transfer would have nothing to overlap."""
    attend, _ = _block_calls(scale, backend)
    o, lse, neighbour_keys = ring_forward(q, k, v, plan=plan, axis_name=axis_name,
                                          attend=attend, keep_neighbour_keys=True,
                                          **_segment_kwargs(segments))
    return o, (q, k, v, segments, o, lse, neighbour_keys)


def _ring_backward_rule(axis_name, scale, plan, backend, residuals, do):
    _, attend_bwd = _block_calls(scale, backend)
    q, k, v, segments, o, lse, neighbour_keys = residuals
    dq, dk, dv = ring_backward(q, k, v, o, lse, do, plan=plan, axis_name=axis_name,
                               attend_bwd=attend_bwd,
                               dq_state=attention_bwd_state_calls(scale=scale, backend=backend),
                               neighbour_keys=neighbour_keys, **_segment_kwargs(segments))
    return dq, dk, dv, None


_ring.defvjp(_ring_forward_rule, _ring_backward_rule)


# ----------------------------------------------------------------------------------------------
# The load-balanced sequence layout. Cut the sequence into 2n chunks; device i gets chunks i and
# 2n-1-i. Reordering the chunks as [0, 2n-1, 1, 2n-2, ...] before a plain contiguous split
# (PartitionSpec over the sequence axis) gives exactly that.


def load_balanced_chunk_order(num_shards: int) -> np.ndarray:
    """[0, 2n-1, 1, 2n-2, ..., n-1, n]: the chunk order of the load-balanced layout."""
    pairs = [(i, 2 * num_shards - 1 - i) for i in range(num_shards)]
    return np.array([c for pair in pairs for c in pair])


def to_load_balanced(x: jax.Array, num_shards: int, *, axis: int = -3) -> jax.Array:
    """Reorder the sequence axis of a full (unsplit) array into the load-balanced layout."""
    return _reorder_chunks(x, load_balanced_chunk_order(num_shards), num_shards, axis)


def from_load_balanced(x: jax.Array, num_shards: int, *, axis: int = -3) -> jax.Array:
    """Inverse of to_load_balanced: back to the natural sequence order."""
    return _reorder_chunks(x, np.argsort(load_balanced_chunk_order(num_shards)), num_shards, axis)


def _reorder_chunks(x, order, num_shards, axis):
    if not is_int(num_shards) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    axis = axis % x.ndim
    length = x.shape[axis]
    if length % (2 * num_shards):
        raise ValueError(
            f"the load-balanced layout cuts the sequence into 2 * num_shards = {2 * num_shards} "
            f"equal chunks; axis {axis} has length {length}, not a multiple of that")
    chunks = jnp.reshape(x, x.shape[:axis] + (2 * num_shards, length // (2 * num_shards))
                         + x.shape[axis + 1:])
    return jnp.reshape(jnp.take(chunks, jnp.asarray(order), axis=axis), x.shape)
