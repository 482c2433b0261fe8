"""What ``log_marginal`` estimates, on the real engine (tiny Llama), at a ``max_tokens`` that cuts.

``T = max_tokens``. ``Z_T``: the probability that a sample ends (EOS) within ``T`` tokens with a
text the constraint accepts; ``C_T``: the probability of ``T`` allowed tokens with no EOS. On a
constraint whose texts can be longer than ``T`` (each step allows the context's ``K`` likeliest
ordinary tokens, and EOS after the first token; the EOS ids are 43 short tokens, so that texts
both end and get cut), both are enumerated exactly, and over seeded runs:

* ``exp(log_marginal)`` is unbiased for ``Z_T`` (the cut particles count zero; the runs resample,
  finished particles taking part) and ``exp(log_marginal_cut)`` for ``C_T``; counting the cut
  particles in ``log_marginal`` (``log_marginal_with_cut``) would be off by half of ``Z_T``;
* the same for a product of prompts (where the cut share is small), and with a critic (it
  reweights finished texts only);
* the engine run and the Python reference agree bit for bit on both estimates;
* a run with no finished particle says so: ``empty_reason``, and one ``EmptyPosteriorWarning``
  per call naming ``max_tokens`` (or, with ``force_eos``, that every particle died there), on
  every path (``smc``, ``smc_sync``, ``in_engine=False``, genlm-control's bridge);
* genlm-control's ``Sequences`` from the bridge: ``log_ml`` is ``log_marginal``, cut particles
  weigh nothing.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import warnings

import numpy as np
import pytest

from genlm_vlm.smc import EmptyPosteriorWarning, Particle, Regex, SMCResult, TokenMask

T = 4  # max_tokens: finished texts have 1 to 3 tokens, cut ones 4
K = 4  # ordinary tokens allowed per step
RUNS = 400
N = 32


def _prompt(lm, text: str = "def main():\n    return") -> list[int]:
    tok = lm.tokenizer
    return [tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]


def _eos_ids(lm) -> list[int]:
    """The model's EOS and the one-byte tokens of digits, punctuation and capitals."""
    ids = {b: i for i, b in enumerate(lm._byte_strings)}
    chars = b"0123456789.,;:!?ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return [lm.tokenizer.eos_token_id, *(ids[bytes([c])] for c in chars if bytes([c]) in ids)]


class Language:
    """Each step allows the ``K`` likeliest tokens (of the summed rows of ``prompts``) that are not
    EOS ids, and the EOS ids once a token was generated; enumerated up to ``T`` tokens:
    ``finished[text]`` is the weight ``prod_j p(x EOS | p_j)`` of the finished texts, ``cut`` the
    summed weight ``prod_j p(x | p_j)`` of the ``T``-token paths."""

    def __init__(self, lm, prompts: list[list[int]], eos: list[int]) -> None:
        self.eos = eos
        ordinary = np.ones(lm.vocab_size, dtype=bool)
        ordinary[eos] = False
        self.allowed: dict[tuple[int, ...], list[int]] = {}
        self.finished: dict[bytes, float] = {}
        self.cut = 0.0
        level = [((), 0.0)]
        for depth in range(T):
            rows = lm.batch_next_token_logprobs_sync([p + list(path) for p in prompts for path, _ in level])
            m = len(level)
            summed = sum(rows[j * m:(j + 1) * m].double() for j in range(len(prompts))).numpy()
            nxt = []
            for (path, lp), row in zip(level, summed, strict=True):
                cand = np.flatnonzero(ordinary)
                top = sorted(int(t) for t in cand[np.argsort(-row[cand], kind="stable")[:K]])
                self.allowed[path] = top
                if path:
                    text = b"".join(lm._byte_strings[t] for t in path)
                    self.finished[text] = self.finished.get(text, 0.0) + math.exp(lp) * float(np.exp(row[eos]).sum())
                for t in top:
                    if depth == T - 1:
                        self.cut += math.exp(lp + row[t])
                    else:
                        nxt.append(((*path, t), lp + row[t]))
            level = nxt
        self.z = sum(self.finished.values())
        self.width = lm.vocab_size

    def constraint(self) -> TokenMask:
        def fn(gens):
            m = np.zeros((len(gens), self.width), dtype=bool)
            for k, g in enumerate(gens):
                m[k, self.allowed[tuple(g)]] = True
                if g:
                    m[k, self.eos] = True
            return m

        return TokenMask(fn, name=f"the {K} likeliest tokens, then EOS")


def _mean_and_se(values) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v)))


