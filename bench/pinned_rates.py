"""The executions the policy chooses between, each pinned, on the outcome bench's data
sets: their first-epoch and later-epoch rates side by side, optionally beside a busy
neighbour process.

Each round runs every candidate once, in a fresh process, the order turning each
round (A B C, C B A, ...); each run is ``--epochs`` epochs of one loader pinned to
the candidate (``execution=`` with ``num_threads=`` / ``num_workers=``).  With
``--neighbour``, one busy-looping process runs beside every run, as the outcome
bench's neighbour rounds.  Printed per candidate: the first epoch's rate and the
later epochs' rate, medians over the rounds (and the slowest round), so the
policy's choices (``bench/explore_cost.py`` counts them) can be read against what
each candidate really delivers there.

    PYTHONPATH=src python bench/pinned_rates.py --datasets cifar-rng,png-augment \
        --candidates threads:2,processes:2,processes:4 --rounds 4 --neighbour
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from asyncfeed._bench.neighbour import busy_neighbour
from asyncfeed._engine.readings import Mode

_CHILD = r"""
import json, sys, time
from asyncfeed import AsyncLoader
from asyncfeed._bench import userdata
name, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
epochs, quick = int(sys.argv[4]), sys.argv[5] == "1"
b = userdata.build(name, quick=quick)
kw = userdata.pinned_kwargs(mode, count)
rates = []
with AsyncLoader(b.dataset, batch_size=b.batch_size, sampler=b.order,
                 collate_fn=b.collate_fn, **kw) as loader:
    for _ in range(epochs):
        t = time.perf_counter()
        for _ in loader:
            pass
        rates.append(len(b.order) / (time.perf_counter() - t))
print(json.dumps(rates))
"""


def _candidates(text: str) -> list[tuple[str, int]]:
    out = []
    for part in text.split(","):
        mode, _, count = part.partition(":")
        if mode not in {m.value for m in Mode}:
            raise argparse.ArgumentTypeError(f"unknown execution {mode!r} in {part!r}")
        out.append((mode, int(count or 0)))
    return out


def _run(name: str, cand: tuple[str, int], epochs: int, quick: bool,
         timeout: float) -> list[float]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, name, cand[0], str(cand[1]), str(epochs),
                           "1" if quick else "0"], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {cand}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", default="cifar-rng,png-augment")
    p.add_argument("--candidates", type=_candidates, default=_candidates(
        "threads:2,processes:2,processes:4"), help="mode:count,... (inline takes no count)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--neighbour", action="store_true", help="a busy-looping process beside")
    p.add_argument("--quick", action="store_true", help="the data sets' small versions")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = p.parse_args()
    with busy_neighbour(args.neighbour):
        for name in args.datasets.split(","):
            runs: dict[tuple[str, int], list[list[float]]] = {c: [] for c in args.candidates}
            for r in range(args.rounds):
                order = args.candidates if r % 2 == 0 else args.candidates[::-1]
                for cand in order:
                    runs[cand].append(_run(name, cand, args.epochs, args.quick, args.timeout))
            for cand, rates in runs.items():
                first = [run[0] for run in rates]
                later = [statistics.median(run[1:]) for run in rates if len(run) > 1]
                line = (f"{name} {cand[0]} {cand[1]}: first epoch "
                        f"{statistics.median(first):,.0f}/s (slowest {min(first):,.0f})")
                if later:
                    line += (f", later epochs {statistics.median(later):,.0f}/s "
                             f"(slowest {min(later):,.0f})")
                print(line, flush=True)


if __name__ == "__main__":
    main()
