"""Pure-JAX attention: the CPU backend and the oracle the CUDA kernels are tested against.

Both functions walk over the keys in blocks of `block_k` (the FlashAttention scheme), so the
largest temporary is a [B, Hq, Tq, block_k] score block, never a Tq x Tk matrix: a CPU user can
run Tq = Tk = 16384.

Shapes (rank 4 exactly; the public wrapper folds extra batch dimensions into B):
    q [B, Tq, Hq, D], k [B, Tk, Hkv, D], v [B, Tk, Hkv, Dv], Hq % Hkv == 0,
    q_segment_ids [B, Tq], kv_segment_ids [B, Tk] (both or neither), q_seq_lengths and
    kv_seq_lengths [B] (each optional), all integers.
Grouped-query attention: query head h uses kv head h // (Hq // Hkv). Queries are viewed as
[B, Tq, Hkv, G, D] (G = Hq // Hkv query heads per kv head) so K and V are never repeated.

Masking, per batch row b (lengths default to Tq and Tk and are clamped to [0, T]):
    query i sees key j iff  i < q_len[b] and j < kv_len[b]
                            and q_segment_ids[b, i] == kv_segment_ids[b, j]
                            and (window_left  < 0 or j >= i + off_b - window_left)
                            and (window_right < 0 or j <= i + off_b + window_right)
with off_b = kv_len[b] - q_len[b] when bottom_right (FlashAttention's alignment; Tk - Tq
without lengths) and off_b = 0 otherwise (jax.nn.dot_product_attention's top-left alignment).

Non-finite values behave as in plain softmax attention, where masked entries are left out of
the sums: a NaN or inf in q, k or v that a row sees makes that row's o NaN (and its lse, for q
and k), forward and backward alike; a row that sees no key gets o = 0, lse = -inf and zero
gradients whatever the inputs hold; keys that no query sees get zero dk and dv. (Products with
a masked-out probability of 0 would otherwise turn an unseen inf or NaN into a NaN.) A score
of -inf weighs nothing, as a masked one: a row whose visible scores are all -inf counts as a
row that sees no key (plain softmax would give 0 / 0 there).

All arithmetic is float32 with full-precision matmuls (on a GPU, XLA would otherwise use TF32
for float32 matmuls, which is too coarse for an oracle).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST
_STATIC = ("scale", "window_left", "window_right", "bottom_right", "block_k")


def _einsum(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _finite_or_zero(x):
    """x with its non-finite entries replaced by 0, in float32: for the products whose NaN
    would otherwise leak through a masked-out 0 into rows that never saw it."""
    x = x.astype(jnp.float32)
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _check_inputs(q, k, v, masks, block_k, op):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{op}: {name} must have rank 4 [B, T, H, D], got shape {x.shape}")
    b, tq, hq, d = q.shape
    tk = k.shape[1]
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
    if (masks.q_segment_ids is None) != (masks.kv_segment_ids is None):
        raise ValueError(f"{op}: q_segment_ids and kv_segment_ids must be given together")
    expected = {"q_segment_ids": (b, tq), "kv_segment_ids": (b, tk), "q_seq_lengths": (b,),
                "kv_seq_lengths": (b,)}
    for name, x in masks._asdict().items():
        if x is None:
            continue
        if tuple(x.shape) != expected[name] or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{op}: {name} must be integers of shape {expected[name]}, got "
                             f"{x.dtype} {tuple(x.shape)}")


class _Masks(NamedTuple):
    """The data-dependent masks of one call (None where absent)."""
    q_segment_ids: jax.Array | None
    kv_segment_ids: jax.Array | None
    q_seq_lengths: jax.Array | None
    kv_seq_lengths: jax.Array | None


class _Plan(NamedTuple):
    """How one call walks over the keys: the static range [lo, hi) of keys that some query
    may see (keys outside it are skipped and get zero gradients), the block size, and the
    per-row quantities of the mask rule, as [B or 1, 1, 1] arrays or Python ints."""
    lo: int
    hi: int
    block_k: int
    q_len: object
    kv_len: object
    offset: object


def _plan(q, k, masks, window_left, window_right, bottom_right, block_k) -> _Plan:
    tq, tk = q.shape[1], k.shape[1]

    def length(x, full):  # [B] -> [B, 1, 1], clamped to [0, T]; None -> the full length
        return full if x is None else jnp.clip(x.astype(jnp.int32), 0, full)[:, None, None]

    q_len = length(masks.q_seq_lengths, tq)
    kv_len = length(masks.kv_seq_lengths, tk)
    offset = (kv_len - q_len) if bottom_right else 0
    if isinstance(offset, int):  # the diagonal is known while tracing: skip keys no one sees
        lo = max(0, offset - window_left) if window_left >= 0 else 0
        hi = min(tk, tq - 1 + offset + window_right + 1) if window_right >= 0 else tk
    else:
        lo, hi = 0, tk
    hi = max(lo, hi)
    return _Plan(lo, hi, max(1, min(block_k, hi - lo)), q_len, kv_len, offset)


def _key_blocks(x, plan, fill=0):
    """Keys lo..hi-1 of x [B, Tk, ...] as blocks [nblocks, B, block_k, ...], padded with
    `fill` to whole blocks (padding keys are masked out: their index is >= hi)."""
    lo, hi, block_k = plan.lo, plan.hi, plan.block_k
    x = x[:, lo:hi]
    n = hi - lo
    nblocks = -(-n // block_k)
    pad = [(0, 0), (0, nblocks * block_k - n)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, pad, constant_values=fill)
    x = x.reshape((x.shape[0], nblocks, block_k) + x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _head_major(blocks):
    """[nblocks, B, block_k, H, D] -> [nblocks, B, H, block_k, D] (for plain batched matmuls)."""
    return jnp.swapaxes(blocks, 2, 3)


def _block_mask(index, kv_segment_ids, *, plan, q_segment_ids, tq, window_left, window_right):
    """[B or 1, Tq, block_k] bool: which (query, key) pairs of key block `index` are visible.
    kv_segment_ids: this block's key segment ids [B, block_k], or None."""
    i = jnp.arange(tq)[None, :, None]
    j = plan.lo + index * plan.block_k + jnp.arange(plan.block_k)[None, None, :]
    visible = j < plan.hi
    diagonal = i + plan.offset
    if window_left >= 0:
        visible &= j >= diagonal - window_left
    if window_right >= 0:
        visible &= j <= diagonal + window_right
    if not isinstance(plan.q_len, int):
        visible &= i < plan.q_len
    if not isinstance(plan.kv_len, int):
        visible &= j < plan.kv_len
    if q_segment_ids is not None:
        visible &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return visible


