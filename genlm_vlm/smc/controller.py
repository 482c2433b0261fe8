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
loop, and an exception they raise fails that run only. Nor may they call the model (a ``*_sync``
method, ``smc``...): on the engine thread that would wait for itself, so it raises at once.
Rows are on the engine's device (the CPU on the CPU build); the controller keeps no reference to
them past ``step`` (a run holds O(N) rows at a time). A controller whose class sets
``borrows_rows = True`` (the built-in :class:`~.algorithm.SMCController`) may be handed its rows
in a buffer that the requests path reuses the next step; any other gets a tensor of its own.

A product of prompts (``prompts``: ``k >= 2`` prompts, ``lm.smc(..., prompts=...)`` or
``run_controller(..., prompts=...)``): the runner keeps one context per factor per particle
(``prompts[j] + generated tokens``), computes all ``k * m`` rows in the same round (each factor
continues its own session; a resampled copy forks every factor's), and hands ``step`` their sum:
row ``k`` is ``sum_j log p(. | prompts[j] + generated)``, float32, added in factor order on the
rows' device (:func:`fold_rows`, the same op in both runners). Such rows are *unnormalised* log
weights of the product ``prod_j p(x | prompts[j] + ...)``, not log-probabilities.

Whatever a controller hands over is checked before it is used (:class:`ParticleSet`, by both
runners): ``n_particles``, ``start``, each decision (see :func:`check_decision`), and that no
live particle's context reaches the model's ``max_model_len`` unless the run stops. A mistake
raises :class:`ControllerError` naming it, which fails that run only.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

Tokens = tuple[int, ...]


@dataclass(slots=True)
class Decision:
    """What a controller decided in one step (see the module docstring).

    ``tokens[k]``: the token particle ``particles[k]`` appends and goes on with, or None: it
    ends (its last token, EOS say, is the controller's to record). ``parents``: None, or one
    index per particle (all ``n_particles``, live or ended), applied after the tokens.
    ``stop``: end the run after this step, whatever is live. Any object with these three
    attributes will do; the types accepted are :func:`check_decision`'s (numpy and torch
    integers and bools too).
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


class ControllerError(ValueError):
    """A controller (or the ``start`` of its run) handed its runner something it cannot run: no
    or a bad ``n_particles``, a ``start`` that is not one sequence of token ids per particle, a
    step result that is not a :class:`Decision`, a token that is not an int in the vocabulary,
    ``parents`` that are not ``n_particles`` indices, a ``stop`` that is not a bool, or a
    particle whose context would reach ``max_model_len``. The message names the mistake; the
    run fails with it, and only that run."""


def n_particles_of(controller: Any) -> int:
    """``controller.n_particles``, checked: an int >= 1 (not a bool, not a str); else
    :class:`ControllerError`."""
    try:
        n = controller.n_particles
    except AttributeError:
        raise ControllerError(
            f"the controller ({type(controller).__name__}) has no n_particles: set it to the number of "
            "particles, an int >= 1"
        ) from None
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ControllerError(f"the controller's n_particles must be an int >= 1, got {n!r} ({type(n).__name__})")
    return int(n)


def _ints(values: Any) -> Any:
    """A tensor or array as a list of Python scalars (anything else as it is)."""
    if hasattr(values, "tolist") and hasattr(values, "dtype"):
        return values.tolist()
    return values


def _scalar(x: Any) -> Any:
    """A 0-d tensor or array (or a numpy scalar) as a Python scalar (anything else as it is)."""
    return x.item() if getattr(x, "ndim", None) == 0 and hasattr(x, "item") else x


def _bad_token(tok: Any) -> bool:
    """Whether ``tok`` is neither an int nor None (a bool, a float, a str, ...)."""
    return tok is not None and (isinstance(tok, bool) or not isinstance(tok, numbers.Integral))


def _as_bool(stop: Any) -> bool:
    if type(stop) is bool:
        return stop
    value = _scalar(stop)
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    raise ControllerError(f"the controller's Decision.stop must be a bool, got {stop!r} ({type(stop).__name__})")


def check_decision(decision: Any, m: int, n: int, vocab_size: int | None
                   ) -> tuple[list[int | None], list[int] | None, bool]:
    """``decision`` (a controller's answer for ``m`` live particles out of ``n``) checked and
    normalised: ``(tokens as Python ints or None, parents as Python ints or None, stop)``.

    Accepted: ``tokens`` a sequence (or 1-D integer tensor / array) of ``m`` items, each an int
    (numpy and torch integers too; not a bool) in ``[0, vocab_size)`` or None; ``parents`` None
    or ``n`` ints in ``[0, n)``; ``stop`` a bool (a numpy/torch bool scalar, 0 or 1 too).
    Anything else raises :class:`ControllerError` naming it."""
    try:
        tokens, parents, stop = decision.tokens, decision.parents, decision.stop
    except AttributeError as e:
        what = f"{e.name!r}" if getattr(e, "name", None) else "tokens, parents or stop"
        raise ControllerError(
            f"the controller's step returned a {type(decision).__name__} without {what}: return a "
            "genlm_vlm.smc.Decision(tokens, parents=None, stop=False)"
        ) from None
    stop = _as_bool(stop)
    tokens = _ints(tokens)
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
        raise ControllerError(
            f"the controller's Decision.tokens must be a sequence of token ids (or None), got {type(tokens).__name__}"
        )
    if len(tokens) != m:
        raise ControllerError(f"the controller returned {len(tokens)} tokens for {m} particles")
    kinds = set(map(type, tokens))
    if not kinds <= {int, type(None)}:  # numpy or torch ints, or a mistake: one pass to tell
        tokens = [_scalar(tok) for tok in tokens]
        for k, tok in enumerate(tokens):
            if _bad_token(tok):
                raise ControllerError(
                    f"the controller's Decision.tokens[{k}] is {tok!r} ({type(tok).__name__}): a token must be an "
                    "int token id, or None to end the particle"
                )
        tokens = [None if tok is None else int(tok) for tok in tokens]
        kinds = set(map(type, tokens))
    elif not isinstance(tokens, list):
        tokens = list(tokens)
    if vocab_size is not None:
        ids = tokens if type(None) not in kinds else [tok for tok in tokens if tok is not None]
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            k, tok = next((k, t) for k, t in enumerate(tokens) if t is not None and not 0 <= t < vocab_size)
            raise ControllerError(
                f"the controller's Decision.tokens[{k}] is {tok}, outside the vocabulary [0, {vocab_size})"
            )
    if parents is not None:
        parents = _ints(parents)
        ok = not isinstance(parents, str | bytes) and isinstance(parents, Sequence) and len(parents) == n
        if ok and set(map(type, parents)) != {int}:  # numpy or torch ints, or a mistake
            parents = [_scalar(p) for p in parents]
            ok = not any(_bad_token(p) or p is None for p in parents)
            parents = [int(p) for p in parents] if ok else parents
        if not ok or min(parents) < 0 or max(parents) >= n:
            raise ControllerError(f"the controller's parents must be {n} indices in [0, {n}), got {parents!r}")
        if not isinstance(parents, list):
            parents = list(parents)
    return tokens, parents, stop


class ParticleSet:
    """The runner's side of a run: each particle's generated tokens and whether it is live.

    ``start``: the particles' generated tokens to begin from (a continued run), or None: ``n``
    empty particles. With ``vocab_size``, every token (of ``start`` and of each decision) must
    be in ``[0, vocab_size)``; with ``max_len`` (the model's ``max_model_len``), every live
    particle's context (``prompt`` + generated) must stay below it, so that its next row can be
    computed. Every violation raises :class:`ControllerError`: the runner (:func:`drive` or a
    burst) checks with this class alone, so both raise the same messages. ``prompts``: None, or
    the factors' prompts of a product (``prompt`` is then ignored; contexts are checked against
    the longest): :meth:`wanted` lists ``k * m`` contexts, :func:`fold_rows` sums their rows.

    A step costs O(number of particles), whatever their length: each particle's tokens are a
    list of the set's own, extended in place (a resampled copy gets a list of its own when it
    is made); :attr:`generated` makes the tuples when it is read.
    """

    __slots__ = ("_gen", "_longest", "_tuples", "live_flags", "max_len", "prompt", "prompts", "vocab_size")

    def __init__(self, prompt: Tokens, n: int, start: Sequence[Sequence[int]] | None = None, *,
                 vocab_size: int | None = None, max_len: int | None = None,
                 prompts: Sequence[Tokens] | None = None) -> None:
        from ..checks import as_token_ids

        self.prompts = (tuple(prompt),) if prompts is None else tuple(tuple(p) for p in prompts)
        self.prompt = max(self.prompts, key=len)  # the longest: what max_len is checked against
        self.vocab_size = vocab_size
        self.max_len = max_len
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ControllerError(f"the controller's n_particles must be an int >= 1, got {n!r} ({type(n).__name__})")
        n = int(n)
        if start is None:
            gen: list[Tokens] = [()] * n
        else:
            if isinstance(start, str | bytes) or not isinstance(start, Sequence):
                raise ControllerError(f"start must be a list of {n} token-id lists (one per particle), "
                                      f"got {type(start).__name__}")
            if len(start) != n:
                raise ControllerError(f"start has {len(start)} particles; the controller has {n}")
            width = vocab_size if vocab_size is not None else 1 << 62
            try:
                gen = [as_token_ids(s, f"start[{i}]", width) for i, s in enumerate(start)]
            except (TypeError, ValueError) as e:
                raise ControllerError(str(e)) from None
            if max_len is not None:
                for i, g in enumerate(gen):
                    if len(self.prompt) + len(g) >= max_len:
                        raise ControllerError(
                            f"start[{i}] makes particle {i}'s context {len(self.prompt) + len(g)} tokens (the prompt's "
                            f"{len(self.prompt)} + {len(g)}); max_model_len={max_len} allows at most {max_len - 1}"
                        )
        self._gen: list[list[int]] = [list(g) for g in gen]  # each particle's own list (see the class docstring)
        self._tuples: list[Tokens] | None = gen  # :attr:`generated`, None once a step changed it
        self.live_flags = [True] * n
        self._longest = max(map(len, gen))  # at least the longest generated (see apply)

    @property
    def generated(self) -> list[Tokens]:
        """Each particle's generated tokens, a tuple per particle (made when read after a step:
        O(total tokens) once, then the same list until the next step)."""
        t = self._tuples
        if t is None:
            t = self._tuples = [tuple(g) for g in self._gen]
        return t

    @property
    def n(self) -> int:
        """The number of particles (live or not)."""
        return len(self._gen)

    @property
    def seqs(self) -> list[list[int]]:
        """Each particle's generated tokens as the set's own lists (no copy): a runner reads them
        (``seqs[i][-1]``, ``len(seqs[i])``) and never changes them; they change in place at the
        next step."""
        return self._gen

    def tokens(self, i: int) -> Tokens:
        """Particle ``i``'s generated tokens (a tuple, made for this call: O(its length))."""
        return tuple(self._gen[i])

    def live(self) -> list[int]:
        """Indices of the live particles, in order."""
        return [i for i, f in enumerate(self.live_flags) if f]

    def prefix(self, i: int) -> Tokens:
        """The token ids whose next-token row particle ``i`` needs (its first factor's, in a
        product of prompts)."""
        return self.prompts[0] + tuple(self._gen[i])

    def wanted(self, particles: Sequence[int]) -> list[Tokens]:
        """The contexts whose rows ``particles`` need, factor-major: ``k * len(particles)`` of
        them (``k`` prompts), to be folded by :func:`fold_rows`."""
        gen = self._gen
        return [p + tuple(gen[i]) for p in self.prompts for i in particles]

    def apply(self, decision: Any, particles: Sequence[int]) -> bool:
        """Apply ``decision`` (made for ``particles``, the live ones) and return its ``stop``.
        Checks it first (:func:`check_decision`, and the contexts against ``max_len`` unless the
        run stops); raises :class:`ControllerError`, with nothing applied, if it is malformed."""
        tokens, parents, stop = check_decision(decision, len(particles), len(self._gen), self.vocab_size)
        return self.apply_checked(tokens, parents, stop, particles)

    def apply_checked(self, tokens: list[int | None], parents: list[int] | None, stop: bool,
                      particles: Sequence[int]) -> bool:
        """:meth:`apply` for a decision that :func:`check_decision` already checked and
        normalised for these ``particles`` and this set (its ``(tokens, parents, stop)``), so
        that a runner that needs the normalised decision itself checks it once. The contexts are
        still checked against ``max_len`` here (:class:`ControllerError`, nothing applied).
        O(number of particles), plus a copy of each resampled copy's tokens."""
        if len(tokens) != len(particles):  # before anything is applied (zip's strict would raise midway)
            raise ValueError(f"{len(tokens)} tokens for {len(particles)} particles")
        gen, flags = self._gen, list(self.live_flags)
        longest = self._longest
        room = None if self.max_len is None else self.max_len - len(self.prompt)
        if stop or room is None or longest + 1 < room:  # no context can reach max_len: apply at once
            for i, tok in zip(particles, tokens, strict=True):
                if tok is None:
                    flags[i] = False
                else:
                    g = gen[i]
                    g.append(tok)
                    if len(g) > longest:
                        longest = len(g)
            return self._applied(flags, longest, parents, stop)
        for i, tok in zip(particles, tokens, strict=True):
            if tok is None:
                flags[i] = False
            elif len(gen[i]) >= longest:
                longest = len(gen[i]) + 1
        if longest >= room:  # a particle may have reached it: look
            self._check_room(tokens, parents, particles, flags, room)
        for i, tok in zip(particles, tokens, strict=True):  # checked: now applied
            if tok is not None:
                gen[i].append(tok)
        return self._applied(flags, longest, parents, stop)

    def _applied(self, flags: list[bool], longest: int, parents: list[int] | None, stop: bool) -> bool:
        """The end of :meth:`apply_checked`, once the tokens are appended: the resampling, the
        new flags and bound on lengths."""
        if parents is not None:
            self._gen = resampled(self._gen, parents, list.copy)
            flags = [flags[p] for p in parents]
        self.live_flags, self._longest, self._tuples = flags, longest, None
        return stop

    def _check_room(self, tokens: list[int | None], parents: list[int] | None, particles: Sequence[int],
                    flags: list[bool], room: int) -> None:
        """Raise :class:`ControllerError` if the decision would leave a live particle with a
        context of ``room`` generated tokens or more (nothing is applied yet)."""
        took = {i for i, tok in zip(particles, tokens, strict=True) if tok is not None}
        order = parents if parents is not None else range(len(self._gen))
        for i, a in enumerate(order):
            n = len(self._gen[a]) + (a in took)
            if flags[a] and n >= room:
                raise ControllerError(
                    f"the controller ran particle {i} to {len(self.prompt) + n} tokens "
                    f"(max_model_len={self.max_len}): stop it earlier (a None token ends a particle, "
                    "Decision.stop the run) while its context is below max_model_len"
                )


