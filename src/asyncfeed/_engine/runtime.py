"""The threads of one pass over the data: an event loop thread and a decode pool.

A :class:`Runtime` owns them.  ``close()`` is idempotent, may be called from any
thread (including a finalizer or one of its own threads), tells the pass to stop
(``on_close`` callbacks), cancels work not yet started, and with ``wait=True``
joins every thread it started, for at most ``grace`` seconds: a thread still
busy then (stuck in a call that does not return) is abandoned (see
:mod:`.workers`) rather than waited for forever.  Threads are named
``asyncfeed-*`` and are not daemons; runtimes still open when the interpreter
exits are closed, with a grace of :data:`EXIT_GRACE_S`, before the interpreter
joins non-daemon threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from .intraop import one_intraop_thread
from .taskpool import TaskPool
from .workers import WorkerPool, abandon, join_until
from .exithooks import OpenSet


#: How long ``close()`` waits for a thread still in a call before abandoning it.
CLOSE_GRACE_S = 1.0
#: The same at interpreter exit: the process exits this long after its last statement
#: at most, whatever a stuck sample is doing.
EXIT_GRACE_S = 0.5


def _close_all_at_exit(runtimes: list[Runtime]) -> None:
    for rt in runtimes:  # stop them all first, so their grace periods overlap
        rt.close(wait=False, reason="the interpreter is exiting")
    deadline = time.monotonic() + EXIT_GRACE_S
    for rt in runtimes:
        rt.close(wait=True, grace=max(0.0, deadline - time.monotonic()))


_open: OpenSet[Runtime] = OpenSet(_close_all_at_exit)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where installed, else asyncio's.  uvloop is imported here, on the
    first pass that needs a loop, not by ``import asyncfeed``."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _io_executor(loop: asyncio.AbstractEventLoop, n: int) -> cf.Executor:
    """The loop's default executor (``run_in_executor(None, ...)``: local reads): a
    :class:`WorkerPool` where the loop takes one (uvloop), else a ThreadPoolExecutor
    (asyncio's loop insists on one; its threads cannot be abandoned)."""
    pool: cf.Executor = WorkerPool(n, "asyncfeed-io-file", lazy=True)
    try:
        loop.set_default_executor(pool)
    except TypeError:
        pool.shutdown(wait=True)
        pool = cf.ThreadPoolExecutor(n, thread_name_prefix="asyncfeed-io-file")
        loop.set_default_executor(pool)
    return pool


class Runtime:
    """A decode thread pool and, when asked, an event loop running in its own thread."""

    def __init__(self, num_threads: int, with_loop: bool, io_threads: int = 8,
                 on_loop_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._on_close: list[weakref.WeakMethod | Callable[[str], None]] = []
        # every decode thread starts now, while nothing else wants the GIL (started
        # while others decode, each start waits for the GIL: 10-20 ms to first batch)
        self.pool = TaskPool(num_threads, "asyncfeed-decode", initializer=one_intraop_thread)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._io_pool: cf.Executor | None = None
        self._on_loop_close = on_loop_close
        # whatever runs on the loop (the pipeline) stays alive until the loop has
        # drained: asyncio holds pending tasks only weakly
        self.keepalive: object = None
        if with_loop:
            self.loop = new_event_loop()
            # run_in_executor(None, ...) uses the loop's default executor: make it ours.
            self._io_pool = _io_executor(self.loop, io_threads)
            started = threading.Event()
            self._loop_thread = threading.Thread(
                target=self._run_loop, args=(started,), name="asyncfeed-io", daemon=False)
            self._loop_thread.start()
            started.wait()
        _open.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_threads(self) -> int:
        """The decode pool's threads (more once it grew)."""
        return self.pool.size

    def grow(self, n: int) -> None:
        """The decode pool grows to ``n`` threads (a thread count the chooser measures
        past the pool's; consumer thread).  Its threads are joined with the rest."""
        self.pool.grow(n)

    def _run_loop(self, started: threading.Event) -> None:
        loop = self.loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        loop.call_soon(started.set)
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(self._drain(loop))
            finally:
                loop.close()
                self.keepalive = None
                if self._io_pool is not None:  # its idle threads exit on their own
                    self._io_pool.shutdown(wait=False, cancel_futures=True)

    async def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        for _ in range(10):  # callbacks queued before stop() may start new tasks
            tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
            if not tasks:
                break
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._on_loop_close is not None:
            try:
                await asyncio.wait_for(self._on_loop_close(), 5.0)
            except Exception:  # closing sessions must not keep the loop alive
                pass
        await loop.shutdown_asyncgens()

    def submit(self, fn: Callable[..., Any], *args: Any) -> bool | None:
        """Run ``fn(*args)`` on the decode pool (its result and exceptions are not
        kept: tasks report to their batch themselves); None once the runtime is closing."""
        try:
            return self.pool.submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            return None

    def call_in_loop(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Schedule ``fn(*args)`` on the event loop thread; False once closing."""
        if self.loop is None:
            raise RuntimeError("this runtime has no event loop")
        try:
            self.loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # loop closed
            return False

    def on_close(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` first thing in ``close()`` (a bound method is held
        weakly): the pass stops starting samples before the pools are shut down."""
        ref: weakref.WeakMethod | Callable[[str], None]
        ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else callback
        self._on_close.append(ref)

    def close(self, wait: bool = True, grace: float | None = None,
              reason: str = "the loader was closed") -> None:
        """Stop everything: pending decode work is cancelled, the loop's tasks too.

        Idempotent.  With ``wait``, returns once every thread has exited or
        ``grace`` seconds (default :data:`CLOSE_GRACE_S`) have passed, whichever
        comes first; a thread still running then (a call that does not return:
        Python cannot interrupt it) is abandoned: renamed
        ``asyncfeed-abandoned-*``, it exits when its call returns, and the
        interpreter does not wait for it at exit.  ``reason`` goes to the
        ``on_close`` callbacks.
        """
        with self._lock:
            first = not self._closed
            self._closed = True
            callbacks, self._on_close = self._on_close, []
        if first:
            for ref in callbacks:
                fn = ref() if isinstance(ref, weakref.WeakMethod) else ref
                if fn is not None:
                    fn(reason)
            self.pool.shutdown(wait=False, cancel_futures=True)
            if self.loop is not None:
                try:
                    self.loop.call_soon_threadsafe(self.loop.stop)
                except RuntimeError:
                    pass
        if not wait:
            return
        deadline = time.monotonic() + (CLOSE_GRACE_S if grace is None else grace)
        if self._loop_thread is not None and join_until([self._loop_thread], deadline):
            abandon(self._loop_thread)
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=False, cancel_futures=True)
            if isinstance(self._io_pool, WorkerPool):
                self._io_pool.join(deadline)
        for t in join_until(self.pool.threads, deadline):
            abandon(t)
        _open.discard(self)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
