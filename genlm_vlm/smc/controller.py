"""The controller seam: a set of particles advanced by a controller, one token per step.

A :class:`Controller` decides, from the next-token rows of its live particles, what each
particle does next. Whoever runs it (:func:`drive`, over any :class:`~genlm_vlm.AsyncLM`, one
``batch_next_token_logprobs`` await per step; or the engine thread of an
:class:`~genlm_vlm.AsyncVirtualLM`, with no trip through the event loop per token: a *burst*)
keeps the particles' token sequences in a :class:`ParticleSet` and applies each
:class:`Decision` the same way, so a deterministic controller gives the same result on both.

The contract, per step:

1. The runner computes the rows of the live particles (``prompt + generated tokens``), one
   ``float32 [m, V]`` tensor, normalised log-probabilities of the raw logits (the model's
   distribution, before any temperature, mask or sampling), row ``k`` for particle
   ``particles[k]``. Particles with the same tokens share one computation, never one tensor row
   object: the controller may write into ``rows``.
2. ``controller.step(rows, particles)`` returns a :class:`Decision`: for each of those particles
   the token to append (it stays live) or None (it ends); then, optionally, ``parents``: particle
   ``i`` becomes a copy of particle ``parents[i]`` (resampling; the runner shares the parent's
   computed KV with its copies); and ``stop``: end the run after this step.
3. The run ends when ``stop`` is set or no particle is live; the runner then returns
   ``controller.result(particles)``, with the token sequences each particle generated.

``step`` and ``result`` run on the engine thread in a burst: they must not block on the event
loop, and an exception they raise fails that run only. Rows are on the engine's device (the CPU
on the CPU build); the controller keeps no reference to them past ``step`` (a run holds O(N)
rows at a time).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Tokens = tuple[int, ...]


@dataclass(slots=True)
class Decision:
    """What a controller decided in one step (see the module docstring).

    ``tokens[k]``: the token particle ``particles[k]`` appends and goes on with, or None: it
    ends (its last token, EOS say, is the controller's to record). ``parents``: None, or one
    index per particle (all ``n_particles``, live or ended), applied after the tokens.
    ``stop``: end the run after this step, whatever is live.
    """

    tokens: Sequence[int | None]
    parents: Sequence[int] | None = None
    stop: bool = False


class Controller(ABC):
    """Decides each step of a set of ``n_particles`` particles (see the module docstring)."""

    n_particles: int

    @abstractmethod
    def step(self, rows: Any, particles: Sequence[int]) -> Decision:
        """One step: ``rows`` ``float32 [len(particles), V]``; return a :class:`Decision`."""

    @abstractmethod
    def result(self, generated: Sequence[Tokens]) -> Any:
        """The run's result; ``generated[i]``: the tokens particle ``i`` was fed after the prompt
        (the tokens the controller appended, not the ones that ended a particle)."""


class ParticleSet:
    """The runner's side of a run: each particle's generated tokens and whether it is live.

    ``start``: the particles' generated tokens to begin from (a continued run), or None: ``n``
    empty particles.
    """

    __slots__ = ("generated", "live_flags", "prompt")

    def __init__(self, prompt: Tokens, n: int, start: Sequence[Sequence[int]] | None = None) -> None:
        self.prompt = tuple(prompt)
        if start is None:
            self.generated: list[Tokens] = [()] * n
        else:
            if len(start) != n:
                raise ValueError(f"start has {len(start)} particles; the controller has {n}")
            self.generated = [tuple(int(t) for t in s) for s in start]
        self.live_flags = [True] * n

    def live(self) -> list[int]:
        """Indices of the live particles, in order."""
        return [i for i, f in enumerate(self.live_flags) if f]

    def prefix(self, i: int) -> Tokens:
        """The token ids whose next-token row particle ``i`` needs."""
        return self.prompt + self.generated[i]

    def apply(self, decision: Decision, particles: Sequence[int]) -> None:
        """Apply ``decision`` (made for ``particles``); raises ``ValueError`` if it is malformed."""
        tokens = decision.tokens
        if len(tokens) != len(particles):
            raise ValueError(f"the controller returned {len(tokens)} tokens for {len(particles)} particles")
        gen, flags = self.generated, self.live_flags
        for i, tok in zip(particles, tokens, strict=True):
            if tok is None:
                flags[i] = False
            else:
                gen[i] = (*gen[i], int(tok))
        parents = decision.parents
        if parents is not None:
            n = len(gen)
            if len(parents) != n or any(not 0 <= int(p) < n for p in parents):
                raise ValueError(f"the controller's parents must be {n} indices in [0, {n})")
            self.generated = [gen[int(p)] for p in parents]
            self.live_flags = [flags[int(p)] for p in parents]


async def drive(lm: Any, prompt_ids: Sequence[int], controller: Controller, *, lora_name: str | None = None,
                start: Sequence[Sequence[int]] | None = None) -> Any:
    """Run ``controller`` per token in Python over any :class:`~genlm_vlm.AsyncLM`: each step
    awaits ``lm.batch_next_token_logprobs`` for the live particles and calls ``step`` on the
    caller's thread. This is the reference a burst is compared with; ``lm`` may be a
    :class:`~genlm_vlm.MockAsyncLM`, a :class:`~genlm_vlm.ReplicaPool` or any wrapper."""
    ps = ParticleSet(tuple(prompt_ids), controller.n_particles, start)
    while True:
        live = ps.live()
        if not live:
            break
        rows = await lm.batch_next_token_logprobs([ps.prefix(i) for i in live], lora_name=lora_name)
        decision = controller.step(rows, live)
        ps.apply(decision, live)
        if decision.stop:
            break
    return controller.result(ps.generated)
