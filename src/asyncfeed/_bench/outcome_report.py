"""The outcome bench's figures: rounds in, per-data-set ratios and a markdown table out.

A *round* is one fresh process running one contender (see :mod:`.outcome_round`):
``{"dataset", "condition", "round", "family", "workers", "ok", "epochs": [...]}``.
Per data set and condition (``quiet``, or ``neighbour``: one busy-looping process
beside the run) :func:`summarise` reports:

* the best DataLoader setting (highest median over rounds) for the first epoch, and
  for later epochs (their mean per round; the first epoch where a round ran only one);
* AsyncLoader's first-epoch rate and its steady state (the mean rate of its epochs
  after the first, on the same loader), each as a ratio to the best DataLoader
  setting's rate *in the same round* (side by side), median and worst round;
* the slowest round over the median, for AsyncLoader's first epoch and steady state,
  and the same for the best DataLoader setting: what a run of a contender that does
  not choose reads against its own median on this machine, the floor that the
  paired ratios' worst round stands on (two such runs, one on each side);
* the execution chosen in each round (after the first epoch, and after the last)
  and how many rounds chose the most common one;
* the median share of the machine's CPU used outside the round's process tree
  ("other load": other users, and the neighbour where there is one).

AsyncLoader's own figures (``own``: its first-epoch and steady-state medians and
slowest round over them) and its executions are kept without DataLoader rounds too:
a run of AsyncLoader alone (``bench/outcome.py --workers ""``) measures how stable
its choice is over many fresh processes, which :func:`stability_markdown` tabulates.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any, Callable


def execution_key(fields: dict[str, Any]) -> str:
    """A short name for an execution: ``inline``, ``threads(4)``, ``processes(2)``.

    From the ``mode`` and ``count`` fields where the execution had them, else read
    from its text (``"processes: 2 workers (...)"``, ``"threads: 1 of 4 running
    (adaptive)"``, ``"threads: 8 (pinned)"``, ``"threads: none running, ..."``)."""
    mode = fields.get("mode")
    if mode is not None:
        count = fields.get("count")
        return f"{mode}({count})" if count is not None and mode != "inline" else str(mode)
    text = str(fields.get("execution", ""))
    m = re.match(r"processes: (\d+)", text)
    if m:
        return f"processes({m.group(1)})"
    if text.startswith("threads: none running"):
        return "inline"
    m = re.match(r"threads: (\d+)", text)
    if m:
        return f"threads({m.group(1)})"
    return text.split("(")[0].strip()[:30] or "?"


def _first(epochs: list[dict]) -> float:
    return float(epochs[0]["rate"])


def _later(epochs: list[dict]) -> float:
    """The steady state: the mean rate of the epochs after the first (the first's rate
    where there is no other)."""
    rates = [e["rate"] for e in epochs[1:]] or [epochs[0]["rate"]]
    return sum(rates) / len(rates)


def _dl_name(workers: int) -> str:
    return f"w={workers}"


def summarise(rounds: list[dict]) -> dict[str, Any]:
    """The figures of one data set under one condition (``rounds`` all share both)."""
    ok = [r for r in rounds if r.get("ok")]
    failed = [f"{r['family']} {r.get('workers')}: {r.get('error')}" for r in rounds
              if not r.get("ok")]
    by_round: dict[int, dict[str, dict]] = {}
    for r in ok:
        key = "async" if r["family"] == "asyncfeed" else _dl_name(r["workers"])
        by_round.setdefault(r["round"], {})[key] = r
    settings = sorted({k for runs in by_round.values() for k in runs if k != "async"})
    out: dict[str, Any] = {"rounds": len(by_round), "failed": failed}
    loads = [r["other_load"] for r in ok if r.get("other_load") is not None]
    out["other_load_median"] = statistics.median(loads) if loads else None

    def rates_of(setting: str, figure: Callable[[list[dict]], float]) -> list[float]:
        return [figure(runs[setting]["epochs"]) for runs in by_round.values()
                if setting in runs]

    def medians(figure: Callable[[list[dict]], float]) -> dict[str, float]:
        return {s: statistics.median(rates_of(s, figure)) for s in settings}

    def best(meds: dict[str, float]) -> str | None:
        return max(meds, key=lambda s: meds[s]) if meds else None

    out["dl_first_medians"] = medians(_first)
    out["dl_later_medians"] = medians(_later)
    best_first = out["best_dl_first"] = best(out["dl_first_medians"])
    best_later = out["best_dl_later"] = best(out["dl_later_medians"])
    af = {n: runs["async"] for n, runs in by_round.items() if "async" in runs}
    if not af:
        return out
    out["executions"] = _executions([r for _, r in sorted(af.items())])
    out["own"] = {name: _spread([figure(r["epochs"]) for r in af.values()])
                  for name, figure in (("first", _first), ("steady", _later))}
    if best_first is None or best_later is None:
        return out
    paired_first = [(_first(r["epochs"]), _first(by_round[n][best_first]["epochs"]))
                    for n, r in af.items() if best_first in by_round[n]]
    paired_later = [(_later(r["epochs"]), _later(by_round[n][best_later]["epochs"]))
                    for n, r in af.items() if best_later in by_round[n]]
    for name, pairs, figure, setting, dl_medians in (
            ("first", paired_first, _first, best_first, out["dl_first_medians"]),
            ("steady", paired_later, _later, best_later, out["dl_later_medians"])):
        if not pairs:
            continue
        rates = [a for a, _ in pairs]
        ratios = [a / b for a, b in pairs]
        med = statistics.median(rates)
        dl_median = dl_medians[setting]
        dl_rates = rates_of(setting, figure)
        out[name] = {"dl_median": dl_median, "median": med, "ratio_median":
                     statistics.median(ratios), "ratio_worst": min(ratios),
                     "slowest_over_median": min(rates) / med, "ratios": ratios,
                     "rates": rates, "dl_slowest_over_median": min(dl_rates) / dl_median}
    return out


def _executions(runs: list[dict]) -> dict[str, Any]:
    """The execution each of AsyncLoader's ``runs`` (in round order) ran after its
    first epoch and after its last, and the most common after the first."""
    chosen_first = [execution_key(r["epochs"][0]) for r in runs]
    chosen_last = [execution_key(r["epochs"][-1]) for r in runs]
    top, count = Counter(chosen_first).most_common(1)[0]
    return {"after_first_epoch": chosen_first, "after_last_epoch": chosen_last,
            "most_common": top, "most_common_rounds": count,
            "changed_after_first_epoch": sum(a != b for a, b in zip(chosen_first, chosen_last))}


def _spread(rates: list[float]) -> dict[str, float]:
    """The median of ``rates`` and their slowest over it."""
    med = statistics.median(rates)
    return {"median": med, "slowest_over_median": min(rates) / med if med > 0 else 0.0}


def _floor(figures: dict[str, Any]) -> str:
    """The best DataLoader setting's slowest round over its median ("-" in summaries
    written before it was kept)."""
    x = figures.get("dl_slowest_over_median")
    return "-" if x is None else f"{x:.2f}"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}/s"


