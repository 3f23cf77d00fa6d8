"""Fixed-shape samples: batch buffers filled row by row, no collate copy.

A :class:`Layout` is read off one sample.  It knows the sample's structure
(tuples, lists, dicts, namedtuples, nested) and each leaf's shape and dtype, so a
batch can be preallocated and each decode thread can write its sample into its
own row.  The batch is then assembled by torch's own ``collate`` walking a
skeleton of the sample whose leaves are replaced by the filled buffers, so the
containers come out exactly as ``default_collate`` makes them.
"""

from __future__ import annotations

import math
import mmap
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate

_PY_SCALARS: dict[type, torch.dtype] = {int: torch.int64, float: torch.float64,
                                        bool: torch.bool}

# dtypes NumPy can view: rows are copied with NumPy, because torch's copy_ called
# from a non-main thread costs several times more CPU (it sets up an OpenMP team)
_NUMPY_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                           torch.float16, torch.float32, torch.float64, torch.bool,
                           torch.complex64, torch.complex128})


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    """An uninitialised CPU tensor in memory of its own (an anonymous mapping) when it
    is a page or more, else ``torch.empty``.

    A batch buffer outlives the allocations a pass makes around it (decoded images,
    read buffers, thread state), and the pool drops its buffers at the end of every
    pass.  From the C heap, each pass's buffers would land above what the last one
    left, and the holes they leave are split by smaller allocations before a
    buffer of their size comes back: the heap grows pass after pass, nearly all
    of it free (``tests/faults/test_fault_memory.py``).  A mapping goes back to
    the system whole when the last tensor over it is freed.
    """
    dtype = dtype or torch.get_default_dtype()
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < mmap.PAGESIZE:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # "The given buffer is not writable": it is
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype)
    return flat.view(shape)


class LayoutMismatch(ValueError):
    """A sample does not have the structure, shape or dtype of the first one."""


class _Leaf:
    __slots__ = ("j",)

    def __init__(self, j: int) -> None:
        self.j = j


