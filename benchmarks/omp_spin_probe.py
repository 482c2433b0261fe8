"""Cores per wall second of ``lm.smc`` on the CPU build, with or without a second OpenMP team.

libgomp's workers spin between parallel regions (CPU time, no work) unless the process holds more
OpenMP threads than cores; then they sleep almost at once. ``--team`` runs one parallel torch
operation on the main thread before the runs (a second team beside the engine thread's), which is
what flips a process from one mode to the other. Prints each run's wall, process CPU seconds and
their ratio, and the busiest threads' CPU seconds.

    python benchmarks/omp_spin_probe.py --n 128 32 --reps 5
    python benchmarks/omp_spin_probe.py --n 128 32 --reps 5 --team
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from genlm_vlm import AsyncVirtualLM
from genlm_vlm.bench import workloads as W
from genlm_vlm.bench.systems import _prompt_ids
from genlm_vlm.smc import Regex


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "..", "genlm_vlm", "data", "demo-model"))
    p.add_argument("--n", type=int, nargs="+", default=[128, 32])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--team", action="store_true", help="one parallel torch op on the main thread first")
    a = p.parse_args()
    lm = AsyncVirtualLM.from_name(a.model, {"kv_cache_memory_bytes": 1 << 30, "max_model_len": 512, "seed": 0})
    prompt = _prompt_ids(lm.tokenizer)
    if a.team:
        import torch

        x = torch.randn(4_000_000)
        float((x.exp() * 2).sum())
    loop = asyncio.new_event_loop()
    for n in a.n:
        for rep in range(a.reps):
            lm.clear_cache()
            lm.release_sessions()
            before = thread_cpu()
            t0, c0 = time.perf_counter(), time.process_time()
            r = loop.run_until_complete(lm.smc(prompt, Regex(W.REGEX), n, 48, seed=rep, ess_threshold=0.5))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            after = thread_cpu()
            busy = sorted((after[k] - before.get(k, 0.0) for k in after), reverse=True)[:3]
            print(f"N={n} rep {rep + 1}: wall {wall:.2f} s, CPU {cpu:.2f} s, cores {cpu / wall:.2f}, "
                  f"path {r.stats.get('engine_path')}, busiest threads {[round(b, 2) for b in busy]} s", flush=True)
    loop.close()
    lm.cleanup()


if __name__ == "__main__":
    main()
