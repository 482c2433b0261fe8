"""The benchmark's workloads: what each one runs, on which systems, and how its work is counted.

Pure Python (no torch, no vLLM): the parent process plans cells from here and the system
processes (:mod:`genlm_vlm.bench.systems`) build their inputs from the same functions, so every
system of a cell gets the same prompts.

A *cell* is one workload at one N. Its *lanes* are the systems compared, each a job in one system
process; the first lane is genlm_vlm's, and every ratio is ``genlm_vlm's rate / the lane's rate``
(above 1: genlm_vlm did more of the same work per second).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

#: Workload names, in the order they run (``control`` imports genlm-backend: last).
WORKLOADS = ("rows", "smc", "scoring", "lm-eval", "control")
#: The constraints of the ``smc`` workload (``--constraint``).
#: ``steady``: ``[a-z ]{1000}`` with ``ess_threshold=0``: no particle can finish within T and none is
#: resampled, so every step has N live particles (the decode comparison is then like for like).
CONSTRAINTS = ("regex", "steady", "json", "grammar")
#: ``lm.smc``'s ``engine_path`` in the ``smc`` workload (``--engine-path``; ``auto``: lm.smc's default).
ENGINE_PATHS = ("auto", "bursts", "requests")

SMC_PROMPT = ('"""Return the words of a sentence in lower case.\n\n    Example: the quick brown fox jumps '
              "over the lazy dog and")
#: The second factor's prompt of the ``smc`` workload's product of prompts (``--product``).
PRODUCT_PROMPT = "# A list of common English words, one after another:\nhouse tree river"
REGEX = r"[a-z ]+"
STEADY = r"[a-z ]{1000}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
#: GBNF-style EBNF (xgrammar's dialect, which both genlm_vlm's ``Grammar`` and vLLM read).
#: Waves of N concurrent row requests in one timed run of the ``rows`` workload.
ROWS_ROUNDS = 4
GRAMMAR = 'root ::= word (" " word)*\nword ::= [a-z]+\n'
#: The ``smc`` cell's decode lane whose sequences end where lm.smc's particles stop (not ``steady``).
SAME_STEPS = "vllm decode (same steps)"


@dataclass(frozen=True)
class Lane:
    """One system of a cell: ``job`` with ``kwargs`` in the system process ``process``."""

    label: str
    process: str
    job: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Cell:
    """One workload at one N: its lanes (genlm_vlm's first) and the result key that counts work."""

    workload: str
    n: int
    lanes: tuple[Lane, ...]
    work_key: str
    unit: str


def processes_for(workloads: list[str]) -> list[str]:
    """The system processes the workloads need: ``genlm_vlm``, ``vllm``, ``lm-eval-vllm``."""
    need = ["genlm_vlm"]
    if set(workloads) & {"rows", "smc", "scoring"}:
        need.append("vllm")
    if "lm-eval" in workloads:
        need.append("lm-eval-vllm")
    return need


def plan(workloads: list[str], ns: list[int], max_tokens: int, constraint: str,
         engine_path: str = "auto", mask_overlap: bool = False, product: bool = False) -> list[Cell]:
    """The cells to run, workload by workload (in :data:`WORKLOADS` order), N ascending.
    ``engine_path``: the path ``lm.smc`` takes in the ``smc`` workload (``"requests"`` adds a lane
    on bursts, ``"lm.smc (bursts)"``, so the two are compared in the same run). ``product``: the
    ``smc`` workload runs a product of two prompts (``prompts=``: :data:`SMC_PROMPT` and
    :data:`PRODUCT_PROMPT`); vLLM's lanes then decode ``n`` sequences on each prompt and count
    one particle-step per pair of tokens (one token per factor, as a product's particle-step).
    ``mask_overlap``: add a lane ``"lm.smc (mask overlap)"``, ``lm.smc`` on the same path with
    ``mask_overlap=True`` (its ratio above 1: the overlap made the run slower)."""
    cells = []
    for w in [w for w in WORKLOADS if w in workloads]:
        for n in sorted(ns):
            cells.append(_cell(w, n, max_tokens, constraint, engine_path, mask_overlap, product))
    return cells


