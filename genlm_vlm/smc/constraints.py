"""Token constraints for SMC: which tokens may come next for each particle.

A :class:`Constraint` is a description (a regular expression, a JSON schema, a grammar, a mask
function); :meth:`Constraint.bind` compiles it against one model's vocabulary and returns a
:class:`BoundConstraint`, which keeps one *state* per particle:

* :meth:`BoundConstraint.initial` -- the state before any generated token;
* :meth:`BoundConstraint.bitmasks` -- ``int32 [m, ceil(V/32)]`` token bitmasks on the host
  (xgrammar's layout: bit ``j % 32`` of word ``j // 32`` set where token ``j`` may come next, EOS
  included where the text generated so far may end); :meth:`BoundConstraint.masks` is the same as
  bool ``[m, V]`` (numpy);
* :meth:`BoundConstraint.advance` -- the state after a token (the state passed in may be reused);
* :meth:`BoundConstraint.copy` -- an independent copy (a resampled particle's).

:class:`Regex` runs as a token automaton (:mod:`.automaton`); the grammar constraints run on
xgrammar (:mod:`.grammars`). The vocabulary is given as the model's ``byte_vocab``
(one ``bytes`` per token id), so the same constraint binds to a real model, a tensor-parallel one,
replicas or :class:`~genlm_vlm.MockAsyncLM` alike; tokens with no bytes (padding columns, and the
special and added tokens, which :func:`genlm_vlm.smc.api.text_vocab` hands over empty) are never
allowed, by any constraint, EOS excepted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .constraint_base import (
    BoundConstraint,
    Constraint,
    ConstraintError,
    _pack,
    unpack_bits,
    usable_bits,
    usable_tokens,
    usable_width,
)
from .grammars import Grammar, JSONSchema, fill_width

if TYPE_CHECKING:
    import torch

__all__ = [
    "AllOf", "BoundConstraint", "Constraint", "ConstraintError", "Grammar", "JSONSchema", "MaskFunction", "Regex",
    "TokenMask", "as_constraint", "fill_width", "unpack_bits", "usable_bits", "usable_tokens", "usable_width",
]


class Regex(Constraint):
    """The generated text (the tokens' bytes, decoded as UTF-8) must match ``pattern`` as
    ``re.fullmatch(pattern, text)`` does, then EOS: Python's syntax and meaning (``.`` excludes
    ``"\\n"`` unless ``(?s)``; ``\\w``, ``\\d``, ``\\s`` and ``(?i)`` are Unicode-aware as in
    ``re``: write ``[0-9]`` or ``(?a)`` for ASCII). Refused, with a message saying what to write
    instead: back-references, look-arounds, conditionals, possessive quantifiers, atomic groups,
    ``\\b``/``\\B``, and anchors away from the pattern's start or end. The pattern is parsed and
    checked here, when the constraint is built.

    Bound to a vocabulary it is a token automaton (:mod:`.automaton`): a DFA over the text's
    UTF-8 bytes made on demand (:mod:`.lazydfa`: only the states a run reaches, in a cache of at
    most ``cache_bytes``, :data:`~.lazydfa.CACHE_BYTES` by default), each state's allowed tokens
    found once per (pattern, vocabulary) and kept as a bitmask row, so a step's masks are a
    gather and advancing a particle is a table walk over its token's bytes. Limits, each a
    :class:`ConstraintError` naming the pattern and the way out: the pattern's code point
    automaton (:data:`~.regex.MAX_NFA_STATES` states), one DFA state's set of NFA positions
    (:data:`~.bytenfa.MAX_SET`), and the states one step may add past the cache
    (:data:`~.lazydfa.OVERDRAFT_BYTES`)."""

    def __init__(self, pattern: str, *, cache_bytes: int | None = None) -> None:
        from . import regex

        if not isinstance(pattern, str):
            raise TypeError(f"Regex needs a pattern string, got {type(pattern).__name__}")
        if not pattern:
            raise ConstraintError("Regex needs a non-empty pattern string, got ''")
        if cache_bytes is not None and (isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int)):
            raise TypeError(f"Regex: cache_bytes must be an int or None, got {type(cache_bytes).__name__}")
        if cache_bytes is not None and cache_bytes < 1 << 16:
            raise ConstraintError(f"Regex: cache_bytes must be >= 65536, got {cache_bytes}")
        self.pattern = pattern
        self.cache_bytes = cache_bytes
        try:
            self._nfa = regex.compile_regex(pattern)
        except regex.RegexError as e:
            sep = " " if str(e).startswith("does not compile") else ": "
            raise ConstraintError(f"{self.describe()}{sep}{e}") from None
        self._bytes: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_bytes"] = None  # made again where it is bound
        return state

    def byte_nfa(self) -> Any:
        """The pattern's :class:`~.bytenfa.ByteNFA` (its code point automaton read over UTF-8)."""
        from .bytenfa import ByteNFA

        if self._bytes is None:
            self._bytes = ByteNFA.from_chars(self._nfa)
        return self._bytes

    def dfa(self) -> Any:
        """A fresh :class:`~.lazydfa.LazyDFA` of the pattern (nothing made past its start)."""
        from .lazydfa import CACHE_BYTES, LazyDFA

        size = CACHE_BYTES if self.cache_bytes is None else self.cache_bytes
        return LazyDFA(self.byte_nfa(), self.describe(), size)

    def bind(self, byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int,
             cache: dict[Any, Any] | None = None) -> BoundConstraint:
        from .automaton import bind_automaton

        key = ("regex", self.pattern, self.cache_bytes)
        return bind_automaton(self.dfa, key, byte_vocab, eos_ids, width, cache, self.describe())

    def describe(self) -> str:
        return f"Regex({self.pattern!r})"


