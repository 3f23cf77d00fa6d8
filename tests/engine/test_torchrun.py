"""Real multi-process runs under torchrun (gloo, CPU): rank defaults, DistributedSampler
parity, equal batch counts, and mid-epoch resume in new processes (same and other
world size).  The ranks run ``tests/support/torchrun_worker.py`` and write JSON; the checks
against ``DistributedSampler`` are made here.

Further down, in-process checks of the corner cases of elastic resume and rank
resolution (each was a bug once).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from support import torchrun_worker as w
from support.datasets import Ids, ids
from asyncfeed import AsyncLoader, StateError
from asyncfeed._engine.plan import distributed_indices

TESTS = Path(__file__).resolve().parent.parent
SRC = TESTS.parent / "src"
HERE = TESTS / "support"
LAUNCH_TIMEOUT = 90     # s; the ranks' process group times out after 60 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(phase: str, out: Path, nproc: int = 2) -> list[dict]:
    """Run ``torchrun_worker.py <phase>`` on ``nproc`` ranks; their JSON reports.

    Fails the test, showing the launcher's and the ranks' output, when a rank
    fails, a report is missing or the run exceeds ``LAUNCH_TIMEOUT``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SRC), str(TESTS), str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--monitor-interval", "0.2", str(HERE / "torchrun_worker.py"), phase, str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)     # the launcher and its ranks
        output, _ = proc.communicate()
        pytest.fail(f"torchrun {phase} ran past {LAUNCH_TIMEOUT} s (ranks hung?); "
                    f"output:\n{output[-12000:]}", pytrace=False)
    finally:                                    # interrupted (pytest-timeout, ^C): no orphans
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        pytest.fail(f"torchrun {phase} failed (exit {proc.returncode}); output:\n"
                    f"{output[-12000:]}", pytrace=False)
    reports = []
    for r in range(nproc):
        f = out / f"{phase}-rank{r}.json"
        if not f.exists():
            pytest.fail(f"rank {r} wrote no report for {phase}; output:\n{output[-12000:]}",
                        pytrace=False)
        reports.append(json.loads(f.read_text()))
    return reports


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("torchrun")


@pytest.fixture(scope="module")
def run(out_dir) -> list[dict]:
    return launch("run", out_dir)


@pytest.fixture(scope="module")
def resumed(run, out_dir) -> list[dict]:
    return launch("resume", out_dir)


@pytest.fixture(scope="module")
def elastic(run, out_dir) -> list[dict]:
    return launch("elastic", out_dir, nproc=3)


def reference(rank: int, epoch: int, drop_last: bool, world_size: int = 2) -> list[list[int]]:
    """What DDP with DataLoader + DistributedSampler gives ``rank`` in ``epoch``."""
    ds = w.IndexDataset()
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=w.SEED, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return [b[0].tolist() for b in DataLoader(ds, batch_size=w.BATCH, sampler=sampler,
                                              drop_last=drop_last)]


def test_rank_and_world_size_default_from_torchrun(run):
    for r, rep in enumerate(run):
        assert rep["env"] == [str(r), "2"]
        assert rep["env_resolved"] == [r, 2]            # RANK/WORLD_SIZE, no process group
        assert rep["resolved"] == [[r, 2], [r, 2]]      # torch.distributed


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("epoch", [0, 1])
def test_each_rank_gets_distributed_samplers_batches(run, drop_last, epoch):
    key = f"dl{int(drop_last)}-epoch{epoch}"
    got = [rep[key] for rep in run]
    for r in range(2):
        assert got[r] == reference(r, epoch, drop_last)
    assert len(got[0]) == len(got[1]) == (4 if drop_last else 5)
    seen = Counter(i for batches in got for b in batches for i in b)
    if drop_last:          # 37 -> 18 per rank, 16 in full batches: no repeats
        assert max(seen.values()) == 1 and len(seen) == 32
    else:                  # 37 -> 19 per rank: one sample padded in, as DistributedSampler
        assert set(seen) == set(range(w.N))
        assert sum(seen.values()) == 38 and max(seen.values()) == 2


def test_epochs_differ(run):
    for rep in run:
        assert rep["dl0-epoch0"] != rep["dl0-epoch1"]


@pytest.mark.parametrize("drop_last", [False, True])
def test_mid_epoch_checkpoint_resumes_exactly_in_new_processes(run, resumed, drop_last):
    k = f"dl{int(drop_last)}"
    for r in range(2):
        state = run[r][f"{k}-state"]
        assert (state["in_pass"], state["epoch"], state["batches_taken"], state["rank"],
                state["world_size"]) == (True, w.CKPT_EPOCH, w.STOP, r, 2)
        before, after = run[r][f"{k}-before"], resumed[r][f"{k}-resumed"]
        assert resumed[r][f"{k}-epoch"] == w.CKPT_EPOCH
        assert after == run[r][f"{k}-uninterrupted"]          # the batches in flight redone
        assert before + after == reference(r, w.CKPT_EPOCH, drop_last)
        assert resumed[r][f"{k}-next"] == reference(r, w.CKPT_EPOCH + 1, drop_last)
    assert len(resumed[0][f"{k}-resumed"]) == len(resumed[1][f"{k}-resumed"])


