"""Medians over a configuration's runs, and the ratios the report shows against the references."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .config import Config

_FIGURES = ("steady_rate", "rate", "cpu_per_sample_ms", "peak_pss_bytes", "peak_rss_sum_bytes",
            "ttfb_s", "wait_fraction", "other_load", "close_s", "build_s")


def _median(vals: Sequence[float | None]) -> float | None:
    present = [v for v in vals if v is not None]
    return statistics.median(present) if present else None


def _disturbed(run: dict, threshold: float = 0.15) -> bool:
    return (run.get("other_load") or 0.0) > threshold


def _used(cfg: Config, threshold: float = 0.15) -> tuple[list[dict], list[dict], list[dict]]:
    """``cfg``'s good runs, its undisturbed ones, and those its figures are read from:
    the undisturbed runs when it has any."""
    ok = [r for r in cfg.runs if r.get("ok")]
    clean = [r for r in ok if not _disturbed(r, threshold)]
    return ok, clean, clean or ok


def summarize(cfg: Config, threshold: float = 0.15) -> dict:
    """Medians over the runs of ``cfg``: its undisturbed runs when it has any."""
    ok, clean, used = _used(cfg, threshold)
    row: dict[str, Any] = {"key": cfg.key, "label": cfg.label, "family": cfg.family,
                           "knob": cfg.knob, "mode": cfg.mode, "context": cfg.context,
                           "dataset": cfg.dataset, "role": cfg.role, "runs": len(cfg.runs),
                           "ok_runs": len(ok), "runs_in_median": len(used),
                           "disturbed": bool(used) and not clean}
    ok = used
    errors = [r.get("error") for r in cfg.runs if not r.get("ok")]
    if errors:
        row["errors"] = errors
    io = [((r.get("loader_stats") or {}).get("io") or {}) for r in ok]
    io = [x for x in io if isinstance(x, dict) and x.get("attempts")]
    if io:  # workload e: extra requests sent by hedging, per read of a sample
        row["hedges"] = sum(x.get("hedges", 0) for x in io)
        reads = sum(x["attempts"] - x.get("hedges", 0) - x.get("retries", 0) for x in io)
        row["extra_requests"] = row["hedges"] / max(1, reads)
    for f in _FIGURES:
        vals = [r.get(f) for r in ok]
        if f == "peak_pss_bytes":
            vals = [v for v in vals if v]  # 0: the run ended before a reading
        row[f] = _median(vals) if f != "other_load" else max(
            (v for v in vals if v is not None), default=None)
    return row


def paired_ratios(cfg: Config, reference: Config) -> list[float]:
    """``cfg``'s rate over ``reference``'s, round by round: each run ``cfg``'s figures
    are read from (:func:`summarize`) against ``reference``'s of the same round (a
    round runs every configuration of a workload one after another, so the two ran
    minutes apart at most, where the medians of all rounds may mix a fast round of
    one with a slow round of the other).  Rounds where either has no such run are
    left out."""
    ref = {r.get("round"): r["rate"] for r in _used(reference)[2] if r.get("rate")}
    return [r["rate"] / ref[r.get("round")] for r in _used(cfg)[2]
            if r.get("rate") and r.get("round") in ref]


def _resolved(cfg: Config) -> int | None:
    """The thread count a default-configured run actually used (from its loader)."""
    for run in cfg.runs:
        k = (run.get("loader_info") or {}).get("resolved_threads")
        if isinstance(k, int):
            return k
    return None


def _best(rows: list[Config]) -> Config | None:
    scored = [(summarize(c).get("rate") or 0, c) for c in rows]
    scored = [x for x in scored if x[0] > 0]
    return max(scored, key=lambda x: x[0])[1] if scored else None


def _relative(workload: str, rows: list[dict]) -> None:
    """Each row's ratios against the references (the limit, the DataLoader settings)."""
    def find(**kw: Any) -> dict | None:
        return next((r for r in rows if all(r.get(k) == v for k, v in kw.items())), None)
    if workload == "b":
        ref = find(family="dataloader", knob=0)
        if ref and ref.get("peak_pss_bytes"):
            for r in rows:
                if r.get("peak_pss_bytes") and r["family"] != "limit":
                    r["memory_vs_w0"] = r["peak_pss_bytes"] / ref["peak_pss_bytes"]
    if workload == "d":
        for r in rows:
            for ctx in ("fork", "spawn"):
                ref = find(family="dataloader", context=ctx, dataset=r["dataset"])
                if ref and ref.get("ttfb_s") and r.get("ttfb_s"):
                    r[f"ttfb_vs_{ctx}"] = r["ttfb_s"] / ref["ttfb_s"]
    if workload == "e":
        for r in rows:
            base = find(family="dataloader", role="reference", dataset=r["dataset"])
            if base and base.get("rate") and r.get("rate"):
                r["vs_dataloader_ref"] = r["rate"] / base["rate"]
            # "remote" (HTTP), "s3", "mount" against "remote0", "s30", "mount0"
            zero = find(family=r["family"], knob=r["knob"], dataset=r["dataset"] + "0")
            if zero and zero.get("rate") and r.get("rate"):
                r["vs_zero_latency"] = r["rate"] / zero["rate"]
        for ds in {r["dataset"] for r in rows if not r["dataset"].endswith("0")}:
            best = max((x.get("rate") or 0 for x in rows if x["family"] == "dataloader"
                        and x["dataset"] == ds), default=0)
            for r in rows:
                if best and r.get("rate") and r["dataset"] == ds:
                    r["vs_dataloader_best"] = r["rate"] / best
    if workload in ("f", "g", "overhead"):
        best = max((x.get("rate") or 0 for x in rows if x["family"] == "dataloader"), default=0)
        for r in rows:
            if best and r.get("rate") and r["family"] != "limit":
                r["vs_dataloader_best"] = r["rate"] / best
    if workload == "h":
        from .augment import relative
        relative(rows)
    if workload == "ceiling":
        from .workloads import SLEEP_S
        for r in rows:
            if r.get("knob") and r.get("rate"):
                r["ideal_rate"] = r["knob"] / SLEEP_S
                r["vs_ideal"] = r["rate"] / r["ideal_rate"]
    if workload == "a":
        ref = next((r for r in rows if r["family"] == "dataloader" and r["knob"] == 2), None)
        if ref and ref.get("cpu_per_sample_ms"):
            for r in rows:
                if r.get("cpu_per_sample_ms"):
                    r["cpu_vs_w2"] = r["cpu_per_sample_ms"] / ref["cpu_per_sample_ms"]


