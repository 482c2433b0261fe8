"""A small fake :class:`genlm_vlm.engine.EngineCore` for unit tests of the step loop.

It records every request, abort and step; finishes a request ``steps_per_request`` steps after
it was added (``max_per_step`` requests at most per step, oldest first); keeps resumable
requests parked after their chunk, so the next ``add_rows`` with the same id continues them;
and writes a deterministic row for the request's whole token sequence into its sink. Parked sessions hold their slots, as in vLLM: at most ``max_num_seqs`` minus the parked ones
run in a step. Knobs:
``kv`` (what ``kv_usage`` reports), ``stall`` (steps schedule nothing), ``fail_next`` (the next
step raises it), ``gate`` (a semaphore each step acquires: the test releases steps one by one),
``forks`` (whether it takes fork markers: a fork whose parent is alive and holds the shared
tokens reports them as cached, like vLLM's ``prefill_stats``). No vLLM, no sleeps.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from genlm_vlm.engine import ModelInfo, StepResult


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
    prefill_stats: Prefill | None = None


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
    ) -> None:
        self.info = ModelInfo(vocab_size=vocab, max_model_len=max_model_len, runner="fake", max_num_seqs=max_num_seqs,
                              block_size=4, vllm_version="fake")
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
        self.gate = threading.Semaphore(0) if gated else None
        # records (read by tests after the engine thread wrote them; guarded by `changed`)
        self.requests: list[tuple[str, tuple[int, ...], str | None, bool]] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.released = False
        self.changed = threading.Condition()
        self._running: dict[str, _Running] = {}
        self._parked: dict[str, tuple[int, ...]] = {}

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
