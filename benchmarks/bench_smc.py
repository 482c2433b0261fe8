#!/usr/bin/env python
"""SMC throughput against vLLM's own decoding: does one SMC step cost one decode token?

Workload: N particles share a P-token prompt; each of T steps awaits every particle's
next-token row and extends every particle by one token. With ``--resample K`` every K-th step
first resamples the particles (random ancestors: forks, drops and duplicates). Tokens are drawn
with a seeded ``random.Random`` (the rows of random-weight models carry no information), so
every system sees the same token sequences.

Systems, all in one process, on the same local model and engine options:

* ``ours``: ``AsyncVirtualLM`` (streaming-input sessions: a continuing particle is one decode
  token);
* ``ours_requests``: ``AsyncVirtualLM(sessions=False)``: every step is a fresh request per
  particle (the previous design);
* ``generate1``: plain ``vllm.LLM.generate(max_tokens=1)`` on every particle's full prompt per
  step (the ceiling of the previous design; rows are not even returned);
* ``decode``: plain ``vllm.LLM.generate(N prompts, max_tokens=T, ignore_eos=True)``: vLLM
  decoding the same number of tokens (the decode ceiling; no rows, no resampling);
* ``hf``: transformers float32 incremental decoding with a KV cache (``past_key_values``,
  reordered on resampling), full-vocabulary ``log_softmax`` per step.

Prints rows/s (one row = one particle-step) per system and the ratios ours/decode,
ours/generate1, ours/hf, and for ours the account of a particle-step (microseconds per row:
``step`` inside vLLM's step, ``host`` genlm_vlm's engine-thread work, ``idle`` the engine
waiting for the program, ``loop`` genlm_vlm's hand-over on the event loop; CPU/wall); medians of ``--reps`` repetitions after one warm-up. Writes JSON to
``--out``. Example::

    .venv/bin/python benchmarks/bench_smc.py --model llama-32k --n 64 256 --resample 0 4
"""

from __future__ import annotations

import argparse
import asyncio
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
_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402

ENGINE_OPTS: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 1536 << 20, "seed": 0}


def plan(n: int, steps: int, prompt_len: int, resample: int, vocab: int, seed: int) -> tuple[list[int], list]:
    """The shared prompt and, per step, (ancestor indices or None, appended token per particle)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
    moves = []
    for t in range(steps):
        anc = [rng.randrange(n) for _ in range(n)] if resample and t % resample == resample - 1 else None
        moves.append((anc, [rng.randrange(3, vocab) for _ in range(n)]))
    return prompt, moves


def step_prompts(prompt: list[int], n: int, moves: list) -> list[list[list[int]]]:
    """The N prompts awaited at every step (what ``generate1`` replays)."""
    parts = [list(prompt) for _ in range(n)]
    out = []
    for anc, toks in moves:
        out.append([list(p) for p in parts])
        if anc is not None:
            parts = [list(parts[a]) for a in anc]
        parts = [p + [t] for p, t in zip(parts, toks, strict=True)]
    return out


async def run_ours(lm: Any, prompt: list[int], n: int, moves: list) -> None:
    parts = [list(prompt) for _ in range(n)]
    for anc, toks in moves:
        await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts))
        if anc is not None:
            parts = [list(parts[a]) for a in anc]
        parts = [p + [t] for p, t in zip(parts, toks, strict=True)]


def run_generate1(llm: Any, prompts_per_step: list) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    for prompts in prompts_per_step:
        uniq = list({tuple(p): None for p in prompts})
        llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in uniq], params, use_tqdm=False)


def run_decode(llm: Any, prompt: list[int], n: int, steps: int, seed: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # distinct last tokens so vLLM cannot share the decode work between particles
    prompts = [TokensPrompt(prompt_token_ids=prompt + [3 + (i % 500)]) for i in range(n)]
    params = SamplingParams(max_tokens=steps, temperature=1.0, seed=None, detokenize=False, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)


def run_hf(model: Any, prompt: list[int], n: int, moves: list) -> None:
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        torch.log_softmax(out.logits[:, -1].float(), -1)
        past = out.past_key_values
        past.batch_repeat_interleave(n)
        for anc, toks in moves[:-1]:  # step 0's row is the prompt's row, computed above
            if anc is not None:
                past.reorder_cache(torch.tensor(anc))
            out = model(torch.tensor(toks).unsqueeze(1), past_key_values=past, use_cache=True)
            torch.log_softmax(out.logits[:, -1].float(), -1)
            past = out.past_key_values


def account(name: str, before: dict, after: dict, rows: int, cpu_s: float, wall_s: float) -> dict[str, float]:
    """Where one particle-step's time went (microseconds per row, over warm-up and reps):
    ``step`` inside vLLM's step, ``host`` genlm_vlm's engine-thread work, ``idle`` the engine
    waiting for the program, ``loop`` genlm_vlm's result hand-over on the event loop; and the
    process's CPU seconds per wall second (2.0 = both cores busy)."""
    t0, t1 = before["engine_time"], after["engine_time"]
    out = {f"{name}_{k[:-2]}_us": round((t1[k] - t0[k]) / rows * 1e6, 1) for k in t1}
    out[f"{name}_loop_us"] = round((after["logprobs"]["deliver_s"] - before["logprobs"]["deliver_s"]) / rows * 1e6, 1)
    out[f"{name}_cpu_per_wall"] = round(cpu_s / wall_s, 2)
    return out


