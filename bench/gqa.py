"""Grouped-query attention benchmark: tk_jax's kernel against cuDNN and FlashAttention-3 at
every ratio of query heads to K/V heads.

The grid keeps the work per point comparable: 16384 tokens per step (B = 16384 / T) and a
fixed query width Hq * D = 4096, so Hq is 64 / 32 / 16 at D = 64 / 128 / 256 and both a ratio
of 16 and MQA (one K/V head) exist at every head dim (at D = 256 they are the same point).
Hkv = Hq / ratio. Inputs are bf16 in the [B, T, H, D] layout every contender reads directly.
FLOPs count the query heads, as the attention suite does: forward 4*B*Hq*T*T*D, half of it
when causal, forward+backward 3.5x the forward.
"""
from __future__ import annotations

import dataclasses
import math

from bench import OURS, PEER, Contender, Outcome, attention, pass_name, random_normal_sets
from bench.timing import Runner, compiled_jax_runner, input_sets_needed

TOKENS = 16384                 # tokens per step: B = TOKENS / T
QUERY_WIDTH = 4096             # Hq * D
MQA = "mqa"                    # the ratio Hq / 1
RATIOS = (1, 2, 4, 8, 16, MQA)
T_GRID = (4096,)               # default: one length, every ratio, head dim, mask and pass
FULL_T = (1024, 2048, 4096, 8192, 16384)
D_GRID = (64, 128, 256)
QUICK = dict(t=(4096,), d=(128,), ratios=(1, 8, MQA), causal=(True,))
TINY_TOKENS, TINY_WIDTH, TINY_T, TINY_D = 256, 128, (64,), (32,)  # CPU smoke test
SECONDS_PER_CELL = 2.5         # rough H100 cost of one cell (3 compiles, settle, samples)


@dataclasses.dataclass(frozen=True)
class GqaConfig:
    d: int
    causal: bool
    t: int
    batch: int
    q_per_kv: int   # Hq / Hkv
    hq: int
    hkv: int
    backward: bool

    @property
    def heads(self) -> int:  # the attention suite's FLOP count runs over the query heads
        return self.hq

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"D={self.d} T={self.t} {mask} {pass_name(self.backward)} "
                f"Hq/Hkv={self.hq}/{self.hkv} (B={self.batch})")


def parse_ratios(text: str) -> list:
    """'1,4,mqa' -> [1, 4, 'mqa'] (an argparse type)."""
    import argparse

    values: list = []
    for item in text.replace(" ", "").lower().split(","):
        if not item:
            continue
        if item == MQA:
            values.append(MQA)
            continue
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected ratios such as 1,2,4,8,16,mqa; got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"ratios must be positive, got {item!r}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one ratio, got {text!r}")
    return values


def make_configs(t_values, d_values, ratios, causal_values, backward_values, *,
                 tokens=TOKENS, width=QUERY_WIDTH) -> tuple[list[GqaConfig], list[str]]:
    """The grid, ordered pass, D, mask, T, ratio; and notes on the points left out (T not
    dividing `tokens`, D not dividing `width`, a ratio not dividing Hq). A ratio equal to Hq is
    MQA: it appears once."""
    configs, notes = [], []
    for d in d_values:
        if width % d:
            notes.append(f"D={d} left out: must divide Hq*D = {width}")
    for t in t_values:
        if tokens % t:
            notes.append(f"T={t} left out: must divide {tokens} tokens per step")
    for backward in backward_values:
        for d in d_values:
            if width % d:
                continue
            hq = width // d
            groups = []
            for ratio in ratios:
                group = hq if ratio == MQA else ratio
                if hq % group:
                    if backward == backward_values[0]:
                        notes.append(f"ratio {ratio} left out at D={d}: must divide Hq={hq}")
                    continue
                if group not in groups:
                    groups.append(group)
            for causal in causal_values:
                for t in t_values:
                    if tokens % t:
                        continue
                    for group in groups:
                        configs.append(GqaConfig(d=d, causal=causal, t=t, batch=tokens // t,
                                                 q_per_kv=group, hq=hq, hkv=hq // group,
                                                 backward=backward))
    return configs, notes


def add_metrics(config: GqaConfig, outcome: Outcome) -> None:
    """TFLOP/s over the query heads, counted as the attention suite counts them."""
    attention.add_metrics(config, outcome)


