"""Does the ring hide its communication? One run on all visible GPUs prints, for ring attention
(shard_map) and for flash_attention on a sequence-sharded input (jit), each compiled as by
default and with XLA's latency-hiding scheduler:

  1. the schedule XLA chose: the entry computation's collective-permute-start/-done, all-gather
     and reduce-scatter pairs, in order, with the kernel calls (tk_attention_*), conditionals
     and other kernels scheduled between each start and its done (a transfer can only
     overlap what lies between them), and whether XLA made any collective synchronous;
  2. the time of one fwd+bwd call (median of a few);
  3. a profiler trace of one call: per GPU, the time its compute streams are busy, the time
     NCCL kernels run, and how much of the NCCL time overlaps compute; and GPU 0's timeline
     (kernels in order with stream, start and duration; runs of small kernels folded).

    python3 scripts/profile_ring.py --t 64k            # 4 GPUs: about 2 minutes
    python3 scripts/profile_ring.py --t 64k --programs ring --schedulers lhs --timeline 200
    python3 scripts/profile_ring.py --t 64k --programs ring --queued 6   # + steady state

On a CPU with host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4) it runs with
--backend reference as a smoke test (no device trace there).
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import tk_jax  # noqa: E402
from bench import parse_int_list  # noqa: E402

LHS = {"xla_gpu_enable_latency_hiding_scheduler": True}
SCHEDULERS = {"default": None, "lhs": LHS}
ASYNC_PAIRS = ("collective-permute", "all-gather", "reduce-scatter", "all-reduce", "all-to-all")


# ----------------------------------------------------------------------------------------------
# The programs.


def build(program: str, mesh, t: int, heads: int, kv_heads: int, d: int, backend: str):
    """(fwd+bwd function, args) of one program on the mesh's devices."""
    n = mesh.size
    spec = P(None, "seq")
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(1, t, heads, d), (1, t, kv_heads, d), (1, t, kv_heads, d), (1, t, heads, d)]
    args = [jax.device_put(jax.random.normal(k, s, jnp.bfloat16), NamedSharding(mesh, spec))
            for k, s in zip(keys, shapes)]
    if program == "ring":
        attend = jax.shard_map(
            functools.partial(tk_jax.ring_attention, axis_name="seq", causal=True,
                              backend=backend),
            mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    elif program == "sequence":
        attend = functools.partial(tk_jax.flash_attention, causal=True, backend=backend)
    else:
        raise ValueError(f"unknown program {program!r}")
    assert t % (2 * n) == 0, f"T={t} must be a multiple of 2 x {n} devices"

    def step(q, k, v, do):
        o, pullback = jax.vjp(attend, q, k, v)
        return o, pullback(do)
    return step, args


# ----------------------------------------------------------------------------------------------
# 1. The schedule.

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][a-z0-9\-]*)\((.*)$")


def entry_schedule(hlo: str) -> list[tuple[str, str, str]]:
    """(name, opcode, rest of line) of the entry computation's instructions, in schedule order
    (a compiled module is scheduled: its text lists them in execution order)."""
    lines = hlo.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    out = []
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        m = _INSTRUCTION.match(line)
        if m:
            out.append(m.groups())
    return out


def nested_kernels(hlo: str) -> dict[str, str]:
    """Per computation of the module: the tk_* custom call it holds, if any. XLA may fuse a
    kernel call into a fusion (with the dynamic slices of its operands, say) that the entry
    computation calls: the fusion then runs that kernel."""
    found, computation = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(1)
            continue
        target = re.search(r'custom_call_target="(tk_[^"]+)"', line)
        if computation and target:
            found.setdefault(computation, target.group(1))
    return found


def kind_of(opcode: str, rest: str, nested: dict[str, str]) -> str:
    """What an instruction runs: a custom call's target, the tk_* kernel of a fusion or call
    that holds one (see nested_kernels), else its opcode."""
    if opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        return target.group(1) if target else "custom-call"
    called = re.search(r"(?:calls|to_apply)=%?([\w.\-]+)", rest)
    if opcode in ("fusion", "call") and called and called.group(1) in nested:
        return nested[called.group(1)]
    return opcode


def describe_schedule(hlo: str) -> list[str]:
    """The schedule in a few lines: the order of collectives and kernel calls (fusions and
    other ops folded into counts), and for every async collective what lies between its start
    and its done."""
    schedule = entry_schedule(hlo)
    nested = nested_kernels(hlo)
    names = [name for name, _, _ in schedule]
    lines, folded = [], 0

    def flush():
        nonlocal folded
        if folded:
            lines.append(f"      ... {folded} other op(s)")
            folded = 0

    important = ("tk_", "conditional", "-start", "-done", "while", "call")
    for name, opcode, rest in schedule:
        kind = kind_of(opcode, rest, nested)
        if any(key in kind for key in important) or kind in ASYNC_PAIRS:
            flush()
            sync = "  [sync]" if '"is_sync":true' in rest.replace(" ", "") else ""
            lines.append(f"    {kind:<32} {name}{sync}")
        elif opcode not in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            folded += 1
    flush()

    summary, overlapped, total = [], 0, 0
    for index, (name, opcode, rest) in enumerate(schedule):
        if not opcode.endswith("-start") or not opcode.startswith(ASYNC_PAIRS):
            continue
        done = next((j for j in range(index + 1, len(schedule))
                     if schedule[j][1].endswith("-done") and
                     re.search(rf"%{re.escape(name)}\b", schedule[j][2])), None)
        between = schedule[index + 1:done] if done is not None else []
        kernels = [kind_of(o, r, nested) for _, o, r in between
                   if o in ("custom-call", "conditional", "fusion", "while", "call")]
        heavy = [k for k in kernels if k.startswith("tk_") or k == "conditional"]
        total += 1
        overlapped += bool(heavy)
        summary.append(f"    {name}: {len(between)} ops between start and done, of them "
                       f"{len(heavy)} attention call(s)/conditional(s) "
                       f"({', '.join(sorted(set(heavy))) or 'none'}), "
                       f"{len(kernels) - len(heavy)} other kernel(s)")
    sync = len(re.findall(r'"is_sync":\s*true', hlo))
    head = [f"  {total} async collective(s) in the entry computation; {overlapped} with an "
            f"attention call or conditional between start and done; {sync} marked is_sync",
            f"  ({len(names)} instructions; order of collectives and kernel calls:)"]
    return head + lines + ["  per collective:"] + summary


# ----------------------------------------------------------------------------------------------
# 3. The trace.


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a, b) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _classify(name: str, stats: dict) -> str:
    text = (name + " " + str(stats.get("hlo_op", ""))).lower()
    if "nccl" in text or "p2p" in text or "peer" in text or any(k in text for k in ASYNC_PAIRS):
        return "comm"
    if "memcpy" in text or "memset" in text:
        return "copy"
    return "compute"


