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

from tk_jax._checks import (check_attention_qkv, check_backend_name, check_bool, is_int,
                            resolve_softmax_scale)
from tk_jax.attention import (attention_bwd_impl, attention_fwd_impl, choose_backend,
                              fold_batch_dims)

# Device r holds the queries and keys of its part of the sequence. In step s = 0..n-1 it holds
# the K/V block that started on device src = (r - s) mod n, computes its queries against it and
# merges the result; meanwhile the block moves on to device r + 1. Which (query, key) pairs of a
# step are visible under a causal mask follows from the two devices' chunk positions alone:
#
#   contiguous layout (device r holds chunk r):
#       src == r: the diagonal block (causal mask)  src < r: fully visible  src > r: invisible
#   load-balanced layout (device r holds chunks r and 2n-1-r, as halves of its block):
#       src == r: causal mask on the local block (the chunk order is kept)
#       src <  r: all local queries see the first half of the keys (chunk src), not the second
#       src >  r: only the second half of the queries (chunk 2n-1-r) sees keys, all of them
#   so with load balancing every device does the same work in every step; without it, device
#   n-1 works in every step while device 0 idles after the first.
#
# Invisible work is skipped with lax.switch (the branch is chosen per device at run time), not
# computed and discarded. Steps are numbered with src < r as "earlier" and src > r as "later".
# The kernels are called on the local blocks directly (on_local_shards), not through the
# partitioning rule.

RING_OP = "ring_attention"
AxisName = Hashable  # a mesh axis name, or a tuple of them
_DIAGONAL, _EARLIER, _LATER = 0, 1, 2


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: AxisName,
                   causal: bool = False, softmax_scale: float | None = None,
                   backend: str = "auto", load_balanced: bool = True) -> jax.Array:
    """Sequence-parallel softmax attention; call it inside `shard_map` (or `pmap`).

    The sequence axis of q, k and v is split over the mesh axis (or tuple of axes) `axis_name`;
    each argument is this device's part. K/V blocks travel around the ring of devices with
    lax.ppermute while each device works on the block it holds; nothing is gathered, so the
    memory per device stays that of the local part.

    Args:
      q: [..., T, Hq, D] local queries (T = the global length / number of devices).
      k, v: [..., T, Hkv, D] local keys and values (Hq % Hkv == 0), same dtype as q.
      axis_name: the shard_map / pmap axis name(s) the sequence is split over.
      causal: causal self-attention over the global sequence.
      softmax_scale: a positive Python number; None means 1 / sqrt(D).
      backend: "auto" | "kernel" | "reference", as for flash_attention.
      load_balanced: the sequence is in the load-balanced layout (see to_load_balanced), so
        that causal attention costs every device the same. Only matters when causal (T must
        then be even); without causal the layout does not change the result.

    Returns:
      o [..., T, Hq, D] in q's dtype, this device's part of the output, in the input's layout.
    """
    check_attention_qkv(q, k, v, RING_OP)
    scale = resolve_softmax_scale(softmax_scale, head_dim=q.shape[-1], op=RING_OP)
    check_bool(causal, "causal", RING_OP)
    check_bool(load_balanced, "load_balanced", RING_OP)
    check_backend_name(backend, RING_OP)
    if q.shape[-3] != k.shape[-3]:
        raise ValueError(
            f"{RING_OP}: q and k must hold the same part of one sequence (self-attention): got "
            f"{q.shape[-3]} query and {k.shape[-3]} key positions on this device (axis -3)")
    num_devices = _ring_size(axis_name)
    balanced = bool(causal and load_balanced and num_devices > 1)
    if balanced and q.shape[-3] % 2:
        raise ValueError(
            f"{RING_OP}: with causal=True and load_balanced=True each device holds two equal "
            f"chunks, so its sequence length must be even; got {q.shape[-3]} (axis -3 of q). "
            f"Pad the sequence or pass load_balanced=False")

    batch_shape = q.shape[:-3]
    q4, k4, v4 = (fold_batch_dims(x) for x in (q, k, v))
    resolved = choose_backend(q4, k4, v4, backend, op=RING_OP)
    o = _ring(q4, k4, v4, axis_name, scale, bool(causal), balanced, resolved)
    return o.reshape(batch_shape + o.shape[1:])


