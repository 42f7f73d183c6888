"""Naive float64 attention in numpy: the full score matrix, no blocking, no tricks.

The test oracle for the blockwise reference and the CUDA kernels. Shapes as in tk_jax:
q [B, Tq, Hq, D], k [B, Tk, Hkv, D], v [B, Tk, Hkv, Dv]; query head h reads kv head h // G with
G = Hq // Hkv. Masking is the bottom-right aligned window rule of tk_jax.flash_attention.
"""
from __future__ import annotations

import numpy as np


def relative_l2(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 when both are zero)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    diff = np.linalg.norm(actual - expected)
    norm = np.linalg.norm(expected)
    return float(diff / norm) if norm > 0 else float(diff)


def visible_mask(tq: int, tk: int, window_left: int, window_right: int) -> np.ndarray:
    """[Tq, Tk] bool: query i may see key j."""
    i = np.arange(tq)[:, None] + (tk - tq)
    j = np.arange(tk)[None, :]
    mask = np.ones((tq, tk), bool)
    if window_left >= 0:
        mask &= j >= i - window_left
    if window_right >= 0:
        mask &= j <= i + window_right
    return mask


def _as_heads(q, k, v):
    """float64 copies with kv heads repeated to match the query heads: [B, H, T, D]."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    group = q.shape[2] // k.shape[2]
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    return (x.transpose(0, 2, 1, 3) for x in (q, k, v))


def _probabilities(q, k, scale, window_left, window_right):
    """Softmax P [B, H, Tq, Tk] (0 where masked or the row sees nothing) and lse [B, H, Tq]."""
    mask = visible_mask(q.shape[2], k.shape[2], window_left, window_right)
    s = np.where(mask, scale * q @ k.transpose(0, 1, 3, 2), -np.inf)
    row_max = s.max(axis=-1, keepdims=True, initial=-np.inf)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.exp(s - row_max)
    total = e.sum(axis=-1, keepdims=True)
    seen = total > 0
    p = np.where(seen, e / np.where(seen, total, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, row_max + np.log(total), -np.inf)[..., 0]
    return p, lse


def naive_attention(q, k, v, scale, window_left, window_right):
    """(o [B, Tq, Hq, Dv], lse [B, Hq, Tq]) in float64; rows that see no key: o = 0, lse = -inf."""
    q, k, v = _as_heads(q, k, v)
    p, lse = _probabilities(q, k, scale, window_left, window_right)
    return (p @ v).transpose(0, 2, 1, 3), lse


def naive_attention_grads(q, k, v, do, scale, window_left, window_right, dlse=None):
    """(dq, dk, dv) in float64 for the loss sum(o * do) [+ sum(lse * dlse)], from the analytic
    softmax derivative: dS = P * (dP - rowsum(P * dP) + dlse), with dP = dO V^T."""
    kv_heads = np.asarray(k).shape[2]
    q, k, v = _as_heads(q, k, v)
    do = np.asarray(do, np.float64).transpose(0, 2, 1, 3)
    p, _ = _probabilities(q, k, scale, window_left, window_right)
    dv = p.transpose(0, 1, 3, 2) @ do
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    if dlse is not None:
        ds = ds + p * np.asarray(dlse, np.float64)[..., None]
    dq = scale * ds @ k
    dk = scale * ds.transpose(0, 1, 3, 2) @ q

    def sum_groups(x):  # [B, Hq, Tk, D] -> [B, Tk, Hkv, D]: repeated kv heads add up
        b, hq, t, d = x.shape
        return x.reshape(b, kv_heads, hq // kv_heads, t, d).sum(axis=2).transpose(0, 2, 1, 3)

    return dq.transpose(0, 2, 1, 3), sum_groups(dk), sum_groups(dv)
