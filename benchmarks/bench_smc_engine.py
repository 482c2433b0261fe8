#!/usr/bin/env python
"""Constrained SMC inside the engine (``lm.smc``) against vLLM and genlm-control.

One process per model; every system runs the same prompt, constraint, N and T:

* ``engine``: ``await lm.smc(prompt, constraint, N, T, seed=s)`` on
  ``AsyncVirtualLM.from_name(path, ENGINE_OPTS)`` with every other option at its default: the
  whole run is a burst on the engine thread.
* ``python``: the same call with ``in_engine=False`` on the same model: the same algorithm per
  token in Python over ``batch_next_token_logprobs`` (the reference; its result is checked to be
  byte-identical to ``engine``'s with the same seed: ``identical``).
* ``control``: genlm-control 0.4.1's SMC over the same model object through its per-token API,
  as its users write it: ``PromptedLLM(lm, prompt_ids=prompt)``, the condition
  ``BoolFSA.from_regex(pattern).coerce(llm, f=b"".join)`` (regex) or
  ``JsonSchema(schema).coerce(llm, f=b"".join)`` (JSON), ``AWRS(llm, condition).smc(N, 0.5, T)``.
* ``decode``: a plain ``vllm.LLM`` with the same engine options (genlm_vlm's defaults, block size
  included, plus ``ENGINE_OPTS``) decoding N sequences (distinct last prompt token, so no two share
  work) for as many tokens as ``engine`` computed rows (``ignore_eos``, no rows returned).
* ``structured``: the same plain ``vllm.LLM`` sampling N sequences of up to T tokens under the
  same constraint with vLLM's own structured outputs (xgrammar; no weights: the biased
  masked-renormalised proposal).

Throughput is particle-steps per second (one token of one sequence), the ratio ``engine/X`` is
engine's throughput over X's in the same run (each system's median over ``--reps``; systems
alternate, the order rotating per repetition, after one warm-up each). Also recorded: for
``engine`` the tokens the engine computed (``stats["tokens"]["scheduled"]``), forks copied, the
controller's and the constraint's seconds per step, rounds; distinct final texts.

Models (random weights, built locally by ``genlm_vlm.testing.tiny_model_path``): ``6-layer``
(``llama-2k-mid``), ``6-layer-32k`` (``llama-2k-32kcols-mid``: the same model with 32,768 logit
columns over its 2,048-token tokenizer, the rest zeroed padding) and ``qwen2-0.5b``
(``qwen2-0.5b-shape``: Qwen2-0.5B's shape, 151,936 columns over a 32k tokenizer).

Constraints: ``regex`` (``[a-z ]+``), ``json`` (a two-field object) and ``steady``
(``[a-z ]{1000}`` with ``ess_threshold=0``: no particle can finish before T and none is resampled,
so every step has N live, distinct particles; genlm-control is not run there). The table shows
the live particles per step, the distinct final texts, and the controller's cost per step: masks
(``mask_ms_per_step``), the rest (``step_ms_per_step``: the proposal on the rows' device and the
bookkeeping), its CPU time per step on the calling thread (``controller_cpu_s``: where it is well
under the wall time, the step waited for a core: the machine was shared) and its share of the run's
wall time.

    .venv/bin/python benchmarks/bench_smc_engine.py --models 6-layer --n 32 128 --t 24 64
    .venv/bin/python benchmarks/bench_smc_engine.py --quick
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
MODELS = {"6-layer": "llama-2k-mid", "6-layer-32k": "llama-2k-32kcols-mid", "qwen2-0.5b": "qwen2-0.5b-shape"}
PROMPT = '"""Return the words of a sentence in lower case.\n\n    Example: the quick brown fox jumps over the lazy dog and'
REGEX = r"[a-z ]+"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
#: No particle can finish within the benchmark's T (tokens here have at most a few dozen bytes).
STEADY = r"[a-z ]{1000}"
SYSTEMS = ("engine", "python", "control", "decode", "structured")
CONSTRAINTS = ("regex", "json", "steady")


def _constraint(kind: str) -> Any:
    from genlm_vlm.smc import JSONSchema, Regex

    return JSONSchema(SCHEMA) if kind == "json" else Regex(STEADY if kind == "steady" else REGEX)


def _ess(kind: str) -> float:
    return 0.0 if kind == "steady" else 0.5


