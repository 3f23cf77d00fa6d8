"""Lifecycle abuse: 200 breaks, close from another thread, SIGINT, exit with live or stuck passes.

Each case checks that nothing hangs (a subprocess that does not exit fails the
test), and the in-process ones that no thread, file descriptor, child process
or shared-memory segment is left and that memory stays flat over repeats.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch
from torch.utils.data import IterableDataset

from asyncfeed import AsyncLoader, LoaderClosedError
from support.executions import EXECUTIONS, on
from support.faults import SRC, Resources, assert_released, rss_mb, run_script, send_signal_when

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]


class Rows:
    """Map-style: ``[i, i, ...]`` rows of 64 floats, ``delay`` seconds each."""

    def __init__(self, n: int = 64, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.full((64,), float(i))


class AsyncRows(Rows):
    """The same through ``async fetch`` (event loop) + ``decode`` (threads)."""

    async def fetch(self, i: int) -> int:
        if self.delay:
            await asyncio.sleep(self.delay)
        return i

    def decode(self, raw: int, i: int) -> torch.Tensor:
        return torch.full((64,), float(raw))


class Stream(IterableDataset):
    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __iter__(self):
        return (torch.full((64,), float(i)) for i in range(self.n))


@pytest.mark.parametrize("make", [Rows, AsyncRows, Stream], ids=["map", "fetch", "iterable"])
def test_200_breaks_leave_nothing_and_memory_flat(make):
    loader = AsyncLoader(make(), batch_size=8, num_threads=2)
    for _ in range(10):  # warm up allocators and caches
        for _ in loader:
            break
    before = Resources.snapshot()
    rss = []
    for k in range(200):
        for batch in loader:
            assert batch.shape == (8, 64)
            break
        if k % 50 == 49:
            rss.append(rss_mb())
    loader.close()
    assert_released(before)
    assert rss[-1] - rss[0] < 20, f"RSS grew over 200 breaks: {rss} MB"
    # and a full pass afterwards still gives every sample once
    with AsyncLoader(make(), batch_size=8, num_threads=2) as al:
        got = torch.cat([b[:, 0] for b in al]).tolist()
    assert sorted(got) == [float(i) for i in range(64)]


@pytest.mark.parametrize("make,execution", [(Rows, e) for e in EXECUTIONS]
                         + [(AsyncRows, "threads")], indirect=["execution"],
                         ids=[f"map-{e}" for e in EXECUTIONS] + ["fetch"])
def test_close_from_another_thread_wakes_the_consumer(make, execution):
    before = Resources.snapshot()
    loader = AsyncLoader(make(n=2000, delay=0.1), batch_size=8, num_threads=2, io_concurrency=8,
                         **on(execution))
    outcome: list[object] = []

    def consume():
        try:
            for _ in loader:
                pass
            outcome.append("ended")
        except LoaderClosedError as e:
            outcome.append(e)

    t = threading.Thread(target=consume, name="test-consumer")
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    loader.close()
    t.join(10)
    assert not t.is_alive(), "the consumer hangs after close()"
    assert time.monotonic() - t0 < 2.0, "close() waited for the samples in flight"
    assert isinstance(outcome[0], LoaderClosedError) and "closed" in str(outcome[0]), outcome
    assert_released(before)


@pytest.mark.parametrize("execution", EXECUTIONS, indirect=True)
def test_a_closed_pass_still_referenced_keeps_none_of_its_batches(execution):
    """An iterator kept after its loader closed (or an exception's traceback that
    holds its frames) keeps none of the batches the consumer had not taken: no
    host buffer, no shared-memory segment stays mapped."""
    before = Resources.snapshot()
    loader = AsyncLoader(Rows(n=256, delay=0.02), batch_size=8, num_threads=2, prefetch=4,
                         **on(execution))
    it = iter(loader)
    first, second = next(it), next(it)
    p = it._p  # type: ignore[attr-defined]
    with p.cond:
        pending = list(p._tracked.values()) + list(p.ready.values())
    # prefetch: later batches are planned, but for inline rows (the consumer loads
    # each batch when it asks for it, as num_workers=0 does)
    assert bool(pending) is (execution != "inline")
    bufs = [weakref.ref(t) for b in pending for t in (b.bufs or ())
            if isinstance(t, torch.Tensor)]
    del pending
    loader.close()
    gc.collect()
    assert not p._tracked and not p.ready
    assert [r for r in bufs if r() is not None] == []
    del first, second
    assert_released(before)  # ``it`` is still alive


class SlowStream(IterableDataset):
    """64-float rows of a stream, ``delay`` seconds each; the rows are kept (weakly)."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay
        self.made: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    def _row(self, i: int) -> torch.Tensor:
        time.sleep(self.delay)
        row = torch.full((64,), float(i))
        self.made.add(row)
        return row

    def __iter__(self):
        return (self._row(i) for i in range(self.n))  # the generator keeps no row


