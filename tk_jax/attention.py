"""Public softmax attention: validate the arguments, choose a backend, differentiate.

    flash_attention(q, k, v, ...)              checks arguments, then attend(...)
      -> attend                                 folds batch dims into B, picks the backend
        -> _attention / _attention_with_lse     (jax.custom_vjp) rank-4 [B, T, H, D] from here on
           forward:  attention_fwd_impl         kernel or reference forward -> (o, lse)
           backward: attention_bwd_impl         kernel or reference backward -> (dq, dk, dv)

The backend is resolved to "kernel" or "reference" in Python, while tracing, before any custom
call is emitted (see tk_jax/_backend.py). The kernel path goes through the partitioning rule of
tk_jax/_partitioning.py, so that a sharded jit runs it per device on (batch, head) shards.
attention_fwd_impl and attention_bwd_impl are also the building blocks of ring attention
(tk_jax/ring.py), which calls them on one block of the sequence at a time.

Segment ids and sequence lengths travel as AttentionMasks, a tuple of optional integer arrays
([B, T] and [B] once folded). They are inputs of the custom_vjp like q, k and v (they may be
traced, batched or sharded) but are not differentiated: their cotangent is None.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from tk_jax import _kernels, _partitioning, kvcache
from tk_jax._backend import select_backend
from tk_jax._checks import (check_attention_qkv, check_backend_name, check_bool, check_index_array,
                            check_window, resolve_softmax_scale)
from tk_jax.reference import attention as reference_attention

OP = "flash_attention"
RESOLVED_BACKENDS = ("kernel", "reference")


class AttentionMasks(NamedTuple):
    """The data-dependent masks of one call, None where absent: segment ids [B, Tq] / [B, Tk]
    (both or neither) and sequence lengths [B], int32. The field names are the keyword names
    of the kernel wrappers and of the reference."""
    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    q_seq_lengths: jax.Array | None = None
    kv_seq_lengths: jax.Array | None = None

    def names(self) -> tuple[str, ...]:
        """The names of the masks given, in field order."""
        return tuple(name for name, x in self._asdict().items() if x is not None)

    def arrays(self) -> tuple[jax.Array, ...]:
        """The masks given, in field order (matching names())."""
        return tuple(x for x in self if x is not None)

    def as_kwargs(self) -> dict:
        return dict(zip(self.names(), self.arrays()))


NO_MASKS = AttentionMasks()


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    softmax_scale: float | None = None,
                    window_size: tuple[int, int] = (-1, -1), return_lse: bool = False,
                    backend: str = "auto", q_segment_ids: ArrayLike | None = None,
                    kv_segment_ids: ArrayLike | None = None,
                    q_seq_lengths: ArrayLike | None = None,
                    kv_seq_lengths: ArrayLike | None = None,
                    ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Softmax attention softmax(scale * q k^T + mask) v, differentiable in q, k and v.

    Args:
      q: [..., Tq, Hq, D] queries, bfloat16, float16 or float32.
      k: [..., Tk, Hkv, D] keys, same dtype and leading batch dims as q; Hq % Hkv == 0
        (grouped-query attention: query head h reads kv head h // (Hq // Hkv)).
      v: values, same shape as k.
      causal: shorthand for window_right = 0 (bottom-right aligned, as FlashAttention: with
        Tq != Tk the last query lines up with the last key). Any window_size[1] is replaced.
      softmax_scale: a positive finite Python number; None means 1 / sqrt(D).
      window_size: (window_left, window_right), each -1 (unbounded) or >= 0. Query i may see
        key j iff j >= i + off - window_left and j <= i + off + window_right, where
        off = kv_len - q_len (Tk - Tq without lengths).
      return_lse: also return the natural-log logsumexp of the scaled, masked scores.
      backend: "auto" (the kernel on a Hopper GPU when it supports these inputs, else the
        reference), "kernel" (raise ValueError if it cannot run) or "reference" (pure JAX).
      q_segment_ids: [..., Tq] integers (packed sequences): query i sees key j only where
        q_segment_ids[i] == kv_segment_ids[j]. Any values, in any order; rows of one segment
        need not be contiguous. Combines with causal and window_size, which stay aligned to
        the whole row (not to each segment).
      kv_segment_ids: [..., Tk] integers; defaults to q_segment_ids when Tq == Tk.
      q_seq_lengths, kv_seq_lengths: [...] integers (one per batch row, as
        jax.nn.dot_product_attention's query_seq_lengths / key_value_seq_lengths): only the
        first q_len queries and kv_len keys of a row take part; values are clamped to
        [0, T]. The causal diagonal and the window are aligned bottom-right per row: the
        last valid query lines up with the last valid key (FlashAttention's varlen).

    Returns:
      o [..., Tq, Hq, D] in q's dtype, and with return_lse also lse [..., Hq, Tq] float32.
      A query that sees no key (padding, or emptied by the masks) gets o = 0, lse = -inf and
      zero gradients. A NaN or inf in q, k or v reaches the rows that see it (NaN o, and NaN
      lse for q and k), forward and backward alike, as in plain softmax attention; a score of
      -inf weighs nothing, like a masked one.
    """
    check_attention_qkv(q, k, v, OP)
    scale = resolve_softmax_scale(softmax_scale, head_dim=q.shape[-1], op=OP)
    window_left, window_right = check_window(window_size, causal, OP)
    check_bool(return_lse, "return_lse", OP)
    check_backend_name(backend, OP)
    masks = check_flash_masks(q, k, q_segment_ids, kv_segment_ids, q_seq_lengths,
                              kv_seq_lengths)
    return attend(q, k, v, scale=scale, window_left=window_left, window_right=window_right,
                  masks=masks, bottom_right=True, return_lse=return_lse, backend=backend)


