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
from support.executions import EXECUTIONS, OFF_THREAD, on

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


def make(kind: str, data: dict | None = None, execution: str = "threads", **kw) -> AsyncLoader:
    return AsyncLoader(dataset(kind, **(data or {})), batch_size=4, num_threads=2,
                       **on(execution), **kw)


KINDS = ["map", "async", "iterable"]
#: a map-style dataset's samples run on every execution; reads on the event loop and
#: streams run on threads whatever ``execution`` says
CASES = [("map", e) for e in EXECUTIONS] + [("async", "threads"), ("iterable", "threads")]


# -------------------------------------------------------------- ending a pass
@pytest.mark.parametrize("kind,execution", CASES, indirect=["execution"])
def test_break_out_of_the_loop(kind, execution):
    loader = make(kind, execution=execution)
    for k, batch in enumerate(loader):
        assert our_threads(), "the pass should be running threads"
        if k == 2:
            break
    assert wait_no_threads() == []
    loader.close()


@pytest.mark.parametrize("kind,execution", CASES, indirect=["execution"])
def test_loader_usable_after_a_break(kind, execution):
    loader = make(kind, dict(n=30, delay=0.001), execution=execution)
    for _ in loader:
        break
    assert [b[1].tolist() for b in loader] == [list(range(i, min(i + 4, 30)))
                                              for i in range(0, 30, 4)]
    assert wait_no_threads(0.5) == [], "a pass that ran to its end joins its threads"


@pytest.mark.parametrize("kind,execution", CASES, indirect=["execution"])
def test_exception_in_the_loop_body(kind, execution):
    loader = make(kind, execution=execution)
    with pytest.raises(ZeroDivisionError):
        for k, batch in enumerate(loader):
            if k == 1:
                1 / 0
    assert wait_no_threads() == []


@pytest.mark.parametrize("kind,execution", CASES, indirect=["execution"])
def test_keyboard_interrupt_in_the_loop_body(kind, execution):
    loader = make(kind, execution=execution)
    with pytest.raises(KeyboardInterrupt):
        for k, batch in enumerate(loader):
            if k == 1:
                raise KeyboardInterrupt
    assert wait_no_threads() == []


def test_keyboard_interrupt_while_waiting_for_a_batch(execution):
    """Ctrl-C while the main thread is blocked in next()."""
    loader = AsyncLoader(Slow(n=40, delay=0.4), batch_size=2, num_threads=2, timeout=0,
                         **on(execution))
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


@pytest.mark.parametrize("kind,execution", CASES, indirect=["execution"])
def test_del_loader_and_iterator(kind, execution):
    loader = make(kind, execution=execution)
    it = iter(loader)
    next(it)
    assert our_threads()
    del loader
    gc.collect()
    next(it)        # the iterator keeps what it needs alive
    del it
    assert wait_no_threads() == []


@pytest.mark.parametrize("kind,execution", CASES, indirect=["execution"])
def test_del_loader_during_a_loop_in_a_helper(kind, execution):
    def train_a_little():
        loader = make(kind, execution=execution)
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
@pytest.mark.parametrize("kind,execution", CASES, indirect=["execution"])
def test_second_iter_closes_the_first(kind, execution):
    loader = make(kind, dict(n=22, delay=0.005), execution=execution)
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


def test_close_twice_and_iterating_after_close(execution):
    loader = make("map", execution=execution)
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


def test_iterator_close(execution):
    loader = make("map", execution=execution)
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


def test_context_manager_with_an_exception(execution):
    with pytest.raises(RuntimeError, match="boom"):
        with make("map", execution=execution) as loader:
            for _ in loader:
                raise RuntimeError("boom")
    assert wait_no_threads(0.5) == []


def test_close_wakes_a_consumer_blocked_in_another_thread(execution):
    """The consumer is woken within 0.5 s (the promise), whatever the samples in
    flight still take (worker processes are stopped in the background of it)."""
    loader = AsyncLoader(Slow(n=40, delay=0.5), batch_size=4, num_threads=1,
                         **on(execution))
    it = iter(loader)
    result: list = []

    def consume():
        try:
            result.append(next(it))
        except BaseException as e:  # noqa: BLE001
            result.append((time.monotonic(), e))

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    loader.close()
    consumer.join(3.0)
    assert not consumer.is_alive(), "close() left the consumer waiting"
    assert len(result) == 1 and isinstance(result[0], tuple), result
    woke, error = result[0]
    assert isinstance(error, LoaderClosedError), error
    assert woke - t0 < 0.5, f"the consumer woke {woke - t0:.2f} s after close()"
    assert wait_no_threads(1.0) == []


