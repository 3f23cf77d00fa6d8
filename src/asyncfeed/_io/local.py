"""Reading files from a local directory tree (the default source of ``ImageFolder``)."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Sequence

# a read from the page cache takes about 0.1 ms; one that waits on a device or a
# network (cold disk, NFS, a FUSE mount of an object store) takes milliseconds
SLOW_READ_S = 1e-3

_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def read_whole(path: str) -> bytes:
    """The bytes of the file ``path``: open, fstat, one read of its size plus one byte.

    ``open(path, "rb").read()`` reads until a read returns nothing, so every file
    costs one more read call than its data needs; on a FUSE mount (gcsfuse,
    mountpoint-s3, the bench's slow mount) each read call is a round trip to the
    file system's daemon, which here costs the daemon ~70 us of CPU.  Asking for
    one byte more than ``fstat`` says and getting exactly the size is the end of
    the file; anything else (a file that grew or shrank since, a short read, a
    size of 0 as procfs files report) is read on until a read returns nothing.
    """
    fd = os.open(path, _O_FLAGS)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)
        if len(data) == size:
            return data
        parts = [data]
        while data:
            data = os.read(fd, max(size, 1 << 16))
            parts.append(data)
        return b"".join(parts)
    except OSError as e:
        if e.filename is None:  # os.read's errors (a directory...) name no file
            raise type(e)(e.errno, e.strerror, path) from None
        raise
    finally:
        os.close(fd)


class LocalSource:
    """Files under a local directory.

    ``read_sync`` reads the whole file in one read call (:func:`read_whole`; about
    0.1 ms from the page cache);
    ``read`` runs that same read in the calling event loop's default executor (one
    hop per file; the loader sizes that pool to its ``io_concurrency``), which keeps
    many reads waiting at once on cold disks and network mounts.
    """

    is_local = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        root = os.fspath(root)
        if root.startswith("file://"):
            root = root[len("file://"):]
        self.root = os.path.abspath(os.path.expanduser(root))
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"no such directory: {self.root}")

    def list_dirs(self) -> list[str]:
        """Names of the immediate subdirectories of the root, sorted."""
        return sorted(e.name for e in os.scandir(self.root) if e.is_dir())

    def list_files(self, subdir: str) -> list[str]:
        """Every file under ``root/subdir`` (recursively, following links), as full paths,
        in torchvision's order: directories walked in sorted order, files sorted.

        A symlink to a folder that contains it, or to the root (a loop), is not followed; torchvision
        follows it until the path is too deep and lists every file ~40 times."""
        walked = []
        top = os.path.join(self.root, subdir)
        start = set()
        for d in (self.root, top):  # a link back to the root is a loop too
            try:
                st = os.stat(d)
                start.add((st.st_dev, st.st_ino))
            except OSError:
                pass
        chains = {top: frozenset(start)}
        for dirpath, dirnames, fnames in os.walk(top, followlinks=True):
            walked.append((dirpath, fnames))
            chain = chains.pop(dirpath, frozenset())
            # a symlink back to a folder it is in would be walked again and again (until
            # ELOOP, ~40 levels deep): each file listed 40 times.  Not followed.
            keep = []
            for d in dirnames:
                try:
                    st = os.stat(os.path.join(dirpath, d))
                except OSError:
                    continue
                ident = (st.st_dev, st.st_ino)
                if ident not in chain:
                    keep.append(d)
                    chains[os.path.join(dirpath, d)] = chain | {ident}
            dirnames[:] = keep
        out: list[str] = []
        for dirpath, fnames in sorted(walked):
            for fname in sorted(fnames):
                out.append(os.path.join(dirpath, fname))
        return out

    def read_sync(self, path: str) -> bytes:
        return read_whole(path)

    async def read(self, path: str) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(None, self.read_sync, path)

    def read_latency(self, paths: Sequence[str], n: int = 8) -> float:
        """Median seconds to open and read ``n`` of ``paths`` (spread over the list),
        one after another in this thread: how long a read waits on this storage."""
        if not paths:
            return 0.0
        step = max(1, len(paths) // n)
        times = []
        for path in list(paths)[::step][:n]:
            t0 = time.perf_counter()
            try:
                self.read_sync(path)
            except OSError:
                continue  # reported when the sample is loaded
            times.append(time.perf_counter() - t0)
        return statistics.median(times) if times else 0.0

    async def close_io(self) -> None:
        """Nothing is bound to an event loop here."""

    def __getstate__(self) -> dict:
        return self.__dict__.copy()
