#!/usr/bin/env python
"""Scoring throughput against vLLM's own prompt log-probabilities, on the same records.

Workloads (random token ids, fixed seeds):

* ``distinct-N``: 16 records, each a distinct 200-token prompt plus a distinct N-token
  continuation (N = 20, 100, 300; ``--conts``);
* ``mc``: multiple choice, 4 prompts of 500 tokens with 8 continuations of 20 tokens each
  (32 records sharing 4 prompts).

Systems, in one process, on the same model and engine options (genlm_vlm's defaults applied to
both, ``block_size=32`` included):

* ``ours``: ``AsyncVirtualLM.from_name`` defaults, ``asyncio.gather(*(lm.score(p, c) ...))``
  (vLLM's prompt log-probabilities through genlm_vlm's scoring path);
* ``rows``: the same model with ``method="rows"`` (one full row per prefix: the path before
  the scoring path existed); ``--rows-for`` picks the workloads (slow on long continuations);
* ``vllm``: a plain ``vllm.LLM``: ``generate([prompt + continuation ...],
  SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False))``, summing the
  continuation's entries.

Both engines' prefix caches (and our output cache) are emptied before every timed run; each
repetition runs the systems one after another (ours, vllm, rows; then vllm, rows, ours; ...),
one warm-up repetition first,
then ``--reps`` timed ones; the table gives the median seconds and ``ours/vllm`` (vLLM's time
over ours: above 1 means ours is faster). ``check`` is the largest difference between the
records' summed log-probabilities of ours and vLLM's.

``--memory`` (run first, before the workloads fragment the heap) measures the peak memory added
while scoring one 300-token continuation (after a 200-token prompt), for each system, and for
``forward``: one row request over the same 500 tokens (the forward pass's own activations, which
every system pays). Two measures, each divided by one row (``4 x V`` bytes): *live*, the peak of
glibc's ``mallinfo2`` (bytes handed out and not freed; torch's CPU tensors come from malloc),
sampled every 0.2 ms; *resident*, the high-water mark of the process (reset through
``/proc/self/clear_refs`` after ``malloc_trim``), which also counts freed memory the allocator
keeps (genlm_vlm's glibc settings keep up to 512 MiB). ``*_over_forward`` subtracts the
forward's figure. Each is measured after two unmeasured runs of the same call. ``ours_20``: ours
on the same record cut to 20 continuation tokens (memory that does not grow with the tokens
scored stays flat). ``--cli`` times ``python -m genlm_vlm score ... --engine-opt
maxmodellen=64`` (the misspelled option must be named in under 2 s).

Example::

    .venv/bin/python benchmarks/bench_score.py --model llama-32k-mid --reps 3 --memory --cli
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

#: Both engines get these (and genlm_vlm's defaults, block_size=32 included). The test models
#: declare 512 positions; the multiple-choice records have 520 tokens, so both engines are told
#: 1024 (RoPE with random weights: positions past 512 are as valid as the others).
ENGINE_OPTS: dict[str, Any] = {
    "dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 1536 << 20, "seed": 0,
    "hf_overrides": {"max_position_embeddings": 1024},
}

Record = tuple[list[int], list[int]]


def workloads(conts: list[int], vocab: int) -> dict[str, list[Record]]:
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    out = {f"distinct-{n}": [(ids(200), ids(n)) for _ in range(16)] for n in conts}
    prompts = [ids(500) for _ in range(4)]
    out["mc"] = [(p, ids(20)) for p in prompts for _ in range(8)]
    return out


async def _ours(lm: Any, records: list[Record], method: str) -> list[float]:
    return list(await asyncio.gather(*(lm.score(p, c, method=method) for p, c in records)))


def run_ours(lm: Any, loop: asyncio.AbstractEventLoop, records: list[Record], method: str = "auto") -> list[float]:
    return loop.run_until_complete(_ours(lm, records, method))


def run_vllm(llm: Any, records: list[Record]) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p + c} for p, c in records], params, use_tqdm=False)
    sums = []
    for out, (p, c) in zip(outs, records, strict=True):
        entries = out.prompt_logprobs[len(p):]
        sums.append(sum(e[t].logprob for e, t in zip(entries, c, strict=True)))
    return sums


def _rss() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _live_bytes(libc: Any) -> int:
    """Bytes malloc has handed out and not taken back (heap chunks in use + mmapped chunks)."""
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def peak_added(fn: Any) -> tuple[int, int]:
    """``(peak resident bytes, peak live malloc bytes)`` added while ``fn()`` runs.

    Resident: the high-water mark (reset first, after ``malloc_trim``) minus the resident size
    before; it includes freed memory the allocator keeps. Live: ``mallinfo2`` sampled every
    0.2 ms from another thread (torch's CPU tensors come from malloc), minus the value before.
    """
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before, _ = _rss()
    base = _live_bytes(libc)
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _live_bytes(libc))
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        stop.set()
        sampler.join()
    return _rss()[1] - before, peak[0] - base


def time_cli() -> float:
    with tempfile.TemporaryDirectory() as d:
        src = pathlib.Path(d) / "in.jsonl"
        src.write_text('{"prompt": "a"}\n')
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "genlm_vlm", "score", str(src), str(pathlib.Path(d) / "out.jsonl"),
             "--engine-opt", "maxmodellen=64"],
            capture_output=True, text=True, timeout=120, cwd=_HERE.parent,
        )
        wall = time.perf_counter() - t0
    assert proc.returncode == 2 and "did you mean 'max_model_len'" in proc.stderr, proc.stderr
    return wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-32k-mid", help="a genlm_vlm.testing kind or a model directory")
    ap.add_argument("--conts", type=int, nargs="+", default=[20, 100, 300], help="continuation lengths")
    ap.add_argument("--workloads", nargs="+", default=None, help="subset of distinct-N and mc")
    ap.add_argument("--rows-for", nargs="*", default=["distinct-20", "distinct-100", "mc"],
                    help="workloads the row path runs on")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--memory", action="store_true", help="peak memory of one 300-token continuation")
    ap.add_argument("--cli", action="store_true", help="time the misspelled --engine-opt exit")
    ap.add_argument("--out", default="benchmarks/results/bench_score.json")
    args = ap.parse_args(argv)

    from vllm import LLM

    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.engine import CPU_ENGINE_OPTS, DEFAULT_ENGINE_OPTS, is_cpu_platform
    from genlm_vlm.testing import tiny_model_path

    path = args.model if os.path.isdir(args.model) else str(tiny_model_path(args.model))
    lm = AsyncVirtualLM.from_name(path, dict(ENGINE_OPTS))
    raw = dict(DEFAULT_ENGINE_OPTS)
    if is_cpu_platform():
        raw.update(CPU_ENGINE_OPTS)
    raw.update(ENGINE_OPTS)
    llm = LLM(model=path, **raw)
    vocab = lm.vocab_size
    loop = asyncio.new_event_loop()

    def fresh() -> None:
        lm.clear_cache()
        lm.llm.reset_prefix_cache()
        llm.reset_prefix_cache()

    cells = workloads(args.conts, min(vocab, len(lm.tokenizer)))
    if args.workloads:
        cells = {k: v for k, v in cells.items() if k in args.workloads}
    memory = None
    if args.memory:  # first, before the workloads fragment the heap
        rng = random.Random(9)
        one = [([rng.randrange(3, vocab) for _ in range(200)], [rng.randrange(3, vocab) for _ in range(300)])]
        row_bytes = 4 * vocab
        memory: dict[str, Any] = {}
        short = [(one[0][0], one[0][1][:20])]
        for system, fn in (("forward", lambda: lm.next_token_logprobs_sync(one[0][0] + one[0][1])),
                           ("ours", lambda: run_ours(lm, loop, one)), ("vllm", lambda: run_vllm(llm, one)),
                           ("rows", lambda: run_ours(lm, loop, one, "rows")),
                           ("ours_20", lambda: run_ours(lm, loop, short))):
            for _ in range(2):  # warm: allocator pools, oneDNN kernels for these shapes
                fresh()
                fn()
            fresh()
            resident, live = peak_added(fn)
            memory[system] = {"resident_bytes": resident, "live_bytes": live,
                              "resident_rows": round(resident / row_bytes, 1), "live_rows": round(live / row_bytes, 1)}
            ref = memory["forward"]
            memory[system]["live_rows_over_forward"] = round((live - ref["live_bytes"]) / row_bytes, 1)
            memory[system]["resident_rows_over_forward"] = round((resident - ref["resident_bytes"]) / row_bytes, 1)
        print(json.dumps({"memory_300": memory}), flush=True)
    results: list[dict[str, Any]] = []
    for name, records in cells.items():
        systems: dict[str, Any] = {
            "ours": lambda records=records: run_ours(lm, loop, records),
            "vllm": lambda records=records: run_vllm(llm, records),
        }
        if name in args.rows_for:
            systems["rows"] = lambda records=records: run_ours(lm, loop, records, "rows")
        times: dict[str, list[float]] = {s: [] for s in systems}
        sums: dict[str, list[float]] = {}
        work: dict[str, int] = {}
        order = list(systems.items())
        for rep in range(args.reps + 1):
            for system, fn in order[rep % 2:] + order[: rep % 2]:  # ours first, then vLLM first, ...
                fresh()
                before = lm.stats
                t0 = time.perf_counter()
                sums[system] = fn()
                dt = time.perf_counter() - t0
                if rep:
                    times[system].append(dt)
                if system == "ours":  # the work of one run of ours (vLLM computes every token)
                    after = lm.stats
                    work = {k: after["scoring"][k] - before["scoring"][k]
                            for k in ("requests", "tokens_computed", "tokens_cached")}
                    work["engine_steps"] = after["engine_steps"] - before["engine_steps"]
        cell: dict[str, Any] = {"workload": name, "records": len(records),
                                "tokens": sum(len(p) + len(c) for p, c in records),
                                **{f"ours_{k}": v for k, v in work.items()}}
        for system, ts in times.items():
            cell[system] = statistics.median(ts)
            cell[f"{system}_all"] = [round(t, 3) for t in ts]
        cell["ours/vllm"] = cell["vllm"] / cell["ours"]
        if "rows" in cell:
            cell["ours/rows"] = cell["rows"] / cell["ours"]
        cell["check"] = max(abs(a - b) for a, b in zip(sums["ours"], sums["vllm"], strict=True))
        results.append(cell)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in cell.items()}), flush=True)
    extra: dict[str, Any] = {"model": args.model, "engine_opts": ENGINE_OPTS, "vocab": vocab,
                             "scoring_stats": lm.stats["scoring"], "memory_300": memory}
    if args.cli:
        walls = [time_cli() for _ in range(3)]
        extra["cli_misspelled_opt_s"] = walls
        print(json.dumps({"cli_misspelled_opt_s": [round(w, 3) for w in walls]}), flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cells": results, **extra}, indent=1))
    print()
    print(f"{'workload':<14}{'vllm s':>9}{'ours s':>9}{'rows s':>9}{'ours/vllm':>11}{'ours/rows':>11}{'check':>10}")
    for c in results:
        rows = f"{c['rows']:9.2f}" if "rows" in c else f"{'-':>9}"
        ratio_rows = f"{c['ours/rows']:10.2f}x" if "ours/rows" in c else f"{'-':>11}"
        print(f"{c['workload']:<14}{c['vllm']:9.2f}{c['ours']:9.2f}{rows}{c['ours/vllm']:10.2f}x{ratio_rows}"
              f"{c['check']:10.1e}")
    lm.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
