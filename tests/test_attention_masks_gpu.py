"""The attention kernels' masks on the GPU: segment ids, sequence lengths and the diagonal's
alignment, with the causal / window band, against a float64 NumPy reference written here from
the rule (cpp/kernels/attention/attention.h, MaskParams). Per batch row b, query i sees key j iff
    i < q_len[b] and j < kv_len[b] and q_seg[b, i] == kv_seg[b, j]
    and (window_left  < 0 or j >= i + off_b - window_left)
    and (window_right < 0 or j <= i + off_b + window_right)
with off_b = kv_len[b] - q_len[b] (bottom_right) or 0. Rows that see no key: o = 0, lse = -inf,
dq = 0; keys no row sees: dk = dv = 0. The kernel wrappers of tk_jax._kernels are called
directly; outputs are poisoned before each launch."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_util import poison_device_memory, rel_l2
from tk_jax import _kernels

pytestmark = pytest.mark.gpu


# ---------------------------------------------------------------- the reference (float64)

def visible(tq, tk, wl, wr, q_seg=None, kv_seg=None, q_len=None, kv_len=None, bottom_right=True):
    """[B, Tq, Tk] bool: the mask rule, for B = len(q_len) or len(q_seg) or 1."""
    batch = len(q_len) if q_len is not None else len(q_seg) if q_seg is not None else 1
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    out = np.zeros((batch, tq, tk), bool)
    for b in range(batch):
        ql = tq if q_len is None else int(np.clip(q_len[b], 0, tq))
        kl = tk if kv_len is None else int(np.clip(kv_len[b], 0, tk))
        off = kl - ql if bottom_right else 0
        m = (i < ql) & (j < kl)
        if q_seg is not None:
            m &= q_seg[b][:, None] == kv_seg[b][None, :]
        if wl >= 0:
            m &= j >= i + off - wl
        if wr >= 0:
            m &= j <= i + off + wr
        out[b] = m
    return out


def reference(q, k, v, do, scale, vis, dlse=None):
    """o, lse and (with do) dq, dk, dv in float64 under the [B, Tq, Tk] mask `vis`."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, tq, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    o = np.zeros(q.shape)
    lse = np.full((batch, hq, tq), -np.inf)
    grads = None if do is None else [np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)]
    for b in range(batch):
        m = vis[b]
        seen = m.any(axis=1)
        for h in range(hq):
            kh = h // group
            s = np.where(m, scale * q[b, :, h] @ k[b, :, kh].T, -np.inf)
            row_max = np.where(seen, s.max(axis=1, initial=-np.inf), 0.0)
            e = np.where(m, np.exp(s - row_max[:, None]), 0.0)
            total = e.sum(axis=1)
            p = np.where(seen[:, None], e / np.where(seen, total, 1.0)[:, None], 0.0)
            o[b, :, h] = p @ v[b, :, kh]
            with np.errstate(divide="ignore"):
                lse[b, h] = np.where(seen, row_max + np.log(np.where(seen, total, 1.0)), -np.inf)
            if do is not None:
                dout = np.asarray(do[b, :, h], np.float64)
                dp = dout @ v[b, :, kh].T
                delta = (dout * o[b, :, h]).sum(axis=1)
                if dlse is not None:
                    delta = delta - np.where(seen, dlse[b, h], 0.0)
                ds = p * (dp - delta[:, None])
                grads[0][b, :, h] = scale * ds @ k[b, :, kh]
                grads[1][b, :, kh] += scale * ds.T @ q[b, :, h]
                grads[2][b, :, kh] += p.T @ dout
    return o, lse, grads


# ---------------------------------------------------------------- segment layouts

