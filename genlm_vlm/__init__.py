"""genlm_vlm: full-vocabulary next-token log-probabilities from vLLM for probabilistic programs.

Public API: :class:`AsyncVirtualLM` (build with ``AsyncVirtualLM.from_name``), the :class:`AsyncLM`
interface, the capture processors :class:`GlobalLogprobsCapture` (V1 model runner) and
:class:`GlobalLogprobsCaptureV2` (Model Runner V2), :func:`load_model_by_name`, and the errors
:class:`ClosedError`, :class:`UnknownAdapterError` and :class:`VLLMLayoutError`.

Importing the package is cheap: the names above are loaded on first access (PEP 562 module
``__getattr__``), torch when a model class is first used, and vLLM only when an engine is built.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from .base import AsyncLM, ContextLimitWarning, TopK
    from .capture import GlobalLogprobsCapture, GlobalLogprobsCaptureV2
    from .control import without_padding
    from .demo import demo_model_path
    from .engine.build import VLLMLayoutError
    from .lora import UnknownAdapterError
    from .mock import MockAsyncLM
    from .replicas import ReplicaDiedError, ReplicaPool
    from .scoring import score_records
    from .vllm_lm import AsyncVirtualLM, ClosedError
    from .vocab import Token

#: Public name -> module that defines it (imported on first access).
_LAZY: dict[str, str] = {
    "AsyncLM": ".base",
    "ContextLimitWarning": ".base",
    "MockAsyncLM": ".mock",
    "Token": ".vocab",
    "TopK": ".base",
    "demo_model_path": ".demo",
    "score_records": ".scoring",
    "without_padding": ".control",
    "AsyncVirtualLM": ".vllm_lm",
    "ClosedError": ".vllm_lm",
    "GlobalLogprobsCapture": ".capture",
    "GlobalLogprobsCaptureV2": ".capture",
    "UnknownAdapterError": ".lora",
    "VLLMLayoutError": ".engine.build",
    "ReplicaPool": ".replicas",
    "ReplicaDiedError": ".replicas",
}

__all__ = [
    "AsyncLM",
    "AsyncVirtualLM",
    "ClosedError",
    "ContextLimitWarning",
    "GlobalLogprobsCapture",
    "GlobalLogprobsCaptureV2",
    "MockAsyncLM",
    "ReplicaDiedError",
    "ReplicaPool",
    "Token",
    "TopK",
    "UnknownAdapterError",
    "VLLMLayoutError",
    "__version__",
    "demo_model_path",
    "load_model_by_name",
    "score_records",
    "without_padding",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


#: ``backend`` values :func:`load_model_by_name` accepts (genlm-backend's other values are its own).
_BACKENDS = (None, "vllm")


def load_model_by_name(
    name: str | os.PathLike[str],
    backend: str | None = None,
    llm_opts: dict[str, Any] | None = None,
    *,
    engine_opts: dict[str, Any] | None = None,
    **kwargs: Any,
) -> AsyncVirtualLM:
    """Build an :class:`AsyncVirtualLM` for ``name`` (local path or hub id), genlm-backend style.

    Same signature as genlm-backend's ``load_model_by_name(name, backend=None, llm_opts=None)``:
    ``backend`` must be ``None`` or ``"vllm"`` (genlm_vlm has only the vLLM backend; for
    genlm-backend's ``"hf"`` backend use genlm-backend itself, for a vLLM-free stand-in
    :class:`genlm_vlm.mock.MockAsyncLM`); ``llm_opts`` are
    the options passed to ``vllm.LLM`` and are the same thing as ``engine_opts`` of
    :meth:`AsyncVirtualLM.from_name` (give one of the two). Other keyword arguments go to
    :meth:`AsyncVirtualLM.from_name` (``output_device``, ``sessions``, ``batch_size``,
    ``cache_size``, ...). Bad arguments raise ``TypeError`` / ``ValueError`` before any engine
    is built.
    """
    if isinstance(backend, dict):
        raise TypeError(
            "load_model_by_name's second argument is `backend` (genlm-backend's signature); "
            "pass engine options as llm_opts=... or engine_opts=..."
        )
    if backend not in _BACKENDS:
        mock = (
            " For a vLLM-free stand-in in tests, use genlm_vlm.mock.MockAsyncLM "
            "(MockAsyncLM() or MockAsyncLM.from_name(name))."
            if backend == "mock"
            else ""
        )
        raise ValueError(
            f"unsupported backend {backend!r}: genlm_vlm only has the vLLM backend "
            "(backend=None or 'vllm'). For genlm-backend's other backends ('hf', 'mock', ...) "
            f"use genlm.backend.load_model_by_name.{mock}"
        )
    if llm_opts is not None and engine_opts is not None:
        raise TypeError("give the vLLM options once: llm_opts (genlm-backend's name) or engine_opts, not both")
    opts = engine_opts if llm_opts is None else llm_opts
    from .vllm_lm import AsyncVirtualLM

    return AsyncVirtualLM.from_name(name, opts, **kwargs)
