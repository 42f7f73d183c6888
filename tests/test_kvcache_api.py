"""tk_jax.flash_attention_with_kvcache on CPU: results and updated caches against a float64
NumPy oracle written here (contiguous and paged caches, random cache lengths including 0 and
full, shuffled page tables, appends across page boundaries, GQA, windows, causal on and off,
1 to 16 query tokens and a chunked prefill), full caches, stale cache entries, validation,
in-place appends (the compiled HLO), jit / vmap / sharded jit / shard_map, the dispatch to the
kernel (with a fake in its place) and flash_attention's decode path.

Every test draws fresh random inputs (the `rng` fixture prints its seed).
"""
from __future__ import annotations

import functools
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tk_jax
from tk_jax import kvcache
from tk_jax.reference.kvcache import kvcache_attention_forward

try:  # tests/ as a package, or tests/ on sys.path
    from tests.naive import naive_attention, relative_l2
    from tests.sharding_util import collectives
except ImportError:
    from naive import naive_attention, relative_l2
    from sharding_util import collectives

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


# ----------------------------------------------------------------------------------------------
# The float64 oracle: write the new tokens, then attend row by row over the whole score matrix.


def naive_kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None,
                  page_table=None, scale=None, window=(-1, -1)):
    """(o, lse, k_cache, v_cache) in float64, by the documented rule of
    flash_attention_with_kvcache (window = (left, right) after causal is applied)."""
    as64 = lambda x: None if x is None else np.array(jnp.asarray(x, jnp.float32), np.float64)
    q, k_new, v_new = as64(q), as64(k_new), as64(v_new)
    k_cache = np.array(jnp.asarray(k_cache, jnp.float32), np.float64)
    v_cache = np.array(jnp.asarray(v_cache, jnp.float32), np.float64)
    cache_seqlens = np.asarray(cache_seqlens, np.int64)
    batch, tq, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    paged = page_table is not None
    if paged:
        page_table = np.asarray(page_table)
        num_pages, page_size = k_cache.shape[:2]
        capacity = page_table.shape[1] * page_size
    else:
        capacity = k_cache.shape[1]

    def location(b, j):  # where keys j (an int or an index array) of row b live in the cache
        if not paged:
            return b, j
        return np.clip(page_table[b, j // page_size], 0, num_pages - 1), j % page_size

    tnew = 0 if k_new is None else k_new.shape[1]
    lengths = []
    for b in range(batch):
        start = min(max(int(cache_seqlens[b]), 0), capacity - tnew)  # a full cache: clamped
        for t in range(tnew):
            j = start + t
            if paged and not 0 <= page_table[b, j // page_size] < num_pages:
                continue  # a token whose page id is out of range is not written
            k_cache[location(b, j)] = k_new[b, t]
            v_cache[location(b, j)] = v_new[b, t]
        lengths.append(start + tnew)

    o = np.zeros((batch, tq, hq, d))
    lse = np.full((batch, hq, tq), -np.inf)
    for b in range(batch):
        n = lengths[b]
        keys, values = k_cache[location(b, np.arange(n))], v_cache[location(b, np.arange(n))]
        i = n - tq + np.arange(tq)[:, None]  # the queries' positions
        j = np.arange(n)[None, :]
        visible = np.ones((tq, n), bool)
        if window[0] >= 0:
            visible &= j >= i - window[0]
        if window[1] >= 0:
            visible &= j <= i + window[1]
        seen = visible.any(axis=1)
        for h in range(hq):
            s = np.where(visible, scale * q[b, :, h] @ keys[:, h // group].T, -np.inf)
            m = np.where(seen, s.max(axis=1, initial=-np.inf), 0.0)
            e = np.exp(s[seen] - m[seen, None])
            total = e.sum(axis=1)
            o[b, seen, h] = e @ values[:, h // group] / total[:, None]
            lse[b, h, seen] = m[seen] + np.log(total)
    return o, lse, k_cache, v_cache


# ----------------------------------------------------------------------------------------------
# Inputs


def random_array(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def shuffled_page_table(rng, batch, max_pages, num_pages):
    """Distinct random pages per row, in random order; num_pages >= batch * max_pages."""
    return jnp.asarray(rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages),
                       jnp.int32)


def random_lengths(rng, batch, capacity, tnew):
    """cache_seqlens with an empty cache and one that the append fills exactly, the rest
    random (rows with fewer rows than 2 take what fits)."""
    top = capacity - tnew
    lengths = rng.integers(0, top + 1, size=batch)
    lengths[0] = 0
    if batch > 1:
        lengths[1] = top
    return jnp.asarray(lengths, jnp.int32)


def make_case(rng, *, batch=3, tq=1, tnew=None, hq=4, hkv=2, d=16, capacity=37, page_size=None,
              dtype=jnp.float32):
    """Arguments of flash_attention_with_kvcache: q, caches, cache_seqlens, and k_new/v_new
    (tnew tokens; None: no append) and a shuffled page table when page_size is given."""
    tnew_ = tnew or 0
    kwargs = {}
    if page_size is None:
        cache_shape = (batch, capacity, hkv, d)
    else:
        max_pages = -(-capacity // page_size)
        num_pages = batch * max_pages + 3  # spare pages nobody uses
        cache_shape = (num_pages, page_size, hkv, d)
        kwargs["page_table"] = shuffled_page_table(rng, batch, max_pages, num_pages)
        capacity = max_pages * page_size
    q = random_array(rng, (batch, tq, hq, d), dtype)
    k_cache, v_cache = random_array(rng, cache_shape, dtype), random_array(rng, cache_shape, dtype)
    if tnew:
        kwargs["k_new"] = random_array(rng, (batch, tnew, hkv, d), dtype)
        kwargs["v_new"] = random_array(rng, (batch, tnew, hkv, d), dtype)
    lengths = random_lengths(rng, batch, capacity, tnew_)
    return (q, k_cache, v_cache, lengths), kwargs


def split_result(result, *, return_lse, appended):
    """(o, lse or None, k_cache or None, v_cache or None) from any return structure."""
    result = result if isinstance(result, tuple) else (result,)
    o, rest = result[0], list(result[1:])
    lse = rest.pop(0) if return_lse else None
    k_cache, v_cache = rest if appended else (None, None)
    return o, lse, k_cache, v_cache


def assert_close(actual, expected, what, tol):
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected),
                                  err_msg=f"{what}: NaN pattern differs")
    keep = ~np.isnan(expected)
    assert np.all(np.isfinite(actual[keep])), f"{what}: non-finite values"
    err = relative_l2(actual[keep], expected[keep])
    assert err < tol, f"{what}: relative L2 error {err:.3g} >= {tol}"


def assert_lse_close(actual, expected, what, tol):
    actual = np.asarray(actual)
    assert actual.dtype == np.float32, f"{what}: dtype {actual.dtype}"
    for check in (np.isneginf, np.isnan):
        np.testing.assert_array_equal(check(actual), check(expected),
                                      err_msg=f"{what}: {check.__name__} pattern differs")
    finite = np.isfinite(expected)
    if finite.any():
        assert relative_l2(actual[finite], expected[finite]) < tol, what


def check_against_naive(args, kwargs, *, dtype=jnp.float32, call=None, **options):
    """Run flash_attention_with_kvcache (or `call`) with return_lse and compare everything."""
    call = call or tk_jax.flash_attention_with_kvcache
    result = call(*args, **kwargs, return_lse=True, **options)
    appended = "k_new" in kwargs
    o, lse, k_cache, v_cache = split_result(result, return_lse=True, appended=appended)
    window = options.get("window_size", (-1, -1))
    if options.get("causal", True):
        window = (window[0], 0)
    ref_o, ref_lse, ref_k, ref_v = naive_kvcache(*args, **kwargs, window=window,
                                                 scale=options.get("softmax_scale"))
    tol = TOLERANCE[dtype]
    assert o.dtype == args[0].dtype and o.shape == args[0].shape
    assert_close(o, ref_o, "o", tol)
    assert_lse_close(lse, ref_lse, "lse", 2e-5 if dtype == jnp.float32 else 2e-3)
    if appended:
        assert k_cache.dtype == args[1].dtype and k_cache.shape == args[1].shape
        # The caches are copied bit for bit: exact equality.
        np.testing.assert_array_equal(np.asarray(k_cache, np.float64), ref_k)
        np.testing.assert_array_equal(np.asarray(v_cache, np.float64), ref_v)


# ----------------------------------------------------------------------------------------------
# 1. Results against the oracle.

# (name, make_case kwargs, options)
CASES = [
    ("decode, contiguous", dict(tq=1, tnew=1), dict()),
    ("decode, paged 4, GQA 4", dict(tq=1, tnew=1, hq=8, hkv=2, page_size=4), dict()),
    ("MQA, paged 8", dict(tq=1, tnew=1, hq=4, hkv=1, page_size=8), dict()),
    ("verify 4 tokens, paged 4", dict(tq=4, tnew=4, page_size=4), dict()),
    ("verify 4, not causal, scale", dict(tq=4, tnew=4), dict(causal=False, softmax_scale=0.3)),
    ("16 tokens, paged 8, window", dict(tq=16, tnew=16, page_size=8, capacity=45),
     dict(window_size=(5, 0))),
    ("16 tokens, not causal, window both sides", dict(tq=16, tnew=16, hq=2, hkv=2),
     dict(causal=False, window_size=(3, 2))),
    ("chunked prefill, paged 8", dict(tq=24, tnew=24, page_size=8, capacity=64), dict()),
    ("more queries than keys appended", dict(tq=4, tnew=1), dict(window_size=(6, -1))),
    ("long cache, several reference blocks", dict(batch=2, tq=1, tnew=1, capacity=600, d=8,
                                                  page_size=16), dict(window_size=(300, -1))),
]


@pytest.mark.parametrize("name, shape, options", CASES, ids=[c[0] for c in CASES])
def test_matches_naive(rng, name, shape, options):
    args, kwargs = make_case(rng, **shape)
    check_against_naive(args, kwargs, **options)


@pytest.mark.parametrize("dtype", [jnp.bfloat16])  # fp16 too on the GPU
def test_half_precision(rng, dtype):
    args, kwargs = make_case(rng, tq=4, tnew=4, hq=4, hkv=1, page_size=8, dtype=dtype)
    check_against_naive(args, kwargs, dtype=dtype)


def test_appends_cross_page_boundaries(rng):
    """Every row's append spans two or three pages (page size 4, 6 new tokens)."""
    args, kwargs = make_case(rng, batch=4, tq=6, tnew=6, page_size=4, capacity=32)
    args = args[:3] + (jnp.asarray([3, 1, 14, 26], jnp.int32),)
    check_against_naive(args, kwargs)


def test_reference_blocks_match(rng):
    """The reference's key blocking (and, for a contiguous cache, its last block moved back to
    fit) does not change the result."""
    (q, k_cache, v_cache, lengths), _ = make_case(rng, batch=2, tq=3, capacity=53)
    results = [kvcache_attention_forward(q, k_cache, v_cache, lengths, scale=0.25,
                                         window_left=20, window_right=0, block_k=block_k)
               for block_k in (7, 256)]
    ref_o, ref_lse, _, _ = naive_kvcache(q, k_cache, v_cache, lengths, scale=0.25, window=(20, 0))
    for o, lse in results:
        assert_close(o, ref_o, "o", 2e-5)
        assert_lse_close(lse, ref_lse, "lse", 2e-5)


# ----------------------------------------------------------------------------------------------
# 2. Edge rows: empty caches, rows that see nothing, stale entries, NaN, full caches.


def test_empty_cache_and_rows_that_see_nothing(rng):
    (q, k_cache, v_cache, _), _ = make_case(rng, batch=2, tq=4, capacity=9)
    o, lse = tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, jnp.asarray([0, 2]),
                                                 return_lse=True)
    assert np.all(np.asarray(o[0]) == 0) and np.all(np.isneginf(lse[0]))
    # Row 1 holds 2 keys at positions 0, 1; its 4 queries sit at -2, -1, 0, 1 (causal).
    assert np.all(np.asarray(o[1, :2]) == 0) and np.all(np.isneginf(lse[1, :, :2]))
    assert np.all(np.isfinite(lse[1, :, 2:]))


@pytest.mark.parametrize("paged", [False, True])
def test_stale_entries_never_reach_a_row(rng, paged):
    """Cache entries past a row's keys (and page table entries past its pages) may hold
    anything, NaN included."""
    args, kwargs = make_case(rng, batch=3, tq=2, tnew=2, capacity=24,
                             page_size=8 if paged else None)
    q, k_cache, v_cache, lengths = args
    lengths = jnp.asarray([0, 5, 9], jnp.int32)
    if paged:
        table = np.array(kwargs["page_table"])
        stale = np.ones(k_cache.shape[:2], bool)  # (page, slot) that holds no key of any row
        for b, n in enumerate(np.asarray(lengths) + 2):
            for j in range(n):
                stale[table[b, j // 8], j % 8] = False
        table[0, 1:] = -7  # never read: row 0 holds 2 keys on its first page
        table[1, 1:] = 10**6
        kwargs["page_table"] = jnp.asarray(table)
        poison = lambda c: jnp.where(stale[:, :, None, None], jnp.nan, c)
    else:
        stale = np.arange(24)[None, :] >= np.asarray(lengths)[:, None] + 2
        poison = lambda c: jnp.where(stale[:, :, None, None], jnp.nan, c)
    o, lse, _, _ = tk_jax.flash_attention_with_kvcache(q, poison(k_cache), poison(v_cache),
                                                       lengths, **kwargs, return_lse=True)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
    clean = (q, k_cache, v_cache, lengths)
    o_clean = tk_jax.flash_attention_with_kvcache(*clean, **kwargs)[0]
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_clean))


def test_nan_reaches_the_rows_that_see_it(rng):
    (q, k_cache, v_cache, _), _ = make_case(rng, batch=2, tq=3, hq=2, hkv=1, capacity=10)
    lengths = jnp.asarray([10, 10], jnp.int32)
    # Key 8 of row 0 is NaN: with causal, queries at 7 do not see it, those at 8 and 9 do.
    k_cache = k_cache.at[0, 8].set(jnp.nan)
    o, lse = tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, lengths, return_lse=True)
    assert np.all(np.isnan(o[0, 1:])) and np.all(np.isnan(lse[0, :, 1:]))
    assert np.all(np.isfinite(o[1])) and np.all(np.isfinite(lse[1]))
    assert np.all(np.isfinite(o[0, 0]))


@pytest.mark.parametrize("paged", [False, True])
def test_full_cache_clamps_like_dynamic_update_slice(rng, paged):
    """cache_seqlens is clamped into [0, capacity - Tnew] (into [0, capacity] without an
    append): an append past the end overwrites the last Tnew positions, as
    lax.dynamic_update_slice would, and nothing is written out of bounds."""
    args, kwargs = make_case(rng, batch=4, tq=3, tnew=3, capacity=16,
                             page_size=4 if paged else None)
    q, k_cache, v_cache, _ = args
    lengths = jnp.asarray([13, 15, -4, 5], jnp.int32)  # 13 + 3 fits exactly; 15 + 3 does not
    check_against_naive((q, k_cache, v_cache, lengths), kwargs)
    if not paged:
        written = jax.lax.dynamic_update_slice(k_cache[1], kwargs["k_new"][1], (15, 0, 0))
        k_out = tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, lengths, **kwargs)[1]
        np.testing.assert_array_equal(np.asarray(k_out[1]), np.asarray(written))
    no_append = (q, k_cache, v_cache, jnp.asarray([16, 17, 0, -3], jnp.int32))
    check_against_naive(no_append, {key: kwargs[key] for key in kwargs if key == "page_table"})


def test_out_of_range_page_ids(rng):
    """An out-of-range id of a page the append writes drops that write; one the attention
    reads is clamped into range (oracle and reference agree on both)."""
    args, kwargs = make_case(rng, batch=2, tq=2, tnew=2, capacity=16, page_size=4)
    table = np.array(kwargs["page_table"])
    table[0, 1] = -1                      # row 0 writes positions 4, 5 -> dropped, read page 0
    table[1, 0] = 10**5                   # row 1 reads page 0 clamped to the last page
    kwargs["page_table"] = jnp.asarray(table)
    args = args[:3] + (jnp.asarray([4, 9], jnp.int32),)
    check_against_naive(args, kwargs)


# ----------------------------------------------------------------------------------------------
# 3. Return structure, integer cache_seqlens, validation.


def test_return_structures(rng):
    args, kwargs = make_case(rng, tq=1, tnew=1)
    q, k_cache, v_cache, lengths = args
    call = functools.partial(tk_jax.flash_attention_with_kvcache, q, k_cache, v_cache, lengths)
    assert isinstance(call(), jax.Array)
    assert len(call(return_lse=True)) == 2
    o, k_out, v_out = call(**kwargs)
    assert k_out.shape == k_cache.shape and v_out.shape == v_cache.shape
    assert len(call(**kwargs, return_lse=True)) == 4
    from_int = tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, 5)  # a Python int
    from_array = tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, jnp.full((3,), 5))
    np.testing.assert_array_equal(np.asarray(from_int), np.asarray(from_array))


