#!/usr/bin/env bash
# On the H100 machine: time kernel variants against each other in one call.
#
# A variant is a folder .ab/<name>/ holding its cpp/ and tk_jax/ (copies from a checkout of
# that variant; .ab/ is ignored, so name it in the device tool's carry). Rounds run in the
# order given: mirror it (m c c m) so that drift in clocks cancels. Each point is timed after
# the bench's --settle second, at the clocks the card sustains (rounds of one variant then
# agree within ~1%; burst-timed rounds differed by up to 6%). Before each round only the
# files that differ from the tree in place are copied over it, so ninja rebuilds only the
# translation units that include them. The bench itself (bench/) is the checkout's in every
# round.
#
# Usage: scripts/experiments/ab_bench.sh "<python3 -m bench attention arguments>" m c c m
#   e.g. scripts/experiments/ab_bench.sh "--d 128 --t 4k,16k --reps 7" m c c m
#   AB_SUITE=based scripts/experiments/ab_bench.sh "--t 2k,8k --no-decode" m c c m
#   AB_SUITE=decode AB_CONTENDERS=tk,tk_paged64 scripts/experiments/ab_bench.sh "--d 128" m c c m
#     (tk's contenders to time: tk alone unless AB_CONTENDERS names others)
# Prints a table last: one row per cell, the mean TFLOP/s (attention, gqa, packed), Mtoken/s
# (based) or TB/s (decode) of each variant over its rounds, and each round's number. The log
# (and the table so far, ab_table.md) go to $OUT when set.
set -uo pipefail
cd "$(dirname "$0")/../.."
BENCH_ARGS="$1"
shift
LOG="${OUT:-/tmp/tk_jax_ab}/ab.log"
WORK=/tmp/tk_jax_ab_runs
mkdir -p "$(dirname "$LOG")" "$WORK"
export PYTHONUNBUFFERED=1

# The table of the rounds run so far (rewritten after each round, so a call cut short by its
# time limit still brings one back).
summarize() {
  python3 - "$WORK" "$@" <<'EOF'
import glob, json, os, sys
work, order = sys.argv[1], sys.argv[2:]
variants = list(dict.fromkeys(order))
cells = {}  # the cell's config, as text -> variant -> [speed per round]
for round_, variant in enumerate(order, 1):
    for path in glob.glob(os.path.join(work, f"r{round_}-{variant}", "*.json")):
        for o in json.load(open(path)).get("results", []):
            metrics = o.get("metrics", {})
            speed = metrics.get("tflops", metrics.get("mtokens_per_s", metrics.get("tb_per_s")))
            if o.get("status") == "ok" and speed is not None:
                key = " ".join(f"{k}={v}" for k, v in sorted(o["config"].items()))
                if o.get("contender", "tk") != "tk":  # several of tk's contenders: a row each
                    key = f"{o['contender']} {key}"
                cells.setdefault(key, {}).setdefault(variant, []).append(speed)
base = variants[0]
def fmt(x):  # TFLOP/s and Mtoken/s as integers, TB/s with three digits
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"
print("| cell | " + " | ".join(variants) + " | rounds |")
print("|---" * (2 + len(variants)) + "|")
for key in sorted(cells):
    row = cells[key]
    means = {v: sum(row[v]) / len(row[v]) for v in variants if row.get(v)}
    shown = []
    for v in variants:
        if v not in means:
            shown.append("-")
        elif v == base or base not in means:
            shown.append(fmt(means[v]))
        else:
            shown.append(f"{fmt(means[v])} ({100 * (means[v] / means[base] - 1):+.1f}%)")
    rounds = " ".join(f"{v}:" + "/".join(fmt(x) for x in row.get(v, [])) for v in variants)
    print(f"| {key} | " + " | ".join(shown) + f" | {rounds} |")
EOF
}

# A warm device machine keeps build/ from the last call, and the tree arrives with older file
# times than those objects: start from a clean build, then copy under new times (below).
rm -rf build
round=0
for variant in "$@"; do
  round=$((round + 1))
  if [ ! -d ".ab/$variant/cpp" ]; then echo "no tree .ab/$variant/cpp" | tee -a "$LOG"; exit 2; fi
  python3 - "$variant" <<'EOF'
import filecmp, os, shutil, sys
tree = os.path.join(".ab", sys.argv[1])
for top in ("cpp", "tk_jax"):
    src_root = os.path.join(tree, top)
    if not os.path.isdir(src_root):
        continue
    wanted = set()
    for folder, _, files in os.walk(src_root):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), tree)
            wanted.add(rel)
            if not os.path.exists(rel) or not filecmp.cmp(os.path.join(tree, rel), rel, shallow=False):
                os.makedirs(os.path.dirname(rel), exist_ok=True)
                shutil.copyfile(os.path.join(tree, rel), rel)  # a new mtime, so ninja rebuilds
                print("  copied", rel)
    if top == "cpp":  # a source the variant lacks must not be compiled into it
        for folder, _, files in os.walk(top):
            for name in files:
                rel = os.path.join(folder, name)
                if rel not in wanted:
                    os.remove(rel)
                    print("  removed", rel)
EOF
  start=$(date +%s)
  if ! python3 -m pip install --no-build-isolation --no-deps -e . >"$WORK/build-$round.log" 2>&1; then
    tail -40 "$WORK/build-$round.log" | tee -a "$LOG"
    echo "round $round ($variant): BUILD FAILED" | tee -a "$LOG"
    continue
  fi
  echo "round $round ($variant): built in $(($(date +%s) - start)) s" | tee -a "$LOG"
  python3 -m bench "${AB_SUITE:-attention}" $BENCH_ARGS --contenders "${AB_CONTENDERS:-tk}" --no-plot \
    --out "$WORK/r$round-$variant" >>"$LOG" 2>&1 || echo "round $round ($variant): bench exit $?" | tee -a "$LOG"
  summarize "${@:1:$round}" >"$(dirname "$LOG")/ab_table.md"
done
summarize "$@" | tee -a "$LOG"
