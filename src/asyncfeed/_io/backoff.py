"""A read waiting out a retry's backoff has no request in flight: it gives its place back.

Whoever bounds the reads in flight (the loader's read-ahead: ``io_concurrency``
reads at a time) sets :data:`PLACE` in the task that runs a read to an object
with ``leave()`` and ``async back()``.  A source sleeps its backoff through
:func:`backoff`, which leaves the place for the sleep and takes one back before
the retry: the reads queued behind a refused one (a ``503 SlowDown``) start
meanwhile, instead of waiting for a backoff that sends nothing.  Without a
place set, :func:`backoff` is a plain sleep.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Protocol

__all__ = ["PLACE", "Place", "backoff"]


class Place(Protocol):
    """A read's place among those in flight."""

    def leave(self) -> None:
        """The read sends nothing for a while: another may take its place."""

    async def back(self) -> None:
        """Wait for a place again (the read is about to send its retry)."""


PLACE: ContextVar[Place | None] = ContextVar("asyncfeed_read_place", default=None)


async def backoff(seconds: float) -> None:
    """Sleep ``seconds`` before a retry, out of the current read's place (if any).

    Cancelled while sleeping, it does not take a place back (the read is over);
    cancelled while waiting for one, neither.
    """
    place = PLACE.get()
    if place is None:
        await asyncio.sleep(seconds)
        return
    place.leave()
    await asyncio.sleep(seconds)
    await place.back()
