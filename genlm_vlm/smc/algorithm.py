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
``"systematic"``) and their weights set to the mean weight, so the estimate of the log marginal
(``log Z``, the probability that a sequence from the model satisfies the constraint) stays
unbiased in ``Z``.

The arithmetic is numpy ``float64`` on one thread (all rows at once over the full width when
they are few and narrow, else each row over its allowed tokens): the result depends on the rows,
the constraint and the seed, nothing else (not on the thread, the batch, or whether the run is in
the engine or in Python).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .constraints import BoundConstraint
from .controller import Controller, Decision, Tokens

RESAMPLING = ("multinomial", "stratified", "systematic")
#: Up to this many row entries (particles x width) a step's rows are handled together over the full
#: width; above it each row over its allowed tokens only (sparse masks of large vocabularies).
DENSE_LIMIT = 1 << 21
#: Tokens per block in a dense step's search for the drawn token.
BLOCK = 256


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


@dataclass
class SMCResult:
    """What :meth:`~genlm_vlm.AsyncLM.smc` returns.

    ``log_marginal``: the estimate of ``log Z`` (``-inf`` if every particle died).
    ``posterior``: normalised weights of the finished particles, summed over identical texts
    (bytes -> probability; empty when no particle finished). ``ess``: the effective sample size
    after each step; ``resampled_at``: the steps (1-based) after which the particles were
    resampled. ``stats``: counters of the run (steps, rows, tokens, the constraint's seconds,
    the controller's seconds, where it ran).
    """

    particles: list[Particle]
    log_marginal: float
    posterior: dict[bytes, float]
    ess: list[float] = field(default_factory=list)
    resampled_at: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

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
    top = float(np.max(x)) if x.size else -math.inf
    if not math.isfinite(top):
        return top
    return top + math.log(float(np.sum(np.exp(x - top))))


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


