"""``lm.smc(..., engine_path="requests")``: particles as running requests whose tokens are forced
inside vLLM's sampler (:mod:`genlm_vlm.engine.particles`), on the real engine.

* a seeded run is byte-identical to the per-token reference (``in_engine=False``) and to the
  burst, with and without resampling, on both architectures;
* a resampled copy that diverges from its parent is a fork that computes only its partial block
  (+1), never its history;
* the option is checked like the others; what the path does not cover runs as a burst and says so.
"""

from __future__ import annotations

import asyncio

import pytest

from genlm_vlm.smc import Regex

pytestmark = pytest.mark.filterwarnings("ignore::genlm_vlm.smc.EmptyPosteriorWarning")

PROMPT = "def main():\n    return"


def _prompt(lm) -> list[int]:
    tok = lm.tokenizer
    return [tok.bos_token_id, *tok.encode(PROMPT, add_special_tokens=False)]


def _fingerprint(result) -> list:
    return [(p.token_ids, p.log_weight, p.status) for p in result.particles]


def _same(a, b) -> None:
    assert _fingerprint(a) == _fingerprint(b)
    assert a.log_marginal == b.log_marginal and a.log_marginal_cut == b.log_marginal_cut
    assert a.ess == b.ess and a.resampled_at == b.resampled_at
    assert a.posterior == b.posterior


@pytest.mark.parametrize("ess", [0.0, 0.9])
def test_requests_path_is_byte_identical_to_the_reference_and_the_burst(lm, ess):
    prompt = _prompt(lm)
    args = dict(seed=11, ess_threshold=ess)
    req = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 12, 16, engine_path="requests", **args)
    ref = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 12, 16, in_engine=False, **args)
    burst = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 12, 16, engine_path="bursts", **args)
    assert req.stats["engine_path"] == "requests" and req.stats["runner"] == "v1"
    assert "engine_path_fallback" not in req.stats
    assert burst.stats["engine_path"] == "bursts"
    _same(req, ref)
    _same(req, burst)
    counts = req.stats["particle_requests"]
    assert counts["early_rows"] == 0 and counts["readded"] == 0  # every particle in every step
    assert counts["forks"] >= 1  # the first step's particles share the prompt
    if ess:
        assert len(req.resampled_at) >= 1
    s = lm.stats
    assert s["particle_requests"]["running"] == 0 and s["particle_requests"]["requests"] == 0
    assert s["bursts"]["running"] == 0


def test_forks_compute_their_partial_block_only(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm)
    args = dict(seed=5, ess_threshold=0.9, resampling="multinomial", temperature=1.5)
    req = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 12, 16, engine_path="requests", **args)
    ref = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 12, 16, in_engine=False, **args)
    _same(req, ref)
    assert len(req.resampled_at) >= 2
    counts = req.stats["particle_requests"]
    assert counts["forks"] > 12  # the first step's and the resampled copies'
    assert counts["fork_prefill_tokens"] > 0
    # copy-on-write of the parent's tail block: a fork computes its new token only
    assert counts["fork_prefill_max"] <= 1
    assert counts["fork_prefill_tokens"] <= counts["forks"]


def test_particles_that_finish_without_resampling_drop_their_groups(llama_lm, monkeypatch):
    # A step where particles finish, without resampling, every group one particle: the finished
    # particles' groups are dropped (their requests aborted) and no other group changes.
    from genlm_vlm.engine.particles import RequestRun

    dropped = []
    real = RequestRun._drop_finished

    def spy(self, old, new_live, gen):
        done = real(self, old, new_live, gen)
        if done:
            dropped.append(len(old) - len(self.groups))
        return done

    monkeypatch.setattr(RequestRun, "_drop_finished", spy)
    lm = llama_lm
    prompt = _prompt(lm)
    args = dict(seed=3, ess_threshold=0.0, temperature=1.5)
    req = lm.smc_sync(prompt, Regex(r"[a-z]{1,6}"), 12, 16, engine_path="requests", **args)
    ref = lm.smc_sync(prompt, Regex(r"[a-z]{1,6}"), 12, 16, in_engine=False, **args)
    _same(req, ref)
    assert sum(dropped) > 0  # the path ran, and dropped groups of finished particles
    counts = req.stats["particle_requests"]
    assert counts["aborted"] == counts["requests"]  # every request ended by the run, none twice
    assert req.stats["finished"] > 0


