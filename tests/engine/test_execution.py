"""Where samples run: threads, or the process stage (``execution=``).

DataLoader is the oracle: batches are bit-identical whichever execution runs,
including a switch from threads to processes mid-pass.  A worker that dies is
an error naming its samples, never a hang, and nothing (no process, no
``/dev/shm`` file) outlives the loader.
"""

from __future__ import annotations

import gc
import glob
import itertools
import math
import os
import pickle
import threading
import time

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from asyncfeed import AsyncLoader, SampleError, WorkerCrashedError
from asyncfeed._engine import processes
from asyncfeed._engine.processes import stage as stage_mod, taskrows
from asyncfeed._engine.policy import INLINE, Mode, Reason
from asyncfeed._engine.policy import processes as processes_n
from asyncfeed._engine.policy import threads as threads_n
from asyncfeed._engine.tasksize import RowCost
from support.oracle import MixedFixed, TupleFixed, assert_parity, assert_same_batches

CONTEXTS = ["fork", "forkserver", "spawn"]


def _shm_files() -> list[str]:
    return glob.glob(f"/dev/shm/asyncfeed-{os.getpid()}-*")


def _children() -> list[psutil.Process]:
    return [c for c in psutil.Process().children(recursive=True)
            if c.status() != psutil.STATUS_ZOMBIE and "forkserver" not in " ".join(
                c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]


@pytest.fixture(autouse=True)
def nothing_left():
    before = set(_shm_files())
    yield
    assert set(_shm_files()) <= before, "shared-memory files outlived the loader"
    left = [c for c in _children()]
    assert not left, f"processes outlived the loader: {left}"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("asyncfeed-")]


class Shapes:
    """Fixed shapes for the first 32 samples, another shape after (batch 16)."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        side = 4 if i < 32 else 3
        return np.full((side, side), i, np.int32), i % 3


@pytest.mark.parametrize("context", CONTEXTS)
def test_processes_give_dataloaders_batches_with_every_start_method(context):
    assert_parity(TupleFixed(120), batch_size=16, shuffle=True, execution="processes",
                  multiprocessing_context=context)


@pytest.mark.parametrize("ds,shuffle", [(MixedFixed(45), True), (Shapes(), False)],
                         ids=["mixed", "shapes-change"])
def test_processes_give_dataloaders_batches_for_any_sample(ds, shuffle):
    assert_parity(ds, batch_size=16, shuffle=shuffle, execution="processes")


class FrozenCount:
    """Each sample: how many objects its process's garbage collector has frozen
    (``gc.get_freeze_count()``)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return gc.get_freeze_count()


@pytest.mark.parametrize("context", CONTEXTS)
def test_a_worker_s_collections_skip_what_it_started_with(context):
    """A worker freezes the objects it holds when it starts (``gc.freeze``): what a
    forked worker inherited, or what a spawned one imported and unpickled.  A full
    collection walks every tracked object and writes to each one's header, which in
    a forked worker copies the pages it shares with the loader's process (over 100k
    objects once torch is imported); frozen, they are never walked.  The loader's
    own process is left as it is."""
    before = gc.get_freeze_count()
    with AsyncLoader(FrozenCount(), batch_size=4, execution="processes", num_workers=2,
                     multiprocessing_context=context) as loader:
        frozen = torch.cat(list(loader))
    assert len(frozen) == 8 and int(frozen.min()) > 1000
    assert gc.get_freeze_count() == before


class Dtypes:
    """Tensors of many dtypes (and a view that is not contiguous), their shape
    changing every batch of 8: rows that do not fit the first batch's layout come
    back pickled."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        n = 1 + (i // 8) % 3
        return {"u8": torch.full((n, 2), i, dtype=torch.uint8),
                "bf16": torch.full((n,), i / 3, dtype=torch.bfloat16),
                "bool": torch.tensor(i % 2 == 0),
                "c64": torch.full((n,), complex(i, -i), dtype=torch.complex64),
                "view": torch.arange(4 * n).view(n, 4).t()[1:] + i,
                "i64": torch.tensor(i),
                "empty": torch.zeros(0, n),
                "np": np.full(n, i, np.float64)}


def test_pickled_rows_of_any_dtype_arrive_as_dataloader_gives_them():
    assert_parity(Dtypes(), batch_size=8, shuffle=False, execution="processes")


@pytest.mark.parametrize("t", [
    torch.randint(0, 255, (3, 8, 8), dtype=torch.uint8), torch.tensor(3),
    torch.tensor([True, False]), torch.randn(4, 5).to(torch.bfloat16),
    torch.randn(3, dtype=torch.complex64), torch.empty(0, 3), torch.randn(5)[2:],
    torch.tensor(2.5, dtype=torch.float16)], ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_a_plain_tensor_goes_back_as_its_bytes(t):
    """Not through a file descriptor shared with the worker's resource sharer, nor
    through torch's own pickling (both far dearer for a sample)."""
    data = processes.dumps_results((7, [t]))
    assert b"rebuild_storage" not in bytes(data) and b"_rebuild_tensor" not in bytes(data)
    got = pickle.loads(data)[1][0]
    assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.stride()
    assert torch.equal(got, t)


@pytest.mark.parametrize("t", [torch.randn(4, 6)[:, ::2], torch.randn(2, requires_grad=True)],
                         ids=["strided-view", "requires-grad"])
def test_other_tensors_go_back_as_multiprocessing_pickles_them(t):
    got = pickle.loads(processes.dumps_results((7, [t])))[1][0]
    assert got.stride() == t.stride() and got.requires_grad == t.requires_grad
    assert torch.equal(got.detach(), t.detach())


