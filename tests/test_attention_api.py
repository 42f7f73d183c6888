"""tk_jax.flash_attention on CPU: results against float64 naive attention, and composition with
jit, grad, vmap and checkpoint, extra batch dims, return_lse (and its gradient), masks, GQA.

Every test draws fresh random inputs; the seed is in each failure message, and TK_TEST_SEED=<n>
replays one. Shapes are small and odd (no multiples of tile sizes) to keep the suite fast.
"""
from __future__ import annotations

import functools
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tk_jax._backend import kernel_unavailable_reason
from tk_jax.attention import flash_attention
from tk_jax.reference.attention import attention_backward, attention_forward

try:  # tests/ as a package, or tests/ on sys.path (pytest's default rootdir-less import)
    from tests.naive import (attention_mask, naive_attention, naive_attention_grads,
                             relative_l2, visible_mask)
except ImportError:
    from naive import (attention_mask, naive_attention, naive_attention_grads, relative_l2,
                       visible_mask)

# Relative L2 error allowed against float64, by input dtype (bf16/fp16 inputs are rounded to
# their dtype before the naive computation, so this measures the computation, not the rounding
# of the inputs; the output's own rounding remains).
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def fresh_rng():
    seed = int(os.environ.get("TK_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    return np.random.default_rng(seed), seed


def random_qkv(rng, *, batch=(2,), tq=13, tk=13, hq=2, hkv=2, d=16, dtype=jnp.float32):
    q = rng.standard_normal(batch + (tq, hq, d))
    k = rng.standard_normal(batch + (tk, hkv, d))
    v = rng.standard_normal(batch + (tk, hkv, d))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def random_like(rng, x):
    return jnp.asarray(rng.standard_normal(x.shape), x.dtype)


def assert_close(actual, expected, what, seed, tol=TOLERANCE[jnp.float32]):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values (seed={seed})"
    err = relative_l2(actual, expected)
    assert err < tol, f"{what}: relative L2 error {err:.3g} >= {tol} (seed={seed})"


def assert_lse_close(actual, expected, what, seed):
    """Same -inf pattern (rows that see no key), finite entries close."""
    actual = np.asarray(actual)
    assert actual.dtype == np.float32, f"{what}: lse dtype {actual.dtype}, expected float32"
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected),
                                  err_msg=f"{what}: -inf pattern differs (seed={seed})")
    finite = np.isfinite(expected)
    if finite.any():
        assert_close(actual[finite], expected[finite], what, seed)


def loss_and_grads(fn, q, k, v, do):
    """o and (dq, dk, dv) of sum(o * do) through jax.grad (all three arguments)."""
    o = fn(q, k, v)
    grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * do),
                     argnums=(0, 1, 2))(q, k, v)
    return o, grads


# Each case: (name, shapes for random_qkv, flash_attention kwargs, the (window_left,
# window_right) the naive oracle should apply).
CASES = [
    ("full", dict(tq=13, tk=13), dict(), (-1, -1)),
    ("causal Tq<Tk GQA", dict(tq=7, tk=19, hq=4, hkv=2), dict(causal=True), (-1, 0)),
    ("causal Tq>Tk (empty rows)", dict(tq=19, tk=7), dict(causal=True), (-1, 0)),
    ("window (3,2)", dict(tq=17, tk=17), dict(window_size=(3, 2)), (3, 2)),
    ("causal + left window, MQA", dict(tq=11, tk=16, hq=3, hkv=1),
     dict(causal=True, window_size=(4, 7)), (4, 0)),  # causal replaces the right bound
    ("right window only, Tq>Tk", dict(tq=12, tk=9), dict(window_size=(-1, 2)), (-1, 2)),
    ("softmax_scale", dict(tq=9, tk=14, d=8), dict(softmax_scale=0.37), (-1, -1)),
]


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("name,shapes,kwargs,window", CASES, ids=[c[0] for c in CASES])
def test_matches_naive(backend, name, shapes, kwargs, window):
    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, **shapes)
    do = random_like(rng, q)
    scale = kwargs.get("softmax_scale", 1 / np.sqrt(q.shape[-1]))
    o_ref, lse_ref = naive_attention(q, k, v, scale, *window)
    grads_ref = naive_attention_grads(q, k, v, do, scale, *window)

    fn = functools.partial(flash_attention, backend=backend, **kwargs)
    o, grads = loss_and_grads(fn, q, k, v, do)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert_close(o, o_ref, f"{name} o", seed)
    for grad_name, grad, ref in zip("qkv", grads, grads_ref):
        assert_close(grad, ref, f"{name} d{grad_name}", seed)
    _, lse = fn(q, k, v, return_lse=True)
    assert_lse_close(lse, lse_ref, f"{name} lse", seed)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(dtype):
    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, tq=10, tk=21, hq=4, hkv=1, dtype=dtype)
    do = random_like(rng, q)
    scale = 1 / np.sqrt(q.shape[-1])
    o, grads = loss_and_grads(functools.partial(flash_attention, causal=True), q, k, v, do)
    assert o.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert_close(o, naive_attention(q, k, v, scale, -1, 0)[0], "o", seed, TOLERANCE[dtype])
    for grad_name, grad, ref in zip("qkv", grads, naive_attention_grads(q, k, v, do, scale, -1, 0)):
        assert_close(grad, ref, f"d{grad_name}", seed, TOLERANCE[dtype])