def test_elastic_resume_from_2_to_3_ranks(run, elastic):
    assert [rep["resolved"] for rep in elastic] == [[[r, 3]] for r in range(3)]
    seen = [i for rep in run for b in rep["dl0-before"] for i in b]
    rest = [[i for b in rep["resumed"] for i in b] for rep in elastic]
    # 37 - 2 ranks * 2 batches * 4 = 21 samples left, 7 per new rank: no padding needed
    assert [len(x) for x in rest] == [7, 7, 7]
    assert sorted(seen + sum(rest, [])) == list(range(w.N))
    # and the rest of the epoch's global order, dealt out round-robin
    order = w.IndexDataset()
    g = torch.Generator().manual_seed(w.SEED + w.CKPT_EPOCH)
    remaining = torch.randperm(len(order), generator=g).tolist()[2 * w.STOP * w.BATCH:]
    for r in range(3):
        assert rest[r] == remaining[r::3]


def test_a_failing_rank_fails_the_launch_with_its_traceback(tmp_path):
    """Ranks that disagree on the number of batches fail (not hang), and the test
    shows the failing rank's traceback."""
    with pytest.raises(pytest.fail.Exception) as info:
        launch("mismatch", tmp_path)
    msg = str(info.value)
    assert "torchrun mismatch failed" in msg
    assert "AssertionError" in msg and "the ranks at" in msg


# ------------------------------------------------------------------ in process




def sharded(n: int, rank: int, ws: int, bad: tuple[int, ...] = (), **kw) -> AsyncLoader:
    return AsyncLoader(Ids(n, bad), batch_size=4, shuffle=True, seed=3, rank=rank,
                       world_size=ws, num_threads=1, prefetch=2, **kw)


def take(n: int, ws: int, batches: int, states: list | None = None, bad=(), **kw):
    """``batches`` batches from each of ``ws`` ranks (resuming ``states`` if given):
    the samples seen and each rank's state."""
    seen, out = [], []
    for r in range(ws):
        with sharded(n, r, ws, bad, **kw) as ld:
            if states is not None:
                ld.load_state_dict(states[0])
            it = iter(ld)
            for _ in range(batches):
                seen += ids(next(it))
            out.append(ld.state_dict())
    return seen, out


def rest(n: int, ws: int, states: list, bad=(), **kw) -> list[int]:
    out = []
    for r in range(ws):
        with sharded(n, r, ws, bad, **kw) as ld:
            ld.load_state_dict(states[r] if len(states) == ws else states[0])
            out += sum((ids(b) for b in ld), [])
    return out


def test_elastic_resume_once_covers_the_rest_exactly():
    seen, states = take(50, 3, 2)                 # 3 ranks, 2 batches each: 24 seen
    assert len({json.dumps({**s, "rank": 0}) for s in states}) == 1   # equal but for rank
    left = rest(50, 2, states)                    # 26 left for 2 ranks: no padding
    assert sorted(seen + left) == list(range(50))


def test_resume_after_an_elastic_resume_with_the_same_world_size():
    seen, states = take(50, 3, 2)                 # 3 ranks: 24 seen
    more, states2 = take(50, 2, 1, states)        # resumed on 2 ranks: 8 more
    assert sorted(seen + more) == sorted(set(seen + more))
    left = rest(50, 2, states2)                   # and resumed again on the same 2 ranks
    assert sorted(seen + more + left) == list(range(50))


def test_elastic_resume_after_a_skipped_sample_is_refused_or_exact():
    n = 40
    bad = (distributed_indices(n, 0, 3, True, 0, 2, False)[1],)   # in rank 0's 1st batch
    seen, states = take(n, 2, 2, bad=bad, on_error="skip")
    try:
        left = rest(n, 3, states, bad=bad, on_error="skip")
    except StateError:
        return
    c = Counter(seen + left)
    assert set(c) == set(range(n)) - set(bad)
    assert sum(v - 1 for v in c.values()) <= 2    # at most the new ranks' padding


def test_sharded_shuffle_keeps_the_seed_when_a_generator_is_also_given():
    with pytest.warns(UserWarning):
        ld = AsyncLoader(Ids(20), batch_size=4, shuffle=True, seed=5, rank=0, world_size=2,
                         generator=torch.Generator().manual_seed(1))
    with ld:
        got = sum((ids(b) for b in ld), [])
    assert got == distributed_indices(20, 0, 5, True, 0, 2, False)


def test_rank_defaults_from_the_environment_when_only_world_size_is_given(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with AsyncLoader(Ids(20), batch_size=4, world_size=2) as ld:
        assert ld.rank == 1
