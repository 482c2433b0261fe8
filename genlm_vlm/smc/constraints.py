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

The grammar constraints run on xgrammar (a dependency of vLLM): its compiled grammars, token
bitmasks and ``GrammarMatcher.fork()``. The vocabulary is given as the model's ``byte_vocab``
(one ``bytes`` per token id), so the same constraint binds to a real model, a tensor-parallel one,
replicas or :class:`~genlm_vlm.MockAsyncLM` alike; tokens with no bytes (padding columns, and the
special and added tokens, which :func:`genlm_vlm.smc.api.text_vocab` hands over empty) are never
allowed, by any constraint, EOS excepted.
"""

from __future__ import annotations

import json
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
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


# ------------------------------------------------------------------------------ xgrammar
def _tokenizer_info(byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int) -> Any:
    import xgrammar as xgr

    if not eos_ids:
        raise ConstraintError("the model has no EOS token id: give eos_token_ids= to smc()")
    return xgr.TokenizerInfo(
        [bytes(b) for b in byte_vocab[:width]], xgr.VocabType.RAW, vocab_size=width,
        stop_token_ids=[int(e) for e in eos_ids if 0 <= int(e) < width]
    )


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


class _Compiled(BoundConstraint):
    """An xgrammar grammar bound to a vocabulary; a state is a ``GrammarMatcher``. Bitmasks of
    all the states of a step are filled at once (``BatchGrammarMatcher``), then ANDed with the
    usable tokens in packed form.

    The grammar is compiled for the first ``fill_width`` columns only (:func:`fill_width`: the
    tokens with bytes and the EOS ids), not for the model's ``width``: xgrammar treats every
    column past the tokenizer as a token of its own, and filling masks over the padding cost 28x
    more per matcher on a model with 32,768 columns over 2,048 tokens (issue 36). The words past
    ``fill_width`` stay zero."""

    def __init__(self, compiled: Any, width: int, what: str, usable: np.ndarray, fill: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._compiled = compiled
        self.width = width
        self._fill = fill
        self._usable = usable
        self._fill_words = (fill + 31) // 32
        self._usable_bits = _pack(usable[None, :fill])[0]
        self._words = (width + 31) // 32
        self._batch = xgr.BatchGrammarMatcher()
        self.seconds = 0.0
        self.what = what
        first = self.bitmasks([self.initial()])
        if not bool(first.any()):
            raise ConstraintError(f"{what}: no token of this vocabulary can start a match (empty language)")
        self.seconds = 0.0

    def initial(self) -> Any:
        return self._xgr.GrammarMatcher(self._compiled)

    def bitmasks(self, states: Sequence[Any]) -> torch.Tensor:
        return self.bitmasks_upto(states, self.width)

    def bitmasks_upto(self, states: Sequence[Any], width: int) -> torch.Tensor:
        import torch

        t0 = time.perf_counter()
        m = len(states)
        words = min(self._words, max((int(width) + 31) // 32, self._fill_words))
        narrow = torch.zeros((m, self._fill_words), dtype=torch.int32)
        live = [i for i, matcher in enumerate(states) if not matcher.is_terminated()]
        if live:
            self._batch.batch_fill_next_token_bitmask([states[i] for i in live], narrow,
                                                      None if len(live) == m else live)
        narrow &= self._usable_bits
        if self._fill_words == words:
            bits = narrow
        else:  # the padding's words: zero (a fresh [m, ceil(V/32)] buffer costs page faults)
            bits = torch.zeros((m, words), dtype=torch.int32)
            bits[:, : self._fill_words] = narrow
        self.seconds += time.perf_counter() - t0
        return bits

    def advance(self, state: Any, token: int) -> Any:
        return self.advance_many((state,), (int(token),))[0]

    def advance_many(self, states: Sequence[Any], tokens: Sequence[int]) -> list[Any]:
        t0 = time.perf_counter()  # one matcher at a time: xgrammar's batch_accept_token was slower here
        for state, token in zip(states, tokens, strict=True):
            if not state.accept_token(token):
                raise ValueError(f"{self.what}: token {token} is not allowed here (the mask allowed it?)")
        self.seconds += time.perf_counter() - t0
        return list(states)

    def copy(self, state: Any) -> Any:
        return state.fork()


def fill_width(byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int) -> int:
    """Columns a grammar is compiled for: one past the last token with bytes or EOS id below
    ``width`` (the rest can never be allowed)."""
    last_eos = max((int(e) for e in eos_ids if 0 <= int(e) < width), default=-1)
    return max(1, min(width, max(usable_width(byte_vocab[:width], eos_ids), last_eos + 1)))


class _Grammarish(Constraint):
    """Shared by the xgrammar constraints: compile once per vocabulary."""

    kind = "grammar"

    def _compile(self, compiler: Any) -> Any:  # pragma: no cover - abstract in spirit
        raise NotImplementedError

    def bind(self, byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int,
             cache: dict[Any, Any] | None = None) -> BoundConstraint:
        import xgrammar as xgr

        fill = fill_width(byte_vocab, eos_ids, width)
        key = ("xgrammar", tuple(eos_ids), width)
        compiler = None if cache is None else cache.get(key)
        if compiler is None:
            compiler = xgr.GrammarCompiler(_tokenizer_info(byte_vocab[:fill], eos_ids, fill))
            if cache is not None:
                cache[key] = compiler
        try:
            compiled = self._compile(compiler)
        except Exception as e:  # noqa: BLE001 - xgrammar raises several types; name the constraint
            raise ConstraintError(f"{self.describe()} does not compile: {e}") from e
        usable = None if cache is None else cache.get(("usable", *key[1:]))
        if usable is None:
            usable = usable_tokens(byte_vocab, eos_ids, width)
            if cache is not None:
                cache[("usable", *key[1:])] = usable
        return _Compiled(compiled, width, self.describe(), usable, fill)


class Regex(Constraint):
    """The generated text (the tokens' bytes, decoded as UTF-8) must match ``pattern`` as
    ``re.fullmatch(pattern, text)`` does, then EOS: Python's syntax and meaning (``.`` excludes
    ``"\\n"`` unless ``(?s)``; ``\\w``, ``\\d``, ``\\s`` and ``(?i)`` are Unicode-aware as in
    ``re``). Refused, with a message saying what to write instead: back-references,
    look-arounds, conditionals, possessive quantifiers, atomic groups, ``\\b``/``\\B``, and
    anchors away from the pattern's start or end. The pattern is parsed and checked here, when
    the constraint is built.

    Bound to a vocabulary it is a token automaton (:mod:`.automaton`): a minimal DFA over the
    text's UTF-8 bytes, each state's allowed tokens found once per (pattern, vocabulary) and
    kept as a bitmask row, so a step's masks are a gather and advancing a particle is a table
    walk over its token's bytes. A pattern whose DFA would pass ``max_states`` states is handed
    to xgrammar instead, as an exact EBNF translation of the same language."""

    def __init__(self, pattern: str, *, max_states: int | None = None) -> None:
        from . import regex

        if not isinstance(pattern, str):
            raise TypeError(f"Regex needs a pattern string, got {type(pattern).__name__}")
        if not pattern:
            raise ConstraintError("Regex needs a non-empty pattern string, got ''")
        if max_states is not None and (isinstance(max_states, bool) or not isinstance(max_states, int)):
            raise TypeError(f"Regex: max_states must be an int or None, got {type(max_states).__name__}")
        if max_states is not None and max_states < 2:
            raise ConstraintError(f"Regex: max_states must be >= 2, got {max_states}")
        self.pattern = pattern
        self.max_states = regex.MAX_DFA_STATES if max_states is None else max_states
        try:
            self._nfa = regex.compile_regex(pattern)
        except regex.RegexError as e:
            sep = " " if str(e).startswith("does not compile") else ": "
            raise ConstraintError(f"{self.describe()}{sep}{e}") from None
        self._dfa: Any = None  # the ByteDFA, or the TooManyStates that sent it to xgrammar

    def dfa(self) -> Any:
        """The minimal byte DFA (:class:`~.regex.ByteDFA`), or None where it passes
        ``max_states`` (xgrammar runs the pattern then)."""
        from . import regex

        if self._dfa is None:
            self._dfa = regex.byte_dfa(self.pattern, self.max_states)
        return None if isinstance(self._dfa, Exception) else self._dfa

    def bind(self, byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int,
             cache: dict[Any, Any] | None = None) -> BoundConstraint:
        from .automaton import bind_dfa

        dfa = self.dfa()
        if dfa is None:
            return Grammar(ebnf=self._nfa.ebnf()).bind(byte_vocab, eos_ids, width, cache)
        key = ("regex", self.pattern, self.max_states)
        return bind_dfa(dfa, key, byte_vocab, eos_ids, width, cache, self.describe())

    def describe(self) -> str:
        return f"Regex({self.pattern!r})"


class JSONSchema(_Grammarish):
    """The generated text must be one JSON value valid under ``schema`` (a dict or its JSON
    text), then EOS.

    ``max_whitespace``: ``0`` (the default) allows no free whitespace: the layout is fixed, with
    ``", "`` and ``": "`` between items (``json.dumps``'s), so a model cannot pad gaps with
    whitespace until ``max_tokens`` cuts it; ``n > 0`` allows up to ``n`` whitespace characters
    in a row wherever JSON allows whitespace; ``None`` any number. The schema is checked when the
    constraint is built (xgrammar's converter, no vocabulary needed)."""

    def __init__(self, schema: dict[str, Any] | str, *, max_whitespace: int | None = 0) -> None:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"JSONSchema: the schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise ConstraintError(f"JSONSchema needs a dict (or its JSON text), got {type(schema).__name__}")
        if max_whitespace is not None and (
            isinstance(max_whitespace, bool) or not isinstance(max_whitespace, int) or max_whitespace < 0
        ):
            raise ConstraintError(
                f"JSONSchema: max_whitespace must be an int >= 0 (0: no free whitespace) or None (any), "
                f"got {max_whitespace!r}"
            )
        self.schema = schema
        self.max_whitespace = max_whitespace
        try:
            import xgrammar as xgr
        except ImportError:  # pragma: no cover - xgrammar comes with vLLM; checked again at bind
            return
        try:
            xgr.Grammar.from_json_schema(json.dumps(schema), **self._options())
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with its C++ location
            why = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e).strip())
            raise ConstraintError(f"{self.describe()} does not compile: {why}") from None

    def _options(self) -> dict[str, Any]:
        if self.max_whitespace == 0:
            return {"any_whitespace": False}
        return {"max_whitespace_cnt": self.max_whitespace}

    def _compile(self, compiler: Any) -> Any:
        return compiler.compile_json_schema(json.dumps(self.schema), **self._options())

    def describe(self) -> str:
        text = json.dumps(self.schema)
        return f"JSONSchema({text if len(text) < 80 else text[:77] + '...'})"


class Grammar(_Grammarish):
    """A context-free grammar: ``ebnf`` (GBNF-style EBNF, root rule ``root``) or ``lark`` (Lark
    syntax, start rule ``start``); exactly one of the two. The text must derive from the root,
    then EOS."""

    def __init__(self, ebnf: str | None = None, *, lark: str | None = None) -> None:
        if (ebnf is None) == (lark is None):
            raise ConstraintError("Grammar takes exactly one of ebnf= or lark=")
        text = ebnf if ebnf is not None else lark
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError("Grammar: the grammar text is empty")
        self.ebnf, self.lark = ebnf, lark

    def _compile(self, compiler: Any) -> Any:
        if self.ebnf is not None:
            return compiler.compile_grammar(self.ebnf)
        return compiler.compile_lark(self.lark)

    def describe(self) -> str:
        text = (self.ebnf or self.lark or "").strip().splitlines()[0]
        return f"Grammar({'ebnf' if self.ebnf is not None else 'lark'}: {text[:60]!r}...)"


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
