"""Sequential Monte Carlo with the locally optimal proposal under a token constraint.

:func:`run_smc` grows ``N`` particles one token at a time; every live particle's
``next_logprobs`` call of a step is awaited at once (:func:`asyncio.gather`), so a batching model
turns them into one engine call. The helpers (:func:`constrained_step`, the weight functions,
:func:`systematic_resample`) are pure functions of their arguments. Internal module of
:mod:`genlm_vlm.demo`.
"""

from __future__ import annotations

import asyncio
import copy
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .constraints import Constraint

if TYPE_CHECKING:  # numpy and torch are imported where used: `demo --help` stays light
    import numpy as np
    import torch

NextLogprobs = Callable[[list[int]], Awaitable["torch.Tensor"]]


def constrained_step(row: torch.Tensor, mask: torch.Tensor) -> tuple[float, torch.Tensor | None]:
    """Locally optimal proposal under a token mask.

    Returns ``(log_mass, proposal)``: ``log_mass = logsumexp(row[mask])`` (the incremental log
    weight; ``-inf`` when the constraint keeps no probability) and the proposal's
    log-probabilities ``row - log_mass`` on allowed tokens, ``-inf`` elsewhere (None when the
    mass is zero).
    """
    import torch

    masked = row.float().masked_fill(~mask, float("-inf"))
    log_mass = float(torch.logsumexp(masked, dim=0))
    if not math.isfinite(log_mass):
        return float("-inf"), None
    return log_mass, masked - log_mass


def normalized_weights(log_weights: Sequence[float]) -> np.ndarray:
    """``exp(log_weights)`` normalised to sum to 1 (all zero if every weight is zero)."""
    import numpy as np

    lw = np.asarray(log_weights, dtype=np.float64)
    top = np.max(lw) if lw.size else -np.inf
    if not np.isfinite(top):
        return np.zeros_like(lw)
    w = np.exp(lw - top)
    return w / w.sum()


def log_mean_exp(log_weights: Sequence[float]) -> float:
    """``log(mean(exp(log_weights)))``, stably."""
    import numpy as np

    lw = np.asarray(log_weights, dtype=np.float64)
    top = np.max(lw)
    if not np.isfinite(top):
        return float("-inf")
    return float(top + np.log(np.mean(np.exp(lw - top))))


def effective_sample_size(log_weights: Sequence[float]) -> float:
    """``1 / sum(w_i^2)`` of the normalised weights (0 when every weight is zero)."""
    w = normalized_weights(log_weights)
    s = float((w * w).sum())
    return 1.0 / s if s > 0 else 0.0


