"""Many particles' token moves through a lazy DFA in one compiled loop (numba).

:meth:`~.automaton.BoundAutomaton.advance_many` moves each particle's DFA state over the bytes of
the token it took. Walked one particle at a time in Python, that cost about 2.5 us a particle on
this project's CPU, the largest per-particle piece of the built-in controller's bookkeeping
(docs/BENCHMARKS.md, fourteenth session). :func:`walk` does every particle's walk in one call
over the DFA's table (``int32 [slots, 256]``, ``-1`` where a move is not made yet) and the
vocabulary's bytes laid end to end (:class:`TokenBytes`). A particle whose walk meets a move not
made yet, the dead state, or a token without bytes (an EOS id, a special token, an id outside
the vocabulary) is left to the caller (``-1``), who walks it as before: the answers are the
DFA's whichever way a walk went.
"""

from __future__ import annotations

import numpy as np

from .jit import Compiled


class TokenBytes:
    """Each token's bytes laid end to end: ``flat[starts[t]:starts[t] + lengths[t]]`` are token
    ``t``'s (``t < len(lengths)``); ``lengths[t] == 0`` for a token that has none or is an EOS
    id (its move is the caller's: see the module docstring)."""

    __slots__ = ("flat", "lengths", "starts")

    def __init__(self, ids: np.ndarray, lengths: np.ndarray, starts: np.ndarray, flat: np.ndarray, n: int) -> None:
        """Tokens ``ids`` (int64, distinct, below ``n``) whose bytes are ``flat[starts[k]:starts[k]
        + lengths[k]]`` (the layout :class:`~.automaton.TokenWalk` makes); every other token of
        ``range(n)`` has none."""
        self.lengths = np.zeros(n, dtype=np.int64)
        self.starts = np.zeros(n, dtype=np.int64)
        self.lengths[ids] = lengths
        self.starts[ids] = starts
        self.flat = np.array(flat if len(flat) else [0], dtype=np.uint8)  # writable (numba), not empty


def _walk(table, slots, tokens, starts, lengths, flat, out):  # pragma: no cover - run compiled
    """:func:`walk`'s loop (plain Python here: see :func:`_compile`)."""
    n_tokens = lengths.shape[0]
    for i in range(slots.shape[0]):
        s = slots[i]
        t = tokens[i]
        if s <= 0 or t < 0 or t >= n_tokens or lengths[t] == 0:
            out[i] = -1
            continue
        a = starts[t]
        for k in range(a, a + lengths[t]):
            s = np.int64(table[s, flat[k]])
            if s <= 0:  # a move not made yet (-1) or the dead state (0): the caller's
                break
        out[i] = s if s > 0 else -1


def _compile() -> object:
    import numba

    sig = "void(int32[:, ::1], int64[::1], int64[::1], int64[::1], int64[::1], uint8[::1], int64[::1])"
    return numba.njit(sig, cache=True, nogil=True)(_walk)


#: The walk, compiled on first use (:class:`~.jit.Compiled`).
_WALK = Compiled(_compile, "the compiled token walk", "particles are walked in Python")


def walker() -> object:
    """The compiled loop (compiled once per process on first use, then loaded from numba's disk
    cache), or None where it cannot be (no numba: the callers walk in Python)."""
    return _WALK.get()


def walk(table: np.ndarray, slots: np.ndarray, tokens: np.ndarray, vocab: TokenBytes) -> np.ndarray | None:
    """The slot each particle reaches: from ``slots[i]`` (int64; ``<= 0``: none) over token
    ``tokens[i]``'s bytes (int64) in ``table`` (the DFA's, C-contiguous int32 ``[S, 256]``; the
    caller holds the DFA's lock), ``-1`` where the caller must walk it (see the module
    docstring). None when the compiled loop is not available."""
    kernel = walker()
    if kernel is None:
        return None
    out = np.empty(len(slots), dtype=np.int64)
    kernel(table, slots, tokens, vocab.starts, vocab.lengths, vocab.flat, out)
    return out
