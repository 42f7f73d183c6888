"""A small case of every kernel (attention forward and backward, with and without a gradient of
lse, Based forward and backward, attention against a KV cache), for running under
compute-sanitizer:
`compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py [attention|based|kvcache]`
(both when no argument is given). Odd lengths and GQA so that tails and masks are exercised.
Tq > Tk: with bottom-right causal alignment the first rows see no key at all, and the backward
walks several query tiles per key block, so work carried from one step to the next is covered.
The KV-cache case: one and two consumer warpgroups, contiguous and paged caches (pages smaller
and larger than a key tile, read one, two or four KV heads a block; garbage table entries past
each row's pages), lengths 0, partial and full, one split and several. The attention backward
also runs as its three calls, on a dQ state with shifted, wrapping rows."""
import itertools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tk_jax import _ext, _kernels

ok, why = _ext.kernels_available()
assert ok, why
rng = np.random.default_rng(0)
which = sys.argv[1:] or ["attention", "based", "kvcache"]
for d in (64, 128, 256) if "attention" in which else ():
    q = jnp.asarray(rng.standard_normal((1, 333, 4, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 130, 2, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, 130, 2, d)), jnp.bfloat16)
    kw = dict(scale=1 / math.sqrt(d), window_left=-1, window_right=0)
    o, lse = _kernels.attention_fwd(q, k, v, **kw)
    jax.block_until_ready(_kernels.attention_bwd(q, k, v, o, lse, jnp.ones_like(o), jnp.ones_like(lse), **kw))
    jax.block_until_ready((o, lse))
    # Unmasked, the D=64 forward runs three consumer warpgroups and the backward has no masked
    # tile but the key tail; more than 4096 keys take the forward's plain grid unmasked, and
    # under the causal mask the persistent kernel on half as many blocks as items, two items a
    # block (the cases above run the persistent grid of at most one block an SM).
    full = dict(kw, window_right=-1)
    o_full, lse_full = _kernels.attention_fwd(q, k, v, **full)
    jax.block_until_ready(_kernels.attention_bwd(q, k, v, o_full, lse_full, jnp.ones_like(o_full), **full))
    k_long, v_long = (jnp.asarray(rng.standard_normal((1, 4100, 2, d)), jnp.bfloat16) for _ in range(2))
    for kw_long in (kw, full):
        jax.block_until_ready(_kernels.attention_fwd(q[:, :70], k_long, v_long, **kw_long))
    # Masks: rows packed with documents (segment ids: one-token ones, ids only the queries hold,
    # unsorted runs), lengths 0, partial and past the end (clamped), a causal window, top-left
    # alignment; the forward's persistent grid (SEG), the backward's walk cut to the segments.
    t = 333
    runs = [1, 40, 1, 100, 60, 31, 90, 10]  # tokens per document: t in all
    seg = np.repeat(np.array([[0, 1, 2, 3, 5, 4, 6, 1], [7, 7, 8, 9, 9, 9, 9, 9]], np.int32), runs, axis=1)
    kv_seg = np.where(seg == 5, 11, seg)  # id 5: queries only (an empty segment)
    qb, kb, vb = (jnp.asarray(rng.standard_normal((2, t, h, d)), jnp.bfloat16) for h in (4, 2, 2))
    masked = dict(scale=1 / math.sqrt(d), window_left=70, window_right=0, q_segment_ids=jnp.asarray(seg),
                  kv_segment_ids=jnp.asarray(kv_seg), q_seq_lengths=jnp.asarray([t, 200], jnp.int32),
                  kv_seq_lengths=jnp.asarray([t + 9, 0], jnp.int32), bottom_right=False)
    o_m, lse_m = _kernels.attention_fwd(qb, kb, vb, **masked)
    jax.block_until_ready(_kernels.attention_bwd(qb, kb, vb, o_m, lse_m, jnp.ones_like(o_m), **masked))
    lengths_only = dict(scale=1 / math.sqrt(d), window_left=-1, window_right=0,
                        q_seq_lengths=jnp.asarray([5, t], jnp.int32), kv_seq_lengths=jnp.asarray([t, 64], jnp.int32))
    o_l, lse_l = _kernels.attention_fwd(qb, kb, vb, **lengths_only)
    jax.block_until_ready(_kernels.attention_bwd(qb, kb, vb, o_l, lse_l, jnp.ones_like(o_l), **lengths_only))
    # Many packed items a block (documents of 1-299 tokens, 2 x 2048 tokens, 8/2 heads): the
    # forward's Q slots and K/V rings wrap many times from item to item.
    t_many = 2048
    runs_many = rng.integers(1, 300, size=(2, t_many))
    seg_many = jnp.asarray(np.stack([np.repeat(np.arange(t_many), r)[:t_many] for r in runs_many]), jnp.int32)
    q_many = jnp.asarray(rng.standard_normal((2, t_many, 8, d)), jnp.bfloat16)
    k_many, v_many = (jnp.asarray(rng.standard_normal((2, t_many, 2, d)), jnp.bfloat16) for _ in range(2))
    jax.block_until_ready(_kernels.attention_fwd(q_many, k_many, v_many, scale=1 / math.sqrt(d), window_left=-1,
                                                 window_right=0, q_segment_ids=seg_many, kv_segment_ids=seg_many))
    # The backward in three calls (context parallelism's dQ state): two blocks of keys, the
    # second call on part of the rows, its rows shifted and wrapping around the state's end.
    rows = 256
    q3, do3 = (jnp.asarray(rng.standard_normal((1, rows, 4, d)), jnp.bfloat16) for _ in range(2))
    o3, lse3 = _kernels.attention_fwd(q3, k, v, **full)
    state = _kernels.attention_bwd_row_stats(o3, lse3, do3, scale=full["scale"])
    state, _, _ = _kernels.attention_bwd_keys(state, q3, k[:, :70], v[:, :70], do3, dq_rows=rows,
                                              dq_row_shift=128, **full)
    state, _, _ = _kernels.attention_bwd_keys(state, q3[:, 64:], k[:, 70:], v[:, 70:], do3[:, 64:],
                                              dq_rows=rows, dq_row_shift=192, **full)
    jax.block_until_ready(_kernels.attention_bwd_dq(state, q3))
