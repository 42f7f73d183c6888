"""Helpers for GPU tests: relative error and output poisoning."""
import jax.numpy as jnp
import numpy as np


def rel_l2(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def poison_device_memory(nbytes: int) -> None:
    """Fill then free a NaN buffer so the allocator hands the next outputs memory that holds
    NaN rather than an earlier (possibly correct) result: unwritten outputs then show up."""
    n = max(nbytes // 4, 1)
    x = jnp.full((n,), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x


def assert_matches(actual, expected, tol=1e-2):
    """(o, (dq, dk, dv)) of a sharded run against the one-GPU run: every array finite and
    within `tol` relative L2 (bf16)."""
    (o, grads), (o_ref, grads_ref) = actual, expected
    errors = {}
    for name, x, x_ref in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref)):
        x = np.asarray(jnp.asarray(x, jnp.float32))
        x_ref = np.asarray(jnp.asarray(x_ref, jnp.float32))
        assert x.shape == x_ref.shape, f"{name}: shape {x.shape}, expected {x_ref.shape}"
        assert np.isfinite(x).all(), f"{name}: non-finite values"
        errors[name] = rel_l2(x, x_ref)
    print("relative L2 vs one GPU:", {k: f"{v:.2e}" for k, v in errors.items()})
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"relative L2 error >= {tol} against one GPU: {bad}"
