"""Writing results: JSON (everything), markdown tables (for people), PNG plots (if matplotlib
is installed). Functions here work on plain dicts, so results read back from a JSON file
(--merge) are reported exactly like fresh ones.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Callable, Iterable

from bench import OK, OURS, PEER

# How a status that is not "ok" shows in a table cell.
STATUS_CELL = {"unsupported": "unsup.", "skipped": "skip", "unavailable": "n/a", "error": "error"}
OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|out of memory", re.IGNORECASE)


def sanitize_card_name(device_kind: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (safe in file names)."""
    name = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")
    return name or "unknown"


def format_number(value: float) -> str:
    """Three or four significant figures, never scientific notation."""
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    if magnitude >= 0.01 or magnitude == 0:
        return f"{value:.3f}"
    return f"{value:.2e}"


def short_count(n: int) -> str:
    """16384 -> '16k', 512 -> '512'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def outcome_summary(outcome: dict) -> str:
    """One line for the progress log: the time and metrics, or the status and its reason."""
    if outcome["status"] != OK:
        return f"{outcome['status'].upper()}: {outcome['reason']}"
    metrics = "  ".join(
        f"{k}={format_number(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v}"
        for k, v in outcome["metrics"].items())
    return f"{format_number(outcome['median_ms'])} ms  {metrics}"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table with columns padded to equal width."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), separator] + [line(r) for r in rows])


class Notes:
    """Numbered footnotes for the table cells that hold no number: one note per (name,
    status, reason), so a failure repeated down a column is explained once."""

    def __init__(self) -> None:
        self.numbers: dict[tuple, int] = {}

    def cell(self, name: str, status: str, reason: str) -> str:
        label = "OOM" if OUT_OF_MEMORY.search(reason) else STATUS_CELL.get(status, status)
        return f"{label} [{self.numbers.setdefault((name, status, reason), len(self.numbers) + 1)}]"

    def text(self) -> str:
        lines = [f"- [{n}] {name} {status}: {reason or '(no reason given)'}"
                 for (name, status, reason), n in self.numbers.items()]
        return "Notes:\n\n" + "\n".join(lines) if lines else ""


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """How to lay out one suite's outcomes.

    group_field:   one table per value of this config field (e.g. "pass")
    key_fields:    config fields that identify a row, in column order
    metric:        outcome dict -> number shown in the cells
    metric_name:   unit of the cells, e.g. "TFLOP/s" or "ms"
    higher_is_better: decides how "tk / best peer" is computed (always a speed ratio: > 1
                   means tk_jax is faster)
    key_format:    optional formatting per key field
    extra_columns: (header, cell) pairs appended to each row, where cell(row) gets the row's
                   outcomes by contender name and returns the text of the cell (e.g. a second
                   ratio, or which setting a peer ran with)
    footer:        a sentence under the tables (what the extra columns mean)
    """

    group_field: str
    key_fields: tuple[str, ...]
    metric: Callable[[dict], float]
    metric_name: str
    higher_is_better: bool
    key_format: dict = dataclasses.field(default_factory=dict)
    extra_columns: tuple[tuple[str, Callable[[dict], str]], ...] = ()
    footer: str = ""


def _config_key(config: dict, fields: Iterable[str]) -> tuple:
    return tuple(config.get(f) for f in fields)


def _natural_order(key: tuple) -> tuple:
    """Sort numbers (and booleans) numerically, before strings."""
    return tuple((0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x)) for x in key)


def speed_ratio(ours: float | None, best_peer: float | None, higher_is_better: bool):
    """tk's speed over the best peer's: > 1 means tk is faster. None if either is missing."""
    if not ours or not best_peer:
        return None
    return ours / best_peer if higher_is_better else best_peer / ours


def results_tables(outcomes: list[dict], contender_names: list[str], spec: TableSpec) -> str:
    """Markdown: one table per group, a column per contender and a `tk / best peer` column,
    then numbered notes explaining every cell that is not a number."""
    notes = Notes()
    roles = {o["contender"]: o["role"] for o in outcomes}
    names = [n for n in contender_names if n in roles] + \
        sorted(n for n in roles if n not in contender_names)
    has_ours = any(roles[n] == OURS for n in names)
    has_peers = any(roles[n] == PEER for n in names)

    sections = []
    groups = list(dict.fromkeys(o["config"].get(spec.group_field) for o in outcomes))
    for group in groups:
        in_group = [o for o in outcomes if o["config"].get(spec.group_field) == group]
        by_row: dict[tuple, dict[str, dict]] = {}
        for o in in_group:
            by_row.setdefault(_config_key(o["config"], spec.key_fields), {})[o["contender"]] = o

        headers = list(spec.key_fields) + [f"{n} ({spec.metric_name})" for n in names]
        if has_ours and has_peers:
            headers.append("tk / best peer")
        headers += [header for header, _ in spec.extra_columns]
        rows = []
        for key in sorted(by_row, key=_natural_order):
            cells = [spec.key_format.get(f, str)(v) for f, v in zip(spec.key_fields, key)]
            ours, peers = None, []  # peers: (value, name) of every peer that ran
            for name in names:
                o = by_row[key].get(name)
                if o is None:
                    cells.append("")
                elif o["status"] == OK:
                    value = spec.metric(o)
                    cells.append(format_number(value))
                    if o["role"] == OURS:
                        ours = value
                    elif o["role"] == PEER:
                        peers.append((value, name))
                else:
                    cells.append(notes.cell(name, o["status"], o.get("reason", "")))
            if has_ours and has_peers:
                pick = max if spec.higher_is_better else min
                best_value, best_name = pick(peers) if peers else (None, "")
                ratio = speed_ratio(ours, best_value, spec.higher_is_better)
                cells.append("-" if ratio is None else f"{ratio:.2f}x vs {best_name}")
            cells += [cell(by_row[key]) for _, cell in spec.extra_columns]
            rows.append(cells)
        title = f"### {spec.group_field} = {group}" if spec.group_field else "###"
        sections.append(f"{title}\n\n{markdown_table(headers, rows)}")

    if has_ours and has_peers:
        sections.append("`tk / best peer` is a speed ratio of tk_jax's kernel over the fastest "
                        "other library: above 1 means tk_jax is faster.")
    if spec.footer:
        sections.append(spec.footer)
    if notes.numbers:
        sections.append(notes.text())
    return "\n\n".join(sections)


def metric_of(row: dict, name: str, metric: Callable[[dict], float]) -> float | None:
    """The metric of contender `name` in a table row (outcomes by contender name), or None
    when it did not run there."""
    o = row.get(name)
    return metric(o) if o is not None and o["status"] == OK else None


def best_peer(row: dict, metric: Callable[[dict], float],
              higher_is_better: bool = True) -> tuple[float | None, str]:
    """(value, name) of the fastest peer that ran in a table row, or (None, "")."""
    peers = [(metric(o), name) for name, o in row.items()
             if o["role"] == PEER and o["status"] == OK]
    if not peers:
        return None, ""
    return (max if higher_is_better else min)(peers)


def ratio_cell(numerator: float | None, denominator: float | None, suffix: str = "") -> str:
    """'1.23x' (+ suffix), or '-' when either side is missing."""
    if not numerator or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}x{suffix}"


def environment_lines(environment: dict) -> list[str]:
    """`key: value` lines for the header, in the dict's order."""
    return [f"{key}: {value}" for key, value in environment.items()]


