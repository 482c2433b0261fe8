"""What travels between submitting threads and the engine thread (see :mod:`.loop`).

* :class:`Job`: one query (a row, or a sample) with everything the engine thread needs; created
  by the submitter, owned by the engine thread once posted.
* :class:`Ticket`: a light handle on a job's result for callers that take results in bursts
  (the async batcher): no ``concurrent.futures.Future`` per query, and one callback per engine
  step per :class:`Listener` instead of one per row.
* Inbox messages (:class:`PostJobs`, :class:`Cancel`, :class:`Call`, :class:`Stop`): small typed
  records read with ``match`` on the engine thread.

Pure Python and torch; no vLLM.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

Tokens = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """One sampling request: up to ``max_tokens`` tokens after ``ids``; ``lora`` is a vLLM
    ``LoRARequest`` or None (the base model)."""

    ids: Tokens
    max_tokens: int
    eos: Tokens
    temperature: float
    seed: int | None
    lora: Any = None


class EngineDiedError(RuntimeError):
    """The engine loop stopped after an internal error: the model serves no more calls.

    Raised by every call made after that (the message names the error that stopped it); the
    calls pending at the time got the same error. Free the model with ``cleanup()`` and build a
    new one. A :class:`~genlm_vlm.ReplicaPool` replica in this state answers its health ping with
    this error, so the pool stops routing to it (and replaces it with ``auto_restart``).
    """


def adapter_key(lora: Any) -> int:
    """The int that names ``lora`` (a ``LoRARequest`` or None) in keys: 0 for the base model."""
    return 0 if lora is None else int(lora.lora_int_id)


#: Callback that receives one engine step's results for its tickets, on the engine thread:
#: ``[(ticket, value, exception)]`` (exactly one of value / exception is meaningful).
Listener = Callable[[list[tuple["Ticket", Any, BaseException | None]]], None]


class Ticket:
    """A caller's claim on one job's result, delivered through a :data:`Listener`.

    :meth:`cancel` (any thread) abandons it: nothing is delivered for it, and the job's request
    is aborted once no waiter is left. ``cancelled`` is written by :meth:`cancel`, ``resolved``
    by the engine thread only. ``payload`` is the caller's (e.g. its own record of the query).
    ``on_device``: a row is delivered where the engine made it, not on ``output_device`` (a
    burst's ticket: its rows are read on the engine thread), whoever else waits for the same job.
    """

    __slots__ = ("_on_cancel", "cancelled", "job", "listener", "on_device", "payload", "resolved")

    def __init__(self, listener: Listener, payload: Any = None,
                 on_cancel: Callable[[Ticket], None] | None = None, on_device: bool = False) -> None:
        self.listener = listener
        self.payload = payload
        self._on_cancel = on_cancel
        self.on_device = on_device
        self.job: Job | None = None
        self.cancelled = False
        self.resolved = False

    def done(self) -> bool:
        return self.cancelled or self.resolved

    def cancel(self) -> bool:
        """Abandon this ticket; False if its result was already handed over."""
        if self.resolved:
            return False
        if not self.cancelled:
            self.cancelled = True
            if self._on_cancel is not None:
                self._on_cancel(self)
        return True


Waiter = cf.Future | Ticket


def on_engine_device(w: Waiter) -> bool:
    """Whether waiter ``w`` takes its row where the engine made it (a burst's ticket) rather than
    on ``output_device``."""
    return type(w) is Ticket and w.on_device


@dataclass(eq=False, slots=True)
class Job:
    """One query. ``kind``: ``"logprobs"`` (a row), ``"sample"`` (vLLM's sampler),
    ``"seeded"`` (our sampler over rows, one session chunk per token), ``"score"`` (a
    continuation scored from prompt log-probabilities) or ``"score_part"`` (one engine request
    of a score job; :mod:`.scoring`)."""

    kind: str
    ids: Tokens
    lora: Any
    waiters: list[Waiter]
    adapter: int = 0
    spec: Any = None
    """A ``SampleSpec`` (sampling), a ``ScoreSpec`` (``"score"``) or a part (``"score_part"``)."""
    # --- engine thread only, from admission on ---
    key: Any = None
    """``TokensKey(adapter, ids)`` of a ``"logprobs"`` job, set at admission (hashed once)."""
    rid: str | None = None
    tag: str | None = None
    session: Any = None
    fork: tuple[str, int] | None = None
    """``(parent request id, shared tokens)`` when the request was sent as a fork."""
    out: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        self.adapter = adapter_key(self.lora)

    def wanted(self) -> bool:
        """Whether any waiter still waits (not cancelled, not resolved)."""
        return any(not w.done() for w in self.waiters)

    def join(self, twin: Job) -> None:
        """``twin`` (identical, admitted earlier) computes this job: its waiters become
        ``twin``'s, tickets included (their ``job``, which cancellation reads)."""
        twin.waiters.extend(self.waiters)
        for w in self.waiters:
            if type(w) is Ticket:
                w.job = twin


# ---------------------------------------------------------------------------- inbox messages
@dataclass(slots=True)
class PostJobs:
    """A group of jobs submitted together."""

    jobs: list[Job]


@dataclass(slots=True)
class Cancel:
    """A waiter of ``job`` was cancelled: abort its request once nobody waits."""

    job: Job


@dataclass(slots=True)
class Call:
    """Run ``fn(*args, **kwargs)`` between two steps; the result goes to ``future``."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    future: cf.Future


@dataclass(slots=True)
class Stop:
    """Fail what is pending, free the engine, end the thread; ``done`` resolves after."""

    done: cf.Future


Message = PostJobs | Cancel | Call | Stop


class Outbox:
    """Results collected during one engine step, handed over after it: futures are resolved
    at once; tickets are grouped by listener, one listener call per step."""

    __slots__ = ("by_listener",)

    def __init__(self) -> None:
        self.by_listener: dict[Any, list[tuple[Ticket, Any, BaseException | None]]] = {}

    def resolve(self, job: Job, value: Any = None, exc: BaseException | None = None) -> None:
        """Resolve every waiter of ``job`` still waiting with the same value (or exception)."""
        for w in job.waiters:
            self.resolve_waiter(w, value, exc)

    def resolve_each(self, job: Job, value: Any, copy: Callable[[Any], Any]) -> None:
        """Resolve every waiter of ``job`` still waiting, each with an object of its own: the
        first with ``value`` itself, the others with ``copy(value)``."""
        live = [w for w in job.waiters if not w.done()]
        for i, w in enumerate(live):
            self.resolve_waiter(w, value if i == 0 else copy(value))

    def resolve_rows(self, job: Job, row: torch.Tensor, out: torch.Tensor) -> None:
        """Resolve every waiter of ``job`` still waiting with a row tensor of its own: a waiter on
        the engine's device (:func:`on_engine_device`) ``row``, any other ``out`` (the row on
        ``output_device``, or ``row`` itself); the first waiter of a tensor takes it, the others
        copies of it."""
        given: set[int] = set()
        for w in [w for w in job.waiters if not w.done()]:
            value = row if on_engine_device(w) else out
            if id(value) in given:
                value = value.clone()
            given.add(id(value))
            self.resolve_waiter(w, value)

    def resolve_waiter(self, w: Waiter, value: Any = None, exc: BaseException | None = None) -> None:
        """Resolve one waiter, unless it is done already (cancelled, or resolved)."""
        if type(w) is Ticket:
            if w.done():
                return
            w.resolved = True
            w.job = None  # job -> ticket -> job would keep both (and the caller's payload) until a GC pass
            self.by_listener.setdefault(w.listener, []).append((w, value, exc))
        elif not w.done() and w.set_running_or_notify_cancel():
            if exc is not None:
                w.set_exception(exc)
            else:
                w.set_result(value)

    def flush(self) -> None:
        """Call each listener once with its results (engine thread)."""
        if not self.by_listener:
            return
        batches, self.by_listener = self.by_listener, {}
        for listener, items in batches.items():
            try:
                listener(items)
            except Exception:  # noqa: BLE001 - a broken listener must not stop the engine
                logger.exception("a result listener failed; %d result(s) were not delivered", len(items))


def fail_messages(inbox: deque[Message], outbox: Outbox, err: BaseException) -> None:
    """Answer every message left in ``inbox`` with ``err`` (engine thread, at shutdown): calls
    and posted jobs fail, a pending ``Stop``'s future is set; then ``outbox`` is flushed."""
    while inbox:
        match inbox.popleft():
            case Call(future=fut) if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
            case PostJobs(jobs):
                for job in jobs:
                    outbox.resolve(job, exc=err)
            case Stop(done) if not done.done():
                done.set_result(None)
    outbox.flush()
