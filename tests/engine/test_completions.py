"""What a pass reports to the execution chooser as completed: at every report, or
at batch completions where a batch's reads go out together on the event loop;
and the CPU its rows took, however they were read."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from asyncfeed import AsyncLoader
from asyncfeed._engine.completions import Completions
from asyncfeed._engine.pipeline import Pipeline


def test_reports_are_read_as_they_come():
    c = Completions(per_batch=False)
    assert c.reading() == (0, 0, 0.0)
    c.count(3, batch_done=False)
    c.count(2, batch_done=True)
    c.count(4, batch_done=False)
    rows, reports, last = c.reading()
    assert (rows, reports) == (9, 3) and last == c.last > 0


def test_per_batch_readings_stand_where_the_last_batch_completed():
    """Reports that complete no batch leave the reading as it was; the report that
    completes one moves it, with every report before it counted."""
    c = Completions(per_batch=True)
    c.count(3, batch_done=False)
    c.count(2, batch_done=False)
    assert c.reading() == (0, 0, 0.0)
    c.count(1, batch_done=True)
    at_batch = c.reading()
    assert at_batch[:2] == (6, 3) and at_batch[2] == c.last
    c.count(5, batch_done=False)
    assert c.reading() == at_batch
    c.count(2, batch_done=True)
    assert c.reading()[:2] == (13, 5)


class Fetched:
    """Reads on the event loop, decodes in the threads."""

    def __len__(self) -> int:
        return 64

    async def fetch(self, i: int) -> int:
        await asyncio.sleep(0)
        return i

    def decode(self, raw: int, i: int) -> torch.Tensor:
        return torch.tensor([raw])

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


class Plain:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


@pytest.mark.parametrize("ds,per_batch", [(Fetched(), True), (Plain(), False)])
def test_a_pass_reads_per_batch_where_its_reads_run_on_the_event_loop(monkeypatch, ds, per_batch):
    made: list[bool] = []
    init = Completions.__init__

    def recording(self: Completions, per_batch: bool) -> None:
        made.append(per_batch)
        init(self, per_batch)

    monkeypatch.setattr(Completions, "__init__", recording)
    with AsyncLoader(ds, batch_size=8) as al:
        got = torch.cat(list(al))
    assert got.flatten().tolist() == list(range(64))
    assert made == [per_batch]


class Burning(Fetched):
    """Reads on the event loop; each decode burns 2 ms of its thread's CPU."""

    def decode(self, raw: int, i: int) -> torch.Tensor:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.002:
            pass
        return torch.tensor([raw])


@pytest.mark.parametrize("execution", ["threads", "inline"])
def test_rows_read_on_the_event_loop_report_the_cpu_their_decode_took(monkeypatch, execution):
    """The chooser's CPU bounds (one core's rate of the rows, the cores more
    threads could use) read each window's row CPU: a row decoded after an async
    read reports it, as a task of rows read in its thread does."""
    reported: list[tuple[int, float]] = []
    rows_done = Pipeline.rows_done

    def spy(self: Pipeline, b, lo: int, hi: int, cpu: float = 0.0) -> None:
        reported.append((hi - lo, cpu))
        rows_done(self, b, lo, hi, cpu)

    monkeypatch.setattr(Pipeline, "rows_done", spy)
    ds = Burning()
    with AsyncLoader(ds, batch_size=8, execution=execution) as al:
        got = torch.cat(list(al))
    assert got.flatten().tolist() == list(range(64))
    assert sum(n for n, _ in reported) == 64
    assert all(cpu >= 0.002 * n for n, cpu in reported), reported


class BurningBatches:
    """A plain data set with ``__getitems__`` (a whole batch in one call) that burns
    2 ms of its thread's CPU a row."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.002 * len(indices):
            pass
        return [torch.tensor([i]) for i in indices]


def test_batches_loaded_whole_report_the_cpu_they_took(monkeypatch):
    """A data set's ``__getitems__`` loads a batch in one task: the CPU it took is
    the rows' CPU the chooser's windows read, as for rows loaded one by one."""
    grew: list[float] = []
    run = Pipeline._run_getitems

    def spy(self: Pipeline, b) -> None:
        before = self.rows_cpu_s
        run(self, b)
        grew.append(self.rows_cpu_s - before)

    monkeypatch.setattr(Pipeline, "_run_getitems", spy)
    with AsyncLoader(BurningBatches(), batch_size=8) as al:
        got = torch.cat(list(al))
    assert got.flatten().tolist() == list(range(64))
    assert len(grew) == 8 and all(g >= 0.002 * 8 for g in grew), grew