def markdown(summaries: list[dict[str, Any]]) -> str:
    """The table: one row per data set and condition, then each round's executions.

    ``summaries``: ``{"dataset", "condition", **summarise(...)}`` dicts."""
    head = ("| data set | neighbour | best DataLoader, 1st epoch | AsyncLoader 1st epoch "
            "| ratio median (worst) | best DataLoader, later | AsyncLoader steady "
            "| ratio median (worst) | slowest/median 1st, steady (best DataLoader's) "
            "| execution: most common (rounds) | other load |")
    lines = [head, "|" + " --- |" * 11]
    notes = []
    for s in summaries:
        f, st, ex = s.get("first"), s.get("steady"), s.get("executions")
        cells = [s["dataset"], "yes" if s["condition"] == "neighbour" else "no"]
        if f is None or st is None or ex is None:
            cells += ["no AsyncLoader/DataLoader pair"] + ["-"] * 8
        else:
            cells += [
                f"{s['best_dl_first']} {_rate(f['dl_median'])}", _rate(f["median"]),
                f"**{f['ratio_median']:.2f}x** ({f['ratio_worst']:.2f}x)",
                f"{s['best_dl_later']} {_rate(st['dl_median'])}", _rate(st["median"]),
                f"**{st['ratio_median']:.2f}x** ({st['ratio_worst']:.2f}x)",
                f"{f['slowest_over_median']:.2f}, {st['slowest_over_median']:.2f} "
                f"({_floor(f)}, {_floor(st)})",
                f"{ex['most_common']} ({ex['most_common_rounds']}/{len(ex['after_first_epoch'])})",
                "-" if s.get("other_load_median") is None else f"{s['other_load_median']:.2f}",
            ]
            changed = (f"; after the last epoch: {', '.join(ex['after_last_epoch'])}"
                       if ex["changed_after_first_epoch"] else "")
            notes.append(f"- {s['dataset']} ({s['condition']}): "
                         f"{', '.join(ex['after_first_epoch'])}{changed}")
        if s.get("failed"):
            notes.append(f"- {s['dataset']} ({s['condition']}) FAILED rounds: "
                         + "; ".join(s["failed"]))
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "Execution chosen per round (after the first epoch):", ""] + notes
    return "\n".join(lines)


def stability_markdown(summaries: list[dict[str, Any]]) -> str:
    """The table of a run of AsyncLoader alone: per data set and condition, the
    execution most rounds ran after the first epoch (and how many), the others, the
    executions after the last epoch (a search may still run at the first epoch's
    end, and a re-check may move a choice), and the first epoch's and the steady
    state's median with the slowest round over it.

    ``summaries``: ``{"dataset", "condition", **summarise(...)}`` dicts."""
    head = ("| data set | neighbour | execution after the 1st epoch: most common (rounds) "
            "| the other rounds | after the last epoch | 1st epoch: median (slowest/median) "
            "| steady: median (slowest/median) | other load |")
    lines = [head, "|" + " --- |" * 8]
    for s in summaries:
        ex, own = s.get("executions"), s.get("own")
        cells = [s["dataset"], "yes" if s["condition"] == "neighbour" else "no"]
        if ex is None or own is None:
            cells += ["no AsyncLoader round"] + ["-"] * 5
        else:
            others = Counter(e for e in ex["after_first_epoch"] if e != ex["most_common"])
            last = Counter(ex["after_last_epoch"]).most_common()
            cells += [
                f"**{ex['most_common']}** ({ex['most_common_rounds']}/"
                f"{len(ex['after_first_epoch'])})",
                ", ".join(f"{e} ({n})" for e, n in others.most_common()) or "-",
                ", ".join(f"{e} ({n})" for e, n in last),
                f"{_rate(own['first']['median'])} ({own['first']['slowest_over_median']:.2f})",
                f"{_rate(own['steady']['median'])} "
                f"({own['steady']['slowest_over_median']:.2f})",
                "-" if s.get("other_load_median") is None else f"{s['other_load_median']:.2f}",
            ]
        if s.get("failed"):
            cells[-1] += " (FAILED rounds: " + "; ".join(s["failed"]) + ")"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
