"""Every exception asyncfeed raises, and how remote errors are classified.

The tree (public names are exported by ``asyncfeed``; backend errors are
chained as ``__cause__``)::

    Exception
    └── AsyncFeedError                    anything asyncfeed raises on its own account
        ├── SampleError                   a sample failed to load (index, source, batch)
        ├── LoaderTimeout       +TimeoutError   no batch within the loader's ``timeout``
        ├── LoaderClosedError   +RuntimeError   the loader/iterator was closed or superseded
        ├── StateError          +ValueError     a ``state_dict`` not fitting this loader
        └── RemoteReadError     +OSError        a remote read failed for good (url, attempts)
            └── RemoteTimeoutError  +TimeoutError   every attempt ran past the read timeout

    OSError
    └── SizeMismatch                      internal: a body not as long as listed (transient)

A remote read that finds no file or is refused ends as the standard
``FileNotFoundError``/``PermissionError`` (what local reads raise too).

:func:`classify` sorts an exception from any layer (aiohttp, the lean client,
botocore/s3fs, fsspec, the OS) into an :class:`ErrorKind`: ``MISSING`` (404,
NoSuchKey), ``DENIED`` (401/403, AccessDenied), ``TRANSIENT`` (timeouts, resets,
truncated bodies, 5xx/408/425/429, S3 throttling codes) or ``PERMANENT``
(everything else: other 4xx, programming errors), looking through ``__cause__``
chains for an HTTP status or an S3 error code.  ``ErrorKind`` is a ``str`` enum:
its members compare equal to ``"missing"``, ``"denied"``, ``"transient"`` and
``"permanent"``, the strings ``classify`` returned before.
"""

from __future__ import annotations

import asyncio
import enum
import errno

__all__ = ["AsyncFeedError", "ErrorKind", "LoaderClosedError", "LoaderTimeout",
           "RemoteReadError", "RemoteTimeoutError", "SampleError", "SizeMismatch",
           "StateError", "classify", "status_and_code"]

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


# -- remote reads -----------------------------------------------------------------------
class RemoteReadError(AsyncFeedError, OSError):
    """A remote read failed for good (retries exhausted, or an error not worth retrying).

    ``url`` is the URL; the last underlying error is chained as ``__cause__``;
    ``attempts`` is how many requests were made.
    """

    def __init__(self, url: str, message: str, attempts: int = 1) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.attempts = attempts

    def __reduce__(self):
        return (_rebuild_remote_error, (type(self), self.url, self.args[0], self.attempts))


class RemoteTimeoutError(RemoteReadError, TimeoutError):
    """Every attempt of a remote read ran past the per-read ``timeout``."""


def _rebuild_remote_error(cls, url, full_message, attempts):
    err = cls.__new__(cls)
    OSError.__init__(err, full_message)
    err.url, err.attempts = url, attempts
    return err


class SizeMismatch(OSError):
    """The body was not as long as the listing said (a transient truncation)."""


# -- classification of remote errors ----------------------------------------------------

_THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "RequestThrottled", "TooManyRequests", "TooManyRequestsException",
    "ProvisionedThroughputExceededException", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "BandwidthLimitExceeded", "PriorRequestNotComplete",
})
_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
_DENIED_CODES = frozenset({"AccessDenied", "Forbidden", "403", "InvalidAccessKeyId",
                           "SignatureDoesNotMatch", "ExpiredToken", "AllAccessDisabled"})
_TRANSIENT_ERRNOS = frozenset(filter(None, (
    errno.EIO, errno.EBUSY, errno.EAGAIN, errno.ECONNRESET, errno.ECONNABORTED,
    errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE, errno.ENETUNREACH, errno.EHOSTUNREACH,
    getattr(errno, "EREMOTEIO", None))))


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [TimeoutError, asyncio.TimeoutError, ConnectionError,
                                        EOFError, SizeMismatch]
    try:
        import aiohttp
        types += [aiohttp.ClientPayloadError, aiohttp.ClientConnectionError]
    except ImportError:  # pragma: no cover
        pass
    try:
        from botocore import exceptions as bx
        types += [bx.HTTPClientError, bx.IncompleteReadError, bx.ResponseStreamingError]
    except ImportError:  # pragma: no cover
        pass
    try:
        from fsspec.exceptions import FSTimeoutError
        types.append(FSTimeoutError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


_TRANSIENT_TYPES: tuple[type[BaseException], ...] | None = None


def status_and_code(e: BaseException) -> tuple[int | None, str | None, float | None]:
    """HTTP status, S3 error code and Retry-After found on ``e`` or its causes."""
    seen = 0
    cur: BaseException | None = e
    while cur is not None and seen < 6:
        response = getattr(cur, "response", None)  # botocore ClientError, S3StatusError
        if isinstance(response, dict):
            err = response.get("Error") or {}
            meta = response.get("ResponseMetadata") or {}
            status = meta.get("HTTPStatusCode")
            retry_after = getattr(cur, "retry_after", None)
            return (status if isinstance(status, int) else None), err.get("Code"), retry_after
        status = getattr(cur, "status", None)
        if isinstance(status, int) and 100 <= status < 600:  # aiohttp, HTTPStatusError
            retry_after = getattr(cur, "retry_after", None)
            headers = getattr(cur, "headers", None)
            if retry_after is None and headers:
                try:
                    retry_after = float(headers.get("Retry-After", ""))
                except ValueError:
                    pass
            return status, None, retry_after
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return None, None, None


class ErrorKind(str, enum.Enum):
    """What a failed read means for retrying it (see :func:`classify`)."""

    MISSING = "missing"        # 404, NoSuchKey: retrying will not help
    DENIED = "denied"          # 401/403, AccessDenied
    TRANSIENT = "transient"    # timeouts, resets, throttling, 5xx: worth retrying
    PERMANENT = "permanent"    # anything else

    def __str__(self) -> str:
        return self.value


def classify(e: BaseException) -> ErrorKind:
    """The :class:`ErrorKind` of ``e`` (looking through its ``__cause__`` chain)."""
    global _TRANSIENT_TYPES
    if isinstance(e, FileNotFoundError):
        return ErrorKind.MISSING
    if isinstance(e, PermissionError):
        return ErrorKind.DENIED
    status, code, _ = status_and_code(e)
    if code in _MISSING_CODES:
        return ErrorKind.MISSING
    if code in _DENIED_CODES:
        return ErrorKind.DENIED
    if code in _THROTTLE_CODES:
        return ErrorKind.TRANSIENT
    if status is not None:
        if status in (404, 410):
            return ErrorKind.MISSING
        if status in (401, 403):
            return ErrorKind.DENIED
        if status in (408, 425, 429) or status >= 500:
            return ErrorKind.TRANSIENT
        if status >= 400:
            return ErrorKind.PERMANENT
    if _TRANSIENT_TYPES is None:
        _TRANSIENT_TYPES = _transient_types()
    if isinstance(e, _TRANSIENT_TYPES):
        return ErrorKind.TRANSIENT
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return ErrorKind.TRANSIENT
    return ErrorKind.PERMANENT
