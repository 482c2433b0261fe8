"""Which replica serves a query: session and prefix affinity first, load second.

Pure Python (no Ray, no vLLM); :class:`Router` is thread-safe (one lock around every method).

A replica's engine keeps, per SMC particle, an idle *session* holding the KV cache of the
particle's last query, and a prefix cache of full KV blocks. The router mirrors both, bounded
(least recently used entries dropped first) and without keeping token lists (entries are keyed
by adapter, length and hash of the ids; a collision could only misroute, never change a row):

* sessions: the last query routed per particle -> replica. A query that extends a recorded
  query (the SMC step: one more token) or repeats it goes to that replica, always: a *session
  hit*. The record is then *claimed* (the replica continues that session, one token of compute)
  and the new query recorded. A second query extending the same record (a fork after
  resampling) finds it claimed: the replica would open a new session for it from its prefix
  cache, so it is routed as a prefix hit of the claimed record's length.
* blocks: chained hashes of the full ``block_size``-token blocks of routed queries -> the replica
  that last got them (vLLM's prefix cache works at that granularity).

A query with no session hit goes to the replica holding its longest recorded prefix (claimed
record or blocks) when that covers at least ``min_match`` of it (a *prefix hit*), unless that
replica has more than ``balance_threshold`` queries in flight beyond the least-loaded live
replica: then it *spills* there. Otherwise (*by load*) it goes to the least-loaded live replica:
fewest queries in flight, then fewest recorded sessions. Entries of a dead or restarted replica
are ignored (each carries the replica's generation) and dropped when met.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

Tokens = tuple[int, ...]
_Key = tuple[Hashable, int, int]  # (adapter, length, hash of the token ids)

#: Counters kept per replica (see :meth:`Router.snapshot`).
COUNTERS = ("routed", "session_hits", "prefix_hits", "by_load", "spilled", "failed")


class ReplicaDiedError(RuntimeError):
    """A replica of a :class:`~genlm_vlm.ReplicaPool` died (or none is live).

    ``replica`` is the index of the replica whose in-flight call failed, or None when no live
    replica was left to route a query to. The pool keeps serving with its live replicas; call
    ``pool.restart_replica(i)`` to start a fresh one in slot ``i``.
    """

    def __init__(self, message: str, replica: int | None = None) -> None:
        super().__init__(message)
        self.replica = replica

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.replica))


class Router:
    """Routing table and load counters for ``num_replicas`` replicas (see the module docstring).

    Args:
        num_replicas: number of replica slots.
        block_size: the engines' KV block size (prefix-cache granularity), in tokens.
        max_routes: most entries kept in each of the session and block tables (least recently
            used dropped first; claimed records: an eighth of it, at least 1024). An entry is
            about 200 bytes whatever the query's length.
        min_match: a recorded prefix counts when it covers at least this fraction of the query.
        balance_threshold: a prefix hit spills to the least-loaded replica when its own replica
            has more than this many queries in flight beyond it. Session hits never spill.
    """

    def __init__(
        self,
        num_replicas: int,
        *,
        block_size: int = 32,
        max_routes: int = 100_000,
        min_match: float = 0.5,
        balance_threshold: int = 32,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas!r}")
        if block_size < 1 or max_routes < 1:
            raise ValueError("block_size and max_routes must be >= 1")
        if not 0.0 <= min_match <= 1.0:
            raise ValueError(f"min_match must be in [0, 1], got {min_match!r}")
        if balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {balance_threshold!r}")
        self.num_replicas = num_replicas
        self.block_size = int(block_size)
        self.max_routes = int(max_routes)
        self.max_claimed = max(1024, self.max_routes // 8)
        self.min_match = float(min_match)
        self.balance_threshold = int(balance_threshold)
        self._lock = threading.Lock()
        self._live = [True] * num_replicas
        self._gen = [0] * num_replicas
        self._load = [0] * num_replicas
        self._owned = [0] * num_replicas  # recorded (unclaimed) sessions per replica
        self._restarts = [0] * num_replicas
        self._counts = [dict.fromkeys(COUNTERS, 0) for _ in range(num_replicas)]
        # Keys are (adapter, length, hash of the ids): no token tuple is kept (a hash collision
        # can only misroute, never change a row). Values: (replica, generation).
        self._sessions: OrderedDict[_Key, tuple[int, int]] = OrderedDict()
        self._claimed: OrderedDict[_Key, tuple[int, int]] = OrderedDict()
        self._lengths: dict[Hashable, Counter[int]] = {}  # over both tables
        self._blocks: OrderedDict[tuple[Hashable, int], tuple[int, int]] = OrderedDict()

    # ------------------------------------------------------------------ routing
    def route_many(self, queries: Sequence[tuple[Hashable, Tokens]], *, record: bool = True) -> list[tuple[int, int]]:
        """Route ``(adapter key, token ids)`` queries in order; returns ``(replica, generation)``
        per query and counts each as in flight until :meth:`done`. ``record=False`` (sampling,
        warm-up) neither claims nor records sessions. Raises :class:`ReplicaDiedError` when no
        replica is live (nothing is counted then)."""
        with self._lock:
            if not any(self._live):
                raise ReplicaDiedError(
                    f"no live replica: all {self.num_replicas} replicas of the pool died; start "
                    "one again with pool.restart_replica(i)"
                )
            return [self._route(adapter, ids, record) for adapter, ids in queries]

    def route(self, adapter: Hashable, ids: Tokens, *, record: bool = True) -> tuple[int, int]:
        """One query (see :meth:`route_many`)."""
        return self.route_many([(adapter, ids)], record=record)[0]

    def _least_loaded(self) -> int:
        live = [i for i in range(self.num_replicas) if self._live[i]]
        return min(live, key=lambda i: (self._load[i], self._owned[i], i))

    def _route(self, adapter: Hashable, ids: Tokens, record: bool) -> tuple[int, int]:
        session, fork = self._find_session(adapter, ids)
        chain: list[int] | None = None
        if session is not None:
            replica, kind = self._sessions[session][0], "session_hits"
            if record:  # the replica continues that session: the record moves to ``ids``
                self._claim(session)
            if session[1] // self.block_size == len(ids) // self.block_size:
                chain = []  # no new full block: nothing to record in the block table
        else:
            least = self._least_loaded()
            chain = self._chain(ids)
            replica, matched = self._find_blocks(adapter, chain)
            if fork is not None and fork[1] > matched:  # a fork of a continued session
                replica, matched = self._claimed[fork][0], fork[1]
            if replica is not None and matched >= self.min_match * len(ids):
                if self._load[replica] - self._load[least] > self.balance_threshold:
                    replica, kind = least, "spilled"
                else:
                    kind = "prefix_hits"
            else:
                replica, kind = least, "by_load"
        if record:
            self._record(adapter, ids, replica, chain)
        self._load[replica] += 1
        counts = self._counts[replica]
        counts["routed"] += 1
        counts[kind] += 1
        return replica, self._gen[replica]

    # ------------------------------------------------------------------ sessions
    # A claimed record's session was continued by an extension; it stays (in a smaller table)
    # as a prefix record for forks of it until it ages out.
    def _find_session(self, adapter: Hashable, ids: Tokens, max_probes: int = 64) -> tuple[_Key | None, _Key | None]:
        """``(session, fork)``: the key of the longest unclaimed record of ``adapter`` that is a
        prefix of ``ids`` (or ``ids`` itself) on a live replica, else None; and the longest
        claimed one (forks), else None."""
        lengths = self._lengths.get(adapter)
        if not lengths:
            return None, None
        n = len(ids)
        fork: _Key | None = None
        probed = 0
        for m in (n - 1, n):  # the SMC step (one more token) first, then a repeat
            if m in lengths:
                probed += 1
                session, fork = self._probe(adapter, ids, m, fork)
                if session is not None:
                    return session, None
        if len(lengths) > probed:  # longer extensions: shorter recorded lengths, longest first
            for m in sorted((m for m in lengths if m < n - 1), reverse=True)[:max_probes]:
                session, fork = self._probe(adapter, ids, m, fork)
                if session is not None:
                    return session, None
        return None, fork

    def _probe(self, adapter: Hashable, ids: Tokens, m: int, fork: _Key | None) -> tuple[_Key | None, _Key | None]:
        key = (adapter, m, hash(ids[:m] if m < len(ids) else ids))
        for table in (self._sessions, self._claimed):
            entry = table.get(key)
            if entry is None:
                continue
            if not self._valid(entry):
                self._drop(table, key)  # a dead or restarted replica's record
            elif table is self._sessions:
                return key, fork
            elif fork is None or m > fork[1]:
                fork = key
        return None, fork

    def _valid(self, entry: tuple[int, int]) -> bool:
        return self._live[entry[0]] and entry[1] == self._gen[entry[0]]

    def _claim(self, key: _Key) -> None:
        """Move a (valid) record to the claimed table: its session now holds a longer query."""
        entry = self._sessions.pop(key)
        self._owned[entry[0]] -= 1
        if key in self._claimed:
            self._drop(self._claimed, key)
        self._claimed[key] = entry  # its length stays counted, now in this table
        while len(self._claimed) > self.max_claimed:
            self._drop(self._claimed, next(iter(self._claimed)))

    def _drop(self, table: OrderedDict[_Key, tuple[int, int]], key: _Key) -> None:
        replica, gen = table.pop(key)
        if table is self._sessions and gen == self._gen[replica]:
            self._owned[replica] -= 1
        self._count_length(key, -1)

    def _count_length(self, key: _Key, delta: int) -> None:
        lengths = self._lengths.get(key[0])
        if lengths is None:
            lengths = self._lengths[key[0]] = Counter()
        lengths[key[1]] += delta
        if lengths[key[1]] <= 0:
            del lengths[key[1]]

    def _record(self, adapter: Hashable, ids: Tokens, replica: int, chain: list[int] | None) -> None:
        key = (adapter, len(ids), hash(ids))
        for table in (self._sessions, self._claimed):
            if key in table:
                self._drop(table, key)
        gen = self._gen[replica]
        self._sessions[key] = (replica, gen)
        self._owned[replica] += 1
        self._count_length(key, +1)
        while len(self._sessions) > self.max_routes:
            self._drop(self._sessions, next(iter(self._sessions)))
        blocks = self._blocks
        for h in self._chain(ids) if chain is None else chain:
            bkey = (adapter, h)
            blocks[bkey] = (replica, gen)
            blocks.move_to_end(bkey)
        while len(blocks) > self.max_routes:
            blocks.popitem(last=False)

    # ------------------------------------------------------------------ blocks
    def _chain(self, ids: Tokens) -> list[int]:
        """Chained hashes of the full blocks of ``ids`` (hash i covers ``ids[:(i+1)*B]``)."""
        b = self.block_size
        out: list[int] = []
        h = 0
        for start in range(0, len(ids) - b + 1, b):
            h = hash((h, ids[start : start + b]))
            out.append(h)
        return out

    def _find_blocks(self, adapter: Hashable, chain: list[int]) -> tuple[int | None, int]:
        """The replica that got the longest recorded block prefix (``chain``: the query's
        :meth:`_chain`), and that prefix's length in tokens."""
        for i in range(len(chain) - 1, -1, -1):
            entry = self._blocks.get((adapter, chain[i]))
            if entry is None:
                continue
            if self._valid(entry):
                return entry[0], (i + 1) * self.block_size
            del self._blocks[(adapter, chain[i])]
        return None, 0

    # ------------------------------------------------------------------ outcomes
    def done(self, replica: int, gen: int, n: int = 1, *, failed: bool = False) -> None:
        """``n`` queries routed to ``replica`` (generation ``gen``) finished (or failed)."""
        with self._lock:
            if failed:
                self._counts[replica]["failed"] += n
            if gen == self._gen[replica]:
                self._load[replica] = max(0, self._load[replica] - n)

    def mark_dead(self, replica: int, gen: int) -> bool:
        """Take ``replica`` out of routing if ``gen`` is still its generation; True if it was
        live. Its table entries become stale (dropped when met)."""
        with self._lock:
            if gen != self._gen[replica] or not self._live[replica]:
                return False
            self._live[replica] = False
            self._gen[replica] += 1
            self._load[replica] = 0
            self._owned[replica] = 0
            return True

    def revive(self, replica: int) -> int:
        """A fresh engine serves slot ``replica`` (empty caches); returns its new generation."""
        with self._lock:
            self._gen[replica] += 1
            self._live[replica] = True
            self._load[replica] = 0
            self._owned[replica] = 0
            self._restarts[replica] += 1
            return self._gen[replica]

    def is_live(self, replica: int) -> bool:
        with self._lock:
            return self._live[replica]

    def generation(self, replica: int) -> int:
        with self._lock:
            return self._gen[replica]

    def live_replicas(self) -> list[int]:
        with self._lock:
            return [i for i in range(self.num_replicas) if self._live[i]]

    def clear(self) -> None:
        """Forget every recorded session and block (counters stay)."""
        with self._lock:
            self._sessions.clear()
            self._claimed.clear()
            self._lengths.clear()
            self._blocks.clear()
            self._owned = [0] * self.num_replicas

    def snapshot(self) -> dict[str, Any]:
        """Per replica: ``live``, ``inflight``, ``sessions`` (recorded), ``restarts`` and the
        counters ``routed``, ``session_hits``, ``prefix_hits``, ``by_load``, ``spilled``,
        ``failed``; plus the table sizes."""
        with self._lock:
            return {
                "replicas": [
                    {
                        "live": self._live[i],
                        "inflight": self._load[i],
                        "sessions": self._owned[i],
                        "restarts": self._restarts[i],
                        **self._counts[i],
                    }
                    for i in range(self.num_replicas)
                ],
                "session_entries": len(self._sessions),
                "claimed_entries": len(self._claimed),
                "block_entries": len(self._blocks),
            }
