"""The ``demo`` command: options, their checks before any model is loaded, and ``main``.

Everything that can be checked without the model (numbers, the regular expression, the
``--engine-opt`` items, the ``--model`` path) is checked before torch or vLLM is imported, so a
typo costs milliseconds. Internal module of :mod:`genlm_vlm.demo` (run it as
``python -m genlm_vlm demo``).
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

from .. import logs
from .._paths import demo_model_path
from ..cli import (
    UsageError,
    add_engine_opt_option,
    add_verbosity_options,
    parse_engine_opts,
    resolve_model_arg,
    verbosity_of,
)
from .constraints import compile_regex, demo_constraint
from .report import PARTICLE_LEGEND, describe_run, format_particles, format_stats, summarize

#: The constraint when neither ``--regex`` nor ``--allowed-chars`` is given: a lipogram (no
#: letter ``e``). On the shipped model it keeps about half of the vocabulary, so particles drift
#: into texts the model would rather continue with an ``e``, the weights spread and SMC
#: resamples; most particles still end with EOS within :data:`DEFAULT_MAX_TOKENS`.
DEFAULT_REGEX = "[^e]*"
DEFAULT_PROMPT = "the"
DEFAULT_PARTICLES = 32
DEFAULT_MAX_TOKENS = 32
#: The demo's ``max_model_len`` unless ``--engine-opt max_model_len=N`` is given.
DEFAULT_MAX_MODEL_LEN = 512


def default_engine_opts() -> dict[str, Any]:
    """``max_model_len=512``; on the CPU build also a 256 MiB KV cache and float32 weights."""
    from ..engine import is_cpu_platform

    opts: dict[str, Any] = {"max_model_len": DEFAULT_MAX_MODEL_LEN}
    if is_cpu_platform():
        opts.update(kv_cache_memory_bytes=256 << 20, dtype="float32")
    return opts


def build_parser() -> argparse.ArgumentParser:
    """The ``demo`` command's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m genlm_vlm demo",
        description=(
            "Constrained generation by sequential Monte Carlo on the shipped demo model (or "
            f"--model). By default the text may not contain the letter e (--regex {DEFAULT_REGEX!r})."
        ),
        epilog=(
            "examples:\n"
            "  python -m genlm_vlm demo --particles 64 --prompt 'this function'\n"
            "  python -m genlm_vlm demo --regex '[a-z ]*'              # lowercase letters and spaces\n"
            "  python -m genlm_vlm demo --allowed-chars 'etaoinshrdlu '  # only these letters\n"
            "  python -m genlm_vlm demo --model Qwen/Qwen2.5-0.5B --engine-opt max_model_len=1024\n"
            "\n"
            "exit status: 0 on success, 1 when no particle can satisfy the constraint or the engine\n"
            "fails, 2 for bad options (checked before the model is loaded)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="HF model name or local path (default: the shipped demo model)",
    )
    p.add_argument(
        "--particles",
        type=int,
        default=DEFAULT_PARTICLES,
        help=f"number of particles (default {DEFAULT_PARTICLES})",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--prompt",
        default=DEFAULT_PROMPT,
        help=f"prompt text (default {DEFAULT_PROMPT!r}); BOS is prepended",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--regex",
        default=None,
        help="generated text must (prefix-)match this pattern; EOS only on a full match "
        f"(default {DEFAULT_REGEX!r}, no letter e, unless --allowed-chars is given)",
    )
    p.add_argument(
        "--allowed-chars",
        default=None,
        help="characters generated text may use (with --regex: both must hold)",
    )
    p.add_argument(
        "--ess-threshold",
        type=float,
        default=0.5,
        help="resample when ESS < this x N, between 0 (never) and 1 (default 0.5)",
    )
    add_engine_opt_option(p)
    p.add_argument("--no-progress", action="store_true",
                   help="accepted for older scripts: the run is one engine burst and shows no progress bar")
    add_verbosity_options(
        p, quiet_help="nothing on stderr but errors (vLLM's included)"
    )
    return p


def check_args(args: argparse.Namespace, user_opts: dict[str, Any]) -> None:
    """Check the options that can be checked without the model; raises
    :class:`~genlm_vlm.cli.UsageError`. Runs before the engine is built, so a typo costs no
    model load."""
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
            "--allowed-chars 'abc ' (leave the option out for the default constraint)"
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
) -> tuple[Any, str]:
    """The constraint the options ask for (``--allowed-chars``, ``--regex`` or both; neither:
    :data:`DEFAULT_REGEX`) and its one-line description."""
    regex = DEFAULT_REGEX if args.regex is None and args.allowed_chars is None else args.regex
    return demo_constraint(args.allowed_chars, regex, byte_vocab, eos_id, special_ids)


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


