#!/usr/bin/env python
"""SMC throughput against vLLM's own decoding: does one SMC step cost one decode token?

Workload: N particles share a P-token prompt; each of T steps awaits every particle's
next-token row and extends every particle by one token. With ``--resample K`` every K-th step
first resamples the particles (random ancestors: forks, drops and duplicates). Tokens are drawn
with a seeded ``random.Random`` (the rows of random-weight models carry no information), so
every system sees the same token sequences.

Systems, all in one process, on the same local model and engine options:

* ``ours``: ``AsyncVirtualLM.from_name(path, engine_opts)`` with every other option at its
  default (what a user runs: the output cache on, streaming-input sessions), awaited per
  particle: ``rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))``,
  then ``torch.stack(rows)`` (what llamppl and hand-written SMC do);
* ``ours_batch``: the same model object, one ``await lm.batch_next_token_logprobs(particles)``
  per step (what genlm-control's ``AutoBatchedPotential`` does);
* ``ours_nocache``: a second ``AsyncVirtualLM`` built with ``cache_size=0``, awaited per
  particle (the configuration the SMC tables used before the defaults were made fast);
* ``ours_noforks``: a second ``AsyncVirtualLM`` built with ``forks=False``, awaited per
  particle: a resampled particle's copies re-prefill their parent's unfinished KV block (what
  every fork cost before forks shared it);
* ``ours_requests``: ``AsyncVirtualLM(sessions=False, cache_size=0)``: every step is a fresh
  request per particle (the previous design);
* ``generate1``: plain ``vllm.LLM.generate(max_tokens=1)`` on every particle's full prompt per
  step (the ceiling of the previous design; rows are not even returned);
* ``decode``: plain ``vllm.LLM.generate(N prompts, max_tokens=T, ignore_eos=True)``: vLLM
  decoding the same number of tokens (the decode ceiling; no rows, no resampling);
* ``hf``: transformers float32 incremental decoding with a KV cache (``past_key_values``,
  reordered on resampling), full-vocabulary ``log_softmax`` per step.

Every vLLM engine gets the same options (genlm_vlm's defaults, block size included, plus
``ENGINE_OPTS``). Each system gets one warm-up, then ``--reps`` timed repetitions that alternate
between the systems (the order rotates from one repetition to the next); before each run of an
``ours*`` system its output cache is cleared, its idle sessions released and vLLM's prefix cache
reset (untimed). Prints rows/s (one row = one particle-step) per system, the ratios ``ours/decode``,
``ours_batch/decode``, ``ours_nocache/decode`` (and against ``generate1``, ``ours_requests``,
``hf``), and for each ``ours*`` system the account of a particle-step (microseconds per row:
``step`` inside vLLM's step, ``host`` genlm_vlm's engine-thread work, ``idle`` the engine
waiting for the program, ``loop`` genlm_vlm's hand-over on the event loop; CPU/wall; output
cache ``hits``); the work each system did per run: ``<system>_tokens``, the tokens the engine
computed (scheduled; for ``ours*`` genlm_vlm's ``stats["tokens"]["scheduled"]``, for
``generate1``/``decode`` the prompt tokens not found in the prefix cache plus the tokens
decoded after the first, from vLLM's ``RequestOutput.num_cached_tokens``) and
``<system>_tokens/decode``; for ``ours*`` the forks served by a copy of the parent's tail block
(``_forks_copied``; ``_forks_aligned``: the parent's context ended on a block boundary, nothing
to copy) and those that re-prefilled it (``_forks_reprefilled``); medians of ``--reps`` (every run's seconds are printed and kept too). Writes JSON to
``--out``. Example::

    .venv/bin/python benchmarks/bench_smc.py --model llama-32k --n 64 256 --resample 0 4
    .venv/bin/python benchmarks/bench_smc.py --model llama-32k --n 64 --resample 0 --systems ours ours_batch ours_nocache decode
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
from collections import Counter
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


async def run_ours(lm: Any, prompt: list[int], n: int, moves: list, batch: bool = False) -> None:
    """One SMC run: per step every particle's row (awaited per particle, or as one batch call),
    stacked into ``[N, V]``; then resampling (if due) and one token per particle."""
    parts = [list(prompt) for _ in range(n)]
    for anc, toks in moves:
        if batch:
            rows = await lm.batch_next_token_logprobs(parts)
        else:
            rows = torch.stack(await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts)))
        assert rows.shape[0] == n
        if anc is not None:
            parts = [list(parts[a]) for a in anc]
        parts = [p + [t] for p, t in zip(parts, toks, strict=True)]


def computed(outs: list) -> int:
    """Tokens vLLM computed for these finished requests: the prompt tokens it did not find in
    its prefix cache, plus every decoded token after the first (each is fed back once)."""
    return sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) + len(o.outputs[0].token_ids) - 1 for o in outs)


def run_generate1(llm: Any, prompts_per_step: list) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    tokens = 0
    for prompts in prompts_per_step:
        uniq = list({tuple(p): None for p in prompts})
        tokens += computed(llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in uniq], params, use_tqdm=False))
    return tokens


def run_decode(llm: Any, prompt: list[int], n: int, steps: int, seed: int) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # distinct last tokens so vLLM cannot share the decode work between particles
    prompts = [TokensPrompt(prompt_token_ids=prompt + [3 + (i % 500)]) for i in range(n)]
    params = SamplingParams(max_tokens=steps, temperature=1.0, seed=None, detokenize=False, ignore_eos=True)
    return computed(llm.generate(prompts, params, use_tqdm=False))


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


def counters(lm: Any) -> dict[str, float]:
    """The counters the account reads, from ``lm.stats``."""
    st = lm.stats
    forks = st["forks"]
    return {**st["engine_time"], "deliver_s": st["logprobs"]["deliver_s"], "cache_hits": st["cache"]["hits"],
            "tokens": st["tokens"]["scheduled"] or 0, "forks_copied": forks["copied"],
            "forks_aligned": forks["aligned"], "forks_reprefilled": forks["reprefilled"]}


def account(name: str, spent: dict[str, float], rows: int) -> dict[str, float]:
    """Where one particle-step's time went (microseconds per row, over the timed runs):
    ``step`` inside vLLM's step, ``host`` genlm_vlm's engine-thread work, ``idle`` the engine
    waiting for the program, ``loop`` genlm_vlm's result hand-over on the event loop; the
    process's CPU seconds per wall second (2.0 = both cores busy); output cache hits."""
    out = {f"{name}_{k[:-2]}_us": round(spent[k] / rows * 1e6, 1) for k in ("step_s", "host_s", "idle_s")}
    out[f"{name}_loop_us"] = round(spent["deliver_s"] / rows * 1e6, 1)
    out[f"{name}_cpu_per_wall"] = round(spent["cpu_s"] / spent["wall_s"], 2)
    out[f"{name}_cache_hits"] = int(spent["cache_hits"])
    for k in ("forks_copied", "forks_aligned", "forks_reprefilled"):  # per run
        out[f"{name}_{k}"] = round(spent[k] / spent["runs"], 1)
    return out


