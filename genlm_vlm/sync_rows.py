"""The blocking rows path of :class:`~genlm_vlm.vllm_lm.AsyncVirtualLM` (``*_sync`` calls).

A blocking call for rows first takes what the output cache holds and joins identical prompts
(:class:`~genlm_vlm.batching.KeyPlan`, the same step the awaited path takes), then computes
the rows still missing in engine calls of at most ``chunk_size`` prompts; a chunk that runs out
of memory (:data:`_OOM_ERRORS`) is halved and retried, down to ``min_chunk_size`` (below it the
error reaches the caller). Its counters are ``stats()["sync"]`` (:data:`_SYNC_STATS`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from .batching import KeyPlan
from .serving import Query

# The messages keep the logger they had before this module was split off vllm_lm.py.
logger = logging.getLogger("genlm_vlm.vllm_lm")

#: What counts as running out of memory on a chunk (the chunk is halved and retried).
_OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, MemoryError)

#: Counters of ``stats["sync"]``: blocking calls, the rows they returned, and how each row was
#: obtained (``rows == cache_hits + dedup_joins + computed`` over the calls that returned).
_SYNC_STATS = ("calls", "rows", "cache_hits", "dedup_joins", "computed", "engine_calls")


def _check_chunk_sizes(chunk_size: int, min_chunk_size: int) -> None:
    """Refuse a ``chunk_size`` or ``min_chunk_size`` below 1 (``ValueError``)."""
    if chunk_size < 1 or min_chunk_size < 1:
        raise ValueError("chunk_size and min_chunk_size must be >= 1")


class SyncRows:
    """The blocking rows path (a mixin of :class:`~genlm_vlm.vllm_lm.AsyncVirtualLM`, ahead of
    :class:`~genlm_vlm.serving.ServingLM` whose ``_rows_sync`` hook it implements). It works on
    the model's state: the attributes below are set by the model's ``__init__``, and
    ``_compute_rows`` (blocking rows of one chunk) is the model's."""

    _driver: Any
    cache: Any
    chunk_size: int
    min_chunk_size: int
    _sync_lock: threading.Lock
    _sync_stats: dict[str, int]
    _compute_rows: Callable[[list[Query]], list[torch.Tensor]]
    _no_rows: Callable[[], torch.Tensor]

    def _rows_sync(self, queries: list[Query], chunk_size: int | None, show_progress: bool) -> torch.Tensor:
        """The blocking path: the cache-and-dedup step (:class:`~genlm_vlm.batching.KeyPlan`),
        then the rows still missing in chunks (:meth:`_run_chunked`); refused on the engine thread."""
        self._driver.refuse_engine_thread("a blocking call for rows (next_token_logprobs_sync, batch_..._sync)")
        self._count_sync(calls=1)
        if not queries:
            return self._no_rows()
        plan: KeyPlan[torch.Tensor] = KeyPlan([q.key for q in queries], self.cache)
        todo = [queries[i] for i in plan.todo.values()]
        if todo:
            rows = self._run_chunked(todo, chunk_size or self.chunk_size, show_progress)
            for q, row in zip(todo, rows, strict=True):
                plan.fill(q.key, row)
        out = torch.stack(plan.results())
        self._count_sync(
            rows=len(queries), cache_hits=plan.cache_hits, dedup_joins=plan.dedup_joins, computed=len(todo)
        )
        return out

    def _count_sync(self, **counts: int) -> None:
        """Add ``counts`` to ``stats()["sync"]`` (any thread)."""
        with self._sync_lock:
            for name, n in counts.items():
                self._sync_stats[name] += n

    def _run_chunked(self, reqs: list[Query], chunk_size: int, show_progress: bool) -> list[torch.Tensor]:
        """The rows of ``reqs``, in order, computed ``chunk_size`` prompts per engine call (at
        least ``min_chunk_size``); a chunk that runs out of memory is halved and retried, and at
        ``min_chunk_size`` the error is raised."""
        out: list[torch.Tensor] = []
        size = max(int(chunk_size), self.min_chunk_size)
        bar = None
        if show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(reqs), desc="scoring", unit="prompt")
        try:
            while len(out) < len(reqs):
                chunk = reqs[len(out) : len(out) + size]
                self._count_sync(engine_calls=1)
                try:
                    # An interrupt (Ctrl-C) cancels the chunk: its requests are aborted.
                    rows = self._compute_rows(chunk)
                except _OOM_ERRORS:
                    if size <= self.min_chunk_size:
                        raise
                    size = max(self.min_chunk_size, size // 2)
                    logger.warning("out of memory on a chunk of %d prompts; retrying with %d", len(chunk), size)
                    continue
                out.extend(rows)
                if bar is not None:
                    bar.update(len(rows))
        finally:
            if bar is not None:
                bar.close()
        return out
