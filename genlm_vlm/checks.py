"""Checks of the values callers pass (token ids, seeds, batch sizes, timeouts), shared by every
model class; each error names the argument and says what is accepted."""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


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


def _shown(value: Any) -> str:
    """``value`` for an error message: its type, and its repr when that is short."""
    text = repr(value)
    return f"{type(value).__name__} ({text})" if len(text) <= 40 else type(value).__name__


def check_count(value: Any, what: str, minimum: int = 1) -> int:
    """An int ``>= minimum`` (numpy integers accepted; a bool is not an int here): another type
    is a ``TypeError``, a smaller int a ``ValueError``; the message names ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int >= {minimum}, got {_shown(value)}")
    if value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value}")
    return int(value)


def check_real(value: Any, what: str, accepted: str = "a real number") -> float:
    """A real number as a float: an int or float (numpy scalars, 0-d arrays and tensors
    accepted), not a bool nor text; another type is a ``TypeError`` saying ``what`` must be
    ``accepted``. The caller checks the range (a ``ValueError``)."""
    if isinstance(value, bool | str | bytes):
        raise TypeError(f"{what} must be {accepted}, got {_shown(value)}")
    if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # a 0-d numpy array or torch tensor
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be {accepted}, got {_shown(value)}")
    try:
        return float(value)
    except OverflowError:  # an int too large for a float: out of any range the callers accept
        return math.inf if value > 0 else -math.inf


def check_flag(value: Any, what: str) -> bool:
    """``True`` or ``False`` (exactly a bool): anything else is a ``TypeError`` naming ``what``."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, got {_shown(value)}")
    return value


ENGINE_PATHS = ("auto", "bursts", "requests")
"""The values of ``lm.smc(..., engine_path=...)`` (``"auto"``: the default)."""


def check_engine_path(value: Any) -> str:
    """``"auto"`` (the default: the requests path where it is covered and measured, bursts
    elsewhere), ``"bursts"`` or ``"requests"`` (particles as running requests): a ``TypeError``
    for another type, a ``ValueError`` for another string."""
    if not isinstance(value, str):
        raise TypeError(f"engine_path must be 'auto', 'bursts' or 'requests' (a str), got {_shown(value)}")
    if value not in ENGINE_PATHS:
        raise ValueError(f"engine_path must be 'auto' (the default: the path measured fastest for the run), "
                         f"'bursts' or 'requests' (particles as running requests), got {value!r}")
    return value


def check_name(value: Any, what: str) -> str | None:
    """None or a ``str`` (an adapter's or a method's name): anything else is a ``TypeError``."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{what} must be a str or None, got {_shown(value)}")
    return value
