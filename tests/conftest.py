"""Shared test setup.

CPU runs get 8 host devices so sharding tests can build meshes; this must be set before JAX
initialises its backends, hence at import time here.
"""
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np
import pytest

# What the kernel_path fixture gives the Based route where the extension is not built: the
# conventions of cpp/kernels/based/based.h (test_based_api.py checks them against the
# extension's where it is) and an H100 SXM's multiprocessor count, so that the sequence split
# decides as it would there.
BASED_CONVENTIONS_STAND_IN = {"feature_dim": 16, "num_features": 273, "chunk": 64,
                              "column_block": 64, "value_dims": (64, 128), "max_batch": 65535,
                              "max_heads": 65535}
MULTIPROCESSOR_COUNT_STAND_IN = 132


def pytest_runtest_logreport(report):
    """With TK_TEST_TIMES naming a file, each test phase's seconds and outcome are appended to
    it as the phase ends, so that a GPU run cut short by its time limit still says where its
    time went (pytest's --durations prints only at the end)."""
    path = os.environ.get("TK_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f} {report.when} {report.outcome} {report.nodeid}\n")


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


@pytest.fixture
def install_kernels(monkeypatch):
    """install(fake): pretend the kernels run on this machine, with the module `fake` standing
    in for the kernel wrappers tk_jax._kernels (for this test only). Every tk_jax module that
    imported the real wrappers gets the fake in their place."""
    import sys

    import tk_jax
    import tk_jax._backend
    import tk_jax._kernels

    real = tk_jax._kernels

    def install(fake):
        monkeypatch.setattr(tk_jax._backend, "kernel_unavailable_reason", lambda: None)
        monkeypatch.setitem(sys.modules, "tk_jax._kernels", fake)
        for name, module in list(sys.modules.items()):
            if name.partition(".")[0] == "tk_jax" and getattr(module, "_kernels", None) is real:
                monkeypatch.setattr(module, "_kernels", fake)

    return install


@pytest.fixture
def kernel_path(monkeypatch, install_kernels):
    """Pretend the kernels are available on this (CPU) machine: tk_jax._kernels is swapped for
    functions that run the reference, so the public functions take exactly the route they take
    on a GPU (partitioning rules, sequence split, custom_vjp wiring) and only the innermost
    function differs. Returns the backend name to pass ("kernel")."""
    import types

    import jax
    import jax.numpy as jnp

    from tk_jax import _kernels as real_kernels
    from tk_jax import _partitioning
    from tk_jax.reference.attention import attention_backward, attention_forward
    from tk_jax.reference.based import based_decode_step_reference, based_forward
    from tk_jax.reference.kvcache import kvcache_attention_forward

    # The masks (segment ids, lengths, bottom_right) are the reference's keyword arguments too.
    def attention_fwd(q, k, v, *, scale, window_left, window_right, **masks):
        return attention_forward(q, k, v, scale=scale, window_left=window_left,
                                 window_right=window_right, **masks)

    def attention_bwd(q, k, v, o, lse, do, dlse=None, *, scale, window_left, window_right,
                      **masks):
        grads = attention_backward(q, k, v, o, lse, do, scale=scale, window_left=window_left,
                                   window_right=window_right, dlse=dlse, **masks)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))

    def based_fwd(q, k, v, s0, z0, *, normalize, eps):
        y, (s, z) = based_forward(q, k, v, normalize=normalize, eps=eps, initial_state=(s0, z0))
        # den_t is num_t for a value column of ones (and the state column z).
        ones = jnp.ones(v.shape[:-1] + (1,), jnp.float32)
        den, _ = based_forward(q.astype(jnp.float32), k.astype(jnp.float32), ones,
                               normalize=False, eps=0.0, initial_state=(z0[..., None], z0))
        return y, s, z, jnp.swapaxes(den[..., 0], 1, 2)

    def based_bwd(q, k, v, y, den, dy, s0, z0, d_state, d_z, *, normalize, eps, with_dq=True):
        def forward(q, k, v, s0, z0):
            return based_forward(q, k, v, normalize=normalize, eps=eps, initial_state=(s0, z0))
        dq, *rest = jax.vjp(forward, q, k, v, s0, z0)[1]((dy, (d_state, d_z)))
        return (dq if with_dq else jnp.zeros_like(dq), *rest)

    def based_decode(q_t, k_t, v_t, s, z, *, normalize, eps):
        y, (s, z) = based_decode_step_reference(q_t, k_t, v_t, (s, z), normalize=normalize,
                                                eps=eps)
        return y, s, z

    def attention_kvcache(q, k_cache, v_cache, seqlens, page_table=None, *, scale, window_left,
                          window_right, num_splits=0):
        return kvcache_attention_forward(q, k_cache, v_cache, seqlens, page_table, scale=scale,
                                         window_left=window_left, window_right=window_right)

    module = types.ModuleType("tk_jax._kernels")
    module.attention_fwd = attention_fwd
    module.attention_bwd = attention_bwd
    module.attention_kernel_unsupported = lambda q, k, v: None
    module.attention_kvcache = attention_kvcache
    module.kvcache_kernel_unsupported = lambda q, k_cache, page_table: None
    module.based_fwd = based_fwd
    module.based_bwd = based_bwd
    module.based_kernel_unsupported = lambda q, k, v: None
    module.based_decode = based_decode
    module.based_decode_unsupported = lambda q_t, v_t: None
    module.based_conventions = lambda: real_kernels.based_conventions() or BASED_CONVENTIONS_STAND_IN
    module.multiprocessor_count = lambda: MULTIPROCESSOR_COUNT_STAND_IN
    for name in dir(real_kernels):  # its constants (importing it needs no extension)
        if name.isupper():
            setattr(module, name, getattr(real_kernels, name))
    install_kernels(module)
    monkeypatch.setattr(_partitioning, "_warned", set())  # one-time warnings start afresh
    return "kernel"