def test_the_travel_cost_is_the_least_of_the_rows_that_travel():
    from asyncfeed._engine.processes.transport import travel_cost
    small = {"i": 1}
    big = {"blob": torch.zeros(1 << 22, dtype=torch.uint8)}
    assert travel_cost([]) is None
    assert travel_cost([lambda: None]) is None  # cannot be pickled: no bound
    one = travel_cost([small])
    assert one is not None and min(one) >= 0
    alone = travel_cost([big])
    both = travel_cost([big, small, lambda: None])
    assert alone is not None and both is not None
    assert both[0] <= alone[0] and both[1] <= alone[1]
    # within a budget the first rows tell: big rows are not all round-tripped
    calls = []

    class Counted:
        def __reduce__(self):
            calls.append(1)
            return (dict, ())

    assert travel_cost([big, Counted(), Counted()], budget_s=0.0) is not None and not calls


def _worker_rows(layout, rows, tmp_path):
    """A worker's view (``worker._Rows``) of a fresh segment for ``rows`` rows."""
    from asyncfeed._engine.processes import worker
    from asyncfeed._engine.processes.shm import open_segment, segment_plan
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = str(tmp_path / "segment")
    _, size = segment_plan(layout, rows)
    open_segment(path, size, create=True).close()
    return worker._Rows(path, layout, rows)


@pytest.mark.parametrize("make", [
    lambda i: (torch.full((3, 4, 4), i, dtype=torch.uint8), torch.tensor(i)),
    lambda i: (np.full((2, 3), i / 7, np.float32), i, i % 2 == 0),
    lambda i: {"x": torch.full((5,), i, dtype=torch.int16), "y": i * 0.5},
], ids=["tensors", "arrays-and-scalars", "dict"])
def test_a_workers_run_of_small_rows_goes_in_at_once_with_the_bytes_of_one_by_one(
        make, tmp_path):
    """A worker writes a task's small rows in one go (``_Rows.write_run``): the
    bytes are those of writing them one at a time; a run with a row that does not
    fit is declined whole (its rows are then written one by one, or go back
    pickled)."""
    from asyncfeed._memory.layout import Layout
    samples = [make(i) for i in range(8)]
    layout = Layout.infer(samples[0])
    a, b = _worker_rows(layout, 8, tmp_path / "a"), _worker_rows(layout, 8, tmp_path / "b")
    try:
        assert a.writer is not None
        assert a.write_run(2, samples[2:7])
        for row in range(2, 7):
            assert b.write(row, samples[row])
        assert all(np.array_equal(x, y) for x, y in zip(a.views, b.views))
        bad = make(0)
        bad = (bad[0][:1], *bad[1:]) if isinstance(bad, tuple) else {**bad, "x": bad["x"][:2]}
        assert not a.write_run(0, samples[:3] + [bad])
    finally:
        a.close()
        b.close()


def test_a_run_of_rows_written_at_once_goes_back_as_one_result(tmp_path):
    """A worker's run of rows written together is one result (``(first, "w",
    end)``), not one a row: one tuple to pickle, send and read back however long
    the run; a row that does not fit goes back pickled, and the loader's side
    marks every written row."""
    from asyncfeed._engine.batch import WRITTEN
    from asyncfeed._engine.processes import worker
    from asyncfeed._memory.layout import Layout
    samples = [(torch.full((4,), i, dtype=torch.int32), i) for i in range(8)]
    layout = Layout.infer(samples[0])
    rows = _worker_rows(layout, 8, tmp_path)
    misfit = (torch.zeros(5, dtype=torch.int32), 4)
    held = [(r, samples[r]) for r in (0, 1, 2)] + [(4, misfit)] \
        + [(r, samples[r]) for r in (6, 7)]
    out: list = []
    try:
        worker._write_held(rows, held, out)
    finally:
        rows.close()
    assert out == [(0, "w", 3), (4, "s", misfit), (6, "w", 8)]

    class Host:
        stopping = False

        def __init__(self) -> None:
            self.done: list = []
            self.rows = self

        def place(self, b, row, sample) -> None:
            b.samples[row] = sample

        def rows_done(self, b, lo, hi) -> None:
            self.done.append((lo, hi))

    class Rows:
        samples = [None] * 8

    host, b = Host(), Rows()
    taskrows.apply_results(host, b, 0, 8, out)
    assert b.samples == [WRITTEN] * 3 + [None, misfit, None] + [WRITTEN] * 2
    assert host.done == [(0, 8)]