def _call_with(rng, **changes):
    args, kwargs = make_case(rng, batch=2, tq=2, tnew=2, hq=4, hkv=2, d=8, capacity=8)
    named = dict(zip(("q", "k_cache", "v_cache", "cache_seqlens"), args), **kwargs)
    named.update(changes)
    return tk_jax.flash_attention_with_kvcache(**named)


BAD_INPUTS = [
    ("q rank", lambda r: dict(q=jnp.zeros((2, 2, 4))), ValueError, "q"),
    ("q dtype", lambda r: dict(q=jnp.zeros((2, 2, 4, 8), jnp.int32)), TypeError, "q"),
    ("dtype mismatch", lambda r: dict(q=jnp.zeros((2, 2, 4, 8), jnp.bfloat16)), ValueError,
     "dtype"),
    ("heads", lambda r: dict(q=jnp.zeros((2, 2, 3, 8))), ValueError, "heads"),
    ("head_dim", lambda r: dict(q=jnp.zeros((2, 2, 4, 4))), ValueError, "head_dim"),
    ("cache batch", lambda r: dict(k_cache=jnp.zeros((3, 8, 2, 8)),
                                   v_cache=jnp.zeros((3, 8, 2, 8))), ValueError, "k_cache"),
    ("v_cache shape", lambda r: dict(v_cache=jnp.zeros((2, 9, 2, 8))), ValueError, "v_cache"),
    ("cache_seqlens dtype", lambda r: dict(cache_seqlens=jnp.zeros((2,))), TypeError,
     "cache_seqlens"),
    ("cache_seqlens shape", lambda r: dict(cache_seqlens=jnp.zeros((3,), jnp.int32)), ValueError,
     "cache_seqlens"),
    ("cache_seqlens bool", lambda r: dict(cache_seqlens=True), TypeError, "cache_seqlens"),
    ("k_new alone", lambda r: dict(v_new=None), ValueError, "v_new"),
    ("k_new shape", lambda r: dict(k_new=jnp.zeros((2, 2, 1, 8)), v_new=jnp.zeros((2, 2, 1, 8))),
     ValueError, "k_new"),
    ("k_new too long", lambda r: dict(k_new=jnp.zeros((2, 9, 2, 8)), v_new=jnp.zeros((2, 9, 2, 8))),
     ValueError, "k_new"),
    ("page_table dtype", lambda r: dict(page_table=jnp.zeros((2, 2))), TypeError, "page_table"),
    ("page_table shape", lambda r: dict(page_table=jnp.zeros((3, 2), jnp.int32)), ValueError,
     "page_table"),
    ("window", lambda r: dict(window_size=(-2, 0)), ValueError, "window_size"),
    ("window type", lambda r: dict(window_size=3), TypeError, "window_size"),
    ("causal", lambda r: dict(causal=1), TypeError, "causal"),
    ("return_lse", lambda r: dict(return_lse="yes"), TypeError, "return_lse"),
    ("scale", lambda r: dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    ("backend", lambda r: dict(backend="cuda"), ValueError, "backend"),
]


@pytest.mark.parametrize("name, changes, error, word", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_validation_names_the_argument(rng, name, changes, error, word):
    with pytest.raises(error, match=re.escape(word)):
        _call_with(rng, **changes(rng))


def test_kernel_backend_unavailable_on_cpu(rng):
    with pytest.raises(ValueError, match="backend='kernel' cannot run here"):
        _call_with(rng, backend="kernel")


def test_differentiation_raises_a_clear_error(rng):
    (q, k_cache, v_cache, lengths), kwargs = make_case(rng, tq=1, tnew=1)
    loss = lambda q: tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, lengths).sum()
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(loss)(q)
    with pytest.raises(TypeError, match="forward-only"):
        jax.jvp(lambda k: tk_jax.flash_attention_with_kvcache(q, k, v_cache, lengths),
                (k_cache,), (k_cache,))
    # Inputs under stop_gradient are fine inside a differentiated function.
    jax.grad(lambda x: x * jnp.sum(tk_jax.flash_attention_with_kvcache(
        jax.lax.stop_gradient(q), k_cache, v_cache, lengths)))(1.0)


# ----------------------------------------------------------------------------------------------
# 4. In place: a jitted step that donates the caches writes the new rows into them.


def _copies_of(text, shape):
    """Instructions in HLO text that copy an array of `shape` (a cache): a copy, or a fusion
    that XLA named after the copy it holds."""
    dims = ",".join(map(str, shape))
    result = rf"\w+\[{dims}\]\{{[0-9,]*\}}"
    return [line for line in text.splitlines()
            if re.search(rf"= {result} copy\(", line)
            or re.search(rf"%[\w.-]*copy[\w.-]* = {result} ", line)]


@pytest.mark.parametrize("route, paged",
                         [("reference", False), ("kernel", False), ("kernel", True)])
def test_append_is_in_place_when_donated(rng, request, route, paged):
    backend = request.getfixturevalue("kernel_path") if route == "kernel" else "reference"
    args, kwargs = make_case(rng, batch=2, tq=1, tnew=1, capacity=64,
                             page_size=16 if paged else None)
    q, k_cache, v_cache, lengths = args

    def step(k_cache, v_cache, q, lengths, k_new, v_new, page_table=None):
        return tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new,
                                                   v_new=v_new, page_table=page_table,
                                                   backend=backend)

    step = jax.jit(step, donate_argnums=(0, 1))
    extra = (kwargs["page_table"],) if paged else ()
    step = step.lower(k_cache, v_cache, q, lengths, kwargs["k_new"], kwargs["v_new"],
                      *extra).compile()
    compiled = step.as_text()
    # Outputs 1 and 2 (the caches) alias parameters 0 and 1, and nothing copies a cache.
    header = compiled.splitlines()[0]
    assert re.search(r"\{1\}: \(0, \{\}", header) and re.search(r"\{2\}: \(1, \{\}", header), header
    assert not _copies_of(compiled, k_cache.shape), _copies_of(compiled, k_cache.shape)
    expected = naive_kvcache(*args, **kwargs, window=(-1, 0))
    k_before = np.array(k_cache)
    # Fresh buffers: one that NumPy has looked at is shared with it and cannot be donated.
    k_cache, v_cache = jnp.copy(k_cache), jnp.copy(v_cache)
    o, k_out, v_out = step(k_cache, v_cache, q, lengths, kwargs["k_new"], kwargs["v_new"], *extra)
    assert k_cache.is_deleted() and v_cache.is_deleted()  # donated
    assert_close(o, expected[0], "o", 2e-5)
    np.testing.assert_array_equal(np.asarray(k_out, np.float64), expected[2])
    assert not np.array_equal(np.asarray(k_out), k_before)


