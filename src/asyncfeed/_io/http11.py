"""A small keep-alive HTTP/1.1 client for GETs on the read hot path.

aiohttp costs about twice the CPU per small GET of what the socket work itself
costs on loopback (request and response objects, header multidicts, stream
readers, per-chunk callbacks); on a 2-core machine that CPU is taken from the
decode threads.  This client does only what reading objects needs: GET with a
few headers, a response framed by ``Content-Length`` (received straight into
the final buffer with ``asyncio.BufferedProtocol``), chunked or closed-delimited,
keep-alive connections pooled per host, TLS through ``ssl``, redirects followed.

A ``Content-Length`` body is received into a buffer that starts at most
``_FIRST_BODY`` bytes and doubles as bytes arrive, so a server that declares a
huge length reserves memory only for what it actually sends.  A body shorter
than its framing says (a dropped connection, a server lying about the length)
raises :class:`IncompleteResponse` naming both sizes; a request cancelled mid-response (a timeout) closes
its connection instead of returning it to the pool.  A kept-alive connection the
server closed while idle is retried once on a fresh connection, as GET is
idempotent.

A request sent inside an attempt watched by :mod:`asyncfeed._io.hedge` reports its
progress there (:mod:`asyncfeed._io.progress`): the time of every piece of the
response as it arrives, so a stalled response is told apart from a slow but
steady one.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from time import monotonic as _monotonic
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

from .progress import CURRENT as _PROGRESS
from .progress import Progress

__all__ = ["HTTPPool", "HTTPStatusError", "IncompleteResponse", "Response"]

_MAX_HEAD = 64 << 10
_FIRST_BODY = 1 << 20   # a Content-Length body's first buffer; doubled as it fills
_NO_BODY = (204, 304)
_REDIRECTS = (301, 302, 303, 307, 308)
_SAFE_PATH = "/%:@!$&'()*+,;=-._~?"


class IncompleteResponse(ConnectionError):
    """The connection closed (or the framing broke) before the whole response arrived."""


class HTTPStatusError(OSError):
    """An error status for ``url``; ``retry_after`` is the server's Retry-After, if any."""

    def __init__(self, status: int, url: str, retry_after: str | None = None,
                 detail: str = "") -> None:
        super().__init__(f"HTTP {status} for {url}" + (f": {detail}" if detail else ""))
        self.status = status
        self.url = url
        try:
            self.retry_after = float(retry_after) if retry_after else None
        except ValueError:
            self.retry_after = None


class _Stale(Exception):
    """A reused connection was closed by the server before it answered."""


class Response:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


