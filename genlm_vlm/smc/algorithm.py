"""Constrained SMC with the locally optimal proposal, as a :class:`~.controller.Controller`.

Per live particle and step, with ``row`` the model's next-token log-probabilities and ``mask``
the constraint's allowed tokens for the particle's state:

* ``log_mass = logsumexp(row[mask])``; with temperature ``t`` the proposal is
  ``q(x) ∝ exp(row[x] / t)`` on the mask and the particle's log weight grows by
  ``row[x] - log q(x)`` (at ``t = 1``: exactly ``log_mass``);
* a mask that keeps no probability ends the particle with weight zero (it *dies*);
* the token is drawn by inverse CDF from one uniform of the run's generator; EOS (allowed where
  the constraint accepts) ends the particle (*finished*); ``max_tokens`` tokens end it (*cut*);
* with ``force_eos``, ``max_tokens`` counts the EOS (genlm-control's convention): a particle that
  has generated ``max_tokens - 1`` tokens may only take EOS next (its mask is cut to the EOS ids),
  so it finishes with its weight grown by ``log P(EOS)`` where the constraint accepts its text,
  and dies where it does not; no particle is cut;
* with ``target_temperature`` ``tau != 1`` the target itself is tempered: each row becomes
  ``log_softmax(row / tau)`` before anything else (genlm-control's ``PromptedLLM(temperature=)``),
  where ``temperature`` tempers only the proposal.

After each step, if the effective sample size of the weights is below ``ess_threshold * N`` and
a particle is still live, the particles are resampled (``"multinomial"``, ``"stratified"`` or
``"systematic"``; finished particles take part, frozen, and a copy of one is finished too; a
particle is only cut at the last step, after which nothing is resampled) and their weights set
to the mean weight, whose log is added to ``log L`` (the resampling steps' log normalisers).

**The log marginal.** With ``T = max_tokens``, ``p`` the target (the model's next-token
distribution from the prompt; tempered by ``target_temperature``; the product of the factors'
with ``prompts``) and ``accepted`` the constraint's language::

    Z_T = sum over token paths x of at most T - 1 tokens, each allowed by the mask, with EOS
          allowed after x (the constraint accepts x):  p(x) * p(EOS | x)

is the probability that a sample of the model ends (EOS) within ``T`` tokens, EOS included, with
a text the constraint accepts (``force_eos`` does not change it: it turns the mass a cut
particle would carry into EOS where the constraint accepts). ``log_marginal = log L +
logsumexp(finished particles' log weights) - log N`` is an estimate of ``log Z_T`` whose
exponential is unbiased for ``Z_T`` (at any temperature above the greedy limit, where the
proposal reaches every allowed path); cut and dead particles count zero. ``log_marginal_cut``,
the same estimator over the cut particles, is unbiased for ``C_T``, the probability of a path of
``T`` allowed tokens with no EOS (``-inf`` with ``force_eos``, which cuts no particle). Why: the particles (a finished or dead
one frozen, its weight multiplied by 1 at each later step) are an SMC sampler whose target after
step ``t`` is ``gamma_t``: ``p`` on the paths of ``t`` allowed tokens and on the finished paths
of fewer, zero elsewhere. A step multiplies a weight by ``gamma_t / (gamma_{t-1} * q)``, so
``E[L * mean_i w_i f(x_i)]`` stays ``sum_x gamma_t(x) f(x)`` for every function ``f``; a
resampling step keeps that expectation too (each scheme here gives particle ``i``
``N * w_i / sum_j w_j`` copies on average, and ``L`` takes the mean weight), and so does
deciding whether to resample from the weights so far. At the end ``f = 1[finished]`` gives
``Z_T`` and ``f = 1[cut]`` gives ``C_T``. ``Z_T`` grows with ``T`` to ``Z``
(the probability that a sample ends with an accepted text, whatever its length) and
``Z_T <= Z <= Z_T + C_T`` (an accepted path of ``T`` tokens or more passes through an allowed
``T``-token prefix), so a run without ``force_eos`` brackets ``Z`` by ``log_marginal`` and
``SMCResult.log_marginal_with_cut``.

The proposal runs where the rows are (:mod:`.step`, torch: the constraint's bitmasks go to the
rows' device, ``m`` tokens and ``m`` increments come back); the bookkeeping (weights, states,
resampling) is numpy float64 on the host. The uniforms come from the run's numpy generator, one
per live particle in particle order, so the result depends on the rows, the constraint, the seed
and the device's kernels, nothing else (not on the thread, the batch, torch's thread count, or
whether the run is in the engine or in Python).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .book import LIVE, Book
from .constraints import BoundConstraint, usable_width
from .controller import Controller, Decision, Tokens, resampled
from .prefetch import MaskPrefetch, StepMasks

if TYPE_CHECKING:  # torch and the step are imported where used: importing genlm_vlm.smc stays light
    import torch

RESAMPLING = ("multinomial", "stratified", "systematic")


@dataclass
class Particle:
    """One final particle: the tokens it generated (EOS not included), their bytes, its log
    weight, and how it ended: ``"finished"`` (EOS), ``"cut"`` (``max_tokens``, or the run was
    stopped) or ``"dead"`` (its constraint kept no probability; log weight ``-inf``)."""

    token_ids: list[int]
    text: bytes
    log_weight: float
    status: str

    @property
    def finished(self) -> bool:
        """Ended with EOS: its text is complete."""
        return self.status == "finished"

    @property
    def dead(self) -> bool:
        """Ended because its constraint kept no probability (weight zero)."""
        return self.status == "dead"


class EmptyPosteriorWarning(UserWarning):
    """An SMC run returned no finished particle with a positive weight: ``posterior`` is empty
    and ``log_marginal`` is ``-inf``. The message (also :attr:`SMCResult.empty_reason`) says why
    (``max_tokens`` cut every particle, every particle died, or the critic weighed every finished
    text zero) and what to change."""


@dataclass
class SMCResult:
    """What :meth:`~genlm_vlm.AsyncLM.smc` returns.

    ``log_marginal``: ``log L + logsumexp(finished particles' log weights) - log N``, whose
    exponential is an unbiased estimate of the probability that a sample of the model (the
    target) ends with EOS within ``max_tokens`` tokens, EOS included, with a text the
    constraint accepts (times the critic's weight, with a critic); ``-inf`` when no particle
    finished. Cut and dead particles count zero (see :mod:`genlm_vlm.smc.algorithm`).
    ``log_marginal_cut``: the same estimator over the cut particles (unbiased for the
    probability of ``max_tokens`` allowed tokens with no EOS; ``-inf`` when none was cut, always
    with ``force_eos``). ``posterior``: normalised weights of the finished particles, summed over
    identical texts (bytes -> probability; empty when no particle finished with a positive
    weight). ``empty_reason``: None, or why ``posterior`` is empty (the text of the
    :class:`EmptyPosteriorWarning` the run gave). ``ess``: the effective sample size after each
    step; ``resampled_at``: the steps (1-based) after which the particles were resampled.
    ``stats``: counters of the run (steps, rows, tokens, the constraint's seconds, the
    controller's seconds, where it ran).
    """

    particles: list[Particle]
    log_marginal: float
    posterior: dict[bytes, float]
    ess: list[float] = field(default_factory=list)
    resampled_at: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    log_marginal_cut: float = -math.inf
    empty_reason: str | None = None

    @property
    def log_marginal_with_cut(self) -> float:
        """``log(exp(log_marginal) + exp(log_marginal_cut))``: the estimate that also counts the
        cut particles' unfinished texts. Without ``force_eos``, ``exp(log_marginal)`` and this
        bracket the probability that a sample ends with an accepted text, whatever its length
        (both estimates unbiased)."""
        return float(np.logaddexp(self.log_marginal, self.log_marginal_cut))

    @property
    def decoded_posterior(self) -> dict[str, float]:
        """:attr:`posterior` with UTF-8 text keys (undecodable bytes replaced)."""
        out: dict[str, float] = {}
        for text, p in self.posterior.items():
            key = text.decode("utf-8", errors="replace")
            out[key] = out.get(key, 0.0) + p
        return out

    @property
    def log_weights(self) -> list[float]:
        return [p.log_weight for p in self.particles]

    @property
    def steps(self) -> int:
        """Steps run (the longest particle's tokens, its EOS included)."""
        return int(self.stats.get("steps", 0))

    @property
    def resamples(self) -> int:
        return len(self.resampled_at)

    @property
    def n_finished(self) -> int:
        return sum(p.status == "finished" for p in self.particles)

    @property
    def n_cut(self) -> int:
        return sum(p.status == "cut" for p in self.particles)

    @property
    def n_dead(self) -> int:
        return sum(p.status == "dead" for p in self.particles)


def _logsumexp(x: np.ndarray) -> float:
    top = float(x.max()) if x.size else -math.inf  # the methods: np.max and np.sum's reductions, less overhead
    if not math.isfinite(top):
        return top
    return top + math.log(float(np.exp(x - top).sum()))


def log_marginals(log_l: float, particles: Sequence[Particle]) -> tuple[float, float]:
    """``(log_marginal, log_marginal_cut)`` of a run whose resampling steps' log normalisers sum
    to ``log_l``: ``log_l + logsumexp(log weights of the finished (resp. cut) particles) - log N``
    (``-inf`` when there are none, or all have weight zero). The one definition every path
    reports (the controller's result, the critic, genlm-control's ``Sequences``)."""
    n = len(particles)
    out = []
    for status in ("finished", "cut"):
        lw = np.array([p.log_weight for p in particles if p.status == status], dtype=np.float64)
        total = _logsumexp(lw)
        out.append(log_l + total - math.log(n) if math.isfinite(total) else -math.inf)
    return out[0], out[1]


def warn_if_empty(result: Any, stacklevel: int = 2) -> None:
    """Issue :class:`EmptyPosteriorWarning` with ``result.empty_reason`` when it has one (a run
    whose posterior is empty). Called once per run, where the caller awaits it (never on the
    engine thread)."""
    reason = getattr(result, "empty_reason", None)
    if reason:
        warnings.warn(reason, EmptyPosteriorWarning, stacklevel=stacklevel + 1)


def posterior_of(particles: Sequence[Particle]) -> dict[bytes, float]:
    """Normalised weights of the finished particles with a finite weight, summed over identical
    texts (empty when none)."""
    posterior: dict[bytes, float] = {}
    done = [p for p in particles if p.finished and math.isfinite(p.log_weight)]
    if done:
        lw = np.array([p.log_weight for p in done])
        w = np.exp(lw - _logsumexp(lw))
        for p, wi in zip(done, w, strict=True):
            posterior[p.text] = posterior.get(p.text, 0.0) + float(wi)
    return posterior


def ancestors(weights: np.ndarray, method: str, rng: np.random.Generator) -> list[int]:
    """``len(weights)`` ancestor indices drawn from normalised ``weights``."""
    n = len(weights)
    if method == "multinomial":
        u = np.sort(rng.random(n))
    elif method == "stratified":
        u = (np.arange(n) + rng.random(n)) / n
    else:  # systematic
        u = (np.arange(n) + rng.random()) / n
    cdf = np.cumsum(weights)
    cdf[-1] = 1.0
    return [int(i) for i in np.minimum(np.searchsorted(cdf, u, side="right"), n - 1)]


class SMCController(StepMasks, Controller):
    """The built-in controller (see the module docstring). Build it through
    :meth:`~genlm_vlm.AsyncLM.smc`, which checks the arguments; one instance runs once.

    ``device``: where the proposal runs (rows elsewhere are moved there); None: where each
    step's rows are (the engine's device in a burst, ``output_device`` through
    ``batch_next_token_logprobs``)."""

    #: :meth:`step` reads its ``rows`` and keeps no reference to them (or to a view of them) once
    #: it returns, so a runner may hand it rows in a buffer that it overwrites the next step (the
    #: requests path does). A subclass whose step keeps its rows must set this to False.
    borrows_rows = True

    def __init__(self, constraint: BoundConstraint, n_particles: int, max_tokens: int, *,
                 eos_ids: Sequence[int], byte_vocab: Sequence[bytes], ess_threshold: float = 0.5,
                 resampling: str = "systematic", temperature: float = 1.0, seed: int | None = None,
                 device: str | torch.device | None = None, force_eos: bool = False,
                 target_temperature: float = 1.0, mask_overlap: bool = False) -> None:
        self.constraint = constraint
        self.n_particles = n_particles
        self.max_tokens = max_tokens
        self.eos = frozenset(int(e) for e in eos_ids)
        self.byte_vocab = byte_vocab
        self.ess_threshold = ess_threshold
        self.resampling = resampling
        self.temperature = temperature
        self.rng = np.random.default_rng(seed)
        self.states = [constraint.initial()]
        self.states += [constraint.copy(self.states[0]) for _ in range(n_particles - 1)]
        #: The particles' weights, tokens, statuses and history numbers, as arrays (:mod:`.book`).
        self.book = Book(n_particles, max_tokens, self.eos)
        self.log_z = 0.0  # from the resampling steps so far
        self.ess: list[float] = []
        self.resampled_at: list[int] = []
        self.steps = 0
        self.died_at: int | None = None
        self.rows = 0
        self.rows_per_step: list[int] = []  # live particles at each step (their sum: rows)
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # the calling thread's CPU time in step(): wall minus waiting for a core
        self.mask_seconds = 0.0
        import torch

        self.device = None if device is None else torch.device(device)
        #: Columns that can ever be allowed (the rest is the logit matrix's padding): never read.
        self.width = usable_width(byte_vocab, self.eos)
        self.force_eos = force_eos
        self.target_temperature = target_temperature
        self.forced = 0  # particles whose last token was cut to EOS (force_eos)
        self._eos_only: torch.Tensor | None = None
        #: Whether a runner that can may compute the next step's masks ahead
        #: (:meth:`prefetch_masks`); the masks, and so the run, are the same either way.
        self.mask_overlap = bool(mask_overlap)
        self._prefetch = MaskPrefetch()
        if (self.device is None and not torch.cuda.is_available()) or (self.device is not None and self.device.type == "cpu"):
            from .step_cpu import fused_available
            from .walk_cpu import walker

            fused_available()  # the fused CPU step compiled (or loaded) here, not in an engine step
            walker()  # and the automata's token walk

    # ------------------------------------------------------------------ one step
    def step(self, rows: Any, particles: Sequence[int]) -> Decision:
        import torch

        from .step import fused_inputs, propose, to_host
        from .step_cpu import fused_arrays

        t0, c0 = time.perf_counter(), time.thread_time()
        self.steps += 1
        m = len(particles)
        self.rows += m
        self.rows_per_step.append(m)
        if not isinstance(rows, torch.Tensor):
            rows = torch.as_tensor(rows)
        if self.device is not None and rows.device != self.device:
            rows = rows.to(self.device)
        rows = self._target_rows(rows)  # target_temperature: log_softmax(rows / tau), on the rows' device
        idx = np.asarray(particles, dtype=np.int64)  # the particles as an index into the book's arrays
        bits, counts = self._bitmasks(particles, rows.device)
        forced = self._last_token_masks(bits, idx)  # force_eos: the max_tokens-th token is EOS
        if forced is not bits:
            bits, counts = forced, None
        t1 = time.perf_counter()
        self.mask_seconds += t1 - t0
        u = self.rng.random(m)  # one per live particle, in particle order, whatever the path
        width = min(self.width, rows.shape[1])
        direct = fused_inputs(rows, bits, width, self.temperature, counts)
        if direct is not None:  # the fused CPU step, called without propose's checks and tensors
            tok, incr = fused_arrays(direct[0], direct[1], u, self.temperature, width)
        else:
            tokens, incr = to_host(*propose(rows, bits, u, self.temperature, width=width, counts=counts))
            tok = np.array(tokens, dtype=np.int64)
        out = self._take(idx, tok, incr)
        parents = self._maybe_resample()
        self.seconds += time.perf_counter() - t0
        self.cpu_seconds += time.thread_time() - c0
        return Decision(out, parents)

    def _target_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's rows: ``rows`` as they are, or ``log_softmax(rows / tau)`` (genlm-control's
        ``PromptedLLM`` tempering) with ``target_temperature`` ``tau != 1``, on the rows' device:
        computed in float64 as ``(rows - max) / tau`` (exact at any finite ``tau > 0``: no
        ``-inf / inf`` or overflow, no cancellation at small ``tau``), returned in float32."""
        tau = self.target_temperature
        if tau == 1.0:
            return rows
        import torch

        x = rows.double()
        top = x.amax(dim=-1, keepdim=True)
        x = (x - torch.where(top > -math.inf, top, torch.zeros_like(top))) / tau
        return x.log_softmax(dim=-1).float()

    def _last_token_masks(self, bits: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
        """With ``force_eos``: the bitmask rows of the live particles ``idx`` that have generated
        ``max_tokens - 1`` tokens keep only their allowed EOS ids (a copy; ``bits`` itself is left
        alone)."""
        if not self.force_eos:
            return bits
        last = np.flatnonzero(self.book.lens[idx] >= self.max_tokens - 1).tolist()
        if not last:
            return bits
        if self._eos_only is None or self._eos_only.shape[0] != bits.shape[1]:
            from .step import pack

            only = np.zeros((1, 32 * bits.shape[1]), dtype=bool)
            only[0, [e for e in self.eos if 0 <= e < only.shape[1]]] = True
            self._eos_only = pack(only)[0]
        bits = bits.clone()
        bits[last] &= self._eos_only.to(bits.device)
        self.forced += len(last)
        return bits

    def _take(self, idx: np.ndarray, tok: np.ndarray, incr: np.ndarray) -> list[int | None]:
        """Each live particle (``idx``, int64) takes its proposed token (``tok``, int64; ``-1``: it
        dies, its increment is ``-inf``); returns what the runner feeds each (None: nothing, it
        stopped). The particles' arrays move in one numpy operation each (:meth:`.Book.take`),
        the constraint's states in one :meth:`~.BoundConstraint.advance_many`."""
        moved, moves, out = self.book.take(idx, tok, incr)
        if len(moved):
            states, at = self.states, moved.tolist()
            for i, state in zip(at, self.constraint.advance_many([states[i] for i in at], moves.tolist()), strict=True):
                states[i] = state
        return out

    @property
    def log_w(self) -> np.ndarray:
        """The particles' log weights (float64 ``[n_particles]``)."""
        return self.book.log_w

    def _maybe_resample(self) -> list[int] | None:
        lw = self.book.log_w
        total = _logsumexp(lw)
        if not math.isfinite(total):  # every particle died
            self.ess.append(0.0)
            if self.died_at is None:
                self.died_at = self.steps
            return None
        w = np.exp(lw - total)
        ess = 1.0 / float((w * w).sum())
        self.ess.append(ess)
        if ess >= self.ess_threshold * self.n_particles or not self.book.any_live():
            return None
        self.log_z += total - math.log(self.n_particles)
        parents = ancestors(w, self.resampling, self.rng)
        # a parent's first copy takes its state, the others copy it
        self.states = resampled(self.states, parents, self.constraint.copy)
        self.book.resample(parents)
        self.resampled_at.append(self.steps)
        return parents

    # ------------------------------------------------------------------ the end
    def result(self, generated: Sequence[Tokens]) -> SMCResult:
        vocab, book = self.byte_vocab, self.book
        particles = []
        for i in range(self.n_particles):
            status = "cut" if book.status[i] == LIVE else book.status_of(i)
            toks = book.tokens(i)
            particles.append(Particle(toks, b"".join(vocab[t] for t in toks), float(book.log_w[i]), status))
        log_marginal, log_marginal_cut = log_marginals(self.log_z, particles)
        posterior = posterior_of(particles)
        stats = {
            "steps": self.steps,
            "rows": self.rows,
            "rows_per_step": list(self.rows_per_step),
            "resamples": len(self.resampled_at),
            "finished": sum(p.status == "finished" for p in particles),
            "cut": sum(p.status == "cut" for p in particles),
            "dead": sum(p.status == "dead" for p in particles),
            "died_at": self.died_at,
            "forced_eos": self.forced,
            "controller_s": round(self.seconds, 6),
            "controller_cpu_s": round(self.cpu_seconds, 6),
            "constraint_s": round(self.constraint.seconds, 6),
            "mask_s": round(self.mask_seconds, 6),
            "mask_ms_per_step": round(1e3 * self.mask_seconds / max(1, self.steps), 4),
            "step_ms_per_step": round(1e3 * (self.seconds - self.mask_seconds) / max(1, self.steps), 4),
        }
        if self.mask_overlap:
            stats["mask_overlap"] = self._prefetch.stats()
        return SMCResult(particles, log_marginal, posterior, list(self.ess), list(self.resampled_at), stats,
                         log_marginal_cut, None if posterior else self._empty_reason(particles))

    def _empty_reason(self, particles: Sequence[Particle]) -> str:
        """Why no particle finished (see :class:`EmptyPosteriorWarning`): ``max_tokens`` cut
        them, or they all died (at the forced EOS, or where the model gives the constraint's
        tokens no probability)."""
        n, cap = self.n_particles, self.max_tokens
        cut = sum(p.status == "cut" for p in particles)
        dead = sum(p.dead for p in particles)
        if cut:
            died = f", {dead} died" if dead else ""
            return (f"no particle finished within max_tokens={cap} ({cut} of {n} cut{died}): log_marginal is -inf "
                    "and posterior is empty. Raise max_tokens, or pass force_eos=True to end each text with EOS at "
                    "the limit where the constraint accepts it (log_marginal_cut estimates the cut texts' mass)")
        forced = sum(p.dead and len(p.token_ids) >= cap - 1 for p in particles) if self.force_eos else 0
        if forced:
            return (f"every particle died ({forced} of {n} at max_tokens={cap}, where force_eos=True allows only "
                    "EOS and the constraint did not accept the text yet): log_marginal is -inf and posterior is "
                    "empty. Raise max_tokens")
        step = f" by step {self.died_at}" if self.died_at is not None else ""
        return (f"every particle died (all {n}{step}): the model gives no probability to any token the "
                "constraint allows there, EOS included, so the constraint's language holds no text this model "
                "writes from this prompt. log_marginal is -inf and posterior is empty. Relax the constraint or "
                "change the prompt")
