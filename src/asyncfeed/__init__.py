"""asyncfeed: keep GPUs fed from one process.

An asyncio I/O layer keeps many reads in flight, a thread pool decodes with
GIL-releasing decoders, decoded samples land in preallocated batch slots, and a
dedicated CUDA copy stream moves them to the GPU while the model computes.

What you can plug in (datasets' optional methods, storage sources, decoders,
the device transfer) is written down as protocols in :mod:`asyncfeed.protocols`;
``docs/extending.md`` shows how.
"""

from typing import Any as _Any

from . import protocols  # noqa: F401 - asyncfeed.protocols, the extension contracts
from ._data.decoder import ImageDecoder
from ._data.folder import IMG_EXTENSIONS, ImageFolder
from ._data.image import decode_image
from ._data.normalize import normalize
from ._data.webdataset import ImageLabelDecoder, WebDatasetShards
from ._engine.loader import AsyncLoader
from ._engine.accounting import StageStats
from ._engine.execution_report import ExecutionReport, Measured
from ._engine.policy import Candidate, Mode, Reason
from ._engine.stats import IOStats, LoaderStats, SkippedSample
from ._errors import (AsyncFeedError, LoaderClosedError, LoaderTimeout, RemoteReadError,
                      RemoteTimeoutError, SampleError, ShardError, StateError,
                      WorkerCrashedError)
from ._io.local import LocalSource
from ._memory.device import CopyStream
from .protocols import Decoder, DecoderInto, DeviceTransfer, Source

__version__ = "0.1.0"

# public names whose modules are imported on first use (they pull optional packages)
_LAZY = {"FsspecSource": "._io.fsspec"}

__all__ = [
    "AsyncFeedError",
    "AsyncLoader",
    "Candidate",
    "CopyStream",
    "Decoder",
    "DecoderInto",
    "DeviceTransfer",
    "ExecutionReport",
    "FsspecSource",
    "IMG_EXTENSIONS",
    "IOStats",
    "ImageDecoder",
    "ImageFolder",
    "ImageLabelDecoder",
    "LoaderClosedError",
    "LoaderStats",
    "LoaderTimeout",
    "LocalSource",
    "Measured",
    "Mode",
    "Reason",
    "RemoteReadError",
    "RemoteTimeoutError",
    "SampleError",
    "ShardError",
    "SkippedSample",
    "Source",
    "StageStats",
    "StateError",
    "WebDatasetShards",
    "WorkerCrashedError",
    "decode_image",
    "normalize",
]


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'asyncfeed' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