# ------------------------------------------------------------------------------ custom masks
MaskFunction = Callable[[Sequence[tuple[int, ...]]], Any]


class _BoundMask(BoundConstraint):
    """A mask function's bitmasks, ANDed with ``usable`` (:func:`usable_bits`: tokens with bytes
    and the EOS ids; None: as returned)."""

    def __init__(self, fn: MaskFunction, width: int, what: str, usable: torch.Tensor | None = None) -> None:
        self.fn = fn
        self.width = width
        self.what = what
        self.usable = usable
        self.seconds = 0.0

    def initial(self) -> tuple[int, ...]:
        return ()

    def bitmasks(self, states: Sequence[tuple[int, ...]]) -> torch.Tensor:
        import torch

        t0 = time.perf_counter()
        out = self.fn(list(states))
        m, words = len(states), (self.width + 31) // 32
        t = out.detach() if torch.is_tensor(out) else np.asarray(out)
        dtype = str(t.dtype).replace("torch.", "")
        bits = None
        if t.ndim == 2 and t.shape[0] == m:
            if dtype == "bool" and t.shape[1] == self.width:
                bits = _pack(t).cpu()
            elif dtype == "int32" and t.shape[1] == words:
                bits = t.cpu().clone() if torch.is_tensor(t) else torch.from_numpy(np.array(t))
        if bits is None:
            raise ValueError(
                f"{self.what} returned an array of dtype {dtype} and shape {tuple(t.shape)}; it must return "
                f"bool [{m}, {self.width}] or an int32 bitmask [{m}, {words}] (one row per particle)"
            )
        if self.usable is not None:  # special tokens and padding: never, whatever fn returned
            bits &= self.usable
        self.seconds += time.perf_counter() - t0
        return bits

    def advance(self, state: tuple[int, ...], token: int) -> tuple[int, ...]:
        return (*state, int(token))

    def copy(self, state: tuple[int, ...]) -> tuple[int, ...]:
        return state


