"""The constraint interface: :class:`Constraint` (a description) binds to a vocabulary as a
:class:`BoundConstraint` (one state per particle); see :mod:`.constraints` for the kinds.

* :meth:`BoundConstraint.initial` -- the state before any generated token;
* :meth:`BoundConstraint.bitmasks` -- ``int32 [m, ceil(V/32)]`` token bitmasks on the host
  (xgrammar's layout: bit ``j % 32`` of word ``j // 32`` set where token ``j`` may come next, EOS
  included where the text generated so far may end); :meth:`BoundConstraint.masks` is the same as
  bool ``[m, V]`` (numpy);
* :meth:`BoundConstraint.advance` -- the state after a token (the state passed in may be reused);
* :meth:`BoundConstraint.copy` -- an independent copy (a resampled particle's).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where used: importing genlm_vlm.smc stays light
    import torch


def _pack(mask: Any) -> torch.Tensor:
    from .step import pack

    return pack(mask)


class ConstraintError(ValueError):
    """A constraint that cannot be used: it does not compile, or its language is empty."""


class BoundConstraint(ABC):
    """A constraint compiled for one vocabulary (see the module docstring). Not thread-safe:
    one SMC run uses it from one thread at a time. A subclass implements :meth:`bitmasks` or
    :meth:`masks` (each has a default made from the other)."""

    #: Seconds spent in :meth:`bitmasks` and :meth:`advance` since creation (the constraint's cost).
    seconds: float = 0.0
    #: The row width ``V`` it was bound for.
    width: int = 0

    @abstractmethod
    def initial(self) -> Any:
        """The state of a particle that has generated nothing yet."""

    def bitmasks(self, states: Sequence[Any]) -> torch.Tensor:
        """``int32 [len(states), ceil(V/32)]`` on the host: the tokens allowed next in each state
        (xgrammar's bitmask layout). Default: :meth:`masks`, packed."""
        if type(self).masks is BoundConstraint.masks:
            raise NotImplementedError(f"{type(self).__name__} must implement bitmasks() or masks()")
        return _pack(np.asarray(self.masks(states), dtype=bool))

    def bitmasks_upto(self, states: Sequence[Any], width: int) -> torch.Tensor:
        """Like :meth:`bitmasks`, for a caller that reads only the first ``width`` columns:
        ``int32 [len(states), >= ceil(width/32)]`` (words past those may be cut). Default:
        :meth:`bitmasks`. The controller calls this; a constraint filled over fewer columns than
        ``V`` saves allocating and copying the padding's words."""
        return self.bitmasks(states)

    #: Allowed tokens per row of the last :meth:`bitmasks_upto` / :meth:`bitmasks_on` call
    #: (int64 numpy ``[m]``), where the constraint knows them without counting; else None.
    last_counts: np.ndarray | None = None

    def bitmasks_on(self, states: Sequence[Any], width: int, device: Any) -> torch.Tensor:
        """:meth:`bitmasks_upto` for a caller that wants the bitmasks on ``device`` (the rows'
        device; None: the host). Default: computed on the host (the caller moves them). A
        constraint that keeps its masks on the device returns them there without a host copy."""
        return self.bitmasks_upto(states, width)

    def masks(self, states: Sequence[Any]) -> np.ndarray:
        """Bool ``[len(states), V]`` (numpy): the tokens allowed next in each state. Default:
        :meth:`bitmasks`, unpacked."""
        if type(self).bitmasks is BoundConstraint.bitmasks:
            raise NotImplementedError(f"{type(self).__name__} must implement bitmasks() or masks()")
        return unpack_bits(self.bitmasks(states), self.width)

    @abstractmethod
    def advance(self, state: Any, token: int) -> Any:
        """The state after ``token`` (``state`` itself may be changed and returned)."""

    @abstractmethod
    def copy(self, state: Any) -> Any:
        """An independent copy of ``state``."""

    def advance_many(self, states: Sequence[Any], tokens: Sequence[int]) -> list[Any]:
        """:meth:`advance` for each pair, in order (the controller calls this once per step with
        distinct states). Default: one :meth:`advance` per pair; a grammar advances its matchers
        in one call."""
        return [self.advance(s, t) for s, t in zip(states, tokens, strict=True)]


def unpack_bits(bits: Any, width: int) -> np.ndarray:
    """Bitmask ``int32 [m, W]`` (tensor on any device, or numpy) -> bool ``[m, width]`` numpy."""
    b = bits.cpu().numpy() if hasattr(bits, "cpu") else np.asarray(bits)
    b = np.ascontiguousarray(b, dtype=np.int32)
    packed = b.view(np.uint8).reshape(b.shape[0], b.shape[1] * 4)
    return np.unpackbits(packed, axis=1, bitorder="little")[:, :width].view(bool)


class Constraint(ABC):
    """A description of which token sequences are allowed (see the module docstring)."""

    @abstractmethod
    def bind(self, byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int,
             cache: dict[Any, Any] | None = None) -> BoundConstraint:
        """Compile for a vocabulary: ``byte_vocab[i]`` is token ``i``'s bytes, ``eos_ids`` the
        tokens that end a sequence, ``width`` the row width ``V`` (at least ``len(byte_vocab)``;
        columns past it are never allowed). ``cache``: a dict kept per vocabulary, where
        compilers may keep what they build for it. Raises :class:`ConstraintError`."""

    def describe(self) -> str:
        return repr(self)


def usable_tokens(byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int) -> np.ndarray:
    """Bool ``[width]``: tokens that have bytes, and the EOS ids (special tokens and padding
    columns have no bytes and are never allowed)."""
    usable = np.zeros(width, dtype=bool)
    usable[: len(byte_vocab)] = [bool(b) for b in byte_vocab[:width]]
    usable[[int(e) for e in eos_ids if 0 <= int(e) < width]] = True
    return usable


def usable_bits(byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int,
                cache: dict[Any, Any] | None = None) -> torch.Tensor:
    """:func:`usable_tokens` as an ``int32 [ceil(width/32)]`` bitmask row, kept in ``cache`` (the
    model's bind cache) per EOS ids and width."""
    key = ("usable_bits", tuple(int(e) for e in eos_ids), width)
    bits = None if cache is None else cache.get(key)
    if bits is None:
        bits = _pack(usable_tokens(byte_vocab, eos_ids, width)[None, :])[0]
        if cache is not None:
            cache[key] = bits
    return bits


def usable_width(byte_vocab: Sequence[bytes], eos_ids: Sequence[int]) -> int:
    """One past the last column that can ever be allowed: a token with bytes or an EOS id. The
    columns after it are the logit matrix's padding; the SMC step never reads them."""
    n = len(byte_vocab)
    last = max((int(e) for e in eos_ids if 0 <= int(e) < n), default=-1)
    for j in range(n - 1, last, -1):
        if byte_vocab[j]:
            return j + 1
    return max(last + 1, 1)
