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
the server.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

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
    for line in sys.stdin:
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
        proto.write(json.dumps({"event": "started", "pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        proto.write(json.dumps({"event": "done", "pid": pid, "status": status}) + "\n")
    proto.close()


if __name__ == "__main__":
    serve()
