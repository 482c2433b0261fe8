"""bench_async's workloads and systems: the prompts of each cell, the plan of calls, and the
systems that serve them (``ours``, plain vLLM's ``ceiling``/``logprobs``/``decode``, transformers).
See bench_async.py's docstring."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(_HERE.parent))

from benchmarks import harness  # noqa: E402

harness.setup_environment()  # before vLLM is imported

import torch  # noqa: E402

log = logging.getLogger("bench_async")
SMC_WORKLOADS = ("smc", "smc_resample")


# --------------------------------------------------------------------------- prompts
@dataclass
class Workload:
    """One (workload, N) cell: ``rounds[t]`` is the list of prompts of step/round ``t``."""

    name: str
    n: int
    rounds: list[list[list[int]]] = field(default_factory=list)
    shared_prompt: list[int] | None = None  # smc only: the particles' common start

    @property
    def rows(self) -> int:
        return sum(len(r) for r in self.rounds)

    def unique_rounds(self) -> list[list[list[int]]]:
        """Per round, its distinct prompts (first-seen order): what the engine has to compute."""
        out = []
        for prompts in self.rounds:
            seen: dict[tuple[int, ...], None] = {}
            for p in prompts:
                seen.setdefault(tuple(p), None)
            out.append([list(k) for k in seen])
        return out


def _random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    from genlm_vlm.testing import random_prompts

    return random_prompts(n, vocab, min_len=lo, max_len=hi, seed=seed)


def unique_workload(n: int, rounds: int, vocab: int, lo: int, hi: int, seed: int) -> Workload:
    prompts = _random_prompts(n * rounds, vocab, lo, hi, seed=seed * 1_000_003 + n)
    return Workload("unique", n, [prompts[i * n : (i + 1) * n] for i in range(rounds)])


# --------------------------------------------------------------------------- timing helpers
@dataclass
class Measurement:
    """One repetition of one system on one cell."""

    round_times: dict[int, float]  # round index -> seconds inside the system's calls
    rows: float  # rows delivered (rounds x N; prorated for a truncated logprobs round)
    latencies: list[float]  # per row: seconds from request to result
    engine_prompts: int  # prompts the engine actually computed
    computed_tokens: int | None = None  # tokens the engine computed (ours, decode)
    forks: dict[str, int] | None = None  # ours: forks copied / aligned / re-prefilled

    @property
    def seconds(self) -> float:
        return sum(self.round_times.values())

    @property
    def calls(self) -> int:
        return len(self.round_times)


def _reset_prefix_cache(llm: Any, call: Callable[..., Any] | None = None) -> None:
    fn = llm.reset_prefix_cache
    ok = call(fn) if call is not None else fn()
    if ok is False:
        log.warning("vLLM refused to reset its prefix cache")


@dataclass
class PlanItem:
    """One engine call of a baseline: the distinct prompts of round ``index`` (or a prefix)."""

    index: int
    prompts: list[list[int]]
    rows: float  # rows of the workload this call stands for


Plan = list[PlanItem]


def make_plan(cell: Workload, max_rows: float | None = None) -> Plan:
    """What a baseline computes: per round, its distinct prompts (in-round duplicates are
    computed once, as our batcher does), each round one call.

    With ``max_rows`` (the slow logprobs=-1 baseline) only the first rounds are kept, until
    they stand for ``max_rows`` rows; the last round may be cut to a prefix of its distinct
    prompts (its row count is then prorated). SMC's round 0, where all particles share one
    prompt, is skipped then, so a short plan is not dominated by that one-prompt round.
    """
    urounds = cell.unique_rounds()
    plan: Plan = []
    start = 1 if max_rows is not None and cell.name in SMC_WORKLOADS and len(urounds) > 1 else 0
    rows = 0.0
    for i in range(start, len(urounds)):
        u, full = urounds[i], len(cell.rounds[i])
        take = u
        if max_rows is not None:
            need = max_rows - rows
            k = max(1, min(len(u), int(-(-need * len(u) // full))))  # ceil(need * u / full)
            take = u[:k]
        plan.append(PlanItem(i, take, full * len(take) / len(u)))
        rows += plan[-1].rows
        if max_rows is not None and rows >= max_rows:
            break
    return plan


def _run_plan(call: Callable[[list[list[int]]], Any], plan: Plan) -> Measurement:
    times: dict[int, float] = {}
    lats: list[float] = []
    for item in plan:
        t0 = time.perf_counter()
        call(item.prompts)
        dt = time.perf_counter() - t0
        times[item.index] = dt
        lats.extend([dt] * round(item.rows))  # every row of a call waits for the whole call
    return Measurement(times, sum(i.rows for i in plan), lats, sum(len(i.prompts) for i in plan))


# --------------------------------------------------------------------------- ours
async def _timed_await(lm: Any, ids: list[int]) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    row = await lm.next_token_logprobs(ids)
    return row, time.perf_counter() - t0


async def _ours_rounds(lm: Any, rounds: Sequence[Sequence[list[int]]]) -> Measurement:
    times: dict[int, float] = {}
    lats: list[float] = []
    for i, prompts in enumerate(rounds):
        t0 = time.perf_counter()
        res = await asyncio.gather(*(_timed_await(lm, p) for p in prompts))
        times[i] = time.perf_counter() - t0
        lats.extend(lat for _, lat in res)
    return Measurement(times, sum(len(r) for r in rounds), lats, -1)


async def _ours_smc(
    lm: Any, prompt: list[int], n: int, steps: int, seed: int, resample_every: int = 0
) -> tuple[Measurement, list[list[list[int]]]]:
    """Run the SMC loop; returns the measurement and the prompts of every step. With
    ``resample_every`` = K > 0, every K-th step (after the first) first replaces the particles
    by uniformly drawn ancestors."""
    gen = torch.Generator().manual_seed(seed)
    particles = [list(prompt) for _ in range(n)]
    record: list[list[list[int]]] = []
    times: dict[int, float] = {}
    lats: list[float] = []
    for step in range(steps):
        if resample_every and step and step % resample_every == 0:
            ancestors = torch.randint(n, (n,), generator=gen).tolist()
            particles = [list(particles[a]) for a in ancestors]
        record.append([list(p) for p in particles])
        t0 = time.perf_counter()
        res = await asyncio.gather(*(_timed_await(lm, p) for p in particles))
        times[step] = time.perf_counter() - t0
        lats.extend(lat for _, lat in res)
        rows = torch.stack([row for row, _ in res])
        tokens = torch.multinomial(rows.exp(), 1, generator=gen).squeeze(1).tolist()
        for p, tok in zip(particles, tokens, strict=True):
            p.append(int(tok))
    return Measurement(times, n * steps, lats, -1), record


class Ours:
    """``AsyncVirtualLM`` (``name="requests"``: one built with ``sessions=False``)."""

    def __init__(self, lm: Any, loop: asyncio.AbstractEventLoop, reset_prefix: bool, name: str = "ours"):
        self.name = name
        self.lm = lm
        self.loop = loop
        self.reset_prefix = reset_prefix

    def _prepare(self) -> dict[str, Any]:
        self.lm.clear_cache()  # never serve a repetition from the previous one's rows
        if self.reset_prefix:
            self.lm.release_sessions()
            _reset_prefix_cache(self.lm.llm, self.lm._driver.call)
        return self.lm.stats

    def _work(self, m: Measurement, before: dict[str, Any]) -> None:
        """The engine's work in this run: requests, tokens computed, forks."""
        after = self.lm.stats
        m.engine_prompts = after["engine_requests"] - before["engine_requests"]
        t0, t1 = before["tokens"]["scheduled"], after["tokens"]["scheduled"]
        m.computed_tokens = None if t0 is None or t1 is None else t1 - t0
        m.forks = {k: after["forks"][k] - before["forks"][k] for k in ("copied", "aligned", "reprefilled")}

    def run_smc(self, cell: Workload, steps: int, seed: int, resample_every: int = 0) -> tuple[Measurement, list]:
        before = self._prepare()
        m, record = self.loop.run_until_complete(
            _ours_smc(self.lm, cell.shared_prompt, cell.n, steps, seed, resample_every)
        )
        self._work(m, before)
        return m, record

    def run(self, cell: Workload) -> Measurement:
        before = self._prepare()
        m = self.loop.run_until_complete(_ours_rounds(self.lm, cell.rounds))
        self._work(m, before)
        return m


