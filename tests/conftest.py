"""Shared test setup.

CPU runs get 8 host devices so sharding tests can build meshes; this must be set before JAX
initialises its backends, hence at import time here.
"""
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A fresh random generator per test; the seed is in the test's name on failure."""
    seed = int(np.random.SeedSequence().entropy % (2**32))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def hopper():
    """GPU tests need the compiled kernels and a Hopper GPU: fail loudly, never skip silently,
    when they were asked for (-m gpu) and cannot run."""
    from tk_jax import _backend

    why = _backend.kernel_unavailable_reason()
    if why is not None:
        pytest.fail(f"GPU tests need the kernels on a Hopper GPU: {why}")
    return True
