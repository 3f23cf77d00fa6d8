"""Shared fixtures.  Every test fails if it leaves an asyncfeed thread running."""

from __future__ import annotations

import gc
import signal
import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the support package (images, servers, oracle)

from support.executions import EXECUTIONS, shm_files, worker_processes  # noqa: E402


def _our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncfeed-") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Fail a test that leaves an ``asyncfeed-*`` thread alive 3 s after it ends."""
    yield
    deadline = time.monotonic() + 3.0
    while True:
        left = _our_threads()
        if not left:
            break
        gc.collect()  # only when needed: it costs ~0.1 s with torch loaded
        left = _our_threads()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not left, f"threads leaked by this test: {[t.name for t in left]}"


# A non-interactive shell starts its background jobs with SIGINT ignored (POSIX), and
# Python then leaves it ignored, as do the child processes it starts: the Ctrl-C tests
# need SIGINT handled as in a terminal, however the suite was launched.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def no_changed_signal_handlers():
    """Fail a test that leaves SIGINT or SIGTERM handled otherwise than it found them
    (a later test's Ctrl-C, and every child process's, would behave differently)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    after = {s: signal.getsignal(s) for s in before}
    changed = {signal.Signals(s).name: (before[s], after[s]) for s in before
               if after[s] is not before[s]}
    for s in before:  # restored, so one test's leak does not fail the rest
        signal.signal(s, before[s])
    assert not changed, f"signal handlers changed by this test: {changed}"


@pytest.fixture(params=EXECUTIONS)
def execution(request):
    """Each execution a promise must hold on (``support.executions``): the test runs
    once per mode, and fails if a worker process or a shared-memory file of a
    loader outlives it (loaders it dropped are collected first)."""
    shm_before = shm_files()
    yield request.param
    deadline = time.monotonic() + 3.0
    while True:
        left = worker_processes()
        files = shm_files() - shm_before
        if (not left and not files) or time.monotonic() > deadline:
            break
        gc.collect()
        time.sleep(0.02)
    assert not left, f"worker processes outlived the test: {left}"
    assert not files, f"shared-memory files outlived the test: {sorted(files)}"
