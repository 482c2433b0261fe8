"""Which deterministic states must have the same mask row: signatures of their near futures.

A state's text-token row (:meth:`~.automaton.TokenMasks._text_row`) depends only on the byte
strings of at most ``L`` bytes (``L`` the vocabulary's longest token) that can be read from it:
a token may come next exactly when its bytes are a prefix of such a string (every position of a
state is live, so any string its positions can read leads somewhere live). A token of ``L`` bytes
touches at most ``L`` characters, so the strings are fixed by the *first ``L`` character steps*
of the state's positions: which code point set (which UTF-8 trie) each step reads, or, for a
position inside a character, which trie node it is at.

:class:`Futures` names those first ``d`` steps by a small integer, the *signature*, built bottom
up and interned (equal structures, equal integers; never a hash that could collide):

* ``sig(p, 0) = 0`` for every position;
* a code point state ``p``: the set of ``(trie, sig(closure(target), d - 1))`` of its arcs to
  live targets;
* a position inside an arc's trie: ``(trie, node, sig(closure(target), d - 1))``;
* a set of positions: the set of its members' signatures.

Two states with equal depth-``L`` signatures read the same strings of ``L`` characters, so they
have the same text row (the converse need not hold: the signature is a sufficient test, never a
guess). The states a counted repeat makes as it advances (``[a-z ]{1000}`` after ``k`` and after
``k + 1`` characters, ``\\w{1,20}`` in each of 40 words) differ only by which copy of the repeated
part they are in, and share a signature while the repeat's end is more than ``L`` characters
away: their row is walked once, not once per copy.

A signature costs one entry per (position, depth) it meets, memoised: a counted repeat's next
state costs about ``L`` new entries. A request that would need more than :data:`BUDGET` of work,
or meets a closure of more than :data:`MAX_CLOSURE` positions, gives up (the caller walks the
vocabulary instead); past :data:`MAX_ENTRIES` entries the memo and
the interned structures are dropped together, with every row filed under them (:attr:`rows`), so
an integer never names two structures.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from .bytenfa import ByteNFA
from .regex import paused_gc

#: Work one signature may do (new (position, depth) entries and the members of the sets they
#: read) before it gives up.
BUDGET = 4096
#: Signatures that may give up, none computed, before sharing is turned off for the automaton.
GIVE_UP = 8
#: A signature that meets an arc whose target's closure holds more positions gives up.
MAX_CLOSURE = 256
#: Entries (memo, interned structures and closures together: some 200 bytes each) kept before
#: all are dropped.
MAX_ENTRIES = 1 << 17
#: Deepest signature computed (the recursion is two frames per level): past it, no sharing.
MAX_DEPTH = 200


class _OverBudget(Exception):
    pass


class Futures:
    """Depth-``depth`` signatures of sets of ``nfa``'s positions (see the module docstring), and
    the text rows filed under them (:attr:`rows`, at most ``max_rows``, least recently used
    dropped). Not thread-safe: the caller holds the mask table's lock."""

    def __init__(self, nfa: ByteNFA, depth: int, max_rows: int) -> None:
        self.nfa = nfa
        self.depth = int(depth)
        self.enabled = 0 < self.depth <= MAX_DEPTH
        self.max_rows = max(1, int(max_rows))
        _src, trie_of, _targets, _tries = nfa._arcs
        self._trie_of: list[int] = trie_of.tolist()
        self._ids: dict[object, int] = {}
        self._memo: dict[int, int] = {}  # position * (MAX_DEPTH + 1) + depth -> signature
        self._closures: dict[int, tuple[int, ...]] = {}
        self._left = 0
        #: Packed text rows by depth-``depth`` signature, least recently used first.
        self.rows: OrderedDict[int, np.ndarray] = OrderedDict()
        self.computed = 0  # signatures computed
        self.gave_up = 0  # signatures that passed the budget

    def signature(self, positions: Sequence[int]) -> int | None:
        """The depth-:attr:`depth` signature of the set ``positions`` (a state's), or None where
        it would cost more than :data:`BUDGET` new entries (or sharing is off)."""
        if not self.enabled:
            return None
        if len(self._memo) + len(self._ids) + len(self._closures) > MAX_ENTRIES:
            self._ids.clear()
            self._memo.clear()
            self._closures.clear()
            self.rows.clear()
        self._left = BUDGET
        try:
            with paused_gc():  # many small sets: collections would walk every object of the process
                got = self._set(positions, self.depth)
        except _OverBudget:
            self.gave_up += 1
            if self.gave_up >= GIVE_UP and not self.computed:
                self.enabled = False
            return None
        self.computed += 1
        return got

    def _intern(self, structure: object) -> int:
        got = self._ids.get(structure)
        if got is None:
            got = self._ids[structure] = len(self._ids) + 1  # 0: the depth-0 signature
        return got

    def _set(self, positions: Sequence[int], d: int) -> int:
        if d == 0:
            return 0
        self._left -= len(positions)
        return self._intern(tuple(sorted({self._position(p, d) for p in positions})))

    def _closure(self, t: int) -> tuple[int, ...]:
        got = self._closures.get(t)
        if got is None:
            got = tuple(self.nfa.closure([t]).tolist())
            if len(got) > MAX_CLOSURE:  # a wide future (nested optional repeats): not signed
                raise _OverBudget
            self._closures[t] = got
        return got

    def _position(self, p: int, d: int) -> int:
        at = p * (MAX_DEPTH + 1) + d
        got = self._memo.get(at)
        if got is not None:
            return got
        self._left -= 1
        if self._left < 0:
            raise _OverBudget
        nfa = self.nfa
        live, targets, trie_of = nfa.live, nfa.arc_target, self._trie_of
        if p < nfa.n:
            structure: object = ("s", *sorted({
                (trie_of[a], self._set(self._closure(targets[a]), d - 1))
                for a in range(nfa.arc_first[p], nfa.arc_first[p + 1]) if live[targets[a]]
            }))
        else:
            a, node = divmod(p - nfa.n, nfa.width)
            t = targets[a]
            structure = ("i", trie_of[a], node, self._set(self._closure(t), d - 1)) if live[t] else ("i",)
        got = self._memo[at] = self._intern(structure)
        return got

    def file(self, signature: int, row: np.ndarray) -> None:
        """File ``row`` (a packed text row) under ``signature``."""
        self.rows[signature] = row
        while len(self.rows) > self.max_rows:
            self.rows.popitem(last=False)

    def find(self, signature: int) -> np.ndarray | None:
        """The row filed under ``signature``, if any."""
        got = self.rows.get(signature)
        if got is not None:
            self.rows.move_to_end(signature)
        return got
