"""``python -m genlm_vlm demo``: constrained generation by sequential Monte Carlo (SMC).

``N`` particles grow continuations of a prompt one token at a time. At each step every live
particle awaits :meth:`AsyncVirtualLM.next_token_logprobs` for its context -- all of them at once
with :func:`asyncio.gather`, so the awaits are batched (and identical contexts deduplicated) into
one engine call. Each particle then

* masks the row with a token-level constraint built from ``lm.byte_vocab`` (by default: tokens
  made only of lowercase ASCII letters and spaces, plus EOS),
* samples the next token from the masked, renormalised distribution (the locally optimal
  proposal), and
* adds ``log sum_{allowed t} p(t | context)`` (the probability mass the constraint keeps) to its
  log weight.

When the effective sample size falls below ``N / 2`` the particles are resampled (systematic
resampling). The weighted particles approximate the language model conditioned on the constraint,
and the product of average weights estimates the probability that an unconstrained sample
satisfies it. The demo runs on a tiny model shipped with the package (see
``genlm_vlm/data/demo-model/TRAINING.md``) unless ``--model`` names another.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import math
import os
import pathlib
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

#: Characters the default constraint allows in generated text.
DEFAULT_ALLOWED_CHARS = "abcdefghijklmnopqrstuvwxyz "
DEFAULT_PROMPT = "the"

NextLogprobs = Callable[[list[int]], Awaitable[torch.Tensor]]


def default_model_path() -> str:
    """Directory of the small model shipped with the package (``genlm_vlm/data/demo-model``)."""
    return str(pathlib.Path(__file__).resolve().parent / "data" / "demo-model")


# ------------------------------------------------------------------------------------ constraints
class Constraint(Protocol):
    """Which tokens may follow the text generated so far."""

    def mask(self, generated: bytes) -> torch.Tensor:
        """Bool tensor ``[V]``: True where the token may come next (EOS included when allowed)."""
        ...

    def describe(self) -> str:
        """One line for the demo's header."""
        ...


def _usable_tokens(byte_vocab: Sequence[bytes], special_ids: Sequence[int]) -> list[int]:
    """Token ids with text: not special, not empty (padding columns past the tokenizer)."""
    special = set(special_ids)
    return [i for i, b in enumerate(byte_vocab) if b and i not in special]


class CharSetConstraint:
    """Generated text may only use characters from ``allowed``; EOS is always allowed.

    A token is allowed when its bytes decode (as UTF-8) to characters of ``allowed`` only;
    special tokens other than EOS never are. The mask does not depend on the particle.
    """

    def __init__(
        self,
        allowed: str,
        byte_vocab: Sequence[bytes],
        eos_id: int,
        special_ids: Sequence[int] = (),
    ) -> None:
        if not allowed:
            raise ValueError("the allowed character set is empty")
        self.allowed = allowed
        chars = set(allowed)
        mask = torch.zeros(len(byte_vocab), dtype=torch.bool)
        for i in _usable_tokens(byte_vocab, special_ids):
            try:
                text = byte_vocab[i].decode("utf-8")
            except UnicodeDecodeError:
                continue
            if chars.issuperset(text):
                mask[i] = True
        mask[eos_id] = True
        self._mask = mask
        self.n_allowed = int(mask.sum()) - 1

    def mask(self, generated: bytes) -> torch.Tensor:
        return self._mask

    def describe(self) -> str:
        return f"characters in {self.allowed!r} ({self.n_allowed} tokens) or EOS"


