"""AutoBatcher (streaming mode, the one users run) against a fake ``start``.

The fake records every group it is handed and returns ``concurrent.futures.Future`` s that the
test resolves itself (on the loop thread or from another thread, as an engine would). Tests
wait for conditions (a group started, a task finished), never for wall-clock time; where a
test needs the tasks it created to run up to their first await, it gives the loop single passes
(:func:`passes`), which is deterministic in asyncio.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading

import pytest
import torch

from genlm_vlm.batching import AutoBatcher, KeyPlan, lookup
from genlm_vlm.cache import OutputCache


def value_of(request) -> int:
    """The value the fake engine computes for a request."""
    return hash(request) % 100_003


async def settle(*aws, return_exceptions: bool = False) -> list:
    """``asyncio.gather`` bounded in time: a test that would hang fails instead."""
    return await asyncio.wait_for(asyncio.gather(*aws, return_exceptions=return_exceptions), 30)


async def one(aw):
    """Await one task, bounded in time."""
    return await asyncio.wait_for(aw, 30)


async def passes(n: int = 1) -> None:
    """Let every task that is ready run ``n`` more steps (one event-loop pass each)."""
    for _ in range(n):
        await asyncio.sleep(0)


class FakeStart:
    """A ``start`` function: records each group and returns futures the test resolves."""

    def __init__(self, fail_on=None) -> None:
        self.groups: list[list] = []
        self.futures: list[list[cf.Future]] = []
        self.fail_on = fail_on
        self._changed = asyncio.Event()

    def __call__(self, requests: list) -> list[cf.Future]:
        futs = [cf.Future() for _ in requests]
        self.groups.append(list(requests))
        self.futures.append(futs)
        self._changed.set()
        if self.fail_on is not None and self.fail_on in requests:
            raise RuntimeError("injected: the engine refused this group")
        return futs

    async def wait_groups(self, n: int) -> None:
        """Return once ``n`` groups were started."""
        while len(self.groups) < n:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), 30)

    def future_of(self, request) -> cf.Future:
        for group, futs in zip(self.groups, self.futures, strict=False):
            if request in group:
                return futs[group.index(request)]
        raise KeyError(request)

    def resolve_all(self) -> None:
        for group, futs in zip(self.groups, self.futures, strict=False):
            for r, f in zip(group, futs, strict=True):
                if not f.done():
                    f.set_result(value_of(r))

    @property
    def sent(self) -> list:
        return [r for g in self.groups for r in g]


def spawn(batcher: AutoBatcher, *requests, key=None) -> list[asyncio.Task]:
    return [asyncio.create_task(batcher.submit(r, key)) for r in requests]


# ---------------------------------------------------------------------------------- grouping
async def test_one_pass_goes_out_as_one_group_in_submit_order():
    fake = FakeStart()
    b = AutoBatcher(fake)
    reqs = [f"r{i}" for i in range(7)]
    tasks = spawn(b, *reqs)
    await fake.wait_groups(1)
    assert fake.groups == [reqs]
    # resolve in reverse order from another thread, as an engine thread would
    t = threading.Thread(target=lambda: [f.set_result(value_of(r)) for r, f in reversed(list(zip(reqs, fake.futures[0], strict=True)))])
    t.start()
    t.join()
    assert await settle(*tasks) == [value_of(r) for r in reqs]
    assert b.stats["engine_calls"] == 1 and b.stats["items"] == 7 and b.stats["batch_sizes"] == {7: 1}
    assert b.num_pending == 0 and b.num_inflight == 0


async def test_batch_size_bounds_every_group():
    fake = FakeStart()
    b = AutoBatcher(fake, batch_size=3)
    tasks = spawn(b, *range(8))
    await fake.wait_groups(3)
    assert [len(g) for g in fake.groups] == [3, 3, 2]
    assert fake.sent == list(range(8))
    fake.resolve_all()
    assert await settle(*tasks) == [value_of(i) for i in range(8)]
    assert b.stats["max_batch"] == 3


async def test_lowered_batch_size_splits_what_is_already_pending():
    fake = FakeStart()
    b = AutoBatcher(fake, batch_size=100, timeout=3600.0)  # the timer never fires in this test
    tasks = spawn(b, *range(5))
    await passes()
    assert b.num_pending == 5 and fake.groups == []
    b.batch_size = 2
    tasks += spawn(b, 5)  # pending reaches batch_size: everything goes, two at a time
    await fake.wait_groups(3)
    assert [len(g) for g in fake.groups] == [2, 2, 2]
    fake.resolve_all()
    assert await settle(*tasks) == [value_of(i) for i in range(6)]


async def test_lone_await_pays_no_timer(monkeypatch):
    fake = FakeStart()
    b = AutoBatcher(fake)
    loop = asyncio.get_running_loop()
    armed = []
    real = loop.call_later

    def call_later(delay, fn, *args, **kwargs):
        armed.append(fn)
        return real(delay, fn, *args, **kwargs)

    monkeypatch.setattr(loop, "call_later", call_later)
    task = asyncio.create_task(b.submit("alone"))
    await fake.wait_groups(1)
    fake.resolve_all()
    assert await one(task) == value_of("alone")
    assert b._flush not in armed  # timeout=0: flushed at the next pass, no timer


async def test_timeout_arms_one_timer_that_flushes_the_stragglers(monkeypatch):
    fake = FakeStart()
    b = AutoBatcher(fake, timeout=5.0)
    loop = asyncio.get_running_loop()
    timers = []

    class Timer:
        def cancel(self) -> None:
            timers.clear()

    def call_later(delay, fn, *args):
        timers.append((delay, fn))
        return Timer()

    monkeypatch.setattr(loop, "call_later", call_later)
    tasks = spawn(b, "a")
    await passes()
    tasks += spawn(b, "b", "c")
    await passes()
    assert fake.groups == [] and [d for d, _ in timers] == [5.0]
    timers[0][1]()  # the timer fires (and a fired timer is not cancelled)
    assert fake.groups == [["a", "b", "c"]]
    fake.resolve_all()
    assert await settle(*tasks) == [value_of(r) for r in "abc"]


# ---------------------------------------------------------------------------------- dedup and cache
async def test_identical_keys_in_flight_are_computed_once():
    fake = FakeStart()
    b = AutoBatcher(fake)
    tasks = spawn(b, "x", "y", "x", "x")
    await fake.wait_groups(1)
    assert fake.groups == [["x", "y"]] and b.stats["dedup_joins"] == 2
    late = spawn(b, "x")  # joins the entry in flight: no second group
    await passes(2)
    assert len(fake.groups) == 1 and b.num_inflight == 2 and b.num_pending == 0
    fake.resolve_all()
    assert await settle(*tasks, *late) == [value_of(r) for r in ["x", "y", "x", "x", "x"]]
    assert b.stats["dedup_joins"] == 3 and b.stats["items"] == 2


async def test_explicit_keys_dedupe_by_key_not_request():
    fake = FakeStart()
    b = AutoBatcher(fake)
    tasks = [asyncio.create_task(b.submit(req, key)) for req, key in (("a1", "k"), ("a2", "k"), ("b", "j"))]
    await fake.wait_groups(1)
    assert fake.groups == [["a1", "b"]]
    fake.resolve_all()
    assert await settle(*tasks) == [value_of("a1"), value_of("a1"), value_of("b")]


async def test_without_dedupe_every_submit_is_sent():
    fake = FakeStart()
    b = AutoBatcher(fake, dedupe=False)
    tasks = spawn(b, "s", "s", "s")
    await fake.wait_groups(1)
    assert fake.groups == [["s", "s", "s"]]
    for i, f in enumerate(fake.futures[0]):
        f.set_result(i)
    assert await settle(*tasks) == [0, 1, 2]


async def test_cache_hits_skip_start_and_each_awaiter_gets_its_own_copy():
    fake = FakeStart()
    cache = OutputCache(max_entries=10, admit_after=1)
    b = AutoBatcher(fake, cache=cache, deliver=torch.Tensor.clone)
    task = asyncio.create_task(b.submit("p", ("k", 1)))
    await fake.wait_groups(1)
    computed = torch.arange(4.0)
    fake.futures[0][0].set_result(computed)
    first = await one(task)
    assert cache.get(("k", 1)) is computed
    hits = await settle(b.submit("p", ("k", 1)), b.submit("p", ("k", 1)))
    assert len(fake.groups) == 1 and b.stats["cache_hits"] == 2
    for row in (first, *hits):
        assert torch.equal(row, computed) and row.data_ptr() != computed.data_ptr()
    hits[0][0] = 99.0  # a caller's copy is its own
    assert computed[0] == 0.0


async def test_a_row_is_cached_the_second_time_it_is_computed():
    """Default admission: the first computation of a key is handed over and not kept (only its
    hash is remembered); the second is kept; later awaits are hits, each caller with its own
    copy, and mutating any of them (through torch or numpy) changes nothing for the others."""
    fake = BurstStart()
    cache = OutputCache(max_entries=10)
    b = AutoBatcher(fake, bursts=True, cache=cache, deliver=torch.Tensor.clone)
    values = [torch.arange(4.0), torch.arange(4.0)]
    got = []
    for i in range(2):
        task = asyncio.ensure_future(b.submit("p"))
        await fake.wait_calls(i + 1)
        fake.report(i, {"p": values[i]})
        got.append(await one(task))
    assert got[0] is values[0]  # first computation: nobody else keeps it, so no copy
    assert cache.get("p") is values[1] and got[1] is not values[1]  # second: kept, the caller has a copy
    assert cache.stats()["not_admitted"] == 1 and len(fake.calls) == 2
    hits = await settle(b.submit("p"), b.submit("p"))
    assert len(fake.calls) == 2 and b.stats["cache_hits"] == 2
    got[1][0] = 50.0
    hits[0].numpy()[1] = 60.0
    hits[1].add_(1.0)
    assert torch.equal(values[1], torch.arange(4.0))
    assert torch.equal(await one(b.submit("p")), torch.arange(4.0))


async def test_awaiters_joined_on_one_computation_count_as_asking_twice():
    """Identical prompts in flight together share one computation; the cache keeps its value
    (it was asked for twice) and every awaiter gets a copy of its own."""
    fake = BurstStart()
    cache = OutputCache(10)
    b = AutoBatcher(fake, bursts=True, cache=cache, deliver=torch.Tensor.clone)
    tasks = [asyncio.ensure_future(b.submit("d")) for _ in range(3)]
    await fake.wait_calls(1)
    value = torch.zeros(3)
    fake.report(0, {"d": value})
    rows = await settle(*tasks)
    assert cache.get("d") is value and all(r is not value for r in rows)
    rows[0].numpy()[:] = 7.0
    rows[1].add_(1.0)
    assert torch.equal(value, torch.zeros(3)) and torch.equal(rows[2], torch.zeros(3))
    assert torch.equal(await one(b.submit("d")), torch.zeros(3)) and len(fake.calls) == 1


async def test_one_of_several_awaiters_takes_a_value_nobody_keeps():
    fake = BurstStart()
    b = AutoBatcher(fake, bursts=True, cache=OutputCache(0), deliver=torch.Tensor.clone)
    tasks = [asyncio.ensure_future(b.submit("d")) for _ in range(3)]
    await fake.wait_calls(1)
    value = torch.zeros(3)
    fake.report(0, {"d": value})
    rows = await settle(*tasks)
    assert sum(r is value for r in rows) == 1 and len({r.data_ptr() for r in rows}) == 3
    rows[0].numpy()[:] = 7.0  # each caller's row is its own
    assert sum(float(r[0]) == 7.0 for r in rows) == 1


async def test_a_failed_entry_is_not_cached():
    fake = FakeStart()
    cache = OutputCache(max_entries=10)
    b = AutoBatcher(fake, cache=cache)
    task = asyncio.create_task(b.submit("p"))
    await fake.wait_groups(1)
    fake.futures[0][0].set_exception(ValueError("bad row"))
    with pytest.raises(ValueError, match="bad row"):
        await one(task)
    assert "p" not in cache
    again = asyncio.create_task(b.submit("p"))  # computed again, not served a stale error
    await fake.wait_groups(2)
    fake.resolve_all()
    assert await one(again) == value_of("p")


def test_lookup_and_keyplan_share_one_step():
    cache = OutputCache(max_entries=10)
    cache.put("cached", torch.zeros(2))
    assert lookup("planned", cache, {"planned": 7}) == ("joined", 7)
    how, value = lookup("cached", cache, {})
    assert how == "cached" and torch.equal(value, torch.zeros(2))
    assert lookup("new", cache, {}) == ("new", None)
    misses = cache.misses
    lookup("planned", cache, {"planned": 0})  # joined: the cache is not asked
    assert cache.misses == misses

    plan: KeyPlan[torch.Tensor] = KeyPlan(["a", "cached", "a", "b", "cached"], cache)
    assert plan.todo == {"a": 0, "b": 3} and plan.cache_hits == 1 and plan.dedup_joins == 2
    plan.fill("a", torch.ones(2))
    plan.fill("b", torch.full((2,), 2.0))
    assert [float(v[0]) for v in plan.results()] == [1.0, 0.0, 1.0, 2.0, 0.0]
    assert "a" in cache  # asked for twice in the call: kept for the next call
    assert "b" not in cache  # asked for once: only its key is remembered
    again: KeyPlan[torch.Tensor] = KeyPlan(["b", "a"], cache)
    assert again.todo == {"b": 0} and again.cache_hits == 1
    again.fill("b", torch.full((2,), 2.0))
    assert "b" in cache  # asked for a second time: kept for the next call


# ---------------------------------------------------------------------------------- cancellation
async def test_cancelling_one_of_two_awaiters_keeps_the_work():
    fake = FakeStart()
    b = AutoBatcher(fake)
    keep, drop = spawn(b, "k", "k")
    await fake.wait_groups(1)
    drop.cancel()
    await settle(drop, return_exceptions=True)
    handle = fake.future_of("k")
    assert not handle.cancelled() and b.num_inflight == 1
    handle.set_result(5)
    assert await one(keep) == 5 and drop.cancelled()


async def test_engine_future_cancelled_once_no_awaiter_waits():
    fake = FakeStart()
    b = AutoBatcher(fake)
    first, second, other = spawn(b, "k", "k", "o")
    await fake.wait_groups(1)
    handle = fake.future_of("k")
    for t in (first, second):
        t.cancel()
        await settle(t, return_exceptions=True)
    assert handle.cancelled()  # tells the engine to abort the work
    assert not fake.future_of("o").cancelled() and b.num_inflight == 1
    assert b.stats["dropped_cancelled"] == 1
    fake.resolve_all()
    assert await one(other) == value_of("o")


async def test_awaiter_cancelled_before_dispatch_is_never_sent():
    fake = FakeStart()
    b = AutoBatcher(fake, batch_size=2, timeout=3600.0)
    [gone] = spawn(b, "gone")
    await passes()
    assert b.num_pending == 1
    gone.cancel()
    await settle(gone, return_exceptions=True)
    assert b.num_pending == 0
    tasks = spawn(b, "a", "b")  # a full group goes out at once
    await fake.wait_groups(1)
    assert fake.groups == [["a", "b"]] and "gone" not in fake.sent
    fake.resolve_all()
    assert await settle(*tasks) == [value_of("a"), value_of("b")]


async def test_awaiter_cancelled_in_the_pass_of_the_flush_is_dropped():
    fake = FakeStart()
    b = AutoBatcher(fake)
    gone, kept = spawn(b, "gone", "kept")
    await passes()  # both registered; the flush runs after this test step
    gone.cancel()  # its awaiter is done now, its task has not run its cleanup yet
    await fake.wait_groups(1)
    assert fake.groups == [["kept"]] and b.stats["dropped_cancelled"] == 1
    fake.resolve_all()
    assert await one(kept) == value_of("kept")
    assert (await settle(gone, return_exceptions=True))[0].__class__ is asyncio.CancelledError


async def test_engine_cancelling_its_future_cancels_the_awaiters():
    fake = FakeStart()
    b = AutoBatcher(fake)
    a1, a2, other = spawn(b, "a", "a", "z")
    await fake.wait_groups(1)
    fake.future_of("a").cancel()
    fake.future_of("z").set_result(1)
    results = await settle(a1, a2, other, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError) and isinstance(results[1], asyncio.CancelledError)
    assert results[2] == 1


# ---------------------------------------------------------------------------------- faults
async def test_start_raising_fails_exactly_that_group():
    fake = FakeStart(fail_on="poison")
    b = AutoBatcher(fake, batch_size=2)
    tasks = spawn(b, "a", "b", "c", "poison", "d")  # groups [a, b], [c, poison], [d]
    await fake.wait_groups(3)
    fake.resolve_all()
    results = await settle(*tasks, return_exceptions=True)
    assert results[0] == value_of("a") and results[1] == value_of("b") and results[4] == value_of("d")
    assert all(isinstance(r, RuntimeError) and "injected" in str(r) for r in results[2:4])
    assert b.stats["failed_calls"] == 1 and b.num_inflight == 0
    again = asyncio.create_task(b.submit("c"))  # the batcher goes on serving
    await fake.wait_groups(4)
    fake.resolve_all()
    assert await one(again) == value_of("c") and fake.groups[3] == ["c"]


async def test_a_failed_future_fails_only_its_entry():
    fake = FakeStart()
    b = AutoBatcher(fake)
    tasks = spawn(b, "ok", "bad", "bad", "ok2")
    await fake.wait_groups(1)
    fake.future_of("bad").set_exception(KeyError("no such row"))
    fake.resolve_all()
    results = await settle(*tasks, return_exceptions=True)
    assert results[0] == value_of("ok") and results[3] == value_of("ok2")
    assert all(isinstance(r, KeyError) for r in results[1:3])


async def test_wrong_number_of_futures_fails_the_group():
    b = AutoBatcher(lambda reqs: [cf.Future()])
    results = await settle(b.submit(1), b.submit(2), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) and "2 requests" in str(r) for r in results)


async def test_stop_iteration_becomes_runtime_error():
    fake = FakeStart()
    b = AutoBatcher(fake)
    task = asyncio.create_task(b.submit("s"))
    await fake.wait_groups(1)
    fake.futures[0][0].set_exception(StopIteration("odd"))
    with pytest.raises(RuntimeError, match="StopIteration"):
        await one(task)


# ---------------------------------------------------------------------------------- reset and close
async def test_reset_cancels_pending_and_inflight_and_drops_late_values():
    fake = FakeStart()
    cache = OutputCache(max_entries=10)
    b = AutoBatcher(fake, cache=cache, batch_size=2, timeout=3600.0)
    inflight = spawn(b, "a", "b")  # a full group: dispatched
    await fake.wait_groups(1)
    pending = spawn(b, "c")
    await passes()
    assert b.num_inflight == 2 and b.num_pending == 1
    b.reset()
    results = await settle(*inflight, *pending, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert all(f.cancelled() for f in fake.futures[0])  # the engine is told to abort
    assert b.num_inflight == 0 and b.num_pending == 0 and "c" not in fake.sent
    assert len(cache) == 0 and b.stats["resets"] == 1


async def test_late_value_after_reset_is_neither_delivered_nor_cached():
    fake = FakeStart()
    cache = OutputCache(max_entries=10)
    b = AutoBatcher(fake, cache=cache)
    old = asyncio.create_task(b.submit("a"))
    await fake.wait_groups(1)
    fake.futures[0][0].cancel = lambda: False  # the engine can no longer cancel it
    b.reset()
    assert isinstance((await settle(old, return_exceptions=True))[0], asyncio.CancelledError)
    fake.futures[0][0].set_result(1)
    new = asyncio.create_task(b.submit("a"))
    await fake.wait_groups(2)
    assert "a" not in cache
    fake.futures[1][0].set_result(2)
    assert await one(new) == 2


async def test_reset_with_an_exception_and_from_another_thread():
    fake = FakeStart()
    b = AutoBatcher(fake)
    tasks = spawn(b, "a", "b")
    await fake.wait_groups(1)
    t = threading.Thread(target=b.reset, args=(ConnectionError("engine gone"),))
    t.start()
    t.join()
    results = await settle(*tasks, return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)


async def test_close_resolves_every_awaiter_and_rejects_new_submits():
    fake = FakeStart()
    b = AutoBatcher(fake, batch_size=1, timeout=3600.0, name="lm")
    inflight = spawn(b, "a")
    await fake.wait_groups(1)
    b.close(LookupError("closed while pending"))
    results = await settle(*inflight, return_exceptions=True)
    assert isinstance(results[0], LookupError)
    assert b.closed
    with pytest.raises(RuntimeError, match="lm is closed"):
        await b.submit("b")
    b.close()  # idempotent


async def test_close_without_exception_gives_runtime_error():
    fake = FakeStart()
    b = AutoBatcher(fake, name="sample")
    task = asyncio.create_task(b.submit("a"))
    await fake.wait_groups(1)
    b.close()
    with pytest.raises(RuntimeError, match="sample is closed"):
        await one(task)


def test_rebinds_to_a_new_loop_when_idle():
    calls = []

    def start(requests):
        calls.append(list(requests))
        futs = [cf.Future() for _ in requests]
        for r, f in zip(requests, futs, strict=True):
            f.set_result(value_of(r))
        return futs

    b = AutoBatcher(start)
    assert asyncio.run(b.submit("first")) == value_of("first")
    assert asyncio.run(b.submit("second")) == value_of("second")
    assert calls == [["first"], ["second"]]


def test_constructor_checks():
    with pytest.raises(ValueError, match="batch_size"):
        AutoBatcher(FakeStart(), batch_size=0)
    with pytest.raises(ValueError, match="timeout"):
        AutoBatcher(FakeStart(), timeout=-1)


# ---------------------------------------------------------------------------- burst mode
class BurstStart:
    """A ``start`` in burst mode: returns tickets; the test reports results through the
    listener from another thread, several at once, as the engine does once per step."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, object, list]] = []
        self.cancelled: list = []
        self._changed = asyncio.Event()

    def __call__(self, requests: list, listener, payloads: list) -> list:
        from genlm_vlm.engine import Ticket

        tickets = [Ticket(listener, p, self.cancelled.append) for p in payloads]
        self.calls.append((list(requests), listener, tickets))
        self._changed.set()
        return tickets

    async def wait_calls(self, n: int) -> None:
        while len(self.calls) < n:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), 30)

    def report(self, call: int, values: dict | None = None, exc: BaseException | None = None) -> None:
        """Report every ticket of a call in one listener call, from another thread."""
        requests, listener, tickets = self.calls[call]
        items = [(t, None if exc else (values or {}).get(r, value_of(r)), exc) for r, t in zip(requests, tickets,
                                                                                               strict=True)]
        worker = threading.Thread(target=listener, args=(items,))
        worker.start()
        worker.join()


