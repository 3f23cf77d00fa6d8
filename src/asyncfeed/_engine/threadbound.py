"""Data sets bound to the thread that made them: their rows fail in decode threads.

Some objects may be used only in the thread that created them: a ``sqlite3``
connection opened in ``__init__`` raises ``ProgrammingError`` in any other thread;
``signal.signal`` raises ``ValueError`` outside the main thread.
DataLoader runs such a data set in the consumer's thread (``num_workers=0``) or in
worker processes forked from it (the forking thread goes on in the child, with the
same thread id), and both work; in decode threads every row fails.

With ``execution="auto"`` (a chooser with candidates to measure), the consumer
looks at the first failed row of a map-style batch before raising or skipping it:

1. it loads the row itself; if that fails too, the row is bad for its own reasons:
   nothing changes, now or later in the loader's life;
2. if it loads, it loads the row once more in a new thread; if that loads, the
   failure was a passing one (a flaky read): nothing changes either, and the
   failure stands as it was;
3. if it fails in the new thread, the data set is bound to the consumer's thread:
   the chooser leaves threads out and measures what runs rows where the consumer's
   thread runs them -- inline, and worker processes forked from it -- keeping the
   faster as it keeps any candidate (where only one of them may run, it runs:
   :meth:`.Chooser.without_threads`); from then on every row that failed elsewhere
   is loaded again here before it counts as failed; the batch then holds the rows
   loaded here, in their places.

So the finding costs one row loaded twice more, once per loader, and a data set
whose rows fail for their own reasons is never slowed by it.
"""

from __future__ import annotations

import threading
from typing import Any

from .._errors import is_fatal
from .batch import Batch, BatchMode
from .chooser import Chooser

__all__ = ["retry_here"]


def retry_here(b: Batch, dataset: Any, chooser: Chooser) -> bool:
    """(consumer thread) Load again here the failed rows of ``b`` where the data set
    is bound to this thread (found as the module says): the rows that load leave
    ``b.failures`` and join ``b.good_samples_host`` in their places; the others keep
    failing, with what they raised here.  Returns whether it loaded rows here (the
    batch's own output then lacks them: it is made from ``b.good_samples_host``).
    Does nothing for a batch loaded whole (``__getitems__``), for a fatal failure,
    or once the loader found the data set not bound."""
    if not b.failures or b.mode not in (BatchMode.RING, BatchMode.COLLATE) \
            or chooser.thread_bound is False:
        return False
    loaded: dict[int, Any] = {}
    if chooser.thread_bound is None:
        row, idx, e = min(b.failures, key=lambda f: f[0])
        if not chooser.here_candidates() or e is None or is_fatal(e):
            return False
        ok, got = _load_here(dataset, idx)
        if not ok:  # a bad row: it fails here too
            chooser.thread_bound = False
            return False
        loaded[row] = got
        if _loads_in_a_new_thread(dataset, idx):
            chooser.thread_bound = False  # a passing failure: it stands
            return False
        chooser.without_threads()
    still: list[tuple[int, Any, BaseException | None]] = []
    for row, idx, _ in b.failures:
        if row in loaded:
            continue
        ok, got = _load_here(dataset, idx)
        if ok:
            loaded[row] = got
        else:  # fails here too: a bad row
            still.append((row, idx, got))
    good = iter(b.good_samples_host)
    failed = {row for row, _, _ in still}
    merged = []
    for row, idx in enumerate(b.indices):
        if row in loaded:
            merged.append((idx, loaded[row]))
        elif row not in failed:
            merged.append(next(good))
    b.good_samples_host, b.failures = merged, still
    return bool(loaded)


def _load_here(dataset: Any, idx: Any) -> tuple[bool, Any]:
    """``(True, dataset[idx])``, or ``(False, what it raised)``.  A frame of its own:
    the exception's traceback holds this frame, not the caller's (whose locals hold
    the batch and the other failures: a cycle only the garbage collector frees)."""
    try:
        return True, dataset[idx]
    except Exception as e:  # noqa: BLE001 - the row's failure, handed back
        return False, e


def _loads_in_a_new_thread(dataset: Any, idx: Any) -> bool:
    """Whether ``dataset[idx]`` loads in a thread of its own (started and joined
    here; a row that hangs there hangs the consumer with it, as it would inline)."""
    result: list[bool] = []

    def load() -> None:
        try:
            dataset[idx]
        except Exception:  # noqa: BLE001 - the answer, not an error
            result.append(False)
        else:
            result.append(True)

    t = threading.Thread(target=load, name="asyncfeed-thread-check")
    t.start()
    t.join()
    return bool(result and result[0])
