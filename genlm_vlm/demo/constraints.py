"""The demo's constraints, as :mod:`genlm_vlm.smc` constraints like any other.

``--allowed-chars`` is a :class:`CharSetConstraint`: a mask over the vocabulary that does not
depend on the text (served to SMC as a :class:`~genlm_vlm.smc.TokenMask`); ``--regex`` is a
:class:`~genlm_vlm.smc.Regex`; both together an :class:`~genlm_vlm.smc.AllOf`.
:func:`compile_regex` checks a pattern's syntax before torch or vLLM is imported. Internal module
of :mod:`genlm_vlm.demo`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where used: `demo --help` stays light
    import torch


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


def demo_constraint(
    allowed_chars: str | None, regex: str | None, byte_vocab: Sequence[bytes], eos_id: int, special_ids: Sequence[int]
) -> tuple[Any, str]:
    """The :mod:`genlm_vlm.smc` constraint for ``--allowed-chars`` and/or ``--regex``, and one
    line describing it."""
    import numpy as np

    from ..smc import AllOf, Regex, TokenMask

    parts: list[Any] = []
    words: list[str] = []
    if allowed_chars is not None:
        cs = CharSetConstraint(allowed_chars, byte_vocab, eos_id, special_ids)
        static = cs.mask(b"").numpy()

        def same_for_all(generated: Sequence[tuple[int, ...]]) -> Any:
            return np.broadcast_to(static, (len(generated), static.size))

        parts.append(TokenMask(same_for_all, name=f"allowed characters {allowed_chars!r}"))
        words.append(cs.describe())
    if regex is not None:
        parts.append(Regex(regex))
        words.append(f"text matching /{regex}/, then EOS")
    return (parts[0] if len(parts) == 1 else AllOf(*parts)), " and ".join(words)
