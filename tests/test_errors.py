"""Bad input, out-of-memory halving and engine faults, on the real engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import fail_first_capture, max_abs_diff

from genlm_vlm.testing import hf_reference_logprobs

BAD_INPUTS = [
    ([], ValueError, "empty"),
    ("hello", TypeError, "tokenizer.encode"),
    ([1, 2.5], TypeError, r"token_ids\[1\]"),
    ([1, True], TypeError, r"token_ids\[1\]"),
    ([1, None], TypeError, r"token_ids\[1\]"),
    (5, TypeError, "sequence"),
    ([1, -1], ValueError, "outside the vocabulary"),
    ([1, 10**6], ValueError, "outside the vocabulary"),
    (list(range(3, 100)) * 6, ValueError, "at most 511"),
    (torch.tensor([[1, 2]]), ValueError, "1-D"),
    (torch.tensor([1.0, 2.0]), TypeError, "integers"),
]


@pytest.mark.parametrize("bad,exc,match", BAD_INPUTS)
def test_bad_input_sync(llama_lm, bad, exc, match):
    with pytest.raises(exc, match=match):
        llama_lm.next_token_logprobs_sync(bad)


@pytest.mark.parametrize("bad,exc,match", BAD_INPUTS)
async def test_bad_input_async(llama_lm, bad, exc, match):
    with pytest.raises(exc, match=match):
        await llama_lm.next_token_logprobs(bad)


def test_vocab_edge_ids_are_accepted(llama_lm):
    llama_lm.next_token_logprobs_sync([0, llama_lm.vocab_size - 1])
    llama_lm.next_token_logprobs_sync([3 + i % 100 for i in range(llama_lm.max_model_len - 1)])


def test_bad_prompt_in_sync_batch_names_index_and_next_call_works(llama_lm, model_paths):
    good = [[5, 6], [7, 8, 9]]
    with pytest.raises(ValueError, match=r"token_ids_list\[1\]"):
        llama_lm.batch_next_token_logprobs_sync([good[0], [], good[1]])
    rows = llama_lm.batch_next_token_logprobs_sync(good)
    assert max_abs_diff(rows, hf_reference_logprobs(model_paths["llama"], good)) < 1e-4


async def test_bad_prompt_among_concurrent_awaits_fails_only_its_caller(llama_lm, model_paths):
    llama_lm.clear_cache()
    good = [[5, 6, i] for i in range(3, 23)]
    calls = [llama_lm.next_token_logprobs(p) for p in good[:10]]
    calls.append(llama_lm.next_token_logprobs([1, 10**6]))
    calls += [llama_lm.next_token_logprobs(p) for p in good[10:]]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(results[10], ValueError)
    rows = results[:10] + results[11:]
    assert all(isinstance(r, torch.Tensor) for r in rows)
    assert max_abs_diff(rows, hf_reference_logprobs(model_paths["llama"], good)) < 1e-4


def test_oom_halves_the_chunk_and_retries(llama_lm, monkeypatch, model_paths):
    llama_lm.clear_cache()
    real = llama_lm._compute_rows
    sizes = []

    def flaky(reqs):
        sizes.append(len(reqs))
        if len(reqs) > 5:
            raise torch.OutOfMemoryError("fake OOM")
        return real(reqs)

    monkeypatch.setattr(llama_lm, "_compute_rows", flaky)
    prompts = [[5, i, i + 1] for i in range(3, 23)]
    rows = llama_lm.batch_next_token_logprobs_sync(prompts, chunk_size=16)
    assert sizes[:3] == [16, 8, 4] and set(sizes[2:]) == {4}
    assert max_abs_diff(rows, hf_reference_logprobs(model_paths["llama"], prompts)) < 1e-4


def test_oom_below_min_chunk_reraises(llama_lm, monkeypatch):
    llama_lm.clear_cache()
    monkeypatch.setattr(llama_lm, "min_chunk_size", 4)

    def always(reqs):
        raise torch.OutOfMemoryError("fake OOM")

    monkeypatch.setattr(llama_lm, "_compute_rows", always)
    with pytest.raises(torch.OutOfMemoryError):
        llama_lm.batch_next_token_logprobs_sync([[5, i] for i in range(3, 20)], chunk_size=16)


def test_engine_failure_mid_generate_then_next_call_is_clean(fresh_lm, model_paths):
    """A step that raises leaves requests in vLLM; they must not leak into the next call."""
    lm = fresh_lm
    fail_first_capture(lm, "boom in the sampler")
    with pytest.raises(RuntimeError, match="boom"):
        lm.batch_next_token_logprobs_sync([[5, 6, 7], [8, 9]])
    assert not lm._driver._loop._by_rid and lm.stats["sessions"]["live"] == 0
    prompts = [[11, 12], [13, 14, 15]]
    rows = lm.batch_next_token_logprobs_sync(prompts)
    assert max_abs_diff(rows, hf_reference_logprobs(model_paths["llama"], prompts)) < 1e-4


def test_uncaught_tracebacks_have_no_rank_prefix(model_paths):
    """torch.distributed (which vLLM initialises in-process) swaps sys.excepthook for one that
    prefixes every traceback line with ``[rank0]:``; building a model keeps the process's own hook."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import ENGINE_OPTS

    code = (
        "import sys\n"
        "from genlm_vlm import AsyncVirtualLM\n"
        "lm = AsyncVirtualLM.from_name(sys.argv[1], eval(sys.argv[2]))\n"
        "raise RuntimeError('boom from the script')\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = {**__import__("os").environ, "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-c", code, model_paths["llama"], repr(ENGINE_OPTS)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "RuntimeError: boom from the script" in proc.stderr
    assert "[rank0]" not in proc.stderr, proc.stderr[-3000:]
