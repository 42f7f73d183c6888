"""Helpers of the context-parallel tests (tests/test_context_parallel.py and the worker of
tests/test_multiprocess.py): a dense stand-in for the attention kernels and the float64 oracle.

The stand-in implements the kernels' contract (tk_jax/_kernels.py: attention_fwd returns o and
lse; attention_bwd takes the global o and lse of the rows and returns dq, dk, dv of the block)
with the full score matrix in float32: it compiles much faster on CPU than the blockwise
reference, and is independent of it. Installed in place of tk_jax._kernels, it lets
flash_attention and ring_attention take exactly the route they take on a GPU.
"""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

try:  # tests/ as a package, or tests/ on sys.path
    from tests.naive import naive_attention, naive_attention_grads, relative_l2
except ImportError:
    from naive import naive_attention, naive_attention_grads, relative_l2

_HIGHEST = jax.lax.Precision.HIGHEST


def _visible(b, tq, tk, window_left, window_right, q_segment_ids=None, kv_segment_ids=None,
             q_seq_lengths=None, kv_seq_lengths=None, bottom_right=True):
    """[B, Tq, Tk] bool: the contract's mask (tk_jax's BRIEF): lengths, segment ids, window."""
    q_len = jnp.full((b,), tq) if q_seq_lengths is None else q_seq_lengths
    kv_len = jnp.full((b,), tk) if kv_seq_lengths is None else kv_seq_lengths
    offset = (kv_len - q_len if bottom_right else jnp.zeros((b,), jnp.int32))[:, None, None]
    i = jnp.arange(tq)[None, :, None]
    j = jnp.arange(tk)[None, None, :]
    mask = (i < q_len[:, None, None]) & (j < kv_len[:, None, None])
    if window_left >= 0:
        mask &= j >= i + offset - window_left
    if window_right >= 0:
        mask &= j <= i + offset + window_right
    if q_segment_ids is not None:
        mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return mask


