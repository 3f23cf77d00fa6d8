"""The contracts you implement to extend asyncfeed, as ``typing.Protocol``\\ s.

Nothing here needs to be subclassed: a class that has the methods fits (the
protocols marked runtime-checkable also work with ``isinstance``).  The loader
reads a dataset's capabilities once, when an :class:`~asyncfeed.AsyncLoader`
is made (``asyncfeed._engine.capabilities``), so attributes added to a dataset
afterwards are not seen.

Datasets (``AsyncLoader(dataset)``), on top of ``__getitem__``/``__len__`` or
``__iter__``; each capability is optional:

- :class:`AsyncFetchDataset`: ``async fetch(index)`` runs on the loader's event
  loop (``io_concurrency`` reads in flight), ``decode(raw, index)`` in a decode
  thread.  ``use_async_fetch = False`` on the dataset turns reads on the loop off.
- :class:`ReadDecodeDataset`: ``read(index)`` then ``decode(raw, index)``, both in
  a decode thread (cheapest for files in the page cache).
- :class:`DecodeIntoDataset`: ``decode_into(raw, index, out)`` writes the sample's
  first tensor straight into ``out``, its row of a preallocated batch.
- :class:`SplitIterableDataset`: an ``IterableDataset`` whose ``iter_raw()`` yields
  cheap raw items (pulled by one thread at a time) and whose ``decode(raw,
  index)`` does the heavy work (several threads at once).  ``use_iter_raw =
  False`` turns the split off.
- :class:`NamedSamples`: ``sample_source(index)`` names a sample (path, URL) in
  error messages.
- :class:`ClosesIO`: ``async close_io()`` releases what was bound to the loader's
  event loop (HTTP sessions) when a pass ends.
- :class:`RankAware`: ``set_rank(rank, world_size)`` is called before each pass of
  an iterable dataset that shards itself.
- :class:`EpochAware`: ``set_epoch(epoch)`` is called by ``AsyncLoader.set_epoch``
  (map-style and iterable datasets alike); a map-style dataset that also has an
  ``epoch`` attribute has it sent to the loader's worker processes with their work.
- :class:`Stateful`: ``state_dict()``/``load_state_dict(state)`` on a dataset, a
  sampler or batch sampler, or the iterator an iterable dataset returns: saved in
  and restored from the loader's own state, as torchdata's StatefulDataLoader does.

``decode`` has one signature for both kinds: ``decode(raw, index)``.  For an
iterable dataset, ``index`` is the item's position in this pass's stream (the
number errors report).  A one-argument ``decode(raw)`` on an iterable dataset,
the form of asyncfeed 0.1, still works but warns (``DeprecationWarning``); it will
stop working in a later release.

Storage and decoding (``ImageFolder(root, source=..., decoder=...)``):

- :class:`Source`: lists class folders and files and reads bytes, synchronously
  and on an event loop.  ``asyncfeed.FsspecSource`` (any fsspec URL) and the
  local directory source are the built-in ones.
- :class:`Decoder`: turns one raw item (a file's bytes) into the sample's data;
  :class:`DecoderInto` also writes it into a given tensor.

Devices (``AsyncLoader(..., copy_stream=...)``):

- :class:`DeviceTransfer`: pins host batches and copies them to the device
  asynchronously, returning a :class:`CopyEvent` per batch.  The built-in one is
  ``asyncfeed.CopyStream`` (a dedicated CUDA stream).

``docs/extending.md`` shows a custom source and a custom decoder end to end.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "AsyncFetchDataset",
    "ClosesIO",
    "CopyEvent",
    "DecodeIntoDataset",
    "Decoder",
    "DecoderInto",
    "DeviceTransfer",
    "EpochAware",
    "NamedSamples",
    "RankAware",
    "ReadDecodeDataset",
    "Source",
    "SplitIterableDataset",
    "Stateful",
]


# -- datasets -------------------------------------------------------------------------
@runtime_checkable
class AsyncFetchDataset(Protocol):
    """Reads on the loader's event loop, decoding in its threads.

    ``fetch`` must not block the loop (await your I/O); it may raise, and the
    error reaches the consumer at the sample's batch.  On cancellation (the pass
    ended) ``fetch`` is cancelled like any asyncio task.  ``decode`` is called from
    several threads at once and must be thread-safe.
    """

    async def fetch(self, index: Any) -> Any:
        """The raw data of sample ``index`` (bytes, usually)."""
        ...

    def decode(self, raw: Any, index: Any) -> Any:
        """The sample ``dataset[index]`` would be, made from ``raw``."""
        ...


@runtime_checkable
class ReadDecodeDataset(Protocol):
    """Reads and decodes in the decode threads, as two steps (``read`` then ``decode``)."""

    def read(self, index: Any) -> Any:
        """The raw data of sample ``index``, read in the calling thread."""
        ...

    def decode(self, raw: Any, index: Any) -> Any:
        """The sample ``dataset[index]`` would be, made from ``raw``."""
        ...


@runtime_checkable
class DecodeIntoDataset(Protocol):
    """Writes a sample straight into its row of a preallocated batch.

    Used with ``fetch`` or ``read``, once the loader knows that samples share one
    shape (from the first samples).  ``out`` is the row for the sample's first
    tensor; return the sample with ``out`` itself in that place, or a sample
    with a fresh tensor when ``out`` does not fit (the loader copies it in).
    """

    def decode_into(self, raw: Any, index: Any, out: Any) -> Any:
        ...


@runtime_checkable
class SplitIterableDataset(Protocol):
    """An iterable dataset that yields raw items cheaply and decodes them apart.

    ``iter(dataset)`` must yield what ``decode(raw, i)`` gives for the ``i``-th
    item ``raw`` of ``iter_raw()``.  ``iter_raw()`` is pulled by one thread at a
    time; ``decode`` runs in several threads at once.
    """

    def iter_raw(self) -> Iterable[Any]:
        ...

    def decode(self, raw: Any, index: int) -> Any:
        ...


@runtime_checkable
class NamedSamples(Protocol):
    """Names samples in errors (``SampleError.source``, ``SkippedSample.source``)."""

    def sample_source(self, index: Any) -> str | None:
        ...


@runtime_checkable
class ClosesIO(Protocol):
    """Releases what reads bound to the loader's event loop, when a pass ends.

    Awaited on that loop before it closes, with a 5 s limit; errors are ignored.
    """

    async def close_io(self) -> None:
        ...


@runtime_checkable
class RankAware(Protocol):
    """An iterable dataset that reads its own share of the data (``AsyncLoader``
    passes its ``rank``/``world_size`` before each pass)."""

    def set_rank(self, rank: int, world_size: int) -> None:
        ...


@runtime_checkable
class EpochAware(Protocol):
    """A dataset whose samples depend on the epoch (random augmentation drawn per
    epoch, a shard order).

    ``AsyncLoader.set_epoch(e)`` calls ``set_epoch(e)`` at once; call it between
    passes.  Worker processes hold a copy of a map-style dataset: each task they
    get carries the loader's dataset's ``epoch``, and a worker whose copy reads
    another one calls ``set_epoch`` on it first, so every execution draws the same
    samples.  A dataset with ``set_epoch`` but no ``epoch`` attribute is told in
    the loader's process only.
    """

    epoch: int

    def set_epoch(self, epoch: int) -> None:
        ...


@runtime_checkable
class Stateful(Protocol):
    """A dataset, sampler, batch sampler or iterable dataset's iterator with a state of
    its own, which ``AsyncLoader.state_dict()`` saves and ``load_state_dict()``
    restores.

    A map-style dataset's state is saved as it is when the loader's state is taken
    (samples being prefetched may have been loaded already).  A sampler's is taken
    after each batch it draws, and a mid-epoch resume loads the one of the last
    batch handed out: the sampler then resumes itself (it is not fast-forwarded).
    An iterable dataset's (or its iterator's) is taken as the stream is pulled; a
    resume loads the one at or before the last item handed out and pulls the rest.
    """

    def state_dict(self) -> Any:
        ...

    def load_state_dict(self, state: Any) -> None:
        ...


# -- storage and decoding ---------------------------------------------------------------
@runtime_checkable
class Source(Protocol):
    """Where ``ImageFolder`` finds and reads its files.

    Paths are whatever ``list_files`` returns (full paths or URLs); they name
    samples in errors.  ``read_sync`` runs in decode threads (and in DataLoader's
    workers: keep the source picklable); ``read`` runs on the loader's event
    loop when ``is_local`` is false (or ``ImageFolder(io="async")``).  Raise
    ``FileNotFoundError``/``PermissionError``/``OSError`` for failed reads.
    """

    is_local: bool

    def list_dirs(self) -> list[str]:
        """The class folder names under the root, sorted."""
        ...

    def list_files(self, subdir: str) -> list[str]:
        """Every file under ``subdir`` (recursively), in sorted walk order."""
        ...

    def read_sync(self, path: str) -> bytes:
        ...

    async def read(self, path: str) -> bytes:
        ...

    async def close_io(self) -> None:
        """Release what ``read`` bound to the current event loop (may do nothing)."""
        ...


@runtime_checkable
class Decoder(Protocol):
    """Turns one raw item into sample data: for ``ImageFolder``, a file's bytes into
    an image (a tensor or NumPy array); for ``WebDatasetShards``, a sample dict
    into a sample.  Called from several threads at once: keep it thread-safe."""

    def __call__(self, raw: Any) -> Any:
        ...


@runtime_checkable
class DecoderInto(Decoder, Protocol):
    """A :class:`Decoder` that can also write into a given tensor (a batch row).

    ``decode_into`` returns False, having written nothing, when ``out`` does not
    fit the decoded data; the caller then uses ``decoder(raw)``.
    """

    def decode_into(self, raw: Any, out: Any) -> bool:
        ...


# -- devices ----------------------------------------------------------------------------
@runtime_checkable
class CopyEvent(Protocol):
    """Completes when a batch's copy has finished (``torch.cuda.Event`` fits)."""

    def query(self) -> bool:
        ...

    def synchronize(self) -> None:
        ...


@runtime_checkable
class DeviceTransfer(Protocol):
    """Moves host batches to the device, asynchronously.

    ``to_device`` may be called from several threads at once, and returns at
    once: the host memory must stay untouched until the returned event has
    completed (the loader waits on it before refilling a batch slot).
    ``hand_over`` runs in the consumer's thread before the batch is handed out and
    makes the consumer wait for the copy (on the device, ideally).
    """

    def pin(self, host_batch: Any) -> Any:
        """``host_batch`` in memory the copy can read asynchronously (pinned)."""
        ...

    def to_device(self, host_batch: Any) -> tuple[Any, CopyEvent]:
        ...

    def hand_over(self, device_batch: Any, event: CopyEvent) -> None:
        ...