T = TypeVar("T")


def resampled(items: Sequence[T], parents: Sequence[int], copy: Callable[[T], T]) -> list[T]:
    """``[items[p] for p in parents]`` where each parent's first place takes ``items[p]`` itself
    and each later place ``copy(items[p])``: after a resampling every particle owns what it
    changes in place (its token list, its constraint state), and a parent's first copy pays no
    copy."""
    taken: set[int] = set()
    out: list[T] = []
    for p in parents:
        if p in taken:
            out.append(copy(items[p]))
        else:
            taken.add(p)
            out.append(items[p])
    return out


def fold_rows(rows: Any, k: int) -> Any:
    """``rows`` (``[k * m, V]``, factor-major as :meth:`ParticleSet.wanted` lists them) as
    ``[m, V]``: the sum over the ``k`` factors, added in factor order in ``rows``' dtype on its
    device (float32: each runner does exactly these adds, so both give the same bits). ``k = 1``:
    ``rows`` itself."""
    if k == 1:
        return rows
    m = rows.shape[0] // k
    out = rows[:m] + rows[m:2 * m]
    for j in range(2, k):
        out += rows[j * m:(j + 1) * m]
    return out


async def drive(lm: Any, prompt_ids: Sequence[int], controller: Controller, *, lora_name: str | None = None,
                start: Sequence[Sequence[int]] | None = None, prompts: Sequence[Tokens] | None = None) -> Any:
    """Run ``controller`` per token in Python over any :class:`~genlm_vlm.AsyncLM`: each step
    awaits ``lm.batch_next_token_logprobs`` for the live particles and calls ``step`` on the
    caller's thread. This is the reference a burst is compared with; ``lm`` may be a
    :class:`~genlm_vlm.MockAsyncLM`, a :class:`~genlm_vlm.ReplicaPool` or any wrapper.
    ``prompts`` (checked prompts, ``k >= 2``): a product of prompts (``prompt_ids`` ignored;
    see the module docstring)."""
    ps = ParticleSet(tuple(prompt_ids), n_particles_of(controller), start, prompts=prompts,
                     vocab_size=getattr(lm, "vocab_size", None), max_len=getattr(lm, "max_model_len", None))
    k = len(ps.prompts)
    while True:
        live = ps.live()
        if not live:
            break
        rows = await lm.batch_next_token_logprobs(ps.wanted(live), lora_name=lora_name)
        if ps.apply(controller.step(fold_rows(rows, k), live), live):
            break
    return controller.result(ps.generated)