#: per workload, the data set its headline compares on (the others are remedies or
#: references: (c)'s numpy rewrite, (e)'s 0 ms server)
_MAIN_DATASET = {"a": "folder", "b": "ram", "c": "gil", "e": "remote", "f": "cifar",
                 "g": "pil", "h": "train", "overhead": "noop"}
#: where the headline's DataLoader is another pipeline: (h) fused against the PIL one
_VERSUS_DATASET = {"h": "pil"}


def headline(summary: dict[str, list[dict]]) -> list[dict]:
    """Per workload: AsyncLoader at its defaults against the best DataLoader setting
    measured in the same run (``ratio`` = asyncfeed's rate / DataLoader's best), and
    on the ceiling workload the best asyncfeed thread count against torchdata.nodes'."""
    out: list[dict] = []
    for wl, rows in summary.items():
        if wl == "ceiling":
            def top(fam: str) -> dict | None:
                cands = [r for r in rows if r["family"] == fam and r.get("rate")]
                return max(cands, key=lambda r: r["rate"]) if cands else None
            af, td = top("asyncfeed"), top("torchdata")
            if af is not None:
                out.append({"workload": wl, "asyncfeed": af["label"], "rate": af["rate"],
                            "versus": td["label"] if td else None,
                            "versus_rate": td["rate"] if td else None,
                            "ratio": af["rate"] / td["rate"] if td else None,
                            "vs_ideal": af.get("vs_ideal")})
            continue
        ds = _MAIN_DATASET.get(wl)
        if ds is None:
            continue
        mine = [r for r in rows if r["dataset"] == ds and r["role"] == "default"
                and r["mode"] == "throughput" and r.get("rate")]
        mine.sort(key=lambda r: ("asyncfeed", "asyncfeed-map", "asyncfeed-async").index(
            r["family"]) if r["family"] in ("asyncfeed", "asyncfeed-map", "asyncfeed-async")
            else 9)
        versus = _VERSUS_DATASET.get(wl, ds)
        dls = [r for r in rows if r["family"] == "dataloader" and r["dataset"] == versus
               and r["mode"] == "throughput" and r.get("rate")]
        if not mine:
            continue
        best = max(dls, key=lambda r: r["rate"]) if dls else None
        out.append({"workload": wl, "asyncfeed": mine[0]["label"], "rate": mine[0]["rate"],
                    "versus": best["label"] if best else None,
                    "versus_rate": best["rate"] if best else None,
                    "ratio": mine[0]["rate"] / best["rate"] if best else None,
                    "vs_limit": mine[0].get("vs_limit"),
                    "cpu_per_sample_ms": mine[0].get("cpu_per_sample_ms"),
                    "versus_cpu_per_sample_ms": best.get("cpu_per_sample_ms") if best else None})
    return out
