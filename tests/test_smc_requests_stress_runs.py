"""More adversarial cases for ``engine_path="requests"``: controllers of one's own that fork every
particle from one parent at every step, a critic, several EOS ids; each equals its reference."""

from __future__ import annotations

import asyncio

import pytest
from test_controller_seam import TIMEOUT
from test_smc_requests_stress import _idle, _on_path, _prompt, _same

from genlm_vlm.smc import Controller, Decision, Regex, drive

pytestmark = pytest.mark.filterwarnings("ignore::genlm_vlm.smc.EmptyPosteriorWarning")


class ForkStorm(Controller):
    """Every step, every particle becomes a copy of particle ``step % n`` and particle ``i`` takes
    that parent's row's ``(i+1)``-th likeliest token: one group splits into n forks each step,
    every fork a fork of an earlier step's fork. The result: each particle's tokens."""

    def __init__(self, n: int, steps: int) -> None:
        self.n_particles, self.steps, self.seen = n, steps, 0

    def step(self, rows, particles):
        k = self.seen % len(particles)
        self.seen += 1
        order = rows[k].argsort(descending=True)
        tokens = [int(order[i]) for i in range(len(particles))]
        return Decision(tokens, parents=[k] * len(particles), stop=self.seen >= self.steps)

    def result(self, generated):
        return [list(g) for g in generated]


@pytest.mark.parametrize("plen", [9, 31, 32, 33])  # the context's tail at and around a block boundary
async def test_every_particle_forks_from_one_parent_every_step(llama_lm, plen):
    lm = llama_lm
    prompt = _prompt(lm, plen)
    got = await asyncio.wait_for(lm.run_controller(prompt, ForkStorm(5, 8), engine_path="requests"), TIMEOUT)
    assert got == await drive(lm, prompt, ForkStorm(5, 8))
    _idle(lm)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_critic_on_the_requests_path(llama_lm, kind):
    lm = llama_lm
    prompt = _prompt(lm, 9)

    def weigh(texts):
        return [-float(len(t)) for t in texts]

    async def aweigh(texts):
        return weigh(texts)

    critic = weigh if kind == "sync" else aweigh
    args = dict(seed=13, ess_threshold=0.9, critic=critic)
    req = lm.smc_sync(prompt, Regex(r"[a-z]{1,4}"), 6, 6, engine_path="requests", **args)
    ref = lm.smc_sync(prompt, Regex(r"[a-z]{1,4}"), 6, 6, in_engine=False, **args)
    _on_path(req)
    _same(req, ref)
    assert req.posterior


def test_several_eos_ids(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm, 9)
    eos = [lm.tokenizer.eos_token_id, *lm.tokenizer.encode(" ", add_special_tokens=False)[:1]]
    args = dict(seed=14, ess_threshold=0.9, eos_token_ids=eos)
    req = lm.smc_sync(prompt, Regex(r"[a-z]+"), 6, 8, engine_path="requests", **args)
    ref = lm.smc_sync(prompt, Regex(r"[a-z]+"), 6, 8, in_engine=False, **args)
    _on_path(req)
    _same(req, ref)


def _no_eos_mask(lm, started, at: int = 3):
    import numpy as np

    calls = {"n": 0}

    def mask(gens):
        calls["n"] += 1
        if calls["n"] == at:
            started.set()
        allow = np.ones((len(gens), lm.vocab_size), dtype=bool)
        allow[:, lm.tokenizer.eos_token_id] = False  # no particle finishes before max_tokens
        return allow

    return mask


async def test_a_run_cancelled_before_the_engine_sees_it(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm, 9)
    for _ in range(3):
        task = asyncio.ensure_future(lm.smc(prompt, Regex(r"[a-z ]+"), 6, 20, seed=1, engine_path="requests"))
        await asyncio.sleep(0)  # submitted, not yet admitted
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await lm.next_token_logprobs(prompt)  # one more engine step: anything left would show
    _idle(lm)
    got = await asyncio.wait_for(lm.smc(prompt, Regex(r"[a-z ]+"), 6, 8, seed=2, engine_path="requests"), TIMEOUT)
    _same(got, await lm.smc(prompt, Regex(r"[a-z ]+"), 6, 8, seed=2, in_engine=False))


async def test_cleanup_during_a_run_fails_it_and_never_hangs(fresh_lm):
    import threading

    from genlm_vlm import ClosedError
    from genlm_vlm.smc import TokenMask

    lm = fresh_lm
    prompt = _prompt(lm, 9)
    started = threading.Event()
    run = asyncio.ensure_future(lm.smc(prompt, TokenMask(_no_eos_mask(lm, started), "no EOS"), 6, 400, seed=0,
                                       engine_path="requests"))
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, started.wait, TIMEOUT)
    await loop.run_in_executor(None, lm.cleanup)
    with pytest.raises(RuntimeError, match="shut down") as info:  # as a burst's run: the loop's stop error
        await asyncio.wait_for(run, TIMEOUT)
    assert not isinstance(info.value, asyncio.TimeoutError)
    with pytest.raises(ClosedError):
        await lm.smc(prompt, Regex(r"[a-z ]+"), 2, 2, seed=0, engine_path="requests")


