"""Bursts: a controller's particles advanced by the step loop itself (engine thread only).

A burst runs a :class:`~genlm_vlm.smc.Controller` (see :mod:`genlm_vlm.smc.controller` for the
contract) with no trip through the event loop per token. Each round it asks the step loop for
the rows of its live particles as ordinary row jobs (kind ``"logprobs"``): the same admission as
an await, so a particle that extends its idle session is a one-token chunk, a resampled copy is a
fork that copies its parent's tail block (:mod:`.forks`), particles with the same tokens share
one request, and the burst's requests share engine steps with every other caller under the same
caps. The jobs' waiters are :class:`~.jobs.Ticket` objects whose listener is the burst: when the
last row of a round arrives (in the step that computed it), the burst stacks the rows, calls
``controller.step`` on the engine thread, applies the decision and queues the next round, which
the loop admits before its next step. One SMC step is one engine step.

Failure and cancellation: an exception from the controller, a failed row or a malformed
decision fails the burst's future alone; cancelling the future cancels the round's tickets
(their requests are aborted at the next step) and releases the burst's idle sessions.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .jobs import Cancel, Job, Message, Ticket

if TYPE_CHECKING:
    from .steps import StepLoop

logger = logging.getLogger(__name__)

Tokens = tuple[int, ...]


@dataclass(slots=True)
class BurstSpec:
    """What :meth:`~.loop.EngineDriver.submit_burst` queues: the controller and where to start."""

    controller: Any
    start: Any = None
    runner: Burst | None = None


class Burst:
    """One controller run on the engine thread (see the module docstring)."""

    def __init__(self, loop: StepLoop, job: Job) -> None:
        from ..smc.controller import ParticleSet

        spec: BurstSpec = job.spec
        spec.runner = self
        self.loop = loop
        self.job = job
        self.controller = spec.controller
        self.particles = ParticleSet(job.ids, self.controller.n_particles, spec.start)
        self.tickets: list[Ticket] = []
        self.jobs: list[Job] = []
        self.distinct = 0
        self.rows: dict[Tokens, torch.Tensor] = {}
        self.live: list[int] = []
        self.want: list[Tokens] = []
        self.sessions: set[str] = set()
        self.dropped = 0  # sessions released mid-run (_release_dropped)
        self.done = False
        self.rounds = 0
        self.seconds = 0.0

    # ---------------------------------------------------------------- rounds
    def start(self) -> None:
        self._round()

    def _round(self) -> None:
        """Queue the live particles' row jobs (distinct prefixes only), or finish."""
        ps = self.particles
        live = ps.live()
        if not live:
            self._finish()
            return
        self.live = live
        self.want = [ps.prefix(i) for i in live]
        self._release_dropped()
        self.rows = {}
        self.tickets = []
        self.jobs = jobs = []
        for ids in dict.fromkeys(self.want):
            job = Job("logprobs", ids, self.job.lora, [], on_device=True)
            t = Ticket(self._on_rows, ids, self._ticket_cancelled)
            t.job = job
            job.waiters.append(t)
            self.tickets.append(t)
            jobs.append(job)
        self.distinct = len(jobs)
        self.rounds += 1
        self.loop.queue_internal(jobs)

    def _release_dropped(self) -> None:
        """Release the last round's sessions that no live particle extends (resampled away, dead
        or finished): vLLM keeps a parked session in its waiting queue and walks past it every
        step, and it holds KV blocks and a sequence slot. The sessions that this round's
        particles continue or fork from (prefix + one token) are kept, and so are sessions that
        another caller's query joined (it may extend them)."""
        extended = {w[:-1] for w in self.want}
        dropped = {job.rid for job in self.jobs
                   if job.session is not None and job.rid is not None and job.ids not in extended
                   and len(job.waiters) == 1}
        if dropped:
            self.sessions -= dropped
            self.dropped += self.loop.release_sessions(dropped)

    def _ticket_cancelled(self, ticket: Ticket) -> None:
        if ticket.job is not None:
            self.loop.post_internal(Cancel(ticket.job))

    def _on_rows(self, items: list[tuple[Ticket, Any, BaseException | None]]) -> None:
        """The step's rows for this burst (engine thread, from the outbox)."""
        if self.done:
            return
        for ticket, row, exc in items:
            if exc is not None:
                self._fail(exc)
                return
            self.rows[ticket.payload] = row
        if len(self.rows) < self.distinct:
            return
        for job in self.jobs:  # the sessions the round left idle: released if the run is cancelled
            if job.session is not None and job.rid is not None:
                self.sessions.add(job.rid)
        t0 = time.perf_counter()
        try:
            rows = torch.stack([self.rows[ids] for ids in self.want])
            self.rows = {}
            decision = self.controller.step(rows, self.live)
            del rows
            self.particles.apply(decision, self.live)
        except Exception as e:  # noqa: BLE001 - the controller's (or the user's mask function's) error: this run only
            self.seconds += time.perf_counter() - t0
            self._fail(e)
            return
        self.seconds += time.perf_counter() - t0
        if decision.stop:
            self._finish()
        else:
            self._round()

    # ---------------------------------------------------------------- endings
    def _finish(self) -> None:
        if self.done:
            return
        t0 = time.perf_counter()
        try:
            value = self.controller.result(self.particles.generated)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            return
        self.seconds += time.perf_counter() - t0
        self.done = True
        if isinstance(getattr(value, "stats", None), dict):
            value.stats.update(engine_rounds=self.rounds, burst_host_s=round(self.seconds, 6),
                               sessions_released=self.dropped)
        self.loop.burst_ended(self, "finished")
        self._resolve(value, None)

    def fail(self, exc: BaseException) -> None:
        """End the run with ``exc`` (also at shutdown)."""
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self.done:
            return
        self.done = True
        logger.warning("a burst (controller run) failed: %r", exc)
        self._abandon()
        self.loop.burst_ended(self, "failed")
        self._resolve(None, exc)

    def cancel(self) -> None:
        """The caller gave up: abandon the round's requests and release the burst's sessions."""
        if self.done:
            return
        self.done = True
        self._abandon()
        self.loop.burst_ended(self, "cancelled")

    def _abandon(self) -> None:
        for t in self.tickets:
            t.cancel()
        self.tickets = []
        self.rows = {}
        self.loop.release_sessions(self.sessions)

    def _resolve(self, value: Any, exc: BaseException | None) -> None:
        for w in self.job.waiters:
            if isinstance(w, cf.Future) and not w.done() and w.set_running_or_notify_cancel():
                if exc is None:
                    w.set_result(value)
                else:
                    w.set_exception(exc)


