"""The exceptions asyncfeed raises.  Backend errors are chained as ``__cause__``."""

from __future__ import annotations


class AsyncFeedError(Exception):
    """Base class of every error asyncfeed raises on its own account."""


class SampleError(AsyncFeedError):
    """A sample could not be loaded.

    Raised at the batch the sample belongs to, with the original error chained as
    ``__cause__``.  ``index`` is the dataset index, ``source`` the path or URL when
    the dataset can name one, ``batch`` the position of the batch in the epoch.
    """

    def __init__(self, index: object, source: str | None, cause: BaseException,
                 batch: int | None = None) -> None:
        self.index = index
        self.source = source
        self.batch = batch
        self.cause = cause
        where = f" ({source})" if source else ""
        in_batch = f" in batch {batch}" if batch is not None else ""
        super().__init__(
            f"sample {index}{where}{in_batch} failed: {type(cause).__name__}: {cause}")

    def __reduce__(self):  # keep it picklable for users who ship errors across processes
        return (type(self), (self.index, self.source, self.cause, self.batch))


class LoaderTimeout(AsyncFeedError, TimeoutError):
    """No batch arrived within the loader's ``timeout``."""


class LoaderClosedError(AsyncFeedError, RuntimeError):
    """The loader (or this iterator of it) was closed or superseded by a newer ``iter()``."""


class StateError(AsyncFeedError, ValueError):
    """A ``state_dict`` that does not fit this loader (other data set, batch size, version)."""
