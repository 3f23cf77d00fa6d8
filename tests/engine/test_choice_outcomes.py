"""The measured choice on real passes, in cases whose outcome is clear-cut.

Each case's candidates differ by far more than any noise margin (twice the
rate, or a bound that rules a candidate out by construction), so the outcome
is the same on a quiet or a busy machine; the rules themselves are tested by
replaying readings (``test_policy.py``, ``test_policy_traces.py``).  Every pass
is checked against DataLoader.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.utils.data import DataLoader

from asyncfeed import AsyncLoader, Mode, Reason
from support.oracle import assert_same_batches


class PurePython:
    """About 2 ms of pure Python a row: it holds the GIL."""

    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> torch.Tensor:
        x = 0
        for k in range(25_000):
            x += k * k % 7
        return torch.tensor([x, i])


class Hashing:
    """About 2 ms of SHA-256 a row: the GIL released."""

    buf = bytes(2 << 20)

    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> torch.Tensor:
        d = hashlib.sha256(self.buf).digest()
        return torch.tensor([d[0], i])


def _settle(al: AsyncLoader, ds, batch_size: int, passes: int = 30, step=None) -> None:
    """Iterate passes (each checked against DataLoader) until the choice settled."""
    want = list(DataLoader(ds, batch_size=batch_size))
    for _ in range(passes):
        got = []
        for b in al:
            got.append(b)
            if step is not None:
                step()
        assert_same_batches(got, want)
        if not al._chooser.exploring:
            return
    raise AssertionError(f"not settled after {passes} passes: {al.stats().execution}")


@pytest.mark.timeout(120)
def test_gil_bound_rows_go_to_worker_processes():
    if (os.cpu_count() or 1) < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: processes cannot run rows side by side")
    ds = PurePython()
    with AsyncLoader(ds, batch_size=16) as al:
        _settle(al, ds, 16)
        ex = al.stats().execution
    assert ex.mode is Mode.PROCESSES and ex.reason is Reason.FASTER, str(ex)
    rates = {m.candidate.mode: m.rate for m in ex.candidates}
    assert rates[Mode.PROCESSES] > rates[Mode.THREADS], str(ex)


@pytest.mark.timeout(120)
def test_gil_free_rows_stay_in_the_loaders_process():
    ds = Hashing()
    with AsyncLoader(ds, batch_size=16) as al:
        _settle(al, ds, 16)
        ex = al.stats().execution
    assert ex.mode is Mode.THREADS, str(ex)


@pytest.mark.timeout(120)
def test_a_consumer_slower_than_the_rows_keeps_the_cheapest_candidate_that_keeps_up():
    """The training step (32 ms a batch) is slower than loading a batch on one thread
    (8 rows of 2 ms): one thread keeps up, inline would add its 16 ms to every step,
    and nothing dearer is tried."""
    ds = Hashing()
    with AsyncLoader(ds, batch_size=8) as al:
        _settle(al, ds, 8, step=lambda: time.sleep(0.032))
        ex = al.stats().execution
    assert (ex.mode, ex.count) == (Mode.THREADS, 1), str(ex)
    assert ex.processes_skipped is Reason.CONSUMER, str(ex)
    assert not any(m.candidate.mode is Mode.PROCESSES for m in ex.candidates), str(ex)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["Hashing", "PurePython"])
def test_on_one_core_rows_never_go_to_worker_processes(kind):
    """Pinned to one core (as ``taskset -c 0``), worker processes cannot beat one
    thread: the bound rules them out before any fork."""
    script = textwrap.dedent(f"""
        import os, sys
        os.sched_setaffinity(0, {{sorted(os.sched_getaffinity(0))[0]}})
        sys.path[:0] = {sys.path!r}
        from test_choice_outcomes import {kind} as DS, _settle
        from asyncfeed import AsyncLoader
        with AsyncLoader(DS(), batch_size=16) as al:
            _settle(al, DS(), 16)
            ex = al.stats().execution
            assert al._exec.stage is None
        print(ex.mode.value, ex.processes_skipped.value if ex.processes_skipped else "-")
    """)
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=170, cwd=here,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])})
    assert out.returncode == 0, out.stderr[-3000:]
    mode, skipped = out.stdout.split()
    assert mode != "processes" and skipped == "no_room", out.stdout
