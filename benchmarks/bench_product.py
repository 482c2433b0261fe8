#!/usr/bin/env python
"""A product of two prompts, ``p(x | p1) p(x | p2)`` on a regular language, three ways.

One process, one ``AsyncVirtualLM`` (``ENGINE_OPTS``, genlm_vlm's defaults otherwise); every
system runs the same program: two ``PromptedLLM``s over that model object (prompts ``PROMPTS``,
the tokenizer's EOS), the condition ``[a-z ]+``, N particles, ``max_tokens`` T (EOS included,
forced at the limit), ESS threshold 0.5:

* ``control``: genlm-control 0.4.1 itself, per token over our model:
  ``AWRS(llm1 * llm2, BoolFSA.from_regex(REGEX).coerce(llm1, f=b"".join)).smc(N, 0.5, T)``;
* ``bridge``: the same sampler through ``await genlm_vlm.control.smc(sampler, N, 0.5, T)``, which
  runs it as ``lm.smc(None, ..., prompts=[p1, p2], force_eos=True)``: one burst on the engine
  thread, genlm-control's ``Sequences`` back;
* ``native``: ``await lm.smc(None, Regex(REGEX), N, T, prompts=[p1, p2], force_eos=True,
  eos_token_ids=[eos])``, the same target written directly.

Systems alternate (the order rotating per repetition) after one warm-up each; each system's wall
time is the median over ``--reps``. Reported: the medians, particle-steps per second (one token of
one particle; a product step computes two rows per particle), the median ``log Z-hat`` of each
system (the three estimate the same ``Z``) and the ratios ``control/bridge`` and
``control/native`` (wall time: how many times faster than genlm-control) and ``bridge/native``.

    .venv/bin/python benchmarks/bench_product.py                        # N = 32, T = 24, llama-2k-mid, 5 reps
    .venv/bin/python benchmarks/bench_product.py --model demo --reps 3  # the shipped demo model
    .venv/bin/python benchmarks/bench_product.py --quick                # smoke configuration
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

ENGINE_OPTS: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "block_size": 32,
                               "kv_cache_memory_bytes": 1536 << 20, "seed": 0}
QUICK_KV = 256 << 20
PROMPTS = ("Here is a sentence in lower case:", "A short note about the weather, in plain words:")
REGEX = r"[a-z ]+"
SYSTEMS = ("control", "bridge", "native")


def model_path(name: str) -> str:
    """``demo``: the shipped demo model; a directory: itself; else a ``genlm_vlm.testing`` tiny model."""
    if name == "demo":
        from genlm_vlm import demo_model_path

        return demo_model_path()
    if os.path.isdir(name):
        return name
    from genlm_vlm.testing import tiny_model_path

    return str(tiny_model_path(name))


class Bench:
    def __init__(self, path: str, opts: dict[str, Any]) -> None:
        from genlm_vlm import AsyncVirtualLM

        self.loop = asyncio.new_event_loop()
        self.lm = AsyncVirtualLM.from_name(path, dict(opts))
        tok = self.lm.tokenizer
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        self.prompts = [bos + tok.encode(p, add_special_tokens=False) for p in PROMPTS]
        from genlm.control import BoolFSA, PromptedLLM  # after the engine: it imports genlm-backend

        self.llms = [PromptedLLM(self.lm, prompt_ids=list(p)) for p in self.prompts]
        self.eos = list(self.llms[0].token_maps.eos_idxs)
        self.fsa = BoolFSA.from_regex(REGEX)
        self.cond = self.fsa.coerce(self.llms[0], f=b"".join)

    def run(self, system: str, n: int, t: int, seed: int) -> dict[str, Any]:
        import numpy as np
        from genlm.control import AWRS

        lm = self.lm
        lm.clear_cache()
        lm.release_sessions()
        rows0 = lm.stats["rows"]
        t0 = time.perf_counter()
        if system == "native":
            from genlm_vlm.smc import Regex

            r = self.loop.run_until_complete(lm.smc(None, Regex(REGEX), n, t, prompts=self.prompts, seed=seed,
                                                    ess_threshold=0.5, force_eos=True, eos_token_ids=self.eos))
            wall = time.perf_counter() - t0
            steps, log_z = r.stats["rows"], r.log_marginal
            texts = {p.text for p in r.particles}
        else:
            sampler = AWRS(self.llms[0] * self.llms[1], self.cond, seed=seed)
            if system == "bridge":
                from genlm_vlm import control

                seqs = self.loop.run_until_complete(control.smc(sampler, n, 0.5, t, seed=seed))
            else:
                np.random.seed(seed)
                seqs = self.loop.run_until_complete(sampler.smc(n_particles=n, ess_threshold=0.5, max_tokens=t))
            wall = time.perf_counter() - t0
            steps, log_z = sum(len(c) for c in seqs.contexts), float(seqs.log_ml)
            texts = {b"".join(bytes(x) for x in c if isinstance(x, bytes)) for c in seqs.contexts}
        return {"wall_s": wall, "particle_steps": steps, "log_z": log_z, "distinct_texts": len(texts),
                "engine_rows": lm.stats["rows"] - rows0}

    def close(self) -> None:
        self.lm.cleanup()


def measure(bench: Bench, n: int, t: int, reps: int, systems: list[str]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for s in systems:  # warm-up
        bench.run(s, n, t, 0)
    for rep in range(reps):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        for s in order:
            runs[s].append(bench.run(s, n, t, rep + 1))
    cell: dict[str, Any] = {"n": n, "t": t, "systems": {}}
    for s, rs in runs.items():
        cell["systems"][s] = {
            "median_wall_s": statistics.median(r["wall_s"] for r in rs),
            "steps_per_s": statistics.median(r["particle_steps"] / r["wall_s"] for r in rs),
            "median_log_z": statistics.median(r["log_z"] for r in rs),
            "median_distinct_texts": statistics.median(r["distinct_texts"] for r in rs),
            "runs": rs,
        }
    wall = {s: v["median_wall_s"] for s, v in cell["systems"].items()}
    cell["ratios"] = {f"{a}/{b}": wall[a] / wall[b] for a, b in
                      (("control", "bridge"), ("control", "native"), ("bridge", "native")) if a in wall and b in wall}
    return cell


def table(cells: list[dict[str, Any]]) -> str:
    lines = ["| model | N | T | system | median wall s | particle-steps/s | median log Z-hat | distinct texts |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        for s, v in c["systems"].items():
            lines.append(f"| {c['model']} | {c['n']} | {c['t']} | {s} | {v['median_wall_s']:.3f} | "
                         f"{v['steps_per_s']:.1f} | {v['median_log_z']:.2f} | {v['median_distinct_texts']:g} |")
    lines.append("")
    for c in cells:
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in c["ratios"].items())
        lines.append(f"{c['model']} N={c['n']} T={c['t']}: {ratios} (wall-time ratios)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-2k-mid", help="a genlm_vlm.testing tiny model, 'demo', or a directory")
    ap.add_argument("--n", type=int, nargs="+", default=[32])
    ap.add_argument("--t", type=int, nargs="+", default=[24])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--quick", action="store_true", help="N=4, T=4, 1 rep, a 256 MiB KV cache (smoke)")
    ap.add_argument("--out", default="benchmarks/results/bench_product.json")
    args = ap.parse_args(argv)
    opts = dict(ENGINE_OPTS)
    if args.quick:
        args.n, args.t, args.reps = [4], [4], 1
        opts["kv_cache_memory_bytes"] = QUICK_KV
    t_start = time.perf_counter()
    bench = Bench(model_path(args.model), opts)
    cells = []
    try:
        for n in args.n:
            for t in args.t:
                cell = measure(bench, n, t, args.reps, list(args.systems))
                cell["model"] = args.model
                cells.append(cell)
                print(json.dumps({"n": n, "t": t, "ratios": cell["ratios"]}), flush=True)
    finally:
        bench.close()
    text = table(cells)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"argv": sys.argv[1:], "quick": args.quick, "model": args.model, "prompts": PROMPTS, "regex": REGEX,
           "systems": list(args.systems), "reps": args.reps, "machine": platform.platform(), "cpus": os.cpu_count(),
           "load_at_start": os.getloadavg(), "engine_opts": opts, "cells": cells, "table": text,
           "wall_s": time.perf_counter() - t_start}
    out.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
