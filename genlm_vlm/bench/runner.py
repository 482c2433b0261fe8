"""Running a benchmark: the system processes, the cells with alternating repetitions, the checks
of the work every system did, and the medians and ratios (see :mod:`genlm_vlm.bench`)."""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import harness
from .workloads import SAME_STEPS, Cell, Lane, plan, processes_for, same_step_lengths


@dataclass
class Config:
    """What the command was asked to run (checked by :mod:`genlm_vlm.bench.cli`)."""

    model: str
    workloads: list[str]
    ns: list[int]
    max_tokens: int
    reps: int
    constraint: str
    engine_opts: dict[str, Any]
    out: pathlib.Path
    engine_path: str = "auto"
    mask_overlap: bool = False
    product: bool = False


def _drop_bulk(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if k not in ("scores",)}


def check_cell(cell: Cell, runs: dict[str, list[dict[str, Any]]], warm: dict[str, dict[str, Any]]) -> list[str]:
    """Problems with the work the cell's systems did (an empty list: all checks passed)."""
    problems: list[str] = []
    n = cell.n
    for label, rs in runs.items():
        for i, r in enumerate(rs, 1):
            where = f"{cell.workload} N={n} {label} rep {i}"
            want = n * cell.lanes[0].kwargs.get("rounds", 1)
            if cell.workload == "rows" and r["rows"] != want:
                problems.append(f"{where}: {r['rows']} rows returned, {want} asked")
            if "particles" in r and r["particles"] != n:
                problems.append(f"{where}: {r['particles']} particles, {n} asked")
            if cell.workload == "scoring" and r["records"] != n:
                problems.append(f"{where}: {r['records']} records scored, {n} asked")
            if cell.workload == "lm-eval" and r["requests"] != 4 * n:
                problems.append(f"{where}: {r['requests']} requests answered, {4 * n} asked")
            if not r.get(cell.work_key):
                problems.append(f"{where}: no work counted ({cell.work_key} = {r.get(cell.work_key)})")
    if cell.workload == "smc":
        path = cell.lanes[0].kwargs.get("engine_path", "auto")
        for label in [x for x in ("lm.smc", "lm.smc (bursts)", "lm.smc (mask overlap)") if x in runs]:
            for i, (a, b) in enumerate(zip(runs[label], runs["python reference"], strict=True), 1):
                if a["fingerprint"] != b["fingerprint"]:
                    problems.append(f"smc N={n} rep {i}: {label} and the Python reference drew different "
                                    "particles with the same seed")
        asked = [("lm.smc", path), ("lm.smc (bursts)", "bursts")]
        for label, want in [(x, p) for x, p in asked if x in runs and p != "auto"]:  # auto: whichever it picks
            for i, r in enumerate(runs[label], 1):
                if r.get("engine_path", want) != want:
                    problems.append(f"smc N={n} rep {i}: {label} asked for engine_path={want!r} and ran on "
                                    f"{r.get('engine_path')!r} ({r.get('fallback')})")
        for label in [x for x in ("vllm decode", SAME_STEPS) if x in runs and x in warm]:
            want = round(n * warm[label]["tokens_asked"])
            for r in runs[label]:
                if r["particle_steps"] != want:
                    problems.append(f"smc N={n} {label}: {r['particle_steps']} tokens, {want} asked")
    return problems


def agreement(runs: dict[str, list[dict[str, Any]]]) -> float | None:
    """The largest difference between two systems' scores of the same inputs (scoring, lm-eval)."""
    lanes = [rs for rs in runs.values() if rs and "scores" in rs[0]]
    if len(lanes) < 2:
        return None
    diffs = [abs(x - y) for a, b in zip(lanes[0], lanes[1], strict=True)
             for x, y in zip(a["scores"], b["scores"], strict=True)]
    return max(diffs, default=None)