def test_empty_rows_are_zero():
    """Tq > Tk with causal: the first Tq - Tk queries see no key."""
    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, tq=9, tk=4)
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    dq = jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, causal=True)))(q)
    empty = ~visible_mask(9, 4, -1, 0).any(axis=1)
    assert empty.sum() == 5
    assert np.all(np.asarray(o)[:, empty] == 0), f"seed={seed}"
    assert np.all(np.isneginf(np.asarray(lse)[:, :, empty])), f"seed={seed}"
    assert np.all(np.asarray(dq)[:, empty] == 0), f"seed={seed}"
    assert np.all(np.isfinite(np.asarray(dq))), f"seed={seed}"


def test_jit_and_grad():
    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, tq=11, tk=15, hq=4, hkv=2)
    do = random_like(rng, q)
    scale = 1 / np.sqrt(q.shape[-1])
    jitted = jax.jit(functools.partial(flash_attention, causal=True))
    o, grads = loss_and_grads(jitted, q, k, v, do)
    grads_jit = jax.jit(jax.grad(
        lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True) * do),
        argnums=(0, 1, 2)))(q, k, v)
    assert_close(o, naive_attention(q, k, v, scale, -1, 0)[0], "jit o", seed)
    for grad_name, g, gj, ref in zip("qkv", grads, grads_jit,
                                     naive_attention_grads(q, k, v, do, scale, -1, 0)):
        assert_close(g, ref, f"grad of jit d{grad_name}", seed)
        assert_close(gj, ref, f"jit of grad d{grad_name}", seed)


def test_extra_leading_batch_dims():
    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, batch=(2, 3), tq=6, tk=10)
    do = random_like(rng, q)
    scale = 1 / np.sqrt(q.shape[-1])
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert o.shape == (2, 3, 6, 2, 16) and lse.shape == (2, 3, 2, 6)
    flat = [x.reshape((6,) + x.shape[2:]) for x in (q, k, v, do)]
    o_ref, lse_ref = naive_attention(*flat[:3], scale, -1, 0)
    assert_close(o.reshape(o_ref.shape), o_ref, "o", seed)
    assert_lse_close(lse.reshape(lse_ref.shape), lse_ref, "lse", seed)
    _, grads = loss_and_grads(functools.partial(flash_attention, causal=True), q, k, v, do)
    for grad_name, grad, ref in zip("qkv", grads, naive_attention_grads(*flat, scale, -1, 0)):
        assert grad.shape == q.shape[:2] + ref.shape[1:]
        assert_close(grad.reshape(ref.shape), ref, f"d{grad_name}", seed)


def test_vmap_over_extra_axis():
    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, batch=(3, 2), tq=7, tk=9, hq=2, hkv=1)
    do = random_like(rng, q)
    scale = 1 / np.sqrt(q.shape[-1])
    fn = functools.partial(flash_attention, window_size=(2, 1))
    o = jax.vmap(fn)(q, k, v)
    grads = jax.vmap(jax.grad(lambda q, k, v, do: jnp.sum(fn(q, k, v) * do),
                              argnums=(0, 1, 2)))(q, k, v, do)
    for i in range(3):
        assert_close(o[i], naive_attention(q[i], k[i], v[i], scale, 2, 1)[0], f"o[{i}]", seed)
        refs = naive_attention_grads(q[i], k[i], v[i], do[i], scale, 2, 1)
        for grad_name, grad, ref in zip("qkv", grads, refs):
            assert_close(grad[i], ref, f"d{grad_name}[{i}]", seed)


