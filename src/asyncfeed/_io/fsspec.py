"""Reading a remote directory tree through fsspec: S3, GCS, HTTP directory indexes...

``FsspecSource`` is the source ``ImageFolder`` uses for URL roots.  Reads go
through the filesystem's async interface (``_cat_file``) on whichever event loop
calls ``read``: the loader makes a new loop per iterator, so the filesystem
object and its connection pool are made per loop and closed by ``close_io`` on
that loop.  ``read_sync`` (decode threads, torch DataLoader workers) runs the same
coroutine on fsspec's own I/O thread.

Every read gets a per-attempt ``timeout`` and is retried on transient errors
(timeouts, dropped connections, truncated bodies, HTTP 5xx/408/429, S3 throttling)
with exponential backoff and jitter; a missing object (404) or a refusal (401/403)
is not retried.  Errors name the URL.  A body shorter than its ``Content-Length``
(the HTTP clients check) or than the size the listing reported (S3, GCS...) is
never returned.  Reads of ``http(s)`` and ``s3`` roots go through asyncfeed's lean
HTTP client where the settings allow (see :mod:`asyncfeed._io.conn`).

Listing happens once, the first time ``ImageFolder`` asks for the class folders:
every class folder is listed at once (S3: one flat paginated listing per class;
HTTP: a concurrent crawl of the index pages).
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import threading
import weakref
from typing import Any, Awaitable, Callable, Coroutine
from urllib.parse import unquote

from .._optional import require
from .backoff import backoff
from .cache import DiskCache, MemoryCache
from .conn import LoopConn, close_conn_soon, open_conn
from .._errors import (RemoteReadError, RemoteTimeoutError, SizeMismatch, classify,
                       status_and_code)
from .hedge import ReadStats, TailGuard, TailPolicy

__all__ = ["FsspecSource", "RemoteReadError", "RemoteTimeoutError"]

_FEATURE = "a remote root (s3://, http://, ...)"
fsspec = require("fsspec", _FEATURE)
require("fsspec.asyn", _FEATURE)  # fsspec.asyn: fsspec's I/O loop, used by read_sync

#: the package fsspec needs for a protocol, where one of asyncfeed's extras installs it
_BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "http": "aiohttp", "https": "aiohttp"}


_SOURCES: weakref.WeakSet[FsspecSource] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for src in list(_SOURCES):
        src._lock = threading.Lock()
        src._conns = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


async def _with_timeout(aw: Awaitable[bytes], timeout: float | None) -> bytes:
    if timeout is None:
        return await aw
    if hasattr(asyncio, "timeout"):  # 3.11+: no extra task per read
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)  # pragma: no cover - 3.10


class FsspecSource:
    """Files under a remote root, read through fsspec (a source for ``ImageFolder``).

    Parameters
    ----------
    root:
        ``s3://bucket/prefix``, ``gs://...``, ``http(s)://host/dir/`` (a directory
        index), or any URL fsspec knows how to list.
    storage_options:
        Passed to the fsspec filesystem (``endpoint_url``, ``key``/``secret``,
        ``anon``, ``client_kwargs``, ``headers``...).
    timeout:
        Seconds one attempt of one read may take (None: no limit).
    retries:
        How many times a read is retried after a transient error.
    backoff, max_backoff:
        The wait before retry *n* is ``min(max_backoff, backoff * 2**(n-1))``, of
        which a random half is jitter.
    cache_dir, cache_size, cache_verify:
        Keep what was read on local disk in ``cache_dir``, at most ``cache_size``
        bytes (None: no limit), least recently used evicted first; entries are
        checked against a CRC-32 on every read unless ``cache_verify=False``.
    cache:
        ``"memory"`` keeps raw bytes in RAM (at most ``cache_size`` bytes when no
        ``cache_dir`` is given); both caches may be used together.
    max_connections:
        Connection pool size per event loop; keep it at least the loader's
        ``io_concurrency``.
    list_concurrency:
        Directory listings in flight while listing the root.
    hedge:
        Send a second request for a read still outstanding past the 98th
        percentile of recent latency (first answer wins, the other is
        cancelled), at most ``hedge_budget`` extra requests per read (default
        5%).  ``None`` (default): on, except for S3 requester-pays buckets.
        ``False`` where a duplicate GET is not idempotent or is billed unusually.
    adaptive_timeout, stall_factor, stall_floor:
        Abandon and retry a stalled attempt well before ``timeout``, which stays
        the hard cap: on the lean client's reads, one that has received no byte
        for ``stall_factor`` (2) times the observed 99th percentile of time to
        first byte (at least ``stall_floor``, 0.5 s), so a large object still
        streaming is never abandoned; on reads through fsspec (which cannot
        report progress), one running ``stall_factor`` times the 99th percentile
        of whole-read latency.  ``adaptive_timeout=False`` keeps only ``timeout``.
    fast:
        Read with asyncfeed's lean HTTP/1.1 client (:mod:`asyncfeed._io.http11`) where
        the settings allow: plain GETs for ``http(s)://`` roots (about half the CPU
        of aiohttp per read) and SigV4-signed GETs for ``s3://`` roots
        (:mod:`asyncfeed._io.s3`, about a fifth of the CPU of a botocore call).
        ``False`` sends every read through the fsspec filesystem.  Listing always
        goes through fsspec.
    """

    is_local = False

    def __init__(self, root: str, *, storage_options: dict[str, Any] | None = None,
                 timeout: float | None = 30.0, retries: int = 5, backoff: float = 0.2,
                 max_backoff: float = 10.0, cache_dir: str | os.PathLike[str] | None = None,
                 cache_size: int | None = None, cache: str | None = None,
                 cache_verify: bool = True, max_connections: int = 256,
                 list_concurrency: int = 32, fast: bool = True, hedge: bool | None = None,
                 hedge_budget: float = 0.05, adaptive_timeout: bool = True,
                 stall_factor: float = 2.0, stall_floor: float = 0.5) -> None:
        root = os.fspath(root)
        if "://" not in root:
            raise ValueError(f"not a URL: {root!r}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive or None, got {timeout!r}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries!r}")
        if cache not in (None, "memory"):
            raise ValueError(f"cache must be None or 'memory', got {cache!r}")
        self.protocol = root.split("://", 1)[0].lower()
        if self.protocol in _BACKENDS:
            require(_BACKENDS[self.protocol], f"reading {self.protocol}:// roots")
        fs_cls = fsspec.get_filesystem_class(self.protocol)  # ValueError for unknown protocols
        self.root = root.rstrip("/")
        self._root_key = fs_cls._strip_protocol(self.root).rstrip("/")
        self._is_http = self.protocol in ("http", "https")
        self.storage_options = dict(storage_options or {})
        self.timeout = timeout
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.max_connections = int(max_connections)
        self.list_concurrency = int(list_concurrency)
        self.fast = bool(fast)
        self.memory_cache = (MemoryCache(None if cache_dir is not None else cache_size)
                             if cache == "memory" else None)
        self.disk_cache = (DiskCache(cache_dir, cache_size, verify=cache_verify)
                           if cache_dir is not None else None)
        self._cache_mode = cache
        if hedge is None:  # a duplicate GET bills the reader of a requester-pays bucket
            hedge = not self.storage_options.get("requester_pays", False)
        self.tail_policy = TailPolicy(hedge=bool(hedge), hedge_budget=float(hedge_budget),
                                      adaptive_timeout=bool(adaptive_timeout),
                                      stall_factor=float(stall_factor),
                                      stall_floor=float(stall_floor))
        self._sizes: dict[str, int] = {}
        self._dirs: list[str] | None = None
        self._dir_rel: dict[str, str] = {}
        self._tree: dict[str, list[str]] = {}
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._conns: dict[int, LoopConn] = {}
        self._rng = random.Random()
        self._read_stats = ReadStats()
        # latency is tracked apart for whole-file reads and range reads (shard blocks)
        self._guards = {kind: TailGuard(self.tail_policy, self._read_stats)
                        for kind in ("file", "range")}
        _SOURCES.add(self)

    # -- pickling (DataLoader workers): drop what is bound to loops and threads ------
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for k in ("_lock", "_conns", "_rng", "_read_stats", "_guards"):
            state.pop(k, None)
        return state  # the caches pickle as their settings (a memory cache starts empty)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        return (f"FsspecSource({self.root!r}, timeout={self.timeout}, retries={self.retries}, "
                f"cache_dir={self.disk_cache.directory if self.disk_cache else None!r}, "
                f"cache={self._cache_mode!r})")

    # -- connections -----------------------------------------------------------------
    def _conn(self) -> LoopConn:
        loop = asyncio.get_running_loop()
        conn = self._conns.get(id(loop))
        if conn is not None and conn.loop is loop:
            return conn
        with self._lock:
            conn = self._conns.get(id(loop))
            if conn is None or conn.loop is not loop:
                conn = open_conn(self.protocol, self.storage_options, self.max_connections,
                                  self.timeout, self.fast)
                self._conns[id(loop)] = conn
                if loop is fsspec.asyn.loop[0]:  # fsspec's I/O loop outlives this source
                    weakref.finalize(self, close_conn_soon, conn)
        return conn

    async def close_io(self) -> None:
        """Close the connections made on the running loop (the loader calls this)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            conn = self._conns.get(id(loop))
            if conn is not None and conn.loop is loop:
                del self._conns[id(loop)]
            else:
                conn = None
        if conn is not None:
            await conn.close()

    def close(self) -> None:
        """Close the connections ``read_sync`` and listing opened (idempotent)."""
        io_loop = fsspec.asyn.loop[0]
        if io_loop is None or io_loop.is_closed():
            return
        with self._lock:
            conn = self._conns.get(id(io_loop))
        if conn is not None and conn.loop is io_loop:
            asyncio.run_coroutine_threadsafe(self.close_io(), io_loop).result()

    def _sync(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        """Run ``func(*args)`` on fsspec's I/O loop and wait (not ``fsspec.asyn.sync``: it
        turns every TimeoutError into its own FSTimeoutError)."""
        loop = fsspec.asyn.get_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("blocking read called on fsspec's I/O loop; await read() instead")
        return asyncio.run_coroutine_threadsafe(func(*args), loop).result()

    # -- reads -------------------------------------------------------------------------
    def read_sync(self, path: str) -> bytes:
        """Read ``path`` from any thread (blocking)."""
        data = self._cache_get(path)
        if data is None:
            data = self._sync(self._fetch, path)
            self._cache_put(path, data)  # in this thread, not on fsspec's shared loop
        return data

    async def read(self, path: str) -> bytes:
        """Read ``path`` on the running event loop."""
        data = self._cache_get(path)
        if data is None:
            data = await self._fetch(path)
            self._cache_put(path, data)
        return data

    async def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path`` (not cached), with timeout and retries."""
        return await self._retrying(path, lambda conn: conn.cat(path, start, end),
                                    expected=end - start, guard=self._guards["range"])

    async def info(self, path: str) -> dict[str, Any]:
        """fsspec's ``info`` for ``path`` (size...), with timeout and retries."""
        return await self._retrying(path, lambda conn: conn.call("info", path))

    def _cache_get(self, path: str) -> bytes | None:
        size = self._sizes.get(path)
        if self.memory_cache is not None:
            data = self.memory_cache.get(path, size)
            if data is not None:
                return data
        if self.disk_cache is not None:
            data = self.disk_cache.get(path, size)
            if data is not None:
                if self.memory_cache is not None:
                    self.memory_cache.put(path, data)
                return data
        return None

    async def _fetch(self, path: str) -> bytes:
        return await self._retrying(path, lambda conn: conn.cat(path, None, None),
                                    expected=self._sizes.get(path), guard=self._guards["file"])

    def read_stats(self) -> ReadStats:
        """A snapshot of this source's read counters (attempts, hedges, stalls...)."""
        return self._read_stats.copy()

    def _cache_put(self, path: str, data: bytes) -> None:
        if self.disk_cache is not None:
            self.disk_cache.put(path, data)
        if self.memory_cache is not None:
            self.memory_cache.put(path, data)

    async def _retrying(self, url: str, op: Callable[[LoopConn], Awaitable[Any]],
                        expected: int | None = None, guard: TailGuard | None = None) -> Any:
        """``op(conn)`` with the timeout, retries and backoff; reads (with a ``guard``)
        are hedged and abandoned early when they stall (see :mod:`asyncfeed._io.hedge`)."""
        conn = self._conn()

        async def one() -> Any:
            result = await _with_timeout(op(conn), self.timeout)
            if expected is not None and len(result) != expected:
                raise SizeMismatch(errno.EIO, f"got {len(result)} bytes, expected {expected}")
            return result

        attempt = 0
        while True:
            attempt += 1
            if attempt > 1 and guard is not None:
                self._read_stats.retries += 1
            try:
                if guard is None:
                    return await one()
                return await guard.attempt(one, self.timeout, first=attempt == 1)
            except Exception as e:  # CancelledError (a BaseException) passes through
                kind = classify(e)
                if kind != "transient" or attempt > self.retries:
                    raise self._final_error(url, e, kind, attempt) from e
                await backoff(self._delay(attempt, e))   # out of its place in flight

    def _delay(self, attempt: int, e: BaseException) -> float:
        cap = min(self.max_backoff, self.backoff * (2 ** (attempt - 1)))
        delay = cap / 2 + self._rng.uniform(0, cap / 2)
        retry_after = status_and_code(e)[2]
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.max_backoff))
        return delay

    def _final_error(self, url: str, e: BaseException, kind: str, attempts: int) -> BaseException:
        what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        status, code, _ = status_and_code(e)
        tag = " ".join(x for x in (f"HTTP {status}" if status else "", code or "") if x)
        if tag and tag not in what:
            what = f"{tag}; {what}"
        if kind == "missing":
            return FileNotFoundError(errno.ENOENT, f"no such remote file ({what})", url)
        if kind == "denied":
            return PermissionError(errno.EACCES, f"access denied ({what})", url)
        if kind == "transient":
            if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
                why = f"timed out after {self.timeout}s" if not str(e) else f"timed out ({what})"
                return RemoteTimeoutError(url, f"{why}, {attempts} attempt(s)", attempts)
            return RemoteReadError(url, f"failed after {attempts} attempt(s): {what}", attempts)
        return RemoteReadError(url, f"failed (not retried): {what}", attempts)

    # -- listing -----------------------------------------------------------------------
    def _rel(self, name: str) -> str | None:
        """``name`` (as the filesystem lists it) relative to the root, or None if outside."""
        prefix = self._root_key + "/"
        if not name.startswith(prefix):
            return None
        rel = name[len(prefix):].rstrip("/")
        if not rel or "?" in rel or "#" in rel:  # HTTP index sort links, anchors
            return None
        return rel

    def _decode(self, rel: str) -> str:
        return unquote(rel) if self._is_http else rel

    def list_dirs(self) -> list[str]:
        """Names of the immediate subdirectories of the root, sorted (lists everything once)."""
        if self._dirs is None:
            self._sync(self._list_all)
        assert self._dirs is not None
        return list(self._dirs)

    def list_files(self, subdir: str) -> list[str]:
        """Every file under ``root/subdir`` as URLs, in torchvision's order."""
        if subdir not in self._tree:
            rel = self._dir_rel.get(subdir)
            if rel is None:
                rel = subdir.strip("/")
                if self._is_http:
                    from urllib.parse import quote
                    rel = quote(rel)
            self._tree[subdir] = self._sync(self._list_tree, rel)
        return list(self._tree[subdir])

    async def _ls(self, path: str) -> list[dict[str, Any]]:
        return await self._retrying(path, lambda conn: conn.call("ls", path, detail=True))

    async def _list_all(self) -> None:
        entries = await self._ls(self.root + "/" if self._is_http else self.root)
        dirs: dict[str, str] = {}
        for e in entries:
            if e.get("type") != "directory":
                continue
            rel = self._rel(e["name"])
            if rel is not None and "/" not in rel:
                dirs[self._decode(rel)] = rel
        sem = asyncio.Semaphore(self.list_concurrency)

        async def one(rel: str) -> list[str]:
            if self._is_http:  # the crawl takes the semaphore per index page
                return await self._list_tree(rel, sem)
            async with sem:
                return await self._list_tree(rel)

        names = sorted(dirs)
        trees = await asyncio.gather(*(one(dirs[n]) for n in names))
        self._dir_rel = dirs
        self._tree = dict(zip(names, trees))
        self._dirs = names

    async def _list_tree(self, rel_dir: str, sem: asyncio.Semaphore | None = None) -> list[str]:
        """Files under ``root/rel_dir`` (URLs), in torchvision's order; records sizes."""
        if self._is_http:
            found = await self._crawl(rel_dir, sem or asyncio.Semaphore(self.list_concurrency))
        else:
            path = self.root + "/" + rel_dir
            listing = await self._retrying(path, lambda conn: conn.call("find", path, detail=True))
            found = []
            for name, info in listing.items():
                if info.get("type", "file") != "file" or name.endswith("/"):
                    continue
                rel = self._rel(name)
                if rel is not None:
                    found.append((rel, info.get("size")))

        def order(item: tuple[str, Any]) -> tuple[str, str]:
            # sorted(os.walk(...)) then sorted(files): by directory path, then file name
            head, _, tail = self._decode(item[0]).rpartition("/")
            return ("/" + head, tail)

        found.sort(key=order)
        urls = []
        for rel, size in found:
            url = self.root + "/" + rel
            if isinstance(size, int):
                self._sizes[url] = size
            urls.append(url)
        return urls

    async def _crawl(self, rel_dir: str, sem: asyncio.Semaphore) -> list[tuple[str, None]]:
        """Walk an HTTP directory index below ``rel_dir``, pages fetched concurrently."""
        url = self.root + "/" + rel_dir + "/"
        async with sem:
            entries = await self._ls(url)
        files: list[tuple[str, None]] = []
        subdirs: list[str] = []
        for e in entries:
            rel = self._rel(e["name"])
            if rel is None or not rel.startswith(rel_dir + "/"):
                continue
            if e.get("type") == "directory":
                subdirs.append(rel)
            else:
                files.append((rel, None))
        for sub in await asyncio.gather(*(self._crawl(d, sem) for d in sorted(set(subdirs)))):
            files.extend(sub)
        return files
