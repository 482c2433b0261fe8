"""Everything that touches vLLM: the only package of genlm_vlm that reads vLLM internals.

* :mod:`.core`: :class:`~.core.EngineCore`, the interface the step loop drives, and
  :class:`~.core.VLLMCore`, the one place that reaches into vLLM's engine core (requests with
  our own ids, streaming-input sessions, single steps, LoRA, freeing, model facts);
* :mod:`.loop`: :class:`~.loop.EngineDriver`, the engine thread and its step loop (given a core
  factory: a real engine, or a fake in unit tests);
* :mod:`.jobs`: jobs, result tickets and the typed inbox messages (pure Python);
* :mod:`.sessions`: the session table (pure Python);
* :mod:`.build`: building the ``vllm.LLM`` (runner choice, environment shims, version errors);
* :mod:`.options`: engine option defaults and checks (names, KV-cache size, CPU binding);
* :mod:`.hub`: where a model name points (local folder, HF cache, hub), before vLLM is imported.

When vLLM's layout is not what genlm_vlm expects, :class:`VLLMLayoutError` names the installed
vLLM version and what was missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .build import (
        ModelInfo,
        VLLMLayoutError,
        build_llm,
        drop_unusable_v2_flag,
        is_cpu_platform,
        make_lora_request,
        predict_v2_runner,
        shield_llvmlite,
        vllm_version,
    )
    from .core import EngineCore, StepResult, VLLMCore, sessions_supported
    from .jobs import SampleSpec, Ticket
    from .loop import EngineDriver, wait_all
    from .options import CPU_ENGINE_OPTS, DEFAULT_ENGINE_OPTS

# Names load on first access, so ``genlm_vlm.engine.hub`` and ``.options`` (pure Python) can be
# imported without torch (the command-line checks run before anything heavy loads).
_LAZY = {
    **dict.fromkeys(
        ("ModelInfo", "VLLMLayoutError", "build_llm", "drop_unusable_v2_flag", "is_cpu_platform",
         "make_lora_request", "predict_v2_runner", "shield_llvmlite", "vllm_version"), ".build"),
    **dict.fromkeys(("EngineCore", "StepResult", "VLLMCore", "sessions_supported"), ".core"),
    **dict.fromkeys(("SampleSpec", "Ticket"), ".jobs"),
    **dict.fromkeys(("EngineDriver", "wait_all"), ".loop"),
    **dict.fromkeys(("CPU_ENGINE_OPTS", "DEFAULT_ENGINE_OPTS"), ".options"),
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "CPU_ENGINE_OPTS",
    "DEFAULT_ENGINE_OPTS",
    "EngineCore",
    "EngineDriver",
    "ModelInfo",
    "SampleSpec",
    "StepResult",
    "Ticket",
    "VLLMCore",
    "VLLMLayoutError",
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
