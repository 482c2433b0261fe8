"""Bounded LRU cache for next-token outputs (torch tensors).

The cache maps hashable keys (the library uses :class:`~genlm_vlm.dedup.TokensKey`, equal to and
hashing like ``(adapter_id, tuple(token_ids))``)
to tensors and is bounded both by the number of entries and by the total number
of bytes held by the stored tensors.  It is built on :class:`cachetools.LRUCache`
and guarded by a :class:`threading.Lock`, so it may be shared between the asyncio
event-loop thread and synchronous code paths running on other threads.

Ownership rule: the cache stores the tensor *object it was given* (no copy) and
:meth:`OutputCache.get` returns that same object.  Callers must therefore

* not mutate a tensor after ``put``-ing it, and
* hand out a copy (e.g. ``tensor.clone()``) of whatever ``get`` returns, so that
  end users cannot corrupt the cached value.

Byte accounting uses ``tensor.element_size() * tensor.nelement()``, i.e. the size
of the tensor's *elements*, not of its underlying storage.  A view into a larger
tensor (e.g. one row of an ``[N, V]`` batch) keeps the whole storage alive while
being counted at its own size, so callers should store compact tensors (e.g.
``row.clone()``) if the byte bound is to be meaningful.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Hashable, Mapping
from typing import Any

import cachetools

__all__ = ["DEFAULT_MAX_BYTES", "OutputCache", "tensor_nbytes"]

#: Default byte bound used by :meth:`OutputCache.from_options` (2 GiB).
DEFAULT_MAX_BYTES: int = 2 * 1024**3

_KNOWN_OPTS = frozenset({"max_bytes"})


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
            bound; ``0`` disables the cache entirely (``put`` is a no-op and
            ``get`` always misses).
        max_bytes: Maximum total bytes (see :func:`tensor_nbytes`) of the stored
            values. ``None`` means no byte bound. A single value larger than
            ``max_bytes`` is not stored at all (and any older value under the
            same key is removed).

    After every ``put`` the least-recently-used entries are evicted until both
    bounds hold.  ``get`` counts as a use (refreshes recency); ``in`` does not.

    Counters: ``hits`` / ``misses`` are updated by :meth:`get` only;
    ``evictions`` counts entries removed to satisfy the bounds.
    """

    def __init__(self, max_entries: int | None = 10_000, max_bytes: int | None = DEFAULT_MAX_BYTES):
        if max_entries is not None and max_entries < 0:
            raise ValueError(f"max_entries must be >= 0 or None, got {max_entries!r}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes!r}")
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        # Unbounded at the cachetools level: both bounds are enforced in ``put``
        # so that they are checked together. ``currsize`` tracks total bytes.
        self._lru: cachetools.LRUCache = cachetools.LRUCache(
            maxsize=math.inf, getsizeof=tensor_nbytes
        )
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    # ------------------------------------------------------------------ build
    @classmethod
    def from_options(
        cls, cache_size: int | None, cache_opts: Mapping[str, Any] | None = None
    ) -> OutputCache:
        """Build a cache from user-facing options.

        Args:
            cache_size: Entry bound. ``None`` = unbounded entry count, ``0`` =
                caching disabled.
            cache_opts: Optional mapping; recognised key ``max_bytes`` (int or
                ``None`` for no byte bound, default :data:`DEFAULT_MAX_BYTES`).
                Unknown keys raise ``ValueError`` (to catch typos).
        """
        opts = dict(cache_opts or {})
        unknown = set(opts) - _KNOWN_OPTS
        if unknown:
            raise ValueError(
                f"unknown cache_opts {sorted(unknown)}; supported: {sorted(_KNOWN_OPTS)}"
            )
        return cls(max_entries=cache_size, max_bytes=opts.get("max_bytes", DEFAULT_MAX_BYTES))

    # ------------------------------------------------------------ properties
    @property
    def enabled(self) -> bool:
        """False when the cache can store nothing (``max_entries=0`` or ``max_bytes=0``)."""
        return self._max_entries != 0 and self._max_bytes != 0

    @property
    def max_entries(self) -> int | None:
        """Entry bound (``None`` = unbounded, ``0`` = disabled)."""
        return self._max_entries

    @property
    def max_bytes(self) -> int | None:
        """Byte bound (``None`` = unbounded)."""
        return self._max_bytes

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

    def stats(self) -> dict[str, int | None]:
        """Snapshot of sizes, bounds and counters."""
        with self._lock:
            return {
                "entries": len(self._lru),
                "nbytes": int(self._lru.currsize),
                "max_entries": self._max_entries,
                "max_bytes": self._max_bytes,
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
            }

    # ------------------------------------------------------------ operations
    def get(self, key: Hashable) -> Any | None:
        """Return the stored value for ``key`` (marking it most recently used), or ``None``.

        The returned object is the cached tensor itself, not a copy: callers
        must clone it before handing it to code that might mutate it.
        """
        if not self.enabled:
            with self._lock:
                self._misses += 1
            return None
        with self._lock:
            try:
                value = self._lru[key]
            except KeyError:
                self._misses += 1
                return None
            self._hits += 1
            return value

    def put(self, key: Hashable, value: Any) -> None:
        """Store ``value`` under ``key`` (replacing any old value) and evict LRU entries.

        The value is stored as-is (no copy). No-op when the cache is disabled.
        A value larger than ``max_bytes`` is not stored, and an existing entry
        for ``key`` is dropped.
        """
        if not self.enabled:
            return
        size = tensor_nbytes(value)
        with self._lock:
            if self._max_bytes is not None and size > self._max_bytes:
                self._lru.pop(key, None)
                return
            self._lru[key] = value
            self._evict_locked()

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
        """Remove every entry (counters are kept)."""
        with self._lock:
            self._lru.clear()

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
