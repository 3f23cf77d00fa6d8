"""The fetch stage of a map-style pass: a dataset's ``async fetch(index)`` on the
event loop, ``io_concurrency`` fetches at once.

Each fetched sample's bytes go to a decode-pool task (``rowtasks.run_sample``)
that decodes it and places it in its row.  With read-ahead (``readahead.py``)
the reads were started as the plan was drawn, and are delivered here instead
of fetched.  A failed fetch is that sample's failure, reported at its batch.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from .._errors import LoaderClosedError
from . import rowtasks
from .accounting import FETCH
from .batch import Batch
from .readahead import ReadAhead
from .samples import RowHost

__all__ = ["FetchStage"]


class FetchStage:
    """Fetches the rows of a pass's batches on the event loop (see the module
    docstring).  ``fetch`` is the dataset's ``async fetch``; ``readahead`` the
    pass's read-ahead, if any (it then reads instead).

    The pass (``host``) is passed to each call, not kept: the pass holds its fetch
    stage, and a stage holding its pass would keep both alive until a garbage
    collection once the consumer dropped the pass."""

    def __init__(self, fetch: Any, io_concurrency: int, readahead: ReadAhead | None) -> None:
        self.fetch = fetch
        self.io_concurrency = io_concurrency
        self.readahead = readahead
        self._queue: asyncio.Queue | None = None
        self._workers: list[asyncio.Task] = []

    def submit(self, host: RowHost, b: Batch) -> bool:
        """Have every row of ``b`` fetched and decoded (consumer thread).  False when
        the event loop is closed (nothing started)."""
        return host.runtime.call_in_loop(self._enqueue, host, b)

    def _enqueue(self, host: RowHost, b: Batch) -> None:
        """(loop thread) Queue ``b``'s rows for the fetch workers, started at the
        first batch; with read-ahead, have its reads delivered instead."""
        if host.stopping or host.runtime.closed:
            return  # the pass is over: start no new fetch workers
        if self.readahead is not None:
            self.readahead.deliver(b, functools.partial(self.raw_ready, host),
                                   functools.partial(self.failed, host))
            return
        if self._queue is None:
            self._queue = asyncio.Queue()
            n = max(1, self.io_concurrency)
            self._workers = [asyncio.ensure_future(self._worker(host)) for _ in range(n)]
        q = self._queue
        for row, idx in enumerate(b.indices):
            q.put_nowait((b, row, idx))

    async def _worker(self, host: RowHost) -> None:
        """Fetch queued samples until the pass ends (the loop cancels the worker).

        Cancellation ends the worker by returning, not raising: a task that ends
        with an exception keeps it, and the exception's traceback holds this
        pass (and its batches) in a reference cycle until a garbage collection.
        """
        q = self._queue
        assert q is not None
        try:
            while True:
                item = await q.get()
                await self._fetch_one(host, *item)
                del item  # an idle worker must not keep its last batch alive
        except asyncio.CancelledError:
            return

    async def _fetch_one(self, host: RowHost, b: Batch, row: int, idx: Any) -> None:
        if host.stopping:
            return
        t0 = time.perf_counter()
        try:
            raw = await self.fetch(idx)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - travels to the consumer
            host.rows.note_failure(b, row, idx, e)
        else:
            host.acct.add_wall(FETCH, time.perf_counter() - t0)
            self.raw_ready(host, b, row, idx, raw)
            return
        host.rows_done(b, row, row + 1)  # outside the handler: its traceback holds b

    def raw_ready(self, host: RowHost, b: Batch, row: int, idx: Any, raw: Any) -> None:
        """Decode a fetched sample in the pool (loop thread)."""
        if host.stopping:
            return
        if host.runtime.submit(rowtasks.run_sample, host, b, row, idx, raw) is None:
            b.error = b.error or LoaderClosedError("the loader was closed")
            host.rows_done(b, row, row + 1)

    def failed(self, host: RowHost, b: Batch, row: int, idx: Any, e: BaseException) -> None:
        """A read-ahead read of sample ``row`` of ``b`` raised ``e`` (loop thread)."""
        if host.stopping:
            return
        host.rows.note_failure(b, row, idx, e)
        host.rows_done(b, row, row + 1)
