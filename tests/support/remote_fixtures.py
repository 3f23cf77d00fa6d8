"""Real servers on 127.0.0.1 for the remote-storage tests, and the data they serve.

- ``image_tree``: a small ImageFolder tree (class names with a space and a non-ASCII
  letter, nested subfolders, a non-image file), JPEGs made with simplejpeg.
- ``http_server``: :class:`asyncfeed._bench.httpserve.DirectoryServer` over that tree,
  fresh per test (faults and request counts start empty).
- ``moto_endpoint``: moto's S3 server (``ThreadedMotoServer``) on a free port, one
  per session; ``s3_tree``: the image tree uploaded to a bucket with boto3.
- ``s3_proxy``: a fault-injecting reverse proxy in front of moto, fresh per test,
  for what moto cannot do itself (503 SlowDown, stalls, dropped connections).

Import with ``from support.remote_fixtures import *``.
"""

from __future__ import annotations

import logging
import os
from typing import Iterator

import aiohttp
import numpy as np
import pytest
import simplejpeg
from aiohttp import web

from asyncfeed._bench.httpserve import (DirectoryServer, Fault, ThreadedHTTPServer, forward,
                                        relayed)  # noqa: E402

__all__ = ["CLASSES", "S3Proxy", "fast_source", "http_server", "image_tree", "make_image_tree", "s3_client",
           "moto_endpoint", "s3_bucket", "s3_options", "s3_proxy", "s3_tree", "slowdown_xml", "write_jpeg"]

CLASSES = ("cat", "dog b", "\u00e9mu")
_SUBDIRS = ("", "x", "x y")
_BUCKET = "asyncfeed-test"
_KEY = "test-key"
_SECRET = "test-secret"


def write_jpeg(path: str, h: int, w: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, h)[:, None, None]
    x = np.linspace(0, 1, w)[None, :, None]
    base = rng.uniform(0, 255, (1, 1, 3))
    img = (base * (0.5 + 0.5 * np.sin(6 * x + 4 * y + rng.uniform(0, 6, (1, 1, 3))))
           + rng.normal(0, 3, (h, w, 3)))
    img = np.clip(img, 0, 255).astype(np.uint8)
    with open(path, "wb") as f:
        f.write(simplejpeg.encode_jpeg(img, quality=90))


def make_image_tree(root: str, per_dir: int = 3) -> str:
    """``root/<class>/[<sub>/]im <i>.jpg`` for every class and subfolder, plus noise files."""
    seed = 0
    for cls in CLASSES:
        for sub in _SUBDIRS:
            d = os.path.join(root, cls, sub)
            os.makedirs(d, exist_ok=True)
            for i in range(per_dir):
                seed += 1
                write_jpeg(os.path.join(d, f"im {i}.jpg"), 40 + seed % 7, 48 + seed % 5, seed)
        with open(os.path.join(root, cls, "notes.txt"), "w") as f:
            f.write("not an image\n")
    with open(os.path.join(root, "README"), "w") as f:
        f.write("a file next to the class folders\n")
    return root


@pytest.fixture(scope="session")
def image_tree(tmp_path_factory) -> str:
    return make_image_tree(str(tmp_path_factory.mktemp("images")))


@pytest.fixture
def http_server(image_tree) -> Iterator[DirectoryServer]:
    with DirectoryServer(image_tree) as server:
        yield server


def fast_source(url: str, **options):
    """An FsspecSource with short backoff and timeout, as the fault tests want."""
    from asyncfeed._io.fsspec import FsspecSource
    options.setdefault("backoff", 0.01)
    options.setdefault("max_backoff", 0.05)
    options.setdefault("timeout", 5.0)
    return FsspecSource(url, **options)


# -- S3 (moto) ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def s3_options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "key": _KEY, "secret": _SECRET,
            "client_kwargs": {"region_name": "us-east-1"}}


def _boto(endpoint: str):
    import boto3
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=_KEY, aws_secret_access_key=_SECRET)


@pytest.fixture(scope="session")
def s3_bucket(moto_endpoint) -> str:
    """An empty bucket on the moto server (its name)."""
    _boto(moto_endpoint).create_bucket(Bucket=_BUCKET)
    return _BUCKET


@pytest.fixture(scope="session")
def s3_tree(moto_endpoint, s3_bucket, image_tree) -> str:
    """The image tree under ``s3://asyncfeed-test/images``; returns that URL."""
    client = _boto(moto_endpoint)
    for dirpath, _, files in os.walk(image_tree):
        for name in files:
            path = os.path.join(dirpath, name)
            key = "images/" + os.path.relpath(path, image_tree).replace(os.sep, "/")
            client.upload_file(path, _BUCKET, key)
    return f"s3://{_BUCKET}/images"


@pytest.fixture(scope="session")
def s3_client(moto_endpoint):
    return _boto(moto_endpoint)


def slowdown_xml() -> str:
    return ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
            "<Message>Please reduce your request rate.</Message><RequestId>1</RequestId></Error>")




class S3Proxy(ThreadedHTTPServer):
    """Forwards every request to ``target`` (moto), applying the faults it is given.

    Paths are ``bucket/key`` (path-style addressing, what botocore uses for an IP
    endpoint).  ``status`` faults answer without asking moto; ``stall``/``drop``/
    ``trickle`` faults apply to successful GETs.
    """

    def __init__(self, target: str, **kw) -> None:
        kw.setdefault("thread_name", "asyncfeed-test-s3proxy")
        super().__init__(**kw)
        self.target = target.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self.clients: list[tuple[str, str, str]] = []  # (method, path, "botocore" or "other")

    def throttle(self, pattern: str, times: int) -> Fault:
        return self.add_fault(pattern, "status", status=503, times=times, body=slowdown_xml(),
                              headers={"Content-Type": "application/xml"})

    async def _handle_one(self, request: web.BaseRequest) -> web.StreamResponse:
        from urllib.parse import unquote, urlsplit
        rel = unquote(urlsplit(request.raw_path).path).lstrip("/")
        agent = request.headers.get("User-Agent", "")
        self.clients.append((request.method, rel, "botocore" if "Botocore" in agent else "other"))
        return await super()._handle_one(request)

    async def _answer(self, request: web.BaseRequest, rel: str,
                      fault: Fault | None) -> web.StreamResponse:
        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        status, out, length, data = await forward(self._session, self.target, request)
        if (fault is not None and fault.kind in ("stall", "drop", "trickle")
                and request.method == "GET"
                and status in (200, 206)):
            return await self._broken(request, data, fault)
        return relayed(request, status, out, length, data)

    async def _on_close(self) -> None:
        if self._session is not None:
            await self._session.close()


@pytest.fixture
def s3_proxy(moto_endpoint, s3_tree) -> Iterator[S3Proxy]:
    with S3Proxy(moto_endpoint) as proxy:
        yield proxy
