#!/usr/bin/env python
"""genlm_vlm's own cost per row, with the engine taken out.

The whole path of an awaited row (validation, the batcher, the engine thread's admission,
routing and delivery, the hand-over to the event loop, the copy a caller gets) runs against a
fake engine core whose step costs almost nothing: it hands back, for every request, a fresh
copy of one precomputed row (the real capture allocates one fresh row per request too). What
is left is genlm_vlm's host work, measured in microseconds per row at a given logit width.

Workload: ``--n`` particles extend a ``--prompt-len``-token prompt by one token per step for
``--steps`` steps (as in bench_smc.py); each step's rows are awaited per particle
(``asyncio.gather`` of ``next_token_logprobs``, then ``torch.stack``: pattern ``await``) or in one
``batch_next_token_logprobs`` call (pattern ``batch``). Configurations (``--configs``):
``defaults`` (the model built with every option at its default, as ``from_name`` builds it: the
output cache on) and ``nocache`` (``cache_size=0``). Every (configuration, pattern) runs on its
own model, and the repetitions alternate between them. Also printed: the cost of the capture's
own work per row (``log_softmax`` of a raw row into a fresh tensor), which the real engine pays
inside its step.

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


async def smc(lm: Any, prompt: list[int], n: int, steps: int, batch: bool = False) -> None:
    parts = [list(prompt) for _ in range(n)]
    for t in range(steps):
        if batch:
            rows = await lm.batch_next_token_logprobs(parts)
        else:
            rows = torch.stack(await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts)))
        assert rows.shape[0] == n
        parts = [p + [3 + (i + t) % 500] for i, p in enumerate(parts)]


CONFIGS: dict[str, dict[str, Any]] = {"defaults": {}, "nocache": {"cache_size": 0}}


def measure(width: int, n: int, steps: int, prompt_len: int, reps: int, systems: list[tuple[str, str]],
            tune_allocator: bool = True) -> list[dict[str, Any]]:
    """One cell: every (configuration, pattern) of ``systems`` on its own model, alternating."""
    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.engine import EngineDriver

    if tune_allocator:  # as building a CPU engine does (genlm_vlm.engine.options.tune_cpu_allocator)
        from genlm_vlm.engine.options import tune_cpu_allocator

        tune_cpu_allocator()

    prompt = [3 + i % 500 for i in range(prompt_len)]
    loop = asyncio.new_event_loop()
    lms, times, before = {}, {}, {}
    try:
        for config, pattern in systems:
            core = CheapCore(width, max_num_seqs=max(256, n))
            driver = EngineDriver("fake", core_factory=lambda core=core: core)
            lm = lms[config, pattern] = AsyncVirtualLM(driver, **CONFIGS[config])
            loop.run_until_complete(smc(lm, prompt, n, steps, pattern == "batch"))  # warm-up
            lm.clear_cache()
            before[config, pattern] = lm.stats
            times[config, pattern] = []
        cpu = dict.fromkeys(lms, 0.0)
        for rep in range(reps):
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for system in order:
                lm = lms[system]
                cpu0, t0 = time.process_time(), time.perf_counter()
                loop.run_until_complete(smc(lm, prompt, n, steps, system[1] == "batch"))
                times[system].append(time.perf_counter() - t0)
                cpu[system] += time.process_time() - cpu0
                lm.clear_cache()
        after = {system: lm.stats for system, lm in lms.items()}
    finally:
        for lm in lms.values():
            lm.cleanup()
        loop.close()
    rows = n * steps * reps
    out = []
    for system in systems:
        b, a = before[system], after[system]
        t0, t1 = b["engine_time"], a["engine_time"]
        per = {k[:-2]: (t1[k] - t0[k]) / rows * 1e6 for k in t1}
        out.append({
            "width": width, "n": n, "steps": steps, "prompt_len": prompt_len, "config": system[0],
            "pattern": system[1], "tuned": tune_allocator,
            "wall_us_per_row": round(statistics.median(times[system]) / (n * steps) * 1e6, 1),
            "cpu_us_per_row": round(cpu[system] / rows * 1e6, 1),
            "engine_thread_host_us": round(per["host"], 1),
            "engine_thread_step_us": round(per["step"], 1),
            "loop_deliver_us": round((a["logprobs"]["deliver_s"] - b["logprobs"]["deliver_s"]) / rows * 1e6, 1),
            "result_hops_per_step": round((a["logprobs"]["result_hops"] - b["logprobs"]["result_hops"])
                                          / (steps * reps), 2),
            "cache_hits": a["cache"]["hits"] - b["cache"]["hits"],
        })
    return out


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
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                    help="defaults: the model's default options (output cache on); nocache: cache_size=0")
    ap.add_argument("--patterns", nargs="+", default=["await", "batch"], choices=["await", "batch"])
    ap.add_argument("--glibc-defaults", action="store_true",
                    help="leave glibc's allocator as it is (the engine build tunes it on CPU)")
    ap.add_argument("--out", default=str(_HERE / "results" / "host.json"))
    args = ap.parse_args(argv)
    results = []
    systems = [(c, p) for c in args.configs for p in args.patterns]
    for width in args.width:
        for n in args.n:
            capture = capture_cost(width)
            for cell in measure(width, n, args.steps, args.prompt_len, args.reps, systems, not args.glibc_defaults):
                cell["capture_us_per_row"] = capture
                results.append(cell)
                print(json.dumps(cell), flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
