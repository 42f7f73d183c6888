"""The pure-JAX Based reference (tk_jax/reference/based.py) against an independent float64 naive.

The naive (tests/naive.py) is the quadratic form tril(1 + s + s^2/2) V over the whole sequence (no chunks,
no scan), with the 273-feature map written out only for the state and the initial-state terms.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from naive import naive_based, naive_feature_map
from tk_jax.reference.based import (NUM_FEATURES, based_decode_step_reference, based_forward,
                                    taylor_feature_map)

D = 16  # Based feature dim


def rel_l2(actual, expected):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)


def random_inputs(seed, *, batch, seq_len, heads, value_dim, dtype):
    """q, k [B, T, H, 16], v [B, T, H, Dv] (numpy draws: no per-shape compiles in the tests)."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, seq_len, heads, D)] * 2 + [(batch, seq_len, heads, value_dim)]
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes)


def random_state(seed, *, batch, heads, value_dim, tokens=20):
    """A plausible float32 state (S0, z0): the state left by `tokens` random earlier tokens."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((batch, tokens, heads, D))
    v = rng.standard_normal((batch, tokens, heads, value_dim))
    pairs = np.einsum("bthi,bthj->bthij", k, k).reshape(batch, tokens, heads, D * D)
    phi_k = np.concatenate([np.ones((batch, tokens, heads, 1)), k / D**0.25,
                            pairs / math.sqrt(2 * D)], axis=-1)
    return (jnp.asarray(np.einsum("bthf,bthv->bhfv", phi_k, v), jnp.float32),
            jnp.asarray(phi_k.sum(axis=1), jnp.float32))


def fresh_seed():
    return int(np.random.default_rng().integers(2**31))


_forward = jax.jit(based_forward, static_argnames=("normalize", "eps", "chunk"))

SETTINGS = [(normalize, with_state) for normalize in (True, False) for with_state in (False, True)]


@jax.jit
def forward_all_settings(q, k, v, state0):
    """based_forward for every (normalize, with initial_state) pair: one compile per shape."""
    return {(normalize, with_state): based_forward(q, k, v, normalize=normalize, eps=1e-6,
                                                   initial_state=state0 if with_state else None)
            for normalize, with_state in SETTINGS}


def check_against_naive(q, k, v, state0, *, y_tol, state_tol, seed):
    results = forward_all_settings(q, k, v, state0)
    batch, _, heads, value_dim = v.shape
    for (normalize, with_state), (y, (s, z)) in results.items():
        where = f"normalize={normalize}, initial_state={with_state}, seed={seed}"
        assert y.dtype == v.dtype and y.shape == v.shape, where
        assert s.shape == (batch, heads, NUM_FEATURES, value_dim) and s.dtype == jnp.float32
        assert z.shape == (batch, heads, NUM_FEATURES) and z.dtype == jnp.float32
        y_ref, (s_ref, z_ref) = naive_based(q, k, v, normalize=normalize, eps=1e-6,
                                            initial_state=state0 if with_state else None)
        assert rel_l2(y, y_ref) < y_tol, where
        assert rel_l2(s, s_ref) < state_tol, where
        assert rel_l2(z, z_ref) < state_tol, where


# ------------------------------------------------------------------ tests

def test_feature_map_gives_taylor_kernel():
    rng = np.random.default_rng()
    x, y = rng.standard_normal((2, 2, 5, D))
    phi_x = np.asarray(taylor_feature_map(jnp.asarray(x, jnp.float32)), np.float64)
    phi_y = np.asarray(taylor_feature_map(jnp.asarray(y, jnp.float32)), np.float64)
    assert phi_x.shape == (2, 5, NUM_FEATURES) and NUM_FEATURES == 273
    s = (x * y).sum(-1) / math.sqrt(D)
    np.testing.assert_allclose((phi_x * phi_y).sum(-1), 1 + s + s**2 / 2, rtol=1e-5)
    np.testing.assert_allclose(phi_x, naive_feature_map(x), rtol=1e-5, atol=1e-6)


# T = 1, below a chunk, exactly one chunk, one past a chunk (63 padded keys), several chunks.
@pytest.mark.parametrize("seq_len,value_dim", [(1, 64), (15, 128), (64, 64), (65, 128),
                                               (200, 64)])
def test_forward_float32_matches_naive(seq_len, value_dim):
    seed = fresh_seed()
    q, k, v = random_inputs(seed, batch=2, seq_len=seq_len, heads=2, value_dim=value_dim,
                            dtype=jnp.float32)
    state0 = random_state(seed + 1, batch=2, heads=2, value_dim=value_dim)
    check_against_naive(q, k, v, state0, y_tol=2e-5, state_tol=2e-5, seed=seed)


@pytest.mark.parametrize("seq_len,value_dim", [(15, 64), (65, 128), (200, 128)])
def test_forward_bf16_matches_naive(seq_len, value_dim):
    seed = fresh_seed()
    # The naive sees the same bf16-rounded inputs, so the error left is the bf16 output rounding.
    q, k, v = random_inputs(seed, batch=1, seq_len=seq_len, heads=3, value_dim=value_dim,
                            dtype=jnp.bfloat16)
    state0 = random_state(seed + 1, batch=1, heads=3, value_dim=value_dim)
    check_against_naive(q, k, v, state0, y_tol=1e-2, state_tol=1e-4, seed=seed)


def test_padded_keys_do_not_enter_state():
    # T = 65 pads the last chunk with 63 zero keys; phi(0) = [1, 0, ...], so unmasked padding
    # would push the order-0 entry of z above the number of real tokens.
    q, k, v = random_inputs(fresh_seed(), batch=1, seq_len=65, heads=1, value_dim=8,
                            dtype=jnp.float32)
    _, (_, z) = _forward(q, k, v, normalize=True, eps=1e-6)
    np.testing.assert_allclose(np.asarray(z[..., 0]), 65.0)


def test_chunk_size_does_not_change_result():
    q, k, v = random_inputs(fresh_seed(), batch=2, seq_len=100, heads=2, value_dim=32,
                            dtype=jnp.float32)
    y64, (s64, _) = _forward(q, k, v, normalize=True, eps=1e-6, chunk=64)
    y16, (s16, _) = _forward(q, k, v, normalize=True, eps=1e-6, chunk=16)
    assert rel_l2(y16, y64) < 1e-5 and rel_l2(s16, s64) < 1e-5


def test_decode_steps_reproduce_sequence():
    seq_len, prefix = 40, 27
    q, k, v = random_inputs(fresh_seed(), batch=2, seq_len=seq_len, heads=2, value_dim=16,
                            dtype=jnp.float32)
    y_full, state_full = naive_based(q, k, v, normalize=True, eps=1e-6)
    y_prefix, state = _forward(q[:, :prefix], k[:, :prefix], v[:, :prefix], normalize=True,
                               eps=1e-6)
    step = jax.jit(based_decode_step_reference, static_argnames=("normalize", "eps"))
    outputs = [y_prefix]
    for t in range(prefix, seq_len):
        y_t, state = step(q[:, t], k[:, t], v[:, t], state, normalize=True, eps=1e-6)
        outputs.append(y_t[:, None])
    assert rel_l2(jnp.concatenate(outputs, axis=1), y_full) < 1e-5
    assert rel_l2(state[0], state_full[0]) < 1e-5 and rel_l2(state[1], state_full[1]) < 1e-5


@pytest.mark.parametrize("seq_len,normalize", [(65, False), (130, True)])
def test_autodiff_gradients_match_naive(seq_len, normalize):
    """Gradients of q, k, v and the initial state, through outputs and the returned state."""
    seed = fresh_seed()
    q, k, v = random_inputs(seed, batch=1, seq_len=seq_len, heads=2, value_dim=32,
                            dtype=jnp.float32)
    state0 = random_state(seed + 1, batch=1, heads=2, value_dim=32)
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal(v.shape)
    ds = rng.standard_normal((1, 2, NUM_FEATURES, 32)) * 1e-2
    dz = rng.standard_normal((1, 2, NUM_FEATURES)) * 1e-2

    def loss(fn, dtype, **kw):
        def f(q, k, v, state):
            y, (s, z) = fn(q, k, v, normalize=normalize, eps=1e-6, initial_state=state, **kw)
            return ((y * dy.astype(dtype)).sum() + (s * ds.astype(dtype)).sum()
                    + (z * dz.astype(dtype)).sum())
        return f

    grads = jax.jit(jax.grad(loss(based_forward, np.float32), argnums=(0, 1, 2, 3)))(
        q, k, v, state0)
    with jax.enable_x64(True):
        as64 = lambda x: jnp.asarray(x, jnp.float64)
        grads_ref = jax.jit(jax.grad(loss(naive_based, np.float64, xp=jnp),
                                     argnums=(0, 1, 2, 3)))(
            as64(q), as64(k), as64(v), jax.tree.map(as64, state0))
    for name, g, g_ref in zip(["dq", "dk", "dv", "dS0", "dz0"], jax.tree.leaves(grads),
                              jax.tree.leaves(grads_ref)):
        assert rel_l2(g, g_ref) < 1e-4, f"{name} (seed {seed})"
