"""The text the demo prints after SMC: the particle table, what SMC did, and the engine's counters.

Pure functions of a :class:`genlm_vlm.smc.SMCResult` (and the model's ``stats``), so the output
can be tested without a model. Internal module of :mod:`genlm_vlm.demo`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from ..smc import SMCResult


def normalized_weights(log_weights: list[float]) -> np.ndarray:
    """``exp(log_weights)`` normalised to sum to 1 (all zero if every weight is zero)."""
    lw = np.asarray(log_weights, dtype=np.float64)
    top = np.max(lw) if lw.size else -np.inf
    if not np.isfinite(top):
        return np.zeros_like(lw)
    w = np.exp(lw - top)
    return w / w.sum()

#: Printed above the particle table.
PARTICLE_LEGEND = (
    "  (weight: the particles' share of the normalised SMC weight, all rows sum to 1; "
    "xN: particles with this text;\n"
    "   <eos>: ended with EOS; <dead>: no allowed token had probability > 0; "
    "no mark: cut off by --max-tokens)"
)


def format_particles(result: SMCResult, prompt: str) -> list[str]:
    """Distinct particles with their total normalised weight and count, heaviest first.

    A row ends with ``<eos>`` (the particle sampled EOS), ``<dead>`` (no allowed token had
    probability > 0) or nothing (cut off by ``max_tokens``); see :data:`PARTICLE_LEGEND`.
    """
    weights = normalized_weights([p.log_weight for p in result.particles])
    groups: dict[tuple[bytes, str], list[float]] = {}
    for p, w in zip(result.particles, weights, strict=True):
        end = "  <dead>" if p.dead else "  <eos>" if p.finished else ""
        groups.setdefault((p.text, end), []).append(float(w))
    rows = sorted(groups.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    lines = []
    for (text, tail), ws in rows:
        decoded = text.decode("utf-8", errors="replace")
        lines.append(
            f"  {sum(ws):.4f}  x{len(ws):<3d} {json.dumps(prompt)} + {json.dumps(decoded)}{tail}"
        )
    return lines


def _steps(steps: list[int]) -> str:
    """``"3"``, ``"3 and 9"``, ``"3, 9 and 14"``."""
    words = [str(s) for s in steps]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def describe_run(result: SMCResult, ess_threshold: float, max_tokens: int) -> list[str]:
    """Two lines: how many steps ran and when the particles were resampled; how the final
    particles ended (EOS, cut off by ``max_tokens``, died)."""
    n = len(result.particles)
    floor = f"{ess_threshold:g} x {n}"
    if result.resampled_at:
        times = "once" if result.resamples == 1 else f"{result.resamples} times"
        plural = "s" if result.resamples > 1 else ""
        resampled = (
            f"resampled {times} (after step{plural} {_steps(result.resampled_at)}: the effective "
            f"sample size fell below {floor})"
        )
    else:
        resampled = f"never resampled (the effective sample size stayed at or above {floor})"
    ended = (
        f"particles: {result.n_finished} of {n} ended with EOS, {result.n_cut} cut off by "
        f"--max-tokens {max_tokens}"
    )
    if result.n_dead:
        ended += f", {result.n_dead} died"
    return [f"SMC: {result.steps} steps, {resampled}", ended]


def summarize(result: SMCResult, max_tokens: int) -> list[str]:
    """What ``log P(constraint)`` estimates, and why it is ``-inf`` or partial when it is; a run
    in which no particle ended with EOS says so (its posterior is empty) and what to raise."""
    n = len(result.particles)
    died_at = result.stats.get("died_at")
    if died_at is not None or not math.isfinite(result.log_marginal):
        step = f" at step {died_at}" if died_at is not None else ""
        return [
            f"no particle can satisfy the constraint: all {n} died{step} (each reached a text "
            "after which no allowed token, EOS included, has probability > 0 under the model), "
            "so estimated log P(constraint) = -inf.",
            "  Relax the constraint: allow more characters (--allowed-chars), or let --regex "
            "accept what the model can write from this prompt (and end it, so EOS is allowed).",
        ]
    cut = result.n_cut
    if not result.n_finished:
        died = f", {result.n_dead} died" if result.n_dead else ""
        return [
            f"no particle ended with EOS within --max-tokens {max_tokens} ({cut} of {n} cut off{died}): "
            "the posterior is empty, no complete text was seen.",
            f"  estimated log P(constraint) = {result.log_marginal:.3f} covers only unfinished texts (the first "
            f"{max_tokens} tokens obey the constraint); raise --max-tokens for complete texts.",
        ]
    lines = [
        f"estimated log P(constraint) = {result.log_marginal:.3f}: the log-probability that "
        f"the model's own text obeys the constraint up to EOS or for {max_tokens} tokens",
    ]
    if cut:
        which = "its text is" if cut == 1 else "their texts are"
        lines.append(
            f"  ({cut} of {n} particles were cut off: {which} unfinished and the estimate covers "
            f"only the first {max_tokens} tokens; raise --max-tokens for complete texts)"
        )
    return lines


def format_stats(stats: dict[str, Any], result: SMCResult) -> list[str]:
    """The run's and the engine's counters (see ``AsyncVirtualLM.stats``)."""
    rs = result.stats
    steps = max(1, int(rs.get("steps", 0)))
    tokens = stats.get("tokens") if isinstance(stats.get("tokens"), dict) else {}
    forks = stats.get("forks") if isinstance(stats.get("forks"), dict) else {}
    return [
        f"  rows (particle-steps):              {rs.get('rows')}",
        f"  engine steps:                       {stats.get('engine_steps')}",
        f"  engine requests (sessions, chunks): {stats.get('engine_requests')}",
        f"  tokens computed by the engine:      {tokens.get('scheduled')}",
        f"  forks sharing their parent's KV:    {forks.get('copied', 0) + forks.get('aligned', 0)}",
        f"  constraint (masks) per step:        {1e3 * float(rs.get('constraint_s', 0.0)) / steps:.2f} ms",
        f"  controller per step (masks incl.):  {1e3 * float(rs.get('controller_s', 0.0)) / steps:.2f} ms",
    ]
