"""A deterministic automaton over bytes, made on demand from a :class:`~.bytenfa.ByteNFA`.

A deterministic state is a set of NFA positions (:meth:`~.bytenfa.ByteNFA.closure`), named by its
*key*: the positions' sorted numbers as ``bytes`` (``b""`` is the dead state: no accepted text goes
through it). Only the states a run reaches are made, as a run reaches them: binding costs the NFA
and the start state's closure. Made states live in a bounded cache (:class:`LazyDFA`): a *slot*
per state, its row of 256 next slots in a numpy table (``-1`` where the move is not made yet, so the
vocabulary walk can gather whole byte columns at once) and in a list copy (for one-token walks).
A row's moves are found at once (the byte intervals and the positions each leads to), but the
state an interval leads to is made only when a byte of it is first read: a state holding a
Unicode class such as ``\\w`` moves to a different state on each of some fifty lead bytes, and a
walk or a particle reads a few of them.
Past :data:`CACHE_BYTES` the least recently used states are dropped, with every row that leads to
them; a state is made again from its key when it is met again. A key always names the same set,
so the answers never depend on what the cache holds.

:class:`ByteDFA` is a complete table, for automata already determinised elsewhere; it runs on the
same lazy machinery (:meth:`ByteDFA.to_nfa`).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .bytenfa import ByteNFA, TooLarge, range_trie
from .constraint_base import ConstraintError
from .walk_cpu import TokenBytes, walk

#: Bytes of made states one automaton keeps (least recently used dropped past it).
CACHE_BYTES = 32 << 20
#: Bytes one operation (a mask row's walk, a step's advances) may add past the cache's bound
#: before it is refused: the most work a step may need.
OVERDRAFT_BYTES = 256 << 20
_ROW_BYTES = 256 * 4 + 256 * 8 + 120  # the numpy row, the list row, bookkeeping


class LazyDFA:
    """The deterministic automaton of ``nfa``, made on demand (see the module docstring);
    ``name`` names it in errors (a :class:`~.constraint_base.ConstraintError` when a limit is
    reached). Thread-safe: every method holds :attr:`lock` (an ``RLock``; callers that walk
    :attr:`table` themselves hold it too)."""

    def __init__(self, nfa: ByteNFA, name: str, max_bytes: int = CACHE_BYTES) -> None:
        self.nfa = nfa
        self.name = name
        self.max_bytes = max(int(max_bytes), 1 << 16)
        self.lock = threading.RLock()
        cap = 64
        self.table = np.full((cap, 256), -1, dtype=np.int32)
        self.table[0] = 0
        self.accept = np.zeros(cap, dtype=bool)
        self._used = np.zeros(cap, dtype=np.int64)
        self._keys: list[bytes | None] = [b""] + [None] * (cap - 1)
        self._rows: list[list[int] | None] = [[0] * 256] + [None] * (cap - 1)
        #: Per touched slot: its moves' intervals not made yet (starts, ends, the positions each
        #: leads to before the closure).
        self._pending: dict[int, tuple[list[int], list[int], list[Sequence[int]]]] = {}
        self._row_bytes = np.zeros(cap, dtype=np.int64)  # the bytes each touched row was counted for
        self._slot: dict[bytes, int] = {b"": 0}
        self._free = list(range(cap - 1, 0, -1))
        self._tick = 1
        self.bytes = 0  # held by made states (keys and rows)
        self.states_made = 0  # states made (again, after an eviction)
        self.rows_made = 0
        self.evicted = 0
        self.seconds = 0.0  # spent making states and rows
        self._single: dict[int, bytes] = {}
        t0 = time.perf_counter()
        self.start: bytes = self._key(self._closure([nfa.start]))
        self.seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ keys and slots
    def _closure(self, targets: Sequence[int] | np.ndarray) -> np.ndarray:
        try:
            return self.nfa.closure(targets)
        except TooLarge as e:
            raise ConstraintError(f"{self.name}: {e}") from None

    @staticmethod
    def _key(positions: np.ndarray) -> bytes:
        return positions.tobytes()

    def position_key(self, p: int) -> bytes:
        """The key of the state of one position ``p`` of a made state (its epsilon closure: a
        subset of every state that holds ``p``); cached."""
        got = self._single.get(p)
        if got is None:
            got = self._key(self._closure([p]))
            if len(self._single) >= 1 << 16:  # a bound on memory: made again when needed
                self._single.clear()
            self._single[p] = got
        return got

    def positions(self, key: bytes) -> np.ndarray:
        """The NFA positions a key names."""
        return np.frombuffer(key, dtype=self.nfa.dtype)

    def slot(self, key: bytes) -> int:
        """The slot of the state ``key`` (made now if it is not in the cache)."""
        with self.lock:
            s = self._slot.get(key)
            return self._add(key) if s is None else s

    def _add(self, key: bytes) -> int:
        if not self._free:
            self._grow()
        s = self._free.pop()
        self._keys[s] = key
        self._slot[key] = s
        pos = self.positions(key)
        inner = pos[pos < self.nfa.n]
        self.accept[s] = bool(self.nfa.is_final[inner].any())
        self.table[s] = -1
        self._rows[s] = None
        self._pending.pop(s, None)
        self._used[s] = self._tick
        self.bytes += len(key) + 200
        self.states_made += 1
        if self.bytes > self.max_bytes + OVERDRAFT_BYTES:
            raise ConstraintError(
                f"{self.name}: one step needs more than {(self.max_bytes + OVERDRAFT_BYTES) >> 20} MiB of automaton "
                "states (a pattern whose states are very large: nested optional repeats, long repeats of "
                "Unicode classes); write a smaller repeat, [0-9] for \\d, or (?a) for ASCII classes"
            )
        return s

    def _grow(self) -> None:
        old = self.table.shape[0]
        new = 2 * old
        table = np.full((new, 256), -1, dtype=np.int32)
        table[:old] = self.table
        self.table = table
        self.accept = np.concatenate([self.accept, np.zeros(new - old, dtype=bool)])
        self._used = np.concatenate([self._used, np.zeros(new - old, dtype=np.int64)])
        self._row_bytes = np.concatenate([self._row_bytes, np.zeros(new - old, dtype=np.int64)])
        self._keys += [None] * (new - old)
        self._rows += [None] * (new - old)
        self._free = list(range(new - 1, old - 1, -1))

    def key_of(self, slot: int) -> bytes:
        key = self._keys[slot]
        assert key is not None
        return key

    def accepts(self, key: bytes) -> bool:
        """Whether a text may end in the state ``key``."""
        with self.lock:
            return bool(self.accept[self.slot(key)]) if key else False

    # ------------------------------------------------------------------ rows
    def make_rows(self, slots: Iterable[int]) -> None:
        """Make the whole rows of ``slots`` (the states after each byte) where they are not made."""
        with self.lock:
            for s in slots:
                s = int(s)
                self._touch(s)
                starts, _ends, _targets = self._pending[s]
                for x in list(starts):
                    self._move(s, x)

    def _touch(self, s: int) -> list[int]:
        """The list row of ``s``, its moves found if they were not (bytes in no move lead to the
        dead state at once, the others are ``-1`` until :meth:`_move`)."""
        row = self._rows[s]
        if row is not None:
            return row
        t0 = time.perf_counter()
        moves = self.nfa.moves(self.positions(self.key_of(s)))
        row = [0] * 256
        starts, ends, targets = [], [], []
        for x, y, tg in moves:
            row[x:y] = [-1] * (y - x)
            starts.append(x)
            ends.append(y)
            targets.append(tg)
        self.table[s] = row
        self._rows[s] = row
        self._pending[s] = (starts, ends, targets)
        size = _ROW_BYTES + sum(64 + 8 * len(tg) for tg in targets)
        self._row_bytes[s] = size
        self.bytes += size
        self.rows_made += 1
        self.seconds += time.perf_counter() - t0
        return row

    def _move(self, s: int, byte: int) -> int:
        """The slot after ``byte`` from the touched slot ``s`` (the interval of ``byte`` made:
        its positions' closure, the state of that set)."""
        row = self._rows[s]
        assert row is not None
        got = row[byte]
        if got >= 0:
            return got
        t0 = time.perf_counter()
        starts, ends, targets = self._pending[s]
        i = bisect.bisect_right(starts, byte) - 1
        x, y, tg = starts[i], ends[i], targets[i]
        assert x <= byte < y
        key = self._key(self._closure(tg))
        t = self.slot(key) if key else 0
        row = self._rows[s]  # the same list unless slot() evicted nothing (it never trims)
        assert row is not None
        row[x:y] = [t] * (y - x)
        self.table[s, x:y] = t
        del starts[i], ends[i], targets[i]
        self.seconds += time.perf_counter() - t0
        return t

    def gather(self, slots: np.ndarray, column: np.ndarray) -> np.ndarray:
        """``table[slots, column]``, moves made where missing (under :attr:`lock`)."""
        got = self.table[slots, column]
        missing = got < 0
        if missing.any():
            col = np.broadcast_to(column, slots.shape)
            pairs = np.unique(slots[missing].astype(np.int64) * 256 + col[missing])
            for pair in pairs.tolist():
                s, byte = divmod(pair, 256)
                self._touch(s)
                self._move(s, byte)
            got[missing] = self.table[slots[missing], col[missing]]
        self._used[slots] = self._tick
        return got

    def step(self, key: bytes, data: bytes) -> bytes:
        """The state after ``data`` from the state ``key`` (``b""``: dead)."""
        if not key:
            return b""
        with self.lock:
            s = self._slot.get(key)
            if s is None:
                s = self._add(key)
            rows = self._rows
            for byte in data:
                row = rows[s]
                if row is None:
                    row = self._touch(s)
                t = row[byte]
                s = self._move(s, byte) if t < 0 else t
                if not s:
                    return b""
            self._used[s] = self._tick
            return self.key_of(s)

    def walk_tokens(self, keys: Sequence[bytes], tokens: Sequence[int] | np.ndarray,
                    vocab: TokenBytes) -> tuple[list[bytes | None], list[int]]:
        """The states after each of ``keys`` reads token ``tokens[i]``'s bytes (``vocab``), made
        in one compiled walk (:mod:`.walk_cpu`) where every move on the way is made already:
        ``(after, rest)``, ``after[i]`` None for each ``i`` in ``rest`` (a move not made yet, a
        state not in the cache, the dead state on the way, a token without bytes in ``vocab``,
        or no compiled walk): the caller walks those (:meth:`step`). Under :attr:`lock`."""
        with self.lock:
            get = self._slot.get
            slots = np.array([get(k, -1) for k in keys], dtype=np.int64)
            got = walk(self.table, slots, np.asarray(tokens, dtype=np.int64), vocab)
            if got is None:
                return [None] * len(keys), list(range(len(keys)))
            ok = got > 0
            self._used[got[ok]] = self._tick
            names = self._keys
            after: list[bytes | None] = [names[s] if s > 0 else None for s in got.tolist()]
            return after, [] if ok.all() else np.flatnonzero(~ok).tolist()

    def matches(self, data: bytes) -> bool:
        """Whether the automaton accepts ``data``."""
        return self.accepts(self.step(self.start, data)) if data else self.accepts(self.start)

    # ------------------------------------------------------------------ the bound
    def trim(self) -> None:
        """Start of an operation: past :attr:`max_bytes`, drop the least recently used states
        (down to half the bound) and every row that leads to one of them."""
        with self.lock:
            self._tick += 1
            if self.bytes <= self.max_bytes:
                return
            held = np.array([s for s, k in enumerate(self._keys) if k is not None and s], dtype=np.int64)
            order = held[np.argsort(self._used[held], kind="stable")]
            goal = self.max_bytes // 2
            victims = []
            for s in order.tolist():
                if self.bytes <= goal:
                    break
                key = self._keys[s]
                assert key is not None
                self.bytes -= len(key) + 200 + int(self._row_bytes[s])
                self._row_bytes[s] = 0
                victims.append(s)
                del self._slot[key]
                self._keys[s] = None
                self._rows[s] = None
                self._pending.pop(s, None)
            gone = np.array(victims, dtype=np.int64)
            self.table[gone] = -1
            made = np.array([s for s, r in enumerate(self._rows) if r is not None and s], dtype=np.int64)
            stale = made[np.isin(self.table[made], gone).any(axis=1)] if len(made) else made
            for s in stale.tolist():
                self._rows[s] = None
                self._pending.pop(s, None)
                self.bytes -= int(self._row_bytes[s])
                self._row_bytes[s] = 0
            self.table[stale] = -1
            self._free.extend(victims)
            self.evicted += len(victims)


@dataclass
class ByteDFA:
    """A complete deterministic automaton over bytes: ``table[s, b]`` the state after byte ``b``
    in state ``s`` (int ``[S, 256]``), ``accept[s]`` whether a text may end in ``s``, ``start``
    the state of the empty text. State 0 is dead where ``dead0`` (the default)."""

    table: np.ndarray
    accept: np.ndarray
    start: int
    dead0: bool = True

    @property
    def n_states(self) -> int:
        return int(self.table.shape[0])

    def walk(self, data: bytes, state: int | None = None) -> int:
        s = self.start if state is None else state
        for byte in data:
            s = int(self.table[s, byte])
        return s

    def matches(self, data: bytes) -> bool:
        return bool(self.accept[self.walk(data)])

    def to_nfa(self) -> ByteNFA:
        """The same language as a :class:`~.bytenfa.ByteNFA` (one position per state, an arc per
        run of bytes with one next state)."""
        table = np.asarray(self.table)
        n = table.shape[0]
        arcs: list[list[tuple[object, int]]] = []
        for s in range(n):
            row = table[s]
            cuts = np.flatnonzero(np.diff(row)) + 1
            starts = np.concatenate([[0], cuts]).tolist()
            ends = np.concatenate([cuts, [256]]).tolist()
            out = []
            for x, y in zip(starts, ends, strict=True):
                t = int(row[x])
                if not (self.dead0 and t == 0):
                    out.append((range_trie(x, y - 1), t))
            arcs.append(out)
        finals = np.flatnonzero(np.asarray(self.accept)).tolist()
        return ByteNFA([[] for _ in range(n)], arcs, int(self.start), finals)
