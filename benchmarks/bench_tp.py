"""Tensor parallel on the SMC workload: TP=1 vs TP=2 rows/s, same prompts, same machine.

Each configuration runs in its own fresh Python process (one engine per process, nothing else
alive in it), one after the other, and the ratio TP=2 / TP=1 is printed at the end. The workload
is bench_async.py's SMC loop: N particles share a prompt, every step awaits all N rows, samples
one token per particle from its row, and (``--resample-every K``) resamples every K-th step.

What a 2-core CPU can show: TP=2 puts one rank on each core (``VLLM_CPU_OMP_THREADS_BIND=0|1``,
genlm_vlm's default on a one-NUMA-node machine) and adds an all-reduce per layer plus an
all-gather of the logits per step; TP=1 runs the model in this process with vLLM's default
thread binding. On a machine this small, tensor parallel is for models that do not fit one
device, not for speed; the figure says what the rank split costs.

    .venv/bin/python benchmarks/bench_tp.py --model llama-32k-mid --n 64 --steps 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """Build one engine with ``tensor_parallel_size=args.tp`` and time the SMC loop."""
    import torch
    from bench_async import ENGINE_OPTS, _ours_smc, _resolve_model

    from genlm_vlm import AsyncVirtualLM

    path = _resolve_model(args.model)
    tp = args.tp[0]
    opts = {**ENGINE_OPTS, "tensor_parallel_size": tp, "max_num_seqs": max(256, args.n)}
    t0 = time.perf_counter()
    lm = AsyncVirtualLM.from_name(path, opts)
    build_s = time.perf_counter() - t0
    try:
        gen = torch.Generator().manual_seed(args.seed)
        vocab = len(lm.tokenizer)
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
        loop = asyncio.new_event_loop()
        loop.run_until_complete(_ours_smc(lm, prompt, args.n, 2, args.seed))  # warm-up
        rates = []
        for rep in range(args.reps):
            lm.clear_cache()
            lm.release_sessions()
            m, _ = loop.run_until_complete(
                _ours_smc(lm, prompt, args.n, args.steps, args.seed + 1 + rep, args.resample_every)
            )
            rates.append(m.rows / m.seconds)
        ring = lm._driver.sink.remote
        loop.close()
        return {
            "tp": tp,
            "rows_per_s": sorted(rates)[len(rates) // 2],
            "rates": rates,
            "build_s": build_s,
            "ring_rows": ring.rows_written if ring is not None else 0,
            "sessions": lm.stats["sessions"],
            "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "(vLLM default)"),
        }
    finally:
        lm.cleanup()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-32k-mid", help="a genlm_vlm.testing kind or a model path")
    p.add_argument("--n", type=int, default=64, help="particles")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--resample-every", type=int, default=0)
    p.add_argument("--reps", type=int, default=2, help="timed repetitions per configuration (median)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor_parallel_size values")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return 0
    results = []
    for tp in args.tp:
        cmd = [sys.executable, __file__, "--worker", "--tp", str(tp), "--model", args.model, "--n", str(args.n),
               "--steps", str(args.steps), "--prompt-len", str(args.prompt_len), "--reps", str(args.reps),
               "--resample-every", str(args.resample_every), "--seed", str(args.seed)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"TP={tp} failed (exit {proc.returncode})")
        res = json.loads(lines[-1][len("RESULT "):])
        results.append(res)
        print(f"TP={tp}: {res['rows_per_s']:.0f} rows/s (reps {', '.join(f'{r:.0f}' for r in res['rates'])}), "
              f"engine built in {res['build_s']:.0f} s, rows through the ring {res['ring_rows']}, "
              f"sessions continued {res['sessions']['continued']}", flush=True)
    base = results[0]["rows_per_s"]
    print(f"\n{args.model}, SMC N={args.n}, {args.steps} steps, prompt {args.prompt_len} tokens, "
          f"resample every {args.resample_every or 'never'}, {os.cpu_count()} CPUs")
    print("| tensor_parallel_size | rows/s | vs TP=" + str(results[0]["tp"]) + " |")
    print("| --- | --- | --- |")
    for r in results:
        print(f"| {r['tp']} | {r['rows_per_s']:.0f} | {r['rows_per_s'] / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
