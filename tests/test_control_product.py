"""genlm-control's product of PromptedLLMs (``llm1 * llm2``) through the bridge
(``genlm_vlm.control.smc`` -> ``lm.smc(None, ..., prompts=[...])``), on the tiny Llama:

* posterior: on an enumerable language, the bridge's pooled posterior matches the exact product
  posterior (enumerated: ``prod_j p(x | p_j)``, EOS weighted by ``sum_j log P_j(EOS)``) and
  genlm-control's own (per-token) SMC of the same program within Monte Carlo error;
* refusals: mismatched models, EOS, LoRA, temperature, several EOS ids.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_control_bridge import LANGUAGE, MAX_TOKENS, PROMPT, _exact, _pooled, _tv, pytestmark  # noqa: F401

OTHER = "x = 'a"  # the second factor's prompt
RUNS = 48


def _prompt(lm, text: str) -> list[int]:
    tok = lm.tokenizer
    return [tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]


@pytest.fixture(scope="module")
def pair(gc, llama_lm):
    eos = [b"."]
    llm1 = gc.PromptedLLM(llama_lm, prompt_ids=_prompt(llama_lm, PROMPT), eos_byte_strings=eos)
    llm2 = gc.PromptedLLM(llama_lm, prompt_ids=_prompt(llama_lm, OTHER), eos_byte_strings=eos)
    assert len(llm1.token_maps.eos_idxs) == 1
    return llm1, llm2


@pytest.mark.parametrize("sampler_kind", ["awrs", "direct+critic"])
async def test_product_posterior_matches_exact_and_genlm_control(gc, pair, llama_lm, sampler_kind):
    from genlm_vlm import control
    from genlm_vlm.control.bridge import Plan, constraint_for
    from genlm_vlm.control.translate import condition_constraint

    llm1, llm2 = pair
    fsa = gc.BoolFSA.from_regex(LANGUAGE)
    cond = fsa.coerce(llm1, f=b"".join)
    target = llm1 * llm2
    exact, log_z = await _exact([llm1, llm2], llama_lm,
                                        constraint_for(Plan(llm1, [condition_constraint(fsa)])))
    single, _ = await _exact([llm1], llama_lm, constraint_for(Plan(llm1, [condition_constraint(fsa)])))
    assert len(exact) == 8 and _tv(exact, single) > 0.05, (exact, single)  # the second factor matters

    def make(run):
        if sampler_kind == "awrs":
            return gc.AWRS(target, cond, seed=run), None
        return gc.direct_token_sampler(target), cond

    ours = []
    for seed in range(RUNS):
        sampler, critic = make(seed)
        ours.append(await control.smc(sampler, 32, 0.5, MAX_TOKENS, critic=critic, seed=seed))
    assert all(c[-1] is gc.EOS or w == -math.inf for s in ours for c, w in s)
    pooled = _pooled(ours)
    z_ratio = np.mean([math.exp(s.log_ml - log_z) for s in ours])
    tv_exact = _tv(pooled, exact)
    assert tv_exact < 0.1, (tv_exact, pooled, exact)
    assert 0.8 < z_ratio < 1.2, z_ratio
    if sampler_kind != "awrs":
        return
    np.random.seed(0)
    theirs = [await gc.AWRS(target, cond, seed=run).smc(32, 0.5, MAX_TOKENS) for run in range(12)]
    tv_theirs = _tv(pooled, _pooled(theirs))
    print(f"product: TV(bridge, exact) {tv_exact:.3f}, TV(bridge, genlm-control) {tv_theirs:.3f}, "
          f"TV(genlm-control, exact) {_tv(_pooled(theirs), exact):.3f}, Z-hat/Z {z_ratio:.3f}")
    assert tv_theirs < _tv(_pooled(theirs), exact) + 0.1, (tv_theirs, pooled, _pooled(theirs))


async def test_product_weights_are_exact(gc, pair, llama_lm):  # noqa: F811
    """Each particle's log weight is ``sum_t logsumexp_mask sum_j log p_j`` along its path (the
    EOS step included): the product's locally optimal proposal, with every factor's prompt."""
    import torch

    from genlm_vlm import control
    from genlm_vlm.control.bridge import Plan, constraint_for
    from genlm_vlm.control.translate import condition_constraint
    from genlm_vlm.smc import api

    llm1, llm2 = pair
    fsa = gc.BoolFSA.from_regex(r"[a-z]{1,3}")
    seqs = await control.smc(gc.AWRS(llm1 * llm2, fsa.coerce(llm1, f=b"".join)), 4, 0.0, 4, seed=0)
    bound = api.bind(llama_lm, constraint_for(Plan(llm1, [condition_constraint(fsa)])), tuple(llm1.token_maps.eos_idxs))
    for context, log_w in seqs:
        ids = [t.token_id for t in context[:-1]]
        state, want = bound.initial(), 0.0
        for k in range(len(ids) + 1):
            rows = await llama_lm.batch_next_token_logprobs([list(f.prompt_ids) + ids[:k] for f in (llm1, llm2)])
            mask = torch.from_numpy(bound.masks([state])[0])
            want += float(torch.logsumexp((rows[0].double() + rows[1].double())[mask], 0))
            if k < len(ids):
                state = bound.advance(state, ids[k])
        assert math.isclose(log_w, want, abs_tol=1e-3), (ids, log_w, want)


async def test_product_refusals_name_why(gc, pair, llama_lm):  # noqa: F811
    from genlm_vlm import control
    llm1, llm2 = pair
    fsa = gc.BoolFSA.from_regex(r"[a-z]+")
    cond = fsa.coerce(llm1, f=b"".join)
    from genlm_vlm.mock import MockAsyncLM

    other_model = gc.PromptedLLM(MockAsyncLM(llama_lm.tokenizer), prompt_ids=list(llm2.prompt_ids),
                                 eos_byte_strings=[b"."])
    # (the product, the problem, its way out; every refusal then ends with fallback=True)
    cases = [
        (llm1 * llm2.spawn(temperature=0.5), "factor 1 has temperature=0.5", "spawn the factors with temperature=1.0"),
        (llm1.spawn(temperature=2.0) * llm2.spawn(temperature=2.0), "factor 0 has temperature=2.0",
         "spawn the factors with temperature=1.0"),
        (llm1 * llm2.spawn_new_eos([b","]), r"factor 1's EOS ids .* differ", "build every factor with the same eos_byte_strings"),
        (llm1.spawn_new_eos([b".", b","]) * llm2.spawn_new_eos([b".", b","]), "2 EOS ids",
         "use one eos_byte_string that is one token"),
        (llm1 * other_model, "factor 1's model is another object", "use the same model object for every PromptedLLM"),
    ]
    fallback = "; or pass fallback=True: genlm-control runs it itself, per token"
    for target, message, way_out in cases:
        with pytest.raises(control.UntranslatableError, match=message) as err:
            await control.smc(gc.direct_token_sampler(target), 4, 0.5, 4, critic=None)
        assert way_out in str(err.value) and str(err.value).endswith(fallback), str(err.value)
    lora = gc.PromptedLLM(llama_lm, prompt_ids=list(llm2.prompt_ids), eos_byte_strings=[b"."], lora_name="x")
    with pytest.raises(control.UntranslatableError, match="lora_name='x' differs.*give every factor the same lora_name"):
        await control.smc(gc.AWRS(llm1 * lora, cond), 4, 0.5, 4)
    # fallback=True: genlm-control runs a refused product itself
    seqs = await control.smc(gc.AWRS(llm1 * llm2.spawn(temperature=0.5), cond), 4, 0.5, 3, fallback=True)
    assert len(seqs) == 4
