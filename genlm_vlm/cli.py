"""Command line: ``python -m genlm_vlm {demo,score,eval,bench} ...``, and what the commands share.

Each command lives in its own package with a ``main(argv) -> int`` function:
``demo`` in :mod:`genlm_vlm.demo.cli`, ``score`` in :mod:`genlm_vlm.scoring.cli`, ``eval`` in
:mod:`genlm_vlm.evaluation.cli`, ``bench`` in :mod:`genlm_vlm.bench.cli`. What they have
in common is here: ``--quiet`` / ``--verbose``, the ``--engine-opt KEY=VALUE`` parser, and the
check of ``--model`` that runs before torch or vLLM is imported (so a wrong path costs
milliseconds, not an engine start).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from typing import Any

_COMMANDS = {
    "demo": ("genlm_vlm.demo.cli", "SMC constrained generation on the embedded model (or --model)"),
    "score": (
        "genlm_vlm.scoring.cli",
        "score a JSONL file: next-token top-k and/or log p(continuation | prompt)",
    ),
    "eval": (
        "genlm_vlm.evaluation.cli",
        "lm-evaluation-harness tasks on genlm_vlm (lm-eval's arguments; the `eval` extra)",
    ),
    "bench": ("genlm_vlm.bench.cli", "benchmark genlm_vlm against vLLM on a model (ratio table, JSON, plot)"),
}


#: Options every command accepts; before the command name they are passed on to it.
_SHARED_FLAGS = ("--quiet", "--verbose")


class UsageError(ValueError):
    """A command-line option that cannot work; the message names it and the fix (exit status 2)."""


# ------------------------------------------------------------------------------ --quiet / --verbose
def add_verbosity_options(p: argparse.ArgumentParser, quiet_help: str) -> None:
    """``--quiet`` / ``--verbose`` (every ``python -m genlm_vlm`` command has both).

    ``--verbose`` shows vLLM's full log (see :mod:`genlm_vlm.logs`); ``--quiet`` is described by
    ``quiet_help`` (what the command leaves out beyond vLLM's log).
    """
    group = p.add_mutually_exclusive_group()
    group.add_argument("--quiet", action="store_true", help=quiet_help)
    group.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's full log (on stderr; by default only its errors; "
        "GENLM_VLM_VERBOSE=1 does the same)",
    )


def verbosity_of(args: argparse.Namespace) -> bool | None:
    """``set_verbosity`` argument for ``--quiet`` / ``--verbose`` (None: neither given)."""
    if getattr(args, "verbose", False):
        return True
    if getattr(args, "quiet", False):
        return False
    return None


# ------------------------------------------------------------------------------ --engine-opt
#: The help text of ``--engine-opt``, the same in every command.
ENGINE_OPT_HELP = (
    "vllm.LLM option, repeatable. VALUE is read as JSON when it parses (512, 0.5, true, null, "
    '[1, 2], {"k": 1}); True/False/None in any case are accepted too; anything else is a string '
    "(dtype=float32)"
)

_WORDS = {"true": True, "false": False, "none": None, "null": None}


def parse_engine_value(text: str) -> Any:
    """The value of ``--engine-opt KEY=VALUE`` (see :data:`ENGINE_OPT_HELP`): JSON when ``text``
    parses as JSON, ``True``/``False``/``None`` for those words in any case, else ``text``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    word = text.strip().lower()
    return _WORDS[word] if word in _WORDS else text


def parse_engine_opts(items: Sequence[str]) -> dict[str, Any]:
    """``--engine-opt`` items (``KEY=VALUE``) as a dict; a later KEY wins. Raises
    :class:`UsageError` for an item without ``=`` or with an empty KEY."""
    opts: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(
                f"--engine-opt expects key=value, got {item!r} (e.g. --engine-opt max_model_len=1024)"
            )
        opts[key.strip()] = parse_engine_value(value)
    check_engine_opt_names(opts)
    return opts


def check_engine_opt_names(opts: dict[str, Any]) -> None:
    """Raise :class:`UsageError` naming each ``--engine-opt`` key that ``vllm.LLM`` does not take
    and the nearest one it does, before vLLM is imported (the accepted names are read from the
    installed vLLM's source: :func:`genlm_vlm.engine.options.vllm_option_names_from_source`).
    Nothing is checked when they cannot be read; the engine build checks again."""
    from .engine.options import check_option_names_early  # standard library only

    try:
        check_option_names_early(opts)
    except TypeError as e:
        raise UsageError(f"--engine-opt: {e}") from None


def add_engine_opt_option(p: argparse.ArgumentParser) -> None:
    """``--engine-opt KEY=VALUE`` (repeatable; parse the collected list with
    :func:`parse_engine_opts`)."""
    p.add_argument(
        "--engine-opt", action="append", default=[], metavar="KEY=VALUE", help=ENGINE_OPT_HELP
    )


# ------------------------------------------------------------------------------ --model
def resolve_model_arg(name: str) -> str:
    """Check ``--model`` before torch and vLLM are imported; return what to build the engine from.

    ``genlm_vlm.engine.hub.resolve_model``: a local folder is returned as is, a path that does
    not exist fails at once, a hub id is looked up in the local Hugging Face cache when the hub
    does not answer. Raises :class:`UsageError` with that function's message.
    """
    from .engine.hub import resolve_model  # standard library and huggingface_hub only

    try:
        return str(resolve_model(name))
    except FileNotFoundError as e:
        raise UsageError(f"--model: {e}") from None


# ------------------------------------------------------------------------------ dispatch
def _usage() -> str:
    lines = ["usage: python -m genlm_vlm COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8}{help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += [
        "",
        "every command takes --quiet and --verbose (also before COMMAND). vLLM's own log shows only",
        "its errors, on stderr; --verbose (or GENLM_VLM_VERBOSE=1) shows all of it.",
        "",
        "`python -m genlm_vlm COMMAND --help` for a command's options.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m genlm_vlm COMMAND ...``: runs the command's ``main`` and returns its status."""
    args = list(sys.argv[1:] if argv is None else argv)
    shared: list[str] = []  # --quiet / --verbose given before the command
    while args and args[0] in _SHARED_FLAGS:
        shared.append(args.pop(0))
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], [*args[1:], *shared]
    if name not in _COMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
