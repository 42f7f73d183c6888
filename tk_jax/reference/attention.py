"""Pure-JAX attention: the CPU backend and the oracle the CUDA kernels are tested against.

Both functions walk over the keys in blocks of `block_k` (the FlashAttention scheme), so the
largest temporary is a [B, Hq, Tq, block_k] score block, never a Tq x Tk matrix: a CPU user can
run Tq = Tk = 16384.

Shapes (rank 4 exactly; the public wrapper folds extra batch dimensions into B):
    q [B, Tq, Hq, D], k [B, Tk, Hkv, D], v [B, Tk, Hkv, Dv], Hq % Hkv == 0.
Grouped-query attention: query head h uses kv head h // (Hq // Hkv). Queries are viewed as
[B, Tq, Hkv, G, D] (G = Hq // Hkv query heads per kv head) so K and V are never repeated.

Masking (bottom-right aligned, as FlashAttention): with offset = Tk - Tq, query i sees key j iff
    (window_left  < 0 or j >= i + offset - window_left) and
    (window_right < 0 or j <= i + offset + window_right).
A row that sees no key gets o = 0 and lse = -inf, and zero gradients.

All arithmetic is float32 with full-precision matmuls (on a GPU, XLA would otherwise use TF32
for float32 matmuls, which is too coarse for an oracle).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST


def _einsum(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _check_inputs(q, k, v, block_k, op):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{op}: {name} must have rank 4 [B, T, H, D], got shape {x.shape}")
    b, _, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"{op}: batch sizes must match, got q {q.shape}, k {k.shape}, v {v.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{op}: k and v must agree in [B, Tk, Hkv], got {k.shape} and {v.shape}")
    if k.shape[3] != d:
        raise ValueError(f"{op}: q and k head dims must match, got {d} and {k.shape[3]}")
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"{op}: query heads ({hq}) must be a multiple of kv heads ({hkv}) for GQA")
    if not isinstance(block_k, int) or block_k < 1:
        raise ValueError(f"{op}: block_k must be a positive int, got {block_k!r}")


def _visible_key_range(tq, tk, window_left, window_right):
    """Static [lo, hi) range of keys that at least one query may see; keys outside it are
    skipped entirely (they get zero weight and zero gradients)."""
    offset = tk - tq
    lo = max(0, offset - window_left) if window_left >= 0 else 0
    hi = min(tk, tq - 1 + offset + window_right + 1) if window_right >= 0 else tk
    return lo, max(lo, hi)


def _key_blocks(x, lo, hi, block_k):
    """Keys lo..hi-1 of x [B, Tk, H, D] as float32 blocks [nblocks, B, H, block_k, D], padded
    with zeros to whole blocks (padding keys are masked out: their index is >= hi)."""
    x = x[:, lo:hi].astype(jnp.float32)
    n = hi - lo
    nblocks = -(-n // block_k)
    x = jnp.pad(x, ((0, 0), (0, nblocks * block_k - n), (0, 0), (0, 0)))
    b, _, h, d = x.shape
    return jnp.transpose(x.reshape(b, nblocks, block_k, h, d), (1, 0, 3, 2, 4))


def _block_mask(block_index, *, tq, tk, lo, hi, block_k, window_left, window_right):
    """[Tq, block_k] bool: which (query, key) pairs of key block `block_index` are visible."""
    i = jnp.arange(tq)[:, None]
    j = lo + block_index * block_k + jnp.arange(block_k)[None, :]
    diagonal = i + (tk - tq)
    visible = j < hi
    if window_left >= 0:
        visible &= j >= diagonal - window_left
    if window_right >= 0:
        visible &= j <= diagonal + window_right
    return visible


def _plan(q, k, window_left, window_right, block_k):
    """Key range and block size for this call (small inputs use one block of their own size)."""
    tq, tk = q.shape[1], k.shape[1]
    lo, hi = _visible_key_range(tq, tk, window_left, window_right)
    block_k = max(1, min(block_k, hi - lo))
    mask = functools.partial(_block_mask, tq=tq, tk=tk, lo=lo, hi=hi, block_k=block_k,
                             window_left=int(window_left), window_right=int(window_right))
    return lo, hi, block_k, mask


def _group_queries(x, hkv):
    """[B, T, Hq, D] -> float32 [B, Hkv, G, T, D]: query heads grouped by the kv head they read,
    heads before time so that every product below is a plain batched matmul."""
    b, t, hq, d = x.shape
    return jnp.transpose(x.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d), (0, 2, 3, 1, 4))


def _ungroup_queries(x):
    """Inverse of _group_queries (without the cast): [B, Hkv, G, T, D] -> [B, T, Hq, D]."""
    b, hkv, g, t, d = x.shape
    return jnp.transpose(x, (0, 3, 1, 2, 4)).reshape(b, t, hkv * g, d)


@functools.partial(jax.jit, static_argnames=("scale", "window_left", "window_right", "block_k"))
def attention_forward(q, k, v, *, scale: float, window_left: int, window_right: int,
                      block_k: int = 512):
    """Softmax attention. Returns o [B, Tq, Hq, Dv] in q.dtype and lse [B, Hq, Tq] float32,
    lse[b, h, i] = log(sum_j exp(scale * q_i . k_j)) over the keys query i may see."""
    _check_inputs(q, k, v, block_k, "attention_forward")
    b, tq, hq, _ = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    g = hq // hkv
    lo, hi, block_k, mask_of = _plan(q, k, window_left, window_right, block_k)
    if hi == lo or tq == 0:  # no query sees any key
        return (jnp.zeros((b, tq, hq, dv), q.dtype),
                jnp.full((b, hq, tq), -jnp.inf, jnp.float32))

    qg = _group_queries(q, hkv)
    k_blocks = _key_blocks(k, lo, hi, block_k)
    v_blocks = _key_blocks(v, lo, hi, block_k)

    # Online softmax: running row max m, row sum l (relative to exp(m)) and output acc.
    def step(carry, block):
        m, l, acc = carry
        index, k_blk, v_blk = block
        s = scale * _einsum("bhgqd,bhkd->bhgqk", qg, k_blk)
        s = jnp.where(mask_of(index), s, -jnp.inf)
        # The result does not depend on m (it cancels), so m carries no gradient; a row whose
        # keys are all masked so far keeps m = -inf and uses 0 as its reference instead.
        m_new = lax.stop_gradient(jnp.maximum(m, s.max(axis=-1)))
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_ref[..., None])  # masked entries: exp(-inf) = 0
        rescale = jnp.exp(m - m_ref)       # m = -inf: 0 (nothing accumulated yet)
        l = l * rescale + p.sum(axis=-1)
        acc = acc * rescale[..., None] + _einsum("bhgqk,bhkd->bhgqd", p, v_blk)
        return (m_new, l, acc), None

    # Built from qg (zeros_like) so that inside shard_map the carry has qg's device-varying
    # type, as scan requires of a carry that the loop body makes varying.
    row = jnp.zeros_like(qg[..., 0], jnp.float32)
    init = (jnp.full_like(row, -jnp.inf), row, jnp.zeros_like(qg, jnp.float32, shape=(b, hkv, g, tq, dv)))
    blocks = (jnp.arange(k_blocks.shape[0]), k_blocks, v_blocks)
    # Under jax.grad, checkpointing makes each step keep only its carry and recompute its score
    # block in the backward pass: memory O(Tq * (Tk / block_k) * D) instead of O(Tq * Tk).
    (m, l, acc), _ = lax.scan(jax.checkpoint(step), init, blocks)

    # Rows that saw no key have l = 0: o = 0, lse = -inf. The inner where keeps log and the
    # division finite so that no NaN reaches the gradients either.
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)
    lse = jnp.where(seen, jnp.where(seen, m, 0.0) + jnp.log(l_safe), -jnp.inf)
    return _ungroup_queries(o).astype(q.dtype), lse.reshape(b, hq, tq)


@functools.partial(jax.jit, static_argnames=("scale", "window_left", "window_right", "block_k"))
def attention_backward(q, k, v, o, lse, do, *, scale: float, window_left: int,
                       window_right: int, block_k: int = 512, dlse=None):
    """Gradients (dq, dk, dv) of attention, in the dtypes of q, k, v.

    o [B, Tq, Hq, Dv] and lse [B, Hq, Tq] are used exactly as given: ring attention passes the
    global o and lse of the whole sequence while k, v hold one block of it, and this returns
    that block's share of the gradients. `dlse` (optional, [B, Hq, Tq]) is the cotangent of lse,
    for callers that return lse and differentiate through it; since d lse / d s = P it enters
    as dS = P * (dP - delta + dlse).
    """
    _check_inputs(q, k, v, block_k, "attention_backward")
    b, tq, hq, _ = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    lo, hi, block_k, mask_of = _plan(q, k, window_left, window_right, block_k)
    if hi == lo or tq == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)

    qg = _group_queries(q, hkv)
    dog = _group_queries(do, hkv)
    delta = jnp.sum(dog * _group_queries(o, hkv), axis=-1)  # rowsum(dO * O): [B, Hkv, G, Tq]
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32).reshape(b, hkv, g, tq)
    # Rows with lse = -inf saw no key, so the mask already zeroes their P; using +inf there
    # also keeps exp(s - lse) finite should a caller pass masks that disagree with its lse.
    lse = lse.astype(jnp.float32).reshape(b, hkv, g, tq)
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)[..., None]

    k_blocks = _key_blocks(k, lo, hi, block_k)
    v_blocks = _key_blocks(v, lo, hi, block_k)

    def step(dq, block):
        index, k_blk, v_blk = block
        s = scale * _einsum("bhgqd,bhkd->bhgqk", qg, k_blk)
        p = jnp.where(mask_of(index), jnp.exp(s - lse), 0.0)
        dv_blk = _einsum("bhgqk,bhgqd->bhkd", p, dog)  # sums the G query heads per kv head
        dp = _einsum("bhgqd,bhkd->bhgqk", dog, v_blk)
        ds = p * (dp - delta[..., None])
        dq = dq + scale * _einsum("bhgqk,bhkd->bhgqd", ds, k_blk)
        dk_blk = scale * _einsum("bhgqk,bhgqd->bhkd", ds, qg)
        return dq, (dk_blk, dv_blk)

    blocks = (jnp.arange(k_blocks.shape[0]), k_blocks, v_blocks)
    dq, (dk, dv) = lax.scan(step, jnp.zeros_like(qg), blocks)

    def unblock(x):  # [nblocks, B, Hkv, block_k, D] -> [B, Tk, Hkv, D], zero outside lo..hi
        x = jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(b, -1, hkv, x.shape[-1])[:, : hi - lo]
        return jnp.pad(x, ((0, 0), (lo, tk - hi), (0, 0), (0, 0)))

    return (_ungroup_queries(dq).astype(q.dtype),
            unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype))
