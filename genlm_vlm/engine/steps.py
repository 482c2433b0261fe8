"""The step loop: everything the engine thread does between two looks at its inbox.

:class:`StepLoop` holds the engine thread's state (the core, the session table, the queued and
in-flight jobs, the counters) and runs the loop described in :mod:`.loop`. It is built and run
on the engine thread by :class:`~.loop.EngineDriver`, and every attribute and method here is
for that thread only: other threads reach it by posting messages to the shared inbox (or
:class:`~.jobs.Call` to run a function between steps).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import threading
import time
from collections import Counter, deque
from typing import Any

import torch

from ..dedup import TokensKey
from .build import ModelInfo
from .bursts import Burst, BurstHost
from .core import EngineCore, StepResult
from .eviction import SessionEviction
from .faults import FaultRecovery
from .forcing import ParticleHost
from .forks import count_fork
from .jobs import (
    Call,
    Cancel,
    Job,
    Message,
    Outbox,
    PostJobs,
    Stop,
    fail_messages,
    on_engine_device,
)
from .loop_stats import LoopStats
from .sampler import draw_token, seeded_generator
from .scoring import SCORING_KINDS, ScoringQueue
from .sessions import SessionTable
from .transfer import move_rows

logger = logging.getLogger(__name__)

Tokens = tuple[int, ...]

#: Idle sessions are evicted (least recently used first) while KV usage is above this fraction.
DEFAULT_KV_EVICT_THRESHOLD = 0.9
#: With ``parts > 1``: the fewest queries admitted in one engine step.
MIN_PART = 8


class StepLoop(SessionEviction, BurstHost, FaultRecovery, LoopStats):
    """The engine thread's state and loop (engine thread only).

    Args:
        core: the engine core it drives.
        info: the model facts, with ``mode`` (``"sessions"`` or ``"requests"``) decided.
        inbox, wake: the messages other threads post, and the event they set after posting.
        output_device: where rows are delivered (None: where the core puts them).
        max_sessions: cap on idle sessions (None: ``info.max_num_seqs``).
        kv_threshold: evict idle sessions while KV usage is above this fraction.
        parts: admit a group of queries over this many engine steps (at least
            :data:`MIN_PART` queries a step), so the first part's rows reach the program while
            the engine computes the next part; 1 (the default) admits a group at once.
        forks: whether a fork may share its parent's KV tail (the core marks it for the
            scheduler, :mod:`.forks`), and why (or why not).
    """

    def __init__(
        self,
        core: EngineCore,
        info: ModelInfo,
        inbox: deque[Message],
        wake: threading.Event,
        *,
        output_device: torch.device | None,
        max_sessions: int | None,
        kv_threshold: float,
        parts: int = 1,
        forks: tuple[bool, str] = (False, "forks not requested"),
    ) -> None:
        self.core = core
        self.info = info
        self.resumable = info.mode == "sessions"
        self.output_device = output_device
        self.log_stats = core.log_stats
        self._reports_tokens = core.reports_tokens
        self._split_lora = core.split_lora
        self._inbox = inbox
        self._wake = wake
        self._kv_threshold = kv_threshold
        self._parts = max(1, int(parts))
        self._part = 0  # most new requests per admission round (0: no limit)
        self._max_num_seqs = max(1, info.max_num_seqs)
        cap = self._max_num_seqs if max_sessions is None else max_sessions
        self._max_idle = min(cap, self._max_num_seqs)
        self._ids = itertools.count()
        self._table = SessionTable()
        self._queue: deque[Job] = deque()  # admitted in order by _admit()
        self._by_rid: dict[str, Job] = {}
        self._by_key: dict[TokensKey, Job] = {}
        self._outbox = Outbox()
        self._forks_ok, self._forks_why = forks
        self._block = max(1, info.block_size)
        # Parents of forks in flight, by request id: eviction spares them while it can, so the
        # fork finds the parent's tail block when it is scheduled.
        self._pins: Counter[str] = Counter()
        self._forks = {"copied": 0, "aligned": 0, "reprefilled": 0, "saved_tokens": 0}
        self._stalls = 0
        self._counts = {"engine_calls": 0, "engine_steps": 0, "engine_requests": 0, "rows": 0}
        self._tokens = {"prefill": 0, "session": 0, "cached": 0, "scheduled": 0}
        self._prefix_cache = {"queries": 0, "hits": 0}
        # Wall time of the engine thread since the loop started, split three ways (seconds):
        # inside core.step(), our own work, and waiting for work (the program's turn). Two parts
        # of "host" are also counted alone: "admit" (queued jobs made requests, caps and KV
        # eviction before a step) and "route" (a step's outputs to their jobs: rows delivered,
        # bursts' controllers and their next rounds queued).
        self._time = {"step": 0.0, "host": 0.0, "idle": 0.0, "admit": 0.0, "route": 0.0}
        self._scoring = ScoringQueue(self)  # score jobs: their own queue and requests (.scoring)
        self._bursts: dict[int, Burst] = {}  # controller runs in progress, by id(job) (.bursts)
        self._burst_counts = dict.fromkeys(("started", "finished", "failed", "cancelled", "sessions_released"), 0)
        self._particles = ParticleHost(self)  # runs whose particles are running requests (.forcing)
        # Failed engine steps and what was dropped after them (see _after_failed_step); runs
        # failed by their controller or by our own burst code (.bursts); blocking calls refused
        # on this thread (EngineDriver.refuse_engine_thread).
        self._faults = dict.fromkeys(("failed_steps", "requests_failed", "sessions_dropped", "prefix_cache_resets",
                                      "prefix_cache_reset_failures", "controller_errors", "burst_errors",
                                      "blocking_calls"), 0)
        self._cache_suspect = False  # a failed step's blocks may still be in the prefix cache

    def run(self) -> None:
        clock = time.perf_counter
        spent = self._time
        mark = clock()
        while True:
            self._wake.clear()
            stop = self._drain()
            if stop is not None:
                self.stop(stop)
                return
            if self._cache_suspect and not self._by_rid:
                self._restore_prefix_cache()  # vLLM refused after the failure: again, before new work
            ta = clock()
            self._admit()
            self._scoring.admit()
            if self._by_rid or self._particles.runs:
                # Before the step too: vLLM counts parked sessions toward max_num_seqs and never
                # preempts them, so after a resample the unchosen parents would keep forks waiting.
                self._enforce_caps()
                self._evict_for_kv()
                t0 = clock()
                spent["admit"] += t0 - ta
                spent["host"] += t0 - mark
                self._step()
                mark = clock()
                self._enforce_caps()
            elif not self._inbox and not self._queue:
                self._outbox.flush()
                t0 = clock()
                spent["host"] += t0 - mark
                self._wake.wait()
                mark = clock()
                spent["idle"] += mark - t0

    def _drain(self) -> cf.Future | None:
        inbox = self._inbox
        while inbox:
            match inbox.popleft():
                case PostJobs(jobs):
                    self._queue.extend(jobs)
                    self._counts["engine_calls"] += 1
                    if self._parts > 1:
                        self._part = max(MIN_PART, -(-len(self._queue) // self._parts))
                case Cancel(job):
                    self._cancel(job)
                case Call(fn, args, kwargs, fut):
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn(*args, **kwargs))
                        except BaseException as e:  # noqa: BLE001 - handed to the caller
                            fut.set_exception(e)
                case Stop(done):
                    return done
        self._outbox.flush()  # results of calls and cancellations
        return None

    # ---------------------------------------------------------------- admission
    def _admit(self) -> None:
        """Turn queued jobs into engine requests, in order."""
        queue = self._queue
        by_key = self._by_key
        budget = self._part or len(queue)
        while queue and budget > 0:
            job = queue[0]
            if not job.wanted():
                queue.popleft()
                continue
            if job.kind in SCORING_KINDS:  # admitted by the scoring queue, under its own caps
                self._scoring.enqueue(queue.popleft())
                continue
            if job.kind == "burst":  # its particles' rows come back as queued row jobs (.bursts)
                self._start_burst(queue.popleft())
                continue
            if self.lora_kind_busy(job):
                return
            queue.popleft()
            if job.kind == "logprobs":
                key = job.key = TokensKey.of(job.adapter, job.ids, job.key)
                twin = by_key.get(key)
                if twin is not None:
                    job.join(twin)
                    continue
                by_key[key] = job
            budget -= 1
            if job.kind == "sample":
                self._start_sample(job)
            else:
                self._start_rows(job, job.ids)

    def lora_kind_busy(self, job: Job) -> bool:
        """Whether ``job`` must wait for the other kind (base model or adapter) to leave the
        engine: the core keeps them in separate steps (``split_lora``; also :mod:`.scoring`)."""
        if not self._split_lora:
            return False
        adapter = job.lora is not None
        if self._by_rid and (next(iter(self._by_rid.values())).lora is not None) != adapter:
            return True
        return self._particles.lora_kind_running(not adapter)  # runs on the requests path

    def _start_rows(self, job: Job, ids: Tokens) -> None:
        """Send a request whose last row is wanted: a session chunk, a new session (a fork when
        it extends what a continued session had computed) or a plain request."""
        table = self._table
        resumable = self.resumable
        session = job.session
        fork = None
        if session is not None:  # seeded sampling: the job owns its session
            chunk = ids[len(session.tokens):]
            table.extend(session, chunk)
            rid, tag, tokens, is_chunk = session.rid, f"{session.rid}.{session.chunks}", list(chunk), True
        elif resumable and (session := table.find(job.adapter, ids)) is not None:
            chunk = table.claim(session, ids)
            table.counters.continued += 1
            rid, tag, tokens, is_chunk = session.rid, f"{session.rid}.{session.chunks}", list(chunk), True
        elif resumable:
            parent = table.find_fork(job.adapter, ids)
            if parent is None:
                table.counters.opened += 1
            else:
                table.counters.forked += 1
                if self._forks_ok:
                    fork = job.fork = (parent.rid, len(parent.base.ids))  # type: ignore[union-attr]
                    self._pins[parent.rid] += 1
                else:
                    self._forks["reprefilled"] += 1
            rid = f"s{next(self._ids)}"
            session = table.open(rid, job.adapter, ids)
            tag, tokens, is_chunk = f"{rid}.0", list(ids), False
        else:
            rid = f"q{next(self._ids)}"
            tag, tokens, is_chunk = rid, list(ids), False
        job.rid, job.tag, job.session = rid, tag, session
        try:
            if fork is None:
                self.core.add_rows(rid, tokens, tag, job.lora, resumable)
            else:
                self.core.add_rows(rid, tokens, tag, job.lora, resumable, fork)
        except Exception as e:  # noqa: BLE001 - this job's error only
            self._end_job(job, exc=e, abort=is_chunk)
            return
        self._by_rid[rid] = job
        self._counts["engine_requests"] += 1
        self._tokens["session" if is_chunk else "prefill"] += len(tokens)

    def _start_sample(self, job: Job) -> None:
        spec = job.spec
        assert spec is not None
        rid = f"g{next(self._ids)}"
        job.rid = rid
        try:
            self.core.add_sample(rid, list(job.ids), spec.max_tokens, spec.temperature, spec.eos, job.lora)
        except Exception as e:  # noqa: BLE001
            self._outbox.resolve(job, exc=e)
            return
        self._by_rid[rid] = job
        self._counts["engine_requests"] += 1
        self._tokens["prefill"] += len(job.ids)

    # ---------------------------------------------------------------- stepping
    def _step(self) -> None:
        core = self.core
        clock = time.perf_counter
        t0 = clock()
        try:
            result = core.step()
        except Exception as e:  # noqa: BLE001 - fails this step's jobs only
            self._time["step"] += clock() - t0
            self._after_failed_step(e)
            return
        t1 = clock()
        self._time["step"] += t1 - t0
        self._counts["engine_steps"] += 1
        self._read_stats(result)
        if not result.executed:
            self._on_stall()
        else:
            self._stalls = 0
        self._route(result, core)
        if self._particles.runs:
            self._particles.after_step(result.outputs)
        self._outbox.flush()
        routed = clock() - t1
        self._time["route"] += routed
        self._time["host"] += routed  # the loop counts host time up to the step, this after it

    def _route(self, result: StepResult, core: EngineCore) -> None:
        """Resolve the jobs whose requests finished in this step."""
        by_rid = self._by_rid
        rows: list[tuple[Job, torch.Tensor]] = []
        for out in result.outputs:
            job = by_rid.get(out.request_id)
            if job is None:
                continue
            row = self._guarded(job, "routing its output", self._route_one, job, out, core)
            if row is not None:
                rows.append((job, row))
        if rows:
            self._deliver(rows)

    def _route_one(self, job: Job, out: Any, core: EngineCore) -> torch.Tensor | None:
        """Handle one output of ``job``; returns its row when a row job finished (the caller
        delivers the step's rows together)."""
        if job.kind in SCORING_KINDS:
            self._scoring.route(job, out)
            return None
        if job.kind == "sample":
            job.out.extend(out.new_token_ids)
            if out.finish_reason is not None:
                del self._by_rid[out.request_id]
                toks = job.out
                if toks and job.spec is not None and toks[-1] in job.spec.eos:
                    toks.pop()
                self._outbox.resolve(job, toks)
            return None
        if out.finish_reason is None:
            return None
        prefill = getattr(out, "prefill_stats", None)
        if prefill is not None:
            self._tokens["cached"] += int(getattr(prefill, "num_cached_tokens", 0) or 0)
        if job.fork is not None:
            count_fork(self._forks, job.fork[1], prefill, self._block)
        row = core.sink.pop(job.tag)  # type: ignore[arg-type]
        if row is None:
            self._end_job(job, exc=RuntimeError(
                f"vLLM {self.info.vllm_version} finished request {job.rid} without the capture seeing "
                "its logits; is another logits processor or speculative decoding interfering?"
            ), abort=True)
            return None
        if job.kind == "logprobs":
            return row
        self._next_seeded(job, row)
        return None

    def _deliver(self, rows: list[tuple[Job, torch.Tensor]]) -> None:
        """Resolve row jobs; every waiter gets a tensor of its own on its own device: a burst's
        ticket (``on_device``) the row where the engine made it, any other waiter a row on
        ``output_device``, whoever else joined the job (:meth:`_end_row_job`). The rows some
        waiter wants on ``output_device`` move there together, in one copy."""
        device = self.output_device
        there: dict[int, torch.Tensor] = {}  # id(job) -> its row on output_device
        if device is not None:
            move = [(job, r) for job, r in rows if r.device != device
                    and any(not w.done() and not on_engine_device(w) for w in job.waiters)]
            if move:
                try:
                    moved = move_rows([r for _, r in move], device)  # pinned + async from CUDA to CPU
                    there = {id(job): r for (job, _), r in zip(move, moved, strict=True)}
                except Exception:  # noqa: BLE001 - e.g. out of memory: row by row, a failure fails its job alone
                    for job, r in move:
                        m = self._guarded(job, f"moving its row to {device}", r.to, device)
                        if m is not None:
                            there[id(job)] = m
                    failed = {id(job) for job, _ in move} - there.keys()
                    rows = [(job, r) for job, r in rows if id(job) not in failed]
        self._counts["rows"] += len(rows)
        for job, row in rows:
            self._guarded(job, "delivering its row", self._end_row_job, job, row, there.get(id(job), row))

    def _end_row_job(self, job: Job, row: torch.Tensor, out: torch.Tensor) -> None:
        """Resolve a row job with ``row`` (engine's device) and ``out`` (``row`` on
        ``output_device``, or ``row`` itself): :meth:`~.jobs.Outbox.resolve_rows`."""
        live = [w for w in job.waiters if not w.done()]
        if len(live) <= 1:
            self._end_job(job, row if live and on_engine_device(live[0]) else out)
        else:
            self._outbox.resolve_rows(job, row, out)
            self._end_job(job)  # bookkeeping; every waiter is resolved already

    def _next_seeded(self, job: Job, row: torch.Tensor) -> None:
        spec = job.spec
        assert spec is not None and spec.seed is not None
        if job.generator is None:  # made here, so that a seed torch refuses fails this job only
            job.generator = seeded_generator(spec.seed)
        token = draw_token(row, spec.temperature, job.generator)
        job.out.append(token)
        total = len(job.ids) + len(job.out)
        if token in spec.eos or len(job.out) >= spec.max_tokens or total >= self.info.max_model_len:
            toks = job.out[:-1] if token in spec.eos else job.out
            self._end_job(job, value=list(toks))
            return
        del self._by_rid[job.rid]  # type: ignore[arg-type]
        # A session job sends the token as a chunk; a plain one, a new request per token.
        self._start_rows(job, job.ids + tuple(job.out))

    # ---------------------------------------------------------------- job endings
    def _end_job(self, job: Job, value: Any = None, exc: BaseException | None = None, abort: bool = False) -> None:
        """Resolve ``job``; park its session (success) or abort its request (``abort``)."""
        if job.kind in SCORING_KINDS:
            self._scoring.end(job, exc, abort)
            return
        rid = job.rid
        if rid is not None and self._by_rid.get(rid) is job:
            del self._by_rid[rid]
        if job.kind == "logprobs":
            key = TokensKey.of(job.adapter, job.ids, job.key)
            if self._by_key.get(key) is job:
                del self._by_key[key]
        if job.tag is not None and value is None:
            self.core.sink.discard([job.tag])  # a row the job will never take
        if job.fork is not None:
            self._unpin(job.fork[0])
            job.fork = None
        session = job.session
        if abort and rid is not None:
            self._abort([rid])
        if session is not None:
            if exc is None and not abort:
                old = self._table.park(session.rid, job.key)
                if old is not None:
                    self._evict(old, indexed=False)
            elif self._table.drop(session.rid) is not None:
                self._table.counters.closed += 1
        self._outbox.resolve(job, value, exc)

    def _cancel(self, job: Job) -> None:
        if job.kind == "burst":
            burst = self._bursts.get(id(job))
            if burst is not None:
                burst.cancel()
            return
        if job.kind in SCORING_KINDS:
            self._scoring.cancel(job)
            return
        if job.kind == "logprobs":  # its waiters may have joined an identical job in flight
            job = self._by_key.get((job.adapter, job.ids), job)
        if job.wanted():
            return
        if job.rid is not None and self._by_rid.get(job.rid) is job:
            self._end_job(job, abort=True)
        elif job.kind == "logprobs" and self._by_key.get((job.adapter, job.ids)) is job:
            del self._by_key[(job.adapter, job.ids)]

    def _abort(self, rids: list[str]) -> None:
        try:
            self.core.abort(rids)
        except Exception:  # noqa: BLE001 - the request may already be gone
            logger.warning("could not abort request(s) %s", rids, exc_info=True)

    # ---------------------------------------------------------------- shutdown
    def stop(self, done: cf.Future, err: BaseException | None = None) -> None:
        if err is None:
            err = RuntimeError("the engine was shut down while the request was pending")
        for job in list(self._by_rid.values()) + list(self._queue):
            self._outbox.resolve(job, exc=err)
        for burst in list(self._bursts.values()):
            burst.fail(err)
        self._particles.close()
        self._scoring.stop(err)
        self._by_rid.clear()
        self._by_key.clear()
        self._queue.clear()
        fail_messages(self._inbox, self._outbox, err)  # calls posted before the stop get an answer too
        try:
            self.core.release()
        except Exception:  # noqa: BLE001 - freeing is best effort; say what failed
            logger.warning("could not shut the engine down cleanly", exc_info=True)
        done.set_result(None)