async def test_bursts_deliver_a_whole_group_in_one_loop_hop():
    fake = BurstStart()
    b = AutoBatcher(fake, bursts=True)
    tasks = [asyncio.ensure_future(b.submit(r)) for r in ("a", "b", "c", "a")]
    await fake.wait_calls(1)
    assert fake.calls[0][0] == ["a", "b", "c"]
    fake.report(0)
    assert await settle(*tasks) == [value_of(r) for r in ("a", "b", "c", "a")]
    st = b.stats
    assert st["result_hops"] == 1 and st["dedup_joins"] == 1 and st["deliver_s"] >= 0


async def test_bursts_copy_only_what_is_shared():
    """A value the cache does not keep goes to one awaiter as is; the others sharing it, and
    every awaiter of a value the cache keeps, get ``deliver`` (a copy)."""
    fake = BurstStart()
    b = AutoBatcher(fake, bursts=True, deliver=torch.Tensor.clone)
    solo, dup1 = torch.zeros(3), torch.ones(3)
    tasks = [asyncio.ensure_future(b.submit(r)) for r in ("solo", "dup", "dup")]
    await fake.wait_calls(1)
    fake.report(0, {"solo": solo, "dup": dup1})
    got_solo, got1, got2 = await settle(*tasks)
    assert got_solo is solo
    assert (got1 is dup1) != (got2 is dup1) and got1 is not got2 and torch.equal(got1, got2)
    cached = AutoBatcher(BurstStart(), bursts=True, deliver=torch.Tensor.clone,
                         cache=OutputCache(10, admit_after=1))
    task = asyncio.ensure_future(cached.submit("k"))
    await cached._start.wait_calls(1)
    value = torch.full((2,), 7.0)
    cached._start.report(0, {"k": value})
    got = await one(task)
    assert got is not value and torch.equal(got, value)
    assert cached.cache.get("k") is value  # the cache keeps the engine's tensor, callers get copies
    off = AutoBatcher(BurstStart(), bursts=True, deliver=torch.Tensor.clone, cache=OutputCache(0))
    task = asyncio.ensure_future(off.submit("k"))
    await off._start.wait_calls(1)
    off._start.report(0, {"k": value})
    assert await one(task) is value  # a cache that stores nothing needs no copy
    batch = torch.arange(6.0).reshape(2, 3)
    task = asyncio.ensure_future(off.submit("v"))
    await off._start.wait_calls(2)
    off._start.report(1, {"v": batch[1]})
    got = await one(task)  # a view into a batch would keep the whole batch alive: a compact copy
    assert torch.equal(got, batch[1]) and got.untyped_storage().nbytes() == 3 * 4


