"""The one front door of the models that own what serves them (:class:`ServingLM`).

:class:`~genlm_vlm.AsyncVirtualLM` (an engine), :class:`~genlm_vlm.ReplicaPool` (Ray actors) and
:class:`~genlm_vlm.MockAsyncLM` (nothing) share their argument checks, closed state, cleanup
and context managers, LoRA names, ``batch_size`` / ``timeout``, row methods and sampling
fan-out through this class; each fills in a few hooks. The interface itself (what SMC code
awaits, scoring, top-k, vocabularies) is :class:`~genlm_vlm.base.AsyncLM`; wrappers such as
:class:`~genlm_vlm.control.UnpaddedLM` derive from that and forward instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch

from .base import (
    AsyncLM,
    ClosedError,
    SampleArgs,
    TokenIds,
)
from .checks import check_batch_size, check_seed, check_timeout
from .dedup import TokensKey
from .lora import Adapter, LoraRegistry

if TYPE_CHECKING:
    from .batching import AutoBatcher

__all__ = ["Query", "ServingLM"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Query:
    """One validated row request: a prompt's token ids and the adapter it runs under."""

    ids: tuple[int, ...]
    adapter: Adapter | None
    key: TokensKey = field(init=False, repr=False, compare=False)
    """Cache and dedup key ``(akey, ids)``, hashed once (:class:`~genlm_vlm.dedup.TokensKey`):
    equal keys have equal rows."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", TokensKey(self.akey, self.ids))

    @property
    def akey(self) -> int:
        """The adapter's never-reused id (0: the base model)."""
        return 0 if self.adapter is None else self.adapter.int_id

    @property
    def lora_name(self) -> str | None:
        return None if self.adapter is None else self.adapter.name