def _check_unbiased(results, z: float, cut: float, *, visible: bool = True) -> None:
    """``exp(log_marginal)`` averages to ``z`` and ``exp(log_marginal_cut)`` to ``cut`` (within 3
    standard errors); ``visible``: counting the cut mass in ``log_marginal`` would miss by far more."""
    mean, se = _mean_and_se([math.exp(r.log_marginal) / z for r in results])
    assert abs(mean - 1.0) < 3 * se, (mean, se)
    if visible:
        assert cut / z > 0.3 and cut / z > 10 * se, (cut / z, se)
    mean_cut, se_cut = _mean_and_se([math.exp(r.log_marginal_cut) / cut for r in results])
    assert abs(mean_cut - 1.0) < 3 * se_cut, (mean_cut, se_cut)
    for r in results:
        assert r.log_marginal_with_cut == pytest.approx(np.logaddexp(r.log_marginal, r.log_marginal_cut), abs=1e-12)
    assert sum(r.resamples for r in results) > RUNS // 4  # resampling with finished particles among them
    assert sum(r.n_cut > 0 and r.n_finished > 0 for r in results) > RUNS // 2


@pytest.fixture(scope="module")
def language(llama_lm) -> tuple[list[int], Language]:
    prompt = _prompt(llama_lm)
    return prompt, Language(llama_lm, [prompt], _eos_ids(llama_lm))


async def _runs(lm, prompt, lang: Language, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmptyPosteriorWarning)  # a few runs finish no particle
        return await asyncio.gather(*(
            lm.smc(prompt, lang.constraint(), N, T, seed=s, eos_token_ids=lang.eos, ess_threshold=0.9, **kwargs)
            for s in range(RUNS)
        ))


# ------------------------------------------------------------------------------ unbiased for Z_T
async def test_log_marginal_counts_finished_texts_and_reports_the_cut_mass(llama_lm, language):
    prompt, lang = language
    results = await _runs(llama_lm, prompt, lang)
    _check_unbiased(results, lang.z, lang.cut)
    assert all(set(r.posterior) <= set(lang.finished) for r in results)
    for r in results:
        if r.n_finished:
            assert r.empty_reason is None and r.posterior
        else:
            assert r.log_marginal == -math.inf and r.posterior == {} and "max_tokens=4" in r.empty_reason


async def test_a_product_of_prompts_counts_finished_texts(llama_lm):
    prompts = [_prompt(llama_lm), _prompt(llama_lm, "hello world")]
    lang = Language(llama_lm, prompts, _eos_ids(llama_lm))
    single = Language(llama_lm, prompts[:1], _eos_ids(llama_lm))
    assert abs(math.log(lang.z) - math.log(single.z)) > 1  # the second factor matters
    results = await _runs(llama_lm, None, lang, prompts=prompts)
    # a product's mass falls faster per token than one factor's: the cut share is small here
    _check_unbiased(results, lang.z, lang.cut, visible=False)


async def test_a_critic_reweights_the_finished_texts_only(llama_lm, language):
    prompt, lang = language
    first = sorted(lang.finished, key=lang.finished.get, reverse=True)[0]

    def critic(texts):  # doubles the likeliest finished text, halves the others
        return [math.log(2.0) if t == first else math.log(0.5) for t in texts]

    z_c = sum(w * (2.0 if t == first else 0.5) for t, w in lang.finished.items())
    results = await _runs(llama_lm, prompt, lang, critic=critic)
    plain = await _runs(llama_lm, prompt, lang)
    _check_unbiased(results, z_c, lang.cut)
    for r, p in zip(results, plain, strict=True):
        assert r.log_marginal_cut == p.log_marginal_cut  # the critic does not see cut particles
        assert [q.log_weight for q in r.particles if not q.finished] == [q.log_weight for q in p.particles if not q.finished]


def test_engine_and_reference_agree_on_both_estimates(llama_lm, language):
    prompt, lang = language
    for seed in range(3):
        args = dict(seed=seed, eos_token_ids=lang.eos, ess_threshold=0.9)
        eng = llama_lm.smc_sync(prompt, lang.constraint(), 16, T, **args)
        ref = llama_lm.smc_sync(prompt, lang.constraint(), 16, T, in_engine=False, **args)
        assert eng.stats["where"] == "engine" and ref.stats["where"] == "python"
        assert [(p.token_ids, p.log_weight, p.status) for p in eng.particles] == \
            [(p.token_ids, p.log_weight, p.status) for p in ref.particles]
        assert (eng.log_marginal, eng.log_marginal_cut, eng.posterior) == (ref.log_marginal, ref.log_marginal_cut,
                                                                           ref.posterior)
        assert eng.n_cut and math.isfinite(eng.log_marginal_cut)


# ------------------------------------------------------------------------------ nothing finished
def _one_warning(record) -> str:
    caught = [w for w in record if issubclass(w.category, EmptyPosteriorWarning)]
    assert len(caught) == 1, [str(w.message) for w in caught]
    return str(caught[0].message)


