"""Tokenizer families: how each kind of tokenizer spells a token, read from its configuration.

A *plan* (:class:`_Plan`) says which family a tokenizer belongs to (the :data:`VocabKind` names
of :mod:`genlm_vlm.vocab`) and how one token string of its own vocabulary turns into bytes:

* fast tokenizers: the ``tokenizers`` decoder pipeline (``ByteLevel``, ``Metaspace``,
  ``Replace``, ``ByteFallback``, ``Fuse``, ``Strip``, nested ``Sequence``) replayed on each token
  alone (:func:`_plan_from_backend`);
* slow tokenizers: ``byte_decoder`` (byte-level), ``sp_model`` (sentencepiece) or ``bytes``
  tokens (:func:`_plan_from_slow`);
* otherwise a guess from the token strings alone (:func:`_plan_from_vocab`);
* ``mistral_common`` tokenizers, bare or wrapped, are found by :func:`_mistral_inner`.

Internal module of :mod:`genlm_vlm.vocab` (the order of detection is in its docstring).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .byte_level import _byte_level_to_bytes, _translation, bytes_to_unicode

VocabKind = Literal["byte_level", "sentencepiece", "plain", "bytes", "decode"]

#: The sentencepiece word-boundary marker (U+2581), which stands for a space.
SPIECE_UNDERLINE = "\u2581"

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# A piece of a token while the decoder pipeline is replayed on it: a str until
# a step turns it into raw bytes (ByteLevel, or ByteFallback on "<0xNN>").
_Piece = str | bytes
_Step = Callable[[_Piece], _Piece]


# --------------------------------------------------------------------------------------
# Per-token decoder steps
# --------------------------------------------------------------------------------------


def _byte_level_step(piece: _Piece) -> _Piece:
    """ByteLevel decoder on one token."""
    if isinstance(piece, bytes):
        return piece
    return _byte_level_to_bytes(piece)


def _byte_fallback_step(piece: _Piece) -> _Piece:
    """ByteFallback decoder on one token: ``<0xNN>`` becomes the byte ``0xNN``."""
    if isinstance(piece, str) and len(piece) == 6:
        m = _BYTE_PIECE.fullmatch(piece)
        if m is not None:
            return bytes([int(m.group(1), 16)])
    return piece


def _replace_step(pattern: str, content: str) -> _Step:
    """Replace decoder (string pattern) on one token."""
    pattern_b, content_b = pattern.encode("utf-8"), content.encode("utf-8")

    def step(piece: _Piece) -> _Piece:
        if isinstance(piece, str):
            return piece.replace(pattern, content)
        return piece.replace(pattern_b, content_b)

    return step


def _strip_step(content: str, start: int, stop: int) -> _Step:
    """Strip decoder applied to each token (only used where no Fuse precedes it)."""

    def strip(seq: Any, unit: Any) -> Any:
        lo = 0
        while lo < min(start, len(seq)) and seq[lo : lo + 1] == unit:
            lo += 1
        hi = len(seq)
        while hi > lo and len(seq) - hi < stop and seq[hi - 1 : hi] == unit:
            hi -= 1
        return seq[lo:hi]

    content_b = content.encode("utf-8")

    def step(piece: _Piece) -> _Piece:
        if isinstance(piece, str):
            return strip(piece, content)
        return strip(piece, content_b) if len(content_b) == 1 else piece

    return step


@dataclass
class _DecoderInfo:
    """What was learned from a ``tokenizers`` decoder configuration."""

    steps: list[_Step]
    byte_level: bool = False
    sentencepiece: bool = False
    byte_fallback: bool = False
    fused: bool = False


def _read_decoder(cfg: dict[str, Any], info: _DecoderInfo) -> bool:
    """Append the per-token steps for decoder config ``cfg`` to ``info``.

    Returns False when the decoder (or one of its parts) has no exact per-token
    reading (WordPiece, BPEDecoder, CTC, regex Replace, ...).
    """
    kind = cfg.get("type")
    if kind == "Sequence":
        return all(_read_decoder(sub, info) for sub in cfg.get("decoders", []))
    if kind == "ByteLevel":
        info.steps.append(_byte_level_step)
        info.byte_level = True
        return True
    if kind == "ByteFallback":
        info.steps.append(_byte_fallback_step)
        info.byte_fallback = True
        info.sentencepiece = True
        return True
    if kind == "Metaspace":
        # Mid-text reading: the replacement always stands for a space (the decoder
        # strips it only from the very first token of a sequence).
        replacement = cfg.get("replacement", SPIECE_UNDERLINE)
        info.steps.append(_replace_step(replacement, " "))
        info.sentencepiece = True
        return True
    if kind == "Replace":
        pattern = cfg.get("pattern", {})
        if not isinstance(pattern, dict) or "String" not in pattern:
            return False
        info.steps.append(_replace_step(pattern["String"], cfg.get("content", "")))
        if pattern["String"] == SPIECE_UNDERLINE:
            info.sentencepiece = True
        return True
    if kind == "Fuse":
        info.fused = True
        return True
    if kind == "Strip":
        # After Fuse, Strip acts on the whole text (e.g. Llama-2 dropping the
        # prepended space): positional, so not part of a token's bytes.
        if not info.fused:
            info.steps.append(
                _strip_step(cfg.get("content", " "), cfg.get("start", 0), cfg.get("stop", 0))
            )
        return True
    return False


def _compose(steps: Sequence[_Step]) -> Callable[[str], bytes]:
    """Compose per-token steps into a token-string to bytes function."""
    if list(steps) == [_byte_level_step]:
        return _byte_level_to_bytes

    def convert(token: str) -> bytes:
        piece: _Piece = token
        for step in steps:
            piece = step(piece)
        return piece if isinstance(piece, bytes) else piece.encode("utf-8")

    return convert


# --------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """How to turn a tokenizer's vocabulary into bytes.

    ``convert`` maps a token of the model's own vocabulary (as returned by
    ``convert_ids_to_tokens``) to its bytes; it is None for the decode strategy.
    """

    kind: VocabKind
    convert: Callable[[Any], bytes] | None


def _backend(tokenizer: Any) -> Any | None:
    """Return the ``tokenizers.Tokenizer`` behind ``tokenizer``, or None for slow tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers ships with transformers
        return None
    return tokenizer if isinstance(tokenizer, Tokenizer) else None


