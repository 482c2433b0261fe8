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

Module map (all internal; import the names from :mod:`genlm_vlm.vocab`):
:mod:`.table` builds the table, :mod:`.families` reads each tokenizer family,
:mod:`.byte_level` holds the GPT-2 alphabet, :mod:`.token` the :class:`Token` type and
:mod:`.padding` the padded logit columns.
"""

from __future__ import annotations

# (_byte_level_to_bytes, _decode_vocab: internal helpers the tests import from here.)
from .byte_level import _byte_level_to_bytes as _byte_level_to_bytes
from .byte_level import bytes_to_unicode, unicode_to_bytes
from .families import SPIECE_UNDERLINE as SPIECE_UNDERLINE
from .families import VocabKind
from .padding import PaddedText, unpadded_length
from .table import _decode_vocab as _decode_vocab
from .table import detect_vocab_kind, get_byte_vocab, get_str_vocab, special_token_ids
from .token import Token, token_class, tokens_of

__all__ = [
    "PaddedText",
    "Token",
    "VocabKind",
    "bytes_to_unicode",
    "detect_vocab_kind",
    "get_byte_vocab",
    "get_str_vocab",
    "special_token_ids",
    "token_class",
    "tokens_of",
    "unicode_to_bytes",
    "unpadded_length",
]

# Pickles name the classes' public home, so they do not depend on the module layout above.
Token.__module__ = PaddedText.__module__ = __name__
