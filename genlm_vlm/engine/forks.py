"""Forks that cost one token: a new request shares its live parent's partial tail KV block.

After an SMC resample, several particles extend the same parent context ``T`` with different
tokens. One of them continues the parent's session; each other one (a *fork*) is a new request
``T + [t]``. vLLM's prefix cache only shares *full* KV blocks, so without help a fork recomputes
the parent's unfinished tail block (up to ``block_size - 1`` tokens) before its own token.

vLLM already has the machinery to share a tail block safely: when a request's local prefix hit
ends inside a block, the KV cache manager gives it a private copy of that block
(``SingleTypeKVCacheManager._apply_cow``), the scheduler hands the copy to the workers in
``SchedulerOutput.kv_cache_block_copies`` and keeps both blocks alive until it has run, and the
model runner copies the block before the forward pass. Stock vLLM only produces such hits for
Mamba hybrids. :class:`ForkScheduler` (given to vLLM through its official ``scheduler_cls``
option) produces them for a request that genlm_vlm marks as a fork: the request's
``SamplingParams.extra_args[FORK_KEY]`` names the parent's request id and how many of its
tokens to share; when, at scheduling time, that parent is alive, under the same adapter and
cache salt, has computed those tokens and holds exactly the full blocks the ordinary lookup
found, its tail block is appended to the hit and vLLM's copy-on-write does the rest. In every
other case the ordinary hit is returned unchanged (the fork re-prefills its tail: slower, still
exact) and the reason is counted.

The scheduler also counts every token it schedules (``SchedulerOutput.total_num_scheduled_tokens``)
so the step loop can report the work done without vLLM's log statistics, and, while particles
run as requests (:mod:`.forcing`), which scheduled requests are partial prefills
(:func:`prefill_chunk_reader`).

This module is part of the engine package: the only one that reads vLLM internals. Names it
relies on (checked when the scheduler is built; a missing one turns forks off with a reason):
``Scheduler._get_local_prefix_cache_hit`` (private; 0.33 adds a ``max_cache_hit_length``
argument, passed through), ``Scheduler.requests``, ``Scheduler.connector``,
``KVCacheManager.get_blocks`` / ``create_kv_cache_blocks`` / ``enable_caching``,
``SingleTypeKVCacheManager._has_partial_local_hit`` (the copy-on-write being there),
``Request.all_token_ids`` / ``num_computed_tokens`` / ``num_tokens`` / ``lora_request`` / ``cache_salt`` /
``skip_reading_prefix_cache``.

Threading: the scheduler runs on the engine thread (in-process engine core); its counters are
read there too.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

logger = logging.getLogger(__name__)

#: ``SamplingParams.extra_args`` key of a fork's marker: ``(parent request id, shared tokens)``.
FORK_KEY = "genlm_vlm_fork"

#: Why a fork could not share its parent's tail block (keys of ``fallbacks`` in the counters).
FALLBACK_REASONS = (
    "disabled",  # forks are off for this engine (see ForkScheduler.fork_support)
    "parent_gone",  # the parent request was finished or aborted before the fork was scheduled
    "parent_behind",  # the parent has not computed the shared tokens (yet)
    "adapter",  # different LoRA adapter or cache salt
    "no_cache_read",  # the fork skips prefix-cache reads (e.g. prompt log-probabilities)
    "hit_mismatch",  # the parent does not hold the blocks of the shared tokens
    "tokens",  # the shared tokens differ from the parent's
    "too_long",  # sharing would leave no token to compute
)


def _fork_support(scheduler: Any) -> tuple[bool, str]:
    """Whether copy-on-write forks can work in this scheduler, and why (or why not)."""
    try:
        from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec
    except ImportError as e:
        return False, f"vLLM's KV cache manager has moved ({e})"
    if not hasattr(SingleTypeKVCacheManager, "_has_partial_local_hit"):
        return False, "this vLLM has no copy-on-write of a partially shared block"
    manager = getattr(scheduler, "kv_cache_manager", None)
    if manager is None or not hasattr(manager, "get_blocks") or not hasattr(manager, "create_kv_cache_blocks"):
        return False, "the scheduler's KV cache manager lacks get_blocks/create_kv_cache_blocks"
    if not getattr(manager, "enable_caching", False):
        return False, "prefix caching is off (enable_prefix_caching=False)"
    if getattr(scheduler, "connector", None) is not None:
        return False, "a KV connector is configured"
    groups = scheduler.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return False, f"the model has {len(groups)} KV cache groups (hybrid attention); only one is supported"
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or getattr(spec, "sliding_window", None) or getattr(
        spec, "attention_chunk_size", None
    ):
        return False, f"the KV cache is {type(spec).__name__} (only full attention is supported)"
    if getattr(scheduler, "mamba_partial_cache_hit", False):
        return False, "the scheduler already shares partial blocks (Mamba align mode)"
    return True, f"copy-on-write of the parent's tail block (block size {scheduler.block_size})"


class _ForkMixin:
    """The fork-aware part of :class:`ForkScheduler` (mixed into vLLM's scheduler class)."""

    # Set in _init_forks (engine thread).
    fork_support: tuple[bool, str]
    fork_counts: dict[str, int]
    fork_fallbacks: Counter[str]

    def _init_forks(self) -> None:
        try:
            self.fork_support = _fork_support(self)
        except Exception as e:  # noqa: BLE001 - a layout we do not know: forks off, say why
            self.fork_support = (False, f"cannot inspect the scheduler ({e!r})")
        self.fork_counts = {"copied": 0, "aligned": 0, "saved_tokens": 0, "scheduled_tokens": 0}
        self.fork_fallbacks = Counter()
        self.track_chunks = False
        self.prefill_chunks: set[str] = set()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self.fork_counts["scheduled_tokens"] += int(getattr(out, "total_num_scheduled_tokens", 0) or 0)
        if self.track_chunks:
            # After schedule() each scheduled request's num_computed_tokens counts this step's
            # tokens: one still short of its tokens is a partial prefill, whose sampled token
            # vLLM discards (its row is not the request's next-token row).
            reqs = self.requests  # type: ignore[attr-defined]
            self.prefill_chunks = {rid for rid in out.num_scheduled_tokens
                                   if (r := reqs.get(rid)) is not None and r.num_computed_tokens < r.num_tokens}
        return out

    def _get_local_prefix_cache_hit(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        hit = super()._get_local_prefix_cache_hit(request, *args, **kwargs)  # type: ignore[misc]
        extra = getattr(request.sampling_params, "extra_args", None)
        marker = extra.get(FORK_KEY) if extra else None
        if marker is None:
            return hit
        limit = kwargs.get("max_cache_hit_length", args[0] if args else None)
        extended, reason = self._extend_hit(request, hit, marker, limit)
        if reason is not None:
            self.fork_fallbacks[reason] += 1
            return hit
        return extended

    def _extend_hit(self, request: Any, hit: tuple[Any, ...], marker: Any, limit: int | None) -> tuple[Any, str | None]:
        """The ordinary hit extended by the parent's tail block, or (hit, reason it was not)."""
        if not self.fork_support[0]:
            return hit, "disabled"
        parent_id, shared = marker[0], int(marker[1])
        num_hit = int(hit[1])
        block_size = int(self.block_size)  # type: ignore[attr-defined]
        full = shared - shared % block_size
        if num_hit >= shared:
            self.fork_counts["aligned"] += 1  # nothing past the full blocks to share
            return hit, None
        if request.skip_reading_prefix_cache:
            return hit, "no_cache_read"
        if shared > request.num_tokens - 1 or (limit is not None and shared > int(limit)):
            return hit, "too_long"
        parent = self.requests.get(parent_id)  # type: ignore[attr-defined]
        if parent is None or parent.is_finished():
            return hit, "parent_gone"
        if parent.num_computed_tokens < shared:
            return hit, "parent_behind"
        if _adapter_id(parent) != _adapter_id(request) or parent.cache_salt != request.cache_salt:
            return hit, "adapter"
        n_full = full // block_size
        theirs = self.kv_cache_manager.get_blocks(parent_id).blocks[0]  # type: ignore[attr-defined]
        if len(theirs) < n_full + (full < shared):
            return hit, "hit_mismatch"  # the parent does not hold the blocks of the shared tokens
        if request.all_token_ids[:shared] != parent.all_token_ids[:shared]:
            return hit, "tokens"
        # The fork shares the parent's own full blocks, whatever the ordinary hit found (usually
        # those very blocks; other copies of them when an earlier request computed the same tokens;
        # fewer when the cache lost track of them), so that it computes only its new tokens, as it
        # would on a fresh engine: a fork's rows never depend on what else the prefix cache holds.
        mine = list(theirs[:n_full])
        if full == shared:
            self.fork_counts["aligned"] += 1
            return (self.kv_cache_manager.create_kv_cache_blocks((mine,)), shared, *hit[2:]), None  # type: ignore[attr-defined]
        tail = theirs[n_full]
        if getattr(tail, "is_null", False):
            return hit, "tokens"
        extended = self.kv_cache_manager.create_kv_cache_blocks((mine + [tail],))  # type: ignore[attr-defined]
        self.fork_counts["copied"] += 1
        self.fork_counts["saved_tokens"] += shared - full
        return (extended, shared, *hit[2:]), None


def _adapter_id(request: Any) -> int:
    lora = request.lora_request
    return 0 if lora is None else int(lora.lora_int_id)


_classes: dict[type, type] = {}


def _fork_class(base: type) -> type:
    cls = _classes.get(base)
    if cls is None:

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            base.__init__(self, *args, **kwargs)
            self._init_forks()

        cls = type(f"Fork{base.__name__}", (_ForkMixin, base), {"__init__": __init__, "__module__": __name__})
        _classes[base] = cls
    return cls


class ForkScheduler:
    """vLLM's scheduler (``Scheduler``, or ``AsyncScheduler`` when the engine schedules
    asynchronously) with copy-on-write forks; pass the class as ``scheduler_cls``.

    vLLM decides whether it schedules asynchronously only after the engine options are read, so
    this class picks the base class when vLLM builds the scheduler.
    """

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.core.sched.scheduler import Scheduler

        base: type = Scheduler
        if getattr(vllm_config.scheduler_config, "async_scheduling", False):
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            base = AsyncScheduler
        return _fork_class(base)(vllm_config, *args, **kwargs)


def prefill_chunk_reader(scheduler: Any) -> Any:
    """A callable returning the ids of the requests that the last scheduled step computes only
    part of (partial prefills: their sampled token is discarded), or None when ``scheduler`` is
    not a :class:`ForkScheduler` or schedules asynchronously (the step being sampled is then
    not the last one scheduled). Turns the tracking on (engine thread)."""
    if not isinstance(scheduler, _ForkMixin):
        return None
    if any(c.__name__ == "AsyncScheduler" for c in type(scheduler).__mro__):
        return None
    scheduler.track_chunks = True
    return lambda: scheduler.prefill_chunks


def scheduler_hooks_present() -> tuple[bool, str]:
    """Whether this vLLM has what :class:`ForkScheduler` overrides (checked before the build)."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as e:
        return False, f"vLLM's v1 scheduler cannot be imported ({e})"
    if not hasattr(Scheduler, "_get_local_prefix_cache_hit"):
        return False, "vLLM's scheduler has no _get_local_prefix_cache_hit"
    return True, "ok"


def fork_stats(scheduler: Any) -> tuple[tuple[bool, str], dict[str, int], dict[str, int]] | None:
    """``(support, counts, fallbacks)`` of a :class:`ForkScheduler` instance, None for another
    scheduler (engine thread)."""
    if not isinstance(scheduler, _ForkMixin):
        return None
    return scheduler.fork_support, dict(scheduler.fork_counts), dict(scheduler.fork_fallbacks)


def count_fork(counts: dict[str, int], shared: int, prefill: Any, block: int) -> None:
    """Count one finished fork in ``counts`` (``copied``, ``aligned``, ``reprefilled``,
    ``saved_tokens``): whether it computed only what came after its parent's ``shared`` tokens,
    read from vLLM's ``prefill_stats.num_local_cached_tokens`` (nothing is counted when the core
    does not report it). ``block``: the KV block size in tokens."""
    cached = getattr(prefill, "num_local_cached_tokens", None)
    if cached is None:
        return
    full = shared - shared % block
    if int(cached) < shared:
        counts["reprefilled"] += 1
    elif shared == full:
        counts["aligned"] += 1
    else:
        counts["copied"] += 1
        counts["saved_tokens"] += shared - full
