"""The decode threads: a minimal pool without futures.

``concurrent.futures.ThreadPoolExecutor`` spends about 10 us of Python per task
holding the GIL (a ``Future`` with its own condition variable, a work item,
two semaphore operations).  The pipeline never looks at a task's result (every
task reports to its batch itself), so this pool keeps only what it needs: a
``queue.SimpleQueue`` (a C queue: ``put`` and a blocked ``get`` cost about a
microsecond) of ``(fn, args)`` tuples and ``n`` named threads started up front
(``grow`` starts more: a thread count the chooser measures past the pool's).
With a hundred threads each waiting on I/O, that overhead is what bounds one
process's rate (the "ceiling" bench workload).

``quiet()`` is a context manager that holds back the start of new tasks and
waits until none is running: the process stage forks its workers inside it, so
that no decode thread is in the middle of user code (holding, say, NumPy's
random generator lock, which the child would inherit locked) at the fork.

``shutdown`` matches the executor's: ``cancel_futures`` drops queued tasks,
``wait`` joins the threads (a task already running is finished first).

``admit(gate)`` (or ``gate=`` at construction) makes a thread pass ``gate`` (an
object with ``enter``, ``leave`` and ``open``, see ``tasksize.Gate``) before it
takes a task; a thread keeps its place from task to task and leaves when the
gate says it is over its limit (``over``).  Threads beyond the limit wait
there, holding no task (a thread already waiting for a task when ``admit`` is
called puts the task it gets back, at the end of the queue, and goes to the
gate).  The threads start up front but take no task before the first
``submit``: by then a pass has installed its gate and set its first limit, so
its first tasks run in order, as many at once as that limit says.  (Waiting in
the queue from the start, they took the first tasks before the gate and put
them back: a fresh pass's sizing rows, meant to run one a task and alone, ran
as a 1-row and a 2-row task, and batch 0's first rows last.)
With the gate inside the task instead, every thread would take a task and park
with it, and the tasks would go round the threads, one thread hand-off (and
GIL hand-off) per task even with one thread allowed to run.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

log = logging.getLogger("asyncfeed")

_STOP = None


def _call(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Run a task; what it raises is logged (tasks report their own errors)."""
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 - tasks report their own errors
        log.exception("a decode task raised")


class Admission(Protocol):
    """What ``TaskPool.admit`` takes (``tasksize.Gate``)."""

    def enter(self) -> None: ...

    def leave(self) -> None: ...

    def over(self) -> bool: ...

    def open(self) -> None: ...


