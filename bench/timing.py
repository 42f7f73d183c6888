"""How one prepared call is timed. Every contender, JAX or PyTorch, goes through `measure`.

A sample is the wall time of a loop of `calls` back-to-back calls divided by `calls`; the loop
is long enough (about `min_rep_seconds`) that launch latency and the final synchronisation are
amortised. The reported time is the median sample over `reps` repeats, after warm-up (compile,
autotuning, allocator growth).

`measure_interleaved` times several runners of one configuration in turns, one sample of each
per round, after unrecorded turns that bring the card to the clocks it sustains, so that every
runner is timed in the same state of the card (its power limit sets the clocks).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Protocol

# Hopper's L2 is 50 MB. Inputs that fit in it would be served from cache when the same
# arrays are passed again, so small problems rotate among several input sets.
L2_BYTES = 50 * 2**20


def input_sets_needed(bytes_per_set: int, max_sets: int = 3) -> int:
    """How many distinct input sets to rotate through so that consecutive calls do not
    find their inputs in L2: enough sets to cover twice the L2 size, at most `max_sets`."""
    if bytes_per_set <= 0:
        return max_sets
    return max(1, min(max_sets, math.ceil(2 * L2_BYTES / bytes_per_set)))


class Clock(Protocol):
    """Measures device time of the work queued between start() and stop()."""

    def start(self) -> Any: ...

    def stop(self, token: Any, last_output: Any) -> float:
        """Seconds since start(), once the work that produced `last_output` has finished."""
        ...

    def sync(self, last_output: Any) -> None: ...


class JaxClock:
    """Host clock around JAX's asynchronous dispatch: the queue is drained before start, and
    stop waits for the last output (XLA runs calls on one stream in order)."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, token: float, last_output: Any) -> float:
        self.sync(last_output)
        return time.perf_counter() - token

    def sync(self, last_output: Any) -> None:
        import jax

        jax.block_until_ready(last_output)


class TorchCudaClock:
    """CUDA events recorded on PyTorch's current stream: device time, host gaps included."""

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def start(self):
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, token, last_output: Any) -> float:
        end = self._torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return token.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds

    def sync(self, last_output: Any) -> None:
        self._torch.cuda.synchronize()


@dataclasses.dataclass
class Runner:
    """A contender compiled for one configuration, ready to be timed.

    `call(i)` runs it on input set `i` (0 <= i < n_sets) and returns its output without
    waiting for it; `clock` knows how to wait. `release`, if given, is called once the runner
    is dropped (e.g. to hand PyTorch's cached memory back before JAX needs it). `info` holds
    what the contender chose while preparing (e.g. FA3's num_splits); it is copied into the
    outcome's metrics.
    """

    call: Callable[[int], Any]
    n_sets: int
    clock: Clock
    release: Callable[[], None] | None = None
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    max_s: float
    reps: int
    calls_per_rep: int


def fwd_bwd(attend: Callable) -> Callable:
    """attend(q, k, v) -> o  to  step(q, k, v, cotangent) -> (o, (dq, dk, dv))."""
    import jax

    def step(q, k, v, cotangent):
        o, pullback = jax.vjp(attend, q, k, v)
        return o, pullback(cotangent)
    return step


def compiled_jax_runner(attend, sets, *, backward: bool, constants: tuple = ()) -> Runner:
    """A Runner over input sets for `attend(q, k, v, *constants) -> o` (forward), or for its
    VJP in q, k, v with the set's fourth entry as the output cotangent (forward + backward).
    q, k, v may be pytrees (e.g. tuples of per-document arrays). `constants` (e.g. segment
    ids) are passed to every call as arguments, not differentiated. Compiled here, so that
    argument errors raised while tracing surface before any timing."""
    import jax

    if constants:
        if backward:
            def step(q, k, v, cotangent, *extra):
                return fwd_bwd(lambda q, k, v: attend(q, k, v, *extra))(q, k, v, cotangent)
        else:
            step = attend
    else:
        step = fwd_bwd(attend) if backward else attend
    compiled = jax.jit(step).lower(*sets[0], *constants).compile()
    return Runner(call=lambda i: compiled(*sets[i], *constants), n_sets=len(sets),
                  clock=JaxClock())


