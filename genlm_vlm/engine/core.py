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
* ``scheduler.get_kv_cache_usage()``,
* ``EngineCoreRequest`` being a ``msgspec.Struct`` (row requests are copies of a template the
  input processor built once per adapter; if not, every request goes through
  ``process_inputs``).

Threading: every method runs on the engine thread; nothing here is thread-safe.
"""

from __future__ import annotations

import copy
import inspect
import time
from typing import Any

from ..capture import TAG_KEY
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
        try:
            import msgspec

            self._replace: Any = msgspec.structs.replace
        except (ImportError, AttributeError):  # pragma: no cover - older layouts
            self._replace = None
        self._templates: dict[tuple[int, bool], Any] = {}

    def forget_templates(self) -> None:
        """Drop the cached row-request templates (after an adapter is added or removed)."""
        self._templates.clear()

    def _rows_params(self, tag: str) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True, extra_args={TAG_KEY: tag}
        )

    def rows_request(
        self, request_id: str, token_ids: list[int], tag: str, lora_request: Any, resumable: bool
    ) -> Any:
        """A one-token greedy request whose logits the capture stores under ``tag``.

        The input processor (validation, generation-config defaults, a deep copy of the
        sampling parameters: about 0.4 ms a request) runs once per adapter and mode; each request
        is then a shallow copy of that template with its own id, tokens, tag and arrival time.
        Token ids and lengths are validated by the caller (``AsyncVirtualLM``).
        """
        if self._replace is None:
            return self.make_request(request_id, token_ids, self._rows_params(tag), lora_request, resumable)
        key = (0 if lora_request is None else int(lora_request.lora_int_id), resumable)
        template = self._templates.get(key)
        if template is None:
            template = self.make_request("genlm-vlm-template", [0], self._rows_params(""), lora_request, resumable)
            self._templates[key] = template
        params = copy.copy(template.sampling_params)
        params.extra_args = {TAG_KEY: tag}
        return self._replace(
            template,
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=time.time(),
            lora_request=lora_request,
        )

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
