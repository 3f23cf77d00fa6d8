"""Calls that raced a pass's first call into the dataset's code, retried once.

DataLoader's idiom for a resource that must not cross a fork (an LMDB environment,
an HDF5 file, a client, an index built from a file) opens it on first use::

    def __getitem__(self, i):
        if self.env is None:
            self.env = lmdb.open(self.path, readonly=True, lock=False)

In a worker process one thread makes that first call.  In decode threads several
make it at once: LMDB refuses a second open of one environment in a process, and
an index filled in place is seen half-filled (a ``KeyError``) by the threads that
find it no longer ``None``.  So a call that started while the pass's first call
was still running and raised is made once more, once that first call has
returned: by then the resource is open.  Where the first call raised instead,
there was nothing to wait for, and the racing calls' failures stand as they are.
Nothing waits otherwise: a slow first sample holds back no other
(``in_order=False`` still delivers the others first), and a sample that fails for
its own reasons fails again, and is reported as it would have been.

Only a loader's passes up to the first whose first call returned are wrapped
(:class:`FirstCall`): the resource is open from then on, and the later passes call
the dataset's own method, so a bad row is called once there whatever it races.

This mends the idiom's race where it raises; it does not make code that shares
other mutable state thread-safe (``docs/migrating.md``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["FirstCall", "retry_racing_first"]

F = TypeVar("F", bound=Callable[..., Any])


class FirstCall:
    """A loader's record of whether a first call of one of its passes into the
    dataset's code has returned (consumer and decode threads; a flag only ever
    set)."""

    def __init__(self) -> None:
        self.returned = False


def retry_racing_first(fn: F, settle: Callable[[F, bool], None]) -> F:
    """``fn``, wrapped: its first call runs as it is; a call that starts before the
    first call has ended and raises an ``Exception`` waits for the first call to
    end; if that returned, the call is made once more, and what the second try
    returns or raises is its outcome; if that raised, what the call raised stands.
    When the first call has ended,
    ``settle(fn, returned)`` is called (the owner swaps the wrapper for ``fn``
    itself, so later calls cost nothing; ``returned``: the first call returned).
    A failed racing call waits as long as a first call that never returns (whose
    batch is then stuck anyway: the loader's ``timeout`` applies); a call that
    does not fail never waits."""
    lock = threading.Lock()
    first_ended = threading.Event()
    started = False
    first_returned = False

    def call(*args: Any) -> Any:
        nonlocal started, first_returned
        if first_ended.is_set():
            return fn(*args)
        with lock:
            mine, started = not started, True
        if mine:
            try:
                out = fn(*args)
                first_returned = True
                return out
            finally:
                first_ended.set()
                settle(fn, first_returned)
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - perhaps the race: tried again below
            first_ended.wait()
            if not first_returned:
                raise
        return fn(*args)

    return call  # type: ignore[return-value]
