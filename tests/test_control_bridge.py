"""genlm-control's SMC in the engine (genlm_vlm.control.smc) and the exact translation of its
Boolean conditions into xgrammar grammars (genlm_vlm.control.translate), on the tiny Llama.

* masks: the translated grammar's token masks equal genlm-control's own ``cond.logw_next``
  (finite vs -inf, EOS included) along random walks through each language, but for the special
  tokens, which genlm-control takes as their literal text and the engine never allows;
* posterior: on an enumerable language, the bridge's pooled posterior matches the exact one and
  genlm-control's own (per-token) SMC within Monte Carlo error; its Z-hat is unbiased;
* refusals: every part the bridge cannot run exactly raises a message naming it.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("genlm.control") is None,
    reason="genlm-control is not installed (pip install 'genlm-vlm[control]')",
)

PROMPT = "def main():\n    return"


@pytest.fixture(scope="module")
def llm(gc, llama_lm):
    tok = llama_lm.tokenizer
    return gc.PromptedLLM(llama_lm, prompt_ids=[tok.bos_token_id, *tok.encode(PROMPT, add_special_tokens=False)])


# ---------------------------------------------------------------------------------- masks
REGEXES = [
    r"[a-z]+@[a-z]+\.(com|org)",
    r"[^a-c \n]{1,3}( [^x]+)?",  # negated classes range over string.printable
    r"(é|ü|中文|😀)+[0-9]?",  # multi-byte characters
    r"(def|return) [a-z_]+\(\)",
    r"\d+(\.\d+)?\n",
]
LARK = """
start: WORD ("," WORD)* "."
WORD: /[a-z]+/
%ignore " "
"""


async def _walks(llm, cond, constraint, lm, *, walks: int, depth: int, seed: int) -> tuple[int, int]:
    """Compare masks along ``walks`` random walks of up to ``depth`` tokens; returns (contexts,
    tokens compared)."""
    from genlm_vlm.control.bridge import Plan, constraint_for
    from genlm_vlm.smc import api

    eos = list(llm.token_maps.eos_idxs)
    bound = api.bind(lm, constraint_for(Plan(llm, [constraint])), tuple(eos))
    rng = np.random.default_rng(seed)
    width = lm.vocab_size
    specials = [i for i in lm._special_ids if i not in eos]
    contexts = compared = 0
    for _ in range(walks):
        state, context = bound.initial(), []
        for _ in range(depth):
            got = bound.masks([state])[0]
            logws = await cond.logw_next(context)
            weights = np.asarray(logws.weights, dtype=np.float64)
            want = np.zeros(width, dtype=bool)
            for tok, w in zip(cond.vocab, weights[:-1], strict=True):
                want[tok.token_id] = w > -np.inf
            want[specials] = False  # genlm-control takes <s>, <pad> as their text; the engine never allows them
            want[eos] = weights[-1] > -np.inf
            bad = np.flatnonzero(got != want)
            assert not bad.size, (
                f"context {b''.join(context)!r}: masks differ at ids {bad[:10].tolist()} "
                f"(ours {got[bad[:10]].tolist()}, genlm-control {want[bad[:10]].tolist()})"
            )
            contexts += 1
            compared += width
            choices = [i for i in np.flatnonzero(got) if i not in eos]
            if not choices:
                break
            t = int(rng.choice(choices))
            state = bound.advance(state, t)
            context.append(llm.token_maps.decode[t])
    return contexts, compared


@pytest.mark.parametrize("pattern", REGEXES)
async def test_translated_regex_masks_equal_genlm_controls(gc, llm, llama_lm, pattern):
    from genlm_vlm.control.translate import condition_constraint

    fsa = gc.BoolFSA.from_regex(pattern)
    cond = fsa.coerce(llm, f=b"".join)
    contexts, _ = await _walks(llm, cond, condition_constraint(fsa), llama_lm, walks=8, depth=12, seed=1)
    assert contexts >= 12


async def test_translated_lark_cfg_masks_equal_genlm_controls(gc, llm, llama_lm):
    from genlm_vlm.control.translate import condition_constraint

    cfg = gc.BoolCFG.from_lark(LARK)
    cond = cfg.coerce(llm, f=b"".join)
    contexts, _ = await _walks(llm, cond, condition_constraint(cfg), llama_lm, walks=4, depth=8, seed=2)
    assert contexts >= 8


# ---------------------------------------------------------------------------------- posterior
LANGUAGE = r"[aq]{3}"  # one tokenization per text in the tiny vocabulary: no token joins a and q
MAX_TOKENS = 4  # EOS included: at most 3 tokens, then EOS (forced at the limit)
RUNS = 64  # bridge runs pooled (cheap: one burst each)
THEIR_RUNS = 16  # genlm-control's own runs pooled (per token)


async def _exact(llms, lm, constraint, tau: float = 1.0) -> tuple[dict[str, float], float]:
    """The exact posterior over texts (and log Z) of the product of the ``PromptedLLM``s
    ``llms`` (one: its own target, tempered by ``tau`` as ``PromptedLLM(temperature=)`` does;
    several: ``prod_j p(x | p_j)``, as the engine runs it) under ``constraint``, with
    genlm-control's ``max_tokens`` convention (EOS counted, forced at the limit, weighted by the
    summed rows' mass on the EOS ids), by enumerating every allowed token path."""
    import torch

    from genlm_vlm.smc import api

    eos = list(llms[0].token_maps.eos_idxs)
    bound = api.bind(lm, constraint, tuple(eos))
    prompts = [list(f.prompt_ids) for f in llms]
    level = [((), 0.0, bound.initial())]
    weights: dict[str, float] = {}
    for depth in range(MAX_TOKENS):
        rows = await lm.batch_next_token_logprobs([p + list(path) for p in prompts for path, _, _ in level])
        m = len(level)
        factors = [rows[j * m:(j + 1) * m].double() for j in range(len(prompts))]
        summed = sum(f if tau == 1.0 else torch.log_softmax(f / tau, -1) for f in factors)
        masks = bound.masks([s for _, _, s in level])
        nxt = []
        for (path, lp, state), row, mask in zip(level, summed, masks, strict=True):
            if mask[eos].any():
                text = b"".join(lm.byte_vocab[t].byte_string for t in path).decode()
                w = math.exp(lp + float(torch.logsumexp(row[eos], 0)))
                weights[text] = weights.get(text, 0.0) + w
            if depth == MAX_TOKENS - 1:
                continue  # the last token is EOS
            for t in np.flatnonzero(mask):
                if int(t) not in eos:
                    nxt.append(((*path, int(t)), lp + float(row[t]), bound.advance(bound.copy(state), int(t))))
        level = nxt
        if not level:
            break
    z = sum(weights.values())
    return {k: v / z for k, v in weights.items()}, math.log(z)


