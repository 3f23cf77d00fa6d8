"""Rows are let go of once written: what a row task holds stays short of a young
collection (``gcpauses.rows_held``), and a batch collated after all reads the rows
it let go of back from its buffers, as DataLoader would have collated them."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from asyncfeed import AsyncLoader
from asyncfeed._engine import gcpauses
from asyncfeed._memory.layout import Layout
from support.executions import on
from support.oracle import assert_parity

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def young_threshold():
    """Sets the young generation's threshold for one test (workers forked meanwhile
    inherit it), then restores it."""
    before = gc.get_threshold()

    def set_to(n: int) -> None:
        gc.set_threshold(n, *before[1:])

    yield set_to
    gc.set_threshold(*before)


def test_rows_held_keeps_a_run_within_half_the_young_threshold(young_threshold):
    young_threshold(700)
    assert gcpauses.rows_held(3, 256) == 86        # 116 at most: three even runs
    assert gcpauses.rows_held(1, 256) == 256       # 350 at most: one run
    assert gcpauses.rows_held(400, 10) == 1        # never below one row
    assert gcpauses.rows_held(0, 256) == 256       # rows hold nothing it counts
    assert gcpauses.rows_held(3, 0) == 0
    young_threshold(0)                             # automatic collection off
    assert gcpauses.rows_held(3, 256) == 256


def test_rows_held_is_unbounded_while_collection_is_disabled(young_threshold):
    young_threshold(700)
    gc.disable()
    try:
        assert gcpauses.rows_held(3, 256) == 256
    finally:
        gc.enable()


def test_a_layout_counts_the_objects_the_collector_counts():
    assert Layout.infer((torch.zeros(2), torch.tensor(1))).gc_objects == 3
    assert Layout.infer((np.zeros(2), 1)).gc_objects == 1          # arrays are not its
    assert Layout.infer({"x": torch.zeros(2), "m": [np.zeros(1), "a"]}).gc_objects == 3
    assert Layout.infer(torch.zeros(2)).gc_objects == 1


class _Alive:
    """Rows of a tensor and how many of this dataset's earlier tensors were still
    alive when the row was made (in the process that makes it)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.made: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.full((4,), float(i))
        alive = len(self.made)
        self.made.add(x)
        return x, alive


@pytest.mark.parametrize("execution", ["inline", "processes"])
def test_a_row_task_holds_no_more_rows_than_rows_held(execution, young_threshold):
    """Each row holds two objects the collector counts (its tuple and its tensor):
    under a young threshold of 60, runs of at most 15 rows (13 over a batch of
    64).  Holding the whole batch until it is written, 63 rows were alive at
    once."""
    young_threshold(60)
    bound = gcpauses.rows_held(2, 64)
    assert bound == 13
    with AsyncLoader(_Alive(64 * 12), batch_size=64, **on(execution)) as loader:
        batches = list(loader)
    assert [len(x) for x, _ in batches] == [64] * 12
    assert torch.equal(torch.cat([x[:, 0] for x, _ in batches]), torch.arange(64 * 12.0))
    # the batches planned before the layout was read off a row are collated, their
    # rows held until then: from the fourth batch on, every batch is written
    alive = [int(a.max()) for _, a in batches[3:]]
    assert max(alive) < bound, alive


class _LateDtype:
    """NumPy rows in float32, but one row of the last batch in float64: DataLoader
    collates that batch in float64 (default_collate promotes)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return np.full(3, i, np.float64 if i == 60 else np.float32), i


class _LateShape:
    """Tensor rows of one shape, but one row of the last batch of another:
    DataLoader's default_collate raises for that batch."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return torch.full((5 if i == 60 else 4,), float(i)), i


def test_a_late_row_of_another_dtype_is_collated_as_dataloader_does(execution,
                                                                  young_threshold):
    """Rows 48..59 were written and let go of (runs of six rows under a young
    threshold of 12) when row 60 turns the batch to collating: they come back
    from the buffers as the NumPy arrays they were, and the batch is float64."""
    young_threshold(12)
    got = assert_parity(_LateDtype(), batch_size=16, **on(execution))
    assert got[-1][0].dtype == torch.float64


def test_a_late_row_of_another_shape_raises_what_dataloader_raises(execution,
                                                                   young_threshold):
    young_threshold(12)
    with AsyncLoader(_LateShape(), batch_size=16, **on(execution)) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
            next(it)