def test_vmap_only_q_mapped():
    """Several query sets against one shared k, v: per-example gradients of k and v."""
    rng, seed = fresh_rng()
    q, _, _ = random_qkv(rng, batch=(3, 2), tq=5, tk=5, hq=4)
    _, k, v = random_qkv(rng, batch=(2,), tq=5, tk=8, hkv=2)
    do = random_like(rng, q)
    scale = 1 / np.sqrt(q.shape[-1])
    fn = functools.partial(flash_attention, causal=True)
    o = jax.vmap(fn, in_axes=(0, None, None))(q, k, v)
    grads = jax.vmap(jax.grad(lambda q, k, v, do: jnp.sum(fn(q, k, v) * do), argnums=(0, 1, 2)),
                     in_axes=(0, None, None, 0))(q, k, v, do)
    assert grads[1].shape == (3,) + k.shape
    for i in range(3):
        assert_close(o[i], naive_attention(q[i], k, v, scale, -1, 0)[0], f"o[{i}]", seed)
        refs = naive_attention_grads(q[i], k, v, do[i], scale, -1, 0)
        for grad_name, grad, ref in zip("qkv", grads, refs):
            assert_close(grad[i], ref, f"d{grad_name}[{i}]", seed)


def test_jit_vmap_grad_together():
    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, batch=(2, 1), tq=6, tk=11, hq=2, hkv=2, d=8)
    do = random_like(rng, q)
    scale = 0.5

    def loss(q, k, v, do):
        o, lse = flash_attention(q, k, v, causal=True, softmax_scale=scale, return_lse=True)
        return jnp.sum(o * do)

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, do)
    for i in range(2):
        refs = naive_attention_grads(q[i], k[i], v[i], do[i], scale, -1, 0)
        for grad_name, grad, ref in zip("qkv", grads, refs):
            assert_close(grad[i], ref, f"d{grad_name}[{i}]", seed)


def test_checkpoint():
    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, tq=8, tk=12, hq=2, hkv=1)
    do = random_like(rng, q)
    scale = 1 / np.sqrt(q.shape[-1])
    attention = jax.checkpoint(functools.partial(flash_attention, window_size=(3, -1)))
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v) * do),
                             argnums=(0, 1, 2)))(q, k, v)
    for grad_name, grad, ref in zip("qkv", grads,
                                    naive_attention_grads(q, k, v, do, scale, 3, -1)):
        assert_close(grad, ref, f"checkpoint d{grad_name}", seed)


def naive_lse_float64(q, k, scale, window_left, window_right):
    """Differentiable float64 logsumexp of the masked scores, [B, Hq, Tq] (jnp, under x64)."""
    tq, hq, tk, hkv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    k = jnp.repeat(k, hq // hkv, axis=2)
    s = scale * jnp.einsum("bqhd,bkhd->bhqk", q, k)
    s = jnp.where(visible_mask(tq, tk, window_left, window_right), s, -jnp.inf)
    return jax.nn.logsumexp(s, axis=-1)


def test_return_lse_and_its_gradient():
    """Differentiating through lse (alone, and together with o) against float64 autodiff."""
    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, tq=9, tk=14, hq=4, hkv=2)
    scale = 1 / np.sqrt(q.shape[-1])
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert o.shape == q.shape and lse.shape == (2, 4, 9) and lse.dtype == jnp.float32
    dlse = rng.standard_normal(lse.shape)
    do = random_like(rng, q)

    def lse_loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=True, return_lse=True)[1] * dlse)

    def both_loss(q, k, v):
        o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
        return jnp.sum(o * do) + jnp.sum(lse * dlse)

    with jax.enable_x64(True):
        q64, k64 = (jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k))
        lse64 = jax.jit(naive_lse_float64, static_argnums=(2, 3, 4))(q64, k64, scale, -1, 0)
        dq64, dk64 = jax.jit(jax.grad(  # jit: one compile instead of one per operation
            lambda q, k: jnp.sum(naive_lse_float64(q, k, scale, -1, 0) * dlse),
            argnums=(0, 1)))(q64, k64)
        dq64, dk64, lse64 = (np.asarray(x) for x in (dq64, dk64, lse64))
    assert_lse_close(lse, lse64, "lse", seed)

    dq, dk, dv = jax.jit(jax.grad(lse_loss, argnums=(0, 1, 2)))(q, k, v)
    assert_close(dq, dq64, "lse-only dq", seed)
    assert_close(dk, dk64, "lse-only dk", seed)
    assert np.all(np.asarray(dv) == 0), "lse does not depend on v"

    grads = jax.grad(both_loss, argnums=(0, 1, 2))(q, k, v)
    refs = naive_attention_grads(q, k, v, do, scale, -1, 0, dlse=dlse)
    for grad_name, grad, ref in zip("qkv", grads, refs):
        assert_close(grad, ref, f"o+lse d{grad_name}", seed)


