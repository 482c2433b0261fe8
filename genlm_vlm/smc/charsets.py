"""Code point sets as Python's ``re`` reads them: sorted, disjoint ranges.

Simple sets (literals, ranges, ``[^...]``) are computed from their ranges; sets that depend on
Unicode tables or case folding (``\\w``, ``\\s``, ``\\d``, ``(?i)``) are read off ``re`` itself,
run once over every code point (cached per set). Surrogates have no UTF-8 encoding and are never
in a set.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

try:  # Python 3.11+: the parser ``re`` itself uses
    from re import _constants as _C
except ImportError:  # pragma: no cover - 3.10 and older (not supported, kept for a clear error)
    import sre_constants as _C  # type: ignore[no-redef]

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent code point ranges, inclusive

_MAX = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
_I, _A = int(re.IGNORECASE), int(re.ASCII)  # ints: RegexFlag operators are slow


class CharsetError(ValueError):
    """A character class this module cannot read."""


# ------------------------------------------------------------------------------ code point sets
def normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sorted, merged ranges with the surrogates (no UTF-8 encoding) removed."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if lo > hi:
            continue
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    cut: list[tuple[int, int]] = []
    s0, s1 = _SURROGATES
    for lo, hi in out:
        if hi < s0 or lo > s1:
            cut.append((lo, hi))
            continue
        if lo < s0:
            cut.append((lo, s0 - 1))
        if hi > s1:
            cut.append((s1 + 1, hi))
    return tuple(cut)


def complement(ranges: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX:
        out.append((nxt, _MAX))
    return normalize(out)


ALL = normalize([(0, _MAX)])
_text_lock = threading.Lock()
_all_text: str | None = None
_scanned: dict[tuple[str, int], Ranges] = {}


def _every_code_point() -> str:
    global _all_text
    with _text_lock:
        if _all_text is None:
            _all_text = "".join(map(chr, range(_SURROGATES[0]))) + "".join(map(chr, range(_SURROGATES[1] + 1, _MAX + 1)))
        return _all_text


def scan(char_class: str, flags: int) -> Ranges:
    """The code points Python's ``re`` matches with the one-character pattern ``char_class``
    under ``flags`` (read off ``re`` run over every code point; cached)."""
    key = (char_class, flags)
    hit = _scanned.get(key)
    if hit is None:
        text = _every_code_point()
        runs = [(ord(text[m.start()]), ord(text[m.end() - 1]))
                for m in re.finditer(f"(?:{char_class})+", text, flags)]
        hit = _scanned[key] = normalize(runs)  # a run across the surrogate gap is cut there
    return hit


def _esc(c: int) -> str:
    return f"\\U{c:08x}"


_CATEGORY_TEXT = {
    _C.CATEGORY_DIGIT: r"\d", _C.CATEGORY_NOT_DIGIT: r"\D", _C.CATEGORY_SPACE: r"\s",
    _C.CATEGORY_NOT_SPACE: r"\S", _C.CATEGORY_WORD: r"\w", _C.CATEGORY_NOT_WORD: r"\W",
}


def class_set(items: Sequence[tuple[Any, Any]], flags: int) -> Ranges:
    """The code points of a parsed character class ``[...]`` under ``flags``."""
    negate = bool(items) and items[0][0] is _C.NEGATE
    body = items[1:] if negate else items
    parts: list[str] = []
    direct: list[tuple[int, int]] = []
    for op, av in body:
        if op is _C.LITERAL:
            parts.append(_esc(av))
            direct.append((av, av))
        elif op is _C.RANGE:
            parts.append(f"{_esc(av[0])}-{_esc(av[1])}")
            direct.append(av)
        elif op is _C.CATEGORY:
            if av not in _CATEGORY_TEXT:
                raise CharsetError(f"unsupported character category {av}")
            parts.append(_CATEGORY_TEXT[av])
        else:
            raise CharsetError(f"unsupported item {op} in a character class")
    if flags & _I or len(direct) != len(body):  # Unicode tables or case folding: ask re itself
        return scan("[" + ("^" if negate else "") + "".join(parts) + "]", flags & (_I | _A))
    got = normalize(direct)
    return complement(got) if negate else got


def literal_set(c: int, flags: int, negate: bool) -> Ranges:
    if flags & _I:
        return scan(("[^" if negate else "[") + _esc(c) + "]", flags & (_I | _A))
    got = normalize([(c, c)])
    return complement(got) if negate else got
