"""Public Based API (tk_jax.linear_attention): checks, backend choice, state passing, custom_vjp
gradients, jit/vmap/grad. The float64 naive lives in test_based_reference.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_based_reference import (D, fresh_seed, naive_based, random_inputs, random_state,
                                  rel_l2)
from tk_jax.linear_attention import (NUM_FEATURES, BasedState, based_decode_step,
                                     based_linear_attention)

OP = "based_linear_attention"


def test_auto_backend_runs_reference_on_cpu_and_matches_naive():
    seed = fresh_seed()
    q, k, v = random_inputs(seed, batch=2, seq_len=33, heads=3, value_dim=24,
                            dtype=jnp.bfloat16)
    y = based_linear_attention(q, k, v)
    y_ref_backend = based_linear_attention(q, k, v, backend="reference")
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref_backend, np.float32))
    y_naive, _ = naive_based(q, k, v, normalize=True, eps=1e-6)
    assert y.dtype == jnp.bfloat16 and rel_l2(y, y_naive) < 1e-2, f"seed {seed}"


def test_fp16_and_extra_leading_dims_are_folded():
    seed = fresh_seed()
    q, k, v = random_inputs(seed, batch=6, seq_len=20, heads=2, value_dim=8, dtype=jnp.float16)
    state0 = random_state(seed + 1, batch=6, heads=2, value_dim=8)
    unfold = lambda x: x.reshape((2, 3) + x.shape[1:])
    y, state = based_linear_attention(unfold(q), unfold(k), unfold(v), normalize=False,
                                      initial_state=tuple(map(unfold, state0)),
                                      return_state=True)
    assert y.shape == (2, 3, 20, 2, 8) and y.dtype == jnp.float16
    assert isinstance(state, BasedState)
    assert state.S.shape == (2, 3, 2, NUM_FEATURES, 8) and state.z.shape == (2, 3, 2, NUM_FEATURES)
    y_ref, (s_ref, z_ref) = naive_based(q, k, v, normalize=False, eps=1e-6, initial_state=state0)
    assert rel_l2(y.reshape(v.shape), y_ref) < 1e-2, f"seed {seed}"
    assert rel_l2(state.S.reshape(s_ref.shape), s_ref) < 1e-4
    assert rel_l2(state.z.reshape(z_ref.shape), z_ref) < 1e-4


def test_prefill_in_pieces_then_decode_reproduces_full_sequence():
    seq_len = 150
    q, k, v = random_inputs(fresh_seed(), batch=2, seq_len=seq_len, heads=2, value_dim=64,
                            dtype=jnp.float32)
    y_full, (s_full, z_full) = naive_based(q, k, v, normalize=True, eps=1e-6)

    prefill = jax.jit(based_linear_attention, static_argnames=("return_state",))
    y1, state = prefill(q[:, :37], k[:, :37], v[:, :37], return_state=True)
    y2, state = prefill(q[:, 37:131], k[:, 37:131], v[:, 37:131], initial_state=state,
                        return_state=True)
    decode = jax.jit(based_decode_step)
    pieces = [y1, y2]
    for t in range(131, seq_len):
        y_t, state = decode(q[:, t], k[:, t], v[:, t], state)
        pieces.append(y_t[:, None])
    assert rel_l2(jnp.concatenate(pieces, axis=1), y_full) < 1e-5
    assert rel_l2(state.S, s_full) < 1e-5 and rel_l2(state.z, z_full) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)])
def test_custom_vjp_gradients_match_naive(dtype, tol):
    """Gradients through the public function (custom_vjp) for q, k, v and initial_state,
    with cotangents on the output and on the returned state."""
    seed = fresh_seed()
    q, k, v = random_inputs(seed, batch=1, seq_len=70, heads=2, value_dim=16, dtype=dtype)
    state0 = random_state(seed + 1, batch=1, heads=2, value_dim=16)
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal(v.shape)
    ds = rng.standard_normal(state0[0].shape) * 1e-2
    dz = rng.standard_normal(state0[1].shape) * 1e-2

    def loss_api(q, k, v, state):
        y, (s, z) = based_linear_attention(q, k, v, initial_state=state, return_state=True)
        return ((y.astype(jnp.float32) * dy).sum() + (s * ds).sum() + (z * dz).sum())

    def loss_naive(q, k, v, state):
        y, (s, z) = naive_based(q, k, v, normalize=True, eps=1e-6, initial_state=state, xp=jnp)
        return (y * dy).sum() + (s * ds).sum() + (z * dz).sum()

    grads = jax.jit(jax.grad(loss_api, argnums=(0, 1, 2, 3)))(q, k, v, state0)
    assert [g.dtype for g in grads[:3]] == [dtype] * 3
    with jax.enable_x64(True):
        as64 = lambda x: jnp.asarray(x, jnp.float64)
        grads_ref = jax.jit(jax.grad(loss_naive, argnums=(0, 1, 2, 3)))(
            *map(as64, (q, k, v)), jax.tree.map(as64, state0))
    for name, g, g_ref in zip(["dq", "dk", "dv", "dS0", "dz0"], jax.tree.leaves(grads),
                              jax.tree.leaves(grads_ref)):
        assert rel_l2(g, g_ref) < tol, f"{name} (seed {seed})"


def test_vmap_and_grad_compose():
    q, k, v = random_inputs(fresh_seed(), batch=4, seq_len=18, heads=2, value_dim=8,
                            dtype=jnp.float32)
    split = lambda x: x.reshape((2, 2) + x.shape[1:])
    # vmap over a leading axis equals folding that axis into the batch.
    y_vmapped = jax.vmap(based_linear_attention)(split(q), split(k), split(v))
    y_folded = based_linear_attention(split(q), split(k), split(v))
    assert rel_l2(y_vmapped, y_folded) < 1e-6
    # grad of vmap (the custom_vjp under a batching trace) equals grad of the folded call.
    loss = lambda f: lambda q: (f(q, split(k), split(v)) ** 2).sum()
    g_vmapped = jax.jit(jax.grad(loss(jax.vmap(based_linear_attention))))(split(q))
    g_folded = jax.jit(jax.grad(loss(based_linear_attention)))(split(q))
    assert rel_l2(g_vmapped, g_folded) < 1e-5 and np.isfinite(np.asarray(g_folded)).all()


def test_decode_step_under_vmap():
    q, k, v = random_inputs(fresh_seed(), batch=3, seq_len=1, heads=2, value_dim=8,
                            dtype=jnp.float32)
    state = random_state(fresh_seed(), batch=3, heads=2, value_dim=8)
    y, new_state = based_decode_step(q[:, 0], k[:, 0], v[:, 0], state)
    y_vmapped, _ = jax.vmap(based_decode_step)(q[:, 0], k[:, 0], v[:, 0], state)
    y_naive, (s_naive, _) = naive_based(q, k, v, normalize=True, eps=1e-6, initial_state=state)
    assert rel_l2(y, y_naive[:, 0]) < 1e-5 and rel_l2(new_state.S, s_naive) < 1e-5
    assert rel_l2(y_vmapped, y) < 1e-6


# ------------------------------------------------------------------ backend choice

def test_backend_kernel_is_refused_clearly():
    q, k, v = random_inputs(0, batch=1, seq_len=4, heads=1, value_dim=8, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="backend='kernel'"):
        based_linear_attention(q, k, v, backend="kernel")


def test_unknown_backend_is_refused():
    q, k, v = random_inputs(0, batch=1, seq_len=4, heads=1, value_dim=8, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="backend='triton'"):
        based_linear_attention(q, k, v, backend="triton")


# ------------------------------------------------------------------ input checks

def _inputs(**overrides):
    shapes = {"q": (2, 5, 3, D), "k": (2, 5, 3, D), "v": (2, 5, 3, 8)}
    arrays = {name: jnp.zeros(shape, jnp.bfloat16) for name, shape in shapes.items()}
    arrays.update(overrides)
    return arrays


@pytest.mark.parametrize("overrides,error,pattern", [
    ({"q": jnp.zeros((2, 5, 3, 32), jnp.bfloat16)}, ValueError, r"q must have feature dim .*16"),
    ({"k": jnp.zeros((2, 5, 3, 8), jnp.bfloat16)}, ValueError, r"k must have feature dim .*16"),
    ({"q": jnp.zeros((5, 3, D), jnp.bfloat16)}, ValueError, r"q must have at least 4 dim"),
    ({"v": jnp.zeros((2, 6, 3, 8), jnp.bfloat16)}, ValueError, r"q, k, v.*\(2, 6, 3\)"),
    ({"k": jnp.zeros((2, 5, 4, D), jnp.bfloat16)}, ValueError, r"q, k, v"),
    ({"v": jnp.zeros((2, 5, 3, 8), jnp.float32)}, ValueError, r"dtypes.*float32"),
    ({"q": jnp.zeros((2, 5, 3, D), jnp.int32)}, TypeError, r"q has dtype int32"),
    ({"v": [[1.0]]}, TypeError, r"v must be an array"),
])
def test_bad_arrays_name_the_argument(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        based_linear_attention(**_inputs(**overrides))


@pytest.mark.parametrize("kwargs,error,pattern", [
    ({"eps": -1e-3}, ValueError, r"eps must be finite and >= 0, got -0.001"),
    ({"eps": float("nan")}, ValueError, r"eps must be finite"),
    ({"eps": "small"}, TypeError, r"eps must be a Python number"),
    ({"normalize": "yes"}, TypeError, r"normalize must be True or False"),
    ({"return_state": 1}, TypeError, r"return_state must be True or False"),
    ({"initial_state": jnp.zeros((2, 3, NUM_FEATURES, 8))}, TypeError, r"initial_state must be"),
    ({"initial_state": (jnp.zeros((2, 3, NUM_FEATURES, 9)), jnp.zeros((2, 3, NUM_FEATURES)))},
     ValueError, r"initial_state\[0\] \(S\) must have shape \(2, 3, 273, 8\)"),
    ({"initial_state": (jnp.zeros((2, 3, NUM_FEATURES, 8)), jnp.zeros((2, 3, 17)))},
     ValueError, r"initial_state\[1\] \(z\) must have shape \(2, 3, 273\)"),
    ({"initial_state": (jnp.zeros((2, 3, NUM_FEATURES, 8), jnp.bfloat16),
                        jnp.zeros((2, 3, NUM_FEATURES)))},
     TypeError, r"initial_state\[0\] \(S\) has dtype bfloat16"),
])
def test_bad_options_name_the_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        based_linear_attention(**_inputs(), **kwargs)


def test_decode_step_checks_name_the_argument():
    q_t = jnp.zeros((2, 3, D))
    v_t = jnp.zeros((2, 3, 8))
    state = (jnp.zeros((2, 3, NUM_FEATURES, 8)), jnp.zeros((2, 3, NUM_FEATURES)))
    with pytest.raises(ValueError, match="q_t must have feature dim"):
        based_decode_step(jnp.zeros((2, 3, 8)), q_t, v_t, state)
    with pytest.raises(ValueError, match=r"state\[0\] \(S\) must have shape \(2, 3, 273, 8\)"):
        based_decode_step(q_t, q_t, v_t, (state[0][..., :4], state[1]))
    with pytest.raises(ValueError, match="eps must be finite"):
        based_decode_step(q_t, q_t, v_t, state, eps=float("inf"))


# ------------------------------------------------------------------ sequence split (kernel route)

def test_sequence_split_choice(kernel_path):
    """Blocks are counted per 64 value columns (the kernels' column block)."""
    from tk_jax._sequence_split import num_groups

    assert num_groups(16, 16, 64, 8192, 132) == 1      # 256 blocks already fill the GPU
    assert num_groups(1, 16, 64, 65536, 132) == 8      # 16 blocks -> 128
    assert num_groups(1, 8, 128, 65536, 132) == 8      # Dv = 128: two blocks per head
    assert num_groups(4, 16, 64, 65536, 132) == 1      # 64 blocks: a split of 2 cannot pay
    assert num_groups(1, 1, 64, 1000, 132) == 1        # too short for >= 4 groups of 256
    assert num_groups(1, 1, 64, 2048, 132) == 8      # groups of 256 tokens
    assert num_groups(2, 3, 64, 777, 132) == 1       # 6 blocks, but too short for 4 groups


@pytest.mark.parametrize("normalize", [True, False])
def test_sequence_split_matches_reference(kernel_path, monkeypatch, normalize):
    """The kernel route with the sequence cut into 4 groups (padded from 300 to 512 tokens),
    kernels replaced by reference stand-ins: outputs, final state and all gradients equal the
    unsplit reference."""
    from tk_jax import _sequence_split

    monkeypatch.setattr(_sequence_split, "num_groups", lambda *args: 4)
    seed = fresh_seed()
    q, k, v = random_inputs(seed, batch=2, seq_len=300, heads=2, value_dim=8, dtype=jnp.float32)
    state0 = random_state(seed + 1, batch=2, heads=2, value_dim=8)
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal(v.shape).astype(np.float32)
    ds = 1e-2 * rng.standard_normal((2, 2, NUM_FEATURES, 8)).astype(np.float32)
    dz = 1e-2 * rng.standard_normal((2, 2, NUM_FEATURES)).astype(np.float32)

    def run(backend):
        def loss(q, k, v, state):
            y, (s, z) = based_linear_attention(q, k, v, normalize=normalize, initial_state=state,
                                               return_state=True, backend=backend)
            return (y * dy).sum() + (s * ds).sum() + (z * dz).sum(), (y, s, z)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, state0)

    (_, outs), grads = run(kernel_path)
    (_, outs_ref), grads_ref = run("reference")
    for name, a, b in zip(["y", "S", "z", "dq", "dk", "dv", "dS0", "dz0"],
                          list(outs) + jax.tree.leaves(grads), list(outs_ref) + jax.tree.leaves(grads_ref)):
        assert rel_l2(a, b) < 1e-5, f"{name} (seed {seed}): {rel_l2(a, b)}"