def test_return_lse_false_returns_one_array():
    rng, _ = fresh_rng()
    q, k, v = random_qkv(rng, tq=4, tk=4)
    assert isinstance(flash_attention(q, k, v), jax.Array)
    assert len(flash_attention(q, k, v, return_lse=True)) == 2


def test_kernel_backend_unavailable_on_cpu():
    reason = kernel_unavailable_reason()
    if reason is None:
        pytest.skip("the kernels can run on this machine")
    rng, _ = fresh_rng()
    q, k, v = random_qkv(rng, tq=8, tk=8, d=64)
    with pytest.raises(ValueError, match="backend='kernel'") as err:
        flash_attention(q, k, v, backend="kernel")
    assert reason in str(err.value)
    with pytest.raises(ValueError, match="backend='kernel'"):  # also while tracing
        jax.jit(functools.partial(flash_attention, backend="kernel"))(q, k, v)


def install_recording_kernels(install_kernels, record) -> types.ModuleType:
    """Pretend kernels, computed by the reference, that first call
    record(kind "fwd" | "bwd", (q, k, v), scale, window_left, window_right, masks); returns
    the module installed."""
    def attention_fwd(q, k, v, *, scale, window_left, window_right, **masks):
        record("fwd", (q, k, v), scale, window_left, window_right, masks)
        return attention_forward(q, k, v, scale=scale, window_left=window_left,
                                 window_right=window_right, **masks)

    def attention_bwd(q, k, v, o, lse, do, dlse=None, *, scale, window_left, window_right,
                      **masks):
        record("bwd", (q, k, v), scale, window_left, window_right, masks)
        grads = attention_backward(q, k, v, o, lse, do, scale=scale, window_left=window_left,
                                   window_right=window_right, dlse=dlse, **masks)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))

    module = types.ModuleType("tk_jax._kernels")
    module.attention_fwd = attention_fwd
    module.attention_bwd = attention_bwd
    module.attention_kernel_unsupported = lambda q, k, v: None
    install_kernels(module)
    return module


def test_auto_dispatches_to_kernel_when_available(install_kernels):
    """With the kernels (pretend) available, "auto" calls tk_jax._kernels.attention_fwd and
    attention_bwd with rank-4 inputs and the resolved scale and window."""
    calls = []

    def record(kind, arrays, scale, window_left, window_right, masks):
        assert not masks
        q, k, _ = arrays
        calls.append((q.shape, k.shape, scale, window_left, window_right) if kind == "fwd"
                     else ("bwd", q.shape, scale, window_left, window_right))

    install_recording_kernels(install_kernels, record)

    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, batch=(2, 3), tq=5, tk=7)
    do = random_like(rng, q)
    o, grads = loss_and_grads(
        functools.partial(flash_attention, causal=True, window_size=(2, 5), softmax_scale=0.3),
        q, k, v, do)
    assert calls and calls[0] == ((6, 5, 2, 16), (6, 7, 2, 16), 0.3, 2, 0)
    assert ("bwd", (6, 5, 2, 16), 0.3, 2, 0) in calls
    flat = [x.reshape((6,) + x.shape[2:]) for x in (q, k, v, do)]
    assert_close(o.reshape((6,) + o.shape[2:]), naive_attention(*flat[:3], 0.3, 2, 0)[0], "o", seed)
    for grad_name, grad, ref in zip("qkv", grads, naive_attention_grads(*flat, 0.3, 2, 0)):
        assert_close(grad.reshape(ref.shape), ref, f"d{grad_name}", seed)