class RegexConstraint:
    """Generated text must be a prefix of a string matching ``pattern`` (whole-string match).

    Uses the ``regex`` package's partial matching: a token is allowed when the text with the
    token appended can still be extended to a full match; EOS is allowed when the text already
    matches. Tokens whose bytes are not valid UTF-8 on their own are never allowed.
    """

    def __init__(
        self,
        pattern: str,
        byte_vocab: Sequence[bytes],
        eos_id: int,
        special_ids: Sequence[int] = (),
    ) -> None:
        try:
            import regex
        except ImportError as e:  # pragma: no cover - a dependency of transformers
            raise ImportError("--regex needs the `regex` package (pip install regex)") from e
        self.pattern = pattern
        self._re = regex.compile(pattern)
        self._eos = eos_id
        self._size = len(byte_vocab)
        self._tokens: list[tuple[int, str]] = []
        for i in _usable_tokens(byte_vocab, special_ids):
            try:
                self._tokens.append((i, byte_vocab[i].decode("utf-8")))
            except UnicodeDecodeError:
                continue
        self._cache: dict[bytes, torch.Tensor] = {}

    def mask(self, generated: bytes) -> torch.Tensor:
        cached = self._cache.get(generated)
        if cached is not None:
            return cached
        text = generated.decode("utf-8", errors="replace")
        mask = torch.zeros(self._size, dtype=torch.bool)
        fullmatch = self._re.fullmatch
        for i, piece in self._tokens:
            if fullmatch(text + piece, partial=True) is not None:
                mask[i] = True
        if fullmatch(text) is not None:
            mask[self._eos] = True
        self._cache[generated] = mask
        return mask

    def describe(self) -> str:
        return f"text matching /{self.pattern}/ (prefix-closed) and EOS once it fully matches"


class AllOf:
    """Intersection of several constraints."""

    def __init__(self, parts: Sequence[Constraint]) -> None:
        self.parts = list(parts)

    def mask(self, generated: bytes) -> torch.Tensor:
        out = self.parts[0].mask(generated)
        for part in self.parts[1:]:
            out = out & part.mask(generated)
        return out

    def describe(self) -> str:
        return " and ".join(p.describe() for p in self.parts)


# ---------------------------------------------------------------------------------- SMC helpers
def constrained_step(row: torch.Tensor, mask: torch.Tensor) -> tuple[float, torch.Tensor | None]:
    """Locally optimal proposal under a token mask.

    Returns ``(log_mass, proposal)``: ``log_mass = logsumexp(row[mask])`` (the incremental log
    weight; ``-inf`` when the constraint keeps no probability) and the proposal's
    log-probabilities ``row - log_mass`` on allowed tokens, ``-inf`` elsewhere (None when the
    mass is zero).
    """
    masked = row.float().masked_fill(~mask, float("-inf"))
    log_mass = float(torch.logsumexp(masked, dim=0))
    if not math.isfinite(log_mass):
        return float("-inf"), None
    return log_mass, masked - log_mass


def normalized_weights(log_weights: Sequence[float]) -> np.ndarray:
    """``exp(log_weights)`` normalised to sum to 1 (all zero if every weight is zero)."""
    lw = np.asarray(log_weights, dtype=np.float64)
    top = np.max(lw) if lw.size else -np.inf
    if not np.isfinite(top):
        return np.zeros_like(lw)
    w = np.exp(lw - top)
    return w / w.sum()


def log_mean_exp(log_weights: Sequence[float]) -> float:
    """``log(mean(exp(log_weights)))``, stably."""
    lw = np.asarray(log_weights, dtype=np.float64)
    top = np.max(lw)
    if not np.isfinite(top):
        return float("-inf")
    return float(top + np.log(np.mean(np.exp(lw - top))))


def effective_sample_size(log_weights: Sequence[float]) -> float:
    """``1 / sum(w_i^2)`` of the normalised weights (0 when every weight is zero)."""
    w = normalized_weights(log_weights)
    s = float(np.sum(w * w))
    return 1.0 / s if s > 0 else 0.0