def _warm_up(runner: Runner, *, warmup: int, min_rep_seconds: float, max_calls_per_rep: int) -> int:
    """Runs max(warmup, n_sets) calls (every input set at least once), then returns how many
    calls make a sample about `min_rep_seconds` long, decided by one timed call."""
    call, n_sets, clock = runner.call, runner.n_sets, runner.clock
    out = None
    for i in range(max(warmup, n_sets)):  # every input set at least once
        out = call(i % n_sets)
    clock.sync(out)
    token = clock.start()
    out = call(0)
    one_call = max(clock.stop(token, out), 1e-7)
    return max(1, min(max_calls_per_rep, math.ceil(min_rep_seconds / one_call)))


def _sample(runner: Runner, calls: int) -> float:
    """Seconds per call over `calls` back-to-back calls. The clock's stop waits for the device,
    so the next sample (of this runner or another) starts on an idle device."""
    token = runner.clock.start()
    out = None
    for c in range(calls):
        out = runner.call(c % runner.n_sets)
    return runner.clock.stop(token, out) / calls


def measure(runner: Runner, *, reps: int = 10, warmup: int = 3, min_rep_seconds: float = 0.02,
            max_calls_per_rep: int = 1000) -> Timing:
    """Median seconds per call of `runner` (see the module docstring); raises what it raised."""
    result = measure_interleaved([runner], reps=reps, warmup=warmup, min_rep_seconds=min_rep_seconds,
                                 max_calls_per_rep=max_calls_per_rep)[0]
    if isinstance(result, Exception):
        raise result
    return result


def measure_interleaved(runners: list[Runner], *, reps: int = 10, warmup: int = 3,
                        min_rep_seconds: float = 0.02, max_calls_per_rep: int = 1000,
                        settle_seconds: float = 0.0) -> list[Timing | Exception]:
    """`measure` for several runners at once: after every runner's warm-up, round r takes one
    sample of each, starting from runner r mod n (the cyclic order stays: runner i mostly
    follows runner i - 1).
    Before the first recorded round, unrecorded rounds run for `settle_seconds`: an H100 runs
    attention at its power limit, and its power reading averages over about a second, so the
    first tenths of a second of a burst run at higher clocks than a training step keeps
    (docs/DESIGN.md). Returns, per runner, its Timing or the exception it raised (it
    then leaves the rounds)."""
    if reps < 1:
        raise ValueError(f"measure: reps must be >= 1, got {reps}")
    results: list[Timing | Exception | None] = [None] * len(runners)
    calls: dict[int, int] = {}
    for i, runner in enumerate(runners):
        try:
            calls[i] = _warm_up(runner, warmup=warmup, min_rep_seconds=min_rep_seconds,
                                max_calls_per_rep=max_calls_per_rep)
        except Exception as err:  # a failing runner must not stop the others
            results[i] = err
    samples: dict[int, list[float]] = {i: [] for i in calls}
    n = len(runners)

    def one_round(r: int, record: bool) -> None:
        for i in [(r + j) % n for j in range(n)]:
            if i not in samples or results[i] is not None:
                continue
            try:
                seconds = _sample(runners[i], calls[i])
            except Exception as err:
                results[i] = err
                continue
            if record:
                samples[i].append(seconds)

    settle_until = time.perf_counter() + settle_seconds
    while time.perf_counter() < settle_until and any(results[i] is None for i in samples):
        one_round(0, record=False)
    for r in range(reps):
        one_round(r, record=True)
    for i, taken in samples.items():
        if results[i] is None:
            results[i] = Timing(median_s=statistics.median(taken), min_s=min(taken), max_s=max(taken),
                                reps=len(taken), calls_per_rep=calls[i])
    return results  # type: ignore[return-value]


def jax_dispatch_overhead_seconds(reps: int = 5) -> float:
    """Per-call time of a trivial jitted function of three arguments: results close to this
    number measure the host, not the kernel."""
    import jax
    import jax.numpy as jnp

    args = [jnp.ones((8,), jnp.float32) for _ in range(3)]
    trivial = jax.jit(lambda a, b, c: a + b + c)
    runner = Runner(call=lambda i: trivial(*args), n_sets=1, clock=JaxClock())
    return measure(runner, reps=reps, min_rep_seconds=0.01).median_s
