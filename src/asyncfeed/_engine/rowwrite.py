"""Writing samples into the rows of a batch's host buffers.

:class:`FlatWriter` writes a sample that is a flat tuple or dict of NumPy arrays,
tensors and Python scalars (the common ``(image, label)``, or ``{"image": ...,
"label": ...}``) with one copy per leaf, or a whole run of rows column by
column; :func:`write_one` falls back to :meth:`Layout.write_row` for every other
sample.  Nothing here knows a pass: a sample that does not fit the layout
raises ``LayoutMismatch`` to the caller (``samples.SampleRows.write``, where the
batch then turns to collating).
"""

from __future__ import annotations

import math
import statistics
from time import thread_time
from typing import Any

import numpy as np
import torch

from .._memory.layout import _PY_SCALARS, Layout, _Leaf
from . import intraop
from .duel import PolicyConfig, spread

__all__ = ["BULK_ROW_BYTES", "HOLD_GIL_BYTES", "FlatWriter", "StackWays", "write_one"]


#: rows of at most this many bytes are copied holding the GIL (a memcpy: ~10 us for a
#: 3x224x224 uint8 image).  NumPy lets go of the GIL for every copy; when other threads
#: wait for it, each release hands it over and taking it back costs two context
#: switches, more than the copy (the "ceiling" bench workload).  Bigger rows are
#: copied by NumPy, the GIL released.
HOLD_GIL_BYTES = 1 << 19
#: a batch written in bulk (see :func:`write_deferred`) copies NumPy array leaves of
#: at least this many bytes a row with one ``torch.stack`` that lets go of the GIL
#: once; smaller arrays are copied one by one holding it (cheaper than wrapping each
#: in a tensor).  Tensor leaves are stacked at any size.
BULK_ROW_BYTES = 1 << 15
#: the duel's parameters: their ``like_windows`` and ``max_rounds`` set the rounds a
#: leaf's stacking ways are judged in (:class:`StackWays`), as a close duel's are
_RUNS = PolicyConfig()


class StackWays:
    """Which way one tensor leaf's runs have their rows' dtypes read, measured on
    the leaf's own runs:

    * *check*: each row's dtype read in Python, then ``torch.stack(out=)`` into
      the batch's buffers (which would cast a row of another dtype);
    * *copy*: ``torch.stack`` into a new tensor, whose dtype is what
      ``default_collate`` returns (a row of another dtype promotes it), then one
      copy into the buffers.

    The check costs a Python attribute read a row, the copy the run's bytes once
    more: which is cheaper depends on the row's size and on the machine
    (``bench/row_writes.py --stack``), so it is measured, as the execution is
    (:func:`.duel.judge`).  The ways alternate, check first; a run is read in
    the writing thread's CPU seconds a row (``time.thread_time``: a run the
    thread waited through, for the GIL or a core, reads what its work cost),
    and each way's first run is left out (it pays for first touches the later
    ones do not).  The runs are judged in rounds, as a close duel of executions
    is (``PolicyConfig.like_windows`` runs a way in the first round, twice as
    many in all after each further one, up to ``PolicyConfig.max_rounds``): the
    way whose median reads cheaper by more than the spread between like runs
    (:func:`.duel.spread`, of either way) is kept; where neither leads by that
    much the runs go on to the next round, and after the last the check way
    stays, which writes no bytes twice.  A leaf's first runs after a start
    still pay for the allocator's first touches, the copy way's most (it
    allocates a run's bytes), so a round that only saw those is not the last
    word; while the ways alternate either writes the same bytes, so measuring
    on costs only the two clock readings a run.

    The batch's bytes are the same either way (a run with a narrower row, which
    the check way declines, is then written row by row, as the copy way promotes
    it), so the choice moves only the cost; threads that race on the readings
    lose a reading, never a row."""

    def __init__(self) -> None:
        #: each way's runs, CPU seconds a row, its first (cold) run left out
        self.check: list[float] = []
        self.copy: list[float] = []
        self._runs = {False: 0, True: 0}   # runs recorded each way, the cold one too
        self._round = 0
        self.kept: bool | None = None   # True: copy, False: check, None: measuring

    def next(self) -> bool:
        """Whether the next run takes the copy way."""
        if self.kept is not None:
            return self.kept
        return self._runs[True] < self._runs[False]

    def record(self, copy: bool, seconds: float, rows: int) -> None:
        """A run of ``rows`` rows written the ``copy`` way (or not) in ``seconds``
        of the writing thread's CPU time."""
        if self.kept is not None or rows <= 0:
            return
        self._runs[copy] += 1
        if self._runs[copy] == 1:
            return
        (self.copy if copy else self.check).append(seconds / rows)
        want = _RUNS.like_windows << self._round
        if len(self.check) < want or len(self.copy) < want:
            return
        margin = max(spread(self.check), spread(self.copy))
        check, copied = statistics.median(self.check), statistics.median(self.copy)
        if check > copied * (1 + margin):
            self.kept = True
        elif copied > check * (1 + margin) or self._round + 1 >= _RUNS.max_rounds:
            self.kept = False
        else:
            self._round += 1


