"""One round of the outcome bench (``bench/outcome.py``) in a fresh process.

A round builds one data set of :mod:`.userdata`, builds one contender over it
(``DataLoader`` with ``num_workers`` given, or ``AsyncLoader`` with its defaults;
both with the set's sample order as the sampler and the set's ``collate_fn``) and
runs ``epochs`` epochs on that one loader, timing each.  The first epoch's time
runs from just before the loader is built to its last batch (what a training
script waits for); a later epoch's from its ``iter()`` to its last batch.  After
each of ``AsyncLoader``'s epochs it records ``stats().execution``: its text, and
its ``mode``/``count``/``reason`` where the object has them.

The fork server (:mod:`.server`) runs :func:`execute` in a process forked for the
round, so every round starts from the same state (torch imported, nothing run).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from . import userdata


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def batch_len(batch: Any) -> int:
    """Samples in a batch: the length of its first field (dict, tuple or tensor)."""
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return len(batch[0])
    return len(batch)


def _plain(value: Any) -> Any:
    """A JSON value for a field of ``stats().execution`` (enums by their value)."""
    value = getattr(value, "value", value)
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def execution_fields(execution: Any) -> dict[str, Any]:
    """``stats().execution`` as data: its text, plus ``mode``, ``count``, ``reason`` and
    ``margin`` where the object has those attributes (a string has none of them), and
    ``candidates`` (each measured candidate's text and ``rate``) where it lists them."""
    out: dict[str, Any] = {"execution": str(execution)}
    if isinstance(execution, str):
        return out
    for name in ("mode", "count", "reason", "margin"):
        if hasattr(execution, name):
            out[name] = _plain(getattr(execution, name))
    measured = getattr(execution, "candidates", None)
    if isinstance(measured, (list, tuple)):
        out["candidates"] = [{"candidate": str(getattr(m, "candidate", m)),
                              "rate": _plain(getattr(m, "rate", None))} for m in measured]
    return out


def _open(spec: dict, built: userdata.Built) -> Any:
    if spec["family"] == "dataloader":
        from torch.utils.data import DataLoader
        kwargs: dict[str, Any] = {}
        if built.collate_fn is not None:
            kwargs["collate_fn"] = built.collate_fn
        return DataLoader(built.dataset, batch_size=built.batch_size, sampler=built.order,
                          num_workers=int(spec["workers"]), **kwargs)
    if spec["family"] == "asyncfeed":
        from .._engine.loader import AsyncLoader
        return AsyncLoader(built.dataset, batch_size=built.batch_size, sampler=built.order,
                           collate_fn=built.collate_fn)
    raise ValueError(f"unknown contender family {spec['family']!r}")


def execute(spec: dict) -> dict:
    """Run one round: ``spec`` has ``dataset``, ``family`` (``dataloader`` or
    ``asyncfeed``), ``workers`` (DataLoader's), ``epochs``, and optionally ``quick``,
    ``workdir`` and ``seed``.  Returns each epoch's rate (and execution) and the
    round's CPU time; raises if an epoch delivers other than every sample once."""
    built = userdata.build(spec["dataset"], quick=bool(spec.get("quick")),
                           workdir=spec.get("workdir"), seed=int(spec.get("seed", 0)))
    expect = len(built.order)
    gc.collect()
    cpu0 = _cpu()
    t0 = time.perf_counter()
    loader = _open(spec, built)
    build_s = time.perf_counter() - t0
    epochs: list[dict[str, Any]] = []
    try:
        for e in range(int(spec["epochs"])):
            start = t0 if e == 0 else time.perf_counter()
            samples = batches = 0
            first = None
            for batch in loader:
                samples += batch_len(batch)
                batches += 1
                if first is None:
                    first = time.perf_counter() - start
                del batch
            seconds = time.perf_counter() - start
            if samples != expect:
                raise RuntimeError(f"epoch {e + 1} delivered {samples} samples, "
                                   f"expected {expect}")
            row: dict[str, Any] = {"epoch": e + 1, "seconds": seconds,
                                   "rate": samples / seconds, "first_batch_s": first}
            if spec["family"] == "asyncfeed":
                row.update(execution_fields(loader.stats().execution))
            epochs.append(row)
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
        del loader
    cpu1 = _cpu()
    # process_cpu_s: everything this process and its reaped children used since the
    # fork; the fork server's client takes it out of the machine's load ("other load")
    return {"dataset": spec["dataset"], "family": spec["family"],
            "workers": spec.get("workers"), "samples": expect, "build_s": build_s,
            "epochs": epochs, "cpu_s": cpu1 - cpu0, "process_cpu_s": cpu1}
