"""Padded logit columns: ids of the logit matrix that no token stands for (Qwen2.5: 151936
logits, 151665 tokens). :func:`unpadded_length` finds where the padding starts, and
:class:`PaddedText` is the ``str_vocab`` entry of such an id. Internal module of
:mod:`genlm_vlm.vocab`, where these names are public.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def unpadded_length(entries: Sequence[Any], tokenizer: Any) -> int:
    """Length of ``entries`` (a model's byte or str vocabulary, one entry per logit) without its
    padding: the trailing empty entries past ``len(tokenizer)``, ids of the logit matrix that no
    token stands for (Qwen2.5: 151936 logits, 151665 tokens). ``len(entries)`` when there are
    none, or when the tokenizer has no ``len``."""
    n = len(entries)
    try:
        known = len(tokenizer)
    except TypeError:
        return n
    while n > known and not entries[n - 1]:
        n -= 1
    return n


class PaddedText(str):
    """The ``str_vocab`` entry of a padded logit column: the empty string, saying so when indexed.

    Equal to ``""`` in every way (length 0, hash, comparisons, slicing, ``str(x)``, JSON), except
    that ``text[i]``, which raises ``IndexError`` on any empty string, raises one whose message
    names the padded ids and the fix. llamppl 0.2.3 reads ``v[0]`` of every ``str_vocab`` entry
    (``llamppl.CachedCausalLM(lm)``), so its users are told to pass
    ``genlm_vlm.without_padding(lm)`` instead of getting a bare ``string index out of range``.
    """

    first: int
    width: int

    def __new__(cls, first: int, width: int) -> PaddedText:
        obj = super().__new__(cls, "")
        obj.first, obj.width = int(first), int(width)
        return obj

    def __getitem__(self, key: Any) -> str:
        if isinstance(key, slice):
            return ""
        raise IndexError(
            f"string index out of range: this is the empty str_vocab entry of a padded logit column "
            f"(ids {self.first}..{self.width - 1} of the model's {self.width} logits stand for no "
            "token). Code that reads the first character of every token, such as llamppl's "
            "CachedCausalLM, needs a vocabulary without them: pass genlm_vlm.without_padding(lm) "
            "(the model without those columns, rows renormalised) instead of the model"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.first, self.width))