def _scores(q, k, scale, window_left, window_right, **masks):
    """Masked scores [B, Hkv, G, Tq, Tk] (float32) and the query heads grouped by kv head."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, tq, hkv, hq // hkv, d)
    s = scale * jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32), precision=_HIGHEST)
    mask = _visible(b, tq, k.shape[1], window_left, window_right, **masks)
    return jnp.where(mask[:, None, None], s, -jnp.inf), qg


def _probabilities(s, lse):
    lse = lse[..., None]
    return jnp.where(jnp.isneginf(s), 0.0, jnp.exp(s - jnp.where(jnp.isneginf(lse), 0.0, lse)))


def dense_attention_fwd(q, k, v, *, scale, window_left, window_right, **masks):
    b, tq, hq, _ = q.shape
    s, _ = _scores(q, k, scale, window_left, window_right, **masks)
    lse = jax.nn.logsumexp(s, axis=-1)  # -inf for a row that sees nothing
    o = jnp.einsum("bhgqk,bkhe->bqhge", _probabilities(s, lse), v.astype(jnp.float32),
                   precision=_HIGHEST)
    return o.reshape(b, tq, hq, v.shape[-1]).astype(q.dtype), lse.reshape(b, hq, tq)


def dense_attention_bwd(q, k, v, o, lse, do, dlse=None, *, scale, window_left, window_right,
                        **masks):
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    s, qg = _scores(q, k, scale, window_left, window_right, **masks)
    p = _probabilities(s, lse.reshape(b, hkv, g, tq))
    dog = do.astype(jnp.float32).reshape(b, tq, hkv, g, -1)
    og = o.astype(jnp.float32).reshape(b, tq, hkv, g, -1)
    dv = jnp.einsum("bhgqk,bqhge->bkhe", p, dog, precision=_HIGHEST)
    dp = jnp.einsum("bqhge,bkhe->bhgqk", dog, v.astype(jnp.float32), precision=_HIGHEST)
    delta = jnp.einsum("bqhge,bqhge->bhgq", dog, og, precision=_HIGHEST)
    ds = dp - delta[..., None]
    if dlse is not None:
        ds = ds + dlse.astype(jnp.float32).reshape(b, hkv, g, tq)[..., None]
    ds = p * ds
    dq = scale * jnp.einsum("bhgqk,bkhd->bqhgd", ds, k.astype(jnp.float32), precision=_HIGHEST)
    dk = scale * jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, precision=_HIGHEST)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# The three-call backward (the kernels' dQ state). The stand-in's state is its own, one float32
# vector like the kernels': dq [B, T, Hq, D], lse [B, Hq, T] and rowsum(do o o) - dlse
# [B, Hq, T], flattened one after the other.


def _state_parts(state, batch, rows, heads, head_dim):
    sizes = np.cumsum([batch * rows * heads * head_dim, batch * heads * rows])
    dq, lse, delta = jnp.split(state, sizes)
    return (dq.reshape(batch, rows, heads, head_dim), lse.reshape(batch, heads, rows),
            delta.reshape(batch, heads, rows))


def dense_attention_bwd_row_stats(o, lse, do, dlse=None, *, scale):
    delta = jnp.einsum("bqhe,bqhe->bhq", do.astype(jnp.float32), o.astype(jnp.float32),
                       precision=_HIGHEST)
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    parts = (jnp.zeros_like(o, jnp.float32), lse.astype(jnp.float32), delta)
    return jnp.concatenate([x.reshape(-1) for x in parts])


def _rotate_rows(x, shift, axis):
    """x with row (i + shift) mod T moved to row i (a static shift)."""
    return jnp.concatenate([jax.lax.slice_in_dim(x, shift, x.shape[axis], axis=axis),
                            jax.lax.slice_in_dim(x, 0, shift, axis=axis)], axis=axis)


def dense_attention_bwd_keys(state, q, k, v, do, *, dq_rows, dq_row_shift, scale, window_left,
                             window_right, **masks):
    b, tq, hq, d = q.shape
    assert tq % 64 == 0 and dq_row_shift % 64 == 0 and tq <= dq_rows, (tq, dq_row_shift)
    dq_acc, lse, delta = _state_parts(state, b, dq_rows, hq, d)
    hkv = k.shape[2]
    g = hq // hkv
    lse_rows = _rotate_rows(lse, dq_row_shift, 2)[..., :tq]
    delta_rows = _rotate_rows(delta, dq_row_shift, 2)[..., :tq]
    s, qg = _scores(q, k, scale, window_left, window_right, **masks)
    p = _probabilities(s, lse_rows.reshape(b, hkv, g, tq))
    dog = do.astype(jnp.float32).reshape(b, tq, hkv, g, -1)
    dv = jnp.einsum("bhgqk,bqhge->bkhe", p, dog, precision=_HIGHEST)
    dp = jnp.einsum("bqhge,bkhe->bhgqk", dog, v.astype(jnp.float32), precision=_HIGHEST)
    ds = p * (dp - delta_rows.reshape(b, hkv, g, tq)[..., None])
    dq = scale * jnp.einsum("bhgqk,bkhd->bqhgd", ds, k.astype(jnp.float32), precision=_HIGHEST)
    dk = scale * jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, precision=_HIGHEST)
    rotated = _rotate_rows(dq_acc, dq_row_shift, 1)
    rotated = jnp.concatenate([rotated[:, :tq] + dq.reshape(q.shape), rotated[:, tq:]], axis=1)
    dq_acc = _rotate_rows(rotated, (dq_rows - dq_row_shift) % dq_rows, 1)
    state = jnp.concatenate([x.reshape(-1) for x in (dq_acc, lse, delta)])
    return state, dk.astype(k.dtype), dv.astype(v.dtype)


def dense_attention_bwd_dq(state, like):
    b, t, h, d = like.shape
    return _state_parts(state, b, t, h, d)[0].astype(like.dtype)


def dense_kernels_module(real_kernels) -> types.ModuleType:
    """A stand-in for tk_jax._kernels with the dense attention kernels."""
    module = types.ModuleType("tk_jax._kernels")
    module.attention_fwd = dense_attention_fwd
    module.attention_bwd = dense_attention_bwd
    module.attention_bwd_row_stats = dense_attention_bwd_row_stats
    module.attention_bwd_keys = dense_attention_bwd_keys
    module.attention_bwd_dq = dense_attention_bwd_dq
    module.attention_kernel_unsupported = lambda q, k, v: None
    module.based_kernel_unsupported = lambda *arrays: "the dense stand-in has no Based kernel"
    module.based_decode_unsupported = lambda *arrays: "the dense stand-in has no Based kernel"
    for name in dir(real_kernels):  # its constants (importing it needs no extension)
        if name.isupper():
            setattr(module, name, getattr(real_kernels, name))
    return module


def install_dense_kernels() -> None:
    """Swap tk_jax._kernels for the dense stand-in in every tk_jax module (for a whole
    process: the multi-process worker; tests use the fixture of test_context_parallel.py)."""
    import sys

    import tk_jax
    import tk_jax._backend
    import tk_jax._kernels

    real = tk_jax._kernels
    fake = dense_kernels_module(real)
    tk_jax._backend.kernel_unavailable_reason = lambda: None
    sys.modules["tk_jax._kernels"] = fake
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] == "tk_jax" and getattr(module, "_kernels", None) is real:
            module._kernels = fake


def oracle(q, k, v, do, *, scale=None, window=(-1, -1), dlse=None):
    """float64 (o, lse, (dq, dk, dv)) of the loss sum(o * do) [+ sum(lse * dlse)]."""
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    o, lse = naive_attention(q, k, v, scale, *window)
    grads = naive_attention_grads(q, k, v, do, scale, *window, dlse=dlse)
    return o, lse, grads


def assert_close(actual, expected, what, tol):
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    finite = np.isfinite(expected)
    assert np.array_equal(np.isfinite(actual), finite), f"{what}: non-finite values differ"
    err = relative_l2(np.where(finite, actual, 0), np.where(finite, expected, 0))
    assert err < tol, f"{what}: relative L2 error {err:.3g} >= {tol}"


def segment_oracle(q, k, v, do, q_segment_ids, kv_segment_ids, *, window):
    """float64 (o, lse, (dq, dk, dv)) with segment ids ([B, T]: query i sees key j only in the
    same segment), multi-head (Hq == Hkv), scale 1/sqrt(D)."""
    q, k, v, do = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, do))
    scale = 1.0 / np.sqrt(q.shape[-1])
    tq, tk = q.shape[2], k.shape[2]
    i = np.arange(tq)[:, None] + (tk - tq)
    j = np.arange(tk)[None, :]
    mask = np.ones((tq, tk), bool)
    if window[0] >= 0:
        mask &= j >= i - window[0]
    if window[1] >= 0:
        mask &= j <= i + window[1]
    mask = mask[None] & (np.asarray(q_segment_ids)[:, :, None] ==
                         np.asarray(kv_segment_ids)[:, None, :])
    s = np.where(mask[:, None], scale * q @ k.transpose(0, 1, 3, 2), -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, m + np.log(total), -np.inf)[..., 0]
    o = p @ v
    dv = p.transpose(0, 1, 3, 2) @ do
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq, dk = scale * ds @ k, scale * ds.transpose(0, 1, 3, 2) @ q
    back = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    return back(o), lse, (back(dq), back(dk), back(dv))
