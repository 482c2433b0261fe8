"""``MockAsyncLM``: an :class:`~genlm_vlm.AsyncVirtualLM` stand-in without vLLM, for unit tests.

It has the same methods, arguments and validation as :class:`~genlm_vlm.AsyncVirtualLM`
(``next_token_logprobs``, the ``batch_*`` and ``*_sync`` variants, ``sample``/``batch_sample``,
``score``, ``next_token_topk``, the LoRA methods, ``clear_cache``, ``cleanup``, ``with`` blocks)
and a ``byte_vocab`` of ``Token`` entries, but its rows are pseudo-random: a deterministic
function of ``(seed, adapter, token ids)``, identical across calls, processes and machines with
the same torch version. Nothing here imports vLLM, so tests of code written against
``AsyncVirtualLM`` run in milliseconds. genlm-control, genlm-bytes and llamppl accept it too
(llamppl sees it as genlm-backend's ``MockAsyncLM``).

::

    from genlm_vlm.mock import MockAsyncLM

    lm = MockAsyncLM()                       # 256 single-byte tokens + <s>=0, </s>=1
    lm = MockAsyncLM(tokenizer)              # a Hugging Face tokenizer's vocabulary
    lm = MockAsyncLM.from_name("path/to/model")   # the tokenizer saved with a model
    row = await lm.next_token_logprobs([0, 72, 105])
"""

from __future__ import annotations

import hashlib
import numbers
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .base import SampleArgs
from .lora import Adapter
from .serving import Query, ServingLM

__all__ = ["MockAsyncLM", "MockTokenizer", "default_byte_vocab"]

#: Special tokens of the default vocabulary: ``<s>`` = 0 (BOS), ``</s>`` = 1 (EOS).
_DEFAULT_SPECIAL = (b"<s>", b"</s>")


def default_byte_vocab() -> list[bytes]:
    """``[b"<s>", b"</s>", b"\\x00", b"\\x01", ..., b"\\xff"]``: byte ``b`` is token ``b + 2``."""
    return [*_DEFAULT_SPECIAL, *(bytes([b]) for b in range(256))]