def test_a_worker_writes_big_rows_one_by_one_as_they_come(tmp_path):
    from asyncfeed._engine.rowwrite import BULK_ROW_BYTES
    from asyncfeed._memory.layout import Layout
    side = int((BULK_ROW_BYTES // 3) ** 0.5) + 1
    layout = Layout.infer((torch.zeros((3, side, side), dtype=torch.uint8), 0))
    rows = _worker_rows(layout, 2, tmp_path)
    try:
        assert rows.writer is None
        assert not rows.write_run(0, [(torch.zeros((3, side, side), dtype=torch.uint8), 0)])
    finally:
        rows.close()


def test_rows_reach_shared_memory_not_pickles():
    with AsyncLoader(TupleFixed(96, shape=(3, 16, 16)), batch_size=16,
                     execution="processes") as al:
        it = iter(al)
        batches = [next(it) for _ in range(3)]
        stage = al._exec.stage
        assert stage is not None and stage.usable
        files = _shm_files()
        assert files, "no batch buffer lives in shared memory"
        rest = list(it)
        ex = al.stats().execution
        assert (ex.mode, ex.count, ex.reason) == (Mode.PROCESSES, 2, Reason.FIXED), str(ex)
    want = list(DataLoader(TupleFixed(96, shape=(3, 16, 16)), batch_size=16))
    assert_same_batches(batches + rest, want)


def test_switch_to_processes_mid_pass_keeps_batches_identical():
    ds = TupleFixed(200)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    want = list(DataLoader(ds, batch_size=8, shuffle=True, generator=g2))
    got = []
    with AsyncLoader(ds, batch_size=8, shuffle=True, generator=g1) as al:
        for k, batch in enumerate(al):
            got.append(batch)
            if k == 4:  # as the chooser does once processes measured faster
                al._chooser.request(processes_n(2))
        ex = al.stats().execution
        assert (ex.mode, ex.count) == (Mode.PROCESSES, 2), str(ex)
    assert_same_batches(got, want)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_switches_into_and_out_of_inline_mid_pass_keep_collated_batches_identical():
    """Collated batches, rows switched mid-pass from threads to inline (the consumer
    then loads each batch itself when it asks for it), to threads, to processes and
    back to inline: the batches DataLoader yields, each sample once, the plan's
    generator left where DataLoader leaves it."""
    def collate(batch):
        return {"img": torch.stack([s["img"] for s in batch]),
                "names": [s["name"] for s in batch]}

    ds = MixedFixed(240)
    want = list(DataLoader(ds, batch_size=6, shuffle=True, collate_fn=collate,
                           generator=(g2 := torch.Generator().manual_seed(3))))
    switches = {3: INLINE, 9: threads_n(2), 15: processes_n(2), 22: INLINE}
    got = []
    with AsyncLoader(ds, batch_size=6, shuffle=True, collate_fn=collate,
                     generator=(g1 := torch.Generator().manual_seed(3)),
                     multiprocessing_context="fork") as al:
        for k, batch in enumerate(al):
            got.append(batch)
            if k in switches:
                al._chooser.request(switches[k])
        ex = al.stats().execution
        assert ex.mode is Mode.INLINE, str(ex)
    assert_same_batches(got, want)
    assert torch.equal(g1.get_state(), g2.get_state())


class CountedBy:
    """Each sample: its index, the worker count of the process that loaded it (0 in
    the loader's process) and that process's pid."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int):
        info = get_worker_info()
        return torch.tensor([i, info.num_workers if info is not None else 0, os.getpid()])


def test_rows_move_between_worker_counts_mid_pass_each_sample_once():
    """Rows switched mid-pass from two workers to four (a stage of their own, two
    more processes), back to two (the same workers again) and to threads: every
    sample once, in DataLoader's order; each stage's workers say their own count.
    The next pass starts on threads: every worker is stopped."""
    switches = {1: processes_n(2), 5: processes_n(4), 11: processes_n(2), 16: threads_n(2)}
    got = []
    with AsyncLoader(CountedBy(), batch_size=4, multiprocessing_context="fork") as al:
        for k, batch in enumerate(al):
            got.append(batch)
            if k in switches:
                al._chooser.request(switches[k])
        rows = torch.cat(got)
        assert rows[:, 0].tolist() == list(range(96))
        counts = rows[:, 1].tolist()
        assert {2, 4} <= set(counts), counts
        assert counts.index(4) < len(counts) - 1 - counts[::-1].index(2)  # 2 again after 4
        by_count = {n: {pid for c, pid in zip(counts, rows[:, 2].tolist()) if c == n}
                    for n in (2, 4)}
        assert len(by_count[2]) <= 2 and len(by_count[4]) <= 4
        assert not by_count[2] & by_count[4]
        workers = [p for s in (al._exec.stage, *al._exec._parked.values()) if s is not None
                   for p in s._workers]
        assert len(workers) == 6 and all(p.is_alive() for p in workers)
        pids = [p.pid for p in workers]
        assert al.stats().execution.candidate == threads_n(2)
        assert len(list(al)) == 24
        assert al._exec.stage is None and not al._exec._parked
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


class Spins:
    """Samples that spin the CPU for about ``ms`` milliseconds each."""

    def __init__(self, n: int, ms: float) -> None:
        self.n, self.ms = n, ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        end = time.process_time() + self.ms / 1e3
        while time.process_time() < end:
            pass
        return torch.tensor([i])


def test_the_pass_counts_the_cpu_its_workers_took_on_its_rows():
    """What the execution chooser reads of worker processes: the CPU they took on the
    pass's rows, reported with each task (at least the time the rows spun)."""
    with AsyncLoader(Spins(40, 2.0), batch_size=8, execution="processes",
                     num_workers=2) as al:
        it = iter(al)
        rows = torch.cat(list(it))
        assert rows.flatten().tolist() == list(range(40))
        assert it._p.workers_cpu() >= 40 * 2.0e-3


def test_twice_the_workers_that_cannot_start_leave_the_running_workers_usable(monkeypatch):
    """A stage of another count that fails to start (here: four workers) is out by
    itself; the two workers already running stay usable, and processes do not
    count as failed."""
    from asyncfeed._engine.processes.execution import Execution
    from asyncfeed._engine.processes.stage import ProcessStage
    start = ProcessStage.start

    def refuse_four(self, quiet=None):
        if self.num_workers == 4:
            raise OSError("no memory for four more")
        return start(self, quiet)
    monkeypatch.setattr(ProcessStage, "start", refuse_four)
    ex = Execution("auto", TupleFixed(16), 2, "fork", None, 1 << 20)
    try:
        two = ex.stage_for(0, None, 2)
        assert two is not None and two.usable
        assert ex.stage_for(0, None, 4) is None
        assert ex.failed is None
        assert ex.stage_for(0, None, 2) is two and two.usable
    finally:
        ex.close()
    assert not two.usable


def test_state_taken_under_processes_resumes_under_threads():
    ds = TupleFixed(120)
    want = list(DataLoader(ds, batch_size=8, shuffle=True,
                           generator=torch.Generator().manual_seed(9)))
    with AsyncLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(9),
                     execution="processes") as al:
        it = iter(al)
        head = [next(it) for _ in range(4)]
        state = al.state_dict()
    with AsyncLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(9),
                     execution="threads") as al2:
        al2.load_state_dict(state)
        tail = list(al2)
    assert_same_batches(head + tail, want)