async def test_bursts_failures_cancellation_and_reset():
    fake = BurstStart()
    b = AutoBatcher(fake, bursts=True)
    t1 = asyncio.ensure_future(b.submit("x"))
    t2 = asyncio.ensure_future(b.submit("y"))
    await fake.wait_calls(1)
    t2.cancel()
    await passes(2)
    assert [t.payload.request for t in fake.cancelled] == ["y"]  # its ticket was cancelled
    fake.report(0, exc=ValueError("bad row"))
    with pytest.raises(ValueError, match="bad row"):
        await one(t1)
    t3 = asyncio.ensure_future(b.submit("z"))
    await fake.wait_calls(2)
    b.reset()
    with pytest.raises(asyncio.CancelledError):
        await one(t3)
    fake.report(1)  # a late result after the reset is dropped
    await passes(2)
    assert b.num_inflight == 0


async def test_submit_many_joins_the_same_groups_without_a_task_per_request():
    """One batch call and a lone await of the same pass go out as one group; duplicates within
    the call are computed once (kept by the cache: asked twice), cache hits are answered at once,
    and every position gets a value of its own."""
    fake = BurstStart()
    cache = OutputCache(10)
    b = AutoBatcher(fake, bursts=True, cache=cache, deliver=torch.Tensor.clone)
    cache.put("hit", torch.full((2,), 9.0))
    tasks_before = len(asyncio.all_tasks())
    many = asyncio.ensure_future(b.submit_many(["a", "b", "a", "hit"], ["a", "b", "a", "hit"]))
    lone = asyncio.ensure_future(b.submit("c"))
    await fake.wait_calls(1)
    assert len(asyncio.all_tasks()) == tasks_before + 2  # the two awaiters, nothing per request
    assert fake.calls[0][0] == ["a", "b", "c"]
    values = {r: torch.full((2,), float(i)) for i, r in enumerate("abc")}
    fake.report(0, values)
    got, c = await settle(many, lone)
    assert [float(r[0]) for r in got] == [0.0, 1.0, 0.0, 9.0] and float(c[0]) == 2.0
    assert got[1] is values["b"] and c is values["c"]  # asked once: handed over as is
    assert len({r.data_ptr() for r in got}) == 4 and cache.get("a") is values["a"]
    assert b.stats["requests"] == 5 and b.stats["dedup_joins"] == 1 and b.stats["cache_hits"] == 1


