"""The blockwise pure-JAX attention (tk_jax.reference.attention) against naive float64 attention.

Every test draws fresh random inputs; the seed is in each failure message, and TK_TEST_SEED=<n>
replays it.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tk_jax.reference.attention import attention_backward, attention_forward

try:  # tests/ as a package, or tests/ on sys.path (pytest's default rootdir-less import)
    from tests.naive import (attention_mask, naive_attention, naive_attention_grads,
                             relative_l2, visible_mask)
except ImportError:
    from naive import (attention_mask, naive_attention, naive_attention_grads, relative_l2,
                       visible_mask)

# Relative L2 bounds against float64 on the same (already rounded) input values.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}
LSE_TOLERANCE = 1e-5  # lse is float32 whatever the input dtype


def fresh_rng():
    seed = int(os.environ.get("TK_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    return np.random.default_rng(seed), seed


def random_inputs(rng, b, tq, tk, hq, hkv, d, dtype):
    """q, k, v, do in `dtype` (jax arrays) and the same values in float64 (numpy)."""
    shapes = [(b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d), (b, tq, hq, d)]
    arrays = [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]
    return arrays, [np.asarray(a, np.float64) for a in arrays]


def assert_close(actual, expected, tol, what, seed):
    assert np.all(np.isfinite(np.asarray(actual, np.float32))), f"{what}: non-finite (seed={seed})"
    err = relative_l2(actual, expected)
    assert err < tol, f"{what}: relative L2 error {err:.3g} >= {tol} (seed={seed})"


def assert_lse_close(actual, expected, what, seed):
    """Same -inf pattern, no NaN, finite entries within LSE_TOLERANCE."""
    actual = np.asarray(actual)
    assert actual.dtype == np.float32, f"{what}: lse dtype {actual.dtype}"
    assert not np.any(np.isnan(actual)), f"{what}: NaN in lse (seed={seed})"
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected),
                                  err_msg=f"{what}: -inf pattern differs (seed={seed})")
    finite = np.isfinite(expected)
    if finite.any():
        assert_close(actual[finite], expected[finite], LSE_TOLERANCE, what, seed)


# (batch, Tq, Tk, Hq, Hkv, D, window_left, window_right, block_k). block_k is chosen smaller than
# the keys and not dividing them, so blocks end mid-window and the last one is padded.
CASES = {
    "full": (2, 33, 33, 2, 2, 16, -1, -1, 8),
    "causal": (2, 33, 33, 2, 2, 16, -1, 0, 8),
    "left_window": (1, 40, 40, 2, 2, 8, 5, -1, 16),
    "right_window": (1, 40, 40, 2, 2, 8, -1, 3, 16),
    "gqa_4_to_2_both_windows": (1, 41, 41, 4, 2, 8, 4, 2, 7),
    "gqa_4_to_1_causal_tq_lt_tk": (2, 13, 37, 4, 1, 8, -1, 0, 10),
    "tq_gt_tk_causal": (2, 37, 13, 2, 2, 8, -1, 0, 5),  # the first 24 rows see nothing
    "tq_gt_tk_both_windows": (1, 29, 11, 2, 1, 8, 3, 1, 4),
    "length_1": (2, 1, 1, 2, 2, 8, -1, 0, 512),
    "decode_1_of_17": (1, 1, 17, 4, 2, 8, -1, 0, 4),
    "length_17_one_block": (1, 17, 17, 2, 2, 8, -1, -1, 512),
    "length_1000_causal": (1, 1000, 1000, 1, 1, 8, -1, 0, 128),  # 128 does not divide 1000
}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def run_case(case, dtype, rng):
    b, tq, tk, hq, hkv, d, wl, wr, block_k = CASES[case]
    params = dict(scale=d ** -0.5, window_left=wl, window_right=wr)
    (q, k, v, do), (q64, k64, v64, do64) = random_inputs(rng, b, tq, tk, hq, hkv, d, dtype)
    return params, block_k, (q, k, v, do), (q64, k64, v64, do64)


def empty_rows(case):
    """[Tq] bool: query rows of `case` that see no key (they must give o = 0, lse = -inf and a
    zero dq, exactly)."""
    _, tq, tk, _, _, _, wl, wr, _ = CASES[case]
    return ~visible_mask(tq, tk, wl, wr).any(axis=1)


# Masks and blocking do not depend on the dtype: every case runs in float32, a spread of them in
# bfloat16 and float16 (each case and dtype costs about a second of XLA compilation).
HALF_CASES = ["causal", "gqa_4_to_2_both_windows", "tq_gt_tk_causal", "decode_1_of_17",
              "length_1000_causal", "gqa_4_to_1_causal_tq_lt_tk"]
CASE_DTYPES = ([(case, "f32") for case in CASES] + [(case, "bf16") for case in HALF_CASES]
               + [(case, "f16") for case in HALF_CASES[:4]])


@pytest.mark.parametrize("case, dtype", CASE_DTYPES)
def test_forward_matches_naive(case, dtype):
    dtype = DTYPES[dtype]
    rng, seed = fresh_rng()
    params, block_k, (q, k, v, _), (q64, k64, v64, _) = run_case(case, dtype, rng)
    o, lse = attention_forward(q, k, v, block_k=block_k, **params)
    o_ref, lse_ref = naive_attention(q64, k64, v64, **params)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_close(o, o_ref, TOLERANCE[dtype], f"{case} o", seed)
    assert_lse_close(lse, lse_ref, f"{case} lse", seed)
    assert np.all(np.asarray(o)[:, empty_rows(case)] == 0), f"{case}: o of empty rows"


@pytest.mark.parametrize("case, dtype", [(case, "f32") for case in CASES]
                         + [(case, "bf16") for case in HALF_CASES[:4]]
                         + [(case, "f16") for case in HALF_CASES[4:]])
def test_backward_matches_naive(case, dtype):
    dtype = DTYPES[dtype]
    rng, seed = fresh_rng()
    params, block_k, (q, k, v, do), (q64, k64, v64, do64) = run_case(case, dtype, rng)
    o, lse = attention_forward(q, k, v, block_k=block_k, **params)
    grads = attention_backward(q, k, v, o, lse, do, block_k=block_k, **params)
    expected = naive_attention_grads(q64, k64, v64, do64, **params)
    for name, grad, inp, ref in zip(("dq", "dk", "dv"), grads, (q, k, v), expected):
        assert grad.dtype == inp.dtype and grad.shape == inp.shape, name
        assert_close(grad, ref, TOLERANCE[dtype], f"{case} {name}", seed)
    assert np.all(np.asarray(grads[0])[:, empty_rows(case)] == 0), f"{case}: dq of empty rows"


@pytest.mark.parametrize("case, dtype", [("gqa_4_to_2_both_windows", "f32"),
                                         ("tq_gt_tk_causal", "f32"), ("causal", "bf16")])
def test_autodiff_of_forward_matches_naive(case, dtype):
    """jax.grad through the blockwise forward (o and lse both carry a cotangent)."""
    dtype = DTYPES[dtype]
    rng, seed = fresh_rng()
    params, block_k, (q, k, v, do), (q64, k64, v64, do64) = run_case(case, dtype, rng)
    b, tq, hq, _ = q.shape
    dlse = rng.standard_normal((b, hq, tq))

    def loss(q, k, v):
        o, lse = attention_forward(q, k, v, block_k=block_k, **params)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see nothing: lse = -inf
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(lse * dlse)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    expected = naive_attention_grads(q64, k64, v64, do64, dlse=dlse, **params)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(grad, ref, TOLERANCE[dtype], f"{case} autodiff {name}", seed)
    assert np.all(np.asarray(grads[0])[:, empty_rows(case)] == 0), f"{case}: dq of empty rows"
    # The same loss through attention_backward's lse cotangent.
    o, lse = attention_forward(q, k, v, block_k=block_k, **params)
    grads = attention_backward(q, k, v, o, lse, do, block_k=block_k, dlse=jnp.asarray(dlse),
                               **params)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(grad, ref, TOLERANCE[dtype], f"{case} backward+dlse {name}", seed)


def test_cases_include_rows_that_see_no_key():
    """Tq > Tk with a causal mask leaves the first Tq - Tk rows empty: the checks on empty rows
    in the tests above must have something to check."""
    assert empty_rows("tq_gt_tk_causal").sum() == 37 - 13
    assert empty_rows("tq_gt_tk_both_windows").sum() == 29 - 11 - 1


def test_no_keys_at_all():
    """Tk = 0: every row is empty."""
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    k = jnp.ones((1, 0, 1, 8), jnp.bfloat16)
    params = dict(scale=1.0, window_left=-1, window_right=-1)
    o, lse = attention_forward(q, k, k, **params)
    assert o.shape == q.shape and o.dtype == q.dtype and np.all(np.asarray(o) == 0)
    assert np.all(np.isneginf(np.asarray(lse)))
    dq, dk, dv = attention_backward(q, k, k, o, lse, q, **params)
    assert dq.shape == q.shape and np.all(np.asarray(dq) == 0)
    assert dk.shape == k.shape and dv.shape == k.shape


def test_large_logits_do_not_overflow():
    """Scores of several hundred: exp would overflow float32 without the running-max shift."""
    rng, seed = fresh_rng()
    (q, k, v, do), (q64, k64, v64, do64) = random_inputs(rng, 1, 50, 50, 2, 2, 16, jnp.float32)
    params = dict(scale=100.0, window_left=-1, window_right=-1)
    o, lse = attention_forward(q, k, v, block_k=16, **params)
    o_ref, lse_ref = naive_attention(q64, k64, v64, **params)
    assert_close(o, o_ref, 1e-5, "o", seed)
    assert_lse_close(lse, lse_ref, "lse", seed)
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, block_k=16, **params)
    for grad in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(grad))), f"seed={seed}"


def test_backward_with_global_o_and_lse_over_key_blocks():
    """Ring attention calls attention_backward once per block of keys, passing the o and lse of
    the whole sequence: dq adds up over blocks, dk and dv are each block's own rows."""
    rng, seed = fresh_rng()
    (q, k, v, do), (q64, k64, v64, do64) = random_inputs(rng, 2, 19, 26, 4, 2, 8, jnp.float32)
    params = dict(scale=0.3, window_left=-1, window_right=-1)
    o, lse = attention_forward(q, k, v, block_k=8, **params)
    split = 13  # two equal halves: one compilation serves both
    first = attention_backward(q, k[:, :split], v[:, :split], o, lse, do, block_k=8, **params)
    second = attention_backward(q, k[:, split:], v[:, split:], o, lse, do, block_k=8, **params)
    dq_ref, dk_ref, dv_ref = naive_attention_grads(q64, k64, v64, do64, **params)
    assert_close(first[0] + second[0], dq_ref, 1e-5, "dq", seed)
    assert_close(jnp.concatenate([first[1], second[1]], axis=1), dk_ref, 1e-5, "dk", seed)
    assert_close(jnp.concatenate([first[2], second[2]], axis=1), dv_ref, 1e-5, "dv", seed)


