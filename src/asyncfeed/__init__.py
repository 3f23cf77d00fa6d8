"""asyncfeed: keep GPUs fed from one process.

An asyncio I/O layer keeps many reads in flight, a thread pool decodes with
GIL-releasing decoders, decoded samples land in preallocated batch slots, and a
dedicated CUDA copy stream moves them to the GPU while the model computes.
"""

from ._data.folder import IMG_EXTENSIONS, ImageFolder
from ._data.image import decode_image
from ._data.webdataset import ImageLabelDecoder, WebDatasetShards
from ._engine.loader import AsyncLoader
from ._engine.stats import LoaderStats, SkippedSample
from ._errors import AsyncFeedError, LoaderClosedError, LoaderTimeout, SampleError, StateError
from ._io.remote_errors import RemoteReadError, RemoteTimeoutError

__version__ = "0.1.0"

__all__ = [
    "AsyncFeedError",
    "AsyncLoader",
    "IMG_EXTENSIONS",
    "ImageFolder",
    "ImageLabelDecoder",
    "LoaderClosedError",
    "LoaderStats",
    "LoaderTimeout",
    "RemoteReadError",
    "RemoteTimeoutError",
    "SampleError",
    "SkippedSample",
    "StateError",
    "WebDatasetShards",
    "decode_image",
]
