"""Naive float64 attention and Based linear attention: the full score matrix, no blocking, no
tricks. The test oracles for the blockwise references and the CUDA kernels.

Softmax attention (numpy): Shapes as in tk_jax:
q [B, Tq, Hq, D], k [B, Tk, Hkv, D], v [B, Tk, Hkv, Dv]; query head h reads kv head h // G with
G = Hq // Hkv. Masking follows the contract of tk_jax.flash_attention, written out here
element by element (see attention_mask): per batch row b, query i sees key j iff
    i < q_len[b] and j < kv_len[b]                      (lengths clamped to [0, T])
    and q_seg[b, i] == kv_seg[b, j]                     (with segment ids)
    and j >= i + off_b - window_left                    (window_left >= 0)
    and j <= i + off_b + window_right                   (window_right >= 0)
with off_b = kv_len[b] - q_len[b] when bottom_right (FlashAttention), 0 when not (jax.nn).

Masked entries are left out of every sum (a select, not a product with 0), so a non-finite q, k
or v reaches exactly the rows that see it, as in plain softmax attention; a row that sees no
key has o = 0, lse = -inf and zero gradients, and so has a row whose visible scores are all
-inf (a score of -inf weighs nothing, like a masked one).
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
    """[Tq, Tk] bool: query i may see key j (bottom-right aligned window, no per-row masks)."""
    return attention_mask(1, tq, tk, window_left, window_right)[0]


def attention_mask(batch: int, tq: int, tk: int, window_left: int, window_right: int, *,
                   q_segment_ids=None, kv_segment_ids=None, q_seq_lengths=None,
                   kv_seq_lengths=None, bottom_right: bool = True) -> np.ndarray:
    """[B, Tq, Tk] bool: query i of batch row b may see key j (the rule in the module doc)."""
    q_len = np.full(batch, tq) if q_seq_lengths is None else np.asarray(q_seq_lengths)
    kv_len = np.full(batch, tk) if kv_seq_lengths is None else np.asarray(kv_seq_lengths)
    q_len = np.clip(q_len.astype(np.int64), 0, tq)[:, None, None]
    kv_len = np.clip(kv_len.astype(np.int64), 0, tk)[:, None, None]
    i = np.arange(tq)[None, :, None]
    j = np.arange(tk)[None, None, :]
    offset = kv_len - q_len if bottom_right else 0
    mask = (i < q_len) & (j < kv_len)
    if q_segment_ids is not None:
        q_ids, kv_ids = np.asarray(q_segment_ids), np.asarray(kv_segment_ids)
        mask = mask & (q_ids[:, :, None] == kv_ids[:, None, :])
    if window_left >= 0:
        mask = mask & (j >= i + offset - window_left)
    if window_right >= 0:
        mask = mask & (j <= i + offset + window_right)
    return np.broadcast_to(mask, (batch, tq, tk))


def _as_heads(q, k, v):
    """float64 copies with kv heads repeated to match the query heads: [B, H, T, D]."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    group = q.shape[2] // k.shape[2]
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    return (x.transpose(0, 2, 1, 3) for x in (q, k, v))


def _mask_of(q, k, window_left, window_right, masks):
    """[B, 1, Tq, Tk] visibility for [B, H, T, D] inputs."""
    batch, tq, tk = q.shape[0], q.shape[2], k.shape[2]
    return attention_mask(batch, tq, tk, window_left, window_right, **masks)[:, None]


def _masked_product(a, mask, b):
    """sum_j a[..., i, j] b[..., j, :] over the visible j only: a plain matmul where b is
    finite (a is 0 where masked), an explicit select where it is not (0 * inf would be NaN)."""
    if np.all(np.isfinite(b)):
        return a @ b
    terms = a[..., :, :, None] * b[..., None, :, :]
    return np.where(mask[..., None], terms, 0.0).sum(axis=-2)


def _probabilities(q, k, scale, mask):
    """Softmax P [B, H, Tq, Tk] (0 where masked), lse [B, H, Tq] and the mask of the entries
    that count: rows that see no key, or only scores of -inf, count none (P = 0, lse = -inf).
    Rows that see a NaN or +inf score get NaN, as plain softmax does."""
    with np.errstate(invalid="ignore", over="ignore"):
        # A non-finite q_i or k_j only spoils score (i, j), which the select drops if masked.
        s = np.where(mask, scale * (q @ np.swapaxes(k, -1, -2)), -np.inf)
        row_max = s.max(axis=-1, keepdims=True)
        seen = row_max != -np.inf  # NaN counts as seen
        row_max = np.where(seen, row_max, 0.0)
        e = np.where(mask, np.exp(s - row_max), 0.0)
        total = e.sum(axis=-1, keepdims=True)
        p = np.where(mask & seen, e / np.where(seen, total, 1.0), 0.0)
        lse = np.where(seen, row_max + np.log(np.where(seen, total, 1.0)), -np.inf)[..., 0]
    return p, lse, mask & seen


def naive_attention(q, k, v, scale, window_left, window_right, **masks):
    """(o [B, Tq, Hq, Dv], lse [B, Hq, Tq]) in float64; rows that see no key: o = 0, lse = -inf.
    masks: q_segment_ids, kv_segment_ids ([B, T]), q_seq_lengths, kv_seq_lengths ([B]),
    bottom_right (default True), as tk_jax.flash_attention takes them."""
    q, k, v = _as_heads(q, k, v)
    mask = _mask_of(q, k, window_left, window_right, masks)
    p, lse, mask = _probabilities(q, k, scale, mask)
    with np.errstate(invalid="ignore", over="ignore"):
        o = _masked_product(p, mask, v)
    return o.transpose(0, 2, 1, 3), lse


def naive_attention_grads(q, k, v, do, scale, window_left, window_right, dlse=None, **masks):
    """(dq, dk, dv) in float64 for the loss sum(o * do) [+ sum(lse * dlse)], from the analytic
    softmax derivative: dS = P * (dP - rowsum(P * dP) + dlse), with dP = dO V^T, every sum over
    the visible entries only."""
    kv_heads = np.asarray(k).shape[2]
    q, k, v = _as_heads(q, k, v)
    do = np.asarray(do, np.float64).transpose(0, 2, 1, 3)
    mask = _mask_of(q, k, window_left, window_right, masks)
    p, _, mask = _probabilities(q, k, scale, mask)
    with np.errstate(invalid="ignore", over="ignore"):
        dv = _masked_product(np.swapaxes(p, -1, -2), np.swapaxes(mask, -1, -2), do)
        dp = np.where(mask, do @ np.swapaxes(v, -1, -2), 0.0)
        ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
        if dlse is not None:
            ds = ds + p * np.asarray(dlse, np.float64)[..., None]
        ds = np.where(mask, ds, 0.0)
        dq = scale * _masked_product(ds, mask, k)
        dk = scale * _masked_product(np.swapaxes(ds, -1, -2), np.swapaxes(mask, -1, -2), q)

    def sum_groups(x):  # [B, Hq, Tk, D] -> [B, Tk, Hkv, D]: repeated kv heads add up
        b, hq, t, d = x.shape
        with np.errstate(invalid="ignore"):  # NaN + inf where non-finite inputs reach
            x = x.reshape(b, kv_heads, hq // kv_heads, t, d).sum(axis=2)
        return x.transpose(0, 2, 1, 3)

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