def test_jit_and_vmap_compose():
    """Callable inside an outer jit and under vmap (an extra leading batch dimension)."""
    rng, seed = fresh_rng()
    (q, k, v, _), (q64, k64, v64, _) = random_inputs(rng, 3, 9, 9, 2, 1, 8, jnp.float32)
    params = dict(scale=0.4, window_left=2, window_right=0, block_k=4)
    fwd = lambda q, k, v: attention_forward(q[None], k[None], v[None], **params)[0][0]
    o = jax.jit(jax.vmap(fwd))(q, k, v)
    o_ref, _ = naive_attention(q64, k64, v64, 0.4, 2, 0)
    assert_close(o, o_ref, 1e-5, "o", seed)


@pytest.mark.parametrize("which", ["forward", "backward", "autodiff"])
def test_memory_is_blockwise_at_16k(which):
    """Compile (not run) Tq = Tk = 16384: temporaries must scale with Tq * block_k, far below
    the 1 GiB that one [Tq, Tk] float32 score matrix would take (also under jax.grad, where
    the forward's scan would otherwise keep every score block for the backward pass)."""
    b, t, h, d, block_k = 1, 16384, 1, 64, 512
    x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((b, h, t), jnp.float32)
    params = dict(scale=0.125, window_left=-1, window_right=0, block_k=block_k)
    if which == "forward":
        compiled = attention_forward.lower(x, x, x, **params).compile()
    elif which == "backward":
        compiled = attention_backward.lower(x, x, x, x, lse, x, **params).compile()
    else:
        loss = lambda q, k, v: attention_forward(q, k, v, **params)[0].astype(jnp.float32).sum()
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("this jaxlib reports no memory analysis")
    score_block = b * h * t * block_k * 4
    assert stats.temp_size_in_bytes < 8 * score_block, stats
    assert stats.temp_size_in_bytes < b * h * t * t * 4 / 2, stats