def systematic_resample(weights: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Ancestor indices by systematic resampling of normalised ``weights`` (one uniform draw)."""
    n = len(weights)
    positions = (rng.random() + np.arange(n)) / n
    cumulative = np.cumsum(weights)
    cumulative[-1] = 1.0  # guard against round-off
    return [int(i) for i in np.searchsorted(cumulative, positions, side="right")]


@dataclass
class Particle:
    """One SMC particle: generated token ids and bytes, log weight, finished flag."""

    token_ids: list[int] = field(default_factory=list)
    text: bytes = b""
    log_weight: float = 0.0
    finished: bool = False  # sampled EOS (or died: weight -inf)


@dataclass
class SMCResult:
    particles: list[Particle]
    log_evidence: float
    """Estimate of log P(constraint holds for the generated tokens) under the model."""
    steps: int
    resamples: int
    awaits: int
    """Number of ``next_logprobs`` awaits issued."""


async def run_smc(
    next_logprobs: NextLogprobs,
    prompt_ids: Sequence[int],
    constraint: Constraint,
    byte_vocab: Sequence[bytes],
    eos_id: int,
    *,
    n_particles: int = 32,
    max_tokens: int = 24,
    ess_threshold: float = 0.5,
    rng: np.random.Generator | None = None,
    progress: bool = False,
) -> SMCResult:
    """Run SMC with the locally optimal proposal; see the module docstring.

    ``next_logprobs(ids)`` returns the normalised next-token log-probabilities after ``ids``
    (prompt + generated tokens); every live particle's call of a step is awaited concurrently.
    """
    if n_particles < 1 or max_tokens < 1:
        raise ValueError("n_particles and max_tokens must be >= 1")
    rng = rng if rng is not None else np.random.default_rng()
    prompt = list(prompt_ids)
    particles = [Particle() for _ in range(n_particles)]
    log_evidence = 0.0
    resamples = awaits = steps = 0

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_tokens, desc="SMC", unit="step", file=sys.stderr)
    try:
        for _ in range(max_tokens):
            live = [p for p in particles if not p.finished]
            if not live:
                break
            steps += 1
            rows = await asyncio.gather(*(next_logprobs(prompt + p.token_ids) for p in live))
            awaits += len(live)
            for p, row in zip(live, rows, strict=True):
                log_mass, proposal = constrained_step(row, constraint.mask(p.text))
                p.log_weight += log_mass
                if proposal is None:
                    p.finished = True
                    continue
                probs = torch.exp(proposal.double()).numpy()
                token = int(rng.choice(len(probs), p=probs / probs.sum()))
                if token == eos_id:
                    p.finished = True
                else:
                    p.token_ids.append(token)
                    p.text += byte_vocab[token]
            log_weights = [p.log_weight for p in particles]
            if not any(math.isfinite(w) for w in log_weights):
                log_evidence = float("-inf")
                break
            ess = effective_sample_size(log_weights)
            if ess < ess_threshold * n_particles:
                log_evidence += log_mean_exp(log_weights)
                ancestors = systematic_resample(normalized_weights(log_weights), rng)
                particles = [copy.deepcopy(particles[a]) for a in ancestors]
                for p in particles:
                    p.log_weight = 0.0
                resamples += 1
            if bar is not None:
                bar.set_postfix(ess=f"{ess:.1f}", live=sum(not p.finished for p in particles))
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if math.isfinite(log_evidence):
        log_evidence += log_mean_exp([p.log_weight for p in particles])
    return SMCResult(particles, log_evidence, steps, resamples, awaits)


# --------------------------------------------------------------------------------------- the CLI
def parse_value(text: str) -> Any:
    """``--engine-opt`` value: bool, None, int, float, JSON list/object, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.strip()[:1] in ("[", "{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def parse_engine_opts(items: Sequence[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--engine-opt expects key=value, got {item!r}")
        opts[key.strip()] = parse_value(value)
    return opts


def default_engine_opts() -> dict[str, Any]:
    """``max_model_len=512``; on the CPU build also a 256 MiB KV cache and float32 weights."""
    from .engine import is_cpu_platform

    opts: dict[str, Any] = {"max_model_len": 512}
    if is_cpu_platform():
        opts.update(kv_cache_memory_bytes=256 << 20, dtype="float32")
    return opts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m genlm_vlm demo",
        description="Constrained generation by sequential Monte Carlo on the shipped demo model (or --model).",
        epilog=(
            "examples:\n"
            "  python -m genlm_vlm demo --particles 64 --prompt 'this function'\n"
            "  python -m genlm_vlm demo --regex '[^e]*'                # a lipogram: no letter e\n"
            "  python -m genlm_vlm demo --allowed-chars 'etaoinshrdlu '  # only these letters\n"
            "  python -m genlm_vlm demo --model Qwen/Qwen2.5-0.5B --engine-opt max_model_len=1024"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="HF model name or local path (default: the shipped demo model)",
    )
    p.add_argument("--particles", type=int, default=32, help="number of particles (default 32)")
    p.add_argument(
        "--max-tokens", type=int, default=24, help="tokens to generate at most (default 24)"
    )
    p.add_argument(
        "--prompt",
        default=DEFAULT_PROMPT,
        help=f"prompt text (default {DEFAULT_PROMPT!r}); BOS is prepended",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--allowed-chars",
        default=None,
        help=f"characters generated text may use (default {DEFAULT_ALLOWED_CHARS!r} unless --regex is given)",
    )
    p.add_argument(
        "--regex",
        default=None,
        help="generated text must (prefix-)match this pattern; EOS only on a full match",
    )
    p.add_argument(
        "--ess-threshold",
        type=float,
        default=0.5,
        help="resample when ESS < this x N (default 0.5)",
    )
    p.add_argument(
        "--engine-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm.LLM option (repeatable; values parsed as int/float/bool when possible)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="show vLLM's log messages")
    return p


def make_constraint(
    args: argparse.Namespace, byte_vocab: Sequence[bytes], eos_id: int, special_ids: Sequence[int]
) -> Constraint:
    parts: list[Constraint] = []
    if args.allowed_chars is not None or args.regex is None:
        chars = DEFAULT_ALLOWED_CHARS if args.allowed_chars is None else args.allowed_chars
        parts.append(CharSetConstraint(chars, byte_vocab, eos_id, special_ids))
    if args.regex is not None:
        parts.append(RegexConstraint(args.regex, byte_vocab, eos_id, special_ids))
    return parts[0] if len(parts) == 1 else AllOf(parts)


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("the tokenizer has no EOS token; the demo needs one to end particles")
    return int(eos)


def _prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    ids = list(tokenizer.encode(prompt, add_special_tokens=False)) if prompt else []
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        ids = [int(bos), *ids]
    if not ids:
        raise ValueError("empty prompt and the tokenizer has no BOS token: give --prompt")
    return ids


def format_particles(result: SMCResult, prompt: str) -> list[str]:
    """Distinct particles with their total normalised weight and count, heaviest first."""
    weights = normalized_weights([p.log_weight for p in result.particles])
    groups: dict[tuple[bytes, bool], list[float]] = {}
    for p, w in zip(result.particles, weights, strict=True):
        groups.setdefault((p.text, p.finished), []).append(float(w))
    rows = sorted(groups.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    lines = []
    for (text, finished), ws in rows:
        decoded = text.decode("utf-8", errors="replace")
        tail = "  <eos>" if finished else ""
        lines.append(
            f"  {sum(ws):.4f}  x{len(ws):<3d} {json.dumps(prompt)} + {json.dumps(decoded)}{tail}"
        )
    return lines


def format_stats(stats: dict[str, Any], awaits: int) -> list[str]:
    lp = stats.get("logprobs", {})
    cache = stats.get("cache", {})
    return [
        f"  awaits (next_token_logprobs calls): {awaits}",
        f"  engine calls:                       {stats.get('engine_calls')}",
        f"  engine requests (prompts run):      {stats.get('engine_requests')}",
        f"  dedup joins (identical in flight):  {lp.get('dedup_joins')}",
        f"  cache hits:                         {lp.get('cache_hits')}",
        f"  max batch:                          {lp.get('max_batch')}",
        f"  batch sizes {{size: calls}}:          {lp.get('batch_sizes')}",
        f"  cached rows:                        {cache.get('entries')} ({(cache.get('nbytes') or 0) / 2**20:.1f} MiB)",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.particles < 1 or args.max_tokens < 1:
        print("--particles and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        user_opts = parse_engine_opts(args.engine_opt)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    model = args.model or default_model_path()
    if args.model is None and not (pathlib.Path(model) / "config.json").is_file():
        print(
            f"the shipped demo model is missing from {model}; run scripts/train_demo_model.py",
            file=sys.stderr,
        )
        return 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    vllm_logger = logging.getLogger("vllm")
    old_level = vllm_logger.level
    if not args.verbose:  # keep the demo's output readable
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        vllm_logger.setLevel(logging.ERROR)
    try:
        return _run_demo(args, user_opts, model)
    finally:
        vllm_logger.setLevel(old_level)


def _run_demo(args: argparse.Namespace, user_opts: dict[str, Any], model: str) -> int:
    from .vllm_lm import AsyncVirtualLM

    t0 = time.perf_counter()
    engine_opts = {**default_engine_opts(), **user_opts}
    lm = AsyncVirtualLM.from_name(model, engine_opts)
    try:
        t_load = time.perf_counter() - t0
        tokenizer = lm.tokenizer
        eos_id = _eos_id(tokenizer)
        byte_vocab = lm.byte_vocab
        special_ids = [int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None]
        try:
            constraint = make_constraint(args, byte_vocab, eos_id, special_ids)
            prompt_ids = _prompt_ids(tokenizer, args.prompt)
        except (ValueError, ImportError) as e:
            print(e, file=sys.stderr)
            return 2
        if len(prompt_ids) + args.max_tokens >= lm.max_model_len:
            print(
                f"prompt ({len(prompt_ids)} tokens) + --max-tokens must stay below max_model_len={lm.max_model_len}",
                file=sys.stderr,
            )
            return 2
        shown = model if args.model else f"{model} (shipped demo model)"
        print(f"model:      {shown}")
        print(f"prompt:     {args.prompt!r} ({len(prompt_ids)} tokens incl. BOS)")
        print(f"constraint: {constraint.describe()}")
        print(
            f"SMC:        {args.particles} particles, up to {args.max_tokens} tokens, resample when ESS < {args.ess_threshold:g} N, seed {args.seed}"
        )
        sys.stdout.flush()

        t1 = time.perf_counter()
        result = asyncio.run(
            run_smc(
                lm.next_token_logprobs,
                prompt_ids,
                constraint,
                byte_vocab,
                eos_id,
                n_particles=args.particles,
                max_tokens=args.max_tokens,
                ess_threshold=args.ess_threshold,
                rng=np.random.default_rng(args.seed),
                progress=not args.no_progress,
            )
        )
        t_smc = time.perf_counter() - t1
        stats = lm.stats
    finally:
        lm.cleanup()

    n_distinct = len({(p.text, p.finished) for p in result.particles})
    print(
        f"\nparticles ({args.particles}, {n_distinct} distinct; weight, count, prompt + generated text), heaviest first:"
    )
    for line in format_particles(result, args.prompt):
        print(line)
    print(
        f"\nSMC: {result.steps} steps, {result.resamples} resampling steps; "
        f"estimated log P(constraint) = {result.log_evidence:.3f}"
    )
    print("engine statistics:")
    for line in format_stats(stats, result.awaits):
        print(line)
    per_step = t_smc / max(result.steps, 1)
    print(
        f"time: engine start {t_load:.1f} s, SMC {t_smc:.2f} s ({per_step * 1000:.0f} ms/step), total {time.perf_counter() - t0:.1f} s (after imports)"
    )
    return 0 if math.isfinite(result.log_evidence) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