class WorkerInfo:
    """Samples that say which worker loaded them; worker_init_fn leaves a file."""

    def __init__(self, n: int, folder: str) -> None:
        self.n, self.folder = n, folder

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        assert info is not None and info.dataset is not None
        return torch.tensor([info.id, info.num_workers, info.seed - info.id, os.getpid()])


def _init(folder: str, worker_id: int) -> None:
    with open(os.path.join(folder, f"w{worker_id}"), "w") as f:
        f.write(str(get_worker_info().id))


@pytest.mark.parametrize("context", ["fork"])
def test_worker_init_fn_and_get_worker_info_as_in_dataloader(tmp_path, context):
    import functools
    ds = WorkerInfo(40, str(tmp_path))
    with AsyncLoader(ds, batch_size=4, num_workers=3, execution="processes",
                     multiprocessing_context=context,
                     worker_init_fn=functools.partial(_init, str(tmp_path))) as al:
        rows = torch.cat(list(al))
    assert set(rows[:, 0].tolist()) <= {0, 1, 2}
    assert set(rows[:, 1].tolist()) == {3}
    assert len(set(rows[:, 2].tolist())) == 1          # seed = base_seed + worker id
    assert os.getpid() not in set(rows[:, 3].tolist())
    assert sorted(os.listdir(tmp_path)) == ["w0", "w1", "w2"]
    assert (tmp_path / "w2").read_text() == "2"
    assert get_worker_info() is None                    # not in the loader's process


class Dies:
    """Sample ``bad`` kills its worker: ``how`` is "exit" (os._exit) or "segv"."""

    def __init__(self, n: int, bad: int, how: str) -> None:
        self.n, self.bad, self.how = n, bad, how

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.bad:
            if self.how == "exit":
                os._exit(3)
            import ctypes
            import faulthandler
            faulthandler.disable()  # pytest's, inherited: no "Fatal Python error" in the log
            ctypes.string_at(0)  # a segfault
        return torch.full((4,), i)


@pytest.mark.parametrize("how,why", [("exit", "exited with code 3"),
                                     ("segv", "killed by signal SIGSEGV")])
def test_a_dead_worker_is_an_error_naming_its_samples(how, why):
    with AsyncLoader(Dies(64, 21, how), batch_size=8, execution="processes") as al:
        with pytest.raises(SampleError) as e:
            list(al)
    cause = e.value.__cause__
    assert isinstance(cause, WorkerCrashedError)
    assert why in str(cause) and "21" in str(cause)


class SlowFirstWorker:
    """Sample ``i`` is ``[i, worker id]``; worker 0 takes 0.1 s a row, worker 1 none."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        info = get_worker_info()
        wid = info.id if info is not None else -1
        if wid == 0:
            time.sleep(0.1)
        return torch.tensor([i, wid])


def test_tasks_wait_for_a_free_worker_not_in_a_slow_ones_queue():
    """Once the layout is known (after the first batch) every other batch is in
    flight at once (prefetch 8, 8 batches); a worker holds at most
    ``WORKER_DEPTH`` tasks, so the slow one does a few rows and the fast one the
    rest.  Shared out as they were submitted, half the pass (about 30 rows, 3 s)
    waited in the slow worker's queue."""
    assert stage_mod.WORKER_DEPTH == 2
    with AsyncLoader(SlowFirstWorker(), batch_size=8, prefetch=8,
                     execution="processes") as al:
        got = list(al)
    rows = torch.cat(got)
    assert rows[:, 0].tolist() == list(range(64))  # DataLoader's order, no row lost
    by_slow = int((rows[:, 1] == 0).sum())
    # 2-row tasks: two of the first batch, two more as the rest arrive, perhaps one more
    assert by_slow <= 10, f"the slow worker ran {by_slow} of 64 rows"


class DiesSlowly(Dies):
    """``Dies`` whose rows take 20 ms in a worker: tasks still wait in the stage's
    backlog when sample ``bad`` kills its worker."""

    def __getitem__(self, i: int):
        if get_worker_info() is not None:
            time.sleep(0.02)
        return super().__getitem__(i)


