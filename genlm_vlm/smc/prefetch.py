"""A run's next masks computed ahead, on a worker thread (``lm.smc(..., mask_overlap=True)``).

A constraint's masks for step ``t + 1`` depend only on the particles' states after step ``t``,
which are known as soon as the controller's step ``t`` returns. A runner that can overlap host
work with the model's forward (the engine's requests path: the forward of step ``t + 1`` runs
between the two controller calls) asks the controller to start them at once
(:meth:`~.algorithm.SMCController.prefetch_masks`); the next ``step`` takes them
(:meth:`MaskPrefetch.take`) instead of computing them.

Exactness: the work is keyed by the particles it was made for and their token histories. The
next step uses it only when it is called with those particles in that state; otherwise it waits
for the work to end, drops it, and computes the masks itself, as it would have without it. The
result is the same bits the synchronous path computes (the same function on the same states),
only computed on another thread. Between :meth:`MaskPrefetch.submit` and :meth:`MaskPrefetch.take`
(or :meth:`MaskPrefetch.discard`) nothing else reads or changes the constraint's states: the
controller itself waits for the work before it advances them.

Faults: an exception the masks raise on the worker is raised again, the same exception object,
by :meth:`MaskPrefetch.take`, inside the step that would have computed them: the run fails where
and how it fails without the overlap. Work that no step takes (the run ended, failed or was
cancelled) is waited for (or cancelled before it starts) by :meth:`MaskPrefetch.discard`, and its
exception, if any, is dropped: the synchronous path would never have computed those masks.

:class:`StepMasks` is the built-in controller's side (:class:`~.algorithm.SMCController` mixes it
in): a step's masks, computed in the step or taken from the work started after the step before.
The thread that runs the work is the caller's (``submit``: a function that takes a zero-argument
callable and returns a :class:`concurrent.futures.Future`).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .book import Book


class MaskPrefetch:
    """At most one piece of mask work in flight for one run (see the module docstring)."""

    __slots__ = ("counts", "future", "key", "wait_s")

    def __init__(self) -> None:
        self.future: cf.Future | None = None
        self.key: Any = None
        #: ``submitted``: work started; ``used``: taken by the step it was made for;
        #: ``discarded``: dropped (another step's particles, or the run ended first).
        self.counts = {"submitted": 0, "used": 0, "discarded": 0}
        #: Seconds the taking thread waited for work still running when its step began.
        self.wait_s = 0.0

    @property
    def pending(self) -> bool:
        return self.future is not None

    def submit(self, key: Any, work: Callable[[], Any], submit: Callable[[Callable[[], Any]], cf.Future]) -> None:
        """Start ``work`` (the masks for ``key``) through ``submit``; any earlier work is
        discarded first (waited for: two pieces of work never run at once for one run)."""
        self.discard()
        future = submit(work)
        self.future, self.key = future, key
        self.counts["submitted"] += 1

    def take(self, key: Any) -> tuple[bool, Any]:
        """``(True, the work's result)`` when work for ``key`` is in flight (waiting for it to
        end; its exception is raised here); ``(False, None)`` when there is none, or it was made
        for another key (then waited for and dropped)."""
        future = self.future
        if future is None:
            return False, None
        if self.key != key:
            self.discard()
            return False, None
        self.future, self.key = None, None
        t0 = time.perf_counter()
        try:
            return True, future.result()
        finally:
            self.wait_s += time.perf_counter() - t0
            self.counts["used"] += 1

    def discard(self) -> None:
        """Drop the work in flight, if any: cancelled if it has not started, else waited for
        (its result and exception dropped). Returns once no thread runs it."""
        future = self.future
        if future is None:
            return
        self.future, self.key = None, None
        self.counts["discarded"] += 1
        if not future.cancel():
            cf.wait([future])

    def stats(self) -> dict[str, Any]:
        return dict(self.counts, wait_s=round(self.wait_s, 6))


def torch_index(index: list[int], device: Any) -> Any:
    """``index`` as an int64 tensor on ``device`` (to index a tensor there)."""
    import torch

    return torch.tensor(index, dtype=torch.int64).to(device)


class StepMasks:
    """A step's constraint masks, computed now or ahead (see the module docstring). Mixed into
    :class:`~.algorithm.SMCController`, whose attributes it reads: ``constraint``, ``states``,
    ``book`` (a :class:`~.book.Book`: each particle's history number), ``width``,
    ``mask_overlap`` and ``_prefetch`` (a :class:`MaskPrefetch`)."""

    constraint: Any
    states: list[Any]
    book: Book
    width: int
    mask_overlap: bool
    _prefetch: MaskPrefetch

    def _bitmasks(self, particles: Sequence[int], device: Any) -> tuple[Any, np.ndarray | None]:
        """The constraint's bitmasks for ``particles`` (on ``device`` where the constraint keeps
        them there, else on the host) and their allowed-token counts where the constraint knows
        them (else None), filled once per distinct token history (resampled copies share
        theirs: a state is a function of the tokens). Masks computed ahead for these particles
        in this state (:meth:`prefetch_masks`) are taken instead (their exception raised here)."""
        if self._prefetch.pending:
            found, masks = self._prefetch.take(self._prefetch_key(particles))
            if found:
                return masks
        return self._masks_now(particles, device)

    def prefetch_masks(self, particles: Sequence[int], submit: Any) -> bool:
        """Start computing the masks of the next step's ``particles`` (the live ones after the
        decision this controller's last ``step`` returned, as the runner applied it) through
        ``submit`` (a function taking a zero-argument callable and returning a
        :class:`concurrent.futures.Future`: a worker thread's queue), so that they are computed
        while the model computes the rows. Returns whether it did (only with ``mask_overlap``,
        for a non-empty ``particles``). The next :meth:`step` takes them if it is called for the
        same particles, else it drops them and computes its own (:mod:`.prefetch`): the run is the
        same either way. They are computed on the host; the step moves them to the rows'
        device, as it moves a host constraint's. The runner calls :meth:`discard_prefetch` when
        the run ends, fails or is cancelled. Not thread-safe: the runner's thread only."""
        if not self.mask_overlap or not particles:
            return False
        live = list(particles)
        self._prefetch.submit(self._prefetch_key(live), lambda: self._masks_now(live, None), submit)
        return True

    def discard_prefetch(self) -> None:
        """Drop masks computed ahead that no step will take; returns once no thread computes
        them (cancelled if not started, else waited for; an exception they raised is dropped)."""
        self._prefetch.discard()

    def _prefetch_key(self, particles: Sequence[int]) -> tuple[tuple[int, ...], bytes]:
        return tuple(particles), self.book.history[np.asarray(particles, dtype=np.int64)].tobytes()

    def _masks_now(self, particles: Sequence[int], device: Any) -> tuple[Any, np.ndarray | None]:
        """:meth:`_bitmasks` computed here and now (on whichever thread calls it)."""
        width, c, states = self.width, self.constraint, self.states
        shared = self.book.first_of_each(np.asarray(particles, dtype=np.int64))
        if shared is None:  # every particle its own history
            bits = c.bitmasks_on([states[i] for i in particles], width, device)
            return bits, c.last_counts
        reps, index = shared
        unique = c.bitmasks_on([states[i] for i in reps.tolist()], width, device)
        counts = c.last_counts
        return unique[torch_index(index.tolist(), unique.device)], None if counts is None else counts[index]
