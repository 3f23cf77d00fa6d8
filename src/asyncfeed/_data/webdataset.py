"""WebDataset-style ``.tar`` shards: many samples per request, shuffled with a bounded buffer.

A shard is a tar file whose members are grouped into samples by key: the member
name up to the first dot of its base name (``train/0001.jpg`` and
``train/0001.cls`` are the ``jpg`` and ``cls`` fields of sample ``train/0001``),
members of one sample stored next to each other, as ``webdataset``/``tarp``
write them.

``WebDatasetShards`` is a ``torch.utils.data.IterableDataset``.  Each pass takes
the shard list (brace patterns expanded), shuffles it with ``seed`` and the epoch
(the same order on every rank), keeps every ``world_size``-th shard from ``rank``
on (and, inside a torch DataLoader worker, every ``num_workers``-th of those), and
reads each shard front to back.  Remote shards are read in ``block_size`` range
requests, ``readahead`` of them in flight on fsspec's I/O loop while the tar
stream is parsed; every block has the per-read timeout and retries of
:class:`~asyncfeed.FsspecSource`, so a stalled or dropped
connection is retried or raised, never parsed as a short shard.  Local shards
(plain paths, ``file://``) are read with ordinary buffered I/O.

A shard cut short or corrupt still gives every sample that is complete before
the break (a sample is complete once the next sample's first member header has
been read), then raises :class:`~asyncfeed._errors.ShardError` naming the shard,
the member and the byte offset (tarfile itself would take a broken header for
the end of the archive and stop silently).  An I/O error part way through a
shard (a remote read that failed for good) is raised as it is, with a note
naming the member.

Samples go through a shuffle buffer of ``shuffle_buffer`` samples whose random
choices come from ``seed``, the epoch, the rank and the worker: the same settings
give the same sample order, run after run.

The work is split for :class:`~asyncfeed.AsyncLoader`
(:class:`asyncfeed.protocols.SplitIterableDataset`): ``iter_raw()`` (reading and
parsing the tar stream, shuffling) is the sequential part, pulled by one thread
at a time, and ``decode(sample, index)`` (the ``decode=`` callable: image
decoding) the parallel part, run in the loader's decode threads.
``iter(dataset)`` is ``map(decoder, iter_raw())``.  The loader also tells the
dataset its rank and world size with ``set_rank``.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import io
import logging
import operator
import random
import tarfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .._errors import SampleError, ShardError
from .._optional import require
from .augment import training_decoder
from .tarshards import RangeStream, ShardTarInfo, expand_braces, group_samples, tar_samples
from .image import Interpolation, MaxPixels, decode_image, pixel_limit

__all__ = ["ImageLabelDecoder", "WebDatasetShards", "expand_braces", "group_samples",
           "sample_key"]

logger = logging.getLogger("asyncfeed.webdataset")

def sample_key(sample: dict[str, Any]) -> int:
    """A 64-bit number naming a shard sample: its shard's file name and its key (so a
    sample keeps its crops wherever the shards are stored)."""
    import hashlib
    shard = str(sample.get("__url__", "")).rstrip("/").rpartition("/")[2]
    name = f"{shard}#{sample.get('__key__')}".encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little")


class ImageLabelDecoder:
    """``decode=`` for image classification shards: sample -> ``(uint8 [3, size, size], label)``.

    The image is the first of ``image_keys`` present, decoded and resized like
    ``ImageFolder`` does (``max_pixels`` as there); the label is the integer text
    of ``label_key``.  An image that fails to decode is raised as
    :class:`SampleError` whose source is ``<shard>#<member>``; a missing field as
    ``KeyError``, a bad label as ``ValueError``, both naming the shard and sample.

    ``train=True`` (with ``scale``, ``ratio``, ``hflip``, ``seed``) gives the
    training samples of ``ImageFolder(train=True)``: random-resized-crop and flip
    fused into decoding, drawn from ``(seed, epoch, sample)`` where the sample is
    named by its shard's file name and its key (the same crops wherever the shards
    are stored, in any order, thread count or resume point).
    ``WebDatasetShards.set_epoch`` passes the epoch on to this decoder.
    """

    def __init__(self, size: int | None = 224, *, image_keys: tuple[str, ...] = (
                 "jpg", "jpeg", "png", "webp", "ppm", "bmp"), label_key: str = "cls",
                 interpolation: Interpolation = "area",
                 max_pixels: MaxPixels = "pillow", train: bool = False,
                 scale: tuple[float, float] | None = None,
                 ratio: tuple[float, float] | None = None, hflip: float | None = None,
                 seed: int | None = None) -> None:
        self.size, self.image_keys, self.label_key = size, image_keys, label_key
        self.interpolation: Interpolation = interpolation
        pixel_limit(max_pixels)
        self.max_pixels: MaxPixels = max_pixels
        self.train = bool(train)
        self._epoch = 0
        self._augment = training_decoder(train, size, scale=scale, ratio=ratio, hflip=hflip,
                                         seed=seed, interpolation=interpolation,
                                         max_pixels=max_pixels)

    @property
    def epoch(self) -> int:
        """The epoch whose crops ``train=True`` draws."""
        return self._augment.epoch if self._augment is not None else self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch ``epoch``'s crops from now on (nothing changes without ``train``)."""
        if self._augment is not None:
            self._augment.set_epoch(epoch)
        else:
            self._epoch = int(epoch)

    @property
    def seed(self) -> int | None:
        """The seed of the training crops (None without ``train=True``)."""
        return self._augment.seed if self._augment is not None else None

    def _image(self, raw: bytes, sample: dict[str, Any]) -> Any:
        if self._augment is None:
            return decode_image(raw, self.size, interpolation=self.interpolation,
                                max_pixels=self.max_pixels)
        return self._augment.decode(raw, sample_key(sample))

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        raw = next((sample[k] for k in self.image_keys if k in sample), None)
        if raw is None:
            raise KeyError(f"sample {sample.get('__key__')!r} in {sample.get('__url__')} has "
                           f"none of {self.image_keys}; it has {sorted(sample)}")
        key = next(k for k in self.image_keys if k in sample)
        where = f"{sample.get('__url__')}#{sample.get('__key__')}"
        try:
            img = self._image(raw, sample)
        except Exception as e:
            raise SampleError(sample.get("__key__"), f"{where}.{key}", e) from e
        if self.label_key not in sample:
            raise KeyError(f"sample {sample.get('__key__')!r} in {sample.get('__url__')} has "
                           f"no {self.label_key!r}; it has {sorted(sample)}")
        try:
            label = int(sample[self.label_key].decode().strip())
        except ValueError as e:
            raise ValueError(f"{where}.{self.label_key} is not an integer label: {e}") from e
        return torch.from_numpy(img), label