def timed(fn: Any, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-32k", help="a genlm_vlm.testing kind (llama-32k, llama-32k-mid) or a path")
    ap.add_argument("--n", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--resample", type=int, nargs="+", default=[0, 4], help="0: no resampling; K: every K-th step")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=None, help="engine block_size (default: genlm_vlm's)")
    ap.add_argument("--systems", nargs="+", default=["ours", "ours_requests", "generate1", "decode", "hf"])
    ap.add_argument("--out", default="benchmarks/results/smc.json")
    ap.add_argument("--delivery-parts", type=int, default=1, help="AsyncVirtualLM delivery_parts for ours")
    args = ap.parse_args(argv)

    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.engine import CPU_ENGINE_OPTS, DEFAULT_ENGINE_OPTS, is_cpu_platform
    from genlm_vlm.testing import tiny_model_path

    path = str(tiny_model_path(args.model)) if not os.path.isdir(args.model) else args.model
    opts = dict(ENGINE_OPTS)
    if args.block_size:
        opts["block_size"] = args.block_size
    loop = asyncio.new_event_loop()
    lms: dict[str, Any] = {}
    if "ours" in args.systems:
        lms["ours"] = AsyncVirtualLM.from_name(path, dict(opts), cache_size=0, delivery_parts=args.delivery_parts)
    if "ours_requests" in args.systems:
        lms["ours_requests"] = AsyncVirtualLM.from_name(path, dict(opts), sessions=False, cache_size=0)
    llm = None
    if {"generate1", "decode"} & set(args.systems):
        from vllm import LLM

        raw = dict(DEFAULT_ENGINE_OPTS)
        if is_cpu_platform():
            raw.update(CPU_ENGINE_OPTS)
        raw.update(opts)
        llm = LLM(model=path, **raw)
    hf = None
    if "hf" in args.systems:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = 32768 if ("32k" in args.model or "0.5b" in args.model) else 400

    def fresh(lm: Any) -> None:
        lm.clear_cache()  # also releases idle sessions
        lm.llm.reset_prefix_cache()

    results = []
    for resample in args.resample:
        for n in args.n:
            prompt, moves = plan(n, args.steps, args.prompt_len, resample, vocab, seed=n + resample)
            rows = n * args.steps
            cell: dict[str, Any] = {"model": args.model, "n": n, "steps": args.steps, "prompt_len": args.prompt_len, "resample": resample}
            for name, lm in lms.items():
                before, cpu0, wall0 = lm.stats, time.process_time(), time.perf_counter()
                cell[name] = rows / timed(lambda lm=lm: (fresh(lm), loop.run_until_complete(run_ours(lm, prompt, n, moves))), args.reps)  # noqa: B023 (called at once)
                cell.update(account(name, before, lm.stats, rows * (args.reps + 1),
                                    time.process_time() - cpu0, time.perf_counter() - wall0))
            if llm is not None and "generate1" in args.systems:
                per_step = step_prompts(prompt, n, moves)
                cell["generate1"] = rows / timed(lambda: (llm.reset_prefix_cache(), run_generate1(llm, per_step)), args.reps)  # noqa: B023
            if llm is not None and "decode" in args.systems:
                cell["decode"] = rows / timed(lambda: (llm.reset_prefix_cache(), run_decode(llm, prompt, n, args.steps, 0)), args.reps)  # noqa: B023
            if hf is not None:
                cell["hf"] = rows / timed(lambda: run_hf(hf, prompt, n, moves), args.reps)  # noqa: B023
            if "ours" in cell:
                for base in ("decode", "generate1", "ours_requests", "hf"):
                    if base in cell:
                        cell[f"ours/{base}"] = cell["ours"] / cell[base]
            results.append(cell)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in cell.items()}), flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    for lm in lms.values():
        lm.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
