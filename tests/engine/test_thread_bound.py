"""A data set bound to the thread that made it (a ``sqlite3`` connection opened in
``__init__``) works as under DataLoader: ``execution="auto"`` finds its rows fail in
decode threads and load in the consumer's thread, and runs them there.

A row that fails for its own reasons (everywhere), or only once (a flaky read),
is not taken for that: the failure stands as it would have, and later failures
are not loaded again (the flaky case is checked on ``retry_here`` itself: end to
end, a failure that races the pass's first call is retried by ``firstcall``).
"""

from __future__ import annotations

import signal
import sqlite3
import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from asyncfeed import AsyncLoader, SampleError
from asyncfeed._engine.batch import Batch, BatchMode
from asyncfeed._engine.chooser import Chooser
from asyncfeed._engine.policy import (INLINE, Mode, Reason, Record, Space, Window, decide,
                                      processes, threads)
from asyncfeed._engine.threadbound import retry_here
from support.executions import on
from support.oracle import assert_same_batches

pytestmark = pytest.mark.timeout(60)


class SqliteRows(Dataset):
    """Rows read through a ``sqlite3`` connection opened in ``__init__``: usable only
    in the thread that opened it (and in a child forked from that thread)."""

    def __init__(self, path: str, n: int = 40, bad: tuple[int, ...] = ()) -> None:
        self.n, self.bad = n, set(bad)
        self.conn = sqlite3.connect(path)
        self.calls: list[tuple[int, str]] = []  # (index, the loading thread's name)
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        with self.lock:
            self.calls.append((i, threading.current_thread().name))
        if i in self.bad:
            raise ValueError(f"row {i} is bad")
        (v,) = self.conn.execute("select v from t where i = ?", (i,)).fetchone()
        return torch.tensor([v]), i


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "rows.db")
    conn = sqlite3.connect(path)
    conn.execute("create table t (i integer primary key, v real)")
    conn.executemany("insert into t values (?, ?)", [(i, i * 0.5) for i in range(100)])
    conn.commit()
    conn.close()
    return path


def dataloader_batches(ds: Dataset) -> list:
    return list(DataLoader(ds, batch_size=4, shuffle=True,
                           generator=torch.Generator().manual_seed(5)))



@pytest.mark.parametrize("on_error,in_order", [("raise", True), ("skip", True),
                                               ("skip", False)])
def test_auto_runs_a_thread_bound_data_set_inline_with_dataloaders_batches(db, on_error,
                                                                           in_order):
    dl = DataLoader(SqliteRows(db), batch_size=4, shuffle=True,
                    generator=torch.Generator().manual_seed(5))
    want, want_next = list(dl), list(dl)
    ds = SqliteRows(db)
    with AsyncLoader(ds, batch_size=4, shuffle=True, on_error=on_error, in_order=in_order,
                     generator=torch.Generator().manual_seed(5)) as al:
        got = list(al)
        if in_order:
            assert_same_batches(got, want)
        else:  # the batches as they came: every sample once, none skipped
            assert sorted(int(i) for b in got for i in b[1]) == list(range(40))
        ex = al.stats().execution
        assert ex.thread_bound and ex.mode is not Mode.THREADS
        assert "only that thread may" in str(ex)
        assert al.stats().skipped == []
        later = list(al)  # the next pass: DataLoader's next epoch
        if in_order:
            assert_same_batches(later, want_next)
        assert al.stats().execution.mode is not Mode.THREADS
        # what was measured since: inline and processes, never threads
        assert {m.candidate.mode for m in ex.candidates} <= {Mode.INLINE, Mode.PROCESSES}


class SignalGuarded(Dataset):
    """Rows that install a signal handler while they load (a guard some libraries set
    up): ``signal.signal`` works only in the main thread."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        old = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        try:
            return torch.tensor([i]), i
        finally:
            signal.signal(signal.SIGUSR1, old)


def test_rows_that_only_the_main_thread_may_load_run_inline():
    assert threading.current_thread() is threading.main_thread()
    with AsyncLoader(SignalGuarded(), batch_size=4) as al:
        assert [int(i) for b in al for i in b[1]] == list(range(24))
        ex = al.stats().execution
        assert ex.thread_bound and ex.mode is not Mode.THREADS, str(ex)


def test_where_inline_may_not_run_a_thread_bound_data_set_goes_to_worker_processes(db):
    """A loader with a ``timeout`` never runs rows inline (a row the consumer loads
    cannot be timed out): the workers, forked from the consumer's thread, can."""
    want = dataloader_batches(SqliteRows(db))
    with AsyncLoader(SqliteRows(db), batch_size=4, shuffle=True, timeout=30,
                     multiprocessing_context="fork",
                     generator=torch.Generator().manual_seed(5)) as al:
        assert_same_batches(list(al), want)
        ex = al.stats().execution
        assert (ex.mode, ex.reason) == (Mode.PROCESSES, Reason.THREAD_BOUND)


@pytest.mark.parametrize("execution", ["inline", "processes"])
def test_a_thread_bound_data_set_loads_where_the_execution_fixed_keeps_it(db, execution):
    want = dataloader_batches(SqliteRows(db))
    with AsyncLoader(SqliteRows(db), batch_size=4, shuffle=True,
                     generator=torch.Generator().manual_seed(5), **on(execution)) as al:
        assert_same_batches(list(al), want)


def test_with_threads_fixed_by_the_user_the_failure_names_the_sample(db):
    ds = SqliteRows(db)
    with AsyncLoader(ds, batch_size=4, execution="threads") as al:
        with pytest.raises(SampleError, match=r"sample \d+ in batch 0 failed.*same thread"):
            list(al)
    here = threading.current_thread().name
    assert not [c for c in ds.calls if c[1] == here]  # nothing loaded again here


