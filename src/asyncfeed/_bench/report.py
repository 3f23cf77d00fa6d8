"""The benchmark's outputs: terminal tables and the JSON document."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from . import contenders
from .config import FULL_ROUNDS
from .workloads import WORKLOADS

MB = 2**20


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if spec == "mb":
        return f"{v / MB:,.0f}"
    if spec == "pct":
        return f"{100 * v:.0f}%"
    if spec == "x":
        return f"{v:.2f}x"
    return format(v, spec)


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                         for i, c in enumerate(cells)).rstrip()
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def _name(row: dict) -> str:
    name = row["label"]
    if row.get("knob") is None and row.get("family") != "limit":
        name += " *"
    if row["ok_runs"] < row["runs"]:
        name += f" [{row['runs'] - row['ok_runs']} failed]"
    if row.get("disturbed"):
        name += " ~"
    return name


def _ds_tag(row: dict) -> str:
    return {"folder": "folder", "ram": "in-RAM", "gil": "folder+py"}.get(row["dataset"], "")


#: printed last by a ``--quick`` run: its ratios are not a comparison
QUICK_NOTICE = ("--quick: a smoke run (few samples, small batches, one round): each "
                "loader's start-up (forks, imports, the first pass's measuring) is most of "
                "every epoch, so its ratios say nothing about speed; run without --quick to "
                "compare loaders.")


@dataclass(frozen=True)
class Section:
    """One table of the report: a workload (or the headline), the same for the terminal
    and for ``docs/benchmarks.md``.  ``lead`` is the line under the table saying who led
    and by how much (None where a table has no contest, e.g. the headline)."""

    key: str
    title: str
    notes: tuple[str, ...]
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    lead: str | None = None


#: per workload: (data set of the contest, figure, higher is better, unit)
_CONTEST: dict[str, tuple[str | None, str, bool, str]] = {
    "a": ("folder", "rate", True, "/s"), "b": ("ram", "rate", True, "/s"),
    "c": ("gil", "rate", True, "/s"), "e": ("remote", "rate", True, "/s"),
    "f": ("cifar", "rate", True, "/s"), "g": ("pil", "rate", True, "/s"),
    "h": (None, "rate", True, "/s"),  # every pipeline gives the same normalized crops
    "overhead": ("noop", "rate", True, "/s"), "ceiling": ("sleep", "rate", True, "/s"),
    "step": ("folder", "wait_fraction", False, " waiting"),
    "d": ("folder", "ttfb_s", False, " s"),
}


def _project(family: str) -> str:
    return "asyncfeed" if family in contenders.ASYNCFEED_FAMILIES else family


def _figure(v: float, unit: str) -> str:
    if unit == "/s":
        return f"{v:,.0f}/s"
    if unit == " waiting":
        return f"{v:.0%} waiting"
    return f"{v:.3f} s"


def lead_line(workload: str, rows: list[dict], *, quick: bool) -> str | None:
    """Who led ``workload`` and by how much over the best row of another loader (the
    limit, a reference with no loader, takes no part); and whether it was a smoke run."""
    if workload not in _CONTEST:
        return None
    dataset, fig, higher, unit = _CONTEST[workload]
    cands = [r for r in rows if r.get("family") != "limit" and r.get(fig) is not None
             and (dataset is None or r.get("dataset") == dataset)
             and (fig != "rate" or r[fig] > 0)]
    if not cands:
        return None
    cands.sort(key=lambda r: r[fig], reverse=higher)
    top = cands[0]
    other = next((r for r in cands if _project(r["family"]) != _project(top["family"])), None)
    line = f"led: {top['label']} ({_figure(top[fig], unit)})"
    if other is None:
        line += ", no other loader measured"
    elif fig == "wait_fraction":
        line += f", against the best other loader, {other['label']} " \
                f"({_figure(other[fig], unit)})"
    elif other[fig] > 0 and top[fig] > 0:
        what = "the rate" if fig == "rate" else "the time"
        line += f", {top[fig] / other[fig]:.2f}x {what} of the best other loader, " \
                f"{other['label']} ({_figure(other[fig], unit)})"
    return line + ("; a smoke run (--quick): not a comparison" if quick else
                   "; a full run")


def _steady_vs_limit(r: dict) -> float | None:
    """A row's steady rate (after its run's first tenth of batches) against the limit,
    which times the per-sample function after its processes started: the limit's
    rate is the row's rate over its ``vs_limit``."""
    rate, vs, steady = r.get("rate"), r.get("vs_limit"), r.get("steady_rate")
    if r.get("family") == "limit" or not rate or not vs or not steady:
        return None
    return float(steady * vs / rate)


