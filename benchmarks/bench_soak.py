#!/usr/bin/env python
"""Soak: is resident memory flat over a long run of SMC-shaped awaits?

What is measured. One ``AsyncVirtualLM`` (the local ``llama-32k`` tiny model; engine options float32,
``max_model_len`` 512, 1.5 GiB of KV cache) serves ``--waves`` waves of ``--per-wave`` awaits (default 60 x 1,080 = 64,800). A wave is one SMC run on a fresh random
shared prompt (``--prompt-len``): ``--particles`` particles (60) each await their next-token row
per step (``per_wave / particles`` steps: 18); every ``--resample-every`` steps (3) the particles
are resampled (ancestors drawn uniformly with duplicates: forks), and at the other steps a
particle whose await was cancelled is replaced by a copy of a survivor. Children of one parent
take the same next token half of the time, so identical prompts are in flight together
(duplicates, computed once). ``--cancel`` (30 %) of the awaits are cancelled before they
complete: half right after they were submitted, before the batcher dispatches them, half at a
random time within ``--cancel-window`` (20 ms, about one engine step) after dispatch: before the
engine admits them (never computed), while their request is in the engine (the row is dropped;
a request that spans several steps is aborted), or too late (the row is kept and checked). After each wave ``lm.clear_cache()`` drops the output cache and the idle sessions.

Every returned row is checked: shape ``[V]``, float32, no NaN, ``|logsumexp| < 1e-4``;
about ``--hf-checks`` rows per wave (4) are compared with
``genlm_vlm.testing.hf_reference_logprobs`` (max abs difference < 1e-4). A row off by 1e-4 or
more is recomputed alone from scratch after the wave (sessions released, prefix cache emptied):
if the served row differs from that by 1e-4 or more it is an error; if it equals it, the
difference is the kernels' arithmetic on that prompt (vLLM's CPU kernels against transformers),
which is reported but not counted. An exception other than the cancellations, or a failed
check, is an error. A heartbeat task (``asyncio.sleep(0.005)`` in a loop) gives the largest event-loop gap
while a wave's awaits run.

Per wave it prints the wall time, RSS (``/proc/self/statm``) and its change, the loop gap,
errors, rows and cancellations, and diagnostics: glibc ``mallinfo2()`` (bytes in use and free
inside malloc's arenas, bytes in mmap'd chunks), the resident part of the KV cache's mapping
(``/proc/self/smaps``), rows left in the capture sink, idle sessions, requests in vLLM's
scheduler and blocks in its prefix cache; with ``--diagnose`` also Python objects and torch
tensors counted through ``gc``. At the end: RSS at the end of warm-up (the first half of the
waves) and at the end, and the growth over the second half, taken as the mean RSS of the last
``--window`` (10) waves of the second half minus that of the first half (RSS moves by tens of MB
from one wave to the next as glibc keeps or returns free memory; the single points and a linear
trend are printed too). PASS: growth < ``--target-mb`` (50) and no error. Exit status 0 on
PASS, 1 on FAIL.

What grows, and the switches that find out, are in benchmarks/README.md.

Examples are in benchmarks/README.md. Results (configuration, memory-related environment
variables, git commit, every wave's figures, the summary, the engine's counters) go to ``--out``
as JSON (default ``benchmarks/results/soak.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import pathlib
import platform
import random
import statistics
import sys
import time
import tracemalloc
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

from benchmarks.soak_probes import (  # noqa: E402
    HF_TOL,
    MB,
    check_rows,
    engine_state,
    explain_misses,
    hf_check,
    kv_tensor,
    mallinfo,
    malloc_trim,
    mapping_resident,
    object_counts,
    peak_rss_bytes,
    rss_bytes,
)


# ----------------------------------------------------------------------------- the workload
class Heartbeat:
    """A task that wakes every ``period`` seconds; records the largest gap between wake-ups."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.max_gap = 0.0
        self._last = time.perf_counter()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        clock = time.perf_counter
        self._last = clock()
        while True:
            await asyncio.sleep(self.period)
            now = clock()
            self.max_gap = max(self.max_gap, now - self._last - self.period)
            self._last = now

    def reset(self) -> float:
        """The largest gap since the last reset; the next gap is counted from now (what blocked
        the loop between two measured stretches is not counted)."""
        gap, self.max_gap = self.max_gap, 0.0
        self._last = time.perf_counter()
        return gap

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


def _tokens(rng: random.Random, vocab: int) -> int:
    return rng.randrange(3, vocab)


