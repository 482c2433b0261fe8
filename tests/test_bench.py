"""``python -m genlm_vlm bench`` without an engine: the option checks (before torch and vLLM are
imported), the harness's processes, alternation and medians with a fake system, the checks of the
work done, and the report (table, JSON, plot, the SVG written when matplotlib is missing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from genlm_vlm.bench import cli, harness, report, runner
from genlm_vlm.bench.workloads import Cell, Lane, mc_requests, plan, processes_for, rows_waves


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--n", "0"], "--n takes positive integers"),
        (["--reps", "0"], "--reps must be >= 1"),
        (["--max-tokens", "-2"], "--max-tokens must be >= 1"),
        (["--workloads", "rows", "speed"], "unknown 'speed'"),
        (["--engine-opts", "max_model_len"], "expects key=value"),
        (["--engine-opts", "max_modle_len=64"], "max_model_len"),
        (["--model", "/no/such/model/dir"], "--model"),
    ],
)
def test_bad_options_exit_2_with_the_fix(argv, needle, tmp_path, capsys):
    assert cli.main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench: error:") and needle in err
    assert not (tmp_path / "o").exists()  # nothing was started or written


def test_a_non_empty_out_is_refused_unless_overwrite(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("a user's file")
    assert cli.main(["--out", str(tmp_path)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    args = cli._parser().parse_args(["--out", str(tmp_path), "--overwrite", "--quick", "--n", "3", "5"])
    cfg = cli.check(args)
    assert cfg["ns"] == [3, 5] and cfg["max_tokens"] == cli.QUICK["max_tokens"] and cfg["reps"] == 1
    assert (tmp_path / "mine.txt").read_text() == "a user's file"


def test_defaults_and_engine_options_merge(tmp_path):
    args = cli._parser().parse_args(["--out", str(tmp_path / "x"), "--dtype", "float32",
                                     "--engine-opts", "max_num_seqs=64", "--engine-opt", "seed=3"])
    cfg = cli.check(args)
    assert cfg["workloads"] == ["smc", "rows"] and cfg["ns"] == cli.DEFAULT_N
    assert cfg["engine_opts"] == {"max_num_seqs": 64, "seed": 3, "dtype": "float32"}


def test_missing_optional_workloads_are_skipped_with_a_line(monkeypatch, tmp_path):
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith(("lm_eval", "genlm")) else real(name, *a))
    args = cli._parser().parse_args(["--workloads", "rows", "lm-eval", "control", "--out", str(tmp_path / "x")])
    cfg = cli.check(args)
    assert cfg["workloads"] == ["rows"]
    assert any("lm-eval" in s and "not installed" in s for s in cfg["skipped"])
    assert any("genlm-control" in s for s in cfg["skipped"])
    args = cli._parser().parse_args(["--workloads", "lm-eval", "--out", str(tmp_path / "y")])
    with pytest.raises(cli.UsageError, match="nothing to run"):
        cli.check(args)


def test_importing_the_command_loads_neither_torch_nor_vllm():
    code = ("import sys, genlm_vlm.bench.cli, genlm_vlm.bench.runner, genlm_vlm.bench.report; "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_command_is_registered():
    from genlm_vlm.cli import _COMMANDS

    assert _COMMANDS["bench"][0] == "genlm_vlm.bench.cli"


# ------------------------------------------------------------------------------ harness
def test_alternate_rotates_and_medians():
    order: list[str] = []

    def job(label):
        def run(rep):
            order.append(f"{label}{rep}")
            return {"wall_s": 0.5 * (1 + rep % 2), "units": 1}
        return run

    out = harness.alternate({"a": job("a"), "b": job("b"), "c": job("c")}, reps=3)
    assert order == ["a0", "b0", "c0", "a1", "b1", "c1", "b2", "c2", "a2", "c3", "a3", "b3"]
    assert out["order"] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert set(out["warm"]) == {"a", "b", "c"} and all(len(v) == 3 for v in out["runs"].values())
    assert harness.median_rate(out["runs"]["a"], "units") == 1.0  # rates 1, 2, 1
    assert harness.median_rate([], "units") is None


def test_system_processes_are_separate_and_report_errors(tmp_path):
    fake = "genlm_vlm.bench.harness:fake_system"
    a = harness.SystemProcess("a", fake, {"scale": 10}, tmp_path)
    b = harness.SystemProcess("b", fake, {"scale": 10}, tmp_path)
    harness.start_systems([a, b])
    try:
        assert a.info["pid"] != b.info["pid"] != os.getpid()
        with pytest.raises(harness.SystemFailed, match="fake job failure"):
            a.run("fail")
        assert a.run("work", units=3)["units"] == 3  # the system survives a failed job
    finally:
        a.close()
        b.close()
    bad = harness.SystemProcess("bad", fake, {"fail_build": True}, tmp_path)
    with pytest.raises(harness.SystemFailed, match="fake build failure"):
        harness.start_systems([bad])


def test_run_cell_with_fake_systems_counts_ratios_and_checks(tmp_path):
    fake = "genlm_vlm.bench.harness:fake_system"
    procs = {"fast": harness.SystemProcess("fast", fake, {"scale": 2000}, tmp_path),
             "slow": harness.SystemProcess("slow", fake, {"scale": 20000}, tmp_path)}
    harness.start_systems(list(procs.values()))
    try:
        cell = Cell("fake", 4, (Lane("ours", "fast", "work", {"units": 50}),
                                Lane("theirs", "slow", "work", {"units": 50})), "units", "units/s")
        res = runner.run_cell(cell, procs, reps=3)
    finally:
        for p in procs.values():
            p.close()
    assert [len(v) for v in res["runs"].values()] == [3, 3]
    assert res["ratios"]["theirs"] > 1.5  # ten times the loops per unit
    assert res["problems"] == []


def test_check_cell_names_missing_work_and_different_particles():
    cell = plan(["smc"], [4], 8, "regex")[0]
    ok = {"wall_s": 1.0, "particle_steps": 32, "particles": 4, "fingerprint": "x"}
    runs = {"lm.smc": [ok], "python reference": [{**ok, "fingerprint": "y"}],
            "vllm decode": [{**ok, "particle_steps": 31}], "vllm structured": [{**ok, "particles": 3}]}
    problems = runner.check_cell(cell, runs, {"vllm decode": {"tokens_asked": 8}})
    assert any("different particles" in p for p in problems)
    assert any("31 tokens, 32 asked" in p for p in problems)
    assert any("3 particles, 4 asked" in p for p in problems)
    rows = plan(["rows"], [2], 8, "regex")[0]
    bad = runner.check_cell(rows, {"genlm_vlm awaits": [{"wall_s": 1, "rows": 7}]}, {})
    assert bad and "7 rows returned, 8 asked" in bad[0]


def test_the_requests_path_adds_the_bursts_lane_and_its_checks():
    cell = plan(["smc"], [4], 8, "regex", "requests")[0]
    labels = [lane.label for lane in cell.lanes]
    assert labels[:2] == ["lm.smc", "lm.smc (bursts)"]
    assert cell.lanes[0].kwargs["engine_path"] == "requests"
    assert cell.lanes[1].kwargs["engine_path"] == "bursts"
    default = plan(["smc"], [4], 8, "regex")[0]  # lm.smc's own default (auto), no bursts lane
    assert [lane.label for lane in default.lanes][:2] == ["lm.smc", "python reference"]
    assert default.lanes[0].kwargs["engine_path"] == "auto"
    ok = {"wall_s": 1.0, "particle_steps": 32, "particles": 4, "fingerprint": "x", "engine_path": "requests"}
    runs = {"lm.smc": [{**ok, "engine_path": "bursts", "fallback": "a reason"}],
            "lm.smc (bursts)": [{**ok, "fingerprint": "z", "engine_path": "bursts"}],
            "python reference": [ok], "vllm decode": [ok], "vllm structured": [ok]}
    problems = runner.check_cell(cell, runs, {"vllm decode": {"tokens_asked": 8}})
    assert any("asked for engine_path='requests'" in p and "a reason" in p for p in problems)
    assert any("lm.smc (bursts) and the Python reference drew different" in p for p in problems)
    assert not any(p.startswith("smc N=4 rep 1: lm.smc and") for p in problems)
    runs["lm.smc (bursts)"] = [{**ok, "engine_path": "requests"}]
    problems = runner.check_cell(cell, runs, {"vllm decode": {"tokens_asked": 8}})
    assert any("lm.smc (bursts) asked for engine_path='bursts'" in p for p in problems)
    auto = {"lm.smc": [{**ok, "engine_path": "bursts", "fallback": "a reason"}], "python reference": [ok],
            "vllm decode": [ok], "vllm structured": [ok]}
    assert runner.check_cell(default, auto, {"vllm decode": {"tokens_asked": 8}}) == []  # auto: either path


def test_the_product_cell_runs_two_prompts_on_every_lane():
    cell = plan(["smc"], [4], 8, "regex", "requests", product=True)[0]
    assert [lane.label for lane in cell.lanes] == ["lm.smc", "lm.smc (bursts)", "python reference", "vllm decode",
                                                   "vllm decode (same steps)", "vllm structured"]
    assert all(lane.kwargs.get("product") is True for lane in cell.lanes)
    assert not any("product" in lane.kwargs for lane in plan(["smc"], [4], 8, "regex")[0].lanes)
    args = cli._parser().parse_args(["--workloads", "smc", "--product", "--engine-path", "requests"])
    assert args.product and args.engine_path == "requests"
    assert cli._parser().parse_args([]).engine_path == "auto"


def test_mask_overlap_adds_its_lane_and_its_checks():
    cell = plan(["smc"], [4], 8, "json", "requests", mask_overlap=True)[0]
    lanes = {lane.label: lane for lane in cell.lanes}
    assert lanes["lm.smc (mask overlap)"].kwargs == {"n": 4, "t": 8, "constraint": "json", "engine_path": "requests",
                                                      "mask_overlap": True}
    assert "mask_overlap" not in lanes["lm.smc"].kwargs
    assert "lm.smc (mask overlap)" not in [lane.label for lane in plan(["smc"], [4], 8, "json", "requests")[0].lanes]
    ok = {"wall_s": 1.0, "particle_steps": 32, "particles": 4, "fingerprint": "x", "engine_path": "requests"}
    runs = {label: [ok] for label in lanes}
    runs["lm.smc (mask overlap)"] = [{**ok, "fingerprint": "z"}]
    problems = runner.check_cell(cell, runs, {"vllm decode": {"tokens_asked": 8}})
    assert any("lm.smc (mask overlap) and the Python reference drew different" in p for p in problems)
    assert cli.check(cli._parser().parse_args(["--mask-overlap", "--engine-path", "requests"]))["workloads"]


def test_same_steps_decode_has_the_smc_runs_live_counts():
    from genlm_vlm.bench.workloads import same_step_lengths

    live = [4, 4, 3, 3, 4, 1, 0]  # a resample may bring a finished slot back; 0: nothing left
    lengths = same_step_lengths(live, 4)
    assert sum(lengths) == sum(live) and max(lengths) == 6  # the same tokens in as many steps
    # the widths of its steps, widest first, are the SMC run's live counts, sorted
    widths = [sum(1 for x in lengths if x > t) for t in range(max(lengths))]
    assert widths == sorted([m for m in live if m], reverse=True)
    labels = [lane.label for lane in plan(["smc"], [4], 8, "regex")[0].lanes]
    assert labels.index("vllm decode (same steps)") == labels.index("vllm decode") + 1
    assert "vllm decode (same steps)" not in [lane.label for lane in plan(["smc"], [4], 8, "steady")[0].lanes]
    cell = plan(["smc"], [4], 8, "regex")[0]
    ok = {"wall_s": 1.0, "particle_steps": 32, "particles": 4, "fingerprint": "x"}
    runs = {lane.label: [ok] for lane in cell.lanes}
    runs["vllm decode (same steps)"] = [{**ok, "particle_steps": 30}]
    warm = {"vllm decode": {"tokens_asked": 8}, "vllm decode (same steps)": {"tokens_asked": 8.0}}
    assert runner.check_cell(cell, runs, warm) == ["smc N=4 vllm decode (same steps): 30 tokens, 32 asked"]


def test_plan_and_inputs():
    assert processes_for(["smc"]) == ["genlm_vlm", "vllm"]
    assert processes_for(["control"]) == ["genlm_vlm"]
    assert [(c.workload, c.n) for c in plan(["smc", "rows"], [64, 16], 8, "json")] == [
        ("rows", 16), ("rows", 64), ("smc", 16), ("smc", 64)]
    waves = rows_waves(5, 3, 1000, rep=1)
    flat = [tuple(p) for w in waves for p in w]
    assert [len(w) for w in waves] == [5, 5, 5] and len(set(flat)) == 15
    assert rows_waves(5, 3, 1000, rep=1) == waves != rows_waves(5, 3, 1000, rep=2)
    mc = mc_requests(8, rep=1)
    assert len(mc) == 32 and len({c for c, _ in mc}) == 8
    assert all(len(c) <= 240 and 0 < len(e) <= 41 for c, e in mc)  # short enough for max_model_len 512


def test_round_ratios_pair_the_systems_round_by_round():
    """Round i's ratio is the first system's rate in round i over the second's in round i;
    a round where either has no time or no work is left out."""
    a = [{"wall_s": 1.0, "w": 10}, {"wall_s": 2.0, "w": 10}, {"wall_s": None, "w": 10}, {"wall_s": 1.0, "w": 8}]
    b = [{"wall_s": 2.0, "w": 10}, {"wall_s": 1.0, "w": 10}, {"wall_s": 1.0, "w": 10}, {"wall_s": 1.0, "w": 0}]
    assert harness.round_ratios(a, b, "w") == [2.0, 0.5]
    assert report.middle_half([0.5, 2.0, 1.0]) is None
    assert report.middle_half([4.0, 1.0, 3.0, 2.0, 5.0]) == (2.0, 4.0)


# ------------------------------------------------------------------------------ report
def _result():
    cell = {"workload": "smc", "n": 8, "unit": "particle-steps/s", "work_key": "particle_steps", "main": "lm.smc",
            "rates": {"lm.smc": 200.0, "vllm decode": 100.0}, "ratios": {"vllm decode": 2.0}, "order": [],
            "agreement": None, "problems": [], "runs": {"lm.smc": [{"distinct": 8}], "vllm decode": [{}]}}
    return {"model": "/m/demo-model", "engine_opts": {"seed": 0}, "genlm_vlm": "0.1", "load_start": [0.5, 0.4, 0.3],
            "load_end": [0.6, 0.5, 0.4], "ok": True,
            "systems": {"genlm_vlm": {"vllm": "0.32.0", "torch": "2.13", "python": "3.11", "device": "CPU",
                                      "dtype": "float32", "runner": "V1", "cuda_graphs": False}},
            "cells": [cell, {**cell, "n": 32, "ratios": {"vllm decode": 3.0}}]}


def test_report_table_header_files_and_svg(tmp_path, monkeypatch):
    res = _result()
    text = report.table(res)
    assert "| smc | 8 | lm.smc / vllm decode | **2** | 200 / 100 particle-steps/s | ok, distinct 8-8/8 |" in text
    res["cells"][1]["cpu_ratios"] = {"vllm decode": 2.5}  # the systems reported their CPU seconds
    assert "| smc | 32 | lm.smc / vllm decode | **3** (CPU 2.5) | 200 / 100" in report.table(res)
    # no per-round ratios (an older result), or fewer than four rounds: no middle half
    assert "| ok, distinct 8-8/8 | - |" in text
    res["cells"][1]["round_ratios"] = {"vllm decode": [3.0, 2.0, 4.0]}
    assert report.table(res).splitlines()[-1].endswith("| ok, distinct 8-8/32 | - |")
    res["cells"][1]["round_ratios"] = {"vllm decode": [1.0, 2.0, 3.0, 4.0, 5.0]}
    assert report.table(res).splitlines()[-1].endswith("| ok, distinct 8-8/32 | 2-4 |")
    head = report.header(res)
    assert "vLLM 0.32.0" in head and "runner: V1, dtype: float32, eager" in head and "0.50 0.40 0.30" in head
    assert report.series(res) == {"smc: lm.smc / vllm decode": [(8, 2.0), (32, 3.0)]}
    files = report.write(res, tmp_path / "a")
    assert json.loads(files["json"].read_text())["cells"][1]["ratios"] == {"vllm decode": 3.0}
    assert files["plot"].suffix in (".png", ".svg") and files["plot"].stat().st_size > 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: the hand-written SVG
    svg = report.plot(res, tmp_path / "ratios")
    assert svg.suffix == ".svg" and "<polyline" in svg.read_text() and "lm.smc / vllm decode" in svg.read_text()