def _group_queries(x, hkv):
    """[B, T, Hq, D] -> float32 [B, Hkv, G, T, D]: query heads grouped by the kv head they read,
    heads before time so that every product below is a plain batched matmul."""
    b, t, hq, d = x.shape
    return jnp.transpose(x.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d), (0, 2, 3, 1, 4))


def _ungroup_queries(x):
    """Inverse of _group_queries (without the cast): [B, Hkv, G, T, D] -> [B, T, Hq, D]."""
    b, hkv, g, t, d = x.shape
    return jnp.transpose(x, (0, 3, 1, 2, 4)).reshape(b, t, hkv * g, d)


def _setup(q, k, v, masks, *, window_left, window_right, bottom_right, block_k, op):
    masks = _Masks(*masks)
    _check_inputs(q, k, v, masks, block_k, op)
    plan = _plan(q, k, masks, window_left, window_right, bottom_right, block_k)
    mask_of = functools.partial(_block_mask, plan=plan, q_segment_ids=masks.q_segment_ids,
                                tq=q.shape[1], window_left=int(window_left),
                                window_right=int(window_right))
    kv_segments = (None if masks.kv_segment_ids is None
                   else _key_blocks(masks.kv_segment_ids, plan))
    return plan, mask_of, kv_segments


@functools.partial(jax.jit, static_argnames=_STATIC)
def attention_forward(q, k, v, *, scale: float, window_left: int, window_right: int,
                      q_segment_ids=None, kv_segment_ids=None, q_seq_lengths=None,
                      kv_seq_lengths=None, bottom_right: bool = True, block_k: int = 512):
    """Softmax attention. Returns o [B, Tq, Hq, Dv] in q.dtype and lse [B, Hq, Tq] float32,
    lse[b, h, i] = log(sum_j exp(scale * q_i . k_j)) over the keys query i may see."""
    masks = (q_segment_ids, kv_segment_ids, q_seq_lengths, kv_seq_lengths)
    plan, mask_of, kv_segments = _setup(q, k, v, masks, window_left=window_left,
                                        window_right=window_right, bottom_right=bottom_right,
                                        block_k=block_k, op="attention_forward")
    b, tq, hq, _ = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    g = hq // hkv
    if plan.hi == plan.lo or tq == 0:  # no query sees any key
        return (jnp.zeros((b, tq, hq, dv), q.dtype),
                jnp.full((b, hq, tq), -jnp.inf, jnp.float32))

    qg = _group_queries(q, hkv)
    k_blocks = _head_major(_key_blocks(k.astype(jnp.float32), plan))
    v_blocks = _head_major(_key_blocks(v.astype(jnp.float32), plan))

    # Online softmax: running row max m, row sum l (relative to exp(m)) and output acc, plus
    # whether each row has seen a non-finite value of v.
    def step(carry, block):
        m, l, acc, spoiled = carry
        index, k_blk, v_blk, segments = block
        # A key whose v holds a non-finite value (per kv head: [B, Hkv, block_k]) spoils the
        # rows that see it, below; its finite stand-in 0 keeps it out of the other rows.
        bad_blk = ~jnp.all(jnp.isfinite(v_blk), axis=-1)
        v_blk = _finite_or_zero(v_blk)
        visible = mask_of(index, segments)  # [B or 1, Tq, block_k]
        s = scale * _einsum("bhgqd,bhkd->bhgqk", qg, k_blk)
        s = jnp.where(visible[:, None, None], s, -jnp.inf)
        # The result does not depend on m (it cancels), so m carries no gradient; a row whose
        # keys are all masked so far keeps m = -inf and uses 0 as its reference instead.
        m_new = lax.stop_gradient(jnp.maximum(m, s.max(axis=-1)))
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_ref[..., None])  # masked entries: exp(-inf) = 0
        rescale = jnp.exp(m - m_ref)       # m = -inf: 0 (nothing accumulated yet)
        l = l * rescale + p.sum(axis=-1)
        acc = acc * rescale[..., None] + _einsum("bhgqk,bhkd->bhgqd", p, v_blk)
        spoiled = spoiled | jnp.any(visible[:, None] & bad_blk[:, :, None, :], axis=-1)
        return (m_new, l, acc, spoiled), None

    # Built from qg (zeros_like) so that inside shard_map the carry has qg's device-varying
    # type, as scan requires of a carry that the loop body makes varying.
    row = jnp.zeros_like(qg[..., 0], jnp.float32)
    init = (jnp.full_like(row, -jnp.inf), row,
            jnp.zeros_like(qg, jnp.float32, shape=(b, hkv, g, tq, dv)),
            jnp.zeros_like(row[:, :, 0], bool))
    blocks = (jnp.arange(k_blocks.shape[0]), k_blocks, v_blocks, kv_segments)
    # Under jax.grad, checkpointing makes each step keep only its carry and recompute its score
    # block in the backward pass: memory O(Tq * (Tk / block_k) * D) instead of O(Tq * Tk).
    (m, l, acc, spoiled), _ = lax.scan(jax.checkpoint(step), init, blocks)

    # l = 0 exactly for the rows that saw no key (or only scores of -inf, which weigh nothing
    # either): o = 0, lse = -inf; the inner wheres keep log and the division finite there, so
    # that no NaN reaches the gradients. Every other row has l >= 1, or NaN if it saw a NaN.
    seen = l != 0
    l_safe = jnp.where(seen, l, 1.0)
    o = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)
    o = jnp.where((spoiled[:, :, None, :] & seen)[..., None], jnp.nan, o)
    lse = jnp.where(seen, jnp.where(seen, m, 0.0) + jnp.log(l_safe), -jnp.inf)
    return _ungroup_queries(o).astype(q.dtype), lse.reshape(b, hq, tq)


