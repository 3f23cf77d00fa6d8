"""When workload (c)'s first pass starts its process stage, over fresh processes.

Each run is a fresh interpreter (the verdict is a first pass's): it builds the
default loader over (c)'s GIL-bound set (320 samples, batch 32), records when
the process stage begins forking (``ProcessStage._start``), when the first batch
arrives and when the epoch ends, all in ms from the loader's construction.
Prints each run and the medians.  Compare two trees side by side (A B A B) with
``PYTHONPATH``:

    python bench/stage_start.py 15                      # this tree
    python bench/stage_start.py 15 --tree /tmp/old/src  # alternating with another
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_ONE = r"""
import time, torch
torch.set_num_threads(1)
from asyncfeed._bench.synthetic import ensure_synthetic
from asyncfeed._bench.workloads import build_dataset
from asyncfeed import AsyncLoader
from asyncfeed._engine import processes
seen = {}
start = processes.ProcessStage._start
def timed(self):
    seen.setdefault("fork", time.perf_counter())
    return start(self)
processes.ProcessStage._start = timed
ds, order = build_dataset({"kind": "gil", "root": ensure_synthetic(2000, 10), "size": 224,
                           "samples": 320, "seed": 0})
t0 = time.perf_counter()
with AsyncLoader(ds, batch_size=32, sampler=order) as loader:
    it = iter(loader)
    next(it)
    t1 = time.perf_counter()
    for _ in it:
        pass
    t2 = time.perf_counter()
print(1e3 * (seen.get("fork", t2) - t0), 1e3 * (t1 - t0), 1e3 * (t2 - t0))
"""


def _run(tree: str | None) -> list[float]:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree
    out = subprocess.run([sys.executable, "-c", _ONE], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return [float(x) for x in out[-3:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=int, nargs="?", default=10)
    ap.add_argument("--tree", help="another tree's src/ to alternate with")
    a = ap.parse_args()
    sides = {"this": None} | ({"other": a.tree} if a.tree else {})
    got: dict[str, list[list[float]]] = {k: [] for k in sides}
    for i in range(a.runs):
        for name, tree in sides.items():
            got[name].append(_run(tree))
            fork, first, epoch = got[name][-1]
            print(f"{i:3d} {name:5s} stage forks at {fork:6.0f} ms, first batch {first:6.0f}, "
                  f"epoch {epoch:6.0f}", flush=True)
    for name, runs in got.items():
        forks = sorted(r[0] for r in runs)
        print(f"{name}: stage forks at median {statistics.median(forks):.0f} ms "
              f"(slowest {forks[-1]:.0f}), first batch "
              f"{statistics.median(r[1] for r in runs):.0f} ms, epoch "
              f"{statistics.median(r[2] for r in runs):.0f} ms over {len(runs)} runs")


if __name__ == "__main__":
    main()
