#!/usr/bin/env python
"""lm-evaluation-harness requests: genlm_vlm's lm-eval model against lm-eval's own ``vllm`` backend.

Workloads (text from the Python standard library's sources, fixed seeds):

* ``mc``: multiple choice, ``--contexts`` contexts (250) of about 200 tokens, 4 endings of about
  20 tokens each: 1,000 ``loglikelihood`` requests, as lm-eval builds them for a task like
  hellaswag (``(context, " " + ending)``);
* ``ppl``: ``loglikelihood_rolling`` over ``--docs`` documents (16) of about 2,500 tokens, more
  than ``max_model_len`` (1024), so each is scored in several of lm-eval's rolling windows.

Systems, in one process, on the same model and engine options (genlm_vlm's defaults for the CPU
build applied to both: ``block_size=32``, ``enforce_eager``, prefix caching on):

* ``ours``: ``genlm_vlm.evaluation.GenlmVLMEval(AsyncVirtualLM.from_name(path, ENGINE_OPTS))``;
* ``vllm``: lm-eval 0.4.13's ``VLLM`` (``--model vllm``) built with the same options
  (``batch_size=auto``: every request in one ``generate`` call, lm-eval's default for that
  backend; it asks for ``prompt_logprobs=1`` per request, which makes vLLM skip its prefix cache).

Each timed run calls the backend's ``loglikelihood`` / ``loglikelihood_rolling`` on the whole
workload (lm-eval's own harness work around those calls, the same for both, is not timed). Both
engines' prefix caches are emptied before every run; one warm-up repetition on a tenth of the
workload, then ``--reps`` alternating runs (ours first, then vllm first, ...); medians of the
wall seconds and of the process's CPU seconds (``time.process_time``: both engines run in this
process, so it is the work each system did, less sensitive than wall time to other work on the
machine). ``check``: the largest difference of a request's log-likelihood (``mc``) and whether
``is_greedy`` agrees everywhere; for ``ppl`` the documents' log-likelihoods differ a little by
design: lm-eval's vllm backend uses windows of ``max_length - 2`` tokens, ours (and lm-eval's
``hf`` backend) ``max_length``.

Example::

    .venv/bin/python benchmarks/bench_lm_eval.py --model llama-2k-mid --reps 3
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import random
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

#: Both engines get these (and genlm_vlm's CPU defaults). The test models declare 512 positions;
#: both engines are told 1024 (RoPE with random weights: positions past 512 are as valid).
ENGINE_OPTS: dict[str, Any] = {
    "dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 1536 << 20, "seed": 0,
    "hf_overrides": {"max_position_embeddings": 1024},
}


def _corpus() -> str:
    import collections
    import email.message
    import json.decoder
    import logging as logging_mod
    import string
    import textwrap

    return "\n".join(inspect.getsource(m) for m in (collections, json.decoder, string, textwrap,
                                                     email.message, logging_mod))


def _cut(tok: Any, text: str, start: int, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of ``text`` from character ``start``."""
    ids = tok.encode(text[start : start + 12 * n_tokens], add_special_tokens=False)[:n_tokens]
    return tok.decode(ids)