def _steady_note(r: dict) -> str:
    steady = _steady_vs_limit(r)
    return f", {steady:.2f} steady" if steady is not None else ""


def _section_a(results: dict, s: dict, summ_a: list[dict]) -> tuple:
    """Workload (a)'s table: title, headers, rows and the notes on twin rows."""
    rows = [[_name(r), _fmt(r.get("rate"), ",.0f"), _fmt(r.get("vs_limit"), ".2f"),
             _fmt(_steady_vs_limit(r), ".2f"),
             _fmt(r.get("cpu_per_sample_ms"), ".2f"), _fmt(r.get("cpu_vs_w2"), ".2f"),
             _fmt(r.get("peak_pss_bytes"), "mb"), _fmt(r.get("ttfb_s"), ".3f")]
            for r in summ_a]
    twins = tuple(
        f"{t['label']} and {t['twin']} are the same configuration; over both rows' "
        f"{t['runs_in_median']} runs: {_fmt(t.get('rate'), ',.0f')}/s "
        f"({_fmt(t.get('vs_limit'), '.2f')} of the limit{_steady_note(t)}), "
        f"{_fmt(t.get('cpu_per_sample_ms'), '.2f')} ms CPU/sample "
        f"({_fmt(t.get('cpu_vs_w2'), '.2f')}x w=2), peak PSS "
        f"{_fmt(t.get('peak_pss_bytes'), 'mb')} MB" for t in results.get("twins") or [])
    return (f"(a) {WORKLOADS['a']}: {s['samples']} samples per run",
            ["contender", "samples/s", "x limit", "steady x limit", "CPU ms/sample",
             "x w=2 CPU", "peak PSS MB", "1st batch s"], rows, twins)


def _section_e(s: dict, summ_e: list[dict]) -> tuple:
    """Workload (e)'s table: title, headers, rows and notes on the servers."""
    where = {"remote": "http", "remote0": "http 0 ms", "s3": "s3", "s30": "s3 0 ms",
             "mount": "mount", "mount0": "page cache"}
    rows = [[_name(r), where.get(r["dataset"], r["dataset"]),
             _fmt(r.get("rate"), ",.0f"), _fmt(r.get("vs_dataloader_ref"), ".2f"),
             _fmt(r.get("vs_dataloader_best"), ".2f"), _fmt(r.get("vs_zero_latency"), ".2f"),
             _fmt(r.get("extra_requests"), ".1%"),
             _fmt(r.get("cpu_per_sample_ms"), ".2f")] for r in summ_e]
    if s.get("tail"):
        from .httpserve import TailModel
        model = TailModel(**s["tail"]).describe()
    else:
        model = f"{s.get('latency', 0.02) * 1e3:.0f} ms per request"
    notes: tuple[str, ...] = ()
    if "mount" in s.get("remotes", ()):
        o, r1 = s.get("mount_ms", (2.0, 10.0))
        notes += (f"mount: FUSE passthrough, {o:g} ms per open, {r1:g} ms per first read",)
    notes += ("the servers are separate processes (their CPU is not counted); x at 0 ms: "
              "against the same contender with a server that answers at once (the mount: "
              "the folder in the page cache); extra req: hedged requests per read",)
    return (f"(e) {WORKLOADS['e']}: {s.get('samples_remote')} samples per run; "
            f"servers: {model}",
            ["contender", "storage", "samples/s", "x w=cores", "x best w", "x at 0 ms",
             "extra req", "CPU ms/sample"], rows, notes)


