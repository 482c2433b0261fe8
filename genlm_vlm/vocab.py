"""Byte vocabulary of a tokenizer.

A probabilistic program that constrains or scores text needs to know, for every
token id the model can emit, exactly which bytes that token contributes to the
text. :func:`get_byte_vocab` computes that table; :func:`get_str_vocab` is the
same table decoded to ``str``.

The bytes of a token are the bytes it stands for *in the middle of a text*:
positional decoding artefacts (the leading space that sentencepiece-style
decoders strip from the first token, ``clean_up_tokenization_spaces``, ...)
are not applied. Concatenating the byte vocabulary entries of
``tokenizer.encode(text, add_special_tokens=False)`` therefore gives back
``text.encode()``, except for whatever the tokenizer's normalizer changed:
sentencepiece-style tokenizers that prepend a space to the text (Metaspace
``prepend_scheme="always"``/``"first"``, sentencepiece ``add_dummy_prefix``)
give ``b" " + text.encode()``, because their ``▁`` stands for ``b" "``.

How the table is built (the kind names are what :func:`detect_vocab_kind`
returns):

``"byte_level"``
    GPT-2 / Llama-3 / Qwen style byte-level BPE. Tokens are strings over the
    GPT-2 byte-to-unicode alphabet (``Ġ`` is the space byte, ...); the table
    is inverted character by character (:func:`unicode_to_bytes`).
``"sentencepiece"``
    Llama-2 / Mistral / Gemma / T5 style. ``▁`` (or the configured
    replacement) stands for a space; with byte fallback, ``<0xNN>`` stands for
    the single byte ``0xNN``; everything else is the UTF-8 of the piece.
``"plain"``
    A fast tokenizer whose decoder only concatenates tokens: the UTF-8 of the
    token string.
``"bytes"``
    Tokenizers whose tokens are already ``bytes`` (mistral_common's Tekken,
    tiktoken-based custom tokenizers): used as they are.
``"decode"``
    Anything else: the bytes are read off ``tokenizer.decode`` of a known
    prefix token followed by the token, with the prefix's decoding removed.
    Exact for whole-character tokens; tokens holding part of a UTF-8
    character come out as U+FFFD, which is why the direct kinds are
    preferred whenever they can be detected.

Detection, in order:

0. A ``mistral_common`` tokenizer, bare or wrapped (transformers'
   ``MistralCommonBackend``, vLLM's ``MistralTokenizer``): Tekken gives each
   id's raw bytes (``id_to_byte_piece``, special tokens as their text); its
   sentencepiece tokenizer is read like a slow sentencepiece tokenizer.
1. A Hugging Face fast tokenizer (``backend_tokenizer``) or a raw
   ``tokenizers.Tokenizer``: its decoder pipeline is read (``ByteLevel``,
   ``Metaspace``, ``Replace`` with a string pattern, ``ByteFallback``,
   ``Fuse``, ``Strip``, nested ``Sequence``) and replayed on each token
   alone. A BPE/Unigram model with ``byte_fallback`` enables ``<0xNN>``
   handling even where the decoder lacks ``ByteFallback``.
2. A slow tokenizer: a ``byte_decoder`` attribute means byte-level; an
   ``sp_model`` attribute means sentencepiece (byte pieces are those the
   sentencepiece model itself marks as bytes); tokens that are ``bytes``
   mean ``"bytes"``.
3. The vocabulary itself: all 256 characters of the byte-to-unicode
   alphabet present as single-character tokens means byte-level; all 256
   ``<0xNN>`` tokens plus tokens containing ``▁`` means sentencepiece.
4. Otherwise ``"decode"``.

Added tokens (``tokenizer.added_tokens_decoder``) are then laid over the
table: special tokens always map to the UTF-8 of their literal text (``<s>``
gives ``b"<s>"``); other added tokens map to the UTF-8 of their text, unless
they merely mark a token of the model's own vocabulary as added (same id,
same string), in which case the model's meaning of that token is kept (for
example ``add_tokens(["é"])`` on a byte-level tokenizer whose vocabulary has
``é`` as the byte ``0xE9``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

__all__ = [
    "PaddedText",
    "Token",
    "VocabKind",
    "bytes_to_unicode",
    "detect_vocab_kind",
    "get_byte_vocab",
    "get_str_vocab",
    "token_class",
    "tokens_of",
    "unicode_to_bytes",
    "unpadded_length",
]

VocabKind = Literal["byte_level", "sentencepiece", "plain", "bytes", "decode"]

#: The sentencepiece word-boundary marker (U+2581), which stands for a space.
SPIECE_UNDERLINE = "\u2581"

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# A piece of a token while the decoder pipeline is replayed on it: a str until
# a step turns it into raw bytes (ByteLevel, or ByteFallback on "<0xNN>").
_Piece = str | bytes
_Step = Callable[[_Piece], _Piece]


# --------------------------------------------------------------------------------------
# GPT-2 byte-to-unicode table
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Tokenizer access helpers
# --------------------------------------------------------------------------------------


def _added_tokens(tokenizer: Any, backend: Any | None) -> dict[int, Any]:
    """Id to ``AddedToken`` (objects with ``.content`` and ``.special``)."""
    try:
        decoder = getattr(tokenizer, "added_tokens_decoder", None)
    except Exception:  # e.g. MistralCommonBackend raises NotImplementedError
        decoder = None
    if decoder is None and backend is not None:
        decoder = backend.get_added_tokens_decoder()
    return dict(decoder or {})


def _vocab_len(tokenizer: Any, backend: Any | None, added: dict[int, Any]) -> int:
    """Number of ids the tokenizer knows: ``len(tokenizer)``, covering every added id."""
    if backend is not None and backend is tokenizer:
        n = backend.get_vocab_size(with_added_tokens=True)
    else:
        n = len(tokenizer)
    if added:
        n = max(n, max(added) + 1)
    return n


def _token_strings(tokenizer: Any, backend: Any | None, n: int) -> list[Any]:
    """Token string (or bytes) of every id below ``n``; None where the id has no token."""
    if backend is not None:
        return [backend.id_to_token(i) for i in range(n)]
    try:
        tokens = list(tokenizer.convert_ids_to_tokens(list(range(n))))
        if len(tokens) == n:
            return tokens
    except Exception:
        pass
    out: list[Any] = []
    for i in range(n):
        try:
            out.append(tokenizer.convert_ids_to_tokens(i))
        except Exception:
            out.append(None)
    return out


def _in_model_vocab(tokenizer: Any, backend: Any | None, token_id: int, content: str) -> bool:
    """Whether ``token_id`` is a token of the model's own vocabulary spelled ``content``."""
    if backend is not None:
        return backend.model.id_to_token(token_id) == content
    vocab_size = getattr(tokenizer, "vocab_size", None)
    return isinstance(vocab_size, int) and token_id < vocab_size


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


