"""The session table on its own (pure Python): lookup, transitions, LRU order, the index."""

from __future__ import annotations

from genlm_vlm.engine.sessions import SessionTable


def parked(table: SessionTable, rid: str, adapter: int, ids: tuple[int, ...]):
    s = table.open(rid, adapter, ids)
    assert table.park(rid) is None
    return s


def test_find_returns_the_longest_idle_proper_prefix_of_the_same_adapter():
    t = SessionTable()
    short = parked(t, "a", 0, (1, 2))
    long = parked(t, "b", 0, (1, 2, 3, 4))
    parked(t, "c", 1, (1, 2, 3, 4, 5))  # another adapter
    assert t.find(0, (1, 2, 3, 4, 5)) is long  # one new token: the fast path
    assert t.find(0, (1, 2, 3, 9)) is short  # the long one is not a prefix
    assert t.find(0, (1, 2)) is None  # equal tokens are not a proper prefix
    assert t.find(0, (7,)) is None and t.find(2, (1, 2, 3)) is None


def test_claim_makes_a_session_live_and_returns_only_the_new_tokens():
    t = SessionTable()
    s = parked(t, "a", 0, (1, 2))
    assert t.claim(s, (1, 2, 3, 4)) == (3, 4)
    assert s.tokens == (1, 2, 3, 4) and s.chunks == 1
    assert "a" in t.live and "a" not in t.idle
    assert t.find(0, (1, 2, 3)) is None  # a live session is not found
    assert t.park("a") is None
    assert t.find(0, (1, 2, 3, 4, 5)) is s


def test_parking_a_duplicate_returns_the_older_session_to_evict():
    t = SessionTable()
    old = parked(t, "a", 0, (1, 2))
    t.open("b", 0, (1, 2))
    assert t.park("b") is old
    assert list(t.idle) == ["b"]  # the old one left the index and the idle list
    assert t.find(0, (1, 2, 3)).rid == "b"


def test_lru_order_and_drop():
    t = SessionTable()
    for rid, ids in (("a", (1,)), ("b", (2,)), ("c", (3,))):
        parked(t, rid, 0, ids)
    assert t.lru().rid == "a"
    assert t.drop("a").rid == "a"
    assert t.lru().rid == "b"
    s = t.find(0, (2, 5))
    t.claim(s, (2, 5))
    t.park("b")  # used again: most recent
    assert t.lru().rid == "c"
    assert t.drop("nope") is None
    t.open("d", 0, (4,))
    assert t.drop("d").rid == "d" and "d" not in t.live


def test_the_length_index_forgets_lengths_nobody_has():
    t = SessionTable()
    parked(t, "a", 0, (1, 2, 3))
    t.drop("a")
    assert t.find(0, (1, 2, 3, 4)) is None
    assert t._lengths[0] == {}  # no stale lengths left to probe
    snap = t.snapshot()
    assert snap["idle"] == 0 and snap["live"] == 0


def test_extend_records_tokens_fed_to_a_live_session():
    t = SessionTable()
    s = t.open("a", 0, (1,))
    t.extend(s, (2, 3))
    assert s.tokens == (1, 2, 3) and s.chunks == 1
    t.park("a")
    assert t.find(0, (1, 2, 3, 4)) is s
