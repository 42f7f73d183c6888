"""flash_attention_with_kvcache's kernel on a Hopper GPU against the float64 oracle of
tests/test_kvcache_api.py and against FlashAttention-3 for JAX (flash_mha_with_kvcache, when
flash_attn3_jax imports): contiguous and paged caches, random lengths (0 and full), shuffled
page tables, appends across pages, GQA/MQA, D 64/128/256, bf16/fp16, 1 to 16 query tokens
and a chunked prefill, caches long enough to split the keys, stale cache entries poisoned with
NaN, full caches, outputs poisoned before each launch, two runs compared bit for bit, the
in-place append in the compiled GPU program, and flash_attention's decode path.

Run: python3 -m pytest -m gpu -q tests/test_kvcache_api_gpu.py
"""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tk_jax
from tk_jax import kvcache
from gpu_util import poison_device_memory, rel_l2
from naive import naive_attention
from test_kvcache_api import _copies_of, naive_kvcache

pytestmark = pytest.mark.gpu


def _case(rng, *, batch, tq, tnew, hq, hkv, d, capacity, page_size, dtype, poison_stale=True,
          lengths=None):
    """Arguments (q, k_cache, v_cache, cache_seqlens) and kwargs (k_new, v_new, page_table)
    with random lengths (row 0 empty, row 1 filled exactly by the append) unless given, a
    shuffled page table with -1 past each row's pages, and every stale cache entry NaN."""
    q = rng.standard_normal((batch, tq, hq, d)).astype(dtype)
    kwargs = {}
    if page_size:
        max_pages = -(-capacity // page_size)
        num_pages = batch * max_pages + 5
        capacity = max_pages * page_size
        shape = (num_pages, page_size, hkv, d)
        table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
    else:
        shape = (batch, capacity, hkv, d)
    k_cache = rng.standard_normal(shape).astype(dtype)
    v_cache = rng.standard_normal(shape).astype(dtype)
    if lengths is None:
        lengths = rng.integers(0, capacity - tnew + 1, size=batch)
        lengths[0] = 0
        if batch > 1:
            lengths[1] = capacity - tnew
    lengths = np.asarray(lengths)
    if tnew:
        kwargs["k_new"] = rng.standard_normal((batch, tnew, hkv, d)).astype(dtype)
        kwargs["v_new"] = rng.standard_normal((batch, tnew, hkv, d)).astype(dtype)
    if poison_stale:
        if page_size:
            stale = np.ones(shape[:2], bool)
            for b, n in enumerate(np.clip(lengths, 0, capacity)):
                j = np.arange(n)
                stale[table[b, j // page_size], j % page_size] = False
            k_cache[stale], v_cache[stale] = np.nan, np.nan
        else:
            for b, n in enumerate(np.clip(lengths, 0, capacity)):
                k_cache[b, n:], v_cache[b, n:] = np.nan, np.nan
            # The append overwrites the NaN in its own rows; the rest stays stale.
    if page_size:
        for b, n in enumerate(np.clip(lengths + tnew, 0, capacity)):
            table[b, -(-n // page_size):] = -1  # never read
        kwargs["page_table"] = table.astype(np.int32)
    return (q, k_cache, v_cache, lengths.astype(np.int32)), kwargs


def _run_kernel(args, kwargs, **options):
    """o, lse (and the caches) from backend="kernel" under jit, outputs poisoned first."""
    fn = jax.jit(functools.partial(tk_jax.flash_attention_with_kvcache, backend="kernel",
                                   return_lse=True, **options))
    q = args[0]
    poison_device_memory(4 * q.size * q.dtype.itemsize + (8 << 20))
    return fn(*(jnp.asarray(x) for x in args), **{k: jnp.asarray(v) for k, v in kwargs.items()})


def _window(options):
    left, right = options.get("window_size", (-1, -1))
    return (left, 0) if options.get("causal", True) else (left, right)


def _check(args, kwargs, *, lse_tol=2e-3, **options):
    result = _run_kernel(args, kwargs, **options)
    o, lse = np.asarray(result[0], np.float32), np.asarray(result[1])
    ref_o, ref_lse, ref_k, ref_v = naive_kvcache(*args, **kwargs, window=_window(options),
                                                 scale=options.get("softmax_scale"))
    np.testing.assert_array_equal(np.isnan(o), np.isnan(ref_o), err_msg="NaN pattern of o")
    keep = ~np.isnan(ref_o)
    assert np.isfinite(o[keep]).all(), "non-finite o where the reference is finite"
    err = rel_l2(o[keep], ref_o[keep])
    assert err < 1e-2, f"o: relative L2 error {err:.3g}"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg="-inf of lse")
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse), err_msg="NaN of lse")
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=lse_tol, atol=lse_tol)
    if "k_new" in kwargs:
        k_out = np.asarray(result[2], np.float32).astype(np.float64)
        # NaN == NaN here: stale entries stay NaN.
        np.testing.assert_array_equal(k_out, ref_k)
        np.testing.assert_array_equal(np.asarray(result[3], np.float32).astype(np.float64), ref_v)
    return o, lse


# ----------------------------------------------------------------------------------------------
# Against the float64 oracle.

SHAPES = [  # (batch, tq, tnew, hq, hkv, capacity)
    (4, 1, 1, 32, 8, 3000),        # decode, GQA 4
    (3, 4, 4, 16, 2, 1000),        # speculative verification, GQA 8
    (2, 16, 16, 8, 1, 777),        # MQA, 16 tokens
    (2, 3, 0, 8, 8, 500),          # no append, MHA
    (1, 1, 1, 32, 8, 40000),       # one long sequence: the keys must be split
    (2, 200, 200, 8, 2, 1500),     # chunked prefill
]


@pytest.mark.parametrize("dtype, d", [(jnp.bfloat16, 64), (jnp.bfloat16, 128),
                                      (jnp.bfloat16, 256), (jnp.float16, 128)])
@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{s[0]}-Tq{s[1]}-new{s[2]}-{s[3]}/{s[4]}-S{s[5]}"
                                                 for s in SHAPES])
