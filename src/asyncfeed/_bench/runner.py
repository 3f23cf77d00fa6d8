"""What to run, in which order, and the medians of what came back.

Runs are grouped by workload; within a workload every configuration is run
once per round and the rounds repeat (A B C A B C ...), so slow drifts of the
machine (other load, thermal state) fall on every contender alike.  Figures
are the median over the rounds.  Each run is a fresh process forked from the
fork server (:mod:`.server`).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any, Callable

from . import contenders
from .client import RunServer, ServerError
from .config import Config, Settings, default_threads, default_workers
from .machine import machine_info
from .summary import (_best, _disturbed, _relative, _resolved, headline, paired_ratios,
                      summarize)
from .tuning import knee
from .workloads import SLEEP_S

__all__ = ["Bench", "Config", "Settings", "default_threads", "default_workers",
           "machine_info", "summarize"]


class Bench:
    """Plans and runs the benchmark; ``results()`` gives everything for the report."""

    def __init__(self, settings: Settings, *, progress: Any = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.s = settings
        self.progress = progress
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.skipped: dict[str, str] = {}
        self.available: list[str] = []
        for fam in settings.families:
            why = contenders.availability(fam)
            if why is None:
                self.available.append(fam)
            else:
                self.skipped[fam] = why
        self.configs: dict[str, list[Config]] = {}
        self.step_s: float | None = None
        self._http: Any = None  # workload e's HTTP servers, while it runs
        self.started = time.time()
        self.elapsed_s: float | None = None

    # -- planning -------------------------------------------------------------------
    def _has(self, fam: str) -> bool:
        return fam in self.available

    def default_threads(self) -> int:
        """The thread count ``AsyncLoader`` picks by itself (its default ``num_threads``)."""
        try:
            from asyncfeed._engine.resources import available_cores
            return int(available_cores())
        except Exception:  # noqa: BLE001 - an older or broken loader: assume the cores
            return self.s.cores

    def _sweep(self, workload: str, dataset: str, families: list[str], *,
               workers: tuple[int, ...], threads: tuple[int, ...],
               sweep: tuple[str, ...] = ("asyncfeed",)) -> list[Config]:
        """DataLoader over ``workers``; thread loaders over ``threads``; each asyncfeed
        family at its defaults, and swept too when listed in ``sweep`` (the point its
        default already covers is not run twice)."""
        s = self.s
        out: list[Config] = []
        for fam in families:
            if not self._has(fam):
                continue
            if fam == "dataloader":
                out += [Config(workload, fam, w, dataset=dataset) for w in workers]
                continue
            if fam in contenders.ASYNCFEED_FAMILIES:
                out.append(Config(workload, fam, None, dataset=dataset, role="default"))
                if fam not in sweep or not s.sweep_asyncfeed:
                    continue
                dflt = self.default_threads()
                out += [Config(workload, fam, t, dataset=dataset) for t in threads if t != dflt]
                continue
            out += [Config(workload, fam, t, dataset=dataset) for t in threads]
        return out

    def _limits(self, workload: str, dataset: str) -> list[Config]:
        procs = sorted({1, self.s.cores} if self.s.single_limit else {self.s.cores})
        return [Config(workload, "limit", p, mode="limit", dataset=dataset, role="limit")
                for p in procs]

    def plan(self) -> None:
        s = self.s
        w = set(s.workloads)
        if "a" in w:
            self.configs["a"] = self._limits("a", "folder") + self._sweep(
                "a", "folder", ["dataloader", "torchdata", "spdl", "asyncfeed",
                                "asyncfeed-async", "asyncfeed-map"],
                workers=s.workers, threads=s.threads)
            self.configs["step"] = []  # filled once (a) has told which setting is best
        if "b" in w:
            self.configs["b"] = self._plan_b()
        if "c" in w:
            self.configs["c"] = self._plan_c()
        if "f" in w:
            cfgs = self._sweep("f", "cifar", ["dataloader", "asyncfeed"], workers=s.workers,
                               threads=s.threads)
            if self._has("torchdata") and not s.quick:
                cfgs.append(Config("f", "torchdata", s.cores, dataset="cifar"))
            self.configs["f"] = cfgs
        if "g" in w:
            cfgs = self._limits("g", "pil") + self._sweep(
                "g", "pil", ["dataloader", "asyncfeed"], workers=s.workers, threads=s.threads)
            if self._has("torchdata") and not s.quick:
                cfgs.append(Config("g", "torchdata", s.cores, dataset="pil"))
            self.configs["g"] = cfgs
        if "h" in w:
            from .augment import plan as plan_h
            self.configs["h"] = plan_h(self)
        if "ceiling" in w:
            self.configs["ceiling"] = [
                Config("ceiling", fam, t, dataset="sleep")
                for t in s.ceiling_threads for fam in ("asyncfeed", "torchdata")
                if self._has(fam)]
        if "overhead" in w:
            cfgs = []
            if self._has("dataloader"):
                cfgs.append(Config("overhead", "dataloader", 0, dataset="noop",
                                   role="reference"))
            if self._has("asyncfeed"):
                cfgs += [Config("overhead", "asyncfeed", 1, dataset="noop"),
                         Config("overhead", "asyncfeed", None, dataset="noop", role="default")]
            self.configs["overhead"] = cfgs
        if "e" in w:
            self.configs["e"] = self._plan_e()
        if "d" in w:
            self.configs["d"] = self._plan_d()

    def _plan_b(self) -> list[Config]:
        """Workload b: the in-RAM data set."""
        s = self.s
        cfgs = [Config("b", "limit", s.cores, mode="limit", dataset="ram", role="limit")]
        cfgs += [Config("b", "dataloader", k, dataset="ram", role="reference" if k == 0
                        else "sweep")
                 for k in sorted({0, s.cores, 2 * s.cores} if not s.quick else {0, s.cores})
                 if self._has("dataloader")]
        cfgs += [Config("b", f, s.cores, dataset="ram") for f in ("torchdata", "spdl")
                 if self._has(f)]
        if self._has("asyncfeed-map"):
            cfgs.append(Config("b", "asyncfeed-map", None, dataset="ram", role="default"))
        return cfgs

    def _plan_c(self) -> list[Config]:
        """Workload c: GIL-bound samples, and the numpy rewrite as the remedy."""
        s = self.s
        # (c) is slow per sample: a shorter sweep shows the shape (threads stay flat)
        few_t = tuple(t for t in s.threads if t in (1, s.cores)) or s.threads[:1]
        few_w = tuple(w for w in s.workers if w in (0, s.cores, 2 * s.cores)) or s.workers
        cfgs = self._limits("c", "gil") + self._sweep(
            "c", "gil", ["dataloader", "torchdata", "asyncfeed"], workers=few_w,
            threads=few_t)
        if self._has("spdl"):
            cfgs.append(Config("c", "spdl", s.cores, dataset="gil"))
        # the remedy: the same transform rewritten with numpy (same pixels out)
        if self._has("dataloader"):
            cfgs.append(Config("c", "dataloader", s.cores, dataset="gil-numpy",
                               role="remedy"))
        if self._has("asyncfeed"):
            cfgs.append(Config("c", "asyncfeed", None, dataset="gil-numpy", role="remedy"))
        return cfgs

    def _plan_e(self) -> list[Config]:
        """Workload e: remote storage, per kind of remote."""
        s = self.s
        cfgs = []
        remote_w = tuple(sorted({s.cores, 2 * s.cores, 4 * s.cores, 8})) if not s.quick \
            else (s.cores,)
        zero_w = tuple(sorted({s.cores, 8})) if not s.quick else (s.cores,)
        names = {"http": ("remote", "remote0"), "s3": ("s3", "s30"),
                 "mount": ("mount", "mount0")}
        sets = [(ds, workers) for kind in s.remotes
                for ds, workers in zip(names[kind], (remote_w, zero_w))]
        for ds, workers in sets:
            if self._has("dataloader"):
                cfgs += [Config("e", "dataloader", k, dataset=ds,
                                role="reference" if k == s.cores else "sweep")
                         for k in workers]
            if self._has("asyncfeed"):
                cfgs.append(Config("e", "asyncfeed", None, dataset=ds, role="default"))
        return cfgs

    def _plan_d(self) -> list[Config]:
        """Workload d: time to the first batch."""
        s = self.s
        cfgs = []
        k = s.ttfb_workers
        for ds in (("folder", "ram") if not s.quick else ("folder",)):
            if self._has("dataloader"):
                cfgs += [Config("d", "dataloader", k, mode="ttfb", context=ctx, dataset=ds,
                                role="reference") for ctx in ("fork", "spawn")]
            fams = (["asyncfeed", "asyncfeed-async", "torchdata", "spdl"] if ds == "folder"
                    else ["asyncfeed-map"])
            for f in fams:
                if self._has(f):
                    knob = None if f in contenders.ASYNCFEED_FAMILIES else s.cores
                    cfgs.append(Config("d", f, knob, mode="ttfb", dataset=ds,
                                       role="default" if knob is None else "sweep"))
        return cfgs

    def rounds(self, workload: str) -> int:
        return self.s.repeats if workload in self.s.full_rounds \
            else min(self.s.repeats, self.s.repeats_other)

    def n_runs(self) -> int:
        n = sum(len(c) * self.rounds(wl) for wl, c in self.configs.items())
        if "step" in self.configs:
            n += self.rounds("step") * (len(self._step_families()) + 1)
        return n

    def _step_families(self) -> list[str]:
        return [f for f in ("dataloader", "torchdata", "spdl", "asyncfeed", "asyncfeed-async",
                            "asyncfeed-map") if self._has(f)]

    # -- running --------------------------------------------------------------------
    def _spec(self, cfg: Config) -> dict:
        s = self.s
        samples = {"folder": s.samples, "ram": s.samples_ram, "gil": s.samples_gil,
                   "gil-numpy": s.samples_gil, "cifar": s.samples_cifar,
                   "pil": s.samples_pil, "noop": s.samples_noop,
                   "sleep": 0}.get(cfg.dataset, s.samples_remote)
        if cfg.workload == "h":
            samples = s.samples_train
        if cfg.dataset == "sleep":  # about ceiling_seconds at the ideal rate T / 5 ms
            samples = max(4 * s.batch_size, int((cfg.knob or 1) / SLEEP_S * s.ceiling_seconds))
        if cfg.mode == "step":  # paced by the step, not by the loader: half as many do
            samples = max(4 * s.batch_size, samples // 2)
        ds: dict[str, Any] = {"kind": cfg.dataset, "root": s.root, "size": s.size,
                              "samples": samples, "seed": s.seed,
                              "interpolation": s.interpolation, "listing": s.listing,
                              "io": "async" if cfg.family == "asyncfeed-async" else "thread"}
        if cfg.dataset == "train" and cfg.workload == "h":
            ds["normalize"] = True  # the consumer normalizes the uint8 batches (see augment)
        if cfg.dataset == "ram":
            ds["floats_per_sample"] = max(1, int(s.ram_mb * 2**20 / max(1, samples) / 32))
        if cfg.workload == "e":  # ImageFolder over the server's URL, or the mount
            assert self._http is not None
            root, options = self._http.source(cfg.dataset)
            options = dict(options)
            ds.update(kind="folder", listing=None, io=options.pop("io", "auto"), root=root,
                      options=options)
        small = cfg.dataset in ("cifar", "noop")
        spec: dict[str, Any] = {"dataset": ds, "family": cfg.family, "knob": cfg.knob, "mode": cfg.mode,
                "batch_size": s.batch_size_small if small else s.batch_size, "device": s.device, "seed": s.seed,
                "context": cfg.context}
        if cfg.mode == "limit":
            spec["procs"] = cfg.knob
        if cfg.mode == "step":
            spec["step_s"] = self.step_s
        return spec

    def _run_one(self, server: RunServer, cfg: Config, rnd: int) -> RunServer:
        if self.progress is not None:
            self.progress.set_postfix_str(f"({cfg.workload}) {cfg.label} #{rnd + 1}", refresh=True)
        t0 = time.time()
        pss_interval = 0.25 if cfg.workload == "b" else self.s.pss_interval
        companions = self._http.pids if (self._http and cfg.workload == "e") else None
        try:
            res = server.run(self._spec(cfg), timeout=self.s.timeout, pss_interval=pss_interval,
                             companions=companions)
        except (ServerError, TimeoutError, OSError, ValueError) as e:
            res = {"ok": False, "error": f"fork server failed: {type(e).__name__}: {e}"}
            server.close()
            server = RunServer(server.workdir)
        res["round"] = rnd
        res["started_unix"] = t0
        cfg.runs.append(res)
        if not res.get("ok"):
            self.log(f"  {cfg.workload}: {cfg.label} run {rnd + 1} failed: {res.get('error')}")
        if self.progress is not None:
            self.progress.update(1)
        return server

    def _rounds(self, server: RunServer, cfgs: list[Config], rounds: int) -> RunServer:
        for rnd in range(rounds):
            for cfg in cfgs:
                server = self._run_one(server, cfg, rnd)
        # One more round for the configurations that other load disturbed, in the same
        # interleaved order; at most half as many runs again.
        again = [c for c in cfgs if self.s.retry_disturbed
                 and any(_disturbed(r, self.s.busy_threshold) for r in c.runs)]
        again = again[: max(1, len(cfgs) * rounds // 2)]
        if again and self.progress is not None:
            self.progress.total += len(again)
            self.progress.refresh()
        for cfg in again:
            server = self._run_one(server, cfg, rounds)
        return server

    def run(self) -> None:
        self.plan()
        with tempfile.TemporaryDirectory(prefix="asyncfeed-bench-") as work:
            server = RunServer(work)
            try:
                for wl in ("a", "step", "b", "c", "d", "e", "f", "g", "h", "overhead",
                           "ceiling"):
                    if wl not in self.configs:
                        continue
                    if wl == "step":
                        self._plan_step()
                    if wl == "e":
                        from .httpserve import TailModel
                        from .remote import RemoteServers
                        tail = TailModel(**self.s.tail) if self.s.tail else None
                        self._http = RemoteServers(self.s.root, self.s.remotes, self.s.latency,
                                                   tail, mount_ms=self.s.mount_ms)
                    try:
                        server = self._rounds(server, self.configs[wl], self.rounds(wl))
                    finally:
                        if wl == "e" and self._http is not None:
                            self._http.close()
            finally:
                server.close()
        self.elapsed_s = time.time() - self.started

    def _plan_step(self) -> None:
        limit = self.limit_rate("a")
        if not limit:
            self.log("  no limit figure for (a): the training-step simulation is skipped")
            if self.progress is not None:
                self.progress.total = max(0, self.progress.total - self.rounds("step")
                                          * (len(self._step_families()) + 1))
            return
        self.step_s = self.s.batch_size / (self.s.step_load * limit)
        cfgs: list[Config] = []
        by_key: set[tuple] = set()
        for fam in self._step_families():
            rows = [c for c in self.configs["a"] if c.family == fam and c.mode == "throughput"]
            best = _best(rows)
            picks = [(best, "best")] if best is not None else []
            if fam == "dataloader":
                ref = next((c for c in rows if c.knob == self.s.cores), None)
                if ref is not None:
                    picks.append((ref, "reference"))
            if fam in contenders.ASYNCFEED_FAMILIES:
                dflt = next((c for c in rows if c.knob is None), None)
                if dflt is not None:
                    picks.append((dflt, "default"))
            for c, role in picks:
                k = (fam, c.knob)
                if k in by_key:
                    continue
                by_key.add(k)
                cfgs.append(Config("step", fam, c.knob, mode="step", dataset="folder", role=role))
        planned = self.rounds("step") * (len(self._step_families()) + 1)
        if self.progress is not None:
            self.progress.total += self.rounds("step") * len(cfgs) - planned
            self.progress.refresh()
        self.configs["step"] = cfgs

    # -- summaries ------------------------------------------------------------------
    def limit_rate(self, workload: str) -> float | None:
        limit = self._limit_config(workload)
        return summarize(limit).get("rate") if limit is not None else None

    def _limit_config(self, workload: str) -> Config | None:
        return next((c for c in self.configs.get(workload, [])
                     if c.family == "limit" and c.knob == self.s.cores), None)

    def summaries(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for wl, cfgs in self.configs.items():
            limit = self.limit_rate("a" if wl == "step" else wl)
            limit_cfg = self._limit_config(wl)
            rows = []
            for c in cfgs:
                row = summarize(c)
                if limit and row.get("rate") and c.mode in ("throughput", "limit"):
                    row["vs_limit"] = row["rate"] / limit
                    paired = paired_ratios(c, limit_cfg) if limit_cfg is not None else []
                    if paired and c is not limit_cfg:
                        # each round's run against the limit's run of that round
                        row["vs_limit_rounds"] = paired
                        row["vs_limit_round_median"] = statistics.median(paired)
                        row["vs_limit_round_worst"] = min(paired)
                rows.append(row)
            _relative(wl, rows)
            out[wl] = rows
        return out

    def twins(self, rows_a: list[dict]) -> list[dict]:
        """Workload (a)'s default rows that resolved to a setting also measured on its
        own (asyncfeed's default is ``t=4`` on 2 cores): the same configuration twice,
        so the median over both rows' runs is the better estimate, and the gap
        between the two rows shows the machine's run-to-run spread."""
        cfgs = [c for c in self.configs.get("a", []) if c.mode == "throughput"]
        ref = next((r for r in rows_a if r["family"] == "dataloader" and r["knob"] == 2), None)
        limit = self.limit_rate("a")
        out = []
        for d in cfgs:
            knob = _resolved(d) if d.knob is None else None
            twin = next((c for c in cfgs if knob is not None and c is not d
                         and (c.family, c.knob, c.dataset) == (d.family, knob, d.dataset)), None)
            if twin is None:
                continue
            both = Config(workload="a", family=d.family, knob=knob, dataset=d.dataset,
                          runs=d.runs + twin.runs)
            row = summarize(both)
            row.update(label=d.label, twin=twin.label)
            if limit and row.get("rate"):
                row["vs_limit"] = row["rate"] / limit
            if ref and ref.get("cpu_per_sample_ms") and row.get("cpu_per_sample_ms"):
                row["cpu_vs_w2"] = row["cpu_per_sample_ms"] / ref["cpu_per_sample_ms"]
            out.append(row)
        return out

    def knees(self) -> dict[str, dict[str, dict]]:
        """Per workload and family: the sweep and its knee (see :func:`.tuning.knee`)."""
        out: dict[str, dict[str, dict]] = {}
        for wl in ("a", "c", "f", "g"):
            fams: dict[str, dict] = {}
            for fam in contenders.FAMILIES:
                cfgs = [c for c in self.configs.get(wl, []) if c.family == fam
                        and c.mode == "throughput" and c.dataset != "gil-numpy"]
                pts = [(c.knob, summarize(c).get("rate")) for c in cfgs if c.knob is not None]
                dflt = next((c for c in cfgs if c.knob is None), None)
                dflt_rate = summarize(dflt).get("rate") if dflt else None
                dflt_knob = _resolved(dflt) if dflt else None
                if dflt_rate and dflt_knob is not None and dflt_knob not in [k for k, _ in pts]:
                    pts.append((dflt_knob, dflt_rate))  # the default is that curve's point
                pts = sorted((k, r) for k, r in pts if r)
                if not pts:
                    continue
                fams[fam] = {"points": pts, "knee": knee(pts), "default_rate": dflt_rate,
                             "default_knob": dflt_knob}
            if fams:
                out[wl] = fams
        return out

    def results(self) -> dict:
        summary = self.summaries()
        return {
            "settings": asdict(self.s),
            "skipped": self.skipped,
            "available": self.available,
            "step_s": self.step_s,
            "elapsed_s": self.elapsed_s,
            "summary": summary,
            "twins": self.twins(summary.get("a", [])),
            "headline": headline(summary),
            "tuning": self.knees(),
            "runs": {wl: [{"key": c.key, "label": c.label, "workload": c.workload,
                           "family": c.family, "knob": c.knob, "mode": c.mode,
                           "context": c.context, "dataset": c.dataset, "role": c.role,
                           "runs": c.runs} for c in cfgs]
                     for wl, cfgs in self.configs.items()},
        }