def test_attention_kernel_unsupported_says_why_without_raising(monkeypatch):
    """The supported head dims come from the extension; without one the answer is a reason,
    never an exception (CPU installs call this while choosing a backend)."""
    from tk_jax import _kernels

    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    assert "bf16 or fp16" in _kernels.attention_kernel_unsupported(q.astype(jnp.float32), q, q)
    if _kernels._tk is not None:
        dims = tuple(_kernels._tk.attention_head_dims)
        assert 64 in dims and 96 not in dims
        assert _kernels.attention_kernel_unsupported(q, q, q) is None
        q96 = jnp.zeros((1, 8, 2, 96), jnp.bfloat16)
        assert "head_dim" in _kernels.attention_kernel_unsupported(q96, q96, q96)
    monkeypatch.setattr(_kernels, "_tk", None)
    monkeypatch.setattr(_kernels, "_TK_IMPORT_ERROR", "not built here", raising=False)
    why = _kernels.attention_kernel_unsupported(q, q, q)
    assert isinstance(why, str) and "tk_jax._tk" in why


# ----------------------------------------------------------------------------------------------
# Packed sequences (segment ids) and padding (sequence lengths), against float64 naive attention
# that applies the same mask rule element by element (tests/naive.py).


def random_segment_ids(rng, batch, t, labels=4):
    """[batch, t] int32 ids: runs of random lengths (one-token runs included), labelled from a
    small shuffled set, so ids are unsorted and one id may come back after another."""
    ids = np.empty((batch, t), np.int32)
    for b in range(batch):
        runs = [1] + list(rng.integers(1, 6, size=t))  # a one-token run first, then 1..5
        bounds = np.minimum(np.cumsum(runs), t)
        label = rng.permutation(labels)[np.arange(len(runs)) % labels] * 7 - 3  # any ints
        ids[b] = np.repeat(label, np.diff(np.concatenate([[0], bounds])))
    return ids


def mask_case(rng, name):
    """(random_qkv shapes, flash_attention kwargs, (window_left, window_right)) of one case;
    the masks are random per run."""
    if name == "segments causal GQA":
        shapes = dict(batch=(2,), tq=17, tk=17, hq=4, hkv=2)
        return shapes, dict(causal=True, q_segment_ids=random_segment_ids(rng, 2, 17)), (-1, 0)
    if name == "segments Tq<Tk window":  # q ids differ from kv ids: some rows see nothing
        shapes = dict(batch=(2,), tq=9, tk=14, hq=2, hkv=2)
        masks = dict(q_segment_ids=random_segment_ids(rng, 2, 9),
                     kv_segment_ids=random_segment_ids(rng, 2, 14))
        return shapes, dict(window_size=(3, 2), **masks), (3, 2)
    if name == "lengths 0, T and out of range, causal, MQA":  # lengths are clamped to [0, T]
        shapes = dict(batch=(3,), tq=11, tk=15, hq=3, hkv=1)
        masks = dict(q_seq_lengths=np.array([0, 11, rng.integers(1, 11)], np.int32),
                     kv_seq_lengths=np.array([40, 0, rng.integers(-2, 15)], np.int32))
        return shapes, dict(causal=True, **masks), (-1, 0)
    if name == "segments + lengths + window":
        shapes = dict(batch=(3,), tq=13, tk=13, hq=2, hkv=1)
        masks = dict(q_segment_ids=random_segment_ids(rng, 3, 13),
                     q_seq_lengths=np.array([13, 6, 1], np.int32),
                     kv_seq_lengths=np.array([9, 13, 2], np.int32))
        return shapes, dict(window_size=(2, 0), **masks), (2, 0)
    raise KeyError(name)


MASK_CASES = ["segments causal GQA", "segments Tq<Tk window",
              "lengths 0, T and out of range, causal, MQA", "segments + lengths + window"]