# ------------------------------------------------------------ a pass that failed
class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("this exception cannot be printed")


class FailsWhileFlagged:
    """Sample 5 fails in the way ``how`` says while the file ``flag`` exists (a file,
    so that worker processes see it change too); ``(tensor of 2, index)`` else."""

    def __init__(self, how: str, flag: str, n: int = 40) -> None:
        self.how, self.flag, self.n = how, flag, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 5 and os.path.exists(self.flag):
            if self.how == "value":
                raise ValueError("bad sample 5")
            if self.how == "memory":
                raise MemoryError("cannot allocate sample 5")
            if self.how == "unprintable":
                raise Unprintable()
            if self.how == "collate":
                return torch.zeros(3), i  # one shape among others: the batch cannot stack
        return torch.full((2,), float(i)), i


class FailingSampler:
    def __init__(self, n: int, flag: str) -> None:
        self.n, self.flag = n, flag

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            if i == 9 and os.path.exists(self.flag):
                raise ValueError("the sampler broke")
            yield i


# (MemoryError cannot be subclassed with SampleError: a plain SampleError, on every execution)
FAILURES = {"value": ValueError, "memory": asyncfeed.SampleError, "unprintable": Unprintable,
            "collate": RuntimeError, "sampler": ValueError, "consumer": ZeroDivisionError}


@pytest.mark.parametrize("how", sorted(FAILURES))
def test_a_failed_pass_leaves_the_loader_usable_and_nothing_behind(how, execution, tmp_path):
    """After a pass that failed (a sample's error, a collate error, a sampler's
    error, the consumer's own exception), no thread of the pass is left, repeated
    failures hold no more descriptors, the same loader then gives every batch,
    and once it is closed no thread, descriptor, process or shared-memory file
    of it is left."""
    from support.faults import Resources, assert_released
    flag = tmp_path / "failing"
    flag.touch()
    kw = {"sampler": FailingSampler(40, str(flag))} if how == "sampler" else {}
    before = Resources.snapshot()
    loader = AsyncLoader(FailsWhileFlagged(how, str(flag)), batch_size=4, num_threads=2,
                         **on(execution), **kw)
    fds = []
    for _ in range(4):
        with pytest.raises(FAILURES[how]):
            for k, batch in enumerate(loader):
                if how == "consumer" and k == 2:
                    1 / 0
        batch = None  # (a batch held keeps its memory, in shared memory too)
        assert wait_no_threads() == [], "the failed pass left its threads"
        fds.append(len(Resources.snapshot().fds))
    assert fds[-1] <= fds[1], f"descriptors after each failed pass: {fds}"
    flag.unlink()
    got = [b[1].tolist() for b in loader]
    assert got == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    loader.close()
    assert_released(before)


# --------------------------------------------------- one iterator, several threads
class Jittery:
    """Rows that take 0-2 ms, so the consumers interleave differently every run."""

    def __len__(self):
        return 400

    def __getitem__(self, i):
        time.sleep((i * 7919 % 13) / 6500)
        return torch.tensor([i])


@pytest.mark.parametrize("in_order", [True, False])
def test_one_iterator_shared_by_consumer_threads(in_order, execution):
    """Several threads take batches from one iterator: none hangs, each batch goes to
    one of them, every sample arrives once."""
    with AsyncLoader(Jittery(), batch_size=2, num_threads=2, prefetch=4, in_order=in_order,
                     timeout=20, **on(execution)) as al:
        it = iter(al)
        seen: list[int] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def consume() -> None:
            try:
                for b in it:
                    with lock:
                        seen.extend(b.flatten().tolist())
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=consume, name=f"test-consumer-{j}")
                   for j in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a consumer hung"
        assert errors == []
        assert sorted(seen) == list(range(400))


def test_exhausted_iterator_keeps_raising_stop_iteration():
    loader = AsyncLoader(Slow(6, 0.0), batch_size=4)
    it = iter(loader)
    assert len(list(it)) == 2
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
    loader.close()


