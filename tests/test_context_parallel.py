"""Context parallelism on 8 CPU host devices (tests/conftest.py): the static plans, ring
attention inside shard_map, and flash_attention on a sequence-sharded input under jit, each
against the float64 oracle of tests/naive.py (forward and gradients), with HLO checks of the
collectives (no all-gather of Q; the ring only passes blocks on).

Kernel-path tests run the dense stand-in of tests/cp_util.py in place of the CUDA kernels (the
public functions then take exactly the route they take on a GPU: the partitioning rule, the
per-device program of tk_jax/_context_parallel.py); a few run the blockwise reference there
instead (the kernel_path fixture), in bf16.
"""
from __future__ import annotations

import functools
import pathlib
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tk_jax
import tk_jax._kernels
from tk_jax import _context_parallel, _partitioning
from tk_jax import _ring_plan as plans

try:  # tests/ as a package, or tests/ on sys.path
    from tests.cp_util import (assert_close, dense_attention_bwd, dense_attention_fwd,
                               dense_kernels_module, oracle)
    from tests.cp_util import segment_oracle as _segment_oracle
    from tests.naive import visible_mask
    from tests.sharding_util import collectives
except ImportError:
    from cp_util import (assert_close, dense_attention_bwd, dense_attention_fwd,
                         dense_kernels_module, oracle)
    from cp_util import segment_oracle as _segment_oracle
    from naive import visible_mask
    from sharding_util import collectives

TOL = 1e-5  # float32 against float64


@pytest.fixture
def dense(install_kernels, monkeypatch):
    """The dense stand-in in place of the kernels; returns the backend name to pass."""
    install_kernels(dense_kernels_module(tk_jax._kernels))
    monkeypatch.setattr(_partitioning, "_warned", set())
    return "kernel"


def mesh_of(shape, names):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def random_arrays(rng, *shapes, dtype=jnp.float32):
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def window_of(mask):
    return {"causal": (-1, 0), "full": (-1, -1)}.get(mask, mask)


def attention_kwargs(mask):
    if mask == "causal":
        return {"causal": True}
    return {} if mask == "full" else {"window_size": tuple(mask)}


def outputs_and_grads(attend, with_lse=False):
    """fn(q, k, v, do[, dlse]) -> (o[, lse], (dq, dk, dv)) of sum(o * do) [+ sum(lse * dlse)]."""
    def run(q, k, v, do, dlse=None):
        def loss(q, k, v):
            out = attend(q, k, v)
            o, lse = out if with_lse else (out, None)
            total = jnp.sum(o.astype(jnp.float32) * do)
            if with_lse:
                total += jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, lse) * dlse)
            return total, out
        grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads
    return run


def assert_matches_oracle(result, q, k, v, do, *, window, tol=TOL, dlse=None):
    out, grads = result
    o_ref, lse_ref, grads_ref = oracle(q, k, v, do, window=window, dlse=dlse)
    if dlse is not None:
        o, lse = out
        assert_close(lse, lse_ref, "lse", tol)
    else:
        o = out
    assert_close(o, o_ref, "o", tol)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(g, g_ref, name, tol)


# ----------------------------------------------------------------------------------------------
# 1. Static plans: every visible pair computed exactly once, nothing else.


def _positions(layout, device, n, length, rows_swapped=False):
    pos = np.empty(length, int)
    chunks = plans.layout_chunks(layout, device, n, length)
    if rows_swapped:
        chunks = plans.swapped_chunks(chunks, length)
    for c in chunks:
        pos[c.local_start:c.local_start + c.length] = c.global_start + np.arange(c.length)
    return pos


def _block_coverage(blocks, q_pos, k_pos, tq, tk):
    covered = np.zeros((tq, tk), int)
    for b in blocks:
        mask = visible_mask(b.q_stop - b.q_start, b.k_stop - b.k_start, b.window_left,
                            b.window_right)
        assert mask.sum() == b.pairs and mask.any(axis=1).all() and mask.any(axis=0).all()
        sub = np.zeros((tq, tk), int)
        sub[np.ix_(q_pos[b.q_start:b.q_stop], k_pos[b.k_start:b.k_stop])] = mask
        covered += sub
    return covered


WINDOWS = [(-1, -1), (-1, 0), (0, 0), (1, 0), (3, 0), (2, 1), (5, 4), (-1, 2), (1, -1)]


def _step_blocks(step, device):
    """The blocks a device runs in a step: its branch, or for a step by lengths the step's
    one block cut to the device's lengths (which must be its branch)."""
    if step.lengths is None:
        return step.blocks_of(device)
    table = step.lengths
    q_len, kv_len = table.q_lengths[device], table.kv_lengths[device]
    assert q_len <= table.rows and kv_len <= table.keys
    cut = (plans.Block(0, q_len, 0, kv_len, -1, -1, q_len * kv_len),)
    assert cut == step.blocks_of(device)
    return cut