def trace_one_call(call, calls: int = 1) -> list:
    """Device events of `calls` calls queued back to back (one by default): (device plane,
    stream, name, kind, start_us, duration_us)."""
    from jax._src.lib import _profiler
    from jax.profiler import ProfileData

    session = _profiler.ProfilerSession(_profiler.ProfileOptions())
    jax.block_until_ready([call() for _ in range(calls)])
    data = ProfileData.from_serialized_xspace(session.stop())
    events = []
    for plane in data.planes:
        if "/device:" not in plane.name or "CPU" in plane.name:
            continue
        lines = list(plane.lines)
        streams = [line for line in lines if line.name.lower().startswith("stream")] or lines
        for line in streams:
            for e in line.events:
                stats = {}
                try:
                    stats = dict(e.stats)
                except Exception:  # a stat the binding cannot convert: not needed
                    pass
                events.append((plane.name, line.name, e.name, _classify(e.name, stats),
                               e.start_ns / 1e3, e.duration_ns / 1e3))
    return events


def describe_queued(events, calls: int, min_gap_us: float = 50.0) -> list[str]:
    """Steady state: per device, the span of `calls` queued calls over their count, and the
    idle gaps of at least `min_gap_us` between kernels (where the device waited: for the host,
    a peer or a transfer)."""
    if not events:
        return ["  no device events in the trace"]
    out = [f"  {calls} queued calls, per device: span / call (ms), idle gaps >= "
           f"{min_gap_us:.0f} us (count, total ms)"]
    for plane in sorted({e[0] for e in events}):
        busy = _union([(s, s + d) for p, _, _, _, s, d in events if p == plane])
        gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= min_gap_us]
        span = busy[-1][1] - busy[0][0]
        out.append(f"  {plane}: {span / calls / 1e3:.2f} | {len(gaps)}, {sum(gaps) / 1e3:.2f}")
    return out