def test_kernel_matches_oracle(hopper, rng, dtype, d, page_size, shape):
    batch, tq, tnew, hq, hkv, capacity = shape
    if d == 256 and capacity > 5000:
        capacity = 5000  # keep the oracle's time in bounds
    args, kwargs = _case(rng, batch=batch, tq=tq, tnew=tnew, hq=hq, hkv=hkv, d=d,
                         capacity=capacity, page_size=page_size, dtype=dtype)
    _check(args, kwargs)


@pytest.mark.parametrize("options", [dict(causal=False), dict(window_size=(100, -1)),
                                     dict(causal=False, window_size=(50, 3)),
                                     dict(softmax_scale=0.05)],
                         ids=["not causal", "window 100", "window (50, 3)", "scale"])
@pytest.mark.parametrize("page_size", [None, 64])
def test_kernel_masks(hopper, rng, options, page_size):
    args, kwargs = _case(rng, batch=3, tq=4, tnew=4, hq=16, hkv=4, d=128, capacity=2000,
                         page_size=page_size, dtype=jnp.bfloat16)
    _check(args, kwargs, **options)


@pytest.mark.parametrize("page_size", [None, 16])
def test_full_cache_and_bad_page_ids(hopper, rng, page_size):
    """cache_seqlens clamped into [0, capacity - Tnew] (an append past the end overwrites the
    last positions); a page id out of range: its writes dropped, its reads clamped."""
    args, kwargs = _case(rng, batch=4, tq=2, tnew=2, hq=8, hkv=2, d=128, capacity=64,
                         page_size=page_size, dtype=jnp.bfloat16, poison_stale=False,
                         lengths=[62, 63, -5, 7])  # 62 + 2 fits exactly, 63 + 2 does not
    if page_size:
        # Row 3 appends at 7, 8 on its page 0: out of range, so not written; its reads of that
        # page are clamped to the last page.
        kwargs["page_table"][3, 0] = 10**6
    _check(args, kwargs)
    # Without an append: lengths clamped into [0, capacity].
    _check(args[:3] + (np.asarray([64, 70, -1, 7], np.int32),),
           {k: v for k, v in kwargs.items() if k == "page_table"})