class BurstHost:
    """The step loop's side of bursts (a mixin of :class:`~.steps.StepLoop`: it works on the
    loop's state, engine thread only)."""

    _bursts: dict[int, Burst]
    _burst_counts: dict[str, int]
    _queue: deque[Job]
    _inbox: deque[Message]
    _table: Any

    def _start_burst(self, job: Job) -> None:
        burst = Burst(self, job)
        self._bursts[id(job)] = burst
        self._burst_counts["started"] += 1
        burst.start()

    def burst_ended(self, burst: Burst, how: str) -> None:
        """``burst`` finished, failed or was cancelled: forget it (called by the burst)."""
        if self._bursts.pop(id(burst.job), None) is not None:
            self._burst_counts[how] += 1

    def queue_internal(self, jobs: list[Job]) -> None:
        """Queue jobs made on the engine thread (a burst's round): admitted before the next step."""
        self._queue.extend(jobs)

    def post_internal(self, message: Message) -> None:
        """Post a message to this loop from the engine thread itself (read at the next drain)."""
        self._inbox.append(message)

    def release_sessions(self, rids: set[str]) -> int:
        """Release those of ``rids`` that are idle sessions (a cancelled burst's); returns how many."""
        n = 0
        for rid in rids:
            s = self._table.idle.get(rid)
            if s is not None:
                self._evict(s)
                n += 1
        return n
