"""Multi-device scaling: `python3 -m bench scale`.

Compares one device with all N visible devices (N = len(jax.devices()); with one device only
the one-device numbers are measured, and the report says so):

  1. attention  flash_attention fwd+bwd (causal, D=128, T=4096, global batch 16 x 16 heads):
                the whole batch on one device, then a batch-sharded jit on N devices (the
                partitioning rules of tk_jax/_partitioning.py split the kernel calls; no collective
                is expected, and the compiled program's collectives are reported).
  2. lm         a data-parallel training step of a small BasedLM (tk_jax.nn) with optax adamw:
                global batch sharded over the devices, parameters replicated, jit with
                shardings (only the gradient all-reduce is expected). Tokens per second.
  3. ring       ring attention (causal, load-balanced, D=128, H=8, B=1, T = 32k and 64k)
                fwd+bwd on N devices, against flash_attention over the whole sequence on one
                device; plus the pieces it is made of, each timed alone (one ring step's
                attention on one device, one ring transfer), to estimate how much of the
                communication the ring hides behind its computation. Each N-device program
                is timed as compiled by default and with XLA's latency-hiding scheduler
                (the compile option xla_gpu_enable_latency_hiding_scheduler).
  4. sequence   flash_attention fwd+bwd (causal) on a sequence-sharded input under jit (the
                user's call unchanged: context parallelism from the partitioning rule), at the
                ring's lengths; and with few KV heads (GQA, Hkv=1) at the first length, with
                K/V passed around the ring and gathered (TK_JAX_CONTEXT_PARALLEL forced).

Parts can be chosen with --contenders (attention,lm,ring,sequence; default all).

Every measurement goes through bench.run_one (median of timed repeats after warm-up, with
block_until_ready), so a failure (OOM, a kernel that cannot run) is recorded in the table and
the run goes on. Inputs are random normal bf16 (never zeros). Results: <out>/scale-<card>.json
(rewritten after every measurement) and <out>/scale-<card>.md.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import re
import time
from typing import Callable

from bench import (OK, OURS, Contender, Skipped, Unsupported, random_normal_sets,
                   run_one)
from bench import report
from bench.attention import AttentionConfig, attention_flops
from bench.timing import JaxClock, Runner, fwd_bwd

SUITE = "scale"
ATTENTION, LM, RING, SEQUENCE = "attention", "lm", "ring", "sequence"
PARTS = (ATTENTION, LM, RING, SEQUENCE)

# Names of the measurements (the "name" field of each result's config).
SHARDED_ATTENTION = "flash_attention, batch-sharded jit"
LM_STEP = "BasedLM train step, data-parallel jit"
FLASH_WHOLE = "flash_attention, whole sequence"
RING_ATTENTION = "ring_attention, sequence-sharded"
RING_ATTENTION_LHS = "ring_attention, sequence-sharded, latency-hiding scheduler"
STEP_DIAGONAL = "ring step alone: diagonal block"
STEP_OFF_DIAGONAL = "ring step alone: off-diagonal block"
SEND_KV = "ring transfer alone: K,V (bf16)"
SEND_DKV = "ring transfer alone: dK,dV (f32)"
SEQUENCE_SHARDED = "flash_attention, sequence-sharded jit"
SEQUENCE_SHARDED_LHS = "flash_attention, sequence-sharded jit, latency-hiding scheduler"
FLASH_WHOLE_GQA = "flash_attention, whole sequence, GQA"
SEQUENCE_GQA = "flash_attention, sequence-sharded jit, GQA"

# The compile option that turns on XLA's latency-hiding scheduler for one program (the same as
# XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true for all of them).
LHS_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}

COLLECTIVES = re.compile(r"\b(all-gather|all-to-all|all-reduce|collective-permute|"
                         r"reduce-scatter)(-start)?\b")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes of the three parts."""

    # 1. batch-sharded attention
    attn_batch: int = 16
    attn_heads: int = 16
    attn_t: int = 4096
    attn_d: int = 128
    # 2. data-parallel BasedLM, a training-step-sized model (d_model 1024, 12 layers, T=4096):
    # "swa" puts sliding-window attention layers (the attention kernel under the batch-sharded
    # jit) between the Based layers. A much smaller step is dominated by the gradient
    # all-reduce and launch overheads and says little about training.
    lm_batch: int = 8
    lm_seq: int = 4096
    lm_vocab: int = 8192
    lm_d_model: int = 1024
    lm_layers: tuple = ("conv", "based", "swa", "based") * 3
    lm_heads: int = 16           # Based and sliding-window heads (head dim d_model / heads)
    lm_window: int = 128
    # 3. ring attention
    ring_t: tuple = (32768, 65536)
    ring_batch: int = 1
    ring_heads: int = 8
    ring_d: int = 128
    ring_gqa_kv_heads: int = 1   # 4. the GQA point of the sequence-sharded path


FULL = Sizes()
# Toy shapes that run in seconds on CPU host devices (a smoke test of the code paths only).
TINY = Sizes(attn_batch=8, attn_heads=2, attn_t=64, attn_d=32, lm_batch=8, lm_seq=32,
             lm_vocab=64, lm_d_model=32, lm_heads=2, lm_window=8, ring_t=(128,), ring_heads=2,
             ring_d=32)


