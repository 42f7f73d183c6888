"""The Based kernels against a float64 naive on the GPU: fresh random inputs, lengths that are
not multiples of the 64-token chunk, outputs poisoned before each launch, both dtypes, both
value dims, with and without normalisation and initial state; forward outputs and states, and
all gradients (q, k, v, initial state) through y and the returned state; then the public API
on the kernel backend (jit, vmap, grad)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tk_jax
from gpu_util import poison_device_memory, rel_l2
from naive import naive_based, naive_feature_map

D = 16     # q/k feature dim
F = 273    # Taylor features: 1 + 16 + 16 * 16


# ------------------------------------------------------------------ the float64 naive (tests/naive.py)

def naive(q, k, v, s0, z0, *, normalize, eps):
    """y [B,T,H,Dv], S [B,H,273,Dv], z [B,H,273] in float64; s0/z0 None for no initial state."""
    state0 = None if s0 is None else (s0, z0)
    y, (state, z) = naive_based(q, k, v, normalize=normalize, eps=eps, initial_state=state0)
    return y, state, z


def random_inputs(rng, b, t, h, dv, dtype):
    q = rng.standard_normal((b, t, h, D)).astype(dtype)
    k = rng.standard_normal((b, t, h, D)).astype(dtype)
    v = rng.standard_normal((b, t, h, dv)).astype(dtype)
    return q, k, v


def random_state(rng, b, h, dv, tokens=40):
    """A state that earlier tokens could have left (so the normaliser stays positive)."""
    k = rng.standard_normal((b, h, tokens, D))
    v = rng.standard_normal((b, h, tokens, dv))
    phi_k = naive_feature_map(k)
    return ((phi_k.transpose(0, 1, 3, 2) @ v).astype(np.float32), phi_k.sum(-2).astype(np.float32))


def _as64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def kernel_forward(q, k, v, s0, z0, *, normalize, eps=1e-6):
    """One launch of the raw kernel wrapper, into poisoned memory."""
    from tk_jax import _kernels

    fn = jax.jit(lambda *xs: _kernels.based_fwd(*xs, normalize=normalize, eps=eps))
    out_bytes = 2 * v.size * v.dtype.itemsize + 4 * (s0.size + z0.size)
    poison_device_memory(2 * out_bytes)
    y, state, z, _ = fn(*(jnp.asarray(x) for x in (q, k, v, s0, z0)))
    return _as64(y), _as64(state), _as64(z)


def check_outputs(y, state, z, y_ref, state_ref, z_ref):
    assert np.isfinite(y).all(), "y has NaN/inf (unwritten rows?)"
    assert np.isfinite(state).all() and np.isfinite(z).all(), "state has NaN/inf (unwritten entries?)"
    assert rel_l2(y, y_ref) < 1e-2, ("y", rel_l2(y, y_ref))
    # Every row on its own too: a wrong tail row of a long sequence would vanish in the global
    # norm. (Rounding gives ~4e-3 per row at most.)
    row_err = np.linalg.norm(y - y_ref, axis=-1) / np.maximum(np.linalg.norm(y_ref, axis=-1), 1e-6)
    worst = np.unravel_index(np.argmax(row_err), row_err.shape)
    assert row_err.max() < 3e-2, ("worst row (b, t, h)", worst, row_err.max())
    assert rel_l2(state, state_ref) < 1e-2, ("S", rel_l2(state, state_ref))
    # z is summed exactly in fp32 from the keys (K^T K, colsum K, token count).
    assert rel_l2(z, z_ref) < 1e-4, ("z", rel_l2(z, z_ref))


# ------------------------------------------------------------------ the kernel itself

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("dv", [64, 128])
@pytest.mark.parametrize("t", [1, 15, 64, 65, 1000, 4097])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
def test_forward_matches_naive(hopper, rng, dtype, dv, t, normalize, with_state):
    b, h = (2, 3) if t <= 1000 else (1, 2)
    q, k, v = random_inputs(rng, b, t, h, dv, dtype)
    if with_state:
        s0, z0 = random_state(rng, b, h, dv)
    else:
        s0, z0 = np.zeros((b, h, F, dv), np.float32), np.zeros((b, h, F), np.float32)
    y, state, z = kernel_forward(q, k, v, s0, z0, normalize=normalize)
    refs = naive(_as64(q), _as64(k), _as64(v), s0 if with_state else None, z0 if with_state else None,
                       normalize=normalize, eps=1e-6)
    check_outputs(y, state, z, *refs)


@pytest.mark.gpu
def test_forward_large_eps_and_many_heads(hopper, rng):
    """eps reaches the kernel (a large eps changes y visibly), and heads > batch blocks work."""
    q, k, v = random_inputs(rng, 1, 200, 17, 64, jnp.bfloat16)
    s0, z0 = np.zeros((1, 17, F, 64), np.float32), np.zeros((1, 17, F), np.float32)
    y, state, z = kernel_forward(q, k, v, s0, z0, normalize=True, eps=50.0)
    check_outputs(y, state, z, *naive(_as64(q), _as64(k), _as64(v), None, None, normalize=True, eps=50.0))


@pytest.mark.gpu
def test_forward_is_deterministic(hopper, rng):
    q, k, v = random_inputs(rng, 2, 1000, 2, 128, jnp.bfloat16)
    s0, z0 = random_state(rng, 2, 2, 128)
    first = kernel_forward(q, k, v, s0, z0, normalize=True)
    second = kernel_forward(q, k, v, s0, z0, normalize=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_forward_state_continues_across_calls(hopper, rng):
    """Prefill in two kernel calls (the second starting from the first's state) equals one call."""
    q, k, v = random_inputs(rng, 1, 300, 2, 64, jnp.float16)
    zeros = np.zeros((1, 2, F, 64), np.float32), np.zeros((1, 2, F), np.float32)
    y1, s1, z1 = kernel_forward(q[:, :130], k[:, :130], v[:, :130], *zeros, normalize=True)
    y2, s2, z2 = kernel_forward(q[:, 130:], k[:, 130:], v[:, 130:], s1.astype(np.float32), z1.astype(np.float32),
                                normalize=True)
    y_ref, s_ref, z_ref = naive(_as64(q), _as64(k), _as64(v), None, None, normalize=True, eps=1e-6)
    check_outputs(np.concatenate([y1, y2], axis=1), s2, z2, y_ref, s_ref, z_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["value_dim", "state_shape", "z_shape", "feature_dim"])
def test_ffi_rejects_bad_input(hopper, what):
    """The C++ handler checks shapes again and fails the call instead of reading out of bounds."""
    from tk_jax import _kernels

    b, t, h, dv, d = 1, 10, 2, 64, D
    s0_shape, z0_shape = (b, h, F, dv), (b, h, F)
    if what == "value_dim":
        dv, s0_shape = 96, (b, h, F, 96)
    elif what == "state_shape":
        s0_shape = (b, h, F - 1, dv)
    elif what == "z_shape":
        z0_shape = (b, h + 1, F)
    else:
        d = 32
    qk = jnp.zeros((b, t, h, d), jnp.bfloat16)
    v = jnp.zeros((b, t, h, dv), jnp.bfloat16)
    with pytest.raises(Exception, match="tk_based_fwd"):
        y = _kernels.based_fwd(qk, qk, v, jnp.zeros(s0_shape), jnp.zeros(z0_shape), normalize=True, eps=1e-6)[0]
        y.block_until_ready()


# ------------------------------------------------------------------ the public API on the kernel

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_public_api_kernel_backend(hopper, rng, dtype):
    b, t, h, dv = 2, 333, 3, 128
    q, k, v = random_inputs(rng, b, t, h, dv, dtype)
    s0, z0 = random_state(rng, b, h, dv)
    run = jax.jit(lambda q, k, v, s0, z0: tk_jax.based_linear_attention(
        q, k, v, initial_state=(s0, z0), return_state=True, backend="kernel"))
    poison_device_memory(4 * (v.nbytes + s0.nbytes))
    y, (state, z) = run(*(jnp.asarray(x) for x in (q, k, v, s0, z0)))
    assert y.dtype == dtype and y.shape == v.shape
    refs = naive(_as64(q), _as64(k), _as64(v), s0, z0, normalize=True, eps=1e-6)
    check_outputs(_as64(y), _as64(state), _as64(z), *refs)
    # "auto" picks the kernel here and gives the same bits.
    y_auto = jax.jit(lambda q, k, v: tk_jax.based_linear_attention(q, k, v, initial_state=(s0, z0)))(q, k, v)
    np.testing.assert_array_equal(np.asarray(y_auto, np.float32), np.asarray(y, np.float32))


@pytest.mark.gpu
def test_public_api_kernel_under_vmap_and_grad(hopper, rng):
    """vmap folds into the kernels' batch (forward and backward) and grad matches the gradient of
    the reference backend."""
    q, k, v = random_inputs(rng, 3, 150, 2, 64, jnp.bfloat16)  # the leading axis 3 is vmapped
    dy = rng.standard_normal(v.shape).astype(np.float32)

    def loss(backend):
        def f(q, k, v, dy):
            y = tk_jax.based_linear_attention(q[None], k[None], v[None], backend=backend)[0]
            return jnp.sum(y.astype(jnp.float32) * dy)
        return f

    y_vmapped = jax.jit(jax.vmap(lambda q, k, v: tk_jax.based_linear_attention(
        q[None], k[None], v[None], backend="kernel")[0]))(q, k, v)
    y_ref, _, _ = naive(_as64(q), _as64(k), _as64(v), None, None, normalize=True, eps=1e-6)
    assert rel_l2(_as64(y_vmapped), y_ref) < 1e-2

    grads = jax.jit(jax.vmap(jax.grad(loss("kernel"), argnums=(0, 1, 2))))(q, k, v, dy)
    grads_ref = jax.jit(jax.vmap(jax.grad(loss("reference"), argnums=(0, 1, 2))))(q, k, v, dy)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert np.isfinite(_as64(g)).all(), name
        assert rel_l2(_as64(g), _as64(g_ref)) < 1e-2, (name, rel_l2(_as64(g), _as64(g_ref)))


# ------------------------------------------------------------------ the backward kernel

def naive_grads(q, k, v, state0, dy, d_state, d_z, *, normalize, eps):
    """float64 (dq, dk, dv, dS0, dz0) of sum(dy y) + sum(dS S) + sum(dz z), by autodiff of the
    naive quadratic form (no chunks, no states but the initial and final ones)."""
    with jax.enable_x64(True):
        def loss(q, k, v, state0):
            y, (s, z) = naive_based(q, k, v, normalize=normalize, eps=eps, initial_state=state0, xp=jnp)
            return (y * dy).sum() + (s * d_state).sum() + (z * d_z).sum()

        as64 = lambda x: jnp.asarray(x, jnp.float64)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(
            as64(q), as64(k), as64(v), None if state0 is None else tuple(map(as64, state0)))
        dq, dk, dv = (np.asarray(g) for g in grads[:3])
        return dq, dk, dv, None if state0 is None else tuple(np.asarray(g) for g in grads[3])


def kernel_grads(q, k, v, state0, dy, d_state, d_z, *, normalize, eps):
    """The same gradients through the public API on the kernel backend (jit + grad)."""
    def loss(q, k, v, state0):
        y, (s, z) = tk_jax.based_linear_attention(q, k, v, normalize=normalize, eps=eps, initial_state=state0,
                                                  return_state=True, backend="kernel")
        return (y.astype(jnp.float32) * dy).sum() + (s * d_state).sum() + (z * d_z).sum()

    poison_device_memory(8 * (v.nbytes + q.nbytes) + 3 * d_state.nbytes)
    args = [jnp.asarray(x) for x in (q, k, v)] + [None if state0 is None else tuple(map(jnp.asarray, state0))]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    assert all(g.dtype == x.dtype for g, x in zip(grads[:3], (q, k, v)))
    dq, dk, dv = (_as64(g) for g in grads[:3])
    return dq, dk, dv, None if state0 is None else tuple(_as64(g) for g in grads[3])


BACKWARD_CASES = [(t, dv, normalize, with_state, jnp.bfloat16)
                  for t in (1, 15, 64, 65, 1000, 4097) for dv in (64, 128)
                  for normalize, with_state in ((True, False), (False, True), (True, True))]
BACKWARD_CASES += [(t, 64, True, True, jnp.float16) for t in (65, 1000)]
BACKWARD_CASES += [(130, 128, False, False, jnp.float16)]


@pytest.mark.gpu
@pytest.mark.parametrize("t,dv,normalize,with_state,dtype", BACKWARD_CASES)
def test_backward_matches_naive(hopper, rng, t, dv, normalize, with_state, dtype):
    """dq, dk, dv and the initial state's gradients, through y and the returned state."""
    b, h = (2, 3) if t <= 1000 else (1, 2)
    q, k, v = random_inputs(rng, b, t, h, dv, dtype)
    state0 = random_state(rng, b, h, dv) if with_state else None
    # y's cotangent reaches the kernel in y's dtype: the oracle gets the same rounded values.
    dy = rng.standard_normal(v.shape).astype(dtype).astype(np.float32)
    d_state = (1e-2 * rng.standard_normal((b, h, F, dv))).astype(np.float32)
    d_z = (1e-2 * rng.standard_normal((b, h, F))).astype(np.float32)
    got = kernel_grads(q, k, v, state0, dy, d_state, d_z, normalize=normalize, eps=1e-6)
    want = naive_grads(_as64(q), _as64(k), _as64(v), state0, dy, d_state, d_z, normalize=normalize, eps=1e-6)
    # Errors are relative to each gradient's own size, with a floor of 1e-3 of dv's size where a
    # true gradient all but vanishes: with one visible token and no state, y_0 = v_0 (1 - eps/den)
    # moves with q_0 and k_0 only through eps (~1e-6), below fp32 resolution.
    dv_rows = np.linalg.norm(want[2], axis=-1)
    for name, g, g_ref in zip(("dq", "dk", "dv"), got[:3], want[:3]):
        assert np.isfinite(g).all(), f"{name} has NaN/inf"
        err = np.linalg.norm(g - g_ref) / max(np.linalg.norm(g_ref), 1e-3 * np.linalg.norm(want[2]))
        assert err < 1e-2, (name, err)
        # Each token on its own too: a wrong chunk of a long sequence would vanish in the norm.
        # Rows whose true gradient is ~0 (the first token's q and k when normalised and there is
        # no initial state) are measured against the typical row.
        row_norm = np.linalg.norm(g_ref, axis=-1)
        floor = max(0.05 * np.sqrt(np.mean(row_norm**2)), 1e-3 * np.sqrt(np.mean(dv_rows**2)))
        row_err = np.linalg.norm(g - g_ref, axis=-1) / np.maximum(row_norm, floor)
        assert np.median(row_err) < 2e-2 and np.percentile(row_err, 99) < 0.1, (name, row_err.max())
    if with_state:
        for name, g, g_ref in zip(("dS0", "dz0"), got[3], want[3]):
            assert rel_l2(g, g_ref) < 1e-2, (name, rel_l2(g, g_ref))


@pytest.mark.gpu
def test_backward_is_deterministic(hopper, rng):
    q, k, v = random_inputs(rng, 1, 777, 2, 128, jnp.bfloat16)
    dy = rng.standard_normal(v.shape).astype(np.float32)
    zero_state, zero_z = np.zeros((1, 2, F, 128), np.float32), np.zeros((1, 2, F), np.float32)
    first = kernel_grads(q, k, v, None, dy, zero_state, zero_z, normalize=True, eps=1e-6)
    second = kernel_grads(q, k, v, None, dy, zero_state, zero_z, normalize=True, eps=1e-6)
    for a, b in zip(first[:3], second[:3]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_backward_without_dq_skips_only_dq(hopper, rng):
    """with_dq=False (pass 2 of a split sequence) returns dq = 0 and the other gradients
    bit for bit as with the dq sweep, Dv = 128 (two column blocks), a tail chunk."""
    from tk_jax import _kernels

    q, k, v = (jnp.asarray(x) for x in random_inputs(rng, 2, 200, 3, 128, jnp.bfloat16))
    s0, z0 = (jnp.asarray(x) for x in random_state(rng, 2, 3, 128))
    y, _, _, den = _kernels.based_fwd(q, k, v, s0, z0, normalize=True, eps=1e-6)
    dy = jnp.asarray(rng.standard_normal(v.shape), jnp.bfloat16)
    d_state = jnp.asarray(rng.standard_normal(s0.shape), jnp.float32)
    d_z = jnp.asarray(rng.standard_normal(z0.shape), jnp.float32)
    poison_device_memory(64 << 20)
    full, no_dq = (jax.jit(lambda *xs, w=w: _kernels.based_bwd(*xs, normalize=True, eps=1e-6, with_dq=w))(
        q, k, v, y, den, dy, s0, z0, d_state, d_z) for w in (True, False))
    assert float(jnp.abs(full[0].astype(jnp.float32)).max()) > 0
    np.testing.assert_array_equal(np.asarray(no_dq[0], np.float32), 0.0)
    for a, b in zip(full[1:], no_dq[1:]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ------------------------------------------------------------------ the decode-step kernel

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("dv", [64, 128])
@pytest.mark.parametrize("normalize", [True, False])
def test_decode_kernel_matches_naive(hopper, rng, dtype, dv, normalize):
    """One step from a random state, extra leading dims, outputs poisoned: y, S', z' against
    the float64 step computed from the definitions."""
    lead, h = (2, 3), 5
    q = rng.standard_normal(lead + (h, D)).astype(dtype)
    k = rng.standard_normal(lead + (h, D)).astype(dtype)
    v = rng.standard_normal(lead + (h, dv)).astype(dtype)
    s0, z0 = random_state(rng, 6, h, dv)
    s0, z0 = s0.reshape(lead + s0.shape[1:]), z0.reshape(lead + z0.shape[1:])
    step = jax.jit(lambda *a: tk_jax.based_decode_step(a[0], a[1], a[2], (a[3], a[4]), normalize=normalize,
                                                       backend="kernel"))
    poison_device_memory(4 * (s0.nbytes + z0.nbytes))
    y, (state, z) = step(*(jnp.asarray(x) for x in (q, k, v, s0, z0)))
    phi_q, phi_k = naive_feature_map(_as64(q)), naive_feature_map(_as64(k))
    state_ref = s0 + phi_k[..., :, None] * _as64(v)[..., None, :]
    z_ref = z0 + phi_k
    y_ref = np.einsum("...f,...fv->...v", phi_q, state_ref)
    if normalize:
        y_ref = y_ref / (np.einsum("...f,...f->...", phi_q, z_ref)[..., None] + 1e-6)
    assert y.dtype == dtype and y.shape == v.shape
    assert rel_l2(_as64(y), y_ref) < 1e-2, rel_l2(_as64(y), y_ref)
    assert rel_l2(_as64(state), state_ref) < 1e-5 and rel_l2(_as64(z), z_ref) < 1e-5


@pytest.mark.gpu
def test_decode_loop_continues_prefill(hopper, rng):
    """Prefill with the sequence kernel, then a jitted loop of kernel decode steps (the state
    updated in place) reproduces the full-sequence output; the first call's inputs survive."""
    b, t, h, dv, prompt = 2, 40, 3, 64, 32
    q, k, v = random_inputs(rng, b, t, h, dv, jnp.bfloat16)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    y_full = tk_jax.based_linear_attention(q, k, v, backend="kernel")
    y_prompt, state = tk_jax.based_linear_attention(q[:, :prompt], k[:, :prompt], v[:, :prompt],
                                                    return_state=True, backend="kernel")
    state_before = np.asarray(state.S)

    @jax.jit
    def generate(state):
        def body(i, carry):
            ys, state = carry
            t_i = prompt + i
            y_t, state = tk_jax.based_decode_step(q[:, t_i], k[:, t_i], v[:, t_i], state, backend="kernel")
            return ys.at[:, i].set(y_t), state
        ys = jnp.zeros((b, t - prompt, h, dv), v.dtype)
        return jax.lax.fori_loop(0, t - prompt, body, (ys, state))

    ys, _ = generate(state)
    np.testing.assert_array_equal(np.asarray(state.S), state_before)  # not donated: untouched
    y = np.concatenate([_as64(y_prompt), _as64(ys)], axis=1)
    assert rel_l2(y, _as64(y_full)) < 1e-2, rel_l2(y, _as64(y_full))


@pytest.mark.gpu
def test_decode_kernel_gradient_is_the_references(hopper, rng):
    q = jnp.asarray(rng.standard_normal((2, 3, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.bfloat16)
    s0, z0 = random_state(rng, 2, 3, 64)

    def loss(backend):
        return lambda q: jnp.sum(tk_jax.based_decode_step(q, q, v, (s0, z0), backend=backend)[0]
                                 .astype(jnp.float32) ** 2)

    g = jax.jit(jax.grad(loss("kernel")))(q)
    g_ref = jax.jit(jax.grad(loss("reference")))(q)
    assert rel_l2(_as64(g), _as64(g_ref)) < 2e-2


@pytest.mark.gpu
def test_decode_ffi_rejects_bad_input(hopper):
    from tk_jax import _kernels

    q = jnp.zeros((2, 3, D), jnp.bfloat16)
    v = jnp.zeros((2, 3, 64), jnp.bfloat16)
    with pytest.raises(Exception, match="tk_based_decode"):
        y = _kernels.based_decode(q, q, v, jnp.zeros((2, 3, F - 1, 64)), jnp.zeros((2, 3, F)),
                                  normalize=True, eps=1e-6)[0]
        y.block_until_ready()


# ------------------------------------------------------------------ the final state under many seeds
# Seen once in an acceptance run on an H100: based_linear_attention(..., normalize=False,
# return_state=True) in fp16 (B=2, H=3, T=777, Dv=64) returned a z with an inf; a rerun with
# another seed was clean. B * H = 6 blocks at T = 777 does not take the sequence split (too short
# for 4 groups of 256 tokens), so z came from one forward launch. These runs repeat that case and
# its neighbours under fresh seeds; scripts/based_state_check.py runs the same check many more
# times and under compute-sanitizer.

def fast_naive(q, k, v, s0, z0, *, normalize, eps):
    """float64 (y, S, z, den) with BLAS matmuls (the quadratic form of naive_based, fast enough
    for many seeds); s0/z0 may be None. den is the normaliser without eps, [B, H, T]."""
    # [B, H, T, X], contiguous: numpy's batched matmul only calls BLAS on contiguous operands.
    q, k, v = (np.ascontiguousarray(np.asarray(x, np.float64).transpose(0, 2, 1, 3)) for x in (q, k, v))
    s = q @ np.ascontiguousarray(k.swapaxes(-1, -2)) / 4.0
    weights = np.tril(1 + s + s * s / 2)
    num, den = weights @ v, weights.sum(-1)
    phi_k = naive_feature_map(k)
    state, z = np.ascontiguousarray(phi_k.swapaxes(-1, -2)) @ v, phi_k.sum(-2)
    if s0 is not None:
        phi_q = naive_feature_map(q)
        num, den = num + phi_q @ s0, den + (phi_q @ z0[..., None])[..., 0]
        state, z = state + s0, z + z0
    y = num / (den[..., None] + eps) if normalize else num
    return y.transpose(0, 2, 1, 3), state, z, den


def state_problems(label, got, want):
    """What is wrong with the outputs `got` against `want` (dicts y, S, z and maybe den), as
    sentences: a non-finite entry anywhere, or an error over the tolerances of check_outputs."""
    problems = []
    for name, x in got.items():
        bad = ~np.isfinite(x)
        if bad.any():
            where = np.argwhere(bad)[:3].tolist()
            problems.append(f"{label}: {name} has {int(bad.sum())} non-finite entries, first at {where}")
    if problems:
        return problems
    # z is summed exactly in fp32 from the keys; den sums 16-bit rounded weights and phi(q) . z
    # from q in bf16.
    tolerances = {"y": 1e-2, "S": 1e-2, "z": 1e-4, "den": 1e-2}
    for name, x in got.items():
        err = rel_l2(x, want[name])
        if err >= tolerances[name]:
            problems.append(f"{label}: {name} rel. error {err:.2e}")
    if "y" in got:
        y, y_ref = got["y"], want["y"]
        row_err = np.linalg.norm(y - y_ref, axis=-1) / np.maximum(np.linalg.norm(y_ref, axis=-1), 1e-6)
        if row_err.max() >= 3e-2:
            worst = np.unravel_index(np.argmax(row_err), row_err.shape)
            problems.append(f"{label}: y row (b, t, h) {worst} rel. error {row_err.max():.2e}")
    return problems


STATE_SEEDS = 3  # per case below (the whole section takes ~20 s on an H100); the script runs more


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("normalize", [False, True])
def test_forward_kernel_state_is_finite_under_many_seeds(hopper, dtype, normalize):
    """The forward kernel alone around T = 777 (B=2, H=3, Dv=64), outputs poisoned before each
    launch, with and without an initial state: y, S, z and den finite and right, every seed."""
    from tk_jax import _kernels

    b, h, dv = 2, 3, 64
    problems = []
    for t in (776, 777, 778, 833):
        fn = jax.jit(lambda *xs: _kernels.based_fwd(*xs, normalize=normalize, eps=1e-6))
        for with_state in (False, True):
            for _ in range(STATE_SEEDS):
                seed = int(np.random.SeedSequence().entropy % 2**32)
                rng = np.random.default_rng(seed)
                q, k, v = random_inputs(rng, b, t, h, dv, dtype)
                if with_state:
                    s0, z0 = random_state(rng, b, h, dv)
                else:
                    s0, z0 = np.zeros((b, h, F, dv), np.float32), np.zeros((b, h, F), np.float32)
                poison_device_memory(4 * (v.nbytes + s0.nbytes + z0.nbytes))
                y, state, z, den = fn(*(jnp.asarray(x) for x in (q, k, v, s0, z0)))
                y_ref, s_ref, z_ref, den_ref = fast_naive(_as64(q), _as64(k), _as64(v), s0 if with_state else None,
                                                          z0 if with_state else None, normalize=normalize, eps=1e-6)
                label = f"T={t} state={with_state} seed={seed}"
                problems += state_problems(label, {"y": _as64(y), "S": _as64(state), "z": _as64(z), "den": _as64(den)},
                                           {"y": y_ref, "S": s_ref, "z": z_ref, "den": den_ref})
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["unsplit", "split"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_public_api_state_is_finite_under_many_seeds(hopper, monkeypatch, split, dtype):
    """based_linear_attention on the kernel backend at B=2, H=3, T=777, Dv=64 (the case seen
    once with an inf in z), normalised or not, with return_state (with and without an initial
    state) and without it; "split" forces the sequence split into 4 groups (777 tokens padded
    to 1024, the pad taken off z's constant feature). The seen case gets the most seeds."""
    from tk_jax import _sequence_split

    if split == "split":
        monkeypatch.setattr(_sequence_split, "num_groups", lambda *args: 4)
    b, t, h, dv = 2, 777, 3, 64
    problems = []
    for normalize in (False, True):
        for return_state in (True, False):
            run = jax.jit(lambda q, k, v, state, n=normalize, r=return_state: tk_jax.based_linear_attention(
                q, k, v, normalize=n, initial_state=state, return_state=r, backend="kernel"))
            for with_state in (False, True) if return_state else (False,):
                seen_case = dtype == jnp.float16 and not normalize and return_state and not with_state
                for _ in range(6 * STATE_SEEDS if seen_case else STATE_SEEDS):
                    seed = int(np.random.SeedSequence().entropy % 2**32)
                    rng = np.random.default_rng(seed)
                    q, k, v = random_inputs(rng, b, t, h, dv, dtype)
                    state0 = random_state(rng, b, h, dv) if with_state else None
                    poison_device_memory(8 * v.nbytes + 4 * b * h * F * (dv + 1))
                    out = run(*(jnp.asarray(x) for x in (q, k, v)),
                              None if state0 is None else tuple(map(jnp.asarray, state0)))
                    y_ref, s_ref, z_ref, _ = fast_naive(_as64(q), _as64(k), _as64(v),
                                                        *(state0 if with_state else (None, None)),
                                                        normalize=normalize, eps=1e-6)
                    got = {"y": _as64(out[0] if return_state else out)}
                    if return_state:
                        got["S"], got["z"] = _as64(out[1].S), _as64(out[1].z)
                    label = (f"{split} normalize={normalize} return_state={return_state} state={with_state} "
                             f"seed={seed}")
                    problems += state_problems(label, got, {"y": y_ref, "S": s_ref, "z": z_ref})
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
def test_public_api_natural_split_state_is_finite(hopper, rng):
    """One (batch, head) of 2100 tokens takes the split by itself (8 groups on an H100's SMs,
    counted by the extension): y, S, z finite and right."""
    from tk_jax import _kernels, _sequence_split

    b, t, h, dv = 1, 2100, 1, 64
    assert _sequence_split.num_groups(b, h, dv, t, _kernels.multiprocessor_count()) > 1
    run = jax.jit(lambda q, k, v: tk_jax.based_linear_attention(q, k, v, normalize=False, return_state=True,
                                                                backend="kernel"))
    problems = []
    for i in range(STATE_SEEDS):
        q, k, v = random_inputs(rng, b, t, h, dv, jnp.float16)
        poison_device_memory(8 * v.nbytes + 4 * F * (dv + 1))
        y, (state, z) = run(*(jnp.asarray(x) for x in (q, k, v)))
        y_ref, s_ref, z_ref, _ = fast_naive(_as64(q), _as64(k), _as64(v), None, None, normalize=False, eps=1e-6)
        problems += state_problems(f"draw {i}", {"y": _as64(y), "S": _as64(state), "z": _as64(z)},
                                   {"y": y_ref, "S": s_ref, "z": z_ref})
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
def test_multiprocessor_count_is_the_devices(hopper):
    """The extension's count (cudaDeviceGetAttribute) agrees with what jax reports, where it does."""
    from tk_jax import _kernels

    count = _kernels.multiprocessor_count()
    assert count > 0
    jax_count = getattr(jax.local_devices()[0], "core_count", None)
    if jax_count:
        assert count == jax_count


# ------------------------------------------------------------------ which inputs the kernel takes (CPU)

def test_kernel_support_rules(monkeypatch):
    """The rules, from the extension's conventions (the kernel_path fixture's stand-in where the
    extension is not built)."""
    from conftest import BASED_CONVENTIONS_STAND_IN
    from tk_jax import _kernels

    conventions = _kernels.based_conventions() or BASED_CONVENTIONS_STAND_IN
    monkeypatch.setattr(_kernels, "based_conventions", lambda: conventions)

    def why(q_shape, v_dim, dtype=jnp.bfloat16):
        q = jax.ShapeDtypeStruct(q_shape, dtype)
        v = jax.ShapeDtypeStruct(q_shape[:-1] + (v_dim,), dtype)
        return _kernels.based_kernel_unsupported(q, q, v)

    assert why((2, 100, 3, D), 64) is None
    assert why((2, 1, 3, D), 128, jnp.float16) is None
    assert "value dim" in why((2, 100, 3, D), 96)
    assert "bf16 or fp16" in why((2, 100, 3, D), 64, jnp.float32)
    assert "at least one token" in why((2, 0, 3, D), 64)
    assert "feature dim" in why((2, 100, 3, 32), 64)
