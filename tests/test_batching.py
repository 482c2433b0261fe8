"""Tests for genlm_vlm.batching.AutoBatcher with a fake (blocking) engine function.

Synchronisation is done with threading primitives held by the fake engine and
with event-loop passes (``asyncio.sleep(0)``), never with wall-clock sleeps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch

from genlm_vlm.batching import AutoBatcher
from genlm_vlm.cache import OutputCache

WAIT = 10.0  # generous upper bound for thread hand-offs (never reached when passing)


def value_of(request) -> int:
    """Expected result for a request (requests are ints, strings or tuples of ints)."""
    if isinstance(request, (tuple, list)):
        return sum(request) * 1000 + len(request)
    return hash(request) % 100_003


class FakeEngine:
    """A blocking compute function that records every call.

    With ``hold=True`` each call blocks until the test calls :meth:`release`;
    :meth:`wait_entered` waits (off the loop) until the next call has started.
    """

    def __init__(self, fn: Callable[[list], list] | None = None, hold: bool = False):
        self.fn = fn or (lambda reqs: [value_of(r) for r in reqs])
        self.hold = hold
        self.calls: list[list] = []
        self.threads: set[int] = set()
        self._lock = threading.Lock()
        self._entered = threading.Semaphore(0)
        self._gate = threading.Semaphore(0)

    def __call__(self, requests: list) -> list:
        with self._lock:
            self.calls.append(list(requests))
            self.threads.add(threading.get_ident())
        self._entered.release()
        if self.hold:
            assert self._gate.acquire(timeout=WAIT), "fake engine was never released"
        return self.fn(requests)

    async def wait_entered(self) -> None:
        ok = await asyncio.to_thread(self._entered.acquire, True, WAIT)
        assert ok, "fake engine call never started"

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._gate.release()

    @property
    def computed(self) -> Counter:
        return Counter(r for call in self.calls for r in call)


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-engine")
    yield ex
    ex.shutdown(wait=True, cancel_futures=True)


def install_error_recorder() -> list[dict]:
    """Collect anything reported to the loop's exception handler (e.g. InvalidStateError)."""
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    return errors


async def until(cond: Callable[[], bool], passes: int = 1000) -> None:
    """Yield to the event loop until ``cond()`` holds (bounded number of loop passes)."""
    for _ in range(passes):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def start_blocker(b: AutoBatcher, engine: FakeEngine, request="blocker") -> asyncio.Task:
    """Occupy the engine with one held call so later submissions accumulate."""
    task = asyncio.create_task(b.submit(request))
    await engine.wait_entered()
    assert b.busy
    return task


def other_tasks() -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


# --------------------------------------------------------------------------- basics


async def test_many_concurrent_with_dedupe(executor):
    engine = FakeEngine()
    b = AutoBatcher(engine, executor=executor, batch_size=64)
    rng = random.Random(0)
    keys = [(i, i + 1) for i in range(150)]
    reqs = [rng.choice(keys) for _ in range(500)]
    distinct = len(set(reqs))
    results = await asyncio.gather(*(b.submit(r, key=("adapter", r)) for r in reqs))
    assert results == [value_of(r) for r in reqs]
    assert b.stats["engine_calls"] == math.ceil(distinct / 64)
    assert all(n == 1 for n in engine.computed.values())
    assert set(engine.computed) == set(reqs)
    assert b.stats["requests"] == 500
    assert b.stats["dedup_joins"] == 500 - distinct
    assert b.stats["max_batch"] == 64
    assert sum(size * n for size, n in b.stats["batch_sizes"].items()) == distinct
    assert not b.busy and b.num_pending == 0 and b.num_inflight == 0


async def test_lone_await_uses_no_timer(executor, monkeypatch):
    engine = FakeEngine()
    b = AutoBatcher(engine, executor=executor, timeout=0.0)
    loop = asyncio.get_running_loop()

    def no_timer(*a, **k):
        raise AssertionError("timeout=0 must not arm a timer")

    monkeypatch.setattr(loop, "call_later", no_timer)
    monkeypatch.setattr(loop, "call_at", no_timer)
    assert await b.submit((1, 2, 3)) == value_of((1, 2, 3))
    assert engine.calls == [[(1, 2, 3)]]