def _section_ceiling(s: dict, summ_c: list[dict]) -> tuple:
    """The ceiling workload's table: title, headers and rows, one row per thread count."""
    by_t: dict[int, dict[str, dict]] = {}
    for r in summ_c:
        by_t.setdefault(r["knob"], {})[r["family"]] = r
    rows = []
    for t in sorted(by_t):
        af, td = by_t[t].get("asyncfeed", {}), by_t[t].get("torchdata", {})
        ideal = af.get("ideal_rate") or td.get("ideal_rate")
        rows.append([str(t), _fmt(ideal, ",.0f"), _fmt(af.get("rate"), ",.0f"),
                     _fmt(af.get("vs_ideal"), ".2f"), _fmt(td.get("rate"), ",.0f"),
                     _fmt(td.get("vs_ideal"), ".2f")])
    return (f"(ceiling) {WORKLOADS['ceiling']}; batch {s['batch_size']}, about "
            f"{s.get('ceiling_seconds')} s per run at the ideal rate",
            ["threads", "ideal T/5ms", "asyncfeed", "x ideal", "torchdata.nodes", "x ideal"],
            rows)


def sections(results: dict) -> list[Section]:
    """Every table of the report, in order: the headline, then each workload measured."""
    s, summ = results["settings"], results["summary"]
    quick = bool(s.get("quick"))
    out: list[Section] = []

    def add(key: str, title: str, headers: list[str], rows: list[list[str]],
            notes: tuple[str, ...] = ()) -> None:
        out.append(Section(key, title, notes, tuple(headers), tuple(tuple(r) for r in rows),
                           lead_line(key, summ.get(key, []), quick=quick)))

    head = results.get("headline") or []
    if head:
        out.append(Section(
            "headline", "headline: AsyncLoader at its defaults against the best DataLoader "
            "setting of the same run (ceiling: best thread count against torchdata.nodes' "
            "best)", (),
            ("workload", "asyncfeed", "samples/s", "best other", "samples/s", "ratio"),
            tuple((h["workload"], h["asyncfeed"], _fmt(h.get("rate"), ",.0f"),
                   h.get("versus") or "-", _fmt(h.get("versus_rate"), ",.0f"),
                   _fmt(h.get("ratio"), "x")) for h in head)))
    if "a" in summ:
        add("a", *_section_a(results, s, summ["a"]))
    if summ.get("step"):
        step_ms = (results.get("step_s") or 0) * 1e3
        roles = {"best": "its best in (a)", "reference": "w = cores", "default": "defaults"}
        rows = [[_name(r), roles.get(r.get("role"), r.get("role") or ""),
                 _fmt(r.get("wait_fraction"), "pct"), _fmt(r.get("rate"), ",.0f")]
                for r in summ["step"]]
        add("step", f"(a) + a simulated training step of {step_ms:.1f} ms per batch (a model "
            f"that consumes {s['step_load']:.0%} of the limit's rate)",
            ["contender", "setting", "time waiting for data", "samples/s"], rows)
    if "b" in summ:
        rows = [[_name(r), _fmt(r.get("rate"), ",.0f"), _fmt(r.get("vs_limit"), ".2f"),
                 _fmt(r.get("peak_pss_bytes"), "mb"), _fmt(r.get("memory_vs_w0"), ".2f"),
                 _fmt(r.get("peak_rss_sum_bytes"), "mb")] for r in summ["b"]]
        add("b", f"(b) {WORKLOADS['b']}: {s['samples_ram']} samples, {s['ram_mb']:.0f} MB "
            "of Python objects + the JPEG bytes",
            ["contender", "samples/s", "x limit", "peak PSS MB", "x w=0 mem", "RSS sum MB"],
            rows)
    if "c" in summ:
        rows = [[_name(r), _fmt(r.get("rate"), ",.0f"), _fmt(r.get("vs_limit"), ".2f"),
                 _fmt(r.get("cpu_per_sample_ms"), ".2f")] for r in summ["c"]]
        add("c", f"(c) {WORKLOADS['c']}: {s['samples_gil']} samples per run",
            ["contender", "samples/s", "x limit", "CPU ms/sample"], rows)
    if "d" in summ:
        rows = [[_name(r), _ds_tag(r), _fmt(r.get("ttfb_s"), ".3f"),
                 _fmt(r.get("ttfb_vs_fork"), ".2f"), _fmt(r.get("ttfb_vs_spawn"), ".3f"),
                 _fmt(r.get("close_s"), ".2f")] for r in summ["d"]]
        add("d", f"(d) {WORKLOADS['d']}: from building the loader to holding batch 1",
            ["contender", "data", "1st batch s", "x fork", "x spawn", "close s"], rows)
    if "e" in summ:
        add("e", *_section_e(s, summ["e"]))
    for wl, what in (("f", s.get("samples_cifar")), ("g", s.get("samples_pil"))):
        if wl not in summ:
            continue
        rows = [[_name(r), _fmt(r.get("rate"), ",.0f"), _fmt(r.get("vs_dataloader_best"), ".2f"),
                 _fmt(r.get("vs_limit"), ".2f"), _fmt(r.get("cpu_per_sample_ms"), ".3f"),
                 _fmt(r.get("peak_pss_bytes"), "mb")] for r in summ[wl]]
        bs = s.get("batch_size_small") if wl == "f" else s["batch_size"]
        add(wl, f"({wl}) {WORKLOADS[wl]}: {what} samples per run, batch {bs}",
            ["contender", "samples/s", "x best DL", "x limit", "CPU ms/sample", "peak PSS MB"],
            rows)
    if "h" in summ:
        from .augment import section as section_h
        add("h", *section_h(summ["h"], s, _fmt, _name))
    if "overhead" in summ:
        rows = [[_name(r), _fmt(r.get("rate"), ",.0f"), _fmt(r.get("vs_dataloader_best"), ".2f"),
                 _fmt((r.get("cpu_per_sample_ms") or 0) * 1e3 or None, ".1f")]
                for r in summ["overhead"]]
        add("overhead", f"(overhead) {WORKLOADS['overhead']}: {s.get('samples_noop')} samples, "
            f"batch {s.get('batch_size_small')}",
            ["contender", "samples/s", "x DL w=0", "CPU us/sample"], rows)
    if "ceiling" in summ:
        add("ceiling", *_section_ceiling(s, summ["ceiling"]))
    return out


