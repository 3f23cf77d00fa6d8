"""FsspecSource and ImageFolder over S3: moto's server, and a fault proxy in front of it."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
import torch

from support.remote_fixtures import *  # noqa: E402,F401,F403
from support.remote_fixtures import fast_source, s3_options  # noqa: E402

from asyncfeed import ImageFolder  # noqa: E402
from asyncfeed._io.fsspec import RemoteReadError, RemoteTimeoutError  # noqa: E402

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


# -- the lean signed GET (asyncfeed._io.s3) ------------------------------------------------

def _gets(proxy, key=KEY):
    return [who for method, path, who in proxy.clients if method == "GET" and path == key]


def test_reads_use_the_fast_path_unless_disabled(image_tree, s3_proxy):
    url = "s3://asyncfeed-test/images/" + REL
    fast = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url))
    assert fast.read_sync(url) == _bytes(image_tree, REL)
    slow = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url),
                       fast=False)
    assert slow.read_sync(url) == _bytes(image_tree, REL)
    assert _gets(s3_proxy) == ["other", "botocore"]
    fast.close()
    slow.close()


def test_fast_path_range_reads(image_tree, s3_proxy):
    src = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url))
    url = "s3://asyncfeed-test/images/" + REL
    data = _bytes(image_tree, REL)

    async def ranges():
        try:
            return [await src.read_range(url, 10, 400), await src.read_range(url, 0, len(data))]
        finally:
            await src.close_io()

    assert asyncio.run(ranges()) == [data[10:400], data]
    assert _gets(s3_proxy) == ["other", "other"]
    src.close()


def test_fast_path_falls_back_to_s3fs_when_misaddressed(image_tree, s3_proxy):
    s3_proxy.add_fault(KEY, "status", status=301, times=1, headers={"Content-Type": "application/xml"},
                       body="<Error><Code>PermanentRedirect</Code><Message>elsewhere</Message></Error>")
    src = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url))
    url = "s3://asyncfeed-test/images/" + REL
    assert src.read_sync(url) == _bytes(image_tree, REL)
    assert src.read_sync(url) == _bytes(image_tree, REL)
    assert _gets(s3_proxy) == ["other", "botocore", "botocore"]  # the bucket stays on s3fs
    src.close()


@pytest.mark.parametrize("token", [None, "session-token"])
def test_signature_matches_botocore(monkeypatch, token):
    import datetime

    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from asyncfeed._io import s3 as _s3fast

    now = datetime.datetime(2026, 3, 4, 5, 6, 7, tzinfo=datetime.timezone.utc)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: now.replace(tzinfo=None))
    monkeypatch.setattr(_s3fast.time, "time", lambda: now.timestamp())
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    url = "http://s3.example.com:9000/my-bucket/dir%20a/x%2By~z.jpg"
    request = AWSRequest(method="GET", url=url, headers={})
    botocore.auth.S3SigV4Auth(creds, "s3", "eu-west-3").add_auth(request)

    reader = _s3fast.S3FastReader(fs=None, pool=None, unsigned=False)
    reader._creds = (creds.access_key, creds.secret_key, token)
    reader._creds_at = float("inf")  # never ask the (absent) filesystem
    bucket = _s3fast._Bucket("http://s3.example.com:9000/my-bucket/k?X=1", "k", "eu-west-3")
    headers = asyncio.run(reader._headers(bucket, "/my-bucket/dir%20a/x%2By~z.jpg", None))
    assert headers["Authorization"] == request.headers["Authorization"]
    assert headers["x-amz-date"] == request.headers["X-Amz-Date"]
    assert headers["Host"] == "s3.example.com:9000"


def test_proxy_in_environment_keeps_reads_on_s3fs(image_tree, s3_proxy, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # botocore bypasses it for the test server
    src = fast_source("s3://asyncfeed-test/images", storage_options=s3_options(s3_proxy.url))
    assert src.read_sync("s3://asyncfeed-test/images/" + REL) == _bytes(image_tree, REL)
    assert _gets(s3_proxy) == ["botocore"]
    src.close()
