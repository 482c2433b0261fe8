"""No silently wrong row (issue 29), on the real engine with tiny models.

1. A fault inside the forward pass (a decoder layer of the tiny model patched to raise once)
   during a plain row step, a session chunk, a fork, a scoring request, a chunked prefill, a
   LoRA request and the sync path's out-of-memory retry: the calls in that step fail (or, on the
   sync path, are retried), and then the same and overlapping prompts are exact (< 1e-4 against
   transformers float32), nothing hangs and later calls are served. Before the fix the failed
   step's KV blocks stayed in vLLM's prefix cache as computed and later hits read garbage.
2. An adapter rewritten in place and registered again under the same name gives the new
   weights' rows (peft reference) on the same and on overlapping prompts, as plain requests and
   as forks; so does removing and adding it again.
3. Every row a caller gets is an ordinary tensor it owns (not an inference tensor): ``row[0] =
   -inf`` and ``row.requires_grad_()`` work on every path.
4. Identical concurrent awaits resume in the order they were made.

Each test fails on the code before the fix (aa329a7).
"""

from __future__ import annotations

import asyncio
import random
import shutil

import pytest
import torch
from conftest import ENGINE_OPTS, ForwardFault, _engine, max_abs_diff
from test_lora import LORA_OPTS, _make_adapter

from genlm_vlm.testing import hf_reference_logprobs, random_prompts

