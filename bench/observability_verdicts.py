"""The bottleneck verdict of AsyncLoader on each bench workload, with a consumer
faster and slower than the loader (docs/observability.md, "The verdict on the
bench workloads").  Prints one JSON line per workload.

    PYTHONPATH=src python bench/observability_verdicts.py [a b c d e f g threads]

Needs the synthetic set (``asyncfeed bench`` or ``asyncfeed profile`` makes it).
"""
import json
import os
import sys
import time

from asyncfeed import AsyncLoader
from asyncfeed._bench.remote import RemoteServers
from asyncfeed._bench.synthetic import cache_root, dataset_name
from asyncfeed._bench.workloads import build_dataset

ROOT = os.path.join(cache_root(), dataset_name(1000, 10, 0))
BS = 32


def spec(kind, samples, **kw):
    d = {"kind": kind, "root": ROOT, "size": 224, "samples": samples, "seed": 0,
         "interpolation": "area", "listing": None, "io": "thread"}
    d.update(kw)
    return d


def run(ds, order, step_s, first_only=False, bs=BS, **kw):
    loader = AsyncLoader(ds, batch_size=bs, sampler=order, seed=0, **kw)
    t0 = time.perf_counter()
    n = 0
    for _ in loader:
        n += 1
        if first_only:
            break
        if step_s:
            time.sleep(step_s)
    el = time.perf_counter() - t0
    st = loader.stats()
    loader.close()
    a = st._reading[1]
    return {"bottleneck": st.bottleneck, "gil_share": round(st.gil_share, 2),
            "gil_pressure": round(a.gil_pressure or 0, 2), "wait_share": round(a.wait_share, 2),
            "rate": round(n * bs / el, 1), "execution": st.execution}


def both(name, make, **kw):
    ds, order = make()
    fast = run(ds, order, 0.0, **kw)
    step = 2.0 * kw.get("bs", BS) / max(fast["rate"], 1.0)  # half the loader's rate
    ds, order = make()
    slow = run(ds, order, step, **kw)
    print(json.dumps({"workload": name, "fast": fast, "slow": slow,
                      "slow_step_ms": round(1000 * step, 1),
                      "load": round(os.getloadavg()[0], 1)}), flush=True)


def main(which):
    if "a" in which:
        both("a folder", lambda: build_dataset(spec("folder", 640)))
    if "b" in which:
        both("b RAM", lambda: build_dataset(spec("ram", 512, floats_per_sample=2000)))
    if "c" in which:
        both("c pure-Python transform", lambda: build_dataset(spec("gil", 320)))
    if "d" in which:
        ds, order = build_dataset(spec("folder", 640))
        print(json.dumps({"workload": "d first batch only",
                          "fast": run(ds, order, 0.0, first_only=True)}), flush=True)
    if "e" in which:
        with RemoteServers(ROOT, ("http",), 0.02, None) as http:
            url = http.source("remote")[0]
            both("e HTTP 20 ms, io_concurrency 64",
                 lambda: build_dataset(spec("folder", 256, root=url, io="auto")))
            both("e HTTP 20 ms, io_concurrency 4",
                 lambda: build_dataset(spec("folder", 128, root=url, io="auto")),
                 io_concurrency=4)
    if "f" in which:
        both("f CIFAR-like", lambda: build_dataset(spec("cifar", 20000)), bs=128)
    if "g" in which:
        both("g PIL + RandomResizedCrop", lambda: build_dataset(spec("pil", 320)))
    if "threads" in which:
        for k, s in (("a", spec("folder", 640)), ("b", spec("ram", 512, floats_per_sample=2000)),
                     ("c", spec("gil", 320))):
            both(f"{k} execution=threads", lambda s=s: build_dataset(s), execution="threads")


if __name__ == "__main__":
    main(sys.argv[1:] or list("abcdefg") + ["threads"])
