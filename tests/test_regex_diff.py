"""A differential test of ``Regex`` against ``re.fullmatch`` over generated patterns (seeded).

Patterns are drawn from a small grammar: literals (ASCII, two- and four-byte characters),
classes (``.``, ``\\d``, ``\\w``, ``\\s``, ranges, negations, ``(?a)``, ``(?i)``), concatenation,
alternation (some branches dead: they end in an empty class), and repeats (``?``, ``*``, ``+``, ``{m}``, ``{m,n}``, lazy forms), nested; plus the
families of issue 48 (bounded repeats of classes, nested optional repeats, ``.`` over multi-byte
characters, alternations of repeats). Each pattern comes with a sampler of texts it matches.

* Byte level: the lazy DFA accepts a text's UTF-8 bytes exactly when ``re.fullmatch`` accepts
  the text, for matching samples, their one-character edits and random texts; every byte prefix
  of a matching text leads to a live state.
* Token level: over a vocabulary with multi-byte tokens, pieces of characters and tokens that
  cross characters, the bound automaton's masks equal walking each token's bytes in a separately
  cached DFA, and following them never reaches a dead end (tests/test_regex.py's check).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import pytest
from test_regex import _mixed_vocab, check_masks_by_walking

from genlm_vlm.smc import Regex

Sampler = Callable[[random.Random], str]
ALPHABET = ["a", "b", "c", "z", "0", "9", "_", " ", "\n", "é", "ß", "٣", "😀", "K", "\u212a", "\u2003", "-"]

#: (pattern, texts it matches) for the atoms of the grammar.
ATOMS: list[tuple[str, list[str]]] = [
    ("a", ["a"]), ("b", ["b"]), ("é", ["é"]), ("😀", ["😀"]), (".", ["a", "é", "😀", "٣", " "]),
    ("[a-c]", ["a", "b", "c"]), ("[^a]", ["b", "é", "😀", "\n"]), (r"\d", ["0", "9", "٣"]),
    (r"\w", ["a", "_", "é", "ß", "٣"]), (r"\s", [" ", "\n", "\u2003"]), ("[é٣]", ["é", "٣"]),
    (r"(?a:\w)", ["a", "_", "0"]), ("(?i:k)", ["k", "K", "\u212a"]), (r"[\d\s]", ["0", " ", "٣"]),
    ("(?s:.)", ["\n", "a", "😀"]), ("[^\\W\\d]", ["a", "é", "_"]), ("ß", ["ß"]), ("-", ["-"]),
]
REPEATS: list[tuple[str, int, int]] = [
    ("?", 0, 1), ("*", 0, 3), ("+", 1, 3), ("{2}", 2, 2), ("{0,3}", 0, 3), ("{1,2}", 1, 2), ("??", 0, 1),
    ("*?", 0, 2), ("{2,}", 2, 4), ("{3}", 3, 3),
]


def gen(rng: random.Random, depth: int) -> tuple[str, Sampler]:
    """A random pattern and a sampler of texts it matches."""
    k = rng.random()
    if depth == 0 or k < 0.3:
        pat, texts = rng.choice(ATOMS)
        return pat, lambda r, texts=texts: r.choice(texts)
    if k < 0.55:
        (p1, s1), (p2, s2) = gen(rng, depth - 1), gen(rng, depth - 1)
        return p1 + p2, lambda r: s1(r) + s2(r)
    if k < 0.7:
        (p1, s1), (p2, s2) = gen(rng, depth - 1), gen(rng, depth - 1)
        if rng.random() < 0.2:  # a branch that reads on, then can never match (an empty class)
            return f"(?:{p1}|{p2}[^\\s\\S])", s1
        return f"(?:{p1}|{p2})", lambda r: (s1 if r.random() < 0.5 else s2)(r)
    p, s = gen(rng, depth - 1)
    rep, lo, hi = rng.choice(REPEATS)
    return f"(?:{p}){rep}", lambda r: "".join(s(r) for _ in range(r.randint(lo, hi)))


def family(rng: random.Random) -> tuple[str, Sampler]:
    """Patterns of issue 48's kinds, with small counts."""
    n, m = rng.randint(1, 6), rng.randint(0, 4)
    k = rng.randrange(6)
    if k == 0:  # a bounded repeat of a class
        cls, texts = rng.choice([(r"\w", ["a", "é", "٣"]), (".", ["a", "😀", "é"]), ("[a-z]", ["q"]),
                                 (r"\d", ["1", "٣"])])
        return f"{cls}{{{m},{m + n}}}", lambda r: "".join(r.choice(texts) for _ in range(r.randint(m, m + n)))
    if k == 1:  # nested optional repeats
        return f"(?:a|b?){{{n}}}", lambda r: "".join(r.choice(["a", "b", ""]) for _ in range(n))
    if k == 2:
        return (f"(?:[a-c]{{0,{n}}}){{0,{m + 1}}}",
                lambda r: "".join(r.choice("abc") for _ in range(r.randint(0, n * (m + 1)))))
    if k == 3:  # words and spaces
        return (rf"(?:\w{{1,{n}}}\s){{1,{m + 1}}}",
                lambda r: "".join("é" * r.randint(1, n) + " " for _ in range(r.randint(1, m + 1))))
    if k == 4:  # the n-th last symbol
        return f"(a|b)*a(a|b){{{n}}}", lambda r: "ba" + "".join(r.choice("ab") for _ in range(n))
    return (f"(?:é{{{n}}}|😀+|[^a]{{{m}}})",
            lambda r: r.choice(["é" * n, "😀" * r.randint(1, 3), "b" * m]))