#: Chunked prefill: a step computes at most 64 tokens (two KV blocks of 32).
FAULT_OPTS = {**ENGINE_OPTS, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def flm(model_paths):
    """A private llama engine that the tests here break (a fault at a time)."""
    from genlm_vlm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(model_paths["llama"], dict(FAULT_OPTS))
    yield lm
    lm.cleanup()


def _exact(path, prompts, rows, lora_path=None) -> None:
    err = max_abs_diff(rows, hf_reference_logprobs(path, prompts, lora_path=lora_path))
    assert err < 1e-4, err


async def _rows_exact(lm, path, prompts, lora_name=None, lora_path=None) -> None:
    rows = await asyncio.gather(*(lm.next_token_logprobs(p, lora_name=lora_name) for p in prompts))
    _exact(path, prompts, rows, lora_path)


def _overlapping(prompts, keep: int, seed: int, V: int, extra: int = 6) -> list[list[int]]:
    """Each prompt's first ``keep`` tokens and ``extra`` new ones (shares its full blocks)."""
    rng = random.Random(seed)
    return [p[:keep] + [rng.randrange(3, V) for _ in range(extra)] for p in prompts]


def _faults(lm) -> dict:
    return lm.stats["faults"]


def _stats(lm) -> dict:
    return lm.stats


async def _fails(coros) -> list:
    out = await asyncio.gather(*coros, return_exceptions=True)
    assert [o for o in out if isinstance(o, BaseException)], "the fault failed no call"
    for o in out:
        if isinstance(o, BaseException):
            assert "injected fault" in str(o), o
    return out


# ================================================================ 1. faults inside the forward
async def test_a_fault_in_a_row_step_leaves_nothing_wrong_behind(flm, model_paths):
    path, V = model_paths["llama"], flm.vocab_size
    prompts = random_prompts(6, V, 70, 70, seed=2901)
    before = _faults(flm)
    with ForwardFault(flm) as fault:
        await _fails(flm.next_token_logprobs(p) for p in prompts)
    assert fault.fired == 1
    after = _faults(flm)
    assert after["failed_steps"] == before["failed_steps"] + 1
    assert after["prefix_cache_resets"] == before["prefix_cache_resets"] + 1 and not after["prefix_cache_suspect"]
    await _rows_exact(flm, path, prompts)
    await _rows_exact(flm, path, _overlapping(prompts, 64, 1, V))


def test_an_out_of_memory_error_in_a_sync_batch_is_retried_exactly(flm, model_paths):
    path, V = model_paths["llama"], flm.vocab_size
    prompts = random_prompts(6, V, 70, 70, seed=2902)
    with ForwardFault(flm, torch.OutOfMemoryError) as fault:
        rows = flm.batch_next_token_logprobs_sync(prompts)  # halves the chunk and tries again
    assert fault.fired == 1
    _exact(path, prompts, rows)
    _exact(path, prompts, flm.batch_next_token_logprobs_sync(prompts))
    overlapping = _overlapping(prompts, 64, 2, V)
    _exact(path, overlapping, flm.batch_next_token_logprobs_sync(overlapping))


async def test_a_fault_in_a_session_chunk(flm, model_paths):
    path, V = model_paths["llama"], flm.vocab_size
    (base,) = random_prompts(1, V, 60, 60, seed=2903)
    await flm.next_token_logprobs(base)  # an idle session holding 60 tokens
    chunk = base + random_prompts(1, V, 10, 10, seed=2904)[0]  # completes the session's 2nd block
    continued = _stats(flm)["sessions"]["continued"]
    with ForwardFault(flm):
        await _fails([flm.next_token_logprobs(chunk)])
    assert _stats(flm)["sessions"]["continued"] == continued + 1  # it was sent as a chunk
    await _rows_exact(flm, path, [chunk, *_overlapping([chunk], 64, 3, V), base + [7]])


async def test_a_fault_in_a_fork(flm, model_paths):
    path, V = model_paths["llama"], flm.vocab_size
    (parent,) = random_prompts(1, V, 50, 50, seed=2905)
    await flm.next_token_logprobs(parent)
    await flm.next_token_logprobs(parent + [11])  # continues the parent's session
    sibling = parent + [12] + random_prompts(1, V, 13, 13, seed=2906)[0]  # a fork; fills block 2
    forked = _stats(flm)["sessions"]["forked"]
    with ForwardFault(flm):
        await _fails([flm.next_token_logprobs(sibling)])
    assert _stats(flm)["sessions"]["forked"] == forked + 1
    await _rows_exact(flm, path, [sibling, *_overlapping([sibling], 64, 4, V), parent + [13]])
    # and forks work again afterwards
    await flm.next_token_logprobs(sibling + [5])
    await _rows_exact(flm, path, [sibling + [6], sibling + [5, 9]])


def _reference_scores(path, prompt, cont) -> torch.Tensor:
    refs = hf_reference_logprobs(path, [prompt + cont[:t] for t in range(len(cont))])
    return torch.stack([r[c] for r, c in zip(refs, cont, strict=True)])


async def test_a_fault_in_a_scoring_request(flm, model_paths):
    path, V = model_paths["llama"], flm.vocab_size
    prompt, cont = random_prompts(2, V, 40, 40, seed=2907)
    with ForwardFault(flm):
        await _fails([flm.continuation_logprobs(prompt, cont)])
    got = await flm.continuation_logprobs(prompt, cont)
    assert float((got - _reference_scores(path, prompt, cont)).abs().max()) < 1e-4
    other = cont[:25] + random_prompts(1, V, 15, 15, seed=2908)[0]
    got = await flm.continuation_logprobs(prompt, other)
    assert float((got - _reference_scores(path, prompt, other)).abs().max()) < 1e-4
    assert _stats(flm)["scoring"]["jobs"] >= 3  # scored from prompt log-probabilities, not rows
    await _rows_exact(flm, path, [prompt + cont[:30], prompt + other])


async def test_a_fault_in_the_second_chunk_of_a_prefill(flm, model_paths):
    path, V = model_paths["llama"], flm.vocab_size
    (long,) = random_prompts(1, V, 150, 150, seed=2909)  # three steps of at most 64 tokens
    with ForwardFault(flm, at=1) as fault:
        await _fails([flm.next_token_logprobs(long)])
    assert fault.fired == 1
    await _rows_exact(flm, path, [long, *_overlapping([long], 128, 5, V), long[:100]])


async def test_a_fault_in_a_lora_request(model_paths, tmp_path):
    path, V = model_paths["llama"], None
    lm = _engine(path, LORA_OPTS)
    V = lm.vocab_size
    adapter = _make_adapter(path, tmp_path / "f", seed=29)
    lm.add_new_lora(adapter, "fault29")
    try:
        prompts = random_prompts(4, V, 70, 70, seed=2910)
        with ForwardFault(lm):
            await _fails(lm.next_token_logprobs(p, lora_name="fault29") for p in prompts)
        await _rows_exact(lm, path, prompts, "fault29", adapter)
        await _rows_exact(lm, path, _overlapping(prompts, 64, 6, V), "fault29", adapter)
        await _rows_exact(lm, path, prompts[:2])  # the base model too
    finally:
        lm.remove_lora("fault29")


# ================================================================ 2. an adapter reloaded
async def test_an_adapter_rewritten_in_place_and_registered_again(model_paths, tmp_path):
    path = model_paths["llama"]
    lm = _engine(path, LORA_OPTS)
    V = lm.vocab_size
    live = tmp_path / "live"
    versions = [_make_adapter(path, tmp_path / f"v{i}", seed=290 + i) for i in range(3)]
    (p,) = random_prompts(1, V, 70, 70, seed=2911)
    overlapping = _overlapping([p], 64, 7, V)

    async def serve_and_check(version: str) -> None:
        await _rows_exact(lm, path, [p], "live", version)  # plain request (prefix-cache hits)
        await _rows_exact(lm, path, [p + [21]], "live", version)  # continues p's session
        await _rows_exact(lm, path, [p + [22], p + [23]], "live", version)  # forks of it
        await _rows_exact(lm, path, overlapping, "live", version)

    shutil.copytree(versions[0], live)
    lm.add_new_lora(str(live), "live")
    try:
        await serve_and_check(versions[0])
        forked = _stats(lm)["sessions"]["forked"]
        shutil.copytree(versions[1], live, dirs_exist_ok=True)  # retrained, saved in place
        lm.add_new_lora(str(live), "live")
        await serve_and_check(versions[1])
        assert _stats(lm)["sessions"]["forked"] >= forked + 2
        lm.remove_lora("live")
        shutil.copytree(versions[2], live, dirs_exist_ok=True)
        lm.add_new_lora(str(live), "live")
        await serve_and_check(versions[2])
        _exact(path, [p], lm.batch_next_token_logprobs_sync([p], lora_name="live"), versions[2])
    finally:
        if "live" in lm.lora_names:
            lm.remove_lora("live")


# ================================================================ 3. rows the caller owns
def _editable(row: torch.Tensor, where: str) -> None:
    assert not row.is_inference(), where
    row = row.detach() if row.requires_grad else row
    row[0] = -float("inf")
    row.requires_grad_()
    assert row.requires_grad, where


async def test_every_row_is_an_ordinary_tensor_the_caller_can_edit(flm):
    V = flm.vocab_size
    prompts = random_prompts(8, V, 5, 40, seed=2912)
    first = await flm.next_token_logprobs(prompts[0])  # asked once: not kept by the cache
    _editable(first, "first ask")
    await flm.next_token_logprobs(prompts[0])  # asked twice: kept
    _editable(await flm.next_token_logprobs(prompts[0]), "cached")
    for i, row in enumerate(await asyncio.gather(*(flm.next_token_logprobs(prompts[1]) for _ in range(3)))):
        _editable(row, f"joined {i}")
    batch = await flm.batch_next_token_logprobs(prompts[2:4])
    _editable(batch, "batch")
    for i in range(2):
        _editable(batch[i], f"batch row {i}")
    _editable(flm.next_token_logprobs_sync(prompts[4]), "sync")
    _editable(flm.batch_next_token_logprobs_sync(prompts[4:6]), "batch sync")
    _editable(await flm.continuation_logprobs(prompts[6], [5, 6, 7]), "continuation")
    _editable((await flm.next_token_topk(prompts[7], 3)).logprobs, "top-k")


async def test_every_row_is_an_ordinary_tensor_without_an_output_cache(model_paths):
    lm = _engine(model_paths["llama"], ENGINE_OPTS)
    (p,) = random_prompts(1, lm.vocab_size, 5, 40, seed=2913)
    cache = lm._logprob_batcher.cache
    lm._logprob_batcher.cache = None  # as with cache_size=0: every single awaiter owns the row
    try:
        for _ in range(2):
            _editable(await lm.next_token_logprobs(p), "no cache")
    finally:
        lm._logprob_batcher.cache = cache


# ================================================================ 4. order of joined awaits
async def test_identical_awaits_resume_in_the_order_they_were_made(flm):
    order: list[int] = []
    (p,) = random_prompts(1, flm.vocab_size, 5, 40, seed=2914)

    async def one(i: int) -> None:
        await flm.next_token_logprobs(p)
        order.append(i)

    await asyncio.gather(*(one(i) for i in range(10)))
    assert order == list(range(10))
