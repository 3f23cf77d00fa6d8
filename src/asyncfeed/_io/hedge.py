"""Tail-tolerant attempts: hedged requests and adaptive stall timeouts.

One attempt of a read (one request) is run by :meth:`TailGuard.attempt`:

- **Hedging**: an attempt still outstanding past the ``hedge_quantile`` (0.98) of
  recently observed latency is sent a second time; the first answer wins and the
  other request is cancelled (its connection closed, never pooled half-read).
  Extra requests are bounded by a token budget: each read earns ``hedge_budget``
  (0.05) of a token with its first attempt (retries earn nothing), a hedge spends
  one, so hedges never exceed that share of reads (the bucket starts empty and
  holds at most 10).  An
  attempt is hedged only once ``hedge_after_later`` (4) attempts started after it
  have answered: a slow answer with nothing overtaking it is this client being
  slow (a busy event loop, a saturated link), which a second request would only
  make worse.
- **Adaptive timeout, by progress**: an attempt whose client reports what it
  receives (the lean HTTP client of :mod:`asyncfeed._io.http11`, so plain
  ``http(s)`` and the signed S3 GETs; see :mod:`asyncfeed._io.progress`) is
  abandoned as a stall when no byte has arrived for ``stall_factor`` (2) times
  the observed 99th percentile of *time to first byte*, at least ``stall_floor``
  (0.5) seconds: a request silent before its headers, or after them, is retried
  long before the source's fixed ``timeout``, while a large or slow object whose
  bytes keep coming is never abandoned by this rule, however long it takes.
  An attempt whose client cannot report (the fsspec filesystems: aiohttp, s3fs)
  is judged on its whole duration instead: abandoned after ``stall_factor``
  times the observed 99th percentile of whole-attempt latency (at least
  ``stall_floor``).  The fixed ``timeout`` stays the hard cap of every attempt.

Latency is tracked online per guard (a source keeps one per kind of read): the
last 256 successful attempts (whole duration, and time to first byte of those
that report it), quantiles recomputed every 16.  Until 10 attempts have been
seen nothing is hedged and only the hard timeout applies; an attempt started
before then picks its limits up as soon as they are known.  The watchdog costs
no work per received chunk: the client writes a timestamp, and the watchdog
looks at it when its timer (the earliest deadline of the attempts it runs) fires.

A failed attempt (a 503...) while its twin is still running does not fail the
read: the twin may still answer.  When every attempt has failed or stalled,
the first error is raised for the caller's retry logic (whose retries run
through here again).  Cancelling the caller cancels every attempt.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import deque
from time import monotonic
from dataclasses import dataclass, fields
from typing import Awaitable, Callable, NamedTuple, Protocol, TypeVar, runtime_checkable

from .progress import CURRENT, Progress

__all__ = ["CountsReads", "Limits", "ReadStats", "StallTimeout", "TailGuard", "TailPolicy"]

T = TypeVar("T")

_WINDOW = 256
_EVERY = 16
_MIN_SAMPLES = 10
_RECHECK = 0.05  # seconds between looks at the limits while they are unknown
_BURST = 10.0


class StallTimeout(TimeoutError):
    """An attempt received nothing for far longer than the observed latency (or, where
    progress is not reported, ran far longer) and was abandoned."""


class Limits(NamedTuple):
    """Seconds after which, for the next look at the running attempts: ``hedge``, send
    a second request (from the attempt's start); ``idle``, abandon an attempt that
    reports progress and has received nothing since (from its latest byte);
    ``whole``, abandon an attempt that does not report progress (from its start).
    None: not known yet (too few attempts seen); ``inf``: never by this rule (turned
    off, or at or above the hard timeout, which comes first).  ``hedge`` None: not
    known yet or hedging off."""

    hedge: float | None
    idle: float | None
    whole: float | None


@dataclass(frozen=True)
class TailPolicy:
    """How a source treats slow attempts (see the module docstring).

    ``hedge=False`` turns hedging off: use it where a duplicate GET is not
    idempotent or is billed unusually (requester-pays buckets, per-request
    egress charges).  ``adaptive_timeout=False`` keeps only the fixed timeout;
    ``stall_factor`` and ``stall_floor`` set how long a silence is a stall.
    """

    hedge: bool = True
    hedge_quantile: float = 0.98
    hedge_budget: float = 0.05
    hedge_after_later: int = 4
    adaptive_timeout: bool = True
    stall_factor: float = 2.0
    stall_floor: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.hedge_quantile < 1.0:
            raise ValueError(f"hedge_quantile must be in (0, 1), got {self.hedge_quantile!r}")
        if not 0.0 <= self.hedge_budget <= 1.0:
            raise ValueError(f"hedge_budget must be in [0, 1], got {self.hedge_budget!r}")
        if self.stall_factor <= 1.0 or self.stall_floor <= 0.0:
            raise ValueError("stall_factor must be > 1 and stall_floor > 0")


@dataclass
class ReadStats:
    """Counters of a source's reads: ``attempts`` (requests sent, hedges included),
    ``hedges`` (extra requests sent by hedging), ``hedge_wins`` (hedges that
    answered first), ``stalls`` (attempts abandoned by the adaptive timeout: silent, or
    where progress is not reported, too long),
    ``retries`` (attempts repeated after a transient error)."""

    attempts: int = 0
    hedges: int = 0
    hedge_wins: int = 0
    stalls: int = 0
    retries: int = 0

    def copy(self) -> "ReadStats":
        return ReadStats(**{f.name: getattr(self, f.name) for f in fields(self)})


@runtime_checkable
class CountsReads(Protocol):
    """A source (or data set) whose reads keep counters: ``read_stats()`` returns a
    :class:`ReadStats` (``FsspecSource``; ``ImageFolder`` over one), or None."""

    def read_stats(self) -> "ReadStats | None": ...


class _Latency:
    """Recent attempt latencies and their quantiles (thread-safe)."""

    def __init__(self) -> None:
        self._ring = [0.0] * _WINDOW
        self._n = 0
        self._sorted: list[float] = []
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._ring[self._n % _WINDOW] = seconds
            self._n += 1
            if self._n >= _MIN_SAMPLES and (self._n % _EVERY == 0 or not self._sorted):
                self._sorted = sorted(self._ring[:min(self._n, _WINDOW)])

    def quantile(self, q: float) -> float | None:
        s = self._sorted
        if not s:
            return None
        return s[min(len(s) - 1, int(q * len(s)))]


class TailGuard:
    """Runs attempts of one kind of read with hedging and an adaptive timeout."""

    def __init__(self, policy: TailPolicy, stats: ReadStats) -> None:
        self.policy = policy
        self.stats = stats
        self._latency = _Latency()   # whole attempts
        self._ttfb = _Latency()      # time to first byte, of attempts that report it
        self._seq = 0                                  # attempts started
        self._answered: deque[int] = deque(maxlen=_WINDOW)  # their numbers, as they answer
        self._tokens = 0.0
        self._lock = threading.Lock()

    def _take_token(self) -> bool:
        with self._lock:
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False

    def _overtaken(self, seq: int) -> bool:
        """Whether enough attempts started after attempt ``seq`` have answered."""
        need = self.policy.hedge_after_later
        return need <= 0 or sum(1 for s in list(self._answered) if s > seq) >= need

    def limits(self, hard: float | None) -> Limits:
        """The limits for the next look at the running attempts (see :class:`Limits`)."""
        p = self.policy
        hedge = self._latency.quantile(p.hedge_quantile) if p.hedge else None
        if not p.adaptive_timeout:
            return Limits(hedge, math.inf, math.inf)
        return Limits(hedge, self._adaptive(self._ttfb, hard),
                      self._adaptive(self._latency, hard))

    def _adaptive(self, latency: _Latency, hard: float | None) -> float | None:
        p99 = latency.quantile(0.99)
        if p99 is None:
            return None
        limit = max(self.policy.stall_floor, self.policy.stall_factor * p99)
        return math.inf if hard is not None and limit >= hard else limit

    def _stalled(self, progress: Progress, lim: Limits, now: float) -> str | None:
        """Why the attempt of ``progress`` counts as stalled at ``now``, or None."""
        if progress.reported:
            if not progress.sent:
                return None  # queued behind the client's own connection limit
            if lim.idle is not None and now - progress.last >= lim.idle:
                what = (f"after {progress.nbytes} bytes" if progress.first
                        else "before the first byte")
                return (f"no byte for {now - progress.last:.2f}s {what} (adaptive: "
                        f"{self.policy.stall_factor:g} x time to first byte p99, "
                        f"{lim.idle:.2f}s)")
        elif lim.whole is not None and now - progress.start >= lim.whole:
            return (f"no answer after {now - progress.start:.2f}s "
                    f"(adaptive timeout {lim.whole:.2f}s)")
        return None

    @staticmethod
    def _deadline(progress: Progress, lim: Limits, now: float) -> float:
        """When to look at the attempt of ``progress`` again: when it will count as
        stalled if nothing arrives meanwhile (``inf``: never), or soon while its limit
        is not known yet."""
        if progress.reported:
            if progress.sent and lim.idle is not None:
                return progress.last + lim.idle
            return now + _RECHECK
        return progress.start + lim.whole if lim.whole is not None else now + _RECHECK

    def _observe(self, progress: Progress, now: float) -> None:
        self._latency.observe(now - progress.start)
        if progress.reported and progress.first and progress.sent:
            self._ttfb.observe(progress.first - progress.sent)

    async def attempt(self, make: Callable[[], Awaitable[T]], hard: float | None,
                      first: bool = True) -> T:
        """The result of ``make()`` (one request), hedged and abandoned as the policy says.

        ``first``: this is a read's first attempt (it earns hedging budget; a retry
        does not, so hedges stay a share of reads, not of requests).

        Raises the first attempt's error when every attempt failed, or
        :class:`StallTimeout` when they stalled.  Cancelling this cancels them all.
        """
        if first:
            with self._lock:
                self._tokens = min(_BURST, self._tokens + self.policy.hedge_budget)
        self.stats.attempts += 1
        self._seq += 1
        seq = self._seq
        t0 = monotonic()
        if not (self.policy.hedge or self.policy.adaptive_timeout):
            result = await make()  # only the hard timeout (make() applies it): no task
            self._latency.observe(monotonic() - t0)
            self._answered.append(seq)
            return result
        return await self._race(make, hard, seq, t0)

    def _drop_stalled(self, running: dict[asyncio.Future, Progress],
                      abandoned: list[asyncio.Future], lim: Limits,
                      now: float) -> StallTimeout | None:
        """Cancel the attempts in ``running`` that the adaptive timeout gives up on
        (moved to ``abandoned``); the first one's :class:`StallTimeout`, if any."""
        first: StallTimeout | None = None
        for fut, progress in list(running.items()):
            why = self._stalled(progress, lim, now)
            if why is not None:
                fut.cancel()
                del running[fut]
                abandoned.append(fut)
                self.stats.stalls += 1
                if first is None:
                    first = StallTimeout(why)
        return first

    async def _race(self, make: Callable[[], Awaitable[T]], hard: float | None, seq: int,
                    t0: float) -> T:
        """:meth:`attempt` with hedging or the adaptive timeout: attempts raced until
        one answers; the losers are cancelled and reaped before this returns."""
        running: dict[asyncio.Future, Progress] = {}
        abandoned: list[asyncio.Future] = []
        hedge: asyncio.Future | None = None
        error: BaseException | None = None

        def launch(now: float) -> asyncio.Future:
            progress = Progress(now)
            token = CURRENT.set(progress)  # the task copies the context: its client reports
            try:
                fut = asyncio.ensure_future(make())
            finally:
                CURRENT.reset(token)
            running[fut] = progress
            return fut

        launch(t0)
        try:
            while running:
                # the limits follow the latency observed meanwhile: the first reads of
                # a pass start before anything is known
                lim = self.limits(hard)
                now = monotonic()
                deadlines = [self._deadline(progress, lim, now)
                             for progress in running.values()]
                if hedge is None and self.policy.hedge:
                    at = t0 + lim.hedge if lim.hedge is not None else now
                    # past it without a token: look again later (tokens come with reads)
                    deadlines.append(at if at > now else now + _RECHECK)
                soonest = min(deadlines, default=math.inf)
                wait = max(0.0, soonest - now) if soonest < math.inf else None
                done, _ = await asyncio.wait(running, timeout=wait,
                                             return_when=asyncio.FIRST_COMPLETED)
                now = monotonic()
                for fut in done:
                    progress = running.pop(fut)
                    exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
                    if exc is None:
                        self._observe(progress, now)
                        self._answered.append(seq)
                        if fut is hedge:
                            self.stats.hedge_wins += 1
                        return fut.result()
                    if error is None:
                        error = exc
                if self.policy.adaptive_timeout and running:
                    lim = self.limits(hard)  # as of now: what just answered counts
                    stalled = self._drop_stalled(running, abandoned, lim, now)
                    if error is None:
                        error = stalled
                if (hedge is None and lim.hedge is not None and running
                        and now - t0 >= lim.hedge and self._overtaken(seq)
                        and self._take_token()):
                    hedge = launch(now)
                    self.stats.hedges += 1
                    self.stats.attempts += 1
            assert error is not None
            raise error
        finally:
            for fut in running:
                fut.cancel()
            abandoned.extend(running)
            if abandoned:
                # reap the losers: they close their connections as they unwind
                await asyncio.gather(*abandoned, return_exceptions=True)
