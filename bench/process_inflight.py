"""Worker processes against DataLoader on one data set of the outcome bench
(``asyncfeed._bench.userdata``): how the batches in flight (``prefetch``) and the
size of a worker's task change what ``AsyncLoader(execution="processes")``
delivers, and where the CPU goes (the loader's process, its workers).

    PYTHONPATH=src python bench/process_inflight.py --dataset cifar-rng --workers 16
    PYTHONPATH=src python bench/process_inflight.py --dataset text \\
        --configs dl,default,prefetch=3,prefetch=32:batch-tasks

Each configuration runs ``--epochs`` epochs on one loader (a fresh one each
configuration; DataLoader with ``persistent_workers=True``) and prints each
epoch's rows/s with the cores the loader's process and its children kept busy.
Configurations: ``dl`` (DataLoader, ``num_workers=--workers``), ``default``
(AsyncLoader's defaults under processes), ``prefetch=N`` (a given prefetch),
each optionally ``:batch-tasks`` (every task a whole batch: the task size
patched, to compare with how the stage cuts them).  Run ``dl`` first and last
to see the machine's drift.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import psutil
from torch.utils.data import DataLoader

from asyncfeed import AsyncLoader
from asyncfeed._bench import userdata
from asyncfeed._engine.processes import stage as stage_mod


def _cpu() -> tuple[float, float]:
    """CPU seconds of this process and of its children so far."""
    me = psutil.Process()
    t = me.cpu_times()
    kids = 0.0
    for c in me.children(recursive=True):
        try:
            ct = c.cpu_times()
            kids += ct.user + ct.system
        except psutil.Error:
            pass
    return t.user + t.system, kids


def _epochs(make: Callable[[], Any], batch_size: int, epochs: int) -> list[str]:
    loader = make()
    out = []
    try:
        for _ in range(epochs):
            (m0, k0), t0, n = _cpu(), time.perf_counter(), 0
            for _batch in loader:
                n += batch_size
            dt = time.perf_counter() - t0
            m1, k1 = _cpu()
            out.append(f"{n / dt:,.0f}/s (loader {(m1 - m0) / dt:.2f}, "
                       f"workers {(k1 - k0) / dt:.2f} cores)")
    finally:
        if isinstance(loader, AsyncLoader):
            loader.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="cifar-rng", choices=sorted(userdata.DATASETS))
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--configs", default="dl,default,prefetch=32:batch-tasks,dl")
    args = ap.parse_args()
    built = userdata.build(args.dataset)
    cut = stage_mod.rows_per_process_task
    for config in args.configs.split(","):
        name, _, extra = config.partition(":")
        if name == "dl":
            def make() -> Any:
                return DataLoader(built.dataset, batch_size=built.batch_size,
                                  sampler=built.order, collate_fn=built.collate_fn,
                                  num_workers=args.workers, persistent_workers=True)
        else:
            kw = {"prefetch": int(name.split("=")[1])} if name.startswith("prefetch=") else {}

            def make() -> Any:
                return AsyncLoader(built.dataset, batch_size=built.batch_size,
                                   sampler=built.order, collate_fn=built.collate_fn,
                                   execution="processes", num_workers=args.workers, **kw)
        stage_mod.rows_per_process_task = (lambda n, *_: n) if extra == "batch-tasks" else cut
        rates = _epochs(make, built.batch_size, args.epochs)
        print(f"{args.dataset} {config:30s} " + "  ".join(rates), flush=True)
    stage_mod.rows_per_process_task = cut


if __name__ == "__main__":
    main()