async def test_same_pass_goes_out_together(executor):
    engine = FakeEngine()
    b = AutoBatcher(engine, executor=executor)
    tasks = [asyncio.create_task(b.submit(i)) for i in range(10)]
    assert await asyncio.gather(*tasks) == [value_of(i) for i in range(10)]
    assert engine.calls == [list(range(10))]


async def test_timeout_collects_stragglers(executor):
    engine = FakeEngine()
    b = AutoBatcher(engine, executor=executor, timeout=0.1)
    t1 = asyncio.create_task(b.submit(1))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # a later loop pass: a straggler
    t2 = asyncio.create_task(b.submit(2))
    assert await asyncio.gather(t1, t2) == [value_of(1), value_of(2)]
    assert engine.calls == [[1, 2]]


async def test_full_batch_goes_out_without_waiting_for_timer(executor):
    engine = FakeEngine()
    b = AutoBatcher(engine, executor=executor, batch_size=4, timeout=3600.0)
    results = await asyncio.wait_for(asyncio.gather(*(b.submit(i) for i in range(4))), WAIT)
    assert results == [value_of(i) for i in range(4)]
    assert engine.calls == [[0, 1, 2, 3]]


async def test_submit_many(executor):
    engine = FakeEngine()
    b = AutoBatcher(engine, executor=executor)
    reqs = [(1,), (2,), (1,), (3,)]
    assert await b.submit_many(reqs) == [value_of(r) for r in reqs]
    assert engine.calls == [[(1,), (2,), (3,)]]
    out = await b.submit_many(["x", "y"], keys=[("k", 1), ("k", 2)])
    assert out == [value_of("x"), value_of("y")]
    assert await b.submit_many([]) == []
    with pytest.raises(ValueError):
        await b.submit_many(["x"], keys=[])


async def test_no_dedupe_computes_every_submit(executor):
    engine = FakeEngine()
    b = AutoBatcher(engine, executor=executor, dedupe=False)
    out = await asyncio.gather(*(b.submit([7]) for _ in range(3)))  # unhashable is fine
    assert out == [value_of([7])] * 3
    assert len(engine.calls) == 1 and len(engine.calls[0]) == 3
    assert b.stats["dedup_joins"] == 0


# ------------------------------------------------------------------ pipelining


async def test_pipelining_and_inflight_join(executor):
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor, batch_size=16)
    first = [asyncio.create_task(b.submit(k)) for k in ("a", "b")]
    await engine.wait_entered()
    assert engine.calls == [["a", "b"]]

    later = [asyncio.create_task(b.submit(k)) for k in ("c", "d", "a", "e", "c")]
    await until(lambda: b.stats["requests"] == 7)
    assert b.num_pending == 3  # c, d, e ("a" joined the in-flight call, "c" deduped)
    assert len(engine.calls) == 1  # nothing dispatched while the engine is busy

    engine.release()
    await engine.wait_entered()
    assert engine.calls[1] == ["c", "d", "e"]
    engine.release()
    res = await asyncio.gather(*first, *later)
    assert res == [value_of(k) for k in ("a", "b", "c", "d", "a", "e", "c")]
    assert engine.computed == Counter({"a": 1, "b": 1, "c": 1, "d": 1, "e": 1})
    assert b.stats["engine_calls"] == 2
    assert b.stats["dedup_joins"] == 2


async def test_backlog_dispatched_in_chunks(executor):
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor, batch_size=4)
    blocker = await start_blocker(b, engine)
    tasks = [asyncio.create_task(b.submit(i)) for i in range(10)]
    await until(lambda: b.num_pending == 10)
    for expected in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9]):
        engine.release()
        await engine.wait_entered()
        assert engine.calls[-1] == expected
    engine.release()
    assert await asyncio.gather(*tasks) == [value_of(i) for i in range(10)]
    await blocker
    assert b.stats["batch_sizes"] == {1: 1, 2: 1, 4: 2}


