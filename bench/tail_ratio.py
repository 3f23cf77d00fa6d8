"""AsyncLoader's rate under the bench's tail model as a share of its 0 ms rate, over
HTTP and S3 (moto behind the tail proxy), at its defaults (docs/remote.md, "Re-measured
on an idle machine").  Each round runs the 0 ms server, then the tail server, in this
process; prints one line per run with ``stats().io``.

    PYTHONPATH=src python bench/tail_ratio.py [ROUNDS]

Needs the synthetic set of 1,200 images (``asyncfeed bench --images 1200`` makes it)
and the ``[remote]`` extra.
"""
import os
import sys
import time

from asyncfeed import AsyncLoader, ImageFolder
from asyncfeed._bench.httpserve import TailModel
from asyncfeed._bench.remote import RemoteServers
from asyncfeed._bench.synthetic import cache_root, dataset_name

ROOT = os.path.join(cache_root(), dataset_name(1200, 10, 0))
TAIL = TailModel(median=0.02, p99=0.25, error_rate=0.1, stall_rate=0.01, stall_s=2.0)


def main(rounds: int) -> None:
    with RemoteServers(ROOT, ("http", "s3"), 0.02, TAIL) as srv:
        for rnd in range(rounds):
            for tail, zero in (("remote", "remote0"), ("s3", "s30")):
                rates = {}
                for name in (zero, tail):
                    root, extra = srv.source(name)
                    ds = ImageFolder(root, size=224, **extra)
                    t0, n = time.perf_counter(), 0
                    with AsyncLoader(ds, batch_size=32, shuffle=True, seed=rnd) as loader:
                        for _, labels in loader:
                            n += len(labels)
                        io = loader.stats().io
                    rates[name] = n / (time.perf_counter() - t0)
                    print(rnd, name, round(rates[name]), io, flush=True)
                print(rnd, tail, "x 0 ms:", round(rates[tail] / rates[zero], 2), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