async def run_wave(lm: Any, rng: random.Random, args: argparse.Namespace, vocab: int,
                   pick: random.Random | None = None) -> dict[str, Any]:
    """One SMC run; returns counts, the checked rows' errors and a sample for the HF check
    (drawn with ``pick``, so the workload is the same whatever ``--hf-checks``)."""
    pick = pick or random.Random(0)
    n = args.particles
    steps = max(1, args.per_wave // n)
    prompt = [_tokens(rng, vocab) for _ in range(rng.randint(args.prompt_len // 2, args.prompt_len))]
    particles = [list(prompt) for _ in range(n)]
    counts = Counter()
    errors: list[str] = []
    sample: list[tuple[list[int], torch.Tensor]] = []
    for step in range(steps):
        tasks = [asyncio.ensure_future(lm.next_token_logprobs(p)) for p in particles]
        counts["awaits"] += len(tasks)
        counts["distinct"] += len({tuple(p) for p in particles})
        doomed = [i for i in range(n) if rng.random() < args.cancel]
        rng.shuffle(doomed)
        early, late = doomed[: len(doomed) // 2], doomed[len(doomed) // 2 :]
        await asyncio.sleep(0)  # every task has submitted; the batcher's flush has not run yet
        for i in early:
            tasks[i].cancel()
        counts["cancel_early"] += len(early)
        # the rest at random times within about one engine step: before the engine admits the
        # query, while its request is in the engine (aborted), or too late (the row is kept)
        loop = asyncio.get_running_loop()
        for i in late:
            loop.call_later(rng.uniform(0.0, args.cancel_window), tasks[i].cancel)
        counts["cancel_late"] += len(late)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        survivors: list[int] = []
        rows: list[torch.Tensor] = []
        for i, r in enumerate(results):
            if isinstance(r, asyncio.CancelledError):
                counts["cancelled"] += 1
                continue
            if isinstance(r, BaseException):
                errors.append(f"step {step} particle {i}: {r!r}")
                continue
            if i in doomed:
                counts["cancel_too_late"] += 1
            survivors.append(i)
            rows.append(r)
        counts["rows"] += len(rows)
        if rows:
            bad = check_rows(rows, vocab)
            errors.extend(f"step {step}: {e}" for e in bad)
            # about hf_checks rows per wave, spread over the steps
            want = args.hf_checks / steps
            k = min(len(rows), int(want) + (pick.random() < want - int(want)), args.hf_checks - len(sample))
            for j in pick.sample(range(len(rows)), k):
                sample.append((list(particles[survivors[j]]), rows[j]))
        if not survivors:
            survivors = list(range(n))  # nothing came back (all cancelled): keep the particles
        # resample (forks with duplicates) or replace the cancelled particles by survivors' copies
        if (step + 1) % args.resample_every == 0:
            parents = [rng.choice(survivors) for _ in range(n)]
            counts["resamples"] += 1
        else:
            alive = set(survivors)
            parents = [i if i in alive else rng.choice(survivors) for i in range(n)]
        chosen: dict[int, int] = {}
        nxt = []
        for p in parents:
            if p in chosen and rng.random() < 0.5:
                tok = chosen[p]  # a duplicate: same parent, same token
            else:
                tok = chosen[p] = _tokens(rng, vocab)
            nxt.append(particles[p] + [tok])
        counts["forks"] += n - len(set(parents))
        particles = nxt
    return {"counts": dict(counts), "errors": errors, "sample": sample}


# ----------------------------------------------------------------------------- driver
#: Environment variables that change how memory behaves (recorded with the results).
_MEMORY_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def _git_state() -> dict[str, Any]:
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=_HERE.parent, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": git("status", "--porcelain", "--", "genlm_vlm").splitlines()}


def _slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (MB per wave)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _fmt_row(w: dict[str, Any]) -> str:
    mi = w.get("mallinfo") or {}
    st = w.get("engine") or {}
    kv = w.get("kv_resident_mb")
    parts = [
        f"wave {w['wave']:3d}",
        f"{w['wall_s']:6.1f}s",
        f"rss {w['rss_mb']:8.1f} MB",
        f"d {w['rss_delta_mb']:+7.1f}",
        f"gap {w['loop_gap_ms']:6.1f} ms",
        f"err {w['errors']}",
        f"rows {w['counts'].get('rows', 0)}",
        f"cancel {w['counts'].get('cancelled', 0)}",
        f"hf {w['hf_max_diff']:.1e}",
    ]
    if mi:
        parts.append(f"malloc used/free {mi['in_use_mb']:.0f}/{mi['free_mb']:.0f} MB mmap {mi['mmap_mb']:.0f}")
    if kv is not None:
        parts.append(f"kv-res {kv:.0f} MB")
    if st:
        parts.append(f"sink {st.get('sink_rows')} idle {st.get('idle_sessions')} sched {st.get('sched_requests')} "
                     f"cached-blocks {st.get('cached_blocks')}")
    if w.get("gc_collected") is not None:
        parts.append(f"gc {w['gc_collected']} objs -{w.get('gc_freed_mb', 0):.1f} MB")
    if w.get("trimmed_mb") is not None:
        parts.append(f"trim -{w['trimmed_mb']:.1f} MB")
    if w.get("tensors") is not None:
        parts.append(f"objs {w['objects']} tensors {w['tensors']} ({w['tensor_mb']:.1f} MB)")
    return "  ".join(parts)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.testing import tiny_model_path

    path = str(tiny_model_path(args.model)) if not os.path.isdir(args.model) else args.model
    opts = dict(ENGINE_OPTS)
    if args.kv_bytes is not None:
        if args.kv_bytes > 0:
            opts["kv_cache_memory_bytes"] = args.kv_bytes
        else:
            opts.pop("kv_cache_memory_bytes")  # genlm_vlm's default sizing
    opts.update(json.loads(args.engine_opts))
    if args.onednn_cache is not None:  # read by oneDNN when it first creates a primitive
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(args.onednn_cache)
    rss_start = rss_bytes()
    t0 = time.perf_counter()
    lm = AsyncVirtualLM.from_name(path, opts)
    build_s = time.perf_counter() - t0
    vocab = lm.vocab_size
    info = lm.engine_info
    kv = kv_tensor(lm)
    kv_bytes = None
    kv_addr = None
    if kv is not None:
        storage = kv.untyped_storage()
        kv_bytes, kv_addr = storage.nbytes(), storage.data_ptr()
    kv_map = mapping_resident(kv_addr) if kv_addr else None
    rss_built = rss_bytes()
    print(f"engine built in {build_s:.1f} s: RSS {rss_start / MB:.0f} -> {rss_built / MB:.0f} MB; "
          f"KV cache {info.kv_cache_tokens} tokens, {None if kv_bytes is None else round(kv_bytes / MB)} MB"
          + (f", resident {kv_map[1] / MB:.0f} of {kv_map[0] / MB:.0f} MB mapped" if kv_map else ""), flush=True)
    del kv

    rng = random.Random(args.seed)
    pick = random.Random(args.seed + 1)
    beat = Heartbeat()
    beat.start()
    waves: list[dict[str, Any]] = []
    prev = rss_bytes()
    warm_snapshot = None
    if args.tracemalloc:
        tracemalloc.start(args.tracemalloc_frames)
    half = args.waves // 2
    warm_types: Counter[str] | None = None
    type_growth: list[tuple[str, int]] = []
    all_errors: list[str] = []
    for wave in range(1, args.waves + 1):
        t_wave = time.perf_counter()
        beat.reset()
        result = await run_wave(lm, rng, args, vocab, pick)
        gap = beat.reset()
        wall = time.perf_counter() - t_wave
        hf_diff, misses = hf_check(path, result["sample"]) if args.hf_checks else (0.0, [])
        result["counts"]["hf_checked"] = len(result.pop("sample"))
        lm.clear_cache()
        miss_errors, numeric = await explain_misses(lm, misses)
        errors = result["errors"] + miss_errors
        lm.clear_cache()
        rec: dict[str, Any] = {"wave": wave, "wall_s": round(wall, 3), "loop_gap_ms": round(gap * 1e3, 2),
                               "errors": len(errors), "hf_max_diff": hf_diff, "counts": result["counts"]}
        rec["hf_numeric_misses"] = len(numeric)
        if misses:
            rec["hf_misses"] = misses
        rec["engine"] = engine_state(lm)
        rec["gc_count"] = list(gc.get_count())
        if args.gc_collect:
            before = mallinfo()
            rec["gc_collected"] = gc.collect()
            after = mallinfo()
            if before and after:
                rec["gc_freed_mb"] = round(before["in_use_mb"] - after["in_use_mb"], 2)
        if args.diagnose:
            types, tensors, tbytes = object_counts()
            rec.update(objects=sum(types.values()), tensors=tensors, tensor_mb=round(tbytes / MB, 2))
            if wave == half:
                warm_types = types
            elif wave == args.waves and warm_types is not None:
                type_growth = [(k, v) for k, v in (types - warm_types).most_common(15)]
        now = rss_bytes()
        rec["rss_mb"] = round(now / MB, 2)
        rec["rss_delta_mb"] = round((now - prev) / MB, 2)
        rec["mallinfo"] = mallinfo()
        if kv_addr:
            m = mapping_resident(kv_addr)
            rec["kv_resident_mb"] = None if m is None else round(m[1] / MB, 1)
        if args.malloc_trim:
            t_trim = time.perf_counter()
            malloc_trim()
            rec["trim_ms"] = round((time.perf_counter() - t_trim) * 1e3, 2)
            after = rss_bytes()
            rec["trimmed_mb"] = round((now - after) / MB, 2)
            rec["rss_after_trim_mb"] = round(after / MB, 2)
            now = after
        prev = now
        if args.tracemalloc and wave == half:
            warm_snapshot = tracemalloc.take_snapshot()
        waves.append(rec)
        all_errors.extend(f"wave {wave}: {e}" for e in errors)
        print(_fmt_row(rec), flush=True)
        for e in errors[:5]:
            print(f"    ERROR {e}", flush=True)
        for e in numeric[:5]:
            print(f"    NOTE {e}", flush=True)
    await beat.stop()

    trace_top: list[str] = []
    if args.tracemalloc:
        snap = tracemalloc.take_snapshot()
        if warm_snapshot is not None:
            stats = snap.compare_to(warm_snapshot, "traceback" if args.tracemalloc_frames > 1 else "lineno")
            trace_top = [str(s) for s in stats[:15]]
        tracemalloc.stop()

    stats = lm.stats
    lm.cleanup()
    key = "rss_after_trim_mb" if args.malloc_trim else "rss_mb"
    series = [w[key] for w in waves]
    rss_warm, rss_end = series[half - 1], series[-1]
    # RSS moves by tens of MB from wave to wave as glibc keeps or returns free memory: compare
    # the means of the last few waves of each half, and report the two single points too
    win = max(1, min(args.window, half))
    warm_mean = statistics.fmean(series[half - win : half])
    end_mean = statistics.fmean(series[-win:])
    growth = end_mean - warm_mean
    xs = list(range(half, len(series)))
    slope = _slope(xs, series[half:]) if len(xs) > 1 else 0.0
    totals = Counter()
    for w in waves:
        totals.update(w["counts"])
    memory_ok = growth < args.target_mb
    ok = memory_ok and not all_errors
    summary = {
        "rss_start_mb": round(rss_start / MB, 1),
        "rss_built_mb": round(rss_built / MB, 1),
        "rss_first_wave_mb": series[0],
        "rss_warm_mb": rss_warm,
        "rss_end_mb": rss_end,
        "growth_second_half_mb": round(growth, 2),
        "growth_second_half_points_mb": round(rss_end - rss_warm, 2),
        "window_waves": win,
        "rss_warm_mean_mb": round(warm_mean, 2),
        "rss_end_mean_mb": round(end_mean, 2),
        "trend_second_half_mb": round(slope * (len(series) - half), 2),
        "max_second_half_mb": max(series[half:]),
        "growth_total_mb": round(rss_end - series[0], 2),
        "peak_rss_mb": None if peak_rss_bytes() is None else round(peak_rss_bytes() / MB, 1),  # type: ignore[operator]
        "median_wave_s": statistics.median(w["wall_s"] for w in waves),
        "max_loop_gap_ms": max(w["loop_gap_ms"] for w in waves),
        "max_hf_diff": max(w["hf_max_diff"] for w in waves),
        "hf_checked": sum(w["counts"].get("hf_checked", 0) for w in waves),
        "hf_numeric_misses": sum(w["hf_numeric_misses"] for w in waves),
        "errors": len(all_errors),
        "totals": dict(totals),
        "target_mb": args.target_mb,
        "memory_pass": memory_ok,
        "pass": ok,
    }
    return {
        "config": {**{k: v for k, v in vars(args).items()}, "engine_opts": opts, "model_path": path,
                   "engine_info": {k: getattr(info, k) for k in ("mode", "max_num_seqs", "block_size",
                                                               "kv_cache_tokens", "vllm_version")},
                   "kv_cache_bytes": kv_bytes,
                   "env": {v: os.environ.get(v) for v in _MEMORY_ENV}, "git": _git_state()},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "machine": platform.machine(), "cpus": os.cpu_count()},
        "waves": waves,
        "summary": summary,
        "errors": all_errors[:100],
        "object_growth_second_half": type_growth,
        "tracemalloc_top": trace_top,
        "stats": {k: stats.get(k) for k in ("engine_steps", "engine_requests", "sessions", "engine_time", "logprobs", "cache")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waves", type=int, default=60)
    ap.add_argument("--per-wave", type=int, default=1080, help="awaits per wave (particles x steps)")
    ap.add_argument("--particles", type=int, default=60)
    ap.add_argument("--prompt-len", type=int, default=240, help="shared prompt length: uniform in [L/2, L]")
    ap.add_argument("--resample-every", type=int, default=3)
    ap.add_argument("--cancel", type=float, default=0.3, help="fraction of awaits cancelled")
    ap.add_argument("--cancel-window", type=float, default=0.02,
                    help="seconds after dispatch within which the in-flight cancellations fall")
    ap.add_argument("--hf-checks", type=int, default=4, help="rows per wave compared with transformers")
    ap.add_argument("--target-mb", type=float, default=50.0, help="RSS growth allowed over the second half")
    ap.add_argument("--window", type=int, default=10,
                    help="the last WINDOW waves of each half: their mean RSS is compared")
    ap.add_argument("--quick", action="store_true", help="6 waves (about 20 s, mostly start-up)")
    ap.add_argument("--model", default="llama-32k")
    ap.add_argument("--kv-bytes", type=int, default=None,
                    help="kv_cache_memory_bytes (default 1.5 GiB; 0: genlm_vlm's sizing)")
    ap.add_argument("--engine-opts", default="{}", help="JSON merged into the engine options")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--diagnose", action="store_true", help="count Python objects and torch tensors per wave (gc)")
    ap.add_argument("--gc-collect", action="store_true", help="gc.collect() after each wave (records what it freed)")
    ap.add_argument("--malloc-trim", action="store_true", help="glibc malloc_trim(0) after each wave")
    ap.add_argument("--onednn-cache", type=int, default=None,
                    help="set ONEDNN_PRIMITIVE_CACHE_CAPACITY before the engine is built (oneDNN's default: 1024)")
    ap.add_argument("--tracemalloc", action="store_true", help="diff tracemalloc snapshots: warm-up vs end")
    ap.add_argument("--tracemalloc-frames", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/soak.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.waves = min(args.waves, 6)
    if args.waves < 2 or args.particles < 1 or args.per_wave < args.particles:
        ap.error("need --waves >= 2 and --per-wave >= --particles >= 1")

    doc = asyncio.run(soak(args))
    s = doc["summary"]
    print(f"\nawaits {s['totals'].get('awaits', 0)}, rows {s['totals'].get('rows', 0)} (all checked), "
          f"cancelled {s['totals'].get('cancelled', 0)}, errors {s['errors']}, max loop gap {s['max_loop_gap_ms']:.1f} ms; "
          f"{s['hf_checked']} rows compared with transformers: max diff {s['max_hf_diff']:.2e}"
          + (f", {s['hf_numeric_misses']} at or above {HF_TOL:g} but equal to the prompt recomputed alone "
             "(the kernels' arithmetic, not an error)" if s["hf_numeric_misses"] else ""))
    half = args.waves // 2
    print(f"RSS: built {s['rss_built_mb']:.0f} MB, wave 1 {s['rss_first_wave_mb']:.0f} MB, "
          f"end of warm-up (wave {half}) {s['rss_warm_mb']:.1f} MB, end {s['rss_end_mb']:.1f} MB, "
          f"max in the second half {s['max_second_half_mb']:.1f} MB, peak {s['peak_rss_mb']} MB")
    print(f"growth over the second half: {s['growth_second_half_mb']:+.1f} MB (mean of the last {s['window_waves']} waves "
          f"of each half: {s['rss_warm_mean_mb']:.1f} -> {s['rss_end_mean_mb']:.1f}; end point minus warm-up "
          f"point {s['growth_second_half_points_mb']:+.1f} MB; linear trend {s['trend_second_half_mb']:+.1f} MB), "
          f"target < {args.target_mb:.0f} MB: {'PASS' if s['memory_pass'] else 'FAIL'}")
    print(f"RESULT: {'PASS' if s['pass'] else 'FAIL'} (memory {'flat' if s['memory_pass'] else 'not flat'}, "
          f"{s['errors']} error(s))")
    if doc["object_growth_second_half"]:
        print("objects gained over the second half:", doc["object_growth_second_half"])
    for line in doc["tracemalloc_top"][:10]:
        print("  tracemalloc:", line)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    return 0 if s["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
