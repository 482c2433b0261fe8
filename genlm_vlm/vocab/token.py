"""The :class:`Token` type: one vocabulary entry, bytes tagged with its token id.

Also :func:`token_class`, which picks genlm-backend's own ``Token`` class while genlm-backend is
loaded (genlm-control and genlm-bytes check entries by type), and :func:`tokens_of`. Internal
module of :mod:`genlm_vlm.vocab`, where these names are public.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


class _TokenMeta(type):
    """Makes ``isinstance(x, Token)`` hold for every token-like object.

    Token-like: a ``bytes`` instance with an ``int`` ``token_id`` attribute, such as
    genlm-backend's ``genlm.backend.tokenization.Token``, which :attr:`AsyncLM.byte_vocab`
    hands out instead of :class:`Token` while genlm-backend is loaded (see :func:`token_class`).
    """

    def __instancecheck__(cls, obj: Any) -> bool:
        if type.__instancecheck__(cls, obj):
            return True
        return isinstance(obj, bytes) and type(getattr(obj, "token_id", None)) is int


class Token(bytes, metaclass=_TokenMeta):
    """One vocabulary entry: the bytes token ``token_id`` stands for, tagged with that id.

    A ``bytes`` subclass, so ``b"".join(tokens)``, ``len``, slicing and ``.decode()`` work on
    the bytes. Two token-like objects (this class or genlm-backend's ``Token``) are equal when
    their ids are, and a token hashes as its id: a vocabulary where two ids stand for the same
    bytes (byte fallback ``<0x0A>`` next to a merged ``"\\n"`` token in Llama-2 / Gemma style
    tokenizers) keeps them apart in sets, dict keys and tries. Compared with plain ``bytes`` a
    token compares its bytes (``Token(5, b"a") == b"a"``). Tokens order by id.

    Same attributes and semantics as genlm-backend's ``Token``, without depending on it.
    """

    token_id: int

    def __new__(cls, token_id: int, byte_string: bytes) -> Token:
        if type(token_id) is not int:
            if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
                raise TypeError(f"token_id must be an int, got {type(token_id).__name__}")
            token_id = token_id.__index__()
        if not isinstance(byte_string, bytes | bytearray | memoryview):
            raise TypeError(f"byte_string must be bytes, got {type(byte_string).__name__}")
        obj = super().__new__(cls, byte_string)
        obj.token_id = token_id
        return obj

    @property
    def byte_string(self) -> bytes:
        """The token's bytes as a plain ``bytes`` object."""
        return bytes(self)

    def __repr__(self) -> str:
        return f"Token({self.token_id}, {bytes(self)!r})"

    def __hash__(self) -> int:
        return hash(self.token_id)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id == other.token_id  # type: ignore[attr-defined]
        return NotImplemented  # plain bytes: bytes.__eq__ compares the bytes

    def __ne__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id != other.token_id  # type: ignore[attr-defined]
        return NotImplemented

    def __lt__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id < other.token_id  # type: ignore[attr-defined]
        return NotImplemented

    def __le__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id <= other.token_id  # type: ignore[attr-defined]
        return NotImplemented

    def __gt__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id > other.token_id  # type: ignore[attr-defined]
        return NotImplemented

    def __ge__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id >= other.token_id  # type: ignore[attr-defined]
        return NotImplemented

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.token_id, bytes(self)))


#: Where genlm-backend defines its ``Token`` class (looked up in ``sys.modules`` only).
_BACKEND_TOKEN_MODULES = ("genlm.backend.tokenization.token", "genlm.backend.tokenization")


def token_class() -> type:
    """The class :attr:`AsyncLM.byte_vocab` entries have *now*.

    genlm-control, genlm-bytes and genlm-backend's tries test entries with
    ``isinstance(x, genlm.backend.tokenization.Token)`` and ``type(x) is Token``. So while
    genlm-backend is loaded in this process (it is whenever genlm-control, genlm-bytes or
    llamppl is), entries are genlm-backend's own ``Token``; otherwise they are
    :class:`genlm_vlm.vocab.Token`, which behaves the same. genlm-backend is never imported
    here: this only looks at modules that are already loaded, so the choice follows the import
    order and needs no care from the caller.
    """
    for name in _BACKEND_TOKEN_MODULES:
        cls = getattr(sys.modules.get(name), "Token", None)
        if isinstance(cls, type) and issubclass(cls, bytes):
            return cls
    return Token


def tokens_of(byte_strings: Iterable[bytes], cls: type | None = None) -> list[Token]:
    """``[cls(i, b) for i, b in enumerate(byte_strings)]``; ``cls`` defaults to :func:`token_class`."""
    make = token_class() if cls is None else cls
    return [make(i, bytes(b)) for i, b in enumerate(byte_strings)]
