"""tk_jax.dot_product_attention: `jax.nn.dot_product_attention`'s arguments and semantics, on
tk_jax's attention wherever it can express the call.

(This module is not named after the function: tk_jax exports the function under that name,
which would hide a module of the same name.)

What maps onto tk_jax's attention (the kernel on a Hopper GPU, its pure-JAX reference
elsewhere): causal masks and local windows aligned top-left as jax.nn aligns them (query i
and key i on one diagonal, whatever Tq and Tk), sequence lengths, scale, GQA/MQA, rank-3
inputs. What does not (a dense `bias` or `mask`, dtypes other than bf16/fp16/fp32, a scale
that is not a positive Python number, negative window sizes) runs jax.nn's own XLA
implementation, with a warning once per reason; with implementation="tk" it raises instead.

One deliberate difference from jax.nn: a query row that sees no key at all (key_value
lengths of 0, or a window that leaves a row empty) gives o = 0 and lse = -inf with zero
gradients here (tk_jax's contract, and FlashAttention's), where jax.nn's XLA path fills the
masked scores with a large negative number and so returns the mean of all values for such a
row. Padded query rows (i >= query_seq_lengths) give 0 in both.
"""
from __future__ import annotations

import math
import numbers
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from tk_jax import _backend, _kernels
from tk_jax._checks import FLOAT_DTYPES, check_bool, check_index_array, is_int
from tk_jax.attention import AttentionMasks, attend

OP = "dot_product_attention"
IMPLEMENTATIONS = (None, "tk", "xla", "cudnn")

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """warnings.warn(message) the first time `key` comes up in this process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, stacklevel=3)


def dot_product_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                          bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                          scale: float | None = None, is_causal: bool = False,
                          query_seq_lengths: ArrayLike | None = None,
                          key_value_seq_lengths: ArrayLike | None = None,
                          local_window_size: int | tuple[int, int] | None = None,
                          implementation: str | None = None, return_residual: bool = False,
                          ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`jax.nn.dot_product_attention` with the same arguments and semantics, on tk_jax's kernels.

    Args:
      query: [B, T, N, H] or [T, N, H]; key, value: [B, S, K, H] or [S, K, H], N a multiple
        of K (GQA; query head n reads key/value head n // (N // K)). One dtype for all three.
      bias, mask: as in jax.nn (broadcastable to [B, N, T, S]; mask True = attend). Either one
        makes the call run jax.nn's XLA implementation (the kernels take no dense bias or
        mask), with a warning once; express masks with is_causal, local_window_size and the
        lengths (or tk_jax.flash_attention's segment ids) to stay on the kernels.
      scale: the logits' scale; None means 1 / sqrt(H).
      is_causal: query i sees keys j <= i (top-left aligned, as jax.nn: with T != S the first
        query lines up with the first key, unlike tk_jax.flash_attention's causal).
      query_seq_lengths, key_value_seq_lengths: [B] int32; only the first q_len queries and
        kv_len keys of a row take part (top-left aligned: the diagonal does not move).
      local_window_size: int w (meaning (w, w)) or (left, right): query i sees keys
        i - left <= j <= i + right.
      implementation: None (default): tk_jax's attention where it can express the call (the
        kernel on a Hopper GPU for bf16/fp16 and supported head dims, its pure-JAX reference
        elsewhere: the same semantics on every machine), else jax.nn's XLA path with a
        warning. "tk": the kernel only; raises ValueError where it cannot run. "xla" and
        "cudnn": jax.nn.dot_product_attention with that implementation, unchanged.
      return_residual: also return the logsumexp of the scaled, masked logits, [B, T, N] (or
        [T, N]) in the query's dtype, without gradient (as jax.nn returns it).

    Returns:
      [B, T, N, H] (or [T, N, H]) in the query's dtype, and the residual if asked for. A row
      that sees no key gives 0 (residual -inf) here, where jax.nn's XLA path gives the mean of
      all values; padded query rows give 0 in both.
    """
    if not (implementation is None or (isinstance(implementation, str)
                                       and implementation in IMPLEMENTATIONS)):
        raise ValueError(f"{OP}: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    check_bool(is_causal, "is_causal", OP)
    check_bool(return_residual, "return_residual", OP)
    if implementation in ("xla", "cudnn"):
        return _jax_nn(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                       key_value_seq_lengths, local_window_size, implementation, return_residual)

    query, key, value = _check_qkv(query, key, value)
    rank3 = query.ndim == 3
    q4, k4, v4 = (x[None] if rank3 else x for x in (query, key, value))
    batch = k4.shape[0]
    lengths = [None if x is None else check_index_array(x, name, (batch,), "one per batch row", OP)
               for x, name in ((query_seq_lengths, "query_seq_lengths"),
                               (key_value_seq_lengths, "key_value_seq_lengths"))]
    window = _check_local_window(local_window_size)

    reason = _why_not_tk(q4, bias, mask, scale, window)
    if reason is None and implementation == "tk":
        why = (_backend.kernel_unavailable_reason()
               or _kernels.attention_kernel_unsupported(q4, k4, v4))
        reason = None if why is None else ("kernel", why)
    if reason is not None:
        if implementation == "tk":
            raise ValueError(f"{OP}: implementation='tk' cannot run this call: {reason[1]}")
        warn_once(reason[0], f"{OP}: {reason[1]}; running jax.nn.dot_product_attention's XLA "
                             "implementation instead (this warning is shown once)")
        return _jax_nn(query, key, value, bias, mask, scale, is_causal, *lengths,
                       local_window_size, "xla", return_residual)

    window_left, window_right = window if window is not None else (-1, -1)
    if is_causal:
        window_right = 0
    head_dim = q4.shape[-1]
    out = attend(q4, k4, v4, scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
                 window_left=window_left, window_right=window_right,
                 masks=AttentionMasks(q_seq_lengths=lengths[0], kv_seq_lengths=lengths[1]),
                 bottom_right=False, return_lse=return_residual,
                 backend="kernel" if implementation == "tk" else "auto", op=OP)
    if not return_residual:
        return out[0] if rank3 else out
    o, lse = out
    residual = jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(query.dtype))
    return (o[0], residual[0]) if rank3 else (o, residual)


