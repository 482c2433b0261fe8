"""The session table: which engine request holds the KV cache of which token sequence.

A *session* is one vLLM streaming-input request. After each chunk it is parked by vLLM with its
KV blocks kept; we call it *idle*. A query whose tokens extend an idle session's tokens (same
adapter) becomes a chunk with only the new tokens; while the chunk runs the session is *live*.

When a session is continued, the tokens it had computed stay in its KV blocks whatever it
computes next; the table remembers them as the session's *base*. A later query that extends a
session's base but not its current tokens (a sibling after an SMC resample: the first sibling
continued the parent) is a *fork*: a new session that may share the parent's KV, tail block
included (see :mod:`.forks`).

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
    base: TokensKey | None = None
    """The tokens it had computed when it was last continued (its KV still holds them), as a
    key of the fork index; None before its first continuation."""


@dataclass
class SessionCounters:
    opened: int = 0
    """Sessions opened for a query that extended no idle session."""
    continued: int = 0
    """Queries sent as a chunk of an idle session."""
    forked: int = 0
    """Queries that extended what a continued session had computed before (a sibling after a
    resample): a new session was opened for each, as a fork of that session."""
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
    _bases: dict[TokensKey, Session] = field(default_factory=dict)
    _base_lengths: dict[int, Counter[int]] = field(default_factory=dict)

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

    def find_fork(self, adapter: int, ids: Tokens) -> Session | None:
        """The session of ``adapter`` whose base (see :attr:`Session.base`) is the longest
        proper prefix of ``ids``: a parent whose KV the query can share."""
        lengths = self._base_lengths.get(adapter)
        if not lengths:
            return None
        n = len(ids)
        if n - 1 in lengths:  # the SMC case: a sibling's one new token
            s = self._bases.get(TokensKey(adapter, ids[:-1]))
            if s is not None:
                return s
        for length in sorted(lengths, reverse=True):
            if length < n - 1:
                s = self._bases.get((adapter, ids[:length]))
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
        """Make idle ``s`` live for query ``ids``; returns the chunk (the new tokens). Its
        current tokens become its base (forks of them may share its KV)."""
        base = s.key if s.key is not None else TokensKey(s.adapter, s.tokens)
        self._unindex(s)
        self._set_base(s, base)
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
            self._set_base(old, None)
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
        if s is not None:
            self._set_base(s, None)
        return s

    def lru(self) -> Session | None:
        """The least recently used idle session."""
        return next(iter(self.idle.values()), None)

    def _set_base(self, s: Session, key: TokensKey | None) -> None:
        """Replace ``s``'s entry in the fork index (None: remove it)."""
        old = s.base
        if old is not None:
            if self._bases.get(old) is s:
                del self._bases[old]
                lengths = self._base_lengths[s.adapter]
                lengths[len(old.ids)] -= 1
                if lengths[len(old.ids)] <= 0:
                    del lengths[len(old.ids)]
            s.base = None
        if key is None:
            return
        other = self._bases.get(key)
        if other is not None:  # the same tokens in two sessions: the newer one serves forks
            self._set_base(other, None)
        s.base = key
        self._bases[key] = s
        self._base_lengths.setdefault(s.adapter, Counter())[len(key.ids)] += 1

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
