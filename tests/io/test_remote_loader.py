"""AsyncLoader over http:// and s3:// roots gives what it gives over the same local folder."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from support.remote_fixtures import *  # noqa: E402,F401,F403
from support.remote_fixtures import s3_options  # noqa: E402

from asyncfeed import AsyncLoader, ImageFolder, SampleError  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def _batches(ds, **kw):
    with AsyncLoader(ds, batch_size=4, shuffle=True, seed=7, num_threads=2, **kw) as loader:
        return list(loader)


def _same(a, b) -> None:
    assert len(a) == len(b)
    for (x, lx), (y, ly) in zip(a, b):
        assert torch.equal(x, y) and torch.equal(lx, ly)


def test_loader_over_http_equals_local(image_tree, http_server):
    http_server.latency = 0.02
    local = ImageFolder(image_tree, 32)
    remote = ImageFolder(http_server.url, 32, timeout=10)
    assert remote.use_async_fetch
    want = _batches(local)
    with AsyncLoader(remote, batch_size=4, shuffle=True, seed=7, num_threads=2,
                     io_concurrency=32) as loader:
        for epoch in range(2):  # a new event loop per pass: connections made and closed per loop
            loader.set_epoch(0)
            _same(list(loader), want)
            # the loader's loop got close_io: only fsspec's (listing, read_sync) is left
            assert all(c.loop is _fsspec_loop() for c in remote._source._conns.values())
    assert http_server.max_in_flight >= 8  # reads overlapped across batches
    remote._source.close()


def _fsspec_loop():
    import fsspec.asyn
    return fsspec.asyn.loop[0]


def test_loader_over_s3_equals_local(image_tree, s3_tree, moto_endpoint):
    local = ImageFolder(image_tree, 32)
    remote = ImageFolder(s3_tree, 32, storage_options=s3_options(moto_endpoint))
    _same(_batches(remote), _batches(local))
    remote._source.close()


def test_loader_reports_missing_remote_file(image_tree, http_server):
    remote = ImageFolder(http_server.url, 32, retries=1, backoff=0.01)
    bad = next(i for i, (p, _) in enumerate(remote.samples) if p.endswith("dog%20b/im%201.jpg"))
    http_server.add_fault("dog b/im 1.jpg", "status", status=404)
    with pytest.raises(SampleError) as info:
        _batches(remote)
    assert info.value.index == bad and "dog%20b/im%201.jpg" in str(info.value)
    assert isinstance(info.value.__cause__, FileNotFoundError)
    with AsyncLoader(remote, batch_size=4, on_error="skip", num_threads=2) as loader:
        n = sum(len(y) for _, y in loader)
        skipped = loader.stats().skipped
    assert n == len(remote) - 1
    assert [s.index for s in skipped] == [bad] and "im%201.jpg" in skipped[0].source
    remote._source.close()


def test_loader_survives_transient_faults(image_tree, http_server):
    local = ImageFolder(image_tree, 32)
    remote = ImageFolder(http_server.url, 32, timeout=0.5, retries=3, backoff=0.01)
    http_server.add_fault("cat/*", "status", status=503, times=5)
    http_server.add_fault("dog b/*", "drop", after=200, times=3)
    http_server.add_fault("\u00e9mu/x/*", "stall", after=50, times=2)
    _same(_batches(remote), _batches(local))
    remote._source.close()


def test_loader_with_disk_cache_skips_the_network_next_epoch(image_tree, http_server, tmp_path):
    remote = ImageFolder(http_server.url, 32, cache_dir=str(tmp_path))
    first = _batches(remote)
    http_server.reset_counts()
    _same(_batches(remote), first)
    assert sum(http_server.requests.values()) == 0
    remote._source.close()


def test_any_fsspec_filesystem_even_a_synchronous_one(image_tree):
    """memory:// has no async interface: reads run in the loop's executor."""
    import fsspec
    mem = fsspec.filesystem("memory")
    for dirpath, _, files in os.walk(image_tree):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                mem.pipe("/asyncfeed-test-tree/" + os.path.relpath(path, image_tree), f.read())
    try:
        local = ImageFolder(image_tree, 32)
        remote = ImageFolder("memory://asyncfeed-test-tree", 32)
        assert remote.classes == local.classes and remote.targets == local.targets
        assert remote.use_async_fetch
        _same(_batches(remote), _batches(local))
        remote._source.close()
    finally:
        mem.rm("/asyncfeed-test-tree", recursive=True)


def test_remote_reads_in_decode_threads(image_tree, http_server):
    """io="thread": blocking reads from the decode threads (through fsspec's I/O loop)."""
    local = ImageFolder(image_tree, 32)
    remote = ImageFolder(http_server.url, 32, io="thread")
    assert not remote.use_async_fetch
    _same(_batches(remote), _batches(local))
    remote._source.close()
