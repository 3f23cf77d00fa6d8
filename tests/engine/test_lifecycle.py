"""Threads start with a pass and are gone soon after it ends, however it ends.

Besides the autouse leak fixture in conftest, the tests assert explicitly (and
sooner) that no ``asyncfeed-*`` thread is left where it matters.
"""

from __future__ import annotations

import _thread
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch.utils.data import IterableDataset

import asyncfeed
from asyncfeed import AsyncFeedError, AsyncLoader, LoaderClosedError

pytestmark = pytest.mark.timeout(60)

SRC = os.path.dirname(os.path.dirname(os.path.abspath(asyncfeed.__file__)))  # the one tested


def our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncfeed-") and t.is_alive()]


def wait_no_threads(within: float = 2.0) -> list[str]:
    """Names of asyncfeed threads still alive after ``within`` seconds (collecting garbage)."""
    deadline = time.monotonic() + within
    while True:
        left = [t.name for t in our_threads()]
        if not left or time.monotonic() > deadline:
            return left
        gc.collect()
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def _start_clean():
    assert wait_no_threads(3.0) == [], "threads left over from an earlier test"


class Slow:
    """Each sample takes ``delay`` seconds (like a read from a slow disk)."""

    def __init__(self, n: int = 400, delay: float = 0.01) -> None:
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return torch.full((3,), float(i)), i


class SlowAsync(Slow):
    async def fetch(self, i):
        import asyncio
        await asyncio.sleep(self.delay)
        return i

    def decode(self, raw, i):
        return torch.full((3,), float(raw)), raw


class SlowStream(IterableDataset):
    def __init__(self, n: int = 400, delay: float = 0.01) -> None:
        self.n, self.delay = n, delay

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.delay)
            yield torch.full((3,), float(i)), i


def dataset(kind: str, **kw):
    return {"map": Slow, "async": SlowAsync, "iterable": SlowStream}[kind](**kw)


def make(kind: str, data: dict | None = None, **kw) -> AsyncLoader:
    return AsyncLoader(dataset(kind, **(data or {})), batch_size=4, num_threads=2, **kw)


KINDS = ["map", "async", "iterable"]


# -------------------------------------------------------------- ending a pass
@pytest.mark.parametrize("kind", KINDS)
def test_break_out_of_the_loop(kind):
    loader = make(kind)
    for k, batch in enumerate(loader):
        assert our_threads(), "the pass should be running threads"
        if k == 2:
            break
    assert wait_no_threads() == []
    loader.close()


@pytest.mark.parametrize("kind", KINDS)
def test_loader_usable_after_a_break(kind):
    loader = make(kind, dict(n=30, delay=0.001))
    for _ in loader:
        break
    assert [b[1].tolist() for b in loader] == [list(range(i, min(i + 4, 30)))
                                              for i in range(0, 30, 4)]
    assert wait_no_threads(0.5) == [], "a pass that ran to its end joins its threads"


@pytest.mark.parametrize("kind", KINDS)
def test_exception_in_the_loop_body(kind):
    loader = make(kind)
    with pytest.raises(ZeroDivisionError):
        for k, batch in enumerate(loader):
            if k == 1:
                1 / 0
    assert wait_no_threads() == []


@pytest.mark.parametrize("kind", KINDS)
def test_keyboard_interrupt_in_the_loop_body(kind):
    loader = make(kind)
    with pytest.raises(KeyboardInterrupt):
        for k, batch in enumerate(loader):
            if k == 1:
                raise KeyboardInterrupt
    assert wait_no_threads() == []


def test_keyboard_interrupt_while_waiting_for_a_batch():
    """Ctrl-C while the main thread is blocked in next()."""
    loader = AsyncLoader(Slow(n=40, delay=0.4), batch_size=2, num_threads=2, timeout=0)
    it = iter(loader)
    timer = threading.Timer(0.15, _thread.interrupt_main)
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(it)
            time.sleep(5)       # next() returned first: the interrupt lands here
        assert time.monotonic() - t0 < 2.5, "the interrupt was not seen while waiting"
    finally:
        timer.join()
    del it
    assert wait_no_threads(3.0) == []


