#!/usr/bin/env python
"""genlm_vlm's own cost per row, with the engine taken out.

The whole path of an awaited row (validation, the batcher, the engine thread's admission,
routing and delivery, the hand-over to the event loop, the copy a caller gets) runs against a
fake engine core whose step costs almost nothing: it hands back, for every request, a fresh
copy of one precomputed row (the real capture allocates one fresh row per request too). What
is left is genlm_vlm's host work, measured in microseconds per row at a given logit width.

Workload: ``--n`` particles extend a ``--prompt-len``-token prompt by one token per step for
``--steps`` steps (as in bench_smc.py), awaited with ``asyncio.gather``; the output cache is off
(``cache_size=0``, as in the SMC benchmarks) unless ``--cache``. Also printed: the cost of the
capture's own work per row (``log_softmax`` of a raw row into a fresh tensor), which the real
engine pays inside its step.

    .venv/bin/python benchmarks/bench_host.py --width 32768 151936

The fake core lives in tests/fake_core.py (the unit tests' fake), made cheap here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import time
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
for extra in (_HERE.parent, _HERE.parent / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import torch  # noqa: E402
from fake_core import FakeCore  # noqa: E402


class CheapCore(FakeCore):
    """The unit tests' fake core, with rows that cost one copy each."""

    def __init__(self, width: int, max_num_seqs: int) -> None:
        super().__init__(vocab=width, max_num_seqs=max_num_seqs, max_model_len=4096)
        row = torch.log_softmax(torch.randn(width), dim=-1)
        self.row_fn = lambda tokens, vocab: row.clone()


async def smc(lm: Any, prompt: list[int], n: int, steps: int) -> None:
    parts = [list(prompt) for _ in range(n)]
    for t in range(steps):
        await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts))
        parts = [p + [3 + (i + t) % 500] for i, p in enumerate(parts)]


def measure(width: int, n: int, steps: int, prompt_len: int, reps: int, cache: bool,
            tune_allocator: bool = True) -> dict[str, Any]:
    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.engine import EngineDriver

    if tune_allocator:  # as building a CPU engine does (genlm_vlm.engine.options.tune_cpu_allocator)
        from genlm_vlm.engine.options import tune_cpu_allocator

        tune_cpu_allocator()

    core = CheapCore(width, max_num_seqs=max(256, n))
    driver = EngineDriver("fake", core_factory=lambda: core)
    lm = AsyncVirtualLM(driver, cache_size=10_000 if cache else 0)
    prompt = [3 + i % 500 for i in range(prompt_len)]
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(smc(lm, prompt, n, steps))  # warm-up
        lm.clear_cache()
        before, cpu0 = lm.stats, time.process_time()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            loop.run_until_complete(smc(lm, prompt, n, steps))
            times.append(time.perf_counter() - t0)
            lm.clear_cache()
        cpu = time.process_time() - cpu0
        after = lm.stats
    finally:
        lm.cleanup()
        loop.close()
    rows = n * steps * reps
    t0, t1 = before["engine_time"], after["engine_time"]
    per = {k[:-2]: (t1[k] - t0[k]) / rows * 1e6 for k in t1}
    return {
        "width": width, "n": n, "steps": steps, "prompt_len": prompt_len, "cache": cache, "tuned": tune_allocator,
        "wall_us_per_row": round(statistics.median(times) / (n * steps) * 1e6, 1),
        "cpu_us_per_row": round(cpu / rows * 1e6, 1),
        "engine_thread_host_us": round(per["host"], 1),
        "engine_thread_step_us": round(per["step"], 1),
        "loop_deliver_us": round((after["logprobs"]["deliver_s"] - before["logprobs"]["deliver_s"]) / rows * 1e6, 1),
        "result_hops_per_step": round((after["logprobs"]["result_hops"] - before["logprobs"]["result_hops"])
                                      / (steps * reps), 2),
    }


def capture_cost(width: int, n: int = 64, reps: int = 50) -> float:
    """Microseconds per row of the capture's work: log_softmax of one raw row into a new tensor."""
    logits = torch.randn(n, width)
    for _ in range(3):
        [torch.log_softmax(logits[r].to(torch.float32), dim=-1) for r in range(n)]
    t0 = time.perf_counter()
    for _ in range(reps):
        [torch.log_softmax(logits[r].to(torch.float32), dim=-1) for r in range(n)]
    return round((time.perf_counter() - t0) / (reps * n) * 1e6, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, nargs="+", default=[32768, 151936], help="logit columns")
    ap.add_argument("--n", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cache", action="store_true", help="keep the output cache on (rows are then copied)")
    ap.add_argument("--glibc-defaults", action="store_true",
                    help="leave glibc's allocator as it is (the engine build tunes it on CPU)")
    ap.add_argument("--out", default=str(_HERE / "results" / "host.json"))
    args = ap.parse_args(argv)
    results = []
    for width in args.width:
        for n in args.n:
            cell = measure(width, n, args.steps, args.prompt_len, args.reps, args.cache, not args.glibc_defaults)
            cell["capture_us_per_row"] = capture_cost(width)
            results.append(cell)
            print(json.dumps(cell), flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
