"""Command line: ``python -m genlm_vlm {demo,score,info} ...``.

Each subcommand lives in its own module with a ``main(argv) -> int`` function.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

_COMMANDS = {
    "demo": ("genlm_vlm.demo", "SMC constrained generation on the embedded model (or --model)"),
    "score": ("genlm_vlm.scoring", "score a JSONL file: next-token top-k and/or log p(continuation | prompt)"),
}


#: Options every command accepts; before the command name they are passed on to it.
_SHARED_FLAGS = ("--quiet", "--verbose")


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
    import importlib

    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
