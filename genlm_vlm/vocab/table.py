"""Building a tokenizer's byte vocabulary: the table of what each token id stands for.

:func:`get_byte_vocab` and :func:`get_str_vocab` (see :mod:`genlm_vlm.vocab` for the semantics):
the tokenizer is analysed once (its family, from :mod:`.families`; its size and added tokens),
the model's own tokens are converted, and the added tokens are laid over them. Tokenizers with
no per-token reading are decoded token by token after a known prefix (:func:`_decode_vocab`).
Internal module of :mod:`genlm_vlm.vocab`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .families import VocabKind, _backend, _make_plan, _mistral_inner, _sp_model_plan

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


def special_token_ids(tokenizer: Any) -> list[int]:
    """Return the ids of ``tokenizer``'s special and added tokens, ascending: those that stand
    for no text of their own.

    These are the ids :func:`get_byte_vocab` writes as their literal text: every special token
    (``<s>``, ``<|end_of_text|>``, padding, chat markers) and every added token that is not just
    a token of the model's own vocabulary marked as added (same id, same string: that one keeps
    the model's meaning and is not listed), plus the tokenizer's ``all_special_ids``. For a
    ``mistral_common`` tokenizer: its control tokens (``special_ids``) and sentencepiece's
    ``<unk>``. A constrained text never
    contains them (:meth:`genlm_vlm.AsyncLM.smc` ends a text only with the EOS ids it is given).
    """
    ids: set[int] = set()
    backend = _backend(tokenizer)
    inner = _mistral_inner(tokenizer) if backend is None else None
    if inner is not None:
        special = getattr(inner, "special_ids", None)
        if special is None:
            special = range(int(getattr(inner, "num_special_tokens", 0) or 0))
        ids.update(int(i) for i in special)
        unk = getattr(getattr(inner, "_model", None), "unk_id", None)  # sentencepiece's <unk>: not a control token
        if callable(unk) and int(unk()) >= 0:
            ids.add(int(unk()))
    else:
        for token_id, token in _added_tokens(tokenizer, backend).items():
            content = str(getattr(token, "content", token))
            if bool(getattr(token, "special", False)) or not _in_model_vocab(tokenizer, backend, token_id, content):
                ids.add(int(token_id))
    try:
        listed = getattr(tokenizer, "all_special_ids", None)
    except Exception:  # noqa: BLE001 - e.g. a wrapper that does not implement it
        listed = None
    ids.update(int(i) for i in listed or () if isinstance(i, int) and i >= 0)
    return sorted(ids)


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
