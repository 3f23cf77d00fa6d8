"""Helpers for the fault suite (``tests/faults``): hostile inputs and leak checks.

- ``bomb_jpeg(w, h)`` / ``bomb_png(w, h)``: a few hundred bytes whose header declares
  a ``w`` x ``h`` image (a decompression bomb).
- ``Resources``: what the process holds (asyncfeed threads, open file descriptors,
  ``/dev/shm`` entries, child processes); ``Resources.snapshot()`` before,
  ``assert_released(before)`` after: waits up to a few seconds for them to return to
  what they were, then fails naming what is left.
- ``run_script(code)``: runs Python code in a fresh interpreter that imports the
  asyncfeed under test; returns (returncode, stdout, stderr, seconds), or fails the
  test when it does not exit in time (a hang).
- ``RawServer``: a TCP server on 127.0.0.1 that answers every connection with raw
  bytes a test scripts (lying ``Content-Length``, garbage, resets, stalls).
"""

from __future__ import annotations

import gc
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import simplejpeg

import asyncfeed

__all__ = ["RawServer", "Resources", "SRC", "assert_released", "bomb_jpeg", "bomb_png",
           "rss_mb", "run_script"]

SRC = os.path.dirname(os.path.dirname(os.path.abspath(asyncfeed.__file__)))


# -- hostile files ---------------------------------------------------------------------

def bomb_jpeg(width: int = 60000, height: int = 60000) -> bytes:
    """A small baseline JPEG whose frame header declares ``width`` x ``height``."""
    raw = bytearray(simplejpeg.encode_jpeg(np.zeros((16, 16, 3), np.uint8), quality=50))
    for marker in (b"\xff\xc0", b"\xff\xc1", b"\xff\xc2"):
        i = raw.find(marker)
        if i >= 0:
            raw[i + 5:i + 7] = height.to_bytes(2, "big")
            raw[i + 7:i + 9] = width.to_bytes(2, "big")
            return bytes(raw)
    raise AssertionError("no SOF marker in the encoded JPEG")


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + \
        struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(width: int = 60000, height: int = 60000) -> bytes:
    """A PNG whose IHDR declares ``width`` x ``height`` RGB, with a few rows of data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat)
            + _png_chunk(b"IEND", b""))


# -- leak checks -----------------------------------------------------------------------

def _fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor)
    return out


def _children() -> set[int]:
    pid = os.getpid()
    kids = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return kids


def _our_shm() -> set[str]:
    """``/dev/shm`` entries this process made or maps: named with its pid (torch's
    ``torch_<pid>_...``, asyncfeed's ``asyncfeed-<pid>-...``) or mapped in its address
    space.  Other processes on the machine (other test runs) make entries too."""
    pid = str(os.getpid())
    names = {n for n in os.listdir("/dev/shm")
             if pid in n.replace("-", "_").split("_")}
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith("/dev/shm/"):
                names.add(path[len("/dev/shm/"):].split(" ")[0])
    return names


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


_warm = False


def _warm_up() -> None:
    """Open what a process opens once for good (not a leak per pass): the first uvloop
    loop of a process opens a pipe uvloop keeps; fsspec runs one I/O loop thread (an
    epoll descriptor and a socket pair) for the process's life."""
    global _warm
    if not _warm:
        import fsspec.asyn
        from asyncfeed._engine.runtime import Runtime
        Runtime(1, with_loop=True).close()
        fsspec.asyn.get_loop()
        _warm = True


@dataclass
class Resources:
    threads: set[str] = field(default_factory=set)
    fds: dict[int, str] = field(default_factory=dict)
    shm: set[str] = field(default_factory=set)
    children: set[int] = field(default_factory=set)

    @classmethod
    def snapshot(cls) -> "Resources":
        _warm_up()
        return cls(threads={t.name for t in threading.enumerate()
                            if t.name.startswith("asyncfeed-") and t.is_alive()},
                   fds=_fds(), shm=_our_shm(), children=_children())

    def extra_over(self, before: "Resources") -> dict[str, object]:
        """What this snapshot holds that ``before`` did not (empty: nothing)."""
        extra: dict[str, object] = {}
        if self.threads - before.threads:
            extra["threads"] = sorted(self.threads - before.threads)
        fds = {fd: target for fd, target in self.fds.items()
               if before.fds.get(fd) != target}
        if fds:
            extra["fds"] = fds
        if self.shm - before.shm:
            extra["shm"] = sorted(self.shm - before.shm)
        if self.children - before.children:
            extra["children"] = sorted(self.children - before.children)
        return extra


def assert_released(before: Resources, within: float = 5.0) -> None:
    """Fail unless threads, descriptors, shared memory and children return to ``before``."""
    deadline = time.monotonic() + within
    while True:
        extra = Resources.snapshot().extra_over(before)
        if not extra:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: {extra}")
        gc.collect()
        time.sleep(0.05)


# -- subprocesses ----------------------------------------------------------------------

def run_script(code: str, timeout: float = 60.0, env: dict[str, str] | None = None
               ) -> tuple[int, str, str, float]:
    """Run ``code`` in a fresh interpreter; a hang fails the test (the child is killed)."""
    full_env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    PYTHONFAULTHANDLER="1")
    full_env.update(env or {})
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the script did not exit within {timeout} s (hang); "
                             f"stderr: {(e.stderr or b'')[-2000:]!r}") from None
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def send_signal_when(proc: subprocess.Popen, marker: str, sig: int) -> str:
    """Read ``proc``'s stdout until a line contains ``marker``, then send it ``sig``."""
    out = []
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if marker in line:
            proc.send_signal(sig)
            break
    return "".join(out)


# -- hostile servers -------------------------------------------------------------------

class RawServer:
    """Answers each connection on 127.0.0.1 with ``respond(request_bytes, sock)``.

    ``respond`` writes whatever it likes (it may stall on ``self.release``, or
    return early to drop the connection); the connection is closed after it
    returns.  ``close()`` releases stalled handlers and joins every thread.
    """

    def __init__(self, respond: Callable[[bytes, socket.socket, "RawServer"], None]) -> None:
        self.respond = respond
        self.release = threading.Event()
        self.requests: list[bytes] = []
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self._handlers: list[threading.Thread] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="test-rawserver")
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), name="test-rawserver-conn")
            self._handlers.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    got = conn.recv(65536)
                    if not got:
                        return
                    data += got
                self.requests.append(data)
                self.respond(data, conn, self)
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        self.release.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(10)
        for t in self._handlers:
            t.join(10)

    def __enter__(self) -> "RawServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