class _Conn(asyncio.BufferedProtocol):
    """One connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.fut: asyncio.Future | None = None
        self.head = bytearray(16 << 10)
        self.hlen = 0
        self.body: bytearray | None = None   # Content-Length body being received
        self.want = 0                        # its declared length
        self.got = 0
        self.mode = ""                       # "", "length", "chunked", "eof"
        self.raw = bytearray()               # chunked / eof bodies, as received
        self.chunks = bytearray()            # decoded chunked body so far
        self.head_only = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep = True
        self.received_any = False
        self.progress: Progress | None = None  # the watched attempt this request is for

    # -- asyncio protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.body is not None:
            if self.got == len(self.body):
                self._grow_body()
            if self.body is not None:
                return memoryview(self.body)[self.got:]
            return memoryview(bytearray(1 << 12))  # failed: the transport is closing
        if self.mode:  # chunked or until-close: into the scratch area
            return memoryview(self.head)
        if self.hlen >= len(self.head):
            if len(self.head) >= _MAX_HEAD:
                self._fail(IncompleteResponse("response headers too large"))
                return memoryview(bytearray(1 << 12))
            self.head.extend(bytes(len(self.head)))
        return memoryview(self.head)[self.hlen:]

    def buffer_updated(self, nbytes: int) -> None:
        self.received_any = True
        p = self.progress
        if p is not None:  # the watchdog reads these when its timer fires
            p.last = now = _monotonic()
            if not p.first:
                p.first = now
            p.nbytes += nbytes
        if self.fut is None:  # data while idle: the server broke the protocol
            self._close()
            return
        if self.body is not None:
            self.got += nbytes
            if self.got == self.want:
                body, self.body = self.body, None
                self._done(bytes(body))
            return
        if self.mode:
            self.raw += memoryview(self.head)[:nbytes]
            if self.mode == "chunked":
                self._parse_chunked()
            return
        self.hlen += nbytes
        self._parse_head()

    def eof_received(self) -> bool | None:
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        fut = self.fut
        if fut is None or fut.done():
            return
        if self.mode == "eof" and exc is None:
            self.keep = False
            self._done(bytes(self.raw))
        elif not self.received_any:
            fut.set_exception(_Stale())
        elif self.body is not None:
            fut.set_exception(IncompleteResponse(
                f"connection closed after {self.got} of {self.want} body bytes (the server "
                f"declared Content-Length: {self.want} and sent {self.got})"
                + (f": {exc}" if exc else "")))
        else:
            have = len(self.chunks) + len(self.raw)
            fut.set_exception(IncompleteResponse(
                f"connection closed after {have} body bytes" + (f": {exc}" if exc else "")))

    # -- parsing -----------------------------------------------------------------------
    def _parse_head(self) -> None:
        while True:
            end = self.head.find(b"\r\n\r\n", 0, self.hlen)
            if end < 0:
                return
            lines = bytes(self.head[:end]).decode("latin-1").split("\r\n")
            rest = self.head[end + 4:self.hlen]
            parts = lines[0].split(" ", 2)
            try:
                version, status = parts[0], int(parts[1])
            except (IndexError, ValueError):
                self._fail(IncompleteResponse(f"bad status line {lines[0]!r}"))
                return
            if 100 <= status < 200:  # interim response: drop it, parse what follows
                self.head[:len(rest)] = rest
                self.hlen = len(rest)
                continue
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                value = value.strip()
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
            break
        self.status, self.headers = status, headers
        conn = headers.get("connection", "").lower()
        self.keep = (version == "HTTP/1.1" and "close" not in conn) or "keep-alive" in conn
        self.hlen = 0
        if self.head_only or status in _NO_BODY:
            self._done(b"", tail=rest)
            return
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.mode = "chunked"
            self.raw = bytearray(rest)
            self._parse_chunked()
            return
        length = headers.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                self._fail(IncompleteResponse(f"bad Content-Length {length!r}"))
                return
            if n < 0:
                self._fail(IncompleteResponse(f"bad Content-Length {length!r}"))
                return
            if len(rest) >= n:
                self._done(bytes(rest[:n]), tail=rest[n:])
                return
            self.mode = "length"
            self.want = n
            self.body = bytearray(0)
            self.got = 0
            self._grow_body(len(rest))
            if self.body is not None:
                self.body[:len(rest)] = rest
                self.got = len(rest)
            return
        self.mode = "eof"
        self.keep = False
        self.raw = bytearray(rest)

    def _parse_chunked(self) -> None:
        """Decode what has arrived of a chunked body; complete the response at its end."""
        raw = self.raw
        pos = 0
        while True:
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            try:
                size = int(bytes(raw[pos:eol]).split(b";", 1)[0].strip(), 16)
            except ValueError:
                self._fail(IncompleteResponse("bad chunk size line"))
                return
            if size == 0:  # last chunk: skip trailer lines up to the empty one
                t = eol + 2
                while True:
                    e2 = raw.find(b"\r\n", t)
                    if e2 < 0:
                        del raw[:pos]
                        return
                    if e2 == t:
                        body, self.chunks = self.chunks, bytearray()
                        self._done(bytes(body), tail=raw[e2 + 2:])
                        return
                    t = e2 + 2
            end = eol + 2 + size
            if len(raw) < end + 2:
                break
            if raw[end:end + 2] != b"\r\n":
                self._fail(IncompleteResponse("bad chunk framing"))
                return
            self.chunks += raw[eol + 2:end]
            pos = end + 2
        del raw[:pos]

    def _grow_body(self, at_least: int = 0) -> None:
        """A bigger buffer for the Content-Length body (at most its declared length).

        A new buffer, not a resize: the transport may still hold a view of the old one.
        """
        assert self.body is not None
        size = min(self.want, max(at_least, _FIRST_BODY, 2 * len(self.body)))
        try:
            new = bytearray(size)
        except MemoryError:
            self._fail(IncompleteResponse(
                f"out of memory for the body: the server declared Content-Length: "
                f"{self.want}, {self.got} bytes arrived"))
            self.body = None
            return
        new[:self.got] = memoryview(self.body)[:self.got]
        self.body = new

    # -- completion --------------------------------------------------------------------
    def _done(self, body: bytes, tail: Any = b"") -> None:
        if tail:
            self.keep = False  # bytes beyond the response: do not trust this connection
        fut, self.fut = self.fut, None
        self.mode, self.got = "", 0
        if fut is not None and not fut.done():
            fut.set_result(Response(self.status, self.headers, body))

    def _fail(self, exc: BaseException) -> None:
        fut, self.fut = self.fut, None
        self._close()
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def start(self, request: bytes, head_only: bool,
              progress: Progress | None = None) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.fut = fut
        self.progress = progress
        self.head_only = head_only
        self.hlen, self.body, self.mode, self.got, self.want = 0, None, "", 0, 0
        self.raw, self.chunks = bytearray(), bytearray()
        self.received_any = False
        assert self.transport is not None
        self.transport.write(request)
        return fut


class HTTPPool:
    """Keep-alive connections for GETs on the running loop, at most ``limit`` open.

    ``headers`` are sent with every request.  Not thread-safe: use it from the loop
    that created it, and ``await close()`` there.
    """

    def __init__(self, limit: int = 256, headers: dict[str, str] | None = None,
                 ssl_context: _ssl.SSLContext | None = None) -> None:
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._sem = asyncio.Semaphore(limit)
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._ssl = ssl_context
        self._all: set[_Conn] = set()
        self._closed = False

    async def get(self, url: str, headers: dict[str, str] | None = None,
                  method: str = "GET") -> Response:
        """One request; redirects (up to 5) are followed.  Raises on a broken response."""
        for _ in range(6):
            resp = await self._once(url, headers, method)
            if resp.status in _REDIRECTS and "location" in resp.headers:
                url = urljoin(url, resp.headers["location"])
                continue
            return resp
        return resp

    async def _once(self, url: str, headers: dict[str, str] | None, method: str) -> Response:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if scheme == "https" else 80)
        key = (scheme, parts.hostname, port)
        target = quote(parts.path or "/", safe=_SAFE_PATH)
        if parts.query:
            target += "?" + parts.query
        host = (headers or {}).get("Host") or parts.netloc.rpartition("@")[2]
        lines = [f"{method} {target} HTTP/1.1\r\n"]
        if not headers or "Host" not in headers:
            lines.append(f"Host: {host}\r\n")
        if headers:
            lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
        lines.append(self._extra)
        lines.append("\r\n")
        request = "".join(lines).encode("latin-1")
        progress = _PROGRESS.get()
        if progress is not None:
            progress.reported = True
        async with self._sem:
            if progress is not None:  # the server's time starts now, with the connection
                progress.sent = progress.last = _monotonic()
            for attempt in range(2):
                conn, reused = await self._checkout(key)
                ok = False
                try:
                    resp = await conn.start(request, method == "HEAD", progress)
                    ok = True
                except _Stale:
                    if reused and attempt == 0:
                        continue  # the server had closed it while idle: once more, fresh
                    raise IncompleteResponse(f"connection closed before any response to {url}")
                finally:
                    self._checkin(key, conn, ok)
                return resp
        raise AssertionError("unreachable")  # pragma: no cover

    async def _checkout(self, key: tuple[str, str, int]) -> tuple[_Conn, bool]:
        if self._closed:
            raise RuntimeError("HTTPPool is closed")
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn, True
            self._all.discard(conn)
        scheme, host, port = key
        ctx = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = _ssl.create_default_context()
            ctx = self._ssl
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, host, port, ssl=ctx,
                                               server_hostname=host if ctx else None)
        self._all.add(conn)
        return conn, False

    def _checkin(self, key: tuple[str, str, int], conn: _Conn, ok: bool) -> None:
        if ok and conn.keep and not conn.closed and conn.fut is None and not self._closed:
            self._idle.setdefault(key, []).append(conn)
        else:  # failed, cancelled mid-response, or not reusable
            conn.fut = None
            conn._close()
            self._all.discard(conn)

    def connections(self) -> tuple[int, int]:
        """(open, idle) connections: the difference are requests under way."""
        return len(self._all), sum(len(v) for v in self._idle.values())

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._all):
            conn._close()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports finish closing
