"""FsspecSource and ImageFolder over an HTTP directory index served on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
import time

import pytest
import torch

from support.remote_fixtures import *  # noqa: E402,F401,F403
from support.remote_fixtures import fast_source  # noqa: E402

from asyncfeed import ImageFolder  # noqa: E402
from asyncfeed._io.fsspec import (  # noqa: E402
    FsspecSource, RemoteReadError, RemoteTimeoutError, classify)

pytestmark = pytest.mark.timeout(60)

FILE = "cat/x y/im 1.jpg"  # a path with a space, in a nested folder


def _url(server, rel: str) -> str:
    from urllib.parse import quote
    return server.url + quote(rel)


def _bytes(tree: str, rel: str) -> bytes:
    with open(os.path.join(tree, rel), "rb") as f:
        return f.read()


# -- listing -------------------------------------------------------------------------------

def test_listing_matches_local_imagefolder(image_tree, http_server):
    local = ImageFolder(image_tree, 32)
    remote = ImageFolder(http_server.url, 32)
    assert remote.classes == local.classes == ["cat", "dog b", "\u00e9mu"]
    assert remote.targets == local.targets
    assert len(remote) == len(local) == 27
    from urllib.parse import unquote
    rel_remote = [unquote(p[len(http_server.url):]) for p, _ in remote.samples]
    rel_local = [os.path.relpath(p, image_tree).replace(os.sep, "/") for p, _ in local.samples]
    assert rel_remote == rel_local  # torchvision's order, nested folders included
    assert remote.io == "async" and not remote._source.is_local
    remote._source.close()


def test_listing_is_done_once(http_server):
    src = fast_source(http_server.url)
    classes = src.list_dirs()
    pages = sum(http_server.requests.values())
    assert pages == 1 + 3 * 3  # root index, then each class folder and its 2 subfolders
    for c in classes:
        assert src.list_files(c)
    src.list_dirs()
    assert sum(http_server.requests.values()) == pages  # nothing listed twice
    src.close()


def test_listing_with_index_failures_is_retried(http_server):
    http_server.add_fault("dog b/", "status", status=503, times=2)
    src = fast_source(http_server.url)
    assert len(src.list_files("dog b")) == 3 + 3 + 3 + 1  # notes.txt too
    assert http_server.count("dog b/") == 3
    src.close()


def test_root_that_is_missing_raises_not_found(http_server):
    src = fast_source(http_server.url + "nothing-here/")
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        src.list_dirs()
    src.close()


# -- reads ---------------------------------------------------------------------------------

def test_imagefolder_items_equal_local(image_tree, http_server):
    local = ImageFolder(image_tree, 32)
    remote = ImageFolder(http_server.url, 32, timeout=10)
    for i in range(len(local)):
        (a, la), (b, lb) = local[i], remote[i]
        assert la == lb and torch.equal(a, b), i
    remote._source.close()


def test_async_read_on_fresh_loops_and_close_io(image_tree, http_server):
    src = fast_source(http_server.url)
    url = _url(http_server, FILE)

    async def twice():
        out = await asyncio.gather(src.read(url), src.read(url))
        assert len(src._conns) == 1
        await src.close_io()
        assert not src._conns
        return out

    for _ in range(2):  # the loader makes a new event loop per pass
        a, b = asyncio.run(twice())
        assert a == b == _bytes(image_tree, FILE)


def test_reads_keep_many_requests_in_flight(http_server):
    http_server.latency = 0.1
    src = fast_source(http_server.url)
    urls = [u for c in src.list_dirs() for u in src.list_files(c)]
    http_server.reset_counts()

    async def all_at_once():
        try:
            return await asyncio.gather(*(src.read(u) for u in urls))
        finally:
            await src.close_io()

    t0 = time.perf_counter()
    asyncio.run(all_at_once())
    assert http_server.max_in_flight >= 20
    assert time.perf_counter() - t0 < 3.0  # 36 reads of 0.1 s each, concurrently (not 3.6 s)
    src.close()


# -- faults (through the lean client and through fsspec's aiohttp one) ---------------------

@pytest.fixture(params=[True, False], ids=["lean", "aiohttp"])
def fast(request):
    return request.param


def test_503_is_retried_then_succeeds(image_tree, http_server, fast):
    http_server.add_fault(FILE, "status", status=503, times=3)
    src = fast_source(http_server.url, retries=5, fast=fast)
    assert src.read_sync(_url(http_server, FILE)) == _bytes(image_tree, FILE)
    assert http_server.count(FILE) == 4
    src.close()


def test_503_forever_gives_up_after_retries(http_server, fast):
    http_server.add_fault(FILE, "status", status=503)
    src = fast_source(http_server.url, retries=3, fast=fast)
    url = _url(http_server, FILE)
    with pytest.raises(RemoteReadError) as info:
        src.read_sync(url)
    assert url in str(info.value) and "503" in str(info.value)
    assert info.value.attempts == 4 and http_server.count(FILE) == 4
    err = pickle.loads(pickle.dumps(info.value))
    assert err.url == url and str(err) == str(info.value)
    src.close()


def test_backoff_grows_with_jitter(http_server):
    http_server.add_fault(FILE, "status", status=500, times=3)
    src = fast_source(http_server.url, retries=3, backoff=0.1, max_backoff=1.0)
    t0 = time.perf_counter()
    src.read_sync(_url(http_server, FILE))
    # waits of 0.1, 0.2, 0.4 s, each at least half of that
    assert 0.35 <= time.perf_counter() - t0 < 2.0
    src.close()


@pytest.mark.parametrize("status,exc", [(404, FileNotFoundError), (403, PermissionError),
                                        (401, PermissionError), (400, RemoteReadError)])
def test_permanent_errors_are_not_retried(http_server, status, exc, fast):
    http_server.add_fault(FILE, "status", status=status)
    src = fast_source(http_server.url, retries=5, backoff=5.0, fast=fast)
    url = _url(http_server, FILE)
    t0 = time.perf_counter()
    with pytest.raises(exc) as info:
        src.read_sync(url)
    assert time.perf_counter() - t0 < 2.0
    assert url in str(info.value)
    assert http_server.count(FILE) == 1
    src.close()


def test_missing_file_is_file_not_found(http_server, fast):
    src = fast_source(http_server.url, fast=fast)
    url = http_server.url + "cat/missing.jpg"
    with pytest.raises(FileNotFoundError) as info:
        src.read_sync(url)
    assert info.value.filename == url and url in str(info.value)
    assert http_server.count("cat/missing.jpg") == 1
    src.close()


def test_stalled_body_hits_the_timeout(http_server, fast):
    http_server.add_fault(FILE, "stall", after=200)
    src = fast_source(http_server.url, timeout=0.3, retries=1, fast=fast)
    url = _url(http_server, FILE)
    t0 = time.perf_counter()
    with pytest.raises(RemoteTimeoutError) as info:
        src.read_sync(url)
    assert time.perf_counter() - t0 < 3.0
    assert url in str(info.value) and "timed out" in str(info.value)
    assert isinstance(info.value, TimeoutError)
    assert http_server.count(FILE) == 2
    src.close()


def test_stalled_headers_hit_the_timeout(http_server, fast):
    http_server.add_fault(FILE, "delay", delay=30.0)
    src = fast_source(http_server.url, timeout=0.3, retries=0, fast=fast)
    with pytest.raises(RemoteTimeoutError):
        src.read_sync(_url(http_server, FILE))
    src.close()


def test_stall_once_then_retry_succeeds(image_tree, http_server, fast):
    http_server.add_fault(FILE, "stall", after=100, times=1)
    src = fast_source(http_server.url, timeout=0.3, retries=2, fast=fast)
    assert src.read_sync(_url(http_server, FILE)) == _bytes(image_tree, FILE)
    src.close()


@pytest.mark.parametrize("chunked", [False, True])
def test_dropped_connection_is_retried(image_tree, http_server, chunked, fast):
    http_server.add_fault(FILE, "drop", after=500, times=2, chunked=chunked)
    src = fast_source(http_server.url, retries=3, fast=fast)
    assert src.read_sync(_url(http_server, FILE)) == _bytes(image_tree, FILE)
    assert http_server.count(FILE) == 3
    src.close()


@pytest.mark.parametrize("chunked", [False, True])
def test_dropped_connection_never_yields_a_partial_file(http_server, chunked, fast):
    http_server.add_fault(FILE, "drop", after=500, chunked=chunked)
    src = fast_source(http_server.url, retries=2, fast=fast)
    url = _url(http_server, FILE)
    with pytest.raises(RemoteReadError) as info:
        src.read_sync(url)
    assert url in str(info.value)
    assert http_server.count(FILE) == 3

    async def on_loop():
        try:
            return await src.read(url)
        finally:
            await src.close_io()

    with pytest.raises(RemoteReadError):
        asyncio.run(on_loop())
    src.close()


def test_short_body_against_listed_size_is_rejected(image_tree, http_server, fast):
    """Where the listing gave a size, a body of another length is never returned."""
    src = fast_source(http_server.url, retries=1, fast=fast)
    url = _url(http_server, FILE)
    src._sizes[url] = len(_bytes(image_tree, FILE)) + 1  # as if the listing said so
    with pytest.raises(RemoteReadError, match="expected"):
        src.read_sync(url)
    assert http_server.count(FILE) == 2
    src.close()


def test_server_gone_is_an_error_not_a_hang(image_tree, fast):
    from asyncfeed._bench.httpserve import DirectoryServer
    with DirectoryServer(image_tree) as server:
        url = server.url
    src = fast_source(url, retries=1, timeout=1.0, fast=fast)
    with pytest.raises(RemoteReadError):
        src.read_sync(url + "cat/im%200.jpg")
    src.close()


def test_classify():
    import aiohttp
    from aiohttp.client_reqrep import RequestInfo
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    def resp(status):
        info = RequestInfo(URL("http://h/x"), "GET", CIMultiDictProxy(CIMultiDict()))
        return aiohttp.ClientResponseError(info, (), status=status)

    assert classify(resp(503)) == "transient"
    assert classify(resp(429)) == "transient"
    assert classify(resp(404)) == "missing"
    assert classify(resp(403)) == "denied"
    assert classify(resp(400)) == "permanent"
    assert classify(TimeoutError()) == "transient"
    assert classify(ConnectionResetError()) == "transient"
    assert classify(aiohttp.ClientPayloadError("cut")) == "transient"
    assert classify(aiohttp.ServerDisconnectedError()) == "transient"
    assert classify(FileNotFoundError("x")) == "missing"
    assert classify(ValueError("x")) == "permanent"
    throttled = OSError(16, "Please reduce your request rate.")
    from botocore.exceptions import ClientError
    throttled.__cause__ = ClientError({"Error": {"Code": "SlowDown"},
                                       "ResponseMetadata": {"HTTPStatusCode": 503}}, "GetObject")
    assert classify(throttled) == "transient"


# -- pickling and worker processes ---------------------------------------------------------

def test_pickled_source_reads_without_relisting(image_tree, http_server):
    ds = ImageFolder(http_server.url, 32)
    first = ds[0]
    blob = pickle.dumps(ds)
    listed = sum(v for k, v in http_server.requests.items() if k == "" or k.endswith("/"))
    ds2 = pickle.loads(blob)
    second = ds2[0]
    assert torch.equal(first[0], second[0]) and first[1] == second[1]
    assert sum(v for k, v in http_server.requests.items()
               if k == "" or k.endswith("/")) == listed
    ds._source.close()
    ds2._source.close()


def test_torch_dataloader_workers(image_tree, http_server):
    local = ImageFolder(image_tree, 32)
    remote = ImageFolder(http_server.url, 32)
    dl = torch.utils.data.DataLoader(remote, batch_size=5, num_workers=2)
    ref = torch.utils.data.DataLoader(local, batch_size=5)
    for (a, la), (b, lb) in zip(dl, ref):
        assert torch.equal(a, b) and torch.equal(la, lb)
    remote._source.close()


def test_unknown_protocol_and_bad_options():
    with pytest.raises(ValueError):
        FsspecSource("nosuchproto://x/y")
    with pytest.raises(ValueError):
        FsspecSource("http://127.0.0.1:1/", cache="disk")
    with pytest.raises(ValueError):
        FsspecSource("http://127.0.0.1:1/", timeout=0)


# -- the server helper itself --------------------------------------------------------------

def test_serve_directory_helper(image_tree):
    import threading
    import urllib.error
    import urllib.request

    from asyncfeed._bench.httpserve import serve_directory

    with serve_directory(image_tree, latency=0.05) as url:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/")
        names = [t.name for t in threading.enumerate()]
        assert "asyncfeed-httpserve" in names
        t0 = time.perf_counter()
        with urllib.request.urlopen(url + "cat/im%200.jpg") as r:
            body = r.read()
            assert r.headers["Content-Length"] == str(len(body))
        assert time.perf_counter() - t0 >= 0.05
        assert body == _bytes(image_tree, "cat/im 0.jpg")
        req = urllib.request.Request(url + "cat/im%200.jpg", headers={"Range": "bytes=2-9"})
        with urllib.request.urlopen(req) as r:
            assert r.status == 206 and r.read() == body[2:10]
            assert r.headers["Content-Range"] == f"bytes 2-9/{len(body)}"
        with urllib.request.urlopen(urllib.request.Request(url + "cat/im%200.jpg",
                                                           method="HEAD")) as r:
            assert r.read() == b"" and r.headers["Content-Length"] == str(len(body))
        with urllib.request.urlopen(url + "dog%20b/") as r:
            index = r.read().decode()
        assert 'href="x%20y/"' in index and 'href="im%200.jpg"' in index
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "..%2f..%2fetc/passwd")
        assert info.value.code in (403, 404)
    assert "asyncfeed-httpserve" not in [t.name for t in threading.enumerate()]


def test_server_close_wakes_stalled_handlers(image_tree):
    import threading

    from asyncfeed._bench.httpserve import DirectoryServer

    server = DirectoryServer(image_tree).start()
    server.add_fault("*", "stall", after=10)
    src = fast_source(server.url, timeout=10.0, retries=0)
    result = []
    reader = threading.Thread(target=lambda: result.append(
        _swallow(lambda: src.read_sync(server.url + "cat/im%200.jpg"))))
    reader.start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    server.close()  # must not wait for the stalled request to time out
    assert time.perf_counter() - t0 < 3.0
    reader.join()
    assert isinstance(result[0], OSError)
    src.close()


def _swallow(fn):
    try:
        return fn()
    except Exception as e:
        return e


def test_server_as_a_child_process(image_tree):
    import signal
    import subprocess
    import urllib.request

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src"),
         os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "asyncfeed._bench.httpserve", image_tree,
                          "--latency", "0"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = p.stdout.readline().strip()
        with urllib.request.urlopen(url + "cat/im%200.jpg") as r:
            assert r.read() == _bytes(image_tree, "cat/im 0.jpg")
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
