"""A step's token moves walked at once (``LazyDFA.walk_tokens``, compiled by numba) give the states
of a one-by-one walk of each particle, whatever the DFA's cache holds; what the compiled walk
cannot take (moves not made yet, EOS, tokens without bytes, refused tokens) goes one by one, with
the same answers and errors; without numba everything goes one by one. The mask table's
least-recently-used order keeps every row a gather reads."""

from __future__ import annotations

import random

import numpy as np
import pytest

from genlm_vlm.smc import Regex, walk_cpu
from genlm_vlm.smc.automaton import TokenMasks
from genlm_vlm.smc.constraints import unpack_bits

PIECES = ["a", "b", "ab", "ba", "abc", " ", " a", "é", "\u00e9b", "1", "12", "x", "-", "ß", "c"]


def _vocab() -> list[bytes]:
    """EOS (id 0), a special token without bytes (id 1), text tokens, and a token that ends
    inside a character (the first byte of ``é``)."""
    return [b"", b""] + [p.encode() for p in PIECES] + ["é".encode()[:1]]


def _one_by_one(bound, states, tokens):
    with bound.dfa.lock:
        return [bound._advance_one(s, int(t)) for s, t in zip(states, tokens, strict=True)]


def _random_steps(bound, vocab, rng, n=24, steps=12):
    """Each step, ``n`` particles' states and a token each allowed (EOS among them where a text
    may end); a particle that ended starts again from the initial state."""
    states = [bound.initial()] * n
    start = np.flatnonzero(unpack_bits(bound.bitmasks([bound.initial()]), len(vocab))[0])
    for _ in range(steps):
        masks = unpack_bits(bound.bitmasks(states), len(vocab))
        for k, row in enumerate(masks):
            if not row.any():  # a dead end of this vocabulary (half a character): start again
                states[k] = bound.initial()
        tokens = [int(rng.choice(list(np.flatnonzero(row)) or list(start))) for row in masks]
        yield states, tokens
        states = [s or bound.initial() for s in bound.advance_many(states, tokens)]


@pytest.mark.parametrize("cache_bytes", [1 << 16, 32 << 20])
def test_walk_tokens_equals_one_by_one(cache_bytes: int) -> None:
    vocab = _vocab()
    pattern = r"(?:[abc]{1,4}(?: |-)?|é|ß|\d{1,3}){1,12}"
    bound = Regex(pattern).bind(vocab, [0], len(vocab), {})
    ref = Regex(pattern).bind(vocab, [0], len(vocab), {})
    bound.dfa.max_bytes = cache_bytes  # small: states dropped and made again between steps
    bound.dfa.trim()
    rng = random.Random(3)
    fast = 0
    for states, tokens in _random_steps(ref, vocab, rng):
        expect = _one_by_one(ref, states, tokens)
        assert bound.advance_many(states, tokens) == expect
        assert bound.advance_many(states, np.asarray(tokens, dtype=np.int64)) == expect  # numpy tokens too
        with bound.dfa.lock:
            _, rest = bound.dfa.walk_tokens(states, tokens, bound.masks_table.walk.token_bytes)
        fast += len(states) - len(rest)
    assert fast > 0, "the compiled walk never took a particle"
    assert (bound.dfa.evicted > 0) == (cache_bytes < 1 << 20)  # the small cache dropped states


def test_eos_special_and_refused_tokens_go_one_by_one() -> None:
    vocab = _vocab()
    bound = Regex(r"ab|a").bind(vocab, [0], len(vocab), {})
    a, b, ab = vocab.index(b"a"), vocab.index(b"b"), vocab.index(b"ab")
    s0 = bound.initial()
    after_a = bound.advance(s0, a)
    # EOS where the text may end (id 0) ends it; a text token in the same call is walked
    got = bound.advance_many([after_a, s0, after_a], [0, ab, b])
    assert got[0] == b"" and got[1] == bound.advance(s0, ab) and got[2] == bound.advance(after_a, b)
    with bound.dfa.lock:
        after, rest = bound.dfa.walk_tokens([after_a, s0], [0, a], bound.masks_table.walk.token_bytes)
    assert rest == [0] and after[0] is None and after[1] == after_a  # EOS left to the caller
    for bad in ([s0, s0], [0, 1]), ([s0, after_a, s0], [a, a, a]), ([s0], [len(vocab) + 5]):
        with pytest.raises(ValueError, match="not allowed here"):
            bound.advance_many(*bad)


def test_without_the_compiled_walk_every_particle_goes_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = _vocab()
    pattern = r"[abc ]{0,20}"
    ref = Regex(pattern).bind(vocab, [0], len(vocab), {})
    monkeypatch.setattr(walk_cpu._WALK, "kernel", None)
    monkeypatch.setattr(walk_cpu._WALK, "failed", ["the compiled token walk is off: ModuleNotFoundError: numba"])
    assert walk_cpu.walker() is None
    bound = Regex(pattern).bind(vocab, [0], len(vocab), {})
    s = bound.initial()
    tokens = [vocab.index(x) for x in (b"ab", b" a", b"c", b"ba")]
    with bound.dfa.lock:
        after, rest = bound.dfa.walk_tokens([s] * 4, tokens, bound.masks_table.walk.token_bytes)
    assert after == [None] * 4 and rest == [0, 1, 2, 3]
    assert bound.advance_many([s] * 4, tokens) == _one_by_one(ref, [ref.initial()] * 4, tokens)


def test_mask_rows_read_by_a_gather_are_never_evicted_by_it() -> None:
    """A table of 3 rows, gathers of 3 states: every fill evicts a row the current gather did not
    read (the least recently read); 4 distinct states in one gather cannot fit and say so."""
    vocab = _vocab()
    bound = Regex(r"[ab]{0,8}").bind(vocab, [0], len(vocab), {})
    ref = Regex(r"[ab]{0,8}").bind(vocab, [0], len(vocab), {})
    bound.masks_table = TokenMasks(bound.masks_table.dfa, bound.masks_table.walk, max_rows=3)
    a = vocab.index(b"a")
    chain = [bound.initial()]
    for _ in range(6):
        chain.append(bound.advance(chain[-1], a))
    for k in range(len(chain) - 2):
        states = chain[k:k + 3]
        assert bool((bound.bitmasks(states) == ref.bitmasks(states)).all())
    assert bound.masks_table.evicted > 0
    with pytest.raises(RuntimeError, match="more distinct automaton states"):
        bound.bitmasks(chain[:4])
