"""Regex means Python's ``re.fullmatch``, as a token automaton over a lazy byte DFA.

* Every string of up to 3 characters over an alphabet with ``\\n``, ``é``, ``ß``, ``٣``, ``_``,
  ``-`` and digits is accepted by the byte DFA exactly when ``re.fullmatch`` accepts it, for a
  few dozen patterns; texts made of single-byte tokens are generated exactly when it accepts
  them (tests/test_regex_diff.py runs thousands of generated patterns).
* The token automaton's masks equal a token-by-token walk of the DFA on thousands of random
  contexts over a vocabulary with multi-byte tokens, tokens that end inside a character and
  tokens that cross several parts of the pattern, and never lead to a dead end.
* Refused constructs name themselves and the way out; the caches' bounds change nothing.
"""

from __future__ import annotations

import functools
import itertools
import random
import re

import numpy as np
import pytest

from genlm_vlm.smc import ConstraintError, Regex
from genlm_vlm.smc.automaton import TokenMasks
from genlm_vlm.smc.bytenfa import utf8_sequences
from genlm_vlm.smc.constraints import unpack_bits
from genlm_vlm.smc.lazydfa import LazyDFA

ALPHABET = ["a", "b", "Z", "0", "7", "_", "-", ".", " ", "\n", "é", "ß", "٣", "K", "\u212a", "😀"]

PATTERNS = [
    r".", r"a.b", r"\w+", r"\d", r"[\w.-]+", r"\W", r"\D", r"\s*", r"\S\S?", r"(?s).+", r"a|b|", r"[^a-z]*",
    r"(ab)*", r"x{0}", r"[a-z]{2,3}", r"(?i)k", r"(?i)[a-z]+", r"(?i:ss)|ß", r"(?a)\w+", r"(?a)[\d\s]+",
    r"^a$", r"\Aa?\Z", r"(?m)^a$", r"^a|b$", r"a*?b+?", r"(?:é|ß)\d?", r"[\d\s]", r"[^\W\d]", r".*", r"😀?",
    r"[^\n]", r"(?x) a  b  # comment", r"[٠-٩]+", r"\d{2}", r"(?:Answer: )?.*", r"[\w.-]+@[\w-]+",
]


def _strings(n: int) -> list[str]:
    return [""] + ["".join(t) for k in range(1, n + 1) for t in itertools.product(ALPHABET, repeat=k)]


STRINGS3 = _strings(3)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_byte_dfa_is_re_fullmatch(pattern: str) -> None:
    dfa = Regex(pattern).dfa()
    wrong = [s for s in STRINGS3 if dfa.matches(s.encode()) != (re.fullmatch(pattern, s) is not None)]
    assert not wrong, f"{pattern!r} disagrees with re.fullmatch on {wrong[:5]}"


def _byte_vocab() -> list[bytes]:
    """EOS (id 0, no bytes), then every single byte: texts are walked byte by byte."""
    return [b""] + [bytes([b]) for b in range(256)]


def _accepts(bound, data: bytes) -> bool:
    width = bound.width
    state = bound.initial()
    for byte in data:
        if not unpack_bits(bound.bitmasks([state]), width)[0][1 + byte]:
            return False
        state = bound.advance(state, 1 + byte)
    return bool(unpack_bits(bound.bitmasks([state]), width)[0][0])


@pytest.mark.parametrize("pattern", PATTERNS[::3])
def test_single_byte_tokens_generate_exactly_the_matches(pattern: str) -> None:
    """Through masks and advances, over a vocabulary of single bytes: a text can be generated
    (then EOS) exactly when ``re.fullmatch`` accepts it."""
    vocab = _byte_vocab()
    auto = Regex(pattern).bind(vocab, [0], len(vocab), {})
    assert type(auto).__name__ == "BoundAutomaton"
    for s in _strings(2):
        assert _accepts(auto, s.encode()) == (re.fullmatch(pattern, s) is not None), (pattern, s)


