"""``python -m genlm_vlm bench --quick --workloads rows smc`` end to end on the shipped demo model:
real engines, each system in its own process; the version lines, the ratio table, the JSON's fields
and the plot file are checked (about 1.5 minutes on 2 cores)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_quick_bench_end_to_end(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "res"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "genlm_vlm", "bench", "--quick", "--workloads", "rows", "smc",
                           "--n", "4", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    text = proc.stdout
    for line in ("versions: genlm_vlm", "vLLM 0.", "runner: V", "eager", "load average at start / end:",
                 "device: CPU"):
        assert line in text, text
    for ratio in ("| rows | 4 | genlm_vlm awaits / vllm logprobs=-1 |", "| smc | 4 | lm.smc / python reference |",
                  "| smc | 4 | lm.smc / vllm decode |", "| smc | 4 | lm.smc / vllm decode (same steps) |",
                  "| smc | 4 | lm.smc / vllm structured |"):
        assert ratio in text, text
    res = json.loads((out / "bench.json").read_text())
    assert res["ok"] is True and res["config"]["n"] == [4] and res["config"]["reps"] == 1
    assert {"genlm_vlm", "vllm"} == set(res["systems"])
    # the two system processes ran with the same options, apart
    assert res["systems"]["genlm_vlm"]["pid"] != res["systems"]["vllm"]["pid"]
    assert res["engine_opts"]["kv_cache_memory_bytes"] == 1 << 30
    split = {s["cpu_attn_split_kv"] for s in res["systems"].values()}
    assert split == {"0"}  # the baseline computes attention as genlm_vlm's engine does
    cells = {(c["workload"], c["n"]): c for c in res["cells"]}
    assert set(cells) == {("rows", 4), ("smc", 4)}
    smc = cells[("smc", 4)]
    assert smc["problems"] == [] and all(r > 0 for r in smc["ratios"].values())
    assert smc["runs"]["lm.smc"][0]["fingerprint"] == smc["runs"]["python reference"][0]["fingerprint"]
    # the same-steps decode ran its 4 sequences (check_cell: as many tokens as its lengths asked)
    assert smc["runs"]["vllm decode (same steps)"][0]["particles"] == 4
    assert sum(smc["runs"]["lm.smc"][0]["rows_per_step"]) == smc["runs"]["lm.smc"][0]["particle_steps"]
    rows = cells[("rows", 4)]
    assert all(r["rows"] == 16 for rs in rows["runs"].values() for r in rs)  # 4 waves of 4
    assert rows["runs"]["vllm logprobs=-1"][0]["width"] >= rows["runs"]["genlm_vlm awaits"][0]["width"]
    plot = pathlib.Path(res["files"]["plot"])
    assert plot.exists() and plot.stat().st_size > 0
    assert (out / "table.md").read_text().count("| smc | 4 |") == 4
    assert (out / "logs" / "vllm.log").exists()
    assert not (out / "partial.json").exists()  # written after each cell, replaced by bench.json