@pytest.mark.parametrize("plen", [1, 2, 32, 64])
def test_short_and_block_aligned_prompts_with_resampling(llama_lm, plen):
    lm = llama_lm
    prompt = _prompt(lm, plen)
    args = dict(seed=15, ess_threshold=0.9, temperature=1.5)
    req = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 8, 10, engine_path="requests", **args)
    ref = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 8, 10, in_engine=False, **args)
    _on_path(req)
    _same(req, ref)
    assert req.resampled_at
    _idle(lm)


def test_many_particles_and_an_unseeded_run(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm, 9)
    args = dict(seed=16, ess_threshold=0.9)
    req = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 48, 6, engine_path="requests", **args)
    ref = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 48, 6, in_engine=False, **args)
    _on_path(req)
    _same(req, ref)
    unseeded = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 6, engine_path="requests")
    _on_path(unseeded)
    assert len(unseeded.particles) == 6
    _idle(lm)


async def test_scoring_beside_runs_on_the_requests_path(llama_lm):
    """Prompt-logprob requests (``continuation_logprobs``) share steps with forced requests: each
    side equals its value alone."""
    lm = llama_lm
    prompt = _prompt(lm, 30)
    conts = [_prompt(lm, 40)[5:], _prompt(lm, 60)[20:]]
    args = dict(seed=17, ess_threshold=0.9)
    a, b, *scores = await asyncio.wait_for(asyncio.gather(
        lm.smc(prompt, Regex(r"[a-z ]+"), 8, 10, engine_path="requests", **args),
        lm.smc(prompt[:12], Regex(r"[a-z ]+"), 5, 10, engine_path="requests", seed=18),
        *(lm.continuation_logprobs(prompt, c) for c in conts),
    ), TIMEOUT)
    _on_path(a)
    _same(a, await lm.smc(prompt, Regex(r"[a-z ]+"), 8, 10, in_engine=False, **args))
    _same(b, await lm.smc(prompt[:12], Regex(r"[a-z ]+"), 5, 10, in_engine=False, seed=18))
    lm.clear_cache()
    for c, got in zip(conts, scores, strict=True):
        assert bool((got == await lm.continuation_logprobs(prompt, c)).all())
    _idle(lm)


async def test_a_forward_fault_fails_every_forced_run_and_later_runs_are_exact(fresh_lm):
    """An exception inside the model's forward while two runs on the requests path, a burst and a
    row await share the step: each fails or is exact (none hangs); the next runs equal their
    reference and nothing is left running."""
    from conftest import ForwardFault

    lm = fresh_lm
    prompt = _prompt(lm, 20)
    lm.next_token_logprobs_sync(prompt)  # warm: the fault lands in the runs' steps
    args = dict(seed=19, ess_threshold=0.9)
    with ForwardFault(lm, at=4) as fault:
        out = await asyncio.wait_for(asyncio.gather(
            lm.smc(prompt, Regex(r"[a-z ]+"), 6, 12, engine_path="requests", **args),
            lm.smc(prompt, Regex(r"[a-z ]+"), 4, 12, engine_path="requests", seed=20),
            lm.smc(prompt, Regex(r"[a-z ]+"), 4, 12, seed=21, engine_path="bursts"),
            lm.next_token_logprobs([*prompt, 9, 9, 9]),
            return_exceptions=True), TIMEOUT)
    assert fault.fired == 1
    refs = [await lm.smc(prompt, Regex(r"[a-z ]+"), 6, 12, in_engine=False, **args),
            await lm.smc(prompt, Regex(r"[a-z ]+"), 4, 12, in_engine=False, seed=20),
            await lm.smc(prompt, Regex(r"[a-z ]+"), 4, 12, in_engine=False, seed=21)]
    failed = 0
    for got, ref in zip(out[:3], refs, strict=True):
        if isinstance(got, BaseException):
            assert "injected fault" in str(got), got
            failed += 1
        else:
            _same(got, ref)
    assert failed >= 1
    _idle(lm)
    again = await asyncio.wait_for(lm.smc(prompt, Regex(r"[a-z ]+"), 6, 12, engine_path="requests", **args), TIMEOUT)
    _same(again, refs[0])
    _idle(lm)


@pytest.mark.parametrize("budget", [0, 1, 2])
async def test_a_controller_whose_max_tokens_understates_its_steps(llama_lm, budget, monkeypatch):
    """A controller of one's own with ``max_tokens`` smaller than the steps it runs: vLLM ends its
    requests on their own mid-run, and the run re-adds them; the result equals the reference."""
    from test_controller_seam import Argmax

    from genlm_vlm.engine.particles import RequestRun

    class Short(Argmax):
        max_tokens = budget

    gone = []
    real = RequestRun.request_gone
    monkeypatch.setattr(RequestRun, "request_gone", lambda run, rid: (gone.append(rid), real(run, rid))[1])
    lm = llama_lm
    prompt = _prompt(lm, 10)
    got = await asyncio.wait_for(lm.run_controller(prompt, Short(3, 6), engine_path="requests"), TIMEOUT)
    assert got == await drive(lm, prompt, Short(3, 6))
    assert gone  # vLLM did end requests of the run on their own
    _idle(lm)