async def test_single_call_in_flight_and_loop_not_blocked(executor):
    """Heartbeat keeps ticking while a blocking compute is held; compute runs off-loop."""
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor)
    task = asyncio.create_task(b.submit("x"))
    await engine.wait_entered()

    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        for _ in range(200):
            ticks += 1
            await asyncio.sleep(0)

    await asyncio.wait_for(heartbeat(), WAIT)
    assert ticks == 200
    assert not task.done() and b.busy  # compute provably still running
    engine.release()
    assert await task == value_of("x")
    assert threading.get_ident() not in engine.threads


# ------------------------------------------------------------------ cancellation


async def test_cancelled_before_dispatch_not_sent(executor):
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor)
    blocker = await start_blocker(b, engine)
    keep = asyncio.create_task(b.submit("keep"))
    gone = [asyncio.create_task(b.submit("gone")) for _ in range(3)]
    half = [asyncio.create_task(b.submit("half")) for _ in range(2)]
    await until(lambda: b.stats["requests"] == 7)
    for t in gone + half[:1]:
        t.cancel()
    engine.release()
    await engine.wait_entered()
    assert engine.calls[1] == ["keep", "half"]
    engine.release()
    assert await keep == value_of("keep")
    assert await half[1] == value_of("half")
    for t in gone + half[:1]:
        with pytest.raises(asyncio.CancelledError):
            await t
    await blocker
    assert b.stats["dropped_cancelled"] == 1
    assert b.num_pending == 0 and not other_tasks()


async def test_cancel_immediately_after_register_same_pass(executor):
    """Cancellation that lands between registration and the call_soon flush."""
    engine = FakeEngine()
    b = AutoBatcher(engine, executor=executor)
    x = asyncio.create_task(b.submit("x"))
    y = asyncio.create_task(b.submit("y"))
    await asyncio.sleep(0)  # x and y register; the flush is queued behind this task
    assert b.num_pending == 2
    x.cancel()
    assert await y == value_of("y")
    with pytest.raises(asyncio.CancelledError):
        await x
    assert engine.calls == [["y"]]