class _LeafSpec:
    __slots__ = ("kind", "shape", "dtype")

    def __init__(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> None:
        self.kind = kind          # "tensor" | "ndarray" | "scalar" | "list"
        self.shape = shape
        self.dtype = dtype


def _is_namedtuple(x: object) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


class Layout:
    """The shape of one sample, and how to write samples into batch buffers."""

    def __init__(self, skeleton: Any, specs: list[_LeafSpec]) -> None:
        self.skeleton = skeleton
        self.specs = specs
        # the first array leaf: where a dataset's decode_into writes directly
        self.primary = next((j for j, s in enumerate(specs)
                             if s.kind in ("tensor", "ndarray")), None)
        # a plain tuple of leaves (an (image, label) sample): assembled without
        # default_collate's walk (see assemble)
        self._flat_tuple = type(skeleton) is tuple and all(type(x) is _Leaf for x in skeleton)
        # the objects of one sample the garbage collector counts (its containers and
        # tensors; NumPy arrays and scalars are not of its types): what a row held
        # until it is written adds to the young generation (see ``gcpauses``)
        self.gc_objects = _containers(skeleton) + sum(s.kind == "tensor" for s in specs)

    @classmethod
    def infer(cls, sample: Any) -> Layout | None:
        """The layout of ``sample``, or None when it cannot go through buffers."""
        specs: list[_LeafSpec] = []
        try:
            skeleton = _skeleton(sample, specs)
        except _NotFixed:
            return None
        if not any(s.kind in ("tensor", "ndarray") for s in specs):
            return None  # nothing big to place: collating a few scalars is as cheap
        return cls(skeleton, specs)

    def flatten(self, sample: Any) -> list[Any]:
        """The leaves of ``sample`` in skeleton order; raises LayoutMismatch."""
        out: list[Any] = []
        _leaves(self.skeleton, sample, out)
        return out

    def allocate(self, n: int, pin: bool = False) -> list[Any]:
        """Uninitialised buffers for ``n`` samples: pinned when asked, else in memory of
        their own (see :func:`mapped_empty`)."""
        bufs: list[Any] = []
        for s in self.specs:
            if s.kind == "list":
                bufs.append([None] * n)
            elif pin:
                bufs.append(torch.empty((n, *s.shape), dtype=s.dtype, pin_memory=True))
            else:
                bufs.append(mapped_empty((n, *s.shape), s.dtype))
        return bufs

    def row_out(self, bufs: list[Any], row: int) -> torch.Tensor | None:
        """The row of the primary array leaf, for a dataset's ``decode_into``."""
        return None if self.primary is None else bufs[self.primary][row]

    def numpy_views(self, bufs: list[Any]) -> list[Any]:
        """NumPy views of the host buffers NumPy can address (None for the others), for
        ``write_row``: decode threads write through NumPy, which is cheaper there."""
        out: list[Any] = []
        for s, buf in zip(self.specs, bufs):
            if s.kind != "list" and s.dtype in _NUMPY_DTYPES and buf.device.type == "cpu":
                out.append(buf.numpy())
            else:
                out.append(None)
        return out

    def write_row(self, bufs: list[Any], row: int, sample: Any,
                  views: list[Any] | None = None) -> None:
        """Copy ``sample`` into row ``row``; leaves already in place are not copied.

        ``views`` (from ``numpy_views(bufs)``) saves making them per row.
        """
        leaves = self.flatten(sample)
        for j, s in enumerate(self.specs):
            x, buf = leaves[j], bufs[j]
            if s.kind == "list":
                if type(x) is not str and type(x) is not bytes:
                    raise LayoutMismatch(f"leaf {j}: expected str or bytes, got {type(x).__name__}")
                buf[row] = x
                continue
            v = views[j] if views is not None else None
            if s.kind == "scalar":
                if type(x) not in _PY_SCALARS or _PY_SCALARS[type(x)] != s.dtype:
                    raise LayoutMismatch(
                        f"leaf {j}: expected a Python {s.dtype}, got {type(x).__name__}")
                # torch's __setitem__ costs several times more, in a thread
                (v if v is not None else buf.numpy())[row] = x
                continue
            if isinstance(x, np.ndarray):
                if x.dtype.kind not in "biuf" or not x.dtype.isnative:
                    raise LayoutMismatch(f"leaf {j}: unsupported array dtype {x.dtype}")
                x = torch.from_numpy(x) if x.ndim else torch.as_tensor(x)
            elif not isinstance(x, torch.Tensor):
                raise LayoutMismatch(f"leaf {j}: expected an array, got {type(x).__name__}")
            if tuple(x.shape) != s.shape or x.dtype != s.dtype:
                raise LayoutMismatch(
                    f"leaf {j}: shape {tuple(x.shape)} {x.dtype} differs from the batch's "
                    f"{s.shape} {s.dtype} (default_collate cannot stack these either)")
            stride = buf.stride()
            if x.data_ptr() == buf.data_ptr() + row * stride[0] * buf.element_size() \
                    and x.stride() == stride[1:]:
                continue  # decode_into already wrote it
            if v is not None and x.device.type == "cpu" and not x.requires_grad \
                    and not x.is_conj() and not x.is_neg():
                np.copyto(v[row, ...], x.numpy())  # [row, ...]: a view even for 0-d leaves
            else:
                buf[row].copy_(x)

    def unflatten(self, leaves: list[Any]) -> Any:
        """A sample of the skeleton's structure with ``leaves`` in it."""
        return _build(self.skeleton, leaves)

    def row_sample(self, bufs: list[Any], row: int) -> Any:
        """Row ``row`` as a standalone sample (copied out of the buffers), its leaves
        of the types the layout was read off: tensors, NumPy arrays, Python scalars,
        strings (``default_collate`` collates it as it would the original)."""
        leaves = []
        for s, buf in zip(self.specs, bufs):
            if s.kind == "list":
                leaves.append(buf[row])
            elif s.kind == "scalar":
                leaves.append(buf[row].item())
            elif s.kind == "ndarray":
                leaves.append(buf[row].numpy().copy())
            else:
                leaves.append(buf[row].clone())
        return self.unflatten(leaves)

    def assemble(self, bufs: list[Any], n: int | None = None, own: bool = False) -> Any:
        """The batch, structured as ``default_collate`` would build it, of the first
        ``n`` rows of ``bufs`` (all of them: None).  With ``own`` (the tensors in
        ``bufs`` are this batch's alone, aliases lent for it), buffers of exactly
        ``n`` rows are handed out as they are rather than sliced: a slice is one
        more tensor call a batch, 40 us where the thread's caches hold the data
        set's code."""
        if n is not None:
            bufs = [b if own and len(b) == n else b[:n] for b in bufs]
        specs = self.specs
        skel = self.skeleton
        if type(skel) is _Leaf:
            return bufs[skel.j]
        if self._flat_tuple:
            # what the walk below builds for a tuple: a list, a string leaf as a tuple
            return [tuple(bufs[x.j]) if specs[x.j].kind == "list" else bufs[x.j]
                    for x in skel]

        def leaf(batch: Any, *, collate_fn_map: Any = None) -> Any:
            # ``batch`` holds this leaf as default_collate would pass its column: a
            # tuple under a sequence (zip), a list under a mapping; a column of
            # strings is returned in that same container, as default_collate does
            j = batch[0].j
            if specs[j].kind == "list" and isinstance(batch, tuple):
                return tuple(bufs[j])
            return bufs[j]

        fn_map: dict[type | tuple[type, ...], Callable[..., Any]] = {_Leaf: leaf}
        return collate([self.skeleton], collate_fn_map=fn_map)


class _NotFixed(Exception):
    pass


# The walks below are module functions, not closures: a recursive closure is a
# reference cycle (function -> cell -> function) that keeps everything it saw,
# a decoded row included, alive until the garbage collector runs, and a batch
# buffer with a live row cannot go back to the host pool.

def _skeleton(x: Any, specs: list[_LeafSpec]) -> Any:
    """``x`` with each leaf replaced by a ``_Leaf``; appends the leaves' specs."""
    t = type(x)
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.is_nested or x.requires_grad \
                or x.device.type != "cpu":
            raise _NotFixed
        specs.append(_LeafSpec("tensor", tuple(x.shape), x.dtype))
    elif isinstance(x, np.ndarray):
        if x.dtype.kind not in "biuf" or not x.dtype.isnative:
            raise _NotFixed
        specs.append(_LeafSpec("ndarray", x.shape, torch.from_numpy(x[:0].copy()).dtype
                               if x.ndim else torch.as_tensor(x).dtype))
    elif t in _PY_SCALARS:
        specs.append(_LeafSpec("scalar", (), _PY_SCALARS[t]))
    elif t is str or t is bytes:
        specs.append(_LeafSpec("list", (), None))
    elif _is_namedtuple(x):
        return t(*(_skeleton(v, specs) for v in x))
    elif t is tuple or t is list:
        return t(_skeleton(v, specs) for v in x)
    elif t is dict:
        return {k: _skeleton(v, specs) for k, v in x.items()}
    else:
        raise _NotFixed
    return _Leaf(len(specs) - 1)


def _leaves(skel: Any, x: Any, out: list[Any]) -> None:
    """Append the leaves of ``x`` in ``skel``'s order; raises LayoutMismatch."""
    if isinstance(skel, _Leaf):
        out.append(x)
    elif isinstance(skel, Mapping):
        if not isinstance(x, Mapping) or len(x) != len(skel):
            raise LayoutMismatch(f"expected a mapping with keys {list(skel)}")
        for k, v in skel.items():
            if k not in x:
                raise LayoutMismatch(f"missing key {k!r}")
            _leaves(v, x[k], out)
    else:
        if type(x) is not type(skel) or len(x) != len(skel):
            raise LayoutMismatch(
                f"expected a {type(skel).__name__} of {len(skel)} items, got "
                f"{type(x).__name__}" + (f" of {len(x)}" if hasattr(x, "__len__") else ""))
        for s, v in zip(skel, x):
            _leaves(s, v, out)


def _containers(skel: Any) -> int:
    """How many containers (tuples, lists, dicts) ``skel`` has, itself included."""
    if isinstance(skel, _Leaf):
        return 0
    return 1 + sum(_containers(v) for v in (skel.values() if isinstance(skel, dict) else skel))


def _build(skel: Any, leaves: list[Any]) -> Any:
    """A sample of ``skel``'s structure with ``leaves`` in it."""
    if isinstance(skel, _Leaf):
        return leaves[skel.j]
    if isinstance(skel, dict):
        return {k: _build(v, leaves) for k, v in skel.items()}
    if _is_namedtuple(skel):
        return type(skel)(*(_build(v, leaves) for v in skel))
    return type(skel)(_build(v, leaves) for v in skel)
