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


def test_a_local_read_is_one_read_call_per_file(image_tree, tmp_path):  # noqa: F811
    """``LocalSource.read_sync`` opens a file and reads it whole in one read call (a
    FUSE round trip each on a network mount), where ``open().read()`` takes two: the
    mount's daemon serves one open, one read and one release per file."""
    why = unavailable()
    if why is not None:
        pytest.skip(f"no FUSE mount here: {why}")
    from asyncfeed._io.local import LocalSource
    with SlowMount(image_tree, str(tmp_path / "mnt"), open_ms=0, read_ms=0,
                   count_calls=True) as m:
        source = LocalSource(m.mountpoint)
        paths = [p for d in source.list_dirs() for p in source.list_files(d)]
        for p in paths:
            with open(p.replace(m.mountpoint, image_tree, 1), "rb") as f:
                assert source.read_sync(p) == f.read()
    assert m.calls == {"open": len(paths), "read": len(paths), "release": len(paths)}


def test_read_whole_reads_any_file_to_its_end(tmp_path):
    """Whatever ``fstat`` says: empty files, files whose size is reported as 0
    (procfs), and errors that name the path."""
    from asyncfeed._io.local import read_whole
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert read_whole(str(empty)) == b""
    big = tmp_path / "big"
    big.write_bytes(bytes(range(256)) * 4099)
    assert read_whole(str(big)) == big.read_bytes()
    with open("/proc/self/status", "rb") as f:
        head = f.read(5)
    assert read_whole("/proc/self/status").startswith(head) and len(head) == 5
    with pytest.raises(IsADirectoryError) as info:
        read_whole(str(tmp_path))
    assert info.value.filename == str(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_whole(str(tmp_path / "missing"))
