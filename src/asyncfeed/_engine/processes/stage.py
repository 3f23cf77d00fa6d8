"""The process stage: worker processes running ``dataset[index]`` for a pass.

:class:`ProcessStage` starts the workers, sends them tasks (at most
``WORKER_DEPTH`` a worker, the rest in a backlog), reads their results in a
thread of its own (``asyncfeed-proc-results``), notices a worker that died, and
stops them all at ``close()``.  How a pass's batches reach it and its results
reach the batches is ``py``'s.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import select
import signal
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, ContextManager

from ..._errors import AsyncFeedError, WorkerCrashedError, describe
from ..._memory.layout import Layout
from ...protocols import EpochAware
from ..accounting import DECODE
from ..tasksize import RowCost
from .opened import register, unregister
from .shm import ShmBuffers, remove_segments
from .taskrows import (WORKER_DEPTH, apply_results, batches_to_fill, rows_per_process_task,
                       rows_to_threads, task_message)
from .transport import unwrap
from .worker import worker_main

if TYPE_CHECKING:  # pragma: no cover
    from ..batch import Batch
    from ..samples import RowHost

__all__ = ["ProcessStage", "resolve_context"]

log = logging.getLogger("asyncfeed")

CLOSE_GRACE_S = 0.5   # close(): the workers' time to leave on their own, before SIGTERM
QUIET_S = 1.0          # the longest the consumer waits for running tasks before a fork
TAIL_SHARE = 0.5       # once a pass's plan ran out, a backlog task sent is at most this
                       # share of the backlog's rows per live worker (ProcessStage._tail_piece)


def resolve_context(context: Any) -> Any:
    """DataLoader's ``multiprocessing_context``: None (the platform's default), a
    start method name, or a context object."""
    if context is None:
        return mp.get_context()
    if isinstance(context, str):
        if context not in mp.get_all_start_methods():
            raise ValueError(f"multiprocessing_context={context!r}: this platform supports "
                             f"{', '.join(mp.get_all_start_methods())}")
        return mp.get_context(context)
    if not isinstance(context, mp.context.BaseContext):
        raise TypeError("multiprocessing_context must be a start method name or a "
                        f"multiprocessing context, got {type(context).__name__}")
    return context



def _travels(collate: Callable[[list[Any]], Any] | None, ctx: Any) -> bool:
    """Whether ``collate`` can go to workers started by ``ctx``: inherited by a fork;
    pickled by the other start methods (a lambda cannot be: its batches are
    collated here)."""
    if collate is None:
        return False
    if ctx.get_start_method() == "fork":
        return True
    try:
        pickle.dumps(collate)
    except Exception:  # noqa: BLE001 - any pickling failure: collated here
        return False
    return True


class ProcessStage:
    """``num_workers`` worker processes running ``dataset[index]`` for the pipeline."""

    def __init__(self, dataset: Any, num_workers: int, context: Any,
                 worker_init_fn: Callable[[int], None] | None, base_seed: int,
                 capacity: int, collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset = dataset
        self.num_workers = max(1, num_workers)
        self.ctx = resolve_context(context)
        # the loader's own collate_fn, run by the workers on whole batches that come
        # back pickled (see collates); None where they cannot have it
        self.collate = collate if _travels(collate, self.ctx) else None
        self.worker_init_fn = worker_init_fn
        self.base_seed = base_seed
        self.buffers = ShmBuffers(capacity)
        self.broken: BaseException | None = None
        self.owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = False      # the results thread may stop
        self._closing = False     # no more work is taken
        self._started = False
        self._workers: list[Any] = []
        self._tasks: list[mp_connection.Connection] = []       # each worker's task pipe
        self._send_locks: list[threading.Lock] = []
        self._readers: dict[mp_connection.Connection, int] = {}  # result pipe -> worker id
        # the results thread runs while a pass uses the stage or a worker holds a task
        # (see _collect); passes using the stage now:
        self._passes: weakref.WeakSet[Any] = weakref.WeakSet()
        self._collector: threading.Thread | None = None
        self._wake_fds: tuple[int, int] | None = None  # wakes the results thread's poll
        self._ids = itertools.count()
        # task id -> (pipeline, batch, lo, hi, worker or -1 while in the backlog, sent at)
        self._pending: dict[int, tuple[Any, Any, int, int, int, float]] = {}
        self._held = [0] * self.num_workers     # tasks sent to each worker, not yet back
        self._backlog: collections.deque[tuple[int, str | None]] = collections.deque()  # tid, path
        self._forget: list[str] = []
        self._dead: set[int] = set()
        self._last_layout: Layout | None = None
        self.row_s: float | None = None  # what a row takes in a worker (a running mean)
        # an EpochAware dataset's epoch travels with every task (see worker.worker_main)
        self._epoch_aware = isinstance(dataset, EpochAware)

    @property
    def usable(self) -> bool:
        return not self._closing and self.broken is None

    def start(self, quiet: Callable[[float], ContextManager[bool]] | None = None) -> bool:
        """Start the workers and the results thread (once; from the consumer thread).

        ``quiet``: the decode pool's ``TaskPool.quiet``.  With the fork start method
        the workers are forked inside it, no decode thread running user code: a
        lock such code held at the fork (NumPy's global generator's, a logging
        handler's) would stay locked in the child for ever.  False, starting
        nothing, if the threads did not go quiet in time (a task still running
        after ``QUIET_S``); the caller may try again later (``Execution`` waits
        ``QUIET_RETRY_S``)."""
        if quiet is not None and self.ctx.get_start_method() == "fork":
            with quiet(QUIET_S) as calm:
                return self._start() if calm else False
        return self._start()

    def _start(self) -> bool:
        with self._lock:
            if self._started or self._closing:
                return True
            self._started = True
            register(self)
            remove_segments()  # of loaders killed with their workers (see there)
            for wid in range(self.num_workers):
                task_reader, task_writer = self.ctx.Pipe(duplex=False)
                reader, writer = self.ctx.Pipe(duplex=False)
                p = self.ctx.Process(target=worker_main, name=f"asyncfeed-proc-{wid}",
                                     args=(wid, self.num_workers, self.dataset,
                                           self.worker_init_fn, self.base_seed,
                                           task_reader, writer, self.owner_pid,
                                           self.collate), daemon=True)
                try:
                    p.start()
                finally:
                    # only the worker holds its results pipe's write end (its death
                    # reads as EOF) and its task pipe's read end (the loader closing
                    # its end stops it); closed before the next fork, so no later
                    # worker inherits them
                    writer.close()
                    task_reader.close()
                self._readers[reader] = wid
                self._tasks.append(task_writer)
                self._send_locks.append(threading.Lock())
                self._workers.append(p)
            # made after the forks: no worker holds a copy
            self._wake_fds = os.pipe()
            for fd in self._wake_fds:
                os.set_blocking(fd, False)
        return True

    def row_cost(self, cost: RowCost | None) -> float | None:
        """What a row costs in a worker, to size its tasks (``rows_per_process_task``):
        measured there once a task came back.  Before, the least of the threads'
        running means (``cost``) of a row's CPU and wall time: the wall time
        carries the GIL waits of the rows beside it."""
        if self.row_s is not None:
            return self.row_s
        if cost is None:
            return None
        known = [x for x in (cost.cpu_s, cost.wall_s) if x]
        return min(known) if known else None

    def pids(self) -> list[int]:
        return [p.pid for p in self._workers if p.pid is not None]

    # -------------------------------------------------------------- submitting
    def take(self, layout: Layout, rows: int) -> tuple[list[Any], str]:
        return self.buffers.take(layout, rows)

    def submit(self, p: RowHost, b: Batch, lo: int, hi: int, path: str | None) -> bool:
        """Send rows ``lo..hi`` of ``b`` to a worker; False if the stage cannot take
        them (closed or broken: the caller runs them in threads).

        A worker holds at most ``WORKER_DEPTH`` tasks; a task no worker can take now
        waits in the stage's backlog (first in, first out) and goes to the first
        worker that sends results back (``_handle``).  Queued straight to a worker,
        a pass's tasks were shared out as they were submitted, a ring's worth ahead:
        a worker that ran a little slower (a busy core) still held several tasks
        at the end of the pass while the other had none (a core idle for several
        tasks' time); held back, they go where a worker is free."""
        with self._lock:
            if not self.usable or p.stopping:  # (a pass over: drop_pipeline has run or will)
                return False
            self._passes.add(p)
            self._ensure_collector()
            tid = next(self._ids)
            wid = self._free_worker()
            if wid < 0:
                self._pending[tid] = (p, b, lo, hi, -1, time.perf_counter())
                self._backlog.append((tid, path))
                return True
            forget = self._assign(tid, p, b, lo, hi, wid)
        msg = task_message(b, lo, hi, path, self.collates(p, b, lo, hi, path))
        if not self._send(wid, tid, msg, forget):
            with self._lock:
                self._pending.pop(tid, None)
                self._held[wid] -= 1
            return False
        return True

    def _free_worker(self) -> int:
        """(under the lock) The live worker holding fewest tasks, if under
        ``WORKER_DEPTH``; else -1."""
        best = -1
        for w in range(self.num_workers):
            if w not in self._dead and self._held[w] < WORKER_DEPTH \
                    and (best < 0 or self._held[w] < self._held[best]):
                best = w
        return best

    def _assign(self, tid: int, p: RowHost, b: Batch, lo: int, hi: int, wid: int
                ) -> list[str]:
        """(under the lock) Task ``tid`` (rows ``lo..hi`` of ``b``) goes to worker
        ``wid`` now; returns the segments it is to forget, sent with the task."""
        self._pending[tid] = (p, b, lo, hi, wid, time.perf_counter())
        self._held[wid] += 1
        forget, self._forget = self._forget, []
        return forget

    def collates(self, p: RowHost, b: Batch, lo: int, hi: int, path: str | None) -> bool:
        """Whether the worker collates rows ``lo..hi`` of ``b``: the whole batch, sent
        back pickled (no buffers to write it into), of a pass whose collate is the
        one the workers have, and whose batches are never re-made of other rows
        (``RowHost.worker_collate``).  As ``DataLoader``'s workers do: the loader's
        process then reads one batch back instead of every row, and runs no
        collate."""
        return self.collate is not None and path is None and lo == 0 and hi == b.n \
            and p.worker_collate and p.collate is self.collate

    def task_rows(self, n: int, cost: RowCost | None, ahead: int = 1) -> int:
        """Rows per task for a batch of ``n`` with ``ahead`` batches in flight
        (``rows_per_process_task`` at :meth:`row_cost`)."""
        return rows_per_process_task(n, self.num_workers, self.row_cost(cost), ahead)

    def fill(self, n: int, cost: RowCost | None) -> int:
        """Batches of ``n`` rows in flight that keep every worker's tasks full
        (``batches_to_fill``), as far as the shared-memory sets they take fit in
        half the free space (``ShmBuffers.room``); the stage keeps that many sets
        (and two more: the batch the consumer holds, the one it returns) for reuse."""
        ahead = batches_to_fill(n, self.num_workers, self.row_cost(cost))
        room = self.buffers.room()
        if room is not None:  # and no more than half the free shared memory holds
            ahead = max(1, min(ahead, room - 2))
        self.buffers.reserve(ahead + 2)
        return ahead

    def _send(self, wid: int, tid: int, task: tuple[Any, ...], forget: list[str]) -> bool:
        """Write a task to worker ``wid``'s pipe (any thread; one writer at a time).
        A worker holds at most ``WORKER_DEPTH`` small tasks: the write does not wait
        for the pipe to drain.  False if the pipe is closed (the stage closing) or
        the worker is gone."""
        epoch = self.dataset.epoch if self._epoch_aware else None
        data = ForkingPickler.dumps((tid, *task, forget, epoch))
        with self._send_locks[wid]:
            try:
                self._tasks[wid].send_bytes(data)
            except (ValueError, OSError):  # closed under us, or the worker died
                return False
        return True

    def _ensure_collector(self) -> None:
        """(under the lock) Start the results thread if it is not running."""
        if self._collector is None and not self._closed:
            self._collector = threading.Thread(target=self._collect,
                                               name="asyncfeed-proc-results", daemon=False)
            self._collector.start()

    def _idle(self) -> bool:
        """(under the lock) No pass uses the stage and no worker holds a task."""
        return not self._passes and not any(self._held) and not self._backlog

    def _wake_collector(self) -> None:
        """(under the lock) Have the results thread look at the stage's state now,
        not at the end of its 0.1 s poll (it ends the moment the stage is idle)."""
        if self._wake_fds is not None:
            try:
                os.write(self._wake_fds[1], b"\0")
            except OSError:  # full: it has been woken already
                pass

    def _dispatch(self) -> None:
        """Send backlog tasks to the workers with room (the results thread, after a
        task came back).  A task the queue refuses (closing) is dropped: the pass
        is being torn down."""
        while True:
            with self._lock:
                if not self._backlog or not self.usable:
                    return
                wid = self._free_worker()
                if wid < 0:
                    return
                tid, path = self._backlog.popleft()
                entry = self._pending.get(tid)
                if entry is None:  # its pass was dropped
                    continue
                p, b, lo, hi = entry[:4]
                piece = self._tail_piece(p, hi - lo)
                if piece < hi - lo:  # the rest waits at the head of the backlog
                    self._pending[tid] = (p, b, lo + piece, hi, -1, entry[5])
                    self._backlog.appendleft((tid, path))
                    tid, hi = next(self._ids), lo + piece
                forget = self._assign(tid, p, b, lo, hi, wid)
            msg = task_message(b, lo, hi, path, self.collates(p, b, lo, hi, path))
            if not self._send(wid, tid, msg, forget):
                return

    def _tail_piece(self, p: RowHost, rows: int) -> int:
        """(under the lock) How many of a backlog task's ``rows`` go now: all of them,
        unless ``p``'s plan has run out (no batch will join the backlog): then the
        backlog's last rows go in ever smaller pieces, a share of what is left
        (``TAIL_SHARE`` of it per live worker), so the workers finish together.
        Whole to the end, the last tasks (about 50 ms each) leave one worker idle
        while the other runs them."""
        if not p.exhausted:
            return rows
        left = rows + sum(e[3] - e[2] for e in (self._pending.get(t) for t, _ in self._backlog)
                          if e is not None)
        live = max(1, self.num_workers - len(self._dead))
        return max(1, min(rows, math.ceil(left * TAIL_SHARE / live)))

    def give_back(self, p: RowHost | None) -> int:
        """Tasks still in the backlog (no worker has them) go to their passes' threads,
        in backlog order (``rows_to_threads``): those of the pass ``p``, which left
        the stage for another execution (it need not wait for the workers to run
        them first; the tasks workers hold finish there), or, with ``p`` None (the
        stage broke), every pass's.  Returns the rows given back.  Any thread."""
        with self._lock:
            mine = [tid for tid, _ in self._backlog
                    if (e := self._pending.get(tid)) is not None and (p is None or e[0] is p)]
            waiting = [self._pending.pop(tid) for tid in mine]
            # as drop_pipeline: the backlog keeps the tasks still pending (entries of
            # dropped passes go too)
            self._backlog = collections.deque(t for t in self._backlog
                                              if t[0] in self._pending)
        for e in waiting:
            rows_to_threads(e[0], e[1], [(e[2], e[3])])
        return sum(e[3] - e[2] for e in waiting)

    # -------------------------------------------------------------- collecting
    def _collect(self) -> None:
        """The results thread: apply each task's results; notice dead workers (at
        least every 0.1 s, busy or not).  It runs while a pass uses the stage or a
        worker still holds a task (of a pass that ended, too: the worker's count of
        tasks must come back); then it ends, and the next ``submit`` starts it
        again: a loader between passes keeps its workers, not a thread."""
        # one poll object for the thread's life: multiprocessing.connection.wait builds
        # and registers a selector per call (0.14 ms of this thread's CPU a task)
        live = {conn.fileno(): conn for conn, wid in self._readers.items()
                if wid not in self._dead}
        poller = select.poll()
        for fd in live:
            poller.register(fd, select.POLLIN)
        with self._lock:
            wake = self._wake_fds[0] if self._wake_fds is not None else -1
        if wake >= 0:
            poller.register(wake, select.POLLIN)
        checked = time.monotonic()
        while not self._closed:
            with self._lock:
                if self._idle() or self._closing:
                    if self._collector is threading.current_thread():
                        self._collector = None
                    return
            if time.monotonic() - checked >= 0.1:
                self._check_workers()
                checked = time.monotonic()
            for fd, _ in poller.poll(100):
                if fd == wake:
                    try:
                        os.read(wake, 4096)
                    except OSError:  # drained already
                        pass
                    continue
                conn = live.get(fd)
                if conn is None:
                    continue
                try:
                    msg = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):  # the worker is gone: _check_workers says how
                    poller.unregister(fd)
                    del live[fd]
                    continue
                except Exception as e:  # noqa: BLE001 - a sample that cannot be unpickled
                    self._fail_worker(self._readers[conn], AsyncFeedError(
                        f"the results of worker process {self._readers[conn]} could not be "
                        f"read: {describe(e)}"))
                    continue
                try:
                    self._handle(msg)
                except Exception:  # noqa: BLE001 - a bug of ours must not stop this thread
                    log.exception("asyncfeed: applying a worker's results failed")
                del msg

    def _handle(self, msg: tuple[int, int, Any, tuple[float, float]]) -> None:
        """Apply one task's results (the results thread)."""
        tid, wid, out, (took, cpu) = msg
        if tid == -1:  # worker_init_fn failed: the worker has returned
            self._fail_worker(wid, unwrap(out))
            return
        with self._lock:
            self._held[wid] = max(0, self._held[wid] - 1)  # (0 already: marked dead)
            entry = self._pending.pop(tid, None)
        self._dispatch()  # before this task's results: the worker is not kept waiting
        if entry is None:
            return
        p, b, lo, hi, _, sent = entry
        if hi > lo:
            c = took / (hi - lo)
            self.row_s = c if self.row_s is None else 0.7 * self.row_s + 0.3 * c
        p.workers_cpu_s += cpu  # (only this thread writes it)
        # stage accounting: a task's rows, from sending to results (decode in a worker)
        p.acct.add_wall(DECODE, time.perf_counter() - sent, hi - lo)
        apply_results(p, b, lo, hi, out)

    def _check_workers(self) -> None:
        for wid, w in enumerate(self._workers):
            if self._closed:
                return
            if self._closing:
                return
            if wid not in self._dead and not w.is_alive():
                code = w.exitcode
                why = (f"killed by signal {signal.Signals(-code).name}" if code and code < 0
                       else f"exited with code {code}")
                self._fail_worker(wid, None, why)

    def _fail_worker(self, wid: int, error: BaseException | None, why: str = "") -> None:
        with self._lock:
            self._dead.add(wid)
            self._held[wid] = 0  # it sends nothing more
            held = [(tid, e) for tid, e in self._pending.items() if e[4] == wid]
            for tid, _ in held:
                del self._pending[tid]
            if self.broken is None:
                self.broken = error or WorkerCrashedError(
                    f"worker process {wid} {why}")
        samples = [i for _, e in held for i in e[1].indices[e[2]:e[3]]]
        if error is None:
            pid = self._workers[wid].pid
            error = WorkerCrashedError(
                f"asyncfeed worker process {wid} (pid {pid}) {why} while loading samples "
                f"{samples[:16]}{'...' if len(samples) > 16 else ''}; the loader stopped "
                "using processes for the rest of its life")
        log.warning("%s", error)
        for _, (p, b, lo, hi, *_) in held:
            for row in range(lo, hi):
                p.rows.note_failure(b, row, b.indices[row], error)
            p.rows_done(b, lo, hi)
        self.give_back(None)  # the backlog runs in its passes' threads

    def forget_segment(self, path: str) -> None:
        with self._lock:
            self._forget.append(path)

    # ----------------------------------------------------------------- closing
    def holds(self, p: RowHost) -> bool:
        """Whether rows of the pass ``p`` are still with the workers or in the backlog."""
        with self._lock:
            return any(e[0] is p for e in self._pending.values())

    def drop_pipeline(self, p: RowHost) -> None:
        """The pass ``p`` is over: results still coming for it are dropped (the
        results thread ends once the workers have sent back what they hold)."""
        with self._lock:
            self._passes.discard(p)
            for tid in [t for t, e in self._pending.items() if e[0] is p]:
                del self._pending[tid]  # a backlog entry without one is skipped
            self._backlog = collections.deque(t for t in self._backlog
                                              if t[0] in self._pending)
            if self._idle():
                self._wake_collector()

    def close(self) -> None:
        """Stop the workers and the results thread; unlink shared memory.  Idempotent;
        does nothing in another process (a forked child holding a copy).

        Every worker is told to stop (between two rows: the rows of dropped tasks
        are not run) and its task pipe closed; their results are drained (a worker
        cannot exit while its last results wait in a full pipe) until they exit,
        ``CLOSE_GRACE_S`` at most for all of them together; one still running then
        (a stuck or slow sample) is terminated, then killed, as DataLoader does at
        its shutdown.  So closing, and the interpreter's exit, wait well under a
        second for the workers, whatever their samples do."""
        if os.getpid() != self.owner_pid:
            return
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._pending.clear()
            self._backlog.clear()
            self._passes = weakref.WeakSet()
            self._wake_collector()
        for wid, conn in enumerate(self._tasks):
            with self._send_locks[wid]:
                try:
                    conn.send_bytes(pickle.dumps(None))
                except (ValueError, OSError):  # the worker is gone already
                    pass
                conn.close()
        self._closed = True
        collector = self._collector
        if collector is not None and collector is not threading.current_thread():
            collector.join()  # woken, it ends at once: from here on, this thread reads
        with self._lock:
            fds, self._wake_fds = self._wake_fds, None
        for fd in fds or ():
            os.close(fd)
        self._drain_until_exited(time.monotonic() + CLOSE_GRACE_S)
        for w in self._workers:
            if w.is_alive():
                w.terminate()
        deadline = time.monotonic() + CLOSE_GRACE_S
        for w in self._workers:
            w.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in self._workers:
            if w.is_alive():  # a worker ignoring SIGTERM
                w.kill()
                w.join(timeout=2)
        for conn in self._readers:
            conn.close()
        for w in self._workers:
            try:
                w.close()  # its sentinel's descriptor
            except ValueError:  # pragma: no cover - still running after SIGKILL
                pass
        self.buffers.close()
        unregister(self)

    def _drain_until_exited(self, deadline: float) -> None:
        """(closing, the results thread gone) Read and drop the workers' results
        until every worker has exited or ``deadline`` (monotonic) has passed."""
        readers = {conn: wid for conn, wid in self._readers.items() if not conn.closed}
        while True:
            running = [w for w in self._workers if w.is_alive()]
            left = deadline - time.monotonic()
            if not running or left <= 0:
                return
            ready = mp_connection.wait(list(readers) + [w.sentinel for w in running],
                                       timeout=min(left, 0.05))
            for obj in ready:
                if isinstance(obj, mp_connection.Connection):
                    try:
                        obj.recv_bytes()
                    except Exception:  # noqa: BLE001 - EOF: that worker is gone
                        del readers[obj]
