"""Python regular expressions, as ``re.fullmatch`` reads them, compiled to byte-level automata.

:func:`compile_regex` parses a pattern with Python's own parser (``re._parser``) and builds a
nondeterministic automaton over code points (:class:`CharNFA`). Every character test (a literal,
a class such as ``[\\w.-]``, ``\\d``, ``.``) becomes the exact set of code points Python's ``re``
matches under the pattern's flags: simple sets are computed from their ranges, and sets that
depend on Unicode tables or case folding (``\\w``, ``\\s``, ``\\d``, ``(?i)``) are read off
Python's ``re`` itself, run once over every code point (cached per set). So ``.`` excludes
``"\\n"`` unless ``(?s)``, ``\\w`` accepts ``é``, ``ß`` and ``٣``, and ``(?i)`` folds as Python
folds.

:meth:`CharNFA.byte_dfa` turns it into a minimal deterministic automaton over the bytes of the
text's UTF-8 encoding (:class:`ByteDFA`, a ``[states, 256]`` table): a byte string is accepted
exactly when it is the UTF-8 encoding of a string ``s`` with ``re.fullmatch(pattern, s)``.
Surrogate code points have no UTF-8 encoding and never match.

Constructs whose meaning depends on more than the text matched so far are refused with
:class:`~.constraints.ConstraintError` saying what to write instead: back-references,
look-arounds, conditionals, possessive quantifiers and atomic groups, ``\\b``/``\\B``, and
anchors (``^``, ``$``, ``\\A``, ``\\Z``) anywhere but where they are always true under
``re.fullmatch`` (at the start, or at the end, of the whole pattern or of a top-level
alternative).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

try:  # Python 3.11+: the parser ``re`` itself uses
    from re import _constants as _C
    from re import _parser as _sre
except ImportError:  # pragma: no cover - 3.10 and older (not supported, kept for a clear error)
    import sre_constants as _C  # type: ignore[no-redef]
    import sre_parse as _sre  # type: ignore[no-redef]

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent code point ranges, inclusive

_MAX = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
_I, _S, _M, _A = re.IGNORECASE, re.DOTALL, re.MULTILINE, re.ASCII

#: Default cap on the states of a pattern's deterministic automaton (before minimisation).
MAX_DFA_STATES = 10_000
#: Cap on the code-point automaton's states (``a{100000}`` is refused, not built).
MAX_NFA_STATES = 200_000


class RegexError(ValueError):
    """A pattern that cannot be compiled: a syntax error, or a construct that is refused."""


class TooManyStates(RegexError):
    """The deterministic automaton would have more states than the cap."""


# ------------------------------------------------------------------------------ code point sets
def normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sorted, merged ranges with the surrogates (no UTF-8 encoding) removed."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if lo > hi:
            continue
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    cut: list[tuple[int, int]] = []
    s0, s1 = _SURROGATES
    for lo, hi in out:
        if hi < s0 or lo > s1:
            cut.append((lo, hi))
            continue
        if lo < s0:
            cut.append((lo, s0 - 1))
        if hi > s1:
            cut.append((s1 + 1, hi))
    return tuple(cut)


def complement(ranges: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX:
        out.append((nxt, _MAX))
    return normalize(out)


_ALL = normalize([(0, _MAX)])
_text_lock = threading.Lock()
_all_text: str | None = None
_scanned: dict[tuple[str, int], Ranges] = {}


def _every_code_point() -> str:
    global _all_text
    with _text_lock:
        if _all_text is None:
            _all_text = "".join(map(chr, range(_SURROGATES[0]))) + "".join(map(chr, range(_SURROGATES[1] + 1, _MAX + 1)))
        return _all_text


def scan(char_class: str, flags: int) -> Ranges:
    """The code points Python's ``re`` matches with the one-character pattern ``char_class``
    under ``flags`` (read off ``re`` run over every code point; cached)."""
    key = (char_class, flags)
    hit = _scanned.get(key)
    if hit is None:
        text = _every_code_point()
        runs = [(ord(text[m.start()]), ord(text[m.end() - 1]))
                for m in re.finditer(f"(?:{char_class})+", text, flags)]
        hit = _scanned[key] = normalize(runs)  # a run across the surrogate gap is cut there
    return hit


def _esc(c: int) -> str:
    return f"\\U{c:08x}"


_CATEGORY_TEXT = {
    _C.CATEGORY_DIGIT: r"\d", _C.CATEGORY_NOT_DIGIT: r"\D", _C.CATEGORY_SPACE: r"\s",
    _C.CATEGORY_NOT_SPACE: r"\S", _C.CATEGORY_WORD: r"\w", _C.CATEGORY_NOT_WORD: r"\W",
}


def _class_set(items: Sequence[tuple[Any, Any]], flags: int) -> Ranges:
    """The code points of a parsed character class ``[...]`` under ``flags``."""
    negate = bool(items) and items[0][0] is _C.NEGATE
    body = items[1:] if negate else items
    parts: list[str] = []
    direct: list[tuple[int, int]] = []
    for op, av in body:
        if op is _C.LITERAL:
            parts.append(_esc(av))
            direct.append((av, av))
        elif op is _C.RANGE:
            parts.append(f"{_esc(av[0])}-{_esc(av[1])}")
            direct.append(av)
        elif op is _C.CATEGORY:
            if av not in _CATEGORY_TEXT:
                raise RegexError(f"unsupported character category {av}")
            parts.append(_CATEGORY_TEXT[av])
        else:
            raise RegexError(f"unsupported item {op} in a character class")
    if flags & _I or len(direct) != len(body):  # Unicode tables or case folding: ask re itself
        return scan("[" + ("^" if negate else "") + "".join(parts) + "]", flags & (_I | _A))
    got = normalize(direct)
    return complement(got) if negate else got


def _literal_set(c: int, flags: int, negate: bool) -> Ranges:
    if flags & _I:
        return scan(("[^" if negate else "[") + _esc(c) + "]", flags & (_I | _A))
    got = normalize([(c, c)])
    return complement(got) if negate else got


# ------------------------------------------------------------------------------ the code point NFA
def epsilon_closure(eps: Sequence[Sequence[int]], states: Iterable[int]) -> frozenset[int]:
    """``states`` and every state reached from them by epsilon moves (``eps[s]``: the states
    ``s`` moves to without input)."""
    seen = set(states)
    todo = list(seen)
    while todo:
        for t in eps[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return frozenset(seen)


@dataclass
class CharNFA:
    """A nondeterministic automaton over code points: ``eps[s]`` the states ``s`` moves to
    without input, ``arcs[s]`` its ``(code point ranges, next state)`` pairs; ``start`` and
    ``final`` (one each)."""

    eps: list[list[int]]
    arcs: list[list[tuple[Ranges, int]]]
    start: int
    final: int

    def closure(self, states: Iterable[int]) -> frozenset[int]:
        """``states`` and every state their epsilon moves reach."""
        return epsilon_closure(self.eps, states)

    def byte_dfa(self, max_states: int = MAX_DFA_STATES) -> ByteDFA:
        """The minimal DFA over the UTF-8 bytes of the accepted strings (raises
        :class:`TooManyStates` past ``max_states`` subset states)."""
        return ByteNFA.from_chars(self).dfa(max_states)

    def ebnf(self) -> str:
        """The same language as a right-linear EBNF grammar (xgrammar's syntax, root ``root``):
        one rule per state that can still reach the end, epsilon moves folded in."""
        closures = [self.closure([s]) for s in range(len(self.eps))]
        good = {s for s, c in enumerate(closures) if self.final in c}
        changed = True
        while changed:  # states from which the final state can be reached
            changed = False
            for s, c in enumerate(closures):
                if s not in good and any(t in good for q in c for _, t in self.arcs[q]):
                    good.add(s)
                    changed = True
        if self.start not in good:
            raise RegexError("the pattern matches no text (empty language)")
        names = {self.start: "root"}
        order = [self.start]
        lines = []
        k = 0
        while k < len(order):
            s = order[k]
            k += 1
            alts = []
            for q in sorted(closures[s]):
                for ranges, t in self.arcs[q]:
                    if t not in good:
                        continue
                    if t not in names:
                        names[t] = f"s{t}"
                        order.append(t)
                    alts.append(f"{_range_class(ranges)} {names[t]}")
            if self.final in closures[s]:
                alts.append('""')
            lines.append(f"{names[s]} ::= " + " | ".join(alts))
        return "\n".join(lines)


def _range_class(ranges: Ranges) -> str:
    def cp(c: int) -> str:
        return f"\\u{c:04X}" if c <= 0xFFFF else f"\\U{c:08X}"

    return "[" + "".join(cp(lo) if lo == hi else f"{cp(lo)}-{cp(hi)}" for lo, hi in ranges) + "]"


class _Builder:
    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.eps: list[list[int]] = []
        self.arcs: list[list[tuple[Ranges, int]]] = []

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise RegexError(f"the pattern's automaton passes {MAX_NFA_STATES:,} states (a repeat count too large?)")
        self.eps.append([])
        self.arcs.append([])
        return len(self.eps) - 1

    def refuse(self, what: str, instead: str) -> RegexError:
        return RegexError(f"{what} is not supported (the text is matched whole, as re.fullmatch): {instead}")

    # Each build returns (entry, exit) of a fragment.
    def seq(self, items: Sequence[Any], flags: int, at_start: bool, at_end: bool) -> tuple[int, int]:
        entry = cur = self.state()
        empty = [_empty_only(it) for it in items]
        for i, item in enumerate(items):
            first = at_start and all(empty[:i])
            last = at_end and all(empty[i + 1:])
            a, b = self.item(item, flags, first, last)
            self.eps[cur].append(a)
            cur = b
        return entry, cur

    def item(self, item: tuple[Any, Any], flags: int, at_start: bool, at_end: bool) -> tuple[int, int]:
        op, av = item
        if op in (_C.LITERAL, _C.NOT_LITERAL, _C.ANY, _C.IN):
            if op is _C.ANY:
                chars = _ALL if flags & _S else complement(normalize([(10, 10)]))
            elif op is _C.IN:
                chars = _class_set(av, flags)
            else:
                chars = _literal_set(av, flags, negate=op is _C.NOT_LITERAL)
            a, b = self.state(), self.state()
            if chars:
                self.arcs[a].append((chars, b))
            return a, b
        if op is _C.SUBPATTERN:
            _group, add, remove, sub = av
            return self.seq(list(sub), (flags | add) & ~remove, at_start, at_end)
        if op is _C.BRANCH:
            a, b = self.state(), self.state()
            for alt in av[1]:
                x, y = self.seq(list(alt), flags, at_start, at_end)
                self.eps[a].append(x)
                self.eps[y].append(b)
            return a, b
        if op in (_C.MAX_REPEAT, _C.MIN_REPEAT):  # lazy or greedy: the same language under fullmatch
            lo, hi, sub = av
            once = hi is not _C.MAXREPEAT and hi <= 1
            a = cur = self.state()
            for _ in range(lo):
                x, y = self.seq(list(sub), flags, at_start and once, at_end and once)
                self.eps[cur].append(x)
                cur = y
            if hi is _C.MAXREPEAT:
                x, y = self.seq(list(sub), flags, False, False)
                loop = self.state()
                self.eps[cur].append(loop)
                self.eps[loop].append(x)
                self.eps[y].append(loop)
                cur = loop
            else:
                end = self.state()
                for _ in range(hi - lo):
                    x, y = self.seq(list(sub), flags, at_start and once, at_end and once)
                    self.eps[cur].append(x)
                    self.eps[cur].append(end)
                    cur = y
                self.eps[cur].append(end)
                cur = end
            return a, cur
        if op is _C.AT:
            if av in (_C.AT_BEGINNING, _C.AT_BEGINNING_STRING):
                if not at_start:
                    name = "'^'" if av is _C.AT_BEGINNING else "'\\A'"
                    raise self.refuse(f"{name} away from the start of the pattern",
                                      "the text is always matched from its start; drop the anchor or move it first")
            elif av in (_C.AT_END, _C.AT_END_STRING):
                if not at_end:
                    name = "'$'" if av is _C.AT_END else "'\\Z'"
                    raise self.refuse(f"{name} away from the end of the pattern",
                                      "the text is always matched to its end; drop the anchor or move it last")
            else:
                raise self.refuse("a word boundary (\\b or \\B)",
                                  "spell out the characters on each side, e.g. [^\\w] or the end of the pattern")
            s = self.state()
            return s, s
        what = {
            _C.GROUPREF: ("a back-reference", "repeat the group's pattern instead (the language must be regular)"),
            _C.GROUPREF_EXISTS: ("a conditional group (?(id)...)", "write the alternatives with |"),
            _C.ASSERT: ("a look-ahead or look-behind", "fold the condition into the pattern itself"),
            _C.ASSERT_NOT: ("a negative look-around", "fold the condition into the pattern, e.g. with a [^...] class"),
        }
        if op in what:
            raise self.refuse(*what[op])
        name = str(op).lower()
        if "possessive" in name or "atomic" in name:
            raise self.refuse("a possessive quantifier or atomic group", "use the ordinary quantifier (*, +, ?, {m,n})")
        raise self.refuse(f"the construct {op}", "rewrite it with classes, groups, | and quantifiers")


def _empty_only(item: tuple[Any, Any]) -> bool:
    """Whether ``item`` can only match the empty string (an anchor, or groups of them)."""
    op, av = item
    if op is _C.AT:
        return True
    if op is _C.SUBPATTERN:
        return all(_empty_only(x) for x in av[3])
    if op is _C.BRANCH:
        return all(all(_empty_only(x) for x in alt) for alt in av[1])
    return False


_compiled: dict[str, CharNFA] = {}
_compiled_lock = threading.Lock()


def compile_regex(pattern: str) -> CharNFA:
    """``pattern`` (Python syntax, matched as ``re.fullmatch``) as a :class:`CharNFA`; raises
    :class:`RegexError` with Python's own message for a syntax error, or naming a refused
    construct. Cached per pattern."""
    with _compiled_lock:
        hit = _compiled.get(pattern)
    if hit is not None:
        return hit
    try:
        parsed = _sre.parse(pattern, 0)
    except re.error as e:
        raise RegexError(f"does not compile: {e} (Python's re syntax)") from None
    flags = parsed.state.flags
    b = _Builder(pattern)
    start, end = b.seq(list(parsed), flags, True, True)
    nfa = CharNFA(b.eps, b.arcs, start, end)
    with _compiled_lock:
        _compiled[pattern] = nfa
        while len(_compiled) > 256:
            _compiled.pop(next(iter(_compiled)))
    return nfa


_dfas: dict[tuple[str, int], Any] = {}


def byte_dfa(pattern: str, max_states: int = MAX_DFA_STATES) -> ByteDFA | TooManyStates:
    """:meth:`CharNFA.byte_dfa` of :func:`compile_regex`, or the :class:`TooManyStates` it
    raised; cached per pattern and cap (the 64 patterns used last)."""
    key = (pattern, max_states)
    with _compiled_lock:
        hit = _dfas.pop(key, None)
        if hit is not None:
            _dfas[key] = hit
            return hit
    try:
        got: ByteDFA | TooManyStates = compile_regex(pattern).byte_dfa(max_states)
    except TooManyStates as e:
        got = e
    with _compiled_lock:
        _dfas[key] = got
        while len(_dfas) > 64:
            _dfas.pop(next(iter(_dfas)))
    return got


# ------------------------------------------------------------------------------ bytes
def utf8_sequences(lo: int, hi: int) -> Iterator[list[tuple[int, int]]]:
    """Byte-range sequences whose concatenations are exactly the UTF-8 encodings of the code
    points ``lo..hi`` (no surrogates inside): each sequence is one ``(low, high)`` per byte."""
    if lo > hi:
        return
    for limit in (0x7F, 0x7FF, 0xFFFF):
        if lo <= limit < hi:
            yield from utf8_sequences(lo, limit)
            yield from utf8_sequences(limit + 1, hi)
            return
    if hi <= 0x7F:
        yield [(lo, hi)]
        return
    n = len(chr(lo).encode())
    for i in range(1, n):
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                yield from utf8_sequences(lo, lo | m)
                yield from utf8_sequences((lo | m) + 1, hi)
                return
            if hi & m != m:
                yield from utf8_sequences(lo, (hi & ~m) - 1)
                yield from utf8_sequences(hi & ~m, hi)
                return
    yield list(zip(chr(lo).encode(), chr(hi).encode(), strict=True))


@dataclass
class ByteNFA:
    """A nondeterministic automaton over bytes: ``eps[s]``, ``arcs[s]`` as ``(low, high,
    next)`` byte ranges, one ``start``, a set of ``finals``."""

    eps: list[list[int]]
    arcs: list[list[tuple[int, int, int]]]
    start: int
    finals: frozenset[int]

    @classmethod
    def from_chars(cls, nfa: CharNFA) -> ByteNFA:
        """Each code point arc becomes a trie of UTF-8 byte ranges (sequences that share their
        leading byte ranges share states)."""
        eps = [list(e) for e in nfa.eps]
        arcs: list[list[tuple[int, int, int]]] = [[] for _ in nfa.arcs]
        for s, out in enumerate(nfa.arcs):
            for ranges, t in out:
                trie: dict[tuple[int, int, tuple[tuple[int, int], ...]], int] = {}
                for lo, hi in ranges:
                    for seq in utf8_sequences(lo, hi):
                        cur = s
                        for k, (a, b) in enumerate(seq):
                            if k == len(seq) - 1:
                                arcs[cur].append((a, b, t))
                                break
                            key = (cur, k, tuple(seq[: k + 1]))
                            nxt = trie.get(key)
                            if nxt is None:
                                nxt = trie[key] = len(eps)
                                eps.append([])
                                arcs.append([])
                                arcs[cur].append((a, b, nxt))
                            cur = nxt
        return cls(eps, arcs, nfa.start, frozenset([nfa.final]))

    def closure(self, states: Iterable[int]) -> frozenset[int]:
        """``states`` and every state their epsilon moves reach."""
        return epsilon_closure(self.eps, states)

    def dfa(self, max_states: int = MAX_DFA_STATES) -> ByteDFA:
        """Subset construction, then minimisation (state 0 is the dead state)."""
        dead: frozenset[int] = frozenset()
        first = self.closure([self.start])
        index = {dead: 0, first: 1}
        order = [dead, first]
        rows: list[np.ndarray] = []
        k = 0
        while k < len(order):
            group = order[k]
            k += 1
            row = np.zeros(256, dtype=np.int32)
            edges = [e for s in group for e in self.arcs[s]]
            if edges:
                cuts = sorted({e[0] for e in edges} | {e[1] + 1 for e in edges})
                for x, y in zip(cuts, cuts[1:], strict=False):
                    targets = [t for lo, hi, t in edges if lo <= x <= hi]
                    if not targets:
                        continue
                    nxt = self.closure(targets)
                    j = index.get(nxt)
                    if j is None:
                        if len(order) >= max_states:
                            raise TooManyStates(f"the automaton passes {max_states:,} states")
                        j = index[nxt] = len(order)
                        order.append(nxt)
                    row[x:y] = j
            rows.append(row)
        table = np.stack(rows)
        accept = np.array([bool(g & self.finals) for g in order])
        return ByteDFA(table, accept, 1).minimal()


@dataclass
class ByteDFA:
    """A deterministic automaton over bytes: ``table[s, b]`` the state after byte ``b`` in state
    ``s`` (int32 ``[S, 256]``), ``accept[s]`` whether a text may end in ``s``; state 0 is dead
    (no accepted text goes through it), ``start`` the state of the empty text."""

    table: np.ndarray
    accept: np.ndarray
    start: int

    @property
    def n_states(self) -> int:
        return int(self.table.shape[0])

    def walk(self, data: bytes, state: int | None = None) -> int:
        """The state after ``data`` (0: dead)."""
        s = self.start if state is None else state
        table = self.table
        for byte in data:
            s = int(table[s, byte])
            if s == 0:
                return 0
        return s

    def matches(self, data: bytes) -> bool:
        return bool(self.accept[self.walk(data)])

    def classes_within(self, k: int) -> np.ndarray:
        """int64 ``[S]``: states in one class agree, for every byte string ``w`` of at most ``k``
        bytes, on whether ``w`` leads to a live state (one from which a text can still be
        accepted) and whether it leads to an accepting one. So two states of one class allow the
        same tokens of up to ``k`` bytes, EOS included (Moore's refinement, ``k`` rounds, from
        the live / accepting partition). The dead state is class 0."""
        table, accept = self.table, self.accept
        _, first = np.unique(table, axis=1, return_index=True)
        compact = table[:, first]
        live = _coreachable(compact, accept)
        cls = np.where(live, np.where(accept, 2, 1), 0).astype(np.int64)
        count = len(np.unique(cls))
        for _ in range(k):
            new, n_new = _refine(cls, compact)
            if n_new == count:
                break
            cls, count = new, n_new
        return cls - cls[0]  # the dead state's class is the smallest: 0

    def minimal(self) -> ByteDFA:
        """The equivalent automaton with states that cannot reach acceptance merged into the
        dead state 0, unreachable states dropped, and (up to :data:`MINIMISE_UP_TO` states)
        equivalent states merged (Moore's refinement over the byte classes)."""
        table, accept = self.table, self.accept
        n = table.shape[0]
        _, first = np.unique(table, axis=1, return_index=True)
        compact = table[:, first]  # one column per byte class
        live = _coreachable(compact, accept)
        cls = np.where(live, np.where(accept, 2, 1), 0).astype(np.int64)
        if n <= MINIMISE_UP_TO:
            count = len(np.unique(cls))
            while True:
                new, n_new = _refine(cls, compact)
                if n_new == count:
                    break
                cls, count = new, n_new
        else:  # only dead states merged
            cls = np.where(live, np.arange(n) + 1, 0)
        # renumber: dead first (0), then classes in order of discovery from the start
        dead_cls = int(cls[0])
        number = {dead_cls: 0}
        reach = np.zeros(n, dtype=bool)
        todo = [self.start]
        reach[self.start] = True
        while todo:
            s = todo.pop()
            c = int(cls[s])
            if c not in number:
                number[c] = len(number)
            for t in np.unique(compact[s]):
                if not reach[t]:
                    reach[t] = True
                    todo.append(int(t))
        lut = np.zeros(int(cls.max()) + 1, dtype=np.int32)
        for c, k in number.items():
            lut[c] = k
        m = len(number)
        new_table = np.zeros((m, 256), dtype=np.int32)
        new_accept = np.zeros(m, dtype=bool)
        rows = np.flatnonzero(reach & live)
        new_table[lut[cls[rows]]] = lut[cls[table[rows]]]
        new_accept[lut[cls[rows]]] = accept[rows]
        new_table[0] = 0
        new_accept[0] = False
        return ByteDFA(new_table, new_accept, int(lut[cls[self.start]]))


#: Automata up to this many states are minimised; larger ones only have their dead states merged.
MINIMISE_UP_TO = 4096


def _refine(cls: np.ndarray, compact: np.ndarray) -> tuple[np.ndarray, int]:
    """One round of Moore's refinement: states stay together when their class and their
    successors' classes agree. Class ids follow the order of the keys (the dead state, class 0
    with dead successors, stays first)."""
    keys = np.concatenate([cls[:, None], cls[compact]], axis=1)
    order = np.lexsort(keys.T[::-1])
    sk = keys[order]
    new_group = np.ones(len(cls), dtype=bool)
    new_group[1:] = (sk[1:] != sk[:-1]).any(axis=1)
    ids = np.cumsum(new_group) - 1
    new = np.empty(len(cls), dtype=np.int64)
    new[order] = ids
    return new, int(ids[-1] + 1)


def _coreachable(table: np.ndarray, accept: np.ndarray) -> np.ndarray:
    """States from which an accepting state can be reached (``table``: ``[S, k]``, any columns),
    by a search backwards from the accepting states."""
    n, k = table.shape
    src = np.repeat(np.arange(n), k)
    dst = table.reshape(-1)
    order = np.argsort(dst, kind="stable")
    src, dst = src[order], dst[order]
    starts = np.searchsorted(dst, np.arange(n + 1))
    good = accept.copy()
    todo = list(np.flatnonzero(accept))
    while todo:
        t = todo.pop()
        for s in src[starts[t]:starts[t + 1]]:
            if not good[s]:
                good[s] = True
                todo.append(s)
    return good
