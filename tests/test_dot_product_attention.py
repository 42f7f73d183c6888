"""tk_jax.dot_product_attention against jax.nn.dot_product_attention(implementation="xla"),
forward, residual and gradients, on configs with random sizes and masks; its fallback to XLA
for what the kernels cannot express (warned once, or refused with implementation="tk"); its
dispatch to the kernel with top-left alignment; its argument checks.

jax.nn and tk_jax agree everywhere but on rows that see no key at all (the documented
difference: tk_jax gives 0, jax.nn's XLA path the mean of all values): outputs are compared on
the other rows, and gradients with the output cotangent zeroed on those rows.
"""
from __future__ import annotations

import functools
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tk_jax
from tk_jax import jax_nn_compat

try:  # tests/ as a package, or tests/ on sys.path
    from tests.naive import attention_mask, relative_l2
except ImportError:
    from naive import attention_mask, relative_l2


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-process warnings afresh."""
    monkeypatch.setattr(jax_nn_compat, "_warned", set())


def draw_config(rng, name):
    """(query, key, value shapes, keyword arguments, dtype) of one named config, with random
    sizes and lengths."""
    b, n, h = int(rng.integers(1, 3)), 4, 8
    if name == "causal+window T>S GQA, empty rows":  # rows i > S + left see nothing (top-left)
        t, s = int(rng.integers(11, 15)), int(rng.integers(4, 8))
        return (b, t, n, h), (b, s, 2, h), dict(is_causal=True, local_window_size=(2, 1)), \
            jnp.float32
    if name == "rank 3, int window, scale":
        t = int(rng.integers(6, 12))
        return (t, 3, h), (t, 1, h), dict(local_window_size=3, scale=0.3), jnp.float32
    if name == "lengths with 0, window, T<S":
        t, s = int(rng.integers(5, 10)), int(rng.integers(10, 14))
        lengths = dict(query_seq_lengths=np.array([t, int(rng.integers(1, t)), 0], np.int32),
                       key_value_seq_lengths=np.array([int(rng.integers(1, s)), 0, s], np.int32))
        return (3, t, 2, h), (3, s, 1, h), dict(local_window_size=(1, 2), **lengths), jnp.float32
    if name == "bf16 causal lengths MQA":
        t = int(rng.integers(9, 14))
        lengths = dict(key_value_seq_lengths=rng.integers(1, t + 1, size=2).astype(np.int32))
        return (2, t, 4, 16), (2, t, 1, 16), dict(is_causal=True, **lengths), jnp.bfloat16
    raise KeyError(name)


CONFIGS = ["causal+window T>S GQA, empty rows", "rank 3, int window, scale",
           "lengths with 0, window, T<S", "bf16 causal lengths MQA"]


def visible(q_shape, k_shape, kwargs):
    """[B, T, S] visibility under jax.nn's rules, from tests/naive.py's mask (top-left)."""
    rank3 = len(q_shape) == 3
    b, t, s = (1 if rank3 else q_shape[0]), q_shape[-3], k_shape[-3]
    window = kwargs.get("local_window_size")
    left, right = (-1, -1) if window is None else (
        (window, window) if isinstance(window, int) else window)
    if kwargs.get("is_causal"):
        right = 0
    return attention_mask(b, t, s, left, right, bottom_right=False,
                          q_seq_lengths=kwargs.get("query_seq_lengths"),
                          kv_seq_lengths=kwargs.get("key_value_seq_lengths"))


def outputs_and_grads(attention, q, k, v, do):
    """jit: (o, residual, (dq, dk, dv)) of sum(o * do)."""
    def run(q, k, v, do):
        (o, residual), vjp = jax.vjp(lambda q, k, v: attention(q, k, v, return_residual=True),
                                     q, k, v)
        grads = vjp((do, jnp.zeros_like(residual)))
        return o, residual, grads
    return jax.jit(run)(q, k, v, do)


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_jax_nn_xla(rng, name):
    q_shape, k_shape, kwargs, dtype = draw_config(rng, name)
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), dtype)
                   for s in (q_shape, k_shape, k_shape, q_shape))
    mask = visible(q_shape, k_shape, kwargs)
    empty = ~mask.any(axis=-1)                   # [B, T]: rows that see no key (padded or not)
    empty_rows = empty[0] if len(q_shape) == 3 else empty
    # Rows that see no key: tk_jax 0, jax.nn the mean of V (or 0 when padded); compare the
    # others, with no cotangent on those rows so they add nothing to any gradient.
    do = jnp.where(jnp.asarray(empty_rows)[..., None, None], 0, do)

    o, residual, grads = outputs_and_grads(
        functools.partial(tk_jax.dot_product_attention, **kwargs), q, k, v, do)
    o_ref, residual_ref, grads_ref = outputs_and_grads(
        functools.partial(jax.nn.dot_product_attention, implementation="xla", **kwargs),
        q, k, v, do)

    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    assert o.shape == q.shape and o.dtype == q.dtype
    assert residual.shape == q.shape[:-1] and residual.dtype == q.dtype
    seen = ~empty_rows
    as64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    assert relative_l2(as64(o)[seen], as64(o_ref)[seen]) < tol
    assert np.all(as64(o)[empty_rows] == 0)
    assert relative_l2(as64(residual)[seen], as64(residual_ref)[seen]) < tol
    assert np.all(np.isneginf(as64(residual)[empty_rows]))
    for grad_name, g, g_ref in zip("qkv", grads, grads_ref):
        assert g.dtype == q.dtype
        err = relative_l2(as64(g), as64(g_ref))
        assert err < tol, f"d{grad_name}: relative L2 error {err:.3g}"


def test_configs_hold_rows_that_see_nothing(rng):
    """The documented difference shows up (rows emptied by the masks, not padded): jax.nn
    returns the mean of all values there, tk_jax 0."""
    q_shape, k_shape, kwargs, _ = draw_config(rng, "causal+window T>S GQA, empty rows")
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in (q_shape, k_shape, k_shape))
    empty = ~visible(q_shape, k_shape, kwargs).any(axis=-1)
    assert empty.any()
    o = tk_jax.dot_product_attention(q, k, v, **kwargs)
    o_xla = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    assert np.all(np.asarray(o)[empty] == 0)
    mean_v = np.repeat(np.asarray(v).mean(axis=1), q_shape[2] // k_shape[2], axis=1)  # [B, N, H]
    # A mean of unit normals can be near 0, where float32 summation order alone exceeds any
    # relative tolerance: atol covers that rounding (~1e-8 here), not a wrong value.
    np.testing.assert_allclose(np.asarray(o_xla)[empty],
                               np.broadcast_to(mean_v[:, None], o_xla.shape)[empty],
                               rtol=1e-5, atol=1e-6)
    # implementation="xla" is jax.nn's, unchanged.
    np.testing.assert_array_equal(
        tk_jax.dot_product_attention(q, k, v, implementation="xla", **kwargs), o_xla)


@pytest.mark.parametrize("what", ["bias", "mask", "array scale", "negative window"])
def test_what_the_kernels_cannot_express_runs_xla_and_warns_once(rng, what):
    q, k, v = (jnp.asarray(rng.standard_normal((2, 6, 2, 8)), jnp.float32) for _ in range(3))
    kwargs = {"bias": dict(bias=jnp.asarray(rng.standard_normal((2, 2, 6, 6)), jnp.float32)),
              "mask": dict(mask=jnp.asarray(rng.random((2, 1, 6, 6)) < 0.7)),
              "array scale": dict(scale=jnp.float32(0.3)),
              "negative window": dict(local_window_size=(-1, 3))}[what]
    with pytest.warns(UserWarning, match="^dot_product_attention: .*XLA implementation"):
        o = tk_jax.dot_product_attention(q, k, v, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once is enough
        tk_jax.dot_product_attention(q, k, v, **kwargs)
    np.testing.assert_array_equal(
        o, jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs))
    with pytest.raises(ValueError, match="^dot_product_attention: implementation='tk' cannot"):
        tk_jax.dot_product_attention(q, k, v, implementation="tk", **kwargs)


def test_tk_refuses_when_the_kernel_cannot_run():
    from tk_jax._backend import kernel_unavailable_reason
    reason = kernel_unavailable_reason()
    if reason is None:
        pytest.skip("the kernels can run on this machine")
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='tk' cannot run this call") as err:
        tk_jax.dot_product_attention(q, q, q, implementation="tk")
    assert reason in str(err.value)


def test_tk_runs_the_kernel_with_top_left_alignment(kernel_path, rng):
    """implementation="tk" on the kernel route: bottom_right=False and the lengths reach the
    kernel wrappers; results as jax.nn's (T != S, so the alignment matters)."""
    fake = sys.modules["tk_jax._kernels"]
    seen = []

    def recording(fn):
        def call(*args, **kwargs):
            seen.append((fn.__name__, kwargs.get("bottom_right"), "kv_seq_lengths" in kwargs))
            return fn(*args, **kwargs)
        call.__name__ = fn.__name__
        return call

    fake.attention_fwd = recording(fake.attention_fwd)
    fake.attention_bwd = recording(fake.attention_bwd)
    q, do = (jnp.asarray(rng.standard_normal((2, 5, 2, 8)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, 9, 2, 8)), jnp.float32) for _ in range(2))
    kwargs = dict(is_causal=True, key_value_seq_lengths=np.array([9, 3], np.int32))
    o, _, grads = outputs_and_grads(
        functools.partial(tk_jax.dot_product_attention, implementation="tk", **kwargs),
        q, k, v, do)
    o_ref, _, grads_ref = outputs_and_grads(
        functools.partial(jax.nn.dot_product_attention, **kwargs), q, k, v, do)
    assert ("attention_fwd", False, True) in seen and ("attention_bwd", False, True) in seen
    assert relative_l2(o, o_ref) < 2e-5
    for g, g_ref in zip(grads, grads_ref):
        assert relative_l2(g, g_ref) < 2e-5


