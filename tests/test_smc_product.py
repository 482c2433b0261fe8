"""A product of prompts (``lm.smc(..., prompts=[...])``) and a terminal critic (``critic=``).

* pure parts: :func:`fold_rows` adds the factors' rows in order; :meth:`ParticleSet.wanted`
  lists one context per factor per particle; bad ``prompts``/``critic`` arguments (and bad
  critic answers) raise errors naming them (on the mock: no engine);
* on the real engine (tiny llama): the product run is byte-identical to its Python reference,
  with resampling and temperature; each factor continues its own session (one token computed per
  factor per particle per step); the same result beside other traffic;
* exactness on a small finite language (two of three tokens, then EOS): the pooled posterior of seeded runs is the enumerated
  product posterior ``∝ prod_j p(x | p_j)``, and ``exp(log_marginal)`` is unbiased for
  ``sum_x prod_j p(x | p_j)``; a critic that reweights texts gives the reweighted posterior and
  an unbiased reweighted marginal.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from test_smc import _enumerate, _tv

from genlm_vlm.smc import Decision, Regex, TokenMask
from genlm_vlm.smc.controller import Controller, ParticleSet, fold_rows


def _prompts(lm) -> list[list[int]]:
    tok = lm.tokenizer
    texts = ("def main():\n    return", "hello world")
    return [[tok.bos_token_id, *tok.encode(t, add_special_tokens=False)] for t in texts]


def _fingerprint(result) -> list:
    return [(p.token_ids, p.log_weight, p.status) for p in result.particles]


# ------------------------------------------------------------------------------ pure parts
def test_fold_rows_adds_the_factors_in_order():
    rows = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    assert fold_rows(rows, 1) is rows
    two = fold_rows(rows, 2)
    assert torch.equal(two, rows[:3] + rows[3:])
    three = fold_rows(rows, 3)
    assert torch.equal(three, (rows[:2] + rows[2:4]) + rows[4:])
    assert three.dtype == torch.float32 and rows[0, 0] == 0  # the input is not written into


def test_particle_set_lists_one_context_per_factor():
    ps = ParticleSet((9,), 2, prompts=[(1, 2), (3, 4, 5)], max_len=6)
    ps.apply(Decision([7, 8]), [0, 1])
    assert ps.wanted([0, 1]) == [(1, 2, 7), (1, 2, 8), (3, 4, 5, 7), (3, 4, 5, 8)]
    assert ps.prefix(1) == (1, 2, 8)
    # contexts are checked against the longest prompt (the first alone would allow one more)
    ps.apply(Decision([1, 1]), [0, 1])
    with pytest.raises(ValueError, match="max_model_len=6"):
        ps.apply(Decision([1, 1]), [0, 1])


def _mock():
    from genlm_vlm import MockAsyncLM

    return MockAsyncLM(seed=1, max_model_len=64)


def _ten_tokens(lm):
    mask = np.zeros((1, lm.vocab_size), dtype=bool)
    mask[0, 10:20] = True
    mask[0, lm.tokenizer.eos_token_id] = True
    return TokenMask(lambda gens: np.repeat(mask, len(gens), axis=0), name="ten tokens")


@pytest.mark.parametrize(("prompt_ids", "prompts", "error", "match"), [
    ([1, 2], [[1, 2], [3]], ValueError, "prompt_ids=None with prompts="),
    (None, [[1, 2]], ValueError, "at least 2 prompts"),
    (None, [1, 2], TypeError, "one list of ints"),
    (None, "ab", TypeError, "prompts must be a list"),
    (None, [[1, 2], []], ValueError, r"prompts\[1\] is empty"),
    (None, [[1, 2], [1, 10**9]], ValueError, r"prompts\[1\]"),
    (None, [[1, 2], [1] * 60], ValueError, r"prompts\[1\] \(60 tokens\) \+ max_tokens"),
])
def test_bad_prompts_are_refused(prompt_ids, prompts, error, match):
    lm = _mock()
    with pytest.raises(error, match=match):
        lm.smc_sync(prompt_ids, _ten_tokens(lm), 4, 6, prompts=prompts)


def test_a_product_refuses_a_target_temperature():
    """Tempering the target normalises each step's summed row (another target): refused."""
    from genlm_vlm.smc.product import check_options

    lm = _mock()
    with pytest.raises(ValueError, match="takes no target_temperature"):
        check_options(lm, None, 6, [[1, 2], [3]], None, {"target_temperature": 0.5})
    assert check_options(lm, None, 6, [[1, 2], [3]], None, {"target_temperature": 1.0})[1] == ((1, 2), (3,))
    assert check_options(lm, [1, 2], 6, None, None, {"target_temperature": 0.5}) == ((1, 2), None, None)


