"""Workload (e): the data set on remote storage, with a latency model, three ways.

- ``http``: ``python -m asyncfeed._bench.httpserve ROOT --latency S [tail flags]``, a
  process of its own (its CPU and GIL apart from the loaders').
- ``s3``: moto's S3 server (a process) holding the data set in a bucket, behind a
  proxy process (``python -m asyncfeed._bench.remote s3proxy``) that plays the
  same latency model, answering refusals as S3's ``503 SlowDown``.
- ``mount``: a FUSE passthrough of the folder (:mod:`.slowfs`) adding a latency per
  open and per first read, read as a local path.

For each, one server plays the latency (the ``tail`` model when given, else a fixed
``latency``) and another answers at once, for the 0 ms reference (for ``mount``,
the reference is the folder itself, in the page cache).  Everything is started
once for the whole workload and stopped at its end (``close()``).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
from typing import Any

from .httpserve import TailModel

KINDS = ("http", "s3", "mount")
_BUCKET = "asyncfeed-bench"
_S3_KEY, _S3_SECRET = "bench-key", "bench-secret"


def tail_flags(latency: float, tail: TailModel | None) -> list[str]:
    flags = ["--latency", str(tail.median if tail else latency)]
    if tail is not None:
        flags += ["--p99", str(tail.p99), "--errors", str(tail.error_rate),
                  "--stalls", str(tail.stall_rate), "--stall-s", str(tail.stall_s),
                  "--seed", str(tail.seed)]
    return flags


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(
        [src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _spawn(args: list[str], what: str, timeout: float) -> tuple[subprocess.Popen, str]:
    """Start ``python args...`` and read the URL it prints on its first line."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=_env())
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().strip() if ready else ""
    if not line.startswith("http"):
        _stop(proc)
        raise RuntimeError(f"{what} did not start (exit status {proc.poll()})")
    return proc, line.rstrip("/") + "/"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


class RemoteServers:
    """The servers of workload (e) for the ``kinds`` asked.

    ``source(dataset)`` gives, for a run's data set name (``remote``/``remote0`` for
    HTTP, ``s3``/``s30``, ``mount``/``mount0``), the root and the extra
    ``ImageFolder`` options; ``pids`` are the serving processes (their CPU is
    reported apart); ``describe(kind)`` says what latency a kind plays.
    """

    def __init__(self, root: str, kinds: tuple[str, ...], latency: float,
                 tail: TailModel | None, *, mount_ms: tuple[float, float] = (2.0, 10.0),
                 start_timeout: float = 60.0) -> None:
        self.root = root
        self.latency, self.tail = latency, tail
        self.mount_ms = mount_ms
        self._procs: list[subprocess.Popen] = []
        self._roots: dict[str, tuple[str, dict[str, Any]]] = {}
        self._mount: Any = None
        self._scratch: tempfile.TemporaryDirectory | None = None
        try:
            if "http" in kinds:
                for name, model in (("remote", tail), ("remote0", None)):
                    lat = latency if name == "remote" else 0.0
                    proc, url = _spawn(["-m", "asyncfeed._bench.httpserve", root,
                                        *tail_flags(lat, model)], "HTTP server", start_timeout)
                    self._procs.append(proc)
                    self._roots[name] = (url, {})
            if "s3" in kinds:
                self._start_s3(start_timeout)
            if "mount" in kinds:
                from .slowfs import SlowMount
                self._scratch = tempfile.TemporaryDirectory(prefix="asyncfeed-mount-")
                self._mount = SlowMount(root, os.path.join(self._scratch.name, "mnt"),
                                        open_ms=mount_ms[0], read_ms=mount_ms[1]).start()
                self._roots["mount"] = (self._mount.mountpoint, {"io": "auto"})
                self._roots["mount0"] = (root, {"io": "auto"})
        except BaseException:
            self.close()
            raise

    def _start_s3(self, timeout: float) -> None:
        proc, moto = _spawn(["-m", "asyncfeed._bench.remote", "moto"], "moto server", timeout)
        self._procs.append(proc)
        upload(self.root, moto.rstrip("/"))
        for name, model in (("s3", self.tail), ("s30", None)):
            lat = self.latency if name == "s3" else 0.0
            proc, url = _spawn(["-m", "asyncfeed._bench.remote", "s3proxy", moto,
                                *tail_flags(lat, model)], "S3 proxy", timeout)
            self._procs.append(proc)
            self._roots[name] = (f"s3://{_BUCKET}/data", {"storage_options": s3_options(url)})

    def source(self, dataset: str) -> tuple[str, dict[str, Any]]:
        return self._roots[dataset]

    def describe(self, kind: str) -> str:
        if kind == "mount":
            return (f"FUSE passthrough, {self.mount_ms[0]:g} ms per open, "
                    f"{self.mount_ms[1]:g} ms per first read")
        if self.tail is not None:
            return self.tail.describe()
        return f"{self.latency * 1e3:g} ms"

    @property
    def pids(self) -> list[int]:
        pids = [p.pid for p in self._procs]
        if self._mount is not None and self._mount._proc is not None:
            pids.append(self._mount._proc.pid)
        return pids

    def close(self) -> None:
        """Stop every server and unmount (idempotent)."""
        procs, self._procs = self._procs, []
        for proc in procs:
            _stop(proc)
        mount, self._mount = self._mount, None
        if mount is not None:
            mount.close()
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            scratch.cleanup()

    def __enter__(self) -> "RemoteServers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def s3_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint.rstrip("/"), "key": _S3_KEY, "secret": _S3_SECRET,
            "client_kwargs": {"region_name": "us-east-1"}}


