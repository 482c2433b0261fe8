"""Health checks of a :class:`~.pool.ReplicaPool`: find replicas that died while idle, and
(``auto_restart``) replace dead replicas with fresh actors.

One daemon thread per pool (:class:`HealthChecker`). Every ``interval`` seconds it sends a ping
(``ReplicaWorker.ping``, answered on the actor's event loop) to each live replica that has no
ping outstanding. A ping that fails with Ray's actor-died error, or with the replica's
:class:`~genlm_vlm.EngineDiedError` (its actor lives but its engine stopped), marks
the replica dead, as a failed call does (its in-flight calls still fail with
:class:`~.routing.ReplicaDiedError` on their own). A slow ping is never taken for a death: it
stays outstanding (a warning is logged once when it has waited long). Failed pings and deaths
seen by calls wake the thread at once, so a dead replica is restarted without waiting for the
next interval. A failed restart is logged and retried after a growing pause (up to
:data:`MAX_RETRY_S`).

The thread holds the pool only through a weak reference between rounds, so a pool that is
dropped without ``cleanup()`` can still be collected (its ``__del__`` cleans it up).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
import weakref
from typing import Any

logger = logging.getLogger(__name__)

#: Longest pause between two attempts to restart a replica whose restart failed.
MAX_RETRY_S = 60.0
#: A ping unanswered for this many intervals (at least :data:`SLOW_PING_MIN_S`) is logged once.
SLOW_PING_INTERVALS = 10
SLOW_PING_MIN_S = 30.0


def backoff(interval: float, fails: int) -> float:
    """Seconds to wait before the next restart after ``fails`` failed ones in a row:
    ``interval * 2**(fails - 1)``, at most :data:`MAX_RETRY_S` (for any number of failures)."""
    return min(MAX_RETRY_S, interval * 2.0 ** min(max(fails - 1, 0), 64))


def check_interval(value: Any) -> float | None:
    """``health_interval_s``: None (off) or a positive number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"health_interval_s must be None (off) or a number of seconds > 0, got {value!r}")
    return float(value)


