"""genlm-control's SMC in the engine (genlm_vlm.control.smc) and the exact translation of its
Boolean conditions into xgrammar grammars (genlm_vlm.control.translate), on the tiny Llama.

* masks: the translated grammar's token masks equal genlm-control's own ``cond.logw_next``
  (finite vs -inf, EOS included) along random walks through each language;
* posterior: on an enumerable language, the bridge's pooled posterior matches the exact one and
  genlm-control's own (per-token) SMC within Monte Carlo error; its Z-hat is unbiased;
* refusals: every part the bridge cannot run exactly raises a message naming it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("genlm.control") is None,
    reason="genlm-control is not installed (pip install 'genlm-vlm[control]')",
)

_VLLM_ENV = ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ENABLE_V1_MULTIPROCESSING")
PROMPT = "def main():\n    return"


@pytest.fixture(scope="module")
def gc():
    saved = {name: os.environ.get(name) for name in _VLLM_ENV}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import genlm.control
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return genlm.control


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
