"""Automatic batching of concurrent asyncio requests onto a blocking compute function.

Many coroutines (e.g. SMC particles) ``await batcher.submit(request, key)``; the
:class:`AutoBatcher` groups the requests that arrive together into one call of a
*blocking* ``compute(requests) -> results`` function, which runs on an executor
thread so that the event loop is never blocked.

Semantics (see :class:`AutoBatcher` for details):

* **Flush policy.** When the first request arrives and the engine is idle, a
  flush is scheduled with ``loop.call_soon`` (``timeout == 0``: everything
  submitted during the current event-loop pass goes out together, and a lone
  request pays no timer) or ``loop.call_later(timeout)`` (``timeout > 0``: wait
  for stragglers).  A batch also goes out immediately when ``batch_size``
  distinct pending entries have accumulated and the engine is idle.
* **Streaming mode** (``start=`` instead of ``compute=``). ``start(requests)``
  runs on the loop thread, hands the group to an engine that batches
  continuously, and returns one ``concurrent.futures.Future`` per request.
  Every flush dispatches at once (no call to wait for) and each entry resolves
  when its own future does. When every waiter of an in-flight entry is gone,
  its future is cancelled, which tells the engine to abort that work.
* **One call in flight** (``compute=`` mode). At most one ``compute`` call is in flight per
  batcher. Requests arriving meanwhile accumulate and are dispatched as soon
  as the call finishes (pipelining), in chunks of at most ``batch_size``.
* **Dedupe.** With ``dedupe=True`` identical keys pending together are computed
  once, and a key that is already in flight is joined rather than recomputed.
* **Cache.** With a :class:`~genlm_vlm.cache.OutputCache`, cached keys are
  answered without touching the engine, and successful results are stored.
* **Per-waiter futures.** Each awaiter owns an ``asyncio.Future``; cancelling an
  awaiter cancels only its own future. Entries whose waiters are all cancelled
  before dispatch are never sent to the engine. Every waiter receives
  ``deliver(value)`` (use ``deliver=torch.Tensor.clone`` to protect shared and
  cached tensors).
* **Faults.** An exception raised by ``compute`` goes to exactly the waiters of
  that call; an exception instance returned in a result slot goes to that
  entry's waiters only; a wrong number of results is a ``RuntimeError`` for the
  call's waiters. :meth:`AutoBatcher.reset` and :meth:`AutoBatcher.close`
  resolve every waiter, so nothing ever hangs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from .cache import OutputCache

__all__ = ["AutoBatcher"]

R = TypeVar("R")
V = TypeVar("V")


def _identity(value: Any) -> Any:
    return value


@dataclass(eq=False)
class _Entry:
    """One unit of work sent to ``compute``; shared by every waiter of its key."""

    key: Hashable  # key in the pending / in-flight dicts (unique token if dedupe=False)
    cache_key: Hashable | None  # key for the output cache (None = not cached)
    request: Any
    waiters: set[asyncio.Future] = field(default_factory=set)
    handle: concurrent.futures.Future | None = None  # streaming mode: the engine's future

    def live(self) -> bool:
        """True if at least one waiter still wants the result."""
        return any(not f.done() for f in self.waiters)


class _Unique:
    """Private per-submit token used as the entry key when ``dedupe=False``."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __repr__(self) -> str:
        return f"<unique #{self.n}>"