def decode_table(decode: dict) -> str:
    """The decode-step result next to its memory floor."""
    headers = ["B", "H", "step (us)", "floor bytes", "copy GB/s", "floor (us)", "floor / step"]
    step_us = decode.get("median_ms") and decode["median_ms"] * 1e3
    floor_us = decode.get("floor_us")
    if decode.get("status") != OK:
        step_cell = f"{decode.get('status')}: {decode.get('reason', '')}"
    else:
        step_cell = format_number(step_us)
    share = f"{100 * floor_us / step_us:.0f}%" if step_us and floor_us else "-"
    row = [str(decode["config"]["batch"]), str(decode["config"]["heads"]), step_cell,
           f"{decode['floor_bytes']:,}",
           format_number(decode["copy_bytes_per_s"] / 1e9) if decode.get("copy_bytes_per_s")
           else "-",
           format_number(floor_us) if floor_us else "-", share]
    return markdown_table(headers, [row])


def outcome_key(outcome: dict) -> str:
    return json.dumps(outcome["config"], sort_keys=True) + "|" + outcome["contender"]


def merge_outcomes(previous: list[dict], fresh: list[dict]) -> list[dict]:
    """Fresh outcomes, plus previous ones for (config, contender) pairs not measured now."""
    measured = {outcome_key(o) for o in fresh}
    return [o for o in previous if outcome_key(o) not in measured] + fresh


