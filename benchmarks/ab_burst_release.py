#!/usr/bin/env python
"""A/B: a burst that releases the sessions its particles dropped, against one that keeps them.

One engine (``AsyncVirtualLM.from_name`` on the 6-layer ``llama-2k-mid`` model, the options of
bench_smc_engine), one process; ``lm.smc`` on bench_smc_engine's prompt and constraint, seeds
1..reps, the two variants alternating (order flipped every repetition) after one warm-up each.
"keep" replaces ``Burst._release_dropped`` by a no-op for its runs (what bursts did before it
existed). Prints, per run, ``(wall s, seconds inside vLLM's steps, sessions released, rows)``;
the same seed gives the same rows in both variants.

    .venv/bin/python benchmarks/ab_burst_release.py --n 32 --t 64 --reps 4
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--t", type=int, default=64)
    ap.add_argument("--constraint", choices=["regex", "json"], default="regex")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args(argv)

    from bench_smc_engine import ENGINE_OPTS, MODELS, PROMPT, _constraint

    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.engine import bursts
    from genlm_vlm.testing import tiny_model_path

    lm = AsyncVirtualLM.from_name(str(tiny_model_path(MODELS["6-layer"])), dict(ENGINE_OPTS))
    tok = lm.tokenizer
    prompt = [tok.bos_token_id, *tok.encode(PROMPT, add_special_tokens=False)]
    release = bursts.Burst._release_dropped

    def run(on: bool, seed: int) -> tuple[float, float, int, int]:
        bursts.Burst._release_dropped = release if on else (lambda self: None)
        lm.release_sessions()
        lm.clear_cache()
        step0 = lm.stats["engine_time"]["step_s"]
        t0 = time.perf_counter()
        r = lm.smc_sync(prompt, _constraint(args.constraint), args.n, args.t, seed=seed)
        wall = time.perf_counter() - t0
        return (round(wall, 3), round(lm.stats["engine_time"]["step_s"] - step0, 3),
                r.stats["sessions_released"], r.stats["rows"])

    try:
        run(True, 0)
        run(False, 0)
        out: dict[bool, list] = {True: [], False: []}
        for rep in range(args.reps):
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                out[on].append(run(on, rep + 1))
    finally:
        bursts.Burst._release_dropped = release
        lm.cleanup()
    for on, runs in out.items():
        print(f"{'release' if on else 'keep':8s} total {sum(r[0] for r in runs):.2f} s  {runs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
