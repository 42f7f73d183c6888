"""Pure-JAX attention against a key/value cache: the CPU backend of
tk_jax.flash_attention_with_kvcache and the oracle its CUDA kernel is tested against.

It computes exactly what the kernel `tk_jax._kernels.attention_kvcache` computes (the append of
new keys happens before, in tk_jax/kvcache.py):

    q [B, Tq, Hq, D]; seqlens [B] int32: the cache holds keys 0 .. seqlens[b] - 1 of row b.
    Contiguous cache: k_cache, v_cache [B, S, Hkv, D], capacity S.
    Paged cache:      k_cache, v_cache [num_pages, page_size, Hkv, D] and page_table
                      [B, max_pages] int32: key j of row b lies on page
                      page_table[b, j // page_size] at slot j % page_size; capacity
                      max_pages * page_size.

Query token t of row b sits at position seqlens[b] - Tq + t (the queries are the last Tq tokens,
FlashAttention's bottom-right alignment) and sees key j iff
    j < seqlens[b]
    and (window_left  < 0 or j >= position - window_left)
    and (window_right < 0 or j <= position + window_right).
A query that sees no key gets o = 0 and lse = -inf. NaN or inf in q, or in the keys or values
a query sees, reaches that query (o and lse NaN); a non-finite value of a key that only other
queries of the row see may reach it too (0 * NaN in the products, as in the kernel's tiles).
Cache entries at positions >= seqlens[b] never touch row b's results (they may hold anything,
NaN included). Values the kernel cannot
trust are clamped, so that nothing is read out of bounds: seqlens[b] into [0, capacity], a
page id into [0, num_pages).

Memory stays bounded for long caches: the keys are visited in blocks of `block_k` (online
softmax, as FlashAttention), from the first block any row can see to the last that holds a
key of any row, so the largest temporary is a [B, Hkv, G, Tq, block_k] score block. A paged
cache is gathered one block of pages at a time. Arithmetic is float32 with full-precision
matmuls. Forward only: this op serves inference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST


def _einsum(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def cache_capacity(k_cache, page_table) -> int:
    """How many tokens a row's cache can hold: S, or max_pages * page_size when paged."""
    if page_table is None:
        return k_cache.shape[1]
    return page_table.shape[1] * k_cache.shape[1]


def _check_inputs(q, k_cache, v_cache, seqlens, page_table, block_k):
    op = "kvcache_attention_forward"
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(f"{op}: {name} must have rank 4, got shape {x.shape}")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"{op}: k_cache and v_cache must have one shape [.., .., Hkv, D] with "
                         f"q's D; got q {q.shape}, k_cache {k_cache.shape}, "
                         f"v_cache {v_cache.shape}")
    hkv = k_cache.shape[2]
    if hkv == 0 or q.shape[2] % hkv != 0:
        raise ValueError(f"{op}: query heads ({q.shape[2]}) must be a multiple of kv heads ({hkv})")
    if seqlens.shape != (q.shape[0],):
        raise ValueError(f"{op}: seqlens must have shape [B] = {(q.shape[0],)}, got "
                         f"{seqlens.shape}")
    if page_table is None:
        if k_cache.shape[0] != q.shape[0]:
            raise ValueError(f"{op}: a contiguous cache needs one row per batch element: q "
                             f"{q.shape}, k_cache {k_cache.shape}")
    elif page_table.ndim != 2 or page_table.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: page_table must have shape [B, max_pages] with B = {q.shape[0]}, "
                         f"got {page_table.shape}")
    if not isinstance(block_k, int) or block_k < 1:
        raise ValueError(f"{op}: block_k must be a positive int, got {block_k!r}")


def _gather_keys(k_cache, v_cache, page_table, start, block_k):
    """Keys start .. start + block_k - 1 of every row as float32 [B, Hkv, block_k, D] (K and V)
    and their positions. `start` is traced; positions past the capacity are clamped to valid
    memory here and masked by the caller (they are >= the seqlens of every row)."""
    if page_table is None:
        # dynamic_slice keeps the block inside the array by moving its start down; the caller
        # masks the keys below `start` that this repeats from the previous block.
        first = jnp.minimum(start, k_cache.shape[1] - block_k)
        positions = first + jnp.arange(block_k)
        k = lax.dynamic_slice_in_dim(k_cache, first, block_k, axis=1)
        v = lax.dynamic_slice_in_dim(v_cache, first, block_k, axis=1)
    else:
        num_pages, page_size = k_cache.shape[:2]
        positions = start + jnp.arange(block_k)
        page_of_key = jnp.minimum(positions // page_size, page_table.shape[1] - 1)
        pages = jnp.clip(page_table[:, page_of_key], 0, num_pages - 1)  # [B, block_k]
        slots = positions % page_size
        k, v = k_cache[pages, slots], v_cache[pages, slots]              # [B, block_k, Hkv, D]
    as_heads = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)
    return as_heads(k), as_heads(v), positions