def attend(q, k, v, *, scale: float, window_left: int, window_right: int,
           masks: AttentionMasks, bottom_right: bool, return_lse: bool, backend: str,
           op: str = OP):
    """flash_attention after its checks (also the tk path of dot_product_attention): fold the
    batch dims, resolve the backend, run the custom_vjp, unfold. Masks are checked arrays with
    q's leading batch dims."""
    batch_shape = q.shape[:-3]
    q4, k4, v4 = (fold_batch_dims(x) for x in (q, k, v))
    masks = _fold_masks(masks, q.shape[-3], k.shape[-3])
    resolved = choose_backend(q4, k4, v4, backend, op=op)
    settings = (scale, window_left, window_right, bottom_right, resolved)
    if not return_lse:
        o = _attention(q4, k4, v4, masks, *settings)
        return o.reshape(batch_shape + o.shape[1:])
    o, lse = _attention_with_lse(q4, k4, v4, masks, *settings)
    return o.reshape(batch_shape + o.shape[1:]), lse.reshape(batch_shape + lse.shape[1:])


def choose_backend(q, k, v, backend: str, *, op: str = OP) -> str:
    """Resolve "auto" | "kernel" | "reference" to "kernel" or "reference" for rank-4 inputs."""
    unsupported = None
    if backend != "reference":
        unsupported = _kernels.attention_kernel_unsupported(q, k, v)
    return select_backend(backend, unsupported=unsupported, op=op)


# ----------------------------------------------------------------------------------------------
# The two halves of the computation, for rank-4 inputs and a resolved backend.


def _kernel_options(bottom_right: bool) -> dict:
    """Static keyword arguments for the kernel wrappers beyond scale and window: only those
    that differ from the defaults, so that a call without masks stays the plain call."""
    return {} if bottom_right else {"bottom_right": False}


def attention_fwd_impl(q, k, v, *, scale, window_left, window_right, backend,
                       masks: AttentionMasks = NO_MASKS, bottom_right: bool = True,
                       local: bool = False):
    """(o [B, Tq, Hq, D] in q's dtype, lse [B, Hq, Tq] float32) from the chosen backend.

    local=True: the arrays are already this device's shards (inside shard_map, as in ring
    attention) and the kernel is called directly, without the partitioning rule."""
    _check_resolved(backend)
    window = dict(scale=scale, window_left=window_left, window_right=window_right)
    if backend == "kernel" and _takes_decode_path(q, k, masks, bottom_right):
        # Few query tokens against many keys: the KV-cache kernel, which packs the query heads
        # of a KV head into one tile and splits the keys over the SMs (tk_jax/kvcache.py).
        return kvcache.decode_attention_fwd(q, k, v, **window, kv_seq_lengths=masks.kv_seq_lengths,
                                            local=local)
    if backend == "kernel":
        # The kernel sees whole arrays; the partitioning rule lets a sharded jit run it once per
        # device on the local (batch, head) shard. (The reference needs no rule: XLA splits
        # plain JAX by itself.) Masks go in as trailing arrays, out as keyword arguments.
        names = masks.names()
        if local:
            kernel = _partitioning.on_local_shards(
                _partitioning.arrays_as_keywords(_kernels.attention_fwd, names))
        else:
            kernel = _partitioning.partitioned_attention_fwd(_kernels.attention_fwd,
                                                             mask_names=names)
        return kernel(q, k, v, *masks.arrays(), **window, **_kernel_options(bottom_right))
    return reference_attention.attention_forward(q, k, v, **window, **masks.as_kwargs(),
                                                 bottom_right=bottom_right)