def test_a_closed_stream_pass_still_referenced_keeps_none_of_its_batches():
    """As above, for an ``IterableDataset``: the batches not taken, and the rows of
    the one being cut, go when the pass ends."""
    ds = SlowStream(512, 0.002)
    loader = AsyncLoader(ds, batch_size=8, num_threads=2, prefetch=4)
    it = iter(loader)
    first, second = next(it), next(it)
    p = it._p  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while not p.ready and time.monotonic() < deadline:
        time.sleep(0.005)
    assert p.ready  # a batch the consumer has not taken
    loader.close()
    gc.collect()
    assert not p.ready and not p._tracked
    assert len(ds.made) == 0, len(ds.made)
    assert first.shape == second.shape == (8, 64)  # the batches taken stay the user's


def test_sigint_interrupts_a_pass_and_a_wait_on_a_stuck_sample():
    code = textwrap.dedent("""
        import sys, threading, time, torch
        from asyncfeed import AsyncLoader

        class Data:
            def __len__(self): return 10_000
            def __getitem__(self, i):
                if i == 40:
                    threading.Event().wait()   # stuck for good
                time.sleep(0.005)
                return torch.zeros(4)

        loader = AsyncLoader(Data(), batch_size=8, num_threads=2)
        for k, b in enumerate(loader):
            if k == 1:
                print("ready", flush=True)
        print("not reached", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out = send_signal_when(p, "ready", signal.SIGINT)
        time.sleep(0.3)  # the consumer now waits for batch 5, which waits on sample 40
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise AssertionError("the process did not exit after SIGINT (hang)")
    assert "ready" in out and "not reached" not in rest
    assert "KeyboardInterrupt" in err, err
    assert p.returncode != 0


def test_exit_with_live_and_stuck_passes_of_every_kind():
    rc, out, err, took = run_script("""
        import asyncio, threading, time, torch
        from torch.utils.data import IterableDataset
        from asyncfeed import AsyncLoader

        class Map:
            def __len__(self): return 1000
            def __getitem__(self, i):
                time.sleep(0.01)
                return torch.zeros(4)

        class StuckFetch(Map):
            async def fetch(self, i):
                if i == 5:
                    await asyncio.Event().wait()   # a read that never completes
                return i
            def decode(self, raw, i): return torch.zeros(4)

        class LoopBlocker(Map):
            async def fetch(self, i):
                if i == 10:
                    time.sleep(1000)   # a blocking call inside a coroutine: the loop is stuck
                return i
            def decode(self, raw, i): return torch.zeros(4)

        class Stream(IterableDataset):
            def __iter__(self):
                for i in range(1000):
                    if i == 20:
                        threading.Event().wait()
                    yield torch.zeros(4)

        its = []
        for ds in (Map(), StuckFetch(), LoopBlocker(), Stream()):
            loader = AsyncLoader(ds, batch_size=4, num_threads=2)
            it = iter(loader)
            next(it)
            its.append((loader, it))
        print("live", len(its), flush=True)
    """, timeout=40)
    assert rc == 0, err
    assert out.strip() == "live 4", out
    assert took < 30, took
