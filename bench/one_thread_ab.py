"""``num_threads=1`` against ``DataLoader(num_workers=0)`` on bench workload (f)
(the CIFAR-like set, batch 128), in one process, epochs alternating A B A B:
the target of issue 15's "cheap per-sample path".  Epochs in one process share
the machine's state, which moves between processes by more than the effect.

    PYTHONPATH=src python bench/one_thread_ab.py 12          # 12 rounds
    PYTHONPATH=src python bench/one_thread_ab.py 12 probe20  # the GIL probe at 20 ms

``probe20`` wakes the GIL probe every 20 ms, as before it slowed to 100 ms for
a pinned thread count.  Prints each side's median epoch rate and their ratio.
"""
import statistics
import sys
import time

import torch

from asyncfeed import AsyncLoader
from asyncfeed._bench.workloads import CifarLike
from asyncfeed._engine import loader as _loader


def rate(loader) -> float:
    t0, n = time.perf_counter(), 0
    for _, y in loader:
        n += len(y)
    return n / (time.perf_counter() - t0)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    if "probe20" in sys.argv[2:]:
        _loader.QUIET_PERIOD_S = 0.02
    torch.set_num_threads(1)
    ds = CifarLike(20_000)
    dl = torch.utils.data.DataLoader(ds, batch_size=128, shuffle=True, num_workers=0)
    with AsyncLoader(ds, batch_size=128, shuffle=True, num_threads=1) as af:
        rate(dl), rate(af)  # warm-up epochs
        got: dict[str, list[float]] = {"DataLoader w=0": [], "asyncfeed t=1": []}
        for _ in range(rounds):
            got["DataLoader w=0"].append(rate(dl))
            got["asyncfeed t=1"].append(rate(af))
    m = {k: statistics.median(v) for k, v in got.items()}
    for k, v in m.items():
        print(f"{k:16s} {v:10,.0f} samples/s")
    print(f"ratio {m['asyncfeed t=1'] / m['DataLoader w=0']:.3f}")


if __name__ == "__main__":
    main()