# ----------------------------------------------------------------------------------------------
# 5. Transformations: jit, vmap, a generation loop, and the kernel route.


def test_jitted_prefill_and_decode_loop_in_place(rng):
    """A jitted prefill of 5 tokens, then a jitted decode loop (lax.scan) of 4 one at a time,
    both donating the paged cache: neither compiled program copies the cache, and the outputs
    and cache equal attending all 9 tokens at once."""
    batch, page_size = 2, 4
    args, kwargs = make_case(rng, batch=batch, tq=9, tnew=9, hq=4, hkv=2, d=16, capacity=16,
                             page_size=page_size)
    q, k_cache, v_cache, _ = args
    k_all, v_all, table = kwargs["k_new"], kwargs["v_new"], kwargs["page_table"]
    zero = jnp.zeros((batch,), jnp.int32)
    o_all, _, k_all_at_once, _ = naive_kvcache(q, k_cache, v_cache, zero, k_new=k_all,
                                               v_new=v_all, page_table=table, window=(-1, 0))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def prefill(k_cache, v_cache):
        return tk_jax.flash_attention_with_kvcache(q[:, :5], k_cache, v_cache, zero,
                                                   k_new=k_all[:, :5], v_new=v_all[:, :5],
                                                   page_table=table)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def decode(k_cache, v_cache):
        def step(carry, t):
            k_cache, v_cache = carry
            take = lambda x: jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1)
            o, k_cache, v_cache = tk_jax.flash_attention_with_kvcache(
                take(q), k_cache, v_cache, zero + t, k_new=take(k_all), v_new=take(v_all),
                page_table=table)
            return (k_cache, v_cache), o[:, 0]

        (k_cache, v_cache), o = jax.lax.scan(step, (k_cache, v_cache), jnp.arange(5, 9))
        return jnp.swapaxes(o, 0, 1), k_cache, v_cache

    prefill, decode = (program.lower(k_cache, v_cache).compile() for program in (prefill, decode))
    for program in (prefill, decode):
        assert not _copies_of(program.as_text(), k_cache.shape)
    o_prefill, k_out, v_out = prefill(jnp.copy(k_cache), jnp.copy(v_cache))
    o_decode, k_out, _ = decode(k_out, v_out)
    o = jnp.concatenate([o_prefill, o_decode], axis=1)
    assert_close(o, o_all, "o", 2e-5)
    np.testing.assert_array_equal(np.asarray(k_out, np.float64), k_all_at_once)


