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


E2E_SCRIPT = ROOT / "benchmarks" / "bench_e2e.py"
E2E_SYSTEMS = {"ours", "bridge", "mock", "decode", "transformers"}


@pytest.mark.slow
def test_bench_e2e_quick(tmp_path: pathlib.Path) -> None:
    """benchmarks/bench_e2e.py --quick: every system runs genlm-control's SMC (or decodes) in its
    own subprocess; the JSON has one cell with every system timed and the PNG is written."""
    pytest.importorskip("genlm.control")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, str(E2E_SCRIPT), "--quick", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "ours/decode" in proc.stdout and "uptime start" in proc.stdout

    doc = json.loads(out.read_text())
    assert {"config", "environment", "workers", "cells", "targets", "table", "wall_s"} <= set(doc)
    assert doc["config"]["quick"] is True and set(doc["config"]["systems"]) == E2E_SYSTEMS
    # the plain vLLM baseline ran without genlm.backend and with ours' engine configuration
    workers = doc["workers"]["6-layer"]
    assert workers["decode"]["genlm_backend_imported"] is False
    assert workers["ours"]["engine_config"]["cache_config.block_size"] == 32
    assert doc["engine_config_differences_ours_vs_decode"] == {"6-layer": {}}
    (cell,) = doc["cells"]
    assert (cell["model"], cell["n"]) == ("6-layer", doc["config"]["n"][0])
    for system in E2E_SYSTEMS | {"decode_bridge"}:
        assert cell["seconds"][system] > 0, system
        assert len(cell["runs"][system]) == doc["config"]["reps"]
    # decode made exactly as many tokens as ours took particle-steps
    assert cell["tokens"] > 0
    assert all(r["particle_steps"] == cell["tokens"] for r in cell["runs"]["decode"])
    assert all(r["particle_steps"] == cell["tokens"] for r in cell["runs"]["ours"])
    assert cell["ours_over_decode"] > 0 and cell["ours_vs_transformers"] > 0
    assert set(cell["engine_time"]) >= {"step_s", "host_s", "idle_s"}
    assert cell["distinct_contexts_per_step"][-1] > 1  # the particles did not collapse
    # the bridge (genlm_vlm.control.smc): its own rows counted, and decode_bridge decoded exactly as many
    bridge = cell["bridge"]
    assert bridge["steps"] > 0 and bridge["final_distinct_texts"] >= 1
    assert 0 < bridge["engine_rows"] <= bridge["particle_steps"] <= doc["config"]["n"][0] * doc["config"]["t"]
    assert all(r["particle_steps"] == bridge["particle_steps"] for r in cell["runs"]["bridge"])  # seeded
    assert all(r["engine_rows"] == r["stats_delta"]["rows"] > 0 for r in cell["runs"]["bridge"])
    assert bridge["decode_tokens"] == bridge["engine_rows"]
    assert all(r["particle_steps"] == bridge["engine_rows"] for r in cell["runs"]["decode_bridge"])
    # decode_steps (a diagnostic): N sequences x the bridge's engine steps
    assert all(r["particle_steps"] == cell["n"] * bridge["steps"] for r in cell["runs"]["decode_steps"])
    assert cell["condition"] == "words" and cell["bridge_over_decode_steps"] > 0
    assert cell["bridge_over_ours"] > 0 and cell["bridge_over_decode"] > 0
    assert "bridge/ours" in proc.stdout and "bridge/decode" in proc.stdout
    assert {t["metric"] for t in doc["targets"]} == {"ours_over_decode", "ours_vs_transformers",
                                                    "bridge_over_ours", "bridge_over_decode"}

    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


PRODUCT_SCRIPT = ROOT / "benchmarks" / "bench_product.py"


@pytest.mark.slow
def test_bench_product_quick(tmp_path: pathlib.Path) -> None:
    """benchmarks/bench_product.py --quick: the product of two prompts run by genlm-control, the
    bridge and lm.smc(prompts=) alike; one cell, every system timed, the three ratios reported."""
    pytest.importorskip("genlm.control")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "product.json"
    proc = subprocess.run(
        [sys.executable, str(PRODUCT_SCRIPT), "--quick", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "control/bridge" in proc.stdout and "bridge/native" in proc.stdout

    doc = json.loads(out.read_text())
    assert doc["quick"] is True and doc["systems"] == ["control", "bridge", "native"]
    (cell,) = doc["cells"]
    assert (cell["n"], cell["t"]) == (4, 4)
    for system in doc["systems"]:
        s = cell["systems"][system]
        assert len(s["runs"]) == doc["reps"] and s["median_wall_s"] > 0 and s["steps_per_s"] > 0
        assert all(r["particle_steps"] > 0 and r["engine_rows"] > 0 for r in s["runs"]), (system, s["runs"])
    # the bridge runs the product as lm.smc(prompts=, force_eos=True) with the same seed and the
    # same masks ([a-z ]+ translated from genlm-control's automaton vs Regex): the same run
    bridge, native = (cell["systems"][s]["runs"] for s in ("bridge", "native"))
    for a, b in zip(bridge, native, strict=True):
        assert a["particle_steps"] == b["particle_steps"] and abs(a["log_z"] - b["log_z"]) < 1e-6, (a, b)
    assert set(cell["ratios"]) == {"control/bridge", "control/native", "bridge/native"}
    assert all(v > 0 for v in cell["ratios"].values())
