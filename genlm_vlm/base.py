"""The interface that SMC and constrained-decoding code awaits (genlm-backend compatible names)."""

from __future__ import annotations

import asyncio
import numbers
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Self, TypeVar

import numpy as np
import torch

from ._genlm_compat import declare_stand_in
from .lora import Adapter, LoraRegistry

if TYPE_CHECKING:
    from .batching import AutoBatcher

TokenIds = Sequence[int]
T = TypeVar("T")


class ContextLimitWarning(UserWarning):
    """``sample`` stopped at the model's context limit (``max_model_len``) before ``max_tokens``
    tokens and before an EOS token: the sample is shorter than asked for.

    Turn it into an error with ``warnings.simplefilter("error", ContextLimitWarning)``, or
    silence it with ``"ignore"``.
    """


class ClosedError(RuntimeError):
    """The model was cleaned up; it accepts no more calls."""


#: Prefixes per engine call in :meth:`AsyncLM.continuation_logprobs` (bounds memory to
#: ``chunk_size`` rows of ``vocab_size`` floats).
SCORE_CHUNK_SIZE = 128


def _fit(vocab: list[T], size: int, empty: T) -> list[T]:
    return vocab[:size] + [empty] * (size - len(vocab))


def as_token_ids(token_ids: Any, what: str, vocab_size: int) -> tuple[int, ...]:
    """``token_ids`` (a sequence of ints, or a 1-D integer tensor / array) as a tuple of ints.

    Raises ``TypeError`` for text, non-integer entries or dtypes, ``ValueError`` for a 2-D
    input or an id outside ``[0, vocab_size)``; the message names ``what``. An empty input gives
    ``()`` (callers decide whether that is allowed).
    """
    if isinstance(token_ids, str | bytes):
        raise TypeError(
            f"{what} must be a sequence of token ids, got {type(token_ids).__name__}; "
            "use lm.tokenizer.encode(text)"
        )
    if isinstance(token_ids, torch.Tensor | np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(token_ids.shape)}")
        if isinstance(token_ids, torch.Tensor):
            integer = not (token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool)
        else:
            integer = bool(np.issubdtype(token_ids.dtype, np.integer))
        if not integer:
            raise TypeError(f"{what} must hold integers, got dtype {token_ids.dtype}")
        ids = tuple(int(t) for t in token_ids.tolist())
    elif isinstance(token_ids, Sequence):
        ids = tuple(token_ids)
        if ids and set(map(type, ids)) != {int}:  # the common case costs one C-level pass
            out = []
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise TypeError(f"{what}[{i}] must be an int token id, got {type(t).__name__} ({t!r})")
                out.append(int(t))
            ids = tuple(out)
    else:
        raise TypeError(f"{what} must be a sequence of int token ids, got {type(token_ids).__name__}")
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise ValueError(f"{what} holds token id {t} at index {i}, outside the vocabulary [0, {vocab_size})")
    return ids


def check_batch_size(value: Any) -> int:
    """The ``batch_size`` setter's check: an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {value!r}")
    return int(value)


def check_timeout(value: Any) -> float:
    """The ``timeout`` setter's check: a finite number of seconds >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 <= value < float("inf")):
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def check_seed(seed: Any) -> int | None:
    """A sampling seed: an int (not a bool) or None; anything else is a ``TypeError``."""
    if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    return None if seed is None else int(seed)


@dataclass(frozen=True, slots=True)
class Query:
    """One validated row request: a prompt's token ids and the adapter it runs under."""

    ids: tuple[int, ...]
    adapter: Adapter | None

    @property
    def akey(self) -> int:
        """The adapter's never-reused id (0: the base model)."""
        return 0 if self.adapter is None else self.adapter.int_id

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        """Cache and dedup key ``(akey, ids)``: equal keys have equal rows."""
        return (self.akey, self.ids)

    @property
    def lora_name(self) -> str | None:
        return None if self.adapter is None else self.adapter.name


class SampleArgs(NamedTuple):
    """The validated arguments of one ``sample`` (see :meth:`AsyncLM._check_sample_args`)."""

    ids: tuple[int, ...]
    max_tokens: int
    eos: tuple[int, ...]
    temperature: float
    seed: int | None


class TopK(NamedTuple):
    """The ``k`` most likely next tokens, most likely first (see :meth:`AsyncLM.next_token_topk`)."""

    #: int64 CPU tensor ``[k]``.
    token_ids: torch.Tensor
    #: float32 CPU tensor ``[k]``: ``log p(token | prompt)``, non-increasing.
    logprobs: torch.Tensor


