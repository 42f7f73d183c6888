"""Multi-device attention on 8 CPU host devices (tests/conftest.py): sharded jit, shard_map,
and pmap, each against unsharded flash_attention (forward and gradients). Context parallelism
(ring attention, a sequence-sharded flash_attention) is tested in test_context_parallel.py.

The CUDA kernels cannot run here, so "kernel path" tests use the kernel_path fixture
(tests/conftest.py), which swaps tk_jax._kernels for functions that run the reference:
flash_attention then takes exactly the route it takes on a GPU (the partitioning rule of
tk_jax/_partitioning.py around the kernel calls), only the innermost function differs. HLO
checks read the compiled program's text for collectives.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tk_jax
import tk_jax._backend

try:  # tests/ as a package, or tests/ on sys.path
    from tests.naive import relative_l2
    from tests.sharding_util import collectives, output_and_grads
except ImportError:
    from naive import relative_l2
    from sharding_util import collectives, output_and_grads

TOL = 2e-5  # float32, sharded vs unsharded: only the order of additions differs


# ----------------------------------------------------------------------------------------------
# Helpers


def mesh_of(shape, names, devices=None):
    devices = jax.devices() if devices is None else devices
    return Mesh(np.array(devices[:int(np.prod(shape))]).reshape(shape), names)


def random_arrays(rng, *shapes, dtype=jnp.float32):
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def assert_close(actual, expected, what, tol=TOL, atol=0.0):
    """Relative L2 error under tol, or an absolute one (L2) within atol: a result that is zero
    but for float32 rounding (a gradient no row's loss depends on) has no relative scale."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    if np.linalg.norm(actual.astype(np.float64) - expected) <= atol:
        return
    err = relative_l2(actual, expected)
    assert err < tol, f"{what}: relative L2 error {err:.3g} >= {tol}"


def expected_result(attend, q, k, v, do):
    """o and grads of `attend` (a flash_attention partial) with the reference, unsharded."""
    return jax.jit(output_and_grads(functools.partial(attend, backend="reference")))(q, k, v, do)


def assert_all_close(actual, expected, tol=TOL):
    """o and the gradients, each within tol (relative); one whose reference is zero but for
    rounding (masks can leave every visible row with a single key: dq and dk vanish) within
    float32 rounding of the largest result's size instead."""
    (o, grads), (o_ref, grads_ref) = actual, expected
    scale = max(float(np.linalg.norm(np.asarray(x, np.float64))) for x in (o_ref, *grads_ref))
    atol = 1e-6 * scale
    assert_close(o, o_ref, "o", tol, atol)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(g, g_ref, name, tol, atol)


# ----------------------------------------------------------------------------------------------
# 1. Sharded jit over batch and heads: no collective, same result.
# Each case: mesh shape, Hq, Hkv, spec of q (and o, do), spec of k and v.

MESH_2x4 = ((2, 4), ("data", "model"))
BATCH_HEAD_CASES = {
    "batch": (MESH_2x4, 4, 4, P(("data", "model")), P(("data", "model"))),
    "heads": (MESH_2x4, 8, 8, P(None, None, ("data", "model")), P(None, None, ("data", "model"))),
    "batch+heads, GQA": (MESH_2x4, 8, 4, P("data", None, "model"), P("data", None, "model")),
    # kv heads fewer than the head shards: K/V stay whole, each device picks its kv head
    "GQA, one kv head per device": (MESH_2x4, 8, 2, P("data", None, "model"), P("data")),
    # 3 head shards, 6 query heads over 2 kv heads: devices need different kv heads per q head
    "GQA, kv head per query head": (((2, 3), ("data", "model")), 6, 2,
                                    P("data", None, "model"), P("data")),
}
KV_PICK_CASES = {"GQA, one kv head per device", "GQA, kv head per query head"}


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("case", list(BATCH_HEAD_CASES))
def test_sharded_jit_over_batch_and_heads_has_no_collectives(request, rng, case, path):
    (mesh_shape, axis_names), hq, hkv, q_spec, kv_spec = BATCH_HEAD_CASES[case]
    backend = request.getfixturevalue("kernel_path") if path == "kernel" else "reference"
    mesh = mesh_of(mesh_shape, axis_names)
    batch, seq, dim = 8, 11, 16
    q, k, v, do = random_arrays(rng, (batch, seq, hq, dim), (batch, seq, hkv, dim),
                                (batch, seq, hkv, dim), (batch, seq, hq, dim))
    attend = functools.partial(tk_jax.flash_attention, causal=True, backend=backend)
    expected = expected_result(attend, q, k, v, do)

    q_sharding, kv_sharding = NamedSharding(mesh, q_spec), NamedSharding(mesh, kv_spec)
    args = (jax.device_put(q, q_sharding), jax.device_put(k, kv_sharding),
            jax.device_put(v, kv_sharding), jax.device_put(do, q_sharding))
    compiled = jax.jit(output_and_grads(attend)).lower(*args).compile()
    found = collectives(compiled.as_text())
    if case in KV_PICK_CASES:
        # Only the kernel path has the rule that picks kv heads per device; XLA's own split of
        # the plain reference may gather K/V here (correct, just not free), so it is only
        # checked for its values. The gradient of K/V that every head shard reads sums over
        # the shards: an all-reduce is inherent. The forward alone needs nothing.
        if path == "kernel":
            assert found <= {"all-reduce"}, found
            forward = jax.jit(attend).lower(*args[:3]).compile()
            assert not collectives(forward.as_text())
    else:
        assert not found, f"collectives in the sharded program: {found}"
    assert_all_close(compiled(*args), expected)


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_based_sharded_jit_has_no_collectives(request, rng, path):
    if path == "kernel":
        request.getfixturevalue("kernel_path")
    mesh = mesh_of((2, 4), ("data", "model"))
    q, k, v = random_arrays(rng, (4, 8, 8, 16), (4, 8, 8, 16), (4, 8, 8, 4))
    spec = NamedSharding(mesh, P("data", None, "model"))

    def output_and_grad(q, k, v):
        attend = functools.partial(tk_jax.based_linear_attention, backend=path)
        return attend(q, k, v), jax.grad(lambda q: jnp.sum(attend(q, k, v) ** 2))(q)

    args = [jax.device_put(x, spec) for x in (q, k, v)]
    compiled = jax.jit(output_and_grad).lower(*args).compile()
    assert not collectives(compiled.as_text())
    for actual, expected in zip(compiled(*args), jax.jit(output_and_grad)(q, k, v)):
        assert_close(actual, expected, "based", tol=1e-5)


def test_kernel_path_under_vmap(kernel_path, rng):
    """custom_partitioning has no vmap rule; the wrapper folds vmapped axes into the batch."""
    q, k, v, do = random_arrays(rng, (3, 2, 7, 4, 8), (3, 2, 9, 2, 8), (3, 2, 9, 2, 8),
                                (3, 2, 7, 4, 8))
    attend = functools.partial(tk_jax.flash_attention, window_size=(3, 1))
    expected = expected_result(attend, q, k, v, do)
    run = jax.jit(jax.vmap(output_and_grads(functools.partial(attend, backend=kernel_path))))
    assert_all_close(run(q, k, v, do), expected)
    # Only q mapped: k and v are broadcast over the mapped axis.
    o = jax.vmap(functools.partial(attend, backend=kernel_path), in_axes=(0, None, None))(
        q, k[0], v[0])
    o_ref = attend(q, jnp.broadcast_to(k[0], k.shape), jnp.broadcast_to(v[0], v.shape),
                   backend="reference")
    assert_close(o, o_ref, "o (only q mapped)")


# ----------------------------------------------------------------------------------------------
# 2. shard_map and pmap: flash_attention on local shards, forward and backward.


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_flash_attention_inside_shard_map(request, rng, path):
    backend = request.getfixturevalue("kernel_path") if path == "kernel" else "reference"
    mesh = mesh_of((2, 4), ("data", "model"))
    q, k, v, do = random_arrays(rng, (4, 9, 8, 16), (4, 12, 4, 16), (4, 12, 4, 16),
                                (4, 9, 8, 16))
    attend = functools.partial(tk_jax.flash_attention, causal=True, backend=backend)
    expected = expected_result(attend, q, k, v, do)
    spec = P("data", None, "model")
    local = jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    assert_all_close(jax.jit(output_and_grads(local))(q, k, v, do), expected)


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_flash_attention_inside_pmap(request, rng, path):
    backend = request.getfixturevalue("kernel_path") if path == "kernel" else "reference"
    q, k, v, do = random_arrays(rng, (8, 1, 6, 2, 8), (8, 1, 10, 1, 8), (8, 1, 10, 1, 8),
                                (8, 1, 6, 2, 8))
    attend = functools.partial(tk_jax.flash_attention, window_size=(4, 0), backend=backend)
    expected = expected_result(attend, q, k, v, do)
    assert_all_close(jax.pmap(output_and_grads(attend))(q, k, v, do), expected)


def test_kernel_calls_inside_shard_map_are_typed_per_device(monkeypatch):
    """With the real FFI wrappers (traced only, never run): the kernel's results must be typed
    as varying between devices, or custom_vjp rejects the backward and autodiff would sum the
    cotangents across devices (a psum in the gradient)."""
    pytest.importorskip("tk_jax._tk")  # the wrappers read the kernels' facts from the extension
    monkeypatch.setattr(tk_jax._backend, "kernel_unavailable_reason", lambda: None)
    mesh = mesh_of((8,), ("x",))
    q = jnp.zeros((8, 64, 2, 64), jnp.bfloat16)
    attend = functools.partial(tk_jax.flash_attention, causal=True, backend="kernel")
    local = jax.shard_map(lambda q: attend(q, q, q), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x"))
    grad = jax.grad(lambda q: jnp.sum(local(q).astype(jnp.float32)))
    jaxpr = str(jax.make_jaxpr(grad)(q))
    assert "ffi_call" in jaxpr
    assert "psum" not in jaxpr


def test_based_decode_step_sharded_jit_has_no_collectives(kernel_path, rng):
    """The decode step's partitioning rule: batch and heads split, no collective, same result
    (forward and the reference-based gradient)."""
    mesh = mesh_of((2, 4), ("data", "model"))
    q, k, v = random_arrays(rng, (4, 8, 16), (4, 8, 16), (4, 8, 8))
    s0 = jnp.asarray(rng.standard_normal((4, 8, 273, 8)), jnp.float32)
    z0 = jnp.asarray(50 + rng.random((4, 8, 273)), jnp.float32)

    def step_and_grad(q, k, v, s0, z0):
        step = functools.partial(tk_jax.based_decode_step, backend=kernel_path)
        y, state = step(q, k, v, (s0, z0))
        grad = jax.grad(lambda q: jnp.sum(step(q, k, v, (s0, z0))[0] ** 2))(q)
        return y, state.S, state.z, grad

    spec = NamedSharding(mesh, P("data", "model"))
    args = [jax.device_put(x, spec) for x in (q, k, v, s0, z0)]
    compiled = jax.jit(step_and_grad).lower(*args).compile()
    assert not collectives(compiled.as_text())
    for actual, expected in zip(compiled(*args), jax.jit(step_and_grad)(q, k, v, s0, z0)):
        assert_close(actual, expected, "decode", tol=1e-5)


# ----------------------------------------------------------------------------------------------
# 4. Segment ids and lengths: they split with the batch, so batch/head sharding stays free.
# (The kernel route only: the reference is plain JAX, which XLA partitions by itself.)


def random_masks(rng, batch, seq):
    """Segment ids [batch, seq] (runs of 1..5 tokens, labels 0..2) and lengths [batch]."""
    runs = rng.integers(1, 6, size=(batch, seq))
    labels = rng.integers(0, 3, size=(batch, seq))
    ids = np.stack([np.repeat(labels[b], runs[b])[:seq] for b in range(batch)]).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(rng.integers(0, seq + 1, size=batch), jnp.int32)


def masked_output_and_grads(backend):
    """fn(q, k, v, ids, lengths, do) -> (o, (dq, dk, dv)): causal, packed, padded keys."""
    def run(q, k, v, ids, lengths, do):
        attend = functools.partial(tk_jax.flash_attention, causal=True, q_segment_ids=ids,
                                   kv_seq_lengths=lengths, backend=backend)
        return output_and_grads(attend)(q, k, v, do)
    return run


def test_sharded_jit_with_segment_ids_and_lengths_has_no_collectives(kernel_path, rng):
    backend = kernel_path
    mesh = mesh_of((2, 4), ("data", "model"))
    q, k, v, do = random_arrays(rng, (4, 11, 8, 16), (4, 11, 4, 16), (4, 11, 4, 16),
                                (4, 11, 8, 16))
    ids, lengths = random_masks(rng, 4, 11)
    expected = jax.jit(masked_output_and_grads("reference"))(q, k, v, ids, lengths, do)

    heads, batch = NamedSharding(mesh, P("data", None, "model")), NamedSharding(mesh, P("data"))
    args = [jax.device_put(x, heads) for x in (q, k, v)] + [
        jax.device_put(ids, batch), jax.device_put(lengths, batch), jax.device_put(do, heads)]
    compiled = jax.jit(masked_output_and_grads(backend)).lower(*args).compile()
    assert not collectives(compiled.as_text())
    assert_all_close(compiled(*args), expected)


def test_segment_ids_inside_shard_map(kernel_path, rng):
    backend = kernel_path
    mesh = mesh_of((2, 4), ("data", "model"))
    q, k, v, do = random_arrays(rng, (4, 9, 8, 16), (4, 9, 4, 16), (4, 9, 4, 16),
                                (4, 9, 8, 16))
    ids, lengths = random_masks(rng, 4, 9)
    expected = jax.jit(masked_output_and_grads("reference"))(q, k, v, ids, lengths, do)

    def attend(q, k, v, ids, lengths):
        return tk_jax.flash_attention(q, k, v, causal=True, q_segment_ids=ids,
                                      kv_seq_lengths=lengths, backend=backend)

    spec = P("data", None, "model")
    local = jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec, P("data"), P("data")),
                          out_specs=spec)
    run = jax.jit(lambda q, k, v, ids, lengths, do: output_and_grads(
        lambda q, k, v: local(q, k, v, ids, lengths))(q, k, v, do))
    assert_all_close(run(q, k, v, ids, lengths, do), expected)


def test_kernel_path_with_segment_ids_under_vmap(kernel_path, rng):
    """The vmapped axis of q, k, v, ids and lengths folds into the batch of the kernel call
    (the forward; the backward's rule is built the same way)."""
    q, k, v = random_arrays(rng, (3, 2, 7, 4, 8), (3, 2, 7, 2, 8), (3, 2, 7, 2, 8))
    ids, lengths = random_masks(rng, 6, 7)
    ids, lengths = ids.reshape(3, 2, 7), lengths.reshape(3, 2)

    def attend(q, k, v, ids, lengths, backend):
        return tk_jax.flash_attention(q, k, v, causal=True, q_segment_ids=ids,
                                      kv_seq_lengths=lengths, backend=backend)

    expected = attend(q, k, v, ids, lengths, "reference")
    o = jax.jit(jax.vmap(functools.partial(attend, backend=kernel_path)))(q, k, v, ids, lengths)
    assert_close(o, expected, "o")