def machine_line(results: dict) -> str:
    """The machine a run measured, in one line."""
    m = results["machine"]
    gpu = m.get("gpu") or "no GPU"
    return (f"{m.get('cores_usable')} cores ({m.get('cpu_model', '?')}), "
            f"{m['memory_bytes'] / 2**30:.1f} GiB, Python {m['python']}, torch {m['torch']}, "
            f"{gpu}")


def settings_line(results: dict) -> str:
    """Sizes, rounds and the data set of a run, in one line."""
    s, data = results["settings"], results.get("data", {})
    kb = data.get("mean_bytes", 0) / 1e3
    desc = (f"synthetic set: {data.get('n_images')} JPEGs, mean {kb:.0f} KB, mean "
            f"{data.get('mean_width', 0):.0f}x{data.get('mean_height', 0):.0f}"
            if s["synthetic"] else
            f"data: {s['root']} ({data.get('files_used')} of its {data.get('files_in_tree')} "
            "files, picked at random)")
    other = min(s["repeats"], s["repeats_other"])
    plural = "s" if s["repeats"] != 1 else ""
    full = ", ".join(f"({w})" if len(w) == 1 else f"the {w}"
                     for w in s.get("full_rounds", FULL_ROUNDS))
    rounds = (f"{s['repeats']} round{plural}" if other == s["repeats"] else
              f"{s['repeats']} rounds for {full}, {other} for the rest")
    return (f"{s['size']}x{s['size']} uint8, batch {s['batch_size']}, {rounds} "
            f"(interleaved), figures are medians; {desc}")