def test_a_dead_worker_fails_only_what_it_held_the_waiting_tasks_run():
    """A worker dies with tasks still waiting in the stage's backlog: the rows it
    held are skipped (and named), every other row is delivered (the backlog goes to
    the threads), in DataLoader's order."""
    with AsyncLoader(DiesSlowly(64, 21, "exit"), batch_size=8, prefetch=8,
                     execution="processes", on_error="skip", timeout=20) as al:
        got = list(al)
        st = al.stats()
        deadline = time.monotonic() + 2.0  # the pass is over: so is the results thread
        while any(t.name == "asyncfeed-proc-results" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the results thread outlived the pass"
            time.sleep(0.01)
    skipped = [s.index for s in st.skipped]
    # it held WORKER_DEPTH tasks of at most half a batch (4 rows) each
    assert 21 in skipped and len(skipped) <= stage_mod.WORKER_DEPTH * 4, skipped
    assert all(s.error_type == "WorkerCrashedError" for s in st.skipped), st.skipped
    delivered = torch.cat(got)[:, 0].tolist()
    assert delivered == [i for i in range(64) if i not in skipped]
    assert st.execution is not None and st.execution.mode is Mode.THREADS
    assert st.execution.processes_skipped is Reason.UNAVAILABLE, st.execution


class Raises:
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int):
        if i == 13:
            raise KeyError(f"no label for {i}")
        return torch.zeros(2)


def test_an_exception_in_a_worker_keeps_its_type_and_traceback():
    with AsyncLoader(Raises(), batch_size=5, execution="processes") as al:
        with pytest.raises(KeyError) as e:
            list(al)
    assert isinstance(e.value, SampleError) and e.value.index == 13
    assert type(e.value.__cause__) is KeyError and e.value.__cause__.args == ("no label for 13",)
    tb = str(e.value).split("Original Traceback (most recent call last):\n")[1]
    assert 'raise KeyError(f"no label for {i}")' in tb and "in __getitem__" in tb, tb


class NeedsTwoArgs(Exception):
    def __init__(self, a: str, b: int) -> None:  # pickle calls cls(*args): args is (msg,)
        super().__init__(f"{a}/{b}")


class HoldsALock(Exception):
    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.lock = threading.Lock()  # cannot be pickled


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this sample cannot be pickled")


class FailsOddly:
    """Sample 3's exception cannot be rebuilt from its pickle, 6's cannot be pickled,
    9's sample cannot be pickled."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        if i == 3:
            raise NeedsTwoArgs("bad", 3)
        if i == 6:
            raise HoldsALock("bad 6")
        if i == 9:
            return Unpicklable()
        return torch.zeros(2)


def test_what_cannot_travel_from_a_worker_is_an_error_naming_the_sample():
    """An exception that cannot be sent as it is arrives as an AsyncFeedError with
    its type, message and traceback; a sample that cannot be pickled fails its
    rows, never the results thread (no hang), and the rest of the pass is loaded."""
    with AsyncLoader(FailsOddly(), batch_size=1, execution="processes", on_error="skip",
                     timeout=30) as al:
        got = list(al)
        skipped = {s.index: s.error for s in al.stats().skipped}
    assert sorted(skipped) == [3, 6, 9], skipped
    assert "NeedsTwoArgs: bad/3" in skipped[3] and "HoldsALock: bad 6" in skipped[6], skipped
    assert "cannot be pickled" in skipped[9], skipped
    assert len(got) == 9
    with AsyncLoader(FailsOddly(), batch_size=3, execution="processes", timeout=30) as al:
        it = iter(al)
        next(it)
        with pytest.raises(SampleError) as e:
            next(it)
    assert e.value.index == 3 and "NeedsTwoArgs: bad/3" in str(e.value)
    assert 'raise NeedsTwoArgs("bad", 3)' in str(e.value), str(e.value)


def test_bad_arguments_are_errors_at_construction():
    with pytest.raises(ValueError, match="execution"):
        AsyncLoader(TupleFixed(4), execution="gpu")
    with pytest.raises(ValueError, match="multiprocessing_context"):
        AsyncLoader(TupleFixed(4), execution="processes", multiprocessing_context="nope")


def test_threads_never_start_processes():
    with AsyncLoader(TupleFixed(40), batch_size=8, execution="threads") as al:
        assert al._chooser.space is not None and al._chooser.space.process is None
        list(al)
        assert al._exec.stage is None and al.stats().execution.mode is Mode.THREADS


@pytest.mark.parametrize("n,workers,row_cost,ahead,expect", [
    (32, 2, None, 1, 8),        # no measurement yet: half a worker's share
    (32, 2, 0.0, 4, 8),
    (32, 2, 0.007, 4, 8),       # 7 ms rows: 50 ms of work is 8 rows
    (32, 2, 0.001, 4, 32),      # cheap rows, enough batches in flight: the whole batch
    (32, 2, 0.001, 1, 8),       # ... one batch in flight: cut to fill both workers' tasks
    (33, 2, 0.0001, 1, 9),      # ... rounded up
    (32, 2, 0.2, 4, 1),         # rows dearer than the target: one per task
    (5, 8, 0.001, 1, 1),        # more workers than rows
    (128, 1, 0.0005, 2, 100),   # one worker: the target alone bounds it
    (64, 16, 25e-6, 32, 64),    # tiny rows on 16 workers, 32 batches in flight: a batch each
    (64, 16, 25e-6, 3, 6),      # ... a user's prefetch of 3: runs that reach every worker
])
def test_a_task_for_a_worker_holds_about_fifty_ms_of_rows(n, workers, row_cost, ahead, expect):
    assert taskrows.PROCESS_TASK_S == 0.05 and taskrows.WORKER_DEPTH == 2
    assert processes.rows_per_process_task(n, workers, row_cost, ahead) == expect


@pytest.mark.parametrize("n,workers,row_cost,expect", [
    (64, 16, 25e-6, 32),     # tiny rows: a batch a task, two tasks a worker
    (32, 16, 0.003, 17),     # 3 ms rows: 17-row tasks, 34 rows a worker
    (128, 2, 0.00016, 4),
    (32, 96, 0.2, 6),        # dear rows: one a task, two a worker
    (64, 96, 25e-6, 192),    # tiny rows on 96 workers: two batches a worker, uncapped
    (32, 16, None, 1),       # nothing measured yet
])
def test_the_batches_in_flight_fill_every_workers_tasks(n, workers, row_cost, expect):
    fill = taskrows.batches_to_fill(n, workers, row_cost)
    assert fill == expect
    if row_cost:
        # and at that many batches, the tasks are the full 50 ms (or the batch)
        k = processes.rows_per_process_task(n, workers, row_cost, fill)
        assert k == min(n, math.ceil(taskrows.PROCESS_TASK_S / row_cost))


class CheapRows:
    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int):
        return torch.tensor([i])


@pytest.mark.parametrize("prefetch", [None, 2])
def test_worker_processes_keep_as_many_batches_in_flight_as_fill_them(monkeypatch, prefetch):
    """Under worker processes and the default prefetch (sized for threads), the pass
    keeps enough batches outstanding to give every worker its tasks; a prefetch
    the user gave stays the bound."""
    from asyncfeed._engine import pipeline as pipeline_mod
    seen: list[int] = []
    real = pipeline_mod.Pipeline.ahead

    def ahead(self):
        n = real(self)
        seen.append(n)
        return n
    monkeypatch.setattr(pipeline_mod.Pipeline, "ahead", ahead)
    kw = {} if prefetch is None else {"prefetch": prefetch}
    with AsyncLoader(CheapRows(), batch_size=8, execution="processes", num_workers=2,
                     **kw) as al:
        for _ in range(2):
            assert torch.cat(list(al)).view(-1).tolist() == list(range(512))
        bound = al.prefetch
    if prefetch is None:
        # 8 cheap rows a batch: a task is the batch, and each worker holds two
        assert bound < max(seen) == 2 * taskrows.WORKER_DEPTH, (max(seen), bound)
    else:
        assert max(seen) == bound == 2


def test_a_workers_task_is_sized_by_what_rows_take_in_the_workers():
    """Before any task came back, the least of the threads' figures (their wall
    time carries GIL waits); then the workers' own measure of their rows."""
    stage = processes.ProcessStage(TupleFixed(8), 2, None, None, 0, 2)
    try:
        assert stage.row_cost(None) is None
        threads = RowCost()
        threads.cpu_s, threads.wall_s = 0.007, 0.025
        assert stage.row_cost(threads) == 0.007
        only_wall = RowCost()
        only_wall.wall_s = 0.025
        assert stage.row_cost(only_wall) == 0.025
        stage.row_s = 0.004
        assert stage.row_cost(threads) == 0.004
    finally:
        stage.close()