@pytest.mark.parametrize("paged, pool_mapped", [(False, True), (True, True), (True, False)])
def test_vmap(rng, paged, pool_mapped, kernel_path):
    """vmap over a leading axis: the partitioning rule folds it into the batch; a paged pool
    that is not mapped is shared, one that is mapped is laid end to end. (Both backends run
    under that rule: the kernel route covers the reference's too.)"""
    n = 2
    cases = [make_case(rng, batch=2, tq=2, tnew=2, capacity=12, page_size=4 if paged else None)
             for _ in range(n)]
    stack = lambda xs: jnp.stack(xs)
    args = tuple(stack([c[0][i] for c in cases]) for i in range(4))
    kwargs = {key: stack([c[1][key] for c in cases]) for key in cases[0][1]}
    q, k_cache, v_cache, lengths = args
    if not pool_mapped:
        k_cache, v_cache = k_cache[0], v_cache[0]
    in_axes = (0, 0 if pool_mapped else None, 0 if pool_mapped else None, 0)

    def call(q, k_cache, v_cache, lengths, kw, backend):
        return tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, lengths, **kw,
                                                   return_lse=True, backend=backend)

    for backend in (kernel_path,):
        mapped = jax.vmap(functools.partial(call, backend=backend),
                          in_axes=in_axes + (0,))(q, k_cache, v_cache, lengths, kwargs)
        for i in range(n):
            cache = (k_cache[i], v_cache[i]) if pool_mapped else (k_cache, v_cache)
            expected = naive_kvcache(q[i], *cache, lengths[i],
                                     **{key: value[i] for key, value in kwargs.items()},
                                     window=(-1, 0))
            assert_close(mapped[0][i], expected[0], f"o[{i}] ({backend})", 2e-5)
            assert_lse_close(mapped[1][i], expected[1], f"lse[{i}] ({backend})", 2e-5)
            if pool_mapped:
                np.testing.assert_array_equal(np.asarray(mapped[2][i], np.float64), expected[2])