OURS = ("ours", "ours_batch", "ours_nocache", "ours_noforks", "ours_requests")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-32k", help="a genlm_vlm.testing kind (llama-32k, llama-32k-mid) or a path")
    ap.add_argument("--n", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--resample", type=int, nargs="+", default=[0, 4], help="0: no resampling; K: every K-th step")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=None, help="engine block_size (default: genlm_vlm's)")
    ap.add_argument("--systems", nargs="+",
                    default=["ours", "ours_batch", "ours_nocache", "ours_noforks", "ours_requests", "generate1", "decode", "hf"],
                    help="ours and ours_batch share one model built with from_name's defaults")
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
    if {"ours", "ours_batch"} & set(args.systems):
        # What a user runs: from_name's defaults (delivery_parts only if asked for).
        extra = {"delivery_parts": args.delivery_parts} if args.delivery_parts != 1 else {}
        lm = AsyncVirtualLM.from_name(path, dict(opts), **extra)
        for name in ("ours", "ours_batch"):
            if name in args.systems:
                lms[name] = lm
    if "ours_nocache" in args.systems:
        lms["ours_nocache"] = AsyncVirtualLM.from_name(path, dict(opts), cache_size=0)
    if "ours_noforks" in args.systems:
        lms["ours_noforks"] = AsyncVirtualLM.from_name(path, dict(opts), forks=False)
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
            # name -> (untimed set-up, timed run)
            runs: dict[str, tuple[Any, Any]] = {}
            for name, lm in lms.items():
                runs[name] = (lambda lm=lm: fresh(lm),
                              lambda lm=lm, batch=(name == "ours_batch"):  # called in this cell only
                              loop.run_until_complete(run_ours(lm, prompt, n, moves, batch)))  # noqa: B023
            if llm is not None and "generate1" in args.systems:
                per_step = step_prompts(prompt, n, moves)
                runs["generate1"] = (llm.reset_prefix_cache, lambda: run_generate1(llm, per_step))  # noqa: B023
            if llm is not None and "decode" in args.systems:
                runs["decode"] = (llm.reset_prefix_cache, lambda: run_decode(llm, prompt, n, args.steps, 0))  # noqa: B023
            if hf is not None:
                runs["hf"] = (lambda: None, lambda: run_hf(hf, prompt, n, moves))  # noqa: B023
            names = [s for s in args.systems if s in runs]
            for name in names:  # warm-up
                runs[name][0]()
                runs[name][1]()
            times: dict[str, list[float]] = {name: [] for name in names}
            spent: dict[str, Counter[str]] = {name: Counter() for name in lms}
            work: dict[str, list[int]] = {name: [] for name in names}  # tokens computed per run
            for rep in range(args.reps):
                k = rep % len(names)
                for name in names[k:] + names[:k]:  # rotate the order from one repetition to the next
                    lm = lms.get(name)
                    runs[name][0]()
                    before = counters(lm) if lm is not None else {}
                    cpu0, t0 = time.process_time(), time.perf_counter()
                    done = runs[name][1]()
                    t1, cpu1 = time.perf_counter(), time.process_time()
                    times[name].append(t1 - t0)
                    if lm is not None:  # this system's runs only (ours and ours_batch share a model)
                        after = counters(lm)
                        spent[name].update({k: after[k] - before[k] for k in after})
                        spent[name].update({"cpu_s": cpu1 - cpu0, "wall_s": t1 - t0, "runs": 1})
                        work[name].append(int(after["tokens"] - before["tokens"]))
                    elif isinstance(done, int):
                        work[name].append(done)
            for name in names:
                cell[name] = rows / statistics.median(times[name])
            cell["seconds"] = {name: [round(t, 3) for t in times[name]] for name in names}
            for name in lms:
                cell.update(account(name, spent[name], rows * args.reps))
            for name in names:
                if work[name] and any(work[name]):
                    cell[f"{name}_tokens"] = statistics.median(work[name])
            if "decode_tokens" in cell:
                for name in names:
                    if f"{name}_tokens" in cell and name != "decode":
                        cell[f"{name}_tokens/decode"] = cell[f"{name}_tokens"] / cell["decode_tokens"]
            for ours in OURS:
                if ours not in cell:
                    continue
                for base in ("decode", "generate1", "ours_requests", "hf"):
                    if base in cell and base != ours:
                        cell[f"{ours}/{base}"] = cell[ours] / cell[base]
            if "ours" in cell and "ours_nocache" in cell:
                cell["ours_nocache/ours"] = cell["ours_nocache"] / cell["ours"]
            results.append(cell)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in cell.items()}), flush=True)
            print("  seconds per run:", cell["seconds"], flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    for lm in set(lms.values()):
        lm.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