def _stack_measured(ways: StackWays, col: Any, shape: Any, dtype: Any, out: Any) -> bool:
    """:func:`_stack_tensors` the way ``ways`` asks for, the run timed until it keeps
    one (a kept way reads no clock: ``thread_time`` is a system call).  The copies
    run on the calling thread alone (:class:`.intraop.alone`: inline, the
    consumer's thread, whose torch thread count is the user's)."""
    with intraop.alone():
        if ways.kept is not None:
            return _stack_tensors(col, shape, dtype, out, ways.kept)
        copy, t0 = ways.next(), thread_time()
        if not _stack_tensors(col, shape, dtype, out, copy):
            return False
    ways.record(copy, thread_time() - t0, len(col))
    return True


def _copy_row(dst: Any, row: int, x: Any, nbytes: int) -> None:
    """``dst[row] = x`` (same shape and dtype), holding the GIL when the row is small
    and both sides are C-contiguous; byte for byte what NumPy's assignment writes."""
    if nbytes <= HOLD_GIL_BYTES and x.flags.c_contiguous:
        try:
            memoryview(dst).cast("B")[row * nbytes:(row + 1) * nbytes] = \
                memoryview(x).cast("B")
            return
        except (TypeError, ValueError):
            pass  # a format memoryview cannot cast (complex): NumPy's copy below
    dst[row] = x


