#!/usr/bin/env python
"""The whole GPU check in one prepared, resumable command (run by ``check_all.sh``, which first
adds a transferred kit part and installs the kit once every part is there; see CHECK.md).

A fixed plan of tasks, in priority order, each with an estimate of its seconds:

* stage 1 (correctness): the environment (versions, GPU, the host's CUDA libraries), the
  controller step on CUDA (``controller_check.py``), the models (``gpu_check.py --phase build``:
  Qwen3-0.6B's shape with random weights; Llama-3-8B's shape as a config and tokenizer only, its
  weights drawn by vLLM's ``load_format="dummy"``), then ``gpu_check.py --phase correctness`` under
  Model Runner V2 (bf16 and fp32; default and chunked scheduling; the bf16 noise-floor rule;
  sessions and forks on: the JSON's ``forks``), under V1, and under V2 with CUDA graphs;
* stage 2 (benchmarks): blocks of (model, runner, CUDA graphs or eager), most important first.
  In a block every system runs in its own process (``benchmarks/harness.py``) with the same
  engine options: ``ours`` (``AsyncVirtualLM``, rows to the CPU), ``ours_cuda``
  (``output_device="cuda"``; first block only) and ``plain`` (``vllm.LLM``). Cells: ``identity``
  (``lm.smc`` byte-identical to its Python reference), ``smc-N`` (``lm.smc`` against vLLM
  decoding as many tokens, and against vLLM's structured outputs under the same regex: the
  bench_smc_engine cell), ``rows-256`` (256 distinct 40-token prompts: ours with CPU and with CUDA
  output against ``generate(max_tokens=1)``), ``async-256`` (bench_async's SMC workload against
  decoding) and ``e2e-64`` (bench_e2e's AWRS program through the bridge; skipped without
  genlm-control). A warm-up of every system, then repetitions whose order rotates.

Each invocation runs the pending tasks in order while the budget (``--budget``; 570 s under
``$OUT``) holds: a task whose estimate no longer fits ends the invocation, and the same command
resumes there. State and results live in ``--state-dir`` (default ``/tmp/genlm_gpu_check``):
``state.json`` and ``results.jsonl``; every invocation rewrites ``results.md`` (tables),
``results.jsonl`` and each task's own output files into ``$OUT`` (or ``--out``), also after each
task. ``--stage 1|2|3|all`` restricts the plan; ``--fake`` replaces every command and system by
stand-ins with no GPU and no vLLM (the CPU test of this driver).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402

MODELS_DIR = "/tmp/genlm_gpu_models"
BUILD_VERSION = 1  # gpu_check.py's
SYSTEMS_FACTORY = {"ours": "benchmarks.gpu.gpu_systems:ours", "ours_cuda": "benchmarks.gpu.gpu_systems:ours",
                   "plain": "benchmarks.gpu.gpu_systems:plain"}
FAKE_FACTORY = "benchmarks.harness:fake_system"


@dataclasses.dataclass
class Task:
    name: str
    stage: int
    est_s: float
    argv: list[str] | None = None  # a command (run from the checkout)
    block: dict[str, Any] | None = None  # or a block of benchmark cells
    outputs: tuple[str, ...] = ()  # files the command writes into its output folder


# =========================================================================== the plan
def model_path(kind: str, models_dir: str) -> str:
    return f"{models_dir}/{kind}-v{BUILD_VERSION}" if kind == "qwen3-0.6b" else f"{models_dir}/{kind}-config-v1"


def cells_for(first: bool, ns: Sequence[int]) -> list[dict[str, Any]]:
    """The cells of a block (``first``: the default configuration, which also gets CUDA output
    rows, the async workload, the e2e program and N = 1024)."""
    cells: list[dict[str, Any]] = [{"name": "identity", "est_s": 25, "reps": 0,
                                    "jobs": {"identity": ["ours", "identity", {"n": 16, "t": 24}, "particle_steps"]}}]
    for n in ns:
        cells.append({"name": f"smc-{n}", "est_s": 15 + n / 16, "reps": 3, "ratios": [["engine", "decode"], ["engine", "structured"]],
                      "jobs": {"engine": ["ours", "smc", {"n": n, "t": 48}, "particle_steps"],
                               "decode": ["plain", "decode", {"n": n, "per_from": "engine"}, "particle_steps"],
                               "structured": ["plain", "structured", {"n": n, "t": 48}, "particle_steps"]}})
    rows = {"ours": ["ours", "rows", {"n": 256, "length": 40}, "rows"],
            "generate": ["plain", "generate1", {"n": 256, "length": 40}, "rows"]}
    ratios = [["ours", "generate"]]
    if first:
        rows["ours_cuda"] = ["ours_cuda", "rows", {"n": 256, "length": 40}, "rows"]
        ratios.append(["ours_cuda", "generate"])
    cells.append({"name": "rows-256", "est_s": 15, "reps": 5, "ratios": ratios, "jobs": rows})
    if first:
        cells.append({"name": "async-256", "est_s": 30, "reps": 3, "ratios": [["ours", "decode"]],
                      "jobs": {"ours": ["ours", "async_smc", {"n": 256, "t": 16}, "particle_steps"],
                               "decode": ["plain", "decode", {"n": 256, "per": 16}, "particle_steps"]}})
        cells.append({"name": "smc-1024", "est_s": 80, "reps": 2, "ratios": [["engine", "decode"], ["engine", "structured"]],
                      "jobs": {"engine": ["ours", "smc", {"n": 1024, "t": 48}, "particle_steps"],
                               "decode": ["plain", "decode", {"n": 1024, "per_from": "engine"}, "particle_steps"],
                               "structured": ["plain", "structured", {"n": 1024, "t": 48}, "particle_steps"]}})
        cells.append({"name": "e2e-64", "est_s": 40, "reps": 2, "ratios": [["bridge", "decode"]],
                      "jobs": {"bridge": ["ours", "e2e", {"n": 64, "t": 24}, "particle_steps"],
                               "decode": ["plain", "decode", {"n": 64, "per_from": "bridge"}, "particle_steps"]}})
    return cells


def block_task(name: str, stage: int, model: str, runner: str, graphs: bool, first: bool,
               args: argparse.Namespace) -> Task:
    systems = ["ours", "plain"] + (["ours_cuda"] if first else [])
    util = round(0.85 / len(systems), 3)
    opts: dict[str, Any] = {"dtype": "bfloat16", "max_model_len": 1024, "seed": 0, "enforce_eager": not graphs,
                            "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30), "gpu_memory_utilization": util}
    if model == "llama-8b":
        opts["load_format"] = "dummy"  # random weights drawn by vLLM: no 16 GB checkpoint to write
    cells = cells_for(first, (64, 256))
    build_s = (90 if graphs else 40) + (30 if model == "llama-8b" else 0)
    est = build_s + cells[0]["est_s"]  # the block starts when its build and first cell fit
    return Task(name, stage, est, block={"model": model, "path": model_path(model, args.models_dir), "runner": runner,
                                         "graphs": graphs, "systems": systems, "engine_opts": opts, "cells": cells,
                                         "build_s": build_s})


def make_plan(args: argparse.Namespace) -> list[Task]:
    py = sys.executable
    gc = [py, "benchmarks/gpu/gpu_check.py"]
    cache = ["--cache-dir", args.models_dir]
    q = ["--models", "qwen3-0.6b"]
    summary = ("gpu_check_summary.txt", "gpu_check.json", "gpu_check_logs.txt")
    plan = [
        Task("env", 1, 20, [py, "benchmarks/gpu/check_all.py", "env"], outputs=("env.json",)),
        Task("controller", 1, 45, [py, "benchmarks/gpu/controller_check.py", "--device", "cuda", "--reps", "10",
                                   "--out", "{out}"], outputs=("controller_check.json", "controller_check.txt")),
        Task("build", 1, 40, gc + ["--phase", "build"] + q + cache + ["--out", "{out}"], outputs=summary),
        Task("correct-v2", 1, 80, gc + ["--phase", "correctness", "--runners", "v2", "--scheds", "default"] + q + cache
             + ["--out", "{out}"], outputs=summary),
        Task("correct-v1", 1, 40, gc + ["--phase", "correctness", "--runners", "v1", "--dtypes", "bfloat16",
                                        "--scheds", "default"] + q + cache + ["--out", "{out}"], outputs=summary),
        block_task("bench-qwen3-v2-graphs", 2, "qwen3-0.6b", "v2", True, True, args),
        block_task("bench-qwen3-v1-graphs", 2, "qwen3-0.6b", "v1", True, False, args),
        Task("correct-v2-chunked", 3, 70, gc + ["--phase", "correctness", "--runners", "v2", "--scheds", "chunked"] + q
             + cache + ["--out", "{out}"], outputs=summary),
        Task("correct-v2-graphs", 3, 60, gc + ["--phase", "correctness", "--runners", "v2", "--dtypes", "bfloat16",
                                               "--scheds", "default", "--compiled"] + q + cache + ["--out", "{out}"],
             outputs=summary),
        block_task("bench-qwen3-v2-eager", 3, "qwen3-0.6b", "v2", False, False, args),
        block_task("bench-qwen3-v1-eager", 3, "qwen3-0.6b", "v1", False, False, args),
        Task("build-llama-config", 3, 15, [py, "benchmarks/gpu/check_all.py", "config-only", "--model", "llama-8b",
                                           "--models-dir", args.models_dir]),
        block_task("bench-llama8b-v2-graphs", 3, "llama-8b", "v2", True, False, args),
    ]
    if args.fake:
        plan = [fake_task(t) for t in plan]
    return [t for t in plan if args.stage == "all" or t.stage == int(args.stage)]


def fake_task(task: Task) -> Task:
    """The same task with no GPU: a command that prints its name; systems without an engine."""
    if task.argv is not None:
        return dataclasses.replace(task, argv=[sys.executable, "-c", f"print('fake {task.name}')"], outputs=())
    block = json.loads(json.dumps(task.block))
    block["fake"] = True
    block["build_s"] = 1
    for cell in block["cells"]:
        cell["est_s"] = 1
    return dataclasses.replace(task, block=block, est_s=1 + len(block["cells"]))


# =========================================================================== state and outputs
class State:
    """``state.json``: each task's status (``done``, ``failed``, ``partial``, ``timeout``) and the
    cells of a block already measured; ``results.jsonl``: one line per task or cell result."""

    def __init__(self, state_dir: pathlib.Path) -> None:
        self.dir = pathlib.Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "state.json"
        self.results = self.dir / "results.jsonl"
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {"tasks": {}}

    def task(self, name: str) -> dict[str, Any]:
        return self.data["tasks"].setdefault(name, {"status": "pending", "cells": [], "runs": 0})

    def pending(self, task: Task, retry_failed: bool) -> bool:
        status = self.task(task.name)["status"]
        return status in ("pending", "partial") or (retry_failed and status in ("failed", "timeout"))

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)

    def record(self, row: dict[str, Any]) -> None:
        harness.append_jsonl(self.results, {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row})


def results_markdown(rows: Sequence[dict[str, Any]], plan: Sequence[Task], state: State) -> str:
    lines = ["# GPU check results", "", "## Tasks", ""]
    lines.append(harness.markdown_table(
        [{"task": t.name, "stage": t.stage, "est_s": t.est_s, **state.task(t.name)} for t in plan],
        ["task", "stage", ("est_s", "est. s"), "status", ("wall_s", "last s"), "runs", ("note", "note")]))
    cells = [r for r in rows if r.get("kind") == "cell"]
    if cells:
        lines += ["", "## Benchmark cells (rates: work per second, medians; ratios of the medians)", ""]
        table = []
        for r in cells:
            row = {"block": r["task"], "cell": r["cell"]}
            row.update({f"{k}/s": v for k, v in (r.get("rates") or {}).items()})
            row.update(r.get("ratios") or {})
            for key in ("identical", "mode", "row_device", "skipped"):
                if key in (r.get("extra") or {}):
                    row[key] = r["extra"][key]
            table.append(row)
        cols = list(dict.fromkeys(k for row in table for k in row))
        lines.append(harness.markdown_table(table, cols))
    return "\n".join(lines) + "\n"


def publish(out: pathlib.Path, plan: Sequence[Task], state: State) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = harness.read_jsonl(state.results)
    if state.results.exists():
        shutil.copyfile(state.results, out / "results.jsonl")
    (out / "results.md").write_text(results_markdown(rows, plan, state))
    for sub in sorted(state.dir.glob("task-*")):
        if sub.is_dir():
            shutil.copytree(sub, out / sub.name, dirs_exist_ok=True)


# =========================================================================== running
def run_command(task: Task, state: State, timeout: float) -> dict[str, Any]:
    outdir = state.dir / f"task-{task.name}"
    outdir.mkdir(parents=True, exist_ok=True)
    argv = [a.replace("{out}", str(outdir)) for a in task.argv or []]
    if argv[1:2] == ["benchmarks/gpu/gpu_check.py"]:
        argv += ["--time-limit", str(max(30, int(timeout) - 5))]
    env = harness.child_env({"OUT": str(outdir)})
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = None, f"{e.stdout or ''}{e.stderr or ''}\n(killed after {timeout:.0f} s)"
    (outdir / "log.txt").write_text(text if isinstance(text, str) else str(text))
    wall = time.perf_counter() - t0
    status = "timeout" if rc is None else "done" if rc == 0 else "failed"
    return {"status": status, "rc": rc, "wall_s": round(wall, 1), "tail": str(text)[-1500:]}


def _job_call(sysproc: harness.SystemProcess, job: str, kwargs: dict[str, Any], derived: dict[str, Any],
              seed_box: list[int], fake: bool) -> Callable[[], dict[str, Any]]:
    def call() -> dict[str, Any]:
        kw = dict(kwargs)
        src = kw.pop("per_from", None)
        if src is not None:  # decode as many tokens as that job's warm-up computed rows
            kw["per"] = max(1, round(derived.get(src, kw["n"] * 48) / kw["n"]))
        kw.setdefault("seed", seed_box[0])
        if fake:
            return sysproc.run("work", units=int(kw.get("n", 1)))
        return sysproc.run(job, **kw)
    return call


def run_cell(cell: dict[str, Any], procs: dict[str, harness.SystemProcess], fake: bool,
             deadline: float) -> dict[str, Any]:
    derived: dict[str, Any] = {}
    seed_box = [0]
    jobs: dict[str, Callable[[], dict[str, Any]]] = {}
    work: dict[str, str] = {}
    for label, (system, job, kwargs, work_key) in cell["jobs"].items():
        call = _job_call(procs[system], job, kwargs, derived, seed_box, fake)
        work[label] = "units" if fake else work_key

        def tracked(call: Callable[[], dict[str, Any]] = call, label: str = label) -> dict[str, Any]:
            res = call()
            derived.setdefault(label, res.get(work[label]) or 0)
            return res
        jobs[label] = tracked

    # every repetition uses a new seed (new prompts for the rows cells), the same for all systems
    labels = list(jobs)
    counter = {"n": 0}

    def seeded(label: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            seed_box[0] = counter["n"] // len(labels)
            counter["n"] += 1
            return jobs[label]()
        return run

    out = harness.alternate({lab: seeded(lab) for lab in labels}, int(cell.get("reps", 3)), deadline=deadline)
    runs = out["runs"] if cell.get("reps") else {lab: [res] for lab, res in out["warm"].items()}
    rates = {lab: harness.median_rate([r for r in rs if r.get("wall_s")], work[lab]) for lab, rs in runs.items()}
    ratios = {f"{a}/{b}": harness.ratio(rates.get(a), rates.get(b)) for a, b in cell.get("ratios", [])}
    extra: dict[str, Any] = {}
    for lab, res in out["warm"].items():
        for key in ("identical", "mode", "row_device", "skipped", "forks_copied", "tokens", "distinct_texts",
                    "mask_ms_per_step", "step_ms_per_step", "python_wall_s"):
            if key in res:
                extra[key if key in ("identical", "mode", "row_device", "skipped") else f"{lab}.{key}"] = res[key]
    return {"rates": rates, "ratios": ratios, "extra": extra, "complete": out["complete"],
            "walls": {lab: [round(r["wall_s"], 4) for r in rs if r.get("wall_s")] for lab, rs in runs.items()}}


def run_block(task: Task, state: State, deadline: float) -> dict[str, Any]:
    block = task.block or {}
    fake = bool(block.get("fake"))
    done = set(state.task(task.name)["cells"])
    todo = [c for c in block["cells"] if c["name"] not in done]
    logs = state.dir / f"task-{task.name}"
    env = harness.child_env({"VLLM_USE_V2_MODEL_RUNNER": "1" if block["runner"] == "v2" else "0",
                             "VLLM_CACHE_ROOT": str(state.dir / "vllm_cache"),
                             "TRITON_CACHE_DIR": str(state.dir / "triton_cache")})
    procs: dict[str, harness.SystemProcess] = {}
    for name in block["systems"]:
        spec = {"model": block["path"], "engine_opts": block["engine_opts"],
                "output_device": "cuda" if name == "ours_cuda" else "cpu"}
        procs[name] = harness.SystemProcess(name, FAKE_FACTORY if fake else SYSTEMS_FACTORY[name], spec, logs, env)
    t0 = time.perf_counter()
    try:
        harness.start_systems(list(procs.values()), together=True, timeout=max(30.0, deadline - time.monotonic()))
        infos = {n: p.info for n, p in procs.items()}
        state.record({"kind": "systems", "task": task.name, "build_s": round(time.perf_counter() - t0, 1), "infos": infos})
        for cell in todo:
            if time.monotonic() + cell["est_s"] > deadline:
                return {"status": "partial", "note": f"budget: stopped before {cell['name']}"}
            try:
                res = run_cell(cell, procs, fake, deadline)
            except harness.SystemError_ as e:
                state.record({"kind": "cell", "task": task.name, "cell": cell["name"], "error": str(e)[-3000:]})
                state.task(task.name)["cells"].append(cell["name"])
                state.save()
                continue
            state.record({"kind": "cell", "task": task.name, "cell": cell["name"], "model": block["model"],
                          "runner": block["runner"], "graphs": block["graphs"], **res})
            state.task(task.name)["cells"].append(cell["name"])
            state.save()
    finally:
        for p in procs.values():
            p.close(timeout=60)
    return {"status": "done", "wall_s": round(time.perf_counter() - t0, 1)}


def run_plan(args: argparse.Namespace) -> int:
    t_start = args.t0 if args.t0 else time.time()
    budget = args.budget if args.budget is not None else (570.0 if os.environ.get("OUT") else 0.0)
    deadline = time.monotonic() + (budget - (time.time() - t_start) if budget else 10**9)
    out = pathlib.Path(os.environ.get("OUT") or args.out)
    state = State(pathlib.Path(args.state_dir))
    plan = make_plan(args)
    failures = 0
    stopped = None
    for task in plan:
        if not state.pending(task, args.retry_failed):
            continue
        left = deadline - time.monotonic()
        if task.est_s > left:
            stopped = f"{task.name} (estimate {task.est_s:.0f} s, {left:.0f} s left)"
            break
        print(f"[check_all {time.strftime('%H:%M:%S')}] {task.name} (stage {task.stage}, ~{task.est_s:.0f} s)", flush=True)
        entry = state.task(task.name)
        entry["runs"] += 1
        try:
            res = run_command(task, state, left - 5) if task.argv else run_block(task, state, deadline)
        except Exception as e:  # noqa: BLE001 - recorded; the next task still runs
            res = {"status": "failed", "note": f"{type(e).__name__}: {str(e)[-1500:]}"}
        entry.update({k: v for k, v in res.items() if k in ("status", "wall_s", "note", "rc")})
        state.record({"kind": "task", "task": task.name, **res})
        state.save()
        failures += res["status"] == "failed"
        print(f"[check_all] {task.name}: {res['status']} {res.get('note', '')}", flush=True)
        publish(out, plan, state)
        if res["status"] in ("partial", "timeout"):
            stopped = f"{task.name} ({res['status']})"
            break
    left = [t.name for t in plan if state.pending(t, False)]
    state.save()
    publish(out, plan, state)
    if stopped or left:
        print(f"[check_all] RESUME: run the same command again ({len(left)} task(s) left; stopped at {stopped})")
    else:
        print("[check_all] ALL DONE: every task of this plan has run (see results.md)")
    return 1 if failures else 0


# =========================================================================== small commands
def cmd_env(args: argparse.Namespace) -> int:
    """Versions, the GPU, and the host's CUDA libraries against torch's pins (env.json)."""
    from importlib import metadata

    info: dict[str, Any] = {"python": sys.version.split()[0]}
    for mod in ("torch", "vllm", "triton", "xgrammar", "transformers", "genlm_vlm"):
        try:
            m = __import__(mod)
            info[mod] = {"version": getattr(m, "__version__", "?"), "file": getattr(m, "__file__", "?")}
        except Exception as e:  # noqa: BLE001 - reported
            info[mod] = {"error": f"{type(e).__name__}: {e}"}
    try:
        import torch

        info["cuda"] = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
                        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}
    except Exception as e:  # noqa: BLE001 - reported
        info["cuda"] = {"error": repr(e)}
    info["nvidia"] = {d.metadata["Name"]: d.version for d in metadata.distributions()
                      if (d.metadata["Name"] or "").lower().startswith(("nvidia-", "cuda-"))}
    try:
        from genlm_vlm.engine import sessions_supported

        info["sessions"] = sessions_supported()
    except Exception as e:  # noqa: BLE001 - reported
        info["sessions"] = repr(e)
    out = pathlib.Path(os.environ.get("OUT") or ".")
    (out / "env.json").write_text(json.dumps(info, indent=1, default=str))
    print(json.dumps(info, indent=1, default=str))
    return 0 if "error" not in info.get("vllm", {}) else 1


def cmd_config_only(args: argparse.Namespace) -> int:
    """A model folder with ``config.json`` and a tokenizer but no weights (vLLM's
    ``load_format="dummy"`` draws them): the Llama-3-8B shape without writing 16 GB."""
    from benchmarks.gpu import gpu_models as gc
    from genlm_vlm.testing import _train_tokenizer

    dest = pathlib.Path(model_path(args.model, args.models_dir))
    if (dest / "config.json").exists():
        print(f"{dest} exists")
        return 0
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    s = gc.SHAPES[args.model]
    _train_tokenizer("qwen2" if s.arch == "qwen3" else "llama", s.tokenizer_vocab, s.corpus_chars).save_pretrained(tmp)
    gc.make_config(args.model).save_pretrained(tmp)
    os.replace(tmp, dest)
    print(f"wrote {dest}")
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", default="run", choices=("run", "plan", "env", "config-only"))
    p.add_argument("--stage", default="all", choices=("1", "2", "3", "all"))
    p.add_argument("--budget", type=float, default=None, help="seconds for this invocation (default 570 under $OUT)")
    p.add_argument("--t0", type=float, default=None, help="epoch seconds the budget counts from (check_all.sh's start)")
    p.add_argument("--state-dir", default=os.environ.get("GENLM_GPU_CHECK_STATE", "/tmp/genlm_gpu_check"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check_all"))
    p.add_argument("--models-dir", default=MODELS_DIR)
    p.add_argument("--kv-cache-gib", type=float, default=12.0, help="KV cache of each benchmark system")
    p.add_argument("--retry-failed", action="store_true", help="run failed and timed-out tasks again")
    p.add_argument("--fake", action="store_true", help="stand-ins for every command and system (CPU test)")
    p.add_argument("--model", default="llama-8b")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "env":
        return cmd_env(args)
    if args.command == "config-only":
        return cmd_config_only(args)
    if args.command == "plan":
        for t in make_plan(args):
            print(f"stage {t.stage}  ~{t.est_s:4.0f} s  {t.name}")
        return 0
    return run_plan(args)


if __name__ == "__main__":
    sys.exit(main())
