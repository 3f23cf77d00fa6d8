"""The benchmark's side of the fork server: send a run, watch it, collect its figures."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import IO

import psutil

from .measure import TreeSampler
from .server import kill_run


def _cpu_of(pids: list[int] | None) -> float:
    total = 0.0
    for pid in pids or ():
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class ServerError(RuntimeError):
    """The fork server died or stopped answering."""


class RunServer:
    """Owns one fork server process (:mod:`.server`); ``close()`` ends it."""

    def __init__(self, workdir: str, *, log_path: str | None = None,
                 start_timeout: float = 120.0) -> None:
        self.workdir = workdir
        self.log_path = log_path or os.path.join(workdir, "server.log")
        self._log: IO[bytes] = open(self.log_path, "ab")
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in
                                                     env.get("PYTHONPATH", "").split(os.pathsep)
                                                     if p])
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncfeed._bench.server"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=workdir)
        self._count = 0
        hello = self._read(start_timeout)
        if hello.get("event") != "ready":
            raise ServerError(f"fork server did not start: {hello}; log: {self.log_tail()}")
        self.pid = self.proc.pid

    def _read(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise ServerError(f"fork server exited ({self.proc.poll()}); log: {self.log_tail()}")
        return json.loads(line)

    def log_tail(self, n: int = 3000) -> str:
        try:
            self._log.flush()
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def run(self, spec: dict, *, timeout: float, pss_interval: float = 1.0,
            rss_interval: float = 0.02, companions: list[int] | None = None) -> dict:
        """Execute ``spec`` in a fresh forked process; returns its figures plus memory.

        ``companions``: processes that serve the run (an HTTP server standing in for
        remote storage): their CPU time is reported as ``companion_cpu_s`` and not
        counted as other load.  ``pss_interval``/``rss_interval``: how often memory is
        read (each reading costs this process CPU the run may miss)."""
        self._count += 1
        result_path = os.path.join(self.workdir, f"run-{self._count}.json")
        spec = {**spec, "result_path": result_path}
        assert self.proc.stdin is not None
        log_start = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()
        started = self._read(60)
        pid = started["pid"]
        me0 = os.times()
        comp0 = _cpu_of(companions)
        sampler: TreeSampler | None = None
        timed_out = False
        deadline = time.monotonic() + timeout
        done = None
        try:
            sampler = TreeSampler(pid, self.pid, pss_interval=pss_interval,
                                  rss_interval=rss_interval)
            while done is None:
                try:
                    done = self._read(max(0.1, deadline - time.monotonic()))
                except TimeoutError:
                    timed_out = True
                    kill_run(pid)
                    done = self._read(30)
        except BaseException:
            # interrupted (Ctrl-C, SIGTERM turned into SystemExit): the run goes too,
            # and the sampler's thread is stopped below, or the interpreter waits on it
            kill_run(pid)
            raise
        finally:
            memory = sampler.stop() if sampler is not None else {}
        me1 = os.times()
        main_cpu = (me1.user + me1.system) - (me0.user + me0.system)
        companion_cpu = _cpu_of(companions) - comp0
        try:
            with open(result_path) as f:
                result = json.load(f)
            os.unlink(result_path)
        except (OSError, ValueError):
            result = {"ok": False, "error": f"run process ended with status {done.get('status')} "
                                            "and wrote no result"}
        if timed_out:
            result = {"ok": False, "error": f"timed out after {timeout:.0f} s (killed)"}
        if not result.get("ok"):
            tail = self._log_since(log_start)
            if tail:
                result["log_tail"] = tail
        result.update(memory)
        busy = memory.pop("machine_cpu_s")
        ncpu = os.cpu_count() or 1
        own = result.get("process_cpu_s") or 0.0
        other = max(0.0, busy - own - main_cpu - companion_cpu)
        if companions:
            result["companion_cpu_s"] = companion_cpu
        result["other_load"] = other / (memory["wall_s"] * ncpu) if memory["wall_s"] else None
        result.pop("machine_cpu_s", None)
        return result

    def _log_since(self, start: int, limit: int = 4000) -> str:
        try:
            self._log.flush()
            with open(self.log_path, "rb") as f:
                f.seek(start)
                data = f.read()
            return data[-limit:].decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """End the server (idempotent)."""
        proc = getattr(self, "proc", None)
        if proc is None:
            return
        self.proc = None  # type: ignore[assignment]
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(b'{"cmd": "exit"}\n')
                proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
            self._log.close()

    def __enter__(self) -> "RunServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
