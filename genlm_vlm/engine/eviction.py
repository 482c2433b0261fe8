"""Which idle sessions the engine thread releases, and when (part of :class:`~.steps.StepLoop`).

Idle sessions hold KV blocks and count toward vLLM's ``max_num_seqs``, and vLLM never preempts
them, so the step loop releases them itself: least recently used first, over the idle cap
(``max_sessions``), when idle sessions plus active requests would exceed ``max_num_seqs``, while
KV usage is above the threshold, and all of them when a step could schedule nothing. A parent
whose forks are in flight (pinned) is released last, so the forks find its KV.

Engine thread only, like the rest of the step loop.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from .sessions import Session, SessionTable

logger = logging.getLogger(__name__)

#: Consecutive engine steps that schedule nothing, with no idle session left to evict, before
#: the waiting jobs are failed.
MAX_STALLED_STEPS = 8


class SessionEviction:
    """The eviction policy of :class:`~.steps.StepLoop` (a mixin: it works on the loop's state)."""

    _table: SessionTable
    _pins: Counter[str]
    _by_rid: dict[str, Any]
    _particles: Any  # a forcing.ParticleHost: its requests hold slots too
    _max_idle: int
    _max_num_seqs: int
    _kv_threshold: float
    _stalls: int
    core: Any

    def _abort(self, rids: list[str]) -> None:  # pragma: no cover - StepLoop's
        raise NotImplementedError

    def _end_job(self, job: Any, value: Any = None, exc: BaseException | None = None, abort: bool = False) -> None:
        raise NotImplementedError  # pragma: no cover - StepLoop's

    def _evict(self, session: Session, indexed: bool = True) -> None:
        if indexed:
            self._table.drop(session.rid)
        self._abort([session.rid])
        self._table.counters.evicted += 1

    def evict_all_idle(self) -> int:
        n = 0
        while (s := self._table.lru()) is not None:
            self._evict(s)
            n += 1
        return n

    def remove_lora(self, int_id: int) -> None:
        for s in [s for s in self._table.idle.values() if s.adapter == int_id]:
            self._evict(s)
        self.core.remove_lora(int_id)

    def _unpin(self, rid: str) -> None:
        n = self._pins[rid] - 1
        if n > 0:
            self._pins[rid] = n
        else:
            del self._pins[rid]

    def _victim(self, pinned_too: bool) -> Any:
        """The least recently used idle session that no fork in flight waits for; with
        ``pinned_too``, else the least recently used one (its forks will re-prefill)."""
        pins = self._pins
        idle = self._table.idle
        if not pins:
            return next(iter(idle.values()), None)
        for s in idle.values():
            if s.rid not in pins:
                return s
        return next(iter(idle.values()), None) if pinned_too else None

    def _enforce_caps(self) -> None:
        table = self._table
        while table.idle:
            # Every running request holds a slot of max_num_seqs: the step loop's jobs and the
            # requests of runs whose particles are running requests (.forcing) alike.
            active = len(self._by_rid) + len(self._particles.by_rid)
            over_seqs = len(table.idle) + active > self._max_num_seqs
            if not over_seqs and len(table.idle) <= self._max_idle:
                return
            victim = self._victim(pinned_too=over_seqs)
            if victim is None:
                return
            self._evict(victim)

    def _evict_for_kv(self) -> None:
        table = self._table
        if not table.idle:
            return
        core = self.core
        while table.idle and core.kv_usage() > self._kv_threshold:
            self._evict(self._victim(pinned_too=True))

    def _on_stall(self) -> None:
        """A step scheduled nothing although jobs wait: parked sessions hold the slots or the
        KV blocks (vLLM never preempts them); release them, or give up after a while."""
        if self.evict_all_idle():
            self._stalls = 0
            return
        self._stalls += 1
        if self._stalls >= MAX_STALLED_STEPS:
            self._stalls = 0
            err = RuntimeError(
                "vLLM could not schedule the waiting requests (the KV cache is too small for them?): "
                "raise kv_cache_memory_bytes or gpu_memory_utilization in engine_opts, or send "
                "shorter prompts"
            )
            for job in list(self._by_rid.values()):
                self._end_job(job, exc=err, abort=True)