def _model_byte_fallback(backend: Any) -> bool:
    """Whether the backend's model (BPE or Unigram) has ``byte_fallback`` on."""
    model = backend.model
    flag = getattr(model, "byte_fallback", None)
    if flag is not None:
        return bool(flag)
    try:  # Unigram does not expose the flag as an attribute.
        return bool(json.loads(model.__getstate__()).get("byte_fallback", False))
    except Exception:
        return False


def _plan_from_backend(backend: Any) -> _Plan | None:
    """Read a fast tokenizer's decoder pipeline; None if it has no per-token reading."""
    decoder = backend.decoder
    if decoder is None:
        return None
    try:
        cfg = json.loads(decoder.__getstate__())
    except Exception:
        cfg = json.loads(backend.to_str()).get("decoder")
    if not isinstance(cfg, dict):
        return None
    info = _DecoderInfo(steps=[])
    if not _read_decoder(cfg, info):
        return None
    if info.byte_level:
        return _Plan("byte_level", _compose(info.steps))
    if not info.byte_fallback and _model_byte_fallback(backend):
        info.steps.insert(0, _byte_fallback_step)
        info.sentencepiece = True
    return _Plan("sentencepiece" if info.sentencepiece else "plain", _compose(info.steps))


def _sp_model_plan(sp_model: Any) -> _Plan:
    """Plan for a slow tokenizer wrapping a ``sentencepiece.SentencePieceProcessor``."""

    def is_byte_piece(piece: str) -> bool:
        if _BYTE_PIECE.fullmatch(piece) is None:
            return False
        try:
            sp_id = sp_model.piece_to_id(piece)
            return bool(sp_model.IsByte(sp_id)) and sp_model.IdToPiece(sp_id) == piece
        except Exception:
            return False

    def convert(token: Any) -> bytes:
        if isinstance(token, bytes):
            return token
        if is_byte_piece(token):
            return bytes([int(token[3:5], 16)])
        return token.replace(SPIECE_UNDERLINE, " ").encode("utf-8")

    return _Plan("sentencepiece", convert)