@pytest.mark.parametrize("kind,execution", CASES, indirect=["execution"])
def test_many_short_epochs(kind, execution):
    ds = dataset(kind, n=10, delay=0.0)
    with AsyncLoader(ds, batch_size=3, num_threads=2, **on(execution)) as loader:
        for epoch in range(20):
            loader.set_epoch(epoch)
            assert [b[1].tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
            assert wait_no_threads(0.5) == [], f"epoch {epoch} left threads"
            assert threading.active_count() < 20
    for epoch in range(20 if execution == "threads" else 3):  # and epochs abandoned
        loader = AsyncLoader(ds, batch_size=3, num_threads=2, **on(execution))  # after a batch
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
    loader = AsyncLoader(ds, batch_size=4, num_threads=2, execution=sys.argv[3])
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


@pytest.mark.parametrize("kind,how,code,execution", [
    ("map", "end", 0, "threads"), ("map", "raise", 1, "threads"), ("async", "end", 0, "threads"),
    ("iterable", "loop", 0, "threads")]
    + [("map", "raise", 1, e) for e in EXECUTIONS if e != "threads"], indirect=["execution"])
def test_interpreter_exit_without_close(kind, how, code, execution):
    """A script that never closes its loader still exits, promptly, with its own status."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run([sys.executable, "-c", SCRIPT, kind, how, execution], env=env,
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


EXIT_SCRIPT = textwrap.dedent("""
    import sys, threading, time, torch
    from asyncfeed import AsyncLoader, LoaderTimeout

    class Data:
        def __len__(self):
            return 100000
        def __getitem__(self, i):
            if sys.argv[1] != "slow" and i >= 4:
                threading.Event().wait()    # never returns
            time.sleep(0.02 if i < 4 else 1.5)  # slow, once the first batch is out
            return torch.zeros(3), i

    loader = AsyncLoader(Data(), batch_size=4, num_threads=2, execution=sys.argv[2],
                         timeout=1 if sys.argv[1] == "timeout" else 0)
    it = iter(loader)
    next(it)
    if sys.argv[1] == "timeout":
        try:
            next(it)
        except LoaderTimeout:
            pass
    time.sleep(0.3)   # the next samples are in flight
    print("end", time.time(), flush=True)
""")


BASELINE_SCRIPT = textwrap.dedent("""
    import time, torch, asyncfeed
    print("end", time.time(), flush=True)
""")


def exit_delays(*argvs: list[str]) -> list[float]:
    """Run the scripts ``argvs`` at once; the seconds from each one's ``end`` line
    (``print("end", time.time())``) to its exit.  Each must exit with status 0 and
    nothing on stderr within 60 s."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", *argv], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv in argvs]
    results: list = [None] * len(procs)

    def wait(j: int) -> None:
        try:
            stdout, stderr = procs[j].communicate(timeout=60)
            results[j] = (time.time(), stdout, stderr)
        except subprocess.TimeoutExpired:
            procs[j].kill()
            procs[j].communicate()

    waiters = [threading.Thread(target=wait, args=(j,), name=f"test-exit-{j}")
               for j in range(len(procs))]
    for t in waiters:
        t.start()
    for t in waiters:
        t.join()
    out = []
    for p, got in zip(procs, results):
        assert got is not None, "the interpreter did not exit within 60 s (a hang)"
        ended, stdout, stderr = got
        assert p.returncode == 0 and "Traceback" not in stderr, stderr
        out.append(ended - float(stdout.split("end")[1].split()[0]))
    return out


@pytest.mark.parametrize("sample,execution", [("slow", e) for e in EXECUTIONS]
                         + [("timeout", e) for e in OFF_THREAD], indirect=["execution"])
def test_exit_within_two_seconds_with_slow_or_stuck_samples_in_flight(sample, execution):
    """The interpreter exits within 2 s of the script's end (not after the samples in
    flight: a worker process still in one is killed, as DataLoader kills its
    workers), with the script's own status and nothing on stderr: with slow
    samples in flight, and with stuck ones after a ``LoaderTimeout``.  Measured beside
    a script that only imports torch and asyncfeed, run at the same time: the
    interpreter's own teardown (a second or more on a loaded machine) is not the
    loader's."""
    took, baseline = exit_delays([EXIT_SCRIPT, sample, execution], [BASELINE_SCRIPT])
    assert took - baseline < 2.0, \
        f"the interpreter exited {took:.1f} s after the script's end ({baseline:.1f} s without a loader)"