def test_nan_reaches_only_the_rows_that_see_it(hopper, rng):
    args, kwargs = _case(rng, batch=2, tq=3, tnew=0, hq=8, hkv=2, d=128, capacity=600,
                         page_size=None, dtype=jnp.bfloat16, poison_stale=False)
    q, k_cache, v_cache, _ = args
    lengths = np.asarray([600, 600], np.int32)
    k_cache[0, 598] = np.nan  # seen by the last query of row 0 only (causal)
    o, _ = _check((q, k_cache, v_cache, lengths), kwargs)
    assert np.isnan(o[0, 1:]).all() and np.isfinite(o[0, 0]).all() and np.isfinite(o[1]).all()


def test_two_runs_agree_bit_for_bit(hopper, rng):
    args, kwargs = _case(rng, batch=1, tq=4, tnew=4, hq=32, hkv=8, d=128, capacity=50000,
                         page_size=64, dtype=jnp.bfloat16)
    first = [np.asarray(x) for x in _run_kernel(args, kwargs)[:2]]
    second = [np.asarray(x) for x in _run_kernel(args, kwargs)[:2]]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_paged_equals_contiguous(hopper, rng):
    """The same keys in a contiguous cache and scattered over shuffled pages: the same o."""
    args, kwargs = _case(rng, batch=2, tq=1, tnew=0, hq=32, hkv=8, d=128, capacity=8192,
                         page_size=None, dtype=jnp.bfloat16, poison_stale=False)
    q, k_cache, v_cache, lengths = args
    page_size = 64
    pages_per_row = 8192 // page_size
    order = rng.permutation(2 * pages_per_row)
    table = order.reshape(2, pages_per_row).astype(np.int32)
    pool_k = np.empty((2 * pages_per_row, page_size) + k_cache.shape[2:], k_cache.dtype)
    pool_v = np.empty_like(pool_k)
    for b in range(2):
        pool_k[table[b]] = k_cache[b].reshape(pages_per_row, page_size, *k_cache.shape[2:])
        pool_v[table[b]] = v_cache[b].reshape(pages_per_row, page_size, *k_cache.shape[2:])
    contiguous = _run_kernel(args, {})[0]
    paged = _run_kernel((q, pool_k, pool_v, lengths), dict(page_table=table))[0]
    assert rel_l2(np.asarray(paged, np.float32), np.asarray(contiguous, np.float32)) < 1e-3


# ----------------------------------------------------------------------------------------------
# The in-place append in the GPU program, and flash_attention's decode path.


@pytest.mark.parametrize("page_size", [None, 64])
def test_append_in_place_on_gpu(hopper, rng, page_size):
    args, kwargs = _case(rng, batch=2, tq=1, tnew=1, hq=32, hkv=8, d=128, capacity=4096,
                         page_size=page_size, dtype=jnp.bfloat16, poison_stale=False)
    q, k_cache, v_cache, lengths = (jnp.asarray(x) for x in args)
    kw = {k: jnp.asarray(v) for k, v in kwargs.items()}

    def step(k_cache, v_cache, q, lengths, kw):
        return tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, lengths, **kw,
                                                   backend="kernel")

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(k_cache, v_cache, q, lengths,
                                                          kw).compile()
    text = compiled.as_text()
    header = text.splitlines()[0]
    assert re.search(r"\{1\}: \(0, \{\}", header) and re.search(r"\{2\}: \(1, \{\}", header), header
    assert not _copies_of(text, k_cache.shape), _copies_of(text, k_cache.shape)
    o, k_out, _ = compiled(jnp.copy(k_cache), jnp.copy(v_cache), q, lengths, kw)
    ref = naive_kvcache(*args, **kwargs, window=(-1, 0))
    assert rel_l2(np.asarray(o, np.float32), ref[0]) < 1e-2
    np.testing.assert_array_equal(np.asarray(k_out, np.float32).astype(np.float64), ref[2])


