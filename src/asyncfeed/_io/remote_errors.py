"""Errors of remote reads, and which of them are worth retrying.

``classify`` sorts an exception from any layer (aiohttp, the lean client,
botocore/s3fs, fsspec, the OS) into ``"missing"`` (404, NoSuchKey),
``"denied"`` (401/403, AccessDenied), ``"transient"`` (timeouts, resets,
truncated bodies, 5xx/408/425/429, S3 throttling codes) or ``"permanent"``
(everything else: other 4xx, programming errors), looking through ``__cause__``
chains for an HTTP status or an S3 error code.
"""

from __future__ import annotations

import asyncio
import errno

from .._errors import AsyncFeedError

__all__ = ["RemoteReadError", "RemoteTimeoutError", "classify", "status_and_code"]


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


# -- error classification ------------------------------------------------------------

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


def classify(e: BaseException) -> str:
    """``"missing"``, ``"denied"``, ``"transient"`` or ``"permanent"``."""
    global _TRANSIENT_TYPES
    if isinstance(e, FileNotFoundError):
        return "missing"
    if isinstance(e, PermissionError):
        return "denied"
    status, code, _ = status_and_code(e)
    if code in _MISSING_CODES:
        return "missing"
    if code in _DENIED_CODES:
        return "denied"
    if code in _THROTTLE_CODES:
        return "transient"
    if status is not None:
        if status in (404, 410):
            return "missing"
        if status in (401, 403):
            return "denied"
        if status in (408, 425, 429) or status >= 500:
            return "transient"
        if status >= 400:
            return "permanent"
    if _TRANSIENT_TYPES is None:
        _TRANSIENT_TYPES = _transient_types()
    if isinstance(e, _TRANSIENT_TYPES):
        return "transient"
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return "transient"
    return "permanent"


# -- per-event-loop connections -------------------------------------------------------
