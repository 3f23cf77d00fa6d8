"""The bench's fork server: a run never outlives the client that asked for it."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import psutil
import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "src")

pytestmark = pytest.mark.timeout(180)


def _read(proc: subprocess.Popen, timeout: float) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the fork server did not answer"
    line = proc.stdout.readline()
    assert line, f"the fork server exited ({proc.poll()})"
    return json.loads(line)


def _until(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def server(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    proc = subprocess.Popen([sys.executable, "-m", "asyncfeed._bench.server"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)
    try:
        assert _read(proc, 120)["event"] == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()  # a run the server failed to end (stopped ones too)
            proc.kill()
        proc.wait(30)
        for f in (proc.stdin, proc.stdout):
            if f is not None and not f.closed:
                try:
                    f.close()
                except BrokenPipeError:
                    pass


def _stopped_run(server, tmp_path) -> int:
    """Send a run that stops itself for its first memory reading, as every measured run
    does; return its pid once it is stopped (the client that would resume it never
    does here)."""
    spec = {"mode": "epoch", "family": "asyncfeed", "knob": None, "batch_size": 32,
            "dataset": {"kind": "cifar", "size": 32, "samples": 64},
            "result_path": str(tmp_path / "run.json")}
    server.stdin.write((json.dumps(spec) + "\n").encode())
    server.stdin.flush()
    started = _read(server, 30)
    assert started["event"] == "started"
    pid = started["pid"]
    assert _until(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, 60)
    return pid


def test_a_stopped_run_goes_with_a_client_that_went_away(server, tmp_path):
    """The client dies (its end of the pipe closes) while the run waits, stopped, for
    it: the server kills the run and exits instead of waiting for it forever."""
    pid = _stopped_run(server, tmp_path)
    server.stdin.close()  # what the client's death does to the pipe
    assert server.wait(30) == 0
    assert _gone(pid)


def test_a_client_that_asks_to_exit_mid_run_ends_the_run(server, tmp_path):
    pid = _stopped_run(server, tmp_path)
    server.stdin.write(b'{"cmd": "exit"}\n')
    server.stdin.flush()
    done = _read(server, 30)
    assert done["event"] == "done" and done["pid"] == pid
    assert server.wait(30) == 0
    assert _gone(pid)


def _running_run(bench: psutil.Process) -> bool:
    """Whether ``bench``'s fork server has a run process under way."""
    try:
        return any("asyncfeed._bench.server" in " ".join(c.cmdline()) and c.children()
                   for c in bench.children())
    except psutil.Error:
        return False


def test_a_bench_ended_by_sigterm_leaves_nothing_behind(tmp_path):
    """``kill`` of ``asyncfeed bench`` mid-run ends it as Ctrl-C does: the run, the
    fork server and the scratch folders go with it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    env["TMPDIR"] = str(tmp_path)
    env["ASYNCFEED_CACHE"] = str(tmp_path / "cache")
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncfeed._bench.cli", "bench", "--quick", "--workloads", "a",
         "--json", str(tmp_path / "out.json")],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bench = psutil.Process(proc.pid)
    try:
        assert _until(lambda: _running_run(bench), 120)
        tree = bench.children(recursive=True)
        proc.terminate()
        assert proc.wait(60) == 128 + 15
        assert _until(lambda: all(_gone(p.pid) for p in tree), 30), tree
        assert not list(tmp_path.glob("asyncfeed-bench-*"))
    finally:
        if proc.poll() is None:
            for p in bench.children(recursive=True):
                p.kill()
            proc.kill()
            proc.wait(30)


_INTERRUPTED_AT_START = r'''
import sys
from asyncfeed._bench import client, measure

class Interrupted(measure.TreeSampler):
    """SIGTERM's SystemExit the moment the run started: its sampler just made."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        print(self.pid, flush=True)
        raise SystemExit(143)

client.TreeSampler = Interrupted
spec = {"mode": "epoch", "family": "asyncfeed", "knob": None, "batch_size": 32,
        "dataset": {"kind": "cifar", "size": 32, "samples": 64}}
with client.RunServer(sys.argv[1]) as server:
    server.run(spec, timeout=60)
'''


def test_a_client_interrupted_as_its_run_starts_exits_and_ends_the_run(tmp_path):
    """An exception between the run's start and the loop that waits for it (a
    SIGTERM then) ends the run, and the sampler thread just started does not keep
    the client's interpreter from exiting."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_AT_START, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            cwd=tmp_path, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert proc.wait(60) == 143
        assert _until(lambda: _gone(pid), 30)
    finally:
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