class Flaky(Dataset):
    """Row 3 fails the first time it is loaded, anywhere; every other row loads."""

    def __init__(self, n: int = 8) -> None:
        self.n, self.failed, self.calls = n, False, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.calls += 1
        if i == 3 and not self.failed:
            self.failed = True
            raise OSError("connection reset")
        return torch.tensor([i]), i


def auto_chooser() -> Chooser:
    return Chooser(Space(ladder=(threads(1), threads(2)), start=threads(2), cores=2,
                         process=processes(2)))


def failed_batch(ds: Dataset, rows: list[int], failed: dict[int, BaseException]) -> Batch:
    """A collated batch of ``rows`` whose rows ``failed`` failed elsewhere (as the
    consumer takes it: the loaded rows copied out)."""
    b = Batch(0, rows, BatchMode.COLLATE)
    b.failures = [(r, rows[r], e) for r, e in failed.items()]
    b.good_samples_host = [(idx, ds[idx]) for r, idx in enumerate(rows) if r not in failed]
    return b


def test_a_failure_that_passes_stands_and_the_execution_is_not_changed():
    """Row 3 failed in a decode thread, loads in the consumer's thread, and loads in
    a new thread too: a passing failure, not a data set bound to a thread."""
    ds, chooser = Flaky(), auto_chooser()
    with pytest.raises(OSError) as first:
        ds[3]
    b = failed_batch(ds, [0, 1, 2, 3], {3: first.value})
    good = list(b.good_samples_host)
    assert retry_here(b, ds, chooser) is False
    assert chooser.thread_bound is False and chooser._requested is None
    assert b.failures == [(3, 3, first.value)] and b.good_samples_host == good
    # decided for the loader's life: a later failure is not loaded again
    ds.failed = False
    with pytest.raises(OSError) as later:
        ds[3]
    b = failed_batch(ds, [3], {0: later.value})
    calls = ds.calls
    assert retry_here(b, ds, chooser) is False and ds.calls == calls  # not loaded again


def test_a_row_bound_to_the_consumers_thread_is_loaded_here_in_its_place(db):
    ds, chooser = SqliteRows(db, n=8), auto_chooser()
    errors: dict[int, BaseException] = {}
    for r in (1, 2):  # the rows that failed in a decode thread
        t = threading.Thread(target=lambda r=r: errors.setdefault(r, _raised(ds, r)))
        t.start()
        t.join()
    b = failed_batch(ds, [0, 1, 2, 3], errors)
    assert retry_here(b, ds, chooser) is True
    # threads leave the space; the search starts again from inline, measured
    assert chooser.thread_bound is True and chooser._requested == (INLINE, None)
    assert chooser.space is not None and chooser.space.ladder == ()
    assert chooser.exploring and chooser.record.windows == []
    assert b.failures == []
    assert [idx for idx, _ in b.good_samples_host] == [0, 1, 2, 3]
    assert [float(s[0]) for _, s in b.good_samples_host] == [0.0, 0.5, 1.0, 1.5]


def _raised(ds: Dataset, i: int) -> BaseException:
    try:
        ds[i]
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError(f"row {i} loaded in a thread of its own")


def test_a_row_bad_everywhere_is_skipped_and_later_bad_rows_are_not_loaded_again(db):
    free = SqliteRows(db, n=40, bad=(1, 17, 33))  # the same rows, any thread may read
    free.conn.close()
    free.conn = sqlite3.connect(db, check_same_thread=False)
    # (a timeout keeps the consumer from loading rows inline: its calls are retries)
    with AsyncLoader(free, batch_size=4, on_error="skip", timeout=30) as al:
        got = [int(x) for b in al for x in b[1]]
        assert got == [i for i in range(40) if i not in (1, 17, 33)]
        assert [s.index for s in al.stats().skipped] == [1, 17, 33]
        assert al.stats().execution.reason is not Reason.THREAD_BOUND
    # the first bad row (batch 0, loaded by the threads the loader starts on) was
    # loaded once more here, and failed: no check in a new thread; the later bad rows
    # are not loaded again here
    here = threading.current_thread().name
    assert [i for i, name in free.calls if name == here] == [1]
    assert not [c for c in free.calls if c[1] == "asyncfeed-thread-check"]


def test_a_thread_bound_search_keeps_what_runs_the_rows_faster_here_or_in_processes():
    """Without threads, inline and the workers forked from the consumer's thread are
    measured as any two candidates are: the workers stay only where they beat
    inline by the margin (replayed windows, the rows' CPU known)."""
    for inline_rate, proc_rate, want in ((1000.0, 1900.0, processes(2)),
                                         (1000.0, 1030.0, INLINE), (1000.0, 500.0, INLINE)):
        chooser = auto_chooser()
        chooser.without_threads()
        sp = chooser.space
        assert sp is not None and sp.ladder == () and sp.start == INLINE
        rec = Record()
        for _ in range(60):
            d = decide(rec, sp)
            if d.settled:
                break
            r = inline_rate if d.run is INLINE else proc_rate
            rec.windows.append(Window(d.run, round(r * 0.1), 0.1, 0.05, 0.1))
        assert d.settled and d.choice == want, (inline_rate, proc_rate, d)
        ran = {w.candidate for w in rec.windows}
        assert ran == {INLINE, processes(2)}, ran


def test_where_one_candidate_runs_rows_here_it_is_fixed_for_the_thread_bound_reason():
    """No worker processes (``execution="auto"`` with an async fetch, or they could not
    start): inline runs, fixed, nothing left to measure."""
    chooser = Chooser(Space(ladder=(threads(1), threads(2)), start=threads(2), cores=2))
    chooser.without_threads()
    assert chooser._requested == (INLINE, Reason.THREAD_BOUND)
