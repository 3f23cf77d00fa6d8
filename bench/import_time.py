"""How long ``import asyncfeed`` takes after ``import torch``, in fresh processes.

    python bench/import_time.py                 # median of 15 runs, limit 60 ms, top imports
    python bench/import_time.py --runs 31 --limit-ms 60 --top 15

Each run is a new interpreter that imports torch, then times ``import asyncfeed`` with
``time.perf_counter``; the figure is the median over the runs.  A first, uncounted run
writes the bytecode cache (as ``pip install`` does for an installed package; with
``PYTHONDONTWRITEBYTECODE`` set every run would recompile the package instead, ~20 ms
here).  The asyncfeed measured is this checkout's ``src/``.

Also reported: full (generation 2) garbage collections that ran during the import.
After ``import torch`` one is due, and torch's heap makes it cost ~45 ms here: any
import that allocates ~10,000 objects next pays it (OpenCV, Pillow and uvloop together
did, when ``import asyncfeed`` imported them).  With ``--top N``, the N modules with the
largest own import time (``python -X importtime``) among those the import loaded.

Exit status 1 when the median exceeds ``--limit-ms``.  Timings on a shared machine are
noisy: read the median, and rerun when the spread is wide.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = r"""
import gc, json, sys, time
import torch
full = []
gc.callbacks.append(lambda phase, info: full.append(phase) if info["generation"] == 2 else None)
before = set(sys.modules)
t0 = time.perf_counter()
import asyncfeed
ms = (time.perf_counter() - t0) * 1000
new = sorted({m.split(".")[0] for m in set(sys.modules) - before})
print(json.dumps({"ms": ms, "full_gcs": full.count("start"), "new_top_level": new}))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    src = os.path.join(ROOT, "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def probe(python: str) -> dict:
    """One fresh interpreter: ``import torch``, then time ``import asyncfeed``."""
    out = subprocess.run([python, "-c", _PROBE], env=_env(), check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def top_imports(python: str, n: int) -> list[tuple[float, float, str]]:
    """``(self ms, cumulative ms, module)`` of the ``n`` slowest modules ``import asyncfeed``
    loaded after torch (``-X importtime`` lists modules in completion order; torch's own
    block ends with its top-level line)."""
    err = subprocess.run([python, "-X", "importtime", "-c", "import torch; import asyncfeed"],
                         env=_env(), check=True, capture_output=True, text=True).stderr
    rows, after_torch = [], False
    for line in err.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        own, cum, name = (part.strip() for part in line[len("import time:"):].split("|"))
        if not own.isdigit():
            continue  # the header line
        if after_torch:
            rows.append((int(own) / 1000, int(cum) / 1000, name.strip()))
        elif name == "torch":
            after_torch = True
    return sorted(rows, reverse=True)[:n]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=15, help="fresh processes to time (15)")
    p.add_argument("--limit-ms", type=float, default=60.0, help="fail above this median (60)")
    p.add_argument("--top", type=int, default=10, help="slowest imports to list (10; 0: none)")
    p.add_argument("--python", default=sys.executable, help="interpreter (this one)")
    args = p.parse_args(argv)

    probe(args.python)  # writes the bytecode cache; not counted
    runs = [probe(args.python) for _ in range(max(1, args.runs))]
    ms = [r["ms"] for r in runs]
    med = statistics.median(ms)
    gcs = sum(1 for r in runs if r["full_gcs"])
    print(f"import asyncfeed after import torch: median {med:.1f} ms "
          f"(min {min(ms):.1f}, max {max(ms):.1f}) over {len(ms)} fresh processes; "
          f"a full GC ran in {gcs} of them")
    print(f"packages it imported: {', '.join(runs[-1]['new_top_level'])}")
    if args.top > 0:
        print(f"slowest imports (python -X importtime, one run), own / cumulative ms:")
        for own, cum, name in top_imports(args.python, args.top):
            print(f"  {own:7.2f} {cum:8.2f}  {name}")
    ok = med <= args.limit_ms
    print(f"limit {args.limit_ms:g} ms: {'OK' if ok else 'EXCEEDED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
