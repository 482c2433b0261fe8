"""genlm-backend-style conveniences on AsyncVirtualLM (score, top-k, batch_size, timeout) and the
registration that lets genlm's type checks accept genlm_vlm's classes."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import sys

import pytest
import torch

from genlm_vlm import _genlm_compat
from genlm_vlm.scoring import score_records


def _ids(lm, text: str) -> list[int]:
    return lm.tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------- scoring
async def test_score_matches_the_rows_and_score_records(llama_lm):
    lm = llama_lm
    prompt = [lm.tokenizer.bos_token_id, *_ids(lm, "def f(x):")]
    cont = _ids(lm, "\n    return x + 1")
    rows = await lm.batch_next_token_logprobs([prompt + cont[:k] for k in range(len(cont))])
    per_token = rows[torch.arange(len(cont)), torch.tensor(cont)]

    logps = await lm.continuation_logprobs(prompt, cont, chunk_size=3)
    assert logps.dtype == torch.float32 and logps.device.type == "cpu"
    assert torch.equal(logps, per_token)
    assert torch.equal(lm.continuation_logprobs_sync(prompt, torch.tensor(cont)), per_token)
    total = await lm.score(prompt, cont)
    assert math.isclose(total, float(per_token.double().sum()), rel_tol=1e-9)
    assert math.isclose(lm.score_sync(prompt, cont), total, rel_tol=1e-9)
    (record,) = score_records(lm, [{"prompt": prompt, "continuation": cont}], top_k=0)
    assert math.isclose(record["continuation_logprob"], total, abs_tol=1e-4)
    assert await lm.score(prompt, []) == 0.0


async def test_sync_calls_are_counted_apart_from_awaits(llama_lm):
    lm = llama_lm
    lm.clear_cache()
    before, awaited = lm.stats["sync"], lm.stats["logprobs"]["requests"]
    rows = lm.batch_next_token_logprobs_sync([[5, 6, 7], [5, 6, 8], [5, 6, 7]])  # one duplicate
    assert torch.equal(lm.next_token_logprobs_sync([5, 6, 7]), rows[0])  # asked twice: from the output cache
    assert lm.batch_next_token_logprobs_sync([]).shape == (0, lm.vocab_size)
    lm.batch_next_token_logprobs_sync([[9, 1], [9, 2], [9, 3]], chunk_size=2)  # two engine calls
    after = lm.stats["sync"]
    assert {k: after[k] - before[k] for k in after} == {
        "calls": 4, "rows": 7, "cache_hits": 1, "dedup_joins": 1, "computed": 5, "engine_calls": 3,
    }
    assert lm.stats["logprobs"]["requests"] == awaited  # the awaited path's counters are apart
    await lm.next_token_logprobs([5, 6, 9])
    assert lm.stats["sync"] == after and lm.stats["logprobs"]["requests"] == awaited + 1


async def test_concurrent_scores_share_engine_calls(llama_lm):
    lm = llama_lm
    prompt = [lm.tokenizer.bos_token_id, *_ids(lm, "import sys")]
    conts = [_ids(lm, s) for s in ("\nimport os", "\nprint(sys.argv)", "\n")]
    expected = [lm.score_sync(prompt, c) for c in conts]
    lm.clear_cache()
    calls = lm.stats["engine_calls"]
    got = await asyncio.gather(*(lm.score(prompt, c) for c in conts))
    assert got == pytest.approx(expected, abs=1e-4)
    assert lm.stats["engine_calls"] - calls < sum(len(c) for c in conts)


def test_score_checks_its_arguments_before_any_engine_work(llama_lm):
    lm = llama_lm
    calls = lm.stats["engine_calls"]
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        lm.score_sync([], [5])
    with pytest.raises(ValueError, match=rf"continuation_ids holds token id {lm.vocab_size} at index 0"):
        lm.score_sync([0], [lm.vocab_size])
    with pytest.raises(TypeError, match="continuation_ids must be a sequence of token ids"):
        lm.score_sync([0], "text")
    too_long = [5] * lm.max_model_len
    with pytest.raises(ValueError, match=rf"this model allows at most {lm.max_model_len} \(max_model_len\)"):
        lm.score_sync([0], too_long)
    assert lm.stats["engine_calls"] == calls


async def test_next_token_topk(llama_lm):
    lm = llama_lm
    prompt = [lm.tokenizer.bos_token_id, *_ids(lm, "for i in")]
    row = lm.next_token_logprobs_sync(prompt)
    top = await lm.next_token_topk(prompt, 7)
    assert top.token_ids.shape == (7,) and top.token_ids.dtype == torch.int64
    assert torch.equal(top.logprobs, torch.sort(row, descending=True).values[:7])
    assert torch.equal(row[top.token_ids], top.logprobs)
    ids, logps = lm.next_token_topk_sync(prompt, 1)
    assert int(ids[0]) == int(torch.argmax(row))
    with pytest.raises(ValueError, match=rf"k must be an int in \[1, {lm.vocab_size}\]"):
        await lm.next_token_topk(prompt, 0)


# ---------------------------------------------------------------------------------- batching knobs
def _new_groups(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    return {size: after[size] - before.get(size, 0) for size in after if after[size] > before.get(size, 0)}


async def test_batch_size_bounds_the_groups(llama_lm):
    lm = llama_lm
    assert lm.batch_size == 256
    lm.batch_size = 2
    try:
        assert lm.batch_size == 2
        before = lm.stats["logprobs"]["batch_sizes"]
        prompts = [[lm.tokenizer.bos_token_id, 40 + i, 7] for i in range(5)]
        lm.clear_cache()
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        groups = _new_groups(before, lm.stats["logprobs"]["batch_sizes"])
        assert groups and max(groups) <= 2 and sum(s * n for s, n in groups.items()) == 5
        assert torch.equal(torch.stack(rows), lm.batch_next_token_logprobs_sync(prompts))
    finally:
        lm.batch_size = 256
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
            lm.batch_size = bad
    assert lm.batch_size == 256


async def test_timeout_waits_for_stragglers(llama_lm):
    lm = llama_lm
    assert lm.timeout == 0.0
    lm.timeout = 1.0  # far longer than one event-loop pass
    try:
        assert lm.timeout == 1.0
        lm.clear_cache()
        before = lm.stats["logprobs"]["batch_sizes"]
        first = asyncio.ensure_future(lm.next_token_logprobs([0, 11, 12]))
        await asyncio.sleep(0)  # one loop pass: with timeout 0 the first query would be sent alone
        await asyncio.sleep(0)
        second = asyncio.ensure_future(lm.next_token_logprobs([0, 13, 14]))
        await asyncio.gather(first, second)
        assert _new_groups(before, lm.stats["logprobs"]["batch_sizes"]) == {2: 1}
    finally:
        lm.timeout = 0.0
    for bad in (-0.1, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="timeout must be a finite number"):
            lm.timeout = bad


# ---------------------------------------------------------------------------------- registration
@pytest.fixture
def fake_backend(tmp_path, monkeypatch):
    """A stand-in for genlm.backend.llm: a module with an ABC named ``MockAsyncLM``."""
    name = f"fake_genlm_backend_llm_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text("import abc\n\n\nclass MockAsyncLM(abc.ABC):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_genlm_compat, "BACKEND_LLM_MODULE", name)
    monkeypatch.setattr(_genlm_compat, "_declared", [])
    yield name
    sys.modules.pop(name, None)
    for finder in [f for f in sys.meta_path if getattr(f, "name", None) == name]:
        sys.meta_path.remove(finder)


def _watchers(name: str) -> list:
    return [f for f in sys.meta_path if isinstance(f, _genlm_compat._Watcher) and f.name == name]


def test_declared_class_is_registered_when_the_backend_is_imported_later(fake_backend):
    class Ours:
        pass

    _genlm_compat.declare_stand_in(Ours, "MockAsyncLM")
    assert fake_backend not in sys.modules and len(_watchers(fake_backend)) == 1
    module = importlib.import_module(fake_backend)
    assert isinstance(Ours(), module.MockAsyncLM)
    assert _watchers(fake_backend) == []  # the watcher removed itself
    assert "class MockAsyncLM" in inspect.getsource(module)  # the real loader still answers
    assert _genlm_compat.register_now() == []  # nothing left to do


def test_declared_class_is_registered_at_once_when_the_backend_is_loaded(fake_backend):
    module = importlib.import_module(fake_backend)

    class Ours:
        pass

    class Unrelated:
        pass

    _genlm_compat.declare_stand_in(Ours, "MockAsyncLM")
    _genlm_compat.declare_stand_in(Unrelated, "NoSuchClass")  # ignored, no error
    assert isinstance(Ours(), module.MockAsyncLM) and _watchers(fake_backend) == []


def test_the_real_classes_are_declared():
    from genlm_vlm.mock import MockAsyncLM
    from genlm_vlm.vllm_lm import AsyncVirtualLM

    declared = dict(_genlm_compat._declared)
    assert declared[AsyncVirtualLM] == "AsyncVirtualLM" and declared[MockAsyncLM] == "MockAsyncLM"