# ---------------------------------------------------------------------------------------------
# Contenders.

def gqa_runner(attend, config: GqaConfig) -> Runner:
    """Compile `attend(q, k, v) -> o` (or its VJP) on random bf16 inputs of `config`'s shape."""
    q_shape = (config.batch, config.t, config.hq, config.d)
    kv_shape = (config.batch, config.t, config.hkv, config.d)
    shapes = [q_shape, kv_shape, kv_shape] + [q_shape] * config.backward  # + cotangent
    bytes_per_set = sum(math.prod(s) for s in shapes) * 2
    sets = random_normal_sets(shapes, input_sets_needed(bytes_per_set))
    return compiled_jax_runner(attend, sets, backward=config.backward)


def contenders(tk_backend: str = "kernel") -> list[Contender]:
    """The attention suite's tk, cuDNN and FA3 contenders on this suite's GQA inputs."""
    return [attention.tk_contender(tk_backend, gqa_runner),
            attention.jax_nn_contender("cudnn", None, gqa_runner),
            attention.fa3_contender(gqa_runner)]


# ---------------------------------------------------------------------------------------------
# Report: the table is the generic one; the plot shows tk / best peer against the ratio.

def tk_over_best(outcomes: list[dict]) -> dict[tuple, float]:
    """(d, t, causal, pass, q_per_kv) -> tk's TFLOP/s over the best peer's, where both ran."""
    cells: dict[tuple, dict[str, dict]] = {}
    for o in outcomes:
        c = o["config"]
        key = (c["d"], c["t"], c["causal"], c["pass"], c["q_per_kv"])
        cells.setdefault(key, {})[o["contender"]] = o
    ratios = {}
    for key, row in cells.items():
        ours = [o["metrics"]["tflops"] for o in row.values()
                if o["role"] == OURS and o["status"] == "ok"]
        peers = [o["metrics"]["tflops"] for o in row.values()
                 if o["role"] == PEER and o["status"] == "ok"]
        if ours and peers:
            ratios[key] = ours[0] / max(peers)
    return ratios


def write_ratio_plot(path: str, outcomes: list[dict], contender_names: list[str],
                     title: str) -> str | None:
    """One panel per (D, T): tk / best peer against Hq / Hkv, a line per (mask, pass), with
    the issue's 1.05 target drawn. None if matplotlib is missing or no ratio was measured."""
    del contender_names  # the plot shows one ratio, not the contenders
    from bench import report

    ratios = tk_over_best(outcomes)
    if not ratios:
        return None
    plt = report.headless_pyplot()
    if plt is None:
        return None

    d_values = sorted({k[0] for k in ratios})
    t_values = sorted({k[1] for k in ratios})
    fig, axes = plt.subplots(len(d_values), len(t_values), squeeze=False,
                             figsize=(4.2 * len(t_values), 3.2 * len(d_values)))
    series = [(causal, p) for causal in (False, True) for p in ("fwd", "fwd+bwd")]
    styles = {s: (f"C{i}", "o-" if s[1] == "fwd" else "s--") for i, s in enumerate(series)}
    for row, d in enumerate(d_values):
        for col, t in enumerate(t_values):
            axis = axes[row][col]
            for causal, p in series:
                points = sorted((k[4], v) for k, v in ratios.items()
                                if k[:4] == (d, t, causal, p))
                if points:
                    xs, ys = zip(*points)
                    color, style = styles[(causal, p)]
                    axis.plot(xs, ys, style, color=color,
                              label=f"{'causal' if causal else 'full'} {p}")
            axis.axhline(1.0, color="gray", lw=0.8)
            axis.axhline(1.05, color="red", lw=0.8, ls=":")
            groups = sorted({k[4] for k in ratios if k[0] == d})
            axis.set_xscale("log", base=2)
            axis.set_xticks(groups, [str(g) if g < QUERY_WIDTH // d else f"{g}\n(MQA)"
                                     for g in groups])
            axis.minorticks_off()
            axis.set_xlabel("Hq / Hkv")
            axis.set_ylabel("tk / best peer")
            axis.set_title(f"D={d} T={t} (Hq={QUERY_WIDTH // d})", fontsize=10)
            axis.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, frameon=False)
    fig.suptitle(title + ": tk TFLOP/s over the best of cuDNN and FA3 (red: 1.05)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return report.save_figure(plt, fig, path, dpi=110)
