"""A loader's process stage over its passes: started when the execution chooser
runs the process candidate, kept while that candidate is chosen."""

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
    """A loader's process stage: started when the execution chooser runs the
    process candidate (or from the first batch with ``execution="processes"``),
    and kept for the loader's later passes while that candidate is chosen.

    Owned by the loader; ``close()`` is idempotent and also runs when the loader
    is garbage-collected or the interpreter exits.
    """

    def __init__(self, mode: str, dataset: Any, workers: int, context: Any,
                 worker_init_fn: Callable[[int], None] | None, capacity: int) -> None:
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
        self.stage: ProcessStage | None = None
        self.failed: str | None = None
        self._retry_after = 0.0  # (monotonic) no start before: see ProcessStage.start
        self._lock = threading.Lock()

    def stage_for(self, base_seed: int,
                  quiet: Callable[[float], ContextManager[bool]] | None = None
                  ) -> ProcessStage | None:
        """The started stage, started now if need be; None when it cannot run now
        (it failed to start or stopped: ``failed`` says why; or the decode threads
        did not go quiet for the fork: ``quiet``, see :meth:`ProcessStage.start`)."""
        if self.failed is not None:
            return None
        if self.stage is None and time.monotonic() < self._retry_after:
            return None  # the threads did not go quiet a moment ago: not again yet
        with self._lock:
            if self.stage is None:
                stage = ProcessStage(self.dataset, self.workers, self.context,
                                     self.worker_init_fn, base_seed, self.capacity)
                try:
                    started = stage.start(quiet)
                except Exception as e:  # noqa: BLE001 - e.g. an unpicklable dataset with spawn
                    stage.close()
                    if self.mode == "processes":
                        raise AsyncFeedError(f"the process stage could not start: "
                                             f"{type(e).__name__}: {e}") from e
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
                log.debug("process stage started (%d workers)", self.workers)
        stage = self.stage
        if not stage.usable:
            if self.failed is None:
                self.failed = f"processes stopped ({stage.broken})"
            return None
        return stage

    def close(self) -> None:
        """Stop the stage's workers (idempotent); a later ``stage_for`` starts anew."""
        with self._lock:
            stage, self.stage = self.stage, None
        if stage is not None:
            stage.close()
