"""Smoke test of benchmarks/bench_async.py: the ``--quick`` configuration runs end to end.

Runs the script in a subprocess (it builds its own engines) and checks the exit status and the
shape of the JSON and PNG it writes. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_async.py"

pytest.importorskip("vllm")
pytest.importorskip("matplotlib")

RESULT_KEYS = {
    "workload", "n", "system", "rows", "engine_prompts", "calls", "times_s", "median_s",
    "rows_per_s", "mean_latency_ms",
}
RATIO_KEYS = {
    "workload", "n", "ours_over_ceiling", "ours_over_logprobs", "ours_over_hf",
    "ceiling_pass", "logprobs_pass",
}


@pytest.mark.slow
def test_bench_async_quick(tmp_path: pathlib.Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path), "--tag", "smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "ours/ceiling" in proc.stdout and "ours/decode" in proc.stdout

    doc = json.loads((tmp_path / "smoke.json").read_text())
    assert {"config", "environment", "results", "ratios", "checks", "table", "wall_s"} <= set(doc)
    assert doc["config"]["quick"] is True
    systems = {"ours", "ceiling", "decode", "logprobs", "hf"}
    assert set(doc["config"]["systems"]) == systems
    smc = ("smc", "smc_resample")
    cells = {(r["workload"], r["n"]) for r in doc["results"]}
    assert cells == {(w, n) for w in (*smc, "unique") for n in doc["config"]["n"]}
    for r in doc["results"]:
        assert RESULT_KEYS <= set(r), r
        assert r["system"] in systems
        assert r["rows_per_s"] > 0 and len(r["times_s"]) == doc["config"]["reps"]
    # the decode ceiling runs on the SMC workloads only
    assert {(r["workload"], r["n"]) for r in doc["results"] if r["system"] == "decode"} == {
        c for c in cells if c[0] in smc
    }
    assert len(doc["results"]) == len(cells) * (len(systems) - 1) + sum(c[0] in smc for c in cells)
    assert len(doc["ratios"]) == len(cells)
    for ra in doc["ratios"]:
        assert RATIO_KEYS <= set(ra), ra
        assert ra["ours_over_ceiling"] > 0 and ra["ours_over_logprobs"] > 0 and ra["ours_over_hf"] > 0
        assert (ra["ours_over_decode"] is not None) == (ra["workload"] in smc)
    # every system computes the same rows (float32 everywhere)
    for c in doc["checks"]:
        assert c["max_abs_diff_ours_vs_logprobs"] < 1e-3, c
        assert c["max_abs_diff_ours_vs_hf"] < 1e-3, c

    png = (tmp_path / "smoke.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
