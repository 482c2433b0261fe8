"""The one place that reaches into vLLM's engine core (engine thread only).

:class:`CoreHandle` turns token ids into ``EngineCoreRequest`` objects with request ids we choose
(``LLM.generate`` and ``LLMEngine.add_request`` randomise ids and cannot drive sessions), adds
and aborts them, and runs one scheduler step at a time. It is built from a ``vllm.LLM`` made
with multiprocessing off, so the ``EngineCore`` lives in this process.

Semi-internal handles used, each checked when the handle is built (a missing one raises
:class:`~genlm_vlm.engine.build.VLLMLayoutError` naming the vLLM version):

* ``llm.llm_engine.input_processor.process_inputs`` (builds requests; ``resumable=True`` makes a
  streaming-input session),
* ``llm.llm_engine.engine_core`` (the in-process client) and its ``engine_core`` (``EngineCore``:
  ``step_fn``/``post_step``, ``add_request``, ``abort_requests``, ``scheduler``),
* ``scheduler.get_kv_cache_usage()``.

Threading: every method runs on the engine thread; nothing here is thread-safe.
"""

from __future__ import annotations

import inspect
from typing import Any

from .build import _layout_error


class StepResult:
    """What one engine step produced."""

    __slots__ = ("executed", "outputs", "stats")

    def __init__(self, outputs: list[Any], stats: Any, executed: bool) -> None:
        self.outputs = outputs
        """``EngineCoreOutput`` objects (``request_id``, ``new_token_ids``, ``finish_reason``)."""
        self.stats = stats
        """``SchedulerStats`` or None (only with ``disable_log_stats=False``)."""
        self.executed = executed
        """Whether the model ran (False: nothing could be scheduled)."""


class CoreHandle:
    """Add, abort and step requests on an in-process vLLM ``EngineCore``."""

    def __init__(self, llm: Any) -> None:
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
            self._kv_usage = self._scheduler.get_kv_cache_usage
            self.log_stats = bool(engine.log_stats)
            observability = engine.vllm_config.observability_config
            #: Whether each step reports its scheduled tokens (SchedulerStats.iteration_details).
            self.reports_tokens = self.log_stats and bool(
                getattr(observability, "enable_logging_iteration_details", False)
            )
        except AttributeError as e:
            raise _layout_error(
                f"cannot reach the in-process EngineCore through LLM.llm_engine.engine_core ({e}); "
                "genlm_vlm needs VLLM_ENABLE_V1_MULTIPROCESSING=0"
            ) from e
        params = inspect.signature(self._process_inputs).parameters
        self.can_resume = "resumable" in params
        self._pass_tasks = "supported_tasks" in params
        try:
            from vllm.inputs.engine import tokens_input
        except ImportError:  # older layouts take a TokensPrompt dict
            tokens_input = None
        self._tokens_input = tokens_input

    def make_request(
        self, request_id: str, token_ids: list[int], params: Any, lora_request: Any, resumable: bool
    ) -> Any:
        """An ``EngineCoreRequest`` for ``token_ids`` (a list this request owns: the scheduler
        extends a session's first prompt list in place)."""
        prompt: Any
        if self._tokens_input is not None:
            prompt = self._tokens_input(token_ids)
        else:
            prompt = {"prompt_token_ids": token_ids}
        kwargs: dict[str, Any] = {"lora_request": lora_request}
        if resumable:
            kwargs["resumable"] = True
        if self._pass_tasks:
            return self._process_inputs(request_id, prompt, params, self._tasks, **kwargs)
        return self._process_inputs(request_id, prompt, params, **kwargs)

    def add(self, request: Any) -> None:
        """Queue a request; with a known request id it is the next chunk of that session."""
        req, wave = self._preprocess(request)
        self._add(req, wave)

    def abort(self, request_ids: list[str]) -> None:
        """Finish these requests (running, waiting or parked sessions) and free their KV blocks."""
        if request_ids:
            self._abort(request_ids)

    def step(self) -> StepResult:
        """Schedule and run one step."""
        outputs, executed = self._step_fn()
        self._post_step(executed)
        eco = outputs.get(0) if outputs else None
        if eco is None:
            return StepResult([], None, bool(executed))
        return StepResult(list(eco.outputs), eco.scheduler_stats, bool(executed))

    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (cached-but-free blocks count as free)."""
        return float(self._kv_usage())
