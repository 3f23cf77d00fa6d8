"""Memory over many passes: RSS stays flat over 1,000 (iterate, take one batch, break)
cycles and over many full passes, on every execution and both I/O modes.

Growth is measured as a slope (KB per pass) after a warm-up, not as a difference
of two readings: the median of the growth between consecutive readings taken
every ``EVERY`` passes, so one step (an allocator arena made once, a page of
the test's own lists) does not count as growth and steady growth does.  The
bound sits between what a pass leaves behind now (about 1-2 KB: OpenCV keeps
~0.8 KB for every thread that ever called its ``resize``, and each pass starts
its own decode threads) and the leak it guards against (10-25 KB a pass: batch
buffers allocated on the C heap each pass fragmented it).
"""

from __future__ import annotations

import itertools
import os
import statistics

import pytest

from asyncfeed import AsyncLoader, ImageFolder
from asyncfeed._engine.processes import EXECUTIONS
from support.faults import rss_mb
from support.imagegen import write

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

# every execution a user can pick, with both I/O modes; reads on the event loop
# (io="async") run in the decode threads whatever the execution, so once
CASES = [(e, "thread") for e in EXECUTIONS if e != "auto"] + [("threads", "async")]
#: KB of RSS a pass may add, measured as a slope (see the module docstring)
BOUND_KB = 5.0
EVERY = 100


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """16 small JPEGs in two classes: batches of 8 x 3 x 64 x 64 bytes (96 KiB)."""
    root = tmp_path_factory.mktemp("memory")
    for c, i in itertools.product(range(2), range(8)):
        os.makedirs(root / f"c{c}", exist_ok=True)
        write("baseline", root / f"c{c}" / f"{i}.jpg", 48, 64, seed=i)
    return str(root)


def growth_kb(readings_mb: list[float]) -> float:
    """KB per pass: the median of the growth between consecutive readings."""
    return statistics.median((b - a) * 1024 / EVERY
                             for a, b in zip(readings_mb, readings_mb[1:]))


def test_growth_measure_sees_steady_growth_and_ignores_a_step():
    steady = [100 + k * 10 * EVERY / 1024 for k in range(10)]       # 10 KB a pass
    step = [100.0] * 5 + [103.0] * 5                                 # one 3 MB step
    assert growth_kb(steady) == pytest.approx(10.0)
    assert growth_kb(step) == 0.0


def _loader(folder: str, io: str, execution: str) -> AsyncLoader:
    return AsyncLoader(ImageFolder(folder, size=64, io=io), batch_size=8, num_threads=2,
                       execution=execution)


@pytest.mark.parametrize("execution, io", CASES)
def test_rss_is_flat_over_1000_break_cycles(folder, io, execution):
    loader = _loader(folder, io, execution)
    for _ in range(EVERY):  # warm up: allocators, caches, worker processes
        for _ in loader:
            break
    readings = [rss_mb()]
    for k in range(1000):
        for batch in loader:
            assert batch[0].shape == (8, 3, 64, 64)
            break
        if k % EVERY == EVERY - 1:
            readings.append(rss_mb())
    loader.close()
    kb = growth_kb(readings)
    assert kb < BOUND_KB, (f"RSS grows {kb:.1f} KB per (iter, one batch, break) cycle "
                           f"({io=}, {execution=}); readings (MB): {readings}")


@pytest.mark.parametrize("execution, io", CASES)
def test_rss_is_flat_over_a_soak_of_full_passes(folder, io, execution):
    loader = _loader(folder, io, execution)
    for _ in range(EVERY):
        assert sum(len(b[1]) for b in loader) == 16
    readings = [rss_mb()]
    for k in range(500):
        assert sum(len(b[1]) for b in loader) == 16
        if k % EVERY == EVERY - 1:
            readings.append(rss_mb())
    loader.close()
    kb = growth_kb(readings)
    assert kb < BOUND_KB, (f"RSS grows {kb:.1f} KB per full pass ({io=}, {execution=}); "
                           f"readings (MB): {readings}")