def test_the_mock_runs_a_product_and_its_reference():
    lm = _mock()
    a = lm.smc_sync(None, _ten_tokens(lm), 8, 6, seed=3, prompts=[[1, 2, 3], [4, 5]])
    b = lm.smc_sync(None, _ten_tokens(lm), 8, 6, seed=3, prompts=[[1, 2, 3], [4, 5]], in_engine=False)
    c = lm.smc_sync([1, 2, 3], _ten_tokens(lm), 8, 6, seed=3)
    assert _fingerprint(a) == _fingerprint(b)
    assert _fingerprint(a) != _fingerprint(c)  # the second factor changed the run


@pytest.mark.parametrize(("critic", "error", "match"), [
    ("not callable", TypeError, "critic must be a callable"),
    (lambda texts: [0.0] * (len(texts) + 1), ValueError, r"critic '<lambda>' returned \d+ log weights for"),
    (lambda texts: [math.nan] * len(texts), ValueError, "critic '<lambda>' returned nan"),
    (lambda texts: [math.inf] * len(texts), ValueError, "returned inf"),
    (lambda texts: ["x"] * len(texts), TypeError, "a log weight must be a real number"),
    (lambda texts: 0.0, TypeError, "must return a sequence of log weights"),
])
def test_bad_critics_are_refused(critic, error, match):
    lm = _mock()
    with pytest.raises(error, match=match):
        lm.smc_sync([1, 2, 3], _ten_tokens(lm), 8, 6, seed=3, critic=critic)


def test_a_critic_that_raises_fails_the_call():
    lm = _mock()

    def critic(texts):
        raise KeyError("the critic's own error")

    with pytest.raises(KeyError, match="the critic's own error"):
        lm.smc_sync([1, 2, 3], _ten_tokens(lm), 8, 6, seed=3, critic=critic)


def test_a_critic_of_zero_keeps_the_run_and_minus_inf_empties_the_posterior():
    lm = _mock()
    plain = lm.smc_sync([1, 2, 3], _ten_tokens(lm), 8, 6, seed=3)
    seen = []

    async def zero(texts):  # a coroutine function is awaited
        seen.append(list(texts))
        return np.zeros(len(texts))

    same = lm.smc_sync([1, 2, 3], _ten_tokens(lm), 8, 6, seed=3, critic=zero)
    assert seen == [[p.text for p in plain.particles if p.finished]] and seen[0]
    assert same.log_marginal == pytest.approx(plain.log_marginal, abs=1e-12)
    assert same.posterior.keys() == plain.posterior.keys()
    none = lm.smc_sync([1, 2, 3], _ten_tokens(lm), 8, 6, seed=3, critic=lambda t: [-math.inf] * len(t))
    assert none.posterior == {}
    assert all(p.log_weight == -math.inf for p in none.particles if p.finished)
    assert none.stats["critic_s"] >= 0


