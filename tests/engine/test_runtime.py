"""The runtime's threads: torch ops in decode threads stay on their own thread."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncfeed import AsyncLoader
from asyncfeed._engine import intraop
from asyncfeed._engine.runtime import Runtime

pytestmark = pytest.mark.timeout(60)

openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()


@pytest.mark.skipif(not openmp, reason="torch does not parallelise with OpenMP here")
def test_openmp_runtime_is_found_when_torch_uses_it():
    assert intraop._openmp is not None


@pytest.mark.skipif(not openmp, reason="torch does not parallelise with OpenMP here")
def test_decode_threads_run_torch_ops_single_threaded_and_nothing_else_changes():
    before = torch.get_num_threads()
    seen: list[int] = []
    done = threading.Semaphore(0)

    def probe() -> None:
        seen.append(torch.get_num_threads())
        done.release()
    with Runtime(2, with_loop=False) as rt:
        for _ in range(8):
            rt.submit(probe)
        for _ in range(8):
            assert done.acquire(timeout=10)
    assert len(seen) == 8 and set(seen) == {1}
    assert torch.get_num_threads() == before, "the caller's thread count must not change"


class Threads:
    """Samples that say how many threads torch would use where they were made."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.tensor([torch.get_num_threads()])


@pytest.mark.skipif(not openmp, reason="torch does not parallelise with OpenMP here")
def test_a_datasets_torch_ops_in_the_loader_are_single_threaded():
    with AsyncLoader(Threads(), batch_size=3, num_threads=2) as al:
        assert {int(v) for b in al for v in b} == {1}


@pytest.mark.skipif(not openmp, reason="torch does not parallelise with OpenMP here")
def test_alone_runs_the_block_on_this_thread_and_restores_the_count():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with intraop.alone():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 3
        with pytest.raises(ValueError):
            with intraop.alone():
                raise ValueError
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not openmp, reason="torch does not parallelise with OpenMP here")
@pytest.mark.parametrize("kind", ["tensor", "ndarray"])
def test_inline_rows_written_by_the_loader_alone_and_the_datasets_ops_as_the_user_set(
        monkeypatch, kind):
    """Inline, the dataset's own torch ops run with the consumer's count (as under
    ``DataLoader(num_workers=0)``); the loader's stack of a run of rows into the
    batch's buffers runs on the consumer's thread alone, and the count is the
    user's again after it."""
    during: list[int] = []
    stack = torch.stack

    def recording(*args, **kwargs):
        during.append(torch.get_num_threads())
        return stack(*args, **kwargs)
    monkeypatch.setattr(torch, "stack", recording)  # the loader's writes stack the rows

    class Rows:
        def __len__(self):
            return 64

        def __getitem__(self, i):
            row = torch.full((128, 128), float(torch.get_num_threads()))
            return row if kind == "tensor" else row.numpy()  # 64 KB: stacked in bulk

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with AsyncLoader(Rows(), batch_size=16, execution="inline") as al:
            batches = list(al)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert {float(v) for b in batches for v in b[:, 0, 0]} == {2.0}
    assert during and set(during) == {1}, during
