"""The live view of a pass: a tqdm bar and/or a periodic log line.

``AsyncLoader(progress=True)`` shows one bar per pass.  While the pass runs its
postfix carries the samples/s and the bottleneck of the last refresh window,
labelled as such (``bottleneck(last 0.5s)``): a window's verdict may differ from
the whole pass's.  When the pass ends the postfix shows the whole pass
(``bottleneck(pass)``), read from the same final snapshot as ``stats()``, so the
bar's last word is ``stats().bottleneck``.  ``log_every=seconds`` writes one
``logging`` line per interval (logger ``"asyncfeed"``, level INFO; the logger's
name already says where it comes from, so the message does not repeat it) with
the window's length, rate, each stage's share of the stage time and the
bottleneck, as ``key=value`` pairs and as a dict in the record's ``asyncfeed``
attribute.

Both are fed by the consumer thread (``tick()`` after each batch handed out);
there is no thread of their own.  A tick costs a clock read unless a refresh
or a log line is due (at most ``REFRESH_S`` apart for the bar).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from .accounting import STAGES, Accounting, Snapshot, analyse
from .advice import with_outcome
from .execution_report import ExecutionReport

__all__ = ["LiveView", "PASS_KEY", "REFRESH_S", "WINDOW_KEY", "window_figures"]

log = logging.getLogger("asyncfeed")

#: the bar's postfix is recomputed at most this often (seconds)
REFRESH_S = 0.5
#: the bar's postfix key for the verdict of the last refresh window, and for the pass's
WINDOW_KEY = f"bottleneck(last {REFRESH_S:g}s)"
PASS_KEY = "bottleneck(pass)"


def window_figures(window: Snapshot, cores: int,
                   execution: ExecutionReport | None = None) -> dict[str, Any]:
    """Rate, stage shares and bottleneck of a window between two snapshots
    (``execution``: what the loader measured, as ``stats()`` heeds it)."""
    elapsed = max(window.elapsed_s, 1e-9)
    total = sum(max(0.0, st.wall_s) for st in window.stages.values()) or 1.0
    a = with_outcome(analyse(window, cores), execution)
    return {"samples_per_s": window.samples / elapsed,
            "batches": window.batches,
            "shares": {name: max(0.0, window.stages[name].wall_s) / total
                       for name in STAGES if name in window.stages},
            "gil_share": a.gil_share,
            "wait_share": a.wait_share,
            "bottleneck": a.bottleneck}


class LiveView:
    """One pass's bar and log lines (either may be off).  ``close()`` is idempotent.
    ``execution``: the loader's execution report, read for each verdict."""

    def __init__(self, acct: Accounting, cores: int, *, progress: bool,
                 log_every: float | None, total: int | None, epoch: int,
                 execution: Callable[[], ExecutionReport] | None = None) -> None:
        self._acct = acct
        self._cores = cores
        self._execution = execution
        self._bar: Any = None
        if progress:
            from .._optional import require
            tqdm = require("tqdm", "AsyncLoader(progress=True)").tqdm
            self._bar = tqdm(total=total, desc=f"epoch {epoch}", unit="batch",
                             file=sys.stderr, mininterval=REFRESH_S, dynamic_ncols=True)
        self._log_every = log_every
        now = time.perf_counter()
        self._bar_at = now
        self._log_at = now
        first = acct.snapshot()
        self._bar_snap = first
        self._log_snap = first
        self._closed = False

    def tick(self) -> None:
        """A batch was handed out (consumer thread)."""
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(1)
            if now - self._bar_at >= REFRESH_S:
                snap = self._acct.snapshot()
                f = window_figures(snap - self._bar_snap, self._cores, self._report())
                self._bar.set_postfix({"samples/s": f"{f['samples_per_s']:.0f}",
                                       WINDOW_KEY: f["bottleneck"] or "-"}, refresh=False)
                self._bar_snap, self._bar_at = snap, now
        if self._log_every is not None and now - self._log_at >= self._log_every:
            snap = self._acct.snapshot()
            self._log(snap - self._log_snap)
            self._log_snap, self._log_at = snap, now

    def _report(self) -> ExecutionReport | None:
        """The loader's execution report now: the bar's and the log's verdicts heed
        what the pass measured, as ``stats()`` does."""
        return self._execution() if self._execution is not None else None

    def _log(self, window: Snapshot) -> None:
        f = window_figures(window, self._cores, self._report())
        shares = " ".join(f"{k}={v:.2f}" for k, v in f["shares"].items())
        log.info("window_s=%.1f samples_per_s=%.1f %s gil_share=%.2f wait_share=%.2f "
                 "bottleneck=%s", window.elapsed_s, f["samples_per_s"], shares,
                 f["gil_share"], f["wait_share"], f["bottleneck"], extra={"asyncfeed": f})

    def close(self) -> None:
        """End the bar (the pass ended or was stopped), its postfix now the whole pass's
        rate and bottleneck: the figures ``stats()`` reports for it."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            whole = window_figures(self._acct.snapshot(), self._cores, self._report())
            self._bar.set_postfix({"samples/s": f"{whole['samples_per_s']:.0f}",
                                   PASS_KEY: whole["bottleneck"] or "-"}, refresh=False)
            self._bar.close()