def _ring_size(axis_name: AxisName) -> int:
    try:
        return int(lax.axis_size(axis_name))
    except NameError as err:
        raise ValueError(
            f"{RING_OP}: axis_name={axis_name!r} is not a bound mesh axis: call ring_attention "
            f"inside shard_map or pmap over that axis ({err})") from None


def _send_to_next(x, axis_name, num_devices):
    """Every device passes x (arrays of one dtype) to the next device on the ring."""
    perm = [(i, (i + 1) % num_devices) for i in range(num_devices)]
    return lax.ppermute(x, axis_name, perm)


def _ring_loop(step, carry, kv, axis_name, num_devices):
    """carry = step(s, kv_s, carry) for s = 0..n-1, kv_s being the K/V block that started on
    device (r - s) mod n. The next block is sent before step s computes, so that the transfer
    can overlap the computation; the last step sends nothing."""
    def body(state, s):
        kv, carry = state
        next_kv = _send_to_next(kv, axis_name, num_devices)
        return (next_kv, step(s, kv, carry)), None

    (kv, carry), _ = lax.scan(body, (kv, carry), jnp.arange(num_devices - 1))
    return step(num_devices - 1, kv, carry)


def _block_kind(s, me):
    """_DIAGONAL for step 0 (the local block), then _EARLIER while the visiting block comes
    from a device before this one (src = me - s >= 0), else _LATER."""
    return jnp.where(s == 0, _DIAGONAL, jnp.where(me >= s, _EARLIER, _LATER))


def _merge(o_acc, lse_acc, o, lse):
    """Combine two partial softmax results over disjoint key sets by their logsumexp.
    o [B, T, H, D], lse [B, H, T]; a side that saw no key has lse = -inf and weight 0."""
    lse_new = jnp.logaddexp(lse_acc, lse)  # -inf when both are -inf
    ref = jnp.where(jnp.isneginf(lse_new), 0.0, lse_new)

    def weight(part_lse):  # [B, H, T] -> [B, T, H, 1]
        return jnp.swapaxes(jnp.exp(part_lse - ref), 1, 2)[..., None]

    return weight(lse_acc) * o_acc + weight(lse) * o.astype(jnp.float32), lse_new


