"""The cache-and-dedup step every row query takes, awaited or blocking.

:func:`lookup` answers one key from work already planned or in flight (a join), from the output
cache, or not at all (it must be computed); :class:`KeyPlan` applies it to the keys of one
blocking call. The async batcher (:mod:`genlm_vlm.batching`) calls :func:`lookup` per submit.
Pure Python; not thread-safe (each caller uses its own tables).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

if TYPE_CHECKING:
    from .cache import OutputCache

V = TypeVar("V")

__all__ = ["KeyPlan", "TokensKey", "lookup"]


class TokensKey:
    """``(adapter id, token ids)`` as a dict key whose hash is computed once.

    A query's key goes through several dicts on its way (planned and in-flight work, the output
    cache, the engine's jobs and session index); a plain ``(adapter, ids)`` tuple hashes all of
    its ids again at every one of them. This key equals, hashes like and unpacks like that tuple,
    so tables keyed by either form answer both.
    """

    __slots__ = ("_hash", "adapter", "ids")

    def __init__(self, adapter: int, ids: tuple[int, ...]) -> None:
        self.adapter = adapter
        self.ids = ids
        self._hash = hash((adapter, ids))

    @classmethod
    def of(cls, adapter: int, ids: tuple[int, ...], key: TokensKey | None = None) -> TokensKey:
        """``key`` when it was made for this very ``ids`` object and ``adapter``, else a new key."""
        if key is not None and key.ids is ids and key.adapter == adapter:
            return key
        return cls(adapter, ids)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is TokensKey:
            return self._hash == other._hash and self.adapter == other.adapter and self.ids == other.ids
        if isinstance(other, tuple):
            return other == (self.adapter, self.ids)
        return NotImplemented

    def __iter__(self) -> Iterator[Any]:
        return iter((self.adapter, self.ids))

    def __repr__(self) -> str:
        return f"TokensKey({self.adapter}, <{len(self.ids)} ids>)"


def lookup(
    key: Hashable, cache: OutputCache | None, *tables: Mapping[Hashable, Any]
) -> tuple[Literal["joined", "cached", "new"], Any]:
    """The cache-and-dedup step every query takes, awaited or blocking.

    ``("joined", x)`` when one of ``tables`` (work already planned or in flight) holds ``key``,
    ``x`` being what it holds there; else ``("cached", value)`` when ``cache`` holds it; else
    ``("new", None)``: the key must be computed. The tables are looked at first, so a joined key
    costs no cache lookup (and no cache miss).
    """
    for table in tables:
        found = table.get(key)
        if found is not None:
            return "joined", found
    if cache is not None:
        value = cache.get(key)
        if value is not None:
            return "cached", value
    return "new", None


class KeyPlan(Generic[V]):
    """The cache-and-dedup step of one blocking call over ``keys`` (:func:`lookup` per key).

    After construction, :attr:`todo` maps each key that must be computed to the index of its
    first occurrence (in first-seen order); the caller computes them, calls :meth:`fill` for
    each, then :meth:`results` gives one value per key of ``keys``, in order.
    ``cache_hits`` counts distinct keys served by the cache, ``dedup_joins`` the keys that
    repeat an earlier key of the call.
    """

    def __init__(self, keys: Sequence[Hashable], cache: OutputCache | None = None) -> None:
        self.keys = keys
        self.cache = cache
        self.values: dict[Hashable, V] = {}
        self.todo: dict[Hashable, int] = {}
        self.asks: dict[Hashable, int] = {}  # how often each key of todo is asked for
        self.cache_hits = 0
        self.dedup_joins = 0
        for i, key in enumerate(keys):
            how, value = lookup(key, cache, self.values, self.todo)
            if how == "joined":
                self.dedup_joins += 1
                if key in self.asks:
                    self.asks[key] += 1
            elif how == "cached":
                self.values[key] = value
                self.cache_hits += 1
            else:
                self.todo[key] = i
                self.asks[key] = 1

    def fill(self, key: Hashable, value: V) -> None:
        """The computed value of ``key`` (offered to the cache too: kept there once ``key`` has
        been asked for twice, in this call or before, see
        :meth:`~genlm_vlm.cache.OutputCache.offer`)."""
        if self.cache is not None:
            self.cache.offer(key, value, self.asks.get(key, 1))
        self.values[key] = value

    def results(self) -> list[V]:
        """One value per key, in the order of ``keys`` (every key of :attr:`todo` filled)."""
        return [self.values[k] for k in self.keys]
