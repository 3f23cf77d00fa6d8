"""What exploring costs: AsyncLoader's first epoch with its defaults against its first
epoch pinned to the execution the defaults chose, on the outcome bench's data sets.

For each data set and round, in fresh processes (the contenders' order turning each
round: A B, B A, ...):

* ``auto``: a default ``AsyncLoader``; its first epoch (timed from building the loader),
  the time until its choice settled, its choice and the windows it measured;
* ``pinned``: the same loader fixed to the choice ``auto`` made in that round
  (``execution=`` and ``num_threads=``/``num_workers=``), nothing measured.

``auto / pinned`` is the first epoch's cost of measuring the candidates (1.0: free).
With ``--window-s`` the policy's window length is changed for ``auto`` (an experiment:
the value of ``PolicyConfig.window_s`` to try).  With ``--tree SRC`` (the ``src`` of
another checkout) no run is pinned: the rounds alternate ``auto`` on this tree and on
that one (A B, B A, ...), and each tree's medians are printed: the time until the
choice settled, the windows measured, the first epoch -- a change to the search
judged by what it spends, which a shared machine's noise moves less than the rate.
Each data set's line tells how often each choice was made, and each mode whatever
its count; with ``--neighbour`` one busy-looping process runs beside every run (as the
outcome bench's neighbour rounds), and the line tells the stability a busy machine
leaves.  With ``--epochs N`` each ``auto`` run goes on for N epochs and its choice is
read after the last (how many were still measuring is printed); ``--choices-only``
runs no pinned loader, only the count of choices.

    PYTHONPATH=src python bench/explore_cost.py --rounds 3
    PYTHONPATH=src python bench/explore_cost.py --datasets gil-python,detection --window-s 0.02
    PYTHONPATH=src python bench/explore_cost.py --datasets png-augment --rounds 8 \
        --tree /tmp/before/src
    PYTHONPATH=src python bench/explore_cost.py --datasets gil-python --rounds 10 --neighbour
    PYTHONPATH=src python bench/explore_cost.py --rounds 10 --epochs 3 --choices-only --neighbour
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys

from asyncfeed._bench.neighbour import busy_neighbour

_CHILD = r"""
import json, sys, time, dataclasses
from asyncfeed import AsyncLoader
from asyncfeed._bench import userdata
from asyncfeed._engine import chooser, policy
name, pin, window_s = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
epochs = int(sys.argv[4])
if window_s > 0:
    cfg = dataclasses.replace(policy.PolicyConfig(), window_s=window_s)
    d = list(chooser.Chooser.__init__.__defaults__)
    d[2] = cfg
    chooser.Chooser.__init__.__defaults__ = tuple(d)
b = userdata.build(name)
kw = userdata.pinned_kwargs(*pin) if pin else {}
t0 = time.perf_counter()
al = AsyncLoader(b.dataset, batch_size=b.batch_size, sampler=b.order, collate_fn=b.collate_fn, **kw)
n = 0
settled_at = None
for batch in al:
    n += 1
    if settled_at is None and not al._chooser.exploring:
        settled_at = time.perf_counter() - t0
t = time.perf_counter() - t0
for _ in range(epochs - 1):  # the later epochs: only the choice they end on is read
    for batch in al:
        pass
ch = al._chooser
out = {"seconds": t, "settled_s": settled_at, "batches": n,
       "choice": [ch.decision.choice.mode.value, ch.decision.choice.count],
       "settled": not ch.exploring,
       "windows": len(ch.record.windows), "report": str(ch.report())}
