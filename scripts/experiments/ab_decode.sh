#!/usr/bin/env bash
# On the H100 machine: the KV-cache probe (scripts/kvcache_probe.py) on kernel variants, one
# after the other in one call. A variant is a whole source tree in .ab/<name>/ (ignored; name
# .ab in the device tool's carry) or "." for the checkout; each is built and installed in turn.
# Usage: scripts/experiments/ab_decode.sh "<kvcache_probe.py arguments>[|<more arguments>]" . old
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
ARGS="$1"
shift
export PYTHONUNBUFFERED=1
for variant in "$@"; do
  tree=$ROOT; [ "$variant" != . ] && tree=$ROOT/.ab/$variant
  (cd "$tree" && rm -rf build && python3 -m pip install --no-build-isolation --no-deps -e . >/tmp/ab_build_$variant.log 2>&1) \
    || { tail -20 /tmp/ab_build_$variant.log; exit 1; }
  echo "== variant $variant"
  IFS='|' read -ra RUNS <<<"$ARGS"
  for run in "${RUNS[@]}"; do
    (cd /tmp && python3 "$ROOT/scripts/kvcache_probe.py" $run 2>&1 | grep -v -i "warn\|kernel's own")
  done
done
