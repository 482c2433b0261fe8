"""Smoke test of benchmarks/bench_soak.py: a small soak runs end to end and checks its rows.

Runs the script in a subprocess (it builds its own engine) with two short waves and a memory
target no run can miss, then checks the exit status and the JSON it writes: every wave
recorded, the SMC shape (forks, duplicates, cancellations before and after dispatch), no error,
rows checked against transformers. No memory figure or timing is asserted (the full soak is a
benchmark, not a test).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_soak.py"

pytest.importorskip("vllm")

WAVE_KEYS = {
    "wave", "wall_s", "loop_gap_ms", "errors", "hf_max_diff", "counts", "engine", "rss_mb",
    "rss_delta_mb", "mallinfo", "gc_count",
}
SUMMARY_KEYS = {
    "rss_built_mb", "rss_warm_mb", "rss_end_mb", "growth_second_half_mb", "max_loop_gap_ms",
    "max_hf_diff", "hf_checked", "errors", "totals", "target_mb", "memory_pass", "pass",
}


@pytest.mark.slow
def test_bench_soak_small(tmp_path: pathlib.Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--waves", "2", "--per-wave", "200", "--particles", "20",
         "--hf-checks", "2", "--target-mb", "100000", "--kv-bytes", str(64 << 20), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "growth over the second half" in proc.stdout and "RESULT: PASS" in proc.stdout

    doc = json.loads(out.read_text())
    assert {"config", "environment", "waves", "summary", "errors", "stats"} <= set(doc)
    assert [w["wave"] for w in doc["waves"]] == [1, 2]
    for w in doc["waves"]:
        assert WAVE_KEYS <= set(w), w
        assert w["errors"] == 0 and w["rss_mb"] > 0
        assert w["engine"]["sink_rows"] == 0 and w["engine"]["live_sessions"] == 0
        assert w["engine"]["cache_entries"] == 0  # clear_cache() after the wave
    s = doc["summary"]
    assert SUMMARY_KEYS <= set(s)
    assert s["pass"] is True and s["errors"] == 0 and doc["errors"] == []
    t = s["totals"]
    assert t["awaits"] == 2 * 200
    assert t["rows"] + t["cancelled"] == t["awaits"]  # every await either got a row or was cancelled
    assert t["rows"] > 0 and t["cancel_early"] > 0 and t["cancel_late"] > 0 and t["cancelled"] > 0
    assert t["forks"] > 0 and t["resamples"] > 0 and t["distinct"] < t["awaits"]  # forks and duplicates
    assert s["hf_checked"] >= 2 and 0 < s["max_hf_diff"] < 1e-3  # rows compared with transformers
    assert doc["stats"]["logprobs"]["dedup_joins"] > 0