class ServingLM(AsyncLM):
    """The front door of the models that own what serves them: :class:`~genlm_vlm.AsyncVirtualLM`
    (an engine), :class:`~genlm_vlm.ReplicaPool` (Ray actors) and
    :class:`~genlm_vlm.mock.MockAsyncLM` (nothing).

    Everything the three share lives here once: argument checks, the closed state
    (:class:`ClosedError`), :meth:`cleanup` and ``with`` / ``async with`` / ``__del__``, LoRA
    names, ``batch_size`` / ``timeout``, the row methods (each prompt validated, then handed
    to a hook) and the ``sample`` / ``batch_sample`` fan-out. A model adds what differs through
    these hooks:

    * :meth:`_row` (one query, awaited), :meth:`_rows_sync` (blocking, a whole call), and
      optionally :meth:`_rows` (a batch, awaited; default: one :meth:`_row` per query);
    * :meth:`_samples` (validated sample arguments under one adapter);
    * :meth:`_batchers` (the :class:`~genlm_vlm.batching.AutoBatcher` s that ``batch_size``,
      ``timeout``, :meth:`reset_async_queries` and :meth:`cleanup` act on);
    * :meth:`_close_impl` (free what the model holds; runs once);
    * :meth:`_check_lora_support`, :meth:`_load_adapter`, :meth:`_drop_adapter` (adapters).

    A model is closed until its ``__init__`` has finished (``self._closed = False`` last), so a
    half-built one is never cleaned up. Classes that wrap a model (such as
    :class:`~genlm_vlm.control.UnpaddedLM`) derive from :class:`AsyncLM` instead and forward.
    """

    #: True until a subclass's ``__init__`` has finished, and again after :meth:`cleanup`.
    _closed: bool = True
    #: :meth:`cleanup`'s progress: None (not begun), "running", "failed" (freeing raised: the
    #: next cleanup() tries again) or "done".
    _cleanup_state: str | None = None
    #: Whether :meth:`cleanup` blocks (``async with`` then runs it on a worker thread).
    _cleanup_blocks: ClassVar[bool] = True
    #: Whether adapter paths are local files that must exist (made absolute on registration).
    _local_lora_paths: ClassVar[bool] = True

    def __init__(self, *, batch_size: int = 256, timeout: float = 0.0) -> None:
        self._cleanup_lock = threading.RLock()
        self._loras = LoraRegistry()
        self._batch_size = check_batch_size(batch_size)
        self._timeout = check_timeout(timeout)

    # ------------------------------------------------------------------ hooks
    async def _row(self, query: Query) -> torch.Tensor:
        """The row of one validated query (hook)."""
        raise NotImplementedError

    async def _rows(self, queries: list[Query]) -> torch.Tensor:
        """The rows ``[N, V]`` of validated queries, ``N >= 1`` (hook; default: :meth:`_row`
        each, concurrently)."""
        return torch.stack(await asyncio.gather(*(self._row(q) for q in queries)))

    def _rows_sync(self, queries: list[Query], chunk_size: int | None, show_progress: bool) -> torch.Tensor:
        """Blocking rows ``[N, V]`` of validated queries, possibly none (hook). ``chunk_size``
        None or 0 means the model's default."""
        raise NotImplementedError

    async def _samples(self, specs: list[SampleArgs], adapter: Adapter | None) -> list[list[int]]:
        """One sample per validated spec, in order, all under ``adapter`` (hook)."""
        raise NotImplementedError

    def _batchers(self) -> tuple[AutoBatcher[Any, Any], ...]:
        """The async batchers of this model (hook; default none)."""
        return ()

    def _close_impl(self) -> None:  # noqa: B027 - optional hook
        """Free what the model holds (hook; runs once, after the batchers were closed)."""

    def _check_lora_support(self) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` when no adapter can be loaded (hook; default: they can)."""

    def _load_adapter(self, adapter: Adapter, previous: Adapter | None) -> None:  # noqa: B027
        """Make ``adapter`` usable before its name points at it (hook). ``previous`` is the
        registration it replaces, if any. An error leaves the earlier registration in place."""

    def _drop_adapter(self, adapter: Adapter, replaced_by: Adapter | None) -> None:  # noqa: B027
        """``adapter`` is unregistered: free it (hook). ``replaced_by``: the registration of the
        same name that took its place, None when the name was removed."""

    def _lora_disabled(self, what: str) -> ValueError:
        """The error of :meth:`_check_lora_support` for a model built without LoRA support."""
        return ValueError(
            f"{what} built without LoRA support: pass engine_opts={{'enable_lora': True, "
            f"'max_lora_rank': R}} (R >= the adapter's rank) to {type(self).__name__}.from_name"
        )

    # ------------------------------------------------------------------ closed state
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"this {type(self).__name__} was cleaned up; build a new one")

    def cleanup(self) -> None:
        """Release what the model holds. Idempotent, and safe from several threads at once: a
        concurrent call returns once the first has finished.

        Pending awaiters get :class:`ClosedError`; every later call raises it. The model's
        resources are freed even when its awaiters cannot be told (their event loop is closed:
        logged as a warning). If freeing itself raises, the error is raised and the next
        ``cleanup()`` tries again.
        """
        lock = self.__dict__.get("_cleanup_lock")
        if lock is None:  # __init__ never got far: nothing to free
            return
        with lock:
            state = self._cleanup_state
            if state in ("done", "running") or (state is None and self._closed):
                return  # finished; or called again from inside it; or never opened
            self._closed = True
            self._cleanup_state = "running"
            try:
                if state is None:
                    self._close_batchers()
                self._close_impl()
            except BaseException:
                self._cleanup_state = "failed"
                raise
            self._cleanup_state = "done"

    def _close_batchers(self) -> None:
        """Resolve every pending awaiter with :class:`ClosedError` (part of :meth:`cleanup`)."""
        err = ClosedError(f"this {type(self).__name__} was cleaned up while the call was pending")
        for batcher in self._batchers():
            try:
                batcher.close(err)
            except Exception as e:  # noqa: BLE001 - e.g. its event loop is closed: nobody waits there
                logger.warning("cleanup of %s: could not resolve the pending awaiters of %r (%r); "
                               "freeing the model all the same", type(self).__name__, batcher, e)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._cleanup_blocks:
            await asyncio.get_running_loop().run_in_executor(None, self.cleanup)
        else:
            self.cleanup()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) and getattr(self, "_cleanup_state", None) != "failed":
            return
        try:
            self.cleanup()
        except Exception as e:  # noqa: BLE001 - never raise from __del__ (interpreter shutdown)
            try:
                warnings.warn(f"{type(self).__name__} cleanup in __del__ failed: {e!r}", RuntimeWarning, stacklevel=1)
            except Exception:  # noqa: BLE001
                pass

    # ------------------------------------------------------------------ batching knobs
    @property
    def batch_size(self) -> int:
        """Most distinct queries the async batcher hands over in one group (default 256;
        settable, e.g. ``lm.batch_size = 64``, effective from the next group; an int >= 1).

        The engine still schedules each step within vLLM's ``max_num_seqs`` and
        ``max_num_batched_tokens``; this only bounds how many async queries are dispatched at
        once (the blocking API sends ``chunk_size`` prompts per call instead). A model without
        a batcher (the mock) accepts and ignores it.
        """
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._batch_size = check_batch_size(value)
        for batcher in self._batchers():
            batcher.batch_size = self._batch_size

    @property
    def timeout(self) -> float:
        """Seconds the async batcher waits for more queries after the first one of an idle
        period (default 0.0: dispatch at the next event-loop pass, so everything awaited
        together still goes together). Settable (a finite number >= 0), effective from the next
        query; a model without a batcher (the mock) accepts and ignores it."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = check_timeout(value)
        for batcher in self._batchers():
            batcher.timeout = self._timeout

    def reset_async_queries(self) -> None:
        """Cancel every pending and in-flight async query: their awaiters get ``CancelledError``."""
        for batcher in self._batchers():
            batcher.reset()

    # ------------------------------------------------------------------ validation
    def _query(self, token_ids: Any, lora_name: str | None, what: str = "token_ids") -> Query:
        """One prompt checked (open model, valid ids, registered adapter)."""
        self._check_open()
        return Query(self._check_ids(token_ids, what), self._loras.resolve(lora_name))

    def _queries(self, token_ids_list: Sequence[TokenIds], lora_name: str | None) -> list[Query]:
        """Every prompt checked before any work, a bad one named by its index."""
        self._check_open()
        return [self._query(t, lora_name, f"token_ids_list[{i}]") for i, t in enumerate(token_ids_list)]

    # ------------------------------------------------------------------ rows
    async def next_token_logprobs(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """Log-probabilities of the token after ``token_ids``: float32 ``[V]``, the caller's own.

        Concurrent awaits are batched together; identical prompts (same adapter) are computed
        once; cached rows do not touch the engine. ``lora_name`` selects a registered adapter
        (None: the default set by :meth:`set_lora`, else the base model).
        """
        return await self._row(self._query(token_ids, lora_name))

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        """Rows for every prompt: float32 ``[N, V]`` in input order (batched with other awaits).
        Every prompt is validated before any is sent."""
        queries = self._queries(token_ids_list, lora_name)
        return await self._rows(queries) if queries else self._no_rows()

    def next_token_logprobs_sync(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """Blocking :meth:`next_token_logprobs` (same cache; safe from any thread)."""
        return self._rows_sync([self._query(token_ids, lora_name)], None, False)[0]

    def batch_next_token_logprobs_sync(
        self,
        token_ids_list: Sequence[TokenIds],
        lora_name: str | None = None,
        *,
        chunk_size: int | None = None,
        show_progress: bool = False,
    ) -> torch.Tensor:
        """Rows for every prompt, blocking: float32 ``[N, V]`` in input order.

        All prompts are validated first (a bad one raises before any engine work, naming its
        index). Cached rows are reused, duplicates computed once, and the rest sent in engine
        calls of at most ``chunk_size`` prompts (default: the model's ``chunk_size``); a call
        that runs out of memory is retried in halves. ``show_progress`` shows a progress bar.
        """
        return self._rows_sync(self._queries(token_ids_list, lora_name), chunk_size, show_progress)

    # ------------------------------------------------------------------ sampling
    async def sample(
        self,
        prompt_token_ids: TokenIds,
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """Up to ``max_tokens`` tokens sampled after the prompt.

        Stops after any token of ``eos_token_ids`` (the model's own EOS is not special), which
        is stripped from the result. ``temperature=0`` is greedy; ``seed`` makes the draw
        reproducible whatever else runs at the same time. Concurrent calls share engine steps.
        A sample also stops when prompt + sample reach ``max_model_len``; it then has fewer than
        ``max_tokens`` tokens and no EOS, and a :class:`ContextLimitWarning` says so.
        """
        self._check_open()
        spec = self._check_sample_args(prompt_token_ids, max_tokens, eos_token_ids, temperature, seed)
        [out] = await self._samples([spec], self._loras.resolve(lora_name))
        self._warn_context_limit([spec.ids], [out], spec.max_tokens)
        return out

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[TokenIds],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        """:meth:`sample` for each prompt, together. With ``seed``, prompt ``i`` uses
        ``seed + i`` (reproducible, and identical prompts still get different samples). Every
        prompt is validated first; one :class:`ContextLimitWarning` counts the samples cut by
        ``max_model_len``."""
        self._check_open()
        seed = check_seed(seed)
        specs = [
            self._check_sample_args(
                p, max_tokens, eos_token_ids, temperature, None if seed is None else seed + i,
                f"prompt_token_ids_list[{i}]",
            )
            for i, p in enumerate(prompt_token_ids_list)
        ]
        if not specs:
            return []
        outs = await self._samples(specs, self._loras.resolve(lora_name))
        self._warn_context_limit([s.ids for s in specs], outs, max_tokens)
        return outs

    # ------------------------------------------------------------------ LoRA
    def add_new_lora(self, lora_path: str | os.PathLike[str], lora_name: str = "lora_1") -> None:
        """Register (or re-register) the adapter at ``lora_path`` under ``lora_name``.

        An engine-backed model loads it now, so a bad path fails here and the name keeps its
        earlier registration (it needs ``enable_lora=True`` and a ``max_lora_rank`` at least the
        adapter's rank in ``engine_opts``). Every registration gets a fresh id, so rows cached
        under an earlier registration of the name are never returned for this one; the one it
        replaces is freed.
        """
        self._check_open()
        self._check_lora_support()
        adapter = self._loras.new(lora_name, lora_path, local=self._local_lora_paths)
        self._load_adapter(adapter, self._loras.get(lora_name))
        old = self._loras.commit(adapter)
        if old is not None:
            self._drop_adapter(old, adapter)

    def remove_lora(self, lora_name: str) -> None:
        """Unregister ``lora_name`` and free it. Unknown name: ``UnknownAdapterError``."""
        self._check_open()
        self._drop_adapter(self._loras.remove(lora_name), None)

    def set_lora(self, lora_path: str | os.PathLike[str] | None = None, lora_name: str = "lora_1") -> None:
        """Make ``lora_name`` the default adapter for calls that pass ``lora_name=None``.

        With ``lora_path`` the adapter is registered first (as :meth:`add_new_lora`).
        """
        if lora_path is not None:
            self.add_new_lora(lora_path, lora_name)
        self._loras.set_default(lora_name)

    def clear_lora(self) -> None:
        """Calls with ``lora_name=None`` use the base model again."""
        self._loras.set_default(None)

    @property
    def lora_names(self) -> list[str]:
        """Names of the registered adapters, sorted."""
        return self._loras.names()