async def test_random_cancellation(executor):
    errors = install_error_recorder()
    rng = random.Random(1234)
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor, batch_size=1000)
    blocker = await start_blocker(b, engine)

    # 40 keys with a single waiter, 60 keys with 2..6 waiters
    reqs = [f"s{i}" for i in range(40)]
    for i in range(60):
        reqs += [f"m{i}"] * rng.randint(2, 6)
    rng.shuffle(reqs)
    tasks = [asyncio.create_task(b.submit(r)) for r in reqs]
    n = len(tasks)
    order = list(range(n))
    rng.shuffle(order)
    n_cancel = int(0.3 * n)
    never_ran = set(order[: n_cancel // 6])  # cancelled before they even register
    before = set(order[n_cancel // 6 : n_cancel // 2])  # registered, before dispatch
    during = set(order[n_cancel // 2 : n_cancel])  # while their call is in flight
    for i in never_ran:
        tasks[i].cancel()
    await until(lambda: b.stats["requests"] == 1 + n - len(never_ran))
    for i in before:
        tasks[i].cancel()
    await asyncio.sleep(0)

    engine.release()  # blocker finishes; the backlog goes out as one call
    await engine.wait_entered()
    sent = engine.calls[1]
    cancelled_early = never_ran | before
    live_keys = {reqs[i] for i in range(n) if i not in cancelled_early}
    assert sorted(sent) == sorted(live_keys)  # cancelled-only keys were not sent
    assert len(sent) == len(set(sent))
    for i in during:
        tasks[i].cancel()
    engine.release()

    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i, res in enumerate(results):
        if i in never_ran or i in before or i in during:
            assert isinstance(res, asyncio.CancelledError)
        else:
            assert res == value_of(reqs[i])
    await blocker
    assert not other_tasks()
    assert b.num_pending == 0 and b.num_inflight == 0 and not b.busy
    assert not errors
    assert b.stats["engine_calls"] == 2

    # the batcher still works afterwards
    engine.release()
    assert await b.submit("after") == value_of("after")


async def test_cancel_submit_many_cleans_up(executor):
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor)
    blocker = await start_blocker(b, engine)
    t = asyncio.create_task(b.submit_many(["p", "q"]))
    other = asyncio.create_task(b.submit("q"))
    await until(lambda: b.num_pending == 2)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert b.num_pending == 1  # "p" dropped, "q" still wanted by `other`
    engine.release(2)
    assert await other == value_of("q")
    await blocker
    assert engine.calls[1] == ["q"]


# ------------------------------------------------------------------------ faults


async def test_compute_raises_fails_only_that_call(executor):
    def fn(reqs):
        if "bad" in reqs:
            raise ValueError("boom")
        return [value_of(r) for r in reqs]

    engine = FakeEngine(fn, hold=True)
    b = AutoBatcher(engine, executor=executor)
    ok1 = await start_blocker(b, engine, "ok1")
    doomed = [asyncio.create_task(b.submit(k)) for k in ("bad", "x", "bad")]
    await until(lambda: b.num_pending == 2)
    engine.release()
    await engine.wait_entered()
    later = asyncio.create_task(b.submit("y"))  # pending while the failing call runs
    await until(lambda: b.num_pending == 1)
    engine.release(2)
    assert await ok1 == value_of("ok1")
    res = await asyncio.gather(*doomed, return_exceptions=True)
    assert all(isinstance(r, ValueError) and "boom" in str(r) for r in res)
    assert await later == value_of("y")
    assert engine.calls == [["ok1"], ["bad", "x"], ["y"]]
    assert b.stats["failed_calls"] == 1
    engine.release()
    assert await b.submit("bad2") == value_of("bad2")  # still works


async def test_exception_in_result_slot(executor):
    def fn(reqs):
        return [KeyError(r) if r == "bad" else value_of(r) for r in reqs]

    cache = OutputCache(max_entries=100, max_bytes=None)
    engine = FakeEngine(fn)
    b = AutoBatcher(engine, executor=executor, cache=cache)
    res = await asyncio.gather(
        b.submit("bad"), b.submit("good"), b.submit("bad"), return_exceptions=True
    )
    assert isinstance(res[0], KeyError) and isinstance(res[2], KeyError)
    assert res[1] == value_of("good")
    assert "bad" not in cache and "good" in cache
    assert engine.calls == [["bad", "good"]]


async def test_wrong_result_count(executor):
    calls = 0

    def fn(reqs):
        nonlocal calls
        calls += 1
        if calls == 1:
            return [value_of(r) for r in reqs][:-1]
        if calls == 2:
            return None
        return [value_of(r) for r in reqs]

    b = AutoBatcher(FakeEngine(fn), executor=executor)
    res = await asyncio.gather(b.submit(1), b.submit(2), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) and "1 results for 2" in str(r) for r in res)
    with pytest.raises(RuntimeError, match="NoneType results for 1"):
        await b.submit(3)
    assert await b.submit(4) == value_of(4)


async def test_executor_shut_down_does_not_hang():
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    ex.shutdown()
    b = AutoBatcher(FakeEngine(), executor=ex)
    with pytest.raises(RuntimeError, match="shutdown"):
        await asyncio.wait_for(b.submit(1), WAIT)
    assert not b.busy and b.num_pending == 0


# ---------------------------------------------------------------- reset / close


async def test_reset_cancels_pending_and_inflight(executor):
    errors = install_error_recorder()
    cache = OutputCache(max_entries=100, max_bytes=None)
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor, cache=cache)
    inflight = await start_blocker(b, engine, "a")
    joined = asyncio.create_task(b.submit("a"))
    pending = [asyncio.create_task(b.submit(k)) for k in ("b", "c")]
    await until(lambda: b.stats["requests"] == 4)
    b.reset()
    for t in [inflight, joined, *pending]:
        with pytest.raises(asyncio.CancelledError):
            await t
    assert b.num_pending == 0 and b.num_inflight == 0
    assert b.busy  # the old call still occupies the engine

    after = asyncio.create_task(b.submit("a"))  # queued behind the stale call
    await until(lambda: b.num_pending == 1)
    engine.release()  # stale call completes: results dropped, not cached, no errors
    await engine.wait_entered()
    assert engine.calls == [["a"], ["a"]]
    engine.release()
    assert await after == value_of("a")
    assert not errors and not other_tasks()
    assert b.stats["resets"] == 1


async def test_reset_with_exception(executor):
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor)
    inflight = await start_blocker(b, engine, "a")
    pending = asyncio.create_task(b.submit("b"))
    await until(lambda: b.num_pending == 1)
    err = ConnectionError("engine died")
    b.reset(err)
    for t in (inflight, pending):
        with pytest.raises(ConnectionError, match="engine died"):
            await t
    engine.release(2)
    assert await b.submit("c") == value_of("c")


async def test_reset_from_another_thread(executor):
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor)
    inflight = await start_blocker(b, engine, "a")
    await asyncio.to_thread(b.reset)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(inflight, WAIT)
    engine.release()


async def test_close_resolves_everything_and_rejects_new(executor):
    errors = install_error_recorder()
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor, name="lm-batcher")
    inflight = await start_blocker(b, engine, "a")
    joined = asyncio.create_task(b.submit("a"))
    pending = asyncio.create_task(b.submit("b"))
    await until(lambda: b.stats["requests"] == 3)

    closing = asyncio.create_task(b.close())
    for t in (inflight, joined, pending):
        with pytest.raises(RuntimeError, match="lm-batcher is closed"):
            await t
    assert not closing.done()  # waits for the running compute call
    engine.release()
    await asyncio.wait_for(closing, WAIT)
    assert b.closed and not b.busy
    with pytest.raises(RuntimeError, match="closed"):
        await b.submit("c")
    with pytest.raises(RuntimeError, match="closed"):
        await b.submit_many(["c"])
    await b.close()  # idempotent
    assert engine.calls == [["a"]]  # "b" was never sent
    assert not errors and not other_tasks()


