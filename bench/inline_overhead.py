"""What loading rows inline costs the consumer against ``DataLoader(num_workers=0)``.

Both run the same work in the consumer's thread (the rows, the collate); what differs
is the loader's own bookkeeping per batch.  One process, the two loaders' epochs
alternating (A B A B) after a warm-up epoch each; per data set, the median wall time
and CPU time per sample of each, and AsyncLoader's rate over DataLoader's, median and
worst round:

    PYTHONPATH=src python bench/inline_overhead.py                 # every set, 8 rounds
    PYTHONPATH=src python bench/inline_overhead.py --sets noop --rounds 12

``noop``: 64-row batches of ints, a ``len`` collate: nothing but the loaders' own cost,
reported per batch.  ``pairs``: ``(int, float)`` rows, 256 a batch, the default
collate: rows of well under a microsecond.  ``detection``, ``text`` and ``tensors``:
the outcome bench's data sets (``asyncfeed._bench.userdata``), with their
``collate_fn`` (``tensors``: the default collate, the rows written into the batch's
buffers).  AsyncLoader runs with ``execution="inline"`` (the choice its defaults
settle on for these sets).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from torch.utils.data import DataLoader

from asyncfeed import AsyncLoader
from asyncfeed._bench import userdata


class _Noop:
    def __len__(self) -> int:
        return 64 * 1000

    def __getitem__(self, i: int) -> int:
        return i


class _Pairs:
    def __len__(self) -> int:
        return 256 * 1024

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, i * 0.5


def _build(name: str) -> tuple[Any, list[int] | None, int, Any]:
    if name == "noop":
        return _Noop(), None, 64, len
    if name == "pairs":
        return _Pairs(), None, 256, None
    b = userdata.build(name)
    return b.dataset, b.order, b.batch_size, b.collate_fn


def _epoch(loader: Any) -> tuple[float, float, int]:
    t, c, n = time.perf_counter(), time.process_time(), 0
    for _ in loader:
        n += 1
    return time.perf_counter() - t, time.process_time() - c, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="noop,pairs,detection,text,tensors")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    for name in args.sets.split(","):
        ds, order, bs, collate = _build(name)
        kw: dict[str, Any] = {"batch_size": bs}
        if collate is not None:
            kw["collate_fn"] = collate
        if order is not None:
            kw["sampler"] = order
        samples = len(order) if order is not None else len(ds)
        dl = DataLoader(ds, num_workers=0, **kw)
        with AsyncLoader(ds, execution="inline", **kw) as al:
            _epoch(dl), _epoch(al)
            runs: dict[str, list[tuple[float, float, int]]] = {"DataLoader w=0": [],
                                                               "AsyncLoader": []}
            for _ in range(args.rounds):
                runs["DataLoader w=0"].append(_epoch(dl))
                runs["AsyncLoader"].append(_epoch(al))
        per, unit = (lambda r: 1e6 * r[0] / r[2], "us/batch") if name == "noop" \
            else (lambda r: 1e6 * r[0] / samples, "us/sample")
        print(f"{name} ({samples} samples, batch {bs}, {args.rounds} rounds)")
        for who, rs in runs.items():
            print(f"  {who:15s} wall {statistics.median(per(r) for r in rs):7.2f} {unit}"
                  f"  cpu {statistics.median(1e6 * r[1] / samples for r in rs):6.2f} us/sample")
        ratios = [d[0] / a[0] for a, d in zip(runs["AsyncLoader"], runs["DataLoader w=0"])]
        print(f"  AsyncLoader rate / DataLoader's: median {statistics.median(ratios):.3f},"
              f" worst {min(ratios):.3f}")


if __name__ == "__main__":
    main()
