"""Benchmarks of tk_jax's kernels against their peers, run from a checkout:
`python3 -m bench --help`. A development tool, not part of the installed library.

Layout of this package:
    __main__.py   command line: parses options, runs suites, writes reports
    attention.py  flash attention configurations and contenders (tk, cuDNN, FA3, XLA)
    gqa.py        grouped-query attention: every Hq/Hkv ratio (tk, cuDNN, FA3)
    packed.py     rows packed with documents: segment ids (tk) vs varlen (FA3) vs per document
    decode.py     one decode step against a K/V cache: bytes read per second (tk, cuDNN, FA3)
    based.py      Based linear attention contenders (tk, plain-JAX reference, fla) and decode
    scale.py      multi-device scaling (batch-sharded attention, data-parallel LM, ring)
    timing.py     the one timing routine every contender goes through
    report.py     markdown tables, JSON and plots
    __init__.py   (this file) the shared vocabulary: Contender, Outcome, and the loop that
                  measures every contender on every configuration

Every peer is optional: a contender that cannot be imported, does not support a configuration
or fails is recorded as such in the results, and the run goes on.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import importlib.metadata
import math
import traceback
from typing import Any, Callable, Iterable

from bench.timing import Runner, Timing, measure_interleaved

# Roles decide what the "tk / best peer" ratio compares.
OURS = "ours"          # tk_jax's kernel: the numerator
PEER = "peer"          # other libraries: the best of them is the denominator
BASELINE = "baseline"  # shown for context only (e.g. tk_jax's own plain-JAX reference)

# Outcome statuses.
OK = "ok"
UNSUPPORTED = "unsupported"   # the contender declines this configuration
SKIPPED = "skipped"           # we chose not to run it (e.g. XLA at long sequences)
UNAVAILABLE = "unavailable"   # not importable on this machine
ERROR = "error"               # it raised while compiling or running


class Unsupported(Exception):
    """Raised by a contender's `prepare` when it does not handle a configuration."""


class Skipped(Exception):
    """Raised by a contender's `prepare` when the benchmark deliberately leaves it out."""


@dataclasses.dataclass(frozen=True)
class Contender:
    """One implementation being timed.

    name:          short column name ("tk", "cudnn", ...)
    description:   what exactly is called, for --list and the report
    role:          OURS, PEER or BASELINE
    unavailable:   returns None when usable here, else a sentence saying why not
    prepare:       prepare(config) -> Runner; compiles and allocates inputs; may raise
                   Unsupported or Skipped
    version:       returns the peer's version string (or "")
    """

    name: str
    description: str
    role: str
    unavailable: Callable[[], str | None]
    prepare: Callable[[Any], Runner]
    version: Callable[[], str] = lambda: ""


@dataclasses.dataclass
class Outcome:
    """What happened to one contender on one configuration."""

    config: dict
    contender: str
    role: str
    status: str
    reason: str = ""
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    reps: int | None = None
    calls_per_rep: int | None = None
    metrics: dict = dataclasses.field(default_factory=dict)  # e.g. {"tflops": 512.3}


def module_unavailable(module: str) -> str | None:
    """None when `module` imports, else why not (for Contender.unavailable)."""
    try:
        importlib.import_module(module)
    except Exception as err:  # ImportError, or a binary extension that fails to load
        return f"cannot import {module}: {short_error(err)}"
    return None


def parse_int_list(text: str) -> list[int]:
    """'512,1k,16k' -> [512, 1024, 16384] (an argparse type)."""
    values = []
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        scale = 1024 if item.lower().endswith("k") else 1
        number = item[:-1] if scale == 1024 else item
        try:
            value = int(number) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers such as 512,1k,16k; got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"values must be positive, got {item!r}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
    return values


def pass_name(backward: bool) -> str:
    return "fwd+bwd" if backward else "fwd"


def config_dict(config) -> dict:
    """A configuration dataclass as the results record it: its fields and its pass."""
    return {**dataclasses.asdict(config), "pass": pass_name(config.backward)}


def availability(contender: Contender) -> str:
    """'version X', 'available', or 'UNAVAILABLE: why not'."""
    why_not = contender.unavailable()
    if why_not is not None:
        return f"UNAVAILABLE: {why_not}"
    version = contender.version()
    return f"version {version}" if version else "available"


