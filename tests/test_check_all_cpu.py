"""CPU tests of the GPU check's driver (benchmarks/gpu/check_all.py) and of the harness it runs
systems with (benchmarks/harness.py): the plan, resuming, the budget, the result files, and one
process per system, with stand-in systems (no engine, no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from benchmarks.gpu import check_all  # noqa: E402

DRIVER = ROOT / "benchmarks" / "gpu" / "check_all.py"


def _args(*extra: str):
    return check_all.parse_args(["run", *extra])


def test_plan_order_stages_and_blocks():
    plan = check_all.make_plan(_args())
    names = [t.name for t in plan]
    assert names[:5] == ["env", "controller", "build", "correct-v2", "correct-v1"]
    assert [t.stage for t in plan] == sorted(t.stage for t in plan)  # priority order = stage order
    assert all(t.est_s > 0 for t in plan)
    first = next(t for t in plan if t.block)
    assert first.name == "bench-qwen3-v2-graphs" and first.block["runner"] == "v2" and first.block["graphs"]
    assert set(first.block["systems"]) == {"ours", "plain", "ours_cuda"}
    cells = {c["name"]: c for c in first.block["cells"]}
    assert {"identity", "smc-64", "smc-256", "rows-256", "async-256", "smc-1024", "e2e-64"} <= set(cells)
    assert ["ours_cuda", "generate"] in cells["rows-256"]["ratios"]
    assert cells["smc-256"]["jobs"]["structured"][:2] == ["plain", "structured"]
    for t in plan:
        if t.block:
            assert t.block["engine_opts"]["enforce_eager"] is (not t.block["graphs"])  # graphs are vLLM's default
            assert t.block["engine_opts"]["gpu_memory_utilization"] * len(t.block["systems"]) <= 0.9
    assert [t.name for t in check_all.make_plan(_args("--stage", "2"))] == ["bench-qwen3-v2-graphs", "bench-qwen3-v1-graphs"]
    llama = next(t for t in plan if t.name == "bench-llama8b-v2-graphs")
    assert llama.block["engine_opts"]["load_format"] == "dummy"
    assert names.index("build-llama-config") < names.index("bench-llama8b-v2-graphs")


def _drive(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, str(DRIVER), "run", "--fake", "--state-dir", str(tmp_path / "state"),
                           "--out", str(tmp_path / "out"), *extra], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


@pytest.mark.slow
def test_fake_run_resumes_and_writes_results(tmp_path):
    # 1. a budget that fits the first task only: it stops, says to resume, and has published
    first = _drive(tmp_path, "--budget", "30")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "RESUME" in first.stdout and "controller" in first.stdout
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["tasks"]["env"]["status"] == "done" and state["tasks"]["controller"]["status"] == "pending"
    assert "| env |" in (tmp_path / "out" / "results.md").read_text()

    # 2. stage 1 only, then everything: nothing runs twice
    assert _drive(tmp_path, "--stage", "1", "--budget", "600").returncode == 0
    done = _drive(tmp_path, "--budget", "600")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ALL DONE" in done.stdout
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert all(t["status"] == "done" and t["runs"] == 1 for t in state["tasks"].values()), state
    plan = check_all.make_plan(_args("--fake"))
    assert set(state["tasks"]) == {t.name for t in plan}

    rows = harness.read_jsonl(tmp_path / "out" / "results.jsonl")
    cells = [r for r in rows if r["kind"] == "cell"]
    blocks = [t for t in plan if t.block]
    assert len(cells) == sum(len(t.block["cells"]) for t in blocks)
    rows_cell = next(r for r in cells if r["task"] == "bench-qwen3-v2-graphs" and r["cell"] == "rows-256")
    assert set(rows_cell["rates"]) == {"ours", "generate", "ours_cuda"}
    assert all(v > 0 for v in rows_cell["rates"].values()) and rows_cell["ratios"]["ours_cuda/generate"] > 0
    assert len(rows_cell["walls"]["ours"]) == 5  # the cell's repetitions
    # one process per system, none of them the driver
    infos = next(r for r in rows if r["kind"] == "systems" and r["task"] == "bench-qwen3-v2-graphs")["infos"]
    pids = [i["pid"] for i in infos.values()]
    assert len(set(pids)) == 3
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## Benchmark cells" in md and "ours_cuda/generate" in md


def test_block_stops_at_the_deadline_and_resumes_without_repeating(tmp_path):
    task = check_all.fake_task(check_all.make_plan(_args())[6])  # bench-qwen3-v1-graphs
    state = check_all.State(tmp_path / "state")
    names = [c["name"] for c in task.block["cells"]]
    # time for the build and the first cell only (each fake cell is estimated at 1 s)
    res = check_all.run_block(task, state, deadline=time.monotonic() + 30)
    assert res["status"] == "done"  # generous deadline: everything
    assert state.task(task.name)["cells"] == names
    state2 = check_all.State(tmp_path / "state2")
    first = check_all.run_block(task, state2, deadline=time.monotonic() + 0.5)
    assert first["status"] == "partial"
    partial = list(state2.task(task.name)["cells"])
    assert len(partial) < len(names)
    second = check_all.run_block(task, state2, deadline=time.monotonic() + 60)
    assert second["status"] == "done" and state2.task(task.name)["cells"] == names
    measured = [r["cell"] for r in harness.read_jsonl(state2.results) if r.get("kind") == "cell"]
    assert sorted(measured) == sorted(names)  # no cell measured twice


def test_alternate_rotates_and_respects_the_deadline():
    order: list[str] = []

    def job(label):
        def run():
            order.append(label)
            return {"wall_s": 0.5, "units": 1}
        return run

    out = harness.alternate({"a": job("a"), "b": job("b"), "c": job("c")}, reps=3)
    assert order == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert out["complete"] and all(len(v) == 3 for v in out["runs"].values())
    assert harness.median_rate(out["runs"]["a"], "units") == 2.0
    cut = harness.alternate({"a": job("a")}, reps=5, deadline=time.monotonic() - 1)
    assert not cut["complete"] and cut["runs"]["a"] == [] and "a" in cut["warm"]


def test_system_process_errors_and_separate_processes(tmp_path):
    a = harness.SystemProcess("a", check_all.FAKE_FACTORY, {"scale": 10}, tmp_path)
    b = harness.SystemProcess("b", check_all.FAKE_FACTORY, {"scale": 10}, tmp_path)
    harness.start_systems([a, b])
    try:
        assert a.info["pid"] != b.info["pid"] != os.getpid()
        with pytest.raises(harness.SystemError_, match="fake job failure"):
            a.run("fail")
        assert a.run("work", units=3)["units"] == 3  # the system survives a failed job
    finally:
        a.close()
        b.close()
    bad = harness.SystemProcess("bad", check_all.FAKE_FACTORY, {"fail_build": True}, tmp_path)
    with pytest.raises(harness.SystemError_, match="fake build failure"):
        harness.start_systems([bad])


def test_results_markdown_tables():
    plan = check_all.make_plan(_args("--fake", "--stage", "2"))
    state = check_all.State.__new__(check_all.State)
    state.data = {"tasks": {plan[0].name: {"status": "done", "wall_s": 3.0, "runs": 1, "cells": []}}}
    rows = [{"kind": "cell", "task": plan[0].name, "cell": "rows-256", "rates": {"ours": 100.0, "generate": 125.0},
             "ratios": {"ours/generate": 0.8}, "extra": {"row_device": "cpu"}}]
    md = check_all.results_markdown(rows, plan, state)
    assert "| bench-qwen3-v2-graphs | 2 |" in md and "| done |" in md
    assert "| ours/generate |" in md.replace("| ours/s | generate/s | ours/generate |", "| ours/generate |")
    assert "0.8" in md and "| pending |" in md


@pytest.mark.slow
def test_real_systems_on_cpu(tmp_path):
    """The GPU check's real systems (benchmarks/gpu/gpu_systems.py), each in its process, on the
    CPU build with the shipped demo model: every job of the plan's cells runs, lm.smc is
    byte-identical to its Python reference, and the ratios come out."""
    pytest.importorskip("vllm")
    model = str(ROOT / "genlm_vlm" / "data" / "demo-model")
    opts = {"dtype": "float32", "max_model_len": 512, "seed": 0, "enforce_eager": True,
            "kv_cache_memory_bytes": 256 << 20}
    cells = [
        {"name": "identity", "est_s": 1, "reps": 0,
         "jobs": {"identity": ["ours", "identity", {"n": 4, "t": 6}, "particle_steps"]}},
        {"name": "smc-4", "est_s": 1, "reps": 1, "ratios": [["engine", "decode"], ["engine", "structured"]],
         "jobs": {"engine": ["ours", "smc", {"n": 4, "t": 6}, "particle_steps"],
                  "decode": ["plain", "decode", {"n": 4, "per_from": "engine"}, "particle_steps"],
                  "structured": ["plain", "structured", {"n": 4, "t": 6}, "particle_steps"]}},
        {"name": "rows-8", "est_s": 1, "reps": 1, "ratios": [["ours", "generate"]],
         "jobs": {"ours": ["ours", "rows", {"n": 8, "length": 12}, "rows"],
                  "generate": ["plain", "generate1", {"n": 8, "length": 12}, "rows"]}},
        {"name": "async-4", "est_s": 1, "reps": 1, "ratios": [["ours", "decode"]],
         "jobs": {"ours": ["ours", "async_smc", {"n": 4, "t": 3}, "particle_steps"],
                  "decode": ["plain", "decode", {"n": 4, "per": 3}, "particle_steps"]}},
    ]
    task = check_all.Task("cpu-block", 2, 10, block={
        "model": "demo", "path": model, "runner": "v1", "graphs": False, "systems": ["ours", "plain"],
        "engine_opts": opts, "cells": cells, "build_s": 60})
    state = check_all.State(tmp_path / "state")
    res = check_all.run_block(task, state, deadline=time.monotonic() + 600)
    rows = harness.read_jsonl(state.results)
    errors = [r.get("error") for r in rows if r.get("error")]
    assert res["status"] == "done" and not errors, errors
    got = {r["cell"]: r for r in rows if r["kind"] == "cell"}
    assert got["identity"]["extra"]["identical"] is True
    assert got["identity"]["extra"]["mode"] == "sessions"
    for name, ratio in (("smc-4", "engine/decode"), ("smc-4", "engine/structured"), ("rows-8", "ours/generate"),
                        ("async-4", "ours/decode")):
        assert got[name]["ratios"][ratio] > 0, (name, got[name])
    assert got["rows-8"]["extra"]["row_device"] == "cpu"
    infos = next(r for r in rows if r["kind"] == "systems")["infos"]
    assert infos["ours"]["runner"] == infos["plain"]["runner"] == "v1"
    assert infos["ours"]["pid"] != infos["plain"]["pid"]