@pytest.mark.parametrize("call, error, match", [
    (dict(implementation="flash"), ValueError, "implementation='flash' is not one of"),
    (dict(q=(1, 2, 6, 2, 8)), ValueError, r"query must have rank 4 \[B, T, N, H\] or 3"),
    (dict(q=(6, 2, 8)), ValueError, "same rank"),
    (dict(q=(2, 6, 3, 8)), ValueError, r"query heads \(3\) must be a multiple"),
    (dict(v=(2, 6, 2, 4)), ValueError, "value must have key's shape"),
    (dict(q=(2, 6, 2, 4)), ValueError, "head dim"),
    (dict(dtype_q=jnp.bfloat16), ValueError, "one dtype"),
    (dict(query_seq_lengths=np.ones(3, np.int32)), ValueError,
     r"query_seq_lengths must have shape \(2,\)"),
    (dict(key_value_seq_lengths=np.ones(2, np.float32)), TypeError,
     "key_value_seq_lengths must hold integers"),
    (dict(local_window_size="3"), TypeError, "local_window_size must be None, an int or a pair"),
    (dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size"),
    (dict(is_causal=1), TypeError, "is_causal must be True or False"),
])
def test_arguments_are_checked(call, error, match):
    shapes = dict(q=(2, 6, 2, 8), k=(2, 6, 2, 8), v=(2, 6, 2, 8))
    shapes.update({name: call.pop(name) for name in ("q", "k", "v") if name in call})
    dtype_q = call.pop("dtype_q", jnp.float32)
    q = jnp.zeros(shapes["q"], dtype_q)
    k, v = jnp.zeros(shapes["k"]), jnp.zeros(shapes["v"])
    with pytest.raises(error, match="^dot_product_attention: .*" + match):
        tk_jax.dot_product_attention(q, k, v, **call)


# ----------------------------------------------------------------------------------------------
# GPU: the kernels themselves through implementation="tk" (run with -m gpu on a Hopper GPU).

GPU_CONFIGS = {
    # name: (B, T, S, N, K, kwargs)
    "causal T<S GQA lengths": (2, 200, 333, 8, 2, dict(
        is_causal=True, query_seq_lengths=np.array([200, 77], np.int32),
        key_value_seq_lengths=np.array([333, 150], np.int32))),
    "window T>S MQA": (1, 300, 190, 4, 1, dict(local_window_size=(64, 17))),
    "full, lengths with 0": (3, 129, 129, 4, 4, dict(
        query_seq_lengths=np.array([129, 0, 50], np.int32),
        key_value_seq_lengths=np.array([1, 129, 0], np.int32))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_kernel_matches_jax_nn_on_gpu(hopper, rng, name, head_dim, dtype):
    """Forward, residual and gradients of the kernel (implementation="tk") against jax.nn's
    XLA path in float32 on the same half-precision values; rows that see no key compared
    as in test_matches_jax_nn_xla, outputs poisoned before each launch."""
    from gpu_util import poison_device_memory
    b, t, s, n, k_heads, kwargs = GPU_CONFIGS[name]
    q, do = (jnp.asarray(rng.standard_normal((b, t, n, head_dim)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, s, k_heads, head_dim)), dtype)
            for _ in range(2))
    empty = ~visible(q.shape, k.shape, kwargs).any(axis=-1)
    do = jnp.where(jnp.asarray(empty)[..., None, None], 0, do)
    poison_device_memory(8 * (q.size + k.size) * 4)
    o, residual, grads = outputs_and_grads(
        functools.partial(tk_jax.dot_product_attention, implementation="tk", **kwargs),
        q, k, v, do)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    o_ref, residual_ref, grads_ref = outputs_and_grads(
        functools.partial(jax.nn.dot_product_attention, implementation="xla", **kwargs), *f32)
    as64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    seen = ~empty
    assert np.isfinite(as64(o)).all() and all(np.isfinite(as64(g)).all() for g in grads)
    assert relative_l2(as64(o)[seen], as64(o_ref)[seen]) < 1e-2
    assert np.all(as64(o)[empty] == 0) and np.all(np.isneginf(as64(residual)[empty]))
    np.testing.assert_allclose(as64(residual)[seen], as64(residual_ref)[seen], rtol=2e-2,
                               atol=2e-2)
    for grad_name, g, g_ref in zip("qkv", grads, grads_ref):
        err = relative_l2(as64(g), as64(g_ref))
        assert err < 1e-2, f"d{grad_name}: relative L2 error {err:.3g}"
