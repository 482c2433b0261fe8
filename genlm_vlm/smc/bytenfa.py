"""Automata over bytes, read from automata over code points through UTF-8 tries.

A code point arc (a set of code points, a next state) is read as a :class:`ByteTrie`: the byte
sequences whose concatenations are exactly the UTF-8 encodings of the set, prefixes shared. One
trie is made per distinct set (``\\w``'s once, however often the pattern repeats it), and the
byte automaton is never written out: a :class:`ByteNFA` *position* is either a state of the code
point automaton (its number, below :attr:`ByteNFA.n`) or a point inside one of its arcs' tries
(a number above, encoding the arc and the trie node). :meth:`ByteNFA.moves` gives a set of
positions' moves on every byte, :meth:`ByteNFA.closure` the positions after a move (epsilon
moves followed, positions that cannot reach acceptance dropped). The lazy DFA
(:mod:`.lazydfa`) determinises it on demand.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from .charsets import Ranges
from .regex import CharNFA, paused_gc

#: Most positions one deterministic state may hold (its set of NFA positions; the work to make a
#: state, and its key's size, grow with it).
MAX_SET = 50_000


class TooLarge(ValueError):
    """A limit on work or memory was reached (the message names it and the way out)."""


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


class ByteTrie:
    """Byte-range sequences as a trie: ``edges[node]`` the ``(low, high, child)`` moves of a node
    (node 0 the root), ``child == -1`` where a sequence ends there."""

    def __init__(self, sequences: Iterable[Sequence[tuple[int, int]]]) -> None:
        self.edges: list[list[tuple[int, int, int]]] = [[]]
        index: dict[tuple[int, int, int], int] = {}
        for seq in sequences:
            node = 0
            for k, (a, b) in enumerate(seq):
                if k == len(seq) - 1:
                    self.edges[node].append((a, b, -1))
                    break
                child = index.get((node, a, b))
                if child is None:
                    child = index[(node, a, b)] = len(self.edges)
                    self.edges.append([])
                    self.edges[node].append((a, b, child))
                node = child


_tries: dict[Ranges | tuple[str, int, int], ByteTrie] = {}
_tries_lock = threading.Lock()


def utf8_trie(ranges: Ranges) -> ByteTrie:
    """The trie of the UTF-8 encodings of a code point set (cached per set)."""
    return _trie(ranges, lambda: (s for lo, hi in ranges for s in utf8_sequences(lo, hi)))


def range_trie(lo: int, hi: int) -> ByteTrie:
    """The one-byte trie of the bytes ``lo..hi``."""
    return _trie(("bytes", lo, hi), lambda: [[(lo, hi)]])


def _trie(key, sequences) -> ByteTrie:  # noqa: ANN001 - private helper
    with _tries_lock:
        got = _tries.get(key)
    if got is None:
        got = ByteTrie(sequences())
        with _tries_lock:
            _tries[key] = got
            while len(_tries) > 4096:
                _tries.pop(next(iter(_tries)))
    return got


def _pass_through(eps: list[list[int]], arc_counts: np.ndarray, finals: frozenset[int]) -> list[int]:
    """``fwd[s]``: the state an epsilon move into ``s`` may go to directly, past states that only
    pass on (no arcs, not final, one epsilon move: a regex's automaton is two thirds such states,
    which every closure would walk through)."""
    n = len(eps)
    lone = np.fromiter(map(len, eps), dtype=np.int64, count=n) == 1
    passes = (lone & (arc_counts == 0)).tolist()
    for f in finals:
        passes[f] = False
    fwd = [-1] * n
    for s0 in range(n):
        if fwd[s0] >= 0:
            continue
        path: list[int] = []
        on: set[int] = set()
        s = s0
        while fwd[s] < 0 and passes[s] and s not in on:
            on.add(s)
            path.append(s)
            s = eps[s][0]
        target = fwd[s] if fwd[s] >= 0 else s  # s: a state that does something, or on an epsilon cycle
        for p in path:
            fwd[p] = target
        if fwd[s] < 0:
            fwd[s] = s
    return fwd


class ByteNFA:
    """A nondeterministic automaton over bytes: ``eps[s]`` the states ``s`` moves to without
    input, ``arcs[s]`` its ``(trie, next state)`` arcs (the trie's byte sequences lead from ``s``
    to the next state), one ``start``, a set of ``finals``. See the module docstring for
    positions."""

    def __init__(self, eps: list[list[int]], arcs: Sequence[Sequence[tuple[ByteTrie, int]]], start: int,
                 finals: Iterable[int], all_live: bool = False) -> None:
        n = self.n = len(eps)
        self.finals = frozenset(finals)
        kept = [[(trie, t) for trie, t in out if trie.edges[0]] for out in arcs]
        counts = np.fromiter(map(len, kept), dtype=np.int64, count=n)
        fwd = _pass_through(eps, counts, self.finals)
        self.eps = [list(dict.fromkeys([fwd[t] for t in e])) if e else e for e in eps]
        self.start = fwd[start]
        kept = [[(trie, fwd[t]) for trie, t in out] for out in kept]
        flat = list(itertools.chain.from_iterable(kept))
        self.arc_trie: list[ByteTrie] = [trie for trie, _ in flat]
        self.arc_target: list[int] = [t for _, t in flat]
        first = np.concatenate([[0], np.cumsum(counts)]).tolist()
        #: The arc numbers of state ``s``: ``range(arc_first[s], arc_first[s + 1])``.
        self.arc_first: list[int] = first
        self.width = max((len(t.edges) for t in set(self.arc_trie)), default=1)
        self.is_final = np.zeros(n, dtype=bool)
        self.is_final[list(self.finals)] = True
        self.important: list[bool] = ((counts > 0) | self.is_final).tolist()
        if all_live:
            self.live = [True] * n
        else:
            self.live = self._coreachable(np.repeat(np.arange(n), counts).tolist())
        top = n + len(self.arc_trie) * self.width
        self.dtype = np.int32 if top < 2**31 else np.int64
        self._edges: dict[int, list[tuple[int, int, int]]] = {}
        self._digest: bytes | None = None

    @classmethod
    def from_chars(cls, nfa: CharNFA) -> ByteNFA:
        """The UTF-8 reading of a code point automaton (one trie per distinct code point set)."""
        with paused_gc():
            tries: dict[int, ByteTrie] = {}  # by the set's id: a repeat's copies share their sets
            arcs = [[(tries.get(id(r)) or tries.setdefault(id(r), utf8_trie(r)), t) for r, t in out]
                    for out in nfa.arcs]
            return cls(nfa.eps, arcs, nfa.start, [nfa.final], nfa.all_live)

    @classmethod
    def from_byte_arcs(cls, eps: list[list[int]], arcs: Sequence[Sequence[tuple[int, int, int]]], start: int,
                       finals: Iterable[int]) -> ByteNFA:
        """An automaton whose arcs are byte ranges ``(low, high, next state)``."""
        return cls(eps, [[(range_trie(lo, hi), t) for lo, hi, t in out] for out in arcs], start, finals)

    def digest(self) -> bytes:
        """A digest of the automaton's structure (equal automata, equal digests)."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(repr((self.n, self.start, sorted(self.finals), self.eps, self.arc_first)).encode())
            number: dict[int, int] = {}  # each distinct trie numbered in order of first use
            tries: list[ByteTrie] = []
            for t in self.arc_trie:
                if id(t) not in number:
                    number[id(t)] = len(tries)
                    tries.append(t)
            h.update(repr([number[id(t)] for t in self.arc_trie]).encode())
            h.update(repr(self.arc_target).encode())
            h.update(repr([t.edges for t in tries]).encode())
            self._digest = h.digest()
        return self._digest

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_edges"] = {}  # a cache: made again
        return state

    def _coreachable(self, sources: list[int]) -> list[bool]:
        """Whether each state can reach a final state (epsilon moves and arcs, backwards)."""
        rev: list[list[int]] = [[] for _ in range(self.n)]
        for s, out in enumerate(self.eps):
            for t in out:
                rev[t].append(s)
        for s, t in zip(sources, self.arc_target, strict=True):
            rev[t].append(s)
        good = [False] * self.n
        todo = list(self.finals)
        for f in todo:
            good[f] = True
        while todo:
            for s in rev[todo.pop()]:
                if not good[s]:
                    good[s] = True
                    todo.append(s)
        return good

    def edges(self, p: int) -> list[tuple[int, int, int]]:
        """Position ``p``'s byte moves ``(low, high, next position)``, toward live positions only."""
        got = self._edges.get(p)
        if got is None:
            if p < self.n:
                got = [e for a in range(self.arc_first[p], self.arc_first[p + 1]) for e in self._resolve(a, 0)]
            else:
                a, node = divmod(p - self.n, self.width)
                got = self._resolve(a, node)
            if len(self._edges) >= 1 << 18:  # a bound on memory: remade when needed
                self._edges.clear()
            self._edges[p] = got
        return got

    def _resolve(self, a: int, node: int) -> list[tuple[int, int, int]]:
        t = self.arc_target[a]
        if not self.live[t]:
            return []
        base = self.n + a * self.width
        return [(lo, hi, t if c < 0 else base + c) for lo, hi, c in self.arc_trie[a].edges[node]]

    def closure(self, targets: Iterable[int]) -> np.ndarray:
        """The sorted positions (states with arcs or final, and points inside arcs) reached from
        ``targets`` by epsilon moves, live ones only: a deterministic state's identity. Raises
        :class:`TooLarge` past :data:`MAX_SET` positions."""
        n, eps, live = self.n, self.eps, self.live
        inside: set[int] = set()
        seen: set[int] = set()
        todo: list[int] = []
        for p in targets:
            if p >= n:
                inside.add(p)
            elif live[p] and p not in seen:
                seen.add(p)
                todo.append(p)
        while todo:
            for t in eps[todo.pop()]:
                if t not in seen and live[t]:
                    seen.add(t)
                    todo.append(t)
            if len(seen) > MAX_SET:
                raise TooLarge(
                    f"one state of its deterministic automaton holds more than {MAX_SET:,} positions of the "
                    "nondeterministic one (nested or overlapping repeats): write fewer nested optional repeats, "
                    "e.g. [a-z]{0,10000} for (?:[a-z]{0,100}){0,100}"
                )
        important = self.important
        keep = [s for s in seen if important[s]]
        keep.extend(inside)
        out = np.array(keep, dtype=self.dtype)
        out.sort()
        return out

    def moves(self, positions: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
        """The moves of a set of positions on every byte, as ``(x, y, targets)``: the bytes
        ``x..y-1`` lead to the positions ``targets`` (before :meth:`closure`); bytes in no
        interval lead nowhere."""
        edges: list[tuple[int, int, int]] = []
        for p in positions.tolist():
            edges += self.edges(p)
        if not edges:
            return []
        arr = np.array(edges, dtype=np.int64)
        lo, hi, tg = arr[:, 0], arr[:, 1], arr[:, 2]
        if len(arr) == 1:
            return [(int(lo[0]), int(hi[0]) + 1, tg)]
        cuts = np.unique(np.concatenate([lo, hi + 1])).tolist()
        out = []
        for x, y in zip(cuts[:-1], cuts[1:], strict=True):
            act = (lo <= x) & (hi >= x)
            if act.any():
                out.append((x, y, tg[act]))
        return out