al.close()
print("RESULT " + json.dumps(out))
"""


def _run(name: str, pin: list | None, window_s: float, src: str | None = None,
         epochs: int = 1) -> dict:
    env = None if src is None else dict(os.environ, PYTHONPATH=src)
    p = subprocess.run([sys.executable, "-c", _CHILD, name, json.dumps(pin), str(window_s),
                        str(epochs)], capture_output=True, text=True, timeout=600, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{name}: no result\n{p.stdout}\n{p.stderr}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="detection,text,cifar-rng,gil-python,gil-free")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=0.0)
    ap.add_argument("--tree", default=None, help="another checkout's src: alternate with it")
    ap.add_argument("--neighbour", action="store_true",
                    help="one busy-looping process beside every run")
    ap.add_argument("--epochs", type=int, default=1,
                    help="epochs of each auto run: its choice is read after the last "
                         "(the first epoch is the one timed)")
    ap.add_argument("--choices-only", action="store_true",
                    help="no pinned runs: only how often each choice was made")
    args = ap.parse_args()
    with busy_neighbour(args.neighbour):
        _main(args)


def _main(args: argparse.Namespace) -> None:
    for name in args.datasets.split(","):
        if args.tree:
            _two_trees(name, args)
            continue
        ratios, rows = [], []
        choices: list[str] = []
        pin: list | None = None
        unsettled = 0
        for r in range(args.rounds):
            if args.choices_only:
                auto, pinned = _run(name, None, args.window_s, epochs=args.epochs), None
            elif r % 2 and pin is not None:  # B A: pinned first, to the last round's choice
                pinned = _run(name, pin, 0.0)
                auto = _run(name, None, args.window_s, epochs=args.epochs)
            else:
                auto = _run(name, None, args.window_s, epochs=args.epochs)
                pinned = _run(name, auto["choice"], 0.0)
            pin = auto["choice"]
            choices.append(f"{pin[0]} {pin[1]}")
            unsettled += not auto["settled"]
            row = (f"  round {r}: auto {auto['seconds']:.3f}s (settled "
                   f"{auto['settled_s'] or float('nan'):.3f}s, {auto['windows']} windows, "
                   f"{auto['choice'][0]} {auto['choice'][1]})")
            if pinned is not None:
                ratios.append(pinned["seconds"] / auto["seconds"])
                row += f" pinned {pinned['seconds']:.3f}s -> {ratios[-1]:.2f}"
            rows.append(row)
        rate = (f"rate auto/pinned median {statistics.median(ratios):.2f} "
                f"worst {min(ratios):.2f}; " if ratios else "")
        print(f"{name}: {rate}choices after {args.epochs} epoch(s) {_tally(choices)}"
              f" (by mode: {_tally([c.split()[0] for c in choices])}; {unsettled} still "
              f"measuring)")
        print("\n".join(rows), flush=True)


def _two_trees(name: str, args: argparse.Namespace) -> None:
    """``auto`` on this tree (this run's ``PYTHONPATH``) and on ``args.tree``, rounds
    alternating."""
    # None: the runs inherit this process's own PYTHONPATH
    trees: dict[str, str | None] = {"this tree": None, "--tree": args.tree}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for k in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            runs[k].append(_run(name, None, args.window_s, trees[k]))
    for k, got in runs.items():
        settled = [g["settled_s"] for g in got if g["settled_s"] is not None]
        print(f"{name} {k}: settled median "
              f"{statistics.median(settled) if settled else float('nan'):.3f}s "
              f"({len(settled)} of {len(got)} settled; each "
              f"{' '.join(f'{x:.2f}' for x in sorted(settled))}), windows median "
              f"{statistics.median(g['windows'] for g in got)}, first epoch median "
              f"{statistics.median(g['seconds'] for g in got):.3f}s (slowest "
              f"{max(g['seconds'] for g in got):.3f}s); choices "
              f"{_tally([f'{c[0]} {c[1]}' for c in (g['choice'] for g in got)])}", flush=True)


def _tally(choices: list[str]) -> str:
    """How often each choice was made, the most common first: ``processes 2 7/8, ...``."""
    return ", ".join(f"{c} {k}/{len(choices)}"
                     for c, k in collections.Counter(choices).most_common())


if __name__ == "__main__":
    main()