def _error(message: str) -> None:
    print(f"demo: error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m genlm_vlm demo``: 0 on success, 1 when no particle satisfied the constraint
    or the engine failed, 2 for bad options (reported before torch and vLLM are imported when
    the cause is in the options alone, a missing ``--model`` path included)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    with logs.verbosity(verbosity_of(args)):
        logs.quiet_torch_cpp_log()
        try:
            user_opts = parse_engine_opts(args.engine_opt)
            check_args(args, user_opts)
            model = demo_model_path() if args.model is None else resolve_model_arg(args.model)
        except UsageError as e:
            _error(str(e))
            return 2
        if args.model is None and not (pathlib.Path(model) / "config.json").is_file():
            _error(f"the shipped demo model is missing from {model}; run scripts/train_demo_model.py")
            return 1
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return _run_demo(args, user_opts, model)


def _run_demo(args: argparse.Namespace, user_opts: dict[str, Any], model: str) -> int:
    from ..smc import ConstraintError, EmptyPosteriorWarning
    from ..smc.api import bind
    from ..vllm_lm import AsyncVirtualLM

    verbose = logs.vllm_log_level() <= logging.INFO
    t0 = time.perf_counter()
    # vLLM's weight-loading bar is off unless verbose: engine.build_llm decides (as for the API)
    engine_opts = {**default_engine_opts(), **user_opts}
    try:
        lm = AsyncVirtualLM.from_name(model, engine_opts)
    except Exception as e:
        if verbose:
            raise
        _error(
            f"could not build the engine for {args.model or model}: {type(e).__name__}: {e} "
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
            constraint, described = make_constraint(args, byte_vocab, eos_id, special_ids)
            prompt_ids = _prompt_ids(tokenizer, args.prompt)
            bound = bind(lm, constraint, (eos_id,))
            first = bound.masks([bound.initial()])[0]
        except ConstraintError as e:
            _error(
                f"{e}: no token of this model's vocabulary can start a text the constraint allows, "
                "so no particle could generate any text. Allow more characters (--allowed-chars) or "
                "loosen --regex."
            )
            return 2
        except (ValueError, ImportError) as e:
            _error(str(e))
            return 2
        if int(first.sum()) - int(bool(first[eos_id])) == 0:
            _error(
                f"the constraint ({described}) allows only EOS right after the prompt: "
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
        shown = args.model if args.model else f"{model} (shipped demo model)"
        allowed = int(first.sum()) - int(bool(first[eos_id]))
        print(f"model:      {shown}")
        print(f"prompt:     {args.prompt!r} ({len(prompt_ids)} tokens incl. BOS)")
        print(f"constraint: {described}")
        print(f"            ({allowed} of the {len(byte_vocab)} tokens may come first)")
        print(
            f"SMC:        {args.particles} particles, up to {args.max_tokens} tokens, "
            f"resample when ESS < {args.ess_threshold:g} N, seed {args.seed}"
        )
        print("            (the whole run is one burst on the engine thread: lm.smc, genlm_vlm.smc)")
        sys.stdout.flush()

        t1 = time.perf_counter()
        with warnings.catch_warnings():  # the report below says why a posterior is empty
            warnings.simplefilter("ignore", EmptyPosteriorWarning)
            result = lm.smc_sync(
                prompt_ids, constraint, args.particles, args.max_tokens,
                ess_threshold=args.ess_threshold, seed=args.seed, eos_token_ids=[eos_id],
            )
        t_smc = time.perf_counter() - t1
        stats = lm.stats
    finally:
        lm.cleanup()

    n_distinct = len({(p.text, p.status) for p in result.particles})
    print(f"\nparticles ({args.particles}, {n_distinct} distinct), heaviest first:")
    print(PARTICLE_LEGEND)
    for line in format_particles(result, args.prompt):
        print(line)
    print()
    for line in describe_run(result, args.ess_threshold, args.max_tokens):
        print(line)
    for line in summarize(result, args.max_tokens):
        print(line)
    print("engine statistics:")
    for line in format_stats(stats, result):
        print(line)
    per_step = t_smc / max(result.steps, 1)
    print(
        f"time: engine start {t_load:.1f} s, SMC {t_smc:.2f} s ({per_step * 1000:.0f} ms/step), "
        f"total {time.perf_counter() - t0:.1f} s (after imports)"
    )
    return 1 if result.n_dead == len(result.particles) else 0  # 1: no text can satisfy the constraint


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
