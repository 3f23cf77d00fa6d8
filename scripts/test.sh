#!/usr/bin/env bash
# The tests: the type check of src/ (mypy, settings in pyproject.toml's [tool.mypy]) and the
# whole pytest suite, in the environment scripts/env.sh creates or reuses.  Arguments go to
# pytest (default: -q).  Fails when either fails, and when pytest collected no test (its
# exit status 5), so a run that tested nothing never passes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
typed=0
"$ASYNCFEED_PY" -m mypy || typed=$?
rc=0
"$ASYNCFEED_PY" -m pytest "${@:--q}" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests: failing" >&2
  exit 1
fi
if [ "$typed" -ne 0 ]; then
  echo "scripts/test.sh: the type check of src/ failed (see mypy's report above)" >&2
  [ "$rc" -ne 0 ] || rc=1
fi
exit "$rc"
