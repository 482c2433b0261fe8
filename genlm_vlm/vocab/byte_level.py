"""The GPT-2 byte-level alphabet: the 256 byte values as printable characters, and back.

Byte-level BPE tokenizers (GPT-2, Llama-3, Qwen) spell each token over this alphabet (``Ġ`` is the
space byte, ``Ċ`` the newline); :func:`unicode_to_bytes` inverts it. Internal module of
:mod:`genlm_vlm.vocab`.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """Return the GPT-2 byte-level alphabet: a bijection from the 256 byte values to characters.

    Printable bytes ``!``..``~``, ``¡``..``¬`` and ``®``..``ÿ`` map to the character
    with the same code point; the remaining 68 bytes (control characters, space,
    DEL, NBSP, soft hyphen, ...) map, in increasing byte order, to the characters
    ``U+0100``, ``U+0101``, ... So the space byte ``0x20`` is ``Ġ`` (``U+0120``)
    and the newline ``0x0A`` is ``Ċ`` (``U+010A``).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    keep = set(printable)
    table: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Return the inverse of :func:`bytes_to_unicode`: alphabet character to byte value."""
    return {c: b for b, c in bytes_to_unicode().items()}


def _translation(decoder: dict[str, int]) -> dict[int, str]:
    """A ``str.translate`` table turning byte-level characters into latin-1 characters.

    After translation, ``.encode("latin-1")`` yields the token's bytes. Characters
    below U+0100 that are not in the alphabet are sent to U+FFFF so that the
    encoding fails for them (as it does for any other character above U+00FF).
    """
    table = {ord(c): chr(b) for c, b in decoder.items()}
    for code in range(256):
        table.setdefault(code, "\uffff")
    return table


@lru_cache(maxsize=1)
def _gpt2_translation() -> dict[int, str]:
    return _translation(unicode_to_bytes())


def _byte_level_to_bytes(token: str, table: dict[int, str] | None = None) -> bytes:
    """Map a byte-level token string to its bytes.

    ``table`` is a :func:`_translation` table (default: the GPT-2 alphabet). Like the
    ``tokenizers`` ByteLevel decoder, a token containing a character outside the
    alphabet is taken to be literal text (its UTF-8).
    """
    try:
        return token.translate(_gpt2_translation() if table is None else table).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")
