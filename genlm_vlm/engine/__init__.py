"""Everything that touches vLLM: the only package of genlm_vlm that reads vLLM internals.

* :mod:`.build`: building and freeing the ``vllm.LLM`` (defaults, runner choice, version gate);
* :mod:`.core`: :class:`~.core.CoreHandle`, the in-process engine core (requests with our own
  ids, streaming-input sessions, single steps);
* :mod:`.sessions`: the session table (pure Python);
* :mod:`.loop`: :class:`~.loop.EngineDriver`, the engine thread and its step loop.

When vLLM's layout is not what genlm_vlm expects, :class:`VLLMLayoutError` names the installed
vLLM version and what was missing.
"""

from .build import (
    CPU_ENGINE_OPTS,
    DEFAULT_ENGINE_OPTS,
    ModelInfo,
    VLLMLayoutError,
    _model_info,
    build_llm,
    drop_unusable_v2_flag,
    is_cpu_platform,
    make_lora_request,
    predict_v2_runner,
    sessions_supported,
    shield_llvmlite,
    vllm_version,
)
from .loop import EngineDriver, SampleSpec, wait_all

__all__ = [
    "CPU_ENGINE_OPTS",
    "DEFAULT_ENGINE_OPTS",
    "EngineDriver",
    "ModelInfo",
    "SampleSpec",
    "VLLMLayoutError",
    "_model_info",
    "build_llm",
    "drop_unusable_v2_flag",
    "is_cpu_platform",
    "make_lora_request",
    "predict_v2_runner",
    "sessions_supported",
    "shield_llvmlite",
    "vllm_version",
    "wait_all",
]