def read_json(path: str) -> dict | None:
    """A results file written earlier, or None if there is none (or it is unreadable)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: str, document: dict) -> None:
    """Write atomically so a run killed mid-write leaves the previous file intact."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(document, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def headless_pyplot():
    """matplotlib.pyplot drawing off-screen (the Agg backend: no display on the benchmark
    machine), or None when matplotlib is not installed: plots are optional, every writer
    returns None then."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    return plt


def save_figure(plt, fig, path: str, *, dpi: int) -> str:
    """Write `fig` to the PNG `path` (making its folder) and close it (pyplot keeps every
    figure open until then); returns path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def write_plot(path: str, outcomes: list[dict], *, panel_fields: tuple[str, ...],
               x_field: str, metric: Callable[[dict], float], metric_name: str,
               contender_names: list[str], title: str, log_y: bool = False,
               panel_format: Callable[[dict], str] | None = None) -> str | None:
    """One panel per value of `panel_fields`, the metric against `x_field`, one line per
    contender. Returns the path written, or None if matplotlib is not installed or there is
    nothing to plot."""
    plt = headless_pyplot()
    if plt is None:
        return None
    ok = [o for o in outcomes if o["status"] == OK]
    if not ok:
        return None

    panels = sorted({_config_key(o["config"], panel_fields) for o in ok}, key=_natural_order)
    columns = min(4, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
    names = [n for n in contender_names if any(o["contender"] == n for o in ok)]
    names += sorted({o["contender"] for o in ok} - set(names))
    colors = {name: f"C{i}" for i, name in enumerate(names)}  # same colour in every panel
    for axis, panel in zip(axes.flat, panels):
        in_panel = [o for o in ok if _config_key(o["config"], panel_fields) == panel]
        for name in names:
            points = sorted((o["config"][x_field], metric(o)) for o in in_panel
                            if o["contender"] == name)
            if points:
                xs, ys = zip(*points)
                axis.plot(xs, ys, marker="o", color=colors[name], label=name)
        axis.set_xscale("log", base=2)
        ticks = sorted({o["config"][x_field] for o in in_panel})
        axis.set_xticks(ticks, [short_count(t) for t in ticks])
        axis.minorticks_off()
        if log_y:
            axis.set_yscale("log")
        else:
            axis.set_ylim(bottom=0)
        axis.set_xlabel(x_field)
        axis.set_ylabel(metric_name)
        described = dict(zip(panel_fields, panel))
        axis.set_title(panel_format(described) if panel_format else
                       " ".join(f"{k}={v}" for k, v in described.items()), fontsize=10)
        axis.grid(True, alpha=0.3)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    handles = [plt.Line2D([], [], color=colors[n], marker="o", label=n) for n in names]
    fig.legend(handles=handles, loc="lower center", ncol=len(names), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08 / rows, 1, 1))
    return save_figure(plt, fig, path, dpi=120)
