"""``asyncfeed profile``: where a data set's loading time goes, AsyncLoader beside DataLoader.

A short pass (bounded by ``seconds``) of the data set through ``AsyncLoader`` and
through ``DataLoader(num_workers=cores)``, each consumed by a loop that takes
``model_ms`` per batch (a sleep on the CPU; on a GPU a matmul loop of that length
while pynvml samples the GPU's utilisation).  For each loader: samples/s after
the first batch, time to the first batch, the share of time the loop waited
for data, and for AsyncLoader the stage breakdown, GIL share, bottleneck and
advice; every half second a window of the stage figures, for ``--plot``.

AsyncLoader's wait share, stages, GIL share, bottleneck and advice come from one
reading: its accounting summed over every pass of the profile, read as
``stats()`` reads a pass.  So the table and the advice cannot disagree, and the
bottleneck is the word ``stats()`` and ``explain()`` give for the same stretch.

The data set: ``ImageFolder(DATA)`` for a folder, ``module:factory`` for a
callable returning a data set (imported from the current directory too), or
the built-in synthetic JPEG set (``_bench/synthetic.py``) when no DATA is given.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch

from .._engine.accounting import STAGES, Accounting, Snapshot, analyse
from .._engine.advice import dataset_knobs, explain
from .._engine.loader import AsyncLoader
from .._engine.resources import available_cores
from .._engine.progress import window_figures

__all__ = ["load_dataset", "profile", "render"]

WINDOW_S = 0.5


def load_dataset(data: str | None, *, size: int, images: int, seed: int = 0,
                 cache: str | None = None) -> tuple[Any, str]:
    """``(dataset, description)`` for DATA (folder, ``module:factory`` or None: synthetic)."""
    from .._data.folder import ImageFolder
    if data is None:
        from . import synthetic
        classes = min(10, images)
        root = synthetic.ensure_synthetic(images, classes, seed=seed,
                                          root=cache or synthetic.cache_root())
        return ImageFolder(root, size), f"synthetic JPEG set ({images} images, {root})"
    if os.path.isdir(data):
        return ImageFolder(data, size), f"ImageFolder({data})"
    module, sep, attr = data.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"DATA must be a folder or module:factory, got {data!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    factory = getattr(importlib.import_module(module), attr)
    return factory(), data


class _GpuSampler:
    """pynvml utilisation of the current GPU, sampled every 0.1 s in a thread of its own."""

    def __init__(self) -> None:
        from .._optional import require
        self._nvml = require("pynvml", "asyncfeed profile's GPU view")
        self._nvml.nvmlInit()
        self._handle = self._nvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asyncfeed-profile-nvml")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append(float(self._nvml.nvmlDeviceGetUtilizationRates(
                self._handle).gpu))

    def close(self) -> float | None:
        self._stop.set()
        self._thread.join()
        self._nvml.nvmlShutdown()
        return sum(self.samples) / len(self.samples) if self.samples else None


def _model_step(model_ms: float, device: str | None) -> Callable[[Any], None]:
    """The consumer's work per batch: sleep on the CPU, a matmul loop on a GPU."""
    if model_ms <= 0:
        return lambda batch: None
    if device is None:
        return lambda batch: time.sleep(model_ms / 1000.0)
    a = torch.randn(2048, 2048, device=device)

    def step(batch: Any) -> None:
        end = time.perf_counter() + model_ms / 1000.0
        while time.perf_counter() < end:
            a.mul_(0.5).add_(a @ a, alpha=1e-6)
        torch.cuda.synchronize()
    return step


