"""torch's intra-op threads (OpenMP), set for the calling thread alone.

The loader's threads are its parallelism: a torch op one of them calls (a user
transform in a decode thread, or the loader's own ``stack`` and ``copy_`` of a
run of rows into a batch's buffers) would otherwise start an OpenMP team whose
threads spin after each op, on the cores the loader and the consumer need: in
an inline epoch of the outcome bench's ``audio`` rows, 20 to 40 ms of a second
thread's CPU for the row writes of 128 batches (``docs/architecture.md``).
DataLoader's workers call ``torch.set_num_threads(1)``, which is global in one
process; OpenMP's thread count is per thread, so these set it for the calling
thread only:

* :func:`one_intraop_thread` for good (the decode threads' initializer);
* :func:`alone` for a block (the loader's own copies in the consumer's thread,
  whose count is the user's: restored after the block).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

__all__ = ["alone", "one_intraop_thread"]


def _find_openmp() -> tuple[Callable[[int], None], Callable[[], int]] | None:
    """The loaded OpenMP runtime's ``omp_set_num_threads`` and ``omp_get_max_threads``,
    when torch parallelises with OpenMP (Linux builds); None elsewhere."""
    try:
        import torch
        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return None
        with open("/proc/self/maps") as maps:
            libs = sorted({line.split()[-1] for line in maps
                           if line.rstrip().endswith((".so", ".so.1")) and
                           ("libgomp" in line or "libiomp" in line)})
        for lib in libs:
            so = ctypes.CDLL(lib)
            set_n = getattr(so, "omp_set_num_threads", None)
            get_n = getattr(so, "omp_get_max_threads", None)
            if set_n is not None and get_n is not None:
                set_n.argtypes, set_n.restype = [ctypes.c_int], None
                get_n.argtypes, get_n.restype = [], ctypes.c_int
                return set_n, get_n
    except Exception:  # noqa: BLE001 - an optimisation, never a reason to fail
        return None
    return None


_openmp = _find_openmp()


def one_intraop_thread() -> None:
    """Make torch ops called in this thread run on this thread alone, for good."""
    if _openmp is None:
        return
    import torch
    torch.get_num_threads()  # torch's lazy per-thread init would reset the count
    _openmp[0](1)


class alone:  # noqa: N801 - used as a context manager, named as one
    """``with alone():`` torch ops called in this thread inside the block run on this
    thread alone; the thread's own count is back after it (an exception
    included).  A class, not a generator: it wraps each stack of a run of rows,
    and costs a few tenths of a microsecond where the count is 1 already."""

    __slots__ = ("_n",)

    def __enter__(self) -> None:
        self._n = 0
        if _openmp is not None:
            n = _openmp[1]()
            if n > 1:
                _openmp[0](1)
                self._n = n

    def __exit__(self, *exc: object) -> None:
        if self._n:
            _openmp[0](self._n)  # type: ignore[index]  # set only where it is found