# --------------------------------------------------------------------------- plain vLLM
def build_plain_llm(model: str, engine_opts: dict[str, Any]) -> Any:
    """A ``vllm.LLM`` with genlm_vlm's engine defaults but no capture; ``max_logprobs=-1``.

    ``max_logprobs`` only bounds what requests may ask for (vLLM validates it, nothing else),
    so the same engine serves the ceiling (no logprobs) and the logprobs=-1 baseline.
    """
    from vllm import LLM

    from genlm_vlm.engine import CPU_ENGINE_OPTS, DEFAULT_ENGINE_OPTS, is_cpu_platform

    opts = dict(DEFAULT_ENGINE_OPTS)
    if is_cpu_platform():
        opts.update(CPU_ENGINE_OPTS)
    opts.update(engine_opts)
    opts["max_logprobs"] = -1
    return LLM(model=model, **opts)


def dense_from_logprobs(d: dict[int, Any], vocab: int) -> torch.Tensor:
    """vLLM's ``{token_id: Logprob}`` of one position as a dense float32 ``[vocab]`` row."""
    row = torch.full((vocab,), float("-inf"), dtype=torch.float32)
    ids = torch.tensor(list(d.keys()), dtype=torch.long)
    vals = torch.tensor([lp.logprob for lp in d.values()], dtype=torch.float32)
    row[ids] = vals
    return row