# ------------------------------------------------------------------ the kernels' conventions

def test_kernel_path_stand_ins_match_the_extension():
    """The conventions the kernel_path fixture gives an unbuilt machine are the extension's
    (cpp/kernels/based/based.h), wherever the extension is built."""
    from conftest import BASED_CONVENTIONS_STAND_IN
    from tk_jax import _kernels

    conventions = _kernels.based_conventions()
    if conventions is None:
        pytest.skip("tk_jax._tk is not built: no conventions to compare the stand-in with")
    assert dict(conventions) == BASED_CONVENTIONS_STAND_IN


def test_without_the_extension_the_kernel_is_unsupported_not_an_error(monkeypatch):
    """Where tk_jax._tk is not built the support checks give a reason (and "auto" runs the
    reference); they never raise."""
    from tk_jax import _kernels

    monkeypatch.setattr(_kernels, "based_conventions", lambda: None)
    q = jnp.zeros((1, 8, 2, D), jnp.bfloat16)
    v = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    assert "not built" in _kernels.based_kernel_unsupported(q, q, v)
    assert "not built" in _kernels.based_decode_unsupported(q[:, 0], v[:, 0])
    y = based_linear_attention(q, q, v)
    assert y.shape == v.shape and bool(jnp.isfinite(y.astype(jnp.float32)).all())