def render(results: dict) -> str:
    """The human-readable report (what the terminal shows at the end).  A smoke run's
    :data:`QUICK_NOTICE` is not in it: the command prints it after everything else, where
    it does not scroll away (each table's last line already says it was a smoke run)."""
    s, summ = results["settings"], results["summary"]
    parts = [f"asyncfeed bench: {machine_line(results)}", settings_line(results),
             "* = the loader's defaults (no tuning).  samples/s: the whole epoch, from "
             "building the loader to the last batch; CPU: every process of the run.",
             f"~ = every run of that row was disturbed by other load (> "
             f"{s.get('busy_threshold', 0.15):.0%} of the machine); disturbed runs are re-run "
             "once and left out of the medians when a clean run exists."]
    for sec in sections(results):
        parts.append("\n" + sec.title)
        if sec.key == "a":
            parts.append(table(list(sec.headers), [list(r) for r in sec.rows]))
            parts.extend(sec.notes)
        else:
            parts.extend(sec.notes)
            parts.append(table(list(sec.headers), [list(r) for r in sec.rows]))
        if sec.lead:
            parts.append(sec.lead)
    tuning = results.get("tuning", {})
    for wl, fams in tuning.items():
        bits = []
        for fam, t in fams.items():
            k = t.get("knee")
            if k:
                bits.append(f"{contenders.label(fam, k['knob'])} ({k['rate']:,.0f}/s)")
        if bits:
            parts.append(f"\nknee ({wl}, first setting within 5% of its best): " + "; ".join(bits))
    close_errors = [(cfg["label"], r["close_error"]) for cfgs in results["runs"].values()
                    for cfg in cfgs for r in cfg["runs"] if r.get("close_error")]
    if close_errors:
        parts.append("\nerrors while closing a loader after its figures were taken:")
        for lab, err in close_errors[:10]:
            parts.append(f"  {lab}: {err}")
    if results.get("skipped"):
        parts.append("\nskipped:")
        for fam, why in results["skipped"].items():
            parts.append(f"  {contenders.FAMILIES.get(fam, fam)}: {why}")
    runs = [r for cfgs in results["runs"].values() for c in cfgs for r in c["runs"]]
    busy = [r for r in runs if (r.get("other_load") or 0) > s.get("busy_threshold", 0.15)]
    dirty = [r["label"] for rows in summ.values() for r in rows if r.get("disturbed")]
    if busy:
        parts.append(f"\nnote: other processes used more than {s.get('busy_threshold', 0.15):.0%}"
                     f" of the machine during {len(busy)} of {len(runs)} runs (up to "
                     f"{max(r['other_load'] for r in busy):.0%}).")
    if dirty:
        parts.append("warning: no undisturbed run for: " + ", ".join(dirty)
                     + "; those figures are noisy.")
    if results.get("elapsed_s"):
        parts.append(f"\ntotal time {results['elapsed_s']:.0f} s")
    return "\n".join(parts)


def public(obj: Any) -> Any:
    """``obj`` without the keys that start with ``_``, at every depth: a loader's private
    fields (its stats' internal reading) are not figures, and the JSON is published."""
    if isinstance(obj, dict):
        return {k: public(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list):
        return [public(v) for v in obj]
    return obj


def write_json(results: dict, path: str) -> None:
    """Every figure of a run, as published (:func:`public`)."""
    with open(path, "w") as f:
        json.dump(public(results), f, indent=1, default=str)