def describe_trace(events, timeline_lines: int) -> list[str]:
    if not events:
        return ["  no device events in the trace (a CPU run, or the profiler saw no GPU)"]
    out = ["  per device: busy compute | NCCL kernels | NCCL time overlapping compute "
           "(share) | copies/memsets | span (ms)"]
    for plane in sorted({e[0] for e in events}):
        mine = [e for e in events if e[0] == plane]
        by_kind = {kind: _union([(s, s + d) for _, _, _, k, s, d in mine if k == kind])
                   for kind in ("compute", "comm", "copy")}
        comm = _length(by_kind["comm"])
        overlap = _intersection(by_kind["comm"], by_kind["compute"])
        span = max(s + d for *_, s, d in mine) - min(s for *_, s, _ in mine)
        share = f"{100 * overlap / comm:.0f}%" if comm else "-"
        copies = sum(1 for e in mine if e[3] == "copy")
        out.append(f"  {plane}: {_length(by_kind['compute']) / 1e3:.2f} | {comm / 1e3:.2f} | "
                   f"{overlap / 1e3:.2f} ({share}) | {copies} | {span / 1e3:.2f}")
    first = sorted({e[0] for e in events})[0]
    mine = sorted((e for e in events if e[0] == first), key=lambda e: e[4])
    t0 = mine[0][4]
    out.append(f"  timeline of {first} (start and duration in us; runs of small kernels "
               f"folded):")
    shown, run = 0, []

    def flush_run():
        if run:
            out.append(f"    {run[0][4] - t0:>10.0f} {sum(e[5] for e in run):>9.0f}  "
                       f"{len(run)} small kernel(s) on {run[0][1]}")
            run.clear()

    for e in mine:
        if shown >= timeline_lines:
            out.append(f"    ... {len(mine)} events in all")
            break
        plane, stream, name, kind, start, duration = e
        if kind == "compute" and duration < 50 and "tk" not in name.lower():
            run.append(e)
            continue
        flush_run()
        out.append(f"    {start - t0:>10.0f} {duration:>9.0f}  [{kind}] {stream}: {name[:90]}")
        shown += 1
    flush_run()
    return out


# ----------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=parse_int_list, default=[65536], help="e.g. 64k")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--programs", default="ring,sequence")
    parser.add_argument("--schedulers", default="default,lhs")
    parser.add_argument("--backend", default="kernel", choices=["kernel", "auto", "reference"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--timeline", type=int, default=80, help="timeline lines per run")
    parser.add_argument("--hlo-out", help="also write each compiled HLO text to this folder")
    parser.add_argument("--queued", type=int, default=0,
                        help="also trace this many calls queued back to back (steady state)")
    args = parser.parse_args()

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("seq",))
    print(f"{len(devices)} x {devices[0].device_kind}; jax {jax.__version__}", flush=True)
    for t in args.t:
        for program in args.programs.split(","):
            step, inputs = build(program, mesh, t, args.heads, args.kv_heads or args.heads,
                                 args.d, args.backend)
            for scheduler in args.schedulers.split(","):
                title = f"== {program}, T={t}, H={args.heads}, scheduler={scheduler}"
                print("\n" + title, flush=True)
                started = time.perf_counter()
                compiled = jax.jit(step).lower(*inputs).compile(
                    compiler_options=SCHEDULERS[scheduler])
                print(f"  compiled in {time.perf_counter() - started:.1f} s")
                hlo = compiled.as_text()
                if args.hlo_out:
                    folder = pathlib.Path(args.hlo_out)
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / f"{program}-{t}-{scheduler}.hlo.txt").write_text(hlo)
                print("\n".join(describe_schedule(hlo)))
                call = functools.partial(compiled, *inputs)
                jax.block_until_ready(call())
                times = []
                for _ in range(args.reps):
                    started = time.perf_counter()
                    jax.block_until_ready(call())
                    times.append((time.perf_counter() - started) * 1e3)
                print(f"  fwd+bwd: median {statistics.median(times):.2f} ms "
                      f"(min {min(times):.2f}, {args.reps} calls)")
                print("\n".join(describe_trace(trace_one_call(call), args.timeline)), flush=True)
                if args.queued:
                    events = trace_one_call(call, args.queued)
                    print("\n".join(describe_queued(events, args.queued)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
