"""Context parallelism on all visible GPUs (at least 2) with the real kernels: ring attention
(shard_map) and flash_attention on a sequence-sharded input under jit, causal / window / GQA,
forward and gradients against flash_attention on one GPU; the collectives of the compiled
programs (no all-gather of Q); and the schedule that lets the ring hide its transfers: with
XLA's latency-hiding scheduler, an attention kernel call (or a switch holding them) lies
between every collective-permute-start of the ring and its done.

tests/test_context_parallel.py checks the same routes on CPU host devices against float64.
Run: pytest -m gpu tests/test_context_parallel_gpu.py
"""
from __future__ import annotations

import functools
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tk_jax
from tk_jax import _context_parallel
from gpu_util import assert_matches
from sharding_util import collectives, output_and_grads

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
from profile_ring import LHS, entry_schedule, kind_of, nested_kernels  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpus(hopper):
    """Every visible GPU; skip (saying why) when fewer than 2."""
    try:
        found = jax.devices("gpu")
    except RuntimeError as err:
        pytest.skip(f"needs 2 GPUs; jax.devices('gpu') failed: {err}")
    if len(found) < 2:
        pytest.skip(f"needs 2 GPUs; jax.devices('gpu') lists {len(found)}")
    return found


def bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)




def one_gpu(kwargs, gpu, q, k, v, do):
    attend = functools.partial(tk_jax.flash_attention, backend="kernel", **kwargs)
    return jax.jit(output_and_grads(attend))(*(jax.device_put(x, gpu) for x in (q, k, v, do)))


def inputs(rng, t, hq, hkv, d=128):
    q, k, v = bf16(rng, (1, t, hq, d)), bf16(rng, (1, t, hkv, d)), bf16(rng, (1, t, hkv, d))
    return q, k, v, jnp.asarray(rng.standard_normal(q.shape), jnp.float32)


def heavy_between_starts_and_dones(hlo: str) -> list[bool]:
    """Per collective-permute-start of the entry computation: is an attention kernel call (also
    one fused with its operands' slices) or a conditional scheduled between it and its done?"""
    schedule = entry_schedule(hlo)
    nested = nested_kernels(hlo)
    found = []
    for index, (name, opcode, _) in enumerate(schedule):
        if opcode != "collective-permute-start":
            continue
        done = next(j for j in range(index + 1, len(schedule))
                    if schedule[j][1] == "collective-permute-done" and
                    re.search(rf"%{re.escape(name)}\b", schedule[j][2]))
        found.append(any(o == "conditional" or kind_of(o, r, nested).startswith("tk_attention")
                         for _, o, r in schedule[index + 1:done]))
    return found


RING_CASES = {  # mask kwargs, load_balanced, Hq, Hkv, positions per GPU
    "causal, load-balanced": ({"causal": True}, True, 4, 4, 1024),
    "window, contiguous": ({"window_size": (700, 0)}, False, 4, 2, 1024),
    "full, GQA": ({}, False, 8, 2, 512),
}


