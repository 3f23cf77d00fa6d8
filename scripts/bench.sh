#!/usr/bin/env bash
# The main job: `asyncfeed bench` (asyncfeed against DataLoader, torchdata.nodes and SPDL)
# on the built-in synthetic JPEG set, in the environment scripts/env.sh creates or reuses.
#
#   bash scripts/bench.sh             # the full run: table on stdout, asyncfeed-bench.png
#   bash scripts/bench.sh --quick     # seconds: tiny data, one round
#   bash scripts/bench.sh --help      # every option (--data DIR, --json PATH, ...)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$ASYNCFEED_PY" -m asyncfeed._bench.cli bench "$@"