class Sleeps:
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        time.sleep(0.01)
        return torch.tensor([i])


def test_the_stage_measures_its_rows_in_the_workers():
    with AsyncLoader(Sleeps(), batch_size=8, execution="processes") as al:
        assert torch.cat(list(al)).view(-1).tolist() == list(range(24))
        stage = al._exec.stage
        assert stage is not None and stage.row_s is not None
        assert 0.01 <= stage.row_s < 1.0, stage.row_s  # each row sleeps 10 ms


def test_once_the_plan_ran_out_the_backlog_goes_in_shrinking_pieces():
    from types import SimpleNamespace
    stage = processes.ProcessStage(TupleFixed(8), 2, None, None, 0, 2)
    try:
        going, done = SimpleNamespace(exhausted=False), SimpleNamespace(exhausted=True)
        for tid, rows in enumerate((8, 8, 8)):  # 24 rows wait besides the one sent now
            stage._pending[tid] = (done, None, 0, rows, -1, 0.0)
            stage._backlog.append((tid, None))
        assert stage_mod.TAIL_SHARE == 0.5
        assert stage._tail_piece(going, 8) == 8        # more batches will come
        assert stage._tail_piece(done, 8) == 8         # 32 rows left: 8 a worker
        stage._backlog.pop(), stage._backlog.pop()
        assert stage._tail_piece(done, 8) == 4         # 16 left: 4
        stage._backlog.clear()
        assert stage._tail_piece(done, 3) == 1         # 3 left: 1 (never 0)
        stage._dead.add(1)
        assert stage._tail_piece(done, 8) == 4         # one live worker: half of 8
    finally:
        stage.close()


class SleepsLong(Sleeps):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        time.sleep(0.005)
        return torch.tensor([i, i % 7])


def test_the_tail_split_in_pieces_keeps_dataloaders_batches(monkeypatch):
    real, split = processes.ProcessStage._tail_piece, []

    def counting(self, p, rows):
        piece = real(self, p, rows)
        if piece < rows:
            split.append((rows, piece))
        return piece

    monkeypatch.setattr(processes.ProcessStage, "_tail_piece", counting)
    ds = SleepsLong()
    with AsyncLoader(ds, batch_size=16, prefetch=4, execution="processes", timeout=30) as al:
        got = list(al)
    assert split, "no task was split at the end of the pass"
    assert_same_batches(got, list(DataLoader(ds, batch_size=16)))


