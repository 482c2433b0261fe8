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
the loop admits before its next step. One SMC step is one engine step. In a product of prompts
(``BurstSpec.prompts``) a round queues every factor's contexts together (each factor continues
or forks its own sessions) and the controller gets the rows summed over the factors
(:func:`~genlm_vlm.smc.controller.fold_rows`, as :func:`~genlm_vlm.smc.drive` does).

Everything the controller hands over (``n_particles``, the run's ``start``, every decision) is
checked here, on the engine thread, before any of it reaches vLLM
(:class:`~genlm_vlm.smc.controller.ParticleSet`, the checks :func:`~genlm_vlm.smc.drive` uses
too). A run ends by finishing (its last round's idle sessions are released, unless another
caller's query joined them), failing or being cancelled:

* an exception from the controller (``step``, ``result``, ``n_particles``, a mask function it
  calls) or a value the checks refuse (:class:`~genlm_vlm.smc.controller.ControllerError`) fails
  this run's future with that exception (``stats()["faults"]["controller_errors"]``);
* a failed row (a failed engine step) fails it with the row's error;
* any other exception while the run is set up, started, stepped, failed or resolved (a bug of
  ours) is caught around that operation (:meth:`Burst.guarded`, :meth:`BurstHost._start_burst`)
  and fails this run alone with a ``RuntimeError`` naming it (``faults["burst_errors"]``); the
  caller's future is answered even when resolving it was what raised;
* cancelling the future cancels the round's tickets (their requests are aborted at the next
  step).

A failed or cancelled run releases its idle sessions (those no other caller joined).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .jobs import Cancel, Job, Message, Outbox, Ticket

if TYPE_CHECKING:
    from .port import LoopPort

logger = logging.getLogger(__name__)

Tokens = tuple[int, ...]


@dataclass(slots=True)
class BurstSpec:
    """What :meth:`~.loop.EngineDriver.submit_burst` queues: the controller, where to start, and
    the factors' prompts of a product of prompts (None: the job's prompt alone)."""

    controller: Any
    start: Any = None
    runner: Burst | None = None
    prompts: Any = None
    path: str = "bursts"
    """``"bursts"``, ``"requests"`` (particles as running requests, :mod:`.particles`) or
    ``"auto"`` (:mod:`.paths` picks one)."""
    fallback: str | None = None
    """Why a run that asked for the requests path (or ``"auto"``) runs as a burst (set on the
    engine thread)."""


def burst_error(exc: BaseException, doing: str) -> BaseException:
    """The error a run's caller gets when genlm_vlm itself raised ``exc`` while ``doing`` (our
    own checks, ``ValueError``, reach the caller as they are)."""
    if isinstance(exc, ValueError):
        return exc
    err = RuntimeError(f"genlm_vlm failed on the engine thread while {doing} this controller run: {exc!r}")
    err.__cause__ = exc
    return err


class Burst:
    """One controller run on the engine thread (see the module docstring)."""

    def __init__(self, loop: LoopPort, job: Job) -> None:
        spec: BurstSpec = job.spec
        spec.runner = self
        self.loop = loop
        self.job = job
        self.controller = spec.controller
        self.start_tokens = spec.start
        self.prompts = spec.prompts
        self.particles: Any = None  # a ParticleSet, made by start()
        self.fold: Any = None  # smc.controller.fold_rows, imported by start()
        self.tickets: list[Ticket] = []
        self.jobs: list[Job] = []
        self.distinct = 0
        self.rows: dict[Tokens, torch.Tensor] = {}
        self.live: list[int] = []
        self.want: list[Tokens] = []
        self.sessions: set[str] = set()  # idle sessions of this run that no other caller joined
        self.dropped = 0  # sessions released (mid-run, at the end)
        self.done = False
        self.rounds = 0
        self.seconds = 0.0
        self.time_at_start = dict(loop._time)  # the engine thread's time by part when the run began

    def guarded(self, doing: str, fn: Any, *args: Any) -> None:
        """``fn(*args)``; whatever it raises fails this run alone (never the loop), and the
        caller's future is answered even if failing the run raises too."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a bug of ours while handling one run: that run only
            err = burst_error(e, doing)
            self.loop.count_fault("burst_errors")
            logger.error("a controller run failed on the engine thread while %s", doing, exc_info=e)
            try:
                self._fail(err)
            except Exception:  # noqa: BLE001 - answered below all the same
                logger.exception("could not fail a controller run cleanly")
            self._settle(err)

    # ---------------------------------------------------------------- rounds
    def start(self) -> None:
        """Check the controller's ``n_particles`` and the run's ``start`` (a mistake fails this
        run: :class:`~genlm_vlm.smc.controller.ControllerError`), then queue the first round."""
        from ..smc.controller import fold_rows

        self.fold = fold_rows
        if self._make_particles():
            self._round()

    def _make_particles(self) -> bool:
        """The run's :class:`~genlm_vlm.smc.controller.ParticleSet`, from the controller's
        ``n_particles`` and the run's ``start``, checked; a mistake fails this run (False)."""
        from ..smc.controller import ParticleSet, n_particles_of

        info = self.loop.info
        try:
            n = n_particles_of(self.controller)
            self.particles = ParticleSet(self.job.ids, n, self.start_tokens, vocab_size=info.vocab_size,
                                         max_len=info.max_model_len, prompts=self.prompts)
        except Exception as e:  # noqa: BLE001 - the controller's (or its start's) mistake: this run only
            self._fail(e, controller=True)
            return False
        return True

    def _round(self) -> None:
        """Queue the live particles' row jobs (distinct prefixes only), or finish."""
        ps = self.particles
        live = ps.live()
        if not live:
            self._finish()
            return
        self.live = live
        self.want = ps.wanted(live)  # k contexts per particle in a product of prompts
        self._release_dropped()
        self.rows = {}
        self.tickets = []
        self.jobs = jobs = []
        for ids in dict.fromkeys(self.want):
            job = Job("logprobs", ids, self.job.lora, [])
            t = Ticket(self._rows_in, ids, self._ticket_cancelled, on_device=True)
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
            self._release(dropped)

    def _release(self, rids: set[str]) -> None:
        self.dropped += self.loop.release_sessions(rids)

    def _ticket_cancelled(self, ticket: Ticket) -> None:
        if ticket.job is not None:
            self.loop.post_internal(Cancel(ticket.job))

    def _rows_in(self, items: list[tuple[Ticket, Any, BaseException | None]]) -> None:
        """The tickets' listener (engine thread, from the outbox): :meth:`_on_rows`, guarded."""
        self.guarded("stepping", self._on_rows, items)

    def _on_rows(self, items: list[tuple[Ticket, Any, BaseException | None]]) -> None:
        """The step's rows for this burst; once the round is complete, the controller's step."""
        if self.done:
            return
        for ticket, row, exc in items:
            if exc is not None:
                self._fail(exc)
                return
            self.rows[ticket.payload] = row
        if len(self.rows) < self.distinct:
            return
        for job in self.jobs:  # the sessions the round left idle: released when the run ends,
            if job.session is not None and job.rid is not None:  # unless another caller joined them
                if len(job.waiters) == 1:
                    self.sessions.add(job.rid)
                else:
                    self.sessions.discard(job.rid)
        rows = self.fold(torch.stack([self.rows[ids] for ids in self.want]), len(self.particles.prompts))
        self.rows = {}
        t0 = time.perf_counter()
        try:
            decision = self.controller.step(rows, self.live)
            del rows
            stop = self.particles.apply(decision, self.live)  # checks it (ControllerError), reads stop
        except Exception as e:  # noqa: BLE001 - the controller's (or the user's mask function's) error: this run only
            self.seconds += time.perf_counter() - t0
            self._fail(e, controller=True)
            return
        self.seconds += time.perf_counter() - t0
        if stop:
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
            self._fail(e, controller=True)
            return
        self.seconds += time.perf_counter() - t0
        self.done = True
        self.tickets = []
        self._release(self.sessions)  # the last round's idle sessions (nobody else joined them)
        self.sessions = set()
        if isinstance(getattr(value, "stats", None), dict):
            self._stats(value)
        self.loop.burst_ended(self, "finished")
        self._resolve(value, None)

    def _stats(self, value: Any) -> None:
        """Add the run's engine-side figures to ``value.stats``: rounds, host time, time by part,
        and which path and model runner ran it (with the reason when the run asked for the
        requests path and fell back to a burst)."""
        spent = {k: v - self.time_at_start.get(k, 0.0) for k, v in self.loop._time.items()}
        per = 1e3 / max(1, self.rounds)
        value.stats.update(engine_rounds=self.rounds, burst_host_s=round(self.seconds, 6),
                           sessions_released=self.dropped,
                           engine_time={f"{k}_s": round(v, 6) for k, v in spent.items()},
                           round_ms={k: round(v * per, 4) for k, v in spent.items() if k != "idle"},
                           engine_path="bursts", runner=self.loop.info.runner)
        why = getattr(self.job.spec, "fallback", None)
        if why is not None:
            value.stats["engine_path_fallback"] = why

    def fail(self, exc: BaseException) -> None:
        """End the run with ``exc`` (at shutdown)."""
        self.guarded("failing", self._fail, exc)

    def _fail(self, exc: BaseException, controller: bool = False) -> None:
        if self.done:
            return
        self.done = True
        if controller:
            self.loop.count_fault("controller_errors")
        logger.warning("a burst (controller run) failed: %r", exc)
        try:
            self._abandon()
        except Exception:  # noqa: BLE001 - the run fails all the same; what was left is evicted later
            self.loop.count_fault("burst_errors")
            logger.exception("could not release a failed controller run's requests and sessions")
        self.loop.burst_ended(self, "failed")
        self._resolve(None, exc)

    def cancel(self) -> None:
        """The caller gave up: abandon the round's requests and release the burst's sessions."""
        if self.done:
            return
        self.done = True
        try:
            self._abandon()
        except Exception:  # noqa: BLE001 - as in _fail
            self.loop.count_fault("burst_errors")
            logger.exception("could not release a cancelled controller run's requests and sessions")
        self.loop.burst_ended(self, "cancelled")

    def _abandon(self) -> None:
        for t in self.tickets:
            t.cancel()
        self.tickets = []
        self.rows = {}
        self._release(self.sessions)
        self.sessions = set()

    def _resolve(self, value: Any, exc: BaseException | None) -> None:
        for w in self.job.waiters:
            if isinstance(w, cf.Future) and not w.done() and w.set_running_or_notify_cancel():
                if exc is None:
                    w.set_result(value)
                else:
                    w.set_exception(exc)

    def _settle(self, exc: BaseException) -> None:
        """The last resort of :meth:`guarded`: fail the caller's future if nothing answered it
        yet, without :meth:`_resolve` (which may be what raised), and forget the run."""
        self.done = True
        for w in self.job.waiters:
            if isinstance(w, cf.Future) and not w.done():
                try:
                    if w.running() or w.set_running_or_notify_cancel():
                        w.set_exception(exc)
                except Exception:  # noqa: BLE001 - answered meanwhile (cancelled by its caller)
                    logger.debug("a controller run's future was answered meanwhile", exc_info=True)
        self.loop.burst_ended(self, "failed")


class BurstHost:
    """The step loop's side of bursts (a mixin of :class:`~.steps.StepLoop`: it works on the
    loop's state, engine thread only). The loop it is mixed into is the
    :class:`~.port.LoopPort` each :class:`Burst` is given."""

    _bursts: dict[int, Burst]
    _burst_counts: dict[str, int]
    _faults: dict[str, int]
    _queue: deque[Job]
    _inbox: deque[Message]
    _outbox: Outbox
    _table: Any
    _particles: Any  # a forcing.ParticleHost

    def _start_burst(self, job: Job) -> None:
        """Set up and start a run (a :class:`Burst`): whatever raises fails that run alone."""
        self._burst_counts["started"] += 1
        try:
            burst = self._particles.runner_for(job)  # a RequestRun, or None: a burst
            if burst is None:
                burst = Burst(self, job)  # type: ignore[arg-type]  # the StepLoop this is mixed into
        except Exception as e:  # noqa: BLE001 - a bug of ours: this run only
            self.count_fault("burst_errors")
            self._burst_counts["failed"] += 1
            logger.error("a controller run could not be set up on the engine thread", exc_info=e)
            self._outbox.resolve(job, exc=burst_error(e, "setting up"))
            return
        self._bursts[id(job)] = burst
        burst.guarded("starting", burst.start)

    def burst_ended(self, burst: Burst, how: str) -> None:
        """``burst`` finished, failed or was cancelled: forget it (called by the burst)."""
        if self._bursts.pop(id(burst.job), None) is not None:
            self._burst_counts[how] += 1
            self._burst_counts["sessions_released"] += burst.dropped

    def count_fault(self, kind: str) -> None:
        """Count one ``stats()["faults"][kind]`` (a run's controller error, a burst error)."""
        self._faults[kind] += 1

    def queue_internal(self, jobs: list[Job]) -> None:
        """Queue jobs made on the engine thread (a burst's round): admitted before the next step."""
        self._queue.extend(jobs)

    def post_internal(self, message: Message) -> None:
        """Post a message to this loop from the engine thread itself (read at the next drain)."""
        self._inbox.append(message)

    def release_sessions(self, rids: set[str]) -> int:
        """Release those of ``rids`` that are idle sessions (a burst's); returns how many."""
        n = 0
        for rid in rids:
            s = self._table.idle.get(rid)
            if s is not None:
                self._evict(s)  # type: ignore[attr-defined]
                n += 1
        return n