@pytest.mark.parametrize("by_lengths", [True, False], ids=["lengths", "switch"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_plans_cover_exactly_the_visible_pairs(n, by_lengths):
    for layout in (plans.CONTIGUOUS, plans.LOAD_BALANCED):
        for local in (2, 6):
            for lk in ((local,) if layout == plans.LOAD_BALANCED else (local, 3)):
                tq, tk = n * local, n * lk
                for window in WINDOWS:
                    want = visible_mask(tq, tk, *window)
                    plan = plans.ring_plan(n, layout, local, lk, tk - tq, *window,
                                           by_lengths=by_lengths)
                    for r in range(n):
                        covered = np.zeros((tq, tk), int)
                        for s, step in enumerate(plan.steps):
                            assert by_lengths or step.lengths is None
                            q_pos = _positions(layout, r, n, local, step.rows_swapped)
                            k_pos = _positions(layout, (r - s) % n, n, lk)
                            covered += _block_coverage(_step_blocks(step, r), q_pos, k_pos, tq,
                                                       tk)
                        expected = np.zeros((tq, tk), int)
                        q_pos = _positions(layout, r, n, local)
                        expected[q_pos] = want[q_pos]
                        assert np.array_equal(covered, expected), (layout, local, lk, window, r)


@pytest.mark.parametrize("layout", [plans.CONTIGUOUS, plans.LOAD_BALANCED])
def test_whole_keys_plans_cover_exactly_the_visible_pairs(layout):
    n, local = 4, 4
    for window in WINDOWS:
        step = plans.whole_keys_plan(n, layout, local, n * local, 0, *window)
        want = visible_mask(n * local, n * local, *window)
        for r in range(n):
            q_pos = _positions(layout, r, n, local)
            covered = _block_coverage(step.blocks_of(r), q_pos, np.arange(n * local),
                                      n * local, n * local)
            expected = np.zeros_like(covered)
            expected[q_pos] = want[q_pos]
            assert np.array_equal(covered, expected), (window, r)


def test_load_balanced_causal_ring_gives_every_device_the_same_work():
    n, local = 4, 8
    balanced = plans.ring_plan(n, plans.LOAD_BALANCED, local, local, 0, -1, 0)
    for step in balanced.steps:
        assert len({step.pairs_of(r) for r in range(n)}) == 1
        assert all(len(blocks) == 1 for blocks in step.branches)  # one call per device and step
    contiguous = plans.ring_plan(n, plans.CONTIGUOUS, local, local, 0, -1, 0)
    assert plans.ring_time(balanced) < 0.6 * plans.ring_time(contiguous)
    # Contiguous: device r has nothing to do once the keys come from after it.
    assert contiguous.steps[1].blocks_of(0) == ()


def test_load_balanced_causal_ring_steps_run_by_lengths():
    """Beyond the diagonal, every step is one call on every device: the queries with their
    chunks swapped against all the keys, device r's part given as lengths (c = half a block):
    for keys from j < r all 2c rows see j's first chunk, for j > r the first c rows (r's
    second chunk) see all 2c keys. The diagonal is one causal call in the layout's order."""
    n, local = 4, 8
    c = local // 2
    plan = plans.ring_plan(n, plans.LOAD_BALANCED, local, local, 0, -1, 0)
    assert plan.rows_swapped
    diagonal, *others = plan.steps
    assert diagonal.lengths is None and not diagonal.rows_swapped
    assert diagonal.branches == ((plans.Block(0, local, 0, local, -1, 0, c * (2 * c + 1)),),)
    for s, step in enumerate(others, 1):
        assert step.rows_swapped and (step.lengths.rows, step.lengths.keys) == (local, local)
        sources = [(r - s) % n for r in range(n)]
        assert step.lengths.q_lengths == tuple(c if j > r else 2 * c
                                               for r, j in enumerate(sources))
        assert step.lengths.kv_lengths == tuple(c if j < r else 2 * c
                                                for r, j in enumerate(sources))
    # Not by lengths: a masked block (a window), several blocks, or a device without work.
    for layout, window in ((plans.LOAD_BALANCED, (3, 0)), (plans.CONTIGUOUS, (-1, 0))):
        assert all(step.lengths is None for step in
                   plans.ring_plan(n, layout, local, local, 0, *window).steps)
    switch = plans.ring_plan(n, plans.LOAD_BALANCED, local, local, 0, -1, 0, by_lengths=False)
    assert not switch.rows_swapped and all(len(s.branches) == 2 for s in switch.steps[1:])


def test_window_ends_the_ring_early():
    n, local = 8, 16
    assert len(plans.ring_plan(n, plans.CONTIGUOUS, local, local, 0, local - 1, 0).steps) == 2
    assert len(plans.ring_plan(n, plans.CONTIGUOUS, local, local, 0, 2 * local, 0).steps) == 3
    assert len(plans.ring_plan(n, plans.CONTIGUOUS, local, local, 0, 2 * local + 1, 0).steps) == 4
    assert len(plans.ring_plan(n, plans.CONTIGUOUS, local, local, 0, 0, 0).steps) == 1
    assert len(plans.ring_plan(n, plans.CONTIGUOUS, local, local, 0, -1, 0).steps) == n


def test_sequence_plan_choices(monkeypatch):
    def plan(hq, hkv, window=(-1, 0), t=65536, kv_split=True):
        return _context_parallel.SequencePlan(
            num_devices=4, tq=t, tk=t, heads_q=hq, heads_kv=hkv, head_dim=128, value_dim=128,
            window_left=window[0], window_right=window[1], offset=0, kv_split=kv_split)

    mha = plan(8, 8)
    assert (mha.exchange, mha.layout) == ("ring", "load_balanced")
    assert plan(32, 1).exchange == "all_gather"        # few KV heads: gather them
    assert plan(32, 1).layout == "load_balanced"       # only the queries move
    assert plan(8, 8, window=(1024, 0)).layout == "contiguous"  # a window balances itself
    assert plan(8, 8, window=(-1, -1)).layout == "contiguous"
    assert plan(8, 8, kv_split=False).exchange == "whole_kv"
    monkeypatch.setenv(_context_parallel.EXCHANGE_ENV, "all_gather")
    assert plan(8, 8).exchange == "all_gather"
    monkeypatch.setenv(_context_parallel.EXCHANGE_ENV, "bogus")
    monkeypatch.setattr(_partitioning, "_warned", set())
    with pytest.warns(UserWarning, match="TK_JAX_CONTEXT_PARALLEL.*ignored"):
        assert plan(8, 8).exchange == "ring"


# ----------------------------------------------------------------------------------------------
# 2. Moving shards between the contiguous and the load-balanced layout.


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_paired_layout_holds_balanced_chunk_pairs_and_comes_back(n):
    """Device r of the paired layout holds chunks x and 2n-1-x (x = its ring position,
    lower chunk first) of every array, whatever its dtype and sequence axis; from_paired
    restores the contiguous split. None stays None."""
    mesh = mesh_of((n,), ("seq",))
    chunk = 3
    t = 2 * n * chunk
    x = jnp.arange(t * 2, dtype=jnp.bfloat16).reshape(1, t, 2)       # sequence axis 1
    y = jnp.arange(2 * t, dtype=jnp.float32).reshape(1, 2, t) * 0.5  # sequence axis 2
    ids = jnp.arange(t, dtype=jnp.int32).reshape(1, t)
    specs = (P(None, "seq"), P(None, None, "seq"), P(None, "seq"))

    def there(x, y, ids):
        items = [(x, 1), (None, 1), (y, 2), (ids, 1)]
        moved = _context_parallel.to_paired(items, "seq", n)
        assert moved[1] is None
        return moved[0], moved[2], moved[3]

    def back(x, y, ids):
        moved = _context_parallel.from_paired([(x, 1), (y, 2), (ids, 1)], "seq", n)
        return tuple(moved)

    paired = jax.jit(jax.shard_map(there, mesh=mesh, in_specs=specs, out_specs=specs))(x, y, ids)
    order = _context_parallel.paired_order(n)
    assert sorted(order) == list(range(n))
    chunks = [c for p in order for c in (p, 2 * n - 1 - p)]
    positions = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks])
    np.testing.assert_array_equal(paired[0], np.asarray(x)[:, positions])
    np.testing.assert_array_equal(paired[1], np.asarray(y)[:, :, positions])
    np.testing.assert_array_equal(paired[2], np.asarray(ids)[:, positions])
    restored = jax.jit(jax.shard_map(back, mesh=mesh, in_specs=specs, out_specs=specs))(*paired)
    for got, want in zip(restored, (x, y, ids)):
        np.testing.assert_array_equal(got, want)


