"""The PNG: tuning curves with their knees, and one panel per other figure."""

from __future__ import annotations

from typing import Any

from . import contenders

COLORS = {"dataloader": "#1f77b4", "torchdata": "#ff7f0e", "spdl": "#2ca02c",
          "asyncfeed": "#d62728", "asyncfeed-async": "#9467bd", "asyncfeed-map": "#8c564b",
          "limit": "#444444"}


def _tuning(ax: Any, results: dict, wl: str, title: str) -> None:
    fams = results.get("tuning", {}).get(wl, {})
    limit = next((r.get("rate") for r in results["summary"].get(wl, [])
                  if r["family"] == "limit" and r["knob"] == results["settings"]["cores"]), None)
    xmax = 1
    ticks: set[int] = set()
    for fam, t in fams.items():
        xs = [p[0] for p in t["points"]]
        ys = [p[1] for p in t["points"]]
        xmax = max(xmax, *xs)
        ticks.update(xs)
        name = contenders.label(fam, 0).rsplit(" ", 1)[0]
        ax.plot(xs, ys, "o-", color=COLORS.get(fam), label=name, lw=1.6, ms=4)
        k = t.get("knee")
        if k:
            ax.plot([k["knob"]], [k["rate"]], "o", ms=13, mfc="none", mec=COLORS.get(fam), mew=2)
        if t.get("default_rate"):
            dk = t.get("default_knob")
            x = dk if dk is not None else results["settings"]["cores"]
            ax.plot([x], [t["default_rate"]], "*", ms=14, color=COLORS.get(fam), mec="black",
                    mew=0.6)
    if limit:
        ax.axhline(limit, ls="--", color=COLORS["limit"], lw=1.2,
                   label=f"limit ({results['settings']['cores']} procs, no loader)")
    ax.set_xlabel("workers (DataLoader) / threads (others)")
    ax.set_ylabel("samples/s")
    ax.set_title(title + "\n(open circle: knee, star: default settings)", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.set_xlim(-0.3, xmax + 0.3)
    ax.set_xticks(sorted(ticks))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def _bars(ax: Any, rows: list[dict], key: str, title: str, xlabel: str, *, scale: float = 1.0,
          log: bool = False, ref: float | None = None, ref_label: str = "",
          name: Any = None) -> None:
    rows = [r for r in rows if r.get(key) is not None]
    if not rows:
        ax.set_visible(False)
        return
    labels = [(name(r) if name else r["label"]) for r in rows]
    vals = [r[key] * scale for r in rows]
    colors = [COLORS.get(r["family"], "#777777") for r in rows]
    y = list(range(len(rows)))[::-1]
    ax.barh(y, vals, color=colors)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    for yi, v in zip(y, vals):
        ax.text(v, yi, f" {v:,.3g}", va="center", fontsize=6)
    ax.margins(x=0.12)
    if log:
        ax.set_xscale("log")
    if ref is not None:
        ax.axvline(ref * scale, ls="--", color="#444444", lw=1, label=ref_label)
        ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.grid(axis="x", alpha=0.3)


def write_png(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = results["summary"]
    fig, axes = plt.subplots(3, 3, figsize=(18, 15.5))
    (a1, a2, a3), (b1, b2, b3), (c1, c2, c3) = axes
    if "a" in results.get("tuning", {}):
        _tuning(a1, results, "a", "(a) JPEG folder in page cache: tuning curve")
    else:
        a1.set_visible(False)
    if "c" in results.get("tuning", {}):
        _tuning(a2, results, "c", "(c) pure-Python transform (GIL): tuning curve")
    else:
        a2.set_visible(False)
    rows_a = [r for r in summ.get("a", []) if r["family"] != "limit"]
    w2 = next((r.get("cpu_per_sample_ms") for r in rows_a
               if r["family"] == "dataloader" and r["knob"] == 2), None)
    _bars(a3, rows_a, "cpu_per_sample_ms", "(a) CPU per sample, whole process tree",
          "CPU ms per sample", ref=w2, ref_label="DataLoader w=2")
    rows_b = [r for r in summ.get("b", []) if r["family"] != "limit"]
    w0 = next((r.get("peak_pss_bytes") for r in rows_b
               if r["family"] == "dataloader" and r["knob"] == 0), None)
    _bars(b1, rows_b, "peak_pss_bytes", "(b) data set in RAM: peak memory of the process tree",
          "peak PSS, MB", scale=1 / 2**20, ref=(w0 * 1.1 if w0 else None),
          ref_label="DataLoader w=0 + 10%")
    _bars(b2, summ.get("d", []), "ttfb_s", "(d) time to first batch (log scale)", "seconds",
          log=True, name=lambda r: r["label"]
          + f" [{ {'folder': 'folder', 'ram': 'in-RAM'}.get(r['dataset'], r['dataset']) }]")
    step_ms = (results.get("step_s") or 0) * 1e3
    _bars(b3, summ.get("step", []), "wait_fraction",
          f"(a) share of a {step_ms:.1f} ms training step spent waiting for data",
          "waiting, % of step time", scale=100)
    lat = results["settings"].get("latency", 0.02) * 1e3
    _bars(c1, summ.get("e", []), "rate",
          f"(e) over loopback HTTP: samples/s at {lat:.0f} ms and at 0 ms per request",
          "samples/s", name=lambda r: r["label"] + (f" [{lat:.0f} ms]" if r["dataset"] == "remote"
                                                     else " [0 ms]"))
    rows_c = [r for r in summ.get("c", [])]
    _bars(c2, rows_c, "rate", "(c) pure-Python transform: samples/s (and its numpy rewrite)",
          "samples/s")
    _bars(c3, rows_a, "peak_pss_bytes", "(a) peak memory of the process tree", "peak PSS, MB",
          scale=1 / 2**20)
    m = results["machine"]
    fig.suptitle(f"asyncfeed bench: {m.get('cores_usable')} cores, "
                 f"{m.get('cpu_model', '')}, torch {m['torch']}, batch "
                 f"{results['settings']['batch_size']}, {results['settings']['size']} px",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(path, dpi=110)
    plt.close(fig)
