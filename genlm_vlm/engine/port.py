"""What bursts and the scoring queue see of the step loop (engine thread only).

:mod:`.bursts` and :mod:`.scoring` work on the state of :class:`~.steps.StepLoop`, which imports
them. So that they need not import it back, they are typed against :class:`LoopPort`: exactly
the attributes and methods of the loop they use. The step loop satisfies it structurally (it is
never subclassed); nothing else implements it. Every member is for the engine thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import itertools

    from .build import ModelInfo
    from .core import EngineCore
    from .jobs import Job, Message, Outbox


class LoopPort(Protocol):
    """The step loop as bursts (:mod:`.bursts`) and score jobs (:mod:`.scoring`) use it."""

    core: EngineCore
    """The engine core the loop drives (its ``sink`` holds the captured rows; ``scoring()``,
    where present, makes the prompt-logprobs backend)."""

    info: ModelInfo
    """The model facts (vocabulary size, ``max_model_len``, vLLM version)."""

    _outbox: Outbox
    """Where results are resolved to their waiters (after the step)."""

    _ids: itertools.count[int]
    """The loop's request-id counter (every engine request id is drawn from it)."""

    _by_rid: dict[str, Job]
    """The jobs in the engine, by request id (a job leaves it when its request ends)."""

    _counts: dict[str, int]
    """The loop's engine counters (``engine_requests`` among them, ``stats()``)."""

    _time: dict[str, float]
    """The engine thread's wall time so far by part (``stats()["engine_time"]``), in seconds."""

    def lora_kind_busy(self, job: Job) -> bool:
        """Whether ``job`` must wait for the other kind (base model or adapter) to leave the
        engine."""
        ...

    def _abort(self, rids: list[str]) -> None:
        """Abort these engine requests (their jobs were taken out of ``_by_rid`` already)."""
        ...

    def count_fault(self, kind: str) -> None:
        """Count one ``stats()["faults"][kind]`` (a run's controller error, a burst error)."""
        ...

    def queue_internal(self, jobs: list[Job]) -> None:
        """Queue jobs made on the engine thread (a burst's round): admitted before the next step."""
        ...

    def post_internal(self, message: Message) -> None:
        """Post a message to the loop from the engine thread itself (read at the next drain)."""
        ...

    def release_sessions(self, rids: set[str]) -> int:
        """Release those of ``rids`` that are idle sessions; returns how many."""
        ...

    def burst_ended(self, burst: Any, how: str) -> None:
        """``burst`` (a :class:`~.bursts.Burst`) finished, failed or was cancelled (``how``):
        the loop forgets it and counts it."""
        ...
