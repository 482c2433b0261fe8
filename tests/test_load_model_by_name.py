"""``load_model_by_name`` takes genlm-backend's arguments the way genlm-backend does (issue 17).

genlm-backend's ``load_model_by_name(name, backend=None, llm_opts=None)`` passes ``llm_opts`` as
the keyword arguments of the backend class's ``from_name``; its users write
``load_model_by_name(name, backend="vllm", llm_opts={"engine_opts": {...}})``. Those exact calls
work here, with ``backend="vllm"`` (a real engine on the shipped model) and ``backend="mock"``;
vLLM options put directly in ``llm_opts`` are refused before any engine is built.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import EngineBuildStopped

import genlm_vlm
from genlm_vlm import AsyncVirtualLM, MockAsyncLM, demo_model_path, load_model_by_name

#: What genlm-backend's users pass to run the shipped model small (float32: the CPU build).
ENGINE_OPTS = {"dtype": "float32", "max_model_len": 64, "kv_cache_memory_bytes": 32 << 20}


def test_signature_is_genlm_backends():
    backend = pytest.importorskip("genlm.backend")
    ours = list(inspect.signature(load_model_by_name).parameters.values())[:3]
    theirs = list(inspect.signature(backend.load_model_by_name).parameters.values())
    assert [(p.name, p.default) for p in ours] == [(p.name, p.default) for p in theirs]
    assert "load_model_by_name" in genlm_vlm.__all__


def test_genlm_backends_vllm_call_builds_the_engine_it_describes():
    """``load_model_by_name(name, backend="vllm", llm_opts={"engine_opts": ...})``, as
    genlm-backend's tests write it, on a real engine."""
    lm = load_model_by_name(
        demo_model_path(), backend="vllm", llm_opts={"engine_opts": ENGINE_OPTS, "batch_size": 16}
    )
    try:
        assert isinstance(lm, AsyncVirtualLM)
        assert lm.max_model_len == 64 and lm.batch_size == 16
        row = lm.next_token_logprobs_sync([1, 5, 9])
        assert row.shape == (lm.vocab_size,)
        assert abs(float(torch.logsumexp(row.double(), 0))) < 1e-4
    finally:
        lm.cleanup()


def test_llm_opts_are_from_names_keyword_arguments(driver_calls):
    with pytest.raises(EngineBuildStopped):
        load_model_by_name("some/model", "vllm", {"engine_opts": {"dtype": "float32"}, "sessions": False})
    with pytest.raises(EngineBuildStopped):
        load_model_by_name("other/model", llm_opts={"engine_opts": {"seed": 1}}, max_sessions=4)
    with pytest.raises(EngineBuildStopped):
        load_model_by_name("third/model")  # genlm-backend's None: here the vLLM backend
    (args0, kw0), (args1, kw1), (args2, _) = driver_calls
    assert args0 == ("some/model", {"dtype": "float32"}) and kw0["sessions"] is False
    assert args1 == ("other/model", {"seed": 1}) and kw1["max_sessions"] == 4
    assert args2 == ("third/model", None)


@pytest.mark.parametrize("backend", ["vllm", None, "mock"])
def test_bare_vllm_options_are_refused_with_where_they_go(no_engine, backend):
    with pytest.raises(TypeError) as exc:
        load_model_by_name(demo_model_path(), backend=backend, llm_opts={"dtype": "float32", "enforce_eager": True})
    message = str(exc.value)
    assert "'dtype', 'enforce_eager' are not options of" in message
    assert "vLLM's own options go under its engine_opts" in message
    assert f"backend={backend!r}, llm_opts={{'engine_opts': {{'dtype': 'float32', 'enforce_eager': True}}}}" in message


def test_misspelled_from_name_option_is_named(no_engine):
    with pytest.raises(TypeError, match=r"'batchsize' \(did you mean 'batch_size'\?\) is not an option"):
        load_model_by_name("some/model", llm_opts={"batchsize": 8})
    with pytest.raises(TypeError, match=r"'engine_opt' \(did you mean 'engine_opts'\?\)"):
        load_model_by_name("some/model", engine_opt={"dtype": "float32"})


def test_an_option_given_twice_is_refused(no_engine):
    with pytest.raises(TypeError, match="'batch_size' given both in llm_opts and as a keyword argument"):
        load_model_by_name("some/model", llm_opts={"batch_size": 8}, batch_size=4)


def test_genlm_backends_mock_call_builds_the_mock():
    """``backend="mock"``: genlm_vlm's MockAsyncLM over the model's tokenizer, no vLLM; the
    engine options of the same call are accepted (only max_model_len means something there)."""
    path = demo_model_path()
    lm = load_model_by_name(path, backend="mock")
    assert isinstance(lm, MockAsyncLM) and lm.vocab_size == 1536
    ids = lm.tokenizer.encode("the cat", add_special_tokens=False)
    assert b"".join(lm.byte_vocab[i] for i in ids) == b"the cat"
    lm = load_model_by_name(path, backend="mock", llm_opts={"engine_opts": ENGINE_OPTS, "seed": 3})
    assert isinstance(lm, MockAsyncLM) and lm.max_model_len == 64 and lm.seed == 3
    row = lm.next_token_logprobs_sync([1, 5, 9])
    assert row.shape == (1536,) and abs(float(torch.logsumexp(row.double(), 0))) < 1e-4


@pytest.mark.parametrize("backend", ["hf", "mlx", "sgl", "transformers"])
def test_other_backends_point_to_genlm_backend(no_engine, backend):
    with pytest.raises(ValueError, match=rf"unsupported backend '{backend}'.*'mock'.*genlm\.backend\.load_model_by_name"):
        load_model_by_name("some/model", backend=backend)


def test_engine_options_as_second_argument_point_to_llm_opts(no_engine):
    with pytest.raises(TypeError, match=r"second argument is `backend`.*llm_opts=\{'engine_opts'"):
        load_model_by_name("some/model", {"dtype": "float32"})
