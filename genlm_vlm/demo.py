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
from typing import TYPE_CHECKING, Any, Protocol

from . import logs
from .cli import add_verbosity_options, verbosity_of

if TYPE_CHECKING:  # numpy and torch are imported where used: `demo --help` stays light
    import numpy as np
    import torch

#: Characters the default constraint allows in generated text.
DEFAULT_ALLOWED_CHARS = "abcdefghijklmnopqrstuvwxyz "
DEFAULT_PROMPT = "the"
#: The demo's ``max_model_len`` unless ``--engine-opt max_model_len=N`` is given.
DEFAULT_MAX_MODEL_LEN = 512

NextLogprobs = Callable[[list[int]], Awaitable["torch.Tensor"]]


def demo_model_path() -> str:
    """Path of the small model shipped in the package, ``genlm_vlm/data/demo-model``.

    A tiny trained language model (Llama architecture, 2 layers, a 1536-token byte-level BPE
    tokenizer with ``<s>``/``</s>``; see ``TRAINING.md`` in that directory) that writes
    English-looking lowercase text. It loads offline, with no download and no Hugging Face hub
    access: ``AsyncVirtualLM.from_name(genlm_vlm.demo_model_path())``. The demo and the ``score``
    command use it when no ``--model`` is given. Also available as ``genlm_vlm.demo_model_path``.
    """
    return str(pathlib.Path(__file__).resolve().parent / "data" / "demo-model")


#: The earlier name of :func:`demo_model_path` (the same function).
default_model_path = demo_model_path


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
            raise ValueError(
                "the allowed character set is empty: give the characters generated text may use, "
                "e.g. 'abc '"
            )
        import torch

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


def compile_regex(pattern: str) -> Any:
    """``regex.compile(pattern)``; an invalid pattern raises ``ValueError`` saying what is wrong."""
    try:
        import regex
    except ImportError as e:  # pragma: no cover - a dependency of transformers
        raise ImportError("regular expressions need the `regex` package (pip install regex)") from e
    try:
        return regex.compile(pattern)
    except regex.error as e:
        raise ValueError(
            f"{pattern!r} is not a valid regular expression ({e}); escape characters meant "
            "literally with a backslash, e.g. \\[ for '['"
        ) from None


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
        self.pattern = pattern
        self._re = compile_regex(pattern)
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
        import torch

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
    import torch

    masked = row.float().masked_fill(~mask, float("-inf"))
    log_mass = float(torch.logsumexp(masked, dim=0))
    if not math.isfinite(log_mass):
        return float("-inf"), None
    return log_mass, masked - log_mass


def normalized_weights(log_weights: Sequence[float]) -> np.ndarray:
    """``exp(log_weights)`` normalised to sum to 1 (all zero if every weight is zero)."""
    import numpy as np

    lw = np.asarray(log_weights, dtype=np.float64)
    top = np.max(lw) if lw.size else -np.inf
    if not np.isfinite(top):
        return np.zeros_like(lw)
    w = np.exp(lw - top)
    return w / w.sum()


def log_mean_exp(log_weights: Sequence[float]) -> float:
    """``log(mean(exp(log_weights)))``, stably."""
    import numpy as np

    lw = np.asarray(log_weights, dtype=np.float64)
    top = np.max(lw)
    if not np.isfinite(top):
        return float("-inf")
    return float(top + np.log(np.mean(np.exp(lw - top))))


def effective_sample_size(log_weights: Sequence[float]) -> float:
    """``1 / sum(w_i^2)`` of the normalised weights (0 when every weight is zero)."""
    w = normalized_weights(log_weights)
    s = float((w * w).sum())
    return 1.0 / s if s > 0 else 0.0


