"""Input checks shared by the public functions. Each error names the argument, what was given
and what is accepted."""
from __future__ import annotations

import math

import jax.numpy as jnp

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


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
