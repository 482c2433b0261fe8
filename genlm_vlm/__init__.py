"""genlm_vlm: full-vocabulary next-token log-probabilities from vLLM for probabilistic programs.

Public API: :class:`AsyncVirtualLM` (build with ``AsyncVirtualLM.from_name``), the :class:`AsyncLM`
interface, the capture processors :class:`GlobalLogprobsCapture` (V1 model runner) and
:class:`GlobalLogprobsCaptureV2` (Model Runner V2), and :func:`load_model_by_name`.
"""

from __future__ import annotations

from typing import Any

from .base import AsyncLM
from .capture import GlobalLogprobsCapture, GlobalLogprobsCaptureV2
from .lora import UnknownAdapterError
from .vllm_lm import AsyncVirtualLM, ClosedError

__version__ = "0.1.0"

__all__ = [
    "AsyncLM",
    "AsyncVirtualLM",
    "ClosedError",
    "GlobalLogprobsCapture",
    "GlobalLogprobsCaptureV2",
    "UnknownAdapterError",
    "load_model_by_name",
]


def load_model_by_name(name: str, engine_opts: dict[str, Any] | None = None, **kwargs: Any) -> AsyncVirtualLM:
    """Shortcut for :meth:`AsyncVirtualLM.from_name` (genlm-backend's helper name)."""
    return AsyncVirtualLM.from_name(name, engine_opts, **kwargs)
