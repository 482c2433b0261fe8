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


#: Sets of at most this many positions find their moves through per-position lists, larger ones
#: through one array gather (:meth:`ByteNFA.moves`).
SMALL_SET = 32


#: Closures of more targets than this go level by level in numpy (:meth:`ByteNFA.closure`), while
#: a level holds more than :data:`WIDE_FRONT` states.
WIDE_SET = 1024
WIDE_FRONT = 16


class TooLarge(ValueError):
    """A limit on work or memory was reached (the message names it and the way out)."""


def _too_large() -> TooLarge:
    return TooLarge(
        f"one state of its deterministic automaton holds more than {MAX_SET:,} positions of the "
        "nondeterministic one (nested or overlapping repeats): write fewer nested optional repeats, "
        "e.g. [a-z]{0,10000} for (?:[a-z]{0,100}){0,100}"
    )


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


def _pass_through(n: int, src: np.ndarray, dst: np.ndarray, arc_counts: np.ndarray,
                  is_final: np.ndarray) -> np.ndarray:
    """``fwd[s]``: the state an epsilon move into ``s`` may go to directly, past states that only
    pass on (no arcs, not final, one epsilon move: a regex's automaton is two thirds such states,
    which every closure would walk through). ``src``/``dst``: the distinct epsilon moves. A chain
    of such states ending on an epsilon cycle of them ends on one of the cycle's states."""
    passes = (np.bincount(src, minlength=n) == 1) & (arc_counts == 0) & ~is_final
    fwd = np.arange(n, dtype=np.int64)
    one = passes[src]
    fwd[src[one]] = dst[one]
    for _ in range(max(1, n.bit_length() + 1)):  # pointer doubling: fwd^(2^k), 2^k >= n at the end
        nxt = fwd[fwd]
        if np.array_equal(nxt, fwd):
            break
        fwd = nxt
    return fwd


def _csr(src: np.ndarray, dst: np.ndarray, n: int) -> tuple[list[int], list[int]]:
    """Moves as ``(targets, offsets)`` lists: state ``s``'s are ``targets[offsets[s]:offsets[s + 1]]``."""
    order = np.argsort(src, kind="stable")
    off = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=n))])
    return dst[order].tolist(), off.tolist()


def _sweep(edges: list[tuple[int, int, int]]) -> list[tuple[int, int, Sequence[int]]]:
    """Byte moves ``(low, high, target)``, possibly overlapping, as disjoint intervals ``(x, y,
    targets)``: the bytes ``x..y-1`` lead to exactly ``targets``; bytes in none, nowhere."""
    edges.sort()
    if all(a[1] < b[0] for a, b in zip(edges, edges[1:], strict=False)):  # disjoint: each its own interval
        return [(lo, hi + 1, (t,)) for lo, hi, t in edges]
    cuts = sorted({lo for lo, _hi, _t in edges} | {hi + 1 for _lo, hi, _t in edges})
    out: list[tuple[int, int, Sequence[int]]] = []
    active: list[tuple[int, int, int]] = []
    i = 0
    for x, y in zip(cuts, cuts[1:], strict=False):
        while i < len(edges) and edges[i][0] <= x:
            active.append(edges[i])
            i += 1
        active = [e for e in active if e[1] >= x]
        if active:
            out.append((x, y, tuple(t for _lo, _hi, t in active)))
    return out