def test_paired_layout_moves_everything_in_one_transfer():
    """All arrays of one direction travel as one collective-permute (between partners)."""
    mesh = mesh_of((4,), ("seq",))
    spec = P(None, "seq")

    def there(a, b, c):
        return tuple(_context_parallel.to_paired([(a, 1), (b, 1), (c, 1)], "seq", 4))

    args = [jnp.zeros((1, 16, 2), dt) for dt in (jnp.bfloat16, jnp.float32, jnp.int32)]
    hlo = jax.jit(jax.shard_map(there, mesh=mesh, in_specs=(spec,) * 3,
                                out_specs=(spec,) * 3)).lower(*args).as_text()
    assert hlo.count("collective_permute") == 1, hlo


# ----------------------------------------------------------------------------------------------
# 3. ring_attention inside shard_map.


def ring(mesh, axis, *, backend, **kwargs):
    """ring_attention over the sequence axis of full arrays (in the layout they are given)."""
    attend = functools.partial(tk_jax.ring_attention, axis_name=axis, backend=backend, **kwargs)
    spec = P(None, axis)
    return jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)


def in_layout(run, load_balanced, n, *arrays):
    """run(*arrays) on the arrays in the load-balanced layout, outputs back in natural order."""
    if not load_balanced:
        return run(*arrays)
    result = run(*(tk_jax.to_load_balanced(x, n) for x in arrays))
    return jax.tree.map(lambda x: tk_jax.from_load_balanced(x, n), result)


RING_CASES = {  # n, mask, load_balanced, Hq, Hkv, positions per device
    "causal, contiguous, n=2": (2, "causal", False, 2, 2, 5),
    "full, n=8, MQA": (8, "full", False, 4, 1, 3),
    "window, contiguous, n=4": (4, (5, 0), False, 2, 2, 4),
    "two-sided window, balanced, n=8": (8, (3, 2), True, 2, 1, 4),
    "causal, balanced, n=8, GQA": (8, "causal", True, 4, 2, 4),
}


@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_attention_matches_oracle(dense, rng, case):
    n, mask, load_balanced, hq, hkv, local = RING_CASES[case]
    t = n * local
    q, k, v, do = random_arrays(rng, (2, t, hq, 8), (2, t, hkv, 8), (2, t, hkv, 8),
                                (2, t, hq, 8))
    run = outputs_and_grads(ring(mesh_of((n,), ("seq",)), "seq", backend=dense,
                                 load_balanced=load_balanced, **attention_kwargs(mask)))
    compiled = jax.jit(run).lower(q, k, v, do).compile()
    # K/V blocks only pass around the ring: no gather, no reduction.
    assert collectives(compiled.as_text()) == {"collective-permute"}
    result = in_layout(compiled, load_balanced, n, q, k, v, do)
    assert_matches_oracle(result, q, k, v, do, window=window_of(mask))


@pytest.mark.parametrize("local, whole_tiles", [(128, True), (96, False)],
                         ids=["whole tiles", "half tiles"])