async def test_submit_many_raises_the_first_failure_and_drops_the_rest():
    fake = BurstStart()
    b = AutoBatcher(fake, bursts=True)
    other = asyncio.ensure_future(b.submit("y"))  # another awaiter of "y" keeps it alive
    many = asyncio.ensure_future(b.submit_many(["x", "y", "z"], ["x", "y", "z"]))
    await fake.wait_calls(1)
    requests, listener, tickets = fake.calls[0]
    listener([(tickets[requests.index("x")], None, ValueError("bad row"))])
    with pytest.raises(ValueError, match="bad row"):
        await one(many)
    assert [t.payload.request for t in fake.cancelled] == ["z"]  # nobody else waits for z
    fake.report(0)
    assert await one(other) == value_of("y")
    assert b.num_inflight == 0


async def test_submit_many_cancelled_releases_every_request():
    fake = BurstStart()
    b = AutoBatcher(fake, bursts=True)
    many = asyncio.ensure_future(b.submit_many(["p", "q"], ["p", "q"]))
    await fake.wait_calls(1)
    many.cancel()
    with pytest.raises(asyncio.CancelledError):
        await one(many)
    assert sorted(t.payload.request for t in fake.cancelled) == ["p", "q"] and b.num_inflight == 0
    assert await b.submit_many([], []) == []