class ByteNFA:
    """A nondeterministic automaton over bytes: ``eps[s]`` the states ``s`` moves to without
    input, ``arcs[s]`` its ``(trie, next state)`` arcs (the trie's byte sequences lead from ``s``
    to the next state), one ``start``, a set of ``finals``. See the module docstring for
    positions. Held as arrays (:meth:`from_chars` reads a :class:`~.regex.CharNFA`'s directly)."""

    def __init__(self, eps: list[list[int]], arcs: Sequence[Sequence[tuple[ByteTrie, int]]], start: int,
                 finals: Iterable[int], all_live: bool = False) -> None:
        flat_eps = [x for s, out in enumerate(eps) for t in out for x in (s, t)]
        tries: list[ByteTrie] = []
        number: dict[int, int] = {}
        flat_arcs: list[int] = []
        for s, out in enumerate(arcs):
            for trie, t in out:
                i = number.get(id(trie))
                if i is None:
                    i = number[id(trie)] = len(tries)
                    tries.append(trie)
                flat_arcs += (s, i, t)
        self._build(len(eps), np.array(flat_eps, dtype=np.int64).reshape(-1, 2),
                    np.array(flat_arcs, dtype=np.int64).reshape(-1, 3), tries, start, finals, all_live)

    def _build(self, n: int, eps: np.ndarray, arcs: np.ndarray, tries: list[ByteTrie], start: int,
               finals: Iterable[int], all_live: bool) -> None:
        """``eps``: int ``[k, 2]`` (from, to); ``arcs``: int ``[m, 3]`` (from, trie index, to)."""
        self.n = n
        self.finals = frozenset(int(f) for f in finals)
        is_final = self.is_final = np.zeros(n, dtype=bool)
        is_final[list(self.finals)] = True
        if len(arcs):
            arcs = arcs[np.array([bool(t.edges[0]) for t in tries], dtype=bool)[arcs[:, 1]]]
        counts = np.bincount(arcs[:, 0], minlength=n)
        pairs = np.unique(eps[:, 0] * n + eps[:, 1]) if len(eps) else np.zeros(0, dtype=np.int64)
        src, dst = pairs // max(n, 1), pairs % max(n, 1)
        fwd = _pass_through(n, src, dst, counts, is_final)
        met = np.zeros(n, dtype=bool)
        met[fwd] = True  # the states a move may lead to (no state that only passes on, cycles aside)
        dst = fwd[dst]
        keep = met[src] & (dst != src)
        pairs = np.unique(src[keep] * n + dst[keep])
        src, dst = pairs // max(n, 1), pairs % max(n, 1)
        self._eps = (src, dst)  # the distinct epsilon moves (for the digest)
        self.start = int(fwd[start])
        order = np.argsort(arcs[:, 0], kind="stable")
        targets = fwd[arcs[order, 2]]
        self.arc_trie: list[ByteTrie] = [tries[i] for i in arcs[order, 1].tolist()]
        self.arc_target: list[int] = targets.tolist()
        self._arcs = (arcs[order, 0], arcs[order, 1], targets, tries)  # from, trie index, to; the tries
        #: The arc numbers of state ``s``: ``range(arc_first[s], arc_first[s + 1])``.
        self.arc_first: list[int] = np.concatenate([[0], np.cumsum(counts)]).tolist()
        self.width = max((len(t.edges) for t in set(self.arc_trie)), default=1)
        if all_live:
            self.live = [True] * n
        else:
            self.live = self._coreachable(np.concatenate([src, arcs[order, 0]]), np.concatenate([dst, targets]))
        self._live = np.array(self.live, dtype=bool)
        self._important = (counts > 0) | is_final
        good = self._live[src] & self._live[dst]
        to, off = _csr(src[good], dst[good], n)
        #: ``_succ[s]``: the live states ``s`` moves to without input (``s`` live).
        self._succ: list[list[int]] = [to[a:b] for a, b in zip(off[:-1], off[1:], strict=True)]
        top = n + len(self.arc_trie) * self.width
        self.dtype = np.int32 if top < 2**31 else np.int64
        self._edges: dict[int, list[tuple[int, int, int]]] = {}
        self._roots: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._succ_csr: tuple[np.ndarray, np.ndarray] | None = None  # _succ as arrays (wide closures)
        self._digest: bytes | None = None

    @classmethod
    def from_chars(cls, nfa: CharNFA) -> ByteNFA:
        """The UTF-8 reading of a code point automaton (one trie per distinct code point set)."""
        with paused_gc():
            self = cls.__new__(cls)
            self._build(nfa.n, nfa.eps, nfa.arcs, [utf8_trie(r) for r in nfa.sets], nfa.start, [nfa.final],
                        nfa.all_live)
            return self

    @classmethod
    def from_byte_arcs(cls, eps: list[list[int]], arcs: Sequence[Sequence[tuple[int, int, int]]], start: int,
                       finals: Iterable[int]) -> ByteNFA:
        """An automaton whose arcs are byte ranges ``(low, high, next state)``."""
        return cls(eps, [[(range_trie(lo, hi), t) for lo, hi, t in out] for out in arcs], start, finals)

    def digest(self) -> bytes:
        """A digest of the automaton's structure (equal automata, equal digests)."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(repr((self.n, self.start, sorted(self.finals), self.arc_first)).encode())
            h.update(self._eps[0].astype(np.int64).tobytes())
            h.update(self._eps[1].astype(np.int64).tobytes())
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

    def _coreachable(self, src: np.ndarray, dst: np.ndarray) -> list[bool]:
        """Whether each state can reach a final state along the moves ``src -> dst`` (epsilon
        moves and arcs), searched backwards."""
        back, off = _csr(dst, src, self.n)
        good = [False] * self.n
        todo = list(self.finals)
        for f in todo:
            good[f] = True
        while todo:
            s = todo.pop()
            for t in back[off[s]:off[s + 1]]:
                if not good[t]:
                    good[t] = True
                    todo.append(t)
        return good

    def _state_edges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The byte moves of every state position (``p < n``: its arcs' tries' roots), toward
        live positions, as arrays: state ``s``'s are ``offsets[s]:offsets[s + 1]`` of ``(low,
        high, next position)``. Made on first use."""
        if self._roots is None:
            src, trie_of, targets, tries = self._arcs
            n = self.n
            root_lo, root_hi, root_child, root_count = [], [], [], []
            for t in tries:
                root = t.edges[0]
                root_count.append(len(root))
                for lo, hi, c in root:
                    root_lo.append(lo)
                    root_hi.append(hi)
                    root_child.append(c)
            r_off = np.concatenate([[0], np.cumsum(root_count)]).astype(np.int64)
            count = np.asarray(root_count, dtype=np.int64)[trie_of] * self._live[targets]
            arc = np.repeat(np.arange(len(src), dtype=np.int64), count)
            k = np.arange(len(arc), dtype=np.int64) + np.repeat(r_off[trie_of] - (np.cumsum(count) - count), count)
            lo = np.asarray(root_lo, dtype=np.int64)[k]
            hi = np.asarray(root_hi, dtype=np.int64)[k]
            child = np.asarray(root_child, dtype=np.int64)[k]
            tg = np.where(child < 0, targets[arc], n + arc * self.width + child)
            off = np.concatenate([[0], np.cumsum(np.bincount(src[arc], minlength=n))]).astype(np.int64)
            self._roots = (off, lo, hi, tg)
        return self._roots

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
        if not isinstance(targets, list | tuple | np.ndarray):
            targets = list(targets)
        if len(targets) > WIDE_SET:
            return self._wide_closure(np.asarray(targets, dtype=np.int64))
        n, live = self.n, self.live
        inside: set[int] = set()
        seen: set[int] = set()
        for p in targets:
            if p >= n:
                inside.add(p)
            elif live[p]:
                seen.add(p)
        self._spread(seen, list(seen))
        states = np.fromiter(seen, dtype=np.int64, count=len(seen))
        return self._identity(states, np.fromiter(inside, dtype=np.int64, count=len(inside)))

    def _identity(self, states: np.ndarray, inside: np.ndarray) -> np.ndarray:
        out = np.concatenate([states[self._important[states]], inside]).astype(self.dtype)
        out.sort()
        return out

    def _spread(self, seen: set[int], todo: list[int]) -> None:
        """Adds to ``seen`` every state reached by epsilon moves from ``todo`` (states already in
        ``seen``). Raises :class:`TooLarge` past :data:`MAX_SET` states."""
        succ = self._succ
        while todo:
            if len(todo) > 16:  # a wide front: one level at once, in C (set and chain operations)
                front = set(itertools.chain.from_iterable(map(succ.__getitem__, todo)))
                front -= seen
                seen |= front
                todo = list(front)
            else:  # a narrow one (a long chain of moves): one state at a time
                for t in succ[todo.pop()]:
                    if t not in seen:
                        seen.add(t)
                        todo.append(t)
            if len(seen) > MAX_SET:
                raise _too_large()

    def _wide_closure(self, targets: np.ndarray) -> np.ndarray:
        """:meth:`closure` of many targets: one numpy gather per level of epsilon moves over the
        successor lists as arrays (a narrow level goes on in :meth:`closure`'s loop)."""
        n = self.n
        if self._succ_csr is None:
            off = np.concatenate([[0], np.cumsum([len(x) for x in self._succ])]).astype(np.int64)
            to = np.fromiter(itertools.chain.from_iterable(self._succ), dtype=np.int64, count=int(off[-1]))
            self._succ_csr = (off, to)
        off, to = self._succ_csr
        inside = np.unique(targets[targets >= n])
        front = targets[targets < n]
        seen = np.zeros(n, dtype=bool)
        seen[front[self._live[front]]] = True
        front = np.flatnonzero(seen)  # sorted, distinct (cheaper than np.unique)
        count = len(front)
        fresh = np.zeros(n, dtype=bool)
        while len(front) > WIDE_FRONT:
            first, many = off[front], off[front + 1] - off[front]
            k = np.arange(int(many.sum()), dtype=np.int64) + np.repeat(first - (np.cumsum(many) - many), many)
            nxt = to[k]
            fresh[nxt[~seen[nxt]]] = True
            front = np.flatnonzero(fresh)
            fresh[front] = False
            seen[front] = True
            count += len(front)
            if count > MAX_SET:
                raise _too_large()
        states = np.flatnonzero(seen)
        if len(front):  # a narrow level: on in sets (a chain of moves)
            done = set(states.tolist())
            self._spread(done, front.tolist())
            states = np.fromiter(done, dtype=np.int64, count=len(done))
        return self._identity(states, inside)

    def moves(self, positions: np.ndarray) -> list[tuple[int, int, Sequence[int]]]:
        """The moves of a set of positions on every byte, as ``(x, y, targets)``: the bytes
        ``x..y-1`` lead to the positions ``targets`` (before :meth:`closure`; a list or an
        array); bytes in no interval lead nowhere."""
        pos = np.asarray(positions, dtype=np.int64)
        if len(pos) <= SMALL_SET:  # a few positions: their cached edge lists (numpy calls cost more)
            inner = [e for p in pos.tolist() for e in self.edges(p)]
            if len(inner) <= 1:
                return [(lo, hi + 1, (t,)) for lo, hi, t in inner]
            return _sweep(inner)
        else:
            states = pos[pos < self.n]
            off, r_lo, r_hi, r_tg = self._state_edges()
            first, count = off[states], off[states + 1] - off[states]
            k = np.arange(int(count.sum()), dtype=np.int64) + np.repeat(first - (np.cumsum(count) - count), count)
            lo, hi, tg = r_lo[k], r_hi[k], r_tg[k]
            inner = [e for p in pos[pos >= self.n].tolist() for e in self.edges(p)]
        if inner:
            arr = np.array(inner, dtype=np.int64)
            lo, hi, tg = np.concatenate([lo, arr[:, 0]]), np.concatenate([hi, arr[:, 1]]), np.concatenate([tg, arr[:, 2]])
        if not len(lo):
            return []
        if len(lo) == 1:
            return [(int(lo[0]), int(hi[0]) + 1, tg)]
        cuts = np.unique(np.concatenate([lo, hi + 1])).tolist()
        out = []
        for x, y in zip(cuts[:-1], cuts[1:], strict=True):
            act = (lo <= x) & (hi >= x)
            if act.any():
                out.append((x, y, tg[act]))
        return out
