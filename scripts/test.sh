#!/usr/bin/env bash
# The tests: the whole pytest suite, in the environment scripts/env.sh creates or reuses.
# Arguments go to pytest (default: -q).  Fails when pytest collected no test (its exit
# status 5), so a run that tested nothing never passes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
rc=0
"$ASYNCFEED_PY" -m pytest "${@:--q}" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