class PlainVLLM:
    """``LLM.generate`` with ``max_tokens=1``: without logprobs (ceiling) or with logprobs=-1."""

    def __init__(self, llm: Any, vocab: int, *, logprobs: bool, reset_prefix: bool):
        from vllm import SamplingParams

        self.name = "logprobs" if logprobs else "ceiling"
        self.llm = llm
        self.vocab = vocab
        self.logprobs = logprobs
        self.reset_prefix = reset_prefix
        kw: dict[str, Any] = {"logprobs": -1} if logprobs else {}
        self.params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, **kw)

    def call(self, prompts: Sequence[list[int]]) -> list[torch.Tensor] | None:
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
            self.params,
            use_tqdm=False,
        )
        if not self.logprobs:
            return None
        return [dense_from_logprobs(o.outputs[0].logprobs[0], self.vocab) for o in outs]

    def run(self, plan: Plan) -> Measurement:
        if self.reset_prefix:
            _reset_prefix_cache(self.llm)
        return _run_plan(self.call, plan)


class PlainDecode:
    """vLLM decoding N x T tokens: ``generate(N prompts, max_tokens=T, ignore_eos=True)``.

    The N prompts are the shared SMC prompt plus one distinct token each (so no two particles
    share decode work); the prompt's full blocks come from the prefix cache as ours do.
    """

    name = "decode"

    def __init__(self, llm: Any, reset_prefix: bool):
        self.llm = llm
        self.reset_prefix = reset_prefix

    def run_cell(self, cell: Workload, steps: int) -> Measurement:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert cell.shared_prompt is not None
        if self.reset_prefix:
            _reset_prefix_cache(self.llm)
        prompts = [TokensPrompt(prompt_token_ids=cell.shared_prompt + [3 + i % 997]) for i in range(cell.n)]
        params = SamplingParams(max_tokens=steps, temperature=1.0, detokenize=False, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        # tokens computed: prompt tokens not found cached, plus each decoded token after the first
        computed = sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) + len(o.outputs[0].token_ids) - 1
                       for o in outs)
        # every step stands for N rows; spread the time evenly so ratios can use any rounds
        return Measurement({i: dt / steps for i in range(steps)}, cell.n * steps, [dt] * cell.n, cell.n, computed)


# --------------------------------------------------------------------------- transformers
class HF:
    """transformers float32 batched forward: left padding, attention mask, last position."""

    name = "hf"

    def __init__(self, model_path: str, pad_id: int, max_batch: int = 256):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True)
        self.model = self.model.to(torch.float32).eval()
        self.pad_id = pad_id
        self.max_batch = max_batch
        self._keep = True  # pass logits_to_keep=1 (only the last position's logits)

    @torch.inference_mode()
    def call(self, prompts: Sequence[list[int]]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for i in range(0, len(prompts), self.max_batch):
            chunk = prompts[i : i + self.max_batch]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, p in enumerate(chunk):
                ids[j, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[j, width - len(p) :] = 1
            pos = (mask.cumsum(-1) - 1).clamp_(min=0)
            kw: dict[str, Any] = {"logits_to_keep": 1} if self._keep else {}
            try:
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **kw).logits
            except TypeError:  # a model without logits_to_keep
                self._keep = False
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            out.extend(torch.log_softmax(logits[:, -1].float(), dim=-1).unbind(0))
        return out

    def run(self, plan: Plan) -> Measurement:
        return _run_plan(self.call, plan)


# --------------------------------------------------------------------------- driver
#: Defaults of the sized options: the full run, and ``--quick`` (a smoke configuration).
#: Options given on the command line win over both.
