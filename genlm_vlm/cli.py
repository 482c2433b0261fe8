"""Command line: ``python -m genlm_vlm {demo,score,info} ...``.

Each subcommand lives in its own module with a ``main(argv) -> int`` function.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

_COMMANDS = {
    "demo": ("genlm_vlm.demo", "SMC constrained generation on the embedded model (or --model)"),
    "score": ("genlm_vlm.scoring", "score a JSONL file: next-token top-k and/or log p(continuation | prompt)"),
}


def _usage() -> str:
    lines = ["usage: python -m genlm_vlm COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8}{help_}" for name, (_, help_) in _COMMANDS.items()]
    lines.append("\n`python -m genlm_vlm COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in _COMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