async def test_no_finished_particle_warns_and_says_so(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm)
    with pytest.warns(EmptyPosteriorWarning) as record:
        r = await lm.smc(prompt, Regex(r"x{12}"), 8, 8, seed=0)
    message = _one_warning(record)
    assert message.startswith("no particle finished within max_tokens=8 (8 of 8 cut): log_marginal is -inf")
    assert "Raise max_tokens, or pass force_eos=True" in message and record[0].filename == __file__
    assert r.empty_reason == message and r.n_finished == 0 and r.n_cut == 8
    assert r.log_marginal == -math.inf and r.posterior == {} and math.isfinite(r.log_marginal_cut)
    with pytest.warns(EmptyPosteriorWarning):
        ref = await lm.smc(prompt, Regex(r"x{12}"), 8, 8, seed=0, in_engine=False)
    assert ref.empty_reason == message and ref.log_marginal_cut == r.log_marginal_cut
    # force_eos: the 8th token must be EOS, which "x" * 7 does not allow: every particle dies there
    with pytest.warns(EmptyPosteriorWarning) as record:
        f = await lm.smc(prompt, Regex(r"x{12}"), 8, 8, seed=0, force_eos=True)
    assert _one_warning(record).startswith("every particle died (8 of 8 at max_tokens=8, where force_eos=True")
    assert f.n_dead == 8 and f.log_marginal == f.log_marginal_cut == -math.inf
    with warnings.catch_warnings():  # a run that finishes says nothing
        warnings.simplefilter("error", EmptyPosteriorWarning)
        ok = await lm.smc(prompt, Regex(r"x{1,12}"), 8, 8, seed=0, force_eos=True)
    assert ok.n_finished == 8 and ok.empty_reason is None


def test_the_blocking_paths_warn_too(llama_lm):
    prompt = _prompt(llama_lm)
    for in_engine in (True, False):  # in the engine, and per token in Python
        with pytest.warns(EmptyPosteriorWarning) as record:
            r = llama_lm.smc_sync(prompt, Regex(r"x{12}"), 8, 8, seed=0, in_engine=in_engine)
        assert _one_warning(record) == r.empty_reason and r.empty_reason.startswith("no particle finished within")
        assert r.stats["where"] == ("engine" if in_engine else "python")


def test_a_critic_that_rejects_every_text_says_so():
    from genlm_vlm import MockAsyncLM

    lm = MockAsyncLM(seed=1)
    mask = np.zeros((1, lm.vocab_size), dtype=bool)
    mask[0, 10:20] = True
    mask[0, lm.tokenizer.eos_token_id] = True
    fn = TokenMask(lambda gens: np.repeat(mask, len(gens), axis=0), name="ten tokens")
    with pytest.warns(EmptyPosteriorWarning, match=r"the critic '.*<lambda>' weighed every finished text zero"):
        r = lm.smc_sync([1, 2, 3], fn, 8, 6, seed=3, critic=lambda texts: [-math.inf] * len(texts))
    assert r.n_finished and r.posterior == {} and r.log_marginal == -math.inf


# ------------------------------------------------------------------------------ genlm-control
_gc = pytest.mark.skipif(importlib.util.find_spec("genlm.control") is None, reason="genlm-control is not installed")


@_gc
def test_sequences_log_ml_is_log_marginal_and_cut_particles_weigh_nothing(gc, llama_lm):
    from genlm_vlm.control.bridge import to_sequences

    llm = gc.PromptedLLM(llama_lm, prompt_ids=_prompt(llama_lm))
    a, b = (llama_lm._byte_strings.index(x) for x in (b"a", b"b"))
    particles = [Particle([a], b"a", -1.0, "finished"), Particle([b, b], b"bb", -0.5, "cut"),
                 Particle([], b"", -math.inf, "dead"), Particle([b], b"b", -2.0, "finished")]
    log_marginal = 0.7 + np.logaddexp(-1.0, -2.0) - math.log(4)  # log L = 0.7
    result = SMCResult(particles, log_marginal, {b"a": 0.73, b"b": 0.27}, log_marginal_cut=0.7 - 0.5 - math.log(4))
    seqs = to_sequences(llm, result)
    assert seqs.log_ml == pytest.approx(log_marginal, abs=1e-12)
    assert seqs.log_weights[1] == seqs.log_weights[2] == -math.inf
    assert seqs.log_weights[0] - seqs.log_weights[3] == pytest.approx(1.0)
    assert seqs.contexts[0][-1] is gc.EOS and seqs.contexts[1][-1] is not gc.EOS
    assert set(seqs.decoded_posterior) == {"a", "b"}


@_gc
@pytest.mark.filterwarnings("ignore:Common vocabulary:RuntimeWarning")  # genlm-control's, on "x" only
async def test_the_bridge_warns_when_every_particle_dies(gc, llama_lm):
    from genlm_vlm import control

    llm = gc.PromptedLLM(llama_lm, prompt_ids=_prompt(llama_lm))
    cond = gc.BoolFSA.from_regex(r"x{12}").coerce(llm, f=b"".join)
    with pytest.warns(EmptyPosteriorWarning, match=r"every particle died \(8 of 8 at max_tokens=8"):
        seqs = await control.smc(gc.AWRS(llm, cond), 8, 0.5, 8, seed=0)
    assert seqs.log_ml == -math.inf and all(w == -math.inf for w in seqs.log_weights)
