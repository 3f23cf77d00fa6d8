"""Tail-tolerant attempts: hedged requests and adaptive stall timeouts.

One attempt of a read (one request) is run by :meth:`TailGuard.attempt`:

- **Hedging**: an attempt still outstanding past the ``hedge_quantile`` (0.95) of
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
- **Adaptive timeout**: an attempt running longer than ``stall_factor`` (4) times
  the observed 99th percentile (at least ``stall_floor`` seconds) is abandoned as
  a timeout, so the caller retries it long before the source's fixed
  ``timeout`` (which stays the hard cap of every attempt).

Latency is tracked online per guard (a source keeps one per kind of read): the
last 256 successful attempts, quantiles recomputed every 16.  Until 10 attempts
have been seen nothing is hedged and only the hard timeout applies; an attempt
started before then picks its limits up as soon as they are known.

A failed attempt (a 503...) while its twin is still running does not fail the
read: the twin may still answer.  When every attempt has failed or stalled,
the first error is raised for the caller's retry logic (whose retries run
through here again).  Cancelling the caller cancels every attempt.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, fields
from typing import Awaitable, Callable, Protocol, TypeVar, runtime_checkable

__all__ = ["CountsReads", "ReadStats", "StallTimeout", "TailGuard", "TailPolicy"]

T = TypeVar("T")

_WINDOW = 256
_EVERY = 16
_MIN_SAMPLES = 10
_RECHECK = 0.05  # seconds between looks at the limits while they are unknown
_BURST = 10.0


class StallTimeout(TimeoutError):
    """An attempt took far longer than the observed latency and was abandoned."""


@dataclass(frozen=True)
class TailPolicy:
    """How a source treats slow attempts (see the module docstring).

    ``hedge=False`` turns hedging off: use it where a duplicate GET is not
    idempotent or is billed unusually (requester-pays buckets, per-request
    egress charges).  ``adaptive_timeout=False`` keeps only the fixed timeout.
    """

    hedge: bool = True
    hedge_quantile: float = 0.95
    hedge_budget: float = 0.05
    hedge_after_later: int = 4
    adaptive_timeout: bool = True
    stall_factor: float = 4.0
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
    answered first), ``stalls`` (attempts abandoned by the adaptive timeout),
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
        self._latency = _Latency()
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

    def limits(self, hard: float | None) -> tuple[float | None, float | None]:
        """(hedge after, abandon after) in seconds for the next attempt; None: never."""
        p = self.policy
        hedge = self._latency.quantile(p.hedge_quantile) if p.hedge else None
        stall = hard
        if p.adaptive_timeout:
            p99 = self._latency.quantile(0.99)
            if p99 is not None:
                adaptive = max(p.stall_floor, p.stall_factor * p99)
                stall = adaptive if hard is None else min(hard, adaptive)
        return hedge, stall

    async def attempt(self, make: Callable[[], Awaitable[T]], hard: float | None,
                      first: bool = True) -> T:
        """The result of ``make()`` (one request), hedged and abandoned as the policy says.

        ``first``: this is a read's first attempt (it earns hedging budget; a retry
        does not, so hedges stay a share of reads, not of requests).

        Raises the first attempt's error when every attempt failed, or
        :class:`StallTimeout` when they stalled.  Cancelling this cancels them all.
        """
        loop = asyncio.get_running_loop()
        if first:
            with self._lock:
                self._tokens = min(_BURST, self._tokens + self.policy.hedge_budget)
        self.stats.attempts += 1
        self._seq += 1
        seq = self._seq
        t0 = loop.time()
        if not (self.policy.hedge or self.policy.adaptive_timeout):
            result = await make()  # only the hard timeout (make() applies it): no task
            self._latency.observe(loop.time() - t0)
            self._answered.append(seq)
            return result
        running: dict[asyncio.Future, float] = {asyncio.ensure_future(make()): t0}
        abandoned: list[asyncio.Future] = []
        hedge: asyncio.Future | None = None
        error: BaseException | None = None
        try:
            while running:
                # the limits follow the latency observed meanwhile: the first reads of
                # a pass start before anything is known
                hedge_after, stall_after = self.limits(hard)
                now = loop.time()
                deadlines = [start + stall_after for start in running.values()] \
                    if stall_after is not None and stall_after != hard else []
                if hedge is None and self.policy.hedge:
                    at = t0 + hedge_after if hedge_after is not None else now
                    # past it without a token: look again later (tokens come with reads)
                    deadlines.append(at if at > now else now + _RECHECK)
                elif stall_after == hard and self.policy.adaptive_timeout:
                    deadlines.append(now + _RECHECK)
                wait = max(0.0, min(deadlines) - now) if deadlines else None
                done, _ = await asyncio.wait(running, timeout=wait,
                                             return_when=asyncio.FIRST_COMPLETED)
                now = loop.time()
                for fut in done:
                    started = running.pop(fut)
                    exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
                    if exc is None:
                        self._latency.observe(now - started)
                        self._answered.append(seq)
                        if fut is hedge:
                            self.stats.hedge_wins += 1
                        return fut.result()
                    if error is None:
                        error = exc
                if stall_after is not None and stall_after != hard:
                    for fut, started in list(running.items()):
                        if now - started >= stall_after:
                            fut.cancel()
                            del running[fut]
                            abandoned.append(fut)
                            self.stats.stalls += 1
                            if error is None:
                                error = StallTimeout(
                                    f"no answer after {now - started:.2f}s "
                                    f"(adaptive timeout {stall_after:.2f}s)")
                if (hedge is None and hedge_after is not None and running
                        and now - t0 >= hedge_after and self._overtaken(seq)
                        and self._take_token()):
                    hedge = asyncio.ensure_future(make())
                    running[hedge] = now
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
