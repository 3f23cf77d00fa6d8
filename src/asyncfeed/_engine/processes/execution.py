"""A loader's process stages over its passes: one started when the execution
chooser runs a process candidate, kept while that candidate is chosen."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, ContextManager

from ..._errors import AsyncFeedError
from .stage import ProcessStage, resolve_context

__all__ = ["EXECUTIONS", "Execution", "QUIET_RETRY_S"]

log = logging.getLogger("asyncfeed")

QUIET_RETRY_S = 5.0    # when the threads did not go quiet for a fork: the wait before a retry


EXECUTIONS = ("auto", "inline", "threads", "processes")


class Execution:
    """A loader's process stages: one started when the execution chooser runs a
    process candidate (or from the first batch with ``execution="processes"``),
    and kept for the loader's later passes while that candidate is chosen.

    ``stage`` is the stage of the candidate run last.  A candidate of another worker
    count (the chooser measures twice the workers against them) gets a stage of its
    own: the one it leaves is kept, idle or finishing the rows it holds, until
    :meth:`keep` names a candidate that is not its own (a pass's start, with the
    choice the pass starts on) or ``close()``.

    Owned by the loader; ``close()`` is idempotent and also runs when the loader
    is garbage-collected or the interpreter exits.
    """

    def __init__(self, mode: str, dataset: Any, workers: int, context: Any,
                 worker_init_fn: Callable[[int], None] | None, capacity: int,
                 collate: Callable[[list[Any]], Any] | None = None) -> None:
        if mode not in EXECUTIONS:
            raise ValueError(f"execution must be one of {', '.join(EXECUTIONS)}, got {mode!r}")
        if mode in ("auto", "processes") and context is not None:
            resolve_context(context)  # a bad start method is an error now, not mid-pass
        self.mode = mode
        self.dataset = dataset
        self.workers = workers
        self.context = context
        self.worker_init_fn = worker_init_fn
        self.capacity = capacity
        self.collate = collate  # the user's collate_fn, for the workers (ProcessStage)
        self.stage: ProcessStage | None = None
        self._parked: dict[int, ProcessStage] = {}  # stages of other counts, by count
        self.failed: str | None = None
        self._retry_after = 0.0  # (monotonic) no start before: see ProcessStage.start
        self._lock = threading.Lock()

    def stage_for(self, base_seed: int,
                  quiet: Callable[[float], ContextManager[bool]] | None = None,
                  workers: int | None = None) -> ProcessStage | None:
        """The started stage of ``workers`` workers (default: the loader's count),
        started now if need be; None when it cannot run now (it failed to start or
        stopped: ``failed`` says why; or the decode threads did not go quiet for
        the fork: ``quiet``, see :meth:`ProcessStage.start`).  A stage of another
        count is parked (see the class docstring); where this count fails to start
        while a parked one runs, only this count is out (``failed`` stays None)."""
        if self.failed is not None:
            return None
        workers = workers or self.workers
        with self._lock:
            if self.stage is not None and self.stage.num_workers != workers:
                self._parked[self.stage.num_workers] = self.stage
                self.stage = None
            if self.stage is None:
                self.stage = self._parked.pop(workers, None)
        if self.stage is None and time.monotonic() < self._retry_after:
            return None  # the threads did not go quiet a moment ago: not again yet
        with self._lock:
            if self.stage is None:
                stage = ProcessStage(self.dataset, workers, self.context,
                                     self.worker_init_fn, base_seed, self.capacity,
                                     self.collate)
                try:
                    started = stage.start(quiet)
                except Exception as e:  # noqa: BLE001 - e.g. an unpicklable dataset with spawn
                    stage.close()
                    if self.mode == "processes":
                        raise AsyncFeedError(f"the process stage could not start: "
                                             f"{type(e).__name__}: {e}") from e
                    if any(s.usable for s in self._parked.values()):
                        # the workers of another count run: only this count is out
                        log.warning("%d worker processes could not start (%s: %s)",
                                    workers, type(e).__name__, e)
                        return None
                    self.failed = f"processes could not start ({type(e).__name__}: {e})"
                    log.warning("%s; staying in this process", self.failed)
                    return None
                if not started:
                    stage.close()
                    self._retry_after = time.monotonic() + QUIET_RETRY_S
                    log.debug("the decode threads did not go quiet for the fork: "
                              "the process stage starts later")
                    return None
                self.stage = stage
                log.debug("process stage started (%d workers)", workers)
        stage = self.stage
        if not stage.usable:
            if self.failed is None:
                self.failed = f"processes stopped ({stage.broken})"
            return None
        return stage

    def keep(self, workers: int | None) -> None:
        """Stop the workers of every stage but the one of ``workers`` workers (None:
        every stage): a pass starts on a candidate that does not use them."""
        with self._lock:
            stages = [s for n, s in self._parked.items() if n != workers]
            self._parked = {n: s for n, s in self._parked.items() if n == workers}
            if self.stage is not None and self.stage.num_workers != workers:
                stages.append(self.stage)
                self.stage = self._parked.pop(workers, None) if workers else None
        for stage in stages:
            stage.close()

    def close(self) -> None:
        """Stop every stage's workers (idempotent); a later ``stage_for`` starts anew."""
        self.keep(None)