def naive_masks(kwargs):
    """The mask keyword arguments for tests/naive.py (kv ids defaulting to q's)."""
    masks = {name: kwargs[name] for name in ("q_segment_ids", "kv_segment_ids", "q_seq_lengths",
                                             "kv_seq_lengths") if name in kwargs}
    if "q_segment_ids" in masks:
        masks.setdefault("kv_segment_ids", masks["q_segment_ids"])
    return masks


@pytest.mark.parametrize("name", MASK_CASES)
def test_masks_match_naive(name):
    rng, seed = fresh_rng()
    shapes, kwargs, window = mask_case(rng, name)
    q, k, v = random_qkv(rng, **shapes)
    do = random_like(rng, q)
    scale = 1 / np.sqrt(q.shape[-1])
    masks = naive_masks(kwargs)
    o_ref, lse_ref = naive_attention(q, k, v, scale, *window, **masks)
    grads_ref = naive_attention_grads(q, k, v, do, scale, *window, **masks)

    # Eager calls: the reference's jitted forward compiles once for o, lse and the gradients.
    fn = functools.partial(flash_attention, **kwargs)
    o, grads = loss_and_grads(fn, q, k, v, do)
    _, lse = fn(q, k, v, return_lse=True)
    assert_close(o, o_ref, f"{name} o", seed)
    for grad_name, grad, ref in zip("qkv", grads, grads_ref):
        assert_close(grad, ref, f"{name} d{grad_name}", seed)
    assert_lse_close(lse, lse_ref, f"{name} lse", seed)
    # Rows that see no key: exactly 0, and exactly zero dq; keys no one sees: zero dk, dv.
    visible = attention_mask(q.shape[0], q.shape[1], k.shape[1], *window, **masks)
    empty_rows, unseen_keys = ~visible.any(axis=2), ~visible.any(axis=1)
    assert np.all(np.asarray(o)[empty_rows] == 0), f"seed={seed}"
    assert np.all(np.asarray(grads[0])[empty_rows] == 0), f"seed={seed}"
    assert np.all(np.asarray(grads[1])[unseen_keys] == 0), f"seed={seed}"
    assert np.all(np.asarray(grads[2])[unseen_keys] == 0), f"seed={seed}"


def test_masks_cover_the_edge_cases():
    """The random layouts above hold one-token segments, ids that are not sorted and ids that
    come back after another; the length cases hold 0 and T (the checks above need them)."""
    rng, _ = fresh_rng()
    ids = random_segment_ids(rng, 50, 17)
    runs = [np.diff(np.flatnonzero(np.diff(np.r_[np.nan, row, np.nan]))) for row in ids]
    assert all(r[0] == 1 for r in runs)
    assert any(np.any(np.diff(row) < 0) for row in ids)
    assert all(len(np.unique(row)) < len(r) for row, r in zip(ids, runs))
    _, kwargs, _ = mask_case(rng, "lengths 0, T and out of range, causal, MQA")
    assert {0, 11} <= set(kwargs["q_seq_lengths"]) and {0, 40} <= set(kwargs["kv_seq_lengths"])