def _mixed_vocab(rng: random.Random) -> list[bytes]:
    """EOS, single bytes, whole characters, pieces that end or start inside a character, and
    merges that cross from one kind of character to another."""
    words = ["é", "ß", "٣", "😀", "ab", "a.b", "-_", "12", "\n", "Answer: ", "x@y", " é", "ab\n", "K\u212a"]
    vocab: set[bytes] = {bytes([b]) for b in range(256)}
    for w in words:
        e = w.encode()
        vocab.add(e)
        for cut in range(1, len(e)):
            vocab.add(e[:cut])
            vocab.add(e[cut:])
    for _ in range(200):
        a, b = rng.choice(words).encode(), rng.choice(words).encode()
        joined = a + b
        i = rng.randrange(len(joined))
        vocab.add(joined[i: i + rng.randrange(1, 6)])
    vocab.discard(b"")
    return [b""] + sorted(vocab)


def check_masks_by_walking(bound, vocab: list[bytes], width: int, rng: random.Random, walks: int,
                           steps: int) -> int:
    """Random walks through ``bound``'s masks: each mask equals walking every token's bytes one by
    one in a separate DFA of the same pattern (a tiny cache: states dropped and made again), EOS
    where that DFA accepts; no mask is empty before EOS (a dead end would mean a token was
    allowed that no accepted text continues). Returns the contexts checked."""
    ref = LazyDFA(bound.dfa.nfa, "reference", 1 << 16)
    contexts = 0
    for _ in range(walks):
        state = bound.initial()
        for _step in range(steps):
            mask = unpack_bits(bound.bitmasks([state]), width)[0]
            ref.trim()
            want = np.zeros(width, dtype=bool)
            want[0] = ref.accepts(state)
            want[1:len(vocab)] = [bool(ref.step(state, t)) for t in vocab[1:]]
            contexts += 1
            assert np.array_equal(mask, want), np.flatnonzero(mask != want)[:10]
            assert mask.any(), "a dead end: a token led to a state no accepted text goes through"
            choices = np.flatnonzero(mask[1:]) + 1
            if not len(choices):
                break
            t = int(rng.choice(list(choices)))
            state = bound.advance(state, t)
    return contexts


@pytest.mark.parametrize("pattern", [r"[\w.-]+@[\w-]+\.(?:com|org)", r"(?:Answer: )?[٠-٩\d]+", r"(?s).{0,6}",
                                     r"(?:é|ß|ab)*\n?", r"[^\W\d_]+( [a-z]+)*"])
def test_token_automaton_masks_are_the_dfa_walked_token_by_token(pattern: str) -> None:
    rng = random.Random(pattern)
    vocab = _mixed_vocab(rng)
    width = len(vocab) + 40  # padding columns past the vocabulary: never allowed
    auto = Regex(pattern).bind(vocab, [0], width, {})
    assert check_masks_by_walking(auto, vocab, width, rng, 60, 8) >= 200


def test_states_of_few_positions_share_their_positions_rows() -> None:
    """``(a|b)*a(a|b){15}``'s DFA has 65,536 states over a few dozen NFA positions: a state of few
    positions gets its mask row as the union of its positions' own rows, so walks through
    hundreds of states walk the vocabulary about once per position, and every mask still equals
    the DFA walked token by token (EOS where it accepts)."""
    rng = random.Random(7)
    words = {"".join(rng.choice("ab") for _ in range(rng.randrange(2, 7))) for _ in range(80)}
    vocab = [b""] + sorted({w.encode() for w in words} | {b"a", b"b", b"c", b"ab\n", b"bc"})
    auto = Regex(r"(a|b)*a(a|b){15}").bind(vocab, [0], len(vocab), {})
    assert check_masks_by_walking(auto, vocab, len(vocab), rng, 30, 12) >= 300
    masks = auto.masks_table
    assert masks.filled >= 200 and masks.walked <= 40, (masks.filled, masks.walked)