def test_engine_path_is_checked(llama_lm):
    prompt = _prompt(llama_lm)
    with pytest.raises(ValueError, match="engine_path must be 'auto'"):
        llama_lm.smc_sync(prompt, Regex("[a-z]+"), 2, 2, engine_path="request")
    with pytest.raises(TypeError, match="engine_path must be 'auto', 'bursts' or 'requests'"):
        asyncio.run(llama_lm.smc(prompt, Regex("[a-z]+"), 2, 2, engine_path=1))
    with pytest.raises(ValueError, match="engine_path must be 'auto'"):
        asyncio.run(llama_lm.run_controller(prompt, object(), engine_path="Auto"))


def test_auto_takes_the_requests_path_on_the_cpu_build_and_bursts_on_a_gpu(llama_lm, monkeypatch):
    """The default, ``"auto"``: the requests path on the CPU build (where it was measured), and
    bursts, with the reason, on any other device until the path has run there; an explicit
    ``"requests"`` is taken there all the same."""
    from genlm_vlm.engine import paths

    lm = llama_lm
    prompt = _prompt(lm)
    auto = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 6, seed=3)
    assert auto.stats["engine_path"] == "requests" and "engine_path_fallback" not in auto.stats
    bursts = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 6, seed=3, engine_path="bursts")
    assert bursts.stats["engine_path"] == "bursts" and "engine_path_fallback" not in bursts.stats
    _same(auto, bursts)
    tok = lm.tokenizer
    prompts = [prompt, [tok.bos_token_id, *tok.encode("hello world", add_special_tokens=False)]]
    product = lm.smc_sync(None, Regex(r"[a-z ]+"), 4, 4, seed=3, prompts=prompts)
    assert product.stats["engine_path"] == "requests" and "engine_path_fallback" not in product.stats
    before = lm.stats["particle_requests"]["fallbacks"].get(paths.GPU_UNMEASURED, 0)
    monkeypatch.setattr(paths, "on_measured_device", lambda host: False)  # as on a CUDA engine
    gpu = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 6, seed=3)
    assert gpu.stats["engine_path"] == "bursts"
    assert gpu.stats["engine_path_fallback"] == paths.GPU_UNMEASURED
    assert "engine_path='requests'" in gpu.stats["engine_path_fallback"]  # the way to take it
    assert lm.stats["particle_requests"]["fallbacks"][paths.GPU_UNMEASURED] == before + 1
    asked = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 6, seed=3, engine_path="requests")
    assert asked.stats["engine_path"] == "requests" and "engine_path_fallback" not in asked.stats
    _same(gpu, auto)
    _same(asked, auto)


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_a_product_of_prompts_is_byte_identical_on_the_requests_path(llama_lm, temperature):
    """One group per factor context, every factor's rows in before the controller decides, folded
    as a burst folds them: the reference's run exactly, with resampling."""
    lm = llama_lm
    tok = lm.tokenizer
    prompts = [_prompt(lm), [tok.bos_token_id, *tok.encode("hello world", add_special_tokens=False)]]
    args = dict(seed=7, ess_threshold=0.9, prompts=prompts, temperature=temperature)
    req = lm.smc_sync(None, Regex(r"[a-z ]+"), 12, 14, engine_path="requests", **args)
    ref = lm.smc_sync(None, Regex(r"[a-z ]+"), 12, 14, in_engine=False, **args)
    burst = lm.smc_sync(None, Regex(r"[a-z ]+"), 12, 14, engine_path="bursts", **args)
    assert req.stats["engine_path"] == "requests", req.stats.get("engine_path_fallback")
    _same(req, ref)
    _same(req, burst)
    assert req.resampled_at
    counts = req.stats["particle_requests"]
    assert counts["early_rows"] == 0 and counts["readded"] == 0
    assert counts["forks"] >= 2  # each factor's first step: its particles share its prompt
    one = lm.smc_sync(prompts[0], Regex(r"[a-z ]+"), 12, 14, seed=7, ess_threshold=0.9, temperature=temperature,
                      engine_path="requests")
    assert _fingerprint(one) != _fingerprint(req)  # the second factor's rows count