def test_auto_dispatches_to_the_kernel(rng, install_kernels):
    """backend="auto" calls _kernels.attention_kvcache with seqlens = cache_seqlens + Tnew
    (clamped to the capacity), the page table and the static attributes; when
    kvcache_kernel_unsupported says why not, it falls back to the reference (and
    backend="kernel" raises with that reason)."""
    import types

    calls = []

    def attention_kvcache(q, k_cache, v_cache, seqlens, page_table=None, *, scale, window_left,
                          window_right, num_splits=0):
        calls.append(dict(page_table=page_table, scale=scale, window=(window_left, window_right),
                          cache=k_cache))
        jax.debug.callback(lambda s: calls[-1].update(seqlens=np.asarray(s)), seqlens)
        return kvcache_attention_forward(q, k_cache, v_cache, seqlens, page_table, scale=scale,
                                         window_left=window_left, window_right=window_right)

    reason = [None]
    fake = types.SimpleNamespace(attention_kvcache=attention_kvcache,
                                 kvcache_kernel_unsupported=lambda q, k, table: reason[0])
    install_kernels(fake)
    args, kwargs = make_case(rng, batch=3, tq=2, tnew=2, capacity=16, page_size=4)
    args = args[:3] + (jnp.asarray([3, 0, 15], jnp.int32),)
    check_against_naive(args, kwargs, window_size=(4, -1))
    assert len(calls) == 1
    np.testing.assert_array_equal(calls[0]["seqlens"], [5, 2, 16])  # 15 + 2: clamped
    assert calls[0]["window"] == (4, 0) and calls[0]["scale"] == pytest.approx(0.25)
    assert calls[0]["page_table"].shape == kwargs["page_table"].shape
    assert calls[0]["cache"].shape == args[1].shape

    reason[0] = "no kernel for this shape"
    check_against_naive(args, kwargs)
    assert len(calls) == 1  # the reference ran
    with pytest.raises(ValueError, match="no kernel for this shape"):
        tk_jax.flash_attention_with_kvcache(*args, **kwargs, backend="kernel")


