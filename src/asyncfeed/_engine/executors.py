"""Where the rows of a map-style pass run: the executors.

Three executors stand behind one interface, :class:`RowExecutor`:

* :class:`ThreadRows`: the decode pool's threads run row tasks
  (``rowtasks.run_rows``), as many at once as the pass's :class:`~.tasksize.Gate`
  lets through, each task a run of rows sized by the measured cost of a row;
* :class:`InlineRows`: the same tasks on the same queue, run by the consumer's
  thread while it waits for a batch (the gate lets no decode thread through);
* :class:`ProcessRows`: the loader's worker processes (``processes``), started
  the first time a pass runs there.

The loader builds one :class:`Executors` per pass and hands it to the pass when
it builds it; the execution chooser picks the executor the pass uses
(``Pipeline.apply``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager, Protocol

from . import rowtasks
from .batch import Batch
from .policy import Mode
from .processes import handover
from .samples import RowHost
from .tasksize import Gate, RowCost, rows_per_task

if TYPE_CHECKING:  # pragma: no cover
    from .chooser import Chooser
    from .processes.execution import Execution
    from .processes.stage import ProcessStage
    from .taskpool import TaskPool

__all__ = ["Executors", "InlineRows", "ProcessRows", "RowExecutor", "ThreadRows"]


class RowExecutor(Protocol):
    """Runs the rows of a pass's batches somewhere."""

    mode: Mode

    def submit(self, p: RowHost, b: Batch) -> bool:
        """Have every row of ``b`` loaded; each run of rows reports to ``p``
        (``RowHost.rows_done``), the last completing ``b``.  False when this
        executor took no row of ``b`` (it stopped, or the loader is closing): the
        caller runs ``b`` elsewhere, or abandons it."""
        ...


class ThreadRows:
    """Row tasks for the decode pool's threads (see the module docstring).

    ``gate``: how many of the pass's tasks run at once (0: none, the consumer
    runs them, :class:`InlineRows`).  ``chooser``: while it still measures
    candidates, tasks are cut for every thread that may run."""

    mode = Mode.THREADS

    def __init__(self, gate: Gate, row_cost: RowCost, pool: TaskPool,
                 chooser: Chooser | None = None) -> None:
        self.gate = gate
        self.row_cost = row_cost
        self.pool = pool  # its size now: it grows where the search climbs past it
        self.chooser = chooser

    def step(self, n: int) -> int:
        """Rows per task for a batch of ``n``."""
        running = self.gate.limit
        if self.chooser is not None and self.chooser.exploring:
            # while candidates are measured, tasks are cut for the most threads the
            # duel runs: a batch queued as one task under one thread would keep a
            # second thread idle in the window that measures two; cut for all the
            # pool's threads, tiny rows would measure inline and one thread with
            # the cost of tasks many times smaller than they run settled
            running = min(self.pool.size, self.chooser.decision.most_threads())
        if running <= 1:
            # one thread (or the consumer, inline): splitting the batch only adds
            # tasks (a queue hand-off, a report, the bookkeeping and a deferred write)
            return n
        # runs of rows per pool task, sized by the measured cost of a row: tiny
        # samples in batch-sized tasks (see tasksize.rows_per_task)
        return rows_per_task(n, running, self.row_cost.wall_s, self.row_cost.cpu_s)

    def submit(self, p: RowHost, b: Batch) -> bool:
        """Queue ``b``'s rows for the pool as runs of :meth:`step` rows.  False when
        the pool is closed (rows queued before that still run, and ``b`` is
        abandoned by the caller)."""
        step = self.step(b.n)
        for lo in range(0, b.n, step):
            if p.runtime.submit(rowtasks.run_rows, p, b, lo, min(lo + step, b.n)) is None:
                return False
        return True


class InlineRows:
    """The row tasks of :class:`ThreadRows`, run by the consumer's thread while it
    waits (``BatchHandoff.inline``); the gate lets no decode thread take them."""

    mode = Mode.INLINE

    def __init__(self, threads: ThreadRows) -> None:
        self.threads = threads

    def submit(self, p: RowHost, b: Batch) -> bool:
        """As :meth:`ThreadRows.submit` (the gate's limit, 0, makes one task a batch)."""
        return self.threads.submit(p, b)


class ProcessRows:
    """The loader's worker processes (its :class:`~.processes.Execution`), for the
    passes whose chooser runs the process candidate."""

    mode = Mode.PROCESSES

    def __init__(self, execution: Execution, base_seed: int,
                 quiet: Callable[[float], ContextManager[bool]] | None) -> None:
        self.execution = execution
        self.base_seed = base_seed
        self.quiet = quiet

    def stage(self, workers: int | None = None) -> ProcessStage | None:
        """The started stage of ``workers`` workers (default: the loader's count),
        started now if need be (consumer thread); None when it cannot run now (see
        ``Execution.stage_for``)."""
        return self.execution.stage_for(self.base_seed, self.quiet, workers)

    def submit(self, p: RowHost, b: Batch) -> bool:
        """Send every row of ``b`` to the pass's stage (``RowHost.stage``); False
        when it cannot take them (stopped, or the pass uses none)."""
        stage = p.stage
        return stage is not None and handover.submit_batch(p, stage, b)


@dataclass(frozen=True)
class Executors:
    """The executors a pass may run its rows on, given when it is built."""

    threads: ThreadRows
    inline: InlineRows
    processes: ProcessRows | None = None   # None: no worker processes
    chooser: Chooser | None = None         # picks among them (None: threads stay)

    @classmethod
    def build(cls, *, gate: Gate, row_cost: RowCost, pool: TaskPool,
              processes: ProcessRows | None = None,
              chooser: Chooser | None = None) -> Executors:
        threads = ThreadRows(gate, row_cost, pool, chooser)
        return cls(threads, InlineRows(threads), processes, chooser)

    @property
    def gate(self) -> Gate:
        return self.threads.gate

    @property
    def row_cost(self) -> RowCost:
        return self.threads.row_cost