for dv in (64, 128) if "based" in which else ():  # Based: two chunks, the second partial; a random initial state
    qk_shape, v_shape = (1, 77, 2, 16), (1, 77, 2, dv)
    q, k = (jnp.asarray(0.5 * rng.standard_normal(qk_shape), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal(v_shape), jnp.bfloat16)
    s0 = jnp.asarray(rng.standard_normal((1, 2, 273, dv)), jnp.float32)
    z0 = jnp.asarray(10 + rng.random((1, 2, 273)), jnp.float32)
    y, s, z, den = _kernels.based_fwd(q, k, v, s0, z0, normalize=True, eps=1e-6)
    grads = _kernels.based_bwd(q, k, v, y, den, jnp.ones_like(y), s0, z0, jnp.ones_like(s), jnp.ones_like(z),
                               normalize=True, eps=1e-6)
    jax.block_until_ready((y, s, z, den, grads))
# 8/2 x 4 tokens: 16 packed rows, one consumer warpgroup (16-key pages: two KV heads a block);
# 16/4 x 4: 16 rows a KV head (16-key pages: four a block, a warp each); 32/4 x 4: 32 rows a KV
# head (16-key pages: four a block, two warps each, at D = 128; two heads at D = 64); 16/1 x 4:
# 64 rows, one KV head a block (16-key pages at D >= 128: grouped rows); 32/1 x 4: 128 rows, two
# consumer warpgroups.
for d, (hq, hkv) in itertools.product((64, 128, 256), ((8, 2), (16, 4), (32, 4), (16, 1), (32, 1))) \
        if "kvcache" in which else ():
    b, s, tq = 3, 300, 4
    q = jnp.asarray(rng.standard_normal((b, tq, hq, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16) for _ in range(2))
    seqlens = jnp.asarray([0, 173, s], jnp.int32)
    kw = dict(scale=1 / math.sqrt(d), window_left=-1, window_right=0)
    for n in (1, 3):
        jax.block_until_ready(_kernels.attention_kvcache(q, k, v, seqlens, num_splits=n, **kw))
    for page_size in (16, 128):
        max_pages = -(-s // page_size)
        pages = b * max_pages + 1
        table = rng.permutation(pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
        table[1, -(-173 // page_size):] = -1  # never read: past row 1's last page
        k_pages, v_pages = (jnp.asarray(rng.standard_normal((pages, page_size, hkv, d)), jnp.bfloat16) for _ in range(2))
        for n in (1, 3):
            jax.block_until_ready(_kernels.attention_kvcache(q, k_pages, v_pages, seqlens, jnp.asarray(table),
                                                             num_splits=n, window_left=40, window_right=0,
                                                             scale=kw["scale"]))
print("sanitize case done")
