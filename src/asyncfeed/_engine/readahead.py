"""Raw reads that run ahead of decoding, bounded by the bytes they hold.

The pipeline's decode window (``prefetch`` batches) holds decoded batches, which
are large; what a read returns (compressed bytes) is small.  :class:`ReadAhead`
draws the index plan further than the decode window and starts the reads of
those samples on the event loop, ``io_concurrency`` at a time and in plan order,
so that by the time a batch enters the decode window its raw bytes are usually
there: a slow or retried read delays only its own batch, while the batches
behind it were read long before.

It stands in for the plan (``next()`` gives the pipeline its next planned item,
exactly as the plan would), so which sample goes into which batch, in-order
delivery and resume are the plan's as before: the reads of items drawn ahead are
simply redone by a resumed pass.  The pipeline asks for each submitted batch's
raw bytes with :meth:`ReadAhead.deliver` (on the loop); each sample's bytes are
handed over exactly once, then forgotten.

Budget: the bytes held by finished reads not yet handed to decoding, plus the
reads in flight or queued at the running mean size, stay under ``budget`` when
drawing another item (one item may overshoot it).  ``budget=None`` sizes it from
the measured rate: ``tail_s`` seconds of bytes handed to decoding, between
``floor`` and ``cap``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .._io.backoff import PLACE

__all__ = ["ReadAhead", "ReadAheadStats"]

DEFAULT_CAP = 256 << 20
DEFAULT_FLOOR = 16 << 20
DEFAULT_TAIL_S = 3.0
_GUESS = 256 << 10  # assumed size of a read before any has finished


@dataclass
class ReadAheadStats:
    """What the read-ahead did in a pass: ``reads`` started, ``peak_bytes`` the most
    held by finished reads not yet decoded, ``budget`` the byte budget last used,
    ``samples_ahead`` the most samples drawn from the plan beyond the decode window."""

    reads: int = 0
    peak_bytes: int = 0
    budget: int = 0
    samples_ahead: int = 0


class _Read:
    __slots__ = ("idx", "raw", "error", "done", "waiter")

    def __init__(self, idx: Any) -> None:
        self.idx = idx
        self.raw: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.waiter: Any = None   # (batch, on_raw, on_error) once the batch was submitted


class ReadAhead:
    """The plan, drawn ahead, with the reads of what was drawn running on the loop.

    ``fetch(idx)`` is the dataset's ``async fetch``; ``call_in_loop(fn, *args)``
    schedules on the event loop (False once it is closing).  ``next()`` runs in
    the consumer thread; ``deliver`` and the reads on the loop.  Nothing here
    outlives the loop: the read tasks are cancelled with the loop's other tasks
    when the pass ends, and a cancelled read hands nothing over.
    """

    def __init__(self, plan: Iterator[Any], *, auto_collation: bool,
                 fetch: Callable[[Any], Awaitable[Any]],
                 call_in_loop: Callable[..., bool], io_concurrency: int,
                 budget: int | None = None, cap: int = DEFAULT_CAP,
                 floor: int = DEFAULT_FLOOR, tail_s: float = DEFAULT_TAIL_S,
                 min_items: int = 1) -> None:
        self._plan = plan
        self._auto = auto_collation
        self._fetch = fetch
        self._call_in_loop = call_in_loop
        self._io_concurrency = max(1, io_concurrency)
        self._fixed = budget
        self._cap, self._floor, self._tail_s = cap, min(floor, cap), tail_s
        self._min_items = min_items
        # stage accounting: called with each successful read's seconds (loop thread)
        self.on_read: Callable[[float], None] | None = None
        # consumer thread
        self._drawn: list[Any] = []      # items drawn ahead, not yet given to the pipeline
        self._head = 0                   # index in _drawn of the next item to give
        self._k = 0                      # number of items drawn so far (= next item's k)
        self._exhausted = False
        self._closed = False
        # shared (lock): accounting
        self._lock = threading.Lock()
        self._held = 0                   # bytes of finished reads not yet handed over
        self._pending = 0                # reads drawn but not finished
        self._undelivered = 0            # samples drawn but not handed over
        self._sizes = 0                  # bytes of finished reads (for the mean)
        self._finished = 0
        self._handed_bytes = 0
        self._left: dict[int, int] = {}  # reads of item k not finished (see reading)
        self._t0: float | None = None
        self.stats = ReadAheadStats()
        # loop thread
        self._reads: dict[tuple[int, int], _Read] = {}
        self._queue: asyncio.Queue | None = None
        self._workers: set[asyncio.Task] = set()
        self._places: asyncio.Semaphore | None = None  # reads sending (io_concurrency)
        self._parked = 0   # reads waiting out a retry's backoff (see _Place)

    # -------------------------------------------------------------- consumer
    def __iter__(self) -> "ReadAhead":
        return self

    def __next__(self) -> Any:
        """The next planned item (StopIteration at the plan's end); draws further ahead."""
        if self._head >= len(self._drawn) and not self._draw():
            raise StopIteration
        item = self._drawn[self._head]
        self._drawn[self._head] = None
        self._head += 1
        if self._head > 64 and self._head * 2 > len(self._drawn):
            del self._drawn[:self._head]
            self._head = 0
        self.fill()
        return item

    def budget(self) -> int:
        """The byte budget now (fixed, or from the rate bytes are decoded at)."""
        if self._fixed is not None:
            return self._fixed
        t0 = self._t0
        if t0 is None:
            return self._floor
        elapsed = max(0.5, time.monotonic() - t0)
        return int(min(self._cap, max(self._floor, self._handed_bytes / elapsed * self._tail_s)))

    def fill(self) -> None:
        """Draw items while the bytes they will hold fit the budget (consumer thread)."""
        budget = self.budget()
        self.stats.budget = budget
        while not self._exhausted and not self._closed:
            ahead = len(self._drawn) - self._head
            if ahead >= self._min_items:
                with self._lock:
                    mean = self._sizes / self._finished if self._finished else _GUESS
                    want = self._held + self._pending * mean
                if want >= budget:
                    return
            if not self._draw():
                return

    def _draw(self) -> bool:
        """Draw one item from the plan and start its reads; False at the plan's end."""
        try:
            item = next(self._plan)
        except StopIteration:
            self._exhausted = True
            return False
        indices = list(item) if self._auto else [item]
        k = self._k
        self._k += 1
        self._drawn.append(item)
        if indices:
            with self._lock:
                self._pending += len(indices)
                self._undelivered += len(indices)
                self._left[k] = len(indices)
                ahead = self._undelivered
            if ahead > self.stats.samples_ahead:
                self.stats.samples_ahead = ahead
            if not self._call_in_loop(self._start, k, indices):
                self._closed = True
        return True

    def reading(self, k: int) -> bool:
        """Whether a read of planned item ``k`` has not finished yet (any thread)."""
        with self._lock:
            return k in self._left

    def close(self) -> None:
        """Draw no more (any thread); reads already started end with the loop."""
        self._closed = True

    # ------------------------------------------------------------- event loop
    def _start(self, k: int, indices: list[Any]) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._places = asyncio.Semaphore(self._io_concurrency)
            for _ in range(self._io_concurrency):
                self._add_worker()
        for row, idx in enumerate(indices):
            self._reads[(k, row)] = _Read(idx)
            self._queue.put_nowait((k, row))
        self.stats.reads += len(indices)

    def _add_worker(self) -> None:
        task = asyncio.ensure_future(self._worker())
        self._workers.add(task)
        task.add_done_callback(self._workers.discard)

    async def _worker(self) -> None:
        """Run queued reads in plan order until the loop cancels this task, or until
        there are more workers than places and parked reads (one added for a read
        that parked, see :class:`_Place`, ends after the read it took)."""
        q, places = self._queue, self._places
        assert q is not None and places is not None
        place = _Place(self, places)
        PLACE.set(place)  # this task's context: the source's backoff finds it
        try:
            while True:
                if len(self._workers) > self._io_concurrency + self._parked:
                    self._workers.discard(asyncio.current_task())
                    return
                key = await q.get()
                r = self._reads.get(key)
                if r is None:
                    continue
                await place.take()
                t0 = time.perf_counter()
                try:
                    raw = await self._fetch(r.idx)
                except asyncio.CancelledError:
                    raise
                except BaseException as e:  # noqa: BLE001 - handed to the batch
                    r.error = e
                    size = 0
                else:
                    if self.on_read is not None:
                        self.on_read(time.perf_counter() - t0)
                    r.raw = raw
                    size = _size(raw)
                r.done = True
                with self._lock:
                    left = self._left.pop(key[0], 1) - 1
                    if left:
                        self._left[key[0]] = left
                    self._pending -= 1
                    self._finished += 1
                    self._sizes += size
                    if r.waiter is None:
                        self._held += size
                        if self._held > self.stats.peak_bytes:
                            self.stats.peak_bytes = self._held
                place.give_back()
                if r.waiter is not None:
                    self._hand(key, r, size)
                del r, key  # an idle worker must not keep the last raw bytes alive
        except asyncio.CancelledError:
            return
        finally:
            place.give_back()

    def deliver(self, b: Any, on_raw: Callable[[Any, int, Any, Any], None],
                on_error: Callable[[Any, int, Any, BaseException], None]) -> None:
        """Hand the raw bytes of every row of batch ``b`` (item ``b.k``) to
        ``on_raw(b, row, idx, raw)``, or the read's exception to ``on_error(b, row,
        idx, e)``: now for reads that finished, later for the others (loop thread)."""
        for row in range(b.n):
            key = (b.k, row)
            r = self._reads.get(key)
            if r is None:  # drawn before the loop ran _start: cannot happen in order
                raise RuntimeError(f"no read-ahead entry for batch {b.k} row {row}")
            r.waiter = (b, on_raw, on_error)
            if r.done:
                size = _size(r.raw) if r.error is None else 0
                with self._lock:
                    self._held -= size
                self._hand(key, r, size)

    def _hand(self, key: tuple[int, int], r: _Read, size: int) -> None:
        del self._reads[key]
        b, on_raw, on_error = r.waiter
        raw, error = r.raw, r.error
        r.raw = r.error = r.waiter = None
        with self._lock:
            self._undelivered -= 1
            self._handed_bytes += size
            if self._t0 is None:
                self._t0 = time.monotonic()
        if error is not None:
            on_error(b, key[1], r.idx, error)
        else:
            on_raw(b, key[1], r.idx, raw)


class _Place:
    """A worker's place among the ``io_concurrency`` reads sending (the semaphore).

    A read that waits out a retry's backoff (``asyncfeed._io.backoff``) sends
    nothing: it leaves its place, and a worker is added so that the next queued
    read starts meanwhile; before its retry it waits for a place again, so no more
    than ``io_concurrency`` reads send at once.  A place held through the
    backoff would sit idle for many times a read's latency (a 503 answers in one
    latency, its backoff lasts 0.1 s or more), and with a share of reads refused
    the reads in flight would fall well below ``io_concurrency``.
    """

    __slots__ = ("ra", "places", "held", "parked")

    def __init__(self, ra: ReadAhead, places: asyncio.Semaphore) -> None:
        self.ra, self.places = ra, places
        self.held = self.parked = False

    async def take(self) -> None:
        await self.places.acquire()
        self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.places.release()

    def leave(self) -> None:
        if not self.held:
            return
        self.give_back()
        self.parked = True
        self.ra._parked += 1
        self.ra._add_worker()

    async def back(self) -> None:
        if not self.parked:
            return
        self.parked = False
        self.ra._parked -= 1
        await self.take()


def _size(raw: Any) -> int:
    try:
        return len(raw)
    except TypeError:
        return 0
