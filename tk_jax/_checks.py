"""Input checks shared by the public functions. Each error names the function (`op`), the
argument, what was given and what is accepted."""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
BACKENDS = ("auto", "kernel", "reference")


def check_array(x, name: str, *, min_ndim: int, dtypes=FLOAT_DTYPES, op: str) -> None:
    """`x` is an array of at least `min_ndim` dimensions with one of `dtypes`."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
    if x.ndim < min_ndim:
        raise ValueError(
            f"{op}: {name} must have at least {min_ndim} dimensions, got shape {tuple(x.shape)}")
    if not any(x.dtype == jnp.dtype(d) for d in dtypes):
        accepted = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"{op}: {name} has dtype {x.dtype}, accepted: {accepted}")


def check_same(values: dict, what: str, op: str) -> None:
    """All values in {argument name: value} are equal (e.g. batch shapes or dtypes)."""
    if len(set(values.values())) > 1:
        listing = ", ".join(f"{name}: {value}" for name, value in values.items())
        raise ValueError(f"{op}: {what} must match across {', '.join(values)}; got {listing}")


def check_positive_finite(value, name: str, op: str) -> float:
    """A positive finite Python number (static attributes of kernels must be concrete)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: {name} must be a Python number, got {value!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{op}: {name} must be finite and > 0, got {value}")
    return value


def check_bool(value, name: str, op: str) -> bool:
    """A Python (or numpy) bool: flags pick the compiled computation, so they must be concrete
    and unambiguous (1 or "yes" are refused)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be True or False (a Python bool), "
                        f"got {type(value).__name__} {value!r}")
    return bool(value)


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def check_backend_name(backend, op: str) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} is not one of {BACKENDS}")


# ----------------------------------------------------------------------------------------------
# Softmax attention (flash_attention and ring_attention take the same q, k, v and scale).


def check_window(window_size, causal, op: str) -> tuple[int, int]:
    """(window_left, window_right) from `window_size`, a pair of ints each -1 (unbounded) or
    >= 0, and the bool `causal`, which sets window_right to 0."""
    accepted = "a pair (window_left, window_right) of ints, each -1 (unbounded) or >= 0"
    if not isinstance(window_size, (tuple, list)) or not all(is_int(w) for w in window_size):
        raise TypeError(f"{op}: window_size must be {accepted}, got {window_size!r}")
    if len(window_size) != 2 or any(w < -1 for w in window_size):
        raise ValueError(f"{op}: window_size must be {accepted}, got {window_size!r}")
    check_bool(causal, "causal", op)
    return int(window_size[0]), 0 if causal else int(window_size[1])


def check_attention_qkv(q, k, v, op: str) -> None:
    """q [..., Tq, Hq, D], k and v [..., Tk, Hkv, D]: one float dtype, the same leading batch
    dims and head_dim, Hq a positive multiple of Hkv."""
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


def resolve_softmax_scale(softmax_scale, *, head_dim: int, op: str) -> float:
    """softmax_scale as a float; None means 1 / sqrt(head_dim)."""
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


def check_index_array(x, name: str, shape: tuple[int, ...], what: str, op: str) -> jax.Array:
    """An integer array of exactly `shape` (`what` says what its axes are, for the message),
    returned as int32. Python ints, lists and NumPy arrays are converted; booleans and floats
    are refused (they are almost always a mask or a bug, not ids or lengths)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        try:
            x = np.asarray(x)
        except (TypeError, ValueError):
            raise TypeError(f"{op}: {name} must be an integer array of shape {shape} ({what}), "
                            f"got {type(x).__name__}") from None
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{op}: {name} must hold integers (int32) of shape {shape} ({what}), "
                        f"got dtype {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)} ({what}), got shape "
                         f"{tuple(x.shape)}")
    return jnp.asarray(x, jnp.int32)
