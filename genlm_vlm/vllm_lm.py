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
import difflib
import inspect
import logging
import os
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .base import AsyncLM, TokenIds, check_batch_size, check_timeout
from .batching import AutoBatcher
from .cache import OutputCache
from .engine import EngineDriver, SampleSpec, make_lora_request, wait_all
from .lora import Adapter, LoraRegistry

logger = logging.getLogger(__name__)

_OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, MemoryError)


class ClosedError(RuntimeError):
    """The model was cleaned up; it accepts no more calls."""


@dataclass(frozen=True, slots=True)
class _LogprobRequest:
    ids: tuple[int, ...]
    adapter: Adapter | None


@dataclass(frozen=True, slots=True)
class _SampleRequest:
    ids: tuple[int, ...]
    max_tokens: int
    eos: tuple[int, ...]
    temperature: float
    seed: int | None
    adapter: Adapter | None


#: Keyword arguments of :meth:`AsyncVirtualLM.from_name` itself (the rest go to ``__init__``).
_FROM_NAME_OPTIONS = ("engine_opts", "output_device", "sessions", "max_sessions")


def _check_chunk_sizes(chunk_size: int, min_chunk_size: int) -> None:
    if chunk_size < 1 or min_chunk_size < 1:
        raise ValueError("chunk_size and min_chunk_size must be >= 1")


#: Counters of ``stats["sync"]``: blocking calls, the rows they returned, and how each row was
#: obtained (``rows == cache_hits + dedup_joins + computed`` over the calls that returned).
_SYNC_STATS = ("calls", "rows", "cache_hits", "dedup_joins", "computed", "engine_calls")


def _clone(row: torch.Tensor) -> torch.Tensor:
    return row.clone()


