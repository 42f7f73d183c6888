"""Public softmax attention: validate the arguments, choose a backend, differentiate.

    flash_attention(q, k, v, ...)              checks arguments, folds batch dims into B
      -> _attention / _attention_with_lse      (jax.custom_vjp) rank-4 [B, T, H, D] from here on
           forward:  attention_fwd_impl         kernel or reference forward -> (o, lse)
           backward: attention_bwd_impl         kernel or reference backward -> (dq, dk, dv)

The backend is resolved to "kernel" or "reference" in Python, while tracing, before any custom
call is emitted (see tk_jax/_backend.py). The kernel path goes through the partitioning rule of
tk_jax/_partitioning.py, so that a sharded jit runs it per device on (batch, head) shards.
attention_fwd_impl and attention_bwd_impl are also the building blocks of ring attention
(tk_jax/ring.py), which calls them on one block of the sequence at a time.
"""
from __future__ import annotations

import functools
import math

import jax

from tk_jax import _kernels, _partitioning
from tk_jax._backend import select_backend
from tk_jax._checks import (check_attention_qkv, check_backend_name, check_bool, is_int,
                            resolve_softmax_scale)
from tk_jax.reference import attention as reference_attention

OP = "flash_attention"
RESOLVED_BACKENDS = ("kernel", "reference")


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    softmax_scale: float | None = None,
                    window_size: tuple[int, int] = (-1, -1), return_lse: bool = False,
                    backend: str = "auto") -> jax.Array | tuple[jax.Array, jax.Array]:
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
        key j iff j >= i + (Tk - Tq) - window_left and j <= i + (Tk - Tq) + window_right.
      return_lse: also return the natural-log logsumexp of the scaled, masked scores.
      backend: "auto" (the kernel on a Hopper GPU when it supports these inputs, else the
        reference), "kernel" (raise ValueError if it cannot run) or "reference" (pure JAX).

    Returns:
      o [..., Tq, Hq, D] in q's dtype, and with return_lse also lse [..., Hq, Tq] float32.
      A query that sees no key gets o = 0, lse = -inf and zero gradients.
    """
    check_attention_qkv(q, k, v, OP)
    scale = resolve_softmax_scale(softmax_scale, head_dim=q.shape[-1], op=OP)
    window_left, window_right = _check_window_size(window_size)
    check_bool(causal, "causal", OP)
    check_bool(return_lse, "return_lse", OP)
    check_backend_name(backend, OP)
    if causal:
        window_right = 0

    batch_shape = q.shape[:-3]
    q4, k4, v4 = (fold_batch_dims(x) for x in (q, k, v))
    resolved = choose_backend(q4, k4, v4, backend)
    if not return_lse:
        o = _attention(q4, k4, v4, scale, window_left, window_right, resolved)
        return o.reshape(batch_shape + o.shape[1:])
    o, lse = _attention_with_lse(q4, k4, v4, scale, window_left, window_right, resolved)
    return o.reshape(batch_shape + o.shape[1:]), lse.reshape(batch_shape + lse.shape[1:])


def choose_backend(q, k, v, backend: str, *, op: str = OP) -> str:
    """Resolve "auto" | "kernel" | "reference" to "kernel" or "reference" for rank-4 inputs."""
    unsupported = None
    if backend != "reference":
        unsupported = _kernels.attention_kernel_unsupported(q, k, v)
    return select_backend(backend, unsupported=unsupported, op=op)


# ----------------------------------------------------------------------------------------------
# The two halves of the computation, for rank-4 inputs and a resolved backend.


def attention_fwd_impl(q, k, v, *, scale, window_left, window_right, backend, local=False):
    """(o [B, Tq, Hq, D] in q's dtype, lse [B, Hq, Tq] float32) from the chosen backend.

    local=True: the arrays are already this device's shards (inside shard_map, as in ring
    attention) and the kernel is called directly, without the partitioning rule."""
    _check_resolved(backend)
    if backend == "kernel":
        # The kernel sees whole arrays; the partitioning rule lets a sharded jit run it once per
        # device on the local (batch, head) shard. (The reference needs no rule: XLA splits
        # plain JAX by itself.)
        wrap = _partitioning.on_local_shards if local else _partitioning.partitioned_attention_fwd
        kernel = wrap(_kernels.attention_fwd)
        return kernel(q, k, v, scale=scale, window_left=window_left, window_right=window_right)
    return reference_attention.attention_forward(q, k, v, scale=scale, window_left=window_left,
                                                 window_right=window_right)


def attention_bwd_impl(q, k, v, o, lse, do, *, scale, window_left, window_right, backend,
                       dlse=None, local=False):
    """(dq, dk, dv) in the dtypes of q, k, v for output cotangent `do` and, optionally, the
    cotangent `dlse` [B, Hq, Tq] of lse (None: lse is not differentiated, which is cheaper).

    The one dispatch point for the backward; backend="kernel" runs the backward kernel under
    the partitioning rule (not with local=True, as in attention_fwd_impl). o and lse are used
    as given (ring attention passes the global ones).
    """
    _check_resolved(backend)
    window = dict(scale=scale, window_left=window_left, window_right=window_right)
    if backend == "kernel":
        backward = (_partitioning.on_local_shards(_kernels.attention_bwd) if local else
                    _partitioning.partitioned_attention_bwd(_kernels.attention_bwd,
                                                            with_dlse=dlse is not None))
        return backward(q, k, v, o, lse, do, *(() if dlse is None else (dlse,)), **window)
    return _reference_backward(q, k, v, o, lse, do, dlse, **window)


def _reference_backward(q, k, v, o, lse, do, dlse=None, *, scale, window_left, window_right):
    dq, dk, dv = reference_attention.attention_backward(
        q, k, v, o, lse, do, scale=scale, window_left=window_left, window_right=window_right,
        dlse=dlse)
    # custom_vjp requires each cotangent in its primal's dtype.
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ----------------------------------------------------------------------------------------------
# Differentiation. The custom_vjp keeps autodiff away from the kernel (it has no JAX derivative)
# and from the reference's inner loop (its derivative would store every score block).
# Two versions, so that the common one (o only) never computes with a cotangent of lse. (Not
# custom_vjp's symbolic_zeros, which could tell the same apart: JAX does not support it inside
# shard_map or pmap.)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention(q, k, v, scale, window_left, window_right, backend):
    return attention_fwd_impl(q, k, v, scale=scale, window_left=window_left,
                              window_right=window_right, backend=backend)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention_with_lse(q, k, v, scale, window_left, window_right, backend):
    return attention_fwd_impl(q, k, v, scale=scale, window_left=window_left,
                              window_right=window_right, backend=backend)


def _forward_rule(q, k, v, scale, window_left, window_right, backend):
    o, lse = attention_fwd_impl(q, k, v, scale=scale, window_left=window_left,
                                window_right=window_right, backend=backend)
    return (o, lse), (q, k, v, o, lse)


def _attention_forward_rule(q, k, v, scale, window_left, window_right, backend):
    (o, _), residuals = _forward_rule(q, k, v, scale, window_left, window_right, backend)
    return o, residuals


def _attention_backward_rule(scale, window_left, window_right, backend, residuals, do):
    q, k, v, o, lse = residuals
    return attention_bwd_impl(q, k, v, o, lse, do, scale=scale, window_left=window_left,
                              window_right=window_right, backend=backend)


def _attention_with_lse_backward_rule(scale, window_left, window_right, backend, residuals,
                                      cotangents):
    q, k, v, o, lse = residuals
    do, dlse = cotangents
    return attention_bwd_impl(q, k, v, o, lse, do, scale=scale, window_left=window_left,
                              window_right=window_right, backend=backend, dlse=dlse)


_attention.defvjp(_attention_forward_rule, _attention_backward_rule)
_attention_with_lse.defvjp(_forward_rule, _attention_with_lse_backward_rule)


# ----------------------------------------------------------------------------------------------
# Argument checks of flash_attention only (those shared with ring_attention are in
# tk_jax/_checks.py). Every error names the argument, the value given and what is accepted.


def _check_window_size(window_size) -> tuple[int, int]:
    accepted = "a pair (window_left, window_right) of ints, each -1 (unbounded) or >= 0"
    if not isinstance(window_size, (tuple, list)) or not all(is_int(w) for w in window_size):
        raise TypeError(f"{OP}: window_size must be {accepted}, got {window_size!r}")
    if len(window_size) != 2 or any(w < -1 for w in window_size):
        raise ValueError(f"{OP}: window_size must be {accepted}, got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _check_resolved(backend) -> None:
    if backend not in RESOLVED_BACKENDS:
        raise ValueError(f"attention backend must be resolved to one of {RESOLVED_BACKENDS} "
                         f"(see choose_backend), got {backend!r}")


def fold_batch_dims(x: jax.Array) -> jax.Array:
    """[..., T, H, D] -> [B, T, H, D], B the product of the leading dims (a view, no copy)."""
    return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:])
