#!/usr/bin/env python
"""Where genlm-control's AWRS trips its own ``AssertionError``, and whether the rows' backend matters.

genlm-control 0.4.1's ``recursive_awrs`` (``genlm/control/sampler/token.py``) walks a row's tokens
in a Gumbel-perturbed order, rejecting tokens the condition refuses, and keeps
``rejected_mass = sum(exp(lp))`` (float64 over the row's float32 log-probabilities, which AWRS
itself renormalises in float32: ``logps = lw - logsumexp(lw)``). It asserts
``log_q = lp - log1p(-rejected_mass) <= 1e-5`` for the next token: the token's probability
given that the rejected ones were not drawn may not exceed 1 by more than a relative 1e-5. A
float32 row's probabilities sum to 1 only within about 1e-7 to 1e-6, so once the rejections have
removed all but a few percent of the mass the remaining mass ``1 - rejected_mass`` is off by that
absolute amount, a relative error past 1e-5, and the assertion fails (``log_q`` slightly above
0) -- whatever backend made the row.

This script runs ``AWRS(llm, condition, seed=seed).smc(N, 0.5, T)`` (the program of
``bench_e2e.py``) over ``seeds`` seeds on each backend, counts the runs that fail with that
``AssertionError`` and reads the failing frame's locals (``n_rejects``, ``rejected_mass``,
``log_q``); it also measures, for the rows the runs asked for, how far ``sum(exp(row))`` is from 1
(float64 sum) for the backend's own rows and after AWRS's float32 renormalisation::

    .venv/bin/python benchmarks/awrs_tolerance.py --backends ours transformers --seeds 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import traceback
import warnings
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = '"""Return the words of a sentence in lower case.\n\n    Example: the quick brown fox jumps over the lazy dog and'
PATTERNS = {"words": r"[a-z ]+", "email": r"[a-z]+@[a-z]+\.(com|org|net)"}
#: The end-of-sequence bytes of each pattern's PromptedLLM (the email needs its ".").
EOS = {r"[a-z ]+": [b"."], r"[a-z]+@[a-z]+\.(com|org|net)": [b"\n"]}


def _mass_errors(rows: list[Any]) -> dict[str, float]:
    """Largest |sum(exp(row)) - 1| (float64 sums) of the rows as made and after AWRS's float32
    renormalisation (``lw - logsumexp(lw)``)."""
    import torch

    own, renorm = 0.0, 0.0
    for r in rows:
        r32 = torch.as_tensor(r).float().cpu()
        own = max(own, abs(float(torch.exp(r32.double()).sum()) - 1.0))
        lp = r32 - torch.logsumexp(r32, 0)
        renorm = max(renorm, abs(float(torch.exp(lp.double()).sum()) - 1.0))
    return {"row": own, "after_awrs_renorm": renorm}


async def _run(lm: Any, pattern: str, n: int, t: int, seed: int, rows: list[Any]) -> dict[str, Any]:
    import numpy as np
    from genlm.control import AWRS, BoolFSA, PromptedLLM

    prompt_ids = [int(lm.tokenizer.bos_token_id), *lm.tokenizer.encode(PROMPT, add_special_tokens=False)]
    llm = PromptedLLM(lm, prompt_ids=prompt_ids, eos_byte_strings=EOS[pattern])
    condition = BoolFSA.from_regex(pattern).coerce(llm, f=b"".join)
    np.random.seed(seed)
    inner = lm.next_token_logprobs

    async def keep(ids: Any, *a: Any, **kw: Any) -> Any:  # a sample of the rows the run used
        row = await inner(ids, *a, **kw)
        if len(rows) < 200:
            rows.append(row.detach().float().cpu().clone())
        return row

    lm.next_token_logprobs = keep
    try:
        seqs = await AWRS(llm, condition, seed=seed).smc(n_particles=n, ess_threshold=0.5, max_tokens=t)
        return {"seed": seed, "ok": True, "log_ml": float(seqs.log_ml)}
    except AssertionError as e:
        return {"seed": seed, "ok": False, **_frame_facts(e)}
    finally:
        del lm.next_token_logprobs