class Bench:
    def __init__(self, path: str, systems: list[str]) -> None:
        self.path = path
        self.systems = systems
        self.loop = asyncio.new_event_loop()
        self.llm = None
        if {"decode", "structured"} & set(systems):
            # Built before genlm-control (which imports genlm-backend) is imported.
            from vllm import LLM

            from genlm_vlm.engine import CPU_ENGINE_OPTS, DEFAULT_ENGINE_OPTS, is_cpu_platform

            raw = dict(DEFAULT_ENGINE_OPTS)
            if is_cpu_platform():
                raw.update(CPU_ENGINE_OPTS)
            raw.update(ENGINE_OPTS)
            self.llm = LLM(model=path, **raw)
        from genlm_vlm import AsyncVirtualLM

        self.lm = AsyncVirtualLM.from_name(path, dict(ENGINE_OPTS))
        tok = self.lm.tokenizer
        self.prompt = [tok.bos_token_id] if tok.bos_token_id is not None else []
        self.prompt += tok.encode(PROMPT, add_special_tokens=False)
        self.engine_rows: dict[tuple, int] = {}

    # ------------------------------------------------------------------ systems
    def run(self, system: str, kind: str, n: int, t: int, seed: int) -> dict[str, Any]:
        return getattr(self, f"_{system}")(kind, n, t, seed)

    def _smc(self, kind: str, n: int, t: int, seed: int, in_engine: bool) -> dict[str, Any]:
        lm = self.lm
        lm.clear_cache()
        lm.release_sessions()
        before = lm.stats
        t0 = time.perf_counter()
        r = self.loop.run_until_complete(lm.smc(self.prompt, _constraint(kind), n, t, seed=seed, in_engine=in_engine,
                                                ess_threshold=_ess(kind)))
        wall = time.perf_counter() - t0
        after = lm.stats
        steps = r.stats["steps"]
        out = {
            "wall_s": wall, "particle_steps": r.stats["rows"], "steps": steps, "resamples": r.stats["resamples"],
            "finished": r.stats["finished"], "distinct_texts": len({p.text for p in r.particles}),
            "log_marginal": r.log_marginal,
            "tokens": (after["tokens"]["scheduled"] or 0) - (before["tokens"]["scheduled"] or 0),
            "forks_copied": after["forks"]["copied"] - before["forks"]["copied"],
            "controller_ms_per_step": 1e3 * r.stats["controller_s"] / max(1, steps),
            "controller_cpu_ms_per_step": 1e3 * r.stats["controller_cpu_s"] / max(1, steps),
            "constraint_ms_per_step": 1e3 * r.stats["constraint_s"] / max(1, steps),
            "mask_ms_per_step": r.stats["mask_ms_per_step"], "step_ms_per_step": r.stats["step_ms_per_step"],
            "controller_share": r.stats["controller_s"] / wall, "live_per_step": r.stats["rows"] / max(1, steps),
            "engine_step_s": after["engine_time"]["step_s"] - before["engine_time"]["step_s"],
            "engine_idle_s": after["engine_time"]["idle_s"] - before["engine_time"]["idle_s"],
            "fingerprint": [(p.token_ids, p.log_weight) for p in r.particles],
        }
        if in_engine:
            self.engine_rows[(kind, n, t)] = r.stats["rows"]
        return out

    def _engine(self, kind: str, n: int, t: int, seed: int) -> dict[str, Any]:
        return self._smc(kind, n, t, seed, True)

    def _python(self, kind: str, n: int, t: int, seed: int) -> dict[str, Any]:
        return self._smc(kind, n, t, seed, False)

    def _control(self, kind: str, n: int, t: int, seed: int) -> dict[str, Any]:
        import numpy as np
        from genlm.control import AWRS, BoolFSA, JsonSchema, PromptedLLM

        lm = self.lm
        lm.clear_cache()
        lm.release_sessions()
        llm = PromptedLLM(lm, prompt_ids=list(self.prompt))
        cond = BoolFSA.from_regex(REGEX) if kind == "regex" else JsonSchema(SCHEMA)
        cond = cond.coerce(llm, f=b"".join)
        np.random.seed(seed)
        rows0 = lm.stats["rows"]
        t0 = time.perf_counter()
        seqs = self.loop.run_until_complete(AWRS(llm, cond, seed=seed).smc(n_particles=n, ess_threshold=0.5, max_tokens=t))
        wall = time.perf_counter() - t0
        steps = sum(len(c) for c in seqs.contexts)
        texts = {b"".join(bytes(x) for x in c if isinstance(x, bytes)) for c in seqs.contexts}
        return {"wall_s": wall, "particle_steps": steps, "distinct_texts": len(texts),
                "engine_rows": lm.stats["rows"] - rows0}

    def _decode(self, kind: str, n: int, t: int, seed: int) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rows = self.engine_rows.get((kind, n, t), n * t)
        per = max(1, round(rows / n))
        prompts = [TokensPrompt(prompt_token_ids=self.prompt + [3 + i % 500]) for i in range(n)]
        params = SamplingParams(max_tokens=per, temperature=1.0, detokenize=False, ignore_eos=True, seed=None)
        self.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "particle_steps": sum(len(o.outputs[0].token_ids) for o in outs)}

    def _structured(self, kind: str, n: int, t: int, seed: int) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams

        so = (StructuredOutputsParams(json=SCHEMA) if kind == "json"
              else StructuredOutputsParams(regex=STEADY if kind == "steady" else REGEX))
        params = [SamplingParams(max_tokens=t, temperature=1.0, detokenize=False, seed=seed * 1000 + i,
                                 structured_outputs=so) for i in range(n)]
        prompts = [TokensPrompt(prompt_token_ids=list(self.prompt)) for _ in range(n)]
        self.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        toks = [tuple(o.outputs[0].token_ids) for o in outs]
        return {"wall_s": wall, "particle_steps": sum(len(x) for x in toks), "distinct_texts": len(set(toks))}

    def close(self) -> None:
        self.lm.cleanup()