def test_rows_the_stage_cannot_take_mid_batch_run_in_threads(monkeypatch):
    """A stage that stops taking rows part way through a batch (it broke): the rest
    of that batch runs in the threads, and the batches are still DataLoader's."""
    real = processes.ProcessStage.submit
    calls = {"n": 0, "refused": 0}

    def flaky(self, p, b, lo, hi, path):
        calls["n"] += 1
        if lo > 0 and calls["n"] % 3 == 0:  # never a batch's first run: mid-batch only
            calls["refused"] += 1
            return False
        return real(self, p, b, lo, hi, path)

    monkeypatch.setattr(processes.ProcessStage, "submit", flaky)
    ds = TupleFixed(96)
    # a row lost on the way fails the wait (LoaderTimeout), not the test run
    with AsyncLoader(ds, batch_size=16, execution="processes", timeout=30) as al:
        got = list(al)
    assert calls["refused"] > 0
    assert_same_batches(got, list(DataLoader(ds, batch_size=16)))


def test_num_workers_sets_the_process_candidates_workers_and_stats_say_so():
    """DataLoader's ``num_workers`` is the process candidate's worker count (0: the
    cores, with twice the cores as the rung above); ``stats().execution`` reports
    the count that ran."""
    import os
    with AsyncLoader(TupleFixed(48), batch_size=8, num_workers=3) as al:
        assert al._chooser.space is not None
        assert al._chooser.space.process == processes_n(3)
        assert al._chooser.space.more_processes is None  # the user's count: no rung above
    with AsyncLoader(TupleFixed(48), batch_size=8) as al:
        cores = len(os.sched_getaffinity(0))
        assert al._chooser.space.process == processes_n(cores)
        assert al._chooser.space.more_processes == processes_n(2 * cores)
    with AsyncLoader(TupleFixed(48), batch_size=8, num_workers=3,
                     execution="processes") as al:
        list(al)
        ex = al.stats().execution
    assert (ex.mode, ex.count, ex.reason) == (Mode.PROCESSES, 3, Reason.FIXED), str(ex)
    assert str(ex) == "processes: 3 worker processes (chosen by the loader's arguments)"


def test_a_loader_with_a_timeout_never_chooses_inline():
    """A row the consumer loads itself cannot be timed out: with ``timeout`` set the
    measured choice leaves inline out (DataLoader's ``num_workers=0`` ignores it too)."""
    with AsyncLoader(TupleFixed(8), batch_size=4, timeout=5) as al:
        assert al._chooser.space is not None and not al._chooser.space.inline
        assert INLINE not in al._chooser.space.rungs()
    with AsyncLoader(TupleFixed(8), batch_size=4) as al:
        assert al._chooser.space is not None and al._chooser.space.inline


# --------------------------------------------- a user's collate_fn in the workers
class Records:
    """Dict samples (a tensor, a string id); rows in ``bad`` raise KeyError."""

    def __init__(self, n: int = 256, bad: tuple[int, ...] = ()) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i in self.bad:
            raise KeyError(f"no record {i}")
        return {"x": torch.full((3,), i), "id": f"r{i}"}


class SlowRecords(Records):
    """:class:`Records` whose rows each wait 0.5 ms (the GIL released): a pass of
    2,048 of them lasts a few tenths of a second however fast the machine, long
    enough for the chooser to read its windows."""

    def __getitem__(self, i: int):
        time.sleep(0.0005)
        return super().__getitem__(i)


def collate_records(samples):
    """A user's collate_fn: stacks the tensors, lists the ids, says where it ran;
    refuses a batch that holds record 133."""
    ids = [s["id"] for s in samples]
    if "r133" in ids:
        raise ValueError("batch with r133 refused")
    return {"x": torch.stack([s["x"] for s in samples]), "ids": ids, "pid": os.getpid()}


def collate_plain(samples):
    return {"x": torch.stack([s["x"] for s in samples]), "ids": [s["id"] for s in samples]}


def _content(batches):
    return [(b["x"].tolist(), b["ids"]) for b in batches]


def test_workers_collate_whole_batches_with_the_users_collate_fn():
    """As DataLoader's workers do: once a worker's task is a whole batch, the worker
    runs the user's collate_fn and sends the batch; the batches are DataLoader's."""
    ds = Records(128)
    ref = _content(DataLoader(ds, batch_size=8, collate_fn=collate_records))
    with AsyncLoader(ds, batch_size=8, execution="processes", num_workers=2,
                     collate_fn=collate_records) as al:
        passes = [list(al) for _ in range(2)]
        assert al._exec.stage.collate is collate_records
    assert [_content(p) for p in passes] == [ref, ref]
    here = [b["pid"] == os.getpid() for b in passes[1]]
    # the first batch of a pass, and the last pieces of its tail, may be cut smaller
    assert here.count(False) >= len(here) // 2, here


@pytest.mark.parametrize("execution", ["threads", "processes"])
def test_a_failing_row_or_collate_fn_fails_its_batch_on_every_execution(execution):
    """A row that raises fails its batch with a SampleError naming it, and a
    collate_fn that raises fails its batch with that error: the same with workers
    collating (they send the rows back instead) as with threads."""
    kw = dict(batch_size=8, execution=execution, collate_fn=collate_records)
    with AsyncLoader(Records(bad=(77,)), **kw) as al:
        it = iter(al)
        assert [b["ids"][0] for b in itertools.islice(it, 9)] == [f"r{8 * k}" for k in range(9)]
        with pytest.raises(KeyError) as e:
            next(it)
        assert isinstance(e.value, SampleError) and e.value.index == 77
    with AsyncLoader(Records(), **kw) as al:
        it = iter(al)
        assert len(list(itertools.islice(it, 16))) == 16
        with pytest.raises(ValueError, match="batch with r133 refused"):
            next(it)


