"""A small fake :class:`genlm_vlm.engine.EngineCore` for unit tests of the step loop.

It records every request, abort and step; finishes a request ``steps_per_request`` steps after
it was added (``max_per_step`` requests at most per step, oldest first); keeps resumable
requests parked after their chunk, so the next ``add_rows`` with the same id continues them;
and writes a deterministic row for the request's whole token sequence into its sink. Parked sessions hold their slots, as in vLLM: at most ``max_num_seqs`` minus the parked ones
run in a step. Knobs:
``kv`` (what ``kv_usage`` reports), ``stall`` (steps schedule nothing), ``fail_next`` (the next
step raises it), ``refuse_reset`` (``reset_prefix_cache`` fails; counted in ``resets`` and
``reset_refusals``), ``gate`` (a semaphore each step acquires: the test releases steps one by one),
``forks`` (whether it takes fork markers: a fork whose parent is alive and holds the shared
tokens reports them as cached, like vLLM's ``prefill_stats``). No vLLM, no sleeps.

Scoring requests (``scoring()``, :mod:`genlm_vlm.engine.scoring`) behave as vLLM's: a request
reads the longest cached run of whole blocks of its tokens, capped at its length minus one (the
cache holds every full block of the requests scheduled before it, in the same step too); its
prompt log-probability rows before that hit are NaN (vLLM leaves them unwritten), the others
``fake_row(tokens[:j + 1])[tokens[j + 1]]`` and the top ``k``; ``logprobs=k`` gives the top ``k``
after all its tokens; a tag gets the row for all its tokens. Knobs: ``scoring=False`` (no
scoring path), ``hit_override`` (tokens -> the hit to report and use), ``refuse_token`` (adding
a scoring request holding it raises ``ValueError``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import torch

from genlm_vlm.engine import ModelInfo, StepResult
from genlm_vlm.engine.prompt_logprobs import ScoringFacts


def fake_row(tokens: tuple[int, ...], vocab: int) -> torch.Tensor:
    """The row the fake engine computes for ``tokens``: a normalised float32 [vocab] tensor."""
    g = torch.Generator().manual_seed(hash(tokens) & 0xFFFFFFFF)
    return torch.log_softmax(torch.randn(vocab, generator=g), dim=-1)


class FakeSink:
    def __init__(self) -> None:
        self.rows: dict[str, torch.Tensor] = {}
        self.apply_calls = 0

    def pop(self, tag: str) -> torch.Tensor | None:
        return self.rows.pop(tag, None)

    def discard(self, tags: list[str]) -> None:
        for t in tags:
            self.rows.pop(t, None)


@dataclass
class Prefill:
    num_cached_tokens: int
    num_local_cached_tokens: int


@dataclass
class Output:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    prefill_stats: Any = None
    new_prompt_logprobs_tensors: Any = None
    new_logprobs: Any = None


class FakeLogprobs(NamedTuple):
    """vLLM's ``LogprobsTensors`` / ``LogprobsLists`` layout: column 0 the token, then the top k."""

    logprob_token_ids: Any
    logprobs: Any


@dataclass
class _Running:
    rid: str
    tokens: tuple[int, ...]
    tag: str | None
    resumable: bool
    steps_left: int
    sample: int = 0  # tokens still to sample (sample requests)
    out: list[int] = field(default_factory=list)
    cached: int | None = None  # tokens found cached (new requests only)
    fork: tuple[str, int] | None = None  # checked when the request first runs
    score: dict[str, Any] | None = None  # a scoring request's flags


