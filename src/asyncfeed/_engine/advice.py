"""What a verdict means for the user: two or three sentences naming the knob to turn.

``explain(snapshot, analysis, knobs)`` is what ``LoaderStats.explain()`` returns;
the sections it points to are in ``docs/observability.md``.  The advice names the
data set's own arguments where it knows them (:class:`DatasetKnobs`): a user of
``ImageFolder`` is told which of its arguments is left to turn, never to do what
it already does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .accounting import Analysis, Snapshot
from .execution_report import ExecutionReport, ThreadScaling
from .policy import Mode

__all__ = ["DatasetKnobs", "dataset_knobs", "explain", "with_outcome"]

DOCS = "docs/observability.md"


@dataclass(frozen=True)
class DatasetKnobs:
    """The settings of an ``ImageFolder`` that decide its cost per sample (plain values,
    so that a stats snapshot never holds the data set itself).

    ``own_decoder``: a ``decoder=`` of the user's replaces the built-in one, whose
    DCT-scaled decode, resize and ``uint8`` output the advice then cannot assume.
    """

    size: int | None
    interpolation: str
    io: str
    own_decoder: bool


def dataset_knobs(dataset: Any) -> DatasetKnobs | None:
    """The knobs of ``dataset`` if it is an ``ImageFolder`` (recognised by its class name
    and attributes: the engine does not import the data sets), else None."""
    if type(dataset).__name__ != "ImageFolder":
        return None
    interpolation = getattr(dataset, "interpolation", None)
    io = getattr(dataset, "io", None)
    if not isinstance(interpolation, str) or not isinstance(io, str):
        return None
    size = getattr(dataset, "size", None)
    builtin = type(getattr(dataset, "decoder", None)).__name__ == "ImageDecoder"
    return DatasetKnobs(size=size if isinstance(size, int) else None,
                        interpolation=interpolation, io=io, own_decoder=not builtin)


def _cheaper(knobs: DatasetKnobs | None) -> str:
    """How to make each sample cheaper, for the data set at hand."""
    if knobs is None:
        return ("make each sample cheaper (DCT-scaled decode, a linear resize, uint8 "
                "output)")
    if knobs.own_decoder:
        return ("make your ImageFolder decoder cheaper (DCT-scaled decode, a linear "
                "resize, uint8 output, as the built-in one does)")
    if knobs.size is None:
        return ("ImageFolder(size=None) decodes every image at full size: a size= lets it "
                "decode DCT-scaled (fewer pixels) and resize")
    if knobs.interpolation == "area":
        return ("ImageFolder already decodes DCT-scaled to uint8; the knob left is "
                "ImageFolder(..., interpolation=\"linear\"), a cheaper resize (not "
                "antialiased)")
    return (f"ImageFolder already decodes DCT-scaled with a linear resize to uint8; what "
            f"is left is fewer pixels (a smaller size than {knobs.size}) or more cores")


def _capacity(s: Snapshot, name: str) -> float:
    for r in s.resources:
        if r.name == name:
            return r.capacity
    return 0.0


def _per_item_ms(s: Snapshot, stage: str) -> float:
    st = s.stages.get(stage)
    return 1000.0 * st.wall_s / st.count if st is not None and st.count else 0.0


def with_outcome(a: Analysis, execution: ExecutionReport | None) -> Analysis:
    """``a`` with what the pass measured (``execution``: the loader's report, None
    where nothing was measured): where the chosen threads ran the rows as many times
    as fast as fewer threads as they are times as many
    (:meth:`ExecutionReport.threads_scaled`), the GIL did not hold them back, whatever
    their time off a core read (rows blocked in ``__getitem__`` on storage or the
    network read as time off a core, as a wait for the GIL does): a ``"gil"`` verdict
    becomes ``"decode"``.  Any other verdict is returned as it is."""
    if a.bottleneck == "gil" and execution is not None \
            and execution.threads_scaled() is not None:
        return replace(a, bottleneck="decode")
    return a


def explain(s: Snapshot, a: Analysis, knobs: DatasetKnobs | None = None, *,
            execution: ExecutionReport | None = None) -> str:
    """Plain sentences on ``a.bottleneck`` with the figures behind it; ``knobs``: the
    data set's own settings, when it is an ``ImageFolder``; ``execution``: the
    loader's report, which says whether the consumer's thread loads the rows (inline:
    no decode thread runs) and whether the threads measured scaling
    (:func:`with_outcome`), named where more threads is the knob."""
    inline = execution is not None and execution.mode is Mode.INLINE
    scaled = execution.threads_scaled() if execution is not None else None
    waited = f"the training loop waited for data {a.wait_share:.0%} of the time"
    load = a.loads.get(a.limiting or "", 0.0)
    used = f"{a.cores_used:.1f} of {a.cores} cores"
    v = a.bottleneck
    if v == "consumer":
        return (f"The loader is ahead of the training step: {waited}, so the step "
                "itself (model, optimizer, logging) is what limits the rate. Loader "
                "settings will not make this faster; fewer num_threads or a smaller "
                "prefetch would save CPU and memory (docs/tuning.md, "
                f"{DOCS}#consumer).")
    if v == "fetch":
        return _explain_fetch(s, a, knobs, waited)
    if v == "decode":
        return _explain_decode(s, a, knobs, waited, inline, scaled)
    if v == "gil":
        held = "" if a.gil_pressure is None else \
            f"a probe found the GIL held {a.gil_pressure:.0%} of the time, "
        return (f"The GIL is the bottleneck: Python held it most of the time ({held}"
                f"decode threads lost {a.gil_share:.0%} of their busy time waiting for it), "
                f"and the process used {used}, so more threads will "
                "not help. Move the heavy loops of the per-sample function into numpy, "
                "torch or OpenCV calls (they "
                "release the GIL), or run it in worker processes (execution=\"processes\"; "
                "the default \"auto\" measures them against threads and keeps the faster) "
                f"(docs/tuning.md, {DOCS}#gil).")
    if v == "h2d":
        return (f"The host-to-device copy is the bottleneck: {waited}, and the copy "
                f"stream was busy {load:.0%} of the time, {_per_item_ms(s, 'h2d'):.2f} ms "
                "per batch. Keep pin_memory on (the default on CUDA), send uint8 and "
                f"normalise on the GPU (docs/gpu.md, {DOCS}#h2d).")
    return "No batch has been delivered yet: there is nothing to explain."


def _explain_fetch(s: Snapshot, a: Analysis, knobs: DatasetKnobs | None, waited: str) -> str:
    """:func:`explain` where reads are the bottleneck (on the event loop, in the
    iterable's iterator, or blocking in the decode threads)."""
    load = a.loads.get(a.limiting or "", 0.0)
    threads = _capacity(s, "threads")
    ms = _per_item_ms(s, "fetch")
    if a.limiting == "io":
        cap = _capacity(s, "io")
        return (f"Reads are the bottleneck: {waited}, with {load * cap:.1f} of "
                f"io_concurrency={cap:g} reads in flight on average, {ms:.1f} ms each. "
                "Raise io_concurrency to keep more reads in flight, or bring the data "
                f"closer (a local cache: docs/remote.md; {DOCS}#fetch).")
    if a.limiting == "iterator":
        return (f"Pulling raw items from the iterable (one thread at a time) is the "
                f"bottleneck: {waited}, and the iterator was busy {load:.0%} of the time, "
                f"{ms:.2f} ms per item. Make iter_raw() cheaper, or read several shards "
                f"at once ({DOCS}#fetch).")
    remedy = ("Pass ImageFolder(..., io=\"async\") so that reads wait on the event "
              "loop" if knobs is not None else
              "Give the data set an async fetch (docs/extending.md) so that reads wait "
              "on the event loop")
    return (f"Blocking reads in the decode threads are the bottleneck: {waited}, "
            f"and the {threads:g} threads were busy {load:.0%} of the time, {ms:.1f} ms "
            f"per read. {remedy}, or raise num_threads (docs/tuning.md, {DOCS}#fetch).")


def _explain_decode(s: Snapshot, a: Analysis, knobs: DatasetKnobs | None, waited: str,
                    inline: bool, scaled: ThreadScaling | None = None) -> str:
    """:func:`explain` where the per-sample work is the bottleneck (the iterable's
    ``__next__``, worker processes, decode threads or the consumer's own thread)."""
    load = a.loads.get(a.limiting or "", 0.0)
    threads = _capacity(s, "threads")
    used = f"{a.cores_used:.1f} of {a.cores} cores"
    if a.limiting == "iterator":
        return (f"The iterable's __next__ is the bottleneck: {waited}, and it runs one "
                f"thread at a time ({_per_item_ms(s, 'decode'):.2f} ms per item). Split "
                "it into iter_raw() and decode(raw) so decoding runs on every decode "
                f"thread ({DOCS}#decode).")
    if a.limiting == "processes":
        n = _capacity(s, "processes")
        return (f"Decoding is the bottleneck: {waited}, and the {n:g} worker processes "
                "the loader moved the per-sample work to were all busy. Give "
                "it more of them (num_workers, default: the cores) if cores are left, "
                "or make each sample cheaper; moving its Python loops into numpy or "
                f"torch calls would let threads do it (docs/tuning.md, {DOCS}#decode).")
    spare = a.cores_used < a.cores - 0.5
    busy = sum(st.wall_s for st in s.stages.values() if st.cpu_s is not None)
    queued = (s.cpu_threads_run_delay_s or 0.0) / busy if busy > 0 else 0.0
    if spare and queued > 0.3:
        knob = (f"the threads waited for a core {min(queued, 1.0):.0%} of their busy "
                "time although this process left cores unused: other processes are "
                "using them (check the machine's load)")
    elif spare and scaled is not None:
        knob = (f"cores are left, and {scaled.more} threads ran the rows "
                f"{scaled.more_rate / scaled.fewer_rate:.1f} times as fast as "
                f"{scaled.fewer} (measured): the rows wait (on storage, the network, a "
                "lock) and more threads overlap more waits: raise num_threads (and "
                "prefetch, the rows in flight), or give the data set an async fetch")
    elif spare:
        knob = "cores are left: raise num_threads"
    else:
        knob = f"the cores are busy: {_cheaper(knobs)}"
    if inline:
        if spare and not queued > 0.3:
            knob = ("cores are left, but where execution=\"auto\" chose inline it "
                    "measured decode threads and worker processes no faster: make "
                    "each sample cheaper")
        return (f"Decoding is the bottleneck: {waited}, and the training loop's own "
                f"thread loads the rows (inline, as num_workers=0) using {used}. "
                f"Here {knob} (docs/tuning.md, {DOCS}#decode).")
    who = (f"{_capacity(s, 'processes'):g} worker processes" if a.limiting == "processes"
           else f"{threads:g} decode threads allowed to run")
    return (f"Decoding is the bottleneck: {waited}, and the {who} "
            f"were busy {load:.0%} of the time using {used}. "
            f"Here {knob} (docs/tuning.md, {DOCS}#decode).")