class SMCController(Controller):
    """The built-in controller (see the module docstring). Build it through
    :meth:`~genlm_vlm.AsyncLM.smc`, which checks the arguments; one instance runs once."""

    def __init__(self, constraint: BoundConstraint, n_particles: int, max_tokens: int, *,
                 eos_ids: Sequence[int], byte_vocab: Sequence[bytes], ess_threshold: float = 0.5,
                 resampling: str = "systematic", temperature: float = 1.0, seed: int | None = None,
                 force_eos: bool = False, target_temperature: float = 1.0) -> None:
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
        self.tokens: list[list[int]] = [[] for _ in range(n_particles)]
        self.log_w = np.zeros(n_particles)
        self.status = ["live"] * n_particles
        self.log_z = 0.0  # from the resampling steps so far
        self.ess: list[float] = []
        self.resampled_at: list[int] = []
        self.steps = 0
        self.died_at: int | None = None
        self.rows = 0
        self.seconds = 0.0
        self.force_eos = force_eos
        self.target_temperature = target_temperature
        self.forced = 0  # particles whose last token was cut to EOS (force_eos)
        self._eos_only: np.ndarray | None = None

    # ------------------------------------------------------------------ one step
    def step(self, rows: Any, particles: Sequence[int]) -> Decision:
        t0 = time.perf_counter()
        self.steps += 1
        self.rows += len(particles)
        rows = self._target_rows(rows)  # target_temperature: log_softmax(rows / tau), on the rows' device
        if getattr(rows, "device", None) is not None and rows.device.type != "cpu":
            rows = rows.cpu()
        values = rows.numpy() if hasattr(rows, "numpy") else np.asarray(rows)
        masks = self.constraint.masks([self.states[i] for i in particles])
        masks = self._last_token_masks(masks, particles)  # force_eos: the max_tokens-th token is EOS
        if values.shape[0] * values.shape[1] <= DENSE_LIMIT:
            proposals = self._propose_dense(values, masks)
        else:
            proposals = [self._propose_one(values[k], masks[k]) for k in range(len(particles))]
        out = [self._apply(i, prop) for i, prop in zip(particles, proposals, strict=True)]
        parents = self._maybe_resample()
        self.seconds += time.perf_counter() - t0
        return Decision(out, parents)

    def _propose_dense(self, values: np.ndarray, masks: np.ndarray) -> list[tuple[int, float] | None]:
        """Every row at once over the full width (small ``m x V``): ``(token, log weight
        increment)`` per row, None where the mask keeps no probability.

        One ``float32 [m, V']`` buffer (``V'``: ``V`` rounded up to whole blocks of
        :data:`BLOCK`): mask, max, shift, exp in place, then float64 sums per block; a draw finds
        its block from the blocks' cumulative sums and its token inside the block."""
        m, width = values.shape
        padded = -(-width // BLOCK) * BLOCK
        x = np.full((m, padded), -np.inf, dtype=np.float32)
        np.copyto(x[:, :width], values, where=masks)
        top = x.max(axis=1).astype(np.float64)
        alive = np.isfinite(top)
        t = self.temperature
        if t < 1e-5:  # greedy: the proposal is a point mass
            j = x.argmax(axis=1)
            return [(int(j[k]), float(x[k, j[k]])) if alive[k] else None for k in range(m)]
        ztop = np.where(alive, top if t == 1.0 else top / t, 0.0)
        if t != 1.0:
            x /= np.float32(t)
        x -= ztop.astype(np.float32)[:, None]
        np.exp(x, out=x)  # e = exp(z - ztop): 0 outside the mask
        cum = np.cumsum(x.reshape(m, padded // BLOCK, BLOCK).sum(axis=2, dtype=np.float64), axis=1)
        u = self.rng.random(int(alive.sum()))
        out: list[tuple[int, float] | None] = []
        n = 0
        for k in range(m):
            if not alive[k]:
                out.append(None)
                continue
            tot = float(cum[k, -1])
            target = u[n] * tot
            n += 1
            b = int(np.searchsorted(cum[k], target, side="right"))  # its block has mass: target < tot
            inside = x[k, b * BLOCK:(b + 1) * BLOCK]
            rest = target - (float(cum[k, b - 1]) if b else 0.0)
            i = min(int(np.searchsorted(np.cumsum(inside, dtype=np.float64), rest, side="right")), BLOCK - 1)
            if inside[i] == 0.0:  # round-off past the block's last allowed token
                i = int(np.flatnonzero(inside[: i + 1])[-1])
            j = b * BLOCK + i
            if t == 1.0:
                incr = float(ztop[k]) + math.log(tot)
            else:  # row[x] - log q(x), with log q(x) = log e[x] - log total
                incr = float(values[k, j]) - (math.log(float(x[k, j])) - math.log(tot))
            out.append((j, incr))
        return out

    def _propose_one(self, row: np.ndarray, mask: np.ndarray) -> tuple[int, float] | None:
        """One row over its allowed tokens only (large ``m x V``): as :meth:`_propose_dense`."""
        allowed = np.flatnonzero(mask)
        vals = row[allowed].astype(np.float64)
        top = float(vals.max()) if vals.size else -math.inf
        if not math.isfinite(top):
            return None
        t = self.temperature
        if t < 1e-5:
            j = int(np.argmax(vals))
            return int(allowed[j]), float(vals[j])
        z, ztop = (vals, top) if t == 1.0 else (vals / t, top / t)
        cdf = np.cumsum(np.exp(z - ztop))
        total = float(cdf[-1])
        j = min(int(np.searchsorted(cdf, self.rng.random() * total, side="right")), len(cdf) - 1)
        incr = ztop + math.log(total) if t == 1.0 else float(vals[j]) - (float(z[j]) - ztop - math.log(total))
        return int(allowed[j]), incr

    def _target_rows(self, rows: Any) -> Any:
        """The target's rows: ``rows`` as they are, or ``log_softmax(rows / tau)`` (float32, as
        genlm-control's ``PromptedLLM`` tempers) with ``target_temperature`` ``tau != 1``; a torch
        tensor stays on its device, anything else becomes numpy."""
        tau = self.target_temperature
        if tau == 1.0:
            return rows
        if hasattr(rows, "log_softmax"):  # a torch tensor
            return (rows.float() / tau).log_softmax(dim=-1)
        z = np.asarray(rows, dtype=np.float64) / tau
        z -= z.max(axis=1, keepdims=True)
        z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
        return z.astype(np.float32)

    def _last_token_masks(self, masks: np.ndarray, particles: Sequence[int]) -> np.ndarray:
        """With ``force_eos``: the rows of particles that have generated ``max_tokens - 1``
        tokens keep only their allowed EOS ids (a copy; ``masks`` itself is left alone)."""
        if not self.force_eos:
            return masks
        last = [k for k, i in enumerate(particles) if len(self.tokens[i]) >= self.max_tokens - 1]
        if not last:
            return masks
        if self._eos_only is None or self._eos_only.shape[0] != masks.shape[1]:
            self._eos_only = np.zeros(masks.shape[1], dtype=bool)
            self._eos_only[[e for e in self.eos if 0 <= e < masks.shape[1]]] = True
        masks = np.array(masks, dtype=bool, copy=True)
        masks[last] &= self._eos_only
        self.forced += len(last)
        return masks

    def _apply(self, i: int, proposal: tuple[int, float] | None) -> int | None:
        """Particle ``i`` takes its proposed token (or dies); returns what the runner feeds it."""
        if proposal is None:
            self.log_w[i] = -math.inf
            self.status[i] = "dead"
            return None
        token, incr = proposal
        self.log_w[i] += incr
        if token in self.eos:
            self.status[i] = "finished"
            return None
        self.states[i] = self.constraint.advance(self.states[i], token)
        self.tokens[i].append(token)
        if len(self.tokens[i]) >= self.max_tokens:
            self.status[i] = "cut"
            return None
        return token

    def _maybe_resample(self) -> list[int] | None:
        lw = self.log_w
        total = _logsumexp(lw)
        if not math.isfinite(total):  # every particle died
            self.ess.append(0.0)
            if self.died_at is None:
                self.died_at = self.steps
            return None
        w = np.exp(lw - total)
        ess = 1.0 / float(np.sum(w * w))
        self.ess.append(ess)
        if "live" not in self.status or ess >= self.ess_threshold * self.n_particles:
            return None
        self.log_z += total - math.log(self.n_particles)
        parents = ancestors(w, self.resampling, self.rng)
        c = self.constraint
        self.states = [c.copy(self.states[p]) for p in parents]
        self.tokens = [list(self.tokens[p]) for p in parents]
        self.status = [self.status[p] for p in parents]
        self.log_w = np.zeros(self.n_particles)
        self.resampled_at.append(self.steps)
        return parents

    # ------------------------------------------------------------------ the end
    def result(self, generated: Sequence[Tokens]) -> SMCResult:
        vocab = self.byte_vocab
        particles = []
        for i in range(self.n_particles):
            status = "cut" if self.status[i] == "live" else self.status[i]
            toks = self.tokens[i]
            particles.append(Particle(list(toks), b"".join(vocab[t] for t in toks), float(self.log_w[i]), status))
        total = _logsumexp(self.log_w)
        log_marginal = self.log_z + total - math.log(self.n_particles) if math.isfinite(total) else -math.inf
        posterior: dict[bytes, float] = {}
        done = [p for p in particles if p.finished and math.isfinite(p.log_weight)]
        if done:
            lw = np.array([p.log_weight for p in done])
            w = np.exp(lw - _logsumexp(lw))
            for p, wi in zip(done, w, strict=True):
                posterior[p.text] = posterior.get(p.text, 0.0) + float(wi)
        stats = {
            "steps": self.steps,
            "rows": self.rows,
            "resamples": len(self.resampled_at),
            "finished": sum(p.status == "finished" for p in particles),
            "cut": sum(p.status == "cut" for p in particles),
            "dead": sum(p.status == "dead" for p in particles),
            "died_at": self.died_at,
            "forced_eos": self.forced,
            "controller_s": round(self.seconds, 6),
            "constraint_s": round(self.constraint.seconds, 6),
        }
        return SMCResult(particles, log_marginal, posterior, list(self.ess), list(self.resampled_at), stats)
