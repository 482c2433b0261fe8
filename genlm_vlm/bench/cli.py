"""``python -m genlm_vlm bench``: genlm_vlm against vLLM (and lm-eval's and genlm-control's
paths, where installed) on your model and machine. See docs/BENCHMARKS.md, "Benchmark on your
own model". Options are checked before torch or vLLM is imported (exit status 2 with the fix);
a failed check of the work done exits 1."""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

from .. import logs
from ..cli import (
    ENGINE_OPT_HELP,
    UsageError,
    add_verbosity_options,
    parse_engine_opts,
    resolve_model_arg,
    verbosity_of,
)
from .workloads import CONSTRAINTS, ENGINE_PATHS, WORKLOADS

#: ``--model-shape``: random-weight models of known shapes, built locally (no download) by
#: ``genlm_vlm.testing.tiny_model_path`` into ``$GENLM_VLM_CACHE`` (default ~/.cache/genlm_vlm).
SHAPES = {
    "qwen3-0.6b": "qwen3-0.6b-shape",  # Qwen3-0.6B's layers and 151,936 logit columns
    "qwen2-0.5b": "qwen2-0.5b-shape",  # Qwen2-0.5B's layers and 151,936 logit columns
    "6-layer-32k": "llama-32k-mid",  # 6 layers, hidden 512, a 32k tokenizer (the docs' "mid")
    "6-layer-32kcols": "llama-2k-32kcols-mid",  # the same with a 2k tokenizer, 32k columns
    "6-layer": "llama-2k-mid",  # 6 layers, hidden 512, 2,048 columns
}
DEFAULT_N = [16, 64]
DEFAULT_MAX_TOKENS = 32
DEFAULT_REPS = 5
QUICK = {"n": [4], "max_tokens": 8, "reps": 1}
OPTIONAL = {"lm-eval": ("lm_eval", "lm-eval (pip install 'genlm-vlm[eval]')"),
            "control": ("genlm.control", "genlm-control (pip install genlm-control)")}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m genlm_vlm bench",
        description="Benchmark genlm_vlm against vLLM on a model: every system in its own process "
        "with the same engine options, repetitions alternating, medians, the work checked. Prints "
        "the machine, the versions and a ratio table; writes bench.json, table.md and a plot.")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", help="a model folder or a hub name (default: the shipped demo model)")
    model.add_argument("--model-shape", choices=list(SHAPES),
                       help="a random-weight model of this shape, built locally on first use (no download)")
    p.add_argument("--workloads", nargs="+", default=["smc", "rows"], metavar="NAME",
                   help=f"any of {', '.join(WORKLOADS)} (default: smc rows)")
    p.add_argument("--n", nargs="+", type=int, help=f"concurrent rows, particles, records or questions "
                   f"(default {' '.join(map(str, DEFAULT_N))})")
    p.add_argument("--max-tokens", type=int, help=f"SMC steps T (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--reps", type=int, help=f"timed repetitions per system (default {DEFAULT_REPS})")
    p.add_argument("--constraint", choices=CONSTRAINTS, default="regex", help="the smc workload's constraint")
    p.add_argument("--engine-path", choices=ENGINE_PATHS, default="auto",
                   help="lm.smc's engine_path in the smc workload (default auto, lm.smc's own default; "
                        "requests: the bursts path runs beside it as 'lm.smc (bursts)')")
    p.add_argument("--product", action="store_true",
                   help="the smc workload runs a product of two prompts (lm.smc's prompts=); vLLM's lanes "
                        "decode N sequences on each prompt")
    p.add_argument("--mask-overlap", action="store_true",
                   help="add a lane 'lm.smc (mask overlap)': lm.smc with mask_overlap=True on the same engine "
                        "path (experimental; takes effect on the requests path)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="the engines' dtype")
    p.add_argument("--engine-opts", nargs="+", default=[], metavar="KEY=VALUE", help=ENGINE_OPT_HELP)
    p.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE", help=argparse.SUPPRESS)
    p.add_argument("--out", help="results folder (default bench-results/<UTC time>); must be new or empty")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument("--quick", action="store_true", help=f"a smoke run: N {QUICK['n'][0]}, "
                   f"T {QUICK['max_tokens']}, {QUICK['reps']} repetition (explicit options win)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_verbosity_options(p, "print only the table")
    return p


def check(args: argparse.Namespace) -> dict[str, Any]:
    """The run's configuration from ``args``; raises :class:`UsageError` naming the bad option
    and its fix. Imports neither torch nor vLLM."""
    quick = QUICK if args.quick else {}
    ns = args.n or quick.get("n") or DEFAULT_N
    max_tokens = args.max_tokens or quick.get("max_tokens") or DEFAULT_MAX_TOKENS
    reps = args.reps if args.reps is not None else quick.get("reps", DEFAULT_REPS)
    if any(n < 1 for n in ns):
        raise UsageError(f"--n takes positive integers, got {' '.join(map(str, ns))} (e.g. --n 16 64)")
    if max_tokens < 1 or (args.max_tokens is not None and args.max_tokens < 1):
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if reps < 1:
        raise UsageError(f"--reps must be >= 1, got {reps} (one warm-up runs before the timed repetitions)")
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        raise UsageError(f"--workloads: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(WORKLOADS)}")
    workloads, skipped = [], []
    for w in dict.fromkeys(args.workloads):
        module, what = OPTIONAL.get(w, (None, ""))
        if module is not None and importlib.util.find_spec(module.split(".")[0]) is None or (
                module == "genlm.control" and _missing("genlm.control")):
            skipped.append(f"bench: skipping the {w} workload: {what} is not installed")
        else:
            workloads.append(w)
    if not workloads:
        raise UsageError("nothing to run: " + "; ".join(s.removeprefix("bench: ") for s in skipped))
    opts = parse_engine_opts([*args.engine_opts, *args.engine_opt])
    if args.dtype:
        opts["dtype"] = args.dtype
    if args.model_shape:
        model = None
    else:
        model = resolve_model_arg(args.model) if args.model else None
    out = pathlib.Path(args.out) if args.out else pathlib.Path("bench-results") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        what = "a file" if not out.is_dir() else "a folder that is not empty"
        raise UsageError(f"--out {out} is {what}: give a new folder, or add --overwrite to write into it")
    return {"model": model, "shape": args.model_shape, "workloads": workloads, "skipped": skipped, "ns": sorted(set(ns)),
            "max_tokens": max_tokens, "reps": reps, "engine_opts": opts, "out": out}


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def engine_options(model: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Every system's engine options: the user's, plus a seed, a ``max_model_len`` of at most
    2,048 and an explicit KV-cache size where the user set none (1 GiB on the CPU build; on a GPU
    0.25 of its memory per engine, since each system's engine lives in its own process)."""
    from ..engine import is_cpu_platform

    out = {"seed": 0, **opts}
    cfg = pathlib.Path(model) / "config.json"
    if "max_model_len" not in out and cfg.is_file():
        positions = json.loads(cfg.read_text()).get("max_position_embeddings")
        if isinstance(positions, int):
            out["max_model_len"] = min(positions, 2048)
    if "kv_cache_memory_bytes" not in out and "gpu_memory_utilization" not in out:
        if is_cpu_platform():
            out["kv_cache_memory_bytes"] = 1 << 30
        else:
            out["gpu_memory_utilization"] = 0.25
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when every check of the work passed, 1 when one failed or a system
    failed, 2 for bad options (checked before torch and vLLM are imported)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = check(args)
    except UsageError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    for line in cfg["skipped"]:
        print(line, file=sys.stderr)
    with logs.verbosity(verbosity_of(args)):
        return _run(args, cfg)


def _run(args: argparse.Namespace, cfg: dict[str, Any]) -> int:
    from .. import __version__
    from .._paths import demo_model_path
    from . import harness, report, runner

    harness.setup_environment()
    if cfg["shape"]:
        from ..testing import tiny_model_path

        print(f"bench: building (or finding) the {cfg['shape']} model ...", file=sys.stderr)
        model = str(tiny_model_path(SHAPES[cfg["shape"]]))
    else:
        model = cfg["model"] or demo_model_path()
    opts = engine_options(model, cfg["engine_opts"])
    conf = runner.Config(model=model, workloads=cfg["workloads"], ns=cfg["ns"], max_tokens=cfg["max_tokens"],
                         reps=cfg["reps"], constraint=args.constraint, engine_opts=opts, out=cfg["out"],
                         engine_path=args.engine_path, mask_overlap=args.mask_overlap, product=args.product)
    cfg["out"].mkdir(parents=True, exist_ok=True)
    try:
        result = runner.run(conf, progress=not (args.no_progress or args.quiet),
                            log=lambda s: print(s, file=sys.stderr))
    except harness.SystemFailed as e:
        print(f"bench: a system failed (logs under {cfg['out'] / 'logs'}):\n{e}", file=sys.stderr)
        return 1
    result.update(model=model, engine_opts=opts, genlm_vlm=__version__, argv=sys.argv[1:],
                  config={"workloads": cfg["workloads"], "n": cfg["ns"], "max_tokens": cfg["max_tokens"],
                          "reps": cfg["reps"], "constraint": args.constraint, "engine_path": args.engine_path,
                          "mask_overlap": args.mask_overlap, "product": args.product,
                          "skipped": cfg["skipped"]})
    files = report.write(result, cfg["out"])
    if not args.quiet:
        print(report.header(result))
        print()
    print(report.table(result))
    if not args.quiet:
        print(f"\nwrote {files['json']}, {files['table']}, {files['plot']}")
    if not result["ok"]:
        print("bench: some checks of the work failed (above and in bench.json 'problems')", file=sys.stderr)
        return 1
    return 0
