"""The bottleneck verdict heeds what the pass measured: threads that scaled with their
count were not held back by the GIL.

Rows that block in ``__getitem__`` (storage, the network, a lock) spend their time
off a core, as threads waiting for the GIL do, and the GIL share alone reads them
as GIL.  Where ``execution="auto"`` measured the chosen threads running the rows as
many times as fast as fewer threads as they are times as many, the verdict is
``"decode"`` and the advice names the threads as the knob.
"""

from __future__ import annotations

import re

import pytest

from asyncfeed._engine.accounting import (ASSEMBLE, DECODE, FETCH, H2D, STAGES, Resource,
                                          Snapshot, StageStats, analyse)
from asyncfeed._engine.advice import explain, with_outcome
from asyncfeed._engine.execution_report import ExecutionReport, Measured, ThreadScaling
from asyncfeed._engine.policy import INLINE, Mode, Reason, processes, threads
from asyncfeed._engine.progress import window_figures
from asyncfeed._engine.stats import LoaderStats, observe

THREADS = (Resource("threads", (FETCH, DECODE, ASSEMBLE), 4), Resource("copy", (H2D,), 1))


def report(mode: Mode, count: int, rates: dict, margin: float = 0.05) -> ExecutionReport:
    return ExecutionReport(mode, count, Reason.FASTER,
                           tuple(Measured(c, 2, r) for c, r in rates.items()), margin)


WAITING = {INLINE: 290.0, threads(1): 292.0, threads(2): 573.0, threads(4): 1180.0}


@pytest.mark.parametrize("r,scaled", [
    # 4 threads ran 2.06 times as fast as 2: scaled (the two readings)
    (report(Mode.THREADS, 4, WAITING), ThreadScaling(2, 573.0, 4, 1180.0)),
    # 1.92 times: within the 5% margin of twice
    (report(Mode.THREADS, 4, {threads(2): 600.0, threads(4): 1150.0}),
     ThreadScaling(2, 600.0, 4, 1150.0)),
    # 1.8 times: short of twice by more than the margin (the GIL, or the cores)
    (report(Mode.THREADS, 4, {threads(2): 600.0, threads(4): 1080.0}), None),
    # ... unless the margin measured is wider
    (report(Mode.THREADS, 4, {threads(2): 600.0, threads(4): 1080.0}, margin=0.12),
     ThreadScaling(2, 600.0, 4, 1080.0)),
    # two threads against one, the start's duel: 1.46 times is not scaling
    (report(Mode.THREADS, 2, {threads(1): 173.0, threads(2): 253.0}), None),
    # the choice is not the most threads measured: more were measured no faster
    (report(Mode.THREADS, 2, {threads(1): 300.0, threads(2): 600.0, threads(4): 610.0}),
     None),
    # no fewer threads measured, or the choice not measured (pinned by the arguments)
    (report(Mode.THREADS, 2, {threads(2): 600.0}), None),
    (report(Mode.THREADS, 2, {}), None),
    # not threads
    (report(Mode.PROCESSES, 2, {threads(1): 100.0, threads(2): 200.0,
                                processes(2): 400.0}), None),
    (report(Mode.INLINE, 0, {INLINE: 300.0, threads(1): 100.0, threads(2): 200.0}), None),
])
def test_threads_scaled_reads_the_chosen_threads_against_the_next_fewer(r, scaled):
    assert r.threads_scaled() == scaled


def snap(**stages: tuple[int, float, float | None]) -> dict[str, StageStats]:
    out = {name: StageStats() for name in STAGES}
    out.update({k: StageStats(*v) for k, v in stages.items()})
    return out


def sleeping_rows() -> Snapshot:
    """Four threads busy for 10 s, 0.5 s of CPU: off a core 95% of their time, not in
    a run queue; the process used 0.3 cores: the share reads it as GIL."""
    return Snapshot(elapsed_s=10.0, stages=snap(decode=(100, 40.0, 0.5)), process_cpu_s=3.0,
                    cpu_threads_run_delay_s=0.0, wait_s=9.5, batches=100, samples=3200,
                    resources=THREADS, gil_held=0, gil_probes=100)