@functools.partial(jax.jit, static_argnames=_STATIC)
def attention_backward(q, k, v, o, lse, do, *, scale: float, window_left: int,
                       window_right: int, q_segment_ids=None, kv_segment_ids=None,
                       q_seq_lengths=None, kv_seq_lengths=None, bottom_right: bool = True,
                       block_k: int = 512, dlse=None):
    """Gradients (dq, dk, dv) of attention, in the dtypes of q, k, v.

    o [B, Tq, Hq, Dv] and lse [B, Hq, Tq] are used exactly as given: ring attention passes the
    global o and lse of the whole sequence while k, v hold one block of it, and this returns
    that block's share of the gradients. `dlse` (optional, [B, Hq, Tq]) is the cotangent of lse,
    for callers that return lse and differentiate through it; since d lse / d s = P it enters
    as dS = P * (dP - delta + dlse).
    """
    masks = (q_segment_ids, kv_segment_ids, q_seq_lengths, kv_seq_lengths)
    plan, mask_of, kv_segments = _setup(q, k, v, masks, window_left=window_left,
                                        window_right=window_right, bottom_right=bottom_right,
                                        block_k=block_k, op="attention_backward")
    b, tq, hq, _ = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    lo, hi = plan.lo, plan.hi
    if hi == lo or tq == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)

    qg = _group_queries(q, hkv)
    q_safe = _group_queries(_finite_or_zero(q), hkv)
    dog = _group_queries(do, hkv)
    delta = jnp.sum(dog * _group_queries(o, hkv), axis=-1)  # rowsum(dO * O): [B, Hkv, G, Tq]
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32).reshape(b, hkv, g, tq)
    # Rows with lse = -inf saw no key, so the mask already zeroes their P; using +inf there
    # also keeps exp(s - lse) finite should a caller pass masks that disagree with its lse.
    lse = lse.astype(jnp.float32).reshape(b, hkv, g, tq)
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)[..., None]

    # Scores use k as it is (a non-finite k_j spoils only the scores of key j, and the rows
    # that see j); the products dS K, dS^T Q and dO V^T use finite stand-ins, since their
    # masked-out zeros would carry a NaN into rows or keys that never saw it. A row that saw
    # a non-finite value has a NaN lse or o (so NaN delta), hence a NaN dS, which they carry.
    k_blocks = _head_major(_key_blocks(k.astype(jnp.float32), plan))
    v_blocks = _head_major(_key_blocks(v.astype(jnp.float32), plan))

    def step(dq, block):
        index, k_blk, v_blk, segments = block
        k_safe_blk, v_blk = _finite_or_zero(k_blk), _finite_or_zero(v_blk)
        visible = mask_of(index, segments)[:, None, None]
        s = scale * _einsum("bhgqd,bhkd->bhgqk", qg, k_blk)
        p = jnp.where(visible, jnp.exp(s - lse), 0.0)
        dv_blk = _einsum("bhgqk,bhgqd->bhkd", p, dog)  # sums the G query heads per kv head
        dp = _einsum("bhgqd,bhkd->bhgqk", dog, v_blk)
        ds = jnp.where(visible, p * (dp - delta[..., None]), 0.0)
        dq = dq + scale * _einsum("bhgqk,bhkd->bhgqd", ds, k_safe_blk)
        dk_blk = scale * _einsum("bhgqk,bhgqd->bhkd", ds, q_safe)
        return dq, (dk_blk, dv_blk)

    blocks = (jnp.arange(k_blocks.shape[0]), k_blocks, v_blocks, kv_segments)
    dq, (dk, dv) = lax.scan(step, jnp.zeros_like(qg), blocks)

    def unblock(x):  # [nblocks, B, Hkv, block_k, D] -> [B, Tk, Hkv, D], zero outside lo..hi
        x = jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(b, -1, hkv, x.shape[-1])[:, : hi - lo]
        return jnp.pad(x, ((0, 0), (lo, tk - hi), (0, 0), (0, 0)))

    return (_ungroup_queries(dq).astype(q.dtype),
            unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype))