def _varying_like(x, *arrays):
    """x typed as varying over every shard_map axis along which any of `arrays` varies: a loop
    carry must start with the type the loop body gives it. Outside shard_map: x itself."""
    axes = set()
    for a in arrays:
        if a is not None:
            axes |= set(jax.typeof(a).manual_axis_type.varying)
    missing = tuple(sorted(axes - set(jax.typeof(x).manual_axis_type.varying), key=str))
    return lax.pcast(x, missing, to="varying") if missing else x


@functools.partial(jax.jit, static_argnames=("scale", "window_left", "window_right", "block_k"))
def kvcache_attention_forward(q, k_cache, v_cache, seqlens, page_table=None, *, scale: float,
                              window_left: int, window_right: int, block_k: int = 256):
    """(o [B, Tq, Hq, D] in q.dtype, lse [B, Hq, Tq] float32) of q against the cache's first
    seqlens[b] keys of each row (see the module docstring for the exact rule)."""
    _check_inputs(q, k_cache, v_cache, seqlens, page_table, block_k)
    b, tq, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    capacity = cache_capacity(k_cache, page_table)
    kv_len = jnp.clip(seqlens.astype(jnp.int32), 0, capacity)
    query_pos = kv_len[:, None] - tq + jnp.arange(tq)  # [B, Tq]

    o = jnp.zeros((b, hkv, g, tq, d), jnp.float32)
    lse = jnp.full((b, hkv, g, tq), -jnp.inf, jnp.float32)
    if capacity > 0 and tq > 0:
        block_k = min(block_k, capacity)
        # Keys a row's queries may see lie in [first_key, kv_len): walk only those blocks.
        first_key = (jnp.maximum(kv_len - tq - window_left, 0) if window_left >= 0
                     else jnp.zeros_like(kv_len))
        first_block = jnp.min(first_key) // block_k
        end_block = (jnp.max(kv_len) + block_k - 1) // block_k
        qg = jnp.transpose(q.astype(jnp.float32).reshape(b, tq, hkv, g, d), (0, 2, 3, 1, 4))

        def step(index, carry):
            m, l, acc = carry
            start = index * block_k
            k_blk, v_blk, pos = _gather_keys(k_cache, v_cache, page_table, start, block_k)
            # Keys some query of the row may see (not stale entries past kv_len, not repeats
            # of the previous block):
            in_row = (pos >= start) & (pos >= first_key[:, None]) & (pos < kv_len[:, None])
            # Stale entries (any bits, NaN too) must not reach the row through 0 * v.
            v_blk = jnp.where(in_row[:, None, :, None], v_blk, 0.0)
            visible = in_row[:, None, :]                                 # [B, Tq, block_k]
            if window_left >= 0:
                visible &= pos >= query_pos[:, :, None] - window_left
            if window_right >= 0:
                visible &= pos <= query_pos[:, :, None] + window_right
            s = scale * _einsum("bhgqd,bhkd->bhgqk", qg, k_blk)
            s = jnp.where(visible[:, None, None], s, -jnp.inf)
            # Online softmax; a row with nothing seen so far keeps m = -inf and uses 0 instead.
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_ref[..., None])
            rescale = jnp.exp(m - m_ref)
            l = l * rescale + p.sum(axis=-1)
            acc = acc * rescale[..., None] + _einsum("bhgqk,bhkd->bhgqd", p, v_blk)
            return m_new, l, acc

        row = _varying_like(jnp.zeros((b, hkv, g, tq), jnp.float32),
                            q, k_cache, v_cache, seqlens, page_table)
        init = (row - jnp.inf, row, jnp.zeros_like(row, shape=o.shape))
        if capacity <= block_k:  # one block holds every key: no loop (it compiles faster)
            m, l, acc = step(0, init)
        else:
            m, l, acc = lax.fori_loop(first_block, end_block, step, init)
        # l == 0 exactly: the row saw no key (o = 0, lse = -inf). A NaN l (NaN in what the row
        # saw) is not 0 and reaches o and lse.
        seen = l != 0
        l_safe = jnp.where(seen, l, 1.0)
        o = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)

    o = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, tq, hq, d)
    return o.astype(q.dtype), lse.reshape(b, hq, tq)