class FlatWriter:
    """Writes a sample that is one array, or a flat tuple, list or dict of arrays,
    Python scalars and strings, into its row with one copy per leaf
    (:meth:`write`), or the rows of a whole task column by column
    (:meth:`write_rows`).

    Both return False (having written nothing that matters) whenever a sample is
    not exactly of that kind; the caller then uses ``Layout.write_row``, which
    handles every other case and raises ``LayoutMismatch`` where it must.  The
    bytes written are the ones ``write_row`` writes.
    """

    def __init__(self, layout: Layout) -> None:
        skel = layout.skeleton
        self.single = isinstance(skel, _Leaf)
        self.container = None if self.single else type(skel)
        #: a dict sample's keys, in the skeleton's order (None: not a dict)
        self.keys: tuple[Any, ...] | None = tuple(skel) if type(skel) is dict else None
        leaves = [skel] if self.single else list(skel.values()) if self.keys is not None \
            else list(skel)
        self.k = len(leaves)
        self.specs = []
        for leaf in leaves:
            s = layout.specs[leaf.j]
            nbytes = 0
            if s.kind in ("tensor", "ndarray") and s.dtype is not None:
                nbytes = math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size()
            self.specs.append((leaf.j, s.kind, s.shape, s.dtype, nbytes))
        #: per leaf, how its tensor runs are stacked (measured: :class:`StackWays`)
        self.ways = [StackWays() for _ in leaves]

    @property
    def row_bytes(self) -> int:
        """The bytes of a row's array and tensor leaves (scalars and strings not
        counted)."""
        return sum(spec[4] for spec in self.specs)

    @classmethod
    def for_layout(cls, layout: Layout) -> FlatWriter | None:
        skel = layout.skeleton
        flat = isinstance(skel, _Leaf) or (
            type(skel) in (tuple, list) and all(isinstance(x, _Leaf) for x in skel)) or (
            type(skel) is dict and all(isinstance(x, _Leaf) for x in skel.values()))
        return cls(layout) if flat else None

    def _leaves(self, sample: Any) -> Any:
        """The leaves of ``sample`` in the layout's order, or None where it is not a
        sample of this writer's kind (another container, length or keys)."""
        if self.single:
            return (sample,)
        if type(sample) is not self.container or len(sample) != self.k:
            return None
        if self.keys is None:
            return sample
        try:
            return [sample[key] for key in self.keys]
        except KeyError:
            return None

    def write(self, bufs: list[Any], views: list[Any], row: int, sample: Any) -> bool:
        leaves = self._leaves(sample)
        if leaves is None:
            return False
        for (j, kind, shape, dtype, nbytes), x in zip(self.specs, leaves):
            v = views[j]
            if kind == "list":
                if type(x) is not str and type(x) is not bytes:
                    return False
                bufs[j][row] = x
            elif v is None:
                return False
            elif kind == "scalar":
                if _PY_SCALARS.get(type(x)) != dtype:
                    return False
                v[row] = x
            elif type(x) is np.ndarray:
                if x.shape != shape or x.dtype != v.dtype:
                    return False
                _copy_row(v, row, x, nbytes)
            elif type(x) is torch.Tensor:
                if not _plain_tensor(x, shape, dtype):
                    return False
                buf = bufs[j]
                if x.data_ptr() == buf.data_ptr() + row * buf.stride()[0] * buf.element_size() \
                        and x.stride() == buf.stride()[1:]:
                    continue  # decode_into already wrote it
                _copy_row(v, row, x.numpy(), nbytes)
            else:
                return False
        return True

    def _columns(self, rows: list[Any]) -> Any:
        """The leaves of ``rows``, one column a leaf in the layout's order; None where
        a row is not of the layout's container or number of leaves."""
        if self.single:
            return (rows,)
        if self.keys is None and set(map(type, rows)) == {self.container}:
            try:  # tuples or lists: the rows are their leaves
                columns = list(zip(*rows, strict=True))
            except ValueError:
                return None  # rows of unequal lengths
            return columns if len(columns) == self.k else None
        flat = [self._leaves(s) for s in rows]
        if any(leaves is None for leaves in flat):
            return None
        return zip(*flat)

    def write_rows(self, bufs: list[Any], views: list[Any], lo: int, hi: int,
                   samples: list[Any], bulk: bool = False) -> bool:
        """Write ``samples[lo:hi]`` into rows ``lo..hi``, one leaf at a time: each
        leaf's values are checked for the whole run first, scalars go in with one
        NumPy assignment.  With ``bulk``, array leaves of at least
        ``BULK_ROW_BYTES`` a row, and leaves whose first row is a tensor, go in
        with one ``torch.stack`` (one release of the
        GIL for the whole copy), else row by row (:func:`_copy_row`).  For samples
        ``__getitem__`` returned (never a view of the batch's own buffers).  May
        raise what a NumPy assignment raises (an int too large for int64): the
        caller then writes row by row."""
        columns = self._columns(samples[lo:hi])
        if columns is None:
            return False
        for (j, kind, shape, dtype, nbytes), ways, col in zip(self.specs, self.ways, columns):
            v = views[j]
            if bulk and v is not None and kind != "scalar" and kind != "list" \
                    and type(col[0]) is torch.Tensor:
                if not _stack_measured(ways, col, shape, dtype, bufs[j][lo:hi]):
                    return False
                continue
            if kind == "list":
                for x in col:
                    if type(x) is not str and type(x) is not bytes:
                        return False
                bufs[j][lo:hi] = col
            elif v is None:
                return False
            elif kind == "scalar":
                # one Python type for the run, the leaf's (the set is built in C)
                types = set(map(type, col))
                if len(types) != 1 or _PY_SCALARS.get(types.pop()) != dtype:
                    return False
                v[lo:hi] = col
            else:
                vdtype = v.dtype
                # arrays (or arrays and tensors) stack from BULK_ROW_BYTES a row
                stacked = bulk and nbytes >= BULK_ROW_BYTES
                arrays: list[Any] = []
                for x in col:
                    if type(x) is np.ndarray:
                        if x.shape != shape or x.dtype != vdtype:
                            return False
                        if stacked:
                            if not x.flags.writeable:
                                stacked = False  # torch would warn: NumPy copies it
                                arrays = [a.numpy() if type(a) is torch.Tensor else a
                                          for a in arrays]
                            else:
                                x = torch.from_numpy(x)
                    elif type(x) is torch.Tensor and stacked:
                        # torch.stack resolves conjugate and negative views itself,
                        # and refuses other devices and tensors that need grad
                        if x.shape != shape or x.dtype != dtype:
                            return False
                    elif type(x) is torch.Tensor and _plain_tensor(x, shape, dtype):
                        x = x.numpy()
                    else:
                        return False
                    arrays.append(x)
                if stacked:
                    with intraop.alone():  # as in _stack_measured
                        torch.stack(arrays, out=bufs[j][lo:hi])
                    continue
                if nbytes < BULK_ROW_BYTES and _joined(v, lo, hi, nbytes, arrays):
                    continue
                row = lo
                for x in arrays:
                    _copy_row(v, row, x, nbytes)
                    row += 1
        return True


