"""Naive float64 attention and Based linear attention: the full score matrix, no blocking, no
tricks. The test oracles for the blockwise references and the CUDA kernels.

Softmax attention (numpy): Shapes as in tk_jax:
q [B, Tq, Hq, D], k [B, Tk, Hkv, D], v [B, Tk, Hkv, Dv]; query head h reads kv head h // G with
G = Hq // Hkv. Masking is the bottom-right aligned window rule of tk_jax.flash_attention.
"""
from __future__ import annotations

import math

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


# ------------------------------------------------------------------ Based linear attention
# Written against the array module `xp`: numpy for outputs (no compile), jax.numpy under
# jax.enable_x64 where gradients are needed.

BASED_FEATURE_DIM = 16


def naive_feature_map(x, xp=np):
    """[..., 16] -> [..., 273]: 1, x_i / 2, x_i x_j / (sqrt(2) * 4)."""
    ones = xp.ones(x.shape[:-1] + (1,), x.dtype)
    pairs = xp.einsum("...i,...j->...ij", x, x).reshape(x.shape[:-1] + (BASED_FEATURE_DIM**2,))
    return xp.concatenate([ones, x / BASED_FEATURE_DIM**0.25, pairs / math.sqrt(2 * BASED_FEATURE_DIM)], axis=-1)


def naive_based(q, k, v, *, normalize, eps, initial_state=None, xp=np):
    """float64 causal Based: q, k [B,T,H,16], v [B,T,H,Dv] -> (y, (S, z))."""
    q, k, v = (xp.asarray(x, np.float64) for x in (q, k, v))
    seq_len = q.shape[1]
    s = xp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(BASED_FEATURE_DIM)
    weights = (1 + s + s * s / 2) * xp.tril(xp.ones((seq_len, seq_len)))
    num = xp.einsum("bhts,bshv->bthv", weights, v)
    den = xp.einsum("bhts->bth", weights)
    phi_k = naive_feature_map(k, xp)
    state_s = xp.einsum("bthf,bthv->bhfv", phi_k, v)
    state_z = xp.einsum("bthf->bhf", phi_k)
    if initial_state is not None:
        s0, z0 = (xp.asarray(x, np.float64) for x in initial_state)
        phi_q = naive_feature_map(q, xp)
        num = num + xp.einsum("bthf,bhfv->bthv", phi_q, s0)
        den = den + xp.einsum("bthf,bhf->bth", phi_q, z0)
        state_s, state_z = state_s + s0, state_z + z0
    y = num / (den[..., None] + eps) if normalize else num
    return y, (state_s, state_z)