@pytest.mark.parametrize("kind", ["json", "ebnf", "lark", "mask"])
def test_every_constraint_kind_is_byte_identical_on_the_requests_path(llama_lm, kind):
    import numpy as np
    from test_smc import CONSTRAINTS

    from genlm_vlm.smc import TokenMask

    lm = llama_lm
    prompt = _prompt(lm)
    if kind == "mask":
        bits = np.zeros(lm.vocab_size, dtype=bool)
        bits[5:200:3] = True
        bits[lm.tokenizer.eos_token_id] = True

        def make():
            return TokenMask(lambda gens: np.repeat(bits[None, :], len(gens), axis=0), "every third token")
    else:
        make = CONSTRAINTS[kind]
    args = dict(seed=11, ess_threshold=0.9, force_eos=True)
    req = lm.smc_sync(prompt, make(), 12, 16, engine_path="requests", **args)
    ref = lm.smc_sync(prompt, make(), 12, 16, in_engine=False, **args)
    assert req.stats["engine_path"] == "requests"
    _same(req, ref)


def test_a_critic_and_an_allof_constraint_are_byte_identical_on_the_requests_path(llama_lm):
    """A terminal critic (applied after the run, on the host) and ``AllOf`` of a grammar and a
    ``TokenMask`` (both matchers inside the sampler) give the reference's run exactly."""
    import numpy as np

    from genlm_vlm.smc import AllOf, TokenMask

    lm = llama_lm
    prompt = _prompt(lm)
    bits = np.ones(lm.vocab_size, dtype=bool)
    bits[1::5] = False  # every fifth id off (EOS stays on: the constraint may end)
    bits[lm.tokenizer.eos_token_id] = True

    def make():
        return AllOf(Regex(r"[a-z ]+"), TokenMask(lambda gens: np.repeat(bits[None, :], len(gens), axis=0), "4 of 5"))

    def critic(texts):
        return [-0.3 * t.count(b" ") - 0.1 * len(t) for t in texts]  # texts are bytes

    args = dict(seed=13, ess_threshold=0.9, force_eos=True)
    for extra in (dict(critic=critic), {}):
        req = lm.smc_sync(prompt, make(), 12, 12, engine_path="requests", **args, **extra)
        ref = lm.smc_sync(prompt, make(), 12, 12, in_engine=False, **args, **extra)
        assert req.stats["engine_path"] == "requests", req.stats.get("engine_path_fallback")
        _same(req, ref)
        assert len(req.resampled_at) >= 1
    plain = lm.smc_sync(prompt, make(), 12, 12, engine_path="requests", **args)
    judged = lm.smc_sync(prompt, make(), 12, 12, engine_path="requests", critic=critic, **args)
    assert plain.posterior != judged.posterior  # the critic reweighted the same texts


def test_idle_sessions_make_room_for_the_runs_requests(model_paths):
    """Idle sessions hold slots of ``max_num_seqs`` (vLLM parks them and counts them): the step
    loop's eviction counts the requests path's requests too, so a run's groups are never left out
    of a step by other callers' idle sessions (before: every step had early rows and re-adds)."""
    from conftest import ENGINE_OPTS

    from genlm_vlm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(model_paths["llama"], {**ENGINE_OPTS, "max_num_seqs": 16})
    try:
        prompt = _prompt(lm)
        lm.batch_next_token_logprobs_sync([[5 + i, 7, 9, 11] for i in range(14)])  # 14 idle sessions
        assert lm.stats["sessions"]["idle"] == 14
        args = dict(seed=3, ess_threshold=0.0)
        req = lm.smc_sync(prompt, Regex(r"[a-z ]{100}"), 8, 10, engine_path="requests", **args)
        ref = lm.smc_sync(prompt, Regex(r"[a-z ]{100}"), 8, 10, in_engine=False, **args)
        _same(req, ref)
        counts = req.stats["particle_requests"]
        assert counts["early_rows"] == 0 and counts["readded"] == 0, counts
        assert lm.stats["sessions"]["evicted"] >= 6  # room for the run's 8 requests
    finally:
        lm.cleanup()