@pytest.mark.parametrize("bad, match", [
    (dict(q=(1, 8, 3, 8), k=(1, 8, 2, 8), v=(1, 8, 2, 8)), "multiple of kv heads"),
    (dict(q=(8, 3, 8)), "rank 4"),
    (dict(k=(1, 8, 1, 16)), "head dims"),
    (dict(v=(1, 9, 1, 8)), "k and v"),
])
def test_bad_shapes_raise(bad, match):
    shapes = dict(q=(1, 8, 2, 8), k=(1, 8, 1, 8), v=(1, 8, 1, 8)) | bad
    q, k, v = (jnp.zeros(shapes[n], jnp.float32) for n in ("q", "k", "v"))
    with pytest.raises(ValueError, match=match):
        attention_forward(q, k, v, scale=1.0, window_left=-1, window_right=-1)


def test_naive_grads_match_finite_differences():
    """The oracle itself: analytic float64 gradients against central differences of
    sum(o * do) + sum(lse * dlse) on a tiny GQA problem with a window and empty rows."""
    rng, seed = fresh_rng()
    _, (q, k, v, do) = random_inputs(rng, 1, 5, 3, 2, 1, 3, jnp.float32)
    dlse = rng.standard_normal((1, 2, 5))
    params = dict(scale=0.7, window_left=1, window_right=0)

    def loss(q, k, v):
        o, lse = naive_attention(q, k, v, **params)
        return np.sum(o * do) + np.sum(np.where(np.isfinite(lse), lse, 0.0) * dlse)

    analytic = naive_attention_grads(q, k, v, do, dlse=dlse, **params)
    inputs = [q, k, v]
    for index, grad in enumerate(analytic):
        numeric = np.zeros_like(grad)
        for pos in np.ndindex(grad.shape):
            shifted = []
            for sign in (1.0, -1.0):
                args = [x.copy() for x in inputs]
                args[index][pos] += sign * 1e-6
                shifted.append(loss(*args))
            numeric[pos] = (shifted[0] - shifted[1]) / 2e-6
        assert_close(grad, numeric, 1e-6, f"naive grad {index}", seed)