async def test_close_with_custom_exception(executor):
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor)
    inflight = await start_blocker(b, engine, "a")

    class ShuttingDown(Exception):
        pass

    b.close_nowait(ShuttingDown("bye"))
    with pytest.raises(ShuttingDown, match="bye"):
        await inflight
    engine.release()


def test_rebinds_to_a_new_loop_when_idle(executor):
    b = AutoBatcher(FakeEngine(), executor=executor)
    assert asyncio.run(b.submit(1)) == value_of(1)
    assert asyncio.run(b.submit(2)) == value_of(2)


# ----------------------------------------------------------------- cache/deliver


async def test_cache_hits_skip_compute_and_deliver_clones(executor):
    def fn(reqs):
        return [torch.full((4,), float(sum(r))) for r in reqs]

    delivered: list[torch.Tensor] = []

    def deliver(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        delivered.append(out)
        return out

    cache = OutputCache(max_entries=10, max_bytes=None)
    engine = FakeEngine(fn)
    b = AutoBatcher(engine, executor=executor, cache=cache, deliver=deliver)
    key = ("base", (1, 2))
    r1, r2 = await asyncio.gather(b.submit((1, 2), key=key), b.submit((1, 2), key=key))
    assert len(engine.calls) == 1
    assert len(delivered) == 2 and r1 is not r2  # deliver() once per waiter
    r1.add_(100.0)  # caller mutates its copy
    assert torch.equal(cache.get(key), torch.full((4,), 3.0))

    r3 = await b.submit((1, 2), key=key)
    assert len(engine.calls) == 1  # cache hit: engine untouched
    assert b.stats["cache_hits"] == 1
    assert torch.equal(r3, torch.full((4,), 3.0)) and r3 is not cache.get(key)
    assert len(delivered) == 3

    r4 = await b.submit_many([(1, 2), (5,)], keys=[key, ("base", (5,))])
    assert [float(t[0]) for t in r4] == [3.0, 5.0]
    assert engine.calls == [[(1, 2)], [(5,)]]


async def test_disabled_cache_always_computes(executor):
    engine = FakeEngine()
    b = AutoBatcher(engine, executor=executor, cache=OutputCache(max_entries=0))
    assert await b.submit(1) == await b.submit(1)
    assert len(engine.calls) == 2 and b.stats["cache_hits"] == 0


async def test_stale_results_not_cached_after_reset(executor):
    cache = OutputCache(max_entries=10, max_bytes=None)
    engine = FakeEngine(hold=True)
    b = AutoBatcher(engine, executor=executor, cache=cache)
    t = await start_blocker(b, engine, "a")
    b.reset()
    with pytest.raises(asyncio.CancelledError):
        await t
    engine.release()
    await asyncio.wait_for(b.close(), WAIT)
    assert "a" not in cache
