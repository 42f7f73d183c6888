"""The attention kernel against a float64 reference on the GPU: fresh random inputs, odd
lengths, outputs poisoned before each launch, and two runs compared bit for bit."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tk_jax
from gpu_util import poison_device_memory, rel_l2
from naive import naive_attention, naive_attention_grads

pytestmark = pytest.mark.gpu


def _inputs(rng, b, tq, tk, hq, hkv, d, dtype):
    q = rng.standard_normal((b, tq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, tk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, tk, hkv, d)).astype(dtype)
    return q, k, v


def _kernel_forward(q, k, v, **kw):
    fn = jax.jit(lambda q, k, v: tk_jax.flash_attention(q, k, v, backend="kernel", return_lse=True, **kw))
    poison_device_memory(2 * (q.size * q.dtype.itemsize + q.size // q.shape[-1] * 4))
    o, lse = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    return np.asarray(o.astype(jnp.float32)), np.asarray(lse)


def _check_forward(q, k, v, scale, wl, wr, **kw):
    o, lse = _kernel_forward(q, k, v, **kw)
    o_ref, lse_ref = naive_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale, wl, wr)
    assert np.isfinite(o).all(), "kernel output has NaN/inf (unwritten rows?)"
    assert rel_l2(o, o_ref) < 1e-2, rel_l2(o, o_ref)
    seen = np.isfinite(lse_ref)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(lse[seen], lse_ref[seen], rtol=2e-3, atol=2e-3)
    return o, lse


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
# 3001: the D=64 forward's persistent grid with three consumers under a causal mask.
@pytest.mark.parametrize("t", [1, 100, 1024, 3001, 4097])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_reference(hopper, rng, dtype, d, t, causal):
    b, h = (2, 2) if t <= 1024 else (1, 2)
    q, k, v = _inputs(rng, b, t, t, h, h, d, dtype)
    _check_forward(q, k, v, 1 / math.sqrt(d), -1, 0 if causal else -1, causal=causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("growth", [0.02, 0.05, -0.05])
def test_forward_with_climbing_scores(hopper, rng, dtype, d, causal, growth):
    """Scores that climb (or fall) by `growth` per key on top of random ones: each row's running
    max grows by 1-6 units per key tile, so the online softmax both rescales O and keeps a
    stale max (probabilities up to 2^8 against it) from tile to tile; O and lse must still
    match the reference."""
    t = 1000
    q, k, v = _inputs(rng, 1, t, t, 2, 2, d, dtype)
    q[..., 0] = 8
    k[..., 0] = (growth * np.arange(t) * math.sqrt(d) / 8)[None, :, None]  # score += growth * key index
    _check_forward(q, k, v, 1 / math.sqrt(d), -1, 0 if causal else -1, causal=causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_head_dim_256_forward_kernel_and_gradients(hopper, rng, dtype):
    """Head dim 256 through the public API: the forward kernel (GQA 4:2, causal, Tq != Tk, a
    window) and the gradients (the role-split backward kernel)."""
    q, k, v = _inputs(rng, 2, 200, 231, 4, 2, 256, dtype)
    scale = 1 / 16
    _check_forward(q, k, v, scale, -1, 0, causal=True)
    _check_forward(q, k, v, scale, 40, 7, window_size=(40, 7))
    do = rng.standard_normal(q.shape).astype(np.float32)

    def loss(q, k, v):
        o = tk_jax.flash_attention(q, k, v, causal=True, backend="kernel")
        return jnp.sum(o.astype(jnp.float32) * do)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(x) for x in (q, k, v)))
    ref = naive_attention_grads(*(x.astype(np.float64) for x in (q, k, v, do)), scale, -1, 0)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert g.dtype == q.dtype, name
        assert rel_l2(np.asarray(g.astype(jnp.float32)), r) < 1e-2, (name, rel_l2(np.asarray(g.astype(jnp.float32)), r))


@pytest.mark.parametrize(
    "tq,tk,hq,hkv,causal,window,scale",
    [
        (65, 300, 4, 1, True, (-1, -1), None),     # decoding-like: bottom-right causal, MQA
        (300, 65, 8, 2, True, (-1, -1), 0.3),      # Tq > Tk: top rows see no key
        (257, 257, 8, 8, False, (31, 17), None),   # sliding window both sides
        (129, 200, 4, 2, True, (63, -1), None),    # causal + left window, GQA
        # a narrow band: the consumers of a query block see different key tiles, leading and
        # trailing, and some see only the first half of their last one
        (1000, 1000, 4, 2, True, (100, -1), None),
    ],
)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_masks_gqa_lengths(hopper, rng, tq, tk, hq, hkv, causal, window, scale, d):
    q, k, v = _inputs(rng, 2, tq, tk, hq, hkv, d, jnp.bfloat16)
    s = scale if scale is not None else 1 / math.sqrt(d)
    wr = 0 if causal else window[1]
    _check_forward(q, k, v, s, window[0], wr, causal=causal, window_size=window, softmax_scale=scale)


@pytest.mark.parametrize("tq,tk,d,window", [
    (4200, 4200, 64, None),
    (4200, 4200, 128, None),
    (4200, 4200, 256, None),
    (3000, 5000, 128, (700, 0)),  # a causal sliding window, Tq < Tk
])
def test_forward_paired_items(hopper, rng, tq, tk, d, window):
    """More than 4096 keys under a band with few query blocks a pair: the launcher runs the
    persistent kernel on half as many blocks as items, each taking a query block and its mirror.
    With 9 (batch, head) pairs the item count is odd at D=128/256 (33 query blocks of 128 rows
    each), so one block takes a single item; at D=64 (192-row blocks) it is even."""
    q, k, v = _inputs(rng, 1, tq, tk, 9, 3, d, jnp.bfloat16)
    if window is None:
        _check_forward(q, k, v, 1 / math.sqrt(d), -1, 0, causal=True)
    else:
        _check_forward(q, k, v, 1 / math.sqrt(d), window[0], window[1], window_size=window)


def test_forward_is_deterministic(hopper, rng):
    q, k, v = _inputs(rng, 2, 1000, 1000, 4, 4, 128, jnp.bfloat16)
    o1, lse1 = _kernel_forward(q, k, v, causal=True)
    o2, lse2 = _kernel_forward(q, k, v, causal=True)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(lse1, lse2)


def test_kernel_path_under_jit_vmap_grad(hopper, rng):
    q, k, v = _inputs(rng, 3, 130, 130, 4, 2, 64, jnp.bfloat16)  # leading axis 3 is vmapped
    do = rng.standard_normal(q.shape).astype(np.float32)

    def loss(q, k, v, do):
        o = tk_jax.flash_attention(q[None], k[None], v[None], causal=True, backend="kernel")[0]
        return jnp.sum(o.astype(jnp.float32) * do)

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, do)
    for i in range(q.shape[0]):
        ref = naive_attention_grads(q[i:i+1].astype(np.float64), k[i:i+1].astype(np.float64),
                                    v[i:i+1].astype(np.float64), do[i:i+1].astype(np.float64), 1 / 8, -1, 0)
        for g, r in zip(grads, ref):
            assert rel_l2(np.asarray(g[i:i+1], np.float32), r) < 1e-2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(
    "tq,tk,hq,hkv,causal,window",
    [
        (1, 1, 2, 2, False, (-1, -1)),
        (63, 63, 2, 2, True, (-1, -1)),
        (129, 129, 4, 4, False, (-1, -1)),
        (1000, 1000, 8, 1, True, (-1, -1)),   # GQA 8:1
        (300, 65, 8, 2, True, (-1, -1)),      # Tq > Tk: rows that see no key
        (65, 300, 4, 2, True, (-1, -1)),      # Tq < Tk, bottom-right causal
        (257, 257, 4, 2, False, (31, 17)),    # sliding window
        (161, 300, 8, 2, False, (-1, -1)),    # unmasked GQA, Tq < Tk, a ragged last query tile
        (2049, 2049, 2, 2, False, (-1, -1)),
    ],
)
def test_backward_kernel_matches_reference(hopper, rng, dtype, d, tq, tk, hq, hkv, causal, window):
    from tk_jax import _kernels

    q, k, v = _inputs(rng, 2, tq, tk, hq, hkv, d, dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    scale = 1 / math.sqrt(d)
    wl, wr = window[0], 0 if causal else window[1]
    kw = dict(scale=scale, window_left=wl, window_right=wr)

    @jax.jit
    def grads(q, k, v, do):
        o, lse = _kernels.attention_fwd(q, k, v, **kw)
        return _kernels.attention_bwd(q, k, v, o, lse, do, **kw)

    poison_device_memory(4 * (q.nbytes + 2 * k.nbytes))
    dq, dk, dv = grads(*(jnp.asarray(x) for x in (q, k, v, do)))
    ref = naive_attention_grads(*(x.astype(np.float64) for x in (q, k, v, do)), scale, wl, wr)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        got = np.asarray(got.astype(jnp.float32), np.float64)
        assert np.isfinite(got).all(), f"{name} has NaN/inf"
        # Relative L2, with a floor for gradients that are zero in exact arithmetic (one key:
        # softmax is exactly 1, so dq = dk = 0 and only rounding remains).
        err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-2 * math.sqrt(want.size))
        assert err < 1e-2, (name, err)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("t", [1, 2, 63, 65, 127, 129, 1000, 4097])
def test_forward_and_gradients_over_lengths(hopper, rng, dtype, d, t):
    """Issue 3's length list through the public API under jit + grad, at every head dim: forward
    and all three gradients against float64. Odd lengths run causal with GQA 8:1, even ones
    full attention with 8:8 heads; Tk = T + 3 (bottom-right alignment, Tq != Tk)."""
    hq, hkv = (8, 1) if t % 2 else (8, 8)
    if t > 1000:
        hq, hkv = 2, 1  # keeps the float64 reference's T x T matrices small
    causal = t % 2 == 1
    q, k, v = _inputs(rng, 1, t, t + 3, hq, hkv, d, dtype)
    do = rng.standard_normal(q.shape).astype(np.float32)

    def loss(q, k, v):
        o = tk_jax.flash_attention(q, k, v, causal=causal, backend="kernel")
        return jnp.sum(o.astype(jnp.float32) * do), o

    poison_device_memory(4 * (q.nbytes + 2 * k.nbytes))
    (grads, o) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*(jnp.asarray(x) for x in (q, k, v)))
    scale = 1 / math.sqrt(d)
    wr = 0 if causal else -1
    o_ref, _ = naive_attention(*(x.astype(np.float64) for x in (q, k, v)), scale, -1, wr)
    assert rel_l2(np.asarray(o.astype(jnp.float32)), o_ref) < 1e-2
    ref = naive_attention_grads(*(x.astype(np.float64) for x in (q, k, v, do)), scale, -1, wr)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert g.dtype == q.dtype, name
        got = np.asarray(g.astype(jnp.float32), np.float64)
        assert np.isfinite(got).all(), name
        assert rel_l2(got, r) < 1e-2, (name, rel_l2(got, r))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(
    "tq,tk,hq,hkv,causal,window",
    [
        (300, 65, 8, 2, True, (-1, -1)),     # Tq > Tk: rows that see no key (lse = -inf)
        (129, 200, 4, 2, True, (63, -1)),    # causal + left window, GQA, a ragged last query tile
        (257, 257, 4, 4, False, (31, 17)),   # sliding window
    ],
)
def test_gradients_through_lse(hopper, rng, dtype, d, tq, tk, hq, hkv, causal, window):
    """return_lse=True and a loss on both o and lse, through the public API under jit: the
    backward's row statistics take lse's cotangent (delta = scale (rowsum(dO o O) - dlse)).
    Gradients against float64. The loss leaves out rows that see no key (lse = -inf), so their
    lse cotangent is 0."""
    q, k, v = _inputs(rng, 2, tq, tk, hq, hkv, d, dtype)
    do = rng.standard_normal(q.shape).astype(np.float32)
    w = rng.standard_normal((2, hq, tq)).astype(np.float32)

    def loss(q, k, v):
        o, lse = tk_jax.flash_attention(q, k, v, causal=causal, window_size=window, backend="kernel",
                                        return_lse=True)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w)

    poison_device_memory(8 * (q.nbytes + 2 * k.nbytes))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(x) for x in (q, k, v)))
    scale = 1 / math.sqrt(d)
    wl, wr = window[0], 0 if causal else window[1]
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    _, lse_ref = naive_attention(q64, k64, v64, scale, wl, wr)
    dlse = np.where(np.isfinite(lse_ref), w, 0.0)
    ref = naive_attention_grads(q64, k64, v64, do.astype(np.float64), scale, wl, wr, dlse=dlse)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert g.dtype == q.dtype, name
        got = np.asarray(g.astype(jnp.float32), np.float64)
        assert np.isfinite(got).all(), name
        assert rel_l2(got, r) < 1e-2, (name, rel_l2(got, r))


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
@pytest.mark.parametrize(
    "b,t,hq,hkv,d,causal",
    [
        (9, 2048, 16, 8, 64, True),     # many key blocks: one block walks the whole GQA group
        (3, 4096, 32, 4, 128, False),   # fewer: the group's 8 query heads split over 2 blocks
        (1, 2048, 24, 1, 128, True),    # MQA: every query head its own block
        (1, 1100, 16, 2, 256, True),    # the D=256 backward, 8 query heads split, ragged keys
    ],
)
def test_gqa_backward_at_every_head_split(hopper, rng, dtype, b, t, hq, hkv, d, causal):
    """Under GQA the backward splits a KV head's query heads over 1 .. group blocks, as many as
    it needs to fill the GPU, and sums dK and dV over the blocks in fp32 (backward.cu). These
    shapes take each kind of split on a 132-SM card; gradients against the float32 reference
    (on the GPU: these are too large for float64 NumPy)."""
    q, k, v = _inputs(rng, b, t, t, hq, hkv, d, dtype)
    do = rng.standard_normal(q.shape).astype(dtype)

    def grads(backend):
        f = lambda q, k, v: tk_jax.flash_attention(q, k, v, causal=causal, backend=backend)
        fn = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
        return [np.asarray(g.astype(jnp.float32), np.float64) for g in fn(*(jnp.asarray(x) for x in (q, k, v, do)))]

    poison_device_memory(4 * (q.nbytes + 2 * k.nbytes))
    got = grads("kernel")
    want = grads("reference")
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert np.isfinite(g).all(), f"{name} has NaN/inf"
        assert rel_l2(g, w) < 1e-2, (name, rel_l2(g, w))