def _replace_rows(x, rows, new, *, axis):
    """x with the positions `rows` along `axis` (a slice: all, or one contiguous part) replaced
    by `new`. Built from slices and a concatenation rather than x.at[rows].set(new): on GPU
    (jax 0.11.2) the scatter that .at[] becomes inside the ring's manual shard_map region
    crashed XLA's partitioner."""
    start, stop, _ = rows.indices(x.shape[axis])
    if (start, stop) == (0, x.shape[axis]):
        return new
    parts = (lax.slice_in_dim(x, 0, start, axis=axis), new,
             lax.slice_in_dim(x, stop, x.shape[axis], axis=axis))
    return jnp.concatenate([p for p in parts if p.shape[axis]], axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _ring(q, k, v, axis_name, scale, causal, balanced, backend):
    return _ring_forward(q, k, v, axis_name, scale, causal, balanced, backend)[0]


def _ring_forward(q, k, v, axis_name, scale, causal, balanced, backend):
    """(o [B, T, Hq, D] in q's dtype, lse [B, Hq, T] float32) of the local queries."""
    num_devices = _ring_size(axis_name)
    half = q.shape[1] // 2

    def attend(acc, q_rows, k, v, window_right):
        """Merge attention(q[:, q_rows], k, v) into the accumulator (o, lse)."""
        o_acc, lse_acc = acc
        o, lse = attention_fwd_impl(q[:, q_rows], k, v, scale=scale, window_left=-1,
                                    window_right=window_right, backend=backend, local=True)
        o_new, lse_new = _merge(o_acc[:, q_rows], lse_acc[..., q_rows], o, lse)
        return (_replace_rows(o_acc, q_rows, o_new, axis=1),
                _replace_rows(lse_acc, q_rows, lse_new, axis=2))

    everything, first, second = slice(None), slice(None, half), slice(half, None)
    if not causal:
        def step(s, kv, acc):
            return attend(acc, everything, *kv, window_right=-1)
    else:
        if balanced:
            earlier = lambda acc, k, v: attend(acc, everything, k[:, first], v[:, first], -1)
            later = lambda acc, k, v: attend(acc, second, k, v, -1)
        else:
            earlier = lambda acc, k, v: attend(acc, everything, k, v, -1)
            later = lambda acc, k, v: acc  # invisible: skipped
        diagonal = lambda acc, k, v: attend(acc, everything, k, v, 0)
        me = lax.axis_index(axis_name)

        def step(s, kv, acc):
            return lax.switch(_block_kind(s, me), (diagonal, earlier, later), acc, *kv)

    # zeros_like / full_like keep q's device-varying type inside shard_map.
    acc = (jnp.zeros_like(q, jnp.float32),
           jnp.full_like(q[..., 0], -jnp.inf, jnp.float32).swapaxes(1, 2))
    o, lse = _ring_loop(step, acc, (k, v), axis_name, num_devices)
    return o.astype(q.dtype), lse


def _ring_forward_rule(q, k, v, axis_name, scale, causal, balanced, backend):
    o, lse = _ring_forward(q, k, v, axis_name, scale, causal, balanced, backend)
    return o, (q, k, v, o, lse)


def _ring_backward_rule(axis_name, scale, causal, balanced, backend, residuals, do):
    """The same ring again: with the global o and lse, attention_bwd_impl on one block gives
    that block's share of dq, dk, dv. dq stays here; dk and dv travel with their K/V block and
    take one more hop at the end, which brings them home."""
    q, k, v, o, lse = residuals
    num_devices = _ring_size(axis_name)
    half = q.shape[1] // 2

    def attend(grads, q_rows, k_rows, k, v, window_right):
        dq, dk, dv = grads
        gq, gk, gv = attention_bwd_impl(
            q[:, q_rows], k[:, k_rows], v[:, k_rows], o[:, q_rows], lse[..., q_rows],
            do[:, q_rows], scale=scale, window_left=-1, window_right=window_right,
            backend=backend, local=True)
        return (_replace_rows(dq, q_rows, dq[:, q_rows] + gq.astype(jnp.float32), axis=1),
                _replace_rows(dk, k_rows, dk[:, k_rows] + gk.astype(jnp.float32), axis=1),
                _replace_rows(dv, k_rows, dv[:, k_rows] + gv.astype(jnp.float32), axis=1))

    everything, first, second = slice(None), slice(None, half), slice(half, None)
    if not causal:
        def block(s, grads, k, v):
            return attend(grads, everything, everything, k, v, -1)
    else:
        if balanced:
            earlier = lambda g, k, v: attend(g, everything, first, k, v, -1)
            later = lambda g, k, v: attend(g, second, everything, k, v, -1)
        else:
            earlier = lambda g, k, v: attend(g, everything, everything, k, v, -1)
            later = lambda g, k, v: g  # invisible: nothing to add
        diagonal = lambda g, k, v: attend(g, everything, everything, k, v, 0)
        me = lax.axis_index(axis_name)

        def block(s, grads, k, v):
            return lax.switch(_block_kind(s, me), (diagonal, earlier, later), grads, k, v)

    def step(s, kv, carry):
        dq, dkv = carry
        dq, dk, dv = block(s, (dq, *dkv), *kv)
        # dk, dv (float32) move in their own ppermute: one dtype per transfer.
        return dq, _send_to_next((dk, dv), axis_name, num_devices)

    init = (jnp.zeros_like(q, jnp.float32),
            (jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)))
    dq, (dk, dv) = _ring_loop(step, init, (k, v), axis_name, num_devices)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


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