# ------------------------------------------------------------------------------ the engine
def test_product_in_engine_is_byte_identical_to_the_reference(llama_lm):
    lm = llama_lm
    prompts = _prompts(lm)
    args = dict(seed=7, ess_threshold=0.9, prompts=prompts)
    forks0 = lm.stats["forks"]["copied"] + lm.stats["forks"]["aligned"]
    eng = lm.smc_sync(None, Regex(r"[a-z ]+"), 12, 14, **args)
    ref = lm.smc_sync(None, Regex(r"[a-z ]+"), 12, 14, in_engine=False, **args)
    assert eng.stats["where"] == "engine" and ref.stats["where"] == "python"
    assert _fingerprint(eng) == _fingerprint(ref)
    assert eng.log_marginal == ref.log_marginal and eng.posterior == ref.posterior
    assert eng.log_marginal_cut == ref.log_marginal_cut
    assert eng.resampled_at and eng.stats["engine_rounds"] == eng.stats["steps"]
    assert lm.stats["forks"]["copied"] + lm.stats["forks"]["aligned"] > forks0  # copies forked factors' KV
    one = lm.smc_sync(prompts[0], Regex(r"[a-z ]+"), 12, 14, seed=7, ess_threshold=0.9)
    assert _fingerprint(one) != _fingerprint(eng)
    hot = dict(args, temperature=1.5)
    assert _fingerprint(lm.smc_sync(None, Regex(r"[a-z ]+"), 8, 10, **hot)) == _fingerprint(
        lm.smc_sync(None, Regex(r"[a-z ]+"), 8, 10, in_engine=False, **hot))


class _Walk(Controller):
    """Each particle appends its own token every step for ``steps`` steps (no resampling);
    records the rows it was handed."""

    def __init__(self, n: int, steps: int) -> None:
        self.n_particles, self.steps, self.seen, self.rows = n, steps, 0, []

    def step(self, rows, particles):
        self.seen += 1
        self.rows.append(rows.clone())
        return Decision([20 + i for i in particles], stop=self.seen >= self.steps)

    def result(self, generated):
        return [list(g) for g in generated]


async def test_each_factor_continues_its_own_session(llama_lm):
    """After the first round, a step computes one token per factor per particle (each
    factor's context extends its own idle session), and the rows are the factors' sums."""
    lm = llama_lm
    prompts = _prompts(lm)
    n, steps, start = 3, 5, [[40 + i] for i in range(3)]
    first = _Walk(n, 1)
    await lm.run_controller(None, first, prompts=prompts, start=start, engine_path="bursts")  # round one alone
    before = lm.stats
    walk = _Walk(n, steps)
    out = await lm.run_controller(None, walk, prompts=prompts, start=start, engine_path="bursts")  # sessions
    after = lm.stats
    assert out == [[40 + i] + [20 + i] * steps for i in range(n)]
    k = len(prompts)
    ext = k * n * (steps - 1)
    delta = {key: after["tokens"][key] - before["tokens"][key] for key in ("session", "prefill", "cached", "scheduled")}
    # rounds 2..steps: one token per factor per particle, each extending its own session
    assert delta["session"] == ext, delta
    assert after["sessions"]["continued"] - before["sessions"]["continued"] == ext
    # round one: at most the k * n contexts' prefill
    assert delta["prefill"] <= n * sum(len(p) + 1 for p in prompts), delta
    # what vLLM computed: the sessions' tokens and the prefills less their prefix-cache hits (earlier
    # tests of the session may have left the prompts' blocks in the cache)
    assert delta["scheduled"] == delta["session"] + delta["prefill"] - delta["cached"], delta
    # the rows are the sums of the factors' rows, as one-prompt awaits give them
    last = [prompts[j] + out[i][:-1] for j in range(k) for i in range(n)]
    single = await lm.batch_next_token_logprobs(last)
    assert torch.equal(walk.rows[-1], single[:n] + single[n:])


async def test_same_product_result_beside_other_traffic(llama_lm):
    lm = llama_lm
    prompts = _prompts(lm)
    solo = await lm.smc(None, Regex(r"[a-z ]+"), 8, 10, seed=31, prompts=prompts)
    others = [prompts[0][:-1] + [t] for t in range(10, 30)]
    out = await asyncio.gather(
        lm.smc(None, Regex(r"[a-z ]+"), 8, 10, seed=31, prompts=prompts),
        lm.smc(prompts[1], Regex(r"[a-z]+"), 6, 10, seed=4),
        lm.batch_next_token_logprobs(others),
        *(lm.next_token_logprobs(o) for o in others[:8]),
    )
    assert _fingerprint(out[0]) == _fingerprint(solo) and out[0].log_marginal == solo.log_marginal