class FakeCore:
    def __init__(
        self,
        vocab: int = 64,
        max_num_seqs: int = 8,
        max_model_len: int = 128,
        steps_per_request: int = 1,
        max_per_step: int | None = None,
        sessions: bool = True,
        gated: bool = False,
        forks: bool = False,
        scoring: bool = True,
        block_size: int = 4,
        max_logprobs: int = 5,
        token_budget: int = 64,
    ) -> None:
        self.info = ModelInfo(vocab_size=vocab, max_model_len=max_model_len, runner="fake", max_num_seqs=max_num_seqs,
                              block_size=block_size, vllm_version="fake")
        self.sink = FakeSink()
        self.llm = None
        self.log_stats = False
        self.reports_tokens = False
        self.sessions = (sessions, "fake sessions" if sessions else "fake: no sessions")
        self.split_lora = False
        self.forks = (forks, "fake forks" if forks else "fake: no forks")
        self.forked: list[tuple[str, tuple[str, int]]] = []  # (rid, fork marker) of each fork sent
        self.steps_per_request = steps_per_request
        self.row_fn = fake_row  # (tokens, vocab) -> the row for that sequence
        self.max_per_step = max_per_step
        self.kv = 0.0
        self.stall = False
        self.fail_next: BaseException | None = None
        self.refuse_reset = False
        self.resets = self.reset_refusals = 0
        self.gate = threading.Semaphore(0) if gated else None
        # records (read by tests after the engine thread wrote them; guarded by `changed`)
        self.requests: list[tuple[str, tuple[int, ...], str | None, bool]] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.released = False
        self.changed = threading.Condition()
        self._running: dict[str, _Running] = {}
        self._parked: dict[str, tuple[int, ...]] = {}
        # scoring
        self.score_facts = ScoringFacts(True, "fake scoring", block_size=block_size, prefix_caching=True,
                                        max_logprobs=max_logprobs, token_budget=token_budget,
                                        max_num_seqs=max_num_seqs)
        self._scoring = scoring
        self.cached: set[tuple[Any, tuple[int, ...]]] = set()  # (adapter, block-aligned prefix)
        self.hit_override: Any = None
        self.refuse_token: int | None = None
        self.score_requests: list[tuple[str, tuple[int, ...], dict[str, Any]]] = []
        self.score_computed = 0  # tokens the scoring requests computed (past their hits)
        self.score_running_max = 0

    # -- helpers for tests
    def wait_for(self, predicate: Any, timeout: float = 10.0) -> None:
        with self.changed:
            if not self.changed.wait_for(predicate, timeout):
                raise AssertionError("the fake engine never reached the expected state")

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    @property
    def parked(self) -> set[str]:
        return set(self._parked)

    # -- EngineCore
    def add_rows(self, rid: str, tokens: list[int], tag: str, lora: Any, resumable: bool,
                 fork: tuple[str, int] | None = None) -> None:
        if rid in self._running:
            raise ValueError(f"request {rid} is already running")
        if fork is not None and not self.forks[0]:
            raise TypeError("this fake core takes no fork markers")
        new = rid not in self._parked
        full = self._parked.pop(rid, ()) + tuple(tokens)
        self.requests.append((rid, tuple(tokens), tag, resumable))
        if fork is not None:
            self.forked.append((rid, fork))
        self._running[rid] = _Running(rid, full, tag, resumable, self.steps_per_request,
                                      cached=0 if new else None, fork=fork)
        self._notify()

    # -- scoring (the object scoring() returns is the core itself)
    def scoring(self) -> Any:
        return self if self._scoring else None

    @property
    def facts(self) -> ScoringFacts:
        return self.score_facts

    def add(self, rid: str, tokens: list[int], lora: Any, *, prompt_logprobs: int | None, logprobs: int | None,
            tag: str | None, read_cache: bool = True) -> None:
        if self.refuse_token is not None and self.refuse_token in tokens:
            raise ValueError(f"token {self.refuse_token} refused")
        flags = {"prompt_logprobs": prompt_logprobs, "logprobs": logprobs, "read_cache": read_cache,
                 "adapter": None if lora is None else lora.lora_int_id}
        self.score_requests.append((rid, tuple(tokens), flags))
        self._running[rid] = _Running(rid, tuple(tokens), tag, False, self.steps_per_request, score=flags)
        running = sum(1 for r in self._running.values() if r.score is not None)
        self.score_running_max = max(self.score_running_max, running)
        self._notify()

    def _hit(self, r: _Running) -> int:
        toks, bs = r.tokens, self.score_facts.block_size
        if not r.score["read_cache"]:
            return 0
        if self.hit_override is not None:
            return int(self.hit_override(toks))
        hit = 0
        for end in range(bs, len(toks), bs):  # at most len - 1, whole blocks
            if (r.score["adapter"], toks[:end]) not in self.cached:
                break
            hit = end
        return hit

    def _score_output(self, r: _Running) -> Output:
        toks, vocab, flags = r.tokens, self.info.vocab_size, r.score
        hit = flags["hit"]
        out = Output(r.rid, [0], "length", prefill_stats=SimpleNamespace(num_cached_tokens=hit))
        k = flags["prompt_logprobs"]
        if k is not None:
            ids = torch.zeros(len(toks) - 1, k + 1, dtype=torch.int32)
            lps = torch.full((len(toks) - 1, k + 1), float("nan"))
            for j in range(hit, len(toks) - 1):
                row = fake_row(toks[: j + 1], vocab)
                top = torch.topk(row, k)
                ids[j, 0], lps[j, 0] = toks[j + 1], row[toks[j + 1]]
                ids[j, 1:], lps[j, 1:] = top.indices.to(torch.int32), top.values
            out.new_prompt_logprobs_tensors = FakeLogprobs(ids, lps)
        k = flags["logprobs"]
        if k is not None:
            row = fake_row(toks, vocab)
            top = torch.topk(row, k)
            ids = np.array([[int(top.indices[0]), *top.indices.tolist()]], dtype=np.int32)
            lps = np.array([[float(top.values[0]), *top.values.tolist()]], dtype=np.float32)
            out.new_logprobs = FakeLogprobs(ids, lps)
        return out

    def add_sample(self, rid: str, tokens: list[int], max_tokens: int, temperature: float, eos: tuple[int, ...],
                   lora: Any) -> None:
        self.requests.append((rid, tuple(tokens), None, False))
        self._running[rid] = _Running(rid, tuple(tokens), None, False, 1, sample=max_tokens)

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self._running.pop(rid, None)
            self._parked.pop(rid, None)
        self.aborted.extend(rids)
        self._notify()

    def step(self) -> StepResult:
        if self.gate is not None:
            self.gate.acquire()
        try:
            if self.fail_next is not None:
                err, self.fail_next = self.fail_next, None
                raise err
            if self.stall or not self._running:
                return StepResult([], False)
            outputs: list[Any] = []
            # like vLLM: parked sessions hold their slots (they count toward max_num_seqs)
            slots = max(0, self.info.max_num_seqs - len(self._parked))
            if self.max_per_step is not None:
                slots = min(slots, self.max_per_step)
            batch = list(self._running.values())[:slots]
            if not batch:
                return StepResult([], False)
            for r in batch:
                if r.score is not None:
                    if "hit" not in r.score:  # first scheduled: look up the cache, then cache its blocks
                        hit = r.score["hit"] = self._hit(r)
                        self.score_computed += len(r.tokens) - hit
                        bs = self.score_facts.block_size
                        for end in range(bs, len(r.tokens) + 1, bs):
                            self.cached.add((r.score["adapter"], r.tokens[:end]))
                    if r.tag is not None:
                        self.sink.rows[r.tag] = self.row_fn(r.tokens, self.info.vocab_size)
                    r.steps_left -= 1
                    if r.steps_left > 0:
                        outputs.append(Output(r.rid, [], None))
                        continue
                    outputs.append(self._score_output(r))
                    del self._running[r.rid]
                    continue
                if r.fork is not None:  # like vLLM's scheduler: the parent must be there now
                    parent, shared = r.fork
                    r.fork = None
                    held = self._parked.get(parent)
                    if held is None and parent in self._running:
                        held = self._running[parent].tokens
                    if held is not None and held[:shared] == r.tokens[:shared]:
                        r.cached = shared
                if r.sample:
                    tok = (sum(r.tokens) + len(r.out)) % self.info.vocab_size
                    r.out.append(tok)
                    done = len(r.out) >= r.sample
                    outputs.append(Output(r.rid, [tok], "length" if done else None))
                    if done:
                        del self._running[r.rid]
                    continue
                r.steps_left -= 1
                if r.tag is not None:
                    self.sink.rows[r.tag] = self.row_fn(r.tokens, self.info.vocab_size)
                if r.steps_left > 0:
                    outputs.append(Output(r.rid, [], None))
                    continue
                stats = None if r.cached is None else Prefill(r.cached, r.cached)
                outputs.append(Output(r.rid, [0], "length", stats))
                del self._running[r.rid]
                if r.resumable:
                    self._parked[r.rid] = r.tokens
            self.sink.apply_calls += 1
            return StepResult(outputs, True)
        finally:
            self.steps += 1
            self._notify()

    def kv_usage(self) -> float:
        return self.kv

    def reset_prefix_cache(self) -> bool:
        """Like vLLM's: only when no request holds blocks (running or parked); ``refuse_reset``
        makes it refuse all the same."""
        if self.refuse_reset or self._running or self._parked:
            self.reset_refusals += 1
            return False
        self.cached.clear()
        self.resets += 1
        return True

    def add_lora(self, lora: Any) -> None:
        pass

    def remove_lora(self, int_id: int) -> None:
        pass

    def tokenizer(self) -> Any:
        return None

    def release(self) -> None:
        self.released = True
        if self.gate is not None:
            self.gate.release(1000)
