"""What a decode thread spends on a row beyond the data set's own work, on the fused
training path (``ImageFolder(train=True)``, workload (h)).

In one process, alternating round by round (A B C, A B C, ...):

* ``bare``: ``dataset.read(i)`` then ``dataset.decode_into(raw, i, out)`` in this
  thread, into one reused row;
* ``bare, rows of a batch``: the same into the rows of one ``[batch, 3, size, size]``
  tensor in turn, as the loader writes a batch slot's rows;
* ``loader thread``: ``AsyncLoader(num_threads=1)`` over the same samples (after a
  warm pass), the CPU of its decode thread (the busiest thread other than this one,
  read from ``/proc/self/task``), the consumer taking the batches and doing nothing;
  and ``loader consumer``: the CPU of the consumer's thread meanwhile (taking the
  batches, planning the next), per row.

Each prints the CPU milliseconds per row of every round and their median.  The
difference between ``loader thread`` and ``bare`` is what the loader adds to a
row in its decode thread (the task hand-off, the per-row accounting, the row's
place in the batch); the consumer's own share is not in it.

    PYTHONPATH=src python bench/row_overhead.py [FOLDER] [--samples 1000] [--rounds 4]

FOLDER defaults to the bench's synthetic set.  Linux only (per-thread CPU from
``/proc``); the clock ticks of ``/proc`` (10 ms) over 1,000 rows resolve 0.01 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from asyncfeed import AsyncLoader, ImageFolder


def _threads_cpu() -> dict[str, float]:
    """Each thread of this process: its CPU seconds (user + system)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    root = args.folder
    if root is None:
        from asyncfeed._bench.synthetic import ensure_synthetic
        root = ensure_synthetic(1000, 10, seed=0)
    ds = ImageFolder(root, size=args.size, train=True)
    n = min(args.samples, len(ds))
    row = torch.empty(3, args.size, args.size, dtype=torch.uint8)
    slot = torch.empty(args.batch_size, 3, args.size, args.size, dtype=torch.uint8)
    me = str(threading.get_native_id())
    res: dict[str, list[float]] = {"bare": [], "bare, rows of a batch": [],
                                   "loader thread": [], "loader consumer": []}
    with AsyncLoader(ds, batch_size=args.batch_size, sampler=list(range(n)),
                     num_threads=1) as loader:
        for _ in loader:
            pass  # the warm pass: files in the page cache, the thread pool's first start
        for _ in range(args.rounds):
            t = time.thread_time()
            for i in range(n):
                ds.decode_into(ds.read(i), i, row)
            res["bare"].append((time.thread_time() - t) / n * 1e3)
            t = time.thread_time()
            for i in range(n):
                ds.decode_into(ds.read(i), i, slot[i % args.batch_size])
            res["bare, rows of a batch"].append((time.thread_time() - t) / n * 1e3)
            before, peak = _threads_cpu(), {}
            reading = 0.0  # this thread's CPU reading /proc, left out of the consumer's
            t = time.thread_time()
            for _ in loader:
                # the pass's threads end with it: keep each one's last reading
                r = time.thread_time()
                for tid, cpu in _threads_cpu().items():
                    peak[tid] = max(peak.get(tid, 0.0), cpu)
                reading += time.thread_time() - r
            consumer = time.thread_time() - t - reading
            busiest = max(peak[k] - before.get(k, 0.0) for k in peak if k != me)
            res["loader thread"].append(busiest / n * 1e3)
            res["loader consumer"].append(consumer / n * 1e3)
    for name, ms in res.items():
        print(f"{name:24s} " + " ".join(f"{x:.3f}" for x in ms)
              + f"  median {statistics.median(ms):.3f} ms/row")


if __name__ == "__main__":
    main()
