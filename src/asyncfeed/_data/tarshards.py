"""Tar shards read front to back: brace-pattern shard lists, member grouping into
samples, a tar parser that reports a shard cut short, and a ranged remote stream.

The WebDataset-style dataset built on these is :mod:`.webdataset`.
"""

from __future__ import annotations

import asyncio
import collections
import io
import re
import tarfile
from collections.abc import Iterable, Iterator
from typing import Any

from .._errors import ShardError
from .._optional import require

__all__ = ["RangeStream", "ShardTarInfo", "expand_braces", "group_samples", "tar_samples"]

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{0000..0127}`` (zero-padded ranges) and ``{a,b,c}`` groups, left to right.

    >>> expand_braces("s-{00..02}.tar")
    ['s-00.tar', 's-01.tar', 's-02.tar']
    >>> expand_braces("{a,b}/{1..2}")
    ['a/1', 'a/2', 'b/1', 'b/2']
    """
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    r = _RANGE.match(body)
    if r is not None:
        lo_s, hi_s = r.groups()
        lo, hi = int(lo_s), int(hi_s)
        width = len(lo_s) if lo_s.lstrip("-").startswith("0") and len(lo_s) > 1 else 0
        step = 1 if hi >= lo else -1
        choices = [str(i).zfill(width) for i in range(lo, hi + step, step)]
    elif "," in body:
        choices = body.split(",")
    else:  # a literal brace pair such as "{x}": keep it
        head = pattern[:m.end()]
        return [head + rest for rest in expand_braces(pattern[m.end():])]
    out: list[str] = []
    for c in choices:
        out.extend(expand_braces(pattern[:m.start()] + c + pattern[m.end():]))
    return out


def _split_name(name: str) -> tuple[str, str] | None:
    """``dir/key.ext.more`` -> (``dir/key``, ``ext.more``); None for names without a dot."""
    head, _, base = name.rpartition("/")
    key, dot, ext = base.partition(".")
    if not dot or not key:
        return None
    return (head + "/" + key if head else key), ext.lower()


def group_samples(members: Iterable[tuple[str, bytes]], url: str) -> Iterator[dict[str, Any]]:
    """Consecutive ``(name, data)`` members with the same key, as sample dicts.

    Each sample has ``__key__``, ``__url__`` (the shard) and one entry per
    extension.  Names without an extension and names starting with ``__`` (metadata)
    are skipped.
    """
    current: dict[str, Any] | None = None
    for name, data in members:
        split = _split_name(name)
        if split is None or name.rpartition("/")[2].startswith("__"):
            continue
        key, ext = split
        if current is not None and current["__key__"] != key:
            yield current
            current = None
        if current is None:
            current = {"__key__": key, "__url__": url}
        current[ext] = data
    if current is not None:
        yield current


class ShardTarInfo(tarfile.TarInfo):
    """Records why tarfile stopped reading headers: it takes a truncated or
    invalid header after the first for the end of the archive, silently."""

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> ShardTarInfo:
        try:
            return super().fromtarfile(tarfile_)
        except tarfile.HeaderError as e:
            tarfile_._asyncfeed_stop = e  # type: ignore[attr-defined]
            raise


# (tarfile has these classes; typeshed lists only their base, HeaderError)
_BROKEN_END = {
    tarfile.TruncatedHeaderError: "cut short inside a member header",  # type: ignore[attr-defined]
    tarfile.EmptyHeaderError: "cut short: it ends without tar's end-of-archive marker",  # type: ignore[attr-defined]
    tarfile.InvalidHeaderError: "a corrupt member header",  # type: ignore[attr-defined]
}


def _noted(e: BaseException, url: str, member: str | None, offset: int) -> BaseException:
    if hasattr(e, "add_note"):
        e.add_note(f"while reading shard {url}, member {member!r} (byte {offset})")
    return e


def tar_samples(tf: tarfile.TarFile, url: str) -> Iterator[dict[str, Any]]:
    """``group_samples`` over a tar stream, yielding each sample as soon as the next
    sample's first header is read, so a break loses only the sample it falls in."""
    current: dict[str, Any] | None = None
    last: str | None = None
    while True:
        offset = tf.offset
        try:
            m = tf.next()
        except tarfile.ReadError as e:
            if current is not None:
                yield current
            raise ShardError(url, last, offset, f"broken member header after it: {e}") from e
        except Exception as e:
            if current is not None:
                yield current
            raise _noted(e, url, last, offset)
        if m is None:
            break
        if not m.isfile():
            continue
        split = _split_name(m.name)
        if split is None or m.name.rpartition("/")[2].startswith("__"):
            continue
        key, ext = split
        if current is not None and current["__key__"] != key:
            yield current
            current = None
        try:
            member = tf.extractfile(m)
            data = member.read() if member is not None else b""
        except tarfile.ReadError as e:
            raise ShardError(url, m.name, m.offset_data,
                             f"{e} (the shard is cut short or corrupt; {m.size} bytes "
                             f"declared)") from e
        except Exception as e:
            raise _noted(e, url, m.name, m.offset_data)
        last = m.name
        if current is None:
            current = {"__key__": key, "__url__": url}
        current[ext] = data
    stop = getattr(tf, "_asyncfeed_stop", None)
    broken = next((why for kind, why in _BROKEN_END.items() if isinstance(stop, kind)), None)
    if current is not None:
        yield current
    if broken is not None and tf.offset > 0:
        raise ShardError(url, last, tf.offset, f"{broken} after it ({stop})")


class RangeStream(io.RawIOBase):
    """A remote file read front to back in blocks, ``readahead`` blocks fetched ahead."""

    def __init__(self, source: Any, url: str, size: int, block_size: int, readahead: int) -> None:
        super().__init__()
        asyn = require("fsspec.asyn", "reading remote shards")
        self._loop = asyn.get_loop()
        self._source, self._url, self._size = source, url, size
        self._block, self._ahead = block_size, max(1, readahead)
        self._next = 0
        self._pending: collections.deque = collections.deque()
        self._buf = memoryview(b"")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def _schedule(self) -> None:
        while len(self._pending) < self._ahead and self._next < self._size:
            end = min(self._size, self._next + self._block)
            coro = self._source.read_range(self._url, self._next, end)
            self._pending.append(asyncio.run_coroutine_threadsafe(coro, self._loop))
            self._next = end

    def readinto(self, b: Any) -> int:
        if self._pos >= len(self._buf):
            self._schedule()
            if not self._pending:
                return 0
            self._buf = memoryview(self._pending.popleft().result())
            self._pos = 0
            self._schedule()
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        for fut in self._pending:
            fut.cancel()
        self._pending.clear()
        super().close()