def measure(bench: Bench, kind: str, n: int, t: int, reps: int, control_json_max_n: int = 32) -> dict[str, Any]:
    systems = [s for s in SYSTEMS if s in bench.systems]
    if (kind == "json" and n > control_json_max_n) or kind == "steady":
        # genlm-control's JsonSchema: ~100x slower than ours at N = 32; steady: vLLM baselines only
        systems = [s for s in systems if s != "control"]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for s in systems:  # warm-up (engine first: decode matches its rows)
        bench.run(s, kind, n, t, 0)
    for rep in range(reps):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        for s in order:
            runs[s].append(bench.run(s, kind, n, t, rep + 1))
    cell: dict[str, Any] = {"constraint": kind, "n": n, "t": t, "systems": {}}
    for s, rs in runs.items():
        tput = [r["particle_steps"] / r["wall_s"] for r in rs]
        summary = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], int | float)}
        summary["steps_per_s"] = statistics.median(tput)
        summary["walls"] = [round(r["wall_s"], 4) for r in rs]
        cell["systems"][s] = summary
    if "engine" in runs and "python" in runs:
        cell["identical"] = all(a["fingerprint"] == b["fingerprint"] for a, b in zip(runs["engine"], runs["python"], strict=True))
    eng = cell["systems"].get("engine", {}).get("steps_per_s")
    cell["ratios"] = {f"engine/{s}": eng / v["steps_per_s"] for s, v in cell["systems"].items() if s != "engine" and eng}
    return cell


def table(cells: list[dict[str, Any]]) -> str:
    lines = ["| model | constraint | N | T | engine steps/s | engine/decode | engine/structured | engine/control | "
             "engine/python | identical | live/step | distinct | forks copied | ctl ms/step | masks ms/step | "
             "rest ms/step | ctl CPU ms/step | ctl share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        r, e = c["ratios"], c["systems"].get("engine", {})

        def f(x: Any) -> str:
            return "-" if x is None else f"{x:.2f}"
        share = e.get("controller_share")
        lines.append(
            f"| {c['model']} | {c['constraint']} | {c['n']} | {c['t']} | {f(e.get('steps_per_s'))} | {f(r.get('engine/decode'))} | "
            f"{f(r.get('engine/structured'))} | {f(r.get('engine/control'))} | {f(r.get('engine/python'))} | {c.get('identical', '-')} | "
            f"{f(e.get('live_per_step'))} | {e.get('distinct_texts', '-')} | {e.get('forks_copied', '-')} | "
            f"{f(e.get('controller_ms_per_step'))} | {f(e.get('mask_ms_per_step'))} | {f(e.get('step_ms_per_step'))} | "
            f"{f(e.get('controller_cpu_ms_per_step'))} | "
            f"{'-' if share is None else f'{100 * share:.1f} %'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["6-layer", "6-layer-32k", "qwen2-0.5b"], choices=list(MODELS))
    ap.add_argument("--constraints", nargs="+", default=list(CONSTRAINTS), choices=list(CONSTRAINTS))
    ap.add_argument("--n", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--t", type=int, nargs="+", default=[24, 64])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--control-json-max-n", type=int, default=32,
                    help="run genlm-control under the JSON schema only up to this N (it is ~100x slower there)")
    ap.add_argument("--quick", action="store_true", help="6-layer, regex, N=8, T=8, 1 rep, no genlm-control")
    ap.add_argument("--out", default="benchmarks/results/smc_engine.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.constraints, args.n, args.t, args.reps = ["6-layer"], ["regex"], [8], [8], 1
        args.systems = [s for s in args.systems if s != "control"]
    from genlm_vlm.testing import tiny_model_path

    cells = []
    for name in args.models:
        bench = Bench(str(tiny_model_path(MODELS[name])), args.systems)
        try:
            for kind in args.constraints:
                for n in args.n:
                    for t in args.t:
                        cell = measure(bench, kind, n, t, args.reps, args.control_json_max_n)
                        cell["model"] = name
                        cells.append(cell)
                        print(json.dumps({k: v for k, v in cell.items() if k != "systems"}), flush=True)
        finally:
            bench.close()
    print(table(cells))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"argv": sys.argv[1:], "machine": platform.platform(), "cpus": os.cpu_count(),
                   "load_at_start": os.getloadavg(), "engine_opts": ENGINE_OPTS, "cells": cells}, f, indent=1,
                  default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
