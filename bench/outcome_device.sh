#!/usr/bin/env bash
# The outcome bench on a many-core machine in one command (docs/architecture.md,
# "Measured on 16 cores"): bench/outcome.py over the seven sets against DataLoader
# num_workers 0, 4 and the cores, then bench/process_inflight.py beside DataLoader's
# workers on cifar-rng and text.  For the lent GPU machine (its 16 cores):
#
#   run(command="bash bench/outcome_device.sh", carry=[".whl"], timeout_s=420)
#
# (.whl: the simplejpeg wheel, as bench/gpu_check.sh fetches it).  Outputs go to
# $OUT (or bench-results/): outcome.json (every round, merged as outcome.py --json
# writes it), outcome.txt, inflight.txt.  Each step runs under its own timeout, so a
# slow one leaves the others' results.  QUICK=1: tiny data sets and no in-flight
# runs, a smoke test.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
cd "$repo" || exit 2
py="${PYTHON:-python3}"
if ! "$py" -c "import simplejpeg" 2>/dev/null; then
  tag="cp$("$py" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
  wheels=(.whl/simplejpeg-*-"$tag"-*.whl)
  if [ -e "${wheels[0]}" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "${wheels[@]}" && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
out="${OUT:-$repo/bench-results}"
mkdir -p "$out"
cores="$("$py" -c 'import os; print(len(os.sched_getaffinity(0)))')"
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
rc=0
# detection apart: its rounds are the slowest, and the others' results should not wait on it
for sets in gil-python,text,gil-free,cifar-rng,audio,png-augment detection; do
  timeout "${STEP_S:-200}" "$py" bench/outcome.py "${quick[@]}" --rounds 1 --timeout 120 \
    --datasets "$sets" --workers "0,4,$cores" --epochs 3 \
    --json "$out/outcome-${sets%%,*}.json" >> "$out/outcome.txt" 2>&1 || rc=1
done
"$py" - "$out" <<'PY' || rc=1
import json, os, sys
out = sys.argv[1]
parts = [os.path.join(out, f) for f in ("outcome-gil-python.json", "outcome-detection.json")]
parts = [json.load(open(p)) for p in parts if os.path.exists(p)]
if parts:
    merged = parts[0]
    for p in parts[1:]:
        merged["rounds"] += p["rounds"]
    json.dump(merged, open(os.path.join(out, "outcome.json"), "w"), indent=1)
PY
# the merged rounds' summary and table, as one run of all seven would write them
[ -e "$out/outcome.json" ] && { "$py" bench/outcome.py --report "$out/outcome.json" \
  >> "$out/outcome.txt" 2>&1 || rc=1; }
[ -n "${QUICK:-}" ] && { tail -n 30 "$out/outcome.txt"; exit "$rc"; }  # no in-flight runs
for ds in cifar-rng text; do
  timeout "${INFLIGHT_S:-60}" "$py" bench/process_inflight.py --dataset "$ds" \
    --workers "$cores" --configs dl,default,dl >> "$out/inflight.txt" 2>&1 || rc=1
done
tail -n 40 "$out/outcome.txt" "$out/inflight.txt"
exit "$rc"
