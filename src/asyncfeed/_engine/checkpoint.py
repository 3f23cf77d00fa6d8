"""A loader's resume bookkeeping: the epoch, the last pass's position, a loaded
state waiting for the next pass, and the ``state_dict()`` that says all three.

:class:`Checkpoints` is owned by one :class:`~asyncfeed.AsyncLoader`; it starts
each pass's plan where a loaded state left off (:meth:`Checkpoints.start_plan`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .._errors import StateError
from .capabilities import Capabilities
from .config import LoaderConfig
from .plan import IndexPlan, _gen_state_from_str, _gen_state_to_str
from .state import LoaderState, PassProgress
from .stream import StreamTracker, has_state


def _blank_taken(plan: Iterator[Any], base: int, taken: set[int]) -> Iterator[Any]:
    """The plan with the batches already taken (out of order) replaced by empty ones."""
    for k, item in enumerate(plan, start=base):
        yield [] if k in taken else item


def _snapshotting(plan: Iterator[Any], sampler: Any, progress: PassProgress,
                  base: int) -> Iterator[Any]:
    """The plan, with the sampler's own state recorded after each batch drawn (the
    state a resume after that many batches loads into the sampler)."""
    if sampler is None:
        return plan

    def gen() -> Iterator[Any]:
        for drawn, item in enumerate(plan, start=base + 1):
            progress.snap_sampler(drawn, sampler.state_dict())
            yield item
    return gen()


def check_epoch(epoch: Any) -> None:
    """Raise ``ValueError`` unless ``epoch`` is a non-negative int."""
    if not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")


class Checkpoints:
    """Where a loader stands between and within passes.

    ``epoch``: the epoch the next pass plans.  ``last``: the position of the
    current or last pass (kept after its iterator is gone, until the next
    ``iter()``).  ``resume``: a loaded mid-pass state the next pass continues.
    ``predrawn``: a global-RNG shuffle's seed drawn early, by a ``state_dict()``
    taken between passes, so that the next pass uses it.
    """

    def __init__(self, config: LoaderConfig, dataset: Any, plan: IndexPlan, caps: Capabilities,
                 generator: torch.Generator | None, iterable: bool) -> None:
        self._config = config
        self._dataset = dataset
        self._plan = plan
        self._caps = caps
        self._generator = generator
        self._iterable = iterable
        self.epoch = 0
        self.resume: LoaderState | None = None
        self.last: PassProgress | None = None
        self.predrawn: dict[str, Any] | None = None

    # ------------------------------------------------------------------ epoch
    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch`` and forward it to the dataset and samplers that have
        ``set_epoch``."""
        self.epoch = epoch
        plan = self._plan
        for s in (self._dataset, plan.user_sampler, plan.user_batch_sampler,
                  getattr(plan.user_batch_sampler, "sampler", None)):
            if s is not None and callable(getattr(s, "set_epoch", None)):
                s.set_epoch(epoch)

    def dataset_len(self) -> int | None:
        """The dataset's length, None where it has none."""
        try:
            return len(self._dataset)
        except TypeError:
            return None

    def stateful_sampler(self) -> Any:
        """The user's batch sampler or sampler when it keeps its own state, else None."""
        for s in (self._plan.user_batch_sampler, self._plan.user_sampler):
            if s is not None and has_state(s):
                return s
        return None

    # -------------------------------------------------------------- the plan
    def start_plan(self, resume: LoaderState | None) -> tuple[Iterator[Any], PassProgress]:
        """The epoch's plan, fast-forwarded past what a loaded state had consumed,
        and the pass's progress record (where it starts)."""
        sampler = self.stateful_sampler()
        epoch = self.epoch
        if resume is None:
            predrawn, self.predrawn = self.predrawn, None
            plan, replay = self._plan.start(epoch, predrawn, predrawn=predrawn is not None)
            progress = PassProgress(epoch, replay)
            return _snapshotting(plan, sampler, progress, 0), progress
        taken = resume.batches_taken
        if resume.world_size != self._config.world_size:
            # the rest of the epoch, from the first global position not consumed
            progress = PassProgress(epoch, {}, 0, resume.offset, [], resume.carry,
                                    resharded_from=resume.offset)
            plan = self._plan.resharded(epoch, resume.offset)
            self._load_dataset_state(resume)
            return plan, progress
        origin = resume.resharded_from
        own_position = sampler is not None and resume.sampler_state is not None and taken
        if own_position:
            # a sampler with its own state resumes itself (as StatefulDataLoader does)
            sampler.load_state_dict(resume.sampler_state)
        if origin is not None:  # the pass was itself an elastic resume: replay its plan
            plan, replay = self._plan.resharded(epoch, origin), {}
        else:
            plan, replay = self._plan.start(epoch, resume.replay)
        if not own_position:
            for _ in range(taken):
                next(plan, None)
        self._load_dataset_state(resume)
        extra = set(resume.taken_extra)
        if extra:
            plan = _blank_taken(plan, taken, extra)
        progress = PassProgress(epoch, replay, taken, resume.offset, sorted(extra),
                                resume.carry, origin,
                                sampler_state=resume.sampler_state if own_position else None)
        return _snapshotting(plan, sampler, progress, taken), progress

    def _load_dataset_state(self, resume: LoaderState) -> None:
        """Load a mid-pass state's dataset state, once the resumed pass's plan has
        started: a sampler drawing its order from the global RNG draws it as in the
        interrupted pass, before a dataset whose state holds that RNG sets it (the
        order StatefulDataLoader restores them in)."""
        if resume.dataset_state is not None and has_state(self._dataset):
            self._dataset.load_state_dict(resume.dataset_state)

    # ------------------------------------------------------------ state_dict
    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands, as ``AsyncLoader.state_dict()`` describes it
        (a loaded state not yet resumed is returned as it was loaded)."""
        if self.resume is not None:
            return self.resume.to_dict()
        cfg = self._config
        st = LoaderState(epoch=self.epoch, dataset_len=self.dataset_len(),
                         batch_size=cfg.batch_size, drop_last=cfg.drop_last,
                         shuffle=self._plan.shuffle, seed=cfg.seed,
                         world_size=cfg.world_size, rank=cfg.rank, on_error=cfg.on_error)
        progress = self.last
        if progress is not None and not progress.done:
            progress.fill(st, cfg.world_size)
            if not self._iterable and has_state(self._dataset):
                st.dataset_state = self._dataset.state_dict()
            return st.to_dict()
        if self._generator is not None:
            st.replay = {"generator_state": _gen_state_to_str(self._generator)}
        elif self._plan.global_shuffle:
            if self.predrawn is None:
                self.predrawn = self._plan.predraw()
            st.replay = dict(self.predrawn)
        if has_state(self._dataset):
            st.dataset_state = self._dataset.state_dict()
        if progress is not None and progress.stream is not None:
            st.stream = progress.stream.ended()
        sampler = self.stateful_sampler()
        if sampler is not None:
            st.sampler_state = sampler.state_dict()
        return st.to_dict()

    # ------------------------------------------------------- load_state_dict
    def check(self, state: dict[str, Any]) -> LoaderState:
        """The state ``state`` describes, if this loader can continue it; raises
        :class:`StateError` otherwise (and changes nothing)."""
        st = LoaderState.from_dict(state)
        n = self.dataset_len()
        if st.dataset_len != n:
            raise StateError(f"the state was taken on a data set of {st.dataset_len} "
                             f"samples; this one has {n}")
        if st.batch_size != self._config.batch_size:
            raise StateError(f"the state was taken with batch_size={st.batch_size}; "
                             f"this loader has batch_size={self._config.batch_size}")
        if not self._iterable:
            self._check_plan_matches(st)
        elif st.in_pass and st.stream is None:
            raise StateError("this mid-stream state of an IterableDataset was written by an "
                             "older asyncfeed (state version 1), which did not record the "
                             "stream position; a state taken between passes is accepted")
        return st

    def adopt(self, st: LoaderState) -> None:
        """Take a checked state (see :meth:`check`) as where the loader stands: the
        dataset's and sampler's own states are loaded now, a mid-pass state's at the
        next pass (:meth:`start_plan`)."""
        self.last = None
        self.predrawn = None
        check_epoch(st.epoch)
        self.set_epoch(st.epoch)
        dataset = self._dataset
        if st.dataset_state is not None and has_state(dataset) \
                and (self._iterable or not st.in_pass):
            dataset.load_state_dict(st.dataset_state)   # mid-pass: see start_plan
        if self._iterable:
            self.resume = st if st.in_pass else None
            if not st.in_pass and st.stream is not None and st.stream.get("ended"):
                caps = self._caps
                StreamTracker.restore_ended(
                    lambda: iter(caps.iter_raw() if caps.iter_raw is not None
                                 else dataset), st.stream)
            return
        if not st.in_pass:
            sampler = self.stateful_sampler()
            if sampler is not None and st.sampler_state is not None:
                sampler.load_state_dict(st.sampler_state)
            if self._generator is not None and "generator_state" in st.replay:
                self._generator.set_state(_gen_state_from_str(st.replay["generator_state"]))
            elif self._plan.global_shuffle and "sampler_seed" in st.replay:
                self.predrawn = dict(st.replay)
            self.resume = None
            return
        self.resume = st

    def _check_plan_matches(self, state: LoaderState) -> None:
        """Raise StateError unless this loader can continue the plan ``state`` was in."""
        cfg, plan = self._config, self._plan
        for key, mine in (("shuffle", plan.shuffle), ("drop_last", cfg.drop_last),
                          ("seed", cfg.seed)):
            theirs = getattr(state, key)
            shown = theirs
            if key == "seed" and plan.sharded:  # a sharded plan shuffles with seed 0 by default
                theirs, mine = theirs or 0, mine or 0
            if theirs != mine:
                raise StateError(f"the state was taken with {key}={shown!r}; this "
                                 f"loader has {key}={mine!r}, so it would continue another "
                                 "order")
        if state.world_size == cfg.world_size:
            # ranks in step share one position; what is held back or taken out of
            # order is the rank's own
            if state.rank != cfg.rank and (state.carry or state.taken_extra
                                           or state.on_error == "skip"):
                raise StateError(f"the state is rank {state.rank}'s and holds that "
                                 f"rank's own progress; this loader is rank {cfg.rank} of "
                                 f"{cfg.world_size} (load each rank's own state)")
            return
        if not state.in_pass:
            return  # between passes: the next epoch starts from scratch on any world size
        if plan.user_sampler is not None or plan.user_batch_sampler is not None:
            raise StateError("resuming with another world size needs the loader's own "
                             "sharding (no custom sampler)")
        if state.taken_extra:
            raise StateError("an elastic resume (another world size) needs a state "
                             "taken with in_order=True")
        if state.on_error == "skip":
            raise StateError("an elastic resume (another world size) needs a state taken "
                             "with on_error='raise': with skipping, ranks consume different "
                             "numbers of samples, so no one state says where the epoch stands")
