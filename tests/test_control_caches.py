"""The bridge's per-run and per-step costs, counted rather than timed (genlm_vlm.control):

* a condition equal to one translated before but a new object (a program that rebuilds it before
  every run) is translated and compiled once: found by content, then by its text; both caches
  are bounded;
* the empty-tokens wrapper's packed path (the SMC controller's, no unpacking) equals its mask
  path on every column the controller reads.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("genlm.control") is None,
    reason="genlm-control is not installed (pip install 'genlm-vlm[control]')",
)

PROMPT = "def main():\n    return"


async def test_an_equal_new_condition_translates_and_compiles_nothing(gc, llama_lm):
    """bench_e2e's case: the program builds its PromptedLLM and condition again before every run
    (new objects, equal content). The second run finds the translation by content, and the
    compiled grammar by its text (BoolCFG) or the token automaton's mask rows by its content
    (BoolFSA): nothing is translated, compiled or filled again. Counted, not timed."""
    from genlm_vlm import control
    from genlm_vlm.control import translate

    tok = llama_lm.tokenizer
    prompt = [tok.bos_token_id, *tok.encode(PROMPT, add_special_tokens=False)]
    pattern = r"[a-z]{1,3}@[a-z]{1,3}\.(com|org)"  # not used by another test: a fresh translation
    lark = 'start: "ab" start | "c"'

    def program(kind: str):
        llm = gc.PromptedLLM(llama_lm, prompt_ids=prompt, eos_byte_strings=[b"\n"])
        cond = (gc.BoolFSA.from_regex(pattern) if kind == "fsa" else gc.BoolCFG.from_lark(lark)).coerce(
            llm, f=b"".join)
        return gc.AWRS(llm, cond, seed=0)

    from genlm_vlm.smc.api import bind_cache

    def rows_filled() -> int:  # mask rows the model's token automata have computed
        return sum(t.filled for t in bind_cache(llama_lm).get("dfa-masks", {}).values())

    for kind in ("fsa", "cfg"):
        grammar = kind == "cfg"  # a BoolCFG compiles an xgrammar grammar; a BoolFSA is a token automaton
        before = translate.cache_counts()
        first = await control.smc(program(kind), 4, 0.5, 8, seed=1)
        mid, filled = translate.cache_counts(), rows_filled()
        assert mid["translated"] == before["translated"] + 1 and mid["compiled"] == before["compiled"] + grammar
        second = await control.smc(program(kind), 4, 0.5, 8, seed=1)
        after = translate.cache_counts()
        assert after["translated"] == mid["translated"], kind  # found by content: no translation
        assert after["compiled"] == mid["compiled"], kind  # found by its text: no compilation
        assert after["translation_hits"] == mid["translation_hits"] + 1
        assert after["compile_hits"] == mid["compile_hits"] + grammar
        if not grammar:  # the automaton's mask rows were kept for the model: none computed again
            assert filled > 0 and rows_filled() == filled
        # the same run: same contexts and weights
        assert list(first.contexts) == list(second.contexts)
        assert np.array_equal(first.log_weights, second.log_weights)
    # different content, different key
    a = translate.content_key(gc.BoolFSA.from_regex(r"[ab]"))
    assert a == translate.content_key(gc.BoolFSA.from_regex(r"[ab]"))
    assert a != translate.content_key(gc.BoolFSA.from_regex(r"[ac]"))


def test_translation_caches_are_bounded(monkeypatch):
    from genlm_vlm.control import translate

    class Compiler:
        def __init__(self):
            self.calls = 0

        def compile_grammar(self, text):
            self.calls += 1
            return ("compiled", text)

    monkeypatch.setattr(translate, "MAX_COMPILED", 3)
    c = Compiler()
    for k in range(5):
        translate.compiled_grammar(c, f"root ::= \"{k}\"\n")
    translate.compiled_grammar(c, 'root ::= "4"\n')  # kept
    assert c.calls == 5
    translate.compiled_grammar(c, 'root ::= "0"\n')  # dropped: compiled again
    assert c.calls == 6 and len(getattr(c, translate._KEPT)) == 3


def test_empty_tokens_packed_path_equals_the_mask_path(gc):
    """The controller's path (bitmasks_upto at the usable width: the inner grammar's bitmasks
    with the empty tokens ORed into live rows, no unpacking) equals masks() on every column it
    reads: with empty ids past the usable width (padding) and inside it, on live and finished
    states; a narrower caller gets the full path."""
    import torch

    from genlm_vlm.control.bridge import _WithEmptyTokens
    from genlm_vlm.control.translate import condition_constraint
    from genlm_vlm.mock import MockAsyncLM
    from genlm_vlm.smc import api
    from genlm_vlm.smc.constraints import unpack_bits, usable_width

    lm = MockAsyncLM(vocab_size=300, logit_scale=1.0)  # 258 tokens, 42 padded columns
    vocab = lm._byte_strings
    eos = (vocab.index(b"."),)
    inner = condition_constraint(gc.BoolFSA.from_regex(r"[a-c]{2}"))
    width = usable_width(vocab, eos)
    a, b = vocab.index(b"a"), vocab.index(b"b")
    for empty in ([i for i in range(lm.vocab_size) if not vocab[i]],  # the padding: past the width
                  [3, 31, 32, 63, 95, 200, 299]):  # inside it too (bit 31 of a word included)
        bound = api.bind(lm, _WithEmptyTokens(inner, empty), eos)
        s0, s1, s2 = bound.initial(), bound.initial(), bound.initial()
        s1 = bound.advance(s1, a)
        s2 = bound.advance(bound.advance(s2, a), b)
        s3 = bound.advance(bound.copy(s2), eos[0])  # finished: allows nothing
        states = [s0, s1, s2, s3, s1]
        full = np.asarray(bound.masks(states))
        assert full[:3].any(axis=1).all() and not full[3].any()
        got = bound.bitmasks_upto(states, width)
        assert torch.equal(torch.as_tensor(unpack_bits(got, width)), torch.as_tensor(full[:, :width]))
        narrow = bound.bitmasks_upto(states, width - 40)  # below the reach: the full path
        assert (unpack_bits(narrow, width - 40) == full[:, : width - 40]).all()
        assert bound.advance(bound.copy(s1), empty[0]) is not None  # an empty token keeps the state

