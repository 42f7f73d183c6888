"""Choosing between the compiled kernel and the pure-JAX reference.

The choice is made in Python while tracing, before any custom call is emitted: a CUDA custom
call that reaches a CPU-only runtime fails with NOT_FOUND, so it must never be emitted there.
"""
from __future__ import annotations

import functools

import jax

from tk_jax import _ext
from tk_jax._checks import check_backend_name


@functools.lru_cache(maxsize=None)
def hopper_device_reason() -> str | None:
    """None when the default device is a Hopper GPU (sm_90), else why not."""
    try:
        device = jax.devices()[0]
    except RuntimeError as err:  # no backend at all
        return f"no JAX device ({err})"
    if device.platform != "gpu":
        return f"default device is {device.platform!r}, not a CUDA GPU"
    capability = str(getattr(device, "compute_capability", ""))
    if not capability.startswith("9."):
        return f"GPU compute capability is {capability or 'unknown'}, kernels need 9.0 (Hopper)"
    return None


def kernel_unavailable_reason() -> str | None:
    """None when compiled kernels can run on the default device, else why not."""
    ok, why = _ext.kernels_available()
    if not ok:
        return why
    return hopper_device_reason()


def select_backend(backend: str, *, unsupported: str | None, op: str) -> str:
    """Resolve `backend` to "kernel" or "reference".

    `unsupported` is None when the kernel handles these inputs, else a sentence saying why not.
    """
    check_backend_name(backend, op)
    if backend == "reference":
        return "reference"
    why_not = kernel_unavailable_reason() or unsupported
    if why_not is None:
        return "kernel"
    if backend == "kernel":
        raise ValueError(f"{op}: backend='kernel' cannot run here: {why_not}")
    return "reference"