# ----------------------------------------------------------------------------------------------
# Segment ids, lengths and top-left alignment, with key blocks that end inside segments and
# inside the padding (block_k smaller than, and not dividing, Tk).

MASK_CASES = {
    # name: (batch, Tq, Tk, Hq, Hkv, D, window_left, window_right, bottom_right, block_k)
    "segments+lengths bottom-right causal": (3, 21, 26, 4, 2, 8, -1, 0, True, 6),
    "segments+lengths top-left window": (3, 23, 17, 2, 1, 8, 4, 3, False, 5),
}


def random_masks(rng, b, tq, tk):
    """Runs of 1..6 tokens with labels from {0..3}, drawn separately for queries and keys
    (so some rows match no key), and lengths that include 0 and the full length."""
    def ids(t):
        runs = rng.integers(1, 7, size=t)
        return np.repeat(rng.integers(0, 4, size=t), runs)[:t].astype(np.int32)

    return dict(q_segment_ids=np.stack([ids(tq) for _ in range(b)]),
                kv_segment_ids=np.stack([ids(tk) for _ in range(b)]),
                q_seq_lengths=np.array([tq, 0, rng.integers(1, tq)], np.int32)[:b],
                kv_seq_lengths=np.array([rng.integers(1, tk), tk, tk], np.int32)[:b])


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_masks_forward_and_backward_match_naive(case):
    b, tq, tk, hq, hkv, d, wl, wr, bottom_right, block_k = MASK_CASES[case]
    rng, seed = fresh_rng()
    (q, k, v, do), (q64, k64, v64, do64) = random_inputs(rng, b, tq, tk, hq, hkv, d, jnp.float32)
    masks = random_masks(rng, b, tq, tk)
    params = dict(scale=d ** -0.5, window_left=wl, window_right=wr)
    o, lse = attention_forward(q, k, v, block_k=block_k, bottom_right=bottom_right, **masks,
                               **params)
    o_ref, lse_ref = naive_attention(q64, k64, v64, **params, bottom_right=bottom_right, **masks)
    assert_close(o, o_ref, 1e-5, f"{case} o", seed)
    assert_lse_close(lse, lse_ref, f"{case} lse", seed)
    grads = attention_backward(q, k, v, o, lse, do, block_k=block_k, bottom_right=bottom_right,
                               **masks, **params)
    expected = naive_attention_grads(q64, k64, v64, do64, **params, bottom_right=bottom_right,
                                     **masks)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(grad, ref, 1e-5, f"{case} {name}", seed)
    empty = ~attention_mask(b, tq, tk, wl, wr, bottom_right=bottom_right, **masks).any(axis=2)
    assert empty[1].all()  # q_seq_lengths[1] = 0
    assert np.all(np.asarray(o)[empty] == 0) and np.all(np.asarray(grads[0])[empty] == 0)


