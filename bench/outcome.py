"""AsyncLoader's defaults against the best DataLoader setting, on data sets written as users
write them (:mod:`asyncfeed._bench.userdata`): first epoch, steady state, and stability.

For each data set, N rounds; in each round every contender runs in its own fresh process
(forked by the bench's fork server: torch imported, nothing else run), the contenders'
order turning each round (A B C D, D C B A, ...):

* ``DataLoader`` with ``num_workers`` 0, 2 and 4, and the more a user would try on
  the set (``UserSet.more_workers``: 8 and 16 for rows that wait), with the set's
  sampler order, batch size and ``collate_fn``, ``--dl-epochs`` epochs;
* ``AsyncLoader`` with its defaults (the same order, batch size and ``collate_fn``),
  ``--epochs`` epochs on one loader: the first epoch (timed from building the loader)
  and the steady state (the mean rate of the later epochs), and ``stats().execution``
  after each epoch.

With ``--neighbour`` every round is run a second time beside one busy-looping process
(``while True: pass``, started before the round's process and killed after it).

The report (markdown, printed; ``--json PATH`` writes every round and the summary) gives,
per data set and condition: the best DataLoader setting's median rate, AsyncLoader's
first-epoch and steady-state medians and their ratios to that setting in the same round
(median and worst round), the slowest round over the median (AsyncLoader's, and the best
DataLoader setting's: the spread of a loader that chooses nothing), and the execution
chosen in each round with how many rounds chose the most common one.

    PYTHONPATH=src python bench/outcome.py                             # 5 rounds, every set
    PYTHONPATH=src python bench/outcome.py --rounds 3 --neighbour --json out.json
    PYTHONPATH=src python bench/outcome.py --rounds 3 --neighbour --into docs/benchmarks-2core.json
    PYTHONPATH=src python bench/outcome.py --datasets detection,text --epochs 4
    PYTHONPATH=src python bench/outcome.py --quick --rounds 1         # smoke test (seconds)
    PYTHONPATH=src python bench/outcome.py --report docs/benchmarks-2core.json  # runs nothing
    PYTHONPATH=src python bench/outcome.py --workers "" --rounds 10 --neighbour  # stability

``--workers ""`` runs AsyncLoader alone: no ratios, but over many rounds how often its
choice is the same, and its slowest round over its median (``--into`` stores such a run
under the bench file's ``stability`` key, the comparison under ``outcome``).

``--report`` runs nothing: it summarises the rounds a file already holds again (an
``--json`` file, or a bench file's ``outcome`` key) and writes the summary and the table
back, for a report that changed since the rounds were run.

Sizes: one ``DataLoader(num_workers=0)`` epoch takes one to two seconds on a 2-core
machine; ``--quick`` makes tiny sets whose rates are start-up costs, not a result.  The
``npy`` set's files are written once into ``--workdir`` (default: a folder in the system's
temporary folder).  On a shared machine the figures are noisy: each row says how many
rounds it has, and the JSON keeps each round's other load on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from asyncfeed._bench import userdata
from asyncfeed._bench.client import RunServer
from asyncfeed._bench.machine import machine_info
from asyncfeed._bench.neighbour import busy_neighbour
from asyncfeed._bench.outcome_report import (execution_key, markdown, stability_markdown,
                                              summarise)

DL_WORKERS = (0, 2, 4)


def _line(r: dict) -> str:
    who = "AsyncLoader" if r["family"] == "asyncfeed" else f"DataLoader w={r['workers']}"
    if not r.get("ok"):
        return f"{r['dataset']:10} {r['condition']:9} r{r['round']} {who:14} FAILED {r.get('error')}"
    rates = " ".join(f"{e['rate']:9,.0f}" for e in r["epochs"])
    ex = f"  {execution_key(r['epochs'][0])} -> {execution_key(r['epochs'][-1])}" \
        if r["family"] == "asyncfeed" else ""
    load = r.get("other_load")
    other = f"  (other load {load:.2f})" if load is not None else ""
    return f"{r['dataset']:10} {r['condition']:9} r{r['round']} {who:14} {rates}/s{other}{ex}"


def _summaries(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per data set and condition, in the order the rounds ran them."""
    keys = list(dict.fromkeys((r["dataset"], r["condition"]) for r in rounds))
    return [{"dataset": name, "condition": condition,
             "description": userdata.DATASETS[name].description if name in userdata.DATASETS
             else "",
             **summarise([r for r in rounds
                          if r["dataset"] == name and r["condition"] == condition])}
            for name, condition in keys]