def workloads(tok: Any, contexts: int, docs: int, seed: int = 0) -> dict[str, list[Any]]:
    from lm_eval.api.instance import Instance

    text = _corpus()
    rng = random.Random(seed)
    mc = []
    for c in range(contexts):
        ctx = _cut(tok, text, rng.randrange(len(text) - 5000), 200).rstrip()
        for e in range(4):
            ending = _cut(tok, text, rng.randrange(len(text) - 500), 20).strip()
            mc.append(Instance("loglikelihood", {}, (ctx, " " + ending), 4 * c + e))
    ppl = [Instance("loglikelihood_rolling", {}, (_cut(tok, text, rng.randrange(len(text) - 40_000), 2500),), d)
           for d in range(docs)]
    return {"mc": mc, "ppl": ppl}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-2k-mid", help="a genlm_vlm.testing kind or a model directory")
    ap.add_argument("--contexts", type=int, default=250)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--workloads", nargs="+", default=["mc", "ppl"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/bench_lm_eval.json")
    args = ap.parse_args(argv)

    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.engine import CPU_ENGINE_OPTS, DEFAULT_ENGINE_OPTS, is_cpu_platform
    from genlm_vlm.evaluation import GenlmVLMEval
    from genlm_vlm.evaluation.baseline import lm_eval_vllm_class
    from genlm_vlm.testing import tiny_model_path

    path = args.model if os.path.isdir(args.model) else str(tiny_model_path(args.model))
    lm = AsyncVirtualLM.from_name(path, dict(ENGINE_OPTS))
    ours = GenlmVLMEval(lm)
    raw = dict(DEFAULT_ENGINE_OPTS)
    if is_cpu_platform():
        raw.update(CPU_ENGINE_OPTS)
    raw.update(ENGINE_OPTS)
    max_model_len = raw.pop("max_model_len")
    theirs = lm_eval_vllm_class()(pretrained=path, max_model_len=max_model_len, batch_size="auto", **raw)
    cells = workloads(lm.tokenizer, args.contexts, args.docs)

    def fresh() -> None:
        lm.clear_cache()
        lm.llm.reset_prefix_cache()
        theirs.model.reset_prefix_cache()

    def call(model: Any, name: str, reqs: list[Any]) -> list[Any]:
        fn = model.loglikelihood if name == "mc" else model.loglikelihood_rolling
        return fn(reqs, disable_tqdm=True)

    results = []
    for name in args.workloads:
        reqs = cells[name]
        systems = {"ours": ours, "vllm": theirs}
        times: dict[str, list[float]] = {s: [] for s in systems}
        cpu: dict[str, list[float]] = {s: [] for s in systems}
        outs: dict[str, list[Any]] = {}
        order = list(systems.items())
        work: dict[str, int] = {}
        for rep in range(args.reps + 1):
            batch = reqs[: max(1, len(reqs) // 10)] if rep == 0 else reqs
            for system, model in order[rep % 2 :] + order[: rep % 2]:
                fresh()
                before = lm.stats
                t0, c0 = time.perf_counter(), time.process_time()
                out = call(model, name, batch)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if rep:
                    times[system].append(dt)
                    cpu[system].append(dc)
                    outs[system] = out
                    if system == "ours":
                        after = lm.stats
                        work = {k: after["scoring"][k] - before["scoring"][k]
                                for k in ("jobs", "requests", "tokens_computed", "tokens_cached")}
                print(json.dumps({"workload": name, "rep": rep, "system": system, "s": round(dt, 3),
                                  "cpu_s": round(dc, 3)}), flush=True)
        tokens = 0
        if name == "mc":
            for r in reqs:
                c, x = ours._encode_pair(*r.args)
                tokens += len(c) + len(x)
        else:
            tokens = sum(len(ours.tok_encode(r.args[0])) for r in reqs)
        cell: dict[str, Any] = {"workload": name, "requests": len(reqs), "tokens": tokens,
                                **{f"ours_{k}": v for k, v in work.items()}}
        for system, ts in times.items():
            cell[system] = statistics.median(ts)
            cell[f"{system}_all"] = [round(t, 3) for t in ts]
            cell[f"{system}_cpu"] = statistics.median(cpu[system])
            cell[f"{system}_cpu_all"] = [round(t, 3) for t in cpu[system]]
        cell["ours/vllm"] = cell["vllm"] / cell["ours"]
        cell["ours/vllm_cpu"] = cell["vllm_cpu"] / cell["ours_cpu"]
        if name == "mc":
            cell["check"] = max(abs(a[0] - b[0]) for a, b in zip(outs["ours"], outs["vllm"], strict=True))
            cell["greedy_agree"] = all(a[1] == b[1] for a, b in zip(outs["ours"], outs["vllm"], strict=True))
        else:
            cell["check"] = max(abs(a - b) / abs(b) for a, b in zip(outs["ours"], outs["vllm"], strict=True))
        results.append(cell)
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in cell.items()}), flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cells": results, "model": args.model, "engine_opts": ENGINE_OPTS,
                               "vocab": lm.vocab_size}, indent=1))
    print()
    print(f"{'workload':<10}{'requests':>9}{'tokens':>9}{'vllm s':>9}{'ours s':>9}{'ours/vllm':>11}"
          f"{'vllm cpu':>10}{'ours cpu':>10}{'cpu ratio':>11}{'check':>10}")
    for c in results:
        print(f"{c['workload']:<10}{c['requests']:>9}{c['tokens']:>9}{c['vllm']:9.2f}{c['ours']:9.2f}"
              f"{c['ours/vllm']:10.2f}x{c['vllm_cpu']:10.2f}{c['ours_cpu']:10.2f}{c['ours/vllm_cpu']:10.2f}x"
              f"{c['check']:10.1e}")
    lm.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