def test_ring_backward_sums_dq_in_the_kernels_state_where_blocks_are_whole_tiles(
        dense, rng, monkeypatch, local, whole_tiles):
    """With every block's rows whole 64-row tiles (chunks of 64 here), the backward adds each
    block's dq into the kernels' dQ state (row statistics once, dq out once) and never calls
    the one-block backward; with chunks of 48 it sums the blocks' dq itself."""
    n = 4
    t = n * local
    q, k, v, do = random_arrays(rng, (1, t, 2, 8), (1, t, 1, 8), (1, t, 1, 8), (1, t, 2, 8))
    fake = _context_parallel_kernels()
    calls = {"keys": 0, "bwd": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    monkeypatch.setattr(fake, "attention_bwd_keys", counted("keys", fake.attention_bwd_keys))
    monkeypatch.setattr(fake, "attention_bwd", counted("bwd", fake.attention_bwd))
    run = outputs_and_grads(ring(mesh_of((n,), ("seq",)), "seq", backend=dense,
                                 load_balanced=True, causal=True))
    result = in_layout(jax.jit(run), True, n, q, k, v, do)
    assert_matches_oracle(result, q, k, v, do, window=(-1, 0))
    assert (calls["keys"] > 0, calls["bwd"] == 0) == (whole_tiles, whole_tiles), calls


def _context_parallel_kernels():
    """The kernels module the executors call now (the stand-in, under the dense fixture)."""
    import tk_jax.attention
    return tk_jax.attention._kernels


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for sub in (value if isinstance(value, (tuple, list)) else (value,)):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield inner


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _sub_jaxprs(eqn):
            yield from _all_eqns(sub)


def _ppermutes(jaxpr) -> int:
    return sum(e.primitive.name == "ppermute" for e in _all_eqns(jaxpr))


def _matmuls(eqn) -> int:
    """Matmuls an equation runs: 1 for a dot_general; inside a switch, its largest branch;
    inside any other call, all of them."""
    if eqn.primitive.name == "dot_general":
        return 1
    inner = [sum(_matmuls(e) for e in sub.eqns) for sub in _sub_jaxprs(eqn)]
    if not inner:
        return 0
    return max(inner) if eqn.primitive.name == "cond" else sum(inner)


def simulated_time(jaxpr, transfer: float) -> float:
    """The time a program takes on a device that runs its computations one after the other in
    program order (a matmul takes 1, all else nothing) and its transfers (ppermute, each
    `transfer` long) one after the other on a second stream, each as soon as its operands
    are ready, as XLA issues asynchronous collectives."""
    ready, compute_free, transfer_free = {}, 0.0, 0.0

    def time_of(x):  # a literal (it has a value) is ready at once
        return 0.0 if hasattr(x, "val") else ready.get(x, 0.0)

    for eqn in jaxpr.eqns:
        start = max((time_of(x) for x in eqn.invars), default=0.0)
        if eqn.primitive.name == "ppermute":
            end = transfer_free = max(start, transfer_free) + transfer
        elif (cost := _matmuls(eqn)):
            end = compute_free = max(start, compute_free) + cost
        else:
            end = start
        for out in eqn.outvars:
            ready[out] = end
    return max((time_of(x) for x in jaxpr.outvars), default=0.0)


@pytest.fixture(params=["lengths", "switch"])
def ring_steps(request, monkeypatch):
    """Both ways of running a ring step whose work differs between devices: one call with
    per-device lengths where the plan allows (the default), or a switch on the device index."""
    monkeypatch.setenv(_context_parallel.STEPS_ENV, request.param)
    return request.param


@pytest.mark.parametrize("mask, load_balanced", [("causal", True), ("causal", False),
                                                 ("full", False)])
def test_ring_transfers_overlap_the_computation(dense, rng, ring_steps, mask, load_balanced):
    """Give every transfer a cost below a ring step's computation: forward and backward must
    take no longer than with free transfers (each is hidden behind a step; the backward's
    first keys are the forward's, kept). A ring whose computation waits for a transfer issued
    after the previous step's computation (e.g. the dK/dV sums as an operand of the step's
    kernels) fails this. Also: n-1 transfers forward, n backward, and a short window ends the
    ring after one."""
    n, local = 4, 4
    q, k, v, do = random_arrays(rng, *[(1, n * local, 2, 8)] * 4, dtype=jnp.bfloat16)
    attend = ring(mesh_of((n,), ("seq",)), "seq", backend=dense, load_balanced=load_balanced,
                  **attention_kwargs(mask))
    jaxpr = jax.make_jaxpr(outputs_and_grads(attend))(q, k, v, do).jaxpr
    forward, backward = [e.params["jaxpr"] for e in _all_eqns(jaxpr)
                         if e.primitive.name == "shard_map"]
    transfer = 1.9  # a step's computation: >= 2 matmuls forward, >= 4 backward
    assert simulated_time(forward, transfer) == simulated_time(forward, 0.0)
    assert simulated_time(backward, transfer) == simulated_time(backward, 0.0)
    assert _ppermutes(forward) == n - 1
    assert _ppermutes(backward) == n  # n-1 steps of keys and sums, the last sums going home

    windowed = ring(mesh_of((n,), ("seq",)), "seq", backend=dense, window_size=(local - 1, 0),
                    load_balanced=False)
    assert _ppermutes(jax.make_jaxpr(windowed)(q, k, v).jaxpr) == 1


def _switches(jaxpr) -> int:
    return sum(e.primitive.name == "cond" for e in _all_eqns(jaxpr))


def test_load_balanced_causal_ring_runs_without_a_switch(dense, rng, ring_steps):
    """By lengths (the default), the load-balanced causal ring has no switch on the device
    index (on GPU a host round trip every step), forward or backward, in shard_map and in a
    sequence-sharded flash_attention alike; TK_JAX_RING_STEPS=switch keeps one per step. Both
    match the oracle, lse and its cotangent included."""
    n, t = 4, 16
    mesh = mesh_of((n,), ("seq",))
    q, k, v, do = random_arrays(rng, (2, t, 4, 8), (2, t, 2, 8), (2, t, 2, 8), (2, t, 4, 8))
    run = outputs_and_grads(ring(mesh, "seq", backend=dense, causal=True))
    switches = _switches(jax.make_jaxpr(run)(q, k, v, do).jaxpr)
    assert switches == (0 if ring_steps == "lengths" else 2 * (n - 1))  # steps 1..n-1, twice
    result = in_layout(jax.jit(run), True, n, q, k, v, do)
    assert_matches_oracle(result, q, k, v, do, window=(-1, 0))

    dlse = random_arrays(rng, (2, 4, t))[0]
    attend = functools.partial(tk_jax.flash_attention, causal=True, backend=dense,
                               return_lse=True)
    split = NamedSharding(mesh, P(None, "seq"))
    args = [jax.device_put(x, split) for x in (q, k, v, do)]
    args.append(jax.device_put(dlse, NamedSharding(mesh, P(None, None, "seq"))))
    compiled = jax.jit(outputs_and_grads(attend, with_lse=True)).lower(*args).compile()
    conditionals = compiled.as_text().count(" conditional(")
    assert conditionals == 0 if ring_steps == "lengths" else conditionals > 0
    assert_matches_oracle(compiled(*args), q, k, v, do, window=(-1, 0), dlse=dlse)


def test_ring_attention_bf16_on_the_reference_blocks(kernel_path, rng):
    n = 8
    q, k, v, do = random_arrays(rng, (1, 32, 2, 16), (1, 32, 1, 16), (1, 32, 1, 16),
                                (1, 32, 2, 16), dtype=jnp.bfloat16)
    run = jax.jit(outputs_and_grads(ring(mesh_of((n,), ("seq",)), "seq", backend=kernel_path,
                                         causal=True)))
    result = in_layout(run, True, n, q, k, v, do)
    assert all(g.dtype == jnp.bfloat16 for g in result[1])
    assert_matches_oracle(result, q, k, v, do, window=(-1, 0), tol=2e-2)


def test_ring_attention_inside_pmap(rng):
    n = 4
    q, k, v, do = random_arrays(rng, *[(1, 16, 2, 8)] * 4)

    def split(x):  # [1, 16, H, D] -> [4 devices, 1, 4, H, D], load-balanced
        x = tk_jax.to_load_balanced(x, n)
        return jnp.moveaxis(x.reshape(1, n, 16 // n, *x.shape[2:]), 1, 0)

    def join(x):
        return tk_jax.from_load_balanced(jnp.moveaxis(x, 0, 1).reshape(1, 16, *x.shape[3:]), n)

    attend = functools.partial(tk_jax.ring_attention, axis_name="i", causal=True,
                               backend="reference")
    o, grads = jax.pmap(outputs_and_grads(attend), axis_name="i")(*map(split, (q, k, v, do)))
    assert_matches_oracle((join(o), tuple(map(join, grads))), q, k, v, do, window=(-1, 0))


def test_load_balanced_layout():
    n = 4
    x = jnp.arange(2 * n * 3)[None, :, None, None]  # 3 positions per chunk
    balanced = tk_jax.to_load_balanced(x, n)
    per_device = np.asarray(balanced).reshape(n, 2, 3)
    for i in range(n):  # device i holds chunks i and 2n-1-i
        np.testing.assert_array_equal(per_device[i, 0], np.arange(3) + 3 * i)
        np.testing.assert_array_equal(per_device[i, 1], np.arange(3) + 3 * (2 * n - 1 - i))
    np.testing.assert_array_equal(tk_jax.from_load_balanced(balanced, n), x)
    y = jnp.arange(40).reshape(5, 8)
    np.testing.assert_array_equal(
        tk_jax.from_load_balanced(tk_jax.to_load_balanced(y, 2, axis=1), 2, axis=1), y)
    with pytest.raises(ValueError, match="multiple"):
        tk_jax.to_load_balanced(jnp.zeros((1, 10, 1, 1)), 4)


def test_ring_attention_errors():
    q = jnp.zeros((1, 6, 2, 8))
    with pytest.raises(ValueError, match="axis_name='seq'.*shard_map"):
        tk_jax.ring_attention(q, q, q, axis_name="seq")
    mesh = mesh_of((2,), ("seq",))

    def call(q, k, **kwargs):  # traced only: the checks run while tracing
        f = functools.partial(tk_jax.ring_attention, axis_name="seq", **kwargs)
        return jax.eval_shape(jax.shard_map(f, mesh=mesh, in_specs=P(None, "seq"),
                                            out_specs=P(None, "seq")), q, k, k)

    x6, x8 = jnp.zeros((1, 6, 2, 8)), jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match="^ring_attention: .*must be even"):
        call(x6, x6, causal=True)
    call(x6, x6, causal=True, load_balanced=False)
    with pytest.raises(ValueError, match="^ring_attention: .*must be even"):
        call(x6, x6, window_size=(2, 2))  # a mask: the load-balanced layout by default
    call(x6, x6, window_size=(2, 2), load_balanced=False)
    with pytest.raises(ValueError, match="^ring_attention: window_size"):
        call(x8, x8, window_size=(-2, 0))
    with pytest.raises(TypeError, match="^ring_attention: window_size"):
        call(x8, x8, window_size=(1.5, 0))
    with pytest.raises(ValueError, match="^ring_attention: q and k must hold the same part"):
        call(x8, jnp.zeros((1, 4, 2, 8)))
    with pytest.raises(ValueError, match="^ring_attention: .*heads"):
        call(jnp.zeros((1, 8, 3, 8)), x8)
    with pytest.raises(TypeError, match="^ring_attention: causal"):
        call(q, q, causal=1)


# ----------------------------------------------------------------------------------------------
# 4. flash_attention on a sequence-sharded input under jit: context-parallel, no gather of Q.

_RESULT_SHAPE = re.compile(r"= \w+\[([\d,]*)\]\S* (all-gather|reduce-scatter|all-reduce)"
                           r"(?:-start)?\(")


def gathered_head_counts(hlo: str) -> set[int]:
    """The head counts (axis 2) of every all-gather result in a compiled program."""
    return {int(m.group(1).split(",")[2]) for m in _RESULT_SHAPE.finditer(hlo)
            if m.group(2) == "all-gather"}


SEQUENCE_CASES = {
    # mesh shape, mesh axes, spec of q (o, do), spec of k/v, Hq, Hkv, mask, Tq, Tk, exchange
    "causal, n=4": ((4,), ("seq",), P(None, "seq"), P(None, "seq"), 2, 2, "causal", 16, 16,
                    None),
    "causal GQA, n=8": ((8,), ("seq",), P(None, "seq"), P(None, "seq"), 4, 2, "causal", 32, 32,
                        None),
    # odd n: the middle device of the paired layout is its own partner
    "causal, n=3": ((3,), ("seq",), P(None, "seq"), P(None, "seq"), 2, 2, "causal", 24, 24,
                    None),
    "window, n=4": ((4,), ("seq",), P(None, "seq"), P(None, "seq"), 2, 2, (3, 0), 16, 16,
                    None),
    "batch x sequence, lse": ((2, 4), ("data", "seq"), P("data", "seq"), P("data", "seq"), 2,
                              2, "causal", 16, 16, None),
    "causal MQA, all-gather, n=4": ((4,), ("seq",), P(None, "seq"), P(None, "seq"), 4, 1,
                                    "causal", 16, 16, "all_gather"),
    "K/V whole, n=4": ((4,), ("seq",), P(None, "seq"), P(), 2, 1, "causal", 16, 16, None),
    "Tq != Tk, n=4": ((4,), ("seq",), P(None, "seq"), P(None, "seq"), 2, 2, "causal", 8, 16,
                      None),
    # chunks of whole 64-row tiles: dq summed in the kernels' state (row shifts included)
    "causal, whole tiles, n=4, lse": ((4,), ("seq",), P(None, "seq"), P(None, "seq"), 2, 1,
                                      "causal", 512, 512, None),
    "causal, whole tiles, all-gather, n=4": ((4,), ("seq",), P(None, "seq"), P(None, "seq"), 2,
                                             1, "causal", 512, 512, "all_gather"),
}


@pytest.mark.parametrize("case", list(SEQUENCE_CASES))
def test_sequence_sharded_flash_attention_matches_oracle(dense, rng, monkeypatch, case):
    shape, names, q_spec, kv_spec, hq, hkv, mask, tq, tk, exchange = SEQUENCE_CASES[case]
    if exchange:
        monkeypatch.setenv(_context_parallel.EXCHANGE_ENV, exchange)
    with_lse = case.endswith("lse")
    mesh = mesh_of(shape, names)
    batch = 2
    q, k, v, do = random_arrays(rng, (batch, tq, hq, 8), (batch, tk, hkv, 8),
                                (batch, tk, hkv, 8), (batch, tq, hq, 8))
    dlse = random_arrays(rng, (batch, hq, tq))[0] if with_lse else None
    attend = functools.partial(tk_jax.flash_attention, backend=dense, return_lse=with_lse,
                               **attention_kwargs(mask))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = [put(q, q_spec), put(k, kv_spec), put(v, kv_spec), put(do, q_spec)]
    if with_lse:
        args.append(put(dlse, P(q_spec[0], None, "seq")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is gathered: no warning
        compiled = jax.jit(outputs_and_grads(attend, with_lse)).lower(*args).compile()
    hlo, found = compiled.as_text(), collectives(compiled.as_text())
    assert hq not in gathered_head_counts(hlo) or hq == hkv and not gathered_head_counts(hlo)
    if kv_spec == P():  # K/V already whole: only the queries move (into the load-balanced
        # layout and back); dK/dV are summed over the devices backward
        forward = jax.jit(attend).lower(*args[:3]).compile()
        assert collectives(forward.as_text()) == {"collective-permute"}
        assert found == {"collective-permute", "all-reduce"}
    elif exchange == "all_gather":
        assert gathered_head_counts(hlo) == {hkv}
        assert found <= {"all-gather", "reduce-scatter", "collective-permute"}
    else:
        assert found == {"collective-permute"}
    if mask == "causal" and exchange is None and kv_spec != P() and tq == tk:
        # The paired layout: one transfer into it and one back, in each pass; the ring: n-1
        # forward, n+1 backward (the first keys again, and the sums' hop home).
        n = mesh.shape["seq"]
        permutes = hlo.count("collective-permute(") + hlo.count("collective-permute-start(")
        assert permutes == 2 + (n - 1) + 2 + (n + 1), permutes
    out, grads = compiled(*args)
    o = out[0] if with_lse else out
    assert o.sharding.is_equivalent_to(NamedSharding(mesh, q_spec), o.ndim)
    assert_matches_oracle((out, grads), q, k, v, do, window=window_of(mask), dlse=dlse)


def test_sequence_sharded_flash_attention_bf16_on_the_reference_blocks(kernel_path, rng):
    mesh = mesh_of((4,), ("seq",))
    q, k, v, do = random_arrays(rng, (1, 32, 2, 16), (1, 32, 2, 16), (1, 32, 2, 16),
                                (1, 32, 2, 16), dtype=jnp.bfloat16)
    spec = NamedSharding(mesh, P(None, "seq"))
    args = [jax.device_put(x, spec) for x in (q, k, v, do)]
    attend = functools.partial(tk_jax.flash_attention, causal=True, backend=kernel_path)
    compiled = jax.jit(outputs_and_grads(attend)).lower(*args).compile()
    assert collectives(compiled.as_text()) == {"collective-permute"}
    result = compiled(*args)
    assert all(g.dtype == jnp.bfloat16 for g in result[1])
    assert_matches_oracle(result, q, k, v, do, window=(-1, 0), tol=2e-2)


def test_sequence_split_with_kv_heads_picked_per_device_is_gathered_with_a_warning(dense,
                                                                                    rng):
    """Context parallelism needs the kv heads split like the query heads; with fewer kv heads
    than head shards the call falls back to gathering the sequence, and says so."""
    mesh = mesh_of((2, 4), ("seq", "model"))
    q, k, v = random_arrays(rng, (1, 8, 8, 8), (1, 8, 2, 8), (1, 8, 2, 8))
    args = [jax.device_put(q, NamedSharding(mesh, P(None, "seq", "model")))] + [
        jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (k, v)]
    with pytest.warns(UserWarning, match="gathers the whole sequence"):
        o = jax.jit(functools.partial(tk_jax.flash_attention, causal=True, backend=dense))(*args)
    o_ref, _, _ = oracle(q, k, v, q, window=(-1, 0))
    assert_close(o, o_ref, "o", TOL)


@pytest.mark.parametrize("by_lengths", [True, False], ids=["lengths", "switch"])
@pytest.mark.parametrize("layout", [plans.CONTIGUOUS, plans.LOAD_BALANCED])
def test_ring_carries_segment_ids(rng, layout, by_lengths):
    """The ring with packed sequences: the keys' segment ids travel with K/V (in the same
    payload) and every block gets the slices of both (with a step's lengths, where it has
    them); rows whose segment has no visible key (padding: queries and keys get different
    ids) give lse = -inf and zero gradients."""
    n, b, local, h, d = 4, 2, 8, 2, 8
    t = n * local
    q, k, v, do = random_arrays(rng, *[(b, t, h, d)] * 4)
    bounds = np.sort(rng.choice(np.arange(1, t), size=(b, 3), replace=False), axis=1)
    seg = (np.arange(t)[None, :, None] >= bounds[:, None, :]).sum(-1).astype(np.int32)
    q_seg, kv_seg = seg.copy(), seg.copy()
    q_seg[:, -5:], kv_seg[:, -5:] = -1, -2  # padding: sees nothing, is seen by nothing
    o_ref, lse_ref, grads_ref = _segment_oracle(q, k, v, do, q_seg, kv_seg, window=(-1, 0))
    there = ((lambda x: x) if layout == plans.CONTIGUOUS else
             (lambda x: tk_jax.to_load_balanced(jnp.asarray(x), n, axis=1)))
    back = ((lambda x: x) if layout == plans.CONTIGUOUS else
            (lambda x, axis=1: tk_jax.from_load_balanced(x, n, axis=axis)))
    plan = plans.ring_plan(n, layout, local, local, 0, -1, 0, by_lengths=by_lengths)
    scale = 1.0 / np.sqrt(d)

    def attend(q, k, v, window_left, window_right, **segments):
        return dense_attention_fwd(q, k, v, scale=scale, window_left=window_left,
                                   window_right=window_right, **segments)

    def attend_bwd(q, k, v, o, lse, do, dlse, window_left, window_right, **segments):
        return dense_attention_bwd(q, k, v, o, lse, do, dlse, scale=scale,
                                   window_left=window_left, window_right=window_right,
                                   **segments)

    def body(q, k, v, do, qs, ks, o_global, lse_global):
        o, lse = _context_parallel.ring_forward(q, k, v, plan=plan, axis_name="seq",
                                                attend=attend, q_segment_ids=qs,
                                                kv_segment_ids=ks)
        grads = _context_parallel.ring_backward(q, k, v, o_global, lse_global, do,
                                                plan=plan, axis_name="seq",
                                                attend_bwd=attend_bwd, q_segment_ids=qs,
                                                kv_segment_ids=ks)
        return o, lse, grads

    rows, lse_rows = P(None, "seq"), P(None, None, "seq")
    run = jax.jit(jax.shard_map(body, mesh=mesh_of((n,), ("seq",)),
                                in_specs=(rows,) * 6 + (rows, lse_rows),
                                out_specs=(rows, lse_rows, (rows,) * 3)))
    lse_layout = (jnp.asarray(lse_ref, jnp.float32) if layout == plans.CONTIGUOUS else
                  tk_jax.to_load_balanced(jnp.asarray(lse_ref, jnp.float32), n, axis=2))
    o, lse, grads = run(*(there(x) for x in (q, k, v, do, q_seg, kv_seg)),
                        there(jnp.asarray(o_ref, jnp.float32)), lse_layout)
    assert_close(back(o), o_ref, "o", TOL)
    lse = lse if layout == plans.CONTIGUOUS else back(lse, axis=2)
    assert_close(lse, lse_ref, "lse", TOL)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, -5:]))
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(back(g), g_ref, name, TOL)
    assert not np.asarray(back(grads[0]))[:, -5:].any()


def _packed_segments(rng, batch, t, pad):
    """Segment ids of packed documents ([B, T] int32, 4 documents a row) and, for `pad`
    positions at the end, ids that match nothing (queries -1, keys -2)."""
    bounds = np.sort(rng.choice(np.arange(1, t - pad), size=(batch, 3), replace=False), axis=1)
    seg = (np.arange(t)[None, :, None] >= bounds[:, None, :]).sum(-1).astype(np.int32)
    q_seg, kv_seg = seg.copy(), seg.copy()
    if pad:
        q_seg[:, -pad:], kv_seg[:, -pad:] = -1, -2
    return q_seg, kv_seg


def test_ring_attention_with_segment_ids(dense, rng):
    n, t = 4, 32
    q, k, v, do = random_arrays(rng, *[(2, t, 2, 8)] * 4)
    q_seg, kv_seg = _packed_segments(rng, 2, t, pad=3)
    o_ref, _, grads_ref = _segment_oracle(q, k, v, do, q_seg, kv_seg, window=(-1, 0))
    rows = P(None, "seq")

    def attend(q, k, v, q_seg, kv_seg):
        return tk_jax.ring_attention(q, k, v, axis_name="seq", causal=True, backend=dense,
                                     q_segment_ids=q_seg, kv_segment_ids=kv_seg)

    ring = jax.shard_map(attend, mesh=mesh_of((n,), ("seq",)), in_specs=(rows,) * 5,
                         out_specs=rows)

    def outputs(q, k, v, do, q_seg, kv_seg):
        return outputs_and_grads(lambda q, k, v: ring(q, k, v, q_seg, kv_seg))(q, k, v, do)

    there = lambda x: tk_jax.to_load_balanced(jnp.asarray(x), n, axis=1)  # noqa: E731
    back = lambda x: tk_jax.from_load_balanced(x, n, axis=1)  # noqa: E731
    o, grads = jax.jit(outputs)(*(there(x) for x in (q, k, v, do, q_seg, kv_seg)))
    assert_close(back(o), o_ref, "o", TOL)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(back(g), g_ref, name, TOL)


@pytest.mark.parametrize("route", ["segment ids, causal", "lengths, top-left (jax.nn)"])
def test_sequence_sharded_masks_run_context_parallel(dense, rng, route):
    """Packed sequences on a sequence-sharded input: segment ids split like q and k (the keys'
    ids travel with them), and jax.nn's lengths (top-left aligned) as padding ids: no gather,
    the oracle's result."""
    n, t, b = 4, 32, 2
    mesh = mesh_of((n,), ("seq",))
    q, k, v, do = random_arrays(rng, *[(b, t, 2, 8)] * 4)
    split = NamedSharding(mesh, P(None, "seq"))
    put = lambda x: jax.device_put(x, split)  # noqa: E731
    if route.startswith("segment"):
        q_seg, kv_seg = _packed_segments(rng, b, t, pad=0)
        attend = lambda q, k, v: tk_jax.flash_attention(  # noqa: E731
            q, k, v, causal=True, backend=dense, q_segment_ids=put(q_seg))
    else:
        q_len = rng.integers(t // 2, t + 1, size=b).astype(np.int32)
        kv_len = q_len.copy()
        positions = np.arange(t)[None]
        q_seg = np.where(positions < q_len[:, None], 0, -1).astype(np.int32)
        kv_seg = np.where(positions < kv_len[:, None], 0, -2).astype(np.int32)
        attend = lambda q, k, v: tk_jax.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, query_seq_lengths=jnp.asarray(q_len),
            key_value_seq_lengths=jnp.asarray(kv_len), implementation="tk")
    o_ref, _, grads_ref = _segment_oracle(q, k, v, do, q_seg, kv_seg, window=(-1, 0))
    args = [put(x) for x in (q, k, v, do)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is gathered: no warning
        compiled = jax.jit(outputs_and_grads(attend)).lower(*args).compile()
    assert collectives(compiled.as_text()) == {"collective-permute"}
    o, grads = compiled(*args)
    valid = q_seg >= 0  # padded query rows: jax.nn leaves them to the implementation
    assert_close(np.where(valid[..., None, None], o, 0), o_ref, "o", TOL)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(g, g_ref, name, TOL)


def test_lengths_with_bottom_right_alignment_are_gathered(dense, rng):
    """flash_attention's lengths move each row's diagonal (bottom-right: by kv_len - q_len),
    which the static plans cannot follow: such a call is gathered, with a warning, and gives
    the unsplit result."""
    mesh = mesh_of((4,), ("seq",))
    q, k, v = random_arrays(rng, *[(2, 16, 2, 8)] * 3)
    split = NamedSharding(mesh, P(None, "seq"))
    lengths = jnp.asarray([16, 9], jnp.int32)

    def attend(q, k, v):
        return tk_jax.flash_attention(q, k, v, causal=True, backend=dense,
                                      kv_seq_lengths=lengths)

    expected = jax.jit(attend)(q, k, v)
    with pytest.warns(UserWarning, match="gathers the whole sequence"):
        o = jax.jit(attend)(*(jax.device_put(x, split) for x in (q, k, v)))
    assert_close(o, expected, "o", TOL)


# ----------------------------------------------------------------------------------------------
# 5. scripts/profile_ring.py's readers (what a 4-GPU run is read for), on made-up input.

SCHEDULE = """HloModule jit_step, is_scheduled=true

%branch (p: bf16[4]) -> bf16[4] {
  ROOT %p = bf16[4]{0} parameter(0)
}

ENTRY %main.1 (p0: bf16[4], p1: s32[]) -> bf16[4] {
  %p0 = bf16[4]{0} parameter(0)
  %collective-permute-start.1 = (bf16[4]{0}, bf16[4]{0}) collective-permute-start(%p0), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %custom-call.2 = (bf16[4]{0}, f32[4]{0}) custom-call(%p0), custom_call_target="tk_attention_fwd"
  %collective-permute-done.1 = bf16[4]{0} collective-permute-done(%collective-permute-start.1)
  %collective-permute-start.10 = (bf16[4]{0}, bf16[4]{0}) collective-permute-start(%collective-permute-done.1), channel_id=2, backend_config={"collective_backend_config":{"is_sync":true}}
  %collective-permute-done.10 = bf16[4]{0} collective-permute-done(%collective-permute-start.10)
  %fusion.3 = bf16[4]{0} fusion(%collective-permute-done.10), kind=kLoop, calls=%branch
  %collective-permute-start.11 = (bf16[4]{0}, bf16[4]{0}) collective-permute-start(%fusion.3), channel_id=3
  %dynamic_slice_fusion = (bf16[4]{0}, f32[4]{0}) fusion(%fusion.3, %p1), kind=kCustom, calls=%sliced_kernel
  %collective-permute-done.11 = bf16[4]{0} collective-permute-done(%collective-permute-start.11)
  ROOT %conditional.4 = bf16[4]{0} conditional(%p1, %fusion.3), branch_computations={%branch}
}

%sliced_kernel (p.0: bf16[4], p.1: s32[]) -> (bf16[4], f32[4]) {
  %p.0 = bf16[4]{0} parameter(0)
  ROOT %custom-call.5 = (bf16[4]{0}, f32[4]{0}) custom-call(%p.0), custom_call_target="tk_attention_bwd"
}
"""


def test_profile_ring_reads_a_schedule_and_a_trace():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
    import profile_ring

    names = [(name, op) for name, op, _ in profile_ring.entry_schedule(SCHEDULE)]
    assert names[1:4] == [("collective-permute-start.1", "collective-permute-start"),
                          ("custom-call.2", "custom-call"),
                          ("collective-permute-done.1", "collective-permute-done")]
    text = "\n".join(profile_ring.describe_schedule(SCHEDULE))
    # The kernel fused with its operands' slices (dynamic_slice_fusion) counts as a kernel call.
    assert "3 async collective(s)" in text and "2 with an attention call" in text, text
    assert "1 marked is_sync" in text and "tk_attention_fwd" in text, text
    assert "tk_attention_bwd                 dynamic_slice_fusion" in text, text
    # Trace: NCCL runs 10..30 us, compute 0..20 and 25..40: 15 of its 20 us overlap.
    events = [("/device:GPU:0", "Stream #1", "fusion", "compute", 0.0, 20.0),
              ("/device:GPU:0", "Stream #1", "tk_attention", "compute", 25.0, 15.0),
              ("/device:GPU:0", "Stream #2", "ncclDevKernel_SendRecv", "comm", 10.0, 20.0)]
    text = "\n".join(profile_ring.describe_trace(events, timeline_lines=10))
    assert "0.04 | 0.02 | 0.01 (75%)" in text, text
    # Two queued calls busy 0..40 and 100..140 us: 0.07 ms a call, one 60 us gap.
    queued = events + [("/device:GPU:0", "Stream #1", "tk_attention", "compute", 100.0, 40.0)]
    text = "\n".join(profile_ring.describe_queued(queued, calls=2))
    assert "/device:GPU:0: 0.07 | 1, 0.06" in text, text
