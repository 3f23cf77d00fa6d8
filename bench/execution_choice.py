"""Which execution AsyncLoader's defaults choose on each workload, in the bench's own
conditions, over many runs (docs/benchmarks.md, "Which execution the defaults chose").

Every run is what ``asyncfeed bench`` runs for the workload's default row: a fresh
process forked by the bench's fork server, one epoch, the benchmark process reading
the run's memory as it does (RSS every 20 ms, PSS every second, every 0.25 s in (b)).
For each run it prints the rate and ``stats().execution`` (which execution ran and
why); at the end, per workload, how many runs chose worker processes and the median
rate of the runs on threads and on processes.  With ``--tree`` the runs alternate
between this tree and another (``SRC`` of another checkout), each side with its own
fork server, so a change to the rules that choose can be judged side by side:

    PYTHONPATH=src python bench/execution_choice.py 8
    PYTHONPATH=src python bench/execution_choice.py 8 --workloads b,g --tree /tmp/old/src

Needs the synthetic set (``asyncfeed bench`` makes it).  The choice is a first pass's
reading of its first rows, so on a shared machine it varies from run to run: count
many runs, not one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from asyncfeed._bench.client import RunServer
from asyncfeed._bench.config import Config, Settings
from asyncfeed._bench.runner import Bench
from asyncfeed._bench.synthetic import ensure_synthetic

kinds = {"a": "folder", "b": "ram", "c": "gil", "g": "pil"}
workload, runs, workdir = sys.argv[2], int(sys.argv[3]), sys.argv[4]
threads = int(sys.argv[5]) if len(sys.argv) > 5 else None
bench = Bench(Settings(root=ensure_synthetic(1000, 10), synthetic=True), log=lambda m: None)
family = "asyncfeed-map" if workload == "b" else "asyncfeed"
spec = bench._spec(Config(workload, family, threads, dataset=kinds[workload], role="default"))
server = RunServer(workdir)
try:
    for _ in range(runs):
        out = server.run(spec, timeout=300, pss_interval=0.25 if workload == "b" else 1.0)
        stats = out.get("loader_stats") or {}
        print(json.dumps({"ok": bool(out.get("ok")), "rate": out.get("rate"),
                          "execution": stats.get("execution") or out.get("error", "")}),
              flush=True)
finally:
    server.close()
"""


def _runs(src: str, workload: str, n: int, threads: int | None = None) -> list[dict]:
    """``n`` runs of ``workload``'s default row on the tree at ``src`` (its own fork
    server), with ``num_threads=threads`` where given: each run's ``ok``, ``rate``
    and ``execution``."""
    cmd = [sys.executable, "-c", _CHILD, src, workload, str(n)]
    with tempfile.TemporaryDirectory() as workdir:
        out = subprocess.run(cmd + [workdir] + ([str(threads)] if threads is not None else []),
                             capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"the runs of ({workload}) failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=int, nargs="?", default=8, help="runs per workload and tree")
    ap.add_argument("--workloads", default="a,b,c,g", help="comma-separated subset of a,b,c,g")
    ap.add_argument("--tree", help="another tree's src/ to alternate with")
    ap.add_argument("--per-server", type=int, default=2,
                    help="runs per fork server before the other tree's turn (2)")
    args = ap.parse_args()
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    trees = {"this": here} | ({"other": args.tree} if args.tree else {})
    got: dict[tuple[str, str], list[dict]] = {}
    done = 0
    while done < args.runs:
        step = min(args.per_server, args.runs - done)
        for workload in args.workloads.split(","):
            for name, src in trees.items():
                for r in _runs(src, workload, step):
                    got.setdefault((workload, name), []).append(r)
                    print(f"({workload}) {name:5} {r['rate'] or 0:8.0f}/s  {r['execution'][:110]}",
                          flush=True)
        done += step
    print()
    for (workload, name), rs in sorted(got.items()):
        procs = [r["rate"] for r in rs if r["ok"] and r["execution"].startswith("processes")]
        thr = [r["rate"] for r in rs if r["ok"] and not r["execution"].startswith("processes")]

        def med(xs: list[float]) -> str:
            return f"{statistics.median(xs):,.0f}/s" if xs else "-"

        print(f"({workload}) {name:5} processes in {len(procs)} of {len(rs)} runs; "
              f"median rate on threads {med(thr)}, on processes {med(procs)}")


if __name__ == "__main__":
    main()