def _takes_decode_path(q, k, masks: AttentionMasks, bottom_right: bool) -> bool:
    """Whether the forward runs the KV-cache kernel: its mask is the bottom-right band with
    key lengths at most (no segment ids, no query lengths), and few queries see many keys."""
    plain = masks.q_segment_ids is None and masks.q_seq_lengths is None and bottom_right
    return plain and kvcache.decode_fast_path_applies(q, k)


def attention_bwd_impl(q, k, v, o, lse, do, *, scale, window_left, window_right, backend,
                       dlse=None, masks: AttentionMasks = NO_MASKS, bottom_right: bool = True,
                       local: bool = False):
    """(dq, dk, dv) in the dtypes of q, k, v for output cotangent `do` and, optionally, the
    cotangent `dlse` [B, Hq, Tq] of lse (None: lse is not differentiated, which is cheaper).

    The one dispatch point for the backward; backend="kernel" runs the backward kernel under
    the partitioning rule (not with local=True, as in attention_fwd_impl). o and lse are used
    as given (ring attention passes the global ones).
    """
    _check_resolved(backend)
    window = dict(scale=scale, window_left=window_left, window_right=window_right)
    if backend == "kernel":
        names = masks.names()
        if local:
            backward = _partitioning.on_local_shards(
                _partitioning.arrays_as_keywords(_kernels.attention_bwd, names))
        else:
            backward = _partitioning.partitioned_attention_bwd(
                _kernels.attention_bwd, with_dlse=dlse is not None, mask_names=names)
        optional = () if dlse is None else (dlse,)
        return backward(q, k, v, o, lse, do, *optional, *masks.arrays(), **window,
                        **_kernel_options(bottom_right))
    dq, dk, dv = reference_attention.attention_backward(
        q, k, v, o, lse, do, **window, dlse=dlse, **masks.as_kwargs(), bottom_right=bottom_right)
    # custom_vjp requires each cotangent in its primal's dtype.
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def attention_bwd_state_calls(*, scale, backend):
    """The kernels' backward in three calls on local blocks (tk_jax/_context_parallel.py,
    DqStateCalls: the row statistics once, a call per block of keys adding its dq into one dQ
    state, dq out of it once), or None for the reference backend, whose blocks' dq the caller
    sums. The blocks' masks are bottom-right aligned (the kernels' default), as the ring plans
    them. Results are typed per device inside shard_map (see _partitioning.on_local_shards)."""
    _check_resolved(backend)
    if backend != "kernel":
        return None
    from tk_jax._context_parallel import DqStateCalls

    def row_stats(o, lse, do, dlse):
        extra = () if dlse is None else (dlse,)
        return _partitioning.on_local_shards(
            lambda *a: (_kernels.attention_bwd_row_stats(*a, scale=scale),))(o, lse, do, *extra)[0]

    def keys(state, q, k, v, do, *, dq_rows, dq_row_shift, window_left, window_right, **masks):
        return _partitioning.on_local_shards(_kernels.attention_bwd_keys)(
            state, q, k, v, do, dq_rows=dq_rows, dq_row_shift=dq_row_shift, scale=scale,
            window_left=window_left, window_right=window_right, **masks)

    def dq(state, like):
        return _partitioning.on_local_shards(
            lambda s: (_kernels.attention_bwd_dq(s, like),))(state)[0]
    return DqStateCalls(row_stats, keys, dq)


# ----------------------------------------------------------------------------------------------
# Differentiation. The custom_vjp keeps autodiff away from the kernel (it has no JAX derivative)
# and from the reference's inner loop (its derivative would store every score block).
# Two versions, so that the common one (o only) never computes with a cotangent of lse. (Not
# custom_vjp's symbolic_zeros, which could tell the same apart: JAX does not support it inside
# shard_map or pmap.) The masks are an ordinary argument (arrays may be traced) whose cotangent
# is None: integer inputs have no derivative.

_SETTINGS = (4, 5, 6, 7, 8)  # scale, window_left, window_right, bottom_right, backend


def _run_forward(q, k, v, masks, scale, window_left, window_right, bottom_right, backend):
    return attention_fwd_impl(q, k, v, scale=scale, window_left=window_left,
                              window_right=window_right, backend=backend, masks=masks,
                              bottom_right=bottom_right)


