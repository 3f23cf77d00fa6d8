"""Workload (e): the data set served over loopback HTTP, with a set latency per request.

The server is ``python -m asyncfeed._bench.httpserve ROOT --latency S``, a process of its
own (its CPU and GIL apart from the loaders'), started once per latency for the
whole workload and stopped at its end.  It stands in for an object store: every
read waits ``latency`` seconds before its bytes come back.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys


class HttpServers:
    """One directory server per latency; ``url(latency)``, ``pids``, ``close()``."""

    def __init__(self, root: str, latencies: list[float], *, start_timeout: float = 60.0) -> None:
        self._procs: dict[float, subprocess.Popen] = {}
        self._urls: dict[float, str] = {}
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(
            [src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        try:
            for lat in latencies:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "asyncfeed._bench.httpserve", root, "--latency", str(lat)],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
                self._procs[lat] = proc
                assert proc.stdout is not None
                ready, _, _ = select.select([proc.stdout], [], [], start_timeout)
                line = proc.stdout.readline().strip() if ready else ""
                if not line.startswith("http"):
                    raise RuntimeError(f"HTTP server for latency {lat} did not start "
                                       f"(exit status {proc.poll()})")
                self._urls[lat] = line.rstrip("/") + "/"
        except BaseException:
            self.close()
            raise

    def url(self, latency: float) -> str:
        return self._urls[latency]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]

    def close(self) -> None:
        """Stop every server (idempotent)."""
        procs, self._procs = self._procs, {}
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def __enter__(self) -> "HttpServers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