class MockTokenizer:
    """A minimal tokenizer over a byte vocabulary (what genlm's consumers call on ``lm.tokenizer``).

    ``encode`` splits the UTF-8 of a text greedily into the longest vocabulary entries (special
    tokens excluded; the first id wins where two ids stand for the same bytes) and adds nothing
    (no BOS). ``decode`` joins the entries' bytes and decodes them as UTF-8 (invalid bytes become
    U+FFFD).
    """

    def __init__(
        self,
        byte_vocab: Sequence[bytes],
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        special_ids: Sequence[int] = (),
    ) -> None:
        self._vocab = [bytes(b) for b in byte_vocab]
        n = len(self._vocab)
        for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if value is not None and not 0 <= value < n:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {n})")
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = None
        self.all_special_ids = sorted({*special_ids, *(i for i in (bos_token_id, eos_token_id) if i is not None)})
        special = set(self.all_special_ids)
        self._ids: dict[bytes, int] = {}
        for i, b in enumerate(self._vocab):
            if b and i not in special:
                self._ids.setdefault(b, i)
        self._longest = max((len(b) for b in self._ids), default=0)

    def __len__(self) -> int:
        return len(self._vocab)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._vocab[self.bos_token_id].decode("utf-8", "replace")

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._vocab[self.eos_token_id].decode("utf-8", "replace")

    @property
    def all_special_tokens(self) -> list[str]:
        return [self._vocab[i].decode("utf-8", "replace") for i in self.all_special_ids]

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of ``text`` (greedy longest match; ``add_special_tokens`` has no effect)."""
        data = text.encode("utf-8")
        ids: list[int] = []
        pos = 0
        while pos < len(data):
            for size in range(min(self._longest, len(data) - pos), 0, -1):
                token = self._ids.get(data[pos : pos + size])
                if token is not None:
                    ids.append(token)
                    pos += size
                    break
            else:
                raise ValueError(f"byte {data[pos]:#04x} at offset {pos} of the text has no token in this vocabulary")
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return b"".join(self._vocab[int(i)] for i in token_ids if int(i) not in skip).decode("utf-8", "replace")

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, numbers.Integral):
            return self._vocab[int(ids)].decode("utf-8", "replace")
        return [self._vocab[int(i)].decode("utf-8", "replace") for i in ids]

    def __repr__(self) -> str:
        return f"MockTokenizer(n={len(self)}, bos={self.bos_token_id}, eos={self.eos_token_id})"


class MockAsyncLM(ServingLM):
    """Deterministic pseudo-random next-token rows with :class:`~genlm_vlm.AsyncVirtualLM`'s API.

    Args:
        tokenizer: A Hugging Face tokenizer (its vocabulary gives ``byte_vocab`` as for a real
            model), or None for a :class:`MockTokenizer` over ``byte_vocab``.
        byte_vocab: The bytes of each token id (default :func:`default_byte_vocab` when no
            tokenizer is given). With a tokenizer too, it replaces the tokenizer's table.
        bos_token_id, eos_token_id: For the :class:`MockTokenizer` (default 0 and 1 with the
            default vocabulary, else None).
        vocab_size: Logit width V, at least the vocabulary's length (more emulates a model whose
            logit matrix is padded past its tokenizer: those ids get empty bytes).
        seed: Changes every row. Rows are ``log_softmax(logit_scale * z)`` with ``z`` standard
            normal, drawn from a generator seeded by a hash of ``(seed, adapter path, ids)``.
        logit_scale: Spread of the logits (larger: peakier rows).
        max_model_len: Longest sequence allowed (prompts up to ``max_model_len - 1`` tokens).
        batch_size, timeout: Accepted, validated and settable like ``AsyncVirtualLM``'s; they
            change nothing here (rows are computed at once).

    Rows are float32 CPU tensors ``[V]`` (each call returns a new tensor); ``chunk_size`` and
    ``show_progress`` of the blocking batch call are accepted and change nothing. ``sample``
    draws from the rows (``temperature=0``: greedy; with ``seed``:
    ``torch.Generator().manual_seed(seed)``, without: torch's global RNG). ``stats`` counts
    ``calls`` (row requests: one per prompt, including those inside batch calls and scoring),
    ``samples`` (sample requests) and ``tokens`` (prompt tokens seen). LoRA adapters are
    registered by name without being read; an adapter's rows depend on its path, so two names
    for one path give the same rows. An adapter not registered raises
    :class:`~genlm_vlm.UnknownAdapterError`. Nothing is cached and nothing is ever pending, so
    ``clear_cache`` and ``reset_async_queries`` do nothing.
    """

    genlm_backend_class = "MockAsyncLM"
    _context_limit_hint = "Shorten the prompt, or build the mock with a larger max_model_len."
    _cleanup_blocks = False
    _local_lora_paths = False  # adapters are never read: a path is a name, kept as given

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        byte_vocab: Sequence[bytes] | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        vocab_size: int | None = None,
        seed: int = 0,
        logit_scale: float = 3.0,
        max_model_len: int = 4096,
        batch_size: int = 256,
        timeout: float = 0.0,
    ) -> None:
        super().__init__(batch_size=batch_size, timeout=timeout)
        if tokenizer is None:
            if byte_vocab is None:
                byte_vocab = default_byte_vocab()
                bos_token_id = 0 if bos_token_id is None else bos_token_id
                eos_token_id = 1 if eos_token_id is None else eos_token_id
            tokenizer = MockTokenizer(byte_vocab, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
        elif bos_token_id is not None or eos_token_id is not None:
            raise TypeError("bos_token_id / eos_token_id are for the built-in MockTokenizer; a real tokenizer has its own")
        self.tokenizer = tokenizer
        known = len(tokenizer) if byte_vocab is None else len(byte_vocab)
        if vocab_size is None:
            vocab_size = known
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size < max(known, 1):
            raise ValueError(f"vocab_size must be an int >= the vocabulary's length ({known}), got {vocab_size!r}")
        self._vocab_size = int(vocab_size)
        if byte_vocab is not None:
            self.__dict__["_byte_strings"] = [bytes(b) for b in byte_vocab] + [b""] * (self._vocab_size - known)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.seed = int(seed)
        if not isinstance(logit_scale, numbers.Real) or not np.isfinite(logit_scale) or logit_scale < 0:
            raise ValueError(f"logit_scale must be a finite number >= 0, got {logit_scale!r}")
        self.logit_scale = float(logit_scale)
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, numbers.Integral) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
        self.max_model_len = int(max_model_len)
        self._stats = {"calls": 0, "samples": 0, "tokens": 0}
        self._closed = False

    @classmethod
    def from_name(cls, model_name: str | os.PathLike[str], **kwargs: Any) -> MockAsyncLM:
        """A mock over the tokenizer of ``model_name`` (a local directory or a hub name; only the
        tokenizer is loaded, with ``transformers.AutoTokenizer``). ``vocab_size`` defaults to the
        model's ``config.json`` ``vocab_size`` when that file is there. Other keyword arguments go
        to :class:`MockAsyncLM`."""
        from transformers import AutoTokenizer

        path = os.fspath(model_name)
        tokenizer = AutoTokenizer.from_pretrained(path)
        if "vocab_size" not in kwargs:
            config = os.path.join(path, "config.json")
            if os.path.isfile(config):
                import json

                with open(config, encoding="utf-8") as f:
                    size = json.load(f).get("vocab_size")
                if isinstance(size, int) and size >= len(tokenizer):
                    kwargs["vocab_size"] = size
        return cls(tokenizer, **kwargs)

    @property
    def vocab_size(self) -> int:
        """Logit width V: the length of every returned row."""
        return self._vocab_size

    @property
    def stats(self) -> dict[str, int]:
        """Counters: ``calls`` (rows requested), ``samples`` (sample requests), ``tokens``."""
        return dict(self._stats)

    # ------------------------------------------------------------------ ServingLM hooks
    def _compute(self, ids: Sequence[int], adapter: Adapter | None) -> torch.Tensor:
        """The row of ``ids`` under ``adapter``: a function of ``(seed, adapter path, ids)``."""
        digest = hashlib.blake2b(digest_size=8)
        digest.update(self.seed.to_bytes(16, "little", signed=True))
        digest.update(b"" if adapter is None else adapter.path.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
        digest.update(np.asarray(ids, dtype="<i8").tobytes())
        gen = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
        logits = torch.randn(self._vocab_size, generator=gen, dtype=torch.float32) * self.logit_scale
        self._stats["calls"] += 1
        self._stats["tokens"] += len(ids)
        return torch.log_softmax(logits, dim=-1)

    async def _row(self, query: Query) -> torch.Tensor:
        return self._compute(query.ids, query.adapter)

    async def _rows(self, queries: list[Query]) -> torch.Tensor:
        return self._rows_sync(queries, None, False)

    def _rows_sync(self, queries: list[Query], chunk_size: int | None, show_progress: bool) -> torch.Tensor:
        if not queries:
            return self._no_rows()
        return torch.stack([self._compute(q.ids, q.adapter) for q in queries])

    async def _samples(self, specs: list[SampleArgs], adapter: Adapter | None) -> list[list[int]]:
        return [self._sample(spec, adapter) for spec in specs]

    def _sample(self, spec: SampleArgs, adapter: Adapter | None) -> list[int]:
        ids, stop = list(spec.ids), set(spec.eos)
        gen = None if spec.seed is None else torch.Generator().manual_seed(spec.seed)
        self._stats["samples"] += 1
        out: list[int] = []
        while len(out) < spec.max_tokens and len(ids) < self.max_model_len:
            row = self._compute(ids, adapter)
            if spec.temperature == 0:
                token = int(torch.argmax(row))
            else:
                probs = torch.softmax(row.double() / spec.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=gen))
            if token in stop:
                break
            out.append(token)
            ids.append(token)
        return out

    # ------------------------------------------------------------------ housekeeping
    def release_sessions(self) -> int:
        """No sessions here; returns 0."""
        self._check_open()
        return 0

    def __repr__(self) -> str:
        return f"MockAsyncLM(vocab_size={self._vocab_size}, seed={self.seed}, tokenizer={type(self.tokenizer).__name__})"