def _run_backward(settings, residuals, do, dlse=None):
    scale, window_left, window_right, bottom_right, backend = settings
    q, k, v, masks, o, lse = residuals
    grads = attention_bwd_impl(q, k, v, o, lse, do, scale=scale, window_left=window_left,
                               window_right=window_right, backend=backend, dlse=dlse,
                               masks=masks, bottom_right=bottom_right)
    return (*grads, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=_SETTINGS)
def _attention(q, k, v, masks, scale, window_left, window_right, bottom_right, backend):
    return _run_forward(q, k, v, masks, scale, window_left, window_right, bottom_right,
                        backend)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=_SETTINGS)
def _attention_with_lse(q, k, v, masks, scale, window_left, window_right, bottom_right,
                        backend):
    return _run_forward(q, k, v, masks, scale, window_left, window_right, bottom_right, backend)


def _forward_rule(q, k, v, masks, *settings):
    o, lse = _run_forward(q, k, v, masks, *settings)
    return (o, lse), (q, k, v, masks, o, lse)


def _attention_forward_rule(q, k, v, masks, *settings):
    (o, _), residuals = _forward_rule(q, k, v, masks, *settings)
    return o, residuals


def _attention_backward_rule(*args):
    *settings, residuals, do = args
    return _run_backward(settings, residuals, do)


def _attention_with_lse_backward_rule(*args):
    *settings, residuals, (do, dlse) = args
    return _run_backward(settings, residuals, do, dlse)


_attention.defvjp(_attention_forward_rule, _attention_backward_rule)
_attention_with_lse.defvjp(_forward_rule, _attention_with_lse_backward_rule)


# ----------------------------------------------------------------------------------------------
# Argument checks of flash_attention only (those shared with ring_attention are in
# tk_jax/_checks.py). Every error names the argument, the value given and what is accepted.


def check_flash_masks(q, k, q_segment_ids, kv_segment_ids, q_seq_lengths, kv_seq_lengths,
                      op: str = OP) -> AttentionMasks:
    """The mask arguments as int32 arrays with q's leading batch dims ([..., T] ids, [...]
    lengths); kv_segment_ids defaults to q_segment_ids when Tq == Tk."""
    batch, tq, tk = tuple(q.shape[:-3]), q.shape[-3], k.shape[-3]
    if kv_segment_ids is not None and q_segment_ids is None:
        raise ValueError(f"{op}: kv_segment_ids was given without q_segment_ids; pass both "
                         "(or q_segment_ids alone when Tq == Tk)")
    if q_segment_ids is not None:
        q_segment_ids = check_index_array(q_segment_ids, "q_segment_ids", batch + (tq,),
                                          "q's batch dims and Tq", op)
        if kv_segment_ids is None:
            if tq != tk:
                raise ValueError(
                    f"{op}: kv_segment_ids is required when q and k differ in length (Tq = "
                    f"{tq}, Tk = {tk}); it defaults to q_segment_ids only when Tq == Tk")
            kv_segment_ids = q_segment_ids
        else:
            kv_segment_ids = check_index_array(kv_segment_ids, "kv_segment_ids", batch + (tk,),
                                               "k's batch dims and Tk", op)
    if q_seq_lengths is not None:
        q_seq_lengths = check_index_array(q_seq_lengths, "q_seq_lengths", batch,
                                          "one per batch row: q's batch dims", op)
    if kv_seq_lengths is not None:
        kv_seq_lengths = check_index_array(kv_seq_lengths, "kv_seq_lengths", batch,
                                           "one per batch row: q's batch dims", op)
    return AttentionMasks(q_segment_ids, kv_segment_ids, q_seq_lengths, kv_seq_lengths)


def _fold_masks(masks: AttentionMasks, tq: int, tk: int) -> AttentionMasks:
    """Batch dims folded into one ([B, T] ids, [B] lengths), lengths clamped to [0, T] so that
    the kernels only ever see lengths within their arrays."""
    def ids(x):
        return None if x is None else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])

    def length(x, full):
        return None if x is None else jnp.clip(x.reshape(math.prod(x.shape)), 0, full)

    return AttentionMasks(ids(masks.q_segment_ids), ids(masks.kv_segment_ids),
                          length(masks.q_seq_lengths, tq), length(masks.kv_seq_lengths, tk))



def _check_resolved(backend) -> None:
    if backend not in RESOLVED_BACKENDS:
        raise ValueError(f"attention backend must be resolved to one of {RESOLVED_BACKENDS} "
                         f"(see choose_backend), got {backend!r}")


def fold_batch_dims(x: jax.Array) -> jax.Array:
    """[..., T, H, D] -> [B, T, H, D], B the product of the leading dims (a view, no copy)."""
    return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:])
