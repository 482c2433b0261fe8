"""Tests for genlm_vlm.cache.OutputCache (no engine needed)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from genlm_vlm.cache import DEFAULT_MAX_BYTES, OutputCache, tensor_nbytes


def vec(n: int, fill: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((n,), fill, dtype=dtype)


def test_get_put_contains_len_counters():
    c = OutputCache(max_entries=10, max_bytes=None)
    assert c.get(("a", (1, 2))) is None
    assert c.misses == 1 and c.hits == 0
    t = vec(4, 1.0)
    c.put(("a", (1, 2)), t)
    assert ("a", (1, 2)) in c
    assert ("a", (1, 3)) not in c
    assert len(c) == 1
    got = c.get(("a", (1, 2)))
    assert got is t  # the stored object itself; callers clone before handing out
    assert c.hits == 1 and c.misses == 1
    assert c.nbytes == 16
    # __contains__ does not touch counters
    assert c.hits == 1 and c.misses == 1
    c.clear()
    assert len(c) == 0 and c.nbytes == 0
    assert c.get(("a", (1, 2))) is None


def test_put_replaces_and_tracks_bytes():
    c = OutputCache(max_entries=None, max_bytes=None)
    c.put("k", vec(10))
    assert c.nbytes == 40
    c.put("k", vec(3, dtype=torch.float64))
    assert len(c) == 1 and c.nbytes == 24
    assert c.pop("k") is not None
    assert c.nbytes == 0 and c.pop("k") is None


def test_lru_eviction_by_entries():
    c = OutputCache(max_entries=2, max_bytes=None)
    c.put("a", vec(1))
    c.put("b", vec(1))
    assert c.get("a") is not None  # a is now most recent
    c.put("c", vec(1))
    assert "b" not in c
    assert "a" in c and "c" in c
    assert len(c) == 2 and c.evictions == 1


def test_lru_eviction_by_bytes():
    c = OutputCache(max_entries=None, max_bytes=1000)
    c.put("a", vec(100))  # 400 B
    c.put("b", vec(100))  # 800 B
    c.get("a")
    c.put("c", vec(100))  # 1200 B > 1000 -> evict LRU ("b")
    assert "b" not in c and "a" in c and "c" in c
    assert c.nbytes == 800
    c.put("d", vec(240))  # 960 B: must evict both a and c
    assert list(k for k in "abcd" if k in c) == ["d"]
    assert c.nbytes == 960


def test_both_bounds_hold():
    c = OutputCache(max_entries=3, max_bytes=100)
    for i in range(20):
        c.put(i, vec(random.Random(i).randint(1, 20)))
        assert len(c) <= 3 and c.nbytes <= 100


def test_oversize_value_not_stored():
    c = OutputCache(max_entries=10, max_bytes=100)
    c.put("small", vec(5))
    c.put("big", vec(1000))
    assert "big" not in c and "small" in c
    c.put("small", vec(1000))  # replacing with an oversize value drops the old one
    assert "small" not in c and len(c) == 0 and c.nbytes == 0


def test_disabled_with_zero_entries():
    c = OutputCache(max_entries=0)
    assert not c.enabled
    c.put("a", vec(2))
    assert len(c) == 0 and "a" not in c
    assert c.get("a") is None


def test_unbounded():
    c = OutputCache(max_entries=None, max_bytes=None)
    for i in range(1000):
        c.put(i, vec(8))
    assert len(c) == 1000 and c.evictions == 0 and c.nbytes == 1000 * 32


def test_validation():
    with pytest.raises(ValueError):
        OutputCache(max_entries=-1)
    with pytest.raises(ValueError):
        OutputCache(max_bytes=-1)


def test_from_options():
    c = OutputCache.from_options(10_000, None)
    assert c.max_entries == 10_000 and c.max_bytes == DEFAULT_MAX_BYTES == 2 * 1024**3
    c = OutputCache.from_options(None, {"max_bytes": 123})
    assert c.max_entries is None and c.max_bytes == 123
    c = OutputCache.from_options(5, {"max_bytes": None})
    assert c.max_bytes is None
    assert not OutputCache.from_options(0, None).enabled
    with pytest.raises(ValueError, match="unknown cache_opts"):
        OutputCache.from_options(10, {"max_byte": 5})
    assert OutputCache.from_options(10, None).admit_after == 2
    assert OutputCache.from_options(10, {"admit_after": 1}).admit_after == 1
    for bad in (0, 3, 2.0, True, "2"):
        with pytest.raises(ValueError, match="admit_after must be 1"):
            OutputCache.from_options(10, {"admit_after": bad})


def test_offer_keeps_a_value_the_second_time_its_key_is_offered():
    c = OutputCache(max_entries=10, max_bytes=None)
    first, second = vec(4, 1.0), vec(4, 2.0)
    assert c.offer("k", first) is False  # first computation: only the key's hash is remembered
    assert "k" not in c and len(c) == 0 and c.nbytes == 0 and c.not_admitted == 1
    assert c.offer("k", second) is True
    assert c.get("k") is second and c.not_admitted == 1
    assert c.offer(("a", (1, 2)), vec(1)) is False  # other keys are not affected
    c.clear()  # forgets the remembered keys too
    assert c.offer("k", vec(4)) is False and "k" not in c
    assert c.offer("j", vec(1), asks=2) is True  # asked for by two callers of one computation
    every = OutputCache(max_entries=10, max_bytes=None, admit_after=1)
    assert every.offer("k", first) is True and every.get("k") is first and every.not_admitted == 0
    off = OutputCache(max_entries=0)
    assert off.offer("k", first) is False and off.offer("k", first) is False and off.not_admitted == 0


def test_offer_remembers_a_bounded_number_of_keys():
    c = OutputCache(max_entries=4, max_bytes=None)
    for i in range(40):
        assert c.offer(i, vec(1)) is False
    assert len(c._seen) + len(c._seen_old) <= 8  # two generations of max_entries hashes at most
    assert c.offer(39, vec(1)) is True  # a recent key is still known
    assert c.offer(0, vec(1)) is False  # an old one was forgotten


def test_views_are_stored_compact_so_the_byte_bound_counts_what_is_kept():
    """A row that is a view into a batched [N, V] tensor would keep the whole batch alive: the
    cache stores a compact copy, so ``nbytes`` and ``max_bytes`` count the bytes really kept."""
    batch = torch.randn(64, 1000)
    c = OutputCache(max_entries=None, max_bytes=10 * 1000 * 4, admit_after=1)
    for i in range(64):
        assert c.put(i, batch[i]) is True
    with c._lock:
        stored = list(c._lru.values())
    assert len(stored) == 10 and c.nbytes == 10 * 1000 * 4
    for v in stored:
        assert v.untyped_storage().nbytes() == 1000 * 4 and v.data_ptr() != batch.data_ptr()
    assert sum(v.untyped_storage().nbytes() for v in stored) <= c.max_bytes
    assert torch.equal(c.get(63), batch[63])
    batch[63] += 1.0  # the batch's owner may reuse it: the cached row is not affected
    assert not torch.equal(c.get(63), batch[63])
    own = torch.randn(1000)
    c.put("own", own)
    assert c.get("own") is own  # a tensor that owns its memory is kept as it is


def test_tensor_nbytes():
    assert tensor_nbytes(torch.zeros(3, 4, dtype=torch.float16)) == 24
    assert tensor_nbytes(torch.zeros(0)) == 0


def test_stats_snapshot():
    c = OutputCache(max_entries=1, max_bytes=None)
    c.put("a", vec(1))
    c.put("b", vec(1))
    c.get("b")
    c.get("a")
    s = c.stats()
    assert s == {
        "entries": 1,
        "nbytes": 4,
        "max_entries": 1,
        "max_bytes": None,
        "admit_after": 2,
        "hits": 1,
        "misses": 1,
        "evictions": 1,
        "not_admitted": 0,
    }


def test_thread_safety_smoke():
    c = OutputCache(max_entries=50, max_bytes=50 * 40)
    n_threads, n_ops = 8, 3000
    gets = [0] * n_threads
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads)

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        try:
            start.wait()
            for _ in range(n_ops):
                k = rng.randrange(200)
                if rng.random() < 0.5:
                    c.put(k, vec(rng.randint(1, 20), float(k)))
                else:
                    gets[tid] += 1
                    v = c.get(k)
                    if v is not None:
                        assert float(v[0]) == float(k)
                if rng.random() < 0.001:
                    c.clear()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(c) <= 50 and c.nbytes <= 50 * 40
    assert c.hits + c.misses == sum(gets)
    # byte accounting is consistent with the stored values
    with c._lock:
        stored = list(c._lru.values())
    assert c.nbytes == sum(tensor_nbytes(v) for v in stored)
