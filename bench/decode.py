"""Decode benchmark: one attention step of a few query tokens against a long K/V cache, in
K/V bytes read per second (bf16, every query token sees the whole cache: no mask).

K/V bytes of a cell = 2 (K and V) * B * S * Hkv * D * 2 bytes. Contenders, all on the same
cache arrays:
  tk              tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens)
  tk_flash        tk_jax.flash_attention(q, k, v) on the same K/V (the ordinary entry point)
  cudnn           jax.nn.dot_product_attention(implementation="cudnn")
  cudnn_lengths   the same with key_value_seq_lengths = cache_seqlens
  fa3             flash_attn3_jax.flash_mha_with_kvcache at its best num_splits: each of
                  --fa3-splits is compiled and timed briefly first, the fastest is timed with
                  the others (its value is in the table)
  tk_paged<P>     tk's kvcache call on the same buffer seen as pages of P tokens
                  ([B*S/P, P, Hkv, D], a free reshape) through a shuffled page table
  fa3_paged<P>    FA3 on the same pages and table, at its best num_splits (a baseline: it
                  says whether a paged cache's cost is the memory system's or the kernel's)
The device copy rate (read + write bytes of a large elementwise pass / time), measured in the
same run, is the reference line.

A cell's cache is read once per step; so that small caches are not served from the 50 MB L2,
one timed call runs `steps` decode steps (distinct queries) rotating over `sets` copies of the
cache, enough to cover 2x the L2 where that fits in 16 steps; and so that a call is long
enough not to measure the host, a call reads at least 512 MiB (16 steps at most: at 128 MiB,
one step a call, the host's dispatch of each call showed in the time). Cells whose
cache would exceed --max-cache-gb are left out.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math

from bench import (BASELINE, OURS, PEER, Contender, Outcome, Unsupported, distribution_version,
                   module_unavailable, short_error)
from bench.timing import L2_BYTES, JaxClock, Runner, measure

BATCHES = (1, 8, 64)
CACHES = (4096, 32768, 131072)
HEADS = ((32, 32), (32, 8), (64, 8), (32, 1))
D_GRID = (128,)                   # default; --full adds 64
FULL_D = (64, 128)
Q_TOKENS = (1,)                   # default; --full adds 4
FULL_Q_TOKENS = (1, 4)
PAGE_SIZES = (16, 64, 256)
FA3_SPLITS = (1, 2, 4, 8, 16)     # flash_mha_with_kvcache rejects num_splits < 1 (no "auto")
MAX_CACHE_GIB = 40.0
TARGET_CALL_BYTES = 512 * 2**20   # K/V bytes one timed call reads at least
MAX_STEPS = 16
BIG_CELL_BYTES = 64 * 2**20       # the ">= 64 MB of K/V" cells
QUICK_CELLS = ((1, 131072, 32, 8), (64, 4096, 32, 8), (8, 32768, 32, 32), (8, 32768, 32, 1))
TINY = dict(batches=(1, 2), caches=(64, 128), heads=((4, 4), (4, 1)), d=(32,), q_tokens=(1,),
            page_sizes=(16,), copy_bytes=4 * 2**20, max_steps=2)
COPY_BYTES = 2 * 2**30
SECONDS_PER_CELL = 4.0            # rough H100 cost of one cell (about 12 compiles, samples)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    d: int
    q_tokens: int
    hq: int
    hkv: int
    batch: int
    cache: int       # cache length S
    kv_mb: float     # K/V bytes of one step, MiB
    steps: int       # decode steps per timed call
    sets: int        # cache copies rotated over

    backward = False  # a class constant, not a field: decode is forward only

    @property
    def kv_bytes(self) -> int:
        return kv_bytes(self.batch, self.cache, self.hkv, self.d)

    def label(self) -> str:
        return (f"B={self.batch} S={self.cache} Hq/Hkv={self.hq}/{self.hkv} D={self.d} "
                f"q={self.q_tokens} ({self.kv_mb:.0f} MiB x{self.steps})")


def kv_bytes(batch: int, cache: int, hkv: int, d: int, itemsize: int = 2) -> int:
    return 2 * batch * cache * hkv * d * itemsize


def steps_and_sets(n_bytes: int, max_steps: int = MAX_STEPS) -> tuple[int, int]:
    """(steps per call, cache copies): a call reads >= TARGET_CALL_BYTES where max_steps
    allow, rotating over enough copies to cover 2x the L2 (at most one per step)."""
    steps = max(1, min(max_steps, math.ceil(TARGET_CALL_BYTES / n_bytes)))
    sets = max(1, min(steps, math.ceil(2 * L2_BYTES / n_bytes)))
    return steps, sets


def parse_heads(text: str) -> list[tuple[int, int]]:
    """'32/32,32/8' -> [(32, 32), (32, 8)] (an argparse type)."""
    import argparse

    pairs = []
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        try:
            hq, hkv = (int(x) for x in item.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected head pairs Hq/Hkv such as 32/8,64/8; got {text!r}") from None
        if hq <= 0 or hkv <= 0 or hq % hkv:
            raise argparse.ArgumentTypeError(
                f"{item}: need positive head counts with Hkv dividing Hq")
        pairs.append((hq, hkv))
    if not pairs:
        raise argparse.ArgumentTypeError(f"expected at least one Hq/Hkv pair, got {text!r}")
    return pairs


def make_configs(batches, caches, heads, d_values, q_tokens, *, max_cache_gib=MAX_CACHE_GIB,
                 cells=None, max_steps=MAX_STEPS) -> tuple[list[DecodeConfig], list[str]]:
    """The grid, ordered q tokens, D, heads, B, S; and notes on the cells left out (cache over
    `max_cache_gib`). `cells`, if given, keeps only these (B, S, Hq, Hkv)."""
    configs, notes = [], []
    for q, d, (hq, hkv), batch, cache in itertools.product(q_tokens, d_values, heads, batches,
                                                           caches):
        if cells is not None and (batch, cache, hq, hkv) not in cells:
            continue
        n = kv_bytes(batch, cache, hkv, d)
        if n > max_cache_gib * 2**30:
            notes.append(f"left out B={batch} S={cache} Hq/Hkv={hq}/{hkv} D={d} q={q}: "
                         f"{n / 2**30:.0f} GiB of K/V > {max_cache_gib:g} GiB")
            continue
        steps, sets = steps_and_sets(n, max_steps)
        configs.append(DecodeConfig(d=d, q_tokens=q, hq=hq, hkv=hkv, batch=batch, cache=cache,
                                    kv_mb=round(n / 2**20, 2), steps=steps, sets=sets))
    return configs, notes


def make_add_metrics(copy_rate: dict):
    """add_metrics for the plan: TB/s of K/V read, the time of one step, and the share of the
    copy rate measured in this run (`copy_rate["bytes_per_s"]`, once known)."""
    def add_metrics(config: DecodeConfig, outcome: Outcome) -> None:
        seconds_per_step = outcome.median_ms * 1e-3 / config.steps
        outcome.metrics["step_us"] = seconds_per_step * 1e6
        outcome.metrics["tb_per_s"] = config.kv_bytes / seconds_per_step / 1e12
        if copy_rate.get("bytes_per_s"):
            outcome.metrics["of_copy"] = (config.kv_bytes / seconds_per_step
                                          / copy_rate["bytes_per_s"])
    return add_metrics


# ---------------------------------------------------------------------------------------------
# Inputs, shared by every contender of a cell (a cache may take tens of GB).

def pseudo_random(shape, dtype, seed: int):
    """Values in [-1, 1] (in bf16) from a hash of each element's index: one fused elementwise
    pass that writes the array and nothing else (jax.random would need twice the array in
    temporaries, which the largest caches cannot afford). Random enough that no kernel takes
    a shortcut."""
    import numpy as np

    return _filler(tuple(shape), np.dtype(dtype).name)(
        np.uint32((seed * 0x9E3779B9 + 0x7F4A7C15) & 0xFFFFFFFF))


@functools.lru_cache(maxsize=16)
def _filler(shape: tuple, dtype: str):
    """pseudo_random's compiled fill for one shape and dtype; the seed is an argument."""
    import jax
    import jax.numpy as jnp

    def fill(seed):
        h = jnp.full(shape, seed, jnp.uint32)
        for axis in range(len(shape)):
            h = (h ^ jax.lax.broadcasted_iota(jnp.uint32, shape, axis)) * jnp.uint32(0x01000193)
            h = h ^ (h >> 15)
        h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
        h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
        h = h ^ (h >> 16)
        return ((h >> 8).astype(jnp.float32) * (2.0 ** -23) - 1.0).astype(dtype)

    return jax.jit(fill)


