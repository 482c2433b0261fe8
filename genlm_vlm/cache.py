"""Bounded LRU cache for next-token outputs (torch tensors), with admission on a second request.

The cache maps hashable keys (the library uses :class:`~genlm_vlm.dedup.TokensKey`, equal to and
hashing like ``(adapter_id, tuple(token_ids))``)
to tensors and is bounded both by the number of entries and by the total number
of bytes held by the stored tensors.  It is built on :class:`cachetools.LRUCache`
and guarded by a :class:`threading.Lock`, so it may be shared between the asyncio
event-loop thread and synchronous code paths running on other threads.

Admission: computed rows are offered with :meth:`OutputCache.offer`, which by default keeps a
row only once it has been asked for twice: by two callers of the same computation (identical
prompts in flight together), or by a later caller after an earlier computation (the first
time, only the key's hash is remembered). A workload that never asks for a row twice, such as
SMC, where every particle's context is new at every step, then pays no copy, no memory and no
eviction for the cache; a row asked for again later is computed once more, kept, and served
from the cache from then on. ``admit_after=1`` keeps every computed row.
:meth:`OutputCache.put` always stores.

Ownership rule: the cache stores the tensor *object it was given* (no copy), unless
that tensor is a view into a larger storage (one row of a batched ``[N, V]`` tensor), which
is stored as a compact copy, so that the byte bound counts the bytes the cache actually keeps
alive. :meth:`OutputCache.get` returns the stored object. Callers must therefore

* not mutate a tensor after ``put``-ing or ``offer``-ing it (when it was kept), and
* hand out a copy (e.g. ``tensor.clone()``) of whatever ``get`` returns, so that
  end users cannot corrupt the cached value.

Byte accounting uses ``tensor.element_size() * tensor.nelement()``, which for the compact
tensors the cache stores is the size of their storage.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Hashable, Mapping
from typing import Any

import cachetools

__all__ = ["DEFAULT_MAX_BYTES", "OutputCache", "owns_its_memory", "tensor_nbytes"]

#: Default byte bound used by :meth:`OutputCache.from_options` (2 GiB).
DEFAULT_MAX_BYTES: int = 2 * 1024**3

#: How many keys of rows offered once and not kept are remembered when there is no entry
#: bound (``max_entries=None``); otherwise ``max_entries`` of them.
DEFAULT_SEEN_KEYS: int = 65_536

_KNOWN_OPTS = frozenset({"max_bytes", "admit_after"})


def owns_its_memory(value: Any) -> bool:
    """False for a tensor that is a view into a larger storage (anything else: True)."""
    storage = getattr(value, "untyped_storage", None)
    if storage is None:
        return True
    return value.storage_offset() == 0 and storage().nbytes() == value.numel() * value.element_size()


def tensor_nbytes(value: Any) -> int:
    """Return the number of bytes accounted for ``value``.

    For torch tensors (anything with ``element_size`` and ``nelement``) this is
    ``element_size() * nelement()``; for other objects ``sys.getsizeof`` is used
    as a rough fallback.
    """
    element_size = getattr(value, "element_size", None)
    nelement = getattr(value, "nelement", None)
    if callable(element_size) and callable(nelement):
        return int(element_size()) * int(nelement())
    return sys.getsizeof(value)


class OutputCache:
    """Thread-safe LRU cache of tensors, bounded by entry count and total bytes.

    Args:
        max_entries: Maximum number of stored entries. ``None`` means no entry
            bound; ``0`` disables the cache entirely (``put`` / ``offer`` store
            nothing and ``get`` always misses).
        max_bytes: Maximum total bytes (see :func:`tensor_nbytes`) of the stored
            values. ``None`` means no byte bound. A single value larger than
            ``max_bytes`` is not stored at all (and any older value under the
            same key is removed).
        admit_after: :meth:`offer` keeps a value once its key has been asked for this many
            times: ``2`` (default) from the second request on, ``1`` always. The keys (their
            hashes) of values offered and not kept are remembered for the last ``max_entries``
            such values (:data:`DEFAULT_SEEN_KEYS` when ``max_entries`` is None).

    After every store the least-recently-used entries are evicted until both
    bounds hold.  ``get`` counts as a use (refreshes recency); ``in`` does not.

    Counters: ``hits`` / ``misses`` are updated by :meth:`get` only;
    ``evictions`` counts entries removed to satisfy the bounds; ``not_admitted`` counts values
    :meth:`offer` did not keep (asked for once so far).
    """

    def __init__(
        self,
        max_entries: int | None = 10_000,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        admit_after: int = 2,
    ):
        if max_entries is not None and max_entries < 0:
            raise ValueError(f"max_entries must be >= 0 or None, got {max_entries!r}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes!r}")
        if type(admit_after) is not int or admit_after not in (1, 2):
            raise ValueError(f"admit_after must be 1 (keep every row) or 2 (keep a row asked for twice), "
                             f"got {admit_after!r}")
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._enabled = max_entries != 0 and max_bytes != 0
        self._admit_after = admit_after
        # Unbounded at the cachetools level: both bounds are enforced in ``put``
        # so that they are checked together. ``currsize`` tracks total bytes.
        self._lru: cachetools.LRUCache = cachetools.LRUCache(
            maxsize=math.inf, getsizeof=tensor_nbytes
        )
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._not_admitted = 0
        # Hashes of keys offered once and not kept, in two generations: when the newer one
        # holds ``_seen_cap`` hashes it becomes the older one (the oldest hashes are forgotten).
        self._seen_cap = max(1, max_entries if max_entries is not None else DEFAULT_SEEN_KEYS)
        self._seen: set[int] = set()
        self._seen_old: set[int] = set()

    # ------------------------------------------------------------------ build
    @classmethod
    def from_options(
        cls, cache_size: int | None, cache_opts: Mapping[str, Any] | None = None
    ) -> OutputCache:
        """Build a cache from user-facing options.

        Args:
            cache_size: Entry bound. ``None`` = unbounded entry count, ``0`` =
                caching disabled.
            cache_opts: Optional mapping; recognised keys ``max_bytes`` (int or
                ``None`` for no byte bound, default :data:`DEFAULT_MAX_BYTES`) and
                ``admit_after`` (``2``, the default: a row is kept once it has been asked
                for twice; ``1``: every computed row is kept).
                Unknown keys raise ``ValueError`` (to catch typos).
        """
        opts = dict(cache_opts or {})
        unknown = set(opts) - _KNOWN_OPTS
        if unknown:
            raise ValueError(
                f"unknown cache_opts {sorted(unknown)}; supported: {sorted(_KNOWN_OPTS)}"
            )
        return cls(max_entries=cache_size, max_bytes=opts.get("max_bytes", DEFAULT_MAX_BYTES),
                   admit_after=opts.get("admit_after", 2))

    # ------------------------------------------------------------ properties
    @property
    def enabled(self) -> bool:
        """False when the cache can store nothing (``max_entries=0`` or ``max_bytes=0``)."""
        return self._enabled

    @property
    def max_entries(self) -> int | None:
        """Entry bound (``None`` = unbounded, ``0`` = disabled)."""
        return self._max_entries

    @property
    def max_bytes(self) -> int | None:
        """Byte bound (``None`` = unbounded)."""
        return self._max_bytes

    @property
    def admit_after(self) -> int:
        """How many requests of a key make :meth:`offer` keep its value (1 or 2)."""
        return self._admit_after

    @property
    def nbytes(self) -> int:
        """Total accounted bytes of the stored values."""
        with self._lock:
            return int(self._lru.currsize)

    @property
    def hits(self) -> int:
        """Number of :meth:`get` calls that found their key."""
        return self._hits

    @property
    def misses(self) -> int:
        """Number of :meth:`get` calls that did not find their key."""
        return self._misses

    @property
    def evictions(self) -> int:
        """Number of entries evicted to satisfy the bounds."""
        return self._evictions

    @property
    def not_admitted(self) -> int:
        """Number of values :meth:`offer` did not keep (asked for once so far)."""
        return self._not_admitted

    def stats(self) -> dict[str, int | None]:
        """Snapshot of sizes, bounds and counters."""
        with self._lock:
            return {
                "entries": len(self._lru),
                "nbytes": int(self._lru.currsize),
                "max_entries": self._max_entries,
                "max_bytes": self._max_bytes,
                "admit_after": self._admit_after,
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "not_admitted": self._not_admitted,
            }

    # ------------------------------------------------------------ operations
    def get(self, key: Hashable) -> Any | None:
        """Return the stored value for ``key`` (marking it most recently used), or ``None``.

        The returned object is the cached tensor itself, not a copy: callers
        must clone it before handing it to code that might mutate it.
        """
        with self._lock:
            # ``in`` then ``[]``: a miss raises no KeyError (the common case when nothing hits).
            if self._enabled and key in self._lru:
                self._hits += 1
                return self._lru[key]
            self._misses += 1
            return None

    def put(self, key: Hashable, value: Any) -> bool:
        """Store ``value`` under ``key`` (replacing any old value) and evict LRU entries.

        The value is stored as-is (no copy), unless it is a view into a larger storage, which
        is stored as a compact copy. Returns whether it was stored: False when the cache is
        disabled, or for a value larger than ``max_bytes`` (an existing entry for ``key`` is
        then dropped).
        """
        if not self._enabled:
            return False
        if not owns_its_memory(value):
            value = value.clone()  # a view would keep its whole batch alive
        size = tensor_nbytes(value)
        with self._lock:
            return self._store_locked(key, value, size)

    def offer(self, key: Hashable, value: Any, asks: int = 1) -> bool:
        """A computed ``value`` for ``key``, asked for by ``asks`` callers together: store it
        (as :meth:`put`) if it was asked for at least ``admit_after`` times, counting the
        callers of earlier offers of ``key``; else only remember ``key``'s hash.

        Returns whether the value was stored. When it was not, the cache holds no reference
        to ``value``: the caller may hand it out as is.
        """
        if not self._enabled:
            return False
        if asks < self._admit_after:
            h = hash(key)
            with self._lock:
                if h not in self._seen and h not in self._seen_old:
                    self._not_admitted += 1
                    seen = self._seen
                    seen.add(h)
                    if len(seen) >= self._seen_cap:
                        self._seen_old, self._seen = seen, set()
                    return False
        return self.put(key, value)

    def _store_locked(self, key: Hashable, value: Any, size: int) -> bool:
        if self._max_bytes is not None and size > self._max_bytes:
            self._lru.pop(key, None)
            return False
        self._lru[key] = value
        self._evict_locked()
        return True

    def _evict_locked(self) -> None:
        lru = self._lru
        while (self._max_entries is not None and len(lru) > self._max_entries) or (
            self._max_bytes is not None and lru.currsize > self._max_bytes
        ):
            lru.popitem()
            self._evictions += 1

    def pop(self, key: Hashable) -> Any | None:
        """Remove and return the value for ``key`` (``None`` if absent)."""
        with self._lock:
            return self._lru.pop(key, None)

    def clear(self) -> None:
        """Remove every entry and forget the keys offered once (counters are kept)."""
        with self._lock:
            self._lru.clear()
            self._seen.clear()
            self._seen_old.clear()

    def __contains__(self, key: object) -> bool:
        """Membership test; does not affect recency or counters."""
        with self._lock:
            return key in self._lru

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def __repr__(self) -> str:
        return (
            f"OutputCache(entries={len(self)}, nbytes={self.nbytes}, "
            f"max_entries={self._max_entries}, max_bytes={self._max_bytes})"
        )