def run_cell(cell: Cell, procs: dict[str, harness.SystemProcess], reps: int,
             tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """One cell: warm-up, ``reps`` alternating rounds, medians, ratios, checks."""
    shared: dict[str, Any] = {}

    def job(lane: Lane) -> Callable[[int], dict[str, Any]]:
        def go(rep: int) -> dict[str, Any]:
            kwargs = dict(lane.kwargs, rep=rep)
            if lane.label == SAME_STEPS:  # sequences that end where lm.smc's live count drops
                kwargs["lengths"] = shared["lengths"]
            elif lane.job == "decode":  # as many tokens per sequence as lm.smc's particles took
                kwargs["tokens"] = shared["tokens"]
            res = procs[lane.process].run(lane.job, **kwargs)
            if lane.label == "lm.smc" and rep == 0:
                shared["tokens"] = max(1, round(res["particle_steps"] / cell.n))
                live = res.get("rows_per_step")  # without it (an older result): decode's own lengths
                shared["lengths"] = same_step_lengths(live, cell.n) if live else [shared["tokens"]] * cell.n
            if lane.job == "decode":
                res["tokens_asked"] = sum(kwargs["lengths"]) / cell.n if "lengths" in kwargs else kwargs["tokens"]
            return res
        return go

    done = harness.alternate({lane.label: job(lane) for lane in cell.lanes}, reps, tick=tick)
    runs, warm = done["runs"], done["warm"]
    rates = {label: harness.median_rate(rs, cell.work_key) for label, rs in runs.items()}
    main = cell.lanes[0].label
    ratios = {label: rates[main] / rate for label, rate in rates.items() if label != main and rate and rates[main]}
    # the same from each system's process CPU seconds (less disturbed than wall by other work on the machine)
    cpu = {label: harness.median_rate(rs, cell.work_key, "cpu_s") for label, rs in runs.items()}
    cpu_ratios = {label: cpu[main] / rate for label, rate in cpu.items() if label != main and rate and cpu[main]}
    # each round's own ratio (the systems ran one after the other in it): how far the ratio moves
    per_round = {label: harness.round_ratios(runs[main], rs, cell.work_key) for label, rs in runs.items() if label != main}
    return {
        "workload": cell.workload, "n": cell.n, "unit": cell.unit, "work_key": cell.work_key, "main": main,
        "rates": rates, "ratios": ratios, "cpu_ratios": cpu_ratios, "round_ratios": per_round,
        "order": done["order"], "agreement": agreement(runs),
        "problems": check_cell(cell, runs, warm),
        "runs": {label: [_drop_bulk(r) for r in rs] for label, rs in runs.items()},
    }


def run(cfg: Config, progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every cell of ``cfg``; returns the result object written as JSON (see report)."""
    from tqdm import tqdm

    cells = plan(cfg.workloads, cfg.ns, cfg.max_tokens, cfg.constraint, cfg.engine_path, cfg.mask_overlap,
                 cfg.product)
    names = processes_for(cfg.workloads)
    spec = {"model": cfg.model, "engine_opts": cfg.engine_opts}
    logs = cfg.out / "logs"
    from .systems import FACTORIES

    procs = {name: harness.SystemProcess(name, FACTORIES[name], spec, logs) for name in names}
    result: dict[str, Any] = {"load_start": _loadavg(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    total = sum(len(c.lanes) * (cfg.reps + 1) for c in cells) + len(procs)
    bar = tqdm(total=total, desc="bench", unit="job", disable=not progress, leave=False)
    try:
        for p in procs.values():  # one after the other: builds do not compete for the device
            bar.set_postfix_str(f"building {p.name}")
            harness.start_systems([p])
            bar.update(1)
        result["systems"] = {name: {**p.info, "ready_s": p.ready_s} for name, p in procs.items()}
        result["cells"] = []
        for cell in cells:
            bar.set_postfix_str(f"{cell.workload} N={cell.n}")
            res = run_cell(cell, procs, cfg.reps, tick=lambda: bar.update(1))
            result["cells"].append(res)
            # what is done so far survives a later failure or a kill (bench.json replaces it)
            (cfg.out / "partial.json").write_text(json.dumps(result, default=str) + "\n")
            for problem in res["problems"]:
                log(f"bench: check failed: {problem}")
    finally:
        bar.close()
        for p in procs.values():
            p.close()
    result["load_end"] = _loadavg()
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result["ok"] = not any(c["problems"] for c in result["cells"])
    return result


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not on this platform
        return None