def test_non_finite_inputs_reach_exactly_the_rows_that_see_them():
    """A NaN in q and in k, an inf in v: the rows that see one get NaN o (and lse, for q and
    k) and NaN dq; every other row matches float64 attention, rows emptied by the masks stay
    0 / -inf with zero dq, forward and backward agreeing row by row."""
    rng, seed = fresh_rng()
    b, t, h = 2, 12, 2
    q, k, v = random_qkv(rng, batch=(b,), tq=t, tk=t, hq=h, hkv=1, d=8)
    do = random_like(rng, q)
    ids = random_segment_ids(rng, b, t)
    masks = dict(q_segment_ids=ids, kv_segment_ids=ids, q_seq_lengths=np.array([t, t - 3]))
    rows, cols = rng.integers(0, t - 3, size=3), rng.integers(0, 8, size=3)
    q = q.at[0, rows[0], 1, cols[0]].set(np.nan)
    k = k.at[1, rows[1], 0, cols[1]].set(np.nan)
    v = v.at[int(rng.integers(0, 2)), rows[2], 0, cols[2]].set(np.inf)
    scale = 1 / np.sqrt(8)

    fn = functools.partial(flash_attention, causal=True, q_segment_ids=ids,
                           q_seq_lengths=masks["q_seq_lengths"])
    o, lse = fn(q, k, v, return_lse=True)
    dq, dk, dv = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * do), argnums=(0, 1, 2))(q, k, v)
    o_ref, lse_ref = naive_attention(q, k, v, scale, -1, 0, **masks)
    dq_ref, _, _ = naive_attention_grads(q, k, v, do, scale, -1, 0, **masks)
    o, lse, dq = (np.asarray(x, np.float64) for x in (o, lse, dq))

    bad_rows = ~np.all(np.isfinite(o_ref), axis=-1)       # [B, Tq, H]
    assert bad_rows.any(), f"the poison reaches no row (seed={seed})"
    np.testing.assert_array_equal(~np.all(np.isfinite(o), axis=-1), bad_rows,
                                  err_msg=f"rows with a non-finite o (seed={seed})")
    np.testing.assert_array_equal(~np.all(np.isfinite(dq), axis=-1), bad_rows,
                                  err_msg=f"rows with a non-finite dq (seed={seed})")
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref),
                                  err_msg=f"NaN lse (seed={seed})")
    good = ~bad_rows
    assert_close(o[good], o_ref[good], "o of the other rows", seed)
    assert_close(dq[good], dq_ref[good], "dq of the other rows", seed)
    empty = ~attention_mask(b, t, t, -1, 0, **masks).any(axis=2)  # [B, Tq]
    assert empty.any()
    assert np.all(o[empty] == 0) and np.all(dq[empty] == 0), f"seed={seed}"
    assert np.all(np.isneginf(np.swapaxes(lse, 1, 2)[empty])), f"seed={seed}"


def test_masks_with_jit_and_vmap():
    """vmap over an axis of q, k, v, ids and lengths (and of do, for gradients); vmap with the
    ids and lengths shared (unmapped); all under one jit."""
    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, batch=(3, 2), tq=8, tk=8, hq=2, hkv=1, d=8)
    do = random_like(rng, q)
    ids = random_segment_ids(rng, 6, 8).reshape(3, 2, 8)
    lengths = rng.integers(0, 9, size=(3, 2)).astype(np.int32)
    scale = 1 / np.sqrt(8)

    def attend(q, k, v, ids, lengths):
        return flash_attention(q, k, v, causal=True, q_segment_ids=ids, kv_seq_lengths=lengths)

    def output_and_grads(q, k, v, ids, lengths, do):
        loss = lambda q, k, v: jnp.sum(attend(q, k, v, ids, lengths) * do)
        return attend(q, k, v, ids, lengths), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    @jax.jit
    def run(q, k, v, ids, lengths, do):
        shared = jax.vmap(attend, in_axes=(0, 0, 0, None, None))(q, k, v, ids[0], lengths[0])
        return jax.vmap(output_and_grads)(q, k, v, ids, lengths, do), shared

    (o, grads), shared = run(q, k, v, ids, lengths, do)
    flat = [np.asarray(x).reshape((6,) + x.shape[2:]) for x in (q, k, v, do)]
    masks = dict(q_segment_ids=ids.reshape(6, 8), kv_segment_ids=ids.reshape(6, 8),
                 kv_seq_lengths=lengths.reshape(6))
    assert_close(o, naive_attention(*flat[:3], scale, -1, 0, **masks)[0].reshape(q.shape),
                 "vmap o", seed)
    for grad_name, g, ref, x in zip("qkv", grads,
                                    naive_attention_grads(*flat, scale, -1, 0, **masks), (q, k, v)):
        assert_close(g, ref.reshape(x.shape), f"vmap d{grad_name}", seed)
    masks0 = dict(q_segment_ids=ids[0], kv_segment_ids=ids[0], kv_seq_lengths=lengths[0])
    for i in range(3):
        ref = naive_attention(q[i], k[i], v[i], scale, -1, 0, **masks0)[0]
        assert_close(shared[i], ref, f"vmap, shared ids, o[{i}]", seed)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kv_segment_ids=np.zeros((2, 6), np.int32)), ValueError,
     "kv_segment_ids was given without q_segment_ids"),
    (dict(q_segment_ids=np.zeros((2, 5), np.int32)), ValueError,
     r"kv_segment_ids is required.*Tq = 5, Tk = 6"),
    (dict(q_segment_ids=np.zeros((2, 4), np.int32), kv_segment_ids=np.zeros((2, 6), np.int32)),
     ValueError, r"q_segment_ids must have shape \(2, 5\).*got shape \(2, 4\)"),
    (dict(q_segment_ids=np.zeros((2, 5), np.int32), kv_segment_ids=np.zeros((1, 6), np.int32)),
     ValueError, r"kv_segment_ids must have shape \(2, 6\)"),
    (dict(q_segment_ids=np.zeros((2, 5), np.float32), kv_segment_ids=np.zeros((2, 6))),
     TypeError, "q_segment_ids must hold integers.*float32"),
    (dict(q_seq_lengths=np.ones((2, 1), np.int32)), ValueError,
     r"q_seq_lengths must have shape \(2,\).*got shape \(2, 1\)"),
    (dict(kv_seq_lengths=np.array([True, False])), TypeError, "kv_seq_lengths must hold integers"),
    (dict(kv_seq_lengths="3"), TypeError, "kv_seq_lengths must hold integers"),
    (dict(q_seq_lengths=4), ValueError, r"q_seq_lengths must have shape \(2,\)"),
])
def test_mask_arguments_are_checked(kwargs, error, match):
    q = jnp.zeros((2, 5, 2, 8))
    k = jnp.zeros((2, 6, 2, 8))
    with pytest.raises(error, match="^flash_attention: " + match):
        flash_attention(q, k, k, **kwargs)


