"""lm-evaluation-harness on genlm_vlm: its tasks scored through genlm_vlm's batched scoring.

Needs the ``eval`` extra (``pip install -e ".[eval]"``: lm-eval 0.4.13). Importing this package
does not import lm-eval; :class:`GenlmVLMEval` and :func:`register` do.

Command line (lm-eval's own arguments, with genlm_vlm's model registered as ``genlm_vlm``)::

    python -m genlm_vlm eval --model_args pretrained=PATH,dtype=float32 --tasks hellaswag \\
        [--limit N] [--log_samples --output_path DIR] [any other lm-eval argument]

Python, over a model you already have::

    import lm_eval
    from genlm_vlm.evaluation import GenlmVLMEval

    results = lm_eval.simple_evaluate(model=GenlmVLMEval(lm), tasks=["hellaswag"])

or by name after :func:`register`: ``simple_evaluate(model="genlm_vlm", model_args="pretrained=PATH")``.

How requests run: ``loglikelihood`` sends every request of the call (a task's whole set) to the
engine at once through the scoring path of :meth:`AsyncVirtualLM.continuation_logprobs` (vLLM's
prompt log-probabilities: one prefill per continuation, a context shared by several choices
computed once, no full rows; ``is_greedy`` from vLLM's top-1 of the same rows);
``loglikelihood_rolling`` cuts each document into lm-eval's rolling windows (those of its ``hf``
backend, ``max_length`` tokens) and sends every window of every document at once;
``generate_until`` runs every request concurrently through :meth:`AsyncVirtualLM.sample`.
Models without the prompt-logprobs path (``MockAsyncLM``, ``ReplicaPool``, an engine with LoRA
enabled) are scored from rows, 256 prefixes per engine call.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GenlmVLMEval", "MODEL_NAME", "register"]

MODEL_NAME = "genlm_vlm"


def register() -> type:
    """Register genlm_vlm's model in lm-eval's model registry as ``"genlm_vlm"`` (idempotent) and
    return the class. lm-eval's own models stay registered."""
    import lm_eval.models  # noqa: F401 - lm-eval's own models first (its registry loads them lazily)

    from .model import GenlmVLMEval

    return GenlmVLMEval


def __getattr__(name: str) -> Any:
    if name == "GenlmVLMEval":
        return register()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
