"""The attention backward in three calls (tk_jax/_kernels.py: row statistics, a call per block
of keys adding into one dQ state, dq out) against the float64 reference on the GPU: the keys
split in two blocks, the state's rows held with their halves exchanged (as the ring holds
them), so that calls land on it unshifted, shifted by half and wrapped around. Outputs
poisoned before each launch."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_util import poison_device_memory
from naive import naive_attention_grads

pytestmark = pytest.mark.gpu


def _swap(x, axis):
    half = x.shape[axis] // 2
    return jnp.concatenate([jax.lax.slice_in_dim(x, half, x.shape[axis], axis=axis),
                            jax.lax.slice_in_dim(x, 0, half, axis=axis)], axis=axis)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("t, hq, hkv, with_dlse", [(256, 2, 2, False), (384, 4, 1, True), (128, 8, 2, False)])
def test_backward_summed_over_key_blocks_in_one_state(hopper, rng, dtype, d, t, hq, hkv, with_dlse):
    from tk_jax import _kernels

    b, half, cut = 2, t // 2, t // 2 + 16  # keys [0, cut) and [cut, t)
    q, k, v, do = (rng.standard_normal(s).astype(dtype)
                   for s in ((b, t, hq, d), (b, t, hkv, d), (b, t, hkv, d), (b, t, hq, d)))
    dlse = rng.standard_normal((b, hq, t)).astype(np.float32) if with_dlse else None
    scale = 1 / math.sqrt(d)
    window = dict(window_left=-1, window_right=-1)

    @jax.jit
    def grads(q, k, v, do, dlse):
        o, lse = _kernels.attention_fwd(q, k, v, scale=scale, **window)
        # The state counts rows with the halves exchanged: state row r is row (r + t/2) mod t.
        state = _kernels.attention_bwd_row_stats(_swap(o, 1), _swap(lse, 2), _swap(do, 1),
                                                 None if dlse is None else _swap(dlse, 2), scale=scale)
        keys = dict(dq_rows=t, scale=scale, **window)
        # All rows in their own order against the first keys: row i at state row i + t/2 (wrapping).
        state, dk1, dv1 = _kernels.attention_bwd_keys(state, q, k[:, :cut], v[:, :cut], do,
                                                      dq_row_shift=half, **keys)
        # The second keys in two calls on the exchanged rows: their halves, unshifted and shifted.
        qs, dos = _swap(q, 1), _swap(do, 1)
        state, dk2, dv2 = _kernels.attention_bwd_keys(state, qs[:, :half], k[:, cut:], v[:, cut:],
                                                      dos[:, :half], dq_row_shift=0, **keys)
        state, dk3, dv3 = _kernels.attention_bwd_keys(state, qs[:, half:], k[:, cut:], v[:, cut:],
                                                      dos[:, half:], dq_row_shift=half, **keys)
        dq = _swap(_kernels.attention_bwd_dq(state, q), 1)
        dk = jnp.concatenate([dk1.astype(jnp.float32), dk2.astype(jnp.float32) + dk3], axis=1)
        dv = jnp.concatenate([dv1.astype(jnp.float32), dv2.astype(jnp.float32) + dv3], axis=1)
        return dq, dk, dv

    poison_device_memory(8 * (q.nbytes + 2 * k.nbytes))
    got = grads(*(jnp.asarray(x) for x in (q, k, v, do)), None if dlse is None else jnp.asarray(dlse))
    ref = naive_attention_grads(*(x.astype(np.float64) for x in (q, k, v, do)), scale, -1, -1,
                                dlse=None if dlse is None else dlse.astype(np.float64))
    for name, g, want in zip(("dq", "dk", "dv"), got, ref):
        g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
        assert np.isfinite(g).all(), f"{name} has NaN/inf"
        err = np.linalg.norm(g - want) / np.linalg.norm(want)
        assert err < 1e-2, (name, err)


def test_a_call_on_part_of_the_rows_needs_whole_tiles(hopper, rng):
    """The C++ side refuses rows or shifts that are not whole 64-row tiles of the state."""
    from tk_jax import _kernels

    t, d = 256, 64
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                   for s in ((1, t, 2, d), (1, t, 2, d), (1, t, 2, d), (1, t, 2, d)))
    o, lse = _kernels.attention_fwd(q, k, v, scale=0.1, window_left=-1, window_right=-1)
    state = _kernels.attention_bwd_row_stats(o, lse, do, scale=0.1)
    for rows, shift in ((100, 0), (128, 32)):
        with pytest.raises(Exception, match="multiples of 64"):
            _kernels.attention_bwd_keys(state, q[:, :rows], k, v, do[:, :rows], dq_rows=t,
                                        dq_row_shift=shift, scale=0.1, window_left=-1,
                                        window_right=-1)[0].block_until_ready()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_rows_no_call_reaches_give_zero_dq(hopper, rng, dtype, d):
    """A call on the first rows of the dQ state leaves the other rows' tiles unwritten: dq is
    zero there whatever the memory held before (poisoned with NaN), and right on the rows the
    call covered (dk, dv summed over those rows only)."""
    from tk_jax import _kernels

    b, t, hq, hkv, half = 2, 320, 4, 2, 192
    q, k, v, do = (rng.standard_normal(s).astype(dtype)
                   for s in ((b, t, hq, d), (b, t, hkv, d), (b, t, hkv, d), (b, t, hq, d)))
    scale = 1 / math.sqrt(d)
    window = dict(window_left=-1, window_right=-1)

    @jax.jit
    def grads(q, k, v, do):
        o, lse = _kernels.attention_fwd(q, k, v, scale=scale, **window)
        state = _kernels.attention_bwd_row_stats(o, lse, do, scale=scale)
        state, dk, dv = _kernels.attention_bwd_keys(state, q[:, :half], k, v, do[:, :half], dq_rows=t,
                                                    dq_row_shift=0, scale=scale, **window)
        return _kernels.attention_bwd_dq(state, q), dk, dv

    poison_device_memory(8 * (q.nbytes + 2 * k.nbytes))
    dq, dk, dv = (np.asarray(jnp.asarray(x, jnp.float32), np.float64)
                  for x in grads(*(jnp.asarray(x) for x in (q, k, v, do))))
    assert (dq[:, half:] == 0).all(), "rows no call reached must have dq = 0"
    ref = naive_attention_grads(q[:, :half].astype(np.float64), k.astype(np.float64),
                                v.astype(np.float64), do[:, :half].astype(np.float64), scale, -1, -1)
    for name, g, want in zip(("dq", "dk", "dv"), (dq[:, :half], dk, dv), ref):
        assert np.isfinite(g).all(), f"{name} has NaN/inf"
        err = np.linalg.norm(g - want) / np.linalg.norm(want)
        assert err < 1e-2, (name, err)
