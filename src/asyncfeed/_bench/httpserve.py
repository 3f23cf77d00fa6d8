"""A small threaded HTTP file server for tests and benchmarks (loopback only by default).

``serve_directory(root, latency=0.02)`` serves a directory tree the way a plain
Apache or nginx ``autoindex`` does: files with ``Content-Length`` (``Range``
supported), directories as an HTML index of ``<a href>`` links (what fsspec's
``HTTPFileSystem`` parses), with a fixed delay per request to stand in for a
remote object store.  ``DirectoryServer`` adds fault injection for tests: a status
code for the first *k* requests of a path, a stall or a dropped connection part way
through a body, a body trickled slowly, and per-path request counts.  ``ThreadedHTTPServer`` is the
reusable part (thread, loop, faults, counts) for other kinds of test servers.

The server runs an asyncio loop (aiohttp's low-level server, no routing, no access
log) on one named, non-daemon thread; ``close()`` stops it, wakes every stalled
handler and joins the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import html
import math
import os
import random
import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Literal
from urllib.parse import quote, unquote, urlsplit

from aiohttp import web

if TYPE_CHECKING:
    import argparse

    import aiohttp

FaultKind = Literal["status", "stall", "drop", "delay", "trickle"]


@dataclass(frozen=True)
class TailModel:
    """A remote store's latency, as the server plays it (each part can be turned off).

    Every request waits a lognormal time with median ``median`` seconds and 99th
    percentile ``p99`` (``sigma = ln(p99 / median) / 2.326``; ``p99 <= median``:
    a fixed ``median``).  ``error_rate`` of first attempts are answered ``503``
    (the retry of a path answered 503 is served normally: a store shedding load,
    not a broken object).  ``stall_rate`` of requests wait ``stall_s`` more before
    sending any byte (a stuck request).  ``seed`` makes the draws repeatable for
    a given arrival order.
    """

    median: float = 0.02
    p99: float = 0.25
    error_rate: float = 0.0
    stall_rate: float = 0.0
    stall_s: float = 2.0
    seed: int = 0

    @property
    def sigma(self) -> float:
        if self.median <= 0 or self.p99 <= self.median:
            return 0.0
        return math.log(self.p99 / self.median) / 2.3263

    def describe(self) -> str:
        parts = [f"lognormal median {self.median * 1e3:g} ms, p99 {self.p99 * 1e3:g} ms"
                 if self.sigma else f"{self.median * 1e3:g} ms"]
        if self.error_rate:
            parts.append(f"{self.error_rate:.0%} of first attempts 503")
        if self.stall_rate:
            parts.append(f"{self.stall_rate:.0%} stall {self.stall_s:g} s")
        return ", ".join(parts)


class _TailState:
    """The draws of a :class:`TailModel` (server thread only)."""

    def __init__(self, model: TailModel) -> None:
        self.model = model
        self.rng = random.Random(model.seed)
        self.refused: set[str] = set()   # paths answered 503, whose next request succeeds
        self.errors = 0
        self.stalls = 0

    def delay(self) -> float:
        m = self.model
        if m.median <= 0:
            return 0.0
        d = m.median * math.exp(self.rng.gauss(0.0, m.sigma)) if m.sigma else m.median
        if m.stall_rate and self.rng.random() < m.stall_rate:
            self.stalls += 1
            d += m.stall_s
        return d

    def refuse(self, rel: str) -> bool:
        if not self.model.error_rate:
            return False
        if rel in self.refused:
            self.refused.discard(rel)
            return False
        if self.rng.random() < self.model.error_rate:
            self.refused.add(rel)
            self.errors += 1
            return True
        return False


@dataclass
class Fault:
    """What to do to requests whose path matches ``pattern`` (``fnmatch``, relative to root).

    ``kind``: ``"status"`` answers ``status`` with a short body; ``"stall"`` sends the
    headers and the first ``after`` bytes, then nothing until the server closes (or,
    with ``delay``, for ``delay`` seconds, then the rest); ``"drop"`` sends the
    headers and ``after`` bytes, then closes the connection; ``"delay"`` waits
    ``delay`` seconds more before answering normally; ``"trickle"`` sends the
    headers and ``after`` bytes, then the rest ``chunk`` bytes every ``interval``
    seconds (a slow but steady body).
    ``times`` is how many matching requests it applies to (``None``: all of them).
    ``chunked`` sends the body with chunked transfer encoding instead of a
    ``Content-Length`` (for ``stall``/``drop``).  ``body``/``headers`` replace the
    default body and add headers of a ``status`` answer (an S3 XML error...).
    """

    pattern: str
    kind: FaultKind
    status: int = 503
    after: int = 0
    delay: float = 0.0
    times: int | None = None
    chunked: bool = False
    body: str | None = None
    headers: dict[str, str] | None = None
    chunk: int = 1
    interval: float = 0.0
    applied: int = 0

    def take(self) -> bool:
        if self.times is not None and self.applied >= self.times:
            return False
        self.applied += 1
        return True


class ThreadedHTTPServer:
    """An aiohttp low-level server on its own thread, with fault injection and counts.

    Subclasses answer requests in ``async _answer(request, rel, fault)``; ``rel`` is
    the unquoted request path without its leading ``/``, ``fault`` the
    :class:`Fault` that applies (``status`` and ``delay`` faults and ``latency``
    are already handled; ``stall``/``drop``/``trickle`` are the subclass's to honour, with
    ``_broken``).  Use as a context manager or call ``start()``/``close()``.
    ``url`` is the base URL, ending in ``/``.  ``latency`` seconds are waited
    before answering every request (an ``asyncio.sleep``: many requests wait at
    once, as they would on a remote server).  ``requests`` counts requests per
    relative path; ``in_flight``/``max_in_flight`` count requests being answered.
    ``tail`` (a :class:`TailModel`) replaces ``latency`` with a latency
    distribution, first-attempt 503s and stalls, applied to file requests (paths
    not ending in ``/``); ``tail_errors``/``tail_stalls`` count what it did.
    """

    def __init__(self, *, latency: float = 0.0, host: str = "127.0.0.1", port: int = 0,
                 thread_name: str = "asyncfeed-httpserve", tail: TailModel | None = None) -> None:
        self.latency = float(latency)
        self._tail = _TailState(tail) if tail is not None else None
        self.host = host
        self.port = port
        self.requests: Counter[str] = Counter()
        self.in_flight = 0       # requests being answered now
        self.max_in_flight = 0   # the most at once since start (or reset_counts)
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._thread_name = thread_name
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._closing: asyncio.Event | None = None

    # -- control (any thread) ----------------------------------------------------
    @property
    def url(self) -> str:
        if not self._ready.is_set():
            raise RuntimeError("server not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def add_fault(self, pattern: str, kind: FaultKind, **options: object) -> Fault:
        """Add a :class:`Fault` (checked in the order added; the first that applies wins)."""
        fault = Fault(pattern, kind, **options)  # type: ignore[arg-type]
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def count(self, path: str) -> int:
        """Requests seen so far for ``path`` (relative to the root, unquoted)."""
        with self._lock:
            return self.requests[path.lstrip("/")]

    @property
    def tail_errors(self) -> int:
        return self._tail.errors if self._tail is not None else 0

    @property
    def tail_stalls(self) -> int:
        return self._tail.stalls if self._tail is not None else 0

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.max_in_flight = self.in_flight

    def start(self) -> "ThreadedHTTPServer":
        if self._thread is not None:
            raise RuntimeError("server already started")
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=False)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise RuntimeError(f"HTTP server failed to start: {self._error}") from self._error
        return self

    def close(self) -> None:
        """Stop serving, wake stalled handlers and join the thread (idempotent)."""
        thread, loop = self._thread, self._loop
        if thread is None:
            return
        if loop is not None and self._stop is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(self._stop.set)
        thread.join()
        self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the server thread ---------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by start() if it happens before ready
            self._error = e
        finally:
            self._ready.set()
            with contextlib.suppress(Exception):  # handlers still running: cancel and reap
                left = asyncio.all_tasks(loop)
                for task in left:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._closing = asyncio.Event()
        server = web.Server(self._handle, access_log=None)
        srv = await asyncio.get_running_loop().create_server(server, self.host, self.port,
                                                              reuse_address=True, backlog=1024)
        self.port = srv.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            self._closing.set()  # wake stalled handlers
            srv.close()
            await server.shutdown(timeout=1.0)
            await srv.wait_closed()
            await self._on_close()

    async def _on_close(self) -> None:
        """Release what a subclass opened on the server loop."""

    def _fault_for(self, rel: str) -> Fault | None:
        with self._lock:
            self.requests[rel] += 1
            for fault in self._faults:
                if fnmatch.fnmatchcase(rel, fault.pattern) and fault.take():
                    return fault
        return None

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.in_flight += 1  # only this thread writes these
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight
        try:
            return await self._handle_one(request)
        finally:
            self.in_flight -= 1

    async def _handle_one(self, request: web.BaseRequest) -> web.StreamResponse:
        rel = unquote(urlsplit(request.raw_path).path).lstrip("/")
        fault = self._fault_for(rel)
        tail = self._tail if not rel.endswith("/") and rel else None
        if tail is not None:
            with self._lock:
                wait, refuse = tail.delay(), tail.refuse(rel)
            if wait > 0:
                await self._wait_closing(wait)
            if refuse:
                return self._tail_error(rel)
        elif self.latency > 0:
            await asyncio.sleep(self.latency)
        if fault is not None and fault.kind == "delay":
            await self._wait_closing(fault.delay)
        if fault is not None and fault.kind == "status":
            body = fault.body if fault.body is not None else f"injected {fault.status} for {rel}\n"
            headers = dict(fault.headers or {})
            headers.setdefault("Content-Type", "text/plain")
            return web.Response(status=fault.status, headers=headers, body=body.encode())
        return await self._answer(request, rel, fault)

    def _tail_error(self, rel: str) -> web.StreamResponse:
        """The answer of a request the tail model refuses (a subclass may say it its way)."""
        return web.Response(status=503, text=f"slow down: {rel}\n")

    async def _answer(self, request: web.BaseRequest, rel: str,
                      fault: Fault | None) -> web.StreamResponse:
        raise NotImplementedError

    async def _wait_closing(self, seconds: float | None) -> None:
        """Sleep ``seconds`` (None: forever); if the server closes first, abort the request."""
        assert self._closing is not None
        try:
            await asyncio.wait_for(self._closing.wait(), seconds)
        except asyncio.TimeoutError:
            return
        raise asyncio.CancelledError  # closing: the connection is dropped

    async def _broken(self, request: web.BaseRequest, data: bytes,
                      fault: Fault) -> web.StreamResponse:
        """Answer ``data`` as a ``stall``, ``drop`` or ``trickle`` fault says."""
        resp = web.StreamResponse(status=200)
        resp.content_type = "application/octet-stream"
        if fault.chunked:
            resp.enable_chunked_encoding()
        else:
            resp.content_length = len(data)
        await resp.prepare(request)
        if fault.after:
            await resp.write(data[:fault.after])
            await asyncio.sleep(0.01)  # let the partial body reach the client first
        if fault.kind == "trickle" or (fault.kind == "stall" and fault.delay > 0):
            try:
                if fault.kind == "stall":
                    await self._wait_closing(fault.delay)
                    await resp.write(data[fault.after:])
                else:
                    step = max(1, fault.chunk)
                    for at in range(fault.after, len(data), step):
                        await self._wait_closing(fault.interval)
                        await resp.write(data[at:at + step])
                await resp.write_eof()
                return resp
            except (ConnectionError, asyncio.CancelledError):
                pass  # the client gave up (or the server closes): drop the connection
        elif fault.kind == "stall":
            with contextlib.suppress(asyncio.CancelledError):
                await self._wait_closing(None)
        transport = request.transport
        if transport is not None:
            transport.abort()
        raise asyncio.CancelledError  # nothing more is sent on this connection


class DirectoryServer(ThreadedHTTPServer):
    """Serve the directory tree ``root`` (see :class:`ThreadedHTTPServer` for the rest).

    Files are answered with ``Content-Length`` (``Range`` and ``HEAD`` supported),
    directories with an Apache-style HTML index (``<a href>`` links, ``/`` after
    directory names, sort links and a parent link as Apache writes them).
    """

    def __init__(self, root: str | os.PathLike[str], *, latency: float = 0.0,
                 host: str = "127.0.0.1", port: int = 0,
                 thread_name: str = "asyncfeed-httpserve", tail: TailModel | None = None) -> None:
        super().__init__(latency=latency, host=host, port=port, thread_name=thread_name,
                         tail=tail)
        self.root = os.path.realpath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"no such directory: {self.root}")

    async def _answer(self, request: web.BaseRequest, rel: str,
                      fault: Fault | None) -> web.StreamResponse:
        path = os.path.realpath(os.path.join(self.root, rel))
        if path != self.root and not path.startswith(self.root + os.sep):
            return web.Response(status=403, text="outside the served root\n")
        if os.path.isdir(path):
            return web.Response(text=self._index(rel, path), content_type="text/html")
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return web.Response(status=404, text=f"not found: {rel}\n")
        except PermissionError:
            return web.Response(status=403, text=f"forbidden: {rel}\n")
        if fault is not None and fault.kind in ("stall", "drop", "trickle"):
            return await self._broken(request, data, fault)
        status, headers = 200, {}
        rng = request.headers.get("Range")
        if rng is not None:
            span = _parse_range(rng, len(data))
            if span is None:
                return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}"})
            start, end = span
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            data, status = data[start:end], 206
        headers["Accept-Ranges"] = "bytes"  # a HEAD gets the same headers, no body (aiohttp)
        return web.Response(status=status, body=data, headers=headers,
                            content_type="application/octet-stream")

    def _index(self, rel: str, path: str) -> str:
        title = html.escape("/" + rel)
        rows = ['<tr><th><a href="?C=N;O=D">Name</a></th><th><a href="?C=M;O=A">Last modified</a>'
                '</th><th><a href="?C=S;O=A">Size</a></th></tr>']
        parent = "/" + rel.rstrip("/").rpartition("/")[0]
        if rel:
            rows.append(f'<tr><td><a href="{html.escape(quote(parent.rstrip("/") + "/"))}">'
                        "Parent Directory</a></td><td></td><td>-</td></tr>")
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            is_dir = e.is_dir()
            name = e.name + ("/" if is_dir else "")
            size = "-" if is_dir else str(e.stat().st_size)
            rows.append(f'<tr><td><a href="{html.escape(quote(name))}">{html.escape(name)}</a>'
                        f"</td><td></td><td>{size}</td></tr>")
        return (f"<!DOCTYPE HTML PUBLIC \"-//W3C//DTD HTML 3.2 Final//EN\">\n<html><head>"
                f"<title>Index of {title}</title></head><body><h1>Index of {title}</h1>\n"
                f"<table>\n" + "\n".join(rows) + "\n</table></body></html>\n")


def _parse_range(value: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` to a half-open span, or None."""
    unit, _, spec = value.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":
            n = int(last)
            start, end = max(0, size - n), size
        else:
            start = int(first)
            end = size if last == "" else min(size, int(last) + 1)
    except ValueError:
        return None
    if start >= end or start >= size:
        return None
    return start, end


