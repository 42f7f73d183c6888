"""Multi-device attention on 2 GPUs with the real kernels: a sharded jit over batch and over
heads (GQA included), shard_map, and ring attention, each against the same kernel on one GPU
(the output and the gradients of sum(o * cotangent)).

tests/test_sharding.py checks the same routes on CPU host devices with the kernels swapped
for the reference; here the FFI calls themselves run, split across two GPUs. The kernels'
accuracy against float64 is tested in tests/test_attention_gpu.py; these tests check that
splitting the work changes nothing (beyond bf16 rounding and the order of additions) and
that the compiled programs move no data that the split does not need.

Needs the kernels on Hopper (the `hopper` fixture fails loudly without them) and at least 2
visible GPUs (skipped with the reason otherwise). Run: pytest -m gpu tests/test_sharding_gpu.py
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tk_jax
from gpu_util import assert_matches
from sharding_util import collectives, output_and_grads

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpus(hopper):
    """The first two GPUs; skip (saying why) when fewer are visible."""
    try:
        found = jax.devices("gpu")
    except RuntimeError as err:  # no GPU backend at all
        pytest.skip(f"needs 2 GPUs; jax.devices('gpu') failed: {err}")
    if len(found) < 2:
        pytest.skip(f"needs 2 GPUs; jax.devices('gpu') lists {len(found)}")
    return found[:2]


# ----------------------------------------------------------------------------------------------
# Helpers


def bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def on_one_gpu(attend, gpu, q, k, v, do):
    """The expected result: the same function, unsharded, on one GPU."""
    args = [jax.device_put(x, gpu) for x in (q, k, v, do)]
    return jax.jit(output_and_grads(attend))(*args)




# ----------------------------------------------------------------------------------------------
# a. Sharded jit over batch, over heads, and GQA over heads: no collective, same result.
# Each case: (batch, seq, q heads, kv heads, head dim, spec of q and do, spec of k and v).

HEADS = P(None, None, "x")
SHARDED_JIT_CASES = {
    "batch": (4, 257, 4, 4, 64, P("x"), P("x")),
    "heads": (2, 300, 8, 8, 128, HEADS, HEADS),
    "gqa-8to2-heads": (2, 300, 8, 2, 128, HEADS, HEADS),  # 8 q heads on 2 kv: one kv head per GPU
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(SHARDED_JIT_CASES))
def test_sharded_jit_matches_one_gpu_without_collectives(gpus, rng, case, causal):
    batch, seq, hq, hkv, dim, q_spec, kv_spec = SHARDED_JIT_CASES[case]
    q, k, v = bf16(rng, (batch, seq, hq, dim)), bf16(rng, (batch, seq, hkv, dim)), \
        bf16(rng, (batch, seq, hkv, dim))
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    attend = functools.partial(tk_jax.flash_attention, causal=causal, backend="kernel")
    expected = on_one_gpu(attend, gpus[0], q, k, v, do)

    mesh = Mesh(np.array(gpus), ("x",))
    q_sharding, kv_sharding = NamedSharding(mesh, q_spec), NamedSharding(mesh, kv_spec)
    args = (jax.device_put(q, q_sharding), jax.device_put(k, kv_sharding),
            jax.device_put(v, kv_sharding), jax.device_put(do, q_sharding))
    compiled = jax.jit(output_and_grads(attend)).lower(*args).compile()
    found = collectives(compiled.as_text())
    assert not found, f"collectives in the sharded program ({case}): {sorted(found)}"
    assert_matches(compiled(*args), expected)


def test_based_sharded_jit_over_batch_matches_one_gpu_without_collectives(gpus, rng):
    """The Based forward and backward kernels under a batch-sharded jit."""
    q, k = bf16(rng, (4, 300, 4, 16)), bf16(rng, (4, 300, 4, 16))
    v = bf16(rng, (4, 300, 4, 64))
    do = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    attend = functools.partial(tk_jax.based_linear_attention, backend="kernel")
    expected = on_one_gpu(attend, gpus[0], q, k, v, do)
    mesh = Mesh(np.array(gpus), ("x",))
    args = [jax.device_put(x, NamedSharding(mesh, P("x"))) for x in (q, k, v, do)]
    compiled = jax.jit(output_and_grads(attend)).lower(*args).compile()
    found = collectives(compiled.as_text())
    assert not found, f"collectives in the sharded Based program: {sorted(found)}"
    assert_matches(compiled(*args), expected)


# ----------------------------------------------------------------------------------------------
# b. flash_attention inside shard_map over the batch.


@pytest.mark.parametrize("causal", [False, True])
def test_shard_map_over_batch_matches_one_gpu(gpus, rng, causal):
    q, k, v = bf16(rng, (4, 300, 4, 128)), bf16(rng, (4, 300, 2, 128)), bf16(rng, (4, 300, 2, 128))
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    attend = functools.partial(tk_jax.flash_attention, causal=causal, backend="kernel")
    expected = on_one_gpu(attend, gpus[0], q, k, v, do)

    mesh = Mesh(np.array(gpus), ("x",))
    spec = P("x")
    local = jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, do)]
    compiled = jax.jit(output_and_grads(local)).lower(*args).compile()
    # The kernel's results are typed per device: autodiff must not sum gradients across GPUs.
    found = collectives(compiled.as_text())
    assert not found, f"collectives in the shard_map program: {sorted(found)}"
    assert_matches(compiled(*args), expected)


# ----------------------------------------------------------------------------------------------
# c. Ring attention over 2 GPUs (sequence split) against flash_attention on one GPU.


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal+load-balanced"])
def test_ring_attention_matches_one_gpu(gpus, rng, causal):
    batch, seq, heads, dim = 1, 2048, 4, 128
    q, k, v = (bf16(rng, (batch, seq, heads, dim)) for _ in range(3))
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    expected = on_one_gpu(functools.partial(tk_jax.flash_attention, causal=causal,
                                            backend="kernel"), gpus[0], q, k, v, do)

    n = len(gpus)
    mesh = Mesh(np.array(gpus), ("seq",))
    spec = P(None, "seq")
    load_balanced = causal  # the layout only matters for causal attention
    attend = functools.partial(tk_jax.ring_attention, axis_name="seq", causal=causal,
                               load_balanced=load_balanced, backend="kernel")
    ring = jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)

    # Load-balanced layout: reorder the sequence before the split, and the results after.
    to_layout = (functools.partial(tk_jax.to_load_balanced, num_shards=n) if load_balanced
                 else (lambda x: x))
    from_layout = (functools.partial(tk_jax.from_load_balanced, num_shards=n)
                   if load_balanced else (lambda x: x))
    args = [jax.device_put(to_layout(x), NamedSharding(mesh, spec)) for x in (q, k, v, do)]
    compiled = jax.jit(output_and_grads(ring)).lower(*args).compile()
    # K/V blocks (and dK/dV) only pass around the ring: no gather, no reduction.
    assert collectives(compiled.as_text()) == {"collective-permute"}, sorted(collectives(compiled.as_text()))
    o, grads = compiled(*args)
    actual = (from_layout(o), tuple(from_layout(g) for g in grads))
    assert_matches(actual, expected)
