"""The loaders the benchmark compares, each built from a small description.

A contender is ``(family, knob)``: the family names the loader and how it is
configured, the knob is its degree of parallelism (``num_workers`` for
DataLoader, threads for the others; ``None`` means the loader's own default).
:func:`open_loader` builds one over a data set and the shared sample order and
returns a :class:`Handle`: iterate it for batches, then ``close()`` it.

Every family gets the same data set object, the same sample order (as its
sampler or source), the same batch size and ``default_collate`` (or the
loader's own equivalent), and is asked for results in order where it offers
the choice; SPDL keeps its default, completion order.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

FAMILIES: dict[str, str] = {
    "dataloader": "torch DataLoader (worker processes)",
    "torchdata": "torchdata.nodes, thread ParallelMapper",
    "spdl": "SPDL PipelineBuilder (thread pool)",
    "asyncfeed": "AsyncLoader, ImageFolder thread reads (the default)",
    "asyncfeed-async": "AsyncLoader, ImageFolder async reads (io='async')",
    "asyncfeed-map": "AsyncLoader, map-style path (__getitem__ only)",
}

#: the module each family needs, for "skipped (not installed)"
REQUIRES: dict[str, str] = {
    "dataloader": "torch.utils.data",
    "torchdata": "torchdata.nodes",
    "spdl": "spdl.pipeline",
    "asyncfeed": "asyncfeed._engine.loader",
    "asyncfeed-async": "asyncfeed._engine.loader",
    "asyncfeed-map": "asyncfeed._engine.loader",
}

ASYNCFEED_FAMILIES = ("asyncfeed", "asyncfeed-async", "asyncfeed-map")


def label(family: str, knob: int | None, context: str | None = None) -> str:
    """A short human name: ``DataLoader w=2``, ``asyncfeed t=default``."""
    short = {"dataloader": "DataLoader", "torchdata": "torchdata.nodes", "spdl": "SPDL",
             "asyncfeed": "asyncfeed", "asyncfeed-async": "asyncfeed async-io",
             "asyncfeed-map": "asyncfeed map-style"}[family]
    if family == "dataloader":
        name = f"{short} w={knob}"
        return f"{name} {context}" if context and knob else name
    return f"{short} t={'default' if knob is None else knob}"


def availability(family: str) -> str | None:
    """``None`` when the family can run here, else why not (for the report)."""
    mod = REQUIRES[family]
    try:
        m = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - any import failure means "cannot run"
        if family in ASYNCFEED_FAMILIES:
            return f"asyncfeed loader not available: {type(e).__name__}: {e}"
        return f"skipped (not installed): {mod}: {type(e).__name__}: {e}"
    if family in ASYNCFEED_FAMILIES and not hasattr(m, "AsyncLoader"):
        return "asyncfeed loader not available: asyncfeed._engine.loader has no AsyncLoader"
    return None


@dataclass
class Handle:
    """A built loader: iterate for batches (one epoch), then ``close()``."""

    iterable: Iterable[Any]
    closer: Callable[[], None] | None = None
    stats: Callable[[], Any] | None = None
    info: dict | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)

    def close(self) -> None:
        if self.closer is not None:
            closer, self.closer = self.closer, None
            closer()


def open_loader(family: str, knob: int | None, dataset: Any, order: list[int],
                batch_size: int, *, device: str = "cpu", context: str | None = None,
                seed: int = 0) -> Handle:
    """Build contender ``family`` with parallelism ``knob`` over ``dataset`` in ``order``."""
    pin = device.startswith("cuda")
    if family == "dataloader":
        return _dataloader(dataset, order, batch_size, knob or 0, context, pin)
    if family == "torchdata":
        return _torchdata(dataset, order, batch_size, knob or 1, pin)
    if family == "spdl":
        return _spdl(dataset, order, batch_size, knob or 1, pin)
    if family in ASYNCFEED_FAMILIES:
        return _asyncfeed(family, dataset, order, batch_size, knob, device, seed)
    raise ValueError(f"unknown contender family {family!r}")


def _dataloader(ds: Any, order: list[int], bs: int, workers: int, context: str | None,
                pin: bool) -> Handle:
    from torch.utils.data import DataLoader
    loader = DataLoader(ds, batch_size=bs, sampler=order, num_workers=workers,
                        multiprocessing_context=(context if workers else None),
                        pin_memory=pin, drop_last=False, persistent_workers=False)
    state: dict[str, Any] = {}

    def gen() -> Iterator[Any]:
        it = iter(loader)
        state["it"] = it
        yield from it

    def close() -> None:
        it = state.pop("it", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()  # joins (reaps) the workers, so their CPU time is counted
    return Handle(gen(), close, info={"num_workers": workers, "context": context or "fork",
                                     "prefetch_factor": 2 if workers else None})


def _torchdata(ds: Any, order: list[int], bs: int, threads: int, pin: bool) -> Handle:
    from torch.utils.data import default_collate
    from torchdata.nodes import (Batcher, IterableWrapper, Loader, Mapper, ParallelMapper,
                                 PinMemory, Prefetcher)
    node: Any = IterableWrapper(order)
    node = ParallelMapper(node, map_fn=ds.__getitem__, num_workers=threads, method="thread",
                          in_order=True)
    node = Batcher(node, batch_size=bs, drop_last=False)
    node = Mapper(node, default_collate)
    if pin:
        node = PinMemory(node)
    node = Prefetcher(node, prefetch_factor=2)
    loader = Loader(node)

    def close() -> None:
        # torchdata.nodes has no close(): its threads stop at the end of the epoch or when
        # garbage-collected.  Stop them now, the way its own reset() does (``_shutdown``
        # on every iterator object in the graph).
        _shutdown_graph(node)
    return Handle(loader, close, info={"threads": threads, "prefetch_factor": 2})


def _shutdown_graph(obj: Any, seen: set | None = None, depth: int = 0) -> None:
    seen = set() if seen is None else seen
    if obj is None or id(obj) in seen or depth > 20:
        return
    seen.add(id(obj))
    for attr in ("_it", "source", "root"):
        _shutdown_graph(getattr(obj, attr, None), seen, depth + 1)
    fn = getattr(obj, "_shutdown", None)
    if callable(fn):
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort; threads are daemons there anyway
            pass


def _spdl(ds: Any, order: list[int], bs: int, threads: int, pin: bool) -> Handle:
    from spdl.pipeline import PipelineBuilder
    from torch.utils.data import default_collate

    def collate(items: list[Any]) -> Any:
        batch = default_collate(items)
        return [t.pin_memory() for t in batch] if pin else batch

    pipeline: Any = (PipelineBuilder()
                .add_source(order)  # type: ignore[arg-type]  # spdl's generic stub: Never
                .pipe(ds.__getitem__, concurrency=threads)
                .aggregate(bs)
                .pipe(collate)
                .add_sink(3)
                .build(num_threads=threads))
    started = {"on": False}

    def gen() -> Iterator[Any]:
        pipeline.start()
        started["on"] = True
        yield from pipeline.get_iterator(timeout=300)

    def close() -> None:
        if started["on"]:
            pipeline.stop(timeout=60)
    return Handle(gen(), close, info={"threads": threads, "output_order": "completion",
                                     "sink_buffer": 3})


class MapOnly:
    """Only ``__getitem__`` and ``__len__`` of a data set: ``AsyncLoader``'s map-style path."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)


def _asyncfeed(family: str, ds: Any, order: list[int], bs: int, threads: int | None,
               device: str, seed: int) -> Handle:
    from asyncfeed._engine.loader import AsyncLoader

    if family == "asyncfeed-map":
        ds = MapOnly(ds)
    kwargs: dict[str, Any] = {"batch_size": bs, "sampler": order, "seed": seed}
    if threads is not None:
        kwargs["num_threads"] = threads
    if device != "cpu":
        kwargs["device"] = device
    loader: AsyncLoader[Any] = AsyncLoader(ds, **kwargs)
    info = {"threads": threads, "path": {"asyncfeed": "thread reads",
                                         "asyncfeed-async": "async reads",
                                         "asyncfeed-map": "map-style"}[family]}
    return Handle(loader, loader.close, stats=getattr(loader, "stats", None), info=info)
