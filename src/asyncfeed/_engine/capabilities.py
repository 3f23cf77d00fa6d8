"""What a dataset can do for the loader, read once per loader.

:meth:`Capabilities.of` is the one place that looks at a dataset's optional
methods (the contracts of :mod:`asyncfeed.protocols`); the loader and its
pipelines only read the resulting frozen object.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .plan import is_iterable_dataset

__all__ = ["Capabilities"]

_warned: set[type] = set()


def _method(obj: Any, name: str) -> Callable[..., Any] | None:
    fn = getattr(obj, name, None)
    return fn if callable(fn) else None


def _takes_index(decode: Callable[..., Any]) -> bool:
    """Whether ``decode`` accepts ``(raw, index)``; an uninspectable callable is
    taken for the one-argument form an iterable's ``decode`` had before."""
    try:
        inspect.signature(decode).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins)
        return False
    return True


def _iterable_decode(dataset: Any, decode: Callable[..., Any]) -> Callable[[Any, int], Any]:
    """``decode`` as ``decode(raw, index)``; the old ``decode(raw)`` warns once per class."""
    if _takes_index(decode):
        return decode
    cls = type(dataset)
    if cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"{cls.__qualname__}.decode(raw) takes one argument; iterable datasets' decode "
            "is now decode(raw, index) like map-style ones (index: the item's position in "
            "the pass's stream). The one-argument form will stop working in a later "
            "release", DeprecationWarning, stacklevel=4)
    return lambda raw, index: decode(raw)


@dataclass(frozen=True)
class Capabilities:
    """A dataset's optional methods, each bound, or None when it lacks them.

    ``fetch`` is set only when reads should run on the event loop (map-style,
    ``fetch`` and ``decode`` present, ``use_async_fetch`` not false); ``read``
    only with ``decode``; ``iter_raw`` only for an iterable dataset that splits
    its work (``decode`` present, ``use_iter_raw`` not false).  ``decode`` always
    takes ``(raw, index)``.  ``close_io`` is kept only when reads run on the loop.
    """

    iterable: bool
    fetch: Callable[[Any], Awaitable[Any]] | None = None
    read: Callable[[Any], Any] | None = None
    decode: Callable[[Any, Any], Any] | None = None
    decode_into: Callable[[Any, Any, Any], Any] | None = None
    getitems: Callable[[list[Any]], Any] | None = None
    sample_source: Callable[[Any], str | None] | None = None
    close_io: Callable[[], Awaitable[None]] | None = None
    set_rank: Callable[[int, int], None] | None = None
    iter_raw: Callable[[], Iterable[Any]] | None = None

    @property
    def use_fetch(self) -> bool:
        """Reads run on the event loop (``fetch``), decoding in the threads."""
        return self.fetch is not None

    @property
    def has_read(self) -> bool:
        """Samples are read then decoded (``read`` + ``decode``) in the threads."""
        return self.read is not None

    @classmethod
    def of(cls, dataset: Any) -> Capabilities:
        """Read ``dataset``'s capabilities (warns once for a deprecated form)."""
        decode = _method(dataset, "decode")
        sample_source = _method(dataset, "sample_source")
        if is_iterable_dataset(dataset):
            iter_raw = _method(dataset, "iter_raw")
            split = bool(getattr(dataset, "use_iter_raw", True))
            if not split or iter_raw is None or decode is None:
                iter_raw = decode = None
            return cls(iterable=True, sample_source=sample_source,
                       set_rank=_method(dataset, "set_rank"), iter_raw=iter_raw,
                       decode=_iterable_decode(dataset, decode) if decode else None)
        fetch = _method(dataset, "fetch")
        use_fetch = (fetch is not None and decode is not None
                     and bool(getattr(dataset, "use_async_fetch", True)))
        read = _method(dataset, "read")
        return cls(iterable=False,
                   fetch=fetch if use_fetch else None,
                   read=read if decode is not None else None,
                   decode=decode,
                   decode_into=_method(dataset, "decode_into"),
                   getitems=getattr(dataset, "__getitems__", None) or None,
                   sample_source=sample_source,
                   close_io=_method(dataset, "close_io") if use_fetch else None)