# ---------------------------------------------------------------------------------------------
# Pure helpers (no device): the ring's pieces and the overlap estimate.

@dataclasses.dataclass(frozen=True)
class RingBlock:
    """One kind of attention block a device computes in the ring: `count` of them per pass."""

    name: str
    count: int
    tq: int
    tk: int
    causal: bool


def ring_step_blocks(t: int, n: int) -> list[RingBlock]:
    """The blocks one device computes in causal load-balanced ring attention over `n` devices
    (see tk_jax/ring.py): step 0 is its own block of t/n positions under the causal mask;
    each of the n-1 other steps is unmasked work of (t/n) x (t/2n) pairs (all local queries
    against the first half of the visiting keys, or the second half of the queries against
    all of them: the same work; the first shape is the one timed)."""
    local = t // n
    return [RingBlock(STEP_DIAGONAL, 1, local, local, True),
            RingBlock(STEP_OFF_DIAGONAL, n - 1, local, local // 2, False)]


def ring_transfers(n: int) -> tuple[int, int]:
    """(K,V sends, dK,dV sends) per device in one fwd+bwd of ring attention: the forward and
    the backward ring each pass K,V on n-1 times; the backward passes the dK,dV partial sums
    on n-1 times (n-2 hops with the next block's K,V in one payload, then one hop home).
    Timed alone as separate payloads: a combined payload moves the sum of their bytes."""
    return 2 * (n - 1), n - 1


def hidden_comm(ring_ms: float, compute_ms: float, comm_ms: float) -> dict:
    """How much of the communication the ring hides, from three times:

    ring_ms     the ring's fwd+bwd
    compute_ms  the sum of its attention steps, each timed alone on one device
    comm_ms     the sum of its transfers, each timed alone

    overhead = ring_ms - compute_ms holds the exposed communication plus the merges and other
    bookkeeping; so hidden = comm_ms - max(overhead, 0), clipped to [0, comm_ms], is a lower
    bound on the communication time hidden behind computation.
    """
    overhead = ring_ms - compute_ms
    hidden = min(max(comm_ms - max(overhead, 0.0), 0.0), comm_ms)
    return {"overhead_ms": overhead, "hidden_ms": hidden,
            "hidden_fraction": hidden / comm_ms if comm_ms > 0 else None}


def collectives(hlo_text: str) -> list[str]:
    """Collective operations named in a compiled program's text, sorted."""
    return sorted({m.group(1) for m in COLLECTIVES.finditer(hlo_text)})


def lm_batches(batch: int, devices: int) -> list[int]:
    """Global batches of the data-parallel step on `devices`: `batch` (strong scaling) and,
    on several devices, `batch` per device (weak scaling)."""
    return [batch] if devices == 1 else [batch, batch * devices]


def device_counts(num_visible: int) -> list[int]:
    """[1, N], or [1] when only one device is visible."""
    return [1] if num_visible <= 1 else [1, num_visible]


# ---------------------------------------------------------------------------------------------
# Building the timed calls. Each `prepare_*(extra, **options)` returns a bench Runner, or raises
# Skipped / Unsupported; `extra` (a dict) receives facts to report next to the time.

def _mesh(devices, axis: str):
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(devices), (axis,))


def _random_on_mesh(shapes, mesh, specs, *, seed: int, dtype: str = "bfloat16") -> tuple:
    """Random normal arrays (drawn on the default device), placed on `mesh` with `specs`."""
    import jax
    from jax.sharding import NamedSharding

    arrays = random_normal_sets(shapes, 1, seed=seed, dtype=dtype)[0]
    return tuple(jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(arrays, specs))


def _compile(fn, args, extra: dict, compiler_options=None, **jit_kwargs):
    """jit(fn) compiled for `args` (with XLA `compiler_options`, e.g. LHS_OPTIONS); the
    collectives of the compiled program go into extra. A ValueError while tracing is how
    backend="kernel" declines: reported as unsupported."""
    import jax

    try:
        compiled = jax.jit(fn, **jit_kwargs).lower(*args).compile(
            compiler_options=compiler_options)
    except ValueError as err:
        raise Unsupported(str(err)) from None
    try:
        extra["collectives"] = collectives(compiled.as_text())
    except Exception as err:  # the text is a diagnostic only
        extra["collectives"] = f"unknown ({type(err).__name__})"
    return compiled


def _runner(call: Callable[[int], object], devices) -> Runner:
    """A Runner of `call`. On CPU host devices each call is waited for: XLA:CPU runs queued
    multi-device programs on one shared thread pool, and many queued collectives can deadlock
    there (seen with 2 host devices on 2 cores). CPU timings mean nothing anyway; GPUs queue
    freely."""
    if devices[0].platform == "cpu" and len(devices) > 1:
        import jax

        queued = call
        call = lambda i: jax.block_until_ready(queued(i))  # noqa: E731
    return Runner(call=call, n_sets=1, clock=JaxClock())


def prepare_flash(extra: dict, *, devices, batch, tq, tk, heads, d, causal, spec_axis, backend,
                  kv_heads=None, seed=0) -> Runner:
    """flash_attention fwd+bwd on [batch, tq|tk, heads, d], split over `devices` along
    `spec_axis` ("batch", or None for whole arrays on one device)."""
    import tk_jax
    from jax.sharding import PartitionSpec as P

    if spec_axis == "batch" and batch % len(devices):
        raise Skipped(f"batch {batch} is not divisible by {len(devices)} devices")
    mesh = _mesh(devices, "data")
    spec = P("data") if spec_axis == "batch" else P()
    q_shape, kv_shape = (batch, tq, heads, d), (batch, tk, kv_heads or heads, d)
    args = _random_on_mesh([q_shape, kv_shape, kv_shape, q_shape], mesh, [spec] * 4, seed=seed)
    attend = functools.partial(tk_jax.flash_attention, causal=causal, backend=backend)
    compiled = _compile(fwd_bwd(attend), args, extra)
    return _runner(lambda i: compiled(*args), devices)


def prepare_ring(extra: dict, *, devices, t, sizes: Sizes, backend, compiler_options=None,
                 seed=0) -> Runner:
    """Causal load-balanced ring_attention fwd+bwd, the sequence split over `devices`. The
    inputs are random, so they count as already being in the load-balanced layout."""
    import jax
    import tk_jax
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    if n < 2:
        raise Skipped("ring attention needs at least 2 devices")
    if t % (2 * n):
        raise Skipped(f"T={t} is not divisible by 2 x {n} devices (load-balanced chunks)")
    mesh = _mesh(devices, "seq")
    spec = P(None, "seq")
    shape = (sizes.ring_batch, t, sizes.ring_heads, sizes.ring_d)
    args = _random_on_mesh([shape] * 4, mesh, [spec] * 4, seed=seed)
    attend = functools.partial(tk_jax.ring_attention, axis_name="seq", causal=True,
                               load_balanced=True, backend=backend)
    ring = jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    compiled = _compile(fwd_bwd(ring), args, extra, compiler_options)
    return _runner(lambda i: compiled(*args), devices)


def prepare_sequence_sharded(extra: dict, *, devices, t, heads, kv_heads, sizes: Sizes,
                             backend, exchange=None, compiler_options=None, seed=0) -> Runner:
    """flash_attention fwd+bwd (causal) on q, k, v split contiguously along the sequence over
    `devices` (NamedSharding, plain jit: the user's call unchanged). `exchange` forces how K/V
    reach the queries ("ring" / "all_gather"; None: the library's choice)."""
    import os

    import tk_jax
    from jax.sharding import PartitionSpec as P
    from tk_jax import _context_parallel

    n = len(devices)
    if n < 2:
        raise Skipped("a sequence split needs at least 2 devices")
    if t % (2 * n):
        raise Skipped(f"T={t} is not divisible by 2 x {n} devices")
    mesh = _mesh(devices, "seq")
    spec = P(None, "seq")
    q_shape = (sizes.ring_batch, t, heads, sizes.ring_d)
    kv_shape = (sizes.ring_batch, t, kv_heads, sizes.ring_d)
    args = _random_on_mesh([q_shape, kv_shape, kv_shape, q_shape], mesh, [spec] * 4, seed=seed)
    attend = functools.partial(tk_jax.flash_attention, causal=True, backend=backend)
    plan = _context_parallel.plan_for(dict(window_left=-1, window_right=0), q_shape, kv_shape,
                                      kv_shape, n, True)
    saved = os.environ.get(_context_parallel.EXCHANGE_ENV)
    if exchange:  # read while compiling (by the partitioning rule)
        os.environ[_context_parallel.EXCHANGE_ENV] = exchange
        plan = _context_parallel.plan_for(dict(window_left=-1, window_right=0), q_shape,
                                          kv_shape, kv_shape, n, True)
    try:
        compiled = _compile(fwd_bwd(attend), args, extra, compiler_options)
    finally:
        if saved is None:
            os.environ.pop(_context_parallel.EXCHANGE_ENV, None)
        else:
            os.environ[_context_parallel.EXCHANGE_ENV] = saved
    if backend != "reference":  # the reference is split by XLA, without the rule
        extra["plan"] = f"{plan.exchange}, {plan.layout}"
    return _runner(lambda i: compiled(*args), devices)


def prepare_ring_transfer(extra: dict, *, devices, t, sizes: Sizes, dtype: str,
                          seed=0) -> Runner:
    """One ring hop alone: every device sends its (t/n)-position pair of K,V-shaped blocks in
    `dtype` to the next device, as one payload of 32-bit words (lax.ppermute, as ring
    attention does)."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    if n < 2:
        raise Skipped("a ring transfer needs at least 2 devices")
    if t % n:
        raise Skipped(f"T={t} is not divisible by {n} devices")
    import jax.numpy as jnp

    mesh = _mesh(devices, "seq")
    block_bytes = 2 * sizes.ring_batch * (t // n) * sizes.ring_heads * sizes.ring_d * \
        jnp.dtype(dtype).itemsize
    # The payload as 32-bit words (float32 here: the same bytes as the ring's uint32 payload).
    args = _random_on_mesh([(n * (block_bytes // 4),)], mesh, [P("seq")], seed=seed,
                           dtype="float32")
    perm = [(i, (i + 1) % n) for i in range(n)]
    send = jax.shard_map(lambda a: lax.ppermute(a, "seq", perm), mesh=mesh,
                         in_specs=P("seq"), out_specs=P("seq"))
    compiled = _compile(send, args, extra)
    return _runner(lambda i: compiled(*args), devices)


def prepare_lm_step(extra: dict, *, devices, sizes: Sizes, backend, batch: int, seed=0) -> Runner:
    """One data-parallel training step of a BasedLM (next-token cross-entropy on random
    tokens, optax adamw) on `batch` sequences split over `devices`, parameters and optimizer
    state replicated. Runs one step while preparing, to report its loss."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from tk_jax.nn import BasedConfig, BasedLM

    n = len(devices)
    if batch % n:
        raise Skipped(f"batch {batch} is not divisible by {n} devices")
    config = BasedConfig(
        vocab_size=sizes.lm_vocab, d_model=sizes.lm_d_model, num_layers=len(sizes.lm_layers),
        layer_pattern=tuple(sizes.lm_layers), based_heads=sizes.lm_heads,
        swa_heads=sizes.lm_heads, swa_window=sizes.lm_window, dtype=jnp.bfloat16,
        backend=backend)
    graphdef, params = nnx.split(BasedLM(config, rngs=nnx.Rngs(seed)), nnx.Param)
    optimizer = optax.adamw(1e-3, weight_decay=0.01)

    def loss_fn(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    mesh = _mesh(devices, "data")
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)
    # seq + 1 tokens per row: the model reads the first seq, predicts the last seq.
    tokens = np.random.default_rng(seed).integers(0, sizes.lm_vocab,
                                                  (batch, sizes.lm_seq + 1))
    tokens = jax.device_put(tokens.astype(np.int32), split)
    compiled = _compile(train_step, (params, opt_state, tokens), extra,
                        in_shardings=(replicated, replicated, split),
                        out_shardings=(replicated, replicated, replicated))
    state = list(compiled(params, opt_state, tokens))  # [params, opt_state, loss]
    extra["first_step_loss"] = float(state[2])

    def call(i):
        state[0], state[1], state[2] = compiled(state[0], state[1], tokens)
        return state[2], state[0]  # waiting on these waits for the whole step

    return _runner(call, devices)


# ---------------------------------------------------------------------------------------------
# The run: measurements in order, each recorded as it completes.

def _config(part: str, name: str, devices: int, **fields) -> dict:
    return {"part": part, "name": name, "devices": devices, **fields}


def _label(config: dict) -> str:
    extra = "".join(f" {k}={v}" for k, v in config.items() if k not in ("part", "name", "devices"))
    return f"{config['name']} on {config['devices']} device(s){extra}"


# A sample of the scale suite is a loop of calls this long. Each sample starts on idle devices,
# so its first call pays the dispatch of a multi-device program (~0.3-1 ms before the GPUs
# start, on 4 x H200) that back-to-back training steps hide; the default 20 ms loops held one
# or two calls of a 14 ms ring and charged it that latency every other call.
SAMPLE_SECONDS = 0.25


class Recorder:
    """Runs measurements and keeps the JSON document up to date after each one."""

    def __init__(self, document: dict, json_path: str, *, reps: int, verbose: bool):
        self.document, self.json_path = document, json_path
        self.reps, self.verbose = reps, verbose

    def measure(self, config: dict, prepare: Callable[[dict], Runner]) -> dict:
        """Time prepare(extra)'s runner; never raises (bench.run_one records failures)."""
        extra: dict = {}
        contender = Contender(name=_label(config), description=config["name"], role=OURS,
                              unavailable=lambda: None, prepare=lambda _: prepare(extra))
        outcome = run_one(contender, None, config, reps=self.reps, verbose_errors=self.verbose,
                          min_rep_seconds=SAMPLE_SECONDS)
        result = dataclasses.asdict(outcome)
        result["metrics"].update(extra)
        self.document["results"].append(result)
        report.write_json(self.json_path, self.document)
        print(f"[{len(self.document['results']):>2}] {_label(config):<68} "
              f"{report.outcome_summary(result)}", flush=True)
        return result

    def skip(self, config: dict, reason: str) -> dict:
        def prepare(extra):
            raise Skipped(reason)
        return self.measure(config, prepare)


def measure_all(rec: Recorder, devices, sizes: Sizes, *, backend: str, lm_backend: str,
                ring_t, parts=PARTS) -> None:
    n = len(devices)
    # 1. Batch-sharded attention.
    for count in device_counts(n) if ATTENTION in parts else ():
        config = _config(ATTENTION, SHARDED_ATTENTION, count, batch=sizes.attn_batch,
                         heads=sizes.attn_heads, t=sizes.attn_t, d=sizes.attn_d, causal=True)
        rec.measure(config, functools.partial(
            prepare_flash, devices=devices[:count], batch=sizes.attn_batch, tq=sizes.attn_t,
            tk=sizes.attn_t, heads=sizes.attn_heads, d=sizes.attn_d, causal=True,
            spec_axis="batch", backend=backend))
    # 2. Data-parallel BasedLM training step: on N devices both the same global batch (strong
    # scaling) and N times it (the same batch per device, as data-parallel training runs).
    for count in device_counts(n) if LM in parts else ():
        for batch in lm_batches(sizes.lm_batch, count):
            config = _config(LM, LM_STEP, count, batch=batch, seq=sizes.lm_seq,
                             d_model=sizes.lm_d_model, layers="-".join(sizes.lm_layers),
                             backend=lm_backend)
            rec.measure(config, functools.partial(prepare_lm_step, devices=devices[:count],
                                                  sizes=sizes, backend=lm_backend, batch=batch))
    # 3. Ring attention, flash_attention on one device, and the ring's pieces alone; 4. the
    # sequence-sharded flash_attention against the same one-device baseline.
    for t in ring_t if RING in parts or SEQUENCE in parts else ():
        flash_on_one = functools.partial(prepare_flash, devices=devices[:1],
                                         batch=sizes.ring_batch, d=sizes.ring_d,
                                         spec_axis=None, backend=backend)
        rec.measure(_config(RING, FLASH_WHOLE, 1, t=t), functools.partial(
            flash_on_one, tq=t, tk=t, heads=sizes.ring_heads, causal=True))
        if n < 2:
            rec.skip(_config(RING, RING_ATTENTION, n, t=t),
                     "only 1 device visible: ring attention needs at least 2")
            continue
        if RING in parts:
            for name, options in ((RING_ATTENTION, None), (RING_ATTENTION_LHS, LHS_OPTIONS)):
                rec.measure(_config(RING, name, n, t=t), functools.partial(
                    prepare_ring, devices=devices, t=t, sizes=sizes, backend=backend,
                    compiler_options=options))
            for block in ring_step_blocks(t, n):
                rec.measure(_config(RING, block.name, 1, t=t, ring_devices=n, tq=block.tq,
                                    tk=block.tk, causal=block.causal),
                            functools.partial(flash_on_one, tq=block.tq, tk=block.tk,
                                              heads=sizes.ring_heads, causal=block.causal))
            for name, dtype in ((SEND_KV, "bfloat16"), (SEND_DKV, "float32")):
                rec.measure(_config(RING, name, n, t=t), functools.partial(
                    prepare_ring_transfer, devices=devices, t=t, sizes=sizes, dtype=dtype))
        if SEQUENCE in parts:
            sharded = functools.partial(prepare_sequence_sharded, devices=devices, t=t,
                                        sizes=sizes, backend=backend)
            for name, options in ((SEQUENCE_SHARDED, None), (SEQUENCE_SHARDED_LHS, LHS_OPTIONS)):
                rec.measure(_config(SEQUENCE, name, n, t=t), functools.partial(
                    sharded, heads=sizes.ring_heads, kv_heads=sizes.ring_heads,
                    compiler_options=options))
            if t == ring_t[0]:  # few KV heads: the ring against the all-gather of K/V
                kv_heads = sizes.ring_gqa_kv_heads
                rec.measure(_config(SEQUENCE, FLASH_WHOLE_GQA, 1, t=t, kv_heads=kv_heads),
                            functools.partial(flash_on_one, tq=t, tk=t, heads=sizes.ring_heads,
                                              kv_heads=kv_heads, causal=True))
                for exchange in ("ring", "all_gather"):
                    rec.measure(
                        _config(SEQUENCE, SEQUENCE_GQA, n, t=t, kv_heads=kv_heads,
                                exchange=exchange),
                        functools.partial(sharded, heads=sizes.ring_heads, kv_heads=kv_heads,
                                          exchange=exchange, compiler_options=LHS_OPTIONS))


# ---------------------------------------------------------------------------------------------
# Report.

def _ok_ms(result: dict | None) -> float | None:
    return result["median_ms"] if result is not None and result["status"] == OK else None


def _fmt(value, suffix: str = "") -> str:
    return "-" if value is None else report.format_number(value) + suffix


def _tflops(flops: float, ms: float | None, devices: int = 1) -> float | None:
    return ms and flops / (ms * 1e-3) / 1e12 / devices


def _causal_fwd_bwd_flops(t: int, d: int, batch: int, heads: int) -> float:
    return attention_flops(AttentionConfig(t=t, d=d, causal=True, backward=True, batch=batch,
                                           heads=heads))


def _weighted_ms(parts: list[tuple[int, dict | None]]) -> float | None:
    """The sum of count x time over (count, result) pairs; None if a time is missing."""
    times = [_ok_ms(r) for _, r in parts]
    return None if None in times else sum(count * ms for (count, _), ms in zip(parts, times))


def _collectives_cell(result: dict | None) -> str:
    if result is None or result["status"] != OK:
        return "-"
    found = result["metrics"].get("collectives")
    return "none" if found == [] else (", ".join(found) if isinstance(found, list) else str(found))


def scale_report(results: list[dict], n: int, sizes: Sizes, ring_t, parts=PARTS) -> str:
    """Markdown: one table per part, how each number is computed, and notes for failures."""
    notes = report.Notes()

    def note(result):  # one note per measurement kind and reason (not per sequence length)
        return notes.cell(result["config"].get("name", result["contender"]), result["status"],
                          result.get("reason", ""))

    def find(part, name, devices, **fields):
        for r in reversed(results):  # the latest measurement of that point
            c = r["config"]
            if (c.get("part"), c.get("name"), c.get("devices")) == (part, name, devices) and \
                    all(c.get(k) == v for k, v in fields.items()):
                return r
        return None

    def ms_cell(value, measured):  # a failed measurement explains a missing number
        failed = [r for r in measured if r is not None and r["status"] != OK]
        return note(failed[0]) if value is None and failed else _fmt(value)

    sections = []

    def add(part, text):
        if part in parts:
            sections.append(text)

    if n <= 1:
        sections.append("**Only 1 device visible: N=1 only** (no multi-device numbers).")

    # 1. Attention.
    flops = _causal_fwd_bwd_flops(sizes.attn_t, sizes.attn_d, sizes.attn_batch, sizes.attn_heads)
    base = _ok_ms(find(ATTENTION, SHARDED_ATTENTION, 1))
    rows = []
    for count in device_counts(n):
        r = find(ATTENTION, SHARDED_ATTENTION, count)
        ms = _ok_ms(r)
        speedup = base / ms if base and ms else None
        rows.append([str(count), str(sizes.attn_batch), str(sizes.attn_batch // count),
                     ms_cell(ms, [r]), _fmt(_tflops(flops, ms, count)), _fmt(speedup, "x"),
                     _fmt(speedup and 100 * speedup / count, "%"), _collectives_cell(r)])
    add(ATTENTION,
        f"### 1. Batch-sharded attention: flash_attention fwd+bwd, causal, D={sizes.attn_d}, "
        f"T={sizes.attn_t}, global batch {sizes.attn_batch} x {sizes.attn_heads} heads\n\n"
        + report.markdown_table(["devices", "global batch", "batch per device", "time (ms)",
                                 "TFLOP/s per device", "speedup", "efficiency",
                                 "collectives"], rows)
        + "\n\nspeedup = time on 1 device / time on N; efficiency = speedup / N. TFLOP/s "
          "counts the causal fwd+bwd matmul FLOPs (3.5 x 2*B*H*T*T*D). A batch-sharded "
          "call needs no collective.")

    # 2. Data-parallel BasedLM.
    base_r = find(LM, LM_STEP, 1, batch=sizes.lm_batch)
    base_ms = _ok_ms(base_r)
    base_per_s = base_ms and sizes.lm_batch * sizes.lm_seq / (base_ms * 1e-3)
    rows = []
    for count in device_counts(n):
        for batch in lm_batches(sizes.lm_batch, count):
            r = find(LM, LM_STEP, count, batch=batch)
            ms = _ok_ms(r)
            per_s = ms and batch * sizes.lm_seq / (ms * 1e-3)
            loss = r["metrics"].get("first_step_loss") if ms else None
            rows.append([str(count), str(batch), str(batch // count), ms_cell(ms, [r]),
                         _fmt(per_s), _fmt(per_s and per_s / count),
                         _fmt(per_s / base_per_s if per_s and base_per_s else None, "x"),
                         _collectives_cell(r), _fmt(loss)])
    backend = (base_r or {}).get("config", {}).get("backend", "?")
    add(LM,
        f"### 2. Data-parallel BasedLM training step (layers {'-'.join(sizes.lm_layers)}, "
        f"d_model {sizes.lm_d_model}, seq {sizes.lm_seq}, vocab {sizes.lm_vocab}, bf16 "
        f"activations, adamw, backend={backend!r})\n\n"
        + report.markdown_table(["devices", "global batch", "batch per device", "step (ms)",
                                 "tokens/s", "tokens/s per device", "speedup", "collectives",
                                 "loss (1st step)"], rows)
        + f"\n\ntokens/s = global batch x {sizes.lm_seq} tokens / step time; speedup = "
          "tokens/s on N devices / on 1 device at the base batch. On N devices the step runs "
          "at the same global batch (strong scaling: each device gets 1/N of it) and at N "
          "times it (weak scaling: the same batch per device, how data-parallel training is "
          "run). Parameters are replicated; the gradients are all-reduced (the only "
          "collective expected).")

    # 3. Ring attention, and the estimate from its pieces timed alone.
    rows, step_rows = [], []
    for t in ring_t:
        flash_r = find(RING, FLASH_WHOLE, 1, t=t)
        flash_ms = _ok_ms(flash_r)
        steps = [(b.count, find(RING, b.name, 1, t=t)) for b in ring_step_blocks(t, max(n, 2))]
        sends = [(count, find(RING, name, n, t=t))
                 for count, name in zip(ring_transfers(max(n, 2)), (SEND_KV, SEND_DKV))]
        compute, comm = _weighted_ms(steps), _weighted_ms(sends)
        row = [report.short_count(t), ms_cell(flash_ms, [flash_r])]
        for name in (RING_ATTENTION, RING_ATTENTION_LHS):
            ring_r = find(RING, name, n, t=t)
            ring_ms = _ok_ms(ring_r)
            estimate = (hidden_comm(ring_ms, compute, comm)
                        if None not in (ring_ms, compute, comm) else {})
            fraction = estimate.get("hidden_fraction")
            row += [ms_cell(ring_ms, [ring_r]),
                    _fmt(flash_ms / ring_ms if flash_ms and ring_ms else None, "x"),
                    _fmt(estimate.get("overhead_ms")),
                    "-" if fraction is None else f"{100 * fraction:.0f}%"]
        rows.append(row + [ms_cell(compute, [r for _, r in steps]),
                           ms_cell(comm, [r for _, r in sends])])
        step_rows.append([report.short_count(t)] + [
            ms_cell(_ok_ms(r), [r]) for _, r in steps + sends])
    block_names = [f"{b.name.split(': ')[-1]} x{b.count} (ms)"
                   for b in ring_step_blocks(max(ring_t), max(n, 2))]
    send_names = [f"{name.split(': ')[-1]} x{count} (ms)"
                  for count, name in zip(ring_transfers(max(n, 2)), (SEND_KV, SEND_DKV))]
    add(RING,
        f"### 3. Ring attention on {n} device(s) vs flash_attention on 1: fwd+bwd, causal, "
        f"load-balanced, D={sizes.ring_d}, H={sizes.ring_heads}, B={sizes.ring_batch}\n\n"
        + report.markdown_table(
            ["T", "flash 1 dev (ms)", f"ring {n} dev (ms)", "speedup", "overhead (ms)",
             "comm hidden", f"ring {n} dev, LHS (ms)", "speedup, LHS", "overhead, LHS (ms)",
             "comm hidden, LHS", "sum of steps (ms)", "comm alone (ms)"], rows)
        + "\n\nPer step, each piece timed alone:\n\n"
        + report.markdown_table(["T"] + block_names + send_names, step_rows)
        + "\n\nspeedup = flash_attention on 1 device / ring on N (ideal: N). \"LHS\": the same "
          "program compiled with XLA's latency-hiding scheduler (compile option "
          "xla_gpu_enable_latency_hiding_scheduler=True).\n\n"
          "How the estimate is computed:\n"
          "- sum of steps = t(diagonal block: causal, T/N x T/N) + (N-1) x t(off-diagonal "
          "block: unmasked, T/N queries x T/2N keys), each timed alone as flash_attention "
          "fwd+bwd on one device: the attention work one device does in the ring.\n"
          "- overhead = ring time - sum of steps: exposed communication plus the merges and "
          "bookkeeping of the ring.\n"
          "- comm alone = 2(N-1) x t(send K,V bf16) + (N-1) x t(send dK,dV f32), each one "
          "lax.ppermute of one device's block (as one payload) around the ring, timed alone "
          "(the ring sends the dK,dV sums of N-2 hops in one payload with the next K,V).\n"
          "- comm hidden = (comm alone - max(overhead, 0)) / comm alone, clipped to [0, 100%]: "
          "a lower bound on the share of communication overlapped with computation.")

    # 4. The sequence-sharded flash_attention.
    rows = []
    for t in ring_t:
        flash_r = find(RING, FLASH_WHOLE, 1, t=t)
        flash_ms = _ok_ms(flash_r)
        row = [report.short_count(t), str(sizes.ring_heads), ms_cell(flash_ms, [flash_r])]
        plan = "-"
        for name in (SEQUENCE_SHARDED, SEQUENCE_SHARDED_LHS):
            r = find(SEQUENCE, name, n, t=t)
            ms = _ok_ms(r)
            row += [ms_cell(ms, [r]), _fmt(flash_ms / ms if flash_ms and ms else None, "x")]
            if ms:
                plan = r["metrics"].get("plan", plan)
        rows.append(row + [plan, _collectives_cell(find(SEQUENCE, SEQUENCE_SHARDED, n, t=t))])
        gqa_flash = find(SEQUENCE, FLASH_WHOLE_GQA, 1, t=t)
        gqa_ms = _ok_ms(gqa_flash)
        for exchange in ("ring", "all_gather"):
            r = find(SEQUENCE, SEQUENCE_GQA, n, t=t, exchange=exchange)
            if r is None:
                continue
            ms = _ok_ms(r)
            rows.append([report.short_count(t),
                         f"{sizes.ring_heads} (KV {sizes.ring_gqa_kv_heads})",
                         ms_cell(gqa_ms, [gqa_flash]), "-", "-", ms_cell(ms, [r]),
                         _fmt(gqa_ms / ms if gqa_ms and ms else None, "x"),
                         f"{exchange} (forced)", _collectives_cell(r)])
    add(SEQUENCE,
        f"### 4. flash_attention on a sequence-sharded input (plain jit, NamedSharding over T) "
        f"on {n} device(s) vs 1: fwd+bwd, causal, D={sizes.ring_d}, B={sizes.ring_batch}\n\n"
        + report.markdown_table(
            ["T", "heads", "flash 1 dev (ms)", f"sharded {n} dev (ms)", "speedup",
             f"sharded {n} dev, LHS (ms)", "speedup, LHS", "plan (K/V exchange, layout)",
             "collectives"], rows)
        + "\n\nThe user's call is unchanged (flash_attention under jit on arrays sharded over "
          "the sequence); the partitioning rule runs it context-parallel (no gather of Q). "
          "Plan: how K/V reach the queries (ring / all_gather) and the layout the work is done "
          "in (load_balanced: the shards are permuted into it and back, so that causal work "
          "is even). The GQA rows force the exchange both ways (TK_JAX_CONTEXT_PARALLEL), "
          "compiled with the latency-hiding scheduler.")

    if (text := notes.text()):
        sections.append(text)
    return "\n\n".join(sections)


# ---------------------------------------------------------------------------------------------
# Entry point (called by __main__.py).

def _sizes_and_lengths(args) -> tuple[Sizes, tuple]:
    sizes = TINY if args.tiny else FULL
    return sizes, tuple(args.t) if args.t else sizes.ring_t


def chosen_parts(args) -> tuple:
    """The parts --contenders names (all by default); ValueError for an unknown one."""
    if not args.contenders:
        return PARTS
    unknown = [p for p in args.contenders if p not in PARTS]
    if unknown:
        raise ValueError(f"scale: unknown part(s) {unknown} in --contenders; the parts are "
                         f"{', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in args.contenders)


def describe_plan(args, num_devices: int) -> str:
    sizes, ring_t = _sizes_and_lengths(args)
    counts = " and ".join(str(c) for c in device_counts(num_devices))
    lines = [f"scale: on {counts} device(s) of {num_devices} visible",
             f"  1. flash_attention fwd+bwd, batch-sharded jit: B={sizes.attn_batch} "
             f"H={sizes.attn_heads} T={sizes.attn_t} D={sizes.attn_d} causal",
             f"  2. BasedLM train step, data-parallel jit: batch {sizes.lm_batch} (and "
             f"{sizes.lm_batch} per device) x seq "
             f"{sizes.lm_seq}, layers {'-'.join(sizes.lm_layers)}, d_model {sizes.lm_d_model}",
             f"  3. ring_attention (causal, load-balanced) vs flash_attention on 1 device: "
             f"T={','.join(map(str, ring_t))} B={sizes.ring_batch} H={sizes.ring_heads} "
             f"D={sizes.ring_d}; default and latency-hiding scheduler; plus its steps and "
             f"transfers timed alone",
             f"  4. flash_attention on a sequence-sharded input (jit): the same T and shapes; "
             f"GQA (KV heads {sizes.ring_gqa_kv_heads}) at T={ring_t[0]}, ring vs all-gather"]
    parts = chosen_parts(args)
    lines = lines[:1] + [line for line, part in zip(lines[1:], PARTS) if part in parts]
    if num_devices <= 1:
        lines.append("  only 1 device visible: N=1 only (ring attention is skipped)")
    return "\n".join(lines)


def run_suite(args, environment: dict, card: str) -> int:
    """`python3 -m bench scale`: measure, print the tables, write JSON and markdown."""
    import jax

    ignored = [flag for flag, given in (("--quick", args.quick), ("--d", args.d),
                                        ("--fwd-only", args.fwd_only),
                                        ("--causal", args.causal != "both"),
                                        ("--merge", args.merge)) if given]
    if ignored:
        print(f"note: {', '.join(ignored)} do(es) not apply to the scale suite (ignored)")
    devices = jax.devices()
    parts = chosen_parts(args)
    plan = describe_plan(args, len(devices))
    print("tk_jax benchmark")
    print("\n".join(f"  {line}" for line in report.environment_lines(environment)) + "\n")
    print(plan + "\n", flush=True)
    if args.list or args.dry_run:
        return 0

    sizes, ring_t = _sizes_and_lengths(args)
    backend = args.tk_backend
    # The LM mixes layers; "auto" lets each use its kernel where one exists for its inputs.
    lm_backend = "reference" if backend == "reference" else "auto"
    stem = os.path.join(args.out, f"{SUITE}-{card}")
    document = {"suite": SUITE, "card": card, "command": args.command,
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
                "environment": environment, "devices": len(devices),
                "device_kinds": sorted({d.device_kind for d in devices}),
                "sizes": dataclasses.asdict(sizes), "ring_t": list(ring_t),
                "backend": backend, "parts": list(parts), "results": []}
    rec = Recorder(document, stem + ".json", reps=args.reps, verbose=args.verbose)
    started = time.perf_counter()
    try:
        measure_all(rec, devices, sizes, backend=backend, lm_backend=lm_backend, ring_t=ring_t,
                    parts=parts)
    finally:  # also on Ctrl-C: report what was measured
        document["elapsed_s"] = round(time.perf_counter() - started, 1)
        report.write_json(stem + ".json", document)
        header = report.environment_lines(environment) + [
            f"devices: {len(devices)} x {', '.join(document['device_kinds'])}",
            f"attention backend: {backend}; reps per point: {args.reps} (median reported)",
            f"elapsed: {document['elapsed_s']} s"]
        text = "\n".join([f"# scale on {card}", "", "\n".join(f"- {h}" for h in header), "",
                          scale_report(document["results"], len(devices), sizes, ring_t,
                                       parts)])
        print("\n" + text + "\n")
        report.write_text(stem + ".md", text)
        print(f"wrote {stem}.json, {stem}.md", flush=True)
    return 0
