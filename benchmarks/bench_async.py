#!/usr/bin/env python
"""Throughput benchmark: ``AsyncVirtualLM`` against raw vLLM and transformers.

Three workloads, each at several particle/batch counts N, on identical prompts for every system:

* ``smc``: N particles share one prompt and each extends it by one token per step for T steps
  (tokens sampled from the returned rows with a seeded ``torch.Generator``, so particles
  diverge). Our run records the per-step prompts; the other systems replay them.
* ``smc_resample``: the same, and every ``--resample-every``-th step first resamples the
  particles (ancestors drawn uniformly with the seeded generator: forks, drops, duplicates).
* ``unique``: ``--rounds`` rounds of N distinct random prompts of mixed lengths.

Systems:

* ``ours``: ``AsyncVirtualLM.from_name(model, engine_opts)`` with genlm_vlm's defaults (the
  output cache on); N coroutines ``await lm.next_token_logprobs(ids)`` per
  step/round under ``asyncio.gather`` (the output cache is cleared before every repetition).
* ``ceiling``: plain ``vllm.LLM.generate`` with ``SamplingParams(max_tokens=1,
  temperature=0, detokenize=False)`` and no logprobs: the cost of the engine alone.
* ``logprobs``: the same plain ``LLM`` with ``SamplingParams(..., logprobs=-1)``, its
  per-prompt ``{token_id: Logprob}`` dict converted to a dense ``[V]`` tensor.
* ``decode`` (SMC workloads only): the same plain ``LLM`` decoding N x T tokens in one
  ``generate(N prompts, max_tokens=T, ignore_eos=True)``: the least work vLLM does for T tokens
  per particle (no rows returned, no resampling). Its rate is N x T / time.
* ``requests`` (``--requests-baseline``): ``AsyncVirtualLM(sessions=False)``, every query a
  fresh request (the design before streaming-input sessions).
* ``hf``: transformers float32 batched forward (left padding + attention mask), last-position
  ``log_softmax``.

The baselines get each round's distinct prompts once (our batcher dedupes identical awaits the
same way; it matters at SMC step 0, where all particles share the prompt); every system is
credited with all N rows of a round. vLLM's prefix caches are reset before every repetition
(``--keep-prefix-cache`` to keep them), so the repetitions do the same work as the warm-up.
Each system gets one warm-up repetition, then ``--reps`` timed repetitions (interleaved
across systems, to spread machine noise evenly); the median is reported. Results go to
``<out>/<tag>.json`` and ``<out>/<tag>.png``. Each system's work is recorded too: engine
requests, and for ours and ``decode`` the tokens the engine computed (``stats['tokens']
['scheduled']``; for decode the prompt tokens vLLM did not find cached plus each decoded token
after the first, from ``RequestOutput.num_cached_tokens``) and ours' forks (``stats['forks']``).
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402

#: Engine options for both vLLM engines (genlm_vlm's defaults are added on top, see
#: ``genlm_vlm.engine``): float32 like the HF baseline, a small KV cache.
ENGINE_OPTS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 512,
    "kv_cache_memory_bytes": 1536 << 20,  # room for N=256 x 216 tokens of the mid model
    "seed": 0,
}

SYSTEMS = ("ours", "requests", "ceiling", "decode", "logprobs", "hf")
WORKLOADS = ("smc", "smc_resample", "unique")

#: Targets (checked at N >= TARGET_MIN_N): ours / ceiling and ours / logprobs=-1.
TARGET_VS_CEILING = 0.85
TARGET_VS_LOGPROBS = 5.0
#: ours / decode ceiling, per SMC workload.
TARGET_VS_DECODE = {"smc": 0.8, "smc_resample": 0.6}
TARGET_MIN_N = 64

log = logging.getLogger("bench_async")

from benchmarks.bench_async_systems import (  # noqa: E402
    HF,
    SMC_WORKLOADS,
    Measurement,
    Ours,
    PlainDecode,
    PlainVLLM,
    Plan,
    PlanItem,
    Workload,
    _random_prompts,
    build_plain_llm,
    make_plan,
    unique_workload,
)

FULL = {"n": [16, 64, 256], "steps": 16, "rounds": 4, "reps": 3, "prompt_len": 200,
        "min_len": 8, "max_len": 128, "logprobs_rows": 128.0, "resample_every": 4}
QUICK = {"n": [4, 16], "steps": 2, "rounds": 2, "reps": 1, "prompt_len": 16,
         "min_len": 4, "max_len": 32, "logprobs_rows": 8.0, "resample_every": 1}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-32k",
                   help="a model directory, or a model kind of genlm_vlm.testing built locally "
                        "(llama-32k: 2 layers, hidden 128; llama-32k-mid: 6 layers, hidden 512; "
                        "default: llama-32k)")

    def sized(flag: str, help: str, **kw: Any) -> None:
        key = flag[2:].replace("-", "_")
        p.add_argument(flag, default=None, help=f"{help} (default {FULL[key]}; --quick {QUICK[key]})", **kw)

    sized("--n", "particle / batch counts N", type=int, nargs="+")
    sized("--steps", "T: SMC steps", type=int)
    sized("--rounds", "rounds of N distinct prompts in the unique workload", type=int)
    sized("--reps", "timed repetitions after one warm-up (median reported)", type=int)
    sized("--prompt-len", "length of the shared SMC prompt", type=int)
    sized("--resample-every", "smc_resample: resample before every K-th step", type=int)
    sized("--min-len", "shortest unique prompt", type=int)
    sized("--max-len", "longest unique prompt", type=int)
    sized("--logprobs-rows", "rows the slow logprobs=-1 baseline is timed on per repetition "
          "(its first rounds; ours is compared on the same rounds)", type=float)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-opts", type=json.loads, default=None,
                   help="JSON dict merged over the engine options of both vLLM engines")
    p.add_argument("--batch-size", type=int, default=256, help="AsyncVirtualLM batch_size")
    p.add_argument("--keep-prefix-cache", action="store_true",
                   help="do not reset vLLM's prefix caches before each repetition")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--requests-baseline", action="store_true",
                   help="also time AsyncVirtualLM(sessions=False) (a second engine)")
    p.add_argument("--no-logprobs-baseline", action="store_true",
                   help="skip the logprobs=-1 baseline")
    p.add_argument("--quick", action="store_true", help="small smoke configuration (~1 min)")
    p.add_argument("--out", default=str(_HERE / "results"),
                   help="output directory (default: benchmarks/results)")
    p.add_argument("--tag", default="bench_async", help="file name stem of the outputs")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.n) < 1 or min(args.steps, args.rounds, args.reps) < 1:
        p.error("--n, --steps, --rounds and --reps must be >= 1")
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    return args


def _resolve_model(name: str) -> str:
    from genlm_vlm.testing import _SPECS, tiny_model_path

    if name in _SPECS:  # tiny kinds and the benchmark-only llama-32k-mid
        return str(tiny_model_path(name))
    return name


def _environment() -> dict[str, Any]:
    import transformers

    from genlm_vlm.engine import vllm_version

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "vllm": vllm_version(),
        "transformers": transformers.__version__,
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _verdict(ratio: float | None, target: float, n: int) -> str:
    if ratio is None:
        return "-"
    if n < TARGET_MIN_N:
        return f"{ratio:.2f}x"
    return f"{ratio:.2f}x {'PASS' if ratio >= target else 'MISS'}"


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _table(results: list[dict], ratios: list[dict]) -> str:
    by = {(r["workload"], r["n"], r["system"]): r for r in results}
    head = (
        f"{'workload':<12} {'N':>4} {'ours':>7} {'lat ms':>7} {'ceiling':>8} {'decode':>8} "
        f"{'lp=-1':>7} {'hf':>7} {'requests':>8}   {'ours/ceiling':<14} {'(best)':<6} "
        f"{'ours/decode':<14} {'ours/lp=-1':<15} {'ours/hf':<8} {'ours/requests':<13} {'computed':>8} "
        f"{'forks c/a/r':>11}"
    )
    lines = ["rates in rows/s (one row = one full-vocabulary next-token distribution); "
             "lat ms = mean time from await to row", head, "-" * len(head)]
    for ra in ratios:
        w, n = ra["workload"], ra["n"]

        def rate(s: str, w: str = w, n: int = n) -> float | None:
            r = by.get((w, n, s))
            return None if r is None else r["rows_per_s"]

        ours = by[(w, n, "ours")]
        fk = ours.get("forks")
        forks = "/".join(str(fk[k]) for k in ("copied", "aligned", "reprefilled")) if fk else "-"
        td = ra.get("decode_target")
        lines.append(
            f"{w:<12} {n:>4} {_fmt_rate(ours['rows_per_s']):>7} {ours['mean_latency_ms']:>7.1f} "
            f"{_fmt_rate(rate('ceiling')):>8} {_fmt_rate(rate('decode')):>8} "
            f"{_fmt_rate(rate('logprobs')):>7} {_fmt_rate(rate('hf')):>7} "
            f"{_fmt_rate(rate('requests')):>8}   "
            f"{_verdict(ra['ours_over_ceiling'], TARGET_VS_CEILING, n):<14} "
            f"{_x(ra['ours_over_ceiling_best']):<6} "
            f"{(_verdict(ra['ours_over_decode'], td, n) if td else '-'):<14} "
            f"{_verdict(ra['ours_over_logprobs'], TARGET_VS_LOGPROBS, n):<15} "
            f"{_x(ra['ours_over_hf']):<8} {_x(ra.get('ours_over_requests')):<13} "
            f"{_x(ra.get('computed_ours_over_decode')):>8} {forks:>11}"
        )
    lines.append(
        f"targets at N >= {TARGET_MIN_N}: ours/ceiling >= {TARGET_VS_CEILING}, ours/decode >= "
        + ", ".join(f"{v} ({k})" for k, v in TARGET_VS_DECODE.items())
        + f", ours/lp=-1 >= {TARGET_VS_LOGPROBS}. rows/s and ratios: medians over repetitions; "
        "(best): ratio of the fastest repetitions; computed: tokens the engine computed, ours over "
        "decode's (SMC workloads); forks c/a/r: ours' forks in the last repetition that copied "
        "their parent's tail block / found it block-aligned / re-prefilled it"
    )
    return "\n".join(lines)


def _plot(results: list[dict], ratios: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in results)]
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in results)]
    labels = {"ours": "ours (AsyncVirtualLM)", "requests": "ours, sessions=False",
              "ceiling": "vLLM generate max_tokens=1 per step",
              "decode": "vLLM decoding N x T tokens (decode ceiling)",
              "logprobs": "vLLM logprobs=-1", "hf": "HF transformers"}
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 5), squeeze=False)
    by = {(r["workload"], r["n"], r["system"]): r["rows_per_s"] for r in results}
    spread = {  # (below, above) the median: the slowest and fastest repetitions
        (r["workload"], r["n"], r["system"]): (
            r["rows_per_s"] - r["rows"] / max(r["times_s"]), r["rows"] / min(r["times_s"]) - r["rows_per_s"]
        ) for r in results if r["times_s"] and min(r["times_s"]) > 0
    }
    width = 0.8 / max(1, len(systems))
    for ax, w in zip(axes[0], workloads, strict=True):
        ns = sorted({r["n"] for r in results if r["workload"] == w})
        for k, s in enumerate(systems):
            xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(ns))]
            ys = [by.get((w, n, s), 0.0) for n in ns]
            err = [[spread.get((w, n, s), (0.0, 0.0))[j] for n in ns] for j in (0, 1)]
            ax.bar(xs, ys, width, label=labels[s], yerr=err, capsize=2, error_kw={"lw": 0.8})
        ax.set_xticks(range(len(ns)), [str(n) for n in ns])
        ax.set_xlabel("N (particles / concurrent awaits per step)")
        ax.set_ylabel("rows / s, log scale (row = one next-token distribution)")
        ax.set_yscale("log")
        ax.set_title(f"workload: {w}")
        ax.grid(axis="y", which="both", alpha=0.3)
        top = max((v for (w2, _, _), v in by.items() if w2 == w), default=1.0)
        ax.set_ylim(top=top * 3)
        for i, n in enumerate(ns):
            ra = next((r for r in ratios if r["workload"] == w and r["n"] == n), None)
            if ra is None:
                continue
            notes = [f"{label} {ra[key]:.2f}x" for key, label in (
                ("ours_over_ceiling", "ours/ceiling"), ("ours_over_decode", "ours/decode"),
                ("ours_over_hf", "ours/hf")) if ra.get(key) is not None]
            if notes:
                group = max(by.get((w, n, s), 0.0) for s in systems)
                ax.annotate("\n".join(notes), (i, group), ha="center", va="bottom", fontsize=7,
                            xytext=(0, 4), textcoords="offset points")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(title + "\nbars: median of repetitions; whiskers: slowest and fastest repetition",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """Largest |a - b| over entries finite in both (logprobs=-1 rows may hold -inf)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        ok = torch.isfinite(x) & torch.isfinite(y)
        worst = max(worst, float((x[ok] - y[ok]).abs().max()))
    return worst


