"""One rank of the torchrun tests (``tests/test_torchrun.py``); not a test module.

Run under ``python -m torch.distributed.run``; every rank writes what it saw to
``<out>/<phase>-rank<r>.json`` and the test compares the ranks with
``DistributedSampler``.  Loaders are built *without* ``rank``/``world_size``:
they must come from torch.distributed (or, before ``init_process_group``, from
the ``RANK``/``WORLD_SIZE`` environment torchrun sets).

Every batch is followed by a collective that checks all ranks are at the same
batch of the same loop, so ranks that disagree on the number of batches fail
(or, at worst, hang until the process group's timeout) instead of pairing
collectives from different loops.

Phases:

``run``
    two epochs of each ``drop_last``; then epoch 2 checkpointed after
    ``STOP`` batches (``state-dl<0|1>-rank<r>.pt``, via ``torch.save``) and the
    same pass continued to its end (what an uninterrupted run yields).
``resume``
    a fresh loader per ``drop_last`` loads this rank's state and runs to the end.
``elastic``
    every rank (any number of them) loads rank 0's ``drop_last=False`` state
    and runs the rest of the epoch.
``mismatch``
    ranks that disagree on ``drop_last``, hence on the number of batches: must fail.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

N = 37          # uneven for 2 (and 3) ranks: DistributedSampler pads or drops
BATCH = 4
SEED = 11
STOP = 2        # batches taken before the mid-epoch checkpoint
CKPT_EPOCH = 2


class IndexDataset(Dataset):
    """Sample i: ``(tensor(i), tensor([i/2, i/2, i/2]))``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor(i), torch.full((3,), i / 2)


def loader(drop_last: bool):
    from asyncfeed import AsyncLoader
    return AsyncLoader(IndexDataset(), batch_size=BATCH, shuffle=True, seed=SEED,
                       drop_last=drop_last, num_threads=2, prefetch=3)


def ids(batch) -> list[int]:
    idx, x = batch
    assert torch.equal(x, idx.unsqueeze(1).expand(-1, 3) / 2), "sample content mismatch"
    return idx.tolist()


def in_step(tag: str, j: int) -> None:
    """Check that every rank is at batch ``j`` of loop ``tag`` (a collective)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (tag, j))
    assert all(g == (tag, j) for g in gathered), \
        f"rank {dist.get_rank()} at {(tag, j)}, the ranks at {gathered}"


def consume(it, tag: str) -> list[list[int]]:
    """The rest of ``it``, one collective per batch and one at the end."""
    out = []
    for j, b in enumerate(it):
        in_step(tag, j)
        # the collective a DDP backward would do: a count of this batch's samples
        t = torch.tensor([len(b[0])], dtype=torch.int64)
        dist.all_reduce(t)
        out.append(ids(b))
    in_step(f"{tag}:end", len(out))   # a rank still in the loop fails this too
    return out


def state_path(out: Path, drop_last: bool, rank: int) -> Path:
    return out / f"state-dl{int(drop_last)}-rank{rank}.pt"


def phase_run(out: Path, rank: int, report: dict) -> None:
    for dl in (False, True):
        with loader(dl) as ld:
            report.setdefault("resolved", []).append([ld.rank, ld.world_size])
            for epoch in (0, 1):
                ld.set_epoch(epoch)
                report[f"dl{int(dl)}-epoch{epoch}"] = consume(ld, f"dl{dl}-e{epoch}")
            ld.set_epoch(CKPT_EPOCH)
            it = iter(ld)
            before = []
            for j in range(STOP):
                b = next(it)
                in_step(f"dl{dl}-before", j)
                before.append(ids(b))
            state = ld.state_dict()
            torch.save(state, state_path(out, dl, rank))
            report[f"dl{int(dl)}-state"] = state
            report[f"dl{int(dl)}-before"] = before
            report[f"dl{int(dl)}-uninterrupted"] = consume(it, f"dl{dl}-after")


def phase_resume(out: Path, rank: int, report: dict) -> None:
    for dl in (False, True):
        with loader(dl) as ld:
            ld.load_state_dict(torch.load(state_path(out, dl, rank)))
            report[f"dl{int(dl)}-epoch"] = ld.epoch
            ld.set_epoch(ld.epoch)     # the usual loop's set_epoch: same epoch, resume kept
            report[f"dl{int(dl)}-resumed"] = consume(ld, f"dl{dl}-resumed")
            # the next epoch follows as in an uninterrupted run
            ld.set_epoch(CKPT_EPOCH + 1)
            report[f"dl{int(dl)}-next"] = consume(ld, f"dl{dl}-next")


def phase_elastic(out: Path, rank: int, report: dict) -> None:
    with loader(False) as ld:
        ld.load_state_dict(torch.load(state_path(out, False, 0)))
        report["resolved"] = [[ld.rank, ld.world_size]]
        report["resumed"] = consume(ld, "elastic")


def phase_mismatch(out: Path, rank: int, report: dict) -> None:
    """A broken setup: rank 1 drops the last partial batch, rank 0 does not."""
    with loader(drop_last=rank == 1) as ld:
        consume(ld, "mismatch")


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    report: dict = {"env": [os.environ["RANK"], os.environ["WORLD_SIZE"]]}
    # before init_process_group: the rank comes from torchrun's environment
    from asyncfeed import AsyncLoader
    with AsyncLoader(IndexDataset(), batch_size=BATCH) as ld:
        report["env_resolved"] = [ld.rank, ld.world_size]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        assert dist.get_rank() == rank
        phases = {"run": phase_run, "resume": phase_resume, "elastic": phase_elastic,
                  "mismatch": phase_mismatch}
        phases[phase](
            out, rank, report)
        in_step("done", 0)
    finally:
        dist.destroy_process_group()
    (out / f"{phase}-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
