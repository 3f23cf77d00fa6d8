"""One measured run, executed in a fresh process forked by the fork server.

The run process builds its data set, stops itself (``SIGSTOP``) so the
benchmark can read the memory of the process tree at rest, builds the loader,
consumes one epoch (or only its first batch, or with a simulated training step
after each batch), stops itself again at the end of the epoch, while every
worker is still alive, for the memory reading, then closes the loader and
reports.  CPU time is the process's own plus that of every child it reaped
(DataLoader workers are joined on close), measured from just before the
loader is built to just after it is closed.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from typing import Any

from . import contenders
from .augment import NormalizedRows, normalized, reserve
from .limit import run_limit
from .workloads import build_dataset


def _cpu() -> tuple[float, float]:
    t = os.times()
    return t.user + t.children_user, t.system + t.children_system


def _pause(label: str, marks: list[dict]) -> None:
    """Let the parent read memory now: it resumes us (SIGCONT) when done."""
    marks.append({"label": label, "t": time.perf_counter()})
    os.kill(os.getpid(), signal.SIGSTOP)


def _images(batch: Any) -> Any:
    if isinstance(batch, dict):
        return next(iter(batch.values()))
    if isinstance(batch, (list, tuple)):
        return batch[0]
    return batch


def _reserve_consumer(spec: dict, rows: int) -> None:
    """Workload h: make the consumer's float buffer for ``rows`` rows before the run,
    as a training loop has its input buffer (see ``augment.reserve``)."""
    if spec["dataset"].get("normalize"):
        size = spec["dataset"]["size"]
        reserve(rows, (3, size, size))


def _limit(spec: dict, dataset: Any, order: list[int]) -> dict:
    """The limit line's figures: ``dataset[i]`` over ``order`` in ``spec["procs"]``
    processes, no loader (workload h's rows then normalized, as its consumer does)."""
    marks: list[dict] = []
    if spec["dataset"].get("normalize"):
        dataset = NormalizedRows(dataset)
    _reserve_consumer(spec, 1)  # before the fork: one row at a time
    out = run_limit(dataset, order, spec["procs"],
                    pause=(lambda: _pause("end", marks)) if spec.get("pause", True) else None)
    return {**out, "marks": marks}


def execute(spec: dict) -> dict:
    """Run ``spec`` (a dict from the runner) and return its figures."""
    mode = spec["mode"]
    dataset, order = build_dataset(spec["dataset"])
    if mode == "limit":
        return _limit(spec, dataset, order)
    family, knob = spec["family"], spec.get("knob")
    if family in ("torchdata", "spdl"):  # import outside the measured window
        __import__(contenders.REQUIRES[family])
    _reserve_consumer(spec, spec["batch_size"])
    gc.collect()
    marks: list[dict] = []
    if spec.get("pause", True):
        _pause("ready", marks)
    device = spec.get("device", "cpu")
    bs = spec["batch_size"]
    step_s = spec.get("step_s") or 0.0
    expect = (len(order) if mode != "ttfb" else min(bs, len(order)))
    threads_before = threading.active_count()

    cpu0 = _cpu()
    t0 = time.perf_counter()
    handle = contenders.open_loader(family, knob, dataset, order, bs, device=device,
                                    context=spec.get("context"), seed=spec.get("seed", 0))
    t_built = time.perf_counter()
    info = _loader_info(handle, family, knob, spec)
    arrivals: list[float] = []
    sizes: list[int] = []
    waits: list[float] = []
    it = iter(handle)
    try:
        samples, shape = _consume(it, spec, t0, expect, arrivals, sizes, waits)
        if device.startswith("cuda"):
            import torch
            torch.cuda.synchronize()
        t_last = time.perf_counter()
        if spec.get("pause", True):
            _pause("end", marks)  # every worker is still alive here
        t_resume = time.perf_counter()
        stats = _loader_stats(handle)
    finally:
        closing = time.perf_counter()
        close_error = _close(it, handle)
        del it, handle
    t_closed = time.perf_counter()
    cpu1 = _cpu()
    pause_s = t_resume - t_last

    if samples != expect:
        raise RuntimeError(f"{family} knob={knob} delivered {samples} samples, expected {expect}")
    warm = max(1, len(arrivals) // 10)
    steady_rate = _slope(arrivals[warm:], sizes[warm:]) if mode != "ttfb" else None
    elapsed = arrivals[-1] if arrivals else None
    out = {
        "samples": samples,
        "batches": len(arrivals),
        "sample_shape": shape,
        "build_s": t_built - t0,
        "ttfb_s": arrivals[0] if arrivals else None,
        "elapsed_s": elapsed,
        "close_s": t_closed - closing,
        "total_s": (t_closed - t0) - pause_s,
        "rate": (samples / elapsed) if elapsed else None,  # the epoch, from building the loader
        "steady_rate": steady_rate,
        "warmup_batches": warm,
        **_cpu_figures(cpu0, cpu1, samples),
        "arrivals_s": [round(a, 5) for a in arrivals],
        "batch_waits_s": [round(w, 5) for w in waits],
        "threads_before": threads_before,
        "threads_after_close": threading.active_count(),
        "loader_info": info,
        "loader_stats": stats,
        "marks": marks,
        "close_error": close_error,
    }
    if step_s:
        out.update(_step_figures(step_s, waits))
    return out


def _loader_info(handle: Any, family: str, knob: Any, spec: dict) -> dict:
    """What the run records about the loader: its settings, and the thread count
    it resolved where it has one."""
    info = {**handle_info(family, knob, spec), **(handle.info or {})}
    resolved = getattr(handle.iterable, "num_threads", None)
    if isinstance(resolved, int):
        info["resolved_threads"] = resolved
    return info


def _cpu_figures(cpu0: tuple[float, float], cpu1: tuple[float, float], samples: int) -> dict:
    """The run's CPU time (user, system, both, per sample) between two ``_cpu()``
    readings, and the process's total at the end."""
    cpu_user = cpu1[0] - cpu0[0]
    cpu_sys = cpu1[1] - cpu0[1]
    return {"cpu_user_s": cpu_user, "cpu_sys_s": cpu_sys, "cpu_s": cpu_user + cpu_sys,
            "cpu_per_sample_ms": (cpu_user + cpu_sys) / samples * 1e3 if samples else None,
            "process_cpu_s": cpu1[0] + cpu1[1]}


def _consume(it: Any, spec: dict, t0: float, expect: int, arrivals: list[float],
             sizes: list[int], waits: list[float]) -> tuple[int, list | None]:
    """Take batches from ``it`` as the training loop would (to the device, the
    simulated step), appending each batch's arrival (since ``t0``), size and wait;
    (samples taken, the first batch's sample shape and dtype)."""
    family, device = spec["family"], spec.get("device", "cpu")
    mode, step_s = spec["mode"], spec.get("step_s") or 0.0
    samples = 0
    shape = None
    while True:
        w0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        now = time.perf_counter()
        images = _images(batch)
        if device.startswith("cuda") and not family.startswith("asyncfeed"):
            images = images.to(device, non_blocking=True)
        if spec["dataset"].get("normalize"):  # workload h: uint8 rows, as training would
            images = normalized(images)
        n = int(images.shape[0])
        if shape is None:
            shape = [int(s) for s in images.shape[1:]] + [str(images.dtype)]
        samples += n
        arrivals.append(now - t0)
        sizes.append(n)
        waits.append(now - w0)
        del batch, images
        if mode == "ttfb" and samples >= expect:
            break
        if step_s:
            time.sleep(step_s)  # the simulated training step (releases the GIL)
    return samples, shape


def _loader_stats(handle: Any) -> Any:
    """The loader's own ``stats()`` as plain data (None without; the error where
    it raised): with an execution report, its sentence and its fields."""
    stats = None
    if handle.stats is not None:
        try:
            raw = handle.stats()
            stats = _plain(raw)
            ex = getattr(raw, "execution", None)
            if ex is not None and isinstance(stats, dict):  # a sentence, and its fields
                stats["execution"] = str(ex)
                stats["execution_mode"] = str(getattr(getattr(ex, "mode", ""), "value", ""))
                stats["execution_count"] = getattr(ex, "count", None)
        except Exception as e:  # noqa: BLE001 - stats are a bonus, not the measurement
            stats = {"error": repr(e)}
    return stats


def _close(it: Any, handle: Any) -> str | None:
    """Close the iterator, then the loader; what either raised, or None."""
    close_errors = []
    for step in (getattr(it, "close", None), handle.close):
        try:
            if step is not None:
                step()
        except Exception as e:  # noqa: BLE001 - reported with the run, figures stay valid
            close_errors.append(f"{type(e).__name__}: {e}")
    return "; ".join(close_errors) or None


def _step_figures(step_s: float, waits: list[float]) -> dict:
    """With a simulated training step: the share of the time spent waiting for data
    (after the first batch)."""
    wait_after = sum(waits[1:])
    steps = step_s * max(0, len(waits) - 1)
    return {"step_s": step_s, "wait_s": wait_after,
            "wait_fraction": wait_after / (wait_after + steps) if (wait_after + steps) else None}


def _slope(times: list[float], sizes: list[int]) -> float | None:
    """Least-squares samples/s through (arrival time, samples so far): the steady rate,
    less sensitive than a two-point difference to batches arriving in bursts."""
    if len(times) < 3:
        return None
    cum, total = [], 0
    for n in sizes:
        total += n
        cum.append(total)
    mt, mc = sum(times) / len(times), sum(cum) / len(cum)
    var = sum((t - mt) ** 2 for t in times)
    if var <= 0:
        return None
    return sum((t - mt) * (c - mc) for t, c in zip(times, cum)) / var


def handle_info(family: str, knob: int | None, spec: dict) -> dict:
    return {"family": family, "knob": knob, "context": spec.get("context"),
            "device": spec.get("device", "cpu")}


def _plain(obj: Any, depth: int = 0) -> Any:
    """A JSON-able copy of a stats object (dataclass, dict, namedtuple, plain values)."""
    if depth > 4:
        return repr(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {str(k): _plain(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v, depth + 1) for v in obj[:50]]
    if hasattr(obj, "_asdict"):
        return _plain(obj._asdict(), depth + 1)
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _plain(getattr(obj, k), depth + 1) for k in obj.__dataclass_fields__}
    if hasattr(obj, "__dict__"):
        return {k: _plain(v, depth + 1) for k, v in vars(obj).items() if not k.startswith("_")}
    return repr(obj)
