"""Packed-sequence benchmark: rows of 16384 tokens holding several documents each, causal
attention within each document only.

Three contenders see the same documents:
  tk           tk_jax.flash_attention on the packed rows with segment ids (one id per document
               in a row), causal=True
  fa3_varlen   FlashAttention-3 for JAX's flash_mha_varlen on the documents laid end to end
               (cu_seqlens), is_causal=True
  tk_per_doc   tk_jax.flash_attention on each document alone ([1, L, H, D], causal), one call
               per document, all calls in one jitted program timed as a whole
Document layouts are drawn with fixed seeds, so every run (and every contender) sees the same
lengths: `mean512` and `mean2k` draw lengths from an exponential distribution of that mean
(at least 1 token; the last document of a row is cut to fill it); `long+short` holds one
document of 3/4 of the row at a random place among short documents of mean 128. FLOPs count
each document's own causal triangle exactly: forward 4 * Hq * D * sum_i L_i (L_i + 1) / 2,
forward+backward 3.5x the forward.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math

from bench import (BASELINE, OURS, PEER, Contender, Outcome, Unsupported, distribution_version,
                   module_unavailable, pass_name, random_normal_sets)
from bench.timing import Runner, compiled_jax_runner, input_sets_needed

ROW_TOKENS = 16384
ROWS = 4                     # rows per step: 64k tokens
HEADS = (16, 4)              # (Hq, Hkv): GQA 4 query heads per K/V head
D_GRID = (128, 64)
FA3_MAX_HEAD_DIM = 128
BACKWARD_FLOP_FACTOR = 2.5
SEED = 20261201              # document layouts are fixed: runs compare
TINY = dict(row_tokens=128, rows=1, heads=(4, 2), d=(32,))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a row is cut into documents, as fractions of the row length (so that the tiny CPU
    run keeps the shape of the real one)."""

    name: str
    mean_fraction: float          # mean document length / row length
    long_fraction: float = 0.0    # one document of this share of the row, if > 0

    def describe(self, row_tokens: int) -> str:
        mean = round(self.mean_fraction * row_tokens)
        if self.long_fraction:
            return (f"one document of {round(self.long_fraction * row_tokens)} tokens among "
                    f"short ones of mean {mean}")
        return f"exponential lengths of mean {mean}"


LAYOUTS = {layout.name: layout for layout in (
    Layout("mean512", 512 / 16384),
    Layout("mean2k", 2048 / 16384),
    Layout("long+short", 128 / 16384, long_fraction=0.75),
)}
QUICK_LAYOUTS = ("mean512", "long+short")


@dataclasses.dataclass(frozen=True)
class PackedConfig:
    layout: str
    d: int
    rows: int
    row_tokens: int
    docs: int          # documents over all rows
    hq: int
    hkv: int
    backward: bool

    def label(self) -> str:
        return (f"{self.layout} D={self.d} {pass_name(self.backward)} "
                f"({self.rows}x{self.row_tokens} tokens, {self.docs} docs, "
                f"Hq/Hkv={self.hq}/{self.hkv})")


def _exponential_lengths(rng, mean: float, total: int) -> list[int]:
    """Lengths of mean `mean` (at least 1) filling exactly `total` tokens."""
    lengths: list[int] = []
    while total > 0:
        length = min(total, max(1, round(rng.exponential(mean))))
        lengths.append(length)
        total -= length
    return lengths


@functools.lru_cache(maxsize=64)
def document_lengths(layout_name: str, rows: int, row_tokens: int) -> tuple[tuple[int, ...], ...]:
    """Per row, its documents' lengths in order (they sum to row_tokens). Deterministic."""
    import numpy as np

    layout = LAYOUTS[layout_name]
    result = []
    for row in range(rows):
        rng = np.random.default_rng([SEED, list(LAYOUTS).index(layout_name), row, row_tokens])
        mean = max(1.0, layout.mean_fraction * row_tokens)
        if layout.long_fraction:
            long = round(layout.long_fraction * row_tokens)
            short = _exponential_lengths(rng, mean, row_tokens - long)
            place = int(rng.integers(0, len(short) + 1))
            lengths = short[:place] + [long] + short[place:]
        else:
            lengths = _exponential_lengths(rng, mean, row_tokens)
        result.append(tuple(lengths))
    return tuple(result)


def all_lengths(config: PackedConfig) -> list[int]:
    return [n for row in document_lengths(config.layout, config.rows, config.row_tokens)
            for n in row]


def segment_ids(config: PackedConfig):
    """[rows, row_tokens] int32: document index within the row, per token (NumPy)."""
    import numpy as np

    ids = [np.repeat(np.arange(len(row), dtype=np.int32), row)
           for row in document_lengths(config.layout, config.rows, config.row_tokens)]
    return np.stack(ids)