def _jax_nn(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
            key_value_seq_lengths, local_window_size, implementation, return_residual):
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation=implementation,
        return_residual=return_residual)


def _why_not_tk(query, bias, mask, scale, window) -> tuple[str, str] | None:
    """(key, sentence) saying why tk_jax's attention cannot express this call, or None."""
    if bias is not None:
        return "bias", "a dense bias is not supported by tk_jax's attention"
    if mask is not None:
        return "mask", ("a dense mask is not supported by tk_jax's attention (use is_causal, "
                        "local_window_size and the sequence lengths, or tk_jax.flash_attention's "
                        "segment ids)")
    if not any(query.dtype == jnp.dtype(d) for d in FLOAT_DTYPES):
        return "dtype", (f"dtype {query.dtype} is not supported by tk_jax's attention "
                         "(bfloat16, float16, float32)")
    if scale is not None:
        number = (isinstance(scale, numbers.Real)
                  and not isinstance(scale, (bool, np.bool_, np.ndarray, jax.Array)))
        if not number or not math.isfinite(float(scale)) or float(scale) <= 0:
            return "scale", (f"scale={scale!r} is not a positive finite Python number, which "
                             "tk_jax's attention needs (it is a static argument of the kernels)")
    if window is not None and min(window) < 0:
        return "window", (f"local_window_size={window} has a negative side, which tk_jax's "
                          "attention does not express")
    return None


def _check_qkv(query, key, value):
    """As jax.nn checks them: rank 3 or 4 alike, key and value one shape, query [B, T, N, H]
    with key's B and H, N a multiple of K, one dtype."""
    arrays = []
    for name, x in (("query", query), ("key", key), ("value", value)):
        x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        if x.ndim not in (3, 4):
            raise ValueError(f"{OP}: {name} must have rank 4 [B, T, N, H] or 3 [T, N, H], got "
                             f"shape {tuple(x.shape)}")
        arrays.append(x)
    query, key, value = arrays
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(f"{OP}: query, key and value must have the same rank, got shapes "
                         f"{query.shape}, {key.shape}, {value.shape}")
    if value.shape != key.shape:
        raise ValueError(f"{OP}: value must have key's shape {key.shape}, got {value.shape}")
    if query.shape[:-3] != key.shape[:-3] or query.shape[-1] != key.shape[-1]:
        raise ValueError(f"{OP}: query {query.shape} and key {key.shape} must agree in batch "
                         "size (axis 0) and head dim (last axis)")
    if key.shape[-2] == 0 or query.shape[-2] % key.shape[-2] != 0:
        raise ValueError(f"{OP}: the number of query heads ({query.shape[-2]}) must be a "
                         f"multiple of the number of key/value heads ({key.shape[-2]})")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"{OP}: query, key and value must have one dtype, got {query.dtype}, "
                         f"{key.dtype}, {value.dtype}")
    return query, key, value


def _check_local_window(local_window_size) -> tuple[int, int] | None:
    if local_window_size is None:
        return None
    if is_int(local_window_size):
        return int(local_window_size), int(local_window_size)
    if (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2
            and all(is_int(w) for w in local_window_size)):
        return int(local_window_size[0]), int(local_window_size[1])
    raise TypeError(f"{OP}: local_window_size must be None, an int or a pair (left, right) of "
                    f"ints, got {local_window_size!r}")
