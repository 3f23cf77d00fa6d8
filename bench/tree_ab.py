"""Two source trees side by side, each execution fixed: is a change that should not
move the speed within noise of the tree before it?

Rounds alternate the trees (A B, then B A), every run in a fresh process that
imports only its own tree:

- the bench's workloads (a), (b), (c) and (g), each run as ``asyncfeed bench`` runs
  its default row (one epoch, a fresh process forked by that tree's own fork
  server), with ``num_threads`` fixed so that both trees run the same execution;
- the outcome bench's data sets (``asyncfeed._bench.userdata``), each with the
  execution fixed (``inline``, ``threads`` or ``processes``), or ``auto`` to compare
  the trees' choices, three epochs on one loader: the first epoch and the steady
  state (the median of the later two).

It prints each run (with the execution it ended on), then per case the median and
the slowest run of each tree and the ratio of the medians (B over A).
``--neighbour`` runs every turn beside a busy-looping process::

    git worktree add /tmp/before <commit>
    PYTHONPATH=src python bench/tree_ab.py /tmp/before/src src --rounds 8
    PYTHONPATH=src python bench/tree_ab.py /tmp/before/src src --workloads "" \
        --datasets gil-python:auto,gil-free:auto --neighbour

Needs the synthetic set for the workloads (``asyncfeed bench`` makes it).  Measure
on a machine that nothing else loads: both trees share it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from asyncfeed._bench.neighbour import busy_neighbour
from execution_choice import _runs  # bench/ is the script's own directory

# the public API and userdata.build only: the tree before may predate the outcome
# bench's own round runner (asyncfeed._bench.outcome_round) and its options
_DATASET_CHILD = r"""
import json, sys, time
from asyncfeed import AsyncLoader
from asyncfeed._bench.userdata import build

name, execution = sys.argv[1], sys.argv[2]
b = build(name)
kw = dict(batch_size=b.batch_size, sampler=b.order, execution=execution)
if b.collate_fn is not None:
    kw["collate_fn"] = b.collate_fn
rates = []
with AsyncLoader(b.dataset, **kw) as loader:
    for _ in range(3):
        t0 = time.perf_counter()
        for _batch in loader:
            pass
        rates.append(len(b.order) / (time.perf_counter() - t0))
    chosen = str(loader.stats().execution).split(" (")[0]
print(json.dumps({"rates": rates, "execution": chosen}))
"""


def _run(src: str, case: tuple[str, str], threads: int, neighbour: bool
         ) -> list[tuple[list[float], str]]:
    """One turn of ``case`` on the tree at ``src``: each run's epoch rates and the
    execution it ended on ("" where not known); with ``neighbour``, beside a
    busy-looping process started for the turn."""
    with busy_neighbour(neighbour):
        return _turn(src, case, threads)


def _turn(src: str, case: tuple[str, str], threads: int) -> list[tuple[list[float], str]]:
    kind, what = case
    if kind == "workload":  # the bench's own run, as execution_choice.py makes it
        return [([r["rate"] or 0.0], str(r["execution"]).split(" (")[0])
                for r in _runs(src, what, 1, threads)]
    name, execution = what.split(":")
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, "-c", _DATASET_CHILD, name, execution],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{what} on {src} failed:\n{out.stderr[-3000:]}")
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [(r["rates"], r.get("execution", "")) for r in runs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree_a", help="the tree before the change: its src/")
    ap.add_argument("tree_b", help="the tree after it: its src/")
    ap.add_argument("--rounds", type=int, default=8, help="runs per case and tree (8)")
    ap.add_argument("--workloads", default="a,b,c,g",
                    help="the bench's workloads, comma-separated ('' for none)")
    ap.add_argument("--threads", type=int, default=2, help="num_threads for the workloads (2)")
    ap.add_argument("--datasets", default="detection:inline,text:inline,gil-python:processes,"
                    "cifar-rng:processes,gil-free:threads",
                    help="outcome-bench data sets with their fixed execution ('' for none)")
    ap.add_argument("--neighbour", action="store_true",
                    help="run every turn beside a busy-looping process (a noisy machine)")
    args = ap.parse_args()
    cases = [("workload", w) for w in args.workloads.split(",") if w]
    cases += [("dataset", d) for d in args.datasets.split(",") if d]
    trees = {"A": args.tree_a, "B": args.tree_b}
    got: dict[tuple[str, str], list[list[float]]] = {}
    for r in range(args.rounds):
        for case in cases:
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                for rates, chosen in _run(trees[name], case, args.threads, args.neighbour):
                    got.setdefault((case[1], name), []).append(rates)
                    shown = " ".join(f"{x:,.0f}" for x in rates)
                    print(f"{case[1]:22} {name} {shown}  {chosen}", flush=True)
    print("\ncase                   epoch   A median (slowest)   B median (slowest)   B/A")
    for _, what in cases:
        runs_a, runs_b = got[(what, "A")], got[(what, "B")]
        phases = [("first", lambda rs: rs[0])]
        if len(runs_a[0]) > 1:
            phases.append(("steady", lambda rs: statistics.median(rs[1:])))
        for phase, pick in phases:
            a = [pick(rs) for rs in runs_a]
            b = [pick(rs) for rs in runs_b]
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"{what:22} {phase:6} {ma:9,.0f} ({min(a):7,.0f})  {mb:9,.0f} ({min(b):7,.0f})"
                  f"  {mb / ma:5.3f}")


if __name__ == "__main__":
    main()