def cu_seqlens(config: PackedConfig):
    """[docs + 1] int32 offsets of the documents laid end to end, row after row (NumPy)."""
    import numpy as np

    return np.concatenate([[0], np.cumsum(all_lengths(config))]).astype(np.int32)


def make_configs(layouts, d_values, backward_values, *, rows=ROWS, row_tokens=ROW_TOKENS,
                 heads=HEADS) -> list[PackedConfig]:
    hq, hkv = heads
    return [PackedConfig(layout=name, d=d, rows=rows, row_tokens=row_tokens,
                         docs=sum(len(r) for r in document_lengths(name, rows, row_tokens)),
                         hq=hq, hkv=hkv, backward=backward)
            for backward in backward_values for d in d_values for name in layouts]


def packed_flops(config: PackedConfig) -> float:
    """Each document's own causal triangle, diagonal included: forward
    4 * Hq * D * sum L (L + 1) / 2; forward+backward 3.5x the forward."""
    pairs = sum(n * (n + 1) // 2 for n in all_lengths(config))
    flops = 4.0 * config.hq * config.d * pairs
    return flops * (1 + BACKWARD_FLOP_FACTOR) if config.backward else flops


def add_metrics(config: PackedConfig, outcome: Outcome) -> None:
    outcome.metrics["tflops"] = packed_flops(config) / (outcome.median_ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# Inputs: the same random tokens for every contender, laid out as each one reads them.

def _packed_sets(config: PackedConfig, leading: tuple[int, ...]) -> list[tuple]:
    """Input sets (q, k, v[, cotangent]) of shape leading + (heads, D)."""
    q_shape = leading + (config.hq, config.d)
    kv_shape = leading + (config.hkv, config.d)
    shapes = [q_shape, kv_shape, kv_shape] + [q_shape] * config.backward
    bytes_per_set = sum(math.prod(s) for s in shapes) * 2
    return random_normal_sets(shapes, input_sets_needed(bytes_per_set))


def _per_document_sets(config: PackedConfig) -> list[tuple]:
    """Input sets (qs, ks, vs[, cotangents]), each a tuple of one [1, L, H, D] array per
    document (drawn by one compiled function, however many documents there are)."""
    lengths = all_lengths(config)
    heads = [config.hq, config.hkv, config.hkv] + [config.hq] * config.backward
    shapes = [(1, n, h, config.d) for h in heads for n in lengths]
    bytes_per_set = sum(math.prod(s) for s in shapes) * 2
    sets = []
    for flat in random_normal_sets(shapes, input_sets_needed(bytes_per_set)):
        sets.append(tuple(tuple(flat[i * len(lengths):(i + 1) * len(lengths)])
                          for i in range(len(heads))))
    return sets


# ---------------------------------------------------------------------------------------------
# Contenders.

def _tk_name(base: str, backend: str) -> str:
    return base if backend == "kernel" else f"{base}_{backend}"


def segment_ids_unavailable() -> str | None:
    """None when tk_jax.flash_attention takes segment ids, else why not."""
    why = module_unavailable("tk_jax")
    if why is not None:
        return why
    import tk_jax

    try:
        parameters = inspect.signature(tk_jax.flash_attention).parameters
    except (AttributeError, TypeError, ValueError) as err:
        return f"tk_jax.flash_attention has no signature: {err}"
    if "q_segment_ids" not in parameters:
        return "tk_jax.flash_attention takes no q_segment_ids (not implemented yet)"
    return None


def tk_segments_contender(backend: str = "kernel") -> Contender:
    def prepare(config: PackedConfig) -> Runner:
        import jax.numpy as jnp
        import tk_jax

        def attend(q, k, v, ids):
            return tk_jax.flash_attention(q, k, v, causal=True, q_segment_ids=ids,
                                          kv_segment_ids=ids, backend=backend)

        sets = _packed_sets(config, (config.rows, config.row_tokens))
        try:
            return compiled_jax_runner(attend, sets, backward=config.backward,
                                       constants=(jnp.asarray(segment_ids(config)),))
        except ValueError as err:
            raise Unsupported(str(err)) from None

    return Contender(
        name=_tk_name("tk", backend),
        description=f'tk_jax.flash_attention(causal=True, q_segment_ids=ids, '
                    f'kv_segment_ids=ids, backend="{backend}") on the packed rows',
        role=OURS if backend == "kernel" else BASELINE,
        unavailable=segment_ids_unavailable,
        prepare=prepare,
        version=lambda: distribution_version("tk_jax"))


def fa3_varlen_contender() -> Contender:
    # flash_attn3_jax.flash_mha_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, seqused_k=None,
    # max_seqlen_q=-1, max_seqlen_k=-1, softmax_scale=None, is_causal=False, window_size):
    # q [total, Hq, D], k/v [total, Hkv, D]; max_seqlen defaults to the total, so it is given.
    def prepare(config: PackedConfig) -> Runner:
        if config.d > FA3_MAX_HEAD_DIM:
            raise Unsupported(f"the flash_attn3_jax wheel supports head dim <= "
                              f"{FA3_MAX_HEAD_DIM}, got {config.d}")
        import jax.numpy as jnp
        from flash_attn3_jax import flash_mha_varlen

        longest = max(all_lengths(config))

        def attend(q, k, v, cu):
            return flash_mha_varlen(q, k, v, cu, cu, max_seqlen_q=longest,
                                    max_seqlen_k=longest, is_causal=True)

        sets = _packed_sets(config, (config.rows * config.row_tokens,))
        return compiled_jax_runner(attend, sets, backward=config.backward,
                                   constants=(jnp.asarray(cu_seqlens(config)),))

    return Contender(
        name="fa3_varlen",
        description="flash_attn3_jax.flash_mha_varlen(cu_seqlens, is_causal=True) on the "
                    "documents laid end to end",
        role=PEER,
        unavailable=lambda: module_unavailable("flash_attn3_jax"),
        prepare=prepare,
        version=lambda: distribution_version("flash_attn3_jax"))


def tk_per_document_contender(backend: str = "kernel") -> Contender:
    def prepare(config: PackedConfig) -> Runner:
        import tk_jax

        def attend(qs, ks, vs):
            return tuple(tk_jax.flash_attention(q, k, v, causal=True, backend=backend)
                         for q, k, v in zip(qs, ks, vs))

        try:
            return compiled_jax_runner(attend, _per_document_sets(config),
                                       backward=config.backward)
        except ValueError as err:
            raise Unsupported(str(err)) from None

    return Contender(
        name=_tk_name("tk_per_doc", backend),
        description=f'tk_jax.flash_attention(causal=True, backend="{backend}") on each '
                    f'document alone, one call per document in one jitted program',
        role=BASELINE,
        unavailable=lambda: module_unavailable("tk_jax"),
        prepare=prepare,
        version=lambda: distribution_version("tk_jax"))


def contenders(tk_backend: str = "kernel") -> list[Contender]:
    return [tk_segments_contender(tk_backend), fa3_varlen_contender(),
            tk_per_document_contender(tk_backend)]


# ---------------------------------------------------------------------------------------------
# Report.

def layout_notes(layouts, rows: int, row_tokens: int) -> list[str]:
    """One line per layout: what it is and the documents it drew."""
    lines = []
    for name in layouts:
        lengths = [n for row in document_lengths(name, rows, row_tokens) for n in row]
        lines.append(f"layout {name}: {LAYOUTS[name].describe(row_tokens)}; {rows} rows of "
                     f"{row_tokens} tokens, {len(lengths)} documents, lengths "
                     f"{min(lengths)}..{max(lengths)}, mean {sum(lengths) / len(lengths):.0f}")
    return lines


def write_bar_plot(path: str, outcomes: list[dict], contender_names: list[str],
                   title: str) -> str | None:
    """One panel per (D, pass): TFLOP/s of each contender, grouped by layout."""
    from bench import report

    ok = [o for o in outcomes if o["status"] == "ok"]
    if not ok:
        return None
    plt = report.headless_pyplot()
    if plt is None:
        return None

    panels = sorted({(o["config"]["d"], o["config"]["pass"]) for o in ok})
    names = [n for n in contender_names if any(o["contender"] == n for o in ok)]
    layouts = [n for n in LAYOUTS if any(o["config"]["layout"] == n for o in ok)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.4), squeeze=False)
    width = 0.8 / max(1, len(names))
    for axis, (d, p) in zip(axes[0], panels):
        for i, name in enumerate(names):
            values = {o["config"]["layout"]: o["metrics"]["tflops"] for o in ok
                      if o["contender"] == name and o["config"]["d"] == d
                      and o["config"]["pass"] == p}
            xs = [j + i * width for j, layout in enumerate(layouts) if layout in values]
            axis.bar(xs, [values[l] for l in layouts if l in values], width, label=name,
                     color=f"C{i}")
        axis.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(layouts))],
                        layouts)
        axis.set_ylabel("TFLOP/s (documents' own causal triangles)")
        axis.set_title(f"D={d} {p}", fontsize=10)
        axis.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(names), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return report.save_figure(plt, fig, path, dpi=110)
