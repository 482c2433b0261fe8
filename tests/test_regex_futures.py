"""Rows shared by states with the same near future (``genlm_vlm.smc.futures``), and moves made per
byte interval on first read (``LazyDFA``): fewer walks and fewer states, the same bits.

Every test checks each mask against the DFA walked token by token (tests/test_regex.py's
``check_masks_by_walking``) and counts work (vocabulary walks, states made), never time.
"""

from __future__ import annotations

import random

import pytest
from test_regex import _mixed_vocab, check_masks_by_walking

from genlm_vlm.smc import Regex, futures


def _walks(pattern: str, sharing: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """(walks, rows shared) of the same random walks through ``pattern``'s masks, each mask
    checked against the DFA walked token by token."""
    with monkeypatch.context() as m:
        if not sharing:
            m.setattr(futures, "MAX_DEPTH", 0)
        rng = random.Random(pattern)
        vocab = _mixed_vocab(rng)
        auto = Regex(pattern).bind(vocab, [0], len(vocab), {})
        assert check_masks_by_walking(auto, vocab, len(vocab), rng, 12, 30) >= 200
        return auto.masks_table.walked, auto.masks_table.shared


@pytest.mark.parametrize(("pattern", "at_most"), [(r"[a-z ]{300}", 0.1), (r"(?:\w{1,6}\s){1,30}", 0.75),
                                                  (r"(?:[a-c]|é|😀){0,40}", 0.1), (r".{200}", 0.2)])
def test_counted_repeats_walk_the_vocabulary_once_not_once_per_copy(pattern: str, at_most: float,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """States a counted repeat makes as it advances read the same strings of up to the longest
    token's length while the repeat's end is further than that: they share one walked row."""
    walked, shared = _walks(pattern, True, monkeypatch)
    alone, none = _walks(pattern, False, monkeypatch)
    assert none == 0 and shared >= 20 and walked <= at_most * alone, (walked, alone, shared)


@pytest.mark.parametrize("pattern", [r"[a-z]{3,9}", r"(?:\w\s?){2,7}", r"(?:ab|é){4}", r"(a|b)*a(a|b){5}"])
def test_rows_near_a_repeats_end_are_exact(pattern: str) -> None:
    """Short repeats, whose ends every walk reaches: states whose futures differ near the end get
    their own rows (each mask still the DFA walked token by token)."""
    rng = random.Random(pattern)
    vocab = _mixed_vocab(rng)
    auto = Regex(pattern).bind(vocab, [0], len(vocab), {})
    assert check_masks_by_walking(auto, vocab, len(vocab), rng, 40, 12) >= 100


def test_signatures_that_pass_the_budget_give_up_and_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signature past its budget gives up (the row is walked, the bits the same); past the
    entry bound the memo, the interned structures and the rows filed under them are dropped
    together and made again."""
    monkeypatch.setattr(futures, "BUDGET", 40)
    monkeypatch.setattr(futures, "MAX_ENTRIES", 300)
    rng = random.Random(3)
    vocab = _mixed_vocab(rng)
    auto = Regex(r"(?:\w{1,4}\s){1,30}").bind(vocab, [0], len(vocab), {})
    assert check_masks_by_walking(auto, vocab, len(vocab), rng, 12, 20) >= 100
    f = auto.masks_table.futures
    assert f.gave_up > 0 and f.computed > 0, (f.gave_up, f.computed)


def test_sharing_turns_itself_off_where_every_signature_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(futures, "BUDGET", 1)
    rng = random.Random(4)
    vocab = _mixed_vocab(rng)
    auto = Regex(r"(?:\w\s){1,30}").bind(vocab, [0], len(vocab), {})
    assert check_masks_by_walking(auto, vocab, len(vocab), rng, 4, 12) >= 30
    f = auto.masks_table.futures
    assert not f.enabled and f.gave_up == futures.GIVE_UP and f.computed == 0


def test_a_class_state_makes_only_the_states_its_bytes_read() -> None:
    """A state holding Unicode ``\\w`` moves to a different state on each of some fifty lead
    bytes; over a vocabulary of ASCII letters, the first mask makes the states of the bytes the
    tokens read (the intervals of ASCII word characters), not one per lead byte."""
    vocab = [b""] + [bytes([c]) for c in b"abcxyz_09"] + [b"ab", b"xyz"]
    auto = Regex(r"\w{30}").bind(vocab, [0], len(vocab), {})
    dfa = auto.dfa
    assert dfa.states_made <= 12, dfa.states_made
    state = auto.advance(auto.initial(), 1)
    assert dfa.step(state, "é".encode())  # a lead byte read later: its state made then
    assert dfa.matches(("a" * 29 + "é").encode()) and not dfa.matches(("a" * 29 + "é!").encode())


@pytest.mark.parametrize("pattern", [r"(?:[a-c]{0,6}){0,5}", r"(?:a|b?){40}", r"(?:\w{1,3}\s?){2,9}", r"(a|b)*a(a|b){4}"])
def test_wide_closures_are_the_set_closures(pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closures of many targets go level by level in numpy (``ByteNFA._wide_closure``): with the
    thresholds at 2 targets and 1 state a level, every closure of two or more targets takes that
    path, each equals the set closure's, and the masks equal the DFA walked token by token."""
    import numpy as np

    from genlm_vlm.smc import bytenfa

    nfa = Regex(pattern).byte_nfa()
    rng = random.Random(pattern)
    state = nfa.closure([nfa.start])
    checked = 0
    for _ in range(40):
        moves = nfa.moves(state)
        if not moves:
            break
        _x, _y, targets = moves[rng.randrange(len(moves))]
        targets = np.asarray(targets, dtype=np.int64)
        narrow = nfa.closure(targets.tolist())
        monkeypatch.setattr(bytenfa, "WIDE_FRONT", 1)
        monkeypatch.setattr(bytenfa, "WIDE_SET", 2)
        wide = nfa.closure(targets)
        monkeypatch.setattr(bytenfa, "WIDE_SET", 1024)
        assert np.array_equal(wide, narrow)
        checked += len(targets) > 2
        state = narrow
    assert checked >= 5
    monkeypatch.setattr(bytenfa, "WIDE_SET", 2)
    vocab = _mixed_vocab(rng)
    auto = Regex(pattern).bind(vocab, [0], len(vocab), {})
    assert check_masks_by_walking(auto, vocab, len(vocab), rng, 10, 15) >= 60
