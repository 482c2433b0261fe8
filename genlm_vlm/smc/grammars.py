"""The grammar constraints on xgrammar (a dependency of vLLM): :class:`JSONSchema` and
:class:`Grammar`, compiled once per vocabulary; a particle's state is a ``GrammarMatcher``
(``fork()`` copies it) and a step's bitmasks are filled at once (``BatchGrammarMatcher``)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .constraint_base import (
    BoundConstraint,
    Constraint,
    ConstraintError,
    _pack,
    usable_tokens,
    usable_width,
)

if TYPE_CHECKING:
    import torch


def _tokenizer_info(byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int) -> Any:
    import xgrammar as xgr

    if not eos_ids:
        raise ConstraintError("the model has no EOS token id: give eos_token_ids= to smc()")
    return xgr.TokenizerInfo(
        [bytes(b) for b in byte_vocab[:width]], xgr.VocabType.RAW, vocab_size=width,
        stop_token_ids=[int(e) for e in eos_ids if 0 <= int(e) < width]
    )


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
