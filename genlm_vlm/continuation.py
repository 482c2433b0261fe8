"""Continuation scoring and top-k: the methods of :class:`~genlm_vlm.base.AsyncLM` built on rows.

:class:`ContinuationScoring` holds :meth:`~ContinuationScoring.score`,
:meth:`~ContinuationScoring.continuation_logprobs` and :meth:`~ContinuationScoring.next_token_topk`
(each with its blocking ``_sync`` form), their argument checks, and the hooks through which a
model that drives an engine scores without rows. :class:`~genlm_vlm.base.AsyncLM` inherits them;
import them from :mod:`genlm_vlm` or :mod:`genlm_vlm.base` as before.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .checks import as_token_ids

TokenIds = Sequence[int]

#: Prefixes per engine call in :meth:`ContinuationScoring.continuation_logprobs` on the row path
#: (bounds memory to ``chunk_size`` rows of ``vocab_size`` floats).
SCORE_CHUNK_SIZE = 128
#: ``method`` of the scoring methods: ``"auto"`` (vLLM's prompt log-probabilities where the model
#: supports them, else rows) or ``"rows"`` (one full row per prefix, always).
SCORE_METHODS = ("auto", "rows")


class TopK(NamedTuple):
    """The ``k`` most likely next tokens, most likely first (see :meth:`ContinuationScoring.next_token_topk`)."""

    #: int64 CPU tensor ``[k]``.
    token_ids: torch.Tensor
    #: float32 CPU tensor ``[k]``: ``log p(token | prompt)``, non-increasing.
    logprobs: torch.Tensor


class ContinuationScoring:
    """Scoring and top-k over a model's rows; mixed into :class:`~genlm_vlm.base.AsyncLM`.

    Uses the model's ``vocab_size``, ``max_model_len`` (where it has one), ``_check_ids`` and
    row methods (``next_token_logprobs``, ``batch_next_token_logprobs`` and their ``_sync``
    forms). Models that drive an engine override the hooks :meth:`_direct_scores` and
    :meth:`_score_futures` to score from vLLM's prompt log-probabilities instead of rows.
    """

    if TYPE_CHECKING:  # provided by AsyncLM
        vocab_size: int

        def _check_ids(self, token_ids: Any, what: str = "token_ids") -> tuple[int, ...]: ...
        async def next_token_logprobs(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor: ...
        def next_token_logprobs_sync(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor: ...
        async def batch_next_token_logprobs(
            self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
        ) -> torch.Tensor: ...
        def batch_next_token_logprobs_sync(
            self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
        ) -> torch.Tensor: ...

    # ------------------------------------------------------------------ argument checks
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
    # Two ways to score a continuation: from vLLM's prompt log-probabilities (one prefill, a few
    # engine requests per record, no full rows: models that drive an engine override the hooks
    # below) or from one full row per prefix (everything else, and ``method="rows"``).
    async def _direct_scores(
        self, prompt: tuple[int, ...], continuation: tuple[int, ...], lora_name: str | None, top_k: int, method: str
    ) -> Any | None:
        """Score ``continuation`` (and the ``top_k`` after ``prompt``) without rows (hook): an
        object with ``logprobs`` (float32 CPU ``[n]``), ``top_ids``, ``top_logprobs``, or None
        when the rows must do it. Arguments are validated already."""
        return None

    def _score_futures(
        self, items: Sequence[tuple[Any, ...]], method: str = "auto", greedy: bool = False
    ) -> list[Any] | None:
        """Blocking form of :meth:`_direct_scores` (hook): one ``concurrent.futures.Future``
        per ``(prompt, continuation, lora_name, top_k)`` (resolving to the same object, or
        failing for that item only), or None when the rows must do it. ``prompt`` and
        ``continuation`` are validated token-id tuples. ``greedy``: the results also say
        whether every continuation token is its row's argmax (``greedy`` field)."""
        return None

    def _scored_sync(self, item: tuple[Any, ...], method: str) -> Any | None:
        """The blocking :meth:`_direct_scores`: one ``(prompt, continuation, lora_name, top_k)``
        through :meth:`_score_futures`, waited for (Ctrl-C aborts it); None when the rows must
        do it."""
        futures = self._score_futures([item], method)
        if futures is None:
            return None
        from .engine.loop import wait_all  # futures of an engine's models only

        return wait_all(futures)[0]

    def _score_args(
        self, prompt_ids: Any, continuation_ids: Any, chunk_size: Any, method: Any
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Validate the arguments of the scoring methods; returns ``(prompt, continuation)``."""
        prompt, cont = self._score_inputs(prompt_ids, continuation_ids)
        if type(chunk_size) is not int or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if method not in SCORE_METHODS:
            raise ValueError(f"method must be one of {', '.join(map(repr, SCORE_METHODS))}, got {method!r}")
        return prompt, cont

    async def continuation_logprobs(
        self,
        prompt_ids: TokenIds,
        continuation_ids: TokenIds,
        *,
        lora_name: str | None = None,
        chunk_size: int = SCORE_CHUNK_SIZE,
        method: str = "auto",
    ) -> torch.Tensor:
        """``log p(c_t | prompt + c_<t)`` for each continuation token ``c_t``: float32 CPU ``[n]``.

        ``prompt_ids`` must be non-empty; an empty continuation gives an empty tensor. Log-
        probabilities are normalised over the full logit width, from the raw logits.

        ``method="auto"``: where the model supports it (:class:`~genlm_vlm.AsyncVirtualLM` on
        vLLM >= 0.32 with the default ``logprobs_mode``), the continuation is scored from vLLM's
        prompt log-probabilities: one prefill, no full rows, batched with other awaits,
        identical (prompt, continuation) pairs in flight computed once. Elsewhere, or with
        ``method="rows"``, from the rows of the prefixes ``prompt``, ``prompt + c_1``, ...,
        ``prompt + c_<n``, requested ``chunk_size`` at a time through
        :meth:`batch_next_token_logprobs` (they share batches and the output cache with other
        awaits; at most ``chunk_size`` rows are held at once). ``stats["scoring"]`` counts both.
        """
        prompt, cont = self._score_args(prompt_ids, continuation_ids, chunk_size, method)
        if not cont:
            return torch.empty(0, dtype=torch.float32)
        found = await self._direct_scores(prompt, cont, lora_name, 0, method)
        if found is not None:
            return found.logprobs
        out = torch.empty(len(cont), dtype=torch.float32)
        for where, prefixes, targets in _prefix_chunks(prompt, cont, chunk_size):
            out[where] = _gather(await self.batch_next_token_logprobs(prefixes, lora_name=lora_name), targets)
        return out

    def continuation_logprobs_sync(
        self,
        prompt_ids: TokenIds,
        continuation_ids: TokenIds,
        *,
        lora_name: str | None = None,
        chunk_size: int = SCORE_CHUNK_SIZE,
        method: str = "auto",
    ) -> torch.Tensor:
        """Blocking :meth:`continuation_logprobs` (rows through :meth:`batch_next_token_logprobs_sync`)."""
        prompt, cont = self._score_args(prompt_ids, continuation_ids, chunk_size, method)
        if not cont:
            return torch.empty(0, dtype=torch.float32)
        found = self._scored_sync((prompt, cont, lora_name, 0), method)
        if found is not None:
            return found.logprobs
        out = torch.empty(len(cont), dtype=torch.float32)
        for where, prefixes, targets in _prefix_chunks(prompt, cont, chunk_size):
            out[where] = _gather(self.batch_next_token_logprobs_sync(prefixes, lora_name=lora_name), targets)
        return out

    async def score(
        self, prompt_ids: TokenIds, continuation_ids: TokenIds, *, lora_name: str | None = None,
        method: str = "auto",
    ) -> float:
        """``log p(continuation | prompt)``: the sum of :meth:`continuation_logprobs` (0.0 if empty),
        summed in float64.

        No token is added: pass the BOS token in ``prompt_ids`` if the model expects one, and the
        EOS token at the end of ``continuation_ids`` to score a finished text.
        """
        logps = await self.continuation_logprobs(prompt_ids, continuation_ids, lora_name=lora_name, method=method)
        return float(logps.double().sum())

    def score_sync(
        self, prompt_ids: TokenIds, continuation_ids: TokenIds, *, lora_name: str | None = None,
        method: str = "auto",
    ) -> float:
        """Blocking :meth:`score`."""
        logps = self.continuation_logprobs_sync(prompt_ids, continuation_ids, lora_name=lora_name, method=method)
        return float(logps.double().sum())

    async def next_token_topk(self, token_ids: TokenIds, k: int, *, lora_name: str | None = None) -> TopK:
        """The ``k`` most likely tokens after ``token_ids``: :class:`TopK` ``(token_ids, logprobs)``,
        CPU tensors of length ``k``, most likely first (ties in no particular order). Every
        logit column counts, padded ones included (see :func:`genlm_vlm.without_padding`).

        On an :class:`~genlm_vlm.AsyncVirtualLM` with the scoring path (see
        :meth:`continuation_logprobs`) no row is delivered: with ``k`` at most vLLM's
        ``max_logprobs`` (20 unless set in ``engine_opts``) the top ``k`` are vLLM's own top-k of
        the sampled position, above it the row is reduced on the engine thread; a row already in
        the output cache is used as is. Elsewhere, from the row.
        """
        k = self._check_k(k, self.vocab_size)
        ids = self._check_ids(token_ids)
        found = await self._direct_scores(ids, (), lora_name, k, "auto")
        if found is not None:
            return TopK(token_ids=found.top_ids, logprobs=found.top_logprobs)
        return _topk(await self.next_token_logprobs(ids, lora_name=lora_name), k)

    def next_token_topk_sync(self, token_ids: TokenIds, k: int, *, lora_name: str | None = None) -> TopK:
        """Blocking :meth:`next_token_topk`."""
        k = self._check_k(k, self.vocab_size)
        ids = self._check_ids(token_ids)
        found = self._scored_sync((ids, (), lora_name, k), "auto")
        if found is not None:
            return TopK(token_ids=found.top_ids, logprobs=found.top_logprobs)
        return _topk(self.next_token_logprobs_sync(ids, lora_name=lora_name), k)


def _prefix_chunks(
    prompt: tuple[int, ...], cont: tuple[int, ...], chunk_size: int
) -> Iterator[tuple[slice, list[tuple[int, ...]], tuple[int, ...]]]:
    """``(where in the output, the prefixes whose rows are needed, the tokens to read from those
    rows)`` per chunk of at most ``chunk_size`` prefixes (the row path of the scoring methods)."""
    for start in range(0, len(cont), chunk_size):
        stop = min(start + chunk_size, len(cont))
        yield slice(start, stop), [prompt + cont[:k] for k in range(start, stop)], cont[start:stop]


def _gather(rows: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """``rows[i, ids[i]]`` for each ``i``, as float32 on the CPU."""
    index = torch.tensor(ids, dtype=torch.long, device=rows.device)
    return rows.gather(1, index.unsqueeze(1)).squeeze(1).float().cpu()


def _topk(row: torch.Tensor, k: int) -> TopK:
    values, indices = torch.topk(row.float(), k)
    return TopK(token_ids=indices.cpu(), logprobs=values.cpu())
