"""Objects still open when the interpreter exits, closed before it joins threads.

Runtimes, GIL probes and process stages each keep one :class:`OpenSet`: a weak
set of the instances not yet closed, and a function that closes whichever are
left at exit.  The hook runs through ``threading._register_atexit``, before the
interpreter joins non-daemon threads (a plain ``atexit`` hook runs after that,
too late: exit would wait on our threads); ``concurrent.futures`` uses the same
hook.  Hooks run in the reverse order of registration.  A forked child starts
with every set empty: what its parent opened is not its to close.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class OpenSet(Generic[T]):
    """The open instances of one kind; ``close_all(left)`` runs on them at exit."""

    def __init__(self, close_all: Callable[[list[T]], None]) -> None:
        self._items: weakref.WeakSet[T] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._close_all = close_all
        _register(self.close_left)
        if hasattr(os, "register_at_fork"):
            # a forked child (a worker process, DataLoader's or ours) must not close
            # its parent's runtimes at its exit: their locks may have been held by
            # another thread at the fork, and would then never be released there
            os.register_at_fork(after_in_child=self._forget_in_child)

    def _forget_in_child(self) -> None:
        self._lock = threading.Lock()  # (the parent's may have been held at the fork)
        self._items = weakref.WeakSet()

    def add(self, item: T) -> None:
        with self._lock:
            self._items.add(item)

    def discard(self, item: T) -> None:
        with self._lock:
            self._items.discard(item)

    def clear(self) -> None:
        """Forget every instance (a forked child: its parent's are not its to close)."""
        with self._lock:
            self._items.clear()

    def left(self) -> list[T]:
        with self._lock:
            return list(self._items)

    def close_left(self) -> None:
        """Close the instances still open (the exit hook; callable any time)."""
        self._close_all(self.left())


def _register(hook: Callable[[], None]) -> None:
    if hasattr(threading, "_register_atexit"):
        threading._register_atexit(hook)
    else:  # pragma: no cover
        import atexit
        atexit.register(hook)