def _consume(batches: Iterator[Any], seconds: float, step: Callable[[Any], None],
             on_batch: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Take batches for ``seconds`` after the first; the figures of that stretch."""
    t0 = time.perf_counter()
    first = None
    n = waited = 0.0
    samples = 0
    while True:
        t = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            break
        now = time.perf_counter()
        if first is None:
            first = now - t0
            t_steady = now
        else:
            waited += now - t
            samples += _batch_len(batch)
            n += 1
        step(batch)
        on_batch()
        if first is not None and time.perf_counter() - t_steady >= seconds:
            break
    steady = time.perf_counter() - t_steady if first is not None else 0.0
    return {"first_batch_s": first, "batches": int(n), "samples": samples,
            "seconds": steady, "samples_per_s": samples / steady if steady > 0 else 0.0,
            "wait_share": waited / steady if steady > 0 else 0.0}


def _batch_len(batch: Any) -> int:
    x = batch
    while isinstance(x, (list, tuple)) and x:
        x = x[0]
    if isinstance(x, dict) and x:
        x = next(iter(x.values()))
    return int(x.shape[0]) if hasattr(x, "shape") and len(x.shape) else 1


def _epochs(make: Callable[[], Any]) -> Generator[Any, None, None]:
    """Batches of pass after pass (a short data set still fills the time)."""
    while True:
        empty = True
        for b in make():
            empty = False
            yield b
        if empty:
            return


def _run_asyncfeed(ds: Any, batch_size: int, seconds: float, threads: int | None,
                   step: Callable[[Any], None], device: str | None,
                   execution: str = "auto") -> dict[str, Any]:
    loader: AsyncLoader[Any] = AsyncLoader(ds, batch_size=batch_size, shuffle=_shuffle(ds),
                                           num_threads=threads, device=device, seed=0,
                                           execution=execution)
    timeline: list[dict[str, Any]] = []
    # the window being filled: ``done`` (from passes already over) plus this pass's
    # figures since ``start``
    state: dict[str, Any] = {"acct": None, "start": None, "done": Snapshot(),
                             "t0": time.perf_counter()}
    passes: list[Accounting] = []

    def on_batch() -> None:
        acct = loader._acct
        assert acct is not None  # a batch arrived: its pass is accounted
        if acct is not state["acct"]:   # a new pass: bank what the last one added
            passes.append(acct)
            if state["acct"] is not None:
                state["done"] = state["done"] + (state["acct"].snapshot() - state["start"])
            state.update(acct=acct, start=acct.snapshot())
        snap = acct.snapshot()
        window = state["done"] + (snap - state["start"])
        if window.elapsed_s >= WINDOW_S:
            f = window_figures(window, available_cores())
            timeline.append({"t": time.perf_counter() - state["t0"], **f})
            state.update(start=snap, done=Snapshot())

    try:
        out = _consume(_epochs(lambda: loader), seconds, step, on_batch)
        report = loader.stats().execution
    finally:
        loader.close()
    # closed: each snapshot is its pass's final one (summed from the first, not from an
    # empty Snapshot, which would drop the run-queue delay the GIL share needs)
    whole = passes[0].snapshot() if passes else Snapshot()
    for acct in passes[1:]:
        whole = whole + acct.snapshot()
    reading = analyse(whole, available_cores())
    advice = (explain(whole, reading, dataset_knobs(ds)) if reading.bottleneck else
              "No batch has been delivered yet: there is nothing to explain.")
    return {**out, "loader": "AsyncLoader", "threads": loader.num_threads,
            "execution": str(report) if report is not None else "",
            # the loop's wait as the verdict read it (each pass's first batch left out)
            "wait_share": reading.wait_share,
            "stages": {k: {"count": v.count, "wall_s": v.wall_s, "cpu_s": v.cpu_s}
                       for k, v in whole.stages.items()},
            "gil_share": reading.gil_share, "bottleneck": reading.bottleneck,
            "advice": advice, "timeline": timeline}


def _run_dataloader(ds: Any, batch_size: int, seconds: float, workers: int,
                    step: Callable[[Any], None], pin: bool) -> dict[str, Any]:
    from torch.utils.data import DataLoader
    loader = DataLoader(ds, batch_size=batch_size, shuffle=_shuffle(ds), num_workers=workers,
                        pin_memory=pin, persistent_workers=workers > 0)
    it = _epochs(lambda: loader)
    try:
        out = _consume(it, seconds, step)
    finally:
        it.close()
        del loader
    return {**out, "loader": "DataLoader", "workers": workers}


def _shuffle(ds: Any) -> bool | None:
    return None if isinstance(ds, torch.utils.data.IterableDataset) else True


def profile(data: str | None = None, *, seconds: float = 10.0, batch_size: int = 32,
            size: int = 224, images: int = 512, threads: int | None = None,
            workers: int | None = None, model_ms: float = 0.0, dataloader: bool = True,
            cache: str | None = None, execution: str = "auto") -> dict[str, Any]:
    """Run both loaders on DATA and return every figure (see the module docstring)."""
    ds, what = load_dataset(data, size=size, images=images, cache=cache)
    cores = available_cores()
    device = "cuda" if torch.cuda.is_available() else None
    step = _model_step(model_ms, device)
    gpu = _GpuSampler() if device is not None and model_ms > 0 else None
    try:
        runs = [_run_asyncfeed(ds, batch_size, seconds, threads, step, device, execution)]
        if dataloader:
            runs.append(_run_dataloader(ds, batch_size, seconds, workers or cores, step,
                                        pin=device is not None))
    finally:
        gpu_util = gpu.close() if gpu is not None else None
    return {"data": what, "samples_in_data": _len(ds), "batch_size": batch_size,
            "seconds": seconds, "cores": cores, "model_ms": model_ms,
            "device": device or "cpu", "gpu_utilisation_percent": gpu_util, "runs": runs}


def _len(ds: Any) -> int | None:
    try:
        return len(ds)
    except TypeError:
        return None


def render(result: dict[str, Any]) -> str:
    """The side-by-side table and the advice, as printed by ``asyncfeed profile``."""
    runs = result["runs"]
    heads = [f"AsyncLoader ({r['execution'] or str(r['threads']) + ' threads'})"
             if r["loader"] == "AsyncLoader" else f"DataLoader ({r['workers']} workers)"
             for r in runs]
    rows: list[tuple[str, list[str]]] = [
        ("samples/s", [f"{r['samples_per_s']:.0f}" for r in runs]),
        ("first batch", [f"{r['first_batch_s']:.2f} s" if r["first_batch_s"] is not None
                         else "-" for r in runs]),
        ("loop waited for data", [f"{r['wait_share']:.0%}" for r in runs]),
    ]
    af = runs[0]
    total = sum(v["wall_s"] for v in af["stages"].values()) or 1.0
    for name in STAGES:
        v = af["stages"].get(name)
        if v is None:
            continue
        per = (f"{1000 * v['wall_s'] / v['count']:.2f} ms" if v["count"] else "-")
        cpu = f", cpu {1000 * v['cpu_s'] / v['count']:.2f} ms" \
            if v["count"] and v["cpu_s"] is not None else ""
        rows.append((f"  {name}", [f"{v['wall_s'] / total:.0%}  ({per}{cpu})"]
                     + ["-"] * (len(runs) - 1)))
    rows.append(("GIL share", [f"{af['gil_share']:.2f}"] + ["-"] * (len(runs) - 1)))
    rows.append(("bottleneck", [str(af["bottleneck"])] + ["-"] * (len(runs) - 1)))
    w0 = max(len(k) for k, _ in rows) + 2
    widths = [max(len(h), *(len(v[i]) for _, v in rows)) + 3 for i, h in enumerate(heads)]
    lines = [f"asyncfeed profile: {result['data']}, batch {result['batch_size']}, "
             f"{result['seconds']:g} s each, {result['cores']} cores, "
             f"device {result['device']}, model step {result['model_ms']:g} ms",
             "", " " * w0 + "".join(h.ljust(w) for h, w in zip(heads, widths))]
    for k, vals in rows:
        lines.append(k.ljust(w0) + "".join(v.ljust(w) for v, w in zip(vals, widths)))
    if result.get("gpu_utilisation_percent") is not None:
        lines.append(f"GPU utilisation (pynvml): {result['gpu_utilisation_percent']:.0f}%")
    lines += ["", "stage shares: of the time summed over the AsyncLoader's stages "
              "(per item: wall, cpu)", "", "advice: " + af["advice"]]
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: str) -> None:
    """A PNG of AsyncLoader's stage shares over time, with samples/s on a second axis."""
    from .._optional import require
    require("matplotlib", "asyncfeed profile --plot", extra="bench")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tl = result["runs"][0]["timeline"]
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    handles: list[Any] = []
    if tl:
        t = [w["t"] for w in tl]
        shares = [[w["shares"].get(name, 0.0) for w in tl] for name in STAGES]
        handles += ax.stackplot(t, shares, labels=STAGES, alpha=0.85)
        ax2 = ax.twinx()
        handles += ax2.plot(t, [w["samples_per_s"] for w in tl], color="black", lw=1.6,
                            label="samples/s")
        ax2.set_ylabel("samples/s")
        ax2.set_ylim(bottom=0)
        for w in tl:
            if w["bottleneck"]:
                ax.annotate(w["bottleneck"], (w["t"], 1.01), fontsize=7, ha="center",
                            annotation_clip=False, rotation=90, va="bottom")
    ax.set_ylim(0, 1)
    ax.set_xlabel("seconds (labels on top: the bottleneck of each half second)")
    ax.set_ylabel("share of stage time")
    ax.set_title(f"asyncfeed profile: {result['data']}", fontsize=10, pad=40)
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  fontsize=8, ncol=len(handles), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