# ------------------------------------------------------------------------------ exactness
def _pooled(results) -> dict:
    mean: dict[bytes, float] = {}
    for r in results:
        for k, v in r.posterior.items():
            mean[k] = mean.get(k, 0.0) + v / len(results)
    return mean


def _unbiased(results, log_z: float) -> None:
    z_hat = np.exp(np.array([r.log_marginal for r in results]) - log_z)  # in units of Z
    se = z_hat.std(ddof=1) / math.sqrt(len(z_hat))
    assert abs(z_hat.mean() - 1.0) < 3 * se + 1e-9, (z_hat.mean(), se)


def _two_of_three(lm) -> TokenMask:
    """Exactly two tokens out of 'on', 'se', 'er', then EOS: nine texts, every one as long as
    the others (no short text hidden behind an improbable EOS, which would need far larger N)."""
    ids = [lm.tokenizer.convert_tokens_to_ids(x) for x in ("on", "se", "er")]
    eos = lm.tokenizer.eos_token_id

    def fn(gens):
        m = np.zeros((len(gens), lm.vocab_size), dtype=bool)
        for k, g in enumerate(gens):
            m[k, ids if len(g) < 2 else [eos]] = True
        return m

    return TokenMask(fn, name="two of three")


async def test_product_matches_the_enumerated_product_posterior(llama_lm):
    lm = llama_lm
    prompts = _prompts(lm)
    post, log_z = _enumerate(lm, prompts, _two_of_three(lm))
    single, _ = _enumerate(lm, prompts[:1], _two_of_three(lm))
    assert len(post) == 9 and _tv(post, single) > 0.2  # the second factor matters here
    small = await asyncio.gather(*(lm.smc(None, _two_of_three(lm), 4, 4, seed=s, prompts=prompts)
                                   for s in range(60)))
    _unbiased(small, log_z)
    big = await asyncio.gather(*(lm.smc(None, _two_of_three(lm), 128, 4, seed=s, prompts=prompts)
                                 for s in range(16)))
    assert all(set(r.posterior) <= set(post) for r in big)
    pooled = _pooled(big)
    assert _tv(pooled, post) < 0.05, (pooled, post)  # measured 0.014
    assert _tv(pooled, single) > 0.15  # ... and not the first factor's posterior


async def test_a_critic_reweights_to_the_enumerated_posterior(llama_lm):
    lm = llama_lm
    prompt = _prompts(lm)[0]
    post, log_z = _enumerate(lm, [prompt], _two_of_three(lm))
    top, second, third = sorted(post, key=post.get, reverse=True)[:3]
    c = {t: 0.25 if t == top else 2.0 if t == second else 0.0 if t == third else 1.0 for t in post}
    calls = []

    async def critic(texts):  # quarters `top`, doubles `second`, removes `third`
        calls.append(len(texts))
        return [math.log(c[t]) if c[t] else -math.inf for t in texts]

    z_c = sum(post[t] * c[t] for t in post)
    want = {t: post[t] * c[t] / z_c for t in post if c[t]}
    assert _tv(want, post) > 0.2
    # N = 32: at N = 4 most runs see only `top`, and the estimate's rare large values (runs that
    # drew `second`) make 60 runs' mean and standard error useless
    small = await asyncio.gather(*(lm.smc(prompt, _two_of_three(lm), 32, 4, seed=s, critic=critic)
                                   for s in range(60)))
    _unbiased(small, log_z + math.log(z_c))
    big = await asyncio.gather(*(lm.smc(prompt, _two_of_three(lm), 128, 4, seed=s, critic=critic) for s in range(32)))
    assert all(third not in r.posterior for r in big)
    pooled = _pooled(big)
    assert _tv(pooled, want) < 0.05, (pooled, want)
    assert _tv(pooled, post) > 0.15  # ... and not the posterior without the critic
    assert len(calls) == 92  # once per run
    sync = lm.smc_sync(prompt, _two_of_three(lm), 128, 4, seed=0, critic=critic)  # the blocking path too
    assert _fingerprint(sync) == _fingerprint(big[0]) and sync.posterior == big[0].posterior