def _pooled(runs) -> dict[str, float]:
    """The runs' posteriors averaged with weights Z-hat (every particle with its weight), which
    converges to the target as the number of runs grows."""
    top = max(s.log_ml for s in runs)
    out: dict[str, float] = {}
    for seqs in runs:
        z = math.exp(seqs.log_ml - top) if seqs.log_ml > -math.inf else 0.0
        for text, p in seqs.decoded_posterior.items():
            out[text] = out.get(text, 0.0) + z * p
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


def _tv(p: dict[str, float], q: dict[str, float]) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


@pytest.fixture(scope="module")
def many_eos_llm(gc, llama_lm):
    """EOS is every one-byte token but the language's letters: its probability varies little
    from one context to the next, so that N = 32 particles weigh the enumerable language well."""
    singles = [t.byte_string for t in llama_lm.byte_vocab if len(t.byte_string) == 1 and t.byte_string not in b"aq"]
    tok = llama_lm.tokenizer
    prompt = [tok.bos_token_id, *tok.encode(PROMPT, add_special_tokens=False)]
    return gc.PromptedLLM(llama_lm, prompt_ids=prompt, eos_byte_strings=singles)


@pytest.mark.parametrize(("sampler_kind", "n"), [("awrs", 32), ("direct+critic", 32), ("eager", 32), ("awrs", 128)])
async def test_bridge_posterior_matches_exact_and_genlm_control(gc, many_eos_llm, llama_lm, sampler_kind, n):
    llm = many_eos_llm
    from genlm_vlm import control
    from genlm_vlm.control.bridge import Plan, constraint_for
    from genlm_vlm.control.translate import condition_constraint

    fsa = gc.BoolFSA.from_regex(LANGUAGE)
    cond = fsa.coerce(llm, f=b"".join)
    exact, log_z = await _exact([llm], llama_lm, constraint_for(Plan(llm, [condition_constraint(fsa)])))
    assert len(exact) == 8, exact  # every text of three letters a, q

    def make(run):
        if sampler_kind == "awrs":
            return gc.AWRS(llm, cond, seed=run), None
        if sampler_kind == "eager":
            return gc.eager_token_sampler(llm, fsa), None
        return gc.direct_token_sampler(llm), cond

    ours = []
    runs = RUNS * 32 // n  # the same number of particles in all
    for seed in range(runs):
        sampler, critic = make(seed)
        ours.append(await control.smc(sampler, n, 0.5, MAX_TOKENS, critic=critic, seed=seed))
    assert all(len(s) == n for s in ours)
    assert all(c[-1] is gc.EOS or w == -math.inf for s in ours for c, w in s)  # every particle ends in EOS
    z_ratio = np.mean([math.exp(s.log_ml - log_z) for s in ours])
    pooled = _pooled(ours)
    tv_exact = _tv(pooled, exact)
    assert tv_exact < 0.1, (tv_exact, pooled, exact)
    assert 0.8 < z_ratio < 1.2, z_ratio
    if sampler_kind == "direct+critic":
        return  # genlm-control samples from the LM unconstrained here: (nearly) every particle dies

    np.random.seed(0)
    theirs = []
    for run in range(THEIR_RUNS * 32 // n):
        sampler, critic = make(run)
        theirs.append(await sampler.smc(n, 0.5, MAX_TOKENS, critic=critic))
    tv_theirs = _tv(pooled, _pooled(theirs))
    print(f"{sampler_kind}, N = {n}: TV(bridge, exact) {tv_exact:.3f}, TV(bridge, genlm-control) {tv_theirs:.3f}, "
          f"TV(genlm-control, exact) {_tv(_pooled(theirs), exact):.3f}, mean Z-hat/Z {z_ratio:.3f}")
    # within the Monte Carlo error of genlm-control's own estimate (its distance to the truth)
    assert tv_theirs < _tv(_pooled(theirs), exact) + 0.1, (tv_theirs, pooled, _pooled(theirs))


async def test_the_bridge_never_allows_a_special_token(gc, llm, llama_lm):
    """genlm-control proposes ``<s>`` and ``<pad>`` as their literal text wherever its condition
    allows that text; the bridge's constraint never allows them (the PromptedLLM's EOS aside),
    with a condition or without one. Before, both masks allowed them and runs drew them."""
    from genlm_vlm import control
    from genlm_vlm.control.bridge import Plan, constraint_for
    from genlm_vlm.control.translate import condition_constraint
    from genlm_vlm.smc import api

    eos = tuple(llm.token_maps.eos_idxs)
    specials = [i for i in llama_lm.tokenizer.all_special_ids if i not in eos]
    assert specials == [0, 2]
    fsa = gc.BoolFSA.from_regex(r"[a-z<>/ ]+")
    theirs = np.asarray((await fsa.coerce(llm, f=b"".join).logw_next([])).weights)
    assert (theirs[:-1][[llm.vocab.index(llama_lm.byte_vocab[i]) for i in specials]] > -np.inf).all()
    for conditions in ([], [condition_constraint(fsa)]):
        bound = api.bind(llama_lm, constraint_for(Plan(llm, conditions)), eos)
        assert not bound.masks([bound.initial()])[0][specials].any()
    cond = gc.BoolFSA.from_regex(r"[<>sad/ ]+").coerce(llm, f=b"".join)
    for sampler in (gc.direct_token_sampler(llm), gc.AWRS(llm, cond)):
        seqs = await control.smc(sampler, 16, 0.5, 6, seed=1)
        for context, _ in seqs:
            ids = [t.token_id for t in context if t is not gc.EOS]
            assert not set(ids) & set(specials), ids


# ---------------------------------------------------------------------------------- refusals
async def test_refusals_name_the_part_and_why(gc, llm):
    from genlm_vlm import control

    fsa = gc.BoolFSA.from_regex(r"[a-z]+")
    cond = fsa.coerce(llm, f=b"".join)
    fallback = "; or pass fallback=True: genlm-control runs it itself, per token"
    # (sampler, critic, the problem, the way out besides fallback=True, which every refusal ends with)
    cases = [
        (gc.AWRS(llm, gc.WFSA.from_regex(r"[a-z]+").coerce(llm, f=b"".join)), None, "WFSA is a weighted potential",
         "use BoolFSA / BoolCFG for a condition"),
        (gc.AWRS(llm, fsa.coerce(llm, f=lambda xs: b"".join(xs).lower())), None,
         r"coerce\(\.\.\., f=.*only f=b''\.join", "coerce with f=b''.join"),
        (gc.topk_token_sampler(llm, fsa, K=4), None, "set sampler TopKSetSampler",
         "eager_token_sampler(llm, condition) or AWRS(llm, condition) targets the same"),
        (gc.direct_token_sampler(llm), llm, "the critic has a PromptedLLM factor",
         "only Boolean critics (BoolFSA, BoolCFG) are folded into the mask"),
        (gc.AWRS(llm.spawn(temperature=0.0), cond), None,
         r"temperature=0\.0\): the target temperature must be a finite number > 0", "use llm.spawn(temperature=1.0)"),
        (gc.AWRS(llm, gc.BoolCFG.from_lark('start: "é"+').coerce(llm, f=b"".join)), None, "not an ASCII byte", ""),
        (gc.AWRS(llm, gc.JsonSchema({"type": "integer"}).coerce(llm, f=b"".join)), None, "JsonSchema",
         "pass json_schema=True to run it as genlm_vlm.smc.JSONSchema anyway"),
        (gc.AWRS(llm, cond, proper_weights=False), None, r"proper_weights=False\) is not properly weighted",
         "AWRS(llm, condition) with proper_weights=True (the default) targets the same and runs in the engine"),
        (gc.direct_token_sampler(llm * llm.spawn(temperature=0.5)), None, "factor 1 has temperature=0.5",
         "spawn the factors with temperature=1.0"),
    ]
    for sampler, critic, message, way_out in cases:
        with pytest.raises(control.UntranslatableError, match=message) as err:
            await control.smc(sampler, 4, 0.5, 4, critic=critic)
        text = str(err.value)
        assert way_out in text, text
        assert text.endswith(fallback), text
    with pytest.raises(ValueError, match=r"the critic's token type .*coerce it, e\.g\. critic\.coerce\(llm"):
        await control.smc(gc.direct_token_sampler(llm), 4, 0.5, 4, critic=fsa)  # not coerced
    with pytest.raises(control.UntranslatableError, match="resampling_method='residual'") as err:
        await control.smc(gc.AWRS(llm, cond), 4, 0.5, 4, resampling_method="residual")
    assert str(err.value).endswith(fallback)
    # A condition that accepts nothing: fallback=True would not help, and the message does not offer it.
    with pytest.raises(control.translate.EmptyLanguageError, match="the language is empty") as err:
        empty = gc.BoolFSA(gc.BoolFSA.from_regex(r"ab").wfsa.spawn(keep_init=True, keep_arcs=True))  # no final state
        await control.smc(gc.AWRS(llm, empty.coerce(llm, f=b"".join)), 4, 0.5, 4)
    assert "fallback" not in str(err.value)


async def test_a_bare_promptedllm_or_wrong_option_types_are_type_errors(gc, llm):
    """A PromptedLLM is not a sampler (fallback=True cannot run it either): TypeError saying to
    wrap it; options of the wrong type are TypeErrors before anything runs."""
    from genlm_vlm import control

    for fallback in (False, True):
        with pytest.raises(TypeError, match=r"got PromptedLLM .*direct_token_sampler\(llm\)"):
            await control.smc(llm, 4, 0.5, 4, fallback=fallback)
    cond = gc.BoolFSA.from_regex(r"[a-z]+").coerce(llm, f=b"".join)
    sampler = gc.AWRS(llm, cond)
    bad = [
        (dict(n_particles="4"), "n_particles must be an int >= 1, got str"),
        (dict(n_particles=True), "n_particles must be an int >= 1, got bool"),
        (dict(max_tokens=4.0), "max_tokens must be an int >= 1, got float"),
        (dict(ess_threshold="0.5"), "ess_threshold must be a number in"),
        (dict(seed=1.5), "seed must be an int or None"),
        (dict(fallback=1), "fallback must be True or False"),
        (dict(json_schema="yes"), "json_schema must be True or False"),
        (dict(in_engine=None), "in_engine must be True or False"),
        (dict(engine_path=1), "engine_path must be 'auto', 'bursts' or 'requests'"),
        (dict(mask_overlap="on"), "mask_overlap must be True or False"),
        (dict(resampling_method=None), "resampling_method must be a str"),
        (dict(critic=lambda texts: 0.0), "critic must be a genlm-control potential"),
    ]
    for change, message in bad:
        args = dict(n_particles=4, ess_threshold=0.5, max_tokens=4)
        args.update(change)
        with pytest.raises(TypeError, match=message):
            await control.smc(sampler, args.pop("n_particles"), args.pop("ess_threshold"), args.pop("max_tokens"),
                              **args)
    with pytest.raises(ValueError, match="n_particles must be an int >= 1, got 0"):
        await control.smc(sampler, 0, 0.5, 4)
    with pytest.raises(ValueError, match="engine_path must be 'auto'"):
        await control.smc(sampler, 4, 0.5, 4, engine_path="request")
    seqs = await control.smc(sampler, np.int64(4), np.float32(0.5), np.int32(4), seed=np.int64(1))  # numpy: fine
    assert len(seqs) == 4


async def test_a_run_where_no_particle_finished_says_so(gc, llm):
    """Under the email pattern no text fits in 3 tokens: every particle dies at the forced EOS.
    Before, genlm_vlm.control.smc returned the empty posterior without a word; now it warns,
    naming max_tokens (in the engine and through genlm-control's own SMC)."""
    import warnings

    from genlm_vlm import control

    cond = gc.BoolFSA.from_regex(r"[a-z]+@[a-z]+\.(com|org)").coerce(llm, f=b"".join)
    for options in (dict(seed=0), dict(resampling_method="residual", fallback=True)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            seqs = await control.smc(gc.AWRS(llm, cond), 4, 0.5, 3, **options)
        assert seqs.log_ml == -math.inf and all(w == -math.inf for _, w in seqs)  # all died at the forced EOS
        # one warning, naming max_tokens (the engine run's own, or genlm-control's run's)
        said = [str(w.message) for w in seen if "max_tokens=3" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in seen]
        assert "Raise max_tokens" in said[0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        await control.smc(gc.AWRS(llm, gc.BoolFSA.from_regex(r"[a-z]").coerce(llm, f=b"".join)), 4, 0.5, 3, seed=0)
    assert not [w for w in seen if "no particle finished" in str(w.message)]


async def test_fallback_runs_genlm_controls_own_smc(gc, llm):
    from genlm_vlm import control

    weighted = gc.WFSA.from_regex(r"[a-z]+").coerce(llm, f=b"".join)
    np.random.seed(0)
    seqs = await control.smc(gc.direct_token_sampler(llm), 4, 0.5, 3, critic=weighted, fallback=True)
    from genlm.control.sampler.sequence import Sequences

    assert isinstance(seqs, Sequences) and len(seqs) == 4
    cond = gc.BoolFSA.from_regex(r"[a-z]+").coerce(llm, f=b"".join)
    seqs = await control.smc(gc.AWRS(llm, cond, seed=0), 4, 0.5, 3, resampling_method="residual", fallback=True)
    assert len(seqs) == 4 and all(w == -math.inf or c[-1] is gc.EOS for c, w in seqs)


async def test_translation_is_kept_and_compiled_once(gc, llm, llama_lm):
    from genlm_vlm import control
    from genlm_vlm.control import translate
    from genlm_vlm.control.translate import condition_constraint

    fsa = gc.BoolFSA.from_regex(r"(yes|no)")
    cond = fsa.coerce(llm, f=b"".join)
    for seed in range(3):
        seqs = await control.smc(gc.AWRS(llm, cond), 8, 0.5, 6, seed=seed)
        assert set(seqs.decoded_posterior) <= {"yes", "no"}
    translated = condition_constraint(fsa)
    assert translated is condition_constraint(fsa)
    assert type(translated).__name__ == "ByteAutomaton"  # a token automaton, not an xgrammar grammar
    dfa = translated.dfa()
    assert dfa.matches(b"yes") and dfa.matches(b"no") and not dfa.matches(b"ye")
    import pickle  # to a replica: the automaton's arrays only; the receiver binds its own

    copy = pickle.loads(pickle.dumps(translated))
    assert copy.key() == translated.key() and vars(copy).keys() == vars(translated).keys()
    assert not any(callable(v) or type(v).__module__.startswith("xgrammar") for v in vars(copy).values())
    assert translate.content_key(fsa) is not None


async def test_json_schema_opt_in(gc, llm):
    from genlm_vlm import control

    cond = gc.JsonSchema({"type": "integer"}).coerce(llm, f=b"".join)
    seqs = await control.smc(gc.AWRS(llm, cond), 8, 0.5, 8, seed=0, json_schema=True)
    for text in seqs.decoded_posterior:
        assert isinstance(__import__("json").loads(text), int), text


# ---------------------------------------------------------------------------------- lm.smc(force_eos=True)
async def test_force_eos_counts_eos_in_max_tokens_and_weights_it(llama_lm):
    import torch

    from genlm_vlm.smc import Regex, api

    tok = llama_lm.tokenizer
    prompt = [tok.bos_token_id, *tok.encode(PROMPT, add_special_tokens=False)]
    eos = tok.eos_token_id
    res = await llama_lm.smc(prompt, Regex(r"[a-z]+"), 8, 2, ess_threshold=0.0, seed=0, force_eos=True)
    assert res.n_cut == 0 and res.stats["forced_eos"] == 8
    row0 = (await llama_lm.next_token_logprobs(prompt)).double()
    bound = api.bind(llama_lm, Regex(r"[a-z]+"), (eos,))
    mask0 = bound.masks([bound.initial()])[0]
    log_mass0 = float(torch.logsumexp(row0[torch.from_numpy(mask0)], 0))
    for p in res.particles:
        assert len(p.token_ids) == 1 and p.finished  # one letter token, then the forced EOS
        row1 = (await llama_lm.next_token_logprobs(prompt + p.token_ids)).double()
        assert math.isclose(p.log_weight, log_mass0 + float(row1[eos]), abs_tol=1e-4)
    with pytest.raises(TypeError, match="force_eos must be True or False"):
        await llama_lm.smc(prompt, Regex(r"[a-z]+"), 2, 2, force_eos=1)


async def test_bridge_tempers_the_target_as_promptedllm_does(gc, many_eos_llm, llama_lm):
    """Each particle's weight is the product of its masses under log_softmax(row / tau) (exact
    check); the pooled posterior matches the tempered exact one (tau = 1.5: sharper targets
    have heavier-tailed weights than N = 32 pools well)."""
    import torch

    from genlm_vlm import control
    from genlm_vlm.control.bridge import Plan, constraint_for
    from genlm_vlm.control.translate import condition_constraint
    from genlm_vlm.smc import api

    fsa = gc.BoolFSA.from_regex(LANGUAGE)
    for tau in (0.7, 1.5):
        llm = many_eos_llm.spawn(temperature=tau)
        assert llm.temperature == tau and llm.prompt_ids == many_eos_llm.prompt_ids
        cond = fsa.coerce(llm, f=b"".join)
        constraint = constraint_for(Plan(llm, [condition_constraint(fsa)]))
        seqs = await control.smc(gc.AWRS(llm, cond), 4, 0.0, MAX_TOKENS, seed=0)
        bound = api.bind(llama_lm, constraint, tuple(llm.token_maps.eos_idxs))
        for context, log_w in seqs:
            ids = [t.token_id for t in context[:-1]]
            state, want = bound.initial(), 0.0
            for k in range(len(ids) + 1):
                row = await llama_lm.next_token_logprobs(list(llm.prompt_ids) + ids[:k])
                row = torch.log_softmax(row.double() / tau, 0)
                mask = torch.from_numpy(bound.masks([state])[0])
                want += float(torch.logsumexp(row[mask], 0))
                if k < len(ids):
                    state = bound.advance(state, ids[k])
            assert math.isclose(log_w, want, abs_tol=1e-4), (tau, ids, log_w, want)

    llm = many_eos_llm.spawn(temperature=1.5)
    cond = fsa.coerce(llm, f=b"".join)
    constraint = constraint_for(Plan(llm, [condition_constraint(fsa)]))
    exact, log_z = await _exact([llm], llama_lm, constraint, tau=1.5)
    untempered, _ = await _exact([llm], llama_lm, constraint)
    assert _tv(exact, untempered) > 0.05  # the temperature changes the target visibly
    ours = [await control.smc(gc.AWRS(llm, cond), 32, 0.5, MAX_TOKENS, seed=seed) for seed in range(RUNS)]
    tv = _tv(_pooled(ours), exact)
    z_ratio = np.mean([math.exp(s.log_ml - log_z) for s in ours])
    print(f"tau 1.5: TV(bridge, exact) {tv:.3f}, TV(exact, untempered) {_tv(exact, untempered):.3f}, Z-hat/Z {z_ratio:.3f}")
    assert tv < 0.1, (tv, _pooled(ours), exact)
    assert 0.8 < z_ratio < 1.2, z_ratio


async def test_padded_ids_are_refused_and_without_padding_runs(gc):
    """Padded logit columns are tokens with no bytes: genlm-control's coerced condition allows
    them wherever the text so far can be completed (the translated masks agree), but the engine's
    SMC never reads those columns: the bridge refuses, naming them and what to do; fallback=True
    runs genlm-control's own SMC, and without_padding(lm) runs in the bridge."""
    from genlm_vlm import control
    from genlm_vlm.control.translate import condition_constraint
    from genlm_vlm.mock import MockAsyncLM

    lm = MockAsyncLM(vocab_size=300, logit_scale=1.0)  # 258 tokens, 42 padded columns
    llm = gc.PromptedLLM(lm, prompt_ids=[0], eos_byte_strings=[b"."])
    fsa = gc.BoolFSA.from_regex(r"[a-c]{2}")
    cond = fsa.coerce(llm, f=b"".join)
    contexts, _ = await _walks(llm, cond, condition_constraint(fsa), lm, walks=4, depth=4, seed=0)
    assert contexts >= 4
    with pytest.raises(control.UntranslatableError, match=r"42 padded logit columns \(ids 258\.\.299.*without_padding"):
        await control.smc(gc.AWRS(llm, cond), 16, 0.5, 6, seed=0)
    with pytest.raises(control.UntranslatableError, match="42 padded logit columns"):  # no condition: too
        await control.smc(gc.direct_token_sampler(llm), 4, 0.5, 3, seed=0)
    seqs = await control.smc(gc.AWRS(llm, cond), 16, 0.5, 6, fallback=True)  # genlm-control's own, per token
    assert len(seqs.contexts) == 16
    # without_padding(lm): a view with no padded ids, run per token in Python (not in an engine)
    view_llm = gc.PromptedLLM(control.without_padding(lm), prompt_ids=[0], eos_byte_strings=[b"."])
    view_cond = fsa.coerce(view_llm, f=b"".join)
    seqs = await control.smc(gc.AWRS(view_llm, view_cond), 16, 0.5, 6, seed=0)
    assert seqs.decoded_posterior and set(seqs.decoded_posterior) <= {a + b for a in "abc" for b in "abc"}


async def test_bridge_in_engine_equals_the_python_reference(gc, many_eos_llm):
    from genlm_vlm import control

    llm = many_eos_llm.spawn(temperature=0.7)
    cond = gc.BoolFSA.from_regex(r"[aq]{1,4}").coerce(llm, f=b"".join)
    runs = [await control.smc(gc.AWRS(llm, cond), 16, 0.5, 4, seed=3, in_engine=flag) for flag in (True, False)]
    (a, b) = runs
    assert [list(c) for c in a.contexts] == [list(c) for c in b.contexts]
    assert np.array_equal(a.log_weights, b.log_weights) and a.log_ml == b.log_ml


async def test_bridge_on_the_requests_path_equals_the_burst(gc, many_eos_llm, llama_lm):
    """``engine_path="requests"`` reaches ``lm.smc``: the run takes that path (counted in
    ``lm.stats``) and equals the same run as a burst, with a critic too; so does
    ``mask_overlap=True`` (its work counted)."""
    from genlm_vlm import control

    llm = many_eos_llm.spawn(temperature=0.7)
    cond = gc.BoolFSA.from_regex(r"[aq]{1,4}").coerce(llm, f=b"".join)
    critic = gc.BoolFSA.from_regex(r"[aq]*q[aq]*").coerce(llm, f=b"".join)
    for crit in (None, critic):
        before = dict(llama_lm.stats["particle_requests"])
        req = await control.smc(gc.AWRS(llm, cond), 16, 0.5, 4, critic=crit, seed=3, engine_path="requests")
        after = llama_lm.stats["particle_requests"]
        assert after["runs"] == before["runs"] + 1 and after["fallbacks"] == before["fallbacks"]
        burst = await control.smc(gc.AWRS(llm, cond), 16, 0.5, 4, critic=crit, seed=3, engine_path="bursts")
        assert [list(c) for c in req.contexts] == [list(c) for c in burst.contexts]
        assert np.array_equal(req.log_weights, burst.log_weights) and req.log_ml == burst.log_ml
        before = llama_lm.stats["particle_requests"]["mask_overlap"]["submitted"]
        ahead = await control.smc(gc.AWRS(llm, cond), 16, 0.5, 4, critic=crit, seed=3, engine_path="requests",
                                  mask_overlap=True)
        assert llama_lm.stats["particle_requests"]["mask_overlap"]["submitted"] > before
        assert [list(c) for c in ahead.contexts] == [list(c) for c in burst.contexts]
        assert np.array_equal(ahead.log_weights, burst.log_weights) and ahead.log_ml == burst.log_ml


async def test_products_of_conditions(gc, llm, llama_lm):
    """A product of byte conditions (coerced together or one by one) is every condition's mask
    at once; the bridge's texts satisfy all of them."""
    import re

    from genlm_vlm import control
    from genlm_vlm.control.translate import condition_constraint
    from genlm_vlm.smc import AllOf

    a, b = gc.BoolFSA.from_regex(r"[a-z]{1,6}"), gc.BoolFSA.from_regex(r"[^e]*")
    together = (a * b).coerce(llm, f=b"".join)
    apart = a.coerce(llm, f=b"".join) * b.coerce(llm, f=b"".join)
    both = AllOf(condition_constraint(a), condition_constraint(b))
    contexts, _ = await _walks(llm, together, both, llama_lm, walks=4, depth=6, seed=4)
    assert contexts >= 6
    for cond in (together, apart):
        seqs = await control.smc(gc.AWRS(llm, cond), 16, 0.5, 8, seed=0)
        assert seqs.decoded_posterior and all(re.fullmatch(r"[a-df-z]{1,6}", t) for t in seqs.decoded_posterior)


async def test_bridge_runs_under_the_promptedllms_lora(gc, model_paths, tmp_path_factory):
    """PromptedLLM(lora_name=...) runs under that adapter: each particle's weight is its
    product of masses under the adapter's rows (exact), which differ from the base model's."""
    from conftest import _engine
    from test_lora import LORA_OPTS, _make_adapter

    lm = _engine(model_paths["llama"], LORA_OPTS)  # shared with test_lora, which counts its adapters:
    lm.add_new_lora(_make_adapter(model_paths["llama"], tmp_path_factory.mktemp("lora") / "bridge", 5), "bridge")
    try:
        await _bridge_weights_under_lora(gc, lm)
    finally:
        lm.remove_lora("bridge")  # ... so this test leaves none behind


async def _bridge_weights_under_lora(gc, lm) -> None:
    import torch

    from genlm_vlm import control
    from genlm_vlm.control.bridge import Plan, constraint_for
    from genlm_vlm.control.translate import condition_constraint
    from genlm_vlm.smc import api

    tok = lm.tokenizer
    llm = gc.PromptedLLM(lm, prompt_ids=[tok.bos_token_id, *tok.encode(PROMPT, add_special_tokens=False)],
                         lora_name="bridge")
    fsa = gc.BoolFSA.from_regex(r"[a-z]{1,3}")
    seqs = await control.smc(gc.AWRS(llm, fsa.coerce(llm, f=b"".join)), 4, 0.0, 4, seed=0)
    bound = api.bind(lm, constraint_for(Plan(llm, [condition_constraint(fsa)])), tuple(llm.token_maps.eos_idxs))
    differs = False
    for context, log_w in seqs:
        ids = [t.token_id for t in context[:-1]]
        state, want, base = bound.initial(), 0.0, 0.0
        for k in range(len(ids) + 1):
            prefix = list(llm.prompt_ids) + ids[:k]
            mask = torch.from_numpy(bound.masks([state])[0])
            want += float(torch.logsumexp((await lm.next_token_logprobs(prefix, lora_name="bridge")).double()[mask], 0))
            base += float(torch.logsumexp((await lm.next_token_logprobs(prefix)).double()[mask], 0))
            if k < len(ids):
                state = bound.advance(state, ids[k])
        assert math.isclose(log_w, want, abs_tol=1e-4), (ids, log_w, want)
        differs |= abs(base - want) > 1e-2
    assert differs  # the adapter changes the weights: they were not the base model's