def _edits(rng: random.Random, text: str) -> list[str]:
    out = []
    for _ in range(3):
        i = rng.randrange(len(text) + 1)
        c = rng.choice(ALPHABET)
        out.append(text[:i] + c + text[i:])
        if text:
            j = rng.randrange(len(text))
            out.append(text[:j] + text[j + 1:])
            out.append(text[:j] + c + text[j + 1:])
    return out


def _patterns(seed: int, count: int) -> list[tuple[str, Sampler]]:
    rng = random.Random(seed)
    return [family(rng) if rng.random() < 0.3 else gen(rng, rng.randint(1, 4)) for _ in range(count)]


@pytest.mark.parametrize("seed", range(4))
def test_byte_level_is_re_fullmatch(seed: int) -> None:
    rng = random.Random(1000 + seed)
    checked = patterns = 0
    for pattern, sample in _patterns(seed, 500):
        dfa = Regex(pattern).dfa()
        patterns += 1
        positives = [sample(rng) for _ in range(4)]
        texts = positives + [t for p in positives[:2] for t in _edits(rng, p)]
        texts += ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(6))) for _ in range(6)]
        # re backtracks: nested repeats take it exponential time in a text's length (62 s on a
        # 15-character text for one pattern here; the DFA takes microseconds)
        texts = [t for t in texts if len(t) <= 9]
        for text in texts:
            want = re.fullmatch(pattern, text) is not None
            assert dfa.matches(text.encode()) == want, (pattern, text)
            checked += 1
        for text in positives:
            data = text.encode()
            assert dfa.matches(data), (pattern, text)  # a sample (the short ones were checked against re)
            state = dfa.start
            for i in range(len(data)):  # every prefix of a match is alive
                state = dfa.step(state, data[i:i + 1])
                assert state, (pattern, text, i)
    assert patterns == 500 and checked > 8_000


@pytest.mark.parametrize("seed", range(2))
def test_token_level_masks(seed: int) -> None:
    rng = random.Random(2000 + seed)
    vocab = _mixed_vocab(rng)
    cache: dict = {}
    contexts = 0
    for pattern, _sample in _patterns(100 + seed, 120):
        bound = Regex(pattern).bind(vocab, [0], len(vocab) + 8, cache)
        contexts += check_masks_by_walking(bound, vocab, len(vocab) + 8, rng, 2, 5)
    assert contexts > 500
