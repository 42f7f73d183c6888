"""Attention against a key/value cache, for inference: decode, speculative verification and
chunked prefill, with the new keys appended to the cache in place.

    flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, ...)   checks arguments
      -> append_to_cache       writes k_new / v_new at cache_seqlens (a scatter that XLA runs in
                               place on a donated cache)
      -> kvcache_attention     the kernel or the reference, under the partitioning rule of
                               tk_jax/_partitioning.py -> (o, lse)

The kernel and the reference take seqlens = the number of valid keys after the append
(cache_seqlens + Tnew) and place the Tq queries at the last Tq positions (bottom-right), as
FlashAttention's flash_attn_with_kvcache does. The op is forward-only: differentiating through
it raises a TypeError (training uses tk_jax.flash_attention).

`decode_fast_path_applies` and `decode_attention_fwd` let tk_jax.flash_attention send its
few-query-token, long-key calls to the same kernel (forward only).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tk_jax import _backend, _kernels, _partitioning
from tk_jax._checks import (FLOAT_DTYPES, check_array, check_backend_name, check_bool, check_same,
                            check_window, is_int, resolve_softmax_scale)
from tk_jax.reference.kvcache import cache_capacity, kvcache_attention_forward

OP = "flash_attention_with_kvcache"

# flash_attention takes the KV-cache kernel for at most this many query tokens and at least
# this many keys: there its tiles (built for long query blocks) would be mostly empty, while
# this kernel packs the query heads of a kv head into one tile and splits the keys.
DECODE_MAX_QUERY_TOKENS = 16
DECODE_MIN_KEYS = 512


def flash_attention_with_kvcache(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                                 cache_seqlens: jax.Array | int, *, k_new: jax.Array | None = None,
                                 v_new: jax.Array | None = None,
                                 page_table: jax.Array | None = None, causal: bool = True,
                                 window_size: tuple[int, int] = (-1, -1),
                                 softmax_scale: float | None = None, return_lse: bool = False,
                                 backend: str = "auto") -> jax.Array | tuple[jax.Array, ...]:
    """Attention of a few new query tokens against a key/value cache (FlashAttention's
    flash_attn_with_kvcache, functional). Forward only (inference).

    Args:
      q: [B, Tq, Hq, D] queries, bfloat16, float16 or float32: 1 to 16 tokens for decode or
        speculative verification, or a longer chunk for chunked prefill.
      k_cache, v_cache: the cache, q's dtype, either contiguous [B, S, Hkv, D] (capacity S)
        or paged [num_pages, page_size, Hkv, D] with `page_table` (capacity
        max_pages * page_size). Hq % Hkv == 0 (query head h reads kv head h // (Hq // Hkv)).
      cache_seqlens: [B] integer array or a Python int for every row: how many tokens each
        row's cache holds *before* k_new is appended (positions 0 .. cache_seqlens[b] - 1).
      k_new, v_new: optional [B, Tnew, Hkv, D] (both or neither), written to positions
        cache_seqlens[b] .. cache_seqlens[b] + Tnew - 1 before the attention, which then
        covers cache_seqlens[b] + Tnew keys. Usually Tnew = Tq (the queries' own tokens).
      page_table: optional [B, max_pages] integer array: key j of row b lives on page
        page_table[b, j // page_size], slot j % page_size. Entries past a row's last page are
        never read (any value). Rows may share pages (a common prefix), but two rows must not
        append to the same slot.
      causal: query token t of row b sits at position n_b - Tq + t, n_b = cache_seqlens[b] +
        Tnew (bottom-right alignment), and sees keys up to its position. Replaces
        window_size[1] by 0.
      window_size: (left, right), each -1 (unbounded) or >= 0: the query at position i sees
        keys [i - left, i + right] (and always only keys < n_b).
      softmax_scale: a positive finite Python number; None means 1 / sqrt(D).
      return_lse: also return lse [B, Hq, Tq] float32, the log-sum-exp of the scaled scores.
      backend: "auto" (the kernel on a Hopper GPU when it supports these inputs, else the
        reference), "kernel" (ValueError if it cannot run) or "reference" (pure JAX).

    Returns:
      o [B, Tq, Hq, D] in q's dtype; with return_lse (o, lse); with k_new also the updated
      caches: (o, k_cache, v_cache) or (o, lse, k_cache, v_cache).
      A query that sees no key gets o = 0 and lse = -inf. Cache entries past a row's n_b keys
      never affect it (they may hold anything, NaN included).

    A full cache (values are not known while tracing, so this is no error) behaves as
    jax.lax.dynamic_update_slice: cache_seqlens[b] is clamped into [0, capacity - Tnew], so an
    append that would run past the end overwrites the last Tnew positions instead, and the
    attention covers the whole cache (without k_new: cache_seqlens clamped into
    [0, capacity]). A new token on a page id outside [0, num_pages) is not written; such a
    page id read by the attention is clamped into range. Nothing is read or written out of
    bounds.

    In place: inside `jax.jit(..., donate_argnums=...)` that donates k_cache and v_cache, the
    append writes only the Tnew new rows into the donated buffers (no copy of the cache), and
    the returned caches alias them. Called eagerly, or without donation, JAX copies the cache.

    Sharding: under a sharded jit, shard a contiguous cache over batch and/or KV heads, a paged
    cache over KV heads (axis 2): no collective is needed. (q, cache_seqlens and the page table
    may also be split over batch against a paged cache when nothing is appended; an append
    from batch shards into a pool that every device holds needs an all-gather.) Inside
    shard_map it runs on the local shard (a paged cache then holds that device's pages, and
    its page table indexes them).
    """
    _check_arrays(q, k_cache, v_cache, k_new, v_new, page_table)
    scale = resolve_softmax_scale(softmax_scale, head_dim=q.shape[-1], op=OP)
    window_left, window_right = check_window(window_size, causal, OP)
    check_bool(return_lse, "return_lse", OP)
    check_backend_name(backend, OP)
    cache_seqlens = _check_cache_seqlens(cache_seqlens, q.shape[0])
    capacity = cache_capacity(k_cache, page_table)
    new_tokens = 0 if k_new is None else k_new.shape[1]
    if new_tokens > capacity:
        raise ValueError(f"{OP}: k_new holds {new_tokens} tokens (axis 1) but the cache holds at "
                         f"most {capacity} per row")
    if page_table is not None:
        page_table = jnp.asarray(page_table).astype(jnp.int32)
    resolved = choose_backend(q, k_cache, page_table, backend)
    o, lse, k_cache, v_cache = _append_and_attend(
        q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, scale=scale,
        window_left=window_left, window_right=window_right, backend=resolved)
    out = (o, lse) if return_lse else (o,)
    if k_new is not None:
        out += (k_cache, v_cache)
    return out[0] if len(out) == 1 else out


# One jitted function, so that an eager call compiles once rather than op by op. Inside the
# caller's jit it is inlined: donation of the caches there still makes the append in place.
@functools.partial(jax.jit, static_argnames=("scale", "window_left", "window_right", "backend"))
def _append_and_attend(q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, *, scale,
                       window_left, window_right, backend):
    q, k_cache, v_cache = (_forward_only(x) for x in (q, k_cache, v_cache))
    if k_new is None:
        seqlens = cache_seqlens
    else:
        k_new, v_new = _forward_only(k_new), _forward_only(v_new)
        k_cache, v_cache, seqlens = append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens,
                                                    page_table)
    o, lse = kvcache_attention(q, k_cache, v_cache, seqlens, page_table, scale=scale,
                               window_left=window_left, window_right=window_right,
                               backend=backend)
    return o, lse, k_cache, v_cache


def choose_backend(q, k_cache, page_table, backend: str) -> str:
    """Resolve "auto" | "kernel" | "reference" to "kernel" or "reference"."""
    unsupported = None
    if backend != "reference" and _backend.kernel_unavailable_reason() is None:
        unsupported = _kernels.kvcache_kernel_unsupported(q, k_cache, page_table)
    return _backend.select_backend(backend, unsupported=unsupported, op=OP)


# ----------------------------------------------------------------------------------------------
# The two steps: append, then attend.


def append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table=None):
    """Write k_new / v_new [B, Tnew, Hkv, D] at positions start[b] + t of each row, start =
    cache_seqlens clamped into [0, capacity - Tnew] (jax.lax.dynamic_update_slice's rule).

    Returns (k_cache, v_cache, seqlens): the updated caches and seqlens = start + Tnew [B]
    int32, the valid keys per row after the append. One scatter per cache: on a donated cache
    XLA performs it in place, writing only the new rows.
    """
    tnew = k_new.shape[1]
    capacity = cache_capacity(k_cache, page_table)
    start = jnp.clip(cache_seqlens, 0, capacity - tnew)
    if page_table is None:
        write = jax.vmap(_write_rows)
        return write(k_cache, k_new, start), write(v_cache, v_new, start), start + tnew

    num_pages, page_size = k_cache.shape[:2]
    positions = start[:, None] + jnp.arange(tnew)                                  # [B, Tnew]
    pages = jnp.take_along_axis(page_table, positions // page_size, axis=1)
    # A page id out of range is not written to: it goes to page num_pages, past the end, which
    # the scatter drops (a negative index would wrap around instead).
    pages = jnp.where((pages >= 0) & (pages < num_pages), pages, num_pages)
    index = jnp.stack([pages, positions % page_size], axis=-1).reshape(-1, 2)
    write = functools.partial(_write_tokens, index)
    return write(k_cache, k_new), write(v_cache, v_new), start + tnew


def _write_rows(cache_row, new_rows, start):
    """cache_row [S, H, D] with new_rows [T, H, D] at start .. start + T - 1 (in range: the
    caller clamps start)."""
    dims = lax.ScatterDimensionNumbers(update_window_dims=(0, 1, 2), inserted_window_dims=(),
                                       scatter_dims_to_operand_dims=(0,))
    return lax.scatter(cache_row, start[None], new_rows.astype(cache_row.dtype), dims,
                       indices_are_sorted=True, unique_indices=True,
                       mode=lax.GatherScatterMode.FILL_OR_DROP)


def _write_tokens(index, pool, new):
    """pool [num_pages, page_size, H, D] with token rows new [B, T, H, D] written at
    index [B * T, 2] = (page, slot); out-of-range indices are dropped."""
    dims = lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(0, 1),
                                       scatter_dims_to_operand_dims=(0, 1))
    rows = new.reshape((-1,) + new.shape[2:]).astype(pool.dtype)
    return lax.scatter(pool, index, rows, dims, mode=lax.GatherScatterMode.FILL_OR_DROP)


def kvcache_attention(q, k_cache, v_cache, seqlens, page_table=None, *, scale, window_left,
                      window_right, backend, local=False):
    """(o [B, Tq, Hq, D], lse [B, Hq, Tq] float32) of q against the first seqlens[b] keys of
    each row's cache, from the resolved backend ("kernel" or "reference").

    Both run under the batch/head partitioning rule (a sharded jit runs them per device, with
    no collective); local=True: the arrays are this device's shards already (inside
    shard_map), the function is called directly."""
    if backend not in ("kernel", "reference"):
        raise ValueError(f"{OP}: backend must be resolved to 'kernel' or 'reference', got "
                         f"{backend!r}")
    fn = _kernels.attention_kvcache if backend == "kernel" else kvcache_attention_forward
    arrays = (q, k_cache, v_cache, seqlens) + (() if page_table is None else (page_table,))
    if local:
        call = _partitioning.on_local_shards(fn)
    else:
        call = _partitioning.partitioned_attention_kvcache(fn, paged=page_table is not None)
    return call(*arrays, scale=scale, window_left=window_left, window_right=window_right)


# ----------------------------------------------------------------------------------------------
# flash_attention's decode path: few query tokens against many keys run the KV-cache kernel.


def decode_fast_path_applies(q, k) -> bool:
    """Whether flash_attention should compute the forward of q [B, Tq, Hq, D] against
    k [B, Tk, Hkv, D] with `decode_attention_fwd` (its kernel backend already chosen): 1 to
    DECODE_MAX_QUERY_TOKENS query tokens, at least DECODE_MIN_KEYS keys, and the KV-cache
    kernel supports the inputs. Masks other than a window (segment ids, query lengths) are
    the caller's to exclude."""
    if not 1 <= q.shape[1] <= DECODE_MAX_QUERY_TOKENS or k.shape[1] < DECODE_MIN_KEYS:
        return False
    return _kernels.kvcache_kernel_unsupported(q, k, None) is None


def decode_attention_fwd(q, k, v, *, scale, window_left, window_right, kv_seq_lengths=None,
                         local=False):
    """flash_attention's forward (o, lse) with the KV-cache kernel: k, v [B, Tk, Hkv, D] as a
    contiguous cache holding Tk keys per row (or kv_seq_lengths[b], clamped into [0, Tk]).
    Same mask as flash_attention's bottom-right window. Not differentiable by itself: the
    caller's custom_vjp keeps its own backward."""
    seqlens = kv_seq_lengths
    if seqlens is None:
        seqlens = jnp.full((q.shape[0],), k.shape[1], jnp.int32)
    return kvcache_attention(q, k, v, seqlens.astype(jnp.int32), scale=scale,
                             window_left=window_left, window_right=window_right,
                             backend="kernel", local=local)


# ----------------------------------------------------------------------------------------------
# Forward only. An identity whose derivative is an error: differentiating through the op
# (jax.grad, jax.jvp, ...) with respect to any of its float inputs fails at trace time with a
# message that says what to use instead. Under jit it costs nothing (an identity).


@jax.custom_jvp
def _forward_only(x):
    return x


@_forward_only.defjvp
def _no_derivative(primals, tangents):
    raise TypeError(
        f"{OP} is forward-only (inference): it cannot be differentiated. To train, use "
        "tk_jax.flash_attention (with kv_seq_lengths for padded keys); to take the cache out of "
        "a differentiated computation, wrap its inputs in jax.lax.stop_gradient.")


# ----------------------------------------------------------------------------------------------
# Argument checks. Every error names the argument, the value given and what is accepted.


def _check_arrays(q, k_cache, v_cache, k_new, v_new, page_table) -> None:
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_array(x, name, min_ndim=4, dtypes=FLOAT_DTYPES, op=OP)
        if x.ndim != 4:
            raise ValueError(f"{OP}: {name} must have rank 4, got shape {tuple(x.shape)} "
                             "(vmap adds batch dimensions)")
    check_same({"q": q.dtype, "k_cache": k_cache.dtype, "v_cache": v_cache.dtype}, "dtype", OP)
    check_same({"k_cache": k_cache.shape, "v_cache": v_cache.shape}, "shape", OP)
    check_same({"q": q.shape[-1], "k_cache": k_cache.shape[-1]}, "head_dim (the last dimension)",
               OP)
    batch, q_heads, head_dim = q.shape[0], q.shape[2], q.shape[3]
    kv_heads = k_cache.shape[2]
    if head_dim == 0:
        raise ValueError(f"{OP}: q has head_dim 0 (shape {tuple(q.shape)}); head_dim must be >= 1")
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"{OP}: q has {q_heads} heads and k_cache, v_cache have {kv_heads} "
                         "(axis 2); the number of q heads must be a positive multiple of the "
                         "number of k/v heads")
    if page_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"{OP}: a contiguous k_cache [B, S, Hkv, D] needs B = q's batch {batch}, got "
                f"shape {tuple(k_cache.shape)} (for a paged cache [num_pages, page_size, Hkv, "
                "D] pass page_table)")
    else:
        _check_integer_array(page_table, "page_table", (batch, None), "[B, max_pages]")
        if k_cache.shape[0] == 0 or k_cache.shape[1] == 0:
            raise ValueError(f"{OP}: a paged k_cache [num_pages, page_size, Hkv, D] needs "
                             f"num_pages >= 1 and page_size >= 1, got shape {tuple(k_cache.shape)}")
    if (k_new is None) != (v_new is None):
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"{OP}: {given} was given without {missing}; pass both or neither")
    if k_new is not None:
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            check_array(x, name, min_ndim=4, dtypes=FLOAT_DTYPES, op=OP)
        check_same({"k_cache": k_cache.dtype, "k_new": k_new.dtype, "v_new": v_new.dtype},
                   "dtype", OP)
        check_same({"k_new": k_new.shape, "v_new": v_new.shape}, "shape", OP)
        expected = (batch, None, kv_heads, head_dim)
        if k_new.ndim != 4 or any(e is not None and e != s for e, s in zip(expected, k_new.shape)):
            raise ValueError(f"{OP}: k_new and v_new must have shape [B, Tnew, Hkv, D] = "
                             f"[{batch}, Tnew, {kv_heads}, {head_dim}], got {tuple(k_new.shape)}")


def _check_integer_array(x, name: str, shape: tuple, described: str) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{OP}: {name} must be an integer array {described}, got "
                        f"{type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{OP}: {name} must be an integer array {described}, got dtype {x.dtype}")
    if x.ndim != len(shape) or any(e is not None and e != s for e, s in zip(shape, x.shape)):
        wanted = ", ".join("any" if e is None else str(e) for e in shape)
        raise ValueError(f"{OP}: {name} must have shape {described} = [{wanted}], got "
                         f"{tuple(x.shape)}")


def _check_cache_seqlens(cache_seqlens, batch: int) -> jax.Array:
    """[B] int32 from an integer array or a Python int."""
    if is_int(cache_seqlens):
        return jnp.full((batch,), int(cache_seqlens), jnp.int32)
    if isinstance(cache_seqlens, (list, tuple)):
        cache_seqlens = np.asarray(cache_seqlens)
    _check_integer_array(cache_seqlens, "cache_seqlens", (batch,), "[B] (or a Python int)")
    return jnp.asarray(cache_seqlens).astype(jnp.int32)
