"""``AsyncVirtualLM``: full-vocabulary next-token log-probabilities from vLLM, sync and async.

How a row is computed: every query becomes an engine request (or, when it extends an earlier
query's tokens, a chunk of that query's streaming-input session) with ``max_tokens=1`` and a
unique tag in ``SamplingParams.extra_args``; the capture logits processor stores
``log_softmax`` of the raw logits of that request's last scheduled row. The engine thread
(:class:`~genlm_vlm.engine.EngineDriver`) steps vLLM itself and resolves each query as soon as
its request finishes. Async awaits reach it through :class:`~genlm_vlm.batching.AutoBatcher`
(streaming mode: dedup, cache, cancellation); sync calls submit to the same loop and wait.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import difflib
import inspect
import os
import threading
from typing import Any

import torch

from .base import ClosedError, SampleArgs, TokenIds
from .batching import AutoBatcher
from .cache import OutputCache
from .checks import check_engine_path, check_flag
from .continuation import _topk
from .engine import EngineDriver, SampleSpec, Ticket, make_lora_request, wait_all
from .engine.scoring import ScoreResult, ScoreSpec
from .lora import Adapter, UnknownAdapterError
from .serving import Query, ServingLM
from .sync_rows import _OOM_ERRORS, _SYNC_STATS, SyncRows, _check_chunk_sizes  # noqa: F401 - importable here too

__all__ = ["AsyncVirtualLM", "ClosedError"]  # ClosedError lives in base; re-exported here

#: Keyword arguments of :meth:`AsyncVirtualLM.from_name` itself (the rest go to ``__init__``).
_FROM_NAME_OPTIONS = ("engine_opts", "output_device", "sessions", "forks", "max_sessions", "delivery_parts")


#: Why a scoring call went to the rows (``stats["scoring"]["fallback"]``): ``method="rows"``,
#: an engine without the prompt-logprobs path, a top-k query whose row is in the output cache.
_FALLBACKS = ("rows_requested", "unsupported", "topk_row_cached")


def _clone(row: torch.Tensor) -> torch.Tensor:
    return row.clone()


class AsyncVirtualLM(SyncRows, ServingLM):
    """A vLLM model that hands out next-token log-probability rows to many concurrent awaiters.

    Rows are 1-D ``torch.float32`` tensors of length :attr:`vocab_size` (the model's logit
    width), normalised (``logsumexp == 0``), on ``output_device`` (CPU by default; ``"engine"``
    keeps them on the engine's device). Every returned tensor is the caller's own copy.

    Results are cached per ``(adapter, token ids)`` in an :class:`~genlm_vlm.cache.OutputCache`
    bounded by ``cache_size`` entries and ``cache_opts["max_bytes"]`` bytes, which keeps a row
    the second time it is computed (``cache_opts["admit_after"]``: 2; 1 keeps every row), so a
    workload that never asks twice (SMC) pays nothing for it; identical prompts in flight are
    computed once, awaited or blocking (one cache-and-dedup step,
    :func:`genlm_vlm.batching.lookup`). Blocking calls send at most ``chunk_size`` prompts per
    engine call and halve a chunk that runs out of memory, down to ``min_chunk_size``. Without a
    ``seed``, ``sample`` draws with vLLM's sampler; with one, genlm_vlm draws from the model's
    rows with ``torch.Generator(seed)`` (one decode step per token through a session), so the
    same seed gives the same tokens whatever else runs in the batch. Build with
    :meth:`from_name`; release with :meth:`cleanup` or a ``with`` / ``async with`` block.
    """

    #: llamppl's ``CachedCausalLM`` and other ``isinstance`` checks against genlm-backend's
    #: ``AsyncVirtualLM`` accept this class (registered once genlm-backend is loaded).
    genlm_backend_class = "AsyncVirtualLM"

    def __init__(
        self,
        driver: EngineDriver,
        *,
        batch_size: int = 256,
        timeout: float = 0.0,
        cache_size: int | None = 10_000,
        cache_opts: dict[str, Any] | None = None,
        chunk_size: int = 1024,
        min_chunk_size: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, timeout=timeout)
        _check_chunk_sizes(chunk_size, min_chunk_size)
        self._driver = driver
        self.tokenizer = driver.tokenizer()
        self._vocab_size = driver.info.vocab_size
        self.max_model_len = driver.info.max_model_len
        self.chunk_size = int(chunk_size)
        self.min_chunk_size = int(min_chunk_size)
        self.cache = OutputCache.from_options(cache_size, cache_opts)
        #: vLLM's ``LoRARequest`` of each registered adapter, by its id (pruned on removal).
        self._lora_requests: dict[int, Any] = {}
        self._logprob_batcher: AutoBatcher[Query, torch.Tensor] = AutoBatcher(
            self._start_logprobs, batch_size=self.batch_size, timeout=self.timeout,
            cache=self.cache, deliver=_clone, name="logprobs", bursts=True,
        )
        self._sample_batcher: AutoBatcher[tuple[SampleArgs, Adapter | None], list[int]] = AutoBatcher(
            self._start_samples, batch_size=self.batch_size, timeout=self.timeout,
            dedupe=False, deliver=list, name="sample", bursts=True,
        )
        self._score_batcher: AutoBatcher[tuple[ScoreSpec, Adapter | None], ScoreResult] = AutoBatcher(
            self._start_scores, batch_size=self.batch_size, timeout=self.timeout,
            deliver=ScoreResult.copy, name="score", bursts=True,
        )
        self._fallbacks = dict.fromkeys(_FALLBACKS, 0)
        # Counters of the blocking path (the batchers count the awaited one); see ``stats``.
        self._sync_lock = threading.Lock()
        self._sync_stats = dict.fromkeys(_SYNC_STATS, 0)
        self._closed = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_name(
        cls,
        model_name: str | os.PathLike[str],
        engine_opts: dict[str, Any] | None = None,
        *,
        output_device: str | torch.device = "cpu",
        sessions: bool = True,
        forks: bool = True,
        max_sessions: int | None = None,
        delivery_parts: int = 1,
        **kwargs: Any,
    ) -> AsyncVirtualLM:
        """Build the vLLM engine for ``model_name`` (hub name or local path) and wrap it.

        ``engine_opts`` go to ``vllm.LLM`` unchanged (e.g. ``dtype``, ``max_model_len``,
        ``enable_lora``, ``max_num_batched_tokens``); genlm_vlm's defaults are prefix caching on
        and, on the CPU build, ``enforce_eager=True``, ``gpu_memory_utilization=0.3`` and
        ``block_size=32``. ``sessions`` (default True) keeps each query's request alive so a
        later query that extends it costs only its new tokens (vLLM >= 0.32; older versions use
        plain requests, see ``engine_info.mode``). ``forks`` (default True): when a query extends
        what another session had computed before it was continued (the siblings of a resampled
        SMC particle), its new session shares that session's KV cache, unfinished block
        included, so it computes only its new token (vLLM's copy-on-write of a block, reached
        through genlm_vlm's scheduler class; see ``stats["forks"]``); False, or where it cannot
        apply, the fork re-prefills the parent's unfinished block. ``max_sessions`` caps idle
        sessions (default vLLM's ``max_num_seqs``). ``delivery_parts`` (default 1) spreads a group of awaited
        queries over that many engine steps, so the program can work on the first part's rows
        while the engine computes the rest (see docs/BENCHMARKS.md for when it pays). Other
        keyword arguments go to :class:`AsyncVirtualLM`
        (``batch_size``, ``timeout``, ``cache_size``, ``cache_opts``, ``chunk_size``,
        ``min_chunk_size``); an unknown one raises ``TypeError`` before the engine is built.
        A model that cannot be found raises ``FileNotFoundError`` before vLLM is imported: a
        missing local path, or a hub id that is not in the local Hugging Face cache while the hub
        is unreachable or ``HF_HUB_OFFLINE=1`` (a cached model is then loaded from its snapshot;
        see :func:`genlm_vlm.engine.build.resolve_model`).
        """
        cls._check_options(kwargs)
        if isinstance(engine_opts, dict):  # a misspelled option fails before vLLM loads
            from .engine.options import check_option_names_early

            check_option_names_early(engine_opts)
        driver = EngineDriver(
            os.fspath(model_name),
            engine_opts,
            output_device=output_device,
            sessions=sessions,
            forks=forks,
            max_sessions=max_sessions,
            parts=delivery_parts,
        )
        try:
            return cls(driver, **kwargs)
        except BaseException:
            driver.shutdown()
            raise

    @classmethod
    def _check_options(cls, kwargs: dict[str, Any]) -> None:
        """Reject what ``cls(driver, **kwargs)`` would reject, before an engine is built."""
        params = inspect.signature(cls.__init__).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            accepted = [n for n, p in params.items() if p.kind in named and n not in ("self", "driver")]
            for key in kwargs:
                if key not in accepted:
                    close = difflib.get_close_matches(key, [*accepted, *_FROM_NAME_OPTIONS], n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise TypeError(
                        f"{cls.__name__}.from_name() got an unexpected keyword argument {key!r}{hint} "
                        f"(accepted: {', '.join([*_FROM_NAME_OPTIONS, *accepted])}; vLLM options "
                        "go in engine_opts)"
                    )
        _check_chunk_sizes(kwargs.get("chunk_size", 1), kwargs.get("min_chunk_size", 1))

    @property
    def vocab_size(self) -> int:
        """Logit width V: the length of every returned row."""
        return self._vocab_size

    @property
    def engine_info(self) -> Any:
        """:class:`~genlm_vlm.engine.ModelInfo`: vocab size, max length, model runner, ``mode``
        (``"sessions"`` or ``"requests"``), vLLM version, ``max_num_seqs``, ``block_size``."""
        return self._driver.info

    @property
    def llm(self) -> Any:
        """The underlying ``vllm.LLM`` (call it only through this object's methods while in use)."""
        self._check_open()
        return self._driver.llm

    # ------------------------------------------------------------------ engine submission
    def _lora_of(self, adapter: Adapter | None) -> Any:
        """The engine's form of ``adapter``: its ``LoRARequest`` (None for the base model). An
        adapter removed or replaced since the call resolved it: ``UnknownAdapterError``."""
        if adapter is None:
            return None
        request = self._lora_requests.get(adapter.int_id)
        if request is None:
            raise UnknownAdapterError(
                f"LoRA adapter {adapter.name!r} was removed or replaced while this call was pending"
            )
        return request

    def _submit(self, items: list[Any], make: Any, submit: Any, listener: Any, payloads: Any) -> list[Any]:
        """``submit([make(item, lora_request) ...])`` for the items whose adapter is still
        registered; the others fail with ``UnknownAdapterError`` (that caller only). Without
        ``listener`` each item gets a ``concurrent.futures.Future``; with one, a
        :class:`~genlm_vlm.engine.Ticket` (the engine reports results through ``listener``)."""
        handles: list[Any] = [None] * len(items)
        ready, index, failed = [], [], []
        for i, (item, adapter) in enumerate(items):
            try:
                lora = self._lora_of(adapter)
            except UnknownAdapterError as e:
                if listener is None:
                    handles[i] = cf.Future()
                    handles[i].set_exception(e)
                else:
                    handles[i] = Ticket(listener, payloads[i])
                    handles[i].resolved = True
                    failed.append((handles[i], None, e))
                continue
            ready.append(make(item, lora))
            index.append(i)
        if ready:
            sub = None if payloads is None else [payloads[i] for i in index]
            for i, handle in zip(index, submit(ready, listener, sub), strict=True):
                handles[i] = handle
        if failed:
            listener(failed)
        return handles

    def _start_logprobs(self, queries: list[Query], listener: Any = None, payloads: Any = None) -> list[Any]:
        """Hand queries to the engine loop: one future per query, or with ``listener`` one
        ticket per query whose row comes back through ``listener`` (the async batcher)."""
        # Each query's key goes along (hashed once, here), so the engine does not hash the ids again.
        return self._submit([(q, q.adapter) for q in queries], lambda q, lora: (q.ids, lora, q.key),
                            self._driver.submit_logprobs, listener, payloads)

    def _start_samples(self, reqs: list[tuple[SampleArgs, Adapter | None]], listener: Any = None,
                       payloads: Any = None) -> list[Any]:
        return self._submit(reqs, lambda s, lora: SampleSpec(*s, lora=lora), self._driver.submit_samples,
                            listener, payloads)

    def _start_scores(self, reqs: list[tuple[ScoreSpec, Adapter | None]], listener: Any = None,
                      payloads: Any = None) -> list[Any]:
        return self._submit(reqs, lambda s, lora: ScoreSpec(s.prompt, s.continuation, s.top_k, lora, s.greedy),
                            self._driver.submit_scores, listener, payloads)

    # ------------------------------------------------------------------ scoring hooks (AsyncLM)
    def _score_route(self, ids: tuple[int, ...], continuation: tuple[int, ...], adapter: Adapter | None,
                     top_k: int, method: str) -> bool:
        """Whether vLLM's prompt log-probabilities serve this query (else rows); counts why not."""
        facts = self._driver.scoring
        why = None
        if method == "rows":
            why = "rows_requested"
        elif not facts.supported:
            why = "unsupported"
        elif not continuation and Query(ids, adapter).key in self.cache:
            why = "topk_row_cached"
        if why is None:
            return True
        with self._sync_lock:
            self._fallbacks[why] += 1
        return False

    async def _direct_scores(self, prompt: tuple[int, ...], continuation: tuple[int, ...], lora_name: str | None,
                             top_k: int, method: str) -> ScoreResult | None:
        self._check_open()
        adapter = self._loras.resolve(lora_name)
        if not self._score_route(prompt, continuation, adapter, top_k, method):
            return None
        spec = ScoreSpec(prompt, continuation, top_k)
        return await self._score_batcher.submit((spec, adapter), (0 if adapter is None else adapter.int_id, spec))

    def _score_futures(self, items: Any, method: str = "auto", greedy: bool = False) -> list[Any] | None:
        """One future per ``(prompt, continuation, lora_name, top_k)``; an unknown adapter fails
        its own item. None (rows) when the prompt-logprobs path is off or ``method="rows"``.
        ``greedy``: each result also says whether the continuation is greedy (``ScoreResult.greedy``)."""
        self._check_open()
        if not self._driver.scoring.supported or method == "rows":
            self._score_route((), (), None, 0, method)  # counts why
            return None
        handles: list[Any] = [None] * len(items)
        ready: list[tuple[ScoreSpec, Adapter | None]] = []
        where: list[int] = []
        for i, (prompt, cont, lora_name, top_k) in enumerate(items):
            try:
                adapter = self._loras.resolve(lora_name)
            except ValueError as e:  # UnknownAdapterError: this item only
                handles[i] = cf.Future()
                handles[i].set_exception(e)
                continue
            if not self._score_route(prompt, cont, adapter, top_k, method):  # a cached row's top-k
                handles[i] = _rows_topk(self, prompt, lora_name, top_k)
                continue
            ready.append((ScoreSpec(tuple(prompt), tuple(cont), top_k, greedy=greedy), adapter))
            where.append(i)
        for i, handle in zip(where, self._start_scores(ready) if ready else (), strict=True):
            handles[i] = handle
        return handles

    def _compute_rows(self, queries: list[Query]) -> list[torch.Tensor]:
        """Blocking rows for ``queries``; an interrupt (Ctrl-C) aborts their requests."""
        return wait_all(self._start_logprobs(queries))

    # ------------------------------------------------------------------ ServingLM hooks
    def _batchers(self) -> tuple[AutoBatcher[Any, Any], ...]:
        return (self._logprob_batcher, self._sample_batcher, self._score_batcher)

    async def _row(self, query: Query) -> torch.Tensor:
        return await self._logprob_batcher.submit(query, query.key)

    async def _rows(self, queries: list[Query]) -> torch.Tensor:
        # One awaiter for the whole batch (no task per query); the same groups, dedup and cache.
        return torch.stack(await self._logprob_batcher.submit_many(queries, [q.key for q in queries]))

    async def _samples(self, specs: list[SampleArgs], adapter: Adapter | None) -> list[list[int]]:
        return list(await asyncio.gather(*(self._sample_batcher.submit((s, adapter)) for s in specs)))

    # ------------------------------------------------------------------ LoRA hooks
    def _check_lora_support(self) -> None:
        if not self._driver.info.lora_enabled:
            raise self._lora_disabled("this engine was")

    def _load_adapter(self, adapter: Adapter, previous: Adapter | None) -> None:
        """Load the adapter into the engine now (a bad path fails here)."""
        request = make_lora_request(adapter.name, adapter.int_id, adapter.path)
        try:
            self._driver.add_lora(request)
        except ValueError as e:
            raise ValueError(f"cannot load LoRA adapter {adapter.name!r} from {adapter.path!r}: {e}") from e
        self._lora_requests[adapter.int_id] = request

    def _drop_adapter(self, adapter: Adapter, replaced_by: Adapter | None) -> None:
        """Forget its ``LoRARequest`` and free its weights (and idle sessions) in the engine."""
        self._lora_requests.pop(adapter.int_id, None)
        self._driver.remove_lora(adapter.int_id)

    # ------------------------------------------------------------------ housekeeping
    # ------------------------------------------------------------------ controllers (genlm_vlm.smc)
    def _submit_burst(self, prompt_ids: Any, controller: Any, lora_name: str | None, start: Any,
                      prompts: Any = None, engine_path: Any = "auto") -> cf.Future:
        from .smc.product import resolve_prompts

        self._check_open()
        path = check_engine_path(engine_path)
        prompt, prompts = resolve_prompts(self, prompt_ids, prompts)
        lora = self._lora_of(self._loras.resolve(lora_name))
        return self._driver.submit_burst(prompt, controller, lora, start, prompts, path)

    async def run_controller(self, prompt_ids: TokenIds | None, controller: Any, *, lora_name: str | None = None,
                             start: Any = None, prompts: Any = None, engine_path: str = "auto") -> Any:
        """Run a :class:`~genlm_vlm.smc.Controller` on the engine thread: each engine step hands
        it the rows of its live particles and continues them with the tokens it chose, with no
        trip through the event loop per token (see :mod:`genlm_vlm.smc`).
        Cancelling the await abandons the run's requests at the next engine step. ``prompts``:
        a product of prompts, as in :meth:`~genlm_vlm.AsyncLM.run_controller`.
        ``engine_path="requests"``: the particles decode as running requests whose tokens are
        forced inside vLLM's sampler (:mod:`genlm_vlm.engine.particles`); a run that path does not
        cover yet runs as a burst, and ``stats["engine_path_fallback"]`` of an SMC result
        (``lm.stats["particle_requests"]["fallbacks"]`` for any controller) says why.
        ``"auto"`` (the default) takes the requests path where it was measured (vLLM's CPU
        build) and bursts elsewhere, with the reason (:mod:`genlm_vlm.engine.paths`);
        ``"bursts"``: always a burst."""
        result = await asyncio.wrap_future(self._submit_burst(prompt_ids, controller, lora_name, start, prompts,
                                                              engine_path))
        if isinstance(getattr(result, "stats", None), dict):
            result.stats["where"] = "engine"
        return result

    def smc_sync(self, prompt_ids: TokenIds, constraint: Any, n_particles: int, max_tokens: int,
                 **kwargs: Any) -> Any:
        """Blocking :meth:`smc` (same arguments), from any thread; an interrupt (Ctrl-C)
        abandons the run."""
        import time

        from .smc import api
        from .smc.algorithm import warn_if_empty

        in_engine = check_flag(kwargs.pop("in_engine", True), "in_engine")
        engine_path = check_engine_path(kwargs.pop("engine_path", "auto"))
        if not in_engine:
            return super().smc_sync(prompt_ids, constraint, n_particles, max_tokens, in_engine=False, **kwargs)
        lora_name = kwargs.get("lora_name")
        prompt, prompts, critic = api.check_options(self, prompt_ids, max_tokens, kwargs.pop("prompts", None),
                                                    kwargs.pop("critic", None), kwargs)
        prompt, controller = api.prepare(self, prompt, constraint, n_particles, max_tokens, **kwargs)
        t0 = time.perf_counter()
        [result] = wait_all([self._submit_burst(None if prompts else prompt, controller, lora_name, None, prompts,
                                                engine_path)])
        if critic is not None:
            api.criticise_sync(result, critic)
        result.stats.update(where="engine", wall_s=round(time.perf_counter() - t0, 6))
        warn_if_empty(result)
        return result

    def warm_up(self, prefix_token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """Prime the engine's prefix cache (and this object's output cache) for a shared prompt.

        Later prompts that extend ``prefix_token_ids`` reuse its KV blocks, and its row is kept
        in the output cache (whatever ``admit_after`` says). Returns its row.
        """
        query = self._query(prefix_token_ids, lora_name)
        row = self._rows_sync([query], None, False)[0]
        self.cache.put(query.key, row.clone())  # the caller's row stays its own
        return row

    def clear_cache(self) -> None:
        """Drop every cached row and release every idle session (the engine's prefix cache is
        left alone)."""
        self.cache.clear()
        if not self._closed:
            self._driver.release_sessions()

    def release_sessions(self) -> int:
        """Release every idle session and its KV blocks now; returns how many were released.

        Full blocks stay in vLLM's prefix cache, so a later query over the same tokens is still
        cheap. Sessions in use by a pending query are not touched.
        """
        self._check_open()
        return self._driver.release_sessions()

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: the engine loop's, then this object's.

        From the engine loop (any further keys it reports are passed through): ``mode``,
        ``engine_calls`` (groups of queries handed to the engine loop), ``engine_steps`` (vLLM
        steps run), ``engine_requests`` (requests and session chunks added), ``sessions``
        (``opened``, ``continued``, ``forked``, ``evicted``, ``closed``, ``live``, ``idle``),
        ``tokens`` (prompt tokens sent as new requests: ``prefill``; as session chunks:
        ``session``; served from the prefix cache: ``cached``; scheduled by the engine:
        ``scheduled``, None unless the engine was built with ``disable_log_stats=False`` and
        ``enable_logging_iteration_details=True``). Then ``logprobs``/``sample`` (batcher
        counters of the awaited methods), ``sync`` (the blocking ``next_token_logprobs_sync`` /
        ``batch_next_token_logprobs_sync``, and what is built on them: ``calls``, ``rows``
        returned, rows served by the output cache ``cache_hits``, by an identical prompt of the
        same call ``dedup_joins``, by the engine ``computed``, and ``engine_calls`` made, a chunk
        retried after out-of-memory counting again), ``cache`` (output cache),
        ``capture_apply_calls``, ``prefix_cache`` (token ``queries`` and ``hits``; None unless
        ``disable_log_stats=False``), ``faults`` (engine steps that raised, the requests and
        sessions they cost, and the prefix-cache resets after them; see docs/API.md).
        """
        with self._sync_lock:
            sync = dict(self._sync_stats)
            fallbacks = dict(self._fallbacks)
        engine = self._driver.stats()
        engine["scoring"] = {**engine.get("scoring", {}), "fallback": fallbacks}
        return {
            **engine,
            "score": self._score_batcher.stats,
            "logprobs": self._logprob_batcher.stats,
            "sample": self._sample_batcher.stats,
            "sync": sync,
            "cache": self.cache.stats(),
        }

    def _close_impl(self) -> None:
        """Shut the engine down and free its memory."""
        self._driver.shutdown()
        self.cache.clear()


def _rows_topk(lm: AsyncVirtualLM, prompt: tuple[int, ...], lora_name: str | None, k: int) -> cf.Future:
    """A done future holding the top ``k`` after ``prompt`` from its row (a top-k query whose row
    is in the output cache)."""
    fut: cf.Future = cf.Future()
    try:
        top = _topk(lm.next_token_logprobs_sync(prompt, lora_name=lora_name), k)
        fut.set_result(ScoreResult(torch.empty(0, dtype=torch.float32), top.token_ids, top.logprobs))
    except Exception as e:  # noqa: BLE001 - this item's error
        fut.set_exception(e)
    return fut