def test_threads_that_scaled_make_a_gil_reading_decode_and_name_the_threads():
    s = sleeping_rows()
    a = analyse(s, cores=2)
    assert a.bottleneck == "gil" and a.gil_share >= 0.15  # what the share alone reads
    r = report(Mode.THREADS, 4, WAITING)
    b = with_outcome(a, r)
    assert b.bottleneck == "decode" and b.gil_share == a.gil_share
    text = explain(s, b, execution=r)
    assert "raise num_threads" in text and "4 threads ran the rows 2.1 times as fast as 2" \
        in text, text
    assert "GIL" not in text and len(re.findall(r"[.!?](?:\s|$)", text)) <= 3, text


class Fixed:
    """An accounting that reads one fixed snapshot."""

    def __init__(self, s: Snapshot) -> None:
        self.s = s

    def snapshot(self) -> Snapshot:
        return self.s


def test_stats_heed_the_measured_scaling_in_the_verdict_and_the_advice():
    """``observe`` (what ``stats()`` reads) and ``LoaderStats.explain`` carry the
    execution report's scaling into the verdict and the advice."""
    s = sleeping_rows()
    scaled_report = report(Mode.THREADS, 4, WAITING)
    fields = observe(Fixed(s), 2, None, scaled_report)  # type: ignore[arg-type]
    assert fields["bottleneck"] == "decode"
    st = LoaderStats(execution=scaled_report, **fields)
    assert "4 threads ran the rows 2.1 times as fast as 2" in st.explain(), st.explain()
    unscaled = report(Mode.THREADS, 4, {threads(2): 600.0, threads(4): 700.0})
    fields = observe(Fixed(s), 2, None, unscaled)  # type: ignore[arg-type]
    assert fields["bottleneck"] == "gil"
    assert "GIL is the bottleneck" in LoaderStats(execution=unscaled, **fields).explain()


def test_without_scaling_measured_the_verdict_stays():
    s = sleeping_rows()
    a = analyse(s, cores=2)
    assert with_outcome(a, None) is a
    assert with_outcome(a, report(Mode.THREADS, 4, {threads(2): 600.0, threads(4): 700.0})) is a
    # "decode" and the others are left as they are
    busy = Snapshot(elapsed_s=10.0, stages=snap(decode=(100, 36.0, 19.0)), process_cpu_s=19.0,
                    cpu_threads_run_delay_s=17.0, wait_s=5.0, batches=100, samples=3200,
                    resources=THREADS, gil_held=0, gil_probes=1000)
    d = analyse(busy, cores=2)
    assert d.bottleneck == "decode"
    r = report(Mode.THREADS, 4, WAITING)
    assert with_outcome(d, r) is d
    # cores busy: the knob is a cheaper sample, whatever the threads measured
    assert "raise num_threads" not in explain(busy, d, execution=r)


def test_the_progress_bars_last_word_heeds_the_scaling_as_stats_do():
    """The bar's last word is ``stats().bottleneck``: read with the same report."""
    s = sleeping_rows()
    assert window_figures(s, 2)["bottleneck"] == "gil"
    assert window_figures(s, 2, report(Mode.THREADS, 4, WAITING))["bottleneck"] == "decode"
    assert window_figures(s, 2, report(Mode.THREADS, 2, {threads(2): 600.0}))["bottleneck"] \
        == "gil"


def test_the_log_line_and_the_bar_heed_the_measured_outcome(caplog):
    """The live view's log line reads the loader's report for each window, as
    ``stats()`` does: threads that scaled make the sleeping rows' "gil" reading
    "decode" there too (a log line that said gil beside stats() saying decode
    contradicted it)."""
    from asyncfeed._engine.accounting import Accounting
    from asyncfeed._engine.progress import LiveView
    r = report(Mode.THREADS, 4, WAITING)
    view = LiveView(Accounting(THREADS), 2, progress=False, log_every=0.0, total=None,
                    epoch=0, execution=lambda: r)
    with caplog.at_level("INFO", logger="asyncfeed"):
        view._log(sleeping_rows())
    view.close()
    (rec,) = [x for x in caplog.records if x.name == "asyncfeed"]
    assert rec.asyncfeed["bottleneck"] == "decode", rec.getMessage()
    assert "bottleneck=decode" in rec.getMessage()
    assert analyse(sleeping_rows(), cores=2).bottleneck == "gil"  # without the report
