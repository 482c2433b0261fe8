"""``python -m genlm_vlm demo``: constrained generation by sequential Monte Carlo (SMC).

``N`` particles grow continuations of a prompt one token at a time under a token constraint (by
default a lipogram: text without the letter ``e``, ``--regex '[^e]*'``; ``--allowed-chars``
gives a character set). The run is :meth:`AsyncVirtualLM.smc <genlm_vlm.AsyncLM.smc>`: the
locally optimal proposal (each particle samples from its row masked by the constraint and
renormalised, and adds the log of the mass the mask kept to its log weight), resampling when
the effective sample size falls below ``N / 2``, the whole run one *burst* on the engine thread.
The weighted particles approximate the language model conditioned on the constraint, and the
product of average weights estimates the probability that an unconstrained sample satisfies it.
The demo runs on a tiny model shipped with the package (see
``genlm_vlm/data/demo-model/TRAINING.md``) unless ``--model`` names another.

Module map (internal modules; the names below are the public ones): :mod:`.constraints` (the
options as :mod:`genlm_vlm.smc` constraints), :mod:`.report` (the text the command prints),
:mod:`.cli` (options and ``main``).
"""

from __future__ import annotations

from .cli import build_parser, main
from .constraints import CharSetConstraint, compile_regex, demo_constraint

__all__ = [
    "CharSetConstraint",
    "build_parser",
    "compile_regex",
    "demo_constraint",
    "main",
]
