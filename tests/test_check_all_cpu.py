"""CPU tests of the GPU check's wrapper (benchmarks/gpu/check_all.sh with --no-kit): the budget
ends a run with RESUME before a task that does not fit, a finished task is published under $OUT
and never run again, and the summary lists every task."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu" / "check_all.sh"
TASKS = ("env", "controller", "model", "rows-v2", "rows-v1", "rows-v2-bf16", "bench-v2-graphs", "bench-v1-graphs",
         "smc-requests-v2", "smc-requests-v1", "smc-mask-overlap-v1", "bench-v2-eager", "bench-v1-eager", "bench-more")


def _run(tmp_path: pathlib.Path, budget: int, *args: str) -> subprocess.CompletedProcess:
    import sys

    env = {**os.environ, "GENLM_CHECK_STATE": str(tmp_path / "state"), "OUT": str(tmp_path / "out"),
           "GENLM_CHECK_BUDGET": str(budget), "PYTHON": sys.executable, "GENLM_VLM_CACHE": str(tmp_path / "models")}
    return subprocess.run(["bash", str(SCRIPT), "--no-kit", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_script_is_strict_bash():
    text = SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    # the check is the bench command under both runners, with CUDA graphs and eager
    assert "-m genlm_vlm bench --model-shape" in text and "enforce_eager=true" in text
    assert "VLLM_USE_V2_MODEL_RUNNER=$runner" in text


def test_budget_too_small_resumes_and_lists_every_task(tmp_path):
    proc = _run(tmp_path, 3)
    assert proc.returncode == 0, proc.stderr
    assert "RESUME" in proc.stdout and "env needs" in proc.stdout
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == list(TASKS)
    assert all(line.endswith("pending") for line in summary)


def test_a_finished_task_is_published_and_not_run_again(tmp_path):
    pytest.importorskip("vllm")
    first = _run(tmp_path, 300, "--only", "env")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "task env" in first.stdout and "ALL DONE" in first.stdout
    log = (tmp_path / "out" / "env" / "log.txt").read_text()
    assert '"vllm"' in log and '"torch"' in log
    assert "env: ok" in (tmp_path / "out" / "summary.txt").read_text()
    again = _run(tmp_path, 300, "--only", "env")
    assert again.returncode == 0 and "task env" not in again.stdout and "ALL DONE" in again.stdout


def test_rows_check_passes_on_the_demo_model(tmp_path):
    """benchmarks/gpu/rows_check.py (the check's correctness half) on the CPU: float32 rows of
    the demo model against transformers, within 2e-3, and its files written."""
    pytest.importorskip("vllm")
    import json
    import runpy

    mod = runpy.run_path(str(ROOT / "benchmarks" / "gpu" / "rows_check.py"), run_name="rows_check")
    assert mod["main"](["--out", str(tmp_path), "--prompts", "4", "--max-len", "40"]) == 0
    doc = json.loads((tmp_path / "rows_check.json").read_text())
    assert doc["failed"] == 0 and doc["prompts"] == 4 and doc["worst_max_abs_diff"] < 2e-3
    assert doc["info"]["runner"] in ("V1", "V2") and doc["engine_opts"]["dtype"] == "float32"
    assert (tmp_path / "rows_check.txt").read_text().startswith("rows_check PASS")