@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_attention_matches_one_gpu(gpus, rng, case):
    kwargs, load_balanced, hq, hkv, local = RING_CASES[case]
    n = len(gpus)
    q, k, v, do = inputs(rng, n * local, hq, hkv)
    expected = one_gpu(kwargs, gpus[0], q, k, v, do)
    mesh, spec = Mesh(np.array(gpus), ("seq",)), P(None, "seq")
    ring = jax.shard_map(functools.partial(tk_jax.ring_attention, axis_name="seq",
                                           load_balanced=load_balanced, backend="kernel",
                                           **kwargs),
                         mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    there = (functools.partial(tk_jax.to_load_balanced, num_shards=n) if load_balanced
             else (lambda x: x))
    back = (functools.partial(tk_jax.from_load_balanced, num_shards=n) if load_balanced
            else (lambda x: x))
    args = [jax.device_put(there(x), NamedSharding(mesh, spec)) for x in (q, k, v, do)]
    compiled = jax.jit(output_and_grads(ring)).lower(*args).compile()
    assert collectives(compiled.as_text()) == {"collective-permute"}
    o, grads = compiled(*args)
    assert_matches((back(o), tuple(back(g) for g in grads)), expected)


SEQUENCE_CASES = {  # mask kwargs, Hq, Hkv, positions per GPU, forced exchange
    "causal": ({"causal": True}, 4, 4, 1024, None),
    "full": ({}, 4, 4, 512, None),
    "window": ({"window_size": (300, 0)}, 4, 2, 1024, None),
    "causal GQA, all-gather": ({"causal": True}, 8, 1, 1024, "all_gather"),
    "causal, packed sequences": ({"causal": True, "packed": True}, 4, 4, 1024, None),
}


@pytest.mark.parametrize("case", list(SEQUENCE_CASES))
def test_sequence_sharded_flash_attention_matches_one_gpu(gpus, rng, monkeypatch, case):
    kwargs, hq, hkv, local, exchange = SEQUENCE_CASES[case]
    if exchange:
        monkeypatch.setenv(_context_parallel.EXCHANGE_ENV, exchange)
    n = len(gpus)
    q, k, v, do = inputs(rng, n * local, hq, hkv)
    mesh = Mesh(np.array(gpus), ("seq",))
    split = NamedSharding(mesh, P(None, "seq"))
    kwargs = dict(kwargs)
    if kwargs.pop("packed", False):  # documents of random lengths, one segment id each
        bounds = np.sort(rng.choice(np.arange(1, n * local), size=7, replace=False))
        ids = (np.arange(n * local)[:, None] >= bounds[None, :]).sum(-1).astype(np.int32)
        kwargs["q_segment_ids"] = jnp.asarray(ids[None])
    expected = one_gpu(kwargs, gpus[0], q, k, v, do)
    if "q_segment_ids" in kwargs:
        kwargs["q_segment_ids"] = jax.device_put(kwargs["q_segment_ids"], split)
    args = [jax.device_put(x, split) for x in (q, k, v, do)]
    attend = functools.partial(tk_jax.flash_attention, backend="kernel", **kwargs)
    compiled = jax.jit(output_and_grads(attend)).lower(*args).compile()
    found = collectives(compiled.as_text())
    if exchange == "all_gather":
        assert found <= {"all-gather", "reduce-scatter", "collective-permute"}, found
    else:
        assert found == {"collective-permute"}, found
    o, grads = compiled(*args)
    assert o.sharding.is_equivalent_to(split, o.ndim)
    assert_matches((o, grads), expected)


@pytest.mark.parametrize("steps", ["lengths", "switch"])
def test_ring_transfers_are_scheduled_around_kernel_calls(gpus, rng, monkeypatch, steps):
    """With the latency-hiding scheduler every transfer of the ring (forward and backward) has
    a kernel call or a switch of them between its start and its done: the schedule lets it
    overlap. Printed for the default scheduler too. Both ways of running the steps whose work
    differs between devices: one call with per-device lengths, or a switch."""
    monkeypatch.setenv(_context_parallel.STEPS_ENV, steps)
    n = len(gpus)
    q, k, v, do = inputs(rng, n * 2048, 8, 8)
    mesh, spec = Mesh(np.array(gpus), ("seq",)), P(None, "seq")
    ring = jax.shard_map(functools.partial(tk_jax.ring_attention, axis_name="seq", causal=True,
                                           backend="kernel"),
                         mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, do)]
    lowered = jax.jit(output_and_grads(ring)).lower(*args)
    for name, options in (("default", None), ("latency-hiding", LHS)):
        overlapped = heavy_between_starts_and_dones(
            lowered.compile(compiler_options=options).as_text())
        print(f"{name} scheduler: {sum(overlapped)} of {len(overlapped)} ring transfers have a "
              f"kernel call between start and done")
    assert overlapped and all(overlapped), overlapped
