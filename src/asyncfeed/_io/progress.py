"""Progress of one request attempt: written by the client receiving it, read by the
watchdog that decides whether it stalled (:mod:`asyncfeed._io.hedge`).

The watchdog makes a :class:`Progress` per attempt and sets it as :data:`CURRENT`
while it creates the attempt's task (a task copies the context it is created in),
so the client, deep inside the attempt, finds it without any argument passed
through the layers between (source, S3 signer, redirects).  A client that can
report sets ``reported`` when it takes the request, ``sent`` (and ``last``) when
it writes it to a connection (waiting for the client's own connection limit is
nobody's silence), and then, for every piece of the response it receives, writes
the time into ``last`` (and ``first`` once):
two attribute writes per chunk, no task, no future, no callback.  The watchdog
only reads them when one of its timers fires.

Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

from contextvars import ContextVar

__all__ = ["CURRENT", "Progress", "unreported"]


class Progress:
    """What one attempt has received so far.

    ``start``: when the attempt began; ``reported``: a client is reporting this
    attempt's bytes (else nothing below moves, whatever arrives); ``sent``: when
    the client began sending the request (0.0 while it waits for a connection
    slot); ``first`` / ``last``: when its first / latest bytes arrived (``first``
    0.0 and ``last`` ``start`` or ``sent`` until then); ``nbytes``: bytes received
    (headers included).
    """

    __slots__ = ("start", "sent", "first", "last", "nbytes", "reported")

    def __init__(self, start: float) -> None:
        self.start = start
        self.sent = 0.0
        self.first = 0.0
        self.last = start
        self.nbytes = 0
        self.reported = False


#: the attempt the running task works for (None outside a watched attempt)
CURRENT: ContextVar[Progress | None] = ContextVar("asyncfeed_progress", default=None)


def unreported() -> None:
    """The rest of the running attempt goes through a client that cannot report its
    progress (a fallback to fsspec after the lean client was tried): the watchdog
    judges it on its whole duration from now on."""
    progress = CURRENT.get()
    if progress is not None:
        progress.reported = False