@dataclass
class _Analysis:
    """A tokenizer's vocabulary strategy and what is needed to carry it out."""

    kind: VocabKind
    n: int
    base: Callable[[], list[bytes]]  # bytes of ids 0..n-1 before added tokens are laid over
    added: dict[int, Any]
    in_model_vocab: Callable[[int, str], bool]


def _analyze_mistral(tokenizer: Any, inner: Any) -> _Analysis:
    """Analysis of a ``mistral_common`` tokenizer (Tekken byte-level, or sentencepiece)."""
    n_words = int(inner.n_words)
    try:
        n = max(n_words, len(tokenizer))
    except Exception:
        n = n_words
    pad = [b""] * (n - n_words)

    if hasattr(inner, "id_to_byte_piece"):  # Tekkenizer: tiktoken ranks are raw bytes
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        def tekken_base() -> list[bytes]:
            keep = SpecialTokenPolicy.KEEP
            return [bytes(inner.id_to_byte_piece(i, keep)) for i in range(n_words)] + pad

        return _Analysis("bytes", n, tekken_base, {}, lambda i, c: True)

    sp_model = getattr(inner, "_model", None)
    if sp_model is not None and hasattr(sp_model, "IdToPiece"):
        convert = _sp_model_plan(sp_model).convert
        assert convert is not None

        def sp_base() -> list[bytes]:
            return [convert(sp_model.IdToPiece(i)) for i in range(n_words)] + pad

        return _Analysis("sentencepiece", n, sp_base, {}, lambda i, c: True)

    return _Analysis("decode", n, lambda: _decode_vocab(tokenizer, n), {}, lambda i, c: True)


def _analyze(tokenizer: Any) -> _Analysis:
    """Work out how to build ``tokenizer``'s byte vocabulary (see the module docstring)."""
    backend = _backend(tokenizer)
    if backend is None:
        inner = _mistral_inner(tokenizer)
        if inner is not None:
            return _analyze_mistral(tokenizer, inner)
    added = _added_tokens(tokenizer, backend)
    n = _vocab_len(tokenizer, backend, added)
    tokens = _token_strings(tokenizer, backend, n)
    plan = _make_plan(tokenizer, backend, tokens)

    def base() -> list[bytes]:
        if plan.convert is None:
            return _decode_vocab(tokenizer, n)
        convert = plan.convert
        return [b"" if tok is None else convert(tok) for tok in tokens]

    def in_model_vocab(token_id: int, content: str) -> bool:
        return _in_model_vocab(tokenizer, backend, token_id, content)

    return _Analysis(plan.kind, n, base, added, in_model_vocab)


