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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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
@dataclass
class CharNFA:
    """A nondeterministic automaton over code points, as arrays: states ``0..n-1``, ``eps`` its
    epsilon moves (int64 ``[k, 2]``: from, to), ``arcs`` its character moves (int64 ``[m, 3]``:
    from, the code point set's index in ``sets``, to); ``start`` and ``final`` (one each)."""

    n: int
    eps: np.ndarray
    arcs: np.ndarray
    sets: list[Ranges]
    start: int
    final: int
    #: Whether every state can reach ``final`` (no empty character set in the pattern).
    all_live: bool = False


class _Builder:
    """Builds a :class:`CharNFA`: moves are appended to flat lists and flushed into numpy
    chunks, so a repeat's copies are one array operation (:meth:`copies`), not a loop."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.n = 0
        self._eps: list[int] = []  # pending moves, flat: from, to, from, to, ...
        self._arcs: list[int] = []  # pending: from, set, to, ...
        self._eps_chunks: list[np.ndarray] = []
        self._arc_chunks: list[np.ndarray] = []
        self.sets: list[Ranges] = []
        self._set_index: dict[Ranges, int] = {}
        self.dead_ends = False  # an empty character set (a state that cannot reach the end)

    def state(self) -> int:
        self.check(1)
        self.n += 1
        return self.n - 1

    def check(self, more: int) -> None:
        if self.n + more > MAX_NFA_STATES:
            raise RegexError(
                f"its automaton passes {MAX_NFA_STATES:,} states (the limit on a pattern's size): "
                "write a smaller repeat count, e.g. split a long {m} repeat or use * / + where any count will do"
            )

    def eps(self, a: int, b: int) -> None:
        self._eps += (a, b)

    def eps_block(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._eps_chunks.append(np.stack([src, dst], axis=1).astype(np.int64))

    def arc(self, a: int, chars: Ranges, b: int) -> None:
        i = self._set_index.get(chars)
        if i is None:
            i = self._set_index[chars] = len(self.sets)
            self.sets.append(chars)
        self._arcs += (a, i, b)

    def _flush(self) -> tuple[int, int]:
        if self._eps:
            self._eps_chunks.append(np.array(self._eps, dtype=np.int64).reshape(-1, 2))
            self._eps.clear()
        if self._arcs:
            self._arc_chunks.append(np.array(self._arcs, dtype=np.int64).reshape(-1, 3))
            self._arcs.clear()
        return len(self._eps_chunks), len(self._arc_chunks)

    @staticmethod
    def _join(chunks: list[np.ndarray], width: int) -> np.ndarray:
        return np.concatenate(chunks) if chunks else np.zeros((0, width), dtype=np.int64)

    def finish(self, start: int, final: int) -> CharNFA:
        self._flush()
        return CharNFA(self.n, self._join(self._eps_chunks, 2), self._join(self._arc_chunks, 3), self.sets,
                       start, final, not self.dead_ends)

    def copies(self, sub: list[Any], flags: int, at_start: bool, at_end: bool,
               count: int) -> tuple[int, int, int] | None:
        """``count`` copies of the fragment of ``sub``: built once, then its moves copied with
        the state numbers shifted (one array operation). Returns the first copy's entry and
        exit and the fragment's size (copy ``i``'s states are the first's plus ``i * size``)."""
        if count <= 0:
            return None
        s0 = self.n
        e0, a0 = self._flush()
        x, y = self.seq(sub, flags, at_start, at_end)
        size = self.n - s0
        self.check(size * (count - 1))  # refused before the copies are made
        if count > 1:
            _e1, _a1 = self._flush()
            shift = np.arange(1, count, dtype=np.int64) * size
            eps = self._join(self._eps_chunks[e0:], 2)
            if len(eps):
                self._eps_chunks.append((eps[None] + shift[:, None, None]).reshape(-1, 2))
            arcs = self._join(self._arc_chunks[a0:], 3)
            if len(arcs):
                more = np.repeat(arcs[None], count - 1, axis=0)
                more[:, :, 0] += shift[:, None]
                more[:, :, 2] += shift[:, None]
                self._arc_chunks.append(more.reshape(-1, 3))
            self.n += size * (count - 1)
        return x, y, size

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
            self.eps(cur, a)
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
                self.arc(a, chars, b)
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
                self.eps(a, x)
                self.eps(y, b)
            return a, b
        if op in (_C.MAX_REPEAT, _C.MIN_REPEAT):  # lazy or greedy: the same language under fullmatch
            lo, hi, sub = av
            once = hi is not _C.MAXREPEAT and hi <= 1
            a = cur = self.state()
            bounded = hi is not _C.MAXREPEAT
            frag = self.copies(list(sub), flags, at_start and once, at_end and once, hi if bounded else lo)
            if lo:  # the mandatory copies, chained
                x, y, size = frag  # type: ignore[misc]
                i = np.arange(lo, dtype=np.int64)
                self.eps_block(np.concatenate([[cur], y + size * i[:-1]]), x + size * i)
                cur = y + size * (lo - 1)
            if not bounded:
                x, y = self.seq(list(sub), flags, False, False)
                loop = self.state()
                self.eps(cur, loop)
                self.eps(loop, x)
                self.eps(y, loop)
                cur = loop
            else:
                end = self.state()
                if hi > lo:  # the optional copies: each may be skipped to the end
                    x, y, size = frag  # type: ignore[misc]
                    i = np.arange(lo, hi, dtype=np.int64)
                    before = np.concatenate([[cur], y + size * i[:-1]])
                    self.eps_block(before, x + size * i)
                    self.eps_block(before, np.full(len(i), end, dtype=np.int64))
                    cur = y + size * (hi - 1)
                self.eps(cur, end)
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
        nfa = b.finish(start, end)
    with _compiled_lock:
        _compiled[pattern] = nfa
        while len(_compiled) > 256:
            _compiled.pop(next(iter(_compiled)))
    return nfa
