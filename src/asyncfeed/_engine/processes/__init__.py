"""The process stage: worker processes for per-sample code that holds the GIL.

Only the per-sample function (``dataset[index]``) moves to worker processes;
the plan, the event loop, batch assembly, the host pool and ring, pinned memory
and the copy stream stay in the loader's process.  The pipeline hands the stage
runs of rows (``submit``), as it hands them to the decode pool:

* the indices go to a worker over its own task queue; a worker holds at most
  ``WORKER_DEPTH`` tasks, the others wait in the stage's backlog for the first
  worker to send results back;
* a fixed-shape batch's buffers live in shared memory (:class:`ShmBuffers`, one
  ``/dev/shm`` file per buffer set): the worker maps the file and writes each
  sample's leaves straight into its row, so nothing big is pickled and nothing
  is collated in the worker; a sample that does not fit the layout (or any
  sample before the layout is known) is pickled back whole;
* a thread of this process (``asyncfeed-proc-results``) reads the results,
  places pickled samples, notes failures, and reports the rows done to the
  pipeline, which finishes the batch as it does for threads.

Workers are started lazily, with the ``multiprocessing_context`` given to the
loader (DataLoader's argument: "fork", "forkserver", "spawn" or a context), and
run ``worker_init_fn(worker_id)`` with ``torch.utils.data.get_worker_info()``
set as DataLoader sets it (id, num_workers, seed, dataset; ``random``, torch and
numpy seeded from the base seed as DataLoader seeds them).

A worker that dies (a segfault, ``os._exit``, the OOM killer) is noticed within
a tenth of a second: every row it held fails with :class:`WorkerCrashedError`
naming those samples, the stage stops taking work (the pipeline goes back to
its threads, and so do the backlog's tasks) and no one waits forever.
``close()`` (idempotent) stops the workers (terminating, then killing, one that
does not exit), joins the results thread and unlinks every shared-memory file;
the loader closes its stage at ``close()``, when it is garbage-collected and at
interpreter exit.  A loader killed outright leaves its files to its workers,
which unlink them as they notice (``remove_segments``).

The package, one job a module:

* ``shm``: buffer sets in shared memory, and the leases that clean up after a
  killed loader;
* ``transport``: what crosses the pipes (results, exceptions);
* ``worker``: a worker process's loop;
* ``stage``: :class:`ProcessStage`, the workers, their task queues and the
  results thread;
* ``handover``: a pass's batches and queued row tasks handed to the stage;
* ``taskrows``: a task's rows on the loader's side: its message, its size,
  its results put back into the batch;
* ``execution``: :class:`Execution`, the loader's stage across passes;
* ``opened``: the stages open in this process, closed at interpreter exit.
"""

from .execution import EXECUTIONS, Execution
from .handover import submit_batch, take_over_queued
from .shm import remove_segments
from .stage import ProcessStage, resolve_context
from .taskrows import rows_per_process_task
from .transport import dumps_results

__all__ = ["EXECUTIONS", "Execution", "ProcessStage", "dumps_results", "remove_segments",
           "resolve_context", "rows_per_process_task", "submit_batch", "take_over_queued"]