def _rate(rows: float, times: Sequence[float], agg: Callable[[Sequence[float]], float]) -> float:
    t = agg(times)
    return rows / t if t > 0 else float("inf")


def measure_cell(
    cell: Workload, ours: Ours, baselines: Sequence[Any], args: argparse.Namespace, check: bool
) -> tuple[list[dict], dict, dict | None]:
    """Warm-up + ``args.reps`` interleaved repetitions of every system on one cell."""
    wname, n = cell.name, cell.n
    smc = wname in SMC_WORKLOADS
    resample = args.resample_every if wname == "smc_resample" else 0
    baselines = [b for b in baselines if smc or b.name != "decode"]
    per_system: dict[str, list[Measurement]] = {s.name: [] for s in (ours, *baselines)}
    plans: dict[str, Plan] | None = None
    for rep in range(args.reps + 1):  # rep 0 is the warm-up
        if smc:
            m, record = ours.run_smc(cell, args.steps, seed=args.seed + n, resample_every=resample)
            if rep == 0:
                cell.rounds = record  # every baseline replays the warm-up's step prompts
        else:
            m = ours.run(cell)
        if rep > 0:
            per_system["ours"].append(m)
        if plans is None:
            plans = {
                b.name: make_plan(cell, args.logprobs_rows if b.name == "logprobs" else None)
                for b in baselines
            }
        for b in baselines:
            if isinstance(b, PlainDecode | Ours):
                gc.collect()
                mb = b.run_cell(cell, args.steps) if isinstance(b, PlainDecode) else (
                    b.run_smc(cell, args.steps, seed=args.seed + n, resample_every=resample)[0]
                    if smc else b.run(cell))
                if rep > 0:
                    per_system[b.name].append(mb)
                continue
            plan = plans[b.name]
            if rep == 0 and b.name == "logprobs":  # a short warm-up for the slow path
                plan = [PlanItem(plan[0].index, plan[0].prompts[:8], 0.0)]
            gc.collect()
            mb = b.run(plan)
            if rep > 0:
                per_system[b.name].append(mb)
        log.info("%s N=%d rep %d/%d done%s", wname, n, rep, args.reps,
                 " (warm-up)" if rep == 0 else "")

    results: dict[str, dict] = {}
    for sname, ms in per_system.items():
        times = [m.seconds for m in ms]
        lats = [x for m in ms for x in m.latencies]
        results[sname] = {
            "workload": wname, "n": n, "system": sname, "rows": ms[-1].rows,
            "engine_prompts": ms[-1].engine_prompts, "calls": ms[-1].calls,
            "rounds": sorted(ms[-1].round_times), "times_s": times,
            "median_s": statistics.median(times),
            "rows_per_s": _rate(ms[-1].rows, times, statistics.median),
            "best_rows_per_s": _rate(ms[-1].rows, times, min),
            "mean_latency_ms": 1e3 * statistics.fmean(lats),
            "computed_tokens": ms[-1].computed_tokens, "forks": ms[-1].forks,
        }

    def ratio(sname: str, best: bool = False) -> float | None:
        """ours / ``sname`` in rows/s (median or best repetition of each), with ours timed on
        the rounds ``sname`` ran."""
        if sname not in results:
            return None
        agg = min if best else statistics.median
        rounds = results[sname]["rounds"]
        ours_times = [sum(m.round_times[i] for i in rounds) for m in per_system["ours"]]
        ours_rate = _rate(sum(len(cell.rounds[i]) for i in rounds), ours_times, agg)
        theirs = [m.seconds for m in per_system[sname]]
        return ours_rate / _rate(per_system[sname][-1].rows, theirs, agg)

    rc, rl, rd = ratio("ceiling"), ratio("logprobs"), ratio("decode")
    td = TARGET_VS_DECODE.get(wname)
    ra = {
        "workload": wname, "n": n,
        "ours_over_ceiling": rc, "ours_over_logprobs": rl, "ours_over_hf": ratio("hf"),
        "ours_over_decode": rd, "ours_over_decode_best": ratio("decode", True),
        "ours_over_requests": ratio("requests"), "decode_target": td,
        "computed_ours_over_decode": (results["ours"]["computed_tokens"] / results["decode"]["computed_tokens"])
        if "decode" in results and results["ours"]["computed_tokens"] and results["decode"]["computed_tokens"]
        else None,
        "decode_pass": None if rd is None or td is None or n < TARGET_MIN_N else rd >= td,
        "ours_over_ceiling_best": ratio("ceiling", True),
        "ours_over_logprobs_best": ratio("logprobs", True),
        "ours_over_hf_best": ratio("hf", True),
        "ceiling_target": TARGET_VS_CEILING, "logprobs_target": TARGET_VS_LOGPROBS,
        "ceiling_pass": None if rc is None or n < TARGET_MIN_N else rc >= TARGET_VS_CEILING,
        "logprobs_pass": None if rl is None or n < TARGET_MIN_N else rl >= TARGET_VS_LOGPROBS,
    }
    chk: dict[str, Any] | None = None
    if check:  # do the systems agree? (a few prompts of one round, through the sync path)
        probe = cell.unique_rounds()[min(1, len(cell.rounds) - 1)][:8]
        ref = list(ours.lm.batch_next_token_logprobs_sync(probe))
        chk = {"workload": wname, "n": n, "prompts": len(probe)}
        for b in baselines:
            if b.name not in ("ceiling", "decode", "requests"):
                chk[f"max_abs_diff_ours_vs_{b.name}"] = _max_diff(ref, b.call(probe))
    return list(results.values()), ra, chk


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("vllm").setLevel(logging.WARNING)
    wall0 = time.perf_counter()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    from genlm_vlm import AsyncVirtualLM

    model = _resolve_model(args.model)
    engine_opts = {**ENGINE_OPTS, **(args.engine_opts or {})}
    reset_prefix = not args.keep_prefix_cache
    log.info("model %s, engine options %s", model, engine_opts)

    t0 = time.perf_counter()
    lm = AsyncVirtualLM.from_name(model, dict(engine_opts), batch_size=args.batch_size)
    log.info("built AsyncVirtualLM in %.1fs (vocab %d, runner %s)",
             time.perf_counter() - t0, lm.vocab_size, lm.engine_info.runner)
    vocab = lm.vocab_size
    t0 = time.perf_counter()
    plain_llm = build_plain_llm(model, engine_opts)
    log.info("built plain vllm.LLM in %.1fs", time.perf_counter() - t0)
    hf = None
    if not args.no_hf:
        pad = lm.tokenizer.pad_token_id
        hf = HF(model, 0 if pad is None else int(pad))

    env = _environment()
    loop = asyncio.new_event_loop()
    ours = Ours(lm, loop, reset_prefix)
    baselines: list[Any] = [PlainVLLM(plain_llm, vocab, logprobs=False, reset_prefix=reset_prefix)]
    if any(w in SMC_WORKLOADS for w in args.workloads):
        baselines.append(PlainDecode(plain_llm, reset_prefix))
    lm_requests = None
    if args.requests_baseline:
        lm_requests = AsyncVirtualLM.from_name(model, dict(engine_opts), batch_size=args.batch_size, sessions=False)
        baselines.append(Ours(lm_requests, loop, reset_prefix, name="requests"))
    if not args.no_logprobs_baseline:
        baselines.append(PlainVLLM(plain_llm, vocab, logprobs=True, reset_prefix=reset_prefix))
    if hf is not None:
        baselines.append(hf)

    results: list[dict] = []
    ratios: list[dict] = []
    checks: list[dict] = []
    try:
        for wname in args.workloads:
            for n in args.n:
                if wname in SMC_WORKLOADS:
                    cell = Workload(wname, n, shared_prompt=_random_prompts(
                        1, vocab, args.prompt_len, args.prompt_len, seed=args.seed * 7919 + n)[0])
                else:
                    cell = unique_workload(n, args.rounds, vocab, args.min_len, args.max_len, args.seed)
                res, ra, chk = measure_cell(
                    cell, ours, baselines, args, check=(n == min(args.n))
                )
                results.extend(res)
                ratios.append(ra)
                if chk:
                    checks.append(chk)
    finally:
        loop.close()
        lm.cleanup()
        if lm_requests is not None:
            lm_requests.cleanup()
        try:
            plain_llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass

    table = _table(results, ratios)
    env["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    config = {
        "model": model, "model_arg": args.model, "vocab_size": vocab, "n": args.n,
        "steps": args.steps, "rounds": args.rounds, "reps": args.reps, "prompt_len": args.prompt_len,
        "resample_every": args.resample_every,
        "unique_len": [args.min_len, args.max_len], "workloads": args.workloads,
        "seed": args.seed, "engine_opts": engine_opts, "batch_size": args.batch_size,
        "reset_prefix_cache": reset_prefix, "quick": args.quick,
        "systems": ["ours", *[b.name for b in baselines]],
        "baselines_dedupe_within_step": True, "logprobs_rows": args.logprobs_rows,
    }
    doc = {
        "config": config, "environment": env, "results": results, "ratios": ratios,
        "checks": checks, "table": table, "wall_s": time.perf_counter() - wall0,
    }
    json_path = out_dir / f"{args.tag}.json"
    png_path = out_dir / f"{args.tag}.png"
    json_path.write_text(json.dumps(doc, indent=2))
    _plot(results, ratios, png_path,
          f"genlm_vlm bench_async: {pathlib.Path(model).name}, V={vocab}, smc T={args.steps}, "
          f"unique {args.rounds} rounds, median of {args.reps}")
    print()
    print(table)
    for c in checks:
        print("check:", ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                                  for k, v in c.items()))
    print(f"wrote {json_path} and {png_path} ({doc['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