class _SharedInputs:
    """The inputs of the cell being measured; a new cell drops the previous one's first."""

    def __init__(self) -> None:
        self.config = None
        self.arrays = None

    def get(self, config: DecodeConfig) -> dict:
        if self.config != config:
            self.drop()
            self.arrays = _make_inputs(config)
            self.config = config
        return self.arrays

    def drop(self) -> None:
        import gc

        self.config = self.arrays = None
        gc.collect()


SHARED = _SharedInputs()


def _make_inputs(config: DecodeConfig) -> dict:
    import jax.numpy as jnp

    cache_shape = (config.batch, config.cache, config.hkv, config.d)
    q_shape = (config.batch, config.q_tokens, config.hq, config.d)
    ks = tuple(pseudo_random(cache_shape, jnp.bfloat16, 2 * i) for i in range(config.sets))
    vs = tuple(pseudo_random(cache_shape, jnp.bfloat16, 2 * i + 1) for i in range(config.sets))
    qs = tuple(pseudo_random(q_shape, jnp.bfloat16, 1000 + i) for i in range(config.steps))
    seqlens = jnp.full((config.batch,), config.cache, jnp.int32)
    return dict(qs=qs, ks=ks, vs=vs, seqlens=seqlens)


def page_table(config: DecodeConfig, page_size: int, seed: int = 0):
    """[B, S / page_size] int32: a random permutation of the pages of the whole buffer."""
    import jax.numpy as jnp
    import numpy as np

    pages = config.batch * config.cache // page_size
    order = np.random.default_rng([seed, page_size]).permutation(pages).astype(np.int32)
    return jnp.asarray(order.reshape(config.batch, config.cache // page_size))


def pages_of(config: DecodeConfig, page_size: int) -> tuple:
    """The shape of the cell's [B, S, Hkv, D] buffer seen as pages of page_size tokens (a free
    reshape); Unsupported where S is not a multiple of page_size."""
    if config.cache % page_size:
        raise Unsupported(f"cache length {config.cache} is not a multiple of {page_size}")
    return (-1, page_size, config.hkv, config.d)


def decode_runner(step, config: DecodeConfig, *extra, info: dict | None = None) -> Runner:
    """A Runner whose call runs config.steps decode steps, step j attending query set j to
    cache copy j mod config.sets: `step(q, k, v, seqlens, *extra) -> o` (o or a tuple whose
    first entry is o)."""
    import jax

    inputs = SHARED.get(config)

    def steps(qs, ks, vs, seqlens, *extra):
        outs = []
        for j, q in enumerate(qs):
            out = step(q, ks[j % len(ks)], vs[j % len(vs)], seqlens, *extra)
            outs.append(out[0] if isinstance(out, (tuple, list)) else out)
        return tuple(outs)

    args = (inputs["qs"], inputs["ks"], inputs["vs"], inputs["seqlens"], *extra)
    compiled = jax.jit(steps).lower(*args).compile()
    return Runner(call=lambda i: compiled(*args), n_sets=1, clock=JaxClock(),
                  release=SHARED.drop, info=dict(info or {}))


# ---------------------------------------------------------------------------------------------
# Contenders.

def _tk_name(base: str, backend: str) -> str:
    return base if backend == "kernel" else f"{base}_{backend}"


def kvcache_unavailable(needs: str | None = None) -> str | None:
    """None when tk_jax.flash_attention_with_kvcache exists (and takes `needs`), else why not."""
    why = module_unavailable("tk_jax")
    if why is not None:
        return why
    import tk_jax

    function = getattr(tk_jax, "flash_attention_with_kvcache", None)
    if function is None:
        return "tk_jax.flash_attention_with_kvcache does not exist (not implemented yet)"
    if needs is not None:
        try:
            if needs not in inspect.signature(function).parameters:
                return f"tk_jax.flash_attention_with_kvcache takes no {needs}"
        except (TypeError, ValueError):
            pass
    return None


def _declining(prepare):
    """ValueError from the kernel backend (it declines the inputs) -> Unsupported."""
    def wrapped(config):
        try:
            return prepare(config)
        except ValueError as err:
            raise Unsupported(short_error(err)) from None
    return wrapped


def tk_kvcache_contender(backend: str = "kernel") -> Contender:
    def prepare(config: DecodeConfig) -> Runner:
        import tk_jax

        def step(q, k, v, seqlens):
            return tk_jax.flash_attention_with_kvcache(q, k, v, seqlens, causal=False,
                                                       backend=backend)
        return decode_runner(step, config)

    return Contender(
        name=_tk_name("tk", backend),
        description=f'tk_jax.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, '
                    f'causal=False, backend="{backend}")',
        role=OURS if backend == "kernel" else BASELINE,
        unavailable=kvcache_unavailable, prepare=_declining(prepare),
        version=lambda: distribution_version("tk_jax"))


def tk_flash_contender(backend: str = "kernel") -> Contender:
    def prepare(config: DecodeConfig) -> Runner:
        import tk_jax

        def step(q, k, v, seqlens):
            return tk_jax.flash_attention(q, k, v, causal=False, backend=backend)
        return decode_runner(step, config)

    return Contender(
        name=_tk_name("tk_flash", backend),
        description=f'tk_jax.flash_attention(q, k, v, causal=False, backend="{backend}") on '
                    f'the same K/V',
        role=BASELINE, unavailable=lambda: module_unavailable("tk_jax"),
        prepare=_declining(prepare), version=lambda: distribution_version("tk_jax"))


def tk_paged_contender(page_size: int, backend: str = "kernel") -> Contender:
    def prepare(config: DecodeConfig) -> Runner:
        import tk_jax

        pool = pages_of(config, page_size)

        def step(q, k, v, seqlens, table):
            return tk_jax.flash_attention_with_kvcache(
                q, k.reshape(pool), v.reshape(pool), seqlens, page_table=table, causal=False,
                backend=backend)
        return decode_runner(step, config, page_table(config, page_size))

    return Contender(
        name=_tk_name(f"tk_paged{page_size}", backend),
        description=f"tk's kvcache call on pages of {page_size} tokens, shuffled page table",
        role=BASELINE, unavailable=lambda: kvcache_unavailable("page_table"),
        prepare=_declining(prepare), version=lambda: distribution_version("tk_jax"))


def cudnn_contender(with_lengths: bool) -> Contender:
    def prepare(config: DecodeConfig) -> Runner:
        import jax

        def step(q, k, v, seqlens):
            lengths = dict(key_value_seq_lengths=seqlens) if with_lengths else {}
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **lengths)
        return decode_runner(step, config)

    return Contender(
        name="cudnn_lengths" if with_lengths else "cudnn",
        description='jax.nn.dot_product_attention(implementation="cudnn"'
                    + (", key_value_seq_lengths=cache_seqlens)" if with_lengths else ")"),
        role=PEER, unavailable=lambda: None, prepare=prepare,
        version=lambda: distribution_version("jax"))


def brief_seconds(runner: Runner) -> float:
    """A short timing, enough to rank settings of one contender."""
    return measure(runner, reps=2, warmup=1, min_rep_seconds=0.005).median_s


def fastest_setting(builders: dict, name: str, *, per_call: int = 1,
                    time_runner=brief_seconds) -> Runner:
    """The runner of the fastest setting: builders maps each value of setting `name` to a
    function building its Runner. Settings that fail to build or run are skipped (and
    listed); the winner's info records its value and what every value took per step."""
    tried, best = {}, None
    for value, build in builders.items():
        try:
            runner = build()
            seconds = time_runner(runner)
        except Exception as err:  # a value the peer rejects: try the others
            tried[value] = f"error ({short_error(err, 80)})"
            continue
        tried[value] = f"{seconds / per_call * 1e6:.1f} us"
        if best is None or seconds < best[0]:
            best = (seconds, value, runner)
    if best is None:
        raise RuntimeError(f"every {name} failed: " +
                           "; ".join(f"{v}: {text}" for v, text in tried.items()))
    _, value, runner = best
    runner.info.update({name: value,
                        f"{name}_tried": ", ".join(f"{k}: {v}" for k, v in tried.items())})
    return runner


def fa3_contender(splits=FA3_SPLITS, page_size: int | None = None) -> Contender:
    """FA3 at its fastest num_splits; with page_size, on the same pages and shuffled table as
    tk_paged (a baseline: is a paged cache's loss against a contiguous one the kernel's or the
    memory system's?)."""
    # flash_attn3_jax.flash_mha_with_kvcache(q, k_cache, v_cache, k=None, v=None,
    # cache_seqlens=None, ..., page_table=None, softmax_scale=None, is_causal=False,
    # window_size=(-1, -1), num_splits=1, return_softmax_lse=False); forward only.
    def prepare(config: DecodeConfig) -> Runner:
        if config.d > 128:
            raise Unsupported(f"the flash_attn3_jax wheel supports head dim <= 128, got {config.d}")
        paged = page_size is not None
        pool = pages_of(config, page_size) if paged else None
        table = page_table(config, page_size) if paged else None
        from flash_attn3_jax import flash_mha_with_kvcache

        def build(n):
            if not paged:
                def step(q, k, v, seqlens):
                    return flash_mha_with_kvcache(q, k, v, cache_seqlens=seqlens, is_causal=False,
                                                  num_splits=n)
                return decode_runner(step, config)

            def paged_step(q, k, v, seqlens, table):
                return flash_mha_with_kvcache(q, k.reshape(pool), v.reshape(pool),
                                              cache_seqlens=seqlens, page_table=table,
                                              is_causal=False, num_splits=n)
            return decode_runner(paged_step, config, table)

        return fastest_setting({n: functools.partial(build, n) for n in splits},
                               "num_splits", per_call=config.steps)

    if page_size is None:
        name, role = "fa3", PEER
        description = (f"flash_attn3_jax.flash_mha_with_kvcache at the fastest num_splits of "
                       f"{', '.join(map(str, splits))} (timed briefly first)")
    else:
        name, role = f"fa3_paged{page_size}", BASELINE
        description = (f"flash_attn3_jax.flash_mha_with_kvcache on pages of {page_size} tokens, "
                       f"the shuffled page table of tk_paged{page_size}, at its fastest num_splits")
    return Contender(name=name, description=description, role=role,
                     unavailable=lambda: module_unavailable("flash_attn3_jax"),
                     prepare=prepare, version=lambda: distribution_version("flash_attn3_jax"))


def contenders(tk_backend: str = "kernel", page_sizes=PAGE_SIZES,
               fa3_splits=FA3_SPLITS) -> list[Contender]:
    return ([tk_kvcache_contender(tk_backend), tk_flash_contender(tk_backend),
             cudnn_contender(False), cudnn_contender(True), fa3_contender(fa3_splits)]
            + [tk_paged_contender(p, tk_backend) for p in page_sizes]
            + [fa3_contender(fa3_splits, p) for p in page_sizes])


def copy_rate(reps: int, n_bytes: int = COPY_BYTES) -> dict:
    """Read + write bytes per second of `x + 1` over an n_bytes float32 array, after warm-up.
    Float32, not the caches' bf16: XLA's bf16 `x + 1` streams slower than the card can (on an
    H200, 2 GiB: 3.27-3.28 TB/s in bf16, 4.16 in float32, same run), so it would understate
    the ceiling."""
    import jax
    import jax.numpy as jnp

    x = pseudo_random((n_bytes // 4,), jnp.float32, 7)
    compiled = jax.jit(lambda a: a + jnp.float32(1)).lower(x).compile()
    timing = measure(Runner(call=lambda i: compiled(x), n_sets=1, clock=JaxClock()), reps=reps)
    return {"bytes_per_s": 2 * n_bytes / timing.median_s, "array_bytes": n_bytes,
            "median_ms": timing.median_s * 1e3}


# ---------------------------------------------------------------------------------------------
# Report.

def tb_per_s(outcome: dict) -> float:
    return outcome["metrics"]["tb_per_s"]


def extra_columns(tk: str, tk_flash: str, page_sizes, tk_backend: str):
    """Table columns after `tk / best peer`: the plain entry point's ratio, FA3's split
    count, paged over contiguous, and whether the cell is one the issue's targets cover."""
    from bench import report

    def flash_ratio(row):
        best, name = report.best_peer(row, tb_per_s)
        return report.ratio_cell(report.metric_of(row, tk_flash, tb_per_s), best,
                                 f" vs {name}" if name else "")

    def splits(row):
        o = row.get("fa3")
        return str(o["metrics"].get("num_splits", "-")) if o and o["status"] == "ok" else "-"

    def paged_over_contiguous(row, contiguous_name, paged_name):
        contiguous = report.metric_of(row, contiguous_name, tb_per_s)
        cells = []
        for p in page_sizes:
            value = report.metric_of(row, paged_name(p), tb_per_s)
            if value and contiguous:
                cells.append(f"{p}: {value / contiguous:.2f}")
        return ", ".join(cells) or "-"

    def paged(row):
        return paged_over_contiguous(row, tk, lambda p: _tk_name(f"tk_paged{p}", tk_backend))

    def fa3_paged(row):
        return paged_over_contiguous(row, "fa3", lambda p: f"fa3_paged{p}")

    def big(row):
        config = next(iter(row.values()))["config"]
        n = kv_bytes(config["batch"], config["cache"], config["hkv"], config["d"])
        return "yes" if n >= BIG_CELL_BYTES else "no"

    return (("tk_flash / best peer", flash_ratio), ("fa3 splits", splits),
            ("paged / contiguous", paged), ("fa3 paged / contiguous", fa3_paged),
            (">= 64 MiB", big))


def write_plot(path: str, outcomes: list[dict], contender_names: list[str],
               title: str) -> str | None:
    """Left: TB/s against K/V MiB per contender, the copy rate dashed. Right: tk (and
    tk_flash) over the best peer against K/V MiB, with the 1.05 target and the 64 MiB line."""
    from bench import report

    ok = [o for o in outcomes if o["status"] == "ok"]
    if not ok:
        return None
    plt = report.headless_pyplot()
    if plt is None:
        return None

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    names = [n for n in contender_names if any(o["contender"] == n for o in ok)]
    for i, name in enumerate(names):
        points = sorted((o["config"]["kv_mb"], tb_per_s(o)) for o in ok if o["contender"] == name)
        xs, ys = zip(*points)
        left.scatter(xs, ys, s=14, color=f"C{i}", label=name, alpha=0.8)
    copies = [o["metrics"]["tb_per_s"] / o["metrics"]["of_copy"] for o in ok
              if o["metrics"].get("of_copy")]
    if copies:
        left.axhline(copies[0], color="black", ls="--", lw=1, label="copy rate")
    left.set_xscale("log")
    left.set_xlabel("K/V MiB per step")
    left.set_ylabel("K/V TB/s")
    left.legend(fontsize=8)
    left.grid(True, alpha=0.3)

    rows: dict[str, dict[str, dict]] = {}
    for o in outcomes:
        rows.setdefault(str(sorted(o["config"].items())), {})[o["contender"]] = o
    ours = [n for n in names if any(o["role"] == OURS for o in ok if o["contender"] == n)]
    series = ours[:1] + [n for n in names if n.startswith("tk_flash")][:1]
    for i, name in enumerate(series):
        points = []
        for row in rows.values():
            best, _ = report.best_peer(row, tb_per_s)
            mine = report.metric_of(row, name, tb_per_s)
            if best and mine:
                points.append((next(iter(row.values()))["config"]["kv_mb"], mine / best))
        if points:
            xs, ys = zip(*sorted(points))
            right.scatter(xs, ys, s=14, color=f"C{names.index(name)}", label=f"{name} / best peer")
    right.axhline(1.0, color="gray", lw=0.8)
    right.axhline(1.05, color="red", lw=0.8, ls=":")
    right.axvline(64, color="gray", lw=0.8, ls="--")
    right.set_xscale("log")
    right.set_xlabel("K/V MiB per step")
    right.set_ylabel("speed over the best of cuDNN and FA3")
    right.grid(True, alpha=0.3)
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return report.save_figure(plt, fig, path, dpi=110)
