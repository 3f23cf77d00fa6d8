"""A pool of named, non-daemon threads whose owner can stop waiting for a stuck one.

``concurrent.futures.ThreadPoolExecutor`` cannot give up on a thread: its
``shutdown(wait=True)`` joins every worker, and so does the hook it registers
for interpreter exit, so one call that never returns (a read from a hung
network mount, a user's ``__getitem__`` stuck on a lock) keeps the process
alive forever.  :class:`WorkerPool` runs submitted calls the same way, but
:meth:`WorkerPool.join` waits only until a deadline; a thread still busy then is
*abandoned* (:func:`abandon`): renamed ``asyncfeed-abandoned-*`` and taken off
the list of threads the interpreter joins at exit.  It finishes the call it is
in (Python cannot interrupt it) and then exits on its own; if the process ends
first, it ends with the process, as a daemon thread would.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ABANDONED_PREFIX", "WorkerPool", "abandon", "join_until"]

ABANDONED_PREFIX = "asyncfeed-abandoned-"

_STOP = None  # the queue item that tells one worker to exit


def abandon(thread: threading.Thread) -> bool:
    """Stop owning ``thread``: the interpreter will not wait for it at exit.

    Renames it ``asyncfeed-abandoned-<rest of its name>`` (so leak checks still
    see it until it ends).  Returns whether the interpreter's exit no longer
    waits for it: CPython 3.10-3.12 join non-daemon threads through
    ``threading._shutdown_locks``, from which its lock is removed; where that
    list does not exist (other versions), exit still waits for the thread.
    """
    if not thread.name.startswith(ABANDONED_PREFIX):
        thread.name = ABANDONED_PREFIX + thread.name.removeprefix("asyncfeed-")
    locks = getattr(threading, "_shutdown_locks", None)
    guard = getattr(threading, "_shutdown_locks_lock", None)
    lock = getattr(thread, "_tstate_lock", None)
    if locks is None or guard is None or lock is None:
        return not thread.is_alive()
    with guard:
        locks.discard(lock)
    return True


def join_until(threads: list[threading.Thread], deadline: float) -> list[threading.Thread]:
    """Join ``threads`` until ``deadline`` (``time.monotonic()``); the ones still alive.

    Threads already abandoned are not waited for again (their owner gave up on them).
    """
    me = threading.current_thread()
    left = []
    for t in threads:
        if t is me:
            continue
        if t.name.startswith(ABANDONED_PREFIX):
            if t.is_alive():
                left.append(t)
            continue
        t.join(None if deadline == float("inf") else max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            left.append(t)
    return left


class WorkerPool(cf.Executor):
    """``n`` threads named ``<prefix>_<i>`` running submitted calls in submission order.

    All threads start in the constructor (starting them later, while the first
    ones already work, costs each start a wait for the GIL), unless ``lazy``: then
    a thread starts when a call is submitted and none is idle.  ``initializer``
    runs first in each thread.  ``shutdown()`` cancels the calls not yet
    started; calls already running finish (they cannot be interrupted).  It is
    a ``concurrent.futures.Executor``, so an event loop can use it as its
    default executor.
    """

    def __init__(self, n: int, prefix: str,
                 initializer: Callable[[], None] | None = None, lazy: bool = False) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._initializer = initializer
        self._n, self._prefix, self._lazy = n, prefix, lazy
        self._idle = threading.Semaphore(0)
        self._started = threading.Semaphore(0)
        self.threads: list[threading.Thread] = []
        if not lazy:
            for _ in range(n):
                self._start_one()
            for _ in range(n):
                self._started.acquire()

    def _start_one(self) -> None:
        t = threading.Thread(target=self._work, name=f"{self._prefix}_{len(self.threads)}",
                             daemon=False)
        self.threads.append(t)
        t.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future:
        """Run ``fn(*args, **kwargs)`` in a pool thread.  RuntimeError once shut down."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.put((fut, fn, args, kwargs))
            if self._lazy and not self._idle.acquire(timeout=0) and len(self.threads) < self._n:
                self._start_one()
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = True) -> None:
        """Cancel the calls not started and let every thread exit once idle.  Idempotent.

        ``wait`` joins the threads (without a time limit: use :meth:`join` for one).
        ``cancel_futures=False`` lets the queued calls run first.
        """
        with self._lock:
            first = not self._closed
            self._closed = True
            if first:
                if cancel_futures:
                    self._cancel_queued()
                for _ in self.threads:
                    self._queue.put(_STOP)
        if wait:
            join_until(list(self.threads), float("inf"))

    def _cancel_queued(self) -> None:
        kept = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                kept += 1
                continue
            item[0].cancel()
        for _ in range(kept):
            self._queue.put(_STOP)

    def join(self, deadline: float) -> list[threading.Thread]:
        """Join the threads until ``deadline`` (monotonic); abandon and return the rest."""
        with self._lock:
            threads = list(self.threads)
        left = join_until(threads, deadline)
        for t in left:
            abandon(t)
        return left

    @property
    def closed(self) -> bool:
        return self._closed

    def _work(self) -> None:
        try:
            if self._initializer is not None:
                self._initializer()
        finally:
            self._started.release()
        get = self._queue.get
        idle = self._idle.release if self._lazy else None
        while True:
            item = get()
            if item is _STOP:
                return
            fut, fn, args, kwargs = item
            del item
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - handed to the future
                    fut.set_exception(e)
                    del e
                else:
                    fut.set_result(result)
                    del result
            # nothing of the call may stay referenced while this thread waits
            del fut, fn, args, kwargs
            if idle is not None:
                idle()
