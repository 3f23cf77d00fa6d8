"""AsyncLoader's rate under the bench's tail model as a share of its 0 ms rate, over
HTTP and S3 (moto behind the tail proxy), at its defaults (docs/remote.md, "Re-measured
on an idle machine").  Each round runs the 0 ms server, then the tail server, in this
process; prints one line per run with ``stats().io``, and the medians at the end.

    PYTHONPATH=src python bench/tail_ratio.py [ROUNDS] [--model tail|errors] [--samples N]

``--model tail`` (default): lognormal 20 ms median, p99 250 ms, 10% of first attempts
503, 1% stalls of 2 s.  ``--model errors``: 20 ms flat and 10% of first attempts 503
(nothing else).  ``--samples N``: each pass reads N of the 1,200 images (a seeded
random subset; the bench's workload (e) reads 256 by default), else all of them.

Needs the synthetic set of 1,200 images (``asyncfeed bench --images 1200`` makes it)
and the ``[remote]`` extra.
"""
import argparse
import os
import statistics
import time

import torch

from asyncfeed import AsyncLoader, ImageFolder
from asyncfeed._bench.httpserve import TailModel
from asyncfeed._bench.remote import RemoteServers
from asyncfeed._bench.synthetic import cache_root, dataset_name

ROOT = os.path.join(cache_root(), dataset_name(1200, 10, 0))
MODELS = {
    "tail": TailModel(median=0.02, p99=0.25, error_rate=0.1, stall_rate=0.01, stall_s=2.0),
    "errors": TailModel(median=0.02, p99=0.0, error_rate=0.1),
}


def main(rounds: int, model: str, samples: int | None) -> None:
    ratios: dict[str, list[float]] = {}
    with RemoteServers(ROOT, ("http", "s3"), 0.02, MODELS[model]) as srv:
        for rnd in range(rounds):
            for tail, zero in (("remote", "remote0"), ("s3", "s30")):
                rates = {}
                for name in (zero, tail):
                    root, extra = srv.source(name)
                    ds = ImageFolder(root, size=224, **extra)
                    kw: dict = dict(shuffle=True, seed=rnd)
                    if samples is not None:
                        g = torch.Generator().manual_seed(rnd)
                        kw = dict(sampler=torch.randperm(len(ds), generator=g)[:samples].tolist())
                    t0, n = time.perf_counter(), 0
                    with AsyncLoader(ds, batch_size=32, **kw) as loader:
                        for _, labels in loader:
                            n += len(labels)
                        io = loader.stats().io
                    rates[name] = n / (time.perf_counter() - t0)
                    print(rnd, name, round(rates[name]), io, flush=True)
                ratios.setdefault(tail, []).append(rates[tail] / rates[zero])
                print(rnd, tail, "x 0 ms:", round(ratios[tail][-1], 2), flush=True)
    for tail, rs in ratios.items():
        print(tail, "x 0 ms: median", round(statistics.median(rs), 2), "worst", round(min(rs), 2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", type=int, nargs="?", default=3)
    ap.add_argument("--model", choices=sorted(MODELS), default="tail")
    ap.add_argument("--samples", type=int, default=None)
    args = ap.parse_args()
    main(args.rounds, args.model, args.samples)
