"""A FUSE passthrough that plays a network mount: a latency per open and per first read.

``python -m asyncfeed._bench.slowfs ROOT MOUNTPOINT --open-ms 2 --read-ms 10`` mounts
``ROOT`` read-only at ``MOUNTPOINT`` and serves it as it is, except that every
``open`` waits ``open_ms`` and the first ``read`` of every open file waits
``read_ms`` (gcsfuse, mountpoint-s3, NFS and Lustre make every open and first read
wait on the network).  It prints ``mounted`` once the mount answers and unmounts
on SIGTERM/SIGINT.  The kernel's page cache is bypassed (``direct_io``), so a
second epoch pays the latency again, as it would on a mount whose data set does
not fit in memory.

Needs ``/dev/fuse``, libfuse (2 or 3) and ``mfusepy`` (``pip install
asyncfeed[bench]``); :func:`unavailable` says why it cannot run here.
:class:`SlowMount` runs it as a child process (tests, the bench).  ``--calls FILE``
writes how many ``open``, ``read`` and ``release`` calls it served to ``FILE`` (JSON)
when it is unmounted.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["SlowMount", "unavailable"]


def unavailable() -> str | None:
    """Why a FUSE mount cannot be made here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None \
            and os.geteuid() != 0:
        return "fusermount is missing (install fuse3)"
    try:
        import mfusepy  # noqa: F401  (loads libfuse)
    except ImportError:
        return "mfusepy is not installed (pip install asyncfeed[bench])"
    except OSError as e:  # mfusepy raises this when libfuse is missing
        return f"libfuse is missing ({e})"
    return None


def _operations(root: str, open_s: float, read_s: float) -> Any:
    import mfusepy

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def __init__(self) -> None:
            self.root = os.path.realpath(root)
            self._fresh: set[int] = set()   # handles not read yet
            self._lock = threading.Lock()
            self.calls = {"open": 0, "read": 0, "release": 0}  # FUSE calls served

        def _path(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.lstat(self._path(path))
            keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime_ns",
                    "st_mtime_ns", "st_ctime_ns")
            out = {k: getattr(st, k) for k in keys}
            for k in ("st_atime", "st_mtime", "st_ctime"):
                out[k] = out.pop(k + "_ns")
            return out

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", ".."] + os.listdir(self._path(path))

        def access(self, path: str, amode: int) -> int:
            if not os.access(self._path(path), amode):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def open(self, path: str, flags: Any) -> int:
            if open_s > 0:
                time.sleep(open_s)
            fh = os.open(self._path(path), os.O_RDONLY)
            with self._lock:
                self._fresh.add(fh)
                self.calls["open"] += 1
            return fh

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            with self._lock:
                first = fh in self._fresh
                self._fresh.discard(fh)
                self.calls["read"] += 1
            if first and read_s > 0:
                time.sleep(read_s)
            return os.pread(fh, size, offset)

        def release(self, path: str, fh: int) -> int:
            with self._lock:
                self._fresh.discard(fh)
                self.calls["release"] += 1
            os.close(fh)
            return 0

        def statfs(self, path: str) -> dict[str, Any]:
            st = os.statvfs(self._path(path))
            return {k: getattr(st, k) for k in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                "f_files", "f_flag", "f_frsize", "f_namemax")}

    return Passthrough()


def _unmount(mountpoint: str) -> None:
    for tool in ("fusermount3", "fusermount"):
        if shutil.which(tool):
            subprocess.run([tool, "-u", "-z", mountpoint], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=False)
            return
    subprocess.run(["umount", "-l", mountpoint], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)


class SlowMount:
    """``root`` mounted at ``mountpoint`` with latency, by a child process.

    ``start()`` returns once the mount answers (RuntimeError if it cannot be
    made); ``close()`` unmounts and reaps the child (idempotent).  A context
    manager.  ``calls``: after ``close()``, the ``open``/``read``/``release`` calls
    the file system served (``count_calls=True`` only; else None).
    """

    def __init__(self, root: str, mountpoint: str, *, open_ms: float = 2.0,
                 read_ms: float = 10.0, threads: int = 64, count_calls: bool = False) -> None:
        self.root, self.mountpoint = os.fspath(root), os.fspath(mountpoint)
        self.open_ms, self.read_ms, self.threads = open_ms, read_ms, threads
        self._proc: subprocess.Popen | None = None
        self._calls_file = (os.path.join(os.path.dirname(os.path.abspath(self.mountpoint)),
                                         f".{os.path.basename(self.mountpoint)}.calls.json")
                            if count_calls else None)
        self.calls: dict[str, int] | None = None

    def start(self, timeout: float = 20.0) -> "SlowMount":
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"cannot mount a FUSE file system: {why}")
        os.makedirs(self.mountpoint, exist_ok=True)
        # run as a script: importing the package would import torch (seconds)
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self.root, self.mountpoint,
             "--open-ms", str(self.open_ms), "--read-ms", str(self.read_ms),
             "--threads", str(self.threads)]
            + (["--calls", self._calls_file] if self._calls_file else []),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read() if self._proc.stderr else ""
                self._proc = None
                raise RuntimeError(f"the FUSE mount failed: {err.strip()[-500:]}")
            if os.path.ismount(self.mountpoint):
                return self
            time.sleep(0.05)
        self.close()
        raise RuntimeError(f"the FUSE mount at {self.mountpoint} did not come up")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            _unmount(self.mountpoint)  # ends the FUSE loop of the child
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if os.path.ismount(self.mountpoint):
            _unmount(self.mountpoint)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
        if self._calls_file is not None and os.path.exists(self._calls_file):
            import json
            with open(self._calls_file) as fh:
                self.calls = json.load(fh)
            os.unlink(self._calls_file)

    def __enter__(self) -> "SlowMount":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m asyncfeed._bench.slowfs", description=__doc__)
    ap.add_argument("root")
    ap.add_argument("mountpoint")
    ap.add_argument("--open-ms", type=float, default=2.0)
    ap.add_argument("--read-ms", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=64, help="FUSE request threads")
    ap.add_argument("--calls", help="write the calls served here (JSON) when unmounted")
    args = ap.parse_args(argv)
    import mfusepy

    ops = _operations(args.root, args.open_ms / 1e3, args.read_ms / 1e3)
    # SIGTERM: unmount, which ends the FUSE loop below
    signal.signal(signal.SIGTERM, lambda *_: _unmount(args.mountpoint))
    kwargs: dict[str, Any] = {"foreground": True, "ro": True, "direct_io": True}
    if getattr(mfusepy, "fuse_version_major", 2) >= 3:
        kwargs["max_threads"] = args.threads
    mfusepy.FUSE(ops, args.mountpoint, **kwargs)
    if args.calls:
        import json
        with open(args.calls, "w") as f:
            json.dump(ops.calls, f)


if __name__ == "__main__":
    main()
