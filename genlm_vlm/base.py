"""The interface that SMC and constrained-decoding code awaits (genlm-backend compatible names)."""

from __future__ import annotations

import asyncio
import numbers
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

import numpy as np
import torch

from ._genlm_compat import declare_stand_in

if TYPE_CHECKING:
    pass

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


class KnownIds:
    """Token-id tuples already found valid for one vocabulary size, so that a prompt of ints
    that repeats one, or extends one by a single id (a continuing SMC particle), needs no range
    check over every id: one lookup of its prefix and a look at its last id.

    Insertion-ordered and bounded by the ids it holds (``budget``, 2**19 by default: at most
    4 MiB of tuple slots; the oldest tuples are forgotten first). Safe to share between
    threads: a race can only forget a tuple, never admit an unchecked one.
    """

    __slots__ = ("_held", "_tuples", "budget", "vocab_size")

    def __init__(self, vocab_size: int, budget: int = 1 << 19) -> None:
        self.vocab_size = vocab_size
        self.budget = budget
        self._tuples: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._held = 0

    def covers(self, ids: tuple[int, ...]) -> bool:
        """True if ``ids`` (a tuple of ``int``, checked by the caller) is known, or extends a
        known tuple by one id in the vocabulary (then it is remembered too)."""
        tuples = self._tuples
        if len(ids) > 1 and ids[:-1] in tuples:
            if 0 <= ids[-1] < self.vocab_size:
                self.add(ids)
                return True
            return False
        return ids in tuples

    def add(self, ids: tuple[int, ...]) -> None:
        """Remember ``ids`` (every id already checked to be an int in the vocabulary)."""
        tuples = self._tuples
        tuples[ids] = None
        self._held += len(ids)
        while self._held > self.budget and tuples:
            try:
                old, _ = tuples.popitem(last=False)
            except KeyError:  # emptied by another thread meanwhile
                break
            self._held -= len(old)


def as_token_ids(token_ids: Any, what: str, vocab_size: int, known: KnownIds | None = None) -> tuple[int, ...]:
    """``token_ids`` (a sequence of ints, or a 1-D integer tensor / array) as a tuple of ints.

    Raises ``TypeError`` for text, non-integer entries or dtypes, ``ValueError`` for a 2-D
    input or an id outside ``[0, vocab_size)``; the message names ``what``. An empty input gives
    ``()`` (callers decide whether that is allowed). With ``known`` (for this ``vocab_size``),
    a prompt that repeats, or extends by one id, a prompt found valid before skips the range
    check over its ids, and a prompt found valid is remembered there.
    """
    if isinstance(token_ids, str | bytes):
        raise TypeError(
            f"{what} must be a sequence of token ids, got {type(token_ids).__name__}; "
            "use lm.tokenizer.encode(text)"
        )
    if type(token_ids) is list or type(token_ids) is tuple:
        ids, typed = tuple(token_ids), False
    elif isinstance(token_ids, torch.Tensor | np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(token_ids.shape)}")
        if isinstance(token_ids, torch.Tensor):
            integer = not (token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool)
        else:
            integer = bool(np.issubdtype(token_ids.dtype, np.integer))
        if not integer:
            raise TypeError(f"{what} must hold integers, got dtype {token_ids.dtype}")
        ids, typed = tuple(token_ids.tolist()), True  # Python ints
    elif isinstance(token_ids, Sequence):
        ids, typed = tuple(token_ids), False
    else:
        raise TypeError(f"{what} must be a sequence of int token ids, got {type(token_ids).__name__}")
    if not ids:
        return ids
    if not typed and set(map(type, ids)) != {int}:  # the common case costs one C-level pass
        out = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"{what}[{i}] must be an int token id, got {type(t).__name__} ({t!r})")
            out.append(int(t))
        ids = tuple(out)
    # Every id is an int now, so equal tuples hold the same ids: a known prefix needs no range check.
    if known is not None and known.covers(ids):
        return ids
    if min(ids) < 0 or max(ids) >= vocab_size:
        i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise ValueError(f"{what} holds token id {t} at index {i}, outside the vocabulary [0, {vocab_size})")
    if known is not None:
        known.add(ids)
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


#: The seeds ``sample`` accepts: those of ``torch.Generator.manual_seed`` (a negative seed ``s``
#: draws as ``s + 2**64`` does).
SEED_RANGE = (-(2**63), 2**64 - 1)
#: ``sample`` treats a temperature below this as 0 (greedy), as vLLM's sampler does.
GREEDY_TEMPERATURE = 1e-5


def check_seed(seed: Any, what: str = "seed") -> int | None:
    """A sampling seed: None, or an int (not a bool) in :data:`SEED_RANGE`. A wrong type is a
    ``TypeError``, an int out of range a ``ValueError``; the message names ``what``."""
    if seed is None:
        return None
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(f"{what} must be an int or None, got {type(seed).__name__}")
    lo, hi = SEED_RANGE
    if not lo <= seed <= hi:
        raise ValueError(f"{what} must be in [-2**63, 2**64 - 1] (what torch.Generator accepts), got {seed}")
    return int(seed)


def _as_float(value: Any) -> float | None:
    """``value`` as a float if it is a real number (not a bool) that fits one, else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except (OverflowError, ValueError):
        return None


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
        vocab_size = self.vocab_size
        known = self.__dict__.get("_known_ids")
        if known is None or known.vocab_size != vocab_size:
            known = self.__dict__["_known_ids"] = KnownIds(vocab_size)
        ids = as_token_ids(token_ids, what, vocab_size, known)
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
        temp = _as_float(temperature)
        if temp is None or not 0 <= temp < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if temp < GREEDY_TEMPERATURE:
            temp = 0.0  # greedy: dividing a row by such a temperature overflows
        what = "seed" if what == "prompt_token_ids" else f"the seed of {what} (seed + index)"
        return SampleArgs(ids, max_tokens, eos_ids, temp, check_seed(seed, what))

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


def _gather(rows: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """``rows[i, ids[i]]`` for each ``i``, as float32 on the CPU."""
    index = torch.tensor(ids, dtype=torch.long, device=rows.device)
    return rows.gather(1, index.unsqueeze(1)).squeeze(1).float().cpu()


def _topk(row: torch.Tensor, k: int) -> TopK:
    values, indices = torch.topk(row.float(), k)
    return TopK(token_ids=indices.cpu(), logprobs=values.cpu())
