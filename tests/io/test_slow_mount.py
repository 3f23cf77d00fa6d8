"""A local path on slow storage (a FUSE passthrough that adds latency per open and
first read, as a network mount does): ``io="auto"`` measures it and reads on the
event loop, with as many reads waiting as ``io_concurrency`` allows."""

from __future__ import annotations

import threading

import pytest
import torch

from support.remote_fixtures import image_tree  # noqa: F401  (fixture)

from asyncfeed import AsyncLoader, ImageFolder
from asyncfeed._bench.slowfs import SlowMount, unavailable

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def slow_mount(image_tree, tmp_path):  # noqa: F811
    why = unavailable()
    if why is not None:
        pytest.skip(f"no FUSE mount here: {why}")
    with SlowMount(image_tree, str(tmp_path / "mnt"), open_ms=2, read_ms=10) as m:
        yield m.mountpoint


def test_auto_io_measures_the_mount(image_tree, slow_mount):  # noqa: F811
    fast = ImageFolder(image_tree, 32)
    assert fast.io == "thread" and fast.read_latency_s < 1e-3
    slow = ImageFolder(slow_mount, 32)
    assert slow.io == "async" and slow.read_latency_s >= 1e-3
    assert slow.use_async_fetch
    assert ImageFolder(slow_mount, 32, io="thread").read_latency_s is None  # asked: no probe


def test_loader_on_the_mount_keeps_many_reads_waiting(image_tree, slow_mount):  # noqa: F811
    with AsyncLoader(ImageFolder(image_tree, 32), batch_size=4, shuffle=True, seed=5,
                     num_threads=2) as loader:
        want = list(loader)
    peak = 0
    with AsyncLoader(ImageFolder(slow_mount, 32), batch_size=4, shuffle=True, seed=5,
                     num_threads=2, io_concurrency=32) as loader:
        got = []
        for batch in loader:
            got.append(batch)
            peak = max(peak, sum(t.name.startswith("asyncfeed-io-file")
                                 for t in threading.enumerate()))
    assert len(got) == len(want)
    for (x, lx), (y, ly) in zip(got, want):
        assert torch.equal(x, y) and torch.equal(lx, ly)
    assert peak > 8  # more reads waiting at once than the old aiofiles path's 8 executor threads allowed
