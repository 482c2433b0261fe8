"""SMC in the engine: a controller seam and constrained SMC (see docs/API.md, "SMC").

* :meth:`genlm_vlm.AsyncLM.smc` / ``smc_sync``: constrained SMC with the locally optimal
  proposal, on any model; on :class:`~genlm_vlm.AsyncVirtualLM` the whole run happens on the
  engine thread (a *burst*), with no trip through the event loop per token.
* Constraints: :class:`Regex`, :class:`JSONSchema`, :class:`Grammar` (EBNF or Lark; xgrammar),
  :class:`TokenMask` (your own vectorised mask function), :class:`AllOf` (several at once).
* :class:`SMCResult`: ``log_marginal`` estimates the log-probability that a sample ends with EOS
  within ``max_tokens`` with a text the constraint accepts (cut particles count zero; their mass
  is ``log_marginal_cut``); a run with an empty posterior says why (``empty_reason``) and gives
  an :class:`EmptyPosteriorWarning`.
* The seam: :class:`Controller`, :class:`Decision` and
  :meth:`genlm_vlm.AsyncLM.run_controller`, for another SMC implementation to run its own
  per-step logic in the engine; :func:`drive` runs any controller per token in Python (the
  reference). Whatever a controller hands over is checked; a mistake fails its run with
  :class:`ControllerError` (a ``ValueError``).
"""

from .algorithm import EmptyPosteriorWarning, Particle, SMCController, SMCResult
from .constraints import (
    AllOf,
    BoundConstraint,
    Constraint,
    ConstraintError,
    Grammar,
    JSONSchema,
    Regex,
    TokenMask,
    as_constraint,
)
from .controller import Controller, ControllerError, Decision, ParticleSet, drive

__all__ = [
    "AllOf",
    "BoundConstraint",
    "Constraint",
    "ConstraintError",
    "Controller",
    "ControllerError",
    "Decision",
    "EmptyPosteriorWarning",
    "Grammar",
    "JSONSchema",
    "Particle",
    "ParticleSet",
    "Regex",
    "SMCController",
    "SMCResult",
    "TokenMask",
    "as_constraint",
    "drive",
]