class _Mailbox:
    """Carries engine-thread completions to one event loop, one loop callback per burst.

    An engine step that finishes 256 requests posts 256 items but wakes the loop once (each
    ``call_soon_threadsafe`` writes to the loop's self-pipe); the loop then handles them in
    order. A closed loop drops the items: nobody can be waiting on it any more.
    """

    __slots__ = ("handler", "items", "lock", "loop", "scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop, handler: Callable[..., None]) -> None:
        self.loop = loop
        self.handler = handler
        self.lock = threading.Lock()
        self.items: list[tuple[Any, ...]] = []
        self.scheduled = False

    def post(self, *item: Any) -> None:
        """Queue ``handler(*item)`` on the loop (any thread)."""
        with self.lock:
            self.items.append(item)
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed
            with self.lock:
                self.items.clear()
                self.scheduled = False

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, []
            self.scheduled = False
        for item in items:
            try:
                self.handler(*item)
            except BaseException as exc:  # noqa: BLE001 - reported, and the rest still delivered
                self.loop.call_exception_handler(
                    {"message": "genlm_vlm: delivering a result failed", "exception": exc}
                )


class AutoBatcher(Generic[R, V]):
    """Batch concurrent ``submit`` calls into calls of a blocking ``compute`` function.

    Args:
        compute: Blocking function ``compute(requests) -> results`` run on
            ``executor``.  ``results`` must be a sequence with one item per
            request, in order; an item may be an exception instance, which is
            then raised to that entry's waiters only.  If ``compute`` raises,
            every waiter of that call receives the exception.
        executor: Executor on which ``compute`` runs (``None`` = the loop's
            default executor).  A single-worker ``ThreadPoolExecutor`` is the
            natural choice, since at most one call is in flight anyway.
        batch_size: Maximum number of distinct entries per ``compute`` call.
        timeout: Seconds to wait for stragglers after the first request of an
            idle period (``0`` = flush at the next event-loop pass).
        cache: Optional :class:`~genlm_vlm.cache.OutputCache`; keys are looked
            up on submit and successful results are stored after compute.
        deliver: Applied to the result once per waiter (including cache hits),
            in the waiter's own task; e.g. ``torch.Tensor.clone``.
        dedupe: If true, requests with equal keys share one computation. If
            false, every submit is its own entry (e.g. for sampling); an
            explicit ``key`` is then used for the cache only.
        name: Label used in error messages.

    Threading: all methods except :meth:`reset` / :meth:`close_nowait` must be
    called from the event loop the batcher is used on; those two may be called
    from any thread (off-loop calls are forwarded with ``call_soon_threadsafe``
    and return before the waiters are resolved).  The batcher binds to the loop
    of the first ``submit`` and may rebind to another loop once it is idle (or
    its old loop is closed); a ``submit`` from another loop while calls are
    pending raises ``RuntimeError`` saying so and what to do instead.
    """

    def __init__(
        self,
        compute: Callable[[list[R]], Sequence[V | BaseException]] | None = None,
        *,
        start: Callable[[list[R]], Sequence[concurrent.futures.Future]] | None = None,
        executor: concurrent.futures.Executor | None = None,
        batch_size: int = 256,
        timeout: float = 0.0,
        cache: OutputCache | None = None,
        deliver: Callable[[V], V] = _identity,
        dedupe: bool = True,
        name: str = "batcher",
    ):
        if (compute is None) == (start is None):
            raise ValueError("pass exactly one of compute= (blocking) or start= (streaming)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout!r}")
        self._compute = compute
        self._start = start
        self.streaming = start is not None
        self._executor = executor
        self.batch_size = int(batch_size)
        self.timeout = float(timeout)
        self.cache = cache
        self._deliver = deliver
        self.dedupe = bool(dedupe)
        self.name = name

        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._pending: dict[Hashable, _Entry] = {}  # insertion-ordered, not yet dispatched
        self._inflight: dict[Hashable, _Entry] = {}  # entries of the running compute call
        self._call: asyncio.Future | None = None  # the running compute call, if any
        self._flush_handle: asyncio.Handle | None = None
        self._mailbox: _Mailbox | None = None  # streaming: completions on their way to the loop
        self._generation = 0  # bumped by reset(); stale calls' results are dropped
        self._closed = False
        self._unique = itertools.count()

        self._n_engine_calls = 0
        self._n_requests = 0
        self._n_dedup_joins = 0
        self._n_cache_hits = 0
        self._n_items = 0
        self._n_dropped_cancelled = 0
        self._n_failed_calls = 0
        self._n_resets = 0
        self._max_batch = 0
        self._batch_hist: Counter[int] = Counter()

    # ---------------------------------------------------------------- status
    @property
    def closed(self) -> bool:
        """True after :meth:`close` / :meth:`close_nowait`; ``submit`` then raises."""
        return self._closed

    @property
    def busy(self) -> bool:
        """True while a ``compute`` call is running."""
        return self._call is not None

    @property
    def num_pending(self) -> int:
        """Number of entries waiting to be dispatched."""
        return len(self._pending)

    @property
    def num_inflight(self) -> int:
        """Number of entries in the running ``compute`` call (0 after a reset)."""
        return len(self._inflight)

    @property
    def stats(self) -> dict[str, Any]:
        """Snapshot of counters.

        Keys: ``engine_calls`` (compute calls started), ``requests`` (submits,
        including cache hits), ``dedup_joins`` (submits that joined an existing
        pending or in-flight entry), ``cache_hits``, ``items`` (entries sent to
        compute), ``dropped_cancelled`` (entries never sent because all their
        waiters were cancelled), ``failed_calls`` (calls that raised or returned
        a bad result list), ``resets``, ``max_batch`` and ``batch_sizes`` (a
        ``{size: count}`` histogram).
        """
        return {
            "engine_calls": self._n_engine_calls,
            "requests": self._n_requests,
            "dedup_joins": self._n_dedup_joins,
            "cache_hits": self._n_cache_hits,
            "items": self._n_items,
            "dropped_cancelled": self._n_dropped_cancelled,
            "failed_calls": self._n_failed_calls,
            "resets": self._n_resets,
            "max_batch": self._max_batch,
            "batch_sizes": dict(sorted(self._batch_hist.items())),
        }

    def reset_stats(self) -> None:
        """Zero all counters."""
        self._n_engine_calls = self._n_requests = self._n_dedup_joins = 0
        self._n_cache_hits = self._n_items = self._n_dropped_cancelled = 0
        self._n_failed_calls = self._n_resets = self._max_batch = 0
        self._batch_hist.clear()

    # ---------------------------------------------------------------- submit
    async def submit(self, request: R, key: Hashable | None = None) -> V:
        """Compute ``request`` in some batch and return ``deliver(result)``.

        ``key`` defaults to ``request`` when ``dedupe`` is true (it must then be
        hashable). Raises ``RuntimeError`` if the batcher is closed, the
        exception of a failed computation, or ``CancelledError`` if the waiter
        was cancelled (by its task or by :meth:`reset`).
        """
        hit, payload = self._register(request, key)
        if hit:
            return self._deliver(payload)
        entry, fut = payload
        try:
            value = await fut
        finally:
            self._release(entry, fut)
        return self._deliver(value)

    async def submit_many(
        self, requests: Sequence[R], keys: Sequence[Hashable | None] | None = None
    ) -> list[V]:
        """Submit several requests at once and return their results in order.

        All requests are registered synchronously (so they can share a batch).
        If any of them fails, its exception is raised and the other waiters of
        this call are cancelled (their entries still serve other waiters).
        """
        if keys is not None and len(keys) != len(requests):
            raise ValueError(f"got {len(keys)} keys for {len(requests)} requests")
        slots: list[tuple[bool, Any]] = []
        try:
            for i, request in enumerate(requests):
                slots.append(self._register(request, None if keys is None else keys[i]))
            values: list[Any] = []
            for hit, payload in slots:
                values.append(payload if hit else await payload[1])
        finally:
            for hit, payload in slots:
                if not hit:
                    entry, fut = payload
                    fut.cancel()
                    self._release(entry, fut)
        return [self._deliver(v) for v in values]

    def _register(self, request: Any, key: Hashable | None) -> tuple[bool, Any]:
        """Synchronously register one request.

        Returns ``(True, cached_value)`` on a cache hit, else ``(False, (entry, future))``.
        """
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._bind(loop)
        if self.dedupe:
            if key is None:
                key = request
            cache_key: Hashable | None = key
        else:
            cache_key = key
        self._n_requests += 1

        if self.cache is not None and cache_key is not None:
            cached = self.cache.get(cache_key)
            if cached is not None:
                self._n_cache_hits += 1
                return True, cached

        fut = loop.create_future()
        entry = None
        if self.dedupe:
            entry = self._inflight.get(key)
            if entry is None:
                entry = self._pending.get(key)
            if entry is not None:
                self._n_dedup_joins += 1
                entry.waiters.add(fut)
                return False, (entry, fut)
        else:
            key = _Unique(next(self._unique))
        entry = _Entry(key=key, cache_key=cache_key, request=request, waiters={fut})
        self._pending[key] = entry
        self._schedule()
        return False, (entry, fut)

    def _release(self, entry: _Entry, fut: asyncio.Future) -> None:
        """Detach a finished (or abandoned) waiter; drop a pending entry nobody wants."""
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled():
            fut.exception()  # mark as retrieved: no "exception never retrieved" log
        entry.waiters.discard(fut)
        if self._pending.get(entry.key) is entry and not entry.live():
            del self._pending[entry.key]
            self._n_dropped_cancelled += 1
        elif entry.handle is not None and self._inflight.get(entry.key) is entry and not entry.live():
            # Streaming: nobody waits any more; cancelling the engine's future aborts the work.
            del self._inflight[entry.key]
            entry.handle.cancel()
            self._n_dropped_cancelled += 1

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        old = self._loop
        if (
            old is not None
            and not old.is_closed()
            and (self._pending or self._inflight or self._call)
        ):
            raise RuntimeError(
                f"this model is busy on another event loop (its async {self.name} calls there "
                "are still pending): one model serves one event loop at a time. From other "
                "threads, use the blocking *_sync methods (thread-safe), or hand coroutines "
                "to the first loop with asyncio.run_coroutine_threadsafe(coro, loop); a new "
                "loop can take over once the old loop's calls have finished or it is closed."
            )
        if old is not None:
            # Old loop is closed or the batcher is idle: forget its state.
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
        self._call = None
        self._flush_handle = None
        self._generation += 1

    # ------------------------------------------------------------- scheduling
    def _schedule(self) -> None:
        """Called after a new pending entry was added."""
        if self.streaming and len(self._pending) >= self.batch_size:
            self._dispatch()
            return
        if self._call is not None:
            return  # dispatched when the running call completes
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
        if self._call is None and not self._closed:
            self._dispatch()

    def _cancel_flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None

    def _dispatch(self) -> None:
        """Start a compute call with up to ``batch_size`` live pending entries (engine idle)."""
        self._cancel_flush()
        if self.streaming:
            self._dispatch_streaming()
            return
        while self._pending and self._call is None:
            batch: list[_Entry] = []
            while self._pending and len(batch) < self.batch_size:
                key = next(iter(self._pending))
                entry = self._pending.pop(key)
                if entry.live():
                    batch.append(entry)
                else:
                    self._n_dropped_cancelled += 1
            if not batch:
                return
            requests = [e.request for e in batch]
            assert self._loop is not None
            try:
                call = self._loop.run_in_executor(self._executor, self._compute, requests)
            except BaseException as exc:  # e.g. executor already shut down
                self._fail_dispatch(batch, exc)
                continue
            self._record_dispatch(batch)
            self._call = call
            call.add_done_callback(functools.partial(self._on_done, self._generation, batch))

    def _fail_dispatch(self, batch: list[_Entry], exc: BaseException) -> None:
        """The batch could not be handed over: its waiters get ``exc``."""
        self._n_failed_calls += 1
        for e in batch:
            self._resolve_exc(e, exc)

    def _record_dispatch(self, batch: list[_Entry]) -> None:
        """Count a dispatched batch and mark its entries in flight."""
        self._n_engine_calls += 1
        self._n_items += len(batch)
        self._batch_hist[len(batch)] += 1
        self._max_batch = max(self._max_batch, len(batch))
        for e in batch:
            self._inflight[e.key] = e

    def _dispatch_streaming(self) -> None:
        """Hand every live pending entry to ``start`` as one group; each resolves on its own."""
        batch = [e for e in self._pending.values() if e.live()]
        self._n_dropped_cancelled += len(self._pending) - len(batch)
        self._pending.clear()
        if not batch:
            return
        assert self._start is not None and self._loop is not None
        try:
            handles = list(self._start([e.request for e in batch]))
            if len(handles) != len(batch):
                raise RuntimeError(f"{self.name}: start returned {len(handles)} futures for {len(batch)} requests")
        except BaseException as exc:  # e.g. the engine is shut down
            self._fail_dispatch(batch, exc)
            return
        self._record_dispatch(batch)
        box = self._mailbox
        if box is None or box.loop is not self._loop:
            box = self._mailbox = _Mailbox(self._loop, self._on_entry_done)
        generation = self._generation
        for e, handle in zip(batch, handles, strict=True):
            e.handle = handle
            handle.add_done_callback(functools.partial(box.post, generation, e))

    def _on_entry_done(self, generation: int, entry: _Entry, handle: concurrent.futures.Future) -> None:
        """Streaming: one entry's engine future finished (loop thread)."""
        if self._inflight.get(entry.key) is entry:
            del self._inflight[entry.key]
        if generation != self._generation:
            return
        if handle.cancelled():
            for f in entry.waiters:
                f.cancel()
            return
        exc = handle.exception()
        if exc is not None:
            self._resolve_exc(entry, exc)
            return
        self._set_value(entry, handle.result())

    def _on_done(self, generation: int, batch: list[_Entry], call: asyncio.Future) -> None:
        """Runs on the loop thread when a compute call finishes."""
        if call is self._call:
            self._call = None
        for e in batch:
            if self._inflight.get(e.key) is e:
                del self._inflight[e.key]
        try:
            if generation == self._generation:
                self._resolve_call(batch, call)
            elif not call.cancelled():
                call.exception()  # results of a reset generation are dropped
        finally:
            if self._pending and self._call is None and not self._closed:
                self._dispatch()

    def _resolve_call(self, batch: list[_Entry], call: asyncio.Future) -> None:
        if call.cancelled():
            self._n_failed_calls += 1
            err: BaseException = RuntimeError(f"{self.name}: compute call was cancelled")
            for e in batch:
                self._resolve_exc(e, err)
            return
        exc = call.exception()
        if exc is not None:
            self._n_failed_calls += 1
            for e in batch:
                self._resolve_exc(e, exc)
            return
        results = call.result()
        try:
            n = len(results)
        except TypeError:
            n = None
        if n != len(batch):
            self._n_failed_calls += 1
            err = RuntimeError(
                f"{self.name}: compute returned {n if n is not None else type(results).__name__} "
                f"results for {len(batch)} requests"
            )
            for e in batch:
                self._resolve_exc(e, err)
            return
        for i, e in enumerate(batch):
            try:
                value = results[i]
            except BaseException as item_exc:  # odd sequence types
                self._resolve_exc(e, item_exc)
                continue
            if isinstance(value, BaseException):
                self._resolve_exc(e, value)
                continue
            self._set_value(e, value)

    def _set_value(self, entry: _Entry, value: Any) -> None:
        """Cache a computed value and hand it to the entry's waiters."""
        if self.cache is not None and entry.cache_key is not None:
            try:
                self.cache.put(entry.cache_key, value)
            except Exception as cache_exc:  # noqa: BLE001 - goes to this entry's waiters
                self._resolve_exc(entry, cache_exc)
                return
        for f in entry.waiters:
            if not f.done():
                f.set_result(value)

    @staticmethod
    def _resolve_exc(entry: _Entry, exc: BaseException) -> None:
        if isinstance(exc, StopIteration):  # futures refuse StopIteration
            err = RuntimeError(f"compute raised StopIteration: {exc}")
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
        """Resolve every pending and in-flight waiter and forget their entries.

        Waiters are cancelled (``exc is None``) or receive ``exc``.  A compute
        call that is still running keeps the engine slot: it is not
        interrupted, new submissions queue behind it, and its results are
        dropped (not delivered, not cached) when it finishes.  Safe to call
        from any thread; off the loop thread it is scheduled on the loop.
        """
        if self._forward_off_loop(self.reset, exc):
            return
        self._n_resets += 1
        self._cancel_flush()
        entries = list(itertools.chain(self._pending.values(), self._inflight.values()))
        self._pending.clear()
        self._inflight.clear()
        self._generation += 1
        for entry in entries:
            if entry.handle is not None:
                entry.handle.cancel()  # streaming: abort the engine work nobody waits for
        for entry in entries:
            if exc is None:
                for f in entry.waiters:
                    f.cancel()
            else:
                self._resolve_exc(entry, exc)

    def close_nowait(self, exc: BaseException | None = None) -> None:
        """Mark the batcher closed and resolve every waiter, without waiting.

        Waiters receive ``exc``, or ``RuntimeError("<name> is closed")`` if
        ``exc`` is None.  Later ``submit`` calls raise ``RuntimeError``.  A
        running compute call is not waited for (see :meth:`close`).  Idempotent;
        safe to call from any thread.
        """
        self._closed = True
        self.reset(exc if exc is not None else RuntimeError(f"{self.name} is closed"))

    async def close(self, exc: BaseException | None = None, *, wait: bool = True) -> None:
        """Close the batcher (see :meth:`close_nowait`) and, if ``wait``, wait until
        the running compute call (if any) has finished, so the engine is idle.

        Waiting never cancels the compute call, and its outcome is ignored.
        """
        self.close_nowait(exc)
        call = self._call
        if wait and call is not None and self._loop is asyncio.get_running_loop():
            await asyncio.wait({call})

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
            f"inflight={len(self._inflight)}, busy={self.busy}, closed={self._closed})"
        )