def test_non_finite_values_reach_only_the_rows_that_see_them():
    """Per row and head: NaN in o (and lse, for q and k) exactly where plain softmax has it:
    a NaN key that only later rows see, an inf value that only one segment sees. A query whose
    scores are all -inf weighs no key: o = 0, lse = -inf, dq = 0. The backward agrees row by
    row."""
    rng, seed = fresh_rng()
    b, t, h, d = 1, 12, 2, 4
    (q, k, v, do), _ = random_inputs(rng, b, t, t, h, 1, d, jnp.float32)
    ids = np.array([[0, 0, 0, 0, 5, 5, 5, 2, 2, 2, 2, 2]], np.int32)
    k = k.at[0, 9, 0, 1].set(jnp.nan)    # segment 2: rows 9.. see it (causal)
    v = v.at[0, 5, 0, 2].set(jnp.inf)    # segment 5: rows 5, 6 see it
    q = q.at[0, 2, 1, :].set(-jnp.inf)   # row 2, head 1: -inf scores unless k has a 0 or < 0
    k = k.at[0, :3, 0, :].set(jnp.abs(k[0, :3, 0, :]) + 0.1)  # keys 0..2 > 0: all -inf
    masks = dict(q_segment_ids=ids, kv_segment_ids=ids)
    params = dict(scale=0.5, window_left=-1, window_right=0)
    o, lse = attention_forward(q, k, v, block_k=5, **masks, **params)
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, block_k=5, **masks, **params)
    args = [np.asarray(x, np.float64) for x in (q, k, v, do)]
    o_ref, lse_ref = naive_attention(*args[:3], **params, **masks)
    dq_ref, dk_ref, dv_ref = naive_attention_grads(*args, **params, **masks)

    bad = ~np.isfinite(o_ref).all(axis=-1)  # [B, T, H]
    expected_bad = np.zeros((b, t, h), bool)
    expected_bad[0, 9:] = True
    expected_bad[0, 5:7] = True
    np.testing.assert_array_equal(bad, expected_bad, err_msg="the oracle's NaN rows")
    assert np.all(np.asarray(o)[0, 2, 1] == 0) and np.all(np.asarray(dq)[0, 2, 1] == 0)
    assert np.isneginf(np.asarray(lse)[0, 1, 2]) and np.isneginf(lse_ref[0, 1, 2])
    for name, x in (("o", o), ("dq", dq)):
        np.testing.assert_array_equal(~np.isfinite(np.asarray(x)).all(axis=-1), bad,
                                      err_msg=f"{name}: rows with a non-finite value (seed={seed})")
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), np.isnan(lse_ref))
    assert_close(np.asarray(o)[~bad], o_ref[~bad], 1e-5, "o of the other rows", seed)
    assert_close(np.asarray(dq)[~bad], dq_ref[~bad], 1e-5, "dq of the other rows", seed)
    for name, x, ref in (("dk", dk, dk_ref), ("dv", dv, dv_ref)):  # keys no bad row sees
        np.testing.assert_array_equal(np.isfinite(np.asarray(x)), np.isfinite(ref), err_msg=name)
        finite = np.isfinite(ref)
        assert_close(np.asarray(x)[finite], ref[finite], 1e-5, name, seed)
