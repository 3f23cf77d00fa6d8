"""The lean HTTP/1.1 client (asyncfeed._io.http11) against a scripted server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from asyncfeed._io.http11 import HTTPPool, IncompleteResponse

pytestmark = pytest.mark.timeout(30)


class Scripted:
    """A TCP server on 127.0.0.1 that answers each request with the next scripted reply.

    A reply is a list of byte strings sent with short pauses between them (so they
    arrive in separate reads); ``CLOSE`` closes the connection at that point.
    ``connections`` counts accepted connections.
    """

    CLOSE = object()

    def __init__(self, replies: list[list]) -> None:
        self.replies = list(replies)
        self.connections = 0
        self.requests: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, name="test-scripted-accept")
        self._accept.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self.connections += 1
            t = threading.Thread(target=self._talk, args=(conn,), name="test-scripted-conn")
            self._threads.append(t)
            t.start()

    def _talk(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        buf = b""
        with conn:
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buf:
                    try:
                        data = conn.recv(65536)
                    except socket.timeout:
                        if self._stop.is_set():
                            return
                        continue
                    except OSError:
                        return
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                self.requests.append(head)
                if not self.replies:
                    return
                for piece in self.replies.pop(0):
                    if piece is Scripted.CLOSE:
                        return
                    try:
                        conn.sendall(piece)
                    except OSError:
                        return
                    time.sleep(0.005)

    def close(self) -> None:
        self._stop.set()
        self._accept.join()
        for t in self._threads:
            t.join()
        self._sock.close()


@pytest.fixture
def scripted():
    servers: list[Scripted] = []

    def make(replies):
        s = Scripted(replies)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def _run(coro_fn):
    async def main():
        pool = HTTPPool(8)
        try:
            return await coro_fn(pool)
        finally:
            await pool.close()
    return asyncio.run(main())


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"


def test_content_length_and_keep_alive(scripted):
    s = scripted([[OK], [b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n", b"a", b"bc"]])

    async def go(pool):
        return [(await pool.get(s.url + "/a")).body, (await pool.get(s.url + "/b b")).body]

    assert _run(go) == [b"hello", b"abc"]
    assert s.connections == 1
    assert s.requests[1].startswith(b"GET /b%20b HTTP/1.1\r\n")


def test_chunked_with_extensions_and_trailers(scripted):
    body = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"4;ext=1\r\nwiki\r\n",
            b"5\r\npedia\r\n", b"e\r\n in\r\n\r\nchunks.\r\n", b"0\r\nX-Trailer: 1\r\n", b"\r\n"]
    s = scripted([body, [OK]])

    async def go(pool):
        return [(await pool.get(s.url)).body, (await pool.get(s.url)).body]

    assert _run(go) == [b"wikipedia in\r\n\r\nchunks.", b"hello"]
    assert s.connections == 1


def test_body_delimited_by_close(scripted):
    s = scripted([[b"HTTP/1.0 200 OK\r\n\r\n", b"until ", b"the end", Scripted.CLOSE], [OK]])

    async def go(pool):
        return [(await pool.get(s.url)).body, (await pool.get(s.url)).body]

    assert _run(go) == [b"until the end", b"hello"]
    assert s.connections == 2


def test_interim_100_response_is_skipped(scripted):
    s = scripted([[b"HTTP/1.1 100 Continue\r\n\r\n", OK]])
    assert _run(lambda pool: pool.get(s.url)).body == b"hello"


def test_stale_keep_alive_connection_is_retried(scripted):
    s = scripted([[OK, Scripted.CLOSE], [OK]])  # closes after answering, without saying so

    async def go(pool):
        first = (await pool.get(s.url)).body
        await asyncio.sleep(0.05)
        return first, (await pool.get(s.url)).body

    assert _run(go) == (b"hello", b"hello")
    assert s.connections == 2


def test_redirect_is_followed(scripted):
    s = scripted([[b"HTTP/1.1 302 Found\r\nLocation: /there\r\nContent-Length: 0\r\n\r\n"], [OK]])
    r = _run(lambda pool: pool.get(s.url + "/here"))
    assert (r.status, r.body) == (200, b"hello")
    assert s.requests[1].startswith(b"GET /there ")


def test_truncated_bodies_raise(scripted):
    s = scripted([[b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", Scripted.CLOSE],
                  [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
                   Scripted.CLOSE]])
    with pytest.raises(IncompleteResponse, match="3 of 10"):
        _run(lambda pool: pool.get(s.url))
    with pytest.raises(IncompleteResponse):
        _run(lambda pool: pool.get(s.url))


def test_closed_before_answering_a_fresh_connection_raises(scripted):
    s = scripted([[Scripted.CLOSE]])
    with pytest.raises(IncompleteResponse, match="before any response"):
        _run(lambda pool: pool.get(s.url))


def test_cancelled_request_closes_its_connection(scripted):
    s = scripted([[b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"], [OK]])

    async def go(pool):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.get(s.url), 0.2)
        assert not any(pool._idle.values()) and not pool._all
        return (await pool.get(s.url)).body

    assert _run(go) == b"hello"
    assert s.connections == 2


def test_head_has_no_body(scripted):
    s = scripted([[b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"], [OK]])

    async def go(pool):
        r = await pool.get(s.url, method="HEAD")
        return r.headers["content-length"], r.body, (await pool.get(s.url)).body

    assert _run(go) == ("99", b"", b"hello")
    assert s.connections == 1


def test_huge_headers_are_refused(scripted):
    s = scripted([[b"HTTP/1.1 200 OK\r\n" + b"X: " + b"y" * 70000 + b"\r\n\r\n"]])
    with pytest.raises(IncompleteResponse, match="too large"):
        _run(lambda pool: pool.get(s.url))


def test_bad_status_line(scripted):
    s = scripted([[b"SSH-2.0-OpenSSH\r\n\r\n"]])
    with pytest.raises(IncompleteResponse, match="bad status line"):
        _run(lambda pool: pool.get(s.url))


def test_extra_headers_are_sent(scripted):
    s = scripted([[OK]])

    async def go(pool):
        p2 = HTTPPool(2, headers={"Authorization": "Bearer t"})
        try:
            return (await p2.get(s.url, headers={"Range": "bytes=0-1"})).body
        finally:
            await p2.close()

    assert _run(go) == b"hello"
    assert b"Authorization: Bearer t" in s.requests[0] and b"Range: bytes=0-1" in s.requests[0]
