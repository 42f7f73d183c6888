"""Bad arguments to tk_jax.flash_attention raise ValueError/TypeError naming the argument.

All checks run in Python before any computation, so these tests are cheap.
"""
from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tk_jax
import tk_jax._backend
from tk_jax.attention import flash_attention


def qkv(q_shape=(2, 8, 4, 16), kv_shape=(2, 10, 2, 16), dtype=jnp.float32):
    return (jnp.zeros(q_shape, dtype), jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype))


def expect(error_type, *fragments, **kwargs):
    """Call flash_attention(**kwargs) (q, k, v defaulting to valid arrays); check the error."""
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v)
    args.update(kwargs)
    with pytest.raises(error_type) as err:
        flash_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    message = str(err.value)
    assert message.startswith("flash_attention:"), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def output_shape(q, k, v, **kwargs):
    """Shape of flash_attention's output, traced but not compiled (cheap)."""
    return jax.eval_shape(functools.partial(flash_attention, **kwargs), q, k, v).shape


def test_valid_defaults_pass():
    q, k, v = qkv()
    assert output_shape(q, k, v) == q.shape


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_not_an_array(name):
    expect(TypeError, name, "must be an array", **{name: [[1.0, 2.0]]})


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_rank_below_4(name):
    expect(ValueError, name, "at least 4", "(8, 2, 16)", **{name: jnp.zeros((8, 2, 16))})


@pytest.mark.parametrize("name,value", [
    ("q", np.zeros((2, 8, 4, 16), np.float64)),
    ("k", jnp.zeros((2, 10, 2, 16), jnp.int32)),
    ("v", np.zeros((2, 10, 2, 16), np.float64)),
])
def test_unsupported_dtype(name, value):
    expect(TypeError, name, str(value.dtype), "bfloat16", **{name: value})


def test_mixed_dtypes():
    q, k, v = qkv()
    expect(ValueError, "dtype", "q: bfloat16", "k: float32", q=q.astype(jnp.bfloat16))
    expect(ValueError, "dtype", "v: float16", v=v.astype(jnp.float16))


def test_batch_mismatch():
    q, k, v = qkv(q_shape=(3, 8, 4, 16))
    expect(ValueError, "batch", "q: (3,)", "k: (2,)", q=q)
    q, k, v = qkv(q_shape=(1, 2, 8, 4, 16))  # different number of leading dims
    expect(ValueError, "batch", "q: (1, 2)", q=q)


def test_head_dim_mismatch():
    q, k, v = qkv(q_shape=(2, 8, 4, 32))
    expect(ValueError, "head_dim", "q: 32", "k: 16", q=q)


def test_k_v_shape_mismatch():
    expect(ValueError, "shape", "k: (2, 10, 2, 16)", "v: (2, 11, 2, 16)",
           v=jnp.zeros((2, 11, 2, 16)))
    expect(ValueError, "shape", "v: (2, 10, 1, 16)", v=jnp.zeros((2, 10, 1, 16)))


def test_zero_head_dim():
    q, k, v = qkv(q_shape=(2, 8, 4, 0), kv_shape=(2, 10, 2, 0))
    expect(ValueError, "head_dim", q=q, k=k, v=v)


@pytest.mark.parametrize("q_heads,kv_heads", [(3, 2), (2, 4), (4, 0)])
def test_heads_not_divisible(q_heads, kv_heads):
    q, k, v = qkv(q_shape=(2, 8, q_heads, 16), kv_shape=(2, 10, kv_heads, 16))
    expect(ValueError, "heads", f"q has {q_heads}", f"have {kv_heads}", q=q, k=k, v=v)


@pytest.mark.parametrize("scale", [0, -1, -0.5, float("nan"), float("inf"), -float("inf")])
def test_bad_scale_value(scale):
    expect(ValueError, "softmax_scale", "> 0", softmax_scale=scale)


@pytest.mark.parametrize("scale", [jnp.array(0.5), jnp.float32(0.5), np.array(0.5), "0.5",
                                   True, [0.5]])
def test_bad_scale_type(scale):
    expect(TypeError, "softmax_scale", "Python number", softmax_scale=scale)


def test_good_scale_types():
    q, k, v = qkv()
    for scale in (1, 0.25, np.float32(0.25), np.float64(0.25)):
        assert output_shape(q, k, v, softmax_scale=scale) == q.shape


@pytest.mark.parametrize("window,error", [
    ((-2, 0), ValueError), ((0, -5), ValueError), ((1,), ValueError), ((1, 2, 3), ValueError),
    (3, TypeError), (None, TypeError), ((1.5, 0), TypeError), ((True, 0), TypeError),
    ("ab", TypeError), ((jnp.array(1), 0), TypeError),
])
def test_bad_window_size(window, error):
    expect(error, "window_size", repr(window), "-1 (unbounded) or >= 0", window_size=window)


def test_good_window_sizes():
    q, k, v = qkv()
    for window in ((-1, -1), [0, 0], (5, -1), (np.int32(2), 3)):
        assert output_shape(q, k, v, window_size=window) == q.shape


@pytest.mark.parametrize("name", ["causal", "return_lse"])
@pytest.mark.parametrize("value", [1, "yes", None, jnp.array(True)])
def test_flags_must_be_bool(name, value):
    expect(TypeError, name, "bool", **{name: value})


@pytest.mark.parametrize("backend", ["cuda", "Kernel", None, ""])
def test_bad_backend(backend):
    expect(ValueError, "backend", repr(backend), "'auto', 'kernel', 'reference'", backend=backend)


def test_kernel_backend_where_unavailable():
    reason = tk_jax._backend.kernel_unavailable_reason()
    if reason is None:
        pytest.skip("the kernels can run on this machine")
    expect(ValueError, "backend='kernel'", reason, backend="kernel")


def test_unsupported_head_dim_matters_only_for_kernel_backend(install_kernels):
    # The kernels (pretend) run here, but not these inputs.
    module = types.ModuleType("tk_jax._kernels")
    module.attention_kernel_unsupported = lambda q, k, v: (
        "head_dim 16 is not supported (supported: 64, 128)")
    install_kernels(module)
    expect(ValueError, "backend='kernel'", "head_dim 16 is not supported", backend="kernel")
    q, k, v = qkv()
    assert output_shape(q, k, v, backend="auto") == q.shape  # falls back to reference