def _decoder_fn(tokenizer: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` that keeps special tokens and does not clean up spaces."""
    try:
        tokenizer.decode([], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    except TypeError:  # e.g. a raw tokenizers.Tokenizer
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    except Exception:
        pass
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def _decode_prefix(tokenizer: Any) -> list[int]:
    """Ids of a short, ordinary text to decode in front of each token."""
    for text in ("a", "the", "x", "0"):
        try:
            ids = tokenizer.encode(text, add_special_tokens=False)
        except TypeError:
            ids = tokenizer.encode(text)
        except Exception:
            continue
        ids = list(getattr(ids, "ids", ids))
        if ids:
            return ids
    return []


def _decode_vocab(tokenizer: Any, n: int) -> list[bytes]:
    """Decode-based byte vocabulary: ``decode(prefix + [i])`` with the prefix's text removed."""
    decode = _decoder_fn(tokenizer)
    prefix = _decode_prefix(tokenizer)
    prefix_text = decode(prefix) if prefix else ""
    out: list[bytes] = []
    for i in range(n):
        try:
            text = decode([*prefix, i])
            if prefix_text and text.startswith(prefix_text):
                text = text[len(prefix_text) :]
            else:
                text = decode([i])
        except Exception:
            text = ""
        out.append(text.encode("utf-8"))
    return out


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def detect_vocab_kind(tokenizer: Any) -> VocabKind:
    """Return which strategy :func:`get_byte_vocab` uses for ``tokenizer``.

    One of ``"byte_level"``, ``"sentencepiece"``, ``"plain"``, ``"bytes"`` or
    ``"decode"``; see the module docstring for what each means and how it is detected.
    """
    return _analyze(tokenizer).kind


def get_byte_vocab(tokenizer: Any, pad_to: int | None = None) -> list[bytes]:
    """Return the bytes each token id stands for in the middle of a text.

    Args:
        tokenizer: A Hugging Face tokenizer (fast/``TokenizersBackend``; slow:
            sentencepiece-backed, byte-level with ``byte_decoder``, or any other with
            ``decode``; ``MistralCommonBackend``), a raw ``tokenizers.Tokenizer``, or a
            ``mistral_common`` tokenizer.
        pad_to: Length of the returned list. The model's logit width may exceed
            ``len(tokenizer)``; ids with no token get ``b""``. Must be at least
            the number of ids the tokenizer knows (``len(tokenizer)``, or more if
            an added token has a larger id). None means exactly that number.

    Returns:
        ``vocab`` with ``vocab[i]`` the bytes of token ``i``. Joining the entries of
        ``tokenizer.encode(text, add_special_tokens=False)`` gives ``text.encode()``
        (with a leading ``b" "`` where a sentencepiece-style tokenizer prepends one).
        Special and added tokens map to the UTF-8 of their text (``b"<s>"``).

    Raises:
        ValueError: If ``pad_to`` is smaller than the tokenizer's vocabulary.
    """
    analysis = _analyze(tokenizer)
    n = analysis.n
    if pad_to is not None and pad_to < n:
        raise ValueError(
            f"pad_to={pad_to} is smaller than the tokenizer's vocabulary ({n} ids); "
            "slice the result instead if the model really has fewer logits"
        )
    vocab = analysis.base()
    for token_id, token in analysis.added.items():
        content = str(getattr(token, "content", token))
        special = bool(getattr(token, "special", False))
        if special or not analysis.in_model_vocab(token_id, content):
            vocab[token_id] = content.encode("utf-8")
    if pad_to is not None:
        vocab.extend([b""] * (pad_to - n))
    return vocab


def get_str_vocab(tokenizer: Any, pad_to: int | None = None, errors: str = "replace") -> list[str]:
    """Return :func:`get_byte_vocab` decoded to ``str``.

    A byte-level or byte-fallback token can hold part of a multi-byte UTF-8
    character, which has no exact ``str`` form. ``errors`` is passed to
    ``bytes.decode``: the default ``"replace"`` turns such bytes into U+FFFD
    (readable, but lossy: use the byte vocabulary for exact work);
    ``"surrogateescape"`` is lossless (``s.encode("utf-8", "surrogateescape")``
    gives the bytes back); ``"strict"`` raises on such tokens.
    """
    return [b.decode("utf-8", errors=errors) for b in get_byte_vocab(tokenizer, pad_to)]


# --------------------------------------------------------------------------------------
# Vocabulary entries
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Padded logit columns
# --------------------------------------------------------------------------------------


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
