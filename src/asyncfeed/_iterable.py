"""One pass over an IterableDataset.

An iterator cannot be advanced from two threads at once, so batches are made
one at a time: each task takes the iterator's lock, pulls ``batch_size``
samples, collates them and starts the device copy, while the consumer trains on
earlier batches.  Batch numbers follow the stream, so the order is DataLoader's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ._device import CopyStream
from ._pipeline import Batch, LayoutHolder, Pipeline
from ._runtime import Runtime

MAX_CONSECUTIVE_ERRORS = 100


class IterablePipeline(Pipeline):
    """Pipeline over ``iter(dataset)``; ``on_error="skip"`` pulls past failures."""

    def __init__(self, *, dataset: Any, batch_size: int | None, drop_last: bool,
                 collate: Callable[[list[Any]], Any], runtime: Runtime, prefetch: int,
                 copy: CopyStream | None, pin_host: bool, skip: bool) -> None:
        super().__init__(dataset=dataset, plan=iter(()), auto_collation=batch_size is not None,
                         collate=collate, default_collate=False,
                         layouts=LayoutHolder(False), runtime=runtime, prefetch=prefetch,
                         io_concurrency=0, use_fetch=False, copy=copy, pin_host=pin_host,
                         ring=lambda layout, n: None, batch_size=batch_size)
        self.it = iter(dataset)  # in the caller's thread, at iter(), as DataLoader does
        self.drop_last = drop_last
        self.skip = skip
        self.it_lock = threading.Lock()
        self.position = 0        # samples pulled from the stream so far
        self.made = 0            # batches numbered so far

    def top_up(self) -> None:
        with self.cond:
            want = 0
            while not self.exhausted and self.submitted - self.taken < self.prefetch:
                self.submitted += 1
                want += 1
        for _ in range(want):
            if self.runtime.submit(self._produce) is None:
                with self.cond:
                    self.exhausted = True
                    self.submitted -= 1
                    self.cond.notify_all()

    def _produce(self) -> None:
        if self.stopping:
            return
        with self.it_lock:
            if self.exhausted:
                self._produced_nothing()
                return
            size = self.batch_size or 1
            samples: list[Any] = []
            failures: list[tuple[int, Any, BaseException]] = []
            ended = False
            errors_in_row = 0
            while len(samples) < size:
                pos = self.position
                try:
                    sample = next(self.it)
                except StopIteration:
                    ended = True
                    break
                except BaseException as e:  # noqa: BLE001 - travels to the consumer
                    self.position += 1
                    failures.append((len(samples), pos, e))
                    errors_in_row += 1
                    if not self.skip or errors_in_row >= MAX_CONSECUTIVE_ERRORS:
                        break
                    continue
                errors_in_row = 0
                self.position += 1
                samples.append(sample)
            if ended:
                with self.cond:
                    self.exhausted = True
            if not samples and not failures or (
                    ended and self.drop_last and len(samples) < size and not failures):
                self._produced_nothing()
                return
            b = Batch(self.made, list(range(self.position - len(samples) - len(failures),
                                            self.position)), "collate")
            self.made += 1
            b.samples = samples
            b.failures = failures
            b.remaining = 0
            b.done[:] = b"\x01" * b.n
            with self.cond:
                self._tracked[b.k] = b
        skipped_all = self.skip and failures and len(failures) < MAX_CONSECUTIVE_ERRORS
        try:
            if samples and (not failures or skipped_all):
                host = self.collate(samples)
                b.output, b.event = self.to_target(host)
        except BaseException as e:  # noqa: BLE001
            b.error = e
        self._mark_ready(b)

    def _produced_nothing(self) -> None:
        with self.cond:
            self.submitted -= 1
            self.cond.notify_all()
