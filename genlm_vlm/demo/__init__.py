"""``python -m genlm_vlm demo``: constrained generation by sequential Monte Carlo (SMC).

``N`` particles grow continuations of a prompt one token at a time. At each step every live
particle awaits :meth:`AsyncVirtualLM.next_token_logprobs` for its context -- all of them at once
with :func:`asyncio.gather`, so the awaits are batched (and identical contexts deduplicated) into
one engine call. Each particle then

* masks the row with a token-level constraint built from ``lm.byte_vocab`` (by default a
  lipogram: text without the letter ``e``, ``--regex '[^e]*'``; EOS is always allowed),
* samples the next token from the masked, renormalised distribution (the locally optimal
  proposal), and
* adds ``log sum_{allowed t} p(t | context)`` (the probability mass the constraint keeps) to its
  log weight.

When the effective sample size falls below ``N / 2`` the particles are resampled (systematic
resampling): particles whose text the model would rarely continue without an ``e`` are replaced
by copies of likelier ones. The weighted particles approximate the language model conditioned on
the constraint, and the product of average weights estimates the probability that an
unconstrained sample satisfies it. The demo runs on a tiny model shipped with the package (see
``genlm_vlm/data/demo-model/TRAINING.md``) unless ``--model`` names another.

Module map (internal modules; the names below are the public ones):
:mod:`.constraints` (token masks), :mod:`.smc` (the algorithm, model-agnostic),
:mod:`.report` (the text the command prints), :mod:`.cli` (options and ``main``).
"""

from __future__ import annotations

from .cli import build_parser, main
from .constraints import AllOf, CharSetConstraint, Constraint, RegexConstraint, compile_regex
from .smc import (
    Particle,
    SMCResult,
    constrained_step,
    effective_sample_size,
    log_mean_exp,
    normalized_weights,
    run_smc,
    systematic_resample,
)

__all__ = [
    "AllOf",
    "CharSetConstraint",
    "Constraint",
    "Particle",
    "RegexConstraint",
    "SMCResult",
    "build_parser",
    "compile_regex",
    "constrained_step",
    "effective_sample_size",
    "log_mean_exp",
    "main",
    "normalized_weights",
    "run_smc",
    "systematic_resample",
]
