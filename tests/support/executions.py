"""The executions every promise-guarding suite runs on, in one place.

``EXECUTIONS`` is every ``execution=`` mode but ``"auto"`` (which picks one of
the others): derived from the engine's own list, so a new mode is tested by
every suite that takes the ``execution`` fixture (tests/conftest.py) without an
edit here.  ``on(execution)`` is the loader arguments that select it; worker
processes start with ``fork``, the cheapest start method (the start methods
themselves are tested in tests/engine/test_execution.py).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import psutil

from asyncfeed._engine import processes

EXECUTIONS: tuple[str, ...] = tuple(e for e in processes.EXECUTIONS if e != "auto")
#: the executions that load samples off the consumer's thread: only there can a stuck
#: sample not keep the consumer from a ``LoaderTimeout`` (``"inline"`` loads them in
#: ``next()`` itself, as DataLoader's ``num_workers=0`` does)
OFF_THREAD: tuple[str, ...] = tuple(e for e in EXECUTIONS if e != "inline")


def on(execution: str) -> dict[str, Any]:
    """``AsyncLoader`` keyword arguments that run a loader's samples on ``execution``."""
    kw: dict[str, Any] = {"execution": execution}
    if execution == "processes":
        kw["multiprocessing_context"] = "fork"
    return kw


def worker_processes() -> list[psutil.Process]:
    """This process's live children but multiprocessing's own helpers (the forkserver,
    the resource tracker): the worker processes of loaders."""
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(c.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "forkserver" not in cmd and "resource_tracker" not in cmd:
            out.append(c)
    return out


def shm_files() -> set[str]:
    """The ``/dev/shm`` files of this process's process stages."""
    return set(glob.glob(f"/dev/shm/asyncfeed-{os.getpid()}-*"))