def distribution_version(name: str) -> str:
    """Installed version of a distribution, or "" when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def random_normal_sets(shapes: list[tuple[int, ...]], n_sets: int, *, seed: int = 0,
                       dtype: str = "bfloat16") -> list[tuple]:
    """`n_sets` tuples of random normal JAX arrays with the given shapes, on the default device
    (random, never zeros: a kernel may take shortcuts on zeros)."""
    import jax

    make = _normal_maker(tuple(tuple(s) for s in shapes), n_sets, dtype)
    return make(jax.random.key(seed))


@functools.lru_cache(maxsize=8)
def _normal_maker(shapes: tuple, n_sets: int, dtype: str):
    """One compiled function drawing a single flat sample and cutting it into the arrays:
    one random draw compiles far faster than one per array. Cached so contenders on the same
    configuration reuse it."""
    import jax

    sizes = [math.prod(shape) for shape in shapes]

    def make(key):
        flat = jax.random.normal(key, (n_sets * sum(sizes),), dtype)
        sets, offset = [], 0
        for _ in range(n_sets):
            arrays = []
            for shape, size in zip(shapes, sizes):
                arrays.append(flat[offset:offset + size].reshape(shape))
                offset += size
            sets.append(tuple(arrays))
        return sets

    return jax.jit(make)


def short_error(err: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, cut to `limit` characters."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def prepare_runner(contender: Contender, config: Any, verbose_errors: bool = False) -> Runner | tuple[str, str]:
    """The contender's runner for `config`, or (status, reason) when there is none; never raises
    (a failing peer must not end a run). Also used by scripts that time or profile one contender."""
    why_not = contender.unavailable()
    if why_not is not None:
        return UNAVAILABLE, why_not
    try:
        return contender.prepare(config)
    except Unsupported as err:
        return UNSUPPORTED, str(err)
    except Skipped as err:
        return SKIPPED, str(err)
    except Exception as err:  # a failing peer must not end the run
        if verbose_errors:
            traceback.print_exc()
        return ERROR, short_error(err)


def _release(runners: list[Runner]) -> None:
    """Drop inputs and executables before the next configuration allocates its own."""
    hooks = [r.release for r in runners if r.release is not None]
    runners.clear()
    gc.collect()
    for hook in hooks:
        hook()


def _outcome(contender: Contender, config_dict: dict, status: str, reason: str = "",
             timing: Timing | None = None, info: dict | None = None) -> Outcome:
    measured = {} if timing is None else dict(
        median_ms=timing.median_s * 1e3, min_ms=timing.min_s * 1e3, max_ms=timing.max_s * 1e3,
        reps=timing.reps, calls_per_rep=timing.calls_per_rep)
    return Outcome(config=config_dict, contender=contender.name, role=contender.role,
                   status=status, reason=reason, metrics=dict(info or {}), **measured)


def run_one(contender: Contender, config: Any, config_dict: dict, *, reps: int,
            verbose_errors: bool = False, min_rep_seconds: float = 0.02) -> Outcome:
    """Prepare and time one contender on one configuration; never raises (except on Ctrl-C)."""
    return run_interleaved([contender], config, config_dict, reps=reps, verbose_errors=verbose_errors,
                           min_rep_seconds=min_rep_seconds)[0]


def run_interleaved(contenders: list[Contender], config: Any, config_dict: dict, *, reps: int,
                    verbose_errors: bool = False, settle_seconds: float = 0.0,
                    min_rep_seconds: float = 0.02) -> list[Outcome]:
    """Every contender on one configuration, prepared first and then timed in turns after
    `settle_seconds` of unrecorded turns (timing.measure_interleaved), so that all of them run
    in the same state of the card's clocks and power; each sample about `min_rep_seconds`
    long. One outcome per contender, in order; never raises (except on Ctrl-C)."""
    prepared = [prepare_runner(c, config, verbose_errors) for c in contenders]
    runners = [p for p in prepared if isinstance(p, Runner)]
    failures = [None if isinstance(p, Runner) else p for p in prepared]
    infos = iter([r.info for r in runners])
    del prepared  # the runners list holds the only references, for _release
    try:
        timings = iter(measure_interleaved(runners, reps=reps, settle_seconds=settle_seconds,
                                           min_rep_seconds=min_rep_seconds))
    finally:
        _release(runners)
    outcomes = []
    for contender, failure in zip(contenders, failures):
        if failure is not None:
            outcomes.append(_outcome(contender, config_dict, *failure))
            continue
        result, info = next(timings), next(infos)
        if isinstance(result, Exception):
            if verbose_errors:
                traceback.print_exception(result)
            outcomes.append(_outcome(contender, config_dict, ERROR, short_error(result), info=info))
        else:
            outcomes.append(_outcome(contender, config_dict, OK, timing=result, info=info))
    return outcomes


def run_grid(configs: Iterable[Any], contenders: list[Contender], *, reps: int,
             to_dict: Callable[[Any], dict], add_metrics: Callable[[Any, Outcome], None],
             on_outcome: Callable[[Any, Outcome], None],
             verbose_errors: bool = False, interleave: bool = False,
             settle_seconds: float = 0.0) -> list[Outcome]:
    """The benchmark loop: every contender on every configuration, in order.

    `add_metrics(config, outcome)` fills outcome.metrics for successful runs;
    `on_outcome(config, outcome)` is called after each measurement (progress, incremental JSON).
    With `interleave`, a configuration's contenders are all prepared and then timed in turns
    after `settle_seconds` (run_interleaved); else one after the other, each released before
    the next is prepared.
    """
    outcomes = []
    for config in configs:
        if interleave:
            results = run_interleaved(contenders, config, to_dict(config), reps=reps,
                                      verbose_errors=verbose_errors, settle_seconds=settle_seconds)
        else:
            results = (run_one(c, config, to_dict(config), reps=reps, verbose_errors=verbose_errors)
                       for c in contenders)
        for result in results:
            if result.status == OK:
                add_metrics(config, result)
            outcomes.append(result)
            on_outcome(config, result)
    return outcomes
