"""``ImageFolder``: torchvision's folder layout over any :class:`~asyncfeed.protocols.Source`,
decoded by any :class:`~asyncfeed.protocols.Decoder` (fixed-size uint8 tensors by default)."""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal

import numpy as np
import torch

from .._errors import SampleError
from .._io.hedge import CountsReads, ReadStats
from .._io.local import SLOW_READ_S, LocalSource
from ..protocols import Decoder, DecoderInto, Source
from .augment import RandomResizedCropDecoder, training_decoder
from .decoder import ImageDecoder
from .image import Interpolation, MaxPixels, check_interpolation, check_size, pixel_limit

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

IOMode = Literal["auto", "thread", "async"]

#: class folder names that are the names of a data set's splits, not of classes
SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing"})


def _is_url(root: str) -> bool:
    return "://" in root and not root.startswith("file://")


class ImageFolder:
    """Images in ``root/<class>/**/<file>``, as ``(uint8 tensor [3, size, size], label)``.

    Classes and sample order are exactly torchvision's ``ImageFolder``: class names
    are the sorted subdirectory names, labels their positions, files walked in
    sorted order and kept when their lower-cased name ends in ``extensions``.

    It is a plain map-style dataset (``__getitem__``/``__len__``), so
    ``torch.utils.data.DataLoader`` can run exactly the same work, and it also
    splits its work for ``AsyncLoader``: ``fetch`` (async read, on the loader's
    event loop) and ``decode``/``decode_into`` (decode threads).

    ``size=None`` keeps full-size images (variable shapes: give the loader a
    ``collate_fn`` that accepts them).  ``interpolation`` is ``"area"``
    (antialiased, the default) or ``"linear"`` (faster).  ``io`` chooses where
    reads happen: ``"thread"`` reads in the decode thread (cheapest for files in
    the page cache), ``"async"`` keeps up to the loader's ``io_concurrency`` reads
    in flight on its event loop (cold disks, network mounts, object stores);
    ``"auto"`` picks ``"async"`` for URLs and, for local directories, times a few
    reads (``read_latency_s``): ``"async"`` when they wait a millisecond or more
    (cold disks, network and FUSE mounts), else ``"thread"``.

    ``source`` replaces where files are listed and read (any
    :class:`~asyncfeed.protocols.Source`; by default a local directory, or
    :class:`~asyncfeed.FsspecSource` for a URL root, given ``**source_options``).
    ``decoder`` replaces how a file's bytes become the image (any
    :class:`~asyncfeed.protocols.Decoder`; by default
    ``ImageDecoder(size, interpolation)``; ``size`` and ``interpolation`` then
    belong to your decoder).  A decoder that also fits
    :class:`~asyncfeed.protocols.DecoderInto` writes straight into batch rows.
    See ``docs/extending.md``.  ``max_pixels`` bounds the pixels an image's header
    may declare, checked before decoding (``"pillow"``, the default: what Pillow
    refuses, more than twice ``PIL.Image.MAX_IMAGE_PIXELS``; None: no limit); it
    configures the default decoder too.

    ``train=True`` yields training samples: torchvision's ``RandomResizedCrop`` to
    ``size`` and a horizontal flip, fused into decoding (the window is drawn from
    the JPEG header, the image decoded at 1/2, 1/4 or 1/8 scale where the window
    allows, cropped, resized, flipped and written in place; see
    ``docs/augmentation.md``).  ``scale``, ``ratio`` and ``hflip`` override
    torchvision's defaults (``(0.08, 1.0)``, ``(3/4, 4/3)``, ``0.5``).  Each sample's
    window and flip come from ``(seed, epoch, index)``: the same for any thread
    count, execution and resume point.  ``seed=None`` takes ``torch.initial_seed()``
    when the dataset is made (so ``torch.manual_seed`` fixes it); ``set_epoch`` (which
    ``AsyncLoader.set_epoch`` calls) selects the epoch.  Normalize the uint8
    batches on the device with :func:`asyncfeed.normalize`.

    Class folders named like splits (``train``, ``val``, ``test``...) warn: the
    root is probably one level too high.  A class folder with no image raises
    ``FileNotFoundError``, as torchvision's does; ``allow_empty=True`` keeps such
    classes (their labels stay reserved) with a warning naming them.

    Errors are raised as :class:`asyncfeed.SampleError` naming the index and path.
    """

    def __init__(self, root: str | os.PathLike[str], size: int | None = 224, *,
                 extensions: tuple[str, ...] = IMG_EXTENSIONS,
                 interpolation: Interpolation = "area", io: IOMode = "auto",
                 source: Source | None = None, decoder: Decoder | None = None,
                 max_pixels: MaxPixels = "pillow", train: bool = False,
                 scale: tuple[float, float] | None = None,
                 ratio: tuple[float, float] | None = None, hflip: float | None = None,
                 seed: int | None = None, allow_empty: bool = False,
                 **source_options: Any) -> None:
        check_size(size)
        check_interpolation(interpolation)
        if io not in ("auto", "thread", "async"):
            raise ValueError(f"io must be 'auto', 'thread' or 'async', got {io!r}")
        self.root = os.fspath(root)
        pixel_limit(max_pixels)  # ValueError now for a bad value
        self.train = bool(train)
        self._epoch = 0
        if train and decoder is not None:
            raise TypeError("train=True configures the default decoder; with decoder=, "
                            "do the augmentation in your decoder")
        self._augment = training_decoder(train, size, scale=scale, ratio=ratio, hflip=hflip,
                                         seed=seed, interpolation=interpolation,
                                         max_pixels=max_pixels)
        if train:
            pass  # the augmentation decodes
        elif decoder is None:
            decoder = ImageDecoder(size, interpolation, max_pixels=max_pixels)
        elif size != 224 or interpolation != "area" or max_pixels != "pillow":
            raise TypeError("size, interpolation and max_pixels configure the default "
                            "decoder; with decoder=, give them to your decoder")
        elif not callable(decoder):
            raise TypeError(f"decoder must be callable (a Decoder), got {decoder!r}")
        #: how a file's bytes become the image: the ``RandomResizedCropDecoder`` with
        #: ``train=True`` (called with the sample's index), else a ``Decoder``
        self.decoder: Any = self._augment if self._augment is not None else decoder
        self._decode_into = decoder.decode_into if isinstance(decoder, DecoderInto) else None
        # the default decoder's settings (None with a decoder of your own)
        self.size = self.decoder.size if isinstance(
            self.decoder, (ImageDecoder, RandomResizedCropDecoder)) else None
        self.interpolation: Interpolation = interpolation
        self.extensions = tuple(e.lower() for e in extensions)
        if source is None:
            source = self._open_source(self.root, source_options)
        elif source_options:
            raise TypeError(f"unexpected options with an explicit source: {sorted(source_options)}")
        elif not isinstance(source, Source):
            missing = [m for m in ("is_local", "list_dirs", "list_files", "read_sync", "read",
                                   "close_io") if not hasattr(source, m)]
            raise TypeError(f"source {source!r} is not a Source (asyncfeed.protocols.Source): "
                            f"it lacks {', '.join(missing)}")
        self._source = source
        self.read_latency_s: float | None = None
        self.io: IOMode = io if io != "auto" else ("thread" if source.is_local else "async")
        samples = self._list_samples(source, allow_empty)
        self.samples = samples
        self.targets = [t for _, t in samples]
        if io == "auto" and isinstance(source, LocalSource):
            # measured, not guessed from the path: a network mount is a local path
            self.read_latency_s = source.read_latency([p for p, _ in samples])
            self.io = "async" if self.read_latency_s >= SLOW_READ_S else "thread"

    def _list_samples(self, source: Source, allow_empty: bool) -> list[tuple[str, int]]:
        """Every (path, label) under the class folders, sorted as ``source`` lists
        them; sets ``classes`` and ``class_to_idx``.  Raises ``FileNotFoundError``
        for no class, no image, or (without ``allow_empty``) a class with no
        image; warns (at the caller of ``__init__``) for split-like class names
        and kept empty classes."""
        self.classes: list[str] = source.list_dirs()
        if not self.classes:
            raise FileNotFoundError(f"no class folders found in {self.root}")
        splits = [c for c in self.classes if c.lower() in SPLIT_NAMES]
        if splits:
            warnings.warn(
                f"ImageFolder({self.root!r}): the class folders {', '.join(splits)} look like "
                f"the splits of a data set, not classes; point root at one split "
                f"(e.g. {os.path.join(self.root, splits[0])!r})", UserWarning, stacklevel=3)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        samples: list[tuple[str, int]] = []
        empty: list[str] = []
        for cls in self.classes:
            found = [p for p in source.list_files(cls) if p.lower().endswith(self.extensions)]
            if not found:
                empty.append(cls)
            samples.extend((p, self.class_to_idx[cls]) for p in found)
        if empty and not allow_empty:
            raise FileNotFoundError(
                f"found no valid file for the classes {', '.join(empty)} in {self.root}; "
                f"supported extensions are: {', '.join(self.extensions)} "
                f"(allow_empty=True keeps empty classes)")
        if empty:
            warnings.warn(
                f"ImageFolder({self.root!r}): the class folders {', '.join(empty)} hold no "
                f"image (extensions {', '.join(self.extensions)}); their labels are kept "
                f"with no sample", UserWarning, stacklevel=3)
        if not samples:
            raise FileNotFoundError(f"no image found under {self.root}")
        return samples

    @staticmethod
    def _open_source(root: str, options: dict[str, Any]) -> Source:
        if _is_url(root):
            from .._io.fsspec import FsspecSource  # optional layer, imported on demand
            return FsspecSource(root, **options)
        if options:
            raise TypeError(f"options {sorted(options)} apply only to remote roots")
        return LocalSource(root)

    def __len__(self) -> int:
        return len(self.samples)

    def sample_source(self, index: int) -> str:
        """The path or URL of sample ``index``, for error messages."""
        return self.samples[index][0]

    # -- the synchronous path (DataLoader, or AsyncLoader with io="thread") --------
    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        try:
            raw = self._source.read_sync(path)
            img = self._decoded(raw, index)
        except Exception as e:
            raise SampleError(index, path, e) from e
        return img, label

    def _decoded(self, raw: bytes, index: int) -> Any:
        """Sample ``index``'s image from its bytes (a tensor where the decoder gives an array)."""
        if self._augment is not None:
            return torch.from_numpy(self._augment.decode(raw, index))
        return self._image(self.decoder(raw))

    @staticmethod
    def _image(img: Any) -> Any:
        """A decoder's NumPy array as a tensor (anything else as it is)."""
        return torch.from_numpy(img) if isinstance(img, np.ndarray) else img

    # -- training augmentation -----------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch whose windows ``train=True`` draws (0 until ``set_epoch``)."""
        return self._augment.epoch if self._augment is not None else self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch ``epoch``'s windows and flips from now on (``train=True``; without
        it the epoch changes nothing).  ``AsyncLoader.set_epoch`` calls this, and
        sends the epoch to its worker processes; call it between passes.  With
        torch's DataLoader, call it before each epoch's ``iter()`` (workers made with
        ``persistent_workers=True`` keep the epoch they were started with)."""
        if self._augment is not None:
            self._augment.set_epoch(epoch)
            return
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self._epoch = epoch

    @property
    def seed(self) -> int | None:
        """The seed of the training windows (None without ``train=True``)."""
        return self._augment.seed if self._augment is not None else None

    # -- the split path (AsyncLoader) ----------------------------------------------
    @property
    def use_async_fetch(self) -> bool:
        """Whether ``AsyncLoader`` should call ``fetch`` on its event loop."""
        return self.io == "async"

    async def fetch(self, index: int) -> bytes:
        """Read the file of sample ``index`` (on the loader's event loop)."""
        path = self.samples[index][0]
        try:
            return await self._source.read(path)
        except Exception as e:
            raise SampleError(index, path, e) from e

    def read(self, index: int) -> bytes:
        """Read the file of sample ``index`` in the calling thread."""
        path = self.samples[index][0]
        try:
            return self._source.read_sync(path)
        except Exception as e:
            raise SampleError(index, path, e) from e

    def decode(self, raw: bytes, index: int) -> tuple[torch.Tensor, int]:
        """Decode what ``fetch`` returned into the sample ``__getitem__`` would give."""
        try:
            img = self._decoded(raw, index)
        except Exception as e:
            raise SampleError(index, self.samples[index][0], e) from e
        return img, self.samples[index][1]

    def decode_into(self, raw: bytes, index: int, out: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Decode straight into ``out`` (e.g. a ``[3, size, size]`` uint8 row of a batch slot).

        Returns the sample with ``out`` itself as the image, so the loader knows
        the pixels are already in place; when the decoder cannot write into
        ``out`` (another shape, or no ``decode_into``), the sample ``decode`` gives.
        """
        aug = self._augment
        if aug is not None:
            if tuple(out.shape) != (3, aug.size, aug.size) or out.dtype != torch.uint8 \
                    or out.device.type != "cpu":
                return self.decode(raw, index)
            try:
                aug.decode(raw, index, out.numpy())
            except Exception as e:
                raise SampleError(index, self.samples[index][0], e) from e
            return out, self.samples[index][1]
        if self._decode_into is None:
            return self.decode(raw, index)
        try:
            written = self._decode_into(raw, out)
        except Exception as e:
            raise SampleError(index, self.samples[index][0], e) from e
        if not written:
            return self.decode(raw, index)
        return out, self.samples[index][1]

    def read_stats(self) -> ReadStats | None:
        """The source's read counters (attempts, hedges, stalls...), or None for a
        source that keeps none (local directories)."""
        return self._source.read_stats() if isinstance(self._source, CountsReads) else None

    async def close_io(self) -> None:
        """Release what the source bound to the current event loop (HTTP sessions)."""
        await self._source.close_io()

    def __repr__(self) -> str:
        return (f"ImageFolder(root={self.root!r}, decoder={self.decoder!r}, "
                f"samples={len(self)}, classes={len(self.classes)}, io={self.io!r})")
