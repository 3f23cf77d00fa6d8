"""Filesystem objects bound to one event loop: how a source reads and closes on it.

The loader makes a new event loop per pass, and aiohttp sessions, s3fs clients and
the lean client's connections belong to the loop they were made on.  A
:class:`LoopConn` bundles, for one loop, the fsspec filesystem (listing, ``info``,
the fallback read path), a ``cat(path, start, end)`` coroutine for reads and a
``close()`` to run on that loop.  ``open_conn`` picks the read path:

- ``http(s)``: the lean client of :mod:`asyncfeed._io.http11` when the storage
  options are plain (``headers`` and listing options only), else fsspec's
  ``HTTPFileSystem._cat_file`` (aiohttp, pool sized ``max_connections``);
- ``s3``: signed GETs of :mod:`asyncfeed._io.s3` when the settings allow, else
  s3fs; s3fs is set to one attempt per call (the source retries) and a pool of
  ``max_connections`` (botocore's default is 10);
- other async filesystems: ``_cat_file``; synchronous ones: ``cat_file`` in the
  loop's default executor.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
from typing import Any, Awaitable, Callable

from .._optional import require
from .progress import unreported

fsspec = require("fsspec", "a remote root (s3://, http://, ...)")

__all__ = ["LoopConn", "close_conn_soon", "open_conn"]

logger = logging.getLogger("asyncfeed.remote")


async def _http_client(limit: int, **kwargs: Any):
    """aiohttp session for fsspec's HTTPFileSystem with a connection pool of ``limit``."""
    aiohttp = require("aiohttp", "reading http:// roots")
    kwargs.pop("loop", None)
    if "connector" not in kwargs:
        kwargs["connector"] = aiohttp.TCPConnector(limit=limit, limit_per_host=0,
                                                   ttl_dns_cache=300)
    return aiohttp.ClientSession(**kwargs)


class LoopConn:
    """A filesystem object bound to one event loop, and how to read and close with it."""

    __slots__ = ("loop", "fs", "cat", "_close", "pool", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop, fs: Any,
                 cat: Callable[[str, int | None, int | None], Awaitable[bytes]],
                 close: Callable[[], Awaitable[None]], pool: Any = None) -> None:
        self.loop, self.fs, self.cat, self._close = loop, fs, cat, close
        self.pool = pool  # the lean client's HTTPPool, when reads go through it

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``fs._<method>(...)`` of an async filesystem, or ``fs.<method>(...)`` of a
        synchronous one in the loop's default executor (``ls``, ``find``, ``info``)."""
        if getattr(self.fs, "async_impl", False):
            return await getattr(self.fs, "_" + method)(*args, **kwargs)
        func = functools.partial(getattr(self.fs, method), *args, **kwargs)
        return await self.loop.run_in_executor(None, func)

    async def close(self) -> None:
        await self._close()


# fsspec HTTP options that leave requests plain GETs (the lean client can send them)
_PLAIN_HTTP_OPTIONS = frozenset({
    "headers", "simple_links", "same_scheme", "block_size", "cache_type", "cache_options",
    "size_policy", "use_listings_cache", "listings_expiry_time", "max_paths", "encoded"})


def open_conn(protocol: str, storage_options: dict[str, Any], max_connections: int,
               timeout: float | None, fast: bool = True) -> LoopConn:
    """Make a filesystem object for the running loop (called in the loop's thread)."""
    loop = asyncio.get_running_loop()
    cls = fsspec.get_filesystem_class(protocol)
    opts = dict(storage_options)
    opts["skip_instance_cache"] = True
    if not getattr(cls, "async_impl", False):
        fs = cls(**opts)

        async def cat_sync(path: str, start: int | None, end: int | None) -> bytes:
            return await loop.run_in_executor(None, functools.partial(fs.cat_file, path,
                                                                      start=start, end=end))

        async def nothing() -> None:
            return None

        return LoopConn(loop, fs, cat_sync, nothing)

    if protocol in ("http", "https"):
        opts.setdefault("get_client", functools.partial(_http_client, max_connections))
    elif protocol in ("s3", "s3a"):
        opts.setdefault("max_concurrency", 1)  # else every _cat_file starts with a HEAD
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        config.setdefault("max_pool_connections", max_connections)  # botocore default: 10
        if timeout is not None:
            config.setdefault("connect_timeout", timeout)
            config.setdefault("read_timeout", timeout)
        opts["config_kwargs"] = config
    fs = cls(asynchronous=True, **opts)
    if protocol in ("s3", "s3a") and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs' own retry loop: one attempt; we retry with our backoff
        if fast:
            return _s3_conn(loop, fs, max_connections)
    if protocol in ("http", "https") and fast and set(storage_options) <= _PLAIN_HTTP_OPTIONS:
        return _http_conn(loop, fs, max_connections, storage_options.get("headers"))

    async def cat(path: str, start: int | None, end: int | None) -> bytes:
        return await fs._cat_file(path, start=start, end=end)

    async def close() -> None:
        await _close_async_fs(fs)

    return LoopConn(loop, fs, cat, close)


