"""The bench's view of a run from outside (:class:`TreeSampler`): what it reads,
and how often it lists the process tree (listing it reads every process's
``stat`` file on the machine, which at every RSS reading took 16% of a core
from the run it measured)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncfeed._bench.measure import TreeSampler

pytestmark = pytest.mark.timeout(60)

# a run that starts a child after a while (as a loader starts its workers), and
# stops itself once to be read, as the bench's runs do
_RUN = r"""
import os, signal, subprocess, sys, time
time.sleep(0.3)
kid = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(5)"])
time.sleep(0.6)
os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(0.3)
kid.kill(); kid.wait()
"""


def _count_listings(monkeypatch) -> list[float]:
    calls: list[float] = []
    real = TreeSampler._tree

    def counted(self):
        calls.append(time.perf_counter())
        return real(self)

    monkeypatch.setattr(TreeSampler, "_tree", counted)
    return calls


def test_the_tree_is_listed_every_tree_interval_not_at_every_rss_reading(monkeypatch):
    calls = _count_listings(monkeypatch)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        s = TreeSampler(proc.pid, None, rss_interval=0.01, pss_interval=100.0,
                        tree_interval=0.2)
        time.sleep(1.0)
        out = s.stop()
    finally:
        proc.kill()
        proc.wait()
    # about 100 RSS readings in the second, about 5 listings of the tree
    assert 3 <= len(calls) <= 8, len(calls)
    assert out["peak_rss_sum_bytes"] > 0


def test_a_child_started_later_and_a_pause_are_still_read(monkeypatch):
    calls = _count_listings(monkeypatch)
    proc = subprocess.Popen([sys.executable, "-c", _RUN])
    try:
        s = TreeSampler(proc.pid, None, rss_interval=0.01, pss_interval=100.0,
                        tree_interval=0.2)
        proc.wait(timeout=30)
        out = s.stop()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out["max_procs"] == 2                       # the run and the child it started
    assert out["peak_rss_sum_bytes"] >= 64 << 20       # the child's 64 MB counted
    assert s.pauses == 1
    pause = [p for p in out["pss_samples"] if p["label"] == "pause1"]
    assert pause and pause[0]["procs"] == 2 and pause[0]["bytes"] >= 64 << 20
    # a pause lists the tree afresh, and the next reading lists it again
    assert len(calls) >= 3
