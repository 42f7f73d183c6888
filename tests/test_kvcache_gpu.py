"""The KV-cache attention kernel (tk_jax._kernels.attention_kvcache) against a float64 NumPy
reference on the GPU: contiguous and paged caches (shuffled page tables, pages of 16 to 256
tokens), random cache lengths including 0 and full, GQA ratios 1/4/8/MQA, 1 to 16 query tokens,
head dims 64/128/256, bf16 and fp16, windows and causal masks, the keys in one split or several.
Cache rows at or past a row's length hold NaN and the page-table entries past its last page hold
garbage: neither may reach the output. Outputs are poisoned before each launch, and every call
runs twice and must give the same bits."""
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_util import poison_device_memory, rel_l2
from tk_jax import _kernels

pytestmark = pytest.mark.gpu

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------
# The reference, in float64, written from the contract (cpp/kernels/kvcache/kvcache.h)

def logical_cache(cache, page_table):
    """[B, capacity, Hkv, D]: a contiguous cache as is, a paged one gathered through its table
    (page ids clamped into range, as the kernel does)."""
    if page_table is None:
        return cache
    pages, page_size = cache.shape[:2]
    ids = np.clip(page_table, 0, pages - 1)
    b, max_pages = ids.shape
    return cache[ids].reshape(b, max_pages * page_size, *cache.shape[2:])


def reference_kvcache(q, k_cache, v_cache, seqlens, page_table, scale, window_left, window_right):
    """(o, lse) in float64. q [B, Tq, Hq, D]; query t of row b sits at seqlens[b] - Tq + t and
    sees key j iff j < seqlens[b] and the window allows it; rows that see no key: o = 0,
    lse = -inf."""
    q = np.asarray(q, np.float64)
    k = logical_cache(np.asarray(k_cache, np.float64), page_table)
    v = logical_cache(np.asarray(v_cache, np.float64), page_table)
    b, tq, hq, d = q.shape
    capacity, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    lengths = np.clip(np.asarray(seqlens), 0, capacity)
    keys = np.arange(capacity)
    present = keys[None, :] < lengths[:, None]                       # [B, S]
    k = np.where(present[:, :, None, None], k, 0.0)  # rows past the length are not part of the math
    v = np.where(present[:, :, None, None], v, 0.0)
    pos = lengths[:, None] - tq + np.arange(tq)[None, :]             # [B, Tq]
    visible = np.broadcast_to(present[:, None, :], (b, tq, capacity)).copy()
    if window_left >= 0:
        visible &= keys[None, None, :] >= pos[:, :, None] - window_left
    if window_right >= 0:
        visible &= keys[None, None, :] <= pos[:, :, None] + window_right
    qg = q.reshape(b, tq, hkv, group, d)
    scores = np.einsum("btkgd,bjkd->bkgtj", qg, k) * scale           # [B, Hkv, G, Tq, S]
    scores = np.where(visible[:, None, None], scores, -np.inf)
    m = scores.max(-1, keepdims=True)  # NaN where a visible score is NaN: the row becomes NaN
    blind = m == -np.inf
    p = np.exp(scores - np.where(blind, 0.0, m))
    l = p.sum(-1, keepdims=True)
    o = np.einsum("bkgtj,bjkd->btkgd", np.where(blind, 0.0, p / np.where(blind, 1.0, l)), v).reshape(b, tq, hq, d)
    lse = np.where(blind, -np.inf, m + np.log(np.where(blind, 1.0, l)))[..., 0]  # [B, Hkv, G, Tq]
    return o, lse.reshape(b, hq, tq)


# ---------------------------------------------------------------------------------------------
# Inputs

