"""Checks build_llm makes before vLLM builds anything: one engine per CUDA process, and the note
logged on a vLLM release other than the tested one. No GPU: "is CUDA" is a stand-in."""

from __future__ import annotations

import logging

import pytest

from genlm_vlm.engine import build


@pytest.fixture
def registry(monkeypatch):
    """An empty table of GPU engines for the test (the process's own is left alone)."""
    table: dict[int, str] = {}
    monkeypatch.setattr(build, "_device_engines", table)
    return table


def test_second_engine_on_cuda_is_refused_with_the_way_out(registry):
    first = object()
    registry[id(first)] = "/models/first"
    with pytest.raises(build.EngineInProcessError) as info:
        build.check_device_free("/models/second", on_cpu=False)
    msg = str(info.value)
    assert "/models/second" in msg and "/models/first" in msg
    assert "its own process" in msg and "cleanup()" in msg
    assert registry == {id(first): "/models/first"}  # the first engine is still counted, untouched
    build.check_device_free("/models/second", on_cpu=True)  # CPU engines: several per process
    build.forget_device_engine(first)  # the first one's cleanup()
    build.check_device_free("/models/second", on_cpu=False)


def test_build_llm_refuses_before_building_when_a_cuda_engine_lives(registry, monkeypatch, tmp_path):
    """Through build_llm, with "is CUDA" a stand-in: the check comes before vllm.LLM is called."""
    import vllm

    registry[1] = "/models/first"
    monkeypatch.setattr(build, "is_cpu_platform", lambda: False)

    def no_build(*args, **kwargs):  # pragma: no cover - reaching it is the failure
        raise AssertionError("vllm.LLM was called although a GPU engine is alive")

    monkeypatch.setattr(vllm, "LLM", no_build)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(build.EngineInProcessError, match="already holds a vLLM engine on the GPU"):
        build.build_llm(str(tmp_path), {"enforce_eager": True}, forks=False)
    assert registry == {1: "/models/first"}


def test_untested_vllm_release_is_named():
    assert build.untested_version_note(build.TESTED_VLLM) is None
    assert build.untested_version_note(build.TESTED_VLLM + "+cpu") is None
    old = build.untested_version_note("0.25.0")
    assert old is not None and "0.25.0" in old and "no streaming-input sessions" in old
    assert build.TESTED_VLLM in old and "genlm-vlm[gpu]" in old
    newer = build.untested_version_note("0.33.0")
    assert newer is not None and "0.33.0" in newer and "sessions" not in newer


def test_untested_release_is_logged_once(monkeypatch, caplog, tmp_path):
    import vllm

    monkeypatch.setattr(build, "_version_noted", False)
    monkeypatch.setattr(build, "vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop here")))
    (tmp_path / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger=build.logger.name):
        for _ in range(2):
            with pytest.raises(RuntimeError, match="stop here"):
                build.build_llm(str(tmp_path), {"enforce_eager": True}, forks=False)
    notes = [r for r in caplog.records if "not the release genlm_vlm was tested on" in r.getMessage()]
    assert len(notes) == 1