def _plan_from_slow(tokenizer: Any, tokens: Sequence[Any]) -> _Plan | None:
    """Plan for a slow (pure Python) tokenizer from its attributes; None if unknown."""
    byte_decoder = getattr(tokenizer, "byte_decoder", None)
    if isinstance(byte_decoder, dict) and len(byte_decoder) >= 256:
        table = _translation(byte_decoder)

        def convert_bl(token: Any) -> bytes:
            if isinstance(token, bytes):
                return token
            return _byte_level_to_bytes(token, table)

        return _Plan("byte_level", convert_bl)
    sp_model = getattr(tokenizer, "sp_model", None)
    if sp_model is not None and hasattr(sp_model, "IdToPiece"):
        return _sp_model_plan(sp_model)
    if any(isinstance(t, bytes) for t in tokens):
        return _Plan("bytes", _plain_or_bytes)
    return None


def _plain_or_bytes(token: Any) -> bytes:
    """A token that is already bytes, or the UTF-8 of a str token."""
    return token if isinstance(token, bytes) else str(token).encode("utf-8")


def _plan_from_vocab(tokens: Sequence[Any]) -> _Plan | None:
    """Guess the kind from the token strings alone; None if nothing is conclusive."""
    strs = {t for t in tokens if isinstance(t, str)}
    if not strs:
        return None
    if all(c in strs for c in bytes_to_unicode().values()):
        return _Plan("byte_level", lambda t: _byte_level_to_bytes(t) if isinstance(t, str) else t)
    if all(f"<0x{b:02X}>" in strs for b in range(256)) and any(SPIECE_UNDERLINE in t for t in strs):

        def convert_sp(token: Any) -> bytes:
            if isinstance(token, bytes):
                return token
            piece = _byte_fallback_step(token)
            if isinstance(piece, bytes):
                return piece
            return piece.replace(SPIECE_UNDERLINE, " ").encode("utf-8")

        return _Plan("sentencepiece", convert_sp)
    return None


def _make_plan(tokenizer: Any, backend: Any | None, tokens: Sequence[Any]) -> _Plan:
    """Choose the strategy for ``tokenizer`` (see the module docstring)."""
    plan = (
        _plan_from_backend(backend) if backend is not None else _plan_from_slow(tokenizer, tokens)
    )
    if plan is None:
        plan = _plan_from_vocab(tokens)
    return plan if plan is not None else _Plan("decode", None)


# Where a mistral_common tokenizer sits inside the objects that wrap it: transformers'
# MistralCommonBackend (.tokenizer.instruct_tokenizer.tokenizer), vLLM's MistralTokenizer
# (.tokenizer / .instruct.tokenizer), mistral_common's MistralTokenizer, or itself.
_MISTRAL_PATHS: tuple[tuple[str, ...], ...] = (
    (),
    ("tokenizer",),
    ("instruct", "tokenizer"),
    ("instruct_tokenizer", "tokenizer"),
    ("tokenizer", "instruct_tokenizer", "tokenizer"),
    ("mistral", "instruct_tokenizer", "tokenizer"),
)


def _mistral_inner(tokenizer: Any) -> Any | None:
    """The ``mistral_common`` Tekkenizer / SentencePieceTokenizer behind ``tokenizer``, if any."""
    for path in _MISTRAL_PATHS:
        obj = tokenizer
        for name in path:
            try:
                obj = getattr(obj, name)
            except Exception:
                obj = None
                break
        if (
            obj is not None
            and type(obj).__module__.startswith("mistral_common.")
            and hasattr(obj, "n_words")
        ):
            return obj
    return None
