"""The stage accounting's cost on bench workload (a), side by side: A B A B, each
run in its own process, medians.

    python bench/accounting_overhead.py off src 10        # same tree, accounting off
    git archive <parent> src | tar -x -C /tmp/base
    python bench/accounting_overhead.py /tmp/base/src src 10   # against another checkout

``off`` runs ``src`` with the accounting's bookkeeping replaced by bare clock reads
(the row tasks' own timing, which sizes tasks and feeds the adaptive thread count,
uses the same clocks) and no GIL probe (done in the measuring process only; the
library has no switch for it).

Each run: ImageFolder on the synthetic set (thread reads), AsyncLoader with
execution="threads", batch 32, a warm-up epoch then two epochs of 640 samples;
it reports samples/s and process CPU per sample.
"""
import json
import os
import statistics
import subprocess
import sys

OFF = r'''
import time as _t
from asyncfeed._engine import accounting as _a, gilprobe as _g
# the clocks stay: row tasks time themselves with them, and the task sizing and the
# adaptive count need that time; what goes is the bookkeeping and the probe
_a.Accounting.end = lambda self, stage, t, count=1: (_t.perf_counter(), _t.thread_time())
_a.Accounting.add_wall = lambda self, stage, seconds, count=1: None
_g.GilProbe.start = lambda self: None
'''

ONE = r'''
import json, os, time
import numpy as np
from asyncfeed import AsyncLoader, ImageFolder
from asyncfeed._bench.synthetic import cache_root, dataset_name
ds = ImageFolder(os.path.join(cache_root(), dataset_name(1000, 10, 0)), 224)
order = np.random.default_rng(0).permutation(len(ds)).tolist()[:640]
loader = AsyncLoader(ds, batch_size=32, sampler=order, execution="threads")
for b in loader:
    pass
t0, c0 = time.perf_counter(), time.process_time()
n = 0
for _ in range(2):
    for b in loader:
        n += b[0].shape[0]
t, c = time.perf_counter() - t0, time.process_time() - c0
loader.close()
print(json.dumps({"rate": n / t, "cpu_ms": 1000 * c / n}))
'''


def main(base: str, new: str, rounds: int) -> None:
    variants = {"base": base, "new": new}
    res: dict[str, list[dict]] = {k: [] for k in variants}
    for r in range(rounds):
        order = list(variants.items()) if r % 2 == 0 else list(reversed(variants.items()))
        for name, path in order:
            code = ONE
            if path == "off":
                path, code = new, OFF + ONE
            env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, timeout=600, check=True)
            res[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for key in ("rate", "cpu_ms"):
        b = statistics.median(d[key] for d in res["base"])
        n = statistics.median(d[key] for d in res["new"])
        print(f"{key}: base {b:.3f}  new {n:.3f}  new/base {n / b:.4f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 10)
