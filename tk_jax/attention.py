"""Public softmax attention: validate the arguments, choose a backend, differentiate.

    flash_attention(q, k, v, ...)              checks arguments, folds batch dims into B
      -> _attention / _attention_with_lse      (jax.custom_vjp) rank-4 [B, T, H, D] from here on
           forward:  attention_fwd_impl         kernel or reference forward -> (o, lse)
           backward: attention_bwd_impl         kernel or reference backward -> (dq, dk, dv)

The backend is resolved to "kernel" or "reference" in Python, while tracing, before any custom
call is emitted (see tk_jax/_backend.py). The kernel path goes through the partitioning rule of
tk_jax/sharding.py, so that a sharded jit runs it per device on (batch, head) shards.
attention_fwd_impl and attention_bwd_impl are also the building blocks of ring attention, which
calls them on one block of the sequence at a time.
"""
from __future__ import annotations

import functools
import math
import numbers

import jax
import numpy as np

from tk_jax._backend import BACKENDS, select_backend
from tk_jax._checks import check_array, check_positive_finite, check_same
from tk_jax.reference import attention as reference_attention

OP = "flash_attention"
RESOLVED_BACKENDS = ("kernel", "reference")


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                    return_lse=False, backend="auto"):
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
    _check_qkv(q, k, v)
    scale = _resolve_scale(softmax_scale, head_dim=q.shape[-1])
    window_left, window_right = _check_window_size(window_size)
    _check_bool(causal, "causal")
    _check_bool(return_lse, "return_lse")
    _check_backend_name(backend)
    if causal:
        window_right = 0

    batch_shape = q.shape[:-3]
    q4, k4, v4 = (_fold_batch_dims(x) for x in (q, k, v))
    resolved = choose_backend(q4, k4, v4, backend)
    if not return_lse:
        o = _attention(q4, k4, v4, scale, window_left, window_right, resolved)
        return o.reshape(batch_shape + o.shape[1:])
    o, lse = _attention_with_lse(q4, k4, v4, scale, window_left, window_right, resolved)
    return o.reshape(batch_shape + o.shape[1:]), lse.reshape(batch_shape + lse.shape[1:])


def choose_backend(q, k, v, backend: str, *, op: str = OP) -> str:
    """Resolve "auto" | "kernel" | "reference" to "kernel" or "reference" for rank-4 inputs."""
    unsupported = None
    if backend != "reference":  # the reference needs no kernel, so don't import the wrappers
        try:
            from tk_jax import _kernels
        except ImportError as err:
            unsupported = f"the kernel wrappers (tk_jax._kernels) failed to import: {err}"
        else:
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
        from tk_jax import _kernels, sharding
        # The kernel sees whole arrays; the partitioning rule lets a sharded jit run it once per
        # device on the local (batch, head) shard. (The reference needs no rule: XLA splits
        # plain JAX by itself.)
        kernel = (sharding.on_local_shards if local else sharding.partitioned_attention_fwd)(
            _kernels.attention_fwd)
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
        from tk_jax import _kernels, sharding
        backward = (sharding.on_local_shards(_kernels.attention_bwd) if local else
                    sharding.partitioned_attention_bwd(_kernels.attention_bwd,
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
# Argument checks. Every error names the argument, the value given and what is accepted.


def _check_qkv(q, k, v, *, op=OP):
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(x, name, min_ndim=4, op=op)
    check_same({"q": q.dtype, "k": k.dtype, "v": v.dtype}, "dtype", op)
    check_same({"q": q.shape[:-3], "k": k.shape[:-3], "v": v.shape[:-3]},
               "leading batch dimensions (all but the last three)", op)
    check_same({"q": q.shape[-1], "k": k.shape[-1], "v": v.shape[-1]},
               "head_dim (the last dimension)", op)
    check_same({"k": k.shape, "v": v.shape}, "shape", op)
    if q.shape[-1] == 0:
        raise ValueError(f"{op}: q has head_dim 0 (shape {tuple(q.shape)}); head_dim must be >= 1")
    q_heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(
            f"{op}: q has {q_heads} heads and k, v have {kv_heads} (axis -2); the number of q "
            f"heads must be a positive multiple of the number of k/v heads")


def _resolve_scale(softmax_scale, *, head_dim: int, op=OP) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    # The scale is a static attribute of the kernel, so it must be a concrete Python number:
    # a JAX array (possibly traced) is refused even when it holds one element.
    is_number = isinstance(softmax_scale, numbers.Real) and not isinstance(
        softmax_scale, (bool, np.bool_, np.ndarray, jax.Array))
    if not is_number:
        raise TypeError(
            f"{op}: softmax_scale must be None or a positive finite Python number, got "
            f"{type(softmax_scale).__name__} {softmax_scale!r}")
    return check_positive_finite(softmax_scale, "softmax_scale", op)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _check_window_size(window_size) -> tuple[int, int]:
    accepted = "a pair (window_left, window_right) of ints, each -1 (unbounded) or >= 0"
    if not isinstance(window_size, (tuple, list)) or not all(_is_int(w) for w in window_size):
        raise TypeError(f"{OP}: window_size must be {accepted}, got {window_size!r}")
    if len(window_size) != 2 or any(w < -1 for w in window_size):
        raise ValueError(f"{OP}: window_size must be {accepted}, got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _check_bool(value, name: str, *, op=OP) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be a Python bool (True or False), "
                        f"got {type(value).__name__} {value!r}")


def _check_backend_name(backend, *, op=OP) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} is not one of {BACKENDS}")


def _check_resolved(backend) -> None:
    if backend not in RESOLVED_BACKENDS:
        raise ValueError(f"attention backend must be resolved to one of {RESOLVED_BACKENDS} "
                         f"(see choose_backend), got {backend!r}")


def _fold_batch_dims(x):
    """[..., T, H, D] -> [B, T, H, D], B the product of the leading dims (a view, no copy)."""
    return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:])
