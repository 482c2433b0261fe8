"""genlm-control, genlm-bytes and llamppl on genlm_vlm models: no wrapper needed.

An :class:`~genlm_vlm.AsyncVirtualLM` (or :class:`~genlm_vlm.mock.MockAsyncLM`) is passed to
genlm's packages as it is::

    from genlm.control import PromptedLLM, BoolFSA, AWRS
    from genlm_vlm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name("Qwen/Qwen2.5-0.5B")
    llm = PromptedLLM(lm, eos_byte_strings=[b"."])
    llm.set_prompt_from_str("Here is a sentence:")
    # genlm.bytes: await ByteBeamState.initial(lm, BeamParams(K=5))
    # llamppl:     CachedCausalLM(lm)

What makes that work, whatever the import order of genlm_vlm and genlm's packages:

* ``lm.byte_vocab`` holds ``Token`` entries (bytes with ``.token_id`` and ``.byte_string``,
  equal and hashed by id), which genlm-control and genlm-bytes require; tokens standing for the
  same bytes stay distinct. While genlm-backend is loaded the entries are genlm-backend's own
  ``Token`` class, which those packages check for by type; otherwise
  :class:`genlm_vlm.vocab.Token` (see :func:`genlm_vlm.vocab.token_class`). Read
  ``lm.byte_vocab`` again after importing genlm's packages rather than keeping an older list.
* llamppl's ``CachedCausalLM`` accepts only genlm-backend's model classes, tested with
  ``isinstance``. Those are ``abc.ABC`` classes, so genlm_vlm registers its classes as their
  virtual subclasses (``ABCMeta.register``): ``AsyncVirtualLM`` as genlm-backend's
  ``AsyncVirtualLM`` (llamppl's ``"vllm"`` backend: its KV-cache helpers only warn, since vLLM
  manages its cache) and ``MockAsyncLM`` as ``MockAsyncLM``. This happens when genlm-backend is
  first imported, or at once if it already was (:mod:`genlm_vlm._genlm_compat`).
* genlm_vlm does not import genlm-backend (nor depend on it), and an engine built after
  genlm-backend was imported is protected from its process-wide vLLM settings
  (``VLLM_USE_V2_MODEL_RUNNER=1`` without Triton, numba's llvmlite) by
  :func:`genlm_vlm.engine.build_llm` itself.

Padded logit columns: many models have more logits than tokenizer entries (Qwen2.5: 151936
logits, 151665 tokens). Rows have one column per logit, and so do ``lm.byte_vocab`` and
``lm.str_vocab``, with empty entries for the padding ids. With that layout

* genlm-bytes works as it is: its byte trie requires ``len(byte_vocab)`` to equal the row
  length (genlm-backend 0.3.1's vLLM backend, whose vocabulary stops at the tokenizer while its
  rows keep the logit width, fails there with ``AssertionError``);
* genlm-control works as it is (``PromptedLLM`` cuts rows to its vocabulary and renormalises);
  the padding ids are empty-bytes tokens of its vocabulary, with the tiny probability the model
  gives them;
* llamppl 0.2.3 does not: ``CachedCausalLM`` reads the first character of every ``str_vocab``
  entry. The empty entries are :class:`~genlm_vlm.vocab.PaddedText`, so the ``IndexError`` it
  raises says what to do: pass :func:`without_padding` ``(lm)``, a view of ``lm`` whose
  vocabulary and rows stop at the last real token (rows renormalised). (A vocabulary that stops
  at the tokenizer with rows of full width, genlm-backend's layout, gets past that check but
  fails later, with ``IndexError`` in ``str_vocab``, whenever a padding id is sampled.)

This module imports without genlm-control (:func:`without_padding` needs none of genlm's
packages); what needs it (:func:`prompted_llm`, :func:`smc`) raises an ``ImportError`` that says
how to install it: ``pip install 'genlm-vlm[control]'``, or ``bash scripts/setup.sh control`` in
a checkout (the demo's set-up installs the engine only).

genlm-control's SMC in the engine: :func:`smc` ``(sampler, n_particles, ess_threshold,
max_tokens)`` runs a genlm-control sampler's target (one ``PromptedLLM`` over a genlm_vlm model
times Boolean conditions) as ``lm.smc`` and returns genlm-control's ``Sequences``
(:mod:`genlm_vlm.control.bridge`; the conditions' translation: :mod:`genlm_vlm.control.translate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..base import AsyncLM, TokenIds
from ..vocab import unpadded_length
from .bridge import smc
from .options import require_genlm_control
from .translate import UntranslatableError

__all__ = ["UnpaddedLM", "UntranslatableError", "prompted_llm", "smc", "without_padding"]


def _known_ids(lm: Any) -> int:
    """Length of ``lm.byte_vocab`` without the trailing ids no token stands for (logit padding)."""
    return unpadded_length(lm.byte_vocab, lm.tokenizer)


class UnpaddedLM(AsyncLM):
    """A view of a genlm_vlm model without its padded logit columns (see :func:`without_padding`).

    ``byte_vocab``, ``str_vocab`` and every row stop at :attr:`vocab_size` = the number of ids
    up to the tokenizer's last token; rows are renormalised over those ids
    (``log_softmax(row[:vocab_size])``). Every call goes to the wrapped model :attr:`lm`;
    attributes this class does not define (``stats``, ``engine_info``, the LoRA methods, ...)
    are the wrapped model's, and ``batch_size`` / ``timeout`` set the wrapped model's. Cleaning
    up the view cleans up the model. llamppl accepts it as it accepts the model.
    """

    genlm_backend_class = "AsyncVirtualLM"

    def __init__(self, lm: Any) -> None:
        self.lm = lm
        self.tokenizer = lm.tokenizer
        n = _known_ids(lm)
        self._n = n
        self._trim = n < lm.vocab_size
        self.__dict__["_byte_strings"] = [bytes(b) for b in lm.byte_vocab[:n]]
        self.__dict__["str_vocab"] = list(lm.str_vocab[:n])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("lm", "_n", "_trim"):
            raise AttributeError(name)
        return getattr(self.lm, name)

    def __repr__(self) -> str:
        return f"UnpaddedLM({self.lm!r}, vocab_size={self._n})"

    @property
    def vocab_size(self) -> int:
        """Number of ids kept: the wrapped model's logit width minus its trailing padding."""
        return self._n

    @property
    def n_vocab(self) -> int:
        """Same as :attr:`vocab_size` (the name the earlier wrapper used)."""
        return self._n

    @property
    def batch_size(self) -> int:
        return self.lm.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self.lm.batch_size = value

    @property
    def timeout(self) -> float:
        return self.lm.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self.lm.timeout = value

    def _fit(self, rows: torch.Tensor) -> torch.Tensor:
        """Drop the padded logit columns (if any) and renormalise over the rest."""
        if not self._trim:
            return rows
        return torch.log_softmax(rows[..., : self._n], dim=-1)

    def _check_ids(self, token_ids: Any, what: str = "token_ids") -> tuple[int, ...]:
        ids = AsyncLM._check_ids(self, token_ids, what)
        check = getattr(self.lm, "_check_ids", None)
        return ids if check is None else check(ids, what)

    # ------------------------------------------------------------------ rows
    async def next_token_logprobs(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        """The wrapped model's row, cut to :attr:`vocab_size` and renormalised."""
        return self._fit(await self.lm.next_token_logprobs(token_ids, lora_name=lora_name))

    def next_token_logprobs_sync(self, token_ids: TokenIds, lora_name: str | None = None) -> torch.Tensor:
        return self._fit(self.lm.next_token_logprobs_sync(token_ids, lora_name=lora_name))

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        return self._fit(await self.lm.batch_next_token_logprobs(token_ids_list, lora_name=lora_name))

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None, **kwargs: Any
    ) -> torch.Tensor:
        return self._fit(self.lm.batch_next_token_logprobs_sync(token_ids_list, lora_name=lora_name, **kwargs))

    # ------------------------------------------------------------------ housekeeping
    def clear_cache(self) -> None:
        self.lm.clear_cache()

    def cleanup(self) -> None:
        self.lm.cleanup()

    def __enter__(self) -> UnpaddedLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def without_padding(lm: Any) -> Any:
    """``lm`` without its padded logit columns: an :class:`UnpaddedLM` view, or ``lm`` itself
    when every logit has a token (most models; the view of a view is that view)."""
    if isinstance(lm, UnpaddedLM):
        return lm
    return UnpaddedLM(lm) if _known_ids(lm) < lm.vocab_size else lm


def prompted_llm(lm: Any, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Any:
    """``genlm.control.PromptedLLM(lm, **kwargs)`` with its prompt set from text or token ids.

    Text goes through ``PromptedLLM.set_prompt_from_str`` (``lm.tokenizer.encode(text)``).
    Other keyword arguments (``eos_byte_strings``, ``temperature``, ``lora_name``) go to
    ``PromptedLLM``. Needs genlm-control (``pip install 'genlm-vlm[control]'``; an
    ``ImportError`` says so).
    """
    require_genlm_control("genlm_vlm.control.prompted_llm")
    from genlm.control import PromptedLLM

    llm = PromptedLLM(lm, **kwargs)
    if isinstance(prompt, str):
        llm.set_prompt_from_str(prompt)
    elif prompt is not None:
        llm.prompt_ids = list(prompt)
    return llm
