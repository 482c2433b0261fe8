"""The interface that SMC and constrained-decoding code awaits (genlm-backend compatible names)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from typing import Any, TypeVar

import torch

TokenIds = Sequence[int]
T = TypeVar("T")


def _fit(vocab: list[T], size: int, empty: T) -> list[T]:
    return vocab[:size] + [empty] * (size - len(vocab))


class AsyncLM(ABC):
    """A language model that returns full-vocabulary next-token log-probabilities.

    Subclasses implement :meth:`next_token_logprobs` and :meth:`next_token_logprobs_sync`; the
    batch methods here are generic fallbacks that concrete backends override with real batching.
    ``byte_vocab[i]`` / ``str_vocab[i]`` give what token ``i`` stands for (computed on first use).
    """

    tokenizer: Any

    # Both vocabularies have exactly ``vocab_size`` entries (the logit width): ids the tokenizer
    # does not cover map to empty, tokenizer entries beyond the logit width are dropped.
    @cached_property
    def byte_vocab(self) -> list[bytes]:
        """Bytes of each token id (length = logit width; ids with no token map to ``b""``)."""
        from .vocab import get_byte_vocab

        return _fit(get_byte_vocab(self.tokenizer), self.vocab_size, b"")

    @cached_property
    def str_vocab(self) -> list[str]:
        """Text of each token id (see :func:`genlm_vlm.vocab.get_str_vocab`)."""
        from .vocab import get_str_vocab

        return _fit(get_str_vocab(self.tokenizer), self.vocab_size, "")

    @property
    def vocab_size(self) -> int:
        """Logit width V: the length of every returned row."""
        return len(self.tokenizer)

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
        rows = await asyncio.gather(*(self.next_token_logprobs(t, lora_name=lora_name) for t in token_ids_list))
        return torch.stack(rows)

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking version of :meth:`batch_next_token_logprobs`."""
        return torch.stack([self.next_token_logprobs_sync(t, lora_name=lora_name) for t in token_ids_list])

    def clear_cache(self) -> None:  # noqa: B027 - optional hook
        """Drop cached results (no-op here)."""
