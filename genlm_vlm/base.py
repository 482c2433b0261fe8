"""The interface that SMC and constrained-decoding code awaits (genlm-backend compatible names)."""

from __future__ import annotations

import asyncio
import numbers
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

import torch

from ._genlm_compat import declare_stand_in
from .checks import GREEDY_TEMPERATURE, KnownIds, _as_float, as_token_ids, check_seed
from .continuation import (  # noqa: F401 - re-exported: these names were defined here
    SCORE_CHUNK_SIZE,
    SCORE_METHODS,
    ContinuationScoring,
    TokenIds,
    TopK,
    _gather,
    _prefix_chunks,
    _topk,
)

if TYPE_CHECKING:
    from .smc import Controller, SMCResult

T = TypeVar("T")


class ContextLimitWarning(UserWarning):
    """``sample`` stopped at the model's context limit (``max_model_len``) before ``max_tokens``
    tokens and before an EOS token: the sample is shorter than asked for.

    Turn it into an error with ``warnings.simplefilter("error", ContextLimitWarning)``, or
    silence it with ``"ignore"``.
    """


class ClosedError(RuntimeError):
    """The model was cleaned up; it accepts no more calls."""


def _fit(vocab: list[T], size: int, empty: T) -> list[T]:
    return vocab[:size] + [empty] * (size - len(vocab))


class SampleArgs(NamedTuple):
    """The validated arguments of one ``sample`` (see :meth:`AsyncLM._check_sample_args`)."""

    ids: tuple[int, ...]
    max_tokens: int
    eos: tuple[int, ...]
    temperature: float
    seed: int | None


class AsyncLM(ContinuationScoring, ABC):
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

    @cached_property
    def _special_ids(self) -> tuple[int, ...]:
        """Ids below the logit width of the tokenizer's special and added tokens
        (:func:`genlm_vlm.vocab.special_token_ids`): never part of a constrained text, EOS aside
        (:mod:`genlm_vlm.smc` sees them as tokens with no bytes)."""
        from .vocab import special_token_ids

        n = self.vocab_size
        return tuple(i for i in special_token_ids(self.tokenizer) if i < n)

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

    # ------------------------------------------------------------------ SMC (genlm_vlm.smc)
    async def smc(
        self,
        prompt_ids: TokenIds,
        constraint: Any,
        n_particles: int,
        max_tokens: int,
        *,
        ess_threshold: float = 0.5, resampling: str = "systematic", temperature: float = 1.0,
        seed: int | None = None, lora_name: str | None = None,
        eos_token_ids: Sequence[int] | int | None = None,
        force_eos: bool = False, target_temperature: float = 1.0,
        in_engine: bool = True,
        prompts: Sequence[TokenIds] | None = None,
        critic: Callable[[list[bytes]], Any] | None = None,
        engine_path: str = "auto",
        mask_overlap: bool = False,
    ) -> SMCResult:
        """Constrained SMC with the locally optimal proposal (:mod:`genlm_vlm.smc`).

        ``constraint``: a :class:`~genlm_vlm.smc.Regex`, :class:`~genlm_vlm.smc.JSONSchema`,
        :class:`~genlm_vlm.smc.Grammar` or :class:`~genlm_vlm.smc.TokenMask` (a ``str`` is a
        regex, a ``dict`` a JSON schema). ``n_particles`` particles grow one token per step
        from ``prompt_ids`` until EOS (allowed where the constraint accepts; default: the
        tokenizer's ``eos_token_id``) or ``max_tokens``; resampled (``resampling``) when the
        effective sample size falls below ``ess_threshold * n_particles`` (``force_eos`` and
        ``target_temperature``: genlm-control's conventions, docs/API.md). With ``seed`` the run
        is reproducible wherever it runs: on an :class:`~genlm_vlm.AsyncVirtualLM` one run on
        the engine thread (``in_engine=False``: per token in Python, the byte-identical reference);
        elsewhere per token in Python. Arguments are checked before any engine work. ``prompts``
        (with ``prompt_ids=None``): a product of prompts; ``critic``: a terminal critic, called once
        at the end in this coroutine (:mod:`genlm_vlm.smc.product`). Returns an ``SMCResult``:
        ``log_marginal`` estimates log P(a sample ends with EOS within ``max_tokens``, its text
        accepted); cut particles count zero (``log_marginal_cut``); none finished: ``-inf``,
        ``empty_reason`` and an :class:`~genlm_vlm.smc.EmptyPosteriorWarning` say why.
        ``engine_path`` (on an :class:`~genlm_vlm.AsyncVirtualLM`; elsewhere a no-op): ``"auto"``
        (the default: particles as running vLLM requests where that path is covered and was
        measured, bursts elsewhere), ``"requests"`` or ``"bursts"``; ``stats["engine_path"]`` says
        which ran, ``stats["engine_path_fallback"]`` why not the requests path (docs/API.md).
        ``mask_overlap=True`` (experimental, meant for GPUs; default False): on the requests path,
        each step's constraint masks are computed on a worker thread while the engine runs the
        forward, from the tokens of the step before (the same masks, so the same run; an
        exception a mask raises fails the run at the step that uses it); elsewhere a no-op.
        """
        from .smc import api

        return await api.smc(self, prompt_ids, constraint, n_particles, max_tokens, prompts=prompts, critic=critic,
                             in_engine=in_engine, engine_path=engine_path, ess_threshold=ess_threshold, resampling=resampling,
                             temperature=temperature, seed=seed, lora_name=lora_name, eos_token_ids=eos_token_ids,
                             force_eos=force_eos, target_temperature=target_temperature, mask_overlap=mask_overlap)

    def smc_sync(self, prompt_ids: TokenIds, constraint: Any, n_particles: int, max_tokens: int,
                 **kwargs: Any) -> SMCResult:
        """Blocking :meth:`smc` (same arguments). Call it outside a running event loop (inside
        one, ``await lm.smc(...)``)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.smc(prompt_ids, constraint, n_particles, max_tokens, **kwargs))
        raise RuntimeError("smc_sync was called inside a running event loop: use `await lm.smc(...)` there")

    async def run_controller(self, prompt_ids: TokenIds | None, controller: Controller, *,
                             lora_name: str | None = None, start: Sequence[Sequence[int]] | None = None,
                             prompts: Sequence[TokenIds] | None = None, engine_path: str = "auto") -> Any:
        """Run a :class:`~genlm_vlm.smc.Controller` over particles that start at ``prompt_ids``
        (plus ``start[i]`` for particle ``i``) and return ``controller.result(...)``. Here: per
        token in Python (:func:`genlm_vlm.smc.drive`); :class:`~genlm_vlm.AsyncVirtualLM` runs
        it on the engine thread. ``prompts=``: a product of prompts (:mod:`genlm_vlm.smc.product`)."""
        from .checks import check_engine_path
        from .smc import api, drive

        check_engine_path(engine_path)
        prompt, prompts = api.resolve_prompts(self, prompt_ids, prompts)
        return await drive(self, prompt, controller, lora_name=lora_name, start=start, prompts=prompts)