def segments(rng, t, layout):
    """[t] int32 segment ids of one row. sorted: documents of random lengths, ids increasing;
    long_short: one long document and many short ones; tiny: one-token documents between longer
    ones; unsorted: runs of random ids from a small set, so that one id recurs far apart;
    single: one id throughout; edges: documents of lengths around the kernels' tile and chunk
    sides (64, 128) and a few long ones, so that documents start mid-chunk, tiles are cut short
    by the next document's start, short documents share a tile, and a long document precedes
    the next one's start within a chunk."""
    if layout == "single":
        return np.full(t, 7, np.int32)
    if layout == "unsorted":
        ids, pos = np.empty(t, np.int32), 0
        while pos < t:
            run = int(rng.integers(1, 150))
            ids[pos:pos + run] = rng.integers(-3, 4)
            pos += run
        return ids
    lengths = []
    while sum(lengths) < t:
        if layout == "sorted":
            lengths.append(int(rng.integers(1, max(2, t // 3))))
        elif layout == "long_short":
            lengths.append(int(rng.integers(1, 40)) if lengths else int(rng.integers(t // 3, t + 1)))
        elif layout == "tiny":
            lengths.append(1 if rng.random() < 0.6 else int(rng.integers(2, 200)))
        elif layout == "edges":
            lengths.append(int(rng.choice([1, 2, 31, 63, 64, 65, 127, 128, 129, 191, 300, 700])))
        else:
            raise ValueError(layout)
    if layout == "long_short":
        rng.shuffle(lengths)
    start = int(rng.integers(-5, 5))
    return np.repeat(np.arange(start, start + len(lengths), dtype=np.int32), lengths)[:t]


def _inputs(rng, b, tq, tk, hq, hkv, d, dtype):
    q = rng.standard_normal((b, tq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, tk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, tk, hkv, d)).astype(dtype)
    do = rng.standard_normal((b, tq, hq, d)).astype(dtype)
    return q, k, v, do


# ---------------------------------------------------------------- running the kernels

def run_kernels(q, k, v, do, *, scale, wl, wr, masks, bottom_right=True, backward=True, dlse=None):
    """o, lse (and dq, dk, dv) from tk_jax._kernels under jit, outputs poisoned first. `masks`:
    the keyword arguments q_segment_ids, kv_segment_ids, q_seq_lengths, kv_seq_lengths (NumPy
    arrays or absent)."""
    masks = {name: jnp.asarray(x, jnp.int32) for name, x in masks.items() if x is not None}

    @jax.jit
    def fn(q, k, v, do, dlse, masks):
        kw = dict(scale=scale, window_left=wl, window_right=wr, bottom_right=bottom_right, **masks)
        o, lse = _kernels.attention_fwd(q, k, v, **kw)
        if not backward:
            return o, lse
        return (o, lse, *_kernels.attention_bwd(q, k, v, o, lse, do, dlse, **kw))

    if do is None:
        do = q
    poison_device_memory(8 * (q.nbytes + 2 * k.nbytes) + 4 * q.size // q.shape[-1])
    out = fn(*(jnp.asarray(x) for x in (q, k, v, do)), None if dlse is None else jnp.asarray(dlse, jnp.float32),
             masks)
    return [np.asarray(x.astype(jnp.float32), np.float64) for x in out]


def check(rng, q, k, v, do, *, wl, wr, masks, bottom_right=True, backward=True, with_dlse=False):
    """Kernel against the reference: o and lse (rows that see nothing exactly 0 and -inf), and
    dq, dk, dv (exactly 0 for rows and keys that see nothing)."""
    scale = 1 / math.sqrt(q.shape[-1])
    vis = visible(q.shape[1], k.shape[1], wl, wr, bottom_right=bottom_right,
                  **{name: masks.get(name) for name in ("q_seg", "kv_seg", "q_len", "kv_len")})
    if vis.shape[0] == 1 and q.shape[0] > 1:
        vis = np.broadcast_to(vis, (q.shape[0], *vis.shape[1:]))
    dlse = rng.standard_normal((q.shape[0], q.shape[2], q.shape[1])).astype(np.float32) if with_dlse else None
    kernel_masks = dict(q_segment_ids=masks.get("q_seg"), kv_segment_ids=masks.get("kv_seg"),
                        q_seq_lengths=masks.get("q_len"), kv_seq_lengths=masks.get("kv_len"))
    got = run_kernels(q, k, v, do, scale=scale, wl=wl, wr=wr, masks=kernel_masks, bottom_right=bottom_right,
                      backward=backward, dlse=dlse)
    o_ref, lse_ref, grads_ref = reference(q, k, v, do if backward else None, scale, vis, dlse)
    o, lse = got[:2]
    seen = vis.any(axis=2)  # [B, Tq]
    assert np.isfinite(o).all(), "o has NaN/inf (unwritten rows?)"
    assert (o[~seen] == 0).all(), "rows that see no key must give o = 0"
    assert rel_l2(o, o_ref) < 1e-2, rel_l2(o, o_ref)
    seen_h = np.broadcast_to(seen[:, None, :], lse.shape)
    assert (lse[~seen_h] == -np.inf).all(), "rows that see no key must give lse = -inf"
    assert np.isfinite(lse[seen_h]).all()
    np.testing.assert_allclose(lse[seen_h], lse_ref[seen_h], rtol=2e-3, atol=2e-3)
    if not backward:
        return
    group = q.shape[2] // k.shape[2]
    key_seen = vis.any(axis=1)  # [B, Tk]: some row sees the key (in every head alike)
    for name, g, want in zip(("dq", "dk", "dv"), got[2:], grads_ref):
        assert np.isfinite(g).all(), f"{name} has NaN/inf"
        idle = ~(seen if name == "dq" else key_seen)
        assert (g[idle] == 0).all(), f"{name} must be 0 for {'rows' if name == 'dq' else 'keys'} that see nothing"
        # Relative L2 with a floor for gradients that are zero in exact arithmetic.
        err = np.linalg.norm(g - want) / max(np.linalg.norm(want), 1e-2 * math.sqrt(want.size))
        assert err < 1e-2, (name, err, group)


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize(
    "d,t,hq,hkv,causal,layout,dtype",
    [
        (64, 1000, 4, 4, True, "sorted", jnp.bfloat16),
        (64, 2049, 8, 2, False, "long_short", jnp.float16),
        (64, 77, 4, 1, True, "tiny", jnp.bfloat16),
        (128, 2049, 8, 2, True, "sorted", jnp.float16),
        (128, 1000, 4, 4, False, "unsorted", jnp.bfloat16),
        (128, 1000, 8, 1, True, "tiny", jnp.float16),
        (128, 4500, 4, 2, True, "long_short", jnp.bfloat16),  # > 4096 keys
        (256, 1000, 4, 1, True, "sorted", jnp.bfloat16),
        (256, 777, 8, 2, False, "tiny", jnp.float16),
        (256, 1000, 2, 2, True, "unsorted", jnp.float16),
        (64, 1, 2, 2, True, "single", jnp.bfloat16),
        (128, 1000, 4, 2, True, "single", jnp.bfloat16),
        (64, 1300, 4, 4, False, "edges", jnp.float16),
        (128, 1500, 8, 2, True, "edges", jnp.bfloat16),
        (128, 1111, 4, 1, False, "edges", jnp.float16),
        (256, 900, 4, 1, True, "edges", jnp.bfloat16),
    ],
)
def test_packed_segments(hopper, rng, d, t, hq, hkv, causal, layout, dtype):
    """Self-attention over rows packed with documents (segment ids, Tq = Tk), forward and
    backward, per layout: sorted ids, one long document among short ones, one-token documents,
    unsorted ids recurring far apart, one id throughout (the segment mask must then cost
    nothing and change nothing)."""
    b = 2
    q, k, v, do = _inputs(rng, b, t, t, hq, hkv, d, dtype)
    seg = np.stack([segments(rng, t, layout) for _ in range(b)])
    check(rng, q, k, v, do, wl=-1, wr=0 if causal else -1, masks=dict(q_seg=seg, kv_seg=seg))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bottom_right", [True, False])
def test_cross_segments_empty_segments_and_windows(hopper, rng, d, bottom_right):
    """Tq != Tk with ids drawn apart for queries and keys: ids only one side holds are empty
    segments (their rows see nothing, their keys get no gradient); a sliding window on top, in
    both alignments."""
    b, tq, tk = 2, 333, 1000
    q, k, v, do = _inputs(rng, b, tq, tk, 4, 2, d, jnp.bfloat16)
    q_seg = np.sort(rng.integers(0, 6, (b, tq)), axis=1).astype(np.int32)
    kv_seg = np.sort(rng.integers(1, 8, (b, tk)), axis=1).astype(np.int32)
    check(rng, q, k, v, do, wl=200, wr=50, masks=dict(q_seg=q_seg, kv_seg=kv_seg), bottom_right=bottom_right)


@pytest.mark.parametrize(
    "d,tq,tk,hq,hkv,causal,window,dtype",
    [
        (64, 1000, 1000, 4, 4, True, (-1, -1), jnp.bfloat16),
        (128, 77, 2049, 8, 2, True, (-1, -1), jnp.float16),
        (128, 2049, 77, 4, 1, False, (-1, -1), jnp.bfloat16),
        (256, 1000, 1000, 4, 2, False, (100, 30), jnp.bfloat16),
        (128, 4200, 4200, 2, 1, True, (-1, -1), jnp.bfloat16),  # the forward's plain grid
        (64, 1, 1, 2, 1, False, (-1, -1), jnp.float16),
    ],
)
@pytest.mark.parametrize("bottom_right", [True, False])
def test_sequence_lengths(hopper, rng, d, tq, tk, hq, hkv, causal, window, dtype, bottom_right):
    """Padding: per-row lengths including 0, the full length and values outside [0, T] (clamped),
    with causal / windowed bands in both alignments; padded rows give 0 / -inf and zero
    gradients, padded keys zero gradients."""
    b = 5
    q, k, v, do = _inputs(rng, b, tq, tk, hq, hkv, d, dtype)
    q_len = np.array([tq, 0, int(rng.integers(0, tq + 1)), int(rng.integers(0, tq + 1)), tq + 7], np.int32)
    kv_len = np.array([int(rng.integers(0, tk + 1)), tk, 0, int(rng.integers(0, tk + 1)), -3], np.int32)
    wl, wr = window[0], 0 if causal else window[1]
    check(rng, q, k, v, do, wl=wl, wr=wr, masks=dict(q_len=q_len, kv_len=kv_len), bottom_right=bottom_right)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_segments_with_lengths_window_and_dlse(hopper, rng, d, dtype):
    """Everything at once: packed rows that end in padding (segment ids and lengths), a causal
    sliding window, top-left alignment, GQA 4:1, odd lengths, and a cotangent for lse."""
    b, t = 3, 1000
    q, k, v, do = _inputs(rng, b, t, t, 4, 1, d, dtype)
    seg = np.stack([segments(rng, t, "sorted") for _ in range(b)])
    lengths = np.array([t, 531, 1], np.int32)
    check(rng, q, k, v, do, wl=300, wr=0, masks=dict(q_seg=seg, kv_seg=seg, q_len=lengths, kv_len=lengths),
          bottom_right=False, with_dlse=True)


def test_forward_is_deterministic_with_masks(hopper, rng):
    q, k, v, _ = _inputs(rng, 2, 1500, 1500, 8, 2, 128, jnp.bfloat16)
    seg = np.stack([segments(rng, 1500, "tiny") for _ in range(2)])
    masks = dict(q_segment_ids=seg, kv_segment_ids=seg, q_seq_lengths=np.array([1500, 1111], np.int32),
                 kv_seq_lengths=np.array([1400, 1500], np.int32))
    runs = [run_kernels(q, k, v, None, scale=0.1, wl=-1, wr=0, masks=masks, backward=False) for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_nan_reaches_exactly_the_rows_that_see_it(hopper, rng, d):
    """A NaN in q reaches its row's o and lse, and its row's dq; a NaN in k reaches the o and lse
    of exactly the rows that see that key (segments and causal mask the others); a NaN in v the
    o of the rows that see it. Rows that see nothing stay 0 / -inf. Everything in other batch
    rows stays finite."""
    b, t, hq, hkv = 2, 500, 4, 2
    q, k, v, do = _inputs(rng, b, t, t, hq, hkv, d, jnp.bfloat16)
    seg = np.stack([segments(rng, t, "sorted") for _ in range(b)])
    q_len = np.array([t - 37, t], np.int32)
    masks = dict(q_segment_ids=seg, kv_segment_ids=seg, q_seq_lengths=q_len, kv_seq_lengths=np.array([t, t], np.int32))
    vis = visible(t, t, -1, 0, q_seg=seg, kv_seg=seg, q_len=q_len, kv_len=[t, t])
    i0, h0 = 300, 1
    j0 = 200
    scale = 1 / math.sqrt(d)
    kv0 = h0 // (hq // hkv)

    # NaN in q[0, i0, h0]
    qn = q.copy()
    qn[0, i0, h0, 3] = np.nan
    o, lse, dq, dk, dv = run_kernels(qn, k, v, do, scale=scale, wl=-1, wr=0, masks=masks)
    assert vis[0, i0].any()
    assert np.isnan(o[0, i0, h0]).all() and np.isnan(lse[0, h0, i0])
    others = np.ones(o.shape[:3], bool)
    others[0, i0, h0] = False
    assert np.isfinite(o[others]).all()
    assert np.isnan(dq[0, i0, h0]).all()
    assert np.isfinite(dq[others]).all()
    keys = vis[0, i0]
    assert np.isnan(dk[0, keys, kv0]).all() and np.isnan(dv[0, keys, kv0]).all()
    assert np.isfinite(dk[1]).all() and np.isfinite(dv[1]).all()

    # NaN in k[0, j0, kv0]: the rows of kv0's query heads that see key j0, and only them
    kn = k.copy()
    kn[0, j0, kv0, 5] = np.nan
    o, lse = run_kernels(q, kn, v, None, scale=scale, wl=-1, wr=0, masks=masks, backward=False)
    sees = np.zeros(o.shape[:3], bool)
    for h in range(hq):
        if h // (hq // hkv) == kv0:
            sees[0, :, h] = vis[0, :, j0]
    assert sees.any() and (~sees & vis.any(axis=2)[:, :, None]).any()
    assert np.isnan(o[sees]).all()
    assert np.isfinite(o[~sees]).all()
    lse_t = np.swapaxes(lse, 1, 2)  # [B, T, H]
    assert np.isnan(lse_t[sees]).all()
    seen = np.broadcast_to(vis.any(axis=2)[:, :, None], sees.shape)
    assert np.isfinite(lse_t[~sees & seen]).all() and (lse_t[~seen] == -np.inf).all()

    # NaN in v[0, j0, kv0]: at least the rows that see key j0; rows that see nothing stay 0
    vn = v.copy()
    vn[0, j0, kv0, 7] = np.nan
    o, lse = run_kernels(q, k, vn, None, scale=scale, wl=-1, wr=0, masks=masks, backward=False)
    assert np.isnan(o[sees][:, 7]).all()  # the NaN's column of the rows that see it, as P V
    assert np.isfinite(np.delete(o[sees], 7, axis=-1)).all()
    assert (o[~seen] == 0).all() and np.isfinite(o[1]).all()
    assert np.isfinite(np.swapaxes(lse, 1, 2)[seen]).all()  # lse does not read v


def test_vmap_folds_masks_with_the_batch(hopper, rng):
    """Under vmap the leading axes fold into the batch in C++, the segment ids' and lengths'
    with q's: each vmapped slice equals the call on that slice alone."""
    n, b, t = 3, 2, 300
    q, k, v, do = _inputs(rng, n * b, t, t, 4, 2, 64, jnp.bfloat16)
    q, k, v, do = (x.reshape(n, b, *x.shape[1:]) for x in (q, k, v, do))
    seg = np.stack([segments(rng, t, "tiny") for _ in range(n * b)]).reshape(n, b, t)
    lengths = rng.integers(0, t + 1, (n, b)).astype(np.int32)
    kw = dict(scale=0.125, window_left=-1, window_right=0)

    def fwd(q, k, v, seg, lengths):
        return _kernels.attention_fwd(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_seq_lengths=lengths,
                                      kv_seq_lengths=lengths, **kw)

    poison_device_memory(8 * q.nbytes)
    o, lse = jax.jit(jax.vmap(fwd))(*(jnp.asarray(x) for x in (q, k, v, seg, lengths)))
    for i in range(n):
        o_i, lse_i = jax.jit(fwd)(*(jnp.asarray(x[i]) for x in (q, k, v, seg, lengths)))
        np.testing.assert_array_equal(np.asarray(o[i].astype(jnp.float32)), np.asarray(o_i.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(lse[i]), np.asarray(lse_i))
        vis = visible(t, t, -1, 0, q_seg=seg[i], kv_seg=seg[i], q_len=lengths[i], kv_len=lengths[i])
        o_ref, _, _ = reference(q[i], k[i], v[i], None, 0.125, vis)
        assert rel_l2(np.asarray(o_i.astype(jnp.float32)), o_ref) < 1e-2


def test_mask_shapes_are_checked_in_cpp(hopper, rng):
    """The handler checks the mask arrays' shapes and returns an error naming the argument."""
    q, k, v, do = _inputs(rng, 2, 100, 120, 2, 2, 64, jnp.bfloat16)
    kw = dict(scale=0.125, window_left=-1, window_right=-1)
    seg_q = jnp.zeros((2, 100), jnp.int32)
    with pytest.raises(Exception, match="kv_segment_ids must be"):
        jax.block_until_ready(_kernels.attention_fwd(q, k, v, q_segment_ids=seg_q, kv_segment_ids=seg_q, **kw))
    with pytest.raises(Exception, match="q_seq_lengths and kv_seq_lengths must be"):
        jax.block_until_ready(_kernels.attention_fwd(q, k, v, q_seq_lengths=jnp.zeros((3,), jnp.int32), **kw))
    o, lse = _kernels.attention_fwd(q, k, v, **kw)
    with pytest.raises(Exception, match="q_segment_ids must be"):
        jax.block_until_ready(_kernels.attention_bwd(q, k, v, o, lse, do, q_segment_ids=jnp.zeros((2, 99), jnp.int32),
                                                     kv_segment_ids=jnp.zeros((2, 120), jnp.int32), **kw))
