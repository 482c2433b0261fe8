"""Smoke test of benchmarks/ab_decode_smc.py on the shipped demo model, in-process.

The forcing processor must reproduce ``lm.smc`` exactly where the rows are the same (the same
particles' tokens and log weights for the same seed), force every token the controller drew,
and count resampling steps and their forks. No timing is asserted.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def ab():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ab_decode_smc
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return ab_decode_smc


@pytest.fixture(scope="module")
def systems(ab):
    from genlm_vlm import demo_model_path

    path = str(demo_model_path())
    forced = ab.Forced(path)  # with no run set its processor leaves rows alone: it serves decode too
    burst = ab.Burst(path)
    yield burst, forced
    burst.close()


class _DecodeOn:
    """The ``decode`` system on the forced system's engine (one engine build fewer)."""

    def __init__(self, ab, forced) -> None:
        self.ab, self.forced = ab, forced

    def run(self, **cmd):
        return self.ab.Decode.run(self.forced, **cmd)


def test_forced_matches_burst_and_decode_does_the_same_work(ab, systems) -> None:
    burst, forced = systems
    workers = {"burst": burst, "decode": _DecodeOn(ab, forced), "forced": forced}
    cell = ab.measure(workers, "steady", 4, 6, 1)
    sy = cell["systems"]
    assert sy["burst"]["particle_steps"] == sy["decode"]["particle_steps"] == sy["forced"]["particle_steps"] == 24
    assert sy["forced"]["engine_tokens"] == 24 and sy["forced"]["forced_ok"] == 4
    assert sy["forced"]["distinct_texts"] == sy["burst"]["distinct_texts"] == 4
    assert sy["forced"]["resample_steps"] == 0 and sy["forced"]["missing"] == 0
    assert [c["identical"] for c in cell["same_seed"]] == [True]
    assert {"burst/decode", "forced/decode", "forced+forks/decode", "forced/burst"} <= set(cell["ratios"])
    assert "| steady | 4 | 6 |" in ab.table([cell])


def test_resampling_is_counted_and_its_forks_replayed(ab, systems, monkeypatch) -> None:
    _, forced = systems
    monkeypatch.setitem(ab.CELLS, "always", (r"[a-z ]+", 1.0))  # resample whenever the weights differ
    r = forced.run("always", 8, 10, 3)
    assert r["resample_steps"] == r["resamples"] > 0
    assert r["forked"] > 0 and r["fork_est_s"] > 0 and r["fork_tail_tokens"] >= r["forked"]
    assert r["steps"] <= 10 and r["particle_steps"] + r["missing"] <= 80
