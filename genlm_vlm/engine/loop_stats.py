"""The step loop's counters as ``lm.stats`` shows them (a mixin of :class:`~.steps.StepLoop`).

Engine thread only, like the loop: ``stats()`` is read through a call posted to that thread.
"""

from __future__ import annotations

from typing import Any

from .core import StepResult


class LoopStats:
    """:meth:`stats` and the per-step reading of the engine's own counters (engine thread)."""

    _tokens: dict[str, Any]
    _prefix_cache: dict[str, int]
    _counts: dict[str, int]
    _reports_tokens: bool
    _forks_ok: bool
    _forks_why: str
    _forks: dict[str, int]
    _table: Any
    _time: dict[str, float]
    _scoring: Any
    _burst_counts: dict[str, int]
    _bursts: dict[int, Any]
    _particles: Any
    _faults: dict[str, int]
    _cache_suspect: bool
    core: Any
    info: Any
    log_stats: bool

    def _read_stats(self, result: StepResult) -> None:
        if result.scheduled_tokens is not None:
            self._tokens["scheduled"] += result.scheduled_tokens
        self._prefix_cache["queries"] += result.prefix_queries
        self._prefix_cache["hits"] += result.prefix_hits

    def stats(self) -> dict[str, Any]:
        c = self._counts
        tokens = dict(self._tokens, scheduled=self._tokens["scheduled"] if self._reports_tokens else None)
        work = self.core.work() if hasattr(self.core, "work") else None
        forks: dict[str, Any] = {"enabled": self._forks_ok, "why": self._forks_why, **self._forks}
        if work is not None:
            tokens["scheduled"] = work["scheduled_tokens"]
            forks["fallback_reasons"] = work["fallback_reasons"]
        return {
            "mode": None if self.info is None else self.info.mode,
            "engine_calls": c["engine_calls"],
            "engine_steps": c["engine_steps"],
            "engine_requests": c["engine_requests"],
            "rows": c["rows"],
            "sessions": self._table.snapshot(),
            "forks": forks,
            "batch_invariant": None if self.info is None else dict(zip(("enabled", "why"), self.info.batch_invariant,
                                                                       strict=True)),
            "tokens": tokens,
            "prefix_cache": dict(self._prefix_cache) if self.log_stats else None,
            "engine_time": {f"{k}_s": round(v, 6) for k, v in self._time.items()},
            "capture_apply_calls": getattr(self.core.sink, "apply_calls", 0),
            "scoring": self._scoring.stats(),
            "bursts": dict(self._burst_counts, running=len(self._bursts)),
            "particle_requests": self._particles.stats(),
            "faults": dict(self._faults, prefix_cache_suspect=self._cache_suspect),
        }