class TokenMask(Constraint):
    """A custom constraint: ``fn(generated)`` gets the token ids each particle has generated so
    far (a list of tuples, one per particle) and returns, for ``m`` particles, a bool array or
    tensor ``[m, V]`` (True where a token may come next, EOS included where the particle may
    end), or the same as a token bitmask, ``int32 [m, ceil(V/32)]`` in xgrammar's layout (bit
    ``j % 32`` of word ``j // 32`` is token ``j``); numpy or torch, on any device. Columns past the
    tokenizer's vocabulary (padding), special and added tokens (``<s>``, chat markers: tokens with
    no bytes in the vocabulary given to :meth:`bind`) are never allowed, EOS ids excepted, whatever
    it returns. Vectorise it: it is
    called once per step for all particles. An exception it raises fails the SMC run that
    called it, and nothing else."""

    def __init__(self, fn: MaskFunction, name: str = "TokenMask") -> None:
        if not callable(fn):
            raise ConstraintError(f"TokenMask needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name

    def bind(self, byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int,
             cache: dict[Any, Any] | None = None) -> BoundConstraint:
        bound = _BoundMask(self.fn, width, self.name, usable_bits(byte_vocab, eos_ids, width, cache))
        try:
            first = bound.bitmasks([()])
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's function; name it
            raise ConstraintError(f"{self.name} raised on the empty prefix: {e!r}") from e
        if not bool(first.any()):
            raise ConstraintError(f"{self.name} allows no token at the start (empty language)")
        bound.seconds = 0.0
        return bound

    def describe(self) -> str:
        return self.name


class _BoundAll(BoundConstraint):
    def __init__(self, parts: list[BoundConstraint]) -> None:
        self.parts = parts
        self.width = parts[0].width

    @property
    def seconds(self) -> float:  # type: ignore[override]
        return sum(p.seconds for p in self.parts)

    def initial(self) -> tuple[Any, ...]:
        return tuple(p.initial() for p in self.parts)

    def bitmasks(self, states: Sequence[tuple[Any, ...]]) -> torch.Tensor:
        return self.bitmasks_upto(states, self.width)

    def bitmasks_upto(self, states: Sequence[tuple[Any, ...]], width: int) -> torch.Tensor:
        parts = [part.bitmasks_upto([s[k] for s in states], width) for k, part in enumerate(self.parts)]
        words = min(p.shape[1] for p in parts)  # every part covers the first ceil(width/32) words
        out = parts[0][:, :words].clone()
        for bits in parts[1:]:
            out.bitwise_and_(bits[:, :words])
        return out

    def advance(self, state: tuple[Any, ...], token: int) -> tuple[Any, ...]:
        return tuple(p.advance(s, token) for p, s in zip(self.parts, state, strict=True))

    def copy(self, state: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(p.copy(s) for p, s in zip(self.parts, state, strict=True))


class AllOf(Constraint):
    """Every one of ``constraints`` holds: a token is allowed where all of them allow it."""

    def __init__(self, *constraints: Any) -> None:
        if not constraints:
            raise ConstraintError("AllOf needs at least one constraint")
        self.constraints = [as_constraint(c) for c in constraints]

    def bind(self, byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int,
             cache: dict[Any, Any] | None = None) -> BoundConstraint:
        bound = _BoundAll([c.bind(byte_vocab, eos_ids, width, cache) for c in self.constraints])
        if not bool(bound.bitmasks([bound.initial()]).any()):
            raise ConstraintError(f"{self.describe()}: no token is allowed by all of them at the start (empty language)")
        return bound

    def describe(self) -> str:
        return " and ".join(c.describe() for c in self.constraints)


def as_constraint(obj: Any) -> Constraint:
    """``obj`` as a :class:`Constraint`: a constraint as it is; a ``str`` is a regular expression,
    a ``dict`` a JSON schema; anything else is a ``TypeError`` saying what to pass."""
    if isinstance(obj, Constraint):
        return obj
    if isinstance(obj, str):
        return Regex(obj)
    if isinstance(obj, dict):
        return JSONSchema(obj)
    raise TypeError(
        f"constraint must be a genlm_vlm.smc constraint (Regex, JSONSchema, Grammar, TokenMask, AllOf), a regex "
        f"string or a JSON-schema dict; got {type(obj).__name__}"
    )
