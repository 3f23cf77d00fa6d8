"""Caches of raw file bytes for remote sources: in memory, or on local disk under a budget.

Both are keyed by a string (the URL), hold whole files only, and are thread-safe:
reads come from the loader's event loop and from decode threads (``read_sync``).
The index is guarded by a lock; file I/O happens outside it.

Disk layout: ``<dir>/<2 hex>/<38 hex>`` named by the SHA-1 of the key.  Each entry
is a 16-byte header -- magic ``AFC1``, payload length (u64), CRC-32 of the payload
(u32), little-endian -- followed by the payload.  An entry is written to a temporary
name in the same directory and renamed into place, so a reader (or a crash) never
sees a partial entry; a header that does not match its payload (disk corruption, a
file cut short by power loss before the page cache was flushed) is detected on
read, the entry deleted and the read reported as a miss, so the caller refetches.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger("asyncfeed.cache")

_MAGIC = b"AFC1"
_HEADER = struct.Struct("<4sQI")  # magic, payload length, crc32
_TMP_SUFFIX = ".tmp"
_STALE_TMP_SECONDS = 600.0  # temporaries older than this are left-overs of a crash


@dataclass
class CacheStats:
    """Counters since the cache was opened (this process only)."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes: int = 0
    entries: int = 0


class MemoryCache:
    """Raw bytes in RAM, least recently used evicted beyond ``max_bytes`` (None: no limit).

    A pickled copy (a DataLoader worker's) starts empty: shipping the cached bytes
    to every worker would cost more than reading them again.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = CacheStats()

    # -- pickling (worker processes): the copy starts empty, same budget ------------
    def __getstate__(self) -> dict:
        return {"max_bytes": self.max_bytes}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, state["max_bytes"])

    def get(self, key: str, size: int | None = None) -> bytes | None:
        """The cached bytes of ``key`` or None; ``size``, when known, must match."""
        with self._lock:
            data = self._data.get(key)
            if data is None or (size is not None and len(data) != size):
                self._stats.misses += 1
                return None
            self._data.move_to_end(key)
            self._stats.hits += 1
            return data

    def put(self, key: str, data: bytes) -> None:
        n = len(data)
        if self.max_bytes is not None and n > self.max_bytes:
            return
        data = bytes(data)
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._data[key] = data
            self._bytes += n
            self._stats.puts += 1
            if self.max_bytes is not None:
                while self._bytes > self.max_bytes:
                    _, victim = self._data.popitem(last=False)
                    self._bytes -= len(victim)
                    self._stats.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def stats(self) -> CacheStats:
        with self._lock:
            s = CacheStats(**vars(self._stats))
            s.bytes, s.entries = self._bytes, len(self._data)
            return s


class DiskCache:
    """Whole files on local disk under ``directory``, LRU beyond ``max_bytes`` (None: no limit).

    The index (key order by last use, sizes) lives in this process and is built
    from the directory the first time the cache is used: entries ordered by their
    modification time, which every hit refreshes, so recency survives restarts.
    Several processes may share a directory (every write is an atomic rename, a
    missing or corrupt entry is a miss), but each enforces ``max_bytes`` on what it
    knows of, so give each one its share of the disk.  ``verify=False`` skips the
    CRC check on reads (the length is always checked).

    Errors writing the cache (disk full, read-only directory) never fail a read:
    they are counted in ``stats().errors`` and logged once.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | None = None,
                 *, verify: bool = True) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes!r}")
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
        self.max_bytes = max_bytes
        self.verify = verify
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] | None = None  # file name -> entry size on disk
        self._bytes = 0
        self._stats = CacheStats()
        self._warned = False
        os.makedirs(self.directory, exist_ok=True)

    # -- pickling: the index is rebuilt from the directory in the new process ------
    def __getstate__(self) -> dict:
        return {"directory": self.directory, "max_bytes": self.max_bytes, "verify": self.verify}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, state["directory"], state["max_bytes"], verify=state["verify"])

    def path_of(self, key: str) -> str:
        h = hashlib.sha1(key.encode("utf-8", "surrogateescape")).hexdigest()
        return os.path.join(self.directory, h[:2], h[2:])

    # -- index -----------------------------------------------------------------------
    def _load_index(self) -> OrderedDict[str, int]:
        """Scan the directory (once); remove temporaries left by a crash. Lock held."""
        if self._index is not None:
            return self._index
        found: list[tuple[float, str, int]] = []
        now = time.time()
        with os.scandir(self.directory) as top:
            subdirs = [e.path for e in top if e.is_dir() and len(e.name) == 2]
        for sub in subdirs:
            with os.scandir(sub) as it:
                for e in it:
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    if e.name.endswith(_TMP_SUFFIX):
                        if now - st.st_mtime > _STALE_TMP_SECONDS:
                            _unlink(e.path)
                        continue
                    found.append((st.st_mtime, e.path, st.st_size))
        found.sort()
        index: OrderedDict[str, int] = OrderedDict((p, n) for _, p, n in found)
        self._bytes = sum(index.values())
        self._index = index
        self._evict_locked()
        return index

    def _evict_locked(self) -> list[str]:
        victims: list[str] = []
        index = self._index
        if self.max_bytes is None or index is None:
            return victims
        while self._bytes > self.max_bytes and index:
            path, n = index.popitem(last=False)
            self._bytes -= n
            self._stats.evictions += 1
            victims.append(path)
        for path in victims:  # unlink under the lock: a concurrent put of it must not race
            _unlink(path)
        return victims

    # -- reads and writes -------------------------------------------------------------
    def get(self, key: str, size: int | None = None) -> bytes | None:
        """The cached bytes of ``key``, or None when absent, corrupt or not ``size`` long."""
        path = self.path_of(key)
        with self._lock:
            index = self._load_index()
            if path not in index:
                self._stats.misses += 1
                return None
        data = self._read_entry(path, size)
        with self._lock:
            if data is None:
                self._stats.misses += 1
                n = self._index.pop(path, None) if self._index is not None else None
                if n is not None:
                    self._bytes -= n
                return None
            if self._index is not None and path in self._index:
                self._index.move_to_end(path)
            self._stats.hits += 1
        try:
            os.utime(path)  # recency for the next process that scans the directory
        except OSError:
            pass
        return data

    def _read_entry(self, path: str, size: int | None) -> bytes | None:
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                data = f.read()
        except FileNotFoundError:  # evicted by another thread or process
            return None
        except OSError as e:
            self._note_error("read", path, e)
            return None
        ok = len(head) == _HEADER.size
        if ok:
            magic, length, crc = _HEADER.unpack(head)
            ok = (magic == _MAGIC and length == len(data)
                  and (size is None or length == size)
                  and (not self.verify or zlib.crc32(data) == crc))
            if ok:
                return data
            if magic == _MAGIC and length == len(data) and size is not None and length != size:
                # a complete entry of another version of the object: stale, not corrupt
                _unlink(path)
                return None
        with self._lock:
            self._stats.corrupt += 1
        logger.warning("corrupt cache entry %s removed; it will be refetched", path)
        _unlink(path)
        return None

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` (replacing any entry); never raises on I/O errors."""
        n = _HEADER.size + len(data)
        if self.max_bytes is not None and n > self.max_bytes:
            return
        path = self.path_of(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}"
        try:
            try:
                f = open(tmp, "wb")
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                f = open(tmp, "wb")
            with f:
                f.write(_HEADER.pack(_MAGIC, len(data), zlib.crc32(data)))
                f.write(data)
            with self._lock:
                index = self._load_index()
                os.replace(tmp, path)
                old = index.pop(path, None)
                if old is not None:
                    self._bytes -= old
                index[path] = n
                self._bytes += n
                self._stats.puts += 1
                self._evict_locked()
        except OSError as e:
            _unlink(tmp)
            self._note_error("write", path, e)

    def _note_error(self, what: str, path: str, e: OSError) -> None:
        with self._lock:
            self._stats.errors += 1
            warned, self._warned = self._warned, True
        if not warned:
            logger.warning("cache %s failed for %s: %s (further cache errors are counted, "
                           "not logged)", what, path, e)

    def __contains__(self, key: str) -> bool:
        path = self.path_of(key)
        with self._lock:
            return path in self._load_index()

    def __len__(self) -> int:
        with self._lock:
            return len(self._load_index())

    @property
    def nbytes(self) -> int:
        """Bytes on disk of the entries this process knows of (headers included)."""
        with self._lock:
            self._load_index()
            return self._bytes

    def stats(self) -> CacheStats:
        with self._lock:
            self._load_index()
            s = CacheStats(**vars(self._stats))
            s.bytes = self._bytes
            s.entries = len(self._index or ())
            return s

    def clear(self) -> None:
        """Remove every entry this process knows of."""
        with self._lock:
            index = self._load_index()
            for path in index:
                _unlink(path)
            index.clear()
            self._bytes = 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # pragma: no cover - permissions on a shared cache
        logger.debug("could not remove %s: %s", path, e)