# ----------------------------------------------------------------------------------------------
# 6. Sharding on the 8 CPU host devices (tests/conftest.py): no collective, same results.


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[:math.prod(shape)]).reshape(shape), names)


# (name, paged, mesh, Hq, Hkv, spec of q / k_new, spec of the cache, spec of the page table)
SHARDED = [
    ("contiguous over batch", False, ((4,), ("data",)), 4, 2, P("data"), P("data"), None),
    ("contiguous over kv heads", False, ((2,), ("model",)), 4, 2, P(None, None, "model"),
     P(None, None, "model"), None),
    ("contiguous over batch and kv heads", False, ((2, 2), ("data", "model")), 8, 4,
     P("data", None, "model"), P("data", None, "model"), None),
    ("paged over kv heads", True, ((4,), ("model",)), 8, 4, P(None, None, "model"),
     P(None, None, "model"), P()),
    # No append: the queries split over batch against one pool split over kv heads.
    ("paged, queries over batch, no append", True, ((2, 2), ("data", "model")), 8, 4,
     P("data", None, "model"), P(None, None, "model"), P("data")),
]


@pytest.mark.parametrize("name, paged, mesh, hq, hkv, q_spec, cache_spec, table_spec", SHARDED,
                         ids=[c[0] for c in SHARDED])