def _check_rank(rank: Any, world_size: Any) -> tuple[int, int]:
    """(rank, world_size) as ints; ValueError unless 0 <= rank < world_size."""
    try:
        r, w = operator.index(rank), operator.index(world_size)
    except TypeError:
        raise ValueError(f"rank and world_size must be ints, got {rank!r} and "
                         f"{world_size!r}") from None
    if w < 1 or not 0 <= r < w:
        raise ValueError(f"rank {r} out of range for world_size {w}")
    return r, w


def _default_rank() -> tuple[int, int]:
    """The loader's rule: torch.distributed's rank and world size, else RANK/WORLD_SIZE."""
    from .._engine.resources import resolve_ranks
    return resolve_ranks(None, None)


class WebDatasetShards(torch.utils.data.IterableDataset):
    """Samples from WebDataset ``.tar`` shards, local or remote (any fsspec URL).

    Parameters
    ----------
    urls:
        A brace pattern (``"s3://bucket/train-{0000..0127}.tar"``) or a list of
        patterns/URLs/paths.
    shuffle_buffer:
        Samples held for shuffling (0 or 1: the order in the shards).  Memory is
        about ``shuffle_buffer`` raw samples.
    seed:
        Seeds the shard order and the buffer's choices, together with the epoch
        (``set_epoch``), the rank and the DataLoader worker.
    shuffle_shards:
        Shuffle the shard list each epoch (same order on every rank).
    decode:
        Called on each sample dict (None: yield the dicts).  ``ImageLabelDecoder(size)``
        gives ``(image tensor, label)``.  Iterating the dataset calls it in the
        iterating thread; ``AsyncLoader`` calls it in its decode threads, several at
        once (it must be thread-safe), while one thread reads the shards.
    rank, world_size:
        Which share of the shards this process reads.  Given here, they win;
        otherwise the values of the last ``set_rank`` (``AsyncLoader`` calls it with
        its own ``rank``/``world_size`` at every ``iter()``); otherwise as
        ``AsyncLoader`` decides: torch.distributed's rank and world size when
        initialised, else the ``RANK``/``WORLD_SIZE`` environment, else 0 and 1.
        Shard ``i`` of the epoch's order goes to rank ``i % world_size``.  Ranks may
        get a different number of samples when shards differ in size or do not
        divide evenly.
    storage_options, timeout, retries, backoff:
        For remote shards, as in :class:`~asyncfeed.FsspecSource`.
    block_size, readahead:
        Remote shards are fetched in range requests of ``block_size`` bytes,
        ``readahead`` of them in flight.
    on_shard_error:
        ``"raise"`` (default) or ``"skip"``: log (once per shard) and go on with the
        next shard.
    """

    def __init__(self, urls: str | Iterable[str], *, shuffle_buffer: int = 1000, seed: int = 0,
                 shuffle_shards: bool = True,
                 decode: Callable[[dict[str, Any]], Any] | None = None,
                 storage_options: dict[str, Any] | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 timeout: float | None = 30.0, retries: int = 5, backoff: float = 0.2,
                 block_size: int = 8 << 20, readahead: int = 2,
                 on_shard_error: str = "raise") -> None:
        super().__init__()
        patterns = [urls] if isinstance(urls, str) else list(urls)
        self.urls = [u for p in patterns for u in expand_braces(p)]
        if not self.urls:
            raise ValueError("no shards given")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {shuffle_buffer!r}")
        if block_size <= 0 or readahead < 1:
            raise ValueError("block_size must be positive and readahead at least 1")
        if on_shard_error not in ("raise", "skip"):
            raise ValueError(f"on_shard_error must be 'raise' or 'skip', got {on_shard_error!r}")
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither")
        if world_size is not None:
            _check_rank(rank, world_size)
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.shuffle_shards = shuffle_shards
        self.decoder = decode
        self.rank, self.world_size = rank, world_size
        self._loader_rank: tuple[int, int] | None = None  # from set_rank
        self.block_size, self.readahead = block_size, readahead
        self.on_shard_error = on_shard_error
        self.epoch = 0
        self._source_options: dict[str, Any] = dict(storage_options=storage_options or {}, timeout=timeout,
                                    retries=retries, backoff=backoff)
        self._sources: dict[str, Any] = {}
        self._pass: _PassPosition | None = None          # the pass being read
        self._resume_at: dict[str, Any] | None = None    # where the next pass starts

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_sources"] = {}
        state["_pass"] = None
        return state

    # -- resuming -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this dataset stands: ``{"epoch": e, "position": p}``, plain (JSON and
        ``torch.save``).

        Inside a pass ``p`` says which shard and which sample of it come next, which
        samples the shuffle buffer holds (shard and sample numbers, flat) and the
        shuffle's random state; between passes it is None (or the position a loaded
        state will resume at).  ``AsyncLoader`` saves it in its own state, taken as
        its batches are pulled, so a resume continues after the last batch handed out.
        """
        p = self._pass
        position: dict[str, Any] | None
        if p is not None and not p.finished:
            position = p.position()
        else:
            position = None if self._resume_at is None else copy.deepcopy(self._resume_at)
        return {"epoch": self.epoch, "position": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from ``state_dict``): the epoch now, the position at
        the next ``iter_raw()``/``iter()``.

        The resumed pass does not read the shards before the one it stopped in. It
        reads that shard from its start up to the sample it stopped at (a tar
        stream has no index), and reads again the samples that were in the shuffle
        buffer, from their shards.  The rank, world size and worker must be the
        ones the state was taken with (``ValueError`` at ``iter`` otherwise).
        """
        self.set_epoch(int(state["epoch"]))
        self._resume_at = copy.deepcopy(state.get("position"))
        self._pass = None

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass's shard order and shuffle (like DistributedSampler),
        and for the ``decode=`` callable's crops when it has a ``set_epoch`` too
        (``ImageLabelDecoder(train=True)``)."""
        self.epoch = int(epoch)
        forward = getattr(self.decoder, "set_epoch", None)
        if callable(forward):
            forward(self.epoch)

    @property
    def use_iter_raw(self) -> bool:
        """Whether ``AsyncLoader`` may pull ``iter_raw()`` and call ``decode`` itself: when
        there is a ``decode=`` callable, and not in a subclass whose ``__iter__`` is its
        own (set ``use_iter_raw = True`` there when it still yields
        ``map(decoder, iter_raw())``)."""
        return self.decoder is not None and type(self).__iter__ is WebDatasetShards.__iter__

    def decode(self, raw: dict[str, Any], index: int | None = None) -> Any:
        """One raw sample dict through the ``decode=`` callable (the dict itself without
        one); ``index``, its position in the stream, is not used."""
        return raw if self.decoder is None else self.decoder(raw)

    def set_rank(self, rank: int, world_size: int) -> None:
        """Read rank ``rank``'s share of the shards out of ``world_size`` from the next pass on.

        ``AsyncLoader`` calls this with its ``rank``/``world_size`` before each pass.
        A ``rank``/``world_size`` given to the constructor takes precedence.
        """
        self._loader_rank = _check_rank(rank, world_size)

    # -- which shards ---------------------------------------------------------------------
    def shards_for(self, rank: int = 0, world_size: int = 1, worker: int = 0,
                   num_workers: int = 1, epoch: int | None = None) -> list[str]:
        """The shards one rank's worker reads in ``epoch`` (default: the current one)."""
        order = list(self.urls)
        if self.shuffle_shards:
            random.Random(f"shards-{self.seed}-{self.epoch if epoch is None else epoch}").shuffle(order)
        return order[rank::world_size][worker::num_workers]

    def _placement(self) -> tuple[int, int, int, int]:
        if self.world_size is not None:
            rank, world = self.rank, self.world_size
        elif self._loader_rank is not None:
            rank, world = self._loader_rank
        else:
            rank, world = _default_rank()
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return rank, world, worker, workers  # type: ignore[return-value]

    # -- reading --------------------------------------------------------------------------
    def _source_for(self, url: str) -> Any:
        from .._io.fsspec import FsspecSource
        protocol = url.split("://", 1)[0].lower()
        src = self._sources.get(protocol)
        if src is None:
            src = FsspecSource(url.rsplit("/", 1)[0], **self._source_options)
            self._sources[protocol] = src
        return src

    def _open(self, url: str) -> io.IOBase:
        if "://" not in url or url.startswith("file://"):
            return open(url[len("file://"):] if url.startswith("file://") else url, "rb")
        asyn = require("fsspec.asyn", "reading remote shards")
        src = self._source_for(url)
        info = asyncio.run_coroutine_threadsafe(src.info(url), asyn.get_loop()).result()
        size = info.get("size")
        if not isinstance(size, int):  # no length known: one request for the whole shard
            return io.BytesIO(src.read_sync(url))
        return RangeStream(src, url, size, self.block_size, self.readahead)

    def iter_shard(self, url: str) -> Iterator[dict[str, Any]]:
        """The raw samples of one shard, in order.

        A shard cut short or corrupt yields every sample completed before the
        break, then raises :class:`ShardError` (shard, member, offset).
        """
        with self._open(url) as f:
            try:
                tf = tarfile.open(fileobj=f, mode="r|", bufsize=1 << 20, tarinfo=ShardTarInfo)
            except tarfile.ReadError as e:
                raise ShardError(url, None, 0, f"not a tar file: {e}") from e
            with tf:
                yield from tar_samples(tf, url)

    def iter_raw(self) -> Iterator[dict[str, Any]]:
        """The raw sample dicts of this pass, shuffled, before ``decode`` (from the
        position a loaded state names, if any)."""
        rank, world, worker, workers = self._placement()
        shards = self.shards_for(rank, world, worker, workers)
        rng = random.Random(f"samples-{self.seed}-{self.epoch}-{rank}-{worker}")
        resume, self._resume_at = self._resume_at, None
        pos = _PassPosition(rng, [rank, world, worker, workers])
        if resume is not None:
            pos.restore(resume)
        self._pass = pos
        return self._run_pass(shards, pos, resume is not None)

    def _run_pass(self, shards: list[str], pos: _PassPosition,
                  resumed: bool) -> Iterator[dict[str, Any]]:
        """The bounded shuffle (see ``_shuffled``) over ``_samples``, keeping ``pos``
        up to date at every ``yield``."""
        size, rng = self.shuffle_buffer, pos.rng
        if pos.draining is not None:          # resumed after the shards were all read
            buf = list(zip(pos.draining, self._read_refs(shards, pos.draining)))
        else:
            buf = list(zip(pos.buffer, self._read_refs(shards, pos.buffer))) \
                if resumed else []
            for ref, sample in self._samples(shards, pos):
                if size <= 1:
                    yield sample
                elif len(buf) < size:
                    buf.append((ref, sample))
                    pos.buffer.append(ref)
                else:
                    i = rng.randrange(size)
                    out, buf[i] = buf[i][1], (ref, sample)
                    pos.buffer[i] = ref
                    yield out
                    del out
            rng.shuffle(buf)
            pos.draining, pos.buffer = [ref for ref, _ in buf], []
        buf.reverse()
        while buf:
            _, sample = buf.pop()
            pos.draining.pop(0)
            yield sample
        pos.finished = True

    def _read_refs(self, shards: list[str], refs: list[list[int]]) -> list[dict[str, Any]]:
        """The samples at ``refs`` ([shard number, sample number] pairs), in that order."""
        want: dict[int, set[int]] = collections.defaultdict(set)
        for i, j in refs:
            want[i].add(j)
        found: dict[tuple[int, int], dict[str, Any]] = {}
        for i, js in want.items():
            last = max(js)
            for j, sample in enumerate(self.iter_shard(shards[i])):
                if j in js:
                    found[(i, j)] = sample
                if j >= last:
                    break
        return [found[(i, j)] for i, j in refs]

    def _samples(self, shards: list[str], pos: _PassPosition
                 ) -> Iterator[tuple[list[int], dict[str, Any]]]:
        """([shard number, sample number], sample) from ``pos``'s shard and sample on."""
        start_shard, start_sample = pos.shard, pos.sample
        for i in range(start_shard, len(shards)):
            url = shards[i]
            skip = start_sample if i == start_shard else 0
            pos.shard, pos.sample = i, skip
            try:
                for j, sample in enumerate(self.iter_shard(url)):
                    if j < skip:
                        continue
                    pos.sample = j + 1
                    yield [i, j], sample
            except Exception as e:
                if self.on_shard_error == "raise":
                    raise
                logger.warning("skipping the rest of shard %s: %s: %s", url, type(e).__name__, e)
        pos.shard, pos.sample = len(shards), 0

    def __iter__(self) -> Iterator[Any]:
        # keep this map(decoder, iter_raw()): AsyncLoader pulls iter_raw() and calls
        # decode itself (asyncfeed._engine.capabilities)
        if self.decoder is None:
            return self.iter_raw()
        return map(self.decoder, self.iter_raw())

    def close(self) -> None:
        """Close the connections of remote sources (they are reopened when needed)."""
        for src in self._sources.values():
            src.close()

    def __repr__(self) -> str:
        return (f"WebDatasetShards({len(self.urls)} shards, first={self.urls[0]!r}, "
                f"shuffle_buffer={self.shuffle_buffer}, seed={self.seed}, epoch={self.epoch})")


