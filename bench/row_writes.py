"""What writing a batch's rows costs: the loader's row writers against DataLoader's
``default_collate``, on the outcome bench's CIFAR-like samples (a 3x32x32 ``uint8``
tensor and a 0-d ``int64`` tensor, batch 128).

    PYTHONPATH=src python bench/row_writes.py [--dataset cifar-rng] [--rounds 5]

Prints, per batch and per row (one thread, medians of interleaved rounds, and the
slowest round):

- ``default_collate``: what DataLoader does with the rows (``torch.stack`` per leaf);
- ``FlatWriter.write_rows``: a whole run of rows into the batch's buffers, as a task
  that loads a whole batch (inline, or one thread's share) writes them;
- ``FlatWriter.write`` row by row: what a row written on its own costs;
- a worker process's writes into its shared-memory rows (``worker._Rows``): one by
  one (``write``) and a task's run at once (``write_run``);
- the data set's own ``__getitem__``, for scale.

Nothing here runs a loader: these are the per-row costs the loader's own figures
(``asyncfeed bench``, ``bench/outcome.py``) contain.

``--stack``: instead, what the two ways ``rowwrite.StackWays`` measures on a tensor
leaf's runs cost, for runs of ``float32`` tensor rows of three sizes: reading every
row's type and dtype in Python, against what stacking into a new tensor and copying it into
the buffers costs beyond stacking straight into them (``out=``), per run.

    PYTHONPATH=src python bench/row_writes.py --stack
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
from torch.utils.data import default_collate

from asyncfeed._bench.userdata import build
from asyncfeed._engine.processes import worker
from asyncfeed._engine.processes.shm import open_segment, segment_plan
from asyncfeed._engine.rowwrite import FlatWriter
from asyncfeed._memory.layout import Layout


def _per_call(fn: Callable[[], Any], seconds: float = 0.2) -> float:
    """Seconds a call of ``fn`` takes, over as many calls as fit in ``seconds``."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        t = time.perf_counter() - t0
        if t >= seconds:
            return t / n


def _alternated(steps: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Each step's seconds a call, one reading a round, the order turning each round."""
    got: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            got[name].append(_per_call(steps[name]))
    return got


def _stack_costs(rounds: int) -> None:
    """The ``--stack`` figures (see the module docstring)."""
    print(f"a run of float32 tensor rows, {rounds} rounds, medians: reading the rows' "
          "types and dtypes, against the stack-then-copy's cost beyond stack(out=)")
    for shape, n in (((64,), 256), ((3, 32, 32), 128), ((3, 224, 224), 32)):
        col = [torch.randn(shape) for _ in range(n)]
        out = torch.empty((n, *shape))
        steps: dict[str, Callable[[], Any]] = {
            "dtypes": lambda: (set(map(type, col)), {x.dtype for x in col}),
            "out": lambda: torch.stack(col, out=out),
            "copy": lambda: out.copy_(torch.stack(col)),
        }
        m = {k: statistics.median(v) * 1e6 for k, v in _alternated(steps, rounds).items()}
        print(f"  {n:3d} rows of {'x'.join(map(str, shape)):9} ({out[0].nbytes:6d} B a row): "
              f"dtypes {m['dtypes']:7.1f} us, the copy {m['copy'] - m['out']:7.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="cifar-rng", help="an outcome-bench data set whose "
                    "samples the loader writes into rows (cifar-rng)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stack", action="store_true",
                    help="the stack-then-copy's cost against reading the rows' dtypes")
    args = ap.parse_args()
    if args.stack:
        _stack_costs(args.rounds)
        return
    built = build(args.dataset)
    n = built.batch_size
    samples = [built.dataset[i] for i in range(n)]
    layout = Layout.infer(samples[0])
    writer = FlatWriter.for_layout(layout) if layout is not None else None
    if writer is None:
        raise SystemExit(f"{args.dataset}: its samples are not rows the loader writes in place")
    bufs = layout.allocate(n)
    views = layout.numpy_views(bufs)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "segment")
        open_segment(path, segment_plan(layout, n)[1], create=True).close()
        shm_rows = worker._Rows(path, layout, n)
        try:
            steps: dict[str, Callable[[], Any]] = {
                "default_collate": lambda: default_collate(samples),
                "FlatWriter.write_rows (a run)": lambda: writer.write_rows(
                    bufs, views, 0, n, samples, bulk=True),
                "FlatWriter.write (row by row)": lambda: [
                    writer.write(bufs, views, r, s) for r, s in enumerate(samples)],
                "worker write (row by row)": lambda: [
                    shm_rows.write(r, s) for r, s in enumerate(samples)],
                "worker write_run (a task's run)": lambda: shm_rows.write_run(0, samples),
                "__getitem__": lambda: [built.dataset[i] for i in range(n)],
            }
            got = _alternated(steps, args.rounds)
        finally:
            shm_rows.close()
    print(f"{args.dataset}: batch {n}, {args.rounds} rounds; per batch, median (slowest), "
          "and per row")
    for name, ts in got.items():
        m = statistics.median(ts)
        print(f"  {name:34} {m * 1e6:9.1f} us ({max(ts) * 1e6:7.1f})  {m / n * 1e6:6.2f} us/row")


if __name__ == "__main__":
    main()