def test_sharded_jit_has_no_collective(rng, kernel_path, name, paged, mesh, hq, hkv, q_spec,
                                       cache_spec, table_spec):
    """The kernel route (the reference takes the same partitioning rule, so one route covers
    both)."""
    backend = kernel_path
    mesh = _mesh(*mesh)
    append = "no append" not in name
    args, kwargs = make_case(rng, batch=4, tq=2, tnew=2 if append else None, hq=hq, hkv=hkv,
                             capacity=16, page_size=4 if paged else None)
    q, k_cache, v_cache, lengths = args
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    batch_spec = P(*q_spec[:1])
    sharded = (put(q, q_spec), put(k_cache, cache_spec), put(v_cache, cache_spec),
               put(lengths, batch_spec))
    sharded_kwargs = {}
    if append:
        sharded_kwargs = dict(k_new=put(kwargs["k_new"], q_spec),
                              v_new=put(kwargs["v_new"], q_spec))
    if paged:
        sharded_kwargs["page_table"] = put(kwargs["page_table"], table_spec)

    def step(q, k_cache, v_cache, lengths, kw):
        return tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, lengths, **kw,
                                                   return_lse=True, backend=backend)

    step = jax.jit(step, donate_argnums=(1, 2) if append else ())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "gathered" warning from the partitioning rule
        step = step.lower(*sharded, sharded_kwargs).compile()
    assert not collectives(step.as_text()), collectives(step.as_text())
    o, lse, *caches = step(*sharded, sharded_kwargs)
    expected = naive_kvcache(*args, **kwargs, window=(-1, 0))
    assert_close(o, expected[0], "o", 2e-5)
    assert_lse_close(lse, expected[1], "lse", 2e-5)
    if append:
        assert caches[0].sharding.is_equivalent_to(NamedSharding(mesh, cache_spec), 4)
        np.testing.assert_array_equal(np.asarray(caches[0], np.float64), expected[2])


