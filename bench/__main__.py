"""Command line, run from the root of a checkout:
`python3 -m bench attention|based|all|scale|gqa|packed|decode [options]`.

Examples:
    python3 -m bench --list                      # which contenders can run here
    python3 -m bench attention --quick           # a few points, a minute or two
    python3 -m bench attention --d 128 --t 4k,16k --causal yes
    python3 -m bench based --fwd-only
    python3 -m bench all --dry-run               # print the plan, run nothing
    python3 -m bench scale                       # 1 vs all visible GPUs (see scale.py)
    python3 -m bench gqa                         # every Hq/Hkv ratio at T=4k (see gqa.py)
    python3 -m bench packed                      # packed documents (see packed.py)
    python3 -m bench decode                      # K/V-cache decode step (see decode.py)

Results go to <out>/<suite>-<card>.json (rewritten after every measurement, so a run cut
short keeps what it measured), <suite>-<card>.md and <suite>-<card>.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from typing import Any, Callable

from bench import (Contender, Outcome, availability, config_dict, distribution_version,
                   parse_int_list, run_grid, run_one, short_error)
from bench import attention, based, decode, gqa, packed, report, scale, timing

DEFAULT_OUT = os.path.join("bench", "results")
SUITES = ["attention", "based", "all", "scale", "gqa", "packed", "decode"]
# The newer suites' defaults are frugal so that each default grid runs in minutes.
DEFAULT_REPS = {"gqa": 5, "packed": 5, "decode": 5}
DEFAULT_SETTLE = {"gqa": 0.5, "packed": 0.5, "decode": 0.2}


@dataclasses.dataclass
class Plan:
    """What one suite will run and how its results are laid out."""

    suite: str
    configs: list
    contenders: list[Contender]
    add_metrics: Callable[[Any, Outcome], None]
    table: report.TableSpec
    plot: dict                    # keyword arguments for report.write_plot
    decode_shape: tuple[int, int] | None = None  # (batch, heads) of the decode step, if any
    # Time a configuration's contenders in turns (bench.run_interleaved) rather than one after
    # the other; all of them then hold their inputs at once.
    interleave: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)  # what the grid is, left-outs
    # plot_writer(path, outcomes, contender_names, title) -> path or None, instead of
    # report.write_plot(**plot)
    plot_writer: Callable[..., str | None] | None = None
    # A measurement taken once before the grid (e.g. the copy rate), stored as
    # document["reference"] and described in the report by reference_lines.
    reference: Callable[[argparse.Namespace], dict] | None = None
    reference_lines: Callable[[dict], list[str]] | None = None
    seconds_per_config: float | None = None  # rough H100 estimate, for --dry-run


# ---------------------------------------------------------------------------------------------
# Arguments.

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m bench",
        description="Time tk_jax's kernels and their peers on this machine's first device.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Peers (cuDNN, FlashAttention-3, XLA, fla) are optional: whatever cannot run "
               "is reported in the table and the run goes on.")
    parser.add_argument("suite", nargs="?", default="all", choices=SUITES,
                        help="all = attention + based; scale = multi-GPU scaling (its own "
                             "sizes; --t sets its ring-attention lengths); gqa = every "
                             "Hq/Hkv ratio; packed = documents packed in rows (segment ids); "
                             "decode = one decode step against a K/V cache")
    parser.add_argument("--list", "--peers-only", dest="list", action="store_true",
                        help="show the contenders, whether they can run here, and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the configurations and contenders, run nothing")
    parser.add_argument("--quick", action="store_true",
                        help="a small subset: attention D=128, T=1k,4k; based T=1k,8k; gqa "
                             "D=128 T=4k causal, ratios 1,8,MQA; packed D=128, two layouts; "
                             "decode four cells")
    parser.add_argument("--tiny", action="store_true",
                        help="toy shapes that run in seconds on a CPU (smoke test only)")
    parser.add_argument("--d", type=parse_int_list, help="attention head dims, e.g. 64,128")
    parser.add_argument("--t", type=parse_int_list, help="sequence lengths, e.g. 1k,4k,16k")
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both",
                        help="attention masks to run (default both)")
    parser.add_argument("--fwd-only", action="store_true", help="forward pass only")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repeats per point; the median is reported (default 10; "
                             "5 for gqa, packed, decode)")
    parser.add_argument("--settle", type=float, default=None,
                        help="seconds of unrecorded turns of all contenders before a point's "
                             "samples, so that they are taken at the card's sustained clocks, "
                             "as in a training run (default 1.0; gqa, packed 0.5; decode 0.2)")
    parser.add_argument("--sequential", action="store_true",
                        help="attention suites: time the contenders one after the other, each in a "
                             "short burst after its own warm-up, instead of in turns after "
                             "--settle")
    parser.add_argument("--contenders", type=lambda s: [x for x in s.split(",") if x],
                        help="only these contenders (names as in --list), comma-separated")
    parser.add_argument("--tk-backend", default="kernel", choices=["kernel", "auto", "reference"],
                        help='backend for the "tk" contender (default kernel)')
    parser.add_argument("--no-decode", action="store_true", help="skip the Based decode step")
    parser.add_argument("--full", action="store_true",
                        help="gqa: T = 1k,2k,4k,8k,16k (default 4k); decode: D = 64,128 and "
                             "1 and 4 query tokens (default D=128, 1 token)")
    parser.add_argument("--ratios", type=gqa.parse_ratios,
                        help="gqa: Hq/Hkv ratios, e.g. 1,4,mqa (default 1,2,4,8,16,mqa)")
    parser.add_argument("--layouts", type=lambda s: [x for x in s.split(",") if x],
                        help=f"packed: document layouts, of {', '.join(packed.LAYOUTS)} "
                             f"(default all)")
    parser.add_argument("--rows", type=int,
                        help=f"packed: rows of {packed.ROW_TOKENS} tokens per step "
                             f"(default {packed.ROWS})")
    parser.add_argument("--heads", type=decode.parse_heads,
                        help="packed: one Hq/Hkv pair (default 16/4); decode: pairs "
                             "(default 32/32,32/8,64/8,32/1)")
    parser.add_argument("--batch", type=parse_int_list, help="decode: batch sizes (default 1,8,64)")
    parser.add_argument("--cache", type=parse_int_list,
                        help="decode: cache lengths (default 4k,32k,128k)")
    parser.add_argument("--q-tokens", type=parse_int_list,
                        help="decode: query tokens per step (default 1; --full 1,4)")
    parser.add_argument("--page-sizes", type=parse_int_list,
                        help="decode: page sizes of tk's paged cache (default 16,64,256)")
    parser.add_argument("--fa3-splits", type=parse_int_list,
                        help="decode: FA3 num_splits to try, the fastest is timed (default "
                             "1,2,4,8,16)")
    parser.add_argument("--max-cache-gb", type=float, default=decode.MAX_CACHE_GIB,
                        help=f"decode: leave out cells whose K/V exceeds this many GiB "
                             f"(default {decode.MAX_CACHE_GIB:g})")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--card-name", help="card name in file names (default: from the device)")
    parser.add_argument("--merge", action="store_true",
                        help="keep results of an earlier JSON for points not measured in this "
                             "run (to assemble a full grid from several shorter runs)")
    parser.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of errors")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = DEFAULT_REPS.get(args.suite, 10)
    if args.settle is None:
        args.settle = DEFAULT_SETTLE.get(args.suite, 1.0)
    if args.layouts:
        unknown = [x for x in args.layouts if x not in packed.LAYOUTS]
        if unknown:
            parser.error(f"--layouts: unknown {', '.join(unknown)}; known: "
                         f"{', '.join(packed.LAYOUTS)}")
    if args.suite == "packed" and args.heads is not None and len(args.heads) != 1:
        parser.error(f"--heads: packed takes one Hq/Hkv pair, got {len(args.heads)}")
    if args.rows is not None and args.rows < 1:
        parser.error(f"--rows must be >= 1, got {args.rows}")
    if not args.max_cache_gb > 0:
        parser.error(f"--max-cache-gb must be > 0, got {args.max_cache_gb}")
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    if not args.settle >= 0:
        parser.error(f"--settle must be >= 0 seconds, got {args.settle}")
    return args


# ---------------------------------------------------------------------------------------------
# Plans.

def attention_plan(args: argparse.Namespace) -> Plan:
    if args.tiny:
        t_values, d_values = attention.TINY_T, attention.TINY_D
        sizes = dict(tokens=attention.TINY_TOKENS, width=attention.TINY_WIDTH)
    elif args.quick:
        t_values, d_values, sizes = attention.QUICK_T, attention.QUICK_D, {}
    else:
        t_values, d_values, sizes = attention.T_GRID, attention.D_GRID, {}
    t_values, d_values = args.t or t_values, args.d or d_values
    tokens = sizes.get("tokens", attention.TOKENS)
    width = sizes.get("width", attention.MODEL_WIDTH)
    for name, values, total in (("T", t_values, tokens), ("D", d_values, width)):
        left_out = [v for v in values if total % v]
        if left_out:
            print(f"note: attention {name} = {left_out} left out: must divide {total}",
                  file=sys.stderr)
    configs = attention.make_configs(
        t_values, d_values, attention.CAUSAL_CHOICES[args.causal],
        (False,) if args.fwd_only else (False, True), **sizes)
    return Plan(
        suite="attention", configs=configs,
        contenders=attention.contenders(args.tk_backend),
        add_metrics=attention.add_metrics,
        interleave=not args.sequential,
        table=report.TableSpec(
            group_field="pass", key_fields=("d", "causal", "t", "batch", "heads"),
            metric=lambda o: o["metrics"]["tflops"], metric_name="TFLOP/s",
            higher_is_better=True, key_format={"causal": lambda c: "causal" if c else "full"}),
        plot=dict(panel_fields=("d", "causal", "pass"), x_field="t",
                  metric=lambda o: o["metrics"]["tflops"], metric_name="TFLOP/s",
                  panel_format=lambda p: (f"D={p['d']} {'causal' if p['causal'] else 'full'} "
                                          f"{p['pass']}")))


def based_plan(args: argparse.Namespace) -> Plan:
    if args.tiny:
        t_values = based.TINY_T
        shape = dict(batch=based.TINY_BATCH, heads=based.TINY_HEADS)
        decode_shape = (based.TINY_BATCH, based.TINY_HEADS)
    else:
        t_values = based.QUICK_T if args.quick else based.T_GRID
        shape, decode_shape = {}, (based.DECODE_BATCH, based.HEADS)
    configs = based.make_configs(args.t or t_values, (False,) if args.fwd_only else (False, True),
                                 **shape)
    return Plan(
        suite="based", configs=configs,
        contenders=based.contenders(args.tk_backend),
        add_metrics=based.add_metrics,
        table=report.TableSpec(group_field="pass", key_fields=("t", "batch", "heads"),
                               metric=lambda o: o["median_ms"], metric_name="ms",
                               higher_is_better=False),
        plot=dict(panel_fields=("pass",), x_field="t", metric=lambda o: o["median_ms"],
                  metric_name="ms", log_y=True),
        decode_shape=None if args.no_decode else decode_shape)


def gqa_plan(args: argparse.Namespace) -> Plan:
    causal_values = attention.CAUSAL_CHOICES[args.causal]
    if args.tiny:
        t_values, d_values, ratios = gqa.TINY_T, gqa.TINY_D, gqa.RATIOS
        sizes = dict(tokens=gqa.TINY_TOKENS, width=gqa.TINY_WIDTH)
    elif args.quick:
        t_values, d_values, ratios = gqa.QUICK["t"], gqa.QUICK["d"], gqa.QUICK["ratios"]
        sizes = {}
        if args.causal == "both":
            causal_values = gqa.QUICK["causal"]
    else:
        t_values = gqa.FULL_T if args.full else gqa.T_GRID
        d_values, ratios, sizes = gqa.D_GRID, gqa.RATIOS, {}
    configs, left_out = gqa.make_configs(
        args.t or t_values, args.d or d_values, args.ratios or ratios, causal_values,
        (False,) if args.fwd_only else (False, True), **sizes)
    width = sizes.get("width", gqa.QUERY_WIDTH)
    notes = [f"{sizes.get('tokens', gqa.TOKENS)} tokens per step (B = tokens / T); Hq * D = "
             f"{width}, so Hq = {', '.join(f'{width // d} at D={d}' for d in gqa.D_GRID)}; "
             f"Hkv = Hq / ratio (MQA: Hkv = 1); FLOPs over the query heads: forward "
             f"4*B*Hq*T*T*D, half for causal, fwd+bwd 3.5x"] + left_out
    tflops = lambda o: o["metrics"]["tflops"]  # noqa: E731
    return Plan(
        suite="gqa", configs=configs, contenders=gqa.contenders(args.tk_backend),
        add_metrics=gqa.add_metrics, interleave=not args.sequential, notes=notes,
        table=report.TableSpec(
            group_field="pass", key_fields=("d", "causal", "t", "batch", "q_per_kv", "hq", "hkv"),
            metric=tflops, metric_name="TFLOP/s", higher_is_better=True,
            key_format={"causal": lambda c: "causal" if c else "full"}),
        plot={}, plot_writer=gqa.write_ratio_plot, seconds_per_config=gqa.SECONDS_PER_CELL)


def packed_plan(args: argparse.Namespace) -> Plan:
    if args.tiny:
        rows, row_tokens = packed.TINY["rows"], packed.TINY["row_tokens"]
        heads, d_values, layouts = packed.TINY["heads"], packed.TINY["d"], list(packed.LAYOUTS)
    else:
        rows, row_tokens, heads = packed.ROWS, packed.ROW_TOKENS, packed.HEADS
        d_values = (packed.D_GRID[0],) if args.quick else packed.D_GRID
        layouts = list(packed.QUICK_LAYOUTS if args.quick else packed.LAYOUTS)
    heads = tuple(args.heads[0]) if args.heads else heads
    rows, layouts = args.rows or rows, args.layouts or layouts
    configs = packed.make_configs(layouts, args.d or d_values,
                                  (False,) if args.fwd_only else (False, True), rows=rows,
                                  row_tokens=row_tokens, heads=heads)
    tk_name = "tk" if args.tk_backend == "kernel" else f"tk_{args.tk_backend}"
    per_doc = "tk_per_doc" if args.tk_backend == "kernel" else f"tk_per_doc_{args.tk_backend}"
    tflops = lambda o: o["metrics"]["tflops"]  # noqa: E731

    def over_per_doc(row):
        return report.ratio_cell(report.metric_of(row, tk_name, tflops),
                                 report.metric_of(row, per_doc, tflops))

    notes = [f"causal within each document; Hq/Hkv = {heads[0]}/{heads[1]}; FLOPs: each "
             f"document's own causal triangle, forward 4*Hq*D*sum L(L+1)/2, fwd+bwd 3.5x; "
             f"tk_per_doc: one flash_attention call per document, all in one jitted program, "
             f"timed as a whole"] + packed.layout_notes(layouts, rows, row_tokens)
    return Plan(
        suite="packed", configs=configs, contenders=packed.contenders(args.tk_backend),
        add_metrics=packed.add_metrics, interleave=not args.sequential, notes=notes,
        table=report.TableSpec(
            group_field="pass", key_fields=("layout", "d", "rows", "docs", "hq", "hkv"),
            metric=tflops, metric_name="TFLOP/s", higher_is_better=True,
            extra_columns=((f"{tk_name} / {per_doc}", over_per_doc),),
            footer="Targets (issue 32): tk / fa3_varlen (the `tk / best peer` column) >= 1.2x; "
                   "tk / tk_per_doc >= 0.9x."),
        plot={}, plot_writer=packed.write_bar_plot, seconds_per_config=5.0)


def decode_plan(args: argparse.Namespace) -> Plan:
    if args.tiny:
        t = decode.TINY
        batches, caches, heads, d_values, q_tokens = (t["batches"], t["caches"], t["heads"],
                                                      t["d"], t["q_tokens"])
        page_sizes, cells, copy_bytes = t["page_sizes"], None, t["copy_bytes"]
        sizes = dict(max_steps=t["max_steps"])
    else:
        batches, caches, heads = decode.BATCHES, decode.CACHES, decode.HEADS
        d_values = decode.FULL_D if args.full else decode.D_GRID
        q_tokens = decode.FULL_Q_TOKENS if args.full else decode.Q_TOKENS
        page_sizes, copy_bytes = decode.PAGE_SIZES, decode.COPY_BYTES
        cells = decode.QUICK_CELLS if args.quick else None
        sizes = {}
    page_sizes = tuple(args.page_sizes or page_sizes)
    configs, left_out = decode.make_configs(
        args.batch or batches, args.cache or caches, args.heads or heads, args.d or d_values,
        args.q_tokens or q_tokens, max_cache_gib=args.max_cache_gb, cells=cells, **sizes)
    copy: dict = {}
    tk_name = "tk" if args.tk_backend == "kernel" else f"tk_{args.tk_backend}"
    flash_name = "tk_flash" if args.tk_backend == "kernel" else f"tk_flash_{args.tk_backend}"

    def reference(run_args) -> dict:
        copy.update(decode.copy_rate(run_args.reps, copy_bytes))
        return dict(copy)

    def reference_lines(measured: dict) -> list[str]:
        if not measured.get("bytes_per_s"):
            return [f"device copy rate: not measured ({measured.get('error', '?')})"]
        return [f"device copy rate (read + write of a {measured['array_bytes'] / 2**30:.2f} GiB float32 "
                f"array, x + 1): {measured['bytes_per_s'] / 1e12:.2f} TB/s"]

    notes = ["bf16; no mask (every query token sees the whole cache, cache_seqlens = S); "
             "K/V bytes = 2*B*S*Hkv*D*2; TB/s = K/V bytes per step / time per step; a timed "
             f"call runs `steps` steps over `sets` cache copies (>= "
             f"{decode.TARGET_CALL_BYTES >> 20} MiB per call, 2x L2 covered where 16 steps "
             f"allow)"] + left_out
    return Plan(
        suite="decode", configs=configs,
        contenders=decode.contenders(args.tk_backend, page_sizes,
                                     tuple(args.fa3_splits or decode.FA3_SPLITS)),
        add_metrics=decode.make_add_metrics(copy), interleave=not args.sequential, notes=notes,
        table=report.TableSpec(
            group_field="q_tokens",
            key_fields=("d", "hq", "hkv", "batch", "cache", "kv_mb", "steps", "sets"),
            metric=decode.tb_per_s, metric_name="TB/s", higher_is_better=True,
            extra_columns=decode.extra_columns(tk_name, flash_name, page_sizes, args.tk_backend),
            footer="Targets (issue 33): cells with >= 64 MiB of K/V at >= 2.9 TB/s and >= 1.05x "
                   "the best peer (tk and tk_flash alike); smaller cells >= 1.0x; paged within "
                   "5% of contiguous (paged / contiguous >= 0.95)."),
        plot={}, plot_writer=decode.write_plot, reference=reference,
        reference_lines=reference_lines, seconds_per_config=decode.SECONDS_PER_CELL)


SUITE_PLANS = {"attention": attention_plan, "based": based_plan, "gqa": gqa_plan,
               "packed": packed_plan, "decode": decode_plan}


# ---------------------------------------------------------------------------------------------
# Environment header.

def describe_environment(*, measure_overhead: bool) -> dict:
    """Device and versions, for the header and the JSON."""
    import jax

    env: dict[str, Any] = {"python": sys.version.split()[0], "jax": jax.__version__,
                           "jaxlib": distribution_version("jaxlib") or "?"}
    try:
        devices = jax.devices()
        env["device"] = f"{devices[0].device_kind} ({devices[0].platform}, {len(devices)} visible)"
        env["platform_version"] = getattr(devices[0].client, "platform_version", "?")
    except Exception as err:
        env["device"] = f"none: {short_error(err)}"
    try:
        import tk_jax

        env["tk_jax"] = distribution_version("tk_jax") or getattr(tk_jax, "__version__", "?")
        info = tk_jax.info()
        env["tk_jax.info()"] = info if isinstance(info, (str, dict)) else str(info)
    except Exception as err:
        env["tk_jax.info()"] = f"failed: {short_error(err)}"
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    if measure_overhead:
        try:
            env["jax dispatch overhead (us/call)"] = round(
                timing.jax_dispatch_overhead_seconds() * 1e6, 1)
        except Exception as err:
            env["jax dispatch overhead (us/call)"] = f"failed: {short_error(err)}"
    return env


def describe_contenders(contenders: list[Contender]) -> dict:
    """name -> what it calls, and its version or why it cannot run here."""
    return {c.name: f"{c.description}; {availability(c)}" for c in contenders}


def card_name(args: argparse.Namespace) -> str:
    if args.card_name:
        return report.sanitize_card_name(args.card_name)
    try:
        import jax

        return report.sanitize_card_name(jax.devices()[0].device_kind)
    except Exception:
        return "unknown"


def header_lines(environment: dict, plans: list[Plan]) -> list[str]:
    lines = report.environment_lines(environment)
    for plan in plans:
        lines += [f"{plan.suite} contender {name}: {text}"
                  for name, text in describe_contenders(plan.contenders).items()]
    return lines


# ---------------------------------------------------------------------------------------------
# Running a plan.

def run_decode(plan: Plan, args: argparse.Namespace) -> dict:
    """The decode step next to its memory floor (bytes of state read and written, at the
    copy bandwidth measured on this card in the same run)."""
    batch, heads = plan.decode_shape
    floor_bytes = based.decode_floor_bytes(batch, heads)
    config = dict(batch=batch, heads=heads, feature=based.FEATURE, value_dim=based.VALUE_DIM)
    outcome = run_one(based.decode_contender(batch, heads), None, config, reps=args.reps,
                      verbose_errors=args.verbose)
    result = dataclasses.asdict(outcome)
    for key in ("median_ms", "min_ms", "max_ms"):  # one call = a loop of DECODE_STEPS steps
        if result.get(key) is not None:
            result[key] /= based.DECODE_STEPS
    result["steps_per_call"] = based.DECODE_STEPS
    result["floor_bytes"] = floor_bytes
    try:
        bandwidth = based.copy_bandwidth_bytes_per_s(
            reps=args.reps, n_bytes=(4 if args.tiny else 512) * 2**20)
        result["copy_bytes_per_s"] = bandwidth
        result["floor_us"] = floor_bytes / bandwidth * 1e6
    except Exception as err:
        result["copy_bandwidth_error"] = short_error(err)
    return result


def run_plan(plan: Plan, args: argparse.Namespace, environment: dict, card: str) -> None:
    stem = os.path.join(args.out, f"{plan.suite}-{card}")
    json_path = stem + ".json"
    previous, earlier = [], None
    if args.merge:
        earlier = report.read_json(json_path) or {}
        previous = earlier.get("results", [])
    timing_method = (f"contenders in turns, {args.reps} samples each after {args.settle} s of "
                     f"unrecorded turns" if plan.interleave else
                     f"contenders one after the other, {args.reps} samples each after warm-up")
    document = {"suite": plan.suite, "card": card, "command": args.command,
                "timing": timing_method,
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
                "environment": environment,
                "contenders": describe_contenders(plan.contenders),
                "results": list(previous)}
    if earlier and earlier.get("decode"):
        document["decode"] = earlier["decode"]  # replaced below if measured again
    if plan.notes:
        document["notes"] = plan.notes
    fresh: list[dict] = []
    total = len(plan.configs) * len(plan.contenders)
    started = time.perf_counter()
    print(f"== {plan.suite}: {len(plan.configs)} configurations x {len(plan.contenders)} "
          f"contenders ==", flush=True)

    def on_outcome(config, outcome: Outcome) -> None:
        fresh.append(dataclasses.asdict(outcome))
        print(f"[{len(fresh):>3}/{total}] {config.label():<42} {outcome.contender:<16} "
              f"{report.outcome_summary(fresh[-1])}", flush=True)
        document["results"] = report.merge_outcomes(previous, fresh)
        report.write_json(json_path, document)

    try:
        if plan.reference is not None:
            try:
                document["reference"] = plan.reference(args)
            except Exception as err:  # the grid is still worth measuring
                document["reference"] = {"error": short_error(err)}
            for line in (plan.reference_lines or (lambda r: [str(r)]))(document["reference"]):
                print(f"-- {plan.suite}: {line}", flush=True)
            report.write_json(json_path, document)
        run_grid(plan.configs, plan.contenders, reps=args.reps, to_dict=config_dict,
                 add_metrics=plan.add_metrics, on_outcome=on_outcome,
                 verbose_errors=args.verbose, interleave=plan.interleave,
                 settle_seconds=args.settle if plan.interleave else 0.0)
        if plan.decode_shape is not None:
            print(f"-- {plan.suite}: decode step --", flush=True)
            document["decode"] = run_decode(plan, args)
            report.write_json(json_path, document)
    finally:  # also on Ctrl-C: report what was measured
        document["elapsed_s"] = round(time.perf_counter() - started, 1)
        print(f"== {plan.suite}: {len(fresh)} measurements in {document['elapsed_s']} s ==")
        report.write_json(json_path, document)
        write_reports(plan, document, stem, plot=not args.no_plot)


def write_reports(plan: Plan, document: dict, stem: str, *, plot: bool) -> None:
    outcomes = document["results"]
    names = [c.name for c in plan.contenders]
    title = f"{plan.suite} on {document['card']}"
    header = report.environment_lines(document["environment"]) + [
        f"timing: {document['timing']}"] * bool(document.get("timing")) + [
        f"contender {name}: {text}" for name, text in document["contenders"].items()]
    if document.get("reference") is not None and plan.reference_lines is not None:
        header += plan.reference_lines(document["reference"])
    header += document.get("notes", [])
    parts = [f"# {title}", "", "\n".join(f"- {line}" for line in header), ""]
    if outcomes:
        parts.append(report.results_tables(outcomes, names, plan.table))
    if document.get("decode"):
        parts += ["", "### decode step", "", report.decode_table(document["decode"])]
    text = "\n".join(parts)
    print("\n" + text + "\n")
    report.write_text(stem + ".md", text)
    written = [stem + ".json", stem + ".md"]
    if plot and outcomes:
        try:
            if plan.plot_writer is not None:
                png = plan.plot_writer(stem + ".png", outcomes, names, title)
            else:
                png = report.write_plot(stem + ".png", outcomes, contender_names=names,
                                        title=title, **plan.plot)
            written.append(png or "(no plot: matplotlib not installed or nothing measured)")
        except Exception as err:  # a plotting problem must not lose the run
            written.append(f"(plot failed: {short_error(err)})")
    print("wrote " + ", ".join(written), flush=True)


# ---------------------------------------------------------------------------------------------

def print_contenders(plans: list[Plan]) -> None:
    for plan in plans:
        print(f"{plan.suite}:")
        for c in plan.contenders:
            print(f"  {c.name:<16} {c.role:<9} {availability(c)}\n  {'':<16} {c.description}")
        if plan.decode_shape is not None:
            print(f"  (+ decode step B={plan.decode_shape[0]} H={plan.decode_shape[1]})")


def print_plan(plans: list[Plan]) -> None:
    for plan in plans:
        print(f"{plan.suite}: {len(plan.configs)} configurations x {len(plan.contenders)} "
              f"contenders ({', '.join(c.name for c in plan.contenders)})")
        if plan.seconds_per_config:
            minutes = len(plan.configs) * plan.seconds_per_config / 60
            print(f"  expected on one H100: about {minutes:.1f} min (rough: "
                  f"{plan.seconds_per_config:g} s per configuration, plus start-up)")
        for note in plan.notes:
            print(f"  note: {note}")
        for config in plan.configs:
            print(f"  {config.label()}")
        if plan.decode_shape is not None:
            print(f"  decode step B={plan.decode_shape[0]} H={plan.decode_shape[1]}")


def main(argv: list[str] | None = None) -> int:
    # By default JAX grabs 75% of GPU memory when it creates its GPU client (the first
    # jax.devices() below), which would starve PyTorch (fla) in the same process.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    args = parse_args(argv)
    args.command = " ".join(["python3 -m bench"] + (sys.argv[1:] if argv is None else argv))
    if args.suite == "scale":  # one device against all visible devices: its own runner
        environment = describe_environment(measure_overhead=not (args.list or args.dry_run))
        return scale.run_suite(args, environment, card_name(args))
    suites = ["attention", "based"] if args.suite == "all" else [args.suite]
    plans = [SUITE_PLANS[s](args) for s in suites]
    if args.contenders:
        known = [c.name for plan in plans for c in plan.contenders]
        known += [based.DECODE_NAME for plan in plans if plan.decode_shape is not None]
        unknown = sorted(set(args.contenders) - set(known))
        if unknown:
            print(f"--contenders: unknown {', '.join(unknown)}; known here: {', '.join(known)}",
                  file=sys.stderr)
            return 2
        for plan in plans:
            plan.contenders = [c for c in plan.contenders if c.name in args.contenders]
            if based.DECODE_NAME not in args.contenders:
                plan.decode_shape = None
    if args.list:
        print("\n".join(report.environment_lines(describe_environment(measure_overhead=False))))
        print()
        print_contenders(plans)
        return 0
    environment = describe_environment(measure_overhead=not args.dry_run)
    print("tk_jax benchmark")
    print("\n".join(f"  {line}" for line in header_lines(environment, plans)) + "\n", flush=True)
    if args.dry_run:
        print_plan(plans)
        return 0
    card = card_name(args)
    for plan in plans:
        run_plan(plan, args, environment, card)
    return 0


if __name__ == "__main__":
    sys.exit(main())