def test_refusals_name_the_construct_and_the_way_out() -> None:
    cases = {
        r"a\b": "word boundary", r"(a)\1": "back-reference", r"(?=a)a": "look-ahead", r"(?!a)b": "look-around",
        r"a^": "'^' away from the start", r"$a": "'$' away from the end", r"a*+": "possessive",
        r"(?>a)": "atomic", r"(a)?(?(1)b|c)": "conditional", r"(a": "does not compile: missing )",
    }
    for pattern, what in cases.items():
        with pytest.raises(ConstraintError, match=re.escape(what)):
            Regex(pattern)
    with pytest.raises(ConstraintError, match="fullmatch"):
        Regex(r"\bword")
    with pytest.raises(TypeError, match="pattern string"):
        Regex(b"abc")  # type: ignore[arg-type]


def test_empty_language_and_anchor_positions() -> None:
    vocab = _byte_vocab()
    with pytest.raises(ConstraintError, match="empty language"):
        Regex(r"[^\s\S]").bind(vocab, [0], len(vocab), {})
    for ok in (r"^(?:^a|b$)$", r"(?:^)?a", r"a(?:$)?"):
        Regex(ok)  # anchors where they always hold


def test_utf8_sequences_cover_each_code_point_once() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        lo = rng.randrange(0, 0x110000)
        hi = min(0x10FFFF, lo + rng.randrange(0, 80000))
        if lo <= 0xDFFF and hi >= 0xD800:
            continue
        seqs = list(utf8_sequences(lo, hi))
        for c in rng.sample(range(lo, hi + 1), min(4, hi - lo + 1)) + [lo, hi]:
            e = chr(c).encode()
            hits = sum(len(s) == len(e) and all(a <= b <= z for b, (a, z) in zip(e, s, strict=True)) for s in seqs)
            assert hits == 1, (lo, hi, c)


def test_mask_table_cap_changes_nothing() -> None:
    vocab = _mixed_vocab(random.Random(1))
    pattern = r"[a-z]{0,12}"
    small = Regex(pattern).bind(vocab, [0], len(vocab), {})
    table = small.masks_table
    small.masks_table = TokenMasks(table.dfa, table.walk, max_rows=2)  # rows evicted and found again
    big = Regex(pattern).bind(vocab, [0], len(vocab), {})
    rng = random.Random(2)
    states_s, states_b = [small.initial()] * 4, [big.initial()] * 4
    for _ in range(10):
        bs, bb = small.bitmasks(states_s[:2]), big.bitmasks(states_b[:2])
        assert bool((bs == bb).all())
        ok = np.flatnonzero(unpack_bits(bb, len(vocab))[0][1:]) + 1
        if not len(ok):
            break
        t = int(rng.choice(list(ok)))
        states_s = [small.advance(states_s[0], t)] + states_s[:3]
        states_b = [big.advance(states_b[0], t)] + states_b[:3]
    assert small.masks_table.evicted > 0

    with pytest.raises(ValueError, match="not allowed here"):
        big.advance(big.initial(), vocab.index(b"\n"))
    ended = big.advance(big.initial(), 0)  # EOS where the text may end: nothing may follow
    assert not bool(big.bitmasks([ended]).any())
    with pytest.raises(ValueError, match="not allowed here"):
        big.advance(ended, vocab.index(b"a"))
    one = Regex("a").bind(vocab, [0], len(vocab), {})
    with pytest.raises(ValueError, match="not allowed here"):
        one.advance(one.initial(), 0)  # EOS where the text may not end yet


def test_bitmasks_on_a_device_and_counts() -> None:
    """The table's copy on another device gives the same bits (``meta`` stands in for a GPU
    where only shapes can be checked; the CPU copy path is the same code), and the counts the
    automaton reports are the bitmasks' popcounts (the controller skips counting)."""
    import torch

    from genlm_vlm.smc.step import popcounts

    vocab = _mixed_vocab(random.Random(4))
    bound = Regex(r"(?:é|ab|\d)+").bind(vocab, [0], len(vocab), {})
    s0 = bound.initial()
    s1 = bound.advance(s0, vocab.index("é".encode()))
    host = bound.bitmasks_upto([s0, s1, s1], len(vocab))
    assert np.array_equal(bound.last_counts, popcounts(host))
    on_meta = bound.bitmasks_on([s0, s1, s1], len(vocab), "meta")
    assert on_meta.device.type == "meta" and on_meta.shape == host.shape
    s2 = bound.advance(s1, vocab.index(b"1"))  # a new row after the copy was made: brought over
    table = bound.masks_table
    fresh = table._table_on(torch.device("meta"))
    assert fresh.shape == table.table.shape and not table._stale[torch.device("meta")]
    assert bool((bound.bitmasks_on([s2], len(vocab), "cpu") == bound.bitmasks_upto([s2], len(vocab))).all())


