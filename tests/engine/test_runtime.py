"""The runtime's threads: torch ops in decode threads stay on their own thread."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncfeed import AsyncLoader
from asyncfeed._engine.runtime import Runtime, _omp_set_num_threads

pytestmark = pytest.mark.timeout(60)

openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()


@pytest.mark.skipif(not openmp, reason="torch does not parallelise with OpenMP here")
def test_openmp_runtime_is_found_when_torch_uses_it():
    assert _omp_set_num_threads is not None


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
