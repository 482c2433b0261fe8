"""The built-in controller's particles as arrays: weights, tokens, how each ended, histories.

A step changes every live particle, so :class:`~.algorithm.SMCController` keeps what it knows of
its particles in numpy arrays indexed by particle and changes them with one operation per field,
whatever the number of particles (:meth:`Book.take`, :meth:`Book.resample`); only the
constraint's states, which are the constraint's own objects, stay a list. The arithmetic on the
weights is the same float64 operations, in the same order, as one particle at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: A particle's status codes (:attr:`Book.status`), and their names (:data:`STATUS`).
LIVE, FINISHED, CUT, DEAD = 0, 1, 2, 3
STATUS = ("live", "finished", "cut", "dead")


class Book:
    """``n`` particles of a run of at most ``cap`` tokens each, whose tokens in ``eos`` end them.

    ``log_w``: float64 ``[n]`` log weights. ``status``: int8 ``[n]`` (:data:`LIVE`,
    :data:`FINISHED`, :data:`CUT`, :data:`DEAD`). ``lens``: int64 ``[n]``, tokens each particle
    took (not the one that ended it); ``seq[i, :lens[i]]`` are they (int32: token ids are below
    2**31; as wide as the longest so far needs, doubling up to ``cap``). ``history``: int64
    ``[n]``, a number per particle naming its token history:
    two live particles have equal numbers exactly when they took the same tokens (and so have
    the same constraint state and mask); ``distinct``: whether the live particles' numbers are
    pairwise distinct (no two share a history), known without looking at them.
    """

    __slots__ = ("cap", "distinct", "eos", "history", "lens", "log_w", "n", "next_history", "seq", "status")

    def __init__(self, n: int, cap: int, eos: Sequence[int]) -> None:
        self.n, self.cap = n, cap
        self.eos = np.array(sorted(set(eos)), dtype=np.int64)
        self.log_w = np.zeros(n)
        self.status = np.zeros(n, dtype=np.int8)
        self.lens = np.zeros(n, dtype=np.int64)
        self.seq = np.zeros((n, min(cap, 64)), dtype=np.int32)
        self.history = np.zeros(n, dtype=np.int64)  # every particle starts from the empty history
        self.next_history = 1  # numbers given so far are below this one
        self.distinct = n == 1

    def take(self, idx: np.ndarray, tok: np.ndarray, incr: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int | None]]:
        """Live particles ``idx`` (int64 ``[m]``, distinct) take ``tok`` (int64 ``[m]``; ``-1``:
        the particle dies, its increment is ``-inf``; an EOS id: it finishes) and their weights
        grow by ``incr`` (float64 ``[m]``). A particle that took a token and reached ``cap``
        tokens is cut. Returns ``(moved, tokens, out)``: the particles that took a token other
        than EOS and their tokens (their constraint states advance), and for each of ``idx`` the
        token its runner feeds it next (None: it ended)."""
        self.log_w[idx] += incr  # the same float64 sums as one by one
        dead = tok < 0
        ended = dead.copy()
        for e in self.eos.tolist():
            ended |= tok == e
        out: list[int | None] = tok.tolist()
        if ended.any():
            self.status[idx[dead]] = DEAD
            self.status[idx[ended & ~dead]] = FINISHED
            keep = ~ended
            moved, moves = idx[keep], tok[keep]
        else:
            keep, moved, moves = None, idx, tok
        if len(moved):
            at = self.lens[moved]
            if int(at.max()) >= self.seq.shape[1]:
                self._grow()
            self.seq[moved, at] = moves
            at += 1
            self.lens[moved] = at
            self._number(moved, moves)
            cut = at >= self.cap
            if cut.any():
                self.status[moved[cut]] = CUT
                if keep is None:
                    ended = cut
                else:
                    ended[np.flatnonzero(keep)[cut]] = True
        if ended.any():
            for k in np.flatnonzero(ended).tolist():
                out[k] = None
        return moved, moves, out

    def _grow(self) -> None:
        """Double the token columns (up to ``cap``)."""
        width = self.seq.shape[1]
        seq = np.zeros((self.n, min(self.cap, 2 * width)), dtype=np.int32)
        seq[:, :width] = self.seq
        self.seq = seq

    def _number(self, moved: np.ndarray, moves: np.ndarray) -> None:
        """New history numbers for the particles that took a token: equal exactly where the old
        numbers and the tokens are equal (fresh numbers, above every number given before)."""
        base = self.next_history
        if self.distinct:  # distinct histories stay distinct whatever tokens they take
            self.history[moved] = base + np.arange(len(moved))
            self.next_history = base + len(moved)
            return
        key = self.history[moved] * (int(moves.max()) + 1) + moves  # < 2**62: numbers and ids < 2**31
        uniq, inverse = np.unique(key, return_inverse=True)
        self.history[moved] = base + inverse
        self.next_history = base + len(uniq)
        self.distinct = len(uniq) == len(moved)

    def resample(self, parents: Sequence[int]) -> None:
        """Particle ``i`` becomes a copy of particle ``parents[i]`` (weights reset to 0)."""
        p = np.asarray(parents, dtype=np.int64)
        width = int(self.lens.max())
        self.seq[:, :width] = self.seq[p, :width]
        self.lens = self.lens[p]
        self.status = self.status[p]
        self.history = self.history[p]
        self.log_w = np.zeros(self.n)
        live = p[self.status == LIVE]  # the live copies' parents, live themselves
        self.distinct = self.distinct and len(np.unique(live)) == len(live)

    def any_live(self) -> bool:
        return bool((self.status == LIVE).any())

    def tokens(self, i: int) -> list[int]:
        """Particle ``i``'s tokens (a new list)."""
        return self.seq[i, : self.lens[i]].tolist()

    def status_of(self, i: int) -> str:
        return STATUS[self.status[i]]

    def first_of_each(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """None when the particles ``idx`` have distinct histories; else ``(reps, index)``: one
        particle per distinct history, in order of first appearance in ``idx``, and for each of
        ``idx`` the position of its history's particle in ``reps``."""
        if self.distinct:
            return None
        h = self.history[idx]
        uniq, first, inverse = np.unique(h, return_index=True, return_inverse=True)
        if len(uniq) == len(h):
            return None
        order = np.argsort(first, kind="stable")
        rank = np.empty(len(uniq), dtype=np.int64)
        rank[order] = np.arange(len(uniq))
        return idx[first[order]], rank[inverse]