class AsyncVirtualLM(AsyncLM):
    """A vLLM model that hands out next-token log-probability rows to many concurrent awaiters.

    Rows are 1-D ``torch.float32`` tensors of length :attr:`vocab_size` (the model's logit
    width), normalised (``logsumexp == 0``), on ``output_device`` (CPU by default; ``"engine"``
    keeps them on the engine's device). Every returned tensor is the caller's own copy.

    Results are cached per ``(adapter, token ids)`` in an :class:`~genlm_vlm.cache.OutputCache`
    bounded by ``cache_size`` entries and ``cache_opts["max_bytes"]`` bytes; identical prompts in
    flight are computed once. Build with :meth:`from_name`; release with :meth:`cleanup` or a
    ``with`` / ``async with`` block.
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
        _check_chunk_sizes(chunk_size, min_chunk_size)
        self._driver = driver
        self.tokenizer = driver.tokenizer()
        self._vocab_size = driver.info.vocab_size
        self.max_model_len = driver.info.max_model_len
        self.chunk_size = int(chunk_size)
        self.min_chunk_size = int(min_chunk_size)
        self.cache = OutputCache.from_options(cache_size, cache_opts)
        self._loras = LoraRegistry()
        self._lora_requests: dict[int, Any] = {}
        self._closed = False
        self._logprob_batcher: AutoBatcher[_LogprobRequest, torch.Tensor] = AutoBatcher(
            start=self._start_logprobs,
            batch_size=batch_size,
            timeout=timeout,
            cache=self.cache,
            deliver=_clone,
            name="logprobs",
        )
        # Counters of the blocking path (the batchers count the awaited one); see ``stats``.
        self._sync_lock = threading.Lock()
        self._sync_stats = dict.fromkeys(_SYNC_STATS, 0)
        self._sample_batcher: AutoBatcher[_SampleRequest, list[int]] = AutoBatcher(
            start=self._start_samples,
            batch_size=batch_size,
            timeout=timeout,
            dedupe=False,
            deliver=list,
            name="sample",
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_name(
        cls,
        model_name: str | os.PathLike[str],
        engine_opts: dict[str, Any] | None = None,
        *,
        output_device: str | torch.device = "cpu",
        sessions: bool = True,
        max_sessions: int | None = None,
        **kwargs: Any,
    ) -> AsyncVirtualLM:
        """Build the vLLM engine for ``model_name`` (hub name or local path) and wrap it.

        ``engine_opts`` go to ``vllm.LLM`` unchanged (e.g. ``dtype``, ``max_model_len``,
        ``enable_lora``, ``max_num_batched_tokens``); genlm_vlm's defaults are prefix caching on
        and, on the CPU build, ``enforce_eager=True``, ``gpu_memory_utilization=0.3`` and
        ``block_size=32``. ``sessions`` (default True) keeps each query's request alive so a
        later query that extends it costs only its new tokens (vLLM >= 0.32; older versions use
        plain requests, see ``engine_info.mode``). ``max_sessions`` caps idle sessions (default
        vLLM's ``max_num_seqs``). Other keyword arguments go to :class:`AsyncVirtualLM`
        (``batch_size``, ``timeout``, ``cache_size``, ``cache_opts``, ``chunk_size``,
        ``min_chunk_size``); an unknown one raises ``TypeError`` before the engine is built.
        A model that cannot be found raises ``FileNotFoundError`` before vLLM is imported: a
        missing local path, or a hub id that is not in the local Hugging Face cache while the hub
        is unreachable or ``HF_HUB_OFFLINE=1`` (a cached model is then loaded from its snapshot;
        see :func:`genlm_vlm.engine.build.resolve_model`).
        """
        cls._check_options(kwargs)
        driver = EngineDriver(
            os.fspath(model_name),
            engine_opts,
            output_device=output_device,
            sessions=sessions,
            max_sessions=max_sessions,
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
    def batch_size(self) -> int:
        """Most distinct queries handed to the engine loop in one group by the async batcher
        (default 256; settable, e.g. ``lm.batch_size = 64``, effective from the next group).

        The engine still schedules each step within vLLM's ``max_num_seqs`` and
        ``max_num_batched_tokens``; this only bounds how many async queries are dispatched at
        once. The sync API sends ``chunk_size`` prompts per call instead.
        """
        return self._logprob_batcher.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        value = check_batch_size(value)
        for batcher in (self._logprob_batcher, self._sample_batcher):
            batcher.batch_size = value

    @property
    def timeout(self) -> float:
        """Seconds the async batcher waits for more queries after the first one of an idle
        period before dispatching (default 0.0: dispatch at the next event-loop pass, so
        everything awaited together still goes together). Settable, effective from the next
        query."""
        return self._logprob_batcher.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        value = check_timeout(value)
        for batcher in (self._logprob_batcher, self._sample_batcher):
            batcher.timeout = value

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

    # ------------------------------------------------------------------ validation
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this AsyncVirtualLM was cleaned up; build a new one")

    def _request(self, token_ids: Any, lora_name: str | None, what: str = "token_ids") -> _LogprobRequest:
        self._check_open()
        return _LogprobRequest(self._check_ids(token_ids, what), self._loras.resolve(lora_name))

    @staticmethod
    def _key(req: _LogprobRequest) -> tuple[int, tuple[int, ...]]:
        return (0 if req.adapter is None else req.adapter.int_id, req.ids)

    # ------------------------------------------------------------------ engine submission
    def _lora_of(self, adapter: Adapter | None) -> tuple[int, Any]:
        if adapter is None:
            return 0, None
        return adapter.int_id, self._lora_requests[adapter.int_id]

    def _start_logprobs(self, reqs: list[_LogprobRequest]) -> list[Any]:
        """Hand queries to the engine loop; one ``concurrent.futures.Future`` per query."""
        return self._driver.submit_logprobs([(r.ids, *self._lora_of(r.adapter)) for r in reqs])

    def _compute_rows(self, reqs: list[_LogprobRequest]) -> list[torch.Tensor]:
        """Blocking rows for ``reqs``; an interrupt (Ctrl-C) aborts their requests."""
        return wait_all(self._start_logprobs(reqs))

    def _start_samples(self, reqs: list[_SampleRequest]) -> list[Any]:
        specs = []
        for r in reqs:
            key, lora = self._lora_of(r.adapter)
            specs.append(SampleSpec(r.ids, r.max_tokens, r.eos, r.temperature, r.seed, key, lora))
        return self._driver.submit_samples(specs)

    # ------------------------------------------------------------------ async API
    async def next_token_logprobs(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """Log-probabilities of the token after ``token_ids``: float32 ``[V]`` on ``output_device``.

        Concurrent awaits are batched into one engine call; identical prompts (same adapter)
        are computed once; cached rows do not touch the engine. ``lora_name`` selects a
        registered adapter (None: the default set by :meth:`set_lora`, else the base model).
        """
        req = self._request(token_ids, lora_name)
        return await self._logprob_batcher.submit(req, self._key(req))

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        """Rows for every prompt: float32 ``[N, V]`` in input order (batched with other awaits)."""
        reqs = [self._request(t, lora_name, f"token_ids_list[{i}]") for i, t in enumerate(token_ids_list)]
        if not reqs:
            return torch.empty((0, self._vocab_size), dtype=torch.float32)
        rows = await asyncio.gather(*(self._logprob_batcher.submit(r, self._key(r)) for r in reqs))
        return torch.stack(rows)

    async def sample(
        self,
        prompt_token_ids: TokenIds,
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """Sample up to ``max_tokens`` tokens after the prompt with vLLM's sampler.

        Stops after any token of ``eos_token_ids`` (the model's own EOS is not special), which is
        stripped from the result. ``temperature=0`` is greedy. Without ``seed`` vLLM's sampler
        draws the tokens; with a ``seed`` genlm_vlm draws them from the model's rows with
        ``torch.Generator(seed)`` (one decode step per token through a session), so the same seed
        gives the same tokens whatever else runs in the batch. Concurrent calls share engine
        steps. A sample also stops when prompt + sample reach ``max_model_len``; it then has fewer
        than ``max_tokens`` tokens and no EOS, and a :class:`~genlm_vlm.base.ContextLimitWarning`
        says so.
        """
        req = self._sample_request(prompt_token_ids, max_tokens, eos_token_ids, temperature, seed, lora_name)
        out = await self._sample_batcher.submit(req)
        self._warn_context_limit([req.ids], [out], req.max_tokens)
        return out

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[TokenIds],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        """:meth:`sample` for each prompt, in one engine call. With ``seed``, prompt ``i`` uses
        ``seed + i`` (reproducible, and identical prompts still get different samples). One
        :class:`~genlm_vlm.base.ContextLimitWarning` counts the samples cut by ``max_model_len``."""
        reqs = [
            self._sample_request(p, max_tokens, eos_token_ids, temperature, None if seed is None else seed + i, lora_name, f"prompt_token_ids_list[{i}]")
            for i, p in enumerate(prompt_token_ids_list)
        ]
        outs = list(await asyncio.gather(*(self._sample_batcher.submit(r) for r in reqs)))
        self._warn_context_limit([r.ids for r in reqs], outs, max_tokens)
        return outs

    def _sample_request(
        self, prompt: Any, max_tokens: Any, eos: Any, temperature: Any, seed: Any, lora_name: str | None,
        what: str = "prompt_token_ids",
    ) -> _SampleRequest:
        self._check_open()
        args = self._check_sample_args(prompt, max_tokens, eos, temperature, seed, what)
        return _SampleRequest(*args, self._loras.resolve(lora_name))

    # ------------------------------------------------------------------ sync API
    def next_token_logprobs_sync(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """Blocking :meth:`next_token_logprobs` (same engine call path, same cache)."""
        return self._rows_sync([self._request(token_ids, lora_name)], self.chunk_size, False)[0]

    def batch_next_token_logprobs_sync(
        self,
        token_ids_list: Sequence[TokenIds],
        lora_name: str | None = None,
        *,
        chunk_size: int | None = None,
        show_progress: bool = False,
    ) -> torch.Tensor:
        """Rows for every prompt, blocking: float32 ``[N, V]`` on ``output_device``.

        All prompts are validated first (a bad one raises before any engine work, naming its
        index). Cached rows are reused, duplicates computed once, and the rest sent in engine
        calls of at most ``chunk_size`` prompts. If a call runs out of memory, the chunk is halved
        and retried, down to ``min_chunk_size``; below that the error is re-raised.
        """
        reqs = [self._request(t, lora_name, f"token_ids_list[{i}]") for i, t in enumerate(token_ids_list)]
        return self._rows_sync(reqs, chunk_size or self.chunk_size, show_progress)

    def _count_sync(self, **counts: int) -> None:
        with self._sync_lock:
            for name, n in counts.items():
                self._sync_stats[name] += n

    def _rows_sync(self, reqs: list[_LogprobRequest], chunk_size: int, show_progress: bool) -> torch.Tensor:
        self._count_sync(calls=1)
        if not reqs:
            return torch.empty((0, self._vocab_size), dtype=torch.float32)
        keys = [self._key(r) for r in reqs]
        found: dict[Any, torch.Tensor] = {}
        todo: dict[Any, _LogprobRequest] = {}
        for k, r in zip(keys, reqs, strict=True):
            if k in found or k in todo:
                continue
            row = self.cache.get(k)
            if row is None:
                todo[k] = r
            else:
                found[k] = row
        hits = len(found)
        if todo:
            rows = self._run_chunked(list(todo.values()), chunk_size, show_progress)
            for k, row in zip(todo, rows, strict=True):
                self.cache.put(k, row)
                found[k] = row
        out = torch.stack([found[k] for k in keys])
        self._count_sync(
            rows=len(keys), cache_hits=hits, dedup_joins=len(keys) - len(found), computed=len(todo)
        )
        return out

    def _run_chunked(self, reqs: list[_LogprobRequest], chunk_size: int, show_progress: bool) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        size = max(int(chunk_size), self.min_chunk_size)
        bar = None
        if show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(reqs), desc="scoring", unit="prompt")
        try:
            while len(out) < len(reqs):
                chunk = reqs[len(out) : len(out) + size]
                self._count_sync(engine_calls=1)
                try:
                    # An interrupt (Ctrl-C) cancels the chunk: its requests are aborted.
                    rows = self._compute_rows(chunk)
                except _OOM_ERRORS:
                    if size <= self.min_chunk_size:
                        raise
                    size = max(self.min_chunk_size, size // 2)
                    logger.warning("out of memory on a chunk of %d prompts; retrying with %d", len(chunk), size)
                    continue
                out.extend(rows)
                if bar is not None:
                    bar.update(len(rows))
        finally:
            if bar is not None:
                bar.close()
        return out

    # ------------------------------------------------------------------ LoRA
    def add_new_lora(self, lora_path: str | os.PathLike[str], lora_name: str = "lora_1") -> None:
        """Register (or re-register) the adapter at ``lora_path`` under ``lora_name``.

        The adapter is loaded into the engine now, so a bad path fails here. Every registration
        gets a fresh vLLM id, so rows cached under an earlier registration of the name are never
        returned for this one. The engine needs ``enable_lora=True`` (and a ``max_lora_rank``
        at least the adapter's rank) in ``engine_opts``.
        """
        self._check_open()
        if not self._driver.info.lora_enabled:
            raise ValueError(
                "this engine was built without LoRA support: pass engine_opts={'enable_lora': True, "
                "'max_lora_rank': R} (R >= the adapter's rank) to AsyncVirtualLM.from_name"
            )
        adapter = self._loras.new(lora_name, lora_path)
        request = make_lora_request(adapter.name, adapter.int_id, adapter.path)
        try:
            self._driver.call(self._driver.add_lora, request)
        except ValueError as e:
            raise ValueError(f"cannot load LoRA adapter {lora_name!r} from {adapter.path!r}: {e}") from e
        self._lora_requests[adapter.int_id] = request
        old = self._loras.commit(adapter)
        if old is not None:
            self._driver.call(self._driver.remove_lora, old.int_id)

    def remove_lora(self, lora_name: str) -> None:
        """Unregister ``lora_name`` and free its weights in the engine. Unknown name: ValueError."""
        self._check_open()
        adapter = self._loras.remove(lora_name)
        self._driver.call(self._driver.remove_lora, adapter.int_id)

    def set_lora(self, lora_path: str | os.PathLike[str] | None = None, lora_name: str = "lora_1") -> None:
        """Make ``lora_name`` the default adapter for calls that pass ``lora_name=None``.

        With ``lora_path`` the adapter is registered first (as :meth:`add_new_lora`).
        """
        if lora_path is not None:
            self.add_new_lora(lora_path, lora_name)
        self._loras.set_default(lora_name)

    def clear_lora(self) -> None:
        """Calls with ``lora_name=None`` use the base model again."""
        self._loras.set_default(None)

    @property
    def lora_names(self) -> list[str]:
        """Names of the registered adapters."""
        return self._loras.names()

    # ------------------------------------------------------------------ housekeeping
    def warm_up(self, prefix_token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """Prime the engine's prefix cache (and this object's output cache) for a shared prompt.

        Later prompts that extend ``prefix_token_ids`` reuse its KV blocks. Returns its row.
        """
        return self.next_token_logprobs_sync(prefix_token_ids, lora_name=lora_name)

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

    def reset_async_queries(self) -> None:
        """Cancel every pending and in-flight async query: their awaiters get ``CancelledError``."""
        self._logprob_batcher.reset()
        self._sample_batcher.reset()

    @property
    def stats(self) -> dict[str, Any]:
        """Counters.

        ``engine_calls`` (groups of queries handed to the engine loop), ``engine_steps`` (vLLM
        steps run), ``engine_requests`` (requests and session chunks
        added), ``sessions`` (``opened``, ``continued``, ``forked``, ``evicted``, ``closed``,
        ``live``, ``idle``), ``tokens`` (prompt tokens sent as new requests: ``prefill``; as
        session chunks: ``session``; served from the prefix cache: ``cached``; scheduled by the
        engine: ``scheduled``, None unless the engine was built with ``disable_log_stats=False``
        and ``enable_logging_iteration_details=True``), ``logprobs``/``sample`` (batcher
        counters of the awaited methods), ``sync`` (the blocking ``next_token_logprobs_sync`` /
        ``batch_next_token_logprobs_sync``, and what is built on them: ``calls``, ``rows``
        returned, rows served by the output cache ``cache_hits``, by an identical prompt of the
        same call ``dedup_joins``, by the engine ``computed``, and ``engine_calls`` made, a chunk
        retried after out-of-memory counting again), ``cache`` (output cache),
        ``capture_apply_calls``, ``prefix_cache`` (token ``queries`` and ``hits``; None unless
        ``disable_log_stats=False``).
        """
        d = self._driver.stats()
        return {
            "mode": d["mode"],
            "engine_calls": d["engine_calls"],
            "engine_steps": d["engine_steps"],
            "engine_requests": d["engine_requests"],
            "sessions": d["sessions"],
            "tokens": d["tokens"],
            "logprobs": self._logprob_batcher.stats,
            "sample": self._sample_batcher.stats,
            "sync": self._sync_stats_snapshot(),
            "cache": self.cache.stats(),
            "capture_apply_calls": self._driver.sink.apply_calls,
            "prefix_cache": dict(self._driver.prefix_cache) if self._driver.log_stats else None,
        }

    def _sync_stats_snapshot(self) -> dict[str, int]:
        with self._sync_lock:
            return dict(self._sync_stats)

    def cleanup(self) -> None:
        """Shut the engine down and free its memory. Idempotent.

        Pending awaiters get :class:`ClosedError`; every later call raises it.
        """
        if self._closed:
            return
        self._closed = True
        err = ClosedError("this AsyncVirtualLM was cleaned up while the call was pending")
        self._logprob_batcher.close_nowait(err)
        self._sample_batcher.close_nowait(err)
        self._driver.shutdown()
        self.cache.clear()

    def __enter__(self) -> AsyncVirtualLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    async def __aenter__(self) -> AsyncVirtualLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.cleanup)

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        try:
            self.cleanup()
        except Exception as e:  # noqa: BLE001 - never raise from __del__ (interpreter shutdown)
            try:
                warnings.warn(f"AsyncVirtualLM cleanup in __del__ failed: {e!r}", RuntimeWarning, stacklevel=1)
            except Exception:  # noqa: BLE001
                pass
