"""Every exception asyncfeed raises, and how remote errors are classified.

The tree (public names are exported by ``asyncfeed``; backend errors are
chained as ``__cause__``)::

    Exception
    └── AsyncFeedError                    anything asyncfeed raises on its own account
        ├── SampleError                   a sample failed to load (index, source, batch);
        │   └── <the original type>       raised as a subclass of it too (rebuild_error):
        │                                 ``except KeyError`` still works
        ├── LoaderTimeout       +RuntimeError +TimeoutError   no batch within ``timeout``
        ├── LoaderClosedError   +RuntimeError   the loader/iterator was closed or superseded
        ├── StateError          +ValueError     a ``state_dict`` not fitting this loader
        ├── WorkerCrashedError  +RuntimeError   a worker process died (names its samples)
        ├── RemoteReadError     +OSError        a remote read failed for good (url, attempts)
        │   └── RemoteTimeoutError  +TimeoutError   every attempt ran past the read timeout
        └── ShardError    +tarfile.ReadError    a tar shard cut short or corrupt (url, member)

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
import tarfile
import threading
import traceback as _traceback

__all__ = ["AsyncFeedError", "ErrorKind", "LoaderClosedError", "LoaderTimeout",
           "RemoteReadError", "RemoteTimeoutError", "SampleError", "ShardError",
           "SizeMismatch", "StateError", "WorkerCrashedError", "classify", "describe",
           "is_fatal", "rebuild_error", "set_remote_traceback", "status_and_code",
           "traceback_text"]

class AsyncFeedError(Exception):
    """Base class of every error asyncfeed raises on its own account."""


class SampleError(AsyncFeedError):
    """A sample could not be loaded.

    Raised at the batch the sample belongs to, with the original error chained as
    ``__cause__``.  ``index`` is the dataset index, ``source`` the path or URL when
    the dataset can name one, ``batch`` the position of the batch in the epoch.

    What the loader raises for a failed sample is, where it can be built, an
    instance of a subclass of both ``SampleError`` and the original exception's
    type (see :func:`rebuild_error`): ``except KeyError:`` still catches a
    ``KeyError`` raised by ``__getitem__``, as with DataLoader.  Its message
    names the sample and ends with the original traceback.
    """

    def __init__(self, index: object, source: str | None = None,
                 cause: BaseException | None = None, batch: int | None = None,
                 traceback: str | None = None, subject: str | None = None) -> None:
        if cause is None and source is None and isinstance(index, str):
            # a message alone: how DataLoader's worker processes rebuild an exception
            # (``exc_type(message)``) when, say, ImageFolder raised one in a worker
            self._setup(None, None, None, batch, traceback, subject)
            super().__init__(index)
            return
        self._setup(index, source, cause, batch, traceback, subject)
        super().__init__(self._message())

    def _setup(self, index: object, source: str | None, cause: BaseException | None,
               batch: int | None, traceback: str | None, subject: str | None) -> None:
        self.index = index
        self.source = source
        self.batch = batch
        self.cause = cause
        self.traceback_text = traceback
        self.subject = subject

    def _message(self) -> str:
        where = f" ({self.source})" if self.source else ""
        in_batch = f" in batch {self.batch}" if self.batch is not None else ""
        subject = self.subject or f"sample {self.index}{where}"
        why = describe(self.cause) if self.cause is not None else "unknown error"
        msg = f"{subject}{in_batch} failed: {why}"
        if self.traceback_text:
            msg += "\nOriginal Traceback (most recent call last):\n" + self.traceback_text
        return msg

    def set_batch(self, batch: int | None) -> None:
        """Name the batch (once known) in the attribute and the message."""
        self.batch = batch
        self.args = (self._message(),)

    def __str__(self) -> str:  # not the original type's __str__ (KeyError's repr, a raising one)
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # keep it picklable for users who ship errors across processes
        return (type(self), (self.index, self.source, self.cause, self.batch,
                             self.traceback_text, self.subject))


def describe(e: BaseException) -> str:
    """``Type: message`` of ``e``, even when its ``__str__`` raises."""
    try:
        text = str(e)
    except Exception as inner:  # noqa: BLE001 - a broken __str__ must not hide the sample
        text = f"<str() of the exception raised {type(inner).__name__}>"
    return f"{type(e).__name__}: {text}"


#: the attribute holding the traceback text of an exception raised in another process
#: (see :func:`set_remote_traceback`)
_REMOTE_TB = "_asyncfeed_remote_traceback"


def traceback_text(e: BaseException) -> str:
    """The frames of ``e``'s traceback and its ``Type: message`` line, as text; for an
    exception that came from a worker process, the text taken there."""
    remote = getattr(e, _REMOTE_TB, None)
    if isinstance(remote, str):
        return remote
    frames = "".join(_traceback.format_tb(e.__traceback__)) if e.__traceback__ else ""
    return frames + describe(e)


def set_remote_traceback(e: BaseException, text: str) -> None:
    """Give ``e`` (rebuilt from a pickle sent by a worker process, its frames lost)
    the ``traceback_text`` taken where it was raised, so it reads as it would
    have read in this process.  Best effort: a type that refuses attributes keeps
    only its message."""
    try:
        setattr(e, _REMOTE_TB, text)
    except (AttributeError, TypeError):
        pass


def is_fatal(e: BaseException) -> bool:
    """KeyboardInterrupt, SystemExit and other non-``Exception``s: never wrapped, never
    skipped; the loader raises them as they are."""
    return not isinstance(e, Exception)


_typed_classes: dict[type, type[SampleError]] = {}
_typed_lock = threading.Lock()


def _typed_class(base: type) -> type[SampleError]:
    """A subclass of ``SampleError`` and ``base``, named like ``base`` (made once)."""
    with _typed_lock:
        cls = _typed_classes.get(base)
        if cls is None:
            cls = type(base.__name__, (SampleError, base), {
                "__module__": base.__module__, "__qualname__": base.__qualname__,
                "__str__": SampleError.__str__, "__reduce__": _typed_reduce,
                "__doc__": f"A sample failed with {base.__qualname__} (see SampleError)."})
            _typed_classes[base] = cls
        return cls


def _typed_reduce(self: SampleError) -> tuple:
    return (_rebuild_pickled, (type(self.cause), self.index, self.source, self.cause,
                               self.batch, self.traceback_text, self.subject))


def _rebuild_pickled(base: type, index: object, source: str | None, cause: BaseException,
                     batch: int | None, tb: str | None, subject: str | None) -> SampleError:
    return _build(base, index, source, cause, batch, tb, subject)


def _build(base: type, index: object, source: str | None, cause: BaseException,
           batch: int | None, tb: str | None, subject: str | None) -> SampleError:
    cls = _typed_class(base)
    err = cls.__new__(cls)
    try:
        err.__dict__.update(cause.__dict__)   # a user exception's own attributes
        err.__dict__.pop(_REMOTE_TB, None)    # the text is in the message already
    except (AttributeError, TypeError):
        pass
    if isinstance(cause, OSError) and isinstance(err, OSError):
        err.errno, err.strerror, err.filename, err.filename2 = (
            cause.errno, cause.strerror, cause.filename, cause.filename2)
    err._setup(index, source, cause, batch, tb, subject)
    err.args = (err._message(),)
    return err


def rebuild_error(cause: BaseException, index: object, source: str | None = None,
                  batch: int | None = None, subject: str | None = None) -> BaseException:
    """What the consumer raises for ``cause`` (raised while loading ``index``).

    - KeyboardInterrupt, SystemExit (anything not an ``Exception``): ``cause`` itself;
    - a ``SampleError`` already: ``cause``, its batch filled in when missing;
    - otherwise an exception of ``cause``'s type (a subclass of it and of
      :class:`SampleError`) whose message names the sample and ends with the
      original traceback, ``cause`` chained as ``__cause__``.  When that type
      cannot be subclassed or instantiated (or is ``StopIteration``, which would
      end the user's loop silently), a plain ``SampleError`` that says so.
    """
    if is_fatal(cause):
        return cause
    if isinstance(cause, SampleError):
        inner = cause.cause
        if type(cause) is SampleError and isinstance(inner, Exception) \
                and not isinstance(inner, (SampleError, StopIteration, StopAsyncIteration)):
            # a dataset's own plain SampleError (ImageFolder's): rebuilt from its cause,
            # so ``except FileNotFoundError`` works there too
            index, source = cause.index, cause.source
            batch = cause.batch if cause.batch is not None else batch
            cause = inner
        else:
            if cause.batch is None and batch is not None:
                cause.set_batch(batch)
            return cause
    tb = traceback_text(cause)
    base = type(cause)
    err: SampleError
    if isinstance(cause, (StopIteration, StopAsyncIteration)):
        why = f"{base.__name__} would end the loop"
    else:
        try:
            err = _build(base, index, source, cause, batch, tb, subject)
        except Exception as e:  # noqa: BLE001 - a type we cannot rebuild: say so
            why = f"{base.__qualname__} could not be rebuilt ({type(e).__name__}: {e})"
        else:
            err.__cause__ = cause
            return err
    err = SampleError(index, source, cause, batch,
                      tb + f"\n(raised as SampleError: the original type {why}; "
                           "it is the __cause__)", subject)
    err.__cause__ = cause
    return err


class LoaderTimeout(AsyncFeedError, RuntimeError, TimeoutError):
    """No batch arrived within the loader's ``timeout``.

    A ``RuntimeError``, as DataLoader's "DataLoader timed out after N seconds" is
    (and also a ``TimeoutError``).
    """


class LoaderClosedError(AsyncFeedError, RuntimeError):
    """The loader (or this iterator of it) was closed or superseded by a newer ``iter()``."""


class WorkerCrashedError(AsyncFeedError, RuntimeError):
    """A worker process of the loader's process stage died (a segfault, ``os._exit``,
    the OOM killer) while it held samples; the message names them.  Raised as the
    cause of the :class:`SampleError` of the first sample it held."""


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


# -- tar shards -------------------------------------------------------------------------
class ShardError(AsyncFeedError, tarfile.ReadError):
    """A tar shard is cut short or corrupt.

    ``url`` is the shard, ``member`` the tar member being read (or, for a broken
    header, the last member read before it), ``offset`` the byte offset in the
    shard where reading failed; the underlying error is chained as ``__cause__``.
    A ``tarfile.ReadError``, so code that catches tarfile's errors still does.
    """

    def __init__(self, url: str, member: str | None, offset: int, message: str) -> None:
        self.url, self.member, self.offset = url, member, offset
        where = f"member {member!r}" if member else "the first member"
        super().__init__(f"shard {url}, {where} (byte {offset}): {message}")

    def __reduce__(self):
        return (_rebuild_shard_error, (self.url, self.member, self.offset, self.args[0]))


def _rebuild_shard_error(url: str, member: str | None, offset: int, text: str) -> ShardError:
    err = ShardError.__new__(ShardError)
    Exception.__init__(err, text)
    err.url, err.member, err.offset = url, member, offset
    return err
