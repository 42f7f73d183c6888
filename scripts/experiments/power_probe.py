"""Throughput, SM clock and board power of attention contenders, each alone and sustained.

Under sustained load an H100 SXM runs attention at its 700 W limit and lowers its SM clock to
stay there, so a kernel's speed depends on its energy per FLOP as well as its cycles per FLOP.
This script separates the two. Each contender runs one cell alone for --seconds after
--idle seconds of rest, while nvidia-smi samples the SM clock and power every 50 ms; over the
second half of each run it prints TFLOP/s, the median MHz and W, and TFLOP/s per GHz (work per
cycle) and per kW (work per joule):

    python3 scripts/experiments/power_probe.py --d 128 --t 16k --contenders tk,fa3
    python3 scripts/experiments/power_probe.py --d 256 --t 8k --causal yes --fwd-only --contenders tk,cudnn

The cells are the bench grid's (B * T = 16384 tokens, Hq * D = 2048). Needs nvidia-smi."""
import argparse
import csv
import datetime
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout's bench/
from bench import Runner, attention, parse_int_list, prepare_runner


def run_alone(runner, seconds: float) -> tuple[float, float, int]:
    """Calls the runner back to back for `seconds`; returns (start, end, calls) of the second half
    (of all of it when one batch of calls outlasts `seconds`)."""
    start, half, calls, calls_half = time.time(), None, 0, 0
    while time.time() - start < seconds:
        for _ in range(5):
            out = runner.call(calls % runner.n_sets)
            calls += 1
        runner.clock.sync(out)
        if half is None and time.time() - start >= seconds / 2:
            half, calls_half = time.time(), calls
    if half is None or calls_half == calls:
        return start, time.time(), calls
    return half, time.time(), calls - calls_half


def read_samples(path: str) -> list[tuple[float, float, float]]:
    """(unix time, SM MHz, W) rows of nvidia-smi's csv, skipping any it could not read."""
    rows = []
    with open(path) as f:
        lines = list(csv.reader(f))
    for r in lines:
        try:
            ts = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((ts, float(r[1]), float(r[2])))
        except (ValueError, IndexError):
            pass
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=parse_int_list, default=[128])
    parser.add_argument("--t", type=parse_int_list, default=[16384])
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="no")
    parser.add_argument("--fwd-only", action="store_true", help="forward only (default fwd+bwd)")
    parser.add_argument("--contenders", default="tk,fa3", help="comma-separated bench contender names")
    parser.add_argument("--seconds", type=float, default=6.0, help="run time of each contender")
    parser.add_argument("--idle", type=float, default=3.0, help="rest before each run, seconds")
    args = parser.parse_args()
    names = [n for n in args.contenders.split(",") if n]
    available = {c.name: c for c in attention.contenders("kernel")}
    unknown = [n for n in names if n not in available]
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; the bench knows {sorted(available)}")
    if shutil.which("nvidia-smi") is None:
        parser.error("needs nvidia-smi (an NVIDIA GPU machine) to read the SM clock and power")
    configs = attention.make_configs(args.t, args.d, attention.CAUSAL_CHOICES[args.causal],
                                     (False,) if args.fwd_only else (True,))

    log = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    log_file = open(log, "w")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=log_file, stderr=subprocess.STDOUT)
    windows = []
    try:
        for cfg in configs:
            for name in names:
                runner = prepare_runner(available[name], cfg)
                if not isinstance(runner, Runner):
                    print(f"{cfg.label()} {name}: not run ({': '.join(runner)})", file=sys.stderr)
                    continue
                runner.clock.sync(runner.call(0))  # compile and warm up
                time.sleep(args.idle)
                t0, t1, calls = run_alone(runner, args.seconds)
                windows.append((cfg.label(), name, t0, t1, attention.attention_flops(cfg) * calls / (t1 - t0) / 1e12))
                print(f"{cfg.label()} {name}: {windows[-1][-1]:.0f} TFLOP/s", file=sys.stderr, flush=True)
                if runner.release is not None:
                    runner.release()
                del runner
    finally:
        smi.terminate()
        smi.wait()
        log_file.close()

    samples = read_samples(log)
    print("| cell | contender | TFLOP/s | SM MHz (median) | W (median) | TFLOP/s per GHz | TFLOP/s per kW |")
    print("|---|---|---|---|---|---|---|")
    for cell, name, t0, t1, tflops in windows:
        inside = [(mhz, w) for ts, mhz, w in samples if t0 <= ts <= t1]
        if not inside:
            print(f"| {cell} | {name} | {tflops:.0f} | - | - | - | - |")
            continue
        mhz, watts = statistics.median(m for m, _ in inside), statistics.median(w for _, w in inside)
        print(f"| {cell} | {name} | {tflops:.0f} | {mhz:.0f} | {watts:.0f} | "
              f"{tflops / mhz * 1000:.0f} | {tflops / watts * 1000:.0f} |")


if __name__ == "__main__":
    main()
