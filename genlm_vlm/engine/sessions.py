"""The session table: which engine request holds the KV cache of which token sequence.

A *session* is one vLLM streaming-input request. After each chunk it is parked by vLLM with its
KV blocks kept; we call it *idle*. A query whose tokens extend an idle session's tokens (same
adapter) becomes a chunk with only the new tokens; while the chunk runs the session is *live*.

Pure Python, no vLLM. Threading: owned by the engine thread; nothing here is thread-safe.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from ..dedup import TokensKey

Tokens = tuple[int, ...]


@dataclass(eq=False)
class Session:
    """One engine request kept alive across chunks."""

    rid: str
    adapter: int
    tokens: Tokens
    """Every token fed to the session so far (its KV is computed up to the last one)."""
    chunks: int = 0
    """Chunks sent after the first request (used to make each chunk's capture tag unique)."""
    key: TokensKey | None = None
    """Its index key ``(adapter, tokens)`` while it is idle."""


@dataclass
class SessionCounters:
    opened: int = 0
    """Sessions opened for a query that extended no idle session."""
    continued: int = 0
    """Queries sent as a chunk of an idle session."""
    forked: int = 0
    """Queries that extended a session another query of the same group continued (a new
    session was opened for them)."""
    evicted: int = 0
    """Idle sessions released (count cap, KV pressure, stall, clear_cache, release_sessions)."""
    closed: int = 0
    """Sessions that ended otherwise (cancelled, failed)."""


@dataclass
class SessionTable:
    """Idle sessions indexed by ``(adapter, tokens)``, in LRU order; live sessions by id."""

    idle: OrderedDict[str, Session] = field(default_factory=OrderedDict)
    live: dict[str, Session] = field(default_factory=dict)
    counters: SessionCounters = field(default_factory=SessionCounters)
    _index: dict[TokensKey, Session] = field(default_factory=dict)
    _lengths: dict[int, Counter[int]] = field(default_factory=dict)

    # ---------------------------------------------------------------- lookup
    def find(self, adapter: int, ids: Tokens) -> Session | None:
        """The idle session of ``adapter`` whose tokens are the longest proper prefix of ``ids``."""
        lengths = self._lengths.get(adapter)
        if not lengths:
            return None
        n = len(ids)
        if n - 1 in lengths:  # the SMC case: one new token
            s = self._index.get(TokensKey(adapter, ids[:-1]))
            if s is not None:
                return s
        for length in sorted(lengths, reverse=True):
            if length < n - 1:
                s = self._index.get((adapter, ids[:length]))
                if s is not None:
                    return s
        return None

    # ---------------------------------------------------------------- transitions
    def open(self, rid: str, adapter: int, ids: Tokens) -> Session:
        """A new live session."""
        s = Session(rid, adapter, ids)
        self.live[rid] = s
        return s

    def claim(self, s: Session, ids: Tokens) -> Tokens:
        """Make idle ``s`` live for query ``ids``; returns the chunk (the new tokens)."""
        self._unindex(s)
        chunk = ids[len(s.tokens) :]
        s.tokens = ids
        s.chunks += 1
        self.live[s.rid] = s
        return chunk

    def extend(self, s: Session, tokens: Tokens) -> None:
        """Record that ``tokens`` were fed to live ``s`` (sampling inside a session)."""
        s.tokens = s.tokens + tokens
        s.chunks += 1

    def park(self, rid: str, key: TokensKey | None = None) -> Session | None:
        """Live -> idle (most recently used). Returns an older idle session with the same tokens,
        which the caller should evict (it is no longer reachable through the index). ``key``:
        the query's key when the session's tokens are that query's ids (saves hashing them)."""
        s = self.live.pop(rid, None)
        if s is None:
            return None
        key = s.key = TokensKey.of(s.adapter, s.tokens, key)
        old = self._index.get(key)
        if old is not None:
            self._unindex(old)
        self.idle[rid] = s
        self._index[key] = s
        self._lengths.setdefault(s.adapter, Counter())[len(s.tokens)] += 1
        return old

    def drop(self, rid: str) -> Session | None:
        """Forget a session (live or idle), e.g. after its request was aborted."""
        s = self.live.pop(rid, None)
        if s is None:
            s = self.idle.get(rid)
            if s is not None:
                self._unindex(s)
        return s

    def lru(self) -> Session | None:
        """The least recently used idle session."""
        return next(iter(self.idle.values()), None)

    def _unindex(self, s: Session) -> None:
        if self.idle.pop(s.rid, None) is None:
            return
        key = s.key if s.key is not None else TokensKey(s.adapter, s.tokens)
        s.key = None
        if self._index.get(key) is s:
            del self._index[key]
        lengths = self._lengths[s.adapter]
        lengths[len(s.tokens)] -= 1
        if lengths[len(s.tokens)] <= 0:
            del lengths[len(s.tokens)]

    # ---------------------------------------------------------------- stats
    def snapshot(self) -> dict[str, int]:
        c = self.counters
        return {
            "opened": c.opened,
            "continued": c.continued,
            "forked": c.forked,
            "evicted": c.evicted,
            "closed": c.closed,
            "live": len(self.live),
            "idle": len(self.idle),
        }