class _PassPosition:
    """Where a pass of ``WebDatasetShards.iter_raw`` stands, at each of its ``yield``s."""

    def __init__(self, rng: random.Random, placement: list[int]) -> None:
        self.rng = rng
        self.placement = placement            # rank, world size, worker, workers
        self.shard = 0                        # the shard and sample read next
        self.sample = 0
        self.buffer: list[list[int]] = []     # the shuffle buffer's samples, by position
        self.draining: list[list[int]] | None = None   # the shards are read: what is left
        self.finished = False

    def position(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"placement": list(self.placement), "shard": self.shard,
                "sample": self.sample, "buffer": _flat(self.buffer),
                "draining": None if self.draining is None else _flat(self.draining),
                "rng": [version, list(internal), gauss]}

    def restore(self, p: dict[str, Any]) -> None:
        if list(p["placement"]) != self.placement:
            raise ValueError(f"this WebDatasetShards state was taken as rank, world size, "
                             f"worker, workers = {p['placement']}; this pass is "
                             f"{self.placement}")
        self.shard, self.sample = int(p["shard"]), int(p["sample"])
        self.buffer = _pairs(p["buffer"])
        self.draining = None if p["draining"] is None else _pairs(p["draining"])
        version, internal, gauss = p["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


def _flat(refs: list[list[int]]) -> list[int]:
    """[[shard, sample], ...] as one flat list of ints: a state snapshotted at every
    chunk pulled copies it in one go."""
    return [v for ref in refs for v in ref]


def _pairs(flat: list[int]) -> list[list[int]]:
    return [[int(flat[i]), int(flat[i + 1])] for i in range(0, len(flat), 2)]