class HealthChecker:
    """The health-check thread of one pool (see the module docstring).

    The pool provides ``_ray``, ``_router``, ``_actors``, ``_closing`` (a ``threading.Event``
    set when it is cleaned up), ``_found_dead(replica, gen, exc) -> bool`` and
    ``_replace(replica, auto=True) -> bool``.
    """

    def __init__(self, pool: Any, interval: float, auto_restart: bool) -> None:
        self.interval = float(interval)
        self._auto_restart = bool(auto_restart)
        self._pool = weakref.ref(pool)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # counters and last_error (read by stats)
        # replica -> (generation pinged, future of the ping, monotonic time sent, warned)
        self._pings: dict[int, tuple[int, cf.Future, float, bool]] = {}
        self._fails: dict[int, int] = {}  # failed restarts in a row, per replica
        self._retry_at: dict[int, float] = {}
        self.counts = {"rounds": 0, "pings": 0, "deaths_found": 0, "restarts": 0, "restart_failures": 0}
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="genlm_vlm-replica-health", daemon=True)

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread and wait for it (a restart in progress is abandoned: the pool's
        ``_closing`` event cancels it). Idempotent; a no-op join from the thread itself."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("genlm_vlm: the replica health-check thread did not stop within %g s", timeout)

    def wake(self) -> None:
        """Run a round now (a replica was found dead elsewhere, or auto_restart was turned on)."""
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def auto_restart(self) -> bool:
        return self._auto_restart

    @auto_restart.setter
    def auto_restart(self, value: bool) -> None:
        self._auto_restart = bool(value)
        if value:
            self.wake()

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "interval_s": self.interval,
                "auto_restart": self._auto_restart,
                "running": self._thread.is_alive(),
                **self.counts,
                "last_error": self.last_error,
            }

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        next_tick = time.monotonic() + self.interval
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_tick - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                break
            now = time.monotonic()
            tick = now >= next_tick
            if tick:
                next_tick = now + self.interval
            pool = self._pool()
            if pool is None or pool._closing.is_set():
                break
            try:
                if not pool._ray.is_initialized():
                    logger.warning("genlm_vlm: Ray was shut down under a ReplicaPool; its health checks stop")
                    break
                self._round(pool, tick)
            except Exception as e:  # noqa: BLE001 - logged and kept; the next round tries again
                if pool._closing.is_set():
                    break
                self._error(f"health check round failed: {e!r}")
                logger.exception("genlm_vlm: a replica health-check round failed")
            finally:
                del pool  # only a weak reference between rounds

    def _error(self, text: str) -> None:
        with self._lock:
            self.last_error = text

    def _round(self, pool: Any, tick: bool) -> None:
        self._collect(pool)
        if tick:
            self.count("rounds")
            self._ping(pool)
        if self._auto_restart:
            self._restart_dead(pool)

    def _collect(self, pool: Any) -> None:
        """Handle the pings that ended: a dead actor marks its replica dead."""
        ray = pool._ray
        now = time.monotonic()
        for i, (gen, fut, sent, warned) in list(self._pings.items()):
            if not fut.done():
                waited = now - sent
                if not warned and waited > max(SLOW_PING_MIN_S, SLOW_PING_INTERVALS * self.interval):
                    logger.warning("genlm_vlm: replica %d has not answered a health ping for %.0f s "
                                   "(busy or hung; it is not taken for dead)", i, waited)
                    self._pings[i] = (gen, fut, sent, True)
                continue
            del self._pings[i]
            exc = fut.exception()
            if exc is None:
                continue
            self._failed_ping(pool, ray, i, gen, exc)

    def _failed_ping(self, pool: Any, ray: Any, i: int, gen: int, exc: BaseException) -> None:
        if isinstance(exc, ray.exceptions.ActorUnavailableError):  # may come back: ping again
            logger.warning("genlm_vlm: replica %d is unavailable (%s); pinging it again", i, exc)
            self._error(f"replica {i}: {type(exc).__name__}")
        elif isinstance(exc, ray.exceptions.RayActorError) or _engine_died(ray, exc):
            if pool._found_dead(i, gen, exc):
                self.count("deaths_found")
        else:
            logger.warning("genlm_vlm: the health ping of replica %d failed: %r", i, exc)
            self._error(f"replica {i}: ping failed: {exc!r}")

    def _ping(self, pool: Any) -> None:
        ray = pool._ray
        for i in pool._router.live_replicas():
            gen = pool._router.generation(i)
            old = self._pings.get(i)
            if old is not None and old[0] == gen:
                continue  # still waiting for the last one
            try:
                fut = pool._actors[i].ping.remote().future()
            except Exception as e:  # noqa: BLE001 - handled as a failed ping
                self._failed_ping(pool, ray, i, gen, e)
                continue
            self.count("pings")
            fut.add_done_callback(self._on_ping_done)
            self._pings[i] = (gen, fut, time.monotonic(), False)

    def _on_ping_done(self, fut: cf.Future) -> None:
        """Ray's thread: a failed ping wakes the checker (a good one waits for the next round)."""
        if fut.cancelled() or fut.exception() is not None:
            self._wake.set()

    def _restart_dead(self, pool: Any) -> None:
        live = set(pool._router.live_replicas())
        for i in range(len(pool._actors)):
            if i in live or time.monotonic() < self._retry_at.get(i, 0.0):
                continue
            if self._stop.is_set() or pool._closing.is_set():
                return
            try:
                replaced = pool._replace(i, auto=True)
            except Exception as e:  # noqa: BLE001 - logged, counted, retried later
                if self._stop.is_set() or pool._closing.is_set():
                    return
                fails = self._fails[i] = self._fails.get(i, 0) + 1
                pause = backoff(self.interval, fails)
                self._retry_at[i] = time.monotonic() + pause
                self.count("restart_failures")
                self._error(f"replica {i}: restart failed: {e!r}")
                logger.warning("genlm_vlm: could not restart replica %d (%r); trying again in %.1f s", i, e, pause)
                continue
            self._fails.pop(i, None)
            self._retry_at.pop(i, None)
            if replaced:
                self.count("restarts")
                logger.warning("genlm_vlm: replica %d was restarted by the health check", i)


def _engine_died(ray: Any, exc: BaseException) -> bool:
    """Whether a replica's call failed because its engine stopped (its actor still answers)."""
    from ..engine.jobs import EngineDiedError
    from .launch import unwrap

    return isinstance(exc, EngineDiedError) or isinstance(unwrap(ray, exc), EngineDiedError)


__all__ = ["HealthChecker", "backoff", "check_interval"]