@pytest.mark.parametrize("shape", [(16, 1, 32768 // 8, 32, 8), (1, 1, 32768, 32, 8),
                                   (4, 4, 4096, 32, 32)])
def test_flash_attention_decode_path(hopper, rng, shape):
    """flash_attention with few query tokens and many keys takes the KV-cache kernel (forward)
    and keeps its own backward."""
    batch, tq, tk, hq, hkv = shape
    q = jnp.asarray(rng.standard_normal((batch, tq, hq, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((batch, tk, hkv, 128)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((batch, tk, hkv, 128)), jnp.bfloat16)
    assert kvcache.decode_fast_path_applies(q, k)
    for causal in (False, True):
        o, lse = tk_jax.flash_attention(q, k, v, causal=causal, return_lse=True, backend="kernel")
        ref_o, ref_lse = naive_attention(np.asarray(q, np.float64), np.asarray(k, np.float64),
                                         np.asarray(v, np.float64), 1 / math.sqrt(128), -1,
                                         0 if causal else -1)
        assert rel_l2(np.asarray(o, np.float32), ref_o) < 1e-2
        np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=2e-3, atol=2e-3)
    grads = jax.grad(lambda q, k, v: tk_jax.flash_attention(q, k, v, backend="kernel")
                     .astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)
    ref = jax.grad(lambda q, k, v: tk_jax.flash_attention(q, k, v, backend="reference")
                   .astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref):
        assert rel_l2(np.asarray(g, np.float32), np.asarray(r, np.float32)) < 2e-2


# ----------------------------------------------------------------------------------------------
# Against FlashAttention-3 for JAX (the peer whose semantics this API follows).

FA3_CASES = [  # (batch, tq, tnew, hq, hkv, d, capacity, page_size, causal)
    (4, 1, 1, 32, 8, 128, 4096, None, True),
    (2, 4, 4, 32, 8, 128, 3000, 64, True),
    (2, 16, 16, 16, 2, 64, 2000, 256, True),
    (3, 2, 0, 16, 4, 128, 1000, None, False),
    (1, 1, 1, 32, 8, 128, 65536, 16, True),
]


@pytest.mark.parametrize("case", FA3_CASES, ids=[f"B{c[0]}-Tq{c[1]}-new{c[2]}-{c[3]}/{c[4]}-D{c[5]}"
                                                 f"-S{c[6]}-page{c[7]}-causal{int(c[8])}"
                                                 for c in FA3_CASES])
def test_matches_fa3_flash_mha_with_kvcache(hopper, rng, case):
    fa3 = pytest.importorskip("flash_attn3_jax")
    batch, tq, tnew, hq, hkv, d, capacity, page_size, causal = case
    args, kwargs = _case(rng, batch=batch, tq=tq, tnew=tnew, hq=hq, hkv=hkv, d=d,
                         capacity=capacity, page_size=page_size, dtype=jnp.bfloat16,
                         poison_stale=False)
    q, k_cache, v_cache, lengths = (jnp.asarray(x) for x in args)
    kw = {k: jnp.asarray(v) for k, v in kwargs.items()}
    ours = tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, lengths, **kw, causal=causal,
                                               return_lse=True, backend="kernel")
    new = dict(k=kw.get("k_new"), v=kw.get("v_new"))
    if page_size and tnew:
        # FA3's wrapper checks cache_seqlens + Tnew against k_cache.shape[1], the page size of a
        # paged cache: give it our appended cache and the lengths after the append instead.
        k_cache, v_cache, lengths, new = ours[2], ours[3], lengths + tnew, {}
    # FA3's kernel may write k/v into the cache buffers it is given: hand it copies.
    theirs = fa3.flash_mha_with_kvcache(
        q, jnp.copy(k_cache), jnp.copy(v_cache), **new, cache_seqlens=lengths,
        page_table=kw.get("page_table"), is_causal=causal, return_softmax_lse=True)
    assert rel_l2(np.asarray(ours[0], np.float32), np.asarray(theirs[0], np.float32)) < 1e-2
    np.testing.assert_allclose(np.asarray(ours[1]), np.asarray(theirs[1]), rtol=2e-3, atol=2e-3)
