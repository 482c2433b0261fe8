"""The step loop's decisions, on a fake engine core (no vLLM; seconds).

Admission (continue / fork / open), dedup of identical queries in flight, LRU and KV-threshold
eviction, stall handling, cancellation, a failing step, tickets delivered in bursts, and the
threading rule's counters. Real-engine behaviour is covered by test_sessions.py and friends.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest
import torch
from fake_core import FakeCore, fake_row

from genlm_vlm.engine import EngineDriver, SampleSpec
from genlm_vlm.engine.loop import MAX_STALLED_STEPS


def make(core: FakeCore | None = None, **kwargs) -> tuple[EngineDriver, FakeCore]:
    core = core or FakeCore()
    driver = EngineDriver("fake", core_factory=lambda: core, **kwargs)
    return driver, core


def rows(driver: EngineDriver, *prompts: tuple[int, ...]) -> list[torch.Tensor]:
    futs = driver.submit_logprobs([(p, None) for p in prompts])
    return [f.result(timeout=10) for f in futs]


@pytest.fixture
def driver_core():
    driver, core = make()
    yield driver, core
    driver.shutdown()


def test_rows_are_the_cores_rows_for_the_whole_sequence(driver_core):
    driver, core = driver_core
    (a,) = rows(driver, (1, 2, 3))
    (b,) = rows(driver, (1, 2, 3, 4))  # a chunk of the first session: the row is for all 4 tokens
    assert torch.equal(a, fake_row((1, 2, 3), 64)) and torch.equal(b, fake_row((1, 2, 3, 4), 64))
    assert driver.stats()["rows"] == 2


def test_a_query_that_extends_an_idle_session_sends_only_its_new_tokens(driver_core):
    driver, core = driver_core
    rows(driver, (1, 2, 3))
    rows(driver, (1, 2, 3, 4, 5))
    (rid0, toks0, _, resumable0), (rid1, toks1, _, _) = core.requests
    assert resumable0 and rid1 == rid0 and toks0 == (1, 2, 3) and toks1 == (4, 5)
    s = driver.stats()["sessions"]
    assert (s["opened"], s["continued"], s["forked"], s["idle"], s["live"]) == (1, 1, 0, 1, 0)
    assert driver.stats()["tokens"]["session"] == 2 and driver.stats()["tokens"]["prefill"] == 3


def test_siblings_of_one_parent_continue_it_once_and_fork_the_rest(driver_core):
    driver, core = driver_core
    rows(driver, (1, 2, 3))
    rows(driver, (1, 2, 3, 7), (1, 2, 3, 8), (9, 9))
    s = driver.stats()["sessions"]
    assert (s["opened"], s["continued"], s["forked"]) == (2, 1, 1)  # (9, 9) opened, (1,2,3,8) forked
    sent = {toks for _, toks, _, _ in core.requests[1:]}
    assert sent == {(7,), (1, 2, 3, 8), (9, 9)}


def test_without_sessions_every_query_is_a_full_request():
    driver, core = make(FakeCore(sessions=False))
    try:
        rows(driver, (1, 2))
        rows(driver, (1, 2, 3))
        assert [(toks, res) for _, toks, _, res in core.requests] == [((1, 2), False), ((1, 2, 3), False)]
        assert driver.info.mode == "requests" and "no sessions" in driver.sessions_reason
    finally:
        driver.shutdown()


def test_identical_queries_in_flight_share_one_request_but_not_one_tensor(driver_core):
    driver, core = driver_core
    a, b, c = rows(driver, (5, 6), (5, 6), (5, 7))
    assert len(core.requests) == 2
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    a.add_(1.0)  # one caller mutating its row does not change another's
    assert torch.equal(b, fake_row((5, 6), 64))


def test_idle_sessions_over_the_cap_are_evicted_least_recently_used_first():
    driver, core = make(max_sessions=2)
    try:
        rows(driver, (1,))
        rows(driver, (2,))
        rows(driver, (3,))
        first = core.requests[0][0]
        assert core.aborted == [first]
        s = driver.stats()["sessions"]
        assert (s["idle"], s["evicted"]) == (2, 1)
        rows(driver, (1, 5))  # its session is gone: a new one, with every token
        assert core.requests[-1][1] == (1, 5)
    finally:
        driver.shutdown()


def test_idle_plus_running_never_exceed_max_num_seqs():
    driver, core = make(FakeCore(max_num_seqs=3))
    try:
        rows(driver, (1,), (2,), (3,))
        assert driver.stats()["sessions"]["idle"] == 3
        rows(driver, (4,), (5,))  # two new requests: two idle sessions must go
        assert len(core.aborted) >= 2 and driver.stats()["sessions"]["idle"] <= 3
    finally:
        driver.shutdown()


def test_kv_pressure_evicts_idle_sessions_before_the_step(driver_core):
    driver, core = driver_core
    rows(driver, (1,), (2,))
    core.kv = 0.95
    rows(driver, (3,))
    assert len(core.aborted) == 2
    s = driver.stats()["sessions"]
    assert s["evicted"] == 2 and s["idle"] == 1


def test_a_stall_releases_idle_sessions_then_fails_the_waiting_jobs(driver_core):
    driver, core = driver_core
    rows(driver, (1,), (2,))
    core.stall = True
    (fut,) = driver.submit_logprobs([((3,), None)])
    with pytest.raises(RuntimeError, match="could not schedule"):
        fut.result(timeout=10)
    assert driver.stats()["sessions"]["evicted"] == 2
    assert core.steps >= MAX_STALLED_STEPS
    core.stall = False
    assert torch.equal(rows(driver, (3,))[0], fake_row((3,), 64))  # the loop carries on


def test_cancelling_the_only_waiter_aborts_the_request():
    core = FakeCore(steps_per_request=3, gated=True)
    driver, _ = make(core)
    try:
        (fut,) = driver.submit_logprobs([((1, 2), None)])
        core.gate.release()
        core.wait_for(lambda: core.steps == 1)
        rid = core.requests[0][0]
        assert fut.cancel()
        core.gate.release(5)
        core.wait_for(lambda: rid in core.aborted)
        assert driver.stats()["sessions"]["closed"] == 1 and rid not in core.parked
    finally:
        driver.shutdown()


def test_cancelling_one_of_two_identical_waiters_keeps_the_request():
    core = FakeCore(steps_per_request=2, gated=True)
    driver, _ = make(core)
    try:
        f1, f2 = driver.submit_logprobs([((1, 2), None), ((1, 2), None)])
        assert f1.cancel()
        core.gate.release(4)
        assert torch.equal(f2.result(timeout=10), fake_row((1, 2), 64))
        assert core.aborted == [] and len(core.requests) == 1
    finally:
        driver.shutdown()


def test_a_failing_step_fails_exactly_its_jobs_and_the_loop_goes_on(driver_core):
    driver, core = driver_core
    rows(driver, (1, 2))
    core.fail_next = RuntimeError("boom")
    futs = driver.submit_logprobs([((1, 2, 3), None), ((4,), None)])
    for f in futs:
        with pytest.raises(RuntimeError, match="boom"):
            f.result(timeout=10)
    assert len(core.aborted) == 2 and core.sink.rows == {}
    assert torch.equal(rows(driver, (4,))[0], fake_row((4,), 64))


def test_after_a_failing_step_idle_sessions_go_and_the_prefix_cache_is_reset(driver_core):
    """Issue 29: a failed step's blocks may be cached as computed; the loop releases every
    session and resets the cache before anything else is admitted, and says so in stats."""
    driver, core = driver_core
    rows(driver, (1, 2), (7, 8))  # two idle sessions
    core.fail_next = RuntimeError("boom")
    (f,) = driver.submit_logprobs([((1, 2, 3), None)])  # continues one of them
    with pytest.raises(RuntimeError, match="boom"):
        f.result(timeout=10)
    assert torch.equal(rows(driver, (7, 8, 9))[0], fake_row((7, 8, 9), 64))
    stats = driver.stats()
    assert stats["faults"] == {"failed_steps": 1, "requests_failed": 1, "sessions_dropped": 2,
                               "prefix_cache_resets": 1, "prefix_cache_reset_failures": 0,
                               "controller_errors": 0, "burst_errors": 0, "blocking_calls": 0,
                               "prefix_cache_suspect": False}
    assert core.resets == 1 and stats["sessions"]["opened"] == 3  # (7, 8, 9) could not continue


def test_a_prefix_cache_reset_the_core_refuses_is_said_and_tried_again(driver_core, caplog):
    driver, core = driver_core
    core.refuse_reset = True
    core.fail_next = RuntimeError("boom")
    (f,) = driver.submit_logprobs([((1, 2), None)])
    with pytest.raises(RuntimeError, match="boom"):
        f.result(timeout=10)
    faults = driver.stats()["faults"]
    assert faults["prefix_cache_suspect"] and faults["prefix_cache_reset_failures"] >= 1
    assert "could not reset its prefix cache" in caplog.text
    core.refuse_reset = False
    assert torch.equal(rows(driver, (4, 5))[0], fake_row((4, 5), 64))  # tried before this was admitted
    faults = driver.stats()["faults"]
    assert not faults["prefix_cache_suspect"] and faults["prefix_cache_resets"] == 1 == core.resets


def test_a_request_the_core_refuses_fails_only_that_query(driver_core):
    driver, core = driver_core
    real = core.add_rows

    def add_rows(rid, tokens, tag, lora, resumable):
        if tuple(tokens) == (13,):
            raise ValueError("refused")
        real(rid, tokens, tag, lora, resumable)

    core.add_rows = add_rows
    good, bad = driver.submit_logprobs([((1,), None), ((13,), None)])
    with pytest.raises(ValueError, match="refused"):
        bad.result(timeout=10)
    assert torch.equal(good.result(timeout=10), fake_row((1,), 64))


def test_tickets_come_back_in_one_listener_call_per_step(driver_core):
    driver, core = driver_core
    calls: list[list] = []
    done = threading.Event()

    def listener(items):
        calls.append(items)
        if sum(len(c) for c in calls) == 3:
            done.set()

    tickets = driver.submit_logprobs([((1,), None), ((2,), None), ((1,), None)], listener=listener, payloads="abc")
    assert done.wait(10)
    assert len(calls) == 1
    got = {t.payload: row for t, row, exc in calls[0]}
    assert set(got) == {"a", "b", "c"} and all(exc is None for _, _, exc in calls[0])
    assert torch.equal(got["a"], fake_row((1,), 64)) and torch.equal(got["c"], got["a"])
    assert got["a"].data_ptr() != got["c"].data_ptr()
    assert all(t.resolved for t in tickets)


def test_a_cancelled_ticket_is_not_delivered_and_its_request_is_aborted():
    core = FakeCore(steps_per_request=4, gated=True)
    driver, _ = make(core)
    try:
        calls: list = []
        got_one = threading.Event()

        def listener(items):
            calls.append(items)
            got_one.set()

        t1, t2 = driver.submit_logprobs([((1,), None), ((2,), None)], listener=listener)
        core.gate.release()
        core.wait_for(lambda: core.steps == 1)
        driver.cancel([t1])  # the engine may already wait in step 2: aborted before step 3
        core.gate.release(10)
        core.wait_for(lambda: len(core.aborted) == 1)
        assert got_one.wait(10)
        delivered = [t for batch in calls for t, _, _ in batch]
        assert delivered == [t2] and t1.cancelled
    finally:
        driver.shutdown()


def test_samples_and_seeded_samples():
    driver, core = make(FakeCore(vocab=50))
    try:
        plain, seeded = driver.submit_samples([
            SampleSpec((1, 2), 3, (), 1.0, None),
            SampleSpec((1, 2), 4, (), 1.0, 7),
        ])
        assert plain.result(timeout=10) == [3, 4, 5]
        toks = seeded.result(timeout=10)
        assert len(toks) == 4 and all(0 <= t < 50 for t in toks)
        # the seeded sample went through one session: a chunk per token after the first
        chunks = [toks_ for rid, toks_, _, _ in core.requests if rid.startswith("s")]
        assert chunks[0] == (1, 2) and all(len(c) == 1 for c in chunks[1:]) and len(chunks) == 4
    finally:
        driver.shutdown()


def test_counters_are_kept_by_the_engine_thread(driver_core):
    driver, core = driver_core
    for i in range(5):
        rows(driver, (i + 1,))
    st = driver.stats()
    assert st["engine_calls"] == 5 and st["engine_requests"] == 5 and st["engine_steps"] >= 5
    t = st["engine_time"]
    assert set(t) == {"step_s", "host_s", "idle_s", "admit_s", "route_s"} and all(v >= 0 for v in t.values())
    assert t["admit_s"] + t["route_s"] <= t["host_s"] + 1e-3  # two parts of the host's time


def test_shutdown_fails_what_is_pending_and_frees_the_core():
    core = FakeCore(steps_per_request=10**9)
    driver, _ = make(core)
    (fut,) = driver.submit_logprobs([((1,), None)])
    core.wait_for(lambda: core.steps >= 1)
    driver.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        fut.result(timeout=10)
    assert core.released
    with pytest.raises(RuntimeError, match="shut down"):
        driver.submit_logprobs([((1,), None)])


def test_a_core_that_fails_to_build_raises_to_the_constructor():
    def factory():
        raise OSError("no model here")

    with pytest.raises(OSError, match="no model here"):
        EngineDriver("fake", core_factory=factory)


def test_calls_run_on_the_engine_thread_between_steps(driver_core):
    driver, _ = driver_core
    name = driver.call(lambda: threading.current_thread().name)
    assert name.startswith("genlm-vlm-engine")
    fut = cf.Future()
    with pytest.raises(ZeroDivisionError):
        driver.call(lambda: 1 / 0)
    assert not fut.done()


def test_a_resample_at_full_capacity_takes_one_step():
    """N = max_num_seqs particles; after a resample half of them fork and the parents nobody
    chose stay parked. Their slots are freed before the step, so the whole SMC step is one engine
    step (vLLM counts parked sessions toward max_num_seqs and never preempts them)."""
    n = 8
    driver, core = make(FakeCore(max_num_seqs=n))
    try:
        prompts = [(1, i + 2) for i in range(n)]
        rows(driver, *prompts)
        steps = driver.stats()["engine_steps"]
        ancestors = [0, 0, 1, 1, 2, 2, 3, 3]  # parents 4..7 have no children
        rows(driver, *[prompts[a] + (9 + i,) for i, a in enumerate(ancestors)])
        st = driver.stats()
        assert st["engine_steps"] - steps == 1
        assert (st["sessions"]["continued"], st["sessions"]["forked"]) == (4, 4)
        assert st["sessions"]["evicted"] >= 4
    finally:
        driver.shutdown()


def test_parts_deliver_a_group_over_several_steps():
    """With parts=2 a group of 16 queries is admitted 8 and 8: the first 8 rows are handed over
    after the first step, while the other 8 wait for the next one."""
    driver, core = make(FakeCore(max_num_seqs=32), parts=2)
    try:
        calls: list[list] = []
        done = threading.Event()

        def listener(items):
            calls.append(items)
            if sum(len(c) for c in calls) == 16:
                done.set()

        driver.submit_logprobs([((i + 1,), None) for i in range(16)], listener=listener)
        assert done.wait(10)
        assert [len(c) for c in calls] == [8, 8]
        assert all(exc is None for c in calls for _, _, exc in c)
        assert driver.stats()["engine_steps"] == 2
    finally:
        driver.shutdown()


def test_a_part_whose_requests_all_fail_does_not_stall_the_rest():
    core = FakeCore(max_num_seqs=32)
    driver, _ = make(core, parts=2)
    try:
        real = core.add_rows

        def add_rows(rid, tokens, tag, lora, resumable):
            if tokens[0] <= 8:
                raise ValueError("refused")
            real(rid, tokens, tag, lora, resumable)

        core.add_rows = add_rows
        futs = driver.submit_logprobs([((i + 1,), None) for i in range(16)])
        outcomes = [f.exception(timeout=10) for f in futs]
        assert all(isinstance(e, ValueError) for e in outcomes[:8]) and outcomes[8:] == [None] * 8
    finally:
        driver.shutdown()


class CountingIds(tuple):
    """Token ids that count how often they are hashed."""

    hashes = 0

    def __hash__(self):
        type(self).hashes += 1
        return tuple.__hash__(self)


def test_a_query_s_ids_are_hashed_once_on_the_engine_side(driver_core):
    """The jobs table, the session lookup, claim and park reuse one key per query."""
    driver, core = driver_core
    CountingIds.hashes = 0
    rows(driver, CountingIds((1, 2, 3)))
    rows(driver, CountingIds((1, 2, 3, 4)))  # continues the first query's session
    assert driver.stats()["sessions"]["continued"] == 1
    assert CountingIds.hashes == 2


def test_tokens_keys_equal_hash_and_unpack_like_tuples():
    from genlm_vlm.dedup import TokensKey

    k = TokensKey(0, (1, 2, 3))
    assert k == (0, (1, 2, 3)) and (0, (1, 2, 3)) == k and hash(k) == hash((0, (1, 2, 3)))
    assert k == TokensKey(0, (1, 2, 3)) and k != TokensKey(1, (1, 2, 3)) and k != (0, (1, 2))
    assert {(0, (1, 2, 3)): "t"}[k] == "t" and {k: "k"}[(0, (1, 2, 3))] == "k"
    adapter, ids = k
    assert (adapter, ids) == (0, (1, 2, 3))


def test_a_key_sent_with_the_query_spares_the_engine_hashing_it(driver_core):
    from genlm_vlm.dedup import TokensKey

    driver, core = driver_core
    first, second = CountingIds((5, 6)), CountingIds((5, 6, 7))
    keys = [TokensKey(0, first), TokensKey(0, second)]
    CountingIds.hashes = 0
    for ids, key in zip((first, second), keys, strict=True):
        (fut,) = driver.submit_logprobs([(ids, None, key)])
        assert torch.equal(fut.result(timeout=10), fake_row(tuple(ids), 64))
    assert CountingIds.hashes == 0
    (fut,) = driver.submit_logprobs([(CountingIds((5, 6, 7, 8)), None, TokensKey(1, (9,)))])  # a wrong key
    assert torch.equal(fut.result(timeout=10), fake_row((5, 6, 7, 8), 64))  # is replaced, not trusted