def _stack_tensors(col: Any, shape: tuple[int, ...], dtype: Any, out: torch.Tensor,
                   copy: bool) -> bool:
    """``out[:] = torch.stack(col)`` for a column of tensors of ``shape`` and
    ``dtype``: one stack, in C, for the whole run (a tensor row's NumPy view
    costs more than its copy).  The first row's shape is checked here and the
    rest by ``torch.stack``, which refuses rows of unequal shape.  The rows'
    dtypes are read the ``copy`` way or the check way (:class:`StackWays`).
    False (the caller writes the rows again row by row) for a run it cannot
    write so: a row that is no plain tensor, another shape or dtype, a tensor
    that needs grad or lives on another device."""
    if col[0].shape != shape:
        return False
    if not copy:
        if set(map(type, col)) != {torch.Tensor} or {x.dtype for x in col} != {dtype}:
            return False
        try:
            torch.stack(col, out=out)
        except RuntimeError:
            return False
        return True
    try:
        stacked = torch.stack(col)
    except (RuntimeError, TypeError):
        return False
    # one look at the stack stands for a look at each row: a row of a tensor
    # subclass makes the stack that subclass, one that needs grad makes it need it
    if type(stacked) is not torch.Tensor or stacked.dtype != dtype \
            or stacked.requires_grad or stacked.device != out.device:
        return False
    out.copy_(stacked)
    return True


def _joined(dst: Any, lo: int, hi: int, nbytes: int, arrays: list[Any]) -> bool:
    """``dst[lo:hi] = arrays`` (rows of ``nbytes`` bytes, dtype and shape checked) as
    one ``bytes.join`` and one copy into ``dst``: a third of the time of a copy
    per row for small rows (0.16 against 0.5 us for a 3 KB row), the GIL held
    throughout (``bytes.join`` lets go of it once, above 1 MB).  False, nothing
    written, where a row is not C-contiguous (NumPy refuses the plain buffer
    ``bytes.join`` asks for, before anything is written) or ``dst`` has no byte
    view."""
    try:
        out = memoryview(dst).cast("B")
        out[lo * nbytes:hi * nbytes] = b"".join(arrays)
    except (TypeError, ValueError, BufferError, NotImplementedError):
        return False
    return True


def _plain_tensor(x: torch.Tensor, shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether NumPy can copy ``x`` as a row of ``shape`` and ``dtype``."""
    return (x.shape == shape and x.dtype == dtype and x.device.type == "cpu"
            and not x.requires_grad and not x.is_conj() and not x.is_neg())


def write_one(layout: Layout, writer: FlatWriter | None, bufs: list[Any], views: Any,
              row: int, sample: Any) -> None:
    """Write ``sample`` into ``row``: through ``writer`` when it takes the sample, else
    ``layout.write_row``.  Raises ``LayoutMismatch`` when the sample does not fit, and
    what a copy raises (an int too large for its dtype)."""
    if writer is None or not writer.write(bufs, views, row, sample):
        layout.write_row(bufs, row, sample, views)
