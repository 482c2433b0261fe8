"""The controller's host work (issue 36, item 5): grammars are filled over the usable columns
only, and the CPU step runs on one torch thread of the calling thread, restored afterwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genlm_vlm.smc import Regex
from genlm_vlm.smc import step as S
from genlm_vlm.smc.constraints import fill_width, unpack_bits


def _vocab(n_real: int = 40) -> tuple[list[bytes], int]:
    letters = [bytes([c]) for c in range(97, 123)] + [b" ", b"ab", b"ba", b"xyz"]
    vocab = [b""] + (letters * 4)[: n_real - 2] + [b"<eos>"]
    return vocab, len(vocab) - 1


def test_grammar_masks_are_filled_over_the_usable_columns_only():
    """A model whose logit matrix is much wider than its tokenizer: the grammar is compiled for
    the tokens with bytes and EOS, the bitmasks keep the ``[m, ceil(V/32)]`` shape, the padding
    words are zero, and the allowed tokens are those of a grammar compiled over every column."""
    vocab, eos = _vocab()
    width = 4096
    assert fill_width(vocab, [eos], width) == len(vocab)
    _check_fill(Regex("[a-c ]{2,5}").bind(vocab, [eos], width), vocab, eos, width)


def _check_fill(bound, vocab, eos, width):
    import xgrammar as xgr

    full = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=width,
                                                 stop_token_ids=[eos])).compile_regex("[a-c ]{2,5}")
    states = [bound.initial() for _ in range(3)]
    ref = [xgr.GrammarMatcher(full) for _ in range(3)]
    for path in ([], [vocab.index(b"a")], [vocab.index(b"a"), vocab.index(b"ba")]):
        for tok in path[-1:]:
            states = [bound.advance(s, tok) for s in states]
            assert all(r.accept_token(tok) for r in ref)
        bits = bound.bitmasks(states)
        assert bits.dtype == torch.int32 and tuple(bits.shape) == (3, width // 32)
        assert not bits[:, 2:].any()  # 40 tokens: two words
        want = torch.zeros((3, width // 32), dtype=torch.int32)
        for k, r in enumerate(ref):
            r.fill_next_token_bitmask(want, k)
        usable = np.array([bool(b) for b in vocab] + [False] * (width - len(vocab)))
        usable[eos] = True
        np.testing.assert_array_equal(unpack_bits(bits, width), unpack_bits(want, width) & usable)
        assert unpack_bits(bits, width)[:, eos].tolist() == [len(path) >= 2] * 3


def test_fill_width_keeps_an_eos_past_the_last_token_with_bytes():
    vocab = [b"a", b"b", b"", b""]
    assert fill_width(vocab, [3], 64) == 4
    assert fill_width(vocab, [0], 64) == 2
    assert fill_width(vocab, [3], 3) == 2  # ids past the width are not columns


@pytest.mark.parametrize("pin", [1, None])
def test_the_cpu_step_runs_on_one_thread_and_restores_the_count(pin, monkeypatch):
    """By default the CPU step runs with one torch thread (CPU_STEP_THREADS) and gives the
    caller's count back; None leaves the caller's count alone. The result is the same."""
    seen = []
    dense = S._dense

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return dense(*a, **k)

    monkeypatch.setattr(S, "_dense", spy)
    monkeypatch.setattr(S, "CPU_STEP_THREADS", pin)
    rng = np.random.default_rng(3)
    rows = torch.log_softmax(torch.from_numpy(rng.normal(size=(4, 300)).astype(np.float32)), dim=1)
    bits = S.pack(np.ones((4, 300), dtype=bool))
    u = rng.random(4)
    before = torch.get_num_threads()
    try:
        S.set_threads(2)
        out = S.to_host(*S.propose(rows.clone(), bits, u, path="dense"))
        assert torch.get_num_threads() == 2
    finally:
        S.set_threads(before)
    assert seen == [1 if pin else 2]
    monkeypatch.setattr(S, "CPU_STEP_THREADS", 1)
    again = S.to_host(*S.propose(rows.clone(), bits, u, path="dense"))
    assert out[0] == again[0] and out[1].tobytes() == again[1].tobytes()


def test_bitmasks_upto_cuts_the_padding_words_and_agrees_with_bitmasks():
    """What the controller asks for: the words covering the usable columns only, the same bits
    as :meth:`bitmasks` there; AllOf of a grammar and a TokenMask (full width) agrees too."""
    from genlm_vlm.smc import AllOf, TokenMask

    vocab, eos = _vocab()
    width = 4096
    odd = TokenMask(lambda g: np.arange(width)[None, :].repeat(len(g), 0) % 2 == 1, "odd ids")
    for c in (Regex("[a-c ]{2,5}"), AllOf(Regex("[a-c ]{2,5}"), odd)):
        bound = c.bind(vocab, [eos], width)
        states = [bound.initial(), bound.initial()]
        bound.advance(states[1], vocab.index(b"a"))
        wide, cut = bound.bitmasks(states), bound.bitmasks_upto(states, len(vocab))
        assert tuple(wide.shape) == (2, width // 32) and cut.shape[0] == 2 and 2 <= cut.shape[1] < width // 32
        assert torch.equal(wide[:, : cut.shape[1]], cut) and not wide[:, cut.shape[1]:].any()
        assert cut.any()