class TaskPool:
    """``n`` threads named ``{prefix}_{i}`` (non-daemon) running submitted calls."""

    def __init__(self, n: int, thread_name_prefix: str,
                 initializer: Callable[[], None] | None = None,
                 gate: Admission | None = None) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._shutdown = False
        self._initializer = initializer
        self._gate: Admission | None = gate
        # quiet(): each thread flags its running task (written by that thread only,
        # set before it reads _paused: with the GIL, no task starts unseen)
        self._busy: list[bool] = []
        self._paused = False
        self._resume = threading.Event()
        self._resume.set()
        self._quiet_lock = threading.Lock()
        self._released = False          # set by the first submit (or shutdown) ...
        self._go = threading.Event()    # ... which lets the threads take tasks
        self._prefix = thread_name_prefix
        self._threads: list[threading.Thread] = []
        self.grow(n)

    def grow(self, n: int) -> None:
        """Start threads until the pool has ``n`` (none once shut down).  Each new
        thread takes tasks as the first did (through the gate, once released)."""
        with self._lock:
            if self._shutdown:
                return
            for i in range(len(self._threads), n):
                self._busy.append(False)
                t = threading.Thread(target=self._work, args=(i,),
                                     name=f"{self._prefix}_{i}", daemon=False)
                self._threads.append(t)
                t.start()

    @property
    def size(self) -> int:
        """The pool's threads."""
        return len(self._threads)

    def _work(self, me: int) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:  # noqa: BLE001 - an optimisation, never a reason to fail
                log.debug("decode thread initializer failed", exc_info=True)
        self._go.wait()
        get = self._q.get
        gate: Admission | None = None  # the gate this thread holds a place in
        try:
            while True:
                if gate is None and self._gate is not None:
                    gate = self._gate
                    gate.enter()
                item = get()
                if item is _STOP:
                    self._q.put(_STOP)  # wake the next thread too
                    return
                if gate is None and self._gate is not None:
                    # admitted while this thread waited for a task: the task goes back
                    # to the queue and this thread to the gate.  Waiting at the gate
                    # with the task could deadlock: the thread inside may be waiting
                    # for this very task.
                    self._q.put(item)
                    del item
                    continue
                fn, args = item
                busy = self._busy
                busy[me] = True
                while self._paused:  # quiet(): wait, holding the task, until it ends
                    busy[me] = False
                    self._resume.wait()
                    busy[me] = True
                _call(fn, args)
                busy[me] = False
                del item, fn, args
                # keep the place for the next task unless the limit went down: leaving
                # and entering again would wake a parked thread (which then finds
                # the place taken) after every task
                if gate is not None and gate.over():
                    gate.leave()
                    gate = None
        finally:
            if gate is not None:
                gate.leave()

    def running(self) -> int:
        """How many tasks the pool's threads run now (read without a lock: a task that
        starts or ends meanwhile may or may not be counted)."""
        return sum(self._busy)

    def run_one(self) -> bool:
        """Run one queued task in the calling thread; False if none was queued.  For
        the consumer, which loads rows itself while it waits when they are too
        cheap for a thread (the ``inline`` execution); what the task raises is logged
        as in the pool's threads."""
        if self._shutdown:
            return False
        try:
            item = self._q.get_nowait()
        except queue.Empty:
            return False
        if item is _STOP:
            self._q.put(_STOP)
            return False
        _call(*item)
        return True

    def take_queued(self, mine: Callable[[Callable[..., Any], tuple[Any, ...]], bool]
                    ) -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
        """Take back the queued tasks ``mine(fn, args)`` accepts, in queue order; they
        will not run.  Every other task (and a shutdown's stop) is queued again, after
        any a thread submits meanwhile.  A task a thread has already taken is not
        here: it runs.  Any thread."""
        taken: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        others: list[Any] = []
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP and mine(*item):
                taken.append(item)
            else:
                others.append(item)
        for item in others:
            self._q.put(item)
        return taken

    @contextlib.contextmanager
    def quiet(self, timeout: float = 5.0) -> Iterator[bool]:
        """Hold back new tasks and wait (at most ``timeout`` seconds) until no task
        runs; yields whether that was reached.  Tasks start again on exit (also
        when the body raises).  For the consumer thread; never call it from a task
        (it would wait for itself)."""
        with self._quiet_lock:
            self._resume.clear()
            self._paused = True
            try:
                deadline = time.monotonic() + timeout
                while any(self._busy) and time.monotonic() < deadline:
                    time.sleep(0.0005)
                yield not any(self._busy)
            finally:
                self._paused = False
                self._resume.set()

    def admit(self, gate: Admission | None) -> None:
        """From now on, a thread takes a task only inside ``gate`` (None: freely).
        ``shutdown`` opens the gate, so no thread stays parked in it."""
        self._gate = gate
        if gate is not None and self._shutdown:
            gate.open()

    @property
    def threads(self) -> list[threading.Thread]:
        """The pool's threads (for an owner that joins them with a deadline)."""
        return list(self._threads)

    def submit(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Queue ``fn(*args)``; raises RuntimeError after ``shutdown`` (as the executor)."""
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        self._q.put((fn, args))
        if not self._released:
            self._release()
        return True

    def _release(self) -> None:
        self._released = True
        self._go.set()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        with self._lock:
            first = not self._shutdown
            self._shutdown = True
        gate = self._gate
        if gate is not None:
            gate.open()  # threads parked there go on to take _STOP
        if first:
            if cancel_futures:
                while True:
                    try:
                        self._q.get_nowait()
                    except queue.Empty:
                        break
            self._q.put(_STOP)
        self._release()  # threads that never had a task go on to take _STOP too
        if wait:
            me = threading.current_thread()
            for t in self._threads:
                if t is not me:
                    t.join()