@pytest.mark.parametrize("kind", KINDS)
def test_del_loader_and_iterator(kind):
    loader = make(kind)
    it = iter(loader)
    next(it)
    assert our_threads()
    del loader
    gc.collect()
    next(it)        # the iterator keeps what it needs alive
    del it
    assert wait_no_threads() == []


@pytest.mark.parametrize("kind", KINDS)
def test_del_loader_during_a_loop_in_a_helper(kind):
    def train_a_little():
        loader = make(kind)
        for k, _ in enumerate(loader):
            if k == 2:
                return k

    assert train_a_little() == 2
    assert wait_no_threads() == []


def test_dropping_an_unstarted_iterator():
    loader = make("map")
    iter(loader)        # made and dropped at once
    assert wait_no_threads() == []
    loader.close()


# ------------------------------------------------------- a second iter(), close()
@pytest.mark.parametrize("kind", KINDS)
def test_second_iter_closes_the_first(kind):
    loader = make(kind, dict(n=22, delay=0.005))
    first = iter(loader)
    assert next(first)[1].tolist() == [0, 1, 2, 3]
    second = iter(loader)
    with pytest.raises(LoaderClosedError):
        next(first)
    with pytest.raises(LoaderClosedError):
        next(first)
    decode = [t for t in our_threads() if t.name.startswith("asyncfeed-decode")]
    assert len(decode) <= 2, f"the first pass's threads were not stopped: {decode}"
    assert [b[1].tolist() for b in second] == [list(range(i, min(i + 4, 22)))
                                              for i in range(0, 22, 4)]
    with pytest.raises(StopIteration):
        next(second)
    assert wait_no_threads(0.5) == []
    loader.close()


def test_close_twice_and_iterating_after_close():
    loader = make("map")
    it = iter(loader)
    next(it)
    loader.close()
    assert wait_no_threads(0.5) == [], "close() joins the threads before returning"
    loader.close()
    with pytest.raises(LoaderClosedError):
        next(it)
    with pytest.raises(LoaderClosedError):
        iter(loader)
    with pytest.raises(LoaderClosedError):
        for _ in loader:
            pass
    assert isinstance(LoaderClosedError("x"), AsyncFeedError)


def test_close_before_any_iteration():
    loader = make("async")
    loader.close()
    loader.close()
    with pytest.raises(LoaderClosedError):
        iter(loader)
    assert our_threads() == []


def test_iterator_close():
    loader = make("map")
    it = iter(loader)
    next(it)
    it.close()
    it.close()
    assert wait_no_threads(0.5) == []
    with pytest.raises(LoaderClosedError):
        next(it)
    assert len(list(AsyncLoader(Slow(9, 0.0), batch_size=4))) == 3
    loader.close()


def test_context_manager():
    with make("async") as loader:
        it = iter(loader)
        next(it)
        assert our_threads()
    assert wait_no_threads(0.5) == [], "leaving the with block joins the threads"
    with pytest.raises(LoaderClosedError):
        next(it)
    with pytest.raises(LoaderClosedError):
        iter(loader)


def test_context_manager_with_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with make("map") as loader:
            for _ in loader:
                raise RuntimeError("boom")
    assert wait_no_threads(0.5) == []


def test_close_wakes_a_consumer_blocked_in_another_thread():
    loader = AsyncLoader(Slow(n=40, delay=0.5), batch_size=4, num_threads=1)
    it = iter(loader)
    result: list = []

    def consume():
        try:
            result.append(next(it))
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    loader.close()
    consumer.join(3.0)
    assert not consumer.is_alive(), "close() left the consumer waiting"
    assert time.monotonic() - t0 < 2.0
    assert len(result) == 1 and isinstance(result[0], LoaderClosedError), result
    assert wait_no_threads(1.0) == []


def test_exhausted_iterator_keeps_raising_stop_iteration():
    loader = AsyncLoader(Slow(6, 0.0), batch_size=4)
    it = iter(loader)
    assert len(list(it)) == 2
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
    loader.close()