def _report_again(path: str) -> None:
    """``--report``: summarise the rounds stored in ``path`` again and write them back
    (a bench file's ``outcome`` and ``stability`` keys, or an ``--json`` file)."""
    with open(path) as f:
        data = json.load(f)
    results = [data[k] for k in ("outcome", "stability") if k in data] or [data]
    if not any(r.get("rounds") for r in results):
        sys.exit(f"{path}: no outcome rounds to report")
    for result in results:
        if not result.get("rounds"):
            continue
        alone = all(r["family"] == "asyncfeed" for r in result["rounds"])
        result["summary"] = _summaries(result["rounds"])
        result["table"] = (stability_markdown if alone else markdown)(result["summary"])
        print(result["table"])
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds per data set (5)")
    ap.add_argument("--datasets", default=",".join(userdata.DATASETS),
                    help="comma-separated subset of " + ",".join(userdata.DATASETS))
    ap.add_argument("--epochs", type=int, default=3,
                    help="AsyncLoader epochs per round (3: the first and two steady)")
    ap.add_argument("--dl-epochs", type=int, default=2, help="DataLoader epochs per round (2)")
    ap.add_argument("--neighbour", action="store_true",
                    help="also run every round beside one busy-looping process")
    ap.add_argument("--quick", action="store_true", help="tiny data sets: a smoke test")
    ap.add_argument("--json", help="write every round and the summary here")
    ap.add_argument("--into", metavar="BENCH_JSON",
                    help="also store them under the 'outcome' key of an 'asyncfeed bench "
                         "--json' file (docs/benchmarks-2core.json: its --markdown page "
                         "then shows them)")
    ap.add_argument("--workdir", help="where generated files live (default: $TMPDIR)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per round's process")
    ap.add_argument("--workers", default=",".join(map(str, DL_WORKERS)),
                    help="DataLoader num_workers settings, comma-separated (0,2,4)")
    ap.add_argument("--report", metavar="JSON",
                    help="run nothing: summarise the rounds stored in JSON (an --json file "
                         "or a bench file with an 'outcome' key) again, and write them back")
    args = ap.parse_args()
    if args.report:
        _report_again(args.report)
        return
    names = [n for n in args.datasets.split(",") if n]
    unknown = [n for n in names if n not in userdata.DATASETS]
    if unknown or not names:
        ap.error(f"unknown data sets {unknown}; known: {', '.join(userdata.DATASETS)}")
    if args.rounds < 1 or args.epochs < 2 or args.dl_epochs < 1:
        ap.error("need --rounds >= 1, --epochs >= 2 (a steady state), --dl-epochs >= 1")
    workdir = os.path.abspath(args.workdir or os.path.join(tempfile.gettempdir(),
                                                           "asyncfeed-outcome"))
    os.makedirs(workdir, exist_ok=True)
    conditions = ["quiet"] + (["neighbour"] if args.neighbour else [])
    contenders: list[tuple[str, int | None]] = [("dataloader", int(w))
                                                      for w in args.workers.split(",") if w]
    contenders.append(("asyncfeed", None))
    alone = len(contenders) == 1  # AsyncLoader alone: how stable its choice is
    # SIGTERM (and SIGINT, which a shell ignores in background jobs) end the run through
    # its ``finally``: the neighbour is killed and the fork server closed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    info = machine_info()
    rundir = tempfile.mkdtemp(prefix="asyncfeed-outcome-runs-")
    rounds: list[dict[str, Any]] = []
    server = RunServer(rundir)
    try:
        for name in names:
            userdata.build(name, quick=args.quick, workdir=workdir)  # write its files once
            have = {w for f, w in contenders if f == "dataloader"}
            more = () if alone else userdata.DATASETS[name].more_workers
            mine = contenders[:-1] + [("dataloader", w) for w in more if w not in have]
            mine.append(contenders[-1])
            for n in range(args.rounds):
                for condition in conditions:
                    order = mine if n % 2 == 0 else mine[::-1]
                    for family, workers in order:
                        spec = {"entry": "outcome_round", "dataset": name, "quick": args.quick,
                                "workdir": workdir, "family": family, "workers": workers,
                                "epochs": args.epochs if family == "asyncfeed"
                                else args.dl_epochs}
                        with busy_neighbour(condition == "neighbour") as neighbour:
                            out = server.run(spec, timeout=args.timeout, pss_interval=3600,
                                             rss_interval=0.5)
                        r = {"dataset": name, "condition": condition, "round": n,
                             "family": family, "workers": workers, "ok": bool(out.get("ok")),
                             "epochs": out.get("epochs", []), "cpu_s": out.get("cpu_s"),
                             "build_s": out.get("build_s"), "other_load": out.get("other_load"),
                             "error": out.get("error"), "log_tail": out.get("log_tail"),
                             "neighbour_pid": neighbour.pid if neighbour else None}
                        rounds.append(r)
                        print(_line(r), flush=True)
    finally:
        server.close()
        shutil.rmtree(rundir, ignore_errors=True)
    summaries = _summaries(rounds)
    table = stability_markdown(summaries) if alone else markdown(summaries)
    print()
    if args.quick:
        print("--quick: tiny data sets; the ratios are start-up costs, not a result.\n")
    print(table)
    print(f"\n{len(rounds)} processes in {time.time() - started:.0f} s; "
          f"{info.get('cores_usable')} cores, load average at start {info.get('loadavg_start')}")
    result = {"argv": sys.argv, "settings": vars(args), "machine": info,
              "started": started, "rounds": rounds, "summary": summaries, "table": table}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.into:  # one results file per machine kind: this run under its "outcome" key
        with open(args.into) as f:  # ("stability" for AsyncLoader alone)
            bench = json.load(f)
        bench["stability" if alone else "outcome"] = result
        with open(args.into, "w") as f:
            json.dump(bench, f, indent=1)
    if any(not r["ok"] for r in rounds):
        sys.exit(1)


if __name__ == "__main__":
    main()
