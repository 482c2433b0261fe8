"""Particles as running requests: one controller run whose particles decode as vLLM requests.

The other way to run a :class:`~genlm_vlm.smc.Controller` on the engine thread (``lm.smc(...,
engine_path="requests")``; the default, :mod:`.bursts`, resumes every particle as a session at
every step). Particles with the same context share a *group*, and each group is one ordinary
vLLM request that stays in the running batch (``ignore_eos``, no stop ids, greedy, ``max_tokens``
the run's remaining budget), marked in ``SamplingParams.extra_args`` with
:data:`~genlm_vlm.capture.FORCE_KEY`. Its rows reach :class:`~.forcing.ParticleHost` inside vLLM's
sampler (the capture processors hand them over); when every group of the run has its row for
this step, the run stacks them in particle order (one tensor per live particle, the group's row
repeated, as a burst stacks a shared row; in a *flat* step, every group one particle of one
prompt with its row in the same sampler call, the rows are made in particle order at once:
:func:`~genlm_vlm.capture.logprob_matrix`), calls ``controller.step``, checks and applies the
decision (:class:`~genlm_vlm.smc.controller.ParticleSet`, as every runner does) and returns the
token each group's request is forced to take: its row becomes ``-inf`` but for that token, and
vLLM's own decode loop computes it at the next step. One SMC step is one engine step. In a
product of prompts (``BurstSpec.prompts``) each factor's contexts form their own groups
(``Group.factor``): the run decides once every factor's groups have their rows, stacked
factor-major and summed by :func:`~genlm_vlm.smc.controller.fold_rows` as a burst sums them.

After a decision the groups regroup: the particles of an old group that took the same token (or
are copies, after resampling, of a particle that took it) form a new group. The first new group of
an old group keeps its request (the forced token); every other one is a *fork*: a new request
whose prompt is the old context plus its token, marked as a fork of the old request so that it
shares the old request's KV, tail block included (:mod:`.forks`), and computes one token. An old
group that no particle continues has its request aborted after the step. Forks therefore happen
only where particles share a context: at the first step and after resampling.

Lockstep: a group whose row arrives before its run's other groups have theirs (vLLM left some out
of the step: more groups than ``max_num_seqs``, the token budget, preemption) keeps that row;
its request is left as vLLM sampled it and aborted after the step (freeing its slot for the
others); once the run has decided, that group's new groups are re-added as new requests over the
prefix cache (``stats["readded"]``). Partial prefills are never read as rows: the scheduler says
which requests of the step are partial (:func:`~.forks.prefill_chunk_reader`).

Faults, as in a burst: an exception from the controller, or a decision the checks refuse, fails
this run only (its requests are aborted after the step, its future fails with that exception);
a bug of ours while handling the run fails it with a ``RuntimeError``; cancelling the future
aborts its requests at once (between steps). Everything vLLM-facing is done between steps on the
engine thread (:meth:`RequestRun.settle`); inside the sampler the run only reads rows and decides.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from .bursts import Burst

if TYPE_CHECKING:
    from .jobs import Job

logger = logging.getLogger(__name__)

Tokens = tuple[int, ...]


class Group:
    """Particles with one context, and the request that computes its rows."""

    __slots__ = ("factor", "fork", "length", "members", "rid", "row", "stale")

    def __init__(self, length: int, factor: int = 0, fork: tuple[str, int] | None = None) -> None:
        self.factor = factor  # its prompt's index in a product of prompts (0: the prompt)
        self.length = length  # tokens in its context (prompt + every member's generated tokens)
        self.members: list[int] = []
        self.rid: str | None = None  # its request (None: it needs one)
        self.row: torch.Tensor | None = None  # this step's row, once it arrived
        self.stale = False  # its row arrived early: abort the request after the step
        self.fork = fork  # (parent request id, shared tokens) for a new request, or None


class RequestRun(Burst):
    """One controller run whose particles are running requests (see the module docstring).

    It is a :class:`~.bursts.Burst` for the step loop (the same entry points: ``start``,
    ``cancel``, ``fail``, ``guarded``; the same endings and fault counts), with rows that come
    from :class:`~.forcing.ParticleHost` instead of row jobs."""

    def __init__(self, host: Any, job: Job) -> None:
        """``host``: the step loop's :class:`~.forcing.ParticleHost`."""
        super().__init__(host.loop, job)
        self.host = host
        self.groups: list[Group] = []  # this step's groups (each with live members)
        self.group_of: list[dict[int, Group]] = []  # per factor: live particle -> its group
        self.have = 0  # groups of this step whose row arrived
        self.forced: dict[str, int] = {}  # request id -> token, decided in this apply
        self.ending: tuple[str, BaseException | None, bool] | None = None  # set inside the sampler
        self.to_abort: list[str] = []
        budget = getattr(self.controller, "max_tokens", None)  # SMCController's: a request's max_tokens
        self.budget = budget if isinstance(budget, int) and not isinstance(budget, bool) else None
        self.counts = {"requests": 0, "forks": 0, "readded": 0, "fork_prefill_tokens": 0,
                       "fork_prefill_max": 0, "aborted": 0, "early_rows": 0}
        self.fork_len: dict[str, int] = {}  # fork request id -> its partial block + 1 (the most it may compute)
        # the engine's mask worker when the controller asked for its masks ahead (mask_overlap), else None
        self.masks = host.masks if host.masks.attach(self.controller) else None
        # whether the controller's step keeps no reference to its rows once it returns (the
        # built-in one's), so that a flat step's rows may be written into a buffer reused next step
        self.borrows_rows = getattr(self.controller, "borrows_rows", False) is True

    # ---------------------------------------------------------------- set-up
    def start(self) -> None:
        """Check ``n_particles`` and ``start`` (a mistake fails this run), then one group per
        distinct context, each a new request."""
        if not self._make_particles():
            return
        ps = self.particles
        live = ps.live()
        if not live:
            self._finish()
            return
        by_ctx: dict[tuple[int, Tokens], Group] = {}
        for j, prompt in enumerate(ps.prompts):  # a product of prompts: groups of each factor's own
            for i in live:
                ctx = prompt + ps.tokens(i)
                g = by_ctx.get((j, ctx))
                if g is None:
                    g = by_ctx[(j, ctx)] = Group(len(ctx), j)
                g.members.append(i)
        self._begin_step(list(by_ctx.values()))
        self.settle()

    def _begin_step(self, groups: list[Group]) -> None:
        self.groups = groups
        self.group_of = [{} for _ in self.particles.prompts]
        for g in groups:
            of = self.group_of[g.factor]
            for i in g.members:
                of[i] = g
        self.live = sorted(self.group_of[0])
        self.have = 0
        self.rounds += 1

    # ---------------------------------------------------------------- inside the sampler
    def take(self, group: Group, row: torch.Tensor) -> bool:
        """``group``'s row for this step; True when the run now has every group's row."""
        group.row = row
        self.have += 1
        return self.have == len(self.groups)

    def flat(self) -> bool:
        """Whether this step's groups are one particle each, of one prompt (the common step:
        every particle's row is its own group's)."""
        return len(self.group_of) == 1 and len(self.groups) == len(self.live)

    def decide(self, rows: torch.Tensor | None = None) -> None:
        """Every group has its row: the controller's step, checked and applied; fills
        :attr:`forced` and prepares the next step's groups (or the run's ending). A controller
        error sets :attr:`ending` (this run fails after the step). ``rows``: None (the groups'
        rows, stacked here in particle order), or, for a :meth:`flat` step, the live particles'
        rows already in particle order (one tensor, as stacking would give)."""
        from ..smc.controller import check_decision, fold_rows

        ps = self.particles
        live, group_of = self.live, self.group_of
        if rows is None:  # factor-major, folded as a burst folds them (fold_rows: the rows themselves for one prompt)
            rows = fold_rows(torch.stack([of[i].row for of in group_of for i in live]), len(group_of))  # type: ignore[misc]
        t0 = time.perf_counter()
        try:
            with torch.inference_mode(False):  # as in a burst: the controller runs outside inference mode
                decision = self.controller.step(rows, live)
            del rows
            tokens, parents, stop = check_decision(decision, len(live), ps.n, ps.vocab_size)
            stop = ps.apply_checked(tokens, parents, stop, live)  # the context checks (ControllerError)
        except Exception as e:  # noqa: BLE001 - the controller's (or its mask function's) error: this run only
            self.seconds += time.perf_counter() - t0
            self.ending = ("fail", e, True)
            return
        self.seconds += time.perf_counter() - t0
        old = self.groups
        for g in old:
            g.row = None
        new_live = [] if stop else ps.live()
        if not new_live:
            self.ending = ("finish", None, False)  # the run's requests are aborted as it finishes
            return
        gen = ps.seqs  # the set's own lists: read only
        if not (parents is None and len(new_live) == len(live) and self._continue_singletons(gen)):
            self._regroup(old, new_live, parents, gen)
        if self.masks is not None:  # the next step's masks, computed while vLLM runs its forward
            self.masks.prefetch(self.controller, self.live)

    def _regroup(self, old: list[Group], new_live: list[int], parents: Any, gen: list[list[int]]) -> None:
        """The next step's groups after a step that split contexts (resampling, the first step):
        each old group's first child keeps its request, the others fork it. A step where
        particles only finished, every group one particle, just drops their groups
        (:meth:`_drop_finished`)."""
        if parents is None and self._drop_finished(old, new_live, gen):
            return
        ps, group_of = self.particles, self.group_of
        # Regroup: a new particle i descends from old particle a (its parent, or itself) and took
        # a's token; particles with the same old group and token share a new group.
        anc = parents if parents is not None else range(ps.n)
        buckets: dict[tuple[int, int], Group] = {}
        children: dict[int, list[Group]] = {}
        for of in group_of:  # each factor's groups regroup on their own
            for i in new_live:
                g = of[anc[i]]
                tok = gen[i][-1]
                key = (id(g), tok)
                ng = buckets.get(key)
                if ng is None:
                    ng = buckets[key] = Group(g.length + 1, g.factor)
                    children.setdefault(id(g), []).append(ng)
                ng.members.append(i)
        forced = self.forced
        for g in old:
            kids = children.get(id(g), ())
            rid = g.rid
            if rid is None or g.stale:  # its request is gone (or going): every child is a new request
                self.counts["readded"] += len(kids)
                continue
            if not kids:
                self.to_abort.append(rid)
                continue
            first = kids[0]
            first.rid = rid
            forced[rid] = gen[first.members[0]][-1]
            self.host.rebind(rid, self, first)
            for ng in kids[1:]:
                ng.fork = (rid, g.length)
        self._begin_step([ng for g in old for ng in children.get(id(g), ())])

    def _drop_finished(self, old: list[Group], new_live: list[int], gen: list[list[int]]) -> bool:
        """A step without resampling where particles finished, every group one particle with its
        request in the batch: the finished particles' groups are dropped (their requests aborted
        after the step), every other group keeps its request and takes its particle's token (what
        the regrouping gives, without new groups or rebinding). False (nothing changed) when that
        does not hold."""
        for g in old:
            if len(g.members) != 1 or g.rid is None or g.stale:
                return False
        alive = set(new_live)
        kept: list[Group] = []
        forced, to_abort = self.forced, self.to_abort
        for g in old:
            i = g.members[0]
            if i in alive:
                forced[g.rid] = gen[i][-1]  # type: ignore[index]
                g.length += 1
                kept.append(g)
            else:
                to_abort.append(g.rid)  # type: ignore[arg-type]
        self._begin_step(kept)
        return True

    def _continue_singletons(self, gen: list[list[int]]) -> bool:
        """The common step without resampling: every particle lived on and every group is one
        particle with its request in the batch, so each group keeps its request and takes its
        particle's token (what the regrouping gives, without new groups). False (nothing
        changed) when that does not hold."""
        groups = self.groups
        for g in groups:
            if len(g.members) != 1 or g.rid is None or g.stale:
                return False
        forced = self.forced
        for g in groups:
            forced[g.rid] = gen[g.members[0]][-1]  # type: ignore[index]
            g.length += 1
        self.have = 0
        self.rounds += 1
        return True

    # ---------------------------------------------------------------- between steps
    def settle(self) -> None:
        """After a step (engine thread, outside the sampler): abort what the step left behind,
        add the requests the next step needs, or end the run."""
        self.guarded("settling", self._between_steps)

    def _between_steps(self) -> None:
        if self.done:
            return
        if self.to_abort:
            rids, self.to_abort = self.to_abort, []
            self._abort(rids)
        for g in self.groups:
            if g.stale and g.rid is not None:
                rid, g.rid = g.rid, None
                self._abort([rid])
        ending = self.ending
        if ending is not None:
            how, exc, controller = ending
            if how == "finish":
                self._finish()
            else:
                assert exc is not None
                self._fail(exc, controller=controller)
            return
        for g in self.groups:
            if g.rid is None and g.row is None:
                self._add(g)

    def _abort(self, rids: list[str]) -> None:
        self.counts["aborted"] += len(rids)
        self.host.abort(rids)

    def _add(self, g: Group) -> None:
        """A request for ``g``'s rows (a fork of ``g.fork`` when set)."""
        info = self.loop.info
        ps = self.particles
        made = ps.tokens(g.members[0])  # every member's: they share the context
        ctx = ps.prompts[g.factor] + made
        room = info.max_model_len - len(ctx)
        if self.budget is not None:
            room = min(room, self.budget - len(made) + 1)
        rid = self.host.add(self, g, ctx, max(1, room))
        g.rid = rid
        self.counts["requests"] += 1
        if g.fork is not None:
            self.counts["forks"] += 1
            self.fork_len[rid] = g.fork[1] % max(1, info.block_size) + 1
        g.fork = None

    def on_prefill(self, rid: str, computed: int) -> None:
        """A fork's first output: it computed ``computed`` prompt tokens."""
        if self.fork_len.pop(rid, None) is not None:
            self.counts["fork_prefill_tokens"] += computed
            self.counts["fork_prefill_max"] = max(self.counts["fork_prefill_max"], computed)

    def request_gone(self, rid: str) -> None:
        """vLLM finished ``rid`` on its own (its ``max_tokens``): its group needs a new one."""
        for g in self.groups:
            if g.rid == rid:
                g.rid = None
                if g.row is None:
                    self.counts["readded"] += 1

    # ---------------------------------------------------------------- endings
    def _finish(self) -> None:
        self._drop_requests()
        if self.done:
            return
        super()._finish()

    def _stats(self, value: Any) -> None:
        super()._stats(value)
        value.stats.update(engine_path="requests", runner=self.loop.info.runner, particle_requests=dict(self.counts))

    def _abandon(self) -> None:
        self._drop_requests()

    def _drop_requests(self) -> None:
        if self.masks is not None:  # masks computed ahead that no step will take: waited for, dropped
            self.masks.discard(self.controller)
        rids = [g.rid for g in self.groups if g.rid is not None] + self.to_abort
        self.to_abort = []
        for g in self.groups:
            g.rid, g.row = None, None
        if rids:
            self._abort(rids)
        self.host.forget(self)
