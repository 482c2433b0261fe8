"""Special and added tokens are never part of a constrained text (issue 42, item 3), on the real
engine.

The byte vocabulary writes a special token as its literal text (``<s>`` -> ``b"<s>"``), so before
the fix every constraint whose language contains that text (``[a-z<>/ ]+``, a JSON string, a
grammar, a mask function that allows everything) allowed the BOS id inside a text, and on a model
with two terminators the one not chosen as EOS could be drawn as text. Now the constraints see
those ids as tokens with no bytes (``genlm_vlm.smc.api.text_vocab``): never allowed, and only the
chosen EOS ids end a text. Each test here failed on the code before the fix.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from genlm_vlm.smc import AllOf, Grammar, JSONSchema, Regex, TokenMask, api

PROMPT = "def main():\n    return"
#: The extra terminator of the two-terminator tokenizer, at the id of the tiny BPE's last merge.
END_OF_TEXT = "<|end_of_text|>"


def _prompt(lm) -> list[int]:
    tok = lm.tokenizer
    return [tok.bos_token_id, *tok.encode(PROMPT, add_special_tokens=False)]


def _everything(width: int) -> TokenMask:
    return TokenMask(lambda gens: np.ones((len(gens), width), dtype=bool), "everything")


def _constraints(width: int) -> dict:
    """Every constraint kind, each with a language that holds the special tokens' texts."""
    return {
        "regex": Regex(r"[a-z<>/|_ ]+"),
        "json": JSONSchema({"type": "string"}),
        "ebnf": Grammar('root ::= [a-z<>/|_ ]+'),
        "mask": _everything(width),
        "allof": AllOf(Regex(r"[a-z<>/|_ ]+"), _everything(width)),
    }


def _allowed_along(lm, bound, kind: str) -> set[int]:
    """Ids the bound constraint allows at its start and after each token of a short text of its
    language (``"a"`` for the JSON string, ``a<`` for the others)."""
    ids = {b: i for i, b in reversed(list(enumerate(lm._byte_strings))) if b}
    path = [b'"', b"a", b'"'] if kind == "json" else [b"a", b"<"]
    state, seen = bound.initial(), set()
    for piece in [*path, None]:
        seen |= set(np.flatnonzero(bound.masks([state])[0]).tolist())
        if piece is not None:
            state = bound.advance(state, ids[piece])
    return seen


@pytest.mark.parametrize("kind", ["regex", "json", "ebnf", "mask", "allof"])
def test_no_constraint_allows_a_special_token(llama_lm, kind):
    """Before: the BOS ``<s>`` and ``<pad>`` were allowed wherever their text fits (every kind
    here), and ``</s>`` too where it was not the EOS."""
    lm = llama_lm
    specials = set(lm.tokenizer.all_special_ids)
    assert specials == {0, 1, 2}  # <s>, </s>, <pad>: each written as its text in the byte vocabulary
    assert [lm._byte_strings[i] for i in sorted(specials)] == [b"<s>", b"</s>", b"<pad>"]
    for eos in (1, 2):  # the tokenizer's EOS, or another special id chosen as EOS
        bound = api.bind(lm, _constraints(lm.vocab_size)[kind], (eos,))
        allowed = _allowed_along(lm, bound, kind)
        assert allowed & specials == {eos}  # the chosen EOS still ends a text, nothing else special


def test_a_run_never_draws_a_special_token_and_the_reference_agrees(llama_lm):
    """A mask function that allows only special tokens besides a few letters: before, the BOS and
    ``<pad>`` were drawn into texts (as ``<s>``, ``<pad>``); now never, in the engine and in the
    Python reference alike."""
    lm = llama_lm
    width = lm.vocab_size
    allow = np.zeros(width, dtype=bool)
    allow[[0, 1, 2]] = True
    allow[[i for i, b in enumerate(lm._byte_strings) if b in (b"a", b"b")]] = True
    fn = TokenMask(lambda gens: np.repeat(allow[None, :], len(gens), axis=0), "specials and two letters")
    runs = [lm.smc_sync(_prompt(lm), fn, 16, 8, seed=s, in_engine=e) for s in (1, 2) for e in (True, False)]
    for r in runs:
        for p in r.particles:
            assert not {0, 2} & set(p.token_ids), p
            assert b"<" not in p.text
    assert [[(p.token_ids, p.log_weight) for p in r.particles] for r in runs[0::2]] == \
        [[(p.token_ids, p.log_weight) for p in r.particles] for r in runs[1::2]]


