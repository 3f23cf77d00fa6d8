"""The fork server: one pristine process that forks a fresh process per measured run.

Importing torch takes about two seconds here; a fresh interpreter per run would
spend more time importing than measuring.  So the benchmark starts this server
once (``python -m asyncfeed._bench.server``): it imports the heavy modules and
nothing else, starts no thread, and for every run it is sent it forks a child
that executes the run (:mod:`.child`) and exits.  Every run thus starts from the
same state, like a training script that has just imported torch, and one run's
leftovers (allocator state, threads, caches) never leak into the next.

Memory is read over the server *and* the run's process tree: pages the child
still shares with the server are then counted once, as in a fresh process.

A spec's ``entry`` names the module that executes it (:data:`ENTRIES`): :mod:`.child`
(the default) or :mod:`.outcome_round` (the outcome bench's rounds).

Protocol, one JSON object per line: the client writes a run spec to stdin; the
server answers ``{"event": "started", "pid": N}`` and, once the child has exited,
``{"event": "done", "pid": N, "status": S}``; the child writes its figures (or
its error) to ``spec["result_path"]``.  ``{"cmd": "exit"}`` or end of input stops
the server.  The client sends nothing while a run is under way, so input that
arrives meanwhile (its end, where the client died or was killed) ends the run:
its process group and every process below it are killed, and the run is reported
done.  A run that stopped itself for a memory reading waits for the client to
resume it, so a run left behind would otherwise wait forever, and the server
with it.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
import traceback

import psutil

#: the modules whose ``execute(spec)`` a run may name as ``spec["entry"]`` (default ``child``)
ENTRIES = ("child", "outcome_round")


def _child(spec: dict) -> None:
    """In the forked child: run the spec, write the result file, and exit."""
    code = 0
    try:
        os.setpgid(0, 0)  # its own process group: a timeout kills the run and its workers
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(2, 1)  # nothing a loader prints may reach the protocol stream
        sys.stdin = open(os.devnull)
        sys.stdout = sys.stderr
        entry = spec.get("entry", "child")
        if entry not in ENTRIES:
            raise ValueError(f"unknown run entry {entry!r}; known: {', '.join(ENTRIES)}")
        execute = importlib.import_module(f"{__package__}.{entry}").execute
        result = {"ok": True, **execute(spec)}
    except BaseException as e:  # noqa: BLE001 - every failure becomes a reported error
        code = 1
        result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()}
    try:
        tmp = spec["result_path"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, spec["result_path"])
    except BaseException:  # noqa: BLE001
        code = 2
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)


class _Input:
    """The client's lines on a file descriptor, read unbuffered, so that what has
    arrived (a line, or the end of input) is seen while a run is under way."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = b""
        self._eof = False

    def readline(self) -> bytes | None:
        """The next line (without its newline), or None at the end of input."""
        while b"\n" not in self._buf and not self._eof:
            chunk = os.read(self.fd, 65536)
            self._buf += chunk
            self._eof = not chunk
        if not self._buf:
            return None
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def arrived(self) -> bool:
        """Whether input is waiting to be read: a line, or the end of input."""
        return bool(self._buf) or self._eof \
            or bool(select.select([self.fd], [], [], 0)[0])


def kill_run(pid: int) -> None:
    """Kill run ``pid``, its process group and every process below it (stopped ones
    too: ``SIGKILL`` needs no resume): the server's end of a run its client left,
    and the client's end of a run that timed out or was interrupted."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    try:
        os.killpg(pid, signal.SIGKILL)  # the run made itself a group leader
    except (ProcessLookupError, PermissionError):
        pass  # not yet, or gone: the run itself is killed below
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _wait(pid: int, inp: _Input) -> int:
    """Wait for run ``pid`` to end and return its wait status; where input arrives
    first (the client went away, or asks to exit), kill the run (see the module
    docstring) and return the status of its end."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux 5.3+: poll instead
        pidfd = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            if inp.arrived():
                kill_run(pid)
                return os.waitpid(pid, 0)[1]
            select.select([inp.fd] + ([pidfd] if pidfd is not None else []), [], [],
                          None if pidfd is not None else 0.1)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def serve() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Heavy imports once, before any fork; no threads are started here.
    import cv2  # noqa: F401
    import numpy  # noqa: F401
    import simplejpeg  # noqa: F401
    import torch  # noqa: F401
    import torch.utils.data  # noqa: F401

    import asyncfeed  # noqa: F401  (ImageFolder, the loader, the decode function)

    from . import child, contenders, limit, outcome_round, workloads  # noqa: F401
    proto.write(json.dumps({"event": "ready", "pid": os.getpid()}) + "\n")
    inp = _Input(sys.stdin.fileno())
    while (line := inp.readline()) is not None:
        line = line.strip()
        if not line:
            continue
        spec = json.loads(line)
        if spec.get("cmd") == "exit":
            break
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(spec)
        try:
            proto.write(json.dumps({"event": "started", "pid": pid}) + "\n")
        except BrokenPipeError:  # the client is gone: so goes its run
            kill_run(pid)
            os.waitpid(pid, 0)
            break
        status = _wait(pid, inp)
        try:
            proto.write(json.dumps({"event": "done", "pid": pid, "status": status}) + "\n")
        except BrokenPipeError:  # the client is gone
            break
    try:
        proto.close()
    except BrokenPipeError:
        pass


if __name__ == "__main__":
    serve()
