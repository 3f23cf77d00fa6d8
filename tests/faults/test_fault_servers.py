"""Hostile HTTP servers under a remote ImageFolder: good samples arrive once, bad ones named.

A real server on 127.0.0.1 (``DirectoryServer``, fault injection) serves the image
tree; faults hit some files while the loader runs with ``on_error="skip"``:
connections dropped part way through a body (with ``Content-Length`` and
chunked), a body cut short of its ``Content-Length``, a 200 whose body is an
HTML page, a stalled body, 503 with ``Retry-After`` (transient: retried, the
sample arrives), 404, and the server going away during the pass.  A raw socket
server adds what a well-behaved HTTP server cannot send: an absurd
``Content-Length``, a reset (RST) mid-body and garbage instead of a status
line.  Each case checks that nothing hangs, every good sample arrives once,
every failed one is recorded with its URL and reason, and nothing is left
open afterwards.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import struct
import threading
import tracemalloc
from urllib.parse import quote

import pytest
import torch

from asyncfeed import AsyncLoader, ImageFolder, RemoteReadError, decode_image
from asyncfeed._bench.httpserve import DirectoryServer
from support.faults import RawServer, Resources, assert_released
from support.remote_fixtures import image_tree  # noqa: F401 - a fixture

pytestmark = [pytest.mark.faults, pytest.mark.timeout(90)]

FAST = dict(timeout=0.5, retries=2, backoff=0.01, max_backoff=0.05)


def _digest(img: torch.Tensor) -> str:
    return hashlib.sha1(img.contiguous().numpy().tobytes()).hexdigest()


def _expected(root: str, ds: ImageFolder) -> dict[str, str]:
    """URL -> digest of the decoded local file, for every sample of ``ds``."""
    out = {}
    base = ds.root.rstrip("/") + "/"
    for url, _ in ds.samples:
        rel = url[len(base):]
        from urllib.parse import unquote
        with open(os.path.join(root, unquote(rel)), "rb") as f:
            out[url] = _digest(torch.from_numpy(decode_image(f.read(), 32)))
    return out


def _run(ds: ImageFolder, **kw) -> tuple[list[str], dict[str, str]]:
    """One skip-mode pass: (digests delivered, {url: error} of the skipped)."""
    loader = AsyncLoader(ds, batch_size=4, num_threads=2, on_error="skip", **kw)
    got = []
    for imgs, _ in loader:
        got.extend(_digest(img) for img in imgs)
    skipped = {s.source: s.error for s in loader.stats().skipped}
    loader.close()
    return got, skipped


# (fault pattern, fault options, files it breaks for good: reason regex or None if transient)
CASES = {
    "drop_mid_body": ("cat/im 0.jpg", dict(kind="drop", after=200),
                      r"IncompleteResponse|connection closed|ClientPayloadError|Errno"),
    "drop_chunked": ("cat/x/im 1.jpg", dict(kind="drop", after=200, chunked=True),
                     r"IncompleteResponse|connection closed|ClientPayloadError|Errno"),
    "html_200": ("dog b/im 2.jpg", dict(kind="status", status=200,
                                        body="<html><body>Welcome</body></html>"),
                 "not an image file"),
    "stall": ("\u00e9mu/im 0.jpg", dict(kind="stall", after=100), r"RemoteTimeoutError|timed out"),
    "404": ("\u00e9mu/x/im 2.jpg", dict(kind="status", status=404), "FileNotFoundError"),
    "503_retry_after": ("dog b/x/im 0.jpg", dict(kind="status", status=503, times=2,
                                                 headers={"Retry-After": "0"}), None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_server_faults_under_the_loader(image_tree, case):  # noqa: F811
    pattern, options, reason = CASES[case]
    before = Resources.snapshot()
    with DirectoryServer(image_tree) as server:
        ds = ImageFolder(server.url, size=32, **FAST)
        want = _expected(image_tree, ds)
        options = dict(options)
        kind = options.pop("kind")
        server.add_fault(pattern, kind, **options)
        got, skipped = _run(ds)
        ds._source.close()
    bad = {url for url in want if url.endswith(quote(pattern))}
    assert len(bad) == 1
    if reason is None:  # transient: retried, nothing lost
        assert skipped == {}
        assert sorted(got) == sorted(want.values())
    else:
        assert set(skipped) == bad, skipped
        assert re.search(reason, next(iter(skipped.values()))), skipped
        assert sorted(got) == sorted(d for url, d in want.items() if url not in bad)
    assert_released(before)


def test_server_gone_mid_pass(image_tree):  # noqa: F811
    before = Resources.snapshot()
    server = DirectoryServer(image_tree, latency=0.05).start()
    ds = ImageFolder(server.url, size=32, **FAST)
    want = _expected(image_tree, ds)
    loader = AsyncLoader(ds, batch_size=3, num_threads=2, on_error="skip", io_concurrency=2)
    got = []
    for k, (imgs, _) in enumerate(loader):
        got.extend(_digest(img) for img in imgs)
        if k == 1:
            server.close()  # gone: refused connections from now on
    skipped = loader.stats().skipped
    loader.close()
    ds._source.close()
    assert skipped, "nothing failed after the server went away"
    assert all(re.search(r"RemoteReadError|Connect|refused|Errno|closed", s.error)
               for s in skipped), [s.error for s in skipped]
    assert {s.source for s in skipped} <= set(want)
    assert len(got) + len(skipped) == len(want)
    assert len(set(got)) == len(got)
    assert_released(before)


# -- what only a raw socket can send ---------------------------------------------------

def _absurd(request, sock, server):
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 9000000000000\r\n\r\n" + b"\xff" * 5000)


def _reset(request, sock, server):
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"\xff" * 3000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST


def _garbage(request, sock, server):
    sock.sendall(os.urandom(300) + b"\r\n\r\n")


def _stall_headers(request, sock, server):
    server.release.wait(30)


@pytest.mark.parametrize("respond,reason", [
    (_absurd, r"declared Content-Length: 9000000000000 and sent 5000"),
    (_reset, r"connection closed after 3000 of 100000|reset"),
    (_garbage, r"bad status line|IncompleteResponse"),
    (_stall_headers, r"RemoteTimeoutError|timed out"),
], ids=["absurd_content_length", "reset_mid_body", "garbage_status", "stall_headers"])
def test_raw_server_faults_are_named_and_cost_no_memory(respond, reason):
    from support.remote_fixtures import fast_source
    before = Resources.snapshot()
    with RawServer(respond) as server:
        src = fast_source(server.url, timeout=0.5, retries=1)
        url = server.url + "a.jpg"
        tracemalloc.start()
        try:
            with pytest.raises(RemoteReadError) as info:
                src.read_sync(url)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        src.close()
        server.release.set()
    msg = f"{info.value} <- {info.value.__cause__!r}"
    assert url in str(info.value) and re.search(reason, msg), msg
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MiB allocated"
    assert_released(before)
