#!/usr/bin/env bash
# Run the full head-to-head benchmark and keep its outputs under bench-results/ (git-ignored).
#
#   bench/run_bench.sh                 # default settings: synthetic set, all contenders
#   bench/run_bench.sh --data DIR ...  # any `asyncfeed bench` options pass through
#
# Other load distorts every figure (the report flags runs where other processes used
# more than 10% of the machine). With QUIET_WAIT=N set, the script first waits up
# to N seconds for the 1-minute load average to fall below QUIET_LOAD (default 0.5).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
out="$repo/bench-results"
mkdir -p "$out"
stamp="$(date +%Y%m%d-%H%M%S)"
py="${PYTHON:-python}"
if [ -x "$repo/.venv/bin/python" ] && [ -z "${PYTHON:-}" ]; then py="$repo/.venv/bin/python"; fi

if [ -n "${QUIET_WAIT:-}" ]; then
  limit="${QUIET_LOAD:-0.5}"
  deadline=$(( $(date +%s) + QUIET_WAIT ))
  while :; do
    load="$(cut -d' ' -f1 /proc/loadavg)"
    if awk -v l="$load" -v m="$limit" 'BEGIN { exit !(l < m) }'; then break; fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "run_bench: load is still $load after ${QUIET_WAIT}s; running anyway" >&2
      break
    fi
    sleep 5
  done
fi

PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" "$py" -m asyncfeed._bench.cli bench \
  --json "$out/bench-$stamp.json" --plot "$out/bench-$stamp.png" "$@" \
  | tee "$out/bench-$stamp.txt"
