"""FsspecSource and ImageFolder over S3: moto's server, and a fault proxy in front of it."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from remote_fixtures import *  # noqa: E402,F401,F403
from remote_fixtures import fast_source, s3_options  # noqa: E402

from asyncfeed import ImageFolder  # noqa: E402
from asyncfeed._fsspec_source import RemoteReadError, RemoteTimeoutError  # noqa: E402

pytestmark = pytest.mark.timeout(60)

REL = "cat/x y/im 1.jpg"
KEY = "asyncfeed-test/images/" + REL  # the path the proxy sees (path-style addressing)


def _bytes(tree: str, rel: str) -> bytes:
    with open(os.path.join(tree, rel), "rb") as f:
        return f.read()


def test_imagefolder_over_s3_equals_local(image_tree, s3_tree, moto_endpoint):
    local = ImageFolder(image_tree, 32)
    remote = ImageFolder(s3_tree, 32, storage_options=s3_options(moto_endpoint))
    assert remote.classes == local.classes
    rel_remote = [p[len(s3_tree) + 1:] for p, _ in remote.samples]
    rel_local = [os.path.relpath(p, image_tree).replace(os.sep, "/") for p, _ in local.samples]
    assert rel_remote == rel_local
    for i in range(len(local)):
        (a, la), (b, lb) = local[i], remote[i]
        assert la == lb and torch.equal(a, b), i
    # sizes came with the listing: reads can be checked without a HEAD request
    src = remote._source
    assert src._sizes[s3_tree + "/" + REL] == len(_bytes(image_tree, REL))
    src.close()


def test_async_reads_on_fresh_loops(image_tree, s3_tree, moto_endpoint):
    src = fast_source(s3_tree, storage_options=s3_options(moto_endpoint))
    urls = [u for c in src.list_dirs() for u in src.list_files(c) if u.endswith(".jpg")]

    async def read_all():
        try:
            return await asyncio.gather(*(src.read(u) for u in urls))
        finally:
            await src.close_io()

    for _ in range(2):
        out = asyncio.run(read_all())
        assert out == [_bytes(image_tree, u[len(s3_tree) + 1:]) for u in urls]
        assert not src._conns or all(c.loop is not None for c in src._conns.values())
    src.close()


def test_missing_key_is_not_retried(s3_tree, moto_endpoint):
    src = fast_source(s3_tree, storage_options=s3_options(moto_endpoint), backoff=5.0)
    url = s3_tree + "/cat/missing.jpg"
    t0 = time.perf_counter()
    with pytest.raises(FileNotFoundError) as info:
        src.read_sync(url)
    assert time.perf_counter() - t0 < 3.0  # a retry would have waited >= 2.5 s
    assert url in str(info.value)
    src.close()


def test_one_request_per_read_no_head(image_tree, s3_proxy):
    src = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url))
    src.list_dirs()
    s3_proxy.reset_counts()
    assert src.read_sync("s3://asyncfeed-test/images/" + REL) == _bytes(image_tree, REL)
    assert s3_proxy.count(KEY) == 1
    assert sum(s3_proxy.requests.values()) == 1
    src.close()


def test_slowdown_is_retried(image_tree, s3_proxy):
    s3_proxy.throttle(KEY, times=2)
    src = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url))
    assert src.read_sync("s3://asyncfeed-test/images/" + REL) == _bytes(image_tree, REL)
    assert s3_proxy.count(KEY) == 3
    src.close()


def test_internal_error_forever_gives_up(s3_proxy):
    s3_proxy.add_fault(KEY, "status", status=500, headers={"Content-Type": "application/xml"},
                       body="<Error><Code>InternalError</Code><Message>oops</Message></Error>")
    src = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url),
                      retries=2)
    url = "s3://asyncfeed-test/images/" + REL
    with pytest.raises(RemoteReadError) as info:
        src.read_sync(url)
    assert url in str(info.value)
    assert s3_proxy.count(KEY) == 3
    src.close()


def test_access_denied_is_not_retried(s3_proxy):
    s3_proxy.add_fault(KEY, "status", status=403, headers={"Content-Type": "application/xml"},
                       body="<Error><Code>AccessDenied</Code><Message>no</Message></Error>")
    src = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url))
    url = "s3://asyncfeed-test/images/" + REL
    with pytest.raises(PermissionError) as info:
        src.read_sync(url)
    assert url in str(info.value)
    assert s3_proxy.count(KEY) == 1
    src.close()


def test_stalled_object_hits_the_timeout(s3_proxy):
    s3_proxy.add_fault(KEY, "stall", after=100)
    src = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url),
                      timeout=0.5, retries=1)
    url = "s3://asyncfeed-test/images/" + REL
    t0 = time.perf_counter()
    with pytest.raises(RemoteTimeoutError) as info:
        src.read_sync(url)
    assert time.perf_counter() - t0 < 4.0
    assert url in str(info.value)
    src.close()


def test_dropped_object_is_retried_and_never_partial(image_tree, s3_proxy):
    s3_proxy.add_fault(KEY, "drop", after=300, times=1)
    src = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url),
                      retries=2)
    url = "s3://asyncfeed-test/images/" + REL
    assert src.read_sync(url) == _bytes(image_tree, REL)
    assert s3_proxy.count(KEY) == 2
    s3_proxy.add_fault(KEY, "drop", after=300)
    with pytest.raises(RemoteReadError):
        src.read_sync(url)
    src.close()


def test_listing_of_a_throttled_bucket_is_retried(image_tree, s3_proxy):
    s3_proxy.throttle("asyncfeed-test", times=2)  # ListObjectsV2 goes to the bucket path
    src = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url))
    assert src.list_dirs() == ["cat", "dog b", "\u00e9mu"]
    assert s3_proxy.count("asyncfeed-test") >= 3
    src.close()