def systematic_resample(weights: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Ancestor indices by systematic resampling of normalised ``weights`` (one uniform draw)."""
    import numpy as np

    n = len(weights)
    positions = (rng.random() + np.arange(n)) / n
    cumulative = np.cumsum(weights)
    cumulative[-1] = 1.0  # guard against round-off
    return [int(i) for i in np.searchsorted(cumulative, positions, side="right")]


@dataclass
class Particle:
    """One SMC particle: generated token ids and bytes, log weight, finished flag."""

    token_ids: list[int] = field(default_factory=list)
    text: bytes = b""
    log_weight: float = 0.0
    finished: bool = False  # sampled EOS (or died: weight -inf)

    @property
    def dead(self) -> bool:
        """Ended because no allowed token had probability > 0 (its weight is zero)."""
        return self.finished and self.log_weight == float("-inf")

    @property
    def ended_with_eos(self) -> bool:
        """Ended by sampling EOS: its text is complete."""
        return self.finished and not self.dead


@dataclass
class SMCResult:
    """What :func:`run_smc` returns: the final particles and what happened on the way."""

    particles: list[Particle]
    log_evidence: float
    """Estimate of log P(constraint holds for the generated tokens) under the model."""
    steps: int
    resamples: int
    """Number of resampling steps (``len(resampled_at)``)."""
    awaits: int
    """Number of ``next_logprobs`` awaits issued."""
    died_at: int | None = None
    """The step at which every particle had died (no allowed token with probability > 0), if so."""
    resampled_at: list[int] = field(default_factory=list)
    """The steps (1-based) after which the particles were resampled."""

    @property
    def n_eos(self) -> int:
        """Final particles that ended with EOS."""
        return sum(p.ended_with_eos for p in self.particles)

    @property
    def n_dead(self) -> int:
        """Final particles that died (no allowed token had probability > 0)."""
        return sum(p.dead for p in self.particles)

    @property
    def n_cut(self) -> int:
        """Final particles still generating when ``max_tokens`` was reached."""
        return sum(not p.finished for p in self.particles)


async def run_smc(
    next_logprobs: NextLogprobs,
    prompt_ids: Sequence[int],
    constraint: Constraint,
    byte_vocab: Sequence[bytes],
    eos_id: int,
    *,
    n_particles: int = 32,
    max_tokens: int = 32,
    ess_threshold: float = 0.5,
    rng: np.random.Generator | None = None,
    progress: bool = False,
) -> SMCResult:
    """Run SMC with the locally optimal proposal (see :mod:`genlm_vlm.demo`).

    ``next_logprobs(ids)`` returns the normalised next-token log-probabilities after ``ids``
    (prompt + generated tokens); every live particle's call of a step is awaited concurrently.
    At each step a live particle masks its row with ``constraint.mask(text)``, samples the next
    token from the renormalised row and adds the log of the mass the mask kept to its log
    weight. The particles are resampled (systematically) after a step whose effective sample
    size is below ``ess_threshold * n_particles``. A particle ends when it samples ``eos_id``,
    when the mask keeps no probability (it dies), or after ``max_tokens`` tokens.
    """
    if n_particles < 1 or max_tokens < 1:
        raise ValueError("n_particles and max_tokens must be >= 1")
    import numpy as np
    import torch

    rng = rng if rng is not None else np.random.default_rng()
    prompt = list(prompt_ids)
    particles = [Particle() for _ in range(n_particles)]
    log_evidence = 0.0
    awaits = steps = 0
    died_at: int | None = None
    resampled_at: list[int] = []

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_tokens, desc="SMC", unit="step", file=sys.stderr)
    try:
        for _ in range(max_tokens):
            live = [p for p in particles if not p.finished]
            if not live:
                break
            steps += 1
            rows = await asyncio.gather(*(next_logprobs(prompt + p.token_ids) for p in live))
            awaits += len(live)
            for p, row in zip(live, rows, strict=True):
                log_mass, proposal = constrained_step(row, constraint.mask(p.text))
                p.log_weight += log_mass
                if proposal is None:
                    p.finished = True
                    continue
                probs = torch.exp(proposal.double()).numpy()
                token = int(rng.choice(len(probs), p=probs / probs.sum()))
                if token == eos_id:
                    p.finished = True
                else:
                    p.token_ids.append(token)
                    p.text += byte_vocab[token]
            log_weights = [p.log_weight for p in particles]
            if not any(math.isfinite(w) for w in log_weights):
                log_evidence = float("-inf")
                died_at = steps
                if bar is not None:
                    bar.set_postfix(ess="0", live=0)
                break
            ess = effective_sample_size(log_weights)
            if ess < ess_threshold * n_particles:
                log_evidence += log_mean_exp(log_weights)
                ancestors = systematic_resample(normalized_weights(log_weights), rng)
                particles = [copy.deepcopy(particles[a]) for a in ancestors]
                for p in particles:
                    p.log_weight = 0.0
                resampled_at.append(steps)
            if bar is not None:
                bar.set_postfix(ess=f"{ess:.1f}", live=sum(not p.finished for p in particles))
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if math.isfinite(log_evidence):
        log_evidence += log_mean_exp([p.log_weight for p in particles])
    return SMCResult(particles, log_evidence, steps, len(resampled_at), awaits, died_at, resampled_at)