def _frame_facts(e: AssertionError) -> dict[str, Any]:
    """The failing check of an ``AssertionError`` and the locals of the frame that raised it."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    loc = tb.tb_frame.f_locals if tb is not None else {}
    line = traceback.extract_tb(e.__traceback__)[-1]
    out: dict[str, Any] = {"where": f"{line.name} {os.path.basename(line.filename)}:{line.lineno}",
                           "check": line.line, "n_rejects": loc.get("n_rejects")}
    for k in ("rejected_mass", "log_q", "lp"):
        if k in loc:
            out[k] = float(loc[k])
    order = loc.get("order")
    logps = getattr(order, "_logps", None)
    if logps is not None:  # the walked row: how far its float32 probabilities sum from 1
        import torch

        lp = logps.detach().double().cpu()
        out["row_mass_minus_1"] = float(torch.exp(lp).sum()) - 1.0
        out["row_finite"] = int(torch.isfinite(lp).sum())
        out["row_dtype"] = str(logps.dtype)
    return out


async def _contexts(llm: Any, condition: Any, steps: int, seed: int) -> list[list[int]]:
    """Token-id contexts along one AWRS walk from the prompt (the rows the direct mode tests)."""
    from genlm.control import AWRS

    sampler = AWRS(llm, condition, seed=seed)
    ids = {id(t): i for i, t in enumerate(llm.token_maps.decode)}
    ctx: list[Any] = []
    out = [[]]
    for _ in range(steps):
        tok, w, _ = await sampler.sample(ctx)
        if tok is llm.eos or w == float("-inf"):
            break
        ctx = [*ctx, tok]
        out.append([ids[id(t)] for t in ctx])
    return out


async def _direct(lm: Any, pattern: str, contexts: list[list[int]] | None, draws: int, steps: int,
                  seed: int) -> tuple[list[list[int]], dict[str, Any]]:
    """``AWRS.sample(context)`` ``draws`` times per context (one sampler: its Gumbel keys differ
    every draw), counting the draws that fail with an ``AssertionError``."""
    from genlm.control import AWRS, BoolFSA, PromptedLLM

    prompt_ids = [int(lm.tokenizer.bos_token_id), *lm.tokenizer.encode(PROMPT, add_special_tokens=False)]
    llm = PromptedLLM(lm, prompt_ids=prompt_ids, eos_byte_strings=EOS[pattern])
    condition = BoolFSA.from_regex(pattern).coerce(llm, f=b"".join)
    if contexts is None:
        contexts = await _contexts(llm, condition, steps, seed)
    sampler = AWRS(llm, condition, seed=seed)
    decode = llm.token_maps.decode
    per_context = []
    for ids in contexts:
        ctx = [decode[i] for i in ids]
        fails: list[dict[str, Any]] = []
        for _ in range(draws):
            try:
                await sampler.sample(ctx)
            except AssertionError as e:
                fails.append(_frame_facts(e))
        row = (await llm.logw_next(ctx)).weights
        import torch

        lw = torch.as_tensor(row).float()
        lp = lw - torch.logsumexp(lw, 0)
        per_context.append({
            "context_len": len(ids), "draws": draws, "failures": len(fails), "examples": fails[:2],
            "mass_error_after_awrs_renorm": float(torch.exp(lp.double()).sum()) - 1.0,
        })
        print(f"  context of {len(ids)} tokens: {len(fails)}/{draws} draws failed"
              + (f" e.g. {fails[0]}" if fails else ""), flush=True)
    return contexts, {"contexts": per_context, "draws": draws * len(contexts),
                      "failures": sum(c["failures"] for c in per_context)}


def _backend(name: str, path: str) -> Any:
    if name == "ours":
        from genlm_vlm import AsyncVirtualLM

        return AsyncVirtualLM.from_name(path, {"dtype": "float32", "max_model_len": 256, "block_size": 32,
                                               "kv_cache_memory_bytes": 1 << 30, "seed": 0})
    from genlm.backend.llm import AsyncTransformer

    lm = AsyncTransformer.from_name(path, hf_opts={"device_map": "cpu", "torch_dtype": "float32"})
    return lm


def main() -> int:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-2k-mid", help="genlm_vlm.testing kind, or 'demo'")
    p.add_argument("--backends", nargs="+", choices=("ours", "transformers"), default=["ours", "transformers"])
    p.add_argument("--pattern", choices=list(PATTERNS), default="words")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--t", type=int, default=30)
    p.add_argument("--seeds", type=int, default=24)
    p.add_argument("--out", default=None)
    p.add_argument("--direct", type=int, default=0, metavar="DRAWS",
                   help="instead of whole runs: AWRS.sample DRAWS times on each context of one AWRS walk "
                        "(the same token contexts on every backend)")
    p.add_argument("--steps", type=int, default=12, help="--direct: contexts along a walk of this many tokens")
    args = p.parse_args()
    if args.model == "demo":
        from genlm_vlm import demo_model_path

        path = str(demo_model_path())
    else:
        from genlm_vlm.testing import tiny_model_path

        path = str(tiny_model_path(args.model))
    report: dict[str, Any] = {"model": args.model, "pattern": PATTERNS[args.pattern], "n": args.n, "t": args.t}
    contexts = None
    for name in args.backends:
        lm = _backend(name, path)
        loop = asyncio.new_event_loop()
        if args.direct:
            print(name, flush=True)
            contexts, report[name] = loop.run_until_complete(
                _direct(lm, PATTERNS[args.pattern], contexts, args.direct, args.steps, 0))
            print(name, f"{report[name]['failures']}/{report[name]['draws']} draws failed", flush=True)
            cleanup = getattr(lm, "cleanup", None)
            if cleanup is not None:
                cleanup()
            loop.close()
            continue
        rows: list[Any] = []
        runs = []
        for seed in range(args.seeds):
            lm.clear_cache()
            res = loop.run_until_complete(_run(lm, PATTERNS[args.pattern], args.n, args.t, seed, rows))
            runs.append(res)
            print(name, json.dumps(res), flush=True)
        failed = [r for r in runs if not r["ok"]]
        report[name] = {"runs": len(runs), "assertion_failures": len(failed), "failures": failed,
                        "mass_error_max": _mass_errors(rows), "rows_checked": len(rows)}
        print(name, f"{len(failed)}/{len(runs)} runs failed;", "mass error", report[name]["mass_error_max"],
              flush=True)
        cleanup = getattr(lm, "cleanup", None)
        if cleanup is not None:
            cleanup()
        loop.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
