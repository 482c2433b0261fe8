"""The ``eval`` command: lm-eval's command line with genlm_vlm's model registered.

``python -m genlm_vlm eval ARGS`` runs ``lm-eval run ARGS`` (lm-eval 0.4.13's command line, every
argument as lm-eval documents it) after registering the model ``genlm_vlm``; ``--model``
defaults to ``genlm_vlm``. ``--quiet`` / ``--verbose`` set vLLM's log as in the other commands.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

USAGE = """usage: python -m genlm_vlm eval [--model genlm_vlm] --model_args pretrained=NAME_OR_PATH[,KEY=VALUE...]
                                --tasks TASK[,TASK...] [any lm-eval run argument]

Runs lm-evaluation-harness (lm-eval 0.4.13, the `eval` extra) with genlm_vlm's model registered
as `genlm_vlm`. Every argument is lm-eval's own (`lm-eval run --help`). model_args for genlm_vlm:
pretrained, max_length, add_bos_token, prefix_token_id, max_gen_toks, truncation,
lora_local_path, max_lora_rank, sessions, forks, cache_size, chunk_size, and any vllm.LLM option
(dtype=float32, max_model_len=2048, block_size=32, ...).
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run lm-eval's ``run`` command on ``argv`` with the ``genlm_vlm`` model registered."""
    args = list(sys.argv[1:] if argv is None else argv)
    verbose = None
    for flag, value in (("--quiet", False), ("--verbose", True)):
        while flag in args:
            args.remove(flag)
            verbose = value
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    try:
        from . import register

        register()
    except ImportError as e:
        print(f"the eval command needs lm-eval: pip install -e '.[eval]' ({e})", file=sys.stderr)
        return 2
    from ..logs import set_verbosity

    if verbose is not None:
        set_verbosity(verbose)
    elif not os.environ.get("GENLM_VLM_VERBOSE"):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if not any(a == "--model" or a.startswith("--model=") for a in args):
        args = ["--model", "genlm_vlm", *args]
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    saved = sys.argv
    sys.argv = ["lm-eval", "run", *args]
    try:
        setup_logging()
        parser = HarnessCLI()
        parsed = parser.parse_args()
        parser.execute(parsed)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