def test_skipped_rows_under_workers_give_the_batches_threads_give():
    """on_error="skip": a batch is re-made of the next good rows, so the workers
    send rows, never a batch of their own; the batches are those of threads."""
    ds = Records(128, bad=(3, 50, 51, 127))

    def run(execution: str):
        with AsyncLoader(ds, batch_size=8, execution=execution, on_error="skip",
                         collate_fn=collate_records) as al:
            return [_content(list(al)) for _ in range(2)]
    assert run("processes") == run("threads")


def test_a_collate_fn_that_cannot_travel_to_spawned_workers_runs_here():
    """Spawned workers get the collate_fn pickled: a lambda cannot be, so the
    loader's process collates, and the batches are the same."""
    ds = Records(64)
    fn = lambda s: collate_records(s)  # noqa: E731
    with AsyncLoader(ds, batch_size=8, execution="processes", num_workers=2,
                     multiprocessing_context="spawn", collate_fn=fn) as al:
        got = list(al)
        assert al._exec.stage.collate is None
    assert _content(got) == _content(DataLoader(ds, batch_size=8, collate_fn=collate_records))
    assert all(b["pid"] == os.getpid() for b in got)


class GatedRecords(Records):
    """Records whose rows wait until ``go`` is set."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.go = threading.Event()

    def __getitem__(self, i: int):
        assert self.go.wait(30)
        return super().__getitem__(i)


def test_the_hand_off_is_not_priced_on_rows_while_its_batch_is_collated():
    """Batches complete side by side: while the first collated batch is still being
    collated (workers would send it whole), the hand-off is not known yet -- it is
    never priced on that batch's rows instead."""
    ds = GatedRecords(64)
    seen: list = []
    live: dict = {}

    def collate(samples):
        if not seen:
            seen.append(live["pass"].handoff(1.0))  # read as the chooser reads it
        return collate_plain(samples)
    with AsyncLoader(ds, batch_size=8, collate_fn=collate) as al:  # the chooser measures
        it = iter(al)
        live["pass"] = it._p
        ds.go.set()
        got = list(it)
    assert seen == [None]
    assert _content(got) == _content(DataLoader(Records(64), batch_size=8,
                                                collate_fn=collate_plain))


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_the_hand_off_is_priced_on_what_the_workers_would_send(monkeypatch, on_error):
    """Where workers would collate whole batches (a user's collate_fn, no skipping),
    the chooser prices their hand-off on the first batch the pass collated, a row's
    share of it; where they would send rows, on the rows."""
    from asyncfeed._engine.processes import transport
    seen: list[list] = []
    real = transport.travel_cost

    def travel_cost(samples, budget_s=float("inf")):
        seen.append(list(samples))
        return real(samples, budget_s)
    monkeypatch.setattr(transport, "travel_cost", travel_cost)
    with AsyncLoader(SlowRecords(2048), batch_size=8, collate_fn=collate_plain,
                     on_error=on_error) as al:
        list(al)
        handoff = al._chooser.record.handoff
    assert len(seen) == 1 and handoff is not None, seen
    if on_error == "raise":
        # one whole batch, collated (whichever the threads finished first), measured
        # twice: the first trip pays the pickler's first use
        batch, again = seen[0]
        assert again is batch
        first = int(batch["ids"][0][1:])
        assert first % 8 == 0 and batch["ids"] == [f"r{i}" for i in range(first, first + 8)]
    else:
        ids = [s["id"] for s in seen[0]]  # a batch's first rows
        first = int(ids[0][1:])
        assert first % 8 == 0 and ids == [f"r{i}" for i in range(first, first + 4)]


# ------------------------------------------------------- shared memory running out
def test_a_full_shared_memory_file_system_sends_the_batches_to_threads(monkeypatch):
    """Where no buffer set can be made (the file system of /dev/shm is full: the
    reservation fails), the batches go to the threads: the same batches, nothing
    left behind, no worker touching memory that is not there."""
    from asyncfeed._engine.processes import shm as shm_mod

    def full(fd, offset, size):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(shm_mod.os, "posix_fallocate", full, raising=False)
    ds = TupleFixed(96)
    with AsyncLoader(ds, batch_size=8, execution="processes", num_workers=2) as al:
        got = list(al)
        report = al.stats().execution
    assert_same_batches(got, list(DataLoader(ds, batch_size=8)))
    assert report.mode is Mode.THREADS and report.processes_skipped is Reason.UNAVAILABLE, \
        report


def test_the_batches_in_flight_fit_in_half_the_free_shared_memory(monkeypatch):
    """Workers are kept in batches only as far as their buffer sets fit in half
    the free space of the shared-memory file system."""
    from asyncfeed._engine.processes import shm as shm_mod
    from asyncfeed._memory.layout import Layout
    stage = processes.ProcessStage(TupleFixed(8), 16, None, None, 0, 2)
    try:
        layout = Layout.infer(TupleFixed(8)[0])
        assert layout is not None
        stage.take(layout, 8)  # one set made and kept: the layout is known
        _, size = shm_mod.segment_plan(layout, 8)
        cost = RowCost()
        cost.cpu_s = cost.wall_s = 1e-5
        want = taskrows.batches_to_fill(8, 16, 1e-5)
        assert want == 32
        free = {"bytes": 10 * 2 * size}   # half of it holds 10 sets

        class Stat:
            f_frsize = 1

            @property
            def f_bavail(self):
                return free["bytes"]
        monkeypatch.setattr(shm_mod.os, "statvfs", lambda path: Stat())
        assert stage.fill(8, cost) == 1 + 10 - 2      # the kept set and 10 more, less 2
        free["bytes"] = 10 ** 12
        assert stage.fill(8, cost) == want
    finally:
        stage.close()