def systematic_resample(weights: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Ancestor indices by systematic resampling of normalised ``weights`` (one uniform draw)."""
    import numpy as np

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

    @property
    def dead(self) -> bool:
        """Ended because no allowed token had probability > 0 (its weight is zero)."""
        return self.finished and self.log_weight == float("-inf")


@dataclass
class SMCResult:
    particles: list[Particle]
    log_evidence: float
    """Estimate of log P(constraint holds for the generated tokens) under the model."""
    steps: int
    resamples: int
    awaits: int
    """Number of ``next_logprobs`` awaits issued."""
    died_at: int | None = None
    """The step at which every particle had died (no allowed token with probability > 0), if so."""


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
    import numpy as np
    import torch

    rng = rng if rng is not None else np.random.default_rng()
    prompt = list(prompt_ids)
    particles = [Particle() for _ in range(n_particles)]
    log_evidence = 0.0
    resamples = awaits = steps = 0
    died_at: int | None = None

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
                died_at = steps
                if bar is not None:
                    bar.set_postfix(ess="0", live=0)
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
    return SMCResult(particles, log_evidence, steps, resamples, awaits, died_at)


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

    opts: dict[str, Any] = {"max_model_len": DEFAULT_MAX_MODEL_LEN}
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
        help="resample when ESS < this x N, between 0 (never) and 1 (default 0.5)",
    )
    p.add_argument(
        "--engine-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm.LLM option (repeatable; values parsed as int/float/bool when possible)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_verbosity_options(p, quiet_help="no progress bar (vLLM shows only its errors either way)")
    return p


class UsageError(ValueError):
    """A command-line option that cannot work; the message names it and the fix."""


def check_args(args: argparse.Namespace, user_opts: dict[str, Any]) -> None:
    """Check the options that can be checked without the model; raises :class:`UsageError`.

    Runs before the engine is built, so a typo costs no model load.
    """
    if args.particles < 1:
        raise UsageError(f"--particles must be >= 1, got {args.particles}")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if not 0.0 <= args.ess_threshold <= 1.0:  # also rejects nan
        raise UsageError(
            f"--ess-threshold must be between 0 (never resample) and 1 (resample whenever the "
            f"weights differ), got {args.ess_threshold}"
        )
    if args.allowed_chars is not None and not args.allowed_chars:
        raise UsageError(
            "--allowed-chars is empty: give the characters generated text may use, e.g. "
            "--allowed-chars 'abc ' (leave the option out for lowercase letters and space)"
        )
    if args.regex is not None:
        try:
            compile_regex(args.regex)
        except ValueError as e:
            raise UsageError(f"--regex: {e}") from None
    max_len = user_opts.get("max_model_len", DEFAULT_MAX_MODEL_LEN)
    # The prompt holds at least one token (BOS), and the engine needs one position past it.
    if isinstance(max_len, int) and args.max_tokens + 2 > max_len:
        raise UsageError(
            f"--max-tokens {args.max_tokens} does not fit in max_model_len={max_len} (prompt + "
            f"generated tokens must stay below it): lower --max-tokens or pass "
            f"--engine-opt max_model_len={args.max_tokens + 64}"
        )


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


#: Printed above the particle table.
PARTICLE_LEGEND = (
    "  (weight: the particles' share of the normalised SMC weight, all rows sum to 1; "
    "xN: particles with this text;\n"
    "   <eos>: ended with EOS; <dead>: no allowed token had probability > 0; "
    "no mark: cut off by --max-tokens)"
)


def format_particles(result: SMCResult, prompt: str) -> list[str]:
    """Distinct particles with their total normalised weight and count, heaviest first.

    A row ends with ``<eos>`` (the particle sampled EOS), ``<dead>`` (no allowed token had
    probability > 0) or nothing (cut off by ``max_tokens``); see :data:`PARTICLE_LEGEND`.
    """
    weights = normalized_weights([p.log_weight for p in result.particles])
    groups: dict[tuple[bytes, str], list[float]] = {}
    for p, w in zip(result.particles, weights, strict=True):
        end = "  <dead>" if p.dead else "  <eos>" if p.finished else ""
        groups.setdefault((p.text, end), []).append(float(w))
    rows = sorted(groups.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    lines = []
    for (text, tail), ws in rows:
        decoded = text.decode("utf-8", errors="replace")
        lines.append(
            f"  {sum(ws):.4f}  x{len(ws):<3d} {json.dumps(prompt)} + {json.dumps(decoded)}{tail}"
        )
    return lines


def summarize(result: SMCResult, max_tokens: int) -> list[str]:
    """What ``log P(constraint)`` estimates, and why it is ``-inf`` or partial when it is."""
    n = len(result.particles)
    if result.died_at is not None or not math.isfinite(result.log_evidence):
        step = f" at step {result.died_at}" if result.died_at is not None else ""
        return [
            f"no particle can satisfy the constraint: all {n} died{step} (each reached a text "
            "after which no allowed token, EOS included, has probability > 0 under the model), "
            "so estimated log P(constraint) = -inf.",
            "  Relax the constraint: allow more characters (--allowed-chars), or let --regex "
            "accept what the model can write from this prompt (and end it, so EOS is allowed).",
        ]
    lines = [
        f"estimated log P(constraint) = {result.log_evidence:.3f}: the log-probability that "
        f"the model's own text obeys the constraint up to EOS or for {max_tokens} tokens",
    ]
    cut = sum(not p.finished for p in result.particles)
    if cut:
        lines.append(
            f"  {cut} of {n} particles were cut off by --max-tokens {max_tokens} before EOS: "
            "their texts are unfinished and the estimate covers only their first "
            f"{max_tokens} tokens (raise --max-tokens for complete texts)."
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


def _error(message: str) -> None:
    print(f"demo: error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m genlm_vlm demo``: 0 on success, 1 when no particle satisfied the constraint
    or the engine failed, 2 for bad options (reported before the model is loaded when the cause
    is in the options alone)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        user_opts = parse_engine_opts(args.engine_opt)
        check_args(args, user_opts)
    except ValueError as e:
        _error(str(e))
        return 2
    model = args.model or demo_model_path()
    if args.model is None and not (pathlib.Path(model) / "config.json").is_file():
        _error(f"the shipped demo model is missing from {model}; run scripts/train_demo_model.py")
        return 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with logs.verbosity(verbosity_of(args)):
        return _run_demo(args, user_opts, model)


def _run_demo(args: argparse.Namespace, user_opts: dict[str, Any], model: str) -> int:
    import numpy as np

    from .vllm_lm import AsyncVirtualLM

    verbose = logs.vllm_log_level() <= logging.INFO
    progress = not (args.no_progress or args.quiet)
    t0 = time.perf_counter()
    # vLLM's weight-loading bar is off unless verbose: engine.build_llm decides (as for the API)
    engine_opts = {**default_engine_opts(), **user_opts}
    try:
        lm = AsyncVirtualLM.from_name(model, engine_opts)
    except Exception as e:
        if verbose:
            raise
        _error(
            f"could not build the engine for {model}: {type(e).__name__}: {e} "
            "(--verbose shows vLLM's log and the traceback)"
        )
        return 1
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
            _error(str(e))
            return 2
        first = constraint.mask(b"")
        if int(first.sum()) - int(bool(first[eos_id])) == 0:
            what = "only EOS" if bool(first[eos_id]) else "no token at all (not even EOS)"
            _error(
                f"the constraint ({constraint.describe()}) allows {what} right after the prompt: "
                "no token of this model's vocabulary satisfies it, so no particle could generate "
                "any text. Allow more characters (--allowed-chars) or loosen --regex."
            )
            return 2
        if len(prompt_ids) + args.max_tokens >= lm.max_model_len:
            _error(
                f"prompt ({len(prompt_ids)} tokens) + --max-tokens {args.max_tokens} must stay "
                f"below max_model_len={lm.max_model_len}: lower --max-tokens or pass "
                f"--engine-opt max_model_len={len(prompt_ids) + args.max_tokens + 64}"
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
        if progress:
            print(
                "(progress bar: ess = effective sample size of the particle weights, "
                f"resampling when < {args.ess_threshold:g} x {args.particles}; "
                "live = particles still generating)",
                file=sys.stderr,
            )

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
                progress=progress,
            )
        )
        t_smc = time.perf_counter() - t1
        stats = lm.stats
    finally:
        lm.cleanup()

    n_distinct = len({(p.text, p.finished) for p in result.particles})
    print(f"\nparticles ({args.particles}, {n_distinct} distinct), heaviest first:")
    print(PARTICLE_LEGEND)
    for line in format_particles(result, args.prompt):
        print(line)
    print(f"\nSMC: {result.steps} steps, {result.resamples} resampling steps")
    for line in summarize(result, args.max_tokens):
        print(line)
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