class AsyncLM(ABC):
    """A language model that returns full-vocabulary next-token log-probabilities.

    Subclasses implement :meth:`next_token_logprobs` and :meth:`next_token_logprobs_sync`; the
    batch methods here are generic fallbacks that concrete backends override with real batching.
    ``byte_vocab[i]`` / ``str_vocab[i]`` give what token ``i`` stands for (computed on first use).
    Continuation scoring (:meth:`score`, :meth:`continuation_logprobs`) and
    :meth:`next_token_topk` are built on the batch methods.
    """

    tokenizer: Any

    #: Name of the genlm-backend class (in ``genlm.backend.llm``) this class stands in for, or
    #: None. A subclass that sets it is registered as a virtual subclass of that class once
    #: genlm-backend is loaded, so type checks such as llamppl's ``CachedCausalLM`` accept it
    #: (see :mod:`genlm_vlm._genlm_compat`); genlm_vlm never imports genlm-backend itself.
    genlm_backend_class: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("genlm_backend_class")
        if name:
            declare_stand_in(cls, name)

    # ------------------------------------------------------------------ vocabulary
    # Both vocabularies have exactly ``vocab_size`` entries (the logit width), as rows do: ids the
    # tokenizer does not cover (padded logit columns) map to empty, tokenizer entries beyond the
    # logit width are dropped. genlm-bytes needs len(byte_vocab) == row width; genlm-control
    # takes either; llamppl needs without_padding (see genlm_vlm.control).
    @cached_property
    def _byte_strings(self) -> list[bytes]:
        """Plain bytes of each token id (length = logit width; ids with no token map to ``b""``)."""
        from .vocab import get_byte_vocab

        return _fit(get_byte_vocab(self.tokenizer), self.vocab_size, b"")

    @property
    def byte_vocab(self) -> list[Any]:
        """Token ``i``'s bytes as ``byte_vocab[i]``: one entry per logit (``vocab_size``).

        Entries are ``bytes`` subclasses with ``.token_id == i`` and ``.byte_string`` (plain
        bytes), equal and hashed by id, so tokens that stand for the same bytes stay distinct
        (genlm-backend's ``Token`` semantics). Ids the tokenizer does not cover (padding of the
        logit matrix) have empty bytes. The class is :func:`genlm_vlm.vocab.token_class`:
        genlm-backend's ``Token`` while genlm-backend is loaded (genlm-control, genlm-bytes and
        llamppl load it and check for it), else :class:`genlm_vlm.vocab.Token`. The list is
        built once per class and cached: do not modify it.
        """
        from .vocab import token_class, tokens_of

        cls = token_class()
        cached = self.__dict__.get("_byte_vocab_cache")
        if cached is None or cached[0] is not cls:
            cached = (cls, tokens_of(self._byte_strings, cls))
            self.__dict__["_byte_vocab_cache"] = cached
        return cached[1]

    @cached_property
    def str_vocab(self) -> list[str]:
        """Text of each token id (see :func:`genlm_vlm.vocab.get_str_vocab`): one entry per logit.

        Padded logit columns (ids past the tokenizer) have the empty text, as a
        :class:`genlm_vlm.vocab.PaddedText` whose indexing error (``text[0]``, as llamppl's
        ``CachedCausalLM`` does) says to use :func:`genlm_vlm.without_padding`.
        """
        from .vocab import PaddedText, unpadded_length

        texts = [b.decode("utf-8", errors="replace") for b in self._byte_strings]
        n = unpadded_length(texts, self.tokenizer)
        if n < len(texts):
            texts[n:] = [PaddedText(n, len(texts))] * (len(texts) - n)
        return texts

    @property
    def vocab_size(self) -> int:
        """Logit width V: the length of every returned row."""
        return len(self.tokenizer)

    # ------------------------------------------------------------------ rows
    @abstractmethod
    async def next_token_logprobs(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """Log-probabilities of the next token after ``token_ids``: float32 tensor ``[V]``."""

    @abstractmethod
    def next_token_logprobs_sync(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """Blocking version of :meth:`next_token_logprobs`."""

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        """Rows for several prompts: float32 tensor ``[N, V]`` in input order."""
        if not token_ids_list:
            return self._no_rows()
        rows = await asyncio.gather(*(self.next_token_logprobs(t, lora_name=lora_name) for t in token_ids_list))
        return torch.stack(rows)

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking version of :meth:`batch_next_token_logprobs`."""
        if not token_ids_list:
            return self._no_rows()
        return torch.stack([self.next_token_logprobs_sync(t, lora_name=lora_name) for t in token_ids_list])

    def clear_cache(self) -> None:  # noqa: B027 - optional hook
        """Drop cached results (no-op here)."""

    def _no_rows(self) -> torch.Tensor:
        """The ``[0, V]`` result of a batch call over no prompts."""
        return torch.empty((0, self.vocab_size), dtype=torch.float32)

    # ------------------------------------------------------------------ validation
    def _check_ids(self, token_ids: Any, what: str = "token_ids") -> tuple[int, ...]:
        """Validate one prompt (non-empty, ids in the vocabulary, and shorter than
        ``max_model_len`` where the model has one); returns a tuple of ints."""
        ids = as_token_ids(token_ids, what, self.vocab_size)
        if not ids:
            raise ValueError(f"{what} is empty: a prompt needs at least one token (e.g. the BOS token)")
        limit = getattr(self, "max_model_len", None)
        if limit is not None and len(ids) >= limit:
            raise ValueError(
                f"{what} has {len(ids)} tokens; this model allows at most {limit - 1} "
                f"(max_model_len={limit}, one position is needed for the next token)"
            )
        return ids

    def _check_sample_args(
        self, prompt: Any, max_tokens: Any, eos: Any, temperature: Any, seed: Any, what: str = "prompt_token_ids"
    ) -> SampleArgs:
        """Validate the arguments of ``sample``; returns :class:`SampleArgs` with ``eos`` as a
        tuple (a single id is accepted) and the numbers as Python ``float``/``int``."""
        ids = self._check_ids(prompt, what)
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if isinstance(eos, numbers.Integral):
            eos = [eos]
        eos_ids = self._check_ids(eos, "eos_token_ids") if len(eos) else ()
        if not isinstance(temperature, numbers.Real) or temperature < 0 or not np.isfinite(temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        return SampleArgs(ids, max_tokens, eos_ids, float(temperature), check_seed(seed))

    #: The end of the :class:`ContextLimitWarning` message: how to get longer samples.
    _context_limit_hint: ClassVar[str] = (
        "Shorten the prompt, or build the model with a larger max_model_len "
        "(engine_opts={'max_model_len': N})."
    )

    def _warn_context_limit(
        self, prompts: Sequence[Sequence[int]], outs: Sequence[Sequence[int]], max_tokens: int
    ) -> None:
        """One :class:`ContextLimitWarning` for the samples that stopped at ``max_model_len``
        rather than at ``max_tokens`` or EOS (called by ``sample``/``batch_sample``).

        The EOS token is stripped from a sample, so prompt + sample reaching ``max_model_len``
        means the engine stopped for the length (an EOS at the last position leaves one short).
        """
        limit = self.max_model_len  # type: ignore[attr-defined]
        cut = [
            i for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True))
            if len(out) < max_tokens and len(prompt) + len(out) >= limit
        ]
        if not cut:
            return
        n = len(prompts)
        which = "the sample" if n == 1 else f"{len(cut)} of {n} samples (first: index {cut[0]})"
        warnings.warn(
            f"{which} stopped at the context limit: prompt ({len(prompts[cut[0]])} tokens) + sample "
            f"reached max_model_len={limit} before max_tokens={max_tokens} and before an EOS token. "
            + self._context_limit_hint,
            ContextLimitWarning,
            stacklevel=3,
        )

    def _score_inputs(self, prompt_ids: Any, continuation_ids: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        prompt = self._check_ids(prompt_ids, "prompt_ids")
        if not isinstance(continuation_ids, str | bytes) and len(continuation_ids) == 0:
            cont: tuple[int, ...] = ()
        else:
            cont = as_token_ids(continuation_ids, "continuation_ids", self.vocab_size)
        limit = getattr(self, "max_model_len", None)
        total = len(prompt) + len(cont)
        if isinstance(limit, int) and total > limit:
            raise ValueError(
                f"prompt_ids + continuation_ids has {total} tokens ({len(prompt)} + {len(cont)}); "
                f"this model allows at most {limit} (max_model_len)"
            )
        return prompt, cont

    @staticmethod
    def _check_k(k: Any, vocab_size: int) -> int:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= vocab_size:
            raise ValueError(f"k must be an int in [1, {vocab_size}] (the vocabulary size), got {k!r}")
        return int(k)

    # ------------------------------------------------------------------ scoring and top-k
    async def continuation_logprobs(
        self,
        prompt_ids: TokenIds,
        continuation_ids: TokenIds,
        *,
        lora_name: str | None = None,
        chunk_size: int = SCORE_CHUNK_SIZE,
    ) -> torch.Tensor:
        """``log p(c_t | prompt + c_<t)`` for each continuation token ``c_t``: float32 CPU ``[n]``.

        ``prompt_ids`` must be non-empty; an empty continuation gives an empty tensor. Needs the
        rows of the prefixes ``prompt``, ``prompt + c_1``, ..., ``prompt + c_<n``, requested
        ``chunk_size`` at a time through :meth:`batch_next_token_logprobs` (so they share batches
        and caches with other awaits, and at most ``chunk_size`` rows are held at once).
        """
        out, chunks = self._prefix_chunks(prompt_ids, continuation_ids, chunk_size)
        for where, prefixes, targets in chunks:
            out[where] = _gather(await self.batch_next_token_logprobs(prefixes, lora_name=lora_name), targets)
        return out

    def continuation_logprobs_sync(
        self,
        prompt_ids: TokenIds,
        continuation_ids: TokenIds,
        *,
        lora_name: str | None = None,
        chunk_size: int = SCORE_CHUNK_SIZE,
    ) -> torch.Tensor:
        """Blocking :meth:`continuation_logprobs` (through :meth:`batch_next_token_logprobs_sync`)."""
        out, chunks = self._prefix_chunks(prompt_ids, continuation_ids, chunk_size)
        for where, prefixes, targets in chunks:
            out[where] = _gather(self.batch_next_token_logprobs_sync(prefixes, lora_name=lora_name), targets)
        return out

    def _prefix_chunks(
        self, prompt_ids: Any, continuation_ids: Any, chunk_size: Any
    ) -> tuple[torch.Tensor, Iterator[tuple[slice, list[tuple[int, ...]], tuple[int, ...]]]]:
        """Validate the arguments of ``continuation_logprobs`` (now); returns the output tensor
        ``[n]`` and, lazily, ``(where in it, the prefixes whose rows are needed, the tokens to
        read from those rows)`` per chunk of at most ``chunk_size`` prefixes."""
        prompt, cont = self._score_inputs(prompt_ids, continuation_ids)
        if type(chunk_size) is not int or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")

        def chunks() -> Iterator[tuple[slice, list[tuple[int, ...]], tuple[int, ...]]]:
            for start in range(0, len(cont), chunk_size):
                stop = min(start + chunk_size, len(cont))
                yield slice(start, stop), [prompt + cont[:k] for k in range(start, stop)], cont[start:stop]

        return torch.empty(len(cont), dtype=torch.float32), chunks()

    async def score(
        self, prompt_ids: TokenIds, continuation_ids: TokenIds, *, lora_name: str | None = None
    ) -> float:
        """``log p(continuation | prompt)``: the sum of :meth:`continuation_logprobs` (0.0 if empty).

        No token is added: pass the BOS token in ``prompt_ids`` if the model expects one, and the
        EOS token at the end of ``continuation_ids`` to score a finished text.
        """
        logps = await self.continuation_logprobs(prompt_ids, continuation_ids, lora_name=lora_name)
        return float(logps.double().sum())

    def score_sync(
        self, prompt_ids: TokenIds, continuation_ids: TokenIds, *, lora_name: str | None = None
    ) -> float:
        """Blocking :meth:`score`."""
        logps = self.continuation_logprobs_sync(prompt_ids, continuation_ids, lora_name=lora_name)
        return float(logps.double().sum())

    async def next_token_topk(self, token_ids: TokenIds, k: int, *, lora_name: str | None = None) -> TopK:
        """The ``k`` most likely tokens after ``token_ids``: :class:`TopK` ``(token_ids, logprobs)``,
        CPU tensors of length ``k``, most likely first (ties in no particular order)."""
        k = self._check_k(k, self.vocab_size)
        return _topk(await self.next_token_logprobs(token_ids, lora_name=lora_name), k)

    def next_token_topk_sync(self, token_ids: TokenIds, k: int, *, lora_name: str | None = None) -> TopK:
        """Blocking :meth:`next_token_topk`."""
        k = self._check_k(k, self.vocab_size)
        return _topk(self.next_token_logprobs_sync(token_ids, lora_name=lora_name), k)


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
    #: Whether :meth:`cleanup` blocks (``async with`` then runs it on a worker thread).
    _cleanup_blocks: ClassVar[bool] = True

    def __init__(self, *, batch_size: int = 256, timeout: float = 0.0) -> None:
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
        """Release what the model holds. Idempotent.

        Pending awaiters get :class:`ClosedError`; every later call raises it.
        """
        if self._closed:
            return
        self._closed = True
        err = ClosedError(f"this {type(self).__name__} was cleaned up while the call was pending")
        for batcher in self._batchers():
            batcher.close(err)
        self._close_impl()

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
        if getattr(self, "_closed", True):
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
        adapter = self._loras.new(lora_name, lora_path)
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


def _gather(rows: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """``rows[i, ids[i]]`` for each ``i``, as float32 on the CPU."""
    index = torch.tensor(ids, dtype=torch.long, device=rows.device)
    return rows.gather(1, index.unsqueeze(1)).squeeze(1).float().cpu()


def _topk(row: torch.Tensor, k: int) -> TopK:
    values, indices = torch.topk(row.float(), k)
    return TopK(token_ids=indices.cpu(), logprobs=values.cpu())