def _http_conn(loop: asyncio.AbstractEventLoop, fs: Any, max_connections: int,
               headers: dict[str, str] | None) -> LoopConn:
    """Reads through the lean client of :mod:`asyncfeed._io.http11`; listing through fsspec."""
    from .http11 import HTTPPool, HTTPStatusError
    pool = HTTPPool(max_connections, headers=headers)

    async def cat(path: str, start: int | None, end: int | None) -> bytes:
        ranged = None
        if start is not None or end is not None:
            if start is None or end is None or start < 0 or end < 0:
                return await fs._cat_file(path, start=start, end=end)  # needs the size
            if end <= start:
                return b""
            ranged = {"Range": f"bytes={start}-{end - 1}"}
        r = await pool.get(path, ranged)
        if r.status == 200:
            return r.body if ranged is None else r.body[start:end]  # Range ignored: slice
        if r.status == 206 and ranged is not None:
            return r.body
        if r.status in (404, 410):
            raise FileNotFoundError(errno.ENOENT, f"HTTP {r.status}", path)
        raise HTTPStatusError(r.status, path, r.headers.get("retry-after"),
                              r.body[:200].decode("utf-8", "replace").strip())

    async def close() -> None:
        await pool.close()
        await _close_async_fs(fs)

    return LoopConn(loop, fs, cat, close, pool)


def _s3_conn(loop: asyncio.AbstractEventLoop, fs: Any, max_connections: int) -> LoopConn:
    """Reads through :class:`~asyncfeed._io.s3.S3FastReader` where it can, else s3fs."""
    from .s3 import S3FastReader
    state: dict[str, Any] = {"reader": None, "task": None, "session": None}

    async def make_reader() -> S3FastReader | None:
        from .http11 import HTTPPool
        pool = HTTPPool(max_connections)
        state["session"] = pool
        try:
            reader = await S3FastReader.create(fs, pool)
        except Exception as e:  # credentials or client set-up: s3fs will report it
            logger.debug("S3 fast path unavailable: %s: %s", type(e).__name__, e)
            reader = None
        if reader is None:
            await pool.close()
            state["session"] = None
        return reader

    async def cat(path: str, start: int | None, end: int | None) -> bytes:
        reader = state["reader"]
        if reader is None:
            task = state["task"]
            if task is None or (task.done() and (task.cancelled() or task.exception())):
                task = state["task"] = asyncio.ensure_future(make_reader())
            # shielded: a timeout of this read must not cancel the set-up others wait on
            reader = state["reader"] = (await asyncio.shield(task)) or False
        if reader:
            bucket, key, version = fs.split_path(path)
            if not version:
                data = await reader.get(bucket, key, start, end)
                if data is not None:
                    return data
                unreported()  # the lean client may have reported an answer it gave up on
        return await fs._cat_file(path, start=start, end=end)

    async def close() -> None:
        task = state["task"]
        if task is not None and not task.done():
            task.cancel()
        if state["session"] is not None:
            await state["session"].close()
        await _close_async_fs(fs)

    return LoopConn(loop, fs, cat, close)


async def _close_async_fs(fs: Any) -> None:
    """Close what an async fsspec filesystem opened on the running loop (best effort)."""
    creator = getattr(fs, "_s3creator", None)  # s3fs
    if creator is not None:
        if hasattr(creator, "clear"):
            await creator.clear()
        else:
            await creator.__aexit__(None, None, None)
        fs._s3 = fs._s3creator = None
        return
    for name in ("_session", "session"):  # fsspec http, gcsfs and friends: aiohttp sessions
        try:
            session = getattr(fs, name, None)
        except Exception:  # properties that raise when nothing is open
            session = None
        if session is not None and hasattr(session, "close") and not getattr(session, "closed", True):
            result = session.close()
            if asyncio.iscoroutine(result):
                await result
            return


def close_conn_soon(conn: LoopConn) -> None:
    """Finalizer for a connection on fsspec's I/O loop (it outlives any source)."""
    loop = conn.loop
    if loop.is_closed() or not loop.is_running():
        return
    try:
        asyncio.run_coroutine_threadsafe(conn.close(), loop)
    except RuntimeError:  # pragma: no cover - loop shutting down
        pass
