"""The checks and messages of :func:`genlm_vlm.control.smc` (internal to :mod:`genlm_vlm.control`):
its options' types, what it accepts as a sampler and a critic, the way out every refusal ends
with, the warning for a run in which no particle finished, and the ``ImportError`` that says how
to install genlm-control."""

from __future__ import annotations

import math
import warnings
from typing import Any

from ..checks import check_count, check_engine_path, check_flag, check_real, check_seed

#: The resampling schemes ``lm.smc`` runs (others: ``fallback=True``).
RESAMPLING = ("multinomial", "stratified", "systematic")
#: How every refusal of :func:`~genlm_vlm.control.bridge.plan` ends (unless its message names
#: ``fallback=True`` already).
FALLBACK_HINT = "; or pass fallback=True: genlm-control runs it itself, per token"


def check_sampler(sampler: Any, critic: Any = None) -> None:
    """``TypeError`` unless ``sampler`` is a genlm-control token sampler (it has ``smc`` and
    ``target``) and ``critic`` None or a potential (it has ``token_type``)."""
    if not (callable(getattr(sampler, "smc", None)) and hasattr(sampler, "target")):
        kind = type(sampler).__name__
        hint = ""
        if kind == "PromptedLLM":
            hint = " (a PromptedLLM is a potential: sample from it with direct_token_sampler(llm))"
        raise TypeError(
            f"sampler must be a genlm-control token sampler: direct_token_sampler(llm), AWRS(llm, condition) or "
            f"eager_token_sampler(llm, condition); got {kind}{hint}"
        )
    if critic is not None and not hasattr(critic, "token_type"):
        raise TypeError(
            f"critic must be a genlm-control potential (e.g. a BoolFSA coerced to the LM's tokens: "
            f"condition.coerce(llm, f=b''.join)) or None; got {type(critic).__name__}"
        )


def check_options(n_particles: Any, ess_threshold: Any, max_tokens: Any, seed: Any, fallback: Any,
                  json_schema: Any, resampling_method: Any, in_engine: Any, engine_path: Any = "auto",
                  mask_overlap: Any = False) -> None:
    """:func:`~genlm_vlm.control.smc`'s options, for either path: a wrong type is a ``TypeError``, a count below 1
    or an ``ess_threshold`` outside ``[0, 1]`` a ``ValueError``, ``engine_path`` as ``lm.smc`` checks
    it (``lm.smc`` checks the rest)."""
    check_count(n_particles, "n_particles")
    check_count(max_tokens, "max_tokens")
    if not 0.0 <= check_real(ess_threshold, "ess_threshold", "a number in [0, 1]") <= 1.0:
        raise ValueError(f"ess_threshold must be a number in [0, 1], got {ess_threshold!r}")
    check_seed(seed, "seed")
    for name, value in (("fallback", fallback), ("json_schema", json_schema), ("in_engine", in_engine),
                        ("mask_overlap", mask_overlap)):
        check_flag(value, name)
    check_engine_path(engine_path)
    if not isinstance(resampling_method, str):
        raise TypeError(f"resampling_method must be a str ({', '.join(RESAMPLING)}), "
                        f"got {type(resampling_method).__name__}")


def said_if_empty(seqs: Any, max_tokens: int) -> Any:
    """``seqs``, after an :class:`~genlm_vlm.smc.EmptyPosteriorWarning` if none of its particles
    finished (a context ending with genlm-control's ``EOS`` and a weight > 0): its posterior is
    empty."""
    from genlm.control.constant import EndOfSequence

    from ..smc.algorithm import EmptyPosteriorWarning

    finished = sum(bool(c) and isinstance(c[-1], EndOfSequence) and w > -math.inf for c, w in seqs)
    if not finished:
        warnings.warn(
            f"genlm_vlm.control.smc: no particle finished within max_tokens={max_tokens} (none of {len(seqs)} "
            "ended with EOS and a weight > 0): the posterior is empty and log_ml is -inf. Raise max_tokens (it "
            "counts the EOS, which is forced at the limit and dies where the condition does not accept the text "
            "yet), or loosen the condition",
            EmptyPosteriorWarning, stacklevel=3,
        )
    return seqs


def require_genlm_control(what: str) -> None:
    """Import ``genlm.control``, or raise ``ImportError`` saying that ``what`` needs it and how to
    install it (it is not part of the engine-only install that ``scripts/demo.sh`` makes)."""
    try:
        import genlm.control  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"{what} needs genlm-control, which is not installed ({e}): pip install 'genlm-vlm[control]' "
            "(in a checkout of genlm_vlm: bash scripts/setup.sh control)"
        ) from e