def _cell(w: str, n: int, t: int, constraint: str, engine_path: str = "auto", mask_overlap: bool = False,
          product: bool = False) -> Cell:
    if w == "rows":
        kw = {"n": n, "rounds": ROWS_ROUNDS}
        return Cell(w, n, (Lane("genlm_vlm awaits", "genlm_vlm", "rows", kw),
                           Lane("genlm_vlm batch", "genlm_vlm", "rows", {**kw, "batch": True}),
                           Lane("vllm logprobs=-1", "vllm", "rows", kw)), "rows", "rows/s")
    if w == "smc":
        kw: dict[str, Any] = {"n": n, "t": t, "constraint": constraint}
        if product:
            kw["product"] = True
        burst = {**kw, "engine_path": "bursts"}
        bursts = (Lane("lm.smc (bursts)", "genlm_vlm", "smc", burst),) if engine_path == "requests" else ()
        if mask_overlap:
            bursts += (Lane("lm.smc (mask overlap)", "genlm_vlm", "smc",
                            {**kw, "engine_path": engine_path, "mask_overlap": True}),)
        pk = {"product": True} if product else {}
        # Where particles finish, lm.smc's batch narrows step by step over its T steps, while
        # "vllm decode" runs every sequence to the same length (the same tokens in fewer, wider
        # steps); "vllm decode (same steps)" ends its sequences where lm.smc's live count drops.
        same = () if constraint == "steady" else (Lane(SAME_STEPS, "vllm", "decode", {"n": n, **pk}),)
        return Cell(w, n, (Lane("lm.smc", "genlm_vlm", "smc", {**kw, "engine_path": engine_path}), *bursts,
                           Lane("python reference", "genlm_vlm", "smc", {**kw, "in_engine": False}),
                           Lane("vllm decode", "vllm", "decode", {"n": n, **pk}), *same,
                           Lane("vllm structured", "vllm", "structured", kw)), "particle_steps", "particle-steps/s")
    if w == "scoring":
        return Cell(w, n, (Lane("lm.score", "genlm_vlm", "score", {"n": n}),
                           Lane("vllm prompt_logprobs", "vllm", "score", {"n": n})), "tokens", "tokens/s")
    if w == "lm-eval":
        return Cell(w, n, (Lane("genlm_vlm lm-eval", "genlm_vlm", "lmeval", {"n": n}),
                           Lane("lm-eval vllm", "lm-eval-vllm", "lmeval", {"n": n})), "requests", "requests/s")
    if w == "control":
        kw = {"n": n, "t": t, "constraint": "regex"}
        return Cell(w, n, (Lane("lm.smc", "genlm_vlm", "smc", kw),
                           Lane("genlm-control", "genlm_vlm", "control", kw)), "particle_steps", "particle-steps/s")
    raise ValueError(f"unknown workload {w!r}")  # pragma: no cover - checked by the command


# ------------------------------------------------------------------------------ inputs
def same_step_lengths(rows_per_step: list[int], n: int) -> list[int]:
    """``n`` sequence lengths whose decode has ``rows_per_step[t]`` sequences running at step
    ``t`` once sorted (the same tokens, the same number of steps and the same batch widths as an
    SMC run with those live counts): sequence ``i`` runs for as many steps as had more than ``i``
    live particles (at least one token each)."""
    return [max(1, sum(1 for m in rows_per_step if m > i)) for i in range(n)]


def rows_prompts(n: int, vocab: int, rep: int, min_len: int = 24, max_len: int = 48) -> list[list[int]]:
    """``n`` distinct random prompts of token ids in ``[3, vocab)`` for repetition ``rep`` (each
    repetition its own prompts, so no cache serves a later one)."""
    rng = random.Random(1_000_003 * rep + n)
    out, seen = [], set()
    while len(out) < n:
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
        if tuple(p) not in seen:
            seen.add(tuple(p))
            out.append(p)
    return out


def rows_waves(n: int, rounds: int, vocab: int, rep: int) -> list[list[list[int]]]:
    """``rounds`` waves of ``n`` prompts (all distinct) for repetition ``rep``: a wave is sent
    once the previous one has been answered."""
    ps = rows_prompts(n * rounds, vocab, rep)
    return [ps[i * n : (i + 1) * n] for i in range(rounds)]


def score_records(n: int, vocab: int, rep: int) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt, continuation) pairs: 64-token prompts, 32-token continuations."""
    ps = rows_prompts(n, vocab, rep, 96, 96)
    return [(p[:64], p[64:]) for p in ps]


def corpus() -> str:
    """Text to cut lm-eval contexts and endings from (standard library source)."""
    import inspect
    import json.decoder
    import string
    import textwrap

    return "\n".join(inspect.getsource(m) for m in (json.decoder, string, textwrap))


def mc_requests(n: int, rep: int) -> list[tuple[str, str]]:
    """``n`` multiple-choice questions as lm-eval ``loglikelihood`` pairs: a ~240-character
    context and four ~40-character endings each (``4 n`` requests; under 300 tokens even with a
    small vocabulary, so a ``max_model_len`` of 512 holds them)."""
    text = corpus()
    rng = random.Random(7919 * rep + n)
    out = []
    for _ in range(n):
        i = rng.randrange(len(text) - 300)
        ctx = text[i : i + 240].rstrip()
        for _ in range(4):
            j = rng.randrange(len(text) - 100)
            out.append((ctx, " " + text[j : j + 40].strip()))
    return out