def test_dfa_cache_bound_changes_nothing() -> None:
    """A DFA whose cache holds a handful of states (dropped and made again all the time) answers
    as one that keeps everything; its memory stays bounded."""
    rng = random.Random(7)
    pattern = r"(a|b)*a(a|b){12}"
    small = Regex(pattern).dfa()
    small.max_bytes = 1 << 16
    big = Regex(pattern).dfa()
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 40))).encode()
        small.trim()
        assert small.matches(text) == big.matches(text) == (re.fullmatch(pattern, text.decode()) is not None)
    assert small.evicted > 0 and small.bytes <= (1 << 16) + 64 * 1024
    assert big.evicted == 0


ISSUE_48 = [r"\w{30}", r"(?:\w{1,20}\s){1,40}", r".{1000}", r"[a-z]{20000}", r"(?:a|b?){2000}",
            r"(?:[a-z]{0,100}){0,100}", r"(a|b)*a(a|b){15}"]


#: Python's re backtracks exponentially on nested optional repeats: the same languages, written flat.
FLAT = {r"(?:a|b?){2000}": r"[ab]{0,2000}", r"(?:[a-z]{0,100}){0,100}": r"[a-z]{0,10000}"}


@functools.lru_cache(maxsize=1)
def _demo_vocab() -> tuple[list[bytes], int]:
    from transformers import AutoTokenizer

    import genlm_vlm
    from genlm_vlm.vocab import get_byte_vocab

    tok = AutoTokenizer.from_pretrained(genlm_vlm.demo_model_path())
    special = set(tok.all_special_ids)
    return [b"" if i in special else b for i, b in enumerate(get_byte_vocab(tok))], tok.eos_token_id


@pytest.mark.parametrize("pattern", ISSUE_48)
def test_large_patterns_bind_on_the_token_automaton_making_few_states(pattern: str) -> None:
    """Issue 48's patterns (eager DFAs of thousands of states, or none at all) bind as token
    automata on the demo model's vocabulary, making only the states the first mask walks through
    (at most a few per token byte position), and keep to ``re.fullmatch`` on sample texts."""
    vocab, eos = _demo_vocab()
    bound = Regex(pattern).bind(vocab, [eos], len(vocab), {})
    assert type(bound).__name__ == "BoundAutomaton"
    dfa = bound.dfa
    longest = max(map(len, vocab))
    assert dfa.rows_made <= 2 * longest + 2 and dfa.states_made <= 400, (dfa.rows_made, dfa.states_made)
    rng = random.Random(pattern)
    for text in ["", "ab", "é" * 30, "word " * 3, "a" * 16, "😀" * 5]:
        text = text + "".join(rng.choice("ab é") for _ in range(rng.randrange(3)))
        want = re.fullmatch(FLAT.get(pattern, pattern), text) is not None
        assert dfa.matches(text.encode()) == want, (pattern, text)


def test_pathological_patterns_are_refused_within_bounded_memory() -> None:
    """Past the limits a pattern is refused with a ConstraintError naming it, the limit and a way
    out, before it takes much memory: a code point automaton past MAX_NFA_STATES when the
    ``Regex`` is built; a deterministic state past MAX_SET positions when it is bound."""
    import tracemalloc

    vocab = _byte_vocab()
    tracemalloc.start()
    try:
        with pytest.raises(ConstraintError, match=r"Regex\('\(\?:a\|b\?\)\{90000\}'\).*200,000 states.*smaller repeat"):
            Regex(r"(?:a|b?){90000}")
        with pytest.raises(ConstraintError, match=r"Regex\('\(\?:a\?b\?\)\{15000\}'\).*50,000 positions.*fewer nested"):
            Regex(r"(?:a?b?){15000}").bind(vocab, [0], len(vocab), {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 300 << 20, peak
