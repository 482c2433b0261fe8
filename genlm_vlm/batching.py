"""Batching concurrent asyncio awaits into groups for an engine that batches continuously.

Many coroutines (e.g. SMC particles) ``await batcher.submit(request, key)``, or one awaits
``submit_many`` for a whole batch (no task per request); the :class:`AutoBatcher` collects the
requests of one event-loop pass (or of ``timeout`` seconds) into groups of at most ``batch_size``
and hands each to ``start``. Identical keys in flight are computed once and cached values
answered at once (:func:`lookup`, the cache-and-dedup step the blocking paths take too through
:class:`KeyPlan`); work nobody waits for any more is dropped or its future cancelled (the engine
aborts it); failures, :meth:`AutoBatcher.reset` and :meth:`AutoBatcher.close` resolve exactly
the awaiters concerned, so nothing ever hangs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._mailbox import Mailbox
from .cache import owns_its_memory
from .dedup import KeyPlan, lookup

if TYPE_CHECKING:
    from .cache import OutputCache

__all__ = ["AutoBatcher", "KeyPlan", "lookup"]

R = TypeVar("R")
V = TypeVar("V")


@dataclass(eq=False)
class _Entry:
    """One unit of work handed to ``start``; shared by every awaiter of its key."""

    key: Hashable  # key in the pending / in-flight dicts (a unique object() if dedupe=False)
    cache_key: Hashable | None  # key for the output cache (None = not cached)
    request: Any
    # Insertion-ordered (a dict used as an ordered set): awaiters are resolved, and so resume,
    # in the order they were made.
    waiters: dict[asyncio.Future, None] = field(default_factory=dict)
    handle: Any = None  # the engine's future or ticket, once dispatched (has .cancel())
    owner: asyncio.Future | None = None  # the awaiter that takes the value itself (no copy)
    asks: int = 1  # submits that wanted this computation (joins included): the cache's admission

    def live(self) -> bool:
        """True if at least one awaiter still wants the result."""
        return any(not f.done() for f in self.waiters)


class AutoBatcher(Generic[R, V]):
    """Group concurrent ``submit`` calls and hand each group to ``start``.

    Args:
        start: ``start(requests) -> futures``, called on the loop thread with a group of at
            most ``batch_size`` requests; returns one ``concurrent.futures.Future`` per request,
            in order, which the engine resolves (from any thread) with the request's value or
            exception. A future the batcher cancels means nobody waits for it any more: the
            engine may abort that work.
        batch_size: Most distinct entries per group.
        timeout: Seconds to wait for stragglers after the first request of an idle period
            (``0`` = flush at the next event-loop pass).
        cache: Optional :class:`~genlm_vlm.cache.OutputCache`; keys are looked up on submit
            and computed values are offered to it (:meth:`~genlm_vlm.cache.OutputCache.offer`:
            kept once a key has been asked for twice, by joined submits or over time). A value
            the cache did not keep goes to one awaiter as is (in burst mode, unless it is a view
            into a larger tensor).
        deliver: Applied to the value once per awaiter (cache hits included; not for the one
            awaiter that takes a value nobody else keeps), in the awaiter's own task; e.g.
            ``torch.Tensor.clone``.
        dedupe: If true, requests with equal keys pending or in flight together share one
            computation. If false, every submit is its own entry (e.g. for sampling); an
            explicit ``key`` is then used for the cache only.
        name: Label used in error messages.
        bursts: If true, ``start(requests, listener, payloads)`` returns one handle per request
            (anything with ``cancel()``, e.g. :class:`genlm_vlm.engine.Ticket`) and reports
            results by calling ``listener([(handle, value, exception), ...])`` from any thread,
            each handle carrying its payload as ``handle.payload``: one hop to the event loop per
            call instead of one per result (the engine calls it once per step).

    Threading: every method except :meth:`reset` / :meth:`close` must be called from the
    event loop the batcher is used on; those two may be called from any thread (off-loop calls
    are forwarded with ``call_soon_threadsafe`` and return before the awaiters are resolved).
    The batcher binds to the loop of the first ``submit`` and may rebind to another loop once
    it is idle (or its old loop is closed); a ``submit`` from another loop while calls are
    pending raises ``RuntimeError`` saying so and what to do instead.
    """

    def __init__(
        self,
        start: Callable[[list[R]], Sequence[concurrent.futures.Future]],
        *,
        batch_size: int = 256,
        timeout: float = 0.0,
        cache: OutputCache | None = None,
        deliver: Callable[[V], V] | None = None,
        dedupe: bool = True,
        name: str = "batcher",
        bursts: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout!r}")
        self._start = start
        self.batch_size = int(batch_size)
        self.timeout = float(timeout)
        self.cache = cache
        self._deliver: Callable[[V], V] = deliver if deliver is not None else (lambda value: value)
        self.dedupe = bool(dedupe)
        self.name = name
        self._bursts = bool(bursts)
        self._listener: tuple[Any, int, Callable[..., None]] | None = None  # (loop, generation, fn)

        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._pending: dict[Hashable, _Entry] = {}  # insertion-ordered, not yet dispatched
        self._inflight: dict[Hashable, _Entry] = {}  # dispatched, engine future not done
        self._flush_handle: asyncio.Handle | None = None
        self._mailbox: Mailbox | None = None  # completions on their way to the loop
        self._generation = 0  # bumped by reset(); completions of older entries are dropped
        self._closed = False
        self._counts: Counter[str] = Counter()  # the counters of ``stats`` (loop thread)
        self._deliver_s = 0.0  # loop time spent handing burst results to awaiters (loop thread)
        self._batch_hist: Counter[int] = Counter()

    # ---------------------------------------------------------------- status
    @property
    def closed(self) -> bool:
        """True after :meth:`close`; ``submit`` then raises."""
        return self._closed

    @property
    def num_pending(self) -> int:
        """Number of entries waiting to be dispatched."""
        return len(self._pending)

    @property
    def num_inflight(self) -> int:
        """Number of dispatched entries whose engine future is not done (0 after a reset)."""
        return len(self._inflight)

    @property
    def stats(self) -> dict[str, Any]:
        """Snapshot of counters.

        Keys: ``engine_calls`` (groups handed to ``start``), ``requests`` (submits, cache hits
        included), ``dedup_joins`` (submits that joined a pending or in-flight entry),
        ``cache_hits``, ``items`` (entries handed to ``start``), ``dropped_cancelled`` (entries
        nobody waited for any more: never sent, or their engine future cancelled),
        ``failed_calls`` (groups ``start`` could not take), ``resets``, ``max_batch``,
        ``batch_sizes`` (a ``{size: count}`` histogram), and in burst mode ``result_hops``
        (hand-overs of results from the engine thread to the loop: one per engine step) and
        ``deliver_s`` (loop seconds spent caching results and resolving awaiters).
        """
        names = ("engine_calls", "requests", "dedup_joins", "cache_hits", "items", "dropped_cancelled",
                 "failed_calls", "resets", "result_hops")
        return {**{n: self._counts[n] for n in names}, "max_batch": max(self._batch_hist, default=0),
                "batch_sizes": dict(sorted(self._batch_hist.items())), "deliver_s": round(self._deliver_s, 6)}

    # ---------------------------------------------------------------- submit
    async def submit(self, request: R, key: Hashable | None = None) -> V:
        """Compute ``request`` in some group and return ``deliver(value)``.

        ``key`` defaults to ``request`` when ``dedupe`` is true (it must then be hashable).
        Raises ``RuntimeError`` if the batcher is closed, the exception of a failed
        computation, or ``CancelledError`` if the awaiter was cancelled (by its task or by
        :meth:`reset`).
        """
        value, entry, fut = self._enter(request, key, self._running_loop())
        if entry is None:
            return value
        try:
            value = await fut
        finally:
            own = fut is entry.owner
            self._release(entry, fut)
        return value if own else self._deliver(value)

    async def submit_many(self, requests: Sequence[R], keys: Sequence[Hashable | None]) -> list[V]:
        """``[await submit(r, k) for ...]`` as one awaiter: the same groups, dedup, cache and
        hand-over, without a task per request. The first failure is raised and every request of
        the call nobody else waits for is dropped (its engine work aborted)."""
        loop = self._running_loop()
        out: list[Any] = []
        waits: list[tuple[int, _Entry, asyncio.Future]] = []
        ok = False
        try:
            for i, (request, key) in enumerate(zip(requests, keys, strict=True)):
                value, entry, fut = self._enter(request, key, loop)
                out.append(value)
                if entry is not None:
                    waits.append((i, entry, fut))  # type: ignore[arg-type]
            for _, _, fut in waits:
                await fut  # one suspension per burst of results: the rest are done by then
            ok = True
        finally:
            for i, entry, fut in waits:
                own = fut is entry.owner
                self._release(entry, fut)
                if ok:
                    out[i] = fut.result() if own else self._deliver(fut.result())
        return out

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._bind(loop)
        return loop

    def _enter(self, request: R, key: Hashable | None,
               loop: asyncio.AbstractEventLoop) -> tuple[Any, _Entry | None, asyncio.Future | None]:
        """One request's cache-and-dedup step: ``(delivered cache hit, None, None)``, or
        ``(None, entry, future)`` with a new future among the entry's waiters."""
        self._counts["requests"] += 1
        if self.dedupe:
            key = request if key is None else key
            how, found = lookup(key, self.cache, self._inflight, self._pending)
        else:
            how, found = lookup(key, self.cache) if key is not None else ("new", None)
        if how == "cached":
            self._counts["cache_hits"] += 1
            return self._deliver(found), None, None
        fut = loop.create_future()
        if how == "joined":
            self._counts["dedup_joins"] += 1
            entry = found
            entry.asks += 1
            entry.waiters[fut] = None
        else:
            entry = _Entry(key=key if self.dedupe else object(), cache_key=key,
                           request=request, waiters={fut: None})
            self._pending[entry.key] = entry
            self._schedule()
        return None, entry, fut

    def _release(self, entry: _Entry, fut: asyncio.Future) -> None:
        """Detach a finished (or abandoned) awaiter; drop the entry once nobody waits for it."""
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled():
            fut.exception()  # mark as retrieved: no "exception never retrieved" log
        entry.waiters.pop(fut, None)
        if entry.owner is fut:
            entry.owner = None  # the entry must not keep the value alive
        if entry.live():
            return
        if self._pending.get(entry.key) is entry:
            del self._pending[entry.key]
            self._counts["dropped_cancelled"] += 1
        elif entry.handle is not None and self._inflight.get(entry.key) is entry:
            # Nobody waits any more; cancelling the engine's future aborts the work.
            del self._inflight[entry.key]
            entry.handle.cancel()
            self._counts["dropped_cancelled"] += 1

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        old = self._loop
        if old is not None and not old.is_closed() and (self._pending or self._inflight):
            raise RuntimeError(
                f"this model is busy on another event loop (its async {self.name} calls there "
                "are still pending): one model serves one event loop at a time. From other "
                "threads, use the blocking *_sync methods (thread-safe), or hand coroutines "
                "to the first loop with asyncio.run_coroutine_threadsafe(coro, loop); a new "
                "loop can take over once the old loop's calls have finished or it is closed."
            )
        if old is not None:
            # The old loop is closed or the batcher is idle: forget its state.
            self._abandon_state()
        self._loop = loop
        self._loop_thread = threading.get_ident()

    def _abandon_state(self) -> None:
        for entry in itertools.chain(self._pending.values(), self._inflight.values()):
            if entry.handle is not None:
                entry.handle.cancel()
            for f in entry.waiters:
                if not f.done():
                    try:
                        f.cancel()
                    except RuntimeError:  # pragma: no cover - closed loop
                        pass
        self._pending.clear()
        self._inflight.clear()
        self._flush_handle = None
        self._generation += 1

    # ------------------------------------------------------------- scheduling
    def _schedule(self) -> None:
        """Called after a new pending entry was added."""
        if len(self._pending) >= self.batch_size:
            self._dispatch()
        elif self._flush_handle is None:
            assert self._loop is not None
            if self.timeout > 0:
                self._flush_handle = self._loop.call_later(self.timeout, self._flush)
            else:
                self._flush_handle = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        if asyncio.get_running_loop() is not self._loop:
            return  # stale handle from a loop we have since left
        self._flush_handle = None
        if not self._closed:
            self._dispatch()

    def _cancel_flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None

    def _dispatch(self) -> None:
        """Hand every live pending entry to ``start``, in groups of at most ``batch_size``."""
        self._cancel_flush()
        live = [e for e in self._pending.values() if e.live()]
        self._counts["dropped_cancelled"] += len(self._pending) - len(live)
        self._pending.clear()
        for i in range(0, len(live), self.batch_size):
            self._start_group(live[i : i + self.batch_size])

    def _start_group(self, group: list[_Entry]) -> None:
        assert self._loop is not None
        try:
            if self._bursts:
                handles = list(self._start([e.request for e in group], self._burst_listener(), group))
            else:
                handles = list(self._start([e.request for e in group]))
            if len(handles) != len(group):
                raise RuntimeError(f"{self.name}: start returned {len(handles)} futures for {len(group)} requests")
        except BaseException as exc:  # noqa: BLE001 - e.g. the engine is shut down: this group's awaiters
            self._counts["failed_calls"] += 1
            for e in group:
                self._resolve_exc(e, exc)
            return
        self._counts["engine_calls"] += 1
        self._counts["items"] += len(group)
        self._batch_hist[len(group)] += 1
        if self._bursts:
            for e, handle in zip(group, handles, strict=True):
                e.handle = handle
                self._inflight[e.key] = e
            return
        box = self._mailbox
        if box is None or box.loop is not self._loop:
            box = self._mailbox = Mailbox(self._loop, self._on_entry_done)
        for e, handle in zip(group, handles, strict=True):
            e.handle = handle
            self._inflight[e.key] = e
            handle.add_done_callback(functools.partial(box.post, self._generation, e))

    def _on_entry_done(self, generation: int, entry: _Entry, handle: concurrent.futures.Future) -> None:
        """One entry's engine future finished (loop thread)."""
        if handle.cancelled():
            self._finish(generation, entry, None, None, cancelled=True)
        elif (exc := handle.exception()) is not None:
            self._finish(generation, entry, None, exc)
        else:
            self._finish(generation, entry, handle.result(), None)

    def _burst_listener(self) -> Callable[[list[tuple[Any, Any, BaseException | None]]], None]:
        """The listener handed to ``start`` in burst mode: it hops to the loop once per call."""
        loop, generation = self._loop, self._generation
        cached = self._listener
        if cached is not None and cached[0] is loop and cached[1] == generation:
            return cached[2]

        def listener(items: list[tuple[Any, Any, BaseException | None]]) -> None:
            try:
                loop.call_soon_threadsafe(self._on_burst, generation, items)  # type: ignore[union-attr]
            except RuntimeError:  # the loop is closed: nobody waits there any more
                pass

        self._listener = (loop, generation, listener)
        return listener

    def _on_burst(self, generation: int, items: list[tuple[Any, Any, BaseException | None]]) -> None:
        """Results of one engine step (loop thread)."""
        t0 = time.perf_counter()
        self._counts["result_hops"] += 1
        for handle, value, exc in items:
            try:
                self._finish(generation, handle.payload, value, exc)
            except BaseException as err:  # noqa: BLE001 - reported, and the rest still delivered
                self._loop.call_exception_handler(  # type: ignore[union-attr]
                    {"message": "genlm_vlm: delivering a result failed", "exception": err}
                )
        self._deliver_s += time.perf_counter() - t0

    def _finish(self, generation: int, entry: _Entry, value: Any, exc: BaseException | None,
                cancelled: bool = False) -> None:
        """An entry's computation ended: cache its value and resolve its awaiters."""
        if self._inflight.get(entry.key) is entry:
            del self._inflight[entry.key]
        entry.handle = None  # done with it; and entry -> ticket -> entry would be a reference cycle
        if generation != self._generation:
            return  # reset meanwhile: its awaiters were resolved then
        if cancelled:
            for f in entry.waiters:
                f.cancel()
            return
        if exc is not None:
            self._resolve_exc(entry, exc)
            return
        stored = False
        if self.cache is not None and entry.cache_key is not None:
            try:  # the cache keeps a value asked for twice (together, or once before)
                stored = self.cache.offer(entry.cache_key, value, entry.asks)
            except Exception as cache_exc:  # noqa: BLE001 - goes to this entry's awaiters
                self._resolve_exc(entry, cache_exc)
                return
        live = [f for f in entry.waiters if not f.done()]
        # The value is the engine's fresh object: when the cache did not keep it, one awaiter may
        # take it as is (the others get copies), unless it is a view into a larger tensor (rows
        # moved between devices in one batch, an accelerator's batched capture), which would
        # keep the whole batch alive.
        if self._bursts and not stored and live and owns_its_memory(value):
            entry.owner = live[0]
        for f in live:
            f.set_result(value)

    @staticmethod
    def _resolve_exc(entry: _Entry, exc: BaseException) -> None:
        if isinstance(exc, StopIteration):  # futures refuse StopIteration
            err = RuntimeError(f"the engine raised StopIteration: {exc}")
            err.__cause__ = exc
            exc = err
        for f in entry.waiters:
            if not f.done():
                if isinstance(exc, asyncio.CancelledError):
                    f.cancel()
                else:
                    f.set_exception(exc)

    # ------------------------------------------------------- reset / closing
    def reset(self, exc: BaseException | None = None) -> None:
        """Resolve every pending and in-flight awaiter and forget their entries.

        Awaiters are cancelled (``exc is None``) or receive ``exc``; the engine futures of
        in-flight entries are cancelled (the engine aborts that work), and a value that arrives
        later is neither delivered nor cached. Safe to call from any thread; off the loop
        thread it is scheduled on the loop.
        """
        if self._forward_off_loop(self.reset, exc):
            return
        self._counts["resets"] += 1
        self._cancel_flush()
        entries = list(itertools.chain(self._pending.values(), self._inflight.values()))
        self._pending.clear()
        self._inflight.clear()
        self._generation += 1
        for entry in entries:
            if entry.handle is not None:
                entry.handle.cancel()
        for entry in entries:
            if exc is None:
                for f in entry.waiters:
                    f.cancel()
            else:
                self._resolve_exc(entry, exc)

    def close(self, exc: BaseException | None = None) -> None:
        """Mark the batcher closed and resolve every awaiter, as :meth:`reset` does.

        Awaiters receive ``exc``, or ``RuntimeError("<name> is closed")`` if ``exc`` is None.
        Later ``submit`` calls raise ``RuntimeError``. Idempotent; safe from any thread.
        """
        self._closed = True
        self.reset(exc if exc is not None else RuntimeError(f"{self.name} is closed"))

    def _forward_off_loop(self, method: Callable[..., Any], *args: Any) -> bool:
        """If called off the loop thread while the loop runs, reschedule there."""
        loop = self._loop
        if (
            loop is not None
            and self._loop_thread is not None
            and threading.get_ident() != self._loop_thread
            and loop.is_running()
        ):
            loop.call_soon_threadsafe(method, *args)
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"AutoBatcher(name={self.name!r}, batch_size={self.batch_size}, "
            f"timeout={self.timeout}, pending={len(self._pending)}, "
            f"inflight={len(self._inflight)}, closed={self._closed})"
        )