@contextlib.contextmanager
def serve_directory(root: str | os.PathLike[str], latency: float = 0.02,
                    host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``root`` over HTTP for the duration of the ``with`` block; yields the base URL.

    ``latency`` seconds are added to every request.  The server thread is joined
    when the block exits.
    """
    with DirectoryServer(root, latency=latency, host=host, port=port) as server:
        yield server.url



# headers a proxy does not pass on: hop-by-hop ones, and those the relaying
# response sets itself (aiohttp writes its own length, encoding, date and server)
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate",
                         "proxy-authorization", "te", "trailers", "transfer-encoding",
                         "upgrade", "host", "content-length", "content-encoding", "date",
                         "server"})


async def forward(session: aiohttp.ClientSession, target: str,
                  request: web.BaseRequest) -> tuple[int, dict[str, str], str | None, bytes]:
    """Send ``request`` on to ``target`` (same method, path, query and body); returns
    the answer's status, end-to-end headers, declared Content-Length and body."""
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    async with session.request(request.method, target + request.raw_path, headers=headers,
                               data=body, allow_redirects=False) as r:
        data = await r.read()
        out = {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS}
        return r.status, out, r.headers.get("Content-Length"), data


def relayed(request: web.BaseRequest, status: int, headers: dict[str, str],
            length: str | None, data: bytes) -> web.Response:
    """The response that passes a forwarded answer back (a HEAD keeps the upstream's
    Content-Length without a body)."""
    if request.method == "HEAD":
        resp = web.Response(status=status, headers=headers)
        if length is not None:
            resp.headers["Content-Length"] = length
        return resp
    return web.Response(status=status, headers=headers, body=data)


def add_tail_arguments(ap: argparse.ArgumentParser) -> None:
    """The :class:`TailModel` flags (shared by the bench's servers)."""
    ap.add_argument("--p99", type=float, default=0.0,
                    help="99th percentile of a lognormal latency whose median is --latency "
                         "(seconds; 0: a fixed latency)")
    ap.add_argument("--errors", type=float, default=0.0,
                    help="share of first attempts answered 503 (retries succeed)")
    ap.add_argument("--stalls", type=float, default=0.0,
                    help="share of requests that stall --stall-s seconds before any byte")
    ap.add_argument("--stall-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)


def tail_from_arguments(args: argparse.Namespace) -> TailModel | None:
    """The model the flags describe, or None for a plain fixed latency."""
    if not (args.p99 or args.errors or args.stalls):
        return None
    return TailModel(median=args.latency, p99=args.p99, error_rate=args.errors,
                     stall_rate=args.stalls, stall_s=args.stall_s, seed=args.seed)


def main(argv: list[str] | None = None) -> None:
    """``python -m asyncfeed._bench.httpserve ROOT [--latency S] [--p99 S] [--errors P]
    [--stalls P] [--port N]``: serve until SIGTERM/SIGINT.

    Prints the base URL on the first line of stdout, so a parent process can run the
    server out of its own process (its CPU and GIL apart from the loader's) and read
    the URL.
    """
    import argparse

    ap = argparse.ArgumentParser(prog="python -m asyncfeed._bench.httpserve", description=main.__doc__)
    ap.add_argument("root")
    ap.add_argument("--latency", type=float, default=0.02,
                    help="seconds added per request (the median with --p99)")
    add_tail_arguments(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    wait = stop_signal_waiter()
    with DirectoryServer(args.root, latency=args.latency, host=args.host, port=args.port,
                         tail=tail_from_arguments(args)) as s:
        print(s.url, flush=True)
        wait()


def stop_signal_waiter() -> Callable[[], None]:
    """From now on SIGTERM and SIGINT no longer end the process; the returned function
    blocks (in the main thread) until one has arrived, since this call.

    Not ``pthread_sigmask`` + ``sigwait``: threads started at import (OpenBLAS's, by
    numpy) do not block the signals, and one landing there took the default action
    (the process died with -15).  Handled instead, whichever thread takes the signal
    writes its number to the wakeup pipe, which the waiter reads.
    """
    import signal

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)

    def wait() -> None:
        os.read(wake_r, 1)
    return wait


if __name__ == "__main__":
    main()