@pytest.mark.parametrize("paged", [False, True])
def test_shard_map_runs_per_shard(rng, kernel_path, paged):
    """Inside shard_map each device holds its batch rows and (paged) its own pool; the result
    equals each shard computed alone."""
    mesh = _mesh((4,), ("data",))
    devices = 4
    shards = [make_case(rng, batch=2, tq=3, tnew=3, capacity=12, page_size=4 if paged else None)
              for _ in range(devices)]
    concat = lambda xs: jnp.concatenate(xs)
    args = tuple(concat([s[0][i] for s in shards]) for i in range(4))
    kwargs = {key: concat([s[1][key] for s in shards]) for key in shards[0][1]}

    def local(q, k_cache, v_cache, lengths, kw):
        return tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, lengths, **kw,
                                                   backend=kernel_path)

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    o, k_out, _ = f(*args, kwargs)
    for i, (s_args, s_kwargs) in enumerate(shards):
        expected = naive_kvcache(*s_args, **s_kwargs, window=(-1, 0))
        assert_close(o[2 * i:2 * i + 2], expected[0], f"o of shard {i}", 2e-5)
        rows = slice(k_out.shape[0] // devices * i, k_out.shape[0] // devices * (i + 1))
        np.testing.assert_array_equal(np.asarray(k_out[rows], np.float64), expected[2])


# ----------------------------------------------------------------------------------------------
# 7. flash_attention's decode path.


def test_decode_fast_path_applies(install_kernels):
    import types

    reason = [None]
    install_kernels(types.SimpleNamespace(kvcache_kernel_unsupported=lambda q, k, t: reason[0]))
    q = jax.ShapeDtypeStruct((2, 1, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 4096, 2, 64), jnp.bfloat16)
    assert kvcache.decode_fast_path_applies(q, k)
    q17 = jax.ShapeDtypeStruct((2, 17, 8, 64), jnp.bfloat16)
    assert not kvcache.decode_fast_path_applies(q17, k)
    short = jax.ShapeDtypeStruct((2, kvcache.DECODE_MIN_KEYS - 1, 2, 64), jnp.bfloat16)
    assert not kvcache.decode_fast_path_applies(q, short)
    reason[0] = "unsupported"
    assert not kvcache.decode_fast_path_applies(q, k)


def test_decode_attention_fwd_equals_flash_attention(rng, kernel_path):
    window = (30, 7)
    q = random_array(rng, (2, 3, 4, 16))
    k, v = random_array(rng, (2, 700, 2, 16)), random_array(rng, (2, 700, 2, 16))
    o, lse = kvcache.decode_attention_fwd(q, k, v, scale=0.2, window_left=window[0],
                                          window_right=window[1])
    ref_o, ref_lse = naive_attention(q, k, v, 0.2, *window)  # flash_attention's rule
    assert_close(o, ref_o, "o", 2e-5)
    assert_lse_close(lse, ref_lse, "lse", 2e-5)
    lengths = jnp.asarray([700, 450], jnp.int32)
    o, _ = kvcache.decode_attention_fwd(q, k, v, scale=0.2, window_left=window[0],
                                        window_right=window[1], kv_seq_lengths=lengths)
    ref_o = naive_kvcache(q, k, v, lengths, scale=0.2, window=window)[0]
    assert_close(o, ref_o, "o with kv_seq_lengths", 2e-5)
