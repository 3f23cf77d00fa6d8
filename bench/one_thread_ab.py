"""``num_threads=1`` against ``DataLoader(num_workers=0)`` on the CIFAR-like set
(batch 128), in one process, epochs alternating (the order turns each round):
the cheap per-sample path.  Epochs in one process share the machine's state,
which moves between fresh processes by more than the effect.

    PYTHONPATH=src python bench/one_thread_ab.py 36                          # 36 rounds
    PYTHONPATH=src python bench/one_thread_ab.py 36 --samples 20000
    PYTHONPATH=src python bench/one_thread_ab.py 36 --tree /tmp/old/src      # a third side

Each epoch builds its loader afresh (as a training script's ``for epoch`` does
with ``iter()``).  ``--tree`` imports another tree's ``asyncfeed`` (a copy of
its ``src/asyncfeed`` under another package name, in a temporary directory) and
runs it as a third side.  Prints each side's
median epoch rate and the median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncfeed import AsyncLoader
from asyncfeed._bench.workloads import CifarLike


def _other_tree(src: str, into: str) -> Any:
    """``AsyncLoader`` of the tree at ``src`` (its ``src/`` folder), imported as
    ``asyncfeed_other`` (the package imports itself relatively)."""
    shutil.copytree(Path(src) / "asyncfeed", Path(into) / "asyncfeed_other")
    sys.path.insert(0, into)
    return importlib.import_module("asyncfeed_other").AsyncLoader


def _epoch(side: Any, ds: CifarLike, order: list[int]) -> float:
    t0, n = time.perf_counter(), 0
    if side is None:
        for _, y in torch.utils.data.DataLoader(ds, batch_size=128, sampler=order):
            n += len(y)
    else:
        with side(ds, batch_size=128, sampler=order, num_threads=1) as loader:
            for _, y in loader:
                n += len(y)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", type=int, nargs="?", default=36)
    ap.add_argument("--samples", type=int, default=5000, help="samples an epoch (5000)")
    ap.add_argument("--tree", help="another tree's src/ to run as a third side")
    a = ap.parse_args()
    torch.set_num_threads(1)
    np.random.seed(0)
    ds = CifarLike(a.samples)
    order = list(range(a.samples))
    with tempfile.TemporaryDirectory() as tmp:
        sides: dict[str, Any] = {"DataLoader w=0": None, "asyncfeed t=1": AsyncLoader}
        if a.tree:
            sides["other tree t=1"] = _other_tree(a.tree, tmp)
        for side in sides.values():
            _epoch(side, ds, order)  # warm-up epochs
        got: dict[str, list[float]] = {k: [] for k in sides}
        orders = list(itertools.permutations(sides))
        for r in range(a.rounds):
            for name in orders[r % len(orders)]:
                got[name].append(_epoch(sides[name], ds, order))
    base = got["DataLoader w=0"]
    for name, rates in got.items():
        line = f"{name:16s} {statistics.median(rates):10,.0f} samples/s"
        if name != "DataLoader w=0":
            ratios = [x / b for x, b in zip(rates, base)]
            line += f"   per-round ratio to w=0: median {statistics.median(ratios):.3f}"
        print(line)
    if a.tree:
        ratios = [x / b for x, b in zip(got["asyncfeed t=1"], got["other tree t=1"])]
        print(f"this tree against the other: median per-round ratio {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