def upload(root: str, endpoint: str) -> int:
    """Put the folder under ``s3://asyncfeed-bench/data`` on ``endpoint``; files sent."""
    import boto3
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=_S3_KEY, aws_secret_access_key=_S3_SECRET)
    client.create_bucket(Bucket=_BUCKET)
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            key = "data/" + os.path.relpath(path, root).replace(os.sep, "/")
            client.upload_file(path, _BUCKET, key)
            n += 1
    return n


def _s3_proxy_class() -> type:
    import aiohttp
    from aiohttp import web

    from .httpserve import ThreadedHTTPServer, forward, relayed

    class S3TailProxy(ThreadedHTTPServer):
        """Forwards every request to moto after the latency model's wait; refusals are
        S3's ``503 SlowDown``."""

        def __init__(self, target: str, **kw: Any) -> None:
            super().__init__(thread_name="asyncfeed-s3proxy", **kw)
            self.target = target.rstrip("/")
            self._session: aiohttp.ClientSession | None = None

        def _tail_error(self, rel: str) -> web.StreamResponse:
            body = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
                    "<Message>Please reduce your request rate.</Message></Error>")
            return web.Response(status=503, body=body.encode(), content_type="application/xml")

        async def _answer(self, request: web.BaseRequest, rel: str, fault: Any) -> web.StreamResponse:
            if self._session is None:
                self._session = aiohttp.ClientSession(
                    auto_decompress=False, connector=aiohttp.TCPConnector(limit=256))
            return relayed(request, *await forward(self._session, self.target, request))

        async def _on_close(self) -> None:
            if self._session is not None:
                await self._session.close()

    return S3TailProxy


def main(argv: list[str] | None = None) -> None:
    """``python -m asyncfeed._bench.remote moto`` (moto's S3 server) or ``... s3proxy
    TARGET [--latency S] [tail flags]``: serve until SIGTERM, printing the URL first."""
    import argparse

    from .httpserve import add_tail_arguments, stop_signal_waiter, tail_from_arguments

    ap = argparse.ArgumentParser(prog="python -m asyncfeed._bench.remote")
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("moto")
    px = sub.add_parser("s3proxy")
    px.add_argument("target")
    px.add_argument("--latency", type=float, default=0.02)
    add_tail_arguments(px)
    args = ap.parse_args(argv)
    wait = stop_signal_waiter()
    if args.what == "moto":
        import logging

        from moto.server import ThreadedMotoServer
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        print(f"http://{host}:{port}/", flush=True)
        wait()
        server.stop()
        return
    proxy = _s3_proxy_class()(args.target, latency=args.latency,
                              tail=tail_from_arguments(args))
    with proxy:
        print(proxy.url, flush=True)
        wait()


if __name__ == "__main__":
    main()