def test_kernel_receives_the_masks_as_the_contract_says(install_kernels):
    """With the kernels (pretend) available: segment ids [B, T] and lengths [B] (batch dims
    folded, lengths clamped) reach attention_fwd and attention_bwd as int32 keyword
    arguments, both ids or neither, bottom_right only when False; results as float64."""
    calls = []

    def record(kind, arrays, scale, window_left, window_right, masks):
        for name, x in masks.items():
            if name == "bottom_right":
                assert x is False
                continue
            assert x.dtype == jnp.int32, (name, x.dtype)
        assert ("q_segment_ids" in masks) == ("kv_segment_ids" in masks)
        calls.append((kind, arrays[0].shape, tuple(sorted(masks))))

    module = install_recording_kernels(install_kernels, record)
    attention_fwd = module.attention_fwd

    rng, seed = fresh_rng()
    q, k, v = random_qkv(rng, batch=(2, 2), tq=7, tk=7, hq=2, hkv=1, d=8)
    do = random_like(rng, q)
    ids = random_segment_ids(rng, 4, 7).reshape(2, 2, 7)
    lengths = np.array([[7, 3], [0, 99]], np.int64)
    # Python lists and NumPy int64 are accepted (and reach the kernel as int32).
    fn = functools.partial(flash_attention, causal=True, q_segment_ids=ids.tolist(),
                           q_seq_lengths=lengths)
    o, grads = loss_and_grads(fn, q, k, v, do)
    names = ("kv_segment_ids", "q_segment_ids", "q_seq_lengths")
    assert ("fwd", (4, 7, 2, 8), names) in calls and ("bwd", (4, 7, 2, 8), names) in calls

    masks = dict(q_segment_ids=ids.reshape(4, 7), kv_segment_ids=ids.reshape(4, 7),
                 q_seq_lengths=lengths.reshape(4))
    flat = [np.asarray(x).reshape((4,) + x.shape[2:]) for x in (q, k, v, do)]
    scale = 1 / np.sqrt(8)
    assert_close(o.reshape(flat[0].shape), naive_attention(*flat[:3], scale, -1, 0, **masks)[0],
                 "o", seed)
    for grad_name, grad, ref in zip("qkv", grads,
                                    naive_attention_grads(*flat, scale, -1, 0, **masks)):
        assert_close(grad.reshape(ref.shape), ref, f"d{grad_name}", seed)
    # The kernels see lengths within [0, T].
    seen = []

    def forward_recording_lengths(q, k, v, **kw):
        jax.debug.callback(lambda x: seen.append(np.asarray(x)), kw["q_seq_lengths"])
        return attention_fwd(q, k, v, **kw)

    module.attention_fwd = forward_recording_lengths
    jax.block_until_ready(flash_attention(q, k, v, q_seq_lengths=lengths))
    np.testing.assert_array_equal(seen[0], [7, 3, 0, 7])