def test_the_mock_follows_the_same_rule():
    from genlm_vlm import MockAsyncLM

    lm = MockAsyncLM(seed=3)  # its vocabulary: <s> (BOS), </s> (EOS), then one token per byte
    for in_engine in (True, False):
        r = lm.smc_sync([5, 6], Regex(r"[<>/sa]+"), 16, 6, seed=4, in_engine=in_engine)
        assert all(0 not in p.token_ids and 1 not in p.token_ids for p in r.particles)
    bound = api.bind(lm, Regex(r"[<>/sa]+"), (1,))
    assert not bound.masks([bound.initial()])[0][[0, 1]].any()
    assert lm._special_ids == (0, 1)
    lm.cleanup()


# ------------------------------------------------------------------------------ two terminators
def _two_terminators(tmp_path, model_path: str) -> str:
    """The tiny Llama's tokenizer with a second terminator: the last BPE merge (``are``, id 511)
    removed and a special ``<|end_of_text|>`` put at its id, so every id stays inside the
    model's 512 logits."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    data = json.loads(open(f"{model_path}/tokenizer.json", encoding="utf-8").read())
    vocab = data["model"]["vocab"]
    last = max(vocab.values())
    pair = data["model"]["merges"][-1]
    merged = "".join(pair) if isinstance(pair, list) else pair.replace(" ", "")
    assert vocab[merged] == last == 511  # the last merge made the last id: nothing else uses it
    del vocab[merged]
    data["model"]["merges"].pop()
    data["added_tokens"].append({"id": last, "content": END_OF_TEXT, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token="<s>",
                                  eos_token="</s>", pad_token="<pad>", additional_special_tokens=[END_OF_TEXT])
    assert tok.convert_tokens_to_ids(END_OF_TEXT) == last and len(tok) == 512
    out = tmp_path / "two-terminators"
    tok.save_pretrained(out)
    shutil.copy(f"{model_path}/config.json", out)  # vLLM reads a tokenizer's directory as a model's too
    return str(out)


@pytest.fixture(scope="module")
def two_eos_lm(model_paths, tmp_path_factory):
    from conftest import ENGINE_OPTS

    from genlm_vlm import AsyncVirtualLM

    tok_dir = _two_terminators(tmp_path_factory.mktemp("tok"), model_paths["llama"])
    lm = AsyncVirtualLM.from_name(model_paths["llama"], {**ENGINE_OPTS, "tokenizer": tok_dir})
    yield lm
    lm.cleanup()


def test_the_terminator_not_chosen_never_appears_in_a_text(two_eos_lm):
    """``eos_token_ids`` picks one of two terminators: the other is never allowed, neither inside a
    text nor as an ending. Before, ``<|end_of_text|>`` was drawn as text under ``eos=</s>`` (and
    ``</s>`` under ``eos=<|end_of_text|>``)."""
    lm = two_eos_lm
    end = lm.tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    assert lm._byte_strings[end] == END_OF_TEXT.encode()
    eos_ids = (lm.tokenizer.eos_token_id, end)
    letters = [i for i, b in enumerate(lm._byte_strings) if b in (b"a", b"b")]
    for chosen, other in (eos_ids, eos_ids[::-1]):
        for kind, c in _constraints(lm.vocab_size).items():
            allowed = _allowed_along(lm, api.bind(lm, c, (chosen,)), kind)
            assert allowed & {0, 2, *eos_ids} == {chosen}, kind
        allow = np.zeros(lm.vocab_size, dtype=bool)
        allow[[*eos_ids, *letters]] = True
        fn = TokenMask(lambda gens, a=allow: np.repeat(a[None, :], len(gens), axis=0), "both terminators")
        r = lm.smc_sync(_prompt(lm), fn, 16, 6, seed=7, eos_token_ids=[chosen])
        assert r.n_finished > 0
        for p in r.particles:
            assert other not in p.token_ids and chosen not in p.token_ids, p
            assert set(p.token_ids) <= set(letters)
