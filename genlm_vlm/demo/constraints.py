"""The demo's token constraints: which tokens may follow the text generated so far.

A constraint turns the text a particle has generated into a boolean mask over the vocabulary
(EOS included when the text may end there): :class:`CharSetConstraint` (a character set),
:class:`RegexConstraint` (a regular expression, prefix-matched) and :class:`AllOf` (their
intersection). Internal module of :mod:`genlm_vlm.demo`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch is imported where used: `demo --help` stays light
    import torch


class Constraint(Protocol):
    """Which tokens may follow the text generated so far."""

    def mask(self, generated: bytes) -> torch.Tensor:
        """Bool tensor ``[V]``: True where the token may come next (EOS included when allowed)."""
        ...

    def describe(self) -> str:
        """One line for the demo's header."""
        ...


def _usable_tokens(byte_vocab: Sequence[bytes], special_ids: Sequence[int]) -> list[int]:
    """Token ids with text: not special, not empty (padding columns past the tokenizer)."""
    special = set(special_ids)
    return [i for i, b in enumerate(byte_vocab) if b and i not in special]


class CharSetConstraint:
    """Generated text may only use characters from ``allowed``; EOS is always allowed.

    A token is allowed when its bytes decode (as UTF-8) to characters of ``allowed`` only;
    special tokens other than EOS never are. The mask does not depend on the particle.
    """

    def __init__(
        self,
        allowed: str,
        byte_vocab: Sequence[bytes],
        eos_id: int,
        special_ids: Sequence[int] = (),
    ) -> None:
        if not allowed:
            raise ValueError(
                "the allowed character set is empty: give the characters generated text may use, "
                "e.g. 'abc '"
            )
        import torch

        self.allowed = allowed
        chars = set(allowed)
        mask = torch.zeros(len(byte_vocab), dtype=torch.bool)
        for i in _usable_tokens(byte_vocab, special_ids):
            try:
                text = byte_vocab[i].decode("utf-8")
            except UnicodeDecodeError:
                continue
            if chars.issuperset(text):
                mask[i] = True
        mask[eos_id] = True
        self._mask = mask
        self.n_allowed = int(mask.sum()) - 1

    def mask(self, generated: bytes) -> torch.Tensor:
        return self._mask

    def describe(self) -> str:
        return f"characters in {self.allowed!r} ({self.n_allowed} tokens) or EOS"


def compile_regex(pattern: str) -> Any:
    """``regex.compile(pattern)``; an invalid pattern raises ``ValueError`` saying what is wrong."""
    try:
        import regex
    except ImportError as e:  # pragma: no cover - a dependency of transformers
        raise ImportError("regular expressions need the `regex` package (pip install regex)") from e
    try:
        return regex.compile(pattern)
    except regex.error as e:
        raise ValueError(
            f"{pattern!r} is not a valid regular expression ({e}); escape characters meant "
            "literally with a backslash, e.g. \\[ for '['"
        ) from None


class RegexConstraint:
    """Generated text must be a prefix of a string matching ``pattern`` (whole-string match).

    Uses the ``regex`` package's partial matching: a token is allowed when the text with the
    token appended can still be extended to a full match; EOS is allowed when the text already
    matches. Tokens whose bytes are not valid UTF-8 on their own are never allowed.
    """

    def __init__(
        self,
        pattern: str,
        byte_vocab: Sequence[bytes],
        eos_id: int,
        special_ids: Sequence[int] = (),
    ) -> None:
        self.pattern = pattern
        self._re = compile_regex(pattern)
        self._eos = eos_id
        self._size = len(byte_vocab)
        self._tokens: list[tuple[int, str]] = []
        for i in _usable_tokens(byte_vocab, special_ids):
            try:
                self._tokens.append((i, byte_vocab[i].decode("utf-8")))
            except UnicodeDecodeError:
                continue
        self._cache: dict[bytes, torch.Tensor] = {}

    def mask(self, generated: bytes) -> torch.Tensor:
        cached = self._cache.get(generated)
        if cached is not None:
            return cached
        import torch

        text = generated.decode("utf-8", errors="replace")
        mask = torch.zeros(self._size, dtype=torch.bool)
        fullmatch = self._re.fullmatch
        for i, piece in self._tokens:
            if fullmatch(text + piece, partial=True) is not None:
                mask[i] = True
        if fullmatch(text) is not None:
            mask[self._eos] = True
        self._cache[generated] = mask
        return mask

    def describe(self) -> str:
        return f"text matching /{self.pattern}/ (prefix-closed) and EOS once it fully matches"


class AllOf:
    """Intersection of several constraints."""

    def __init__(self, parts: Sequence[Constraint]) -> None:
        self.parts = list(parts)

    def mask(self, generated: bytes) -> torch.Tensor:
        out = self.parts[0].mask(generated)
        for part in self.parts[1:]:
            out = out & part.mask(generated)
        return out

    def describe(self) -> str:
        return " and ".join(p.describe() for p in self.parts)