@pytest.mark.parametrize("kind", KINDS)
def test_many_short_epochs(kind):
    ds = dataset(kind, n=10, delay=0.0)
    with AsyncLoader(ds, batch_size=3, num_threads=2) as loader:
        for epoch in range(20):
            loader.set_epoch(epoch)
            assert [b[1].tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
            assert wait_no_threads(0.5) == [], f"epoch {epoch} left threads"
            assert threading.active_count() < 20
    for epoch in range(20):     # and epochs abandoned after one batch
        loader = AsyncLoader(ds, batch_size=3, num_threads=2)
        next(iter(loader))
    assert wait_no_threads() == []


def test_abandoned_async_passes_leave_no_orphaned_tasks(caplog):
    """Dropping a pass over an async dataset: its event-loop tasks are cancelled and
    awaited on the loop, not destroyed pending by the garbage collector of another
    thread ("Task was destroyed but it is pending!", "Event loop is closed")."""
    hits: list[str] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: hits.append(f"{u.exc_type.__name__}: {u.exc_value} "
                                               f"in {u.object!r}")
    try:
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            for _ in range(10):
                loader = AsyncLoader(SlowAsync(n=10, delay=0.0), batch_size=3, num_threads=2)
                next(iter(loader))
                gc.collect()
            assert wait_no_threads() == []
            gc.collect()
    finally:
        sys.unraisablehook = old_hook
    logged = sorted({r.getMessage().splitlines()[0] for r in caplog.records
                     if r.name == "asyncio"})
    assert logged == [] and hits[:3] == [], (logged, len(hits), hits[:3])


# ----------------------------------------------------------- interpreter exit
SCRIPT = textwrap.dedent("""
    import asyncio, sys, time, torch
    from torch.utils.data import IterableDataset
    from asyncfeed import AsyncLoader

    class Slow:
        def __len__(self):
            return 100000
        def __getitem__(self, i):
            time.sleep(0.05)
            return torch.zeros(3), i

    class SlowAsync(Slow):
        async def fetch(self, i):
            await asyncio.sleep(0.05)
            return i
        def decode(self, raw, i):
            time.sleep(0.01)
            return torch.zeros(3), raw

    class SlowStream(IterableDataset):
        def __iter__(self):
            for i in range(100000):
                time.sleep(0.05)
                yield torch.zeros(3), i

    ds = {"map": Slow, "async": SlowAsync, "iterable": SlowStream}[sys.argv[1]]()
    loader = AsyncLoader(ds, batch_size=4, num_threads=2)
    it = iter(loader)
    next(it)
    print("got a batch at", time.time(), flush=True)
    how = sys.argv[2]
    if how == "raise":
        raise RuntimeError("the training script crashed")
    if how == "exit":
        sys.exit(3)
    if how == "loop":
        for k, b in enumerate(loader):
            if k == 1:
                raise SystemExit(0)
""")


@pytest.mark.parametrize("kind,how,code", [
    ("map", "end", 0), ("map", "raise", 1), ("async", "end", 0), ("iterable", "loop", 0)])
def test_interpreter_exit_without_close(kind, how, code):
    """A script that never closes its loader still exits, promptly, with its own status."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run([sys.executable, "-c", SCRIPT, kind, how], env=env,
                           capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the interpreter did not exit: {e.stdout!r} {e.stderr!r}")
    ended = time.time()
    assert p.returncode == code, p.stderr
    assert "got a batch at" in p.stdout, p.stderr
    got_batch = float(p.stdout.split("got a batch at")[1].split()[0])
    assert ended - got_batch < 8, f"exit took {ended - got_batch:.1f}s after the last batch"
    if how == "raise":
        assert "RuntimeError: the training script crashed" in p.stderr
        assert p.stderr.count("Traceback") == 1, p.stderr
    else:
        assert "Traceback" not in p.stderr and "Exception" not in p.stderr, p.stderr
        assert "Task was destroyed" not in p.stderr, p.stderr
