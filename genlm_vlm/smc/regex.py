"""Python regular expressions, as ``re.fullmatch`` reads them, compiled to automata.

:func:`compile_regex` parses a pattern with Python's own parser (``re._parser``) and builds a
nondeterministic automaton over code points (:class:`CharNFA`). Every character test (a literal,
a class such as ``[\\w.-]``, ``\\d``, ``.``) becomes the exact set of code points Python's ``re``
matches under the pattern's flags (:mod:`.charsets`). So ``.`` excludes ``"\\n"`` unless
``(?s)``, ``\\w`` accepts ``é``, ``ß`` and ``٣``, and ``(?i)`` folds as Python folds.

:class:`~.bytenfa.ByteNFA` reads it over the bytes of the text's UTF-8 encoding, and
:class:`~.lazydfa.LazyDFA` determinises that on demand: a byte string is accepted exactly when it
is the UTF-8 encoding of a string ``s`` with ``re.fullmatch(pattern, s)``. Surrogate code points
have no UTF-8 encoding and never match.

Constructs whose meaning depends on more than the text matched so far are refused with
:class:`RegexError` (a ``ConstraintError`` once ``Regex`` names the pattern) saying what to write
instead: back-references, look-arounds, conditionals, possessive quantifiers and atomic groups,
``\\b``/``\\B``, and anchors (``^``, ``$``, ``\\A``, ``\\Z``) anywhere but where they are always
true under ``re.fullmatch`` (at the start, or at the end, of the whole pattern or of a top-level
alternative).
"""

from __future__ import annotations

import contextlib
import gc
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .charsets import ALL, CharsetError, Ranges, class_set, complement, literal_set, normalize

try:  # Python 3.11+: the parser ``re`` itself uses
    from re import _constants as _C
    from re import _parser as _sre
except ImportError:  # pragma: no cover - 3.10 and older (not supported, kept for a clear error)
    import sre_constants as _C  # type: ignore[no-redef]
    import sre_parse as _sre  # type: ignore[no-redef]

_S = int(re.DOTALL)

#: Cap on the code-point automaton's states (``a{100000}`` is refused, not built): about three
#: states per character test and repeat, so a pattern of up to ~60,000 repeated tests.
MAX_NFA_STATES = 200_000


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector paused: building an automaton makes many small lists, which
    start collections that walk every object of the process (a third of the time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class RegexError(ValueError):
    """A pattern that cannot be compiled: a syntax error, a refused construct, or a limit."""


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
    #: Whether every state can reach ``final`` (no empty character set in the pattern).
    all_live: bool = False

    def closure(self, states: Iterable[int]) -> frozenset[int]:
        """``states`` and every state their epsilon moves reach."""
        return epsilon_closure(self.eps, states)


class _Builder:
    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.eps: list[list[int]] = []
        self.arcs: list[list[tuple[Ranges, int]]] = []
        self.dead_ends = False  # an empty character set (a state that cannot reach the end)

    def state(self) -> int:
        self.check(1)
        self.eps.append([])
        self.arcs.append([])
        return len(self.eps) - 1

    def check(self, more: int) -> None:
        if len(self.eps) + more > MAX_NFA_STATES:
            raise RegexError(
                f"its automaton passes {MAX_NFA_STATES:,} states (the limit on a pattern's size): "
                "write a smaller repeat count, e.g. split a long {m} repeat or use * / + where any count will do"
            )

    def copies(self, sub: list[Any], flags: int, at_start: bool, at_end: bool, count: int) -> list[tuple[int, int]]:
        """``count`` copies of the fragment of ``sub`` (entry, exit each): built once, then its
        states copied with their numbers shifted (a long repeat costs a list copy per state)."""
        if count <= 0:
            return []
        s0 = len(self.eps)
        x, y = self.seq(sub, flags, at_start, at_end)
        eps = [list(e) for e in self.eps[s0:]]
        arcs = [list(a) for a in self.arcs[s0:]]
        size = len(eps)
        self.check(size * (count - 1))  # refused before the copies are made
        out = [(x, y)]
        for _ in range(count - 1):
            off = len(self.eps) - s0
            self.eps.extend([[t + off for t in e] for e in eps])
            self.arcs.extend([[(r, t + off) for r, t in a] for a in arcs])
            out.append((x + off, y + off))
        return out

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
                chars = ALL if flags & _S else complement(normalize([(10, 10)]))
            elif op is _C.IN:
                try:
                    chars = class_set(av, flags)
                except CharsetError as e:
                    raise RegexError(str(e)) from None
            else:
                chars = literal_set(av, flags, negate=op is _C.NOT_LITERAL)
            a, b = self.state(), self.state()
            if chars:
                self.arcs[a].append((chars, b))
            else:
                self.dead_ends = True
            return a, b
        if op is _C.SUBPATTERN:
            _group, add, remove, sub = av
            return self.seq(list(sub), (flags | int(add)) & ~int(remove), at_start, at_end)
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
            bounded = hi is not _C.MAXREPEAT
            parts = self.copies(list(sub), flags, at_start and once, at_end and once, hi if bounded else lo)
            for x, y in parts[:lo]:
                self.eps[cur].append(x)
                cur = y
            if not bounded:
                x, y = self.seq(list(sub), flags, False, False)
                loop = self.state()
                self.eps[cur].append(loop)
                self.eps[loop].append(x)
                self.eps[y].append(loop)
                cur = loop
            else:
                end = self.state()
                for x, y in parts[lo:]:
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
    flags = int(parsed.state.flags)
    b = _Builder(pattern)
    with paused_gc():
        start, end = b.seq(list(parsed), flags, True, True)
    nfa = CharNFA(b.eps, b.arcs, start, end, not b.dead_ends)
    with _compiled_lock:
        _compiled[pattern] = nfa
        while len(_compiled) > 256:
            _compiled.pop(next(iter(_compiled)))
    return nfa
