"""What the step loop does when something fails on the engine thread (part of
:class:`~.steps.StepLoop`).

* A failed engine step (:meth:`FaultRecovery._after_failed_step`): every request in the engine
  fails with the step's error, every idle session is released and the prefix cache is reset, so
  nothing the step may have cached is read as computed.
* An exception while one job's output is handled (:meth:`FaultRecovery._guarded`): that job
  fails alone.

The counters are ``stats()["faults"]``. Engine thread only, like the rest of the step loop.
"""

from __future__ import annotations

import logging
from typing import Any

from .jobs import Job, Outbox

logger = logging.getLogger(__name__)


class FaultRecovery:
    """The failure handling of :class:`~.steps.StepLoop` (a mixin: it works on the loop's state)."""

    _faults: dict[str, int]
    _cache_suspect: bool
    _by_rid: dict[str, Job]
    _table: Any
    _outbox: Outbox
    _particles: Any
    core: Any

    def _end_job(self, job: Job, value: Any = None, exc: BaseException | None = None, abort: bool = False) -> None:
        raise NotImplementedError  # pragma: no cover - StepLoop's

    def _after_failed_step(self, exc: Exception) -> None:
        """``core.step()`` raised ``exc``: fail every job in the engine, then make sure nothing
        the step may have cached is read as computed.

        vLLM enters a request's full KV blocks in its prefix cache when it schedules them, before
        the forward pass: after a forward that raised, those blocks stay cached, marked computed,
        never written, and any later request sharing them reads garbage. vLLM offers no way to
        drop exactly those blocks, so the whole prefix cache is reset; vLLM resets it only when
        no request holds blocks, so every request in the engine is aborted (the jobs fail with
        ``exc``: plain rows, session chunks, forks and their pins, scoring parts and warm-ups,
        samples) and every idle session is released (its KV may share the suspect blocks).
        Should vLLM refuse, it is tried again before new work is admitted
        (:meth:`_restore_prefix_cache`).
        """
        self._particles.fail_all(exc)  # runs whose particles are running requests: their requests go too
        faults = self._faults
        jobs = list(self._by_rid.values())
        logger.warning("engine step failed: %r; failing the %d request(s) in the engine, releasing the idle "
                       "sessions and resetting the prefix cache", exc, len(jobs))
        faults["failed_steps"] += 1
        faults["requests_failed"] += len(jobs)
        faults["sessions_dropped"] += len(self._table.live)
        for job in jobs:
            self._guarded(job, "failing it after a failed step", self._end_job, job, None, exc, True)
        self._cache_suspect = True
        self._restore_prefix_cache(first=True)
        self._outbox.flush()

    def _restore_prefix_cache(self, first: bool = False) -> None:
        """Release every idle session and reset the engine's prefix cache (after a failed
        step); if the engine cannot, say so (a warning the ``first`` time, ``stats()["faults"]``)
        and leave the cache marked suspect, so the loop tries again before it admits new work."""
        self._faults["sessions_dropped"] += self.evict_all_idle()
        reset = getattr(self.core, "reset_prefix_cache", None)
        try:
            done = True if reset is None else reset()  # a core without one has no prefix cache
        except Exception:  # noqa: BLE001 - counted and said below
            logger.warning("resetting the prefix cache raised", exc_info=True)
            done = False
        if done:
            if not first:
                logger.info("the prefix cache was reset at last, after a failed engine step")
            self._cache_suspect = False
            self._faults["prefix_cache_resets"] += 1
            return
        self._faults["prefix_cache_reset_failures"] += 1
        say = logger.warning if first else logger.debug  # retries are counted in stats, not logged
        say(
            "after a failed engine step vLLM could not reset its prefix cache (%d request(s) in the engine); "
            "rows that share a prefix with that step's prompts may be wrong until it can: trying again before "
            "new work is admitted", len(self._by_rid),
        )

    def _guarded(self, job: Job, doing: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; if it raises, fail ``job`` alone (see :meth:`_fail_job`): None."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - this job's error only; the loop goes on
            self._fail_job(job, e, doing)
            return None

    def _fail_job(self, job: Job, exc: BaseException, doing: str) -> None:
        """``job`` raised ``exc`` on the engine thread while ``doing``: fail its waiters only and
        abort its request. Our own checks (``ValueError``, e.g. a NaN row) reach them as they are."""
        logger.warning("failing request %s: %s raised %r", job.rid, doing, exc)
        err = exc
        if not isinstance(exc, ValueError):
            err = RuntimeError(f"genlm_vlm failed on the engine thread while {doing} for this call: {exc!r}")
            err.__cause__ = exc
        try:
            self._end_job(job, exc=err, abort=True)
        except Exception:  # noqa: BLE001 - the bookkeeping failed too: answer the waiters all the same
            logger.exception("could not end request %s cleanly", job.rid)
            self._outbox.resolve(job, exc=err)