def make_case(rng, b, s, hq, hkv, d, tq, dtype, seqlens=None):
    """q, k, v (contiguous, [B, S, Hkv, D]) and seqlens, with rows 0 and 1 empty and full where
    B allows; cache rows at or past each length hold NaN."""
    q = rng.standard_normal((b, tq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    if seqlens is None:
        seqlens = rng.integers(1, s + 1, b)
        seqlens[: min(b, 2)] = [0, s][: min(b, 2)]
        rng.shuffle(seqlens)
    seqlens = np.asarray(seqlens, np.int32)
    past = np.arange(s)[None, :] >= seqlens[:, None]
    k[past], v[past] = np.nan, np.nan
    return q, k.astype(dtype), v.astype(dtype), seqlens


def page(rng, k, v, seqlens, page_size, spare_pages=3):
    """The contiguous cache k, v [B, S, Hkv, D] as shuffled pages: (k_pages, v_pages, table, k_full,
    v_full), where k_full, v_full are k, v padded to the table's capacity (NaN). Spare pages and
    the padding hold NaN; table entries past each row's last page hold garbage ids."""
    b, s, hkv, d = k.shape
    max_pages = -(-s // page_size)
    capacity = max_pages * page_size
    pad = ((0, 0), (0, capacity - s), (0, 0), (0, 0))
    k_full = np.pad(k.astype(np.float32), pad, constant_values=np.nan).astype(k.dtype)
    v_full = np.pad(v.astype(np.float32), pad, constant_values=np.nan).astype(v.dtype)
    num_pages = b * max_pages + spare_pages
    table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    k_pages = np.full((num_pages, page_size, hkv, d), np.nan, np.float32).astype(k.dtype)
    v_pages = k_pages.copy()
    k_pages[table] = k_full.reshape(b, max_pages, page_size, hkv, d)
    v_pages[table] = v_full.reshape(b, max_pages, page_size, hkv, d)
    garbage = np.array([-1, num_pages, 2**31 - 1, -(2**31)], np.int32)
    for row in range(b):
        used = -(-int(seqlens[row]) // page_size)
        table[row, used:] = garbage[rng.integers(0, len(garbage), max_pages - used)]
    return k_pages, v_pages, table, k_full, v_full


# ---------------------------------------------------------------------------------------------
# Running the kernel

def run_kernel(q, k, v, seqlens, table=None, **kw):
    """(o, lse) as float32 NumPy arrays: the kernel called twice on fresh outputs poisoned with
    NaN, both results bit for bit the same."""
    args = [jnp.asarray(x) for x in (q, k, v, seqlens)] + [None if table is None else jnp.asarray(table)]
    results = []
    for _ in range(2):
        poison_device_memory(8 * (q.size * 2 + q.size // q.shape[-1] * 4) + (1 << 20))
        o, lse = _kernels.attention_kvcache(*args, **kw)
        results.append((np.asarray(o.astype(jnp.float32)), np.asarray(lse)))
    (o, lse), (o2, lse2) = results
    np.testing.assert_array_equal(o, o2, err_msg="two runs differ (o)")
    np.testing.assert_array_equal(lse, lse2, err_msg="two runs differ (lse)")
    return o, lse


def check(o, lse, o_ref, lse_ref, what=""):
    assert np.isfinite(o).all(), f"{what}: o has NaN/inf (unwritten rows, or masked keys leaking)"
    seen = np.isfinite(lse_ref)
    np.testing.assert_array_equal(np.isfinite(lse), seen, err_msg=f"{what}: rows that see a key")
    np.testing.assert_array_equal(lse[~seen], -np.inf, err_msg=f"{what}: lse of rows that see no key")
    blind = np.broadcast_to(~seen.transpose(0, 2, 1)[..., None], o.shape)  # [B, Tq, Hq, D]
    np.testing.assert_array_equal(o[blind], 0.0, err_msg=f"{what}: o of rows that see no key")
    if seen.any():
        assert rel_l2(o, o_ref) < 1e-2, (what, rel_l2(o, o_ref))
        np.testing.assert_allclose(lse[seen], lse_ref[seen], rtol=2e-3, atol=2e-3, err_msg=what)


def check_against_reference(q, k, v, seqlens, table=None, *, scale, window_left, window_right,
                            splits=(1, 4, 0), k_ref=None, v_ref=None):
    """The kernel with each split count in `splits` (0: its own choice) against the reference;
    returns the results by split count."""
    o_ref, lse_ref = reference_kvcache(q, k if k_ref is None else k_ref, v if v_ref is None else v_ref,
                                       seqlens, table if k_ref is None else None, scale,
                                       window_left, window_right)
    out = {}
    for n in splits:
        o, lse = run_kernel(q, k, v, seqlens, table, scale=scale, window_left=window_left,
                            window_right=window_right, num_splits=n)
        check(o, lse, o_ref, lse_ref, f"num_splits={n}")
        out[n] = (o, lse)
    return out


@pytest.fixture(autouse=True)
def _kernels_registered(hopper):
    from tk_jax import _ext

    ok, why = _ext.kernels_available()
    assert ok, why


# ---------------------------------------------------------------------------------------------
# Tests

RATIOS = [(8, 8), (8, 2), (16, 2), (32, 1)]  # GQA 1, 4, 8 and MQA


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("heads", RATIOS, ids=lambda h: f"{h[0]}/{h[1]}")
@pytest.mark.parametrize("tq", [1, 4, 16])
def test_contiguous_cache(rng, dtype, d, heads, tq):
    """Causal decode / speculative verification against a contiguous cache of 333 keys (not a
    multiple of any tile), lengths 0, full and random."""
    hq, hkv = heads
    q, k, v, seqlens = make_case(rng, 4, 333, hq, hkv, d, tq, dtype)
    check_against_reference(q, k, v, seqlens, scale=1 / math.sqrt(d), window_left=-1, window_right=0)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page_size", [None, 16, 64])
def test_two_consumer_warpgroups_past_the_rings_first_lap(rng, d, page_size):
    """MQA x 4 tokens (128 packed rows: two consumer warpgroups share the K/V stages) over 2000
    keys in one split: more key tiles than the ring has stages (six at D = 64, three at
    D = 128, two at D = 256), so every stage is refilled and its barriers' phases wrap: the
    other tests' caches (300-900 keys) never take two warpgroups that far."""
    q, k, v, seqlens = make_case(rng, 3, 2000, 32, 1, d, 4, jnp.bfloat16)
    table = None
    if page_size:
        k, v, table, _, _ = page(rng, k, v, seqlens, page_size)
    check_against_reference(q, k, v, seqlens, table, scale=1 / math.sqrt(d), window_left=-1, window_right=0,
                            splits=(1,))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("heads,tq",
                         [((16, 4), 1), ((16, 4), 8), ((12, 6), 4), ((32, 1), 1), ((32, 1), 4), ((8, 8), 16)],
                         ids=["gqa4-t1", "gqa4-t8", "gqa2-t4", "mqa-t1", "mqa-t4", "mha-t16"])
def test_paged_cache_matches_contiguous_bit_for_bit(rng, d, page_size, heads, tq):
    """A paged cache (shuffled pages, NaN in spare pages, garbage table entries past each row's
    last page) against the reference, and bit for bit against the same cache laid out
    contiguously with the same splits where the kernel walks the same key tiles either way:
    pages of 64 keys or more (smaller pages may be read several KV heads a block, in tiles of
    fewer keys each, or one KV head a block in grouped rows at D >= 128)."""
    hq, hkv = heads
    q, k, v, seqlens = make_case(rng, 3, 300, hq, hkv, d, tq, jnp.bfloat16)
    k_pages, v_pages, table, k_full, v_full = page(rng, k, v, seqlens, page_size)
    kw = dict(scale=1 / math.sqrt(d), window_left=-1, window_right=0)
    paged = check_against_reference(q, k_pages, v_pages, seqlens, table, splits=(1, 3), **kw)
    if page_size < 64:
        return
    for n in (1, 3):
        o, lse = run_kernel(q, k_full, v_full, seqlens, num_splits=n, **kw)
        np.testing.assert_array_equal(paged[n][0], o, err_msg=f"paged vs contiguous o, num_splits={n}")
        np.testing.assert_array_equal(paged[n][1], lse, err_msg=f"paged vs contiguous lse, num_splits={n}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("page_size", [16, 32, 64, 256])
@pytest.mark.parametrize("heads", [(16, 4), (8, 1)], ids=["gqa4", "mqa"])
def test_paged_cache_fp16_and_bf16(rng, dtype, page_size, heads):
    """Both dtypes through the paged path, GQA 4 and MQA (one KV head a block: grouped rows on
    pages under 64 keys), 4 query tokens, a sliding causal window."""
    q, k, v, seqlens = make_case(rng, 4, 700, *heads, 128, 4, dtype)
    k_pages, v_pages, table, _, _ = page(rng, k, v, seqlens, page_size)
    check_against_reference(q, k_pages, v_pages, seqlens, table, scale=0.1, window_left=200, window_right=0)


# (window_left, window_right): unbounded, causal, sliding causal, both sides, left only,
# right only, and windows so narrow that some rows see nothing.
WINDOWS = [(-1, -1), (-1, 0), (100, 0), (37, 5), (64, -1), (-1, 3), (0, 0), (2, 1)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("tq", [1, 4, 8, 16])
@pytest.mark.parametrize("page_size", [None, 16, 64])
def test_windows(rng, window, tq, page_size):
    """Every window against the reference, with lengths shorter than Tq (queries at negative
    positions see nothing under a causal mask) and a cache long enough for several tiles;
    contiguous, and paged (16-key pages are read four KV heads a block, a warp each up to 4
    tokens and two warps each with 8; one with 16)."""
    q, k, v, seqlens = make_case(rng, 5, 900, 16, 4, 128, tq, jnp.bfloat16,
                                 seqlens=[0, 900, 3, 1 + rng.integers(899), tq // 2])
    table = None
    if page_size:
        k, v, table, _, _ = page(rng, k, v, seqlens, page_size)
    check_against_reference(q, k, v, seqlens, table, scale=1 / math.sqrt(128),
                            window_left=window[0], window_right=window[1], splits=(1, 5))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_many_splits_agree(rng, d):
    """A long cache with one batch row and one KV head: the kernel's own split count (many, on a
    full GPU), 1, 2, 7 and the most allowed, all against the reference."""
    q, k, v, seqlens = make_case(rng, 1, 6000, 8, 1, d, 1, jnp.bfloat16, seqlens=[5999])
    auto = _kernels.kvcache_num_splits(jnp.asarray(q), jnp.asarray(k))
    assert auto > 1, "one (batch row, KV head) should be split over the GPU"
    most = _kernels.kvcache_num_splits(jnp.asarray(q), jnp.asarray(k), None, 10**6)
    check_against_reference(q, k, v, seqlens, scale=1 / math.sqrt(d), window_left=-1, window_right=-1,
                            splits=(0, 1, 2, 7, most))


@pytest.mark.parametrize("splits", [20, 40], ids=["two-warps-a-row", "four-warps-a-row"])
def test_rows_merged_by_several_warps_with_a_block_part_empty(rng, splits):
    """Splits enough that the combine pass merges a row with two or four warps; 3 query heads x
    3 tokens = 9 rows, so with two warps a row (two rows a block) the last block's second row
    is past the end."""
    q, k, v, seqlens = make_case(rng, 1, 5000, 3, 1, 128, 3, jnp.bfloat16, seqlens=[4321])
    check_against_reference(q, k, v, seqlens, scale=0.1, window_left=-1, window_right=0,
                            splits=(splits,))


def test_climbing_scores_rescale_across_tiles_and_splits(rng):
    """Scores that climb with the key index: each row's running max grows tile after tile (the
    online softmax rescales, or keeps a stale max), and splits see very different maxima, so
    the combine pass must weight them right."""
    q, k, v, seqlens = make_case(rng, 2, 2000, 8, 2, 128, 2, jnp.bfloat16, seqlens=[2000, 1500])
    q = q.astype(np.float32)
    k = k.astype(np.float32)
    q[..., 0] = 8.0
    k[:, :, :, 0] = np.where(np.isnan(k[:, :, :, 0]), np.nan, (0.02 * np.arange(2000) * math.sqrt(128) / 8)[None, :, None])
    check_against_reference(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v, seqlens, scale=1 / math.sqrt(128),
                            window_left=-1, window_right=0, splits=(1, 3, 16))


def test_out_of_range_page_ids_are_clamped(rng):
    """Page ids outside [0, num_pages) inside a row's pages read the nearest valid page (no read
    outside the cache): the result is the reference's with the ids clamped."""
    q, k, v, seqlens = make_case(rng, 2, 256, 8, 2, 64, 1, jnp.bfloat16, seqlens=[256, 200])
    k_pages, v_pages, table, _, _ = page(rng, k, v, seqlens, 16, spare_pages=0)
    k_pages = np.nan_to_num(k_pages.astype(np.float32)).astype(k.dtype)  # every page may be read now
    v_pages = np.nan_to_num(v_pages.astype(np.float32)).astype(v.dtype)
    table[0, 3], table[0, 7], table[1, 2] = -5, len(k_pages) + 100, 2**31 - 1
    check_against_reference(q, k_pages, v_pages, seqlens, table, scale=0.125, window_left=-1,
                            window_right=-1, splits=(1, 2))


def test_seqlens_beyond_capacity_are_clamped(rng):
    q, k, v, _ = make_case(rng, 3, 130, 4, 4, 64, 1, jnp.bfloat16, seqlens=[130, 130, 130])
    o, lse = run_kernel(q, k, v, np.array([-3, 500, 2**31 - 1], np.int32), scale=0.125, window_left=-1,
                        window_right=-1, num_splits=1)
    o_ref, lse_ref = reference_kvcache(q, k, v, np.array([0, 130, 130]), None, 0.125, -1, -1)
    check(o, lse, o_ref, lse_ref)


def test_nan_in_visible_keys_reaches_the_row(rng):
    """A NaN inside a row's visible keys makes that row NaN (and no other), with or without
    splits."""
    q, k, v, seqlens = make_case(rng, 2, 300, 4, 1, 128, 1, jnp.bfloat16, seqlens=[300, 300])
    k = k.astype(np.float32)
    k[0, 123, 0, 5] = np.nan
    k = k.astype(jnp.bfloat16)
    for n in (1, 4):
        o, lse = _kernels.attention_kvcache(*(jnp.asarray(x) for x in (q, k, v, seqlens)), scale=0.1,
                                            window_left=-1, window_right=-1, num_splits=n)
        o, lse = np.asarray(o.astype(jnp.float32)), np.asarray(lse)
        assert np.isnan(lse[0]).all() and np.isnan(o[0]).all(), n
        assert np.isfinite(lse[1]).all() and np.isfinite(o[1]).all(), n


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("heads,tq", [((16, 4), 1), ((16, 4), 8), ((12, 6), 8), ((16, 2), 8)])
def test_nan_in_one_kv_heads_cache_reaches_only_its_rows(rng, page_size, which, heads, tq):
    """A NaN in K or V of one KV head at a visible key makes NaN in that head's query rows only
    (all of o for K, its column for V), even where a block reads several KV heads' pages (with
    16-key pages: 16/4 four heads a warp each with one token, two warps each with eight; 12/6
    two heads; 16/2 x 8 tokens one head, 64 rows)."""
    hq, hkv = heads
    g = hq // hkv
    q, k, v, seqlens = make_case(rng, 2, 300, hq, hkv, 128, tq, jnp.bfloat16, seqlens=[300, 300])
    cache = (k if which == "k" else v).astype(np.float32)
    cache[0, 123, 1, 5] = np.nan  # batch row 0, KV head 1: query heads g to 2 g - 1
    if which == "k":
        k = cache.astype(jnp.bfloat16)
    else:
        v = cache.astype(jnp.bfloat16)
    table = None
    if page_size:
        k, v, table, _, _ = page(rng, k, v, seqlens, page_size)
    for n in (1, 4):
        o, lse = run_kernel(q, k, v, seqlens, table, scale=0.1, window_left=-1, window_right=-1, num_splits=n)
        nan_rows = np.zeros(o.shape, bool)  # [B, Tq, Hq, D]
        if which == "k":
            nan_rows[0, :, g:2 * g, :] = True
        else:
            nan_rows[0, :, g:2 * g, 5] = True
        np.testing.assert_array_equal(np.isnan(o), nan_rows, err_msg=f"NaN in o, num_splits={n}")
        assert np.isnan(lse[0, g:2 * g]).all() == (which == "k"), n
        lse_rest = np.delete(lse, np.s_[g:2 * g], axis=1) if which == "k" else lse
        assert np.isfinite(lse_rest[0]).all() and np.isfinite(lse[1]).all(), n


def test_vmap_folds_leading_axes_with_one_page_pool_each(rng):
    """Under vmap the leading axis folds into the batch; a paged cache then has one page pool per
    leading index (its table's ids index that pool)."""
    n = 3
    cases = [make_case(rng, 2, 200, 8, 2, 64, 2, jnp.bfloat16) for _ in range(n)]
    pages = [page(rng, k, v, s, 32, spare_pages=1) for (_, k, v, s) in cases]
    q = jnp.stack([jnp.asarray(c[0]) for c in cases])
    seqlens = jnp.stack([jnp.asarray(c[3]) for c in cases])
    k_pages = jnp.stack([jnp.asarray(p[0]) for p in pages])
    v_pages = jnp.stack([jnp.asarray(p[1]) for p in pages])
    tables = jnp.stack([jnp.asarray(p[2]) for p in pages])
    fn = jax.vmap(lambda q, k, v, s, t: _kernels.attention_kvcache(q, k, v, s, t, scale=0.125, window_left=-1,
                                                                   window_right=0, num_splits=2))
    o, lse = fn(q, k_pages, v_pages, seqlens, tables)
    for i, (case, pg) in enumerate(zip(cases, pages)):
        o_ref, lse_ref = reference_kvcache(case[0], pg[0], pg[1], case[3], pg[2], 0.125, -1, 0)
        check(np.asarray(o[i].astype(jnp.float32)), np.asarray(lse[i]), o_ref, lse_ref, f"pool {i}")


def test_handler_rejects_bad_calls():
    """The C++ side checks shapes again: a bad call is an error naming the argument, never a
    launch."""
    q = jnp.zeros((2, 1, 8, 128), jnp.bfloat16)
    k = jnp.zeros((2, 64, 2, 128), jnp.bfloat16)
    seqlens = jnp.zeros((2,), jnp.int32)
    kw = dict(scale=0.1, window_left=-1, window_right=0)
    with pytest.raises(Exception, match="seqlens"):
        jax.block_until_ready(_kernels.attention_kvcache(q, k, k, jnp.zeros((3,), jnp.int32), **kw))
    with pytest.raises(Exception, match="heads_q"):
        k3 = jnp.zeros((2, 64, 3, 128), jnp.bfloat16)
        jax.block_until_ready(_kernels.attention_kvcache(q, k3, k3, seqlens, **kw))
    with pytest.raises(Exception, match="page_size"):
        kp = jnp.zeros((4, 48, 2, 128), jnp.bfloat16)
        jax.block_until_ready(_kernels.attention_kvcache(q, kp, kp, seqlens, jnp.zeros((2, 2), jnp.int32), **kw))
    with pytest.raises(Exception, match="v_cache"):
        jax.block_until_ready(_kernels.attention_kvcache(q, k, k[:, :32], seqlens, **kw))


def test_kernel_unsupported_reasons():
    q = jnp.zeros((1, 1, 8, 128), jnp.bfloat16)
    k = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
    assert _kernels.kvcache_kernel_unsupported(q, k, None) is None
    assert "page" in _kernels.kvcache_kernel_unsupported(q, jnp.zeros((4, 48, 2, 128), jnp.bfloat16),
                                                         jnp.zeros((1, 2), jnp.int32))
    assert "head_dim" in _kernels.kvcache_kernel_unsupported(q[..., :96], k[..., :96], None)
    assert "bf16 or fp16" in _kernels.kvcache_kernel_unsupported(q.astype(jnp.float32), k, None)


# ---------------------------------------------------------------------------------------------
# CUDA graphs: the handler is declared command-buffer compatible (and launches the combine pass
# with programmatic dependent launch, which must survive stream capture).

GRAPH_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


def graph_side(seed):
    """In a process started with GRAPH_FLAGS: one jitted step (contiguous and paged calls, split
    and not) compiled with command buffers and without; three calls on fresh inputs at new
    addresses must agree bit for bit."""
    from tk_jax import _ext

    assert _ext.kernels_available()[0]
    rng = np.random.default_rng(seed)

    def step(q, k, v, seqlens, k_pages, v_pages, table):
        kw = dict(scale=0.1, window_left=-1, window_right=0)
        return (*_kernels.attention_kvcache(q, k, v, seqlens, num_splits=1, **kw),
                *_kernels.attention_kvcache(q, k, v, seqlens, num_splits=6, **kw),
                *_kernels.attention_kvcache(q, k_pages, v_pages, seqlens, table, num_splits=3, **kw))

    def inputs():
        q, k, v, seqlens = make_case(rng, 3, 500, 16, 2, 128, 2, jnp.bfloat16)
        k_pages, v_pages, table, _, _ = page(rng, k, v, seqlens, 16)
        return [jnp.asarray(x) for x in (q, k, v, seqlens, k_pages, v_pages, table)]

    example = inputs()
    graph = jax.jit(step).lower(*example).compile()
    plain = jax.jit(step).lower(*example).compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
    alive = []
    for i in range(3):
        args = inputs()
        got, want = graph(*args), plain(*args)
        alive.append((args, got))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)),
                                          err_msg=f"call {i}")
    print("graph side ok")


def test_command_buffers_match_plain_execution(rng):
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), GRAPH_FLAGS]))
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process preallocated most GPU memory
    code = (f"import sys; sys.path.insert(0, {TESTS_DIR!r}); import test_kvcache_gpu as t; "
            f"t.graph_side({int(rng.integers(2**31))})")
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0 and "graph side ok" in child.stdout, (
        f"exit {child.returncode}:\n{child.stdout[-20000:]}\n{child.stderr[-50000:]}")
