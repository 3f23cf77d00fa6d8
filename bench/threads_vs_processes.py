"""What sharing one process costs the fused training path (``ImageFolder(train=True)``,
workload (h)): the same rows in processes, in bare threads, and by ``AsyncLoader``.

Each run is a fresh process that decodes ``--samples`` rows (the folder cycled), k
at a time (``--workers``), one of these ways, the order of the ways turning each
round (A B C, C B A, ...):

* ``processes``: k forked processes, each ``dataset.read(i)`` then
  ``dataset.decode_into(raw, i, row)`` over its share, into the rows of its own batch
  tensors in turn: the bench's limit line for the fused per-sample function;
* ``threads``: the same loop in k threads of one process, no loader;
* ``loader``: ``AsyncLoader(execution="threads", num_threads=k)`` over the same
  samples, the consumer taking the batches.

With ``--normalize`` the float conversion workload (h) does on a CPU-only machine
(:func:`asyncfeed.normalize`, one thread) is added where each of its runs does it:
``processes`` and ``threads`` normalize each row as it is written, into a float row
of their own (as the bench's limit line does); ``loader``'s consumer normalizes each
batch into one reused float batch (as the bench's ``AsyncLoader`` rows do); and a
fourth way, ``processes, batches``, has each process normalize each batch of its own
rows when it is full, the consumer's work done in the decoding process.

Each way warms up first on a few batches (the page cache, the libraries loaded); its
timed run includes starting its processes or threads.  Printed per way: rows/s and
CPU milliseconds per row (the whole process tree, the consumer's thread included),
medians and the slowest round, and each round's rate against the ``processes`` run
of the same round: ``threads`` against ``processes`` is what one process's GIL and
allocator cost the rows; ``loader`` against ``threads``, the loader's own share (the
hand-off, the per-row accounting, the consumer's thread).

    PYTHONPATH=src python bench/threads_vs_processes.py [FOLDER] [--workers 2] \
        [--samples 3000] [--rounds 6] [--normalize]

FOLDER defaults to the bench's synthetic set.  Linux only (fork).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

WAYS = ("processes", "threads", "loader")
BATCHES = "processes, batches"  # with --normalize


def _rows(ds: Any, order: list[int], batch: int, size: int, normalize: str) -> None:
    """Decode ``order``'s rows into the rows of four batch tensors in turn;
    ``normalize``: ``"row"``, each row then normalized into a float row of this
    thread's own; ``"batch"``, each full batch into a float batch of its own."""
    import torch

    from asyncfeed import normalize as to_float
    slots = torch.empty(4, batch, 3, size, size, dtype=torch.uint8)
    out = torch.zeros(batch if normalize == "batch" else 1, 3, size, size)
    for j, i in enumerate(order):
        slot = slots[j // batch % 4]
        ds.decode_into(ds.read(i), i, slot[j % batch])
        if normalize == "row":
            to_float(slot[j % batch].unsqueeze(0), out=out)
        elif normalize == "batch" and (j % batch == batch - 1 or j == len(order) - 1):
            rows = j % batch + 1
            to_float(slot[:rows], out=out[:rows])


def _child(way: str, root: str, k: int, n: int, batch: int, size: int,
           normalize: bool) -> dict[str, float]:
    import torch

    from asyncfeed import AsyncLoader, ImageFolder
    from asyncfeed._bench.augment import normalized, reserve
    torch.set_num_threads(1)  # one thread a normalize, as the bench's runs
    ds = ImageFolder(root, size=size, train=True)
    order = [i % len(ds) for i in range(n)]
    warm = order[:2 * batch]
    per_row = "row" if normalize else ""
    if way == "loader":
        if normalize:
            reserve(batch, (3, size, size))
        with AsyncLoader(ds, batch_size=batch, sampler=warm, execution="threads",
                         num_threads=k) as loader:
            for _ in loader:
                pass
        cpu0, t0 = time.process_time(), time.perf_counter()
        with AsyncLoader(ds, batch_size=batch, sampler=order, execution="threads",
                         num_threads=k) as loader:
            for images, _ in loader:
                if normalize:
                    normalized(images)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    elif way == "threads":
        _rows(ds, warm, batch, size, per_row)
        threads = [threading.Thread(target=_rows, args=(ds, order[t::k], batch, size, per_row))
                   for t in range(k)]
        cpu0, t0 = time.process_time(), time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    else:
        how = "batch" if way == BATCHES else per_row
        _rows(ds, warm, batch, size, how)  # the libraries loaded before the fork
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_rows, args=(ds, order[t::k], batch, size, how))
                 for t in range(k)]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        elapsed = time.perf_counter() - t0
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a process failed: exit codes {[p.exitcode for p in procs]}")
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = used.ru_utime + used.ru_stime
    return {"rate": n / elapsed, "cpu_ms": cpu / n * 1e3}


def _run(way: str, args: argparse.Namespace, root: str) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), root, "--child", way,
           "--workers", str(args.workers), "--samples", str(args.samples),
           "--batch-size", str(args.batch_size), "--size", str(args.size)] \
        + (["--normalize"] if args.normalize else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{way} failed:\n{p.stderr[-3000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="processes or threads side by side (default: the cores)")
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--normalize", action="store_true",
                   help="add workload (h)'s float conversion where each way's run does it")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--child", choices=WAYS + (BATCHES,), help=argparse.SUPPRESS)
    args = p.parse_args()
    root = args.folder
    if root is None:
        from asyncfeed._bench.synthetic import ensure_synthetic
        root = ensure_synthetic(1000, 10, seed=0)
    if args.child:
        print(json.dumps(_child(args.child, root, args.workers, args.samples,
                                args.batch_size, args.size, args.normalize)))
        return
    ways = WAYS + ((BATCHES,) if args.normalize else ())
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for way in (ways if r % 2 == 0 else ways[::-1]):
            runs[way].append(_run(way, args, root))
    print(f"{args.samples} rows, {args.workers} side by side, {args.rounds} rounds"
          + (", normalized" if args.normalize else ""))
    for way, got in runs.items():
        rates = [g["rate"] for g in got]
        by_round = [g["rate"] / b["rate"] for g, b in zip(got, runs["processes"])]
        print(f"  {way:18s} {statistics.median(rates):8,.0f} rows/s (slowest "
              f"{min(rates):,.0f})  CPU {statistics.median(g['cpu_ms'] for g in got):.3f} "
              f"ms/row  x processes by round {statistics.median(by_round):.2f} "
              f"(worst {min(by_round):.2f})")


if __name__ == "__main__":
    main()
