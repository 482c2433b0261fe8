"""Tests for genlm_vlm.vocab: byte vocabularies of locally built tokenizers (no downloads)."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import Any

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from genlm_vlm.vocab import (  # noqa: E402
    _byte_level_to_bytes,
    _decode_vocab,
    bytes_to_unicode,
    detect_vocab_kind,
    get_byte_vocab,
    get_str_vocab,
    special_token_ids,
    unicode_to_bytes,
    unpadded_length,
)

SPIECE = "\u2581"

# Text that the training corpus covers, plus accents it does not (byte-level BPE learns
# every byte anyway; the sentencepiece-style models fall back to <0xNN> for them).
EXTRA_CORPUS = "café naïve façade über straße déjà vu\n" * 20

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x + 1\n",
    "  two leading spaces and trailing  ",
    " one leading space",
    "café naïve façade",
    "Zürich, señor, Ærø, ĳ",
    "日本語のテキストと中文",
    "emoji 😀🎉👩‍👩‍👧 mixed",
    "tabs\tand\r\nwindows newlines\n\n\n",
    "Ω≈ç√∫ symbols ∀x∈ℝ",
    "\u00a0non-breaking\u00adsoft hyphen",
    "",
]


def _corpus() -> list[str]:
    """A few standard-library modules as training text."""
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in ("textwrap.py", "string.py", "shlex.py", "glob.py"):
        path = os.path.join(stdlib, name)
        if os.path.exists(path):
            texts.append(Path(path).read_text(encoding="utf-8"))
    assert texts, "no stdlib sources found for the training corpus"
    return [*texts, EXTRA_CORPUS]


def _join(vocab: list[bytes], ids: list[int]) -> bytes:
    return b"".join(vocab[i] for i in ids)


def _sp_expected(text: str) -> bytes:
    """Bytes a space-prepending sentencepiece-style tokenization stands for."""
    if not text or text.startswith(" "):
        return text.encode()
    return b" " + text.encode()


# --------------------------------------------------------------------------------------
# Tokenizer builders
# --------------------------------------------------------------------------------------


def _train_byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def _byte_pieces() -> list[str]:
    return [f"<0x{b:02X}>" for b in range(256)]


def _train_llama_style(prepend_scheme: str) -> Tokenizer:
    """A Llama-2 style tokenizer: BPE with byte fallback over Metaspace pieces.

    The vocabulary starts like Llama-2's: ``<unk>``, ``<s>``, ``</s>``, then the 256
    ``<0xNN>`` byte pieces, then the learned pieces. The byte pieces are part of the
    model vocabulary (not added tokens), as in real Llama-2 ``tokenizer.json`` files.
    """
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE, prepend_scheme=prepend_scheme
    )
    # Leave the accented letters out of the alphabet so that they use byte fallback.
    trainer = trainers.BpeTrainer(vocab_size=700, limit_alphabet=90, show_progress=False)
    trained.train_from_iterator(_corpus(), trainer)
    state = json.loads(trained.model.__getstate__())

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *_byte_pieces()])}
    for piece, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]

    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE, prepend_scheme=prepend_scheme)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(SPIECE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


@pytest.fixture(scope="module")
def byte_level_tok() -> PreTrainedTokenizerFast:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=_train_byte_level(), eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return hf


@pytest.fixture(scope="module", params=["first", "always"])
def llama_style_tok(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_llama_style(request.param),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a tiny real sentencepiece model as ``tokenizer.model``."""
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("spm")
    corpus_file = d / "corpus.txt"
    corpus_file.write_text("".join(_corpus()), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus_file),
        model_prefix=str(d / "tokenizer"),
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        minloglevel=2,
    )
    return d


# --------------------------------------------------------------------------------------
# Byte-to-unicode table
# --------------------------------------------------------------------------------------


def test_bytes_to_unicode_table() -> None:
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ"
    assert table[ord("\n")] == "Ċ"
    assert table[ord("A")] == "A"
    assert table[0xE9] == "é"
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    inverse = unicode_to_bytes()
    assert all(inverse[c] == b for b, c in table.items())


def test_byte_level_token_conversion() -> None:
    """Alphabet strings map to bytes; strings with other characters are literal UTF-8."""
    assert _byte_level_to_bytes("Ġhello") == b" hello"
    assert _byte_level_to_bytes("ĊĉĠ") == b"\n\t "
    assert _byte_level_to_bytes("é") == b"\xe9"
    assert _byte_level_to_bytes("Ã©") == "é".encode()
    assert _byte_level_to_bytes("".join(bytes_to_unicode().values())) == bytes(range(256))
    # Like the tokenizers ByteLevel decoder: one character outside the alphabet (space,
    # soft hyphen, CJK) makes the whole token literal text.
    for token in ["a b", "é b", "x\u00ady", "日本", "Ġ日"]:
        assert _byte_level_to_bytes(token) == token.encode(), token


# --------------------------------------------------------------------------------------
# (a) Byte-level BPE
# --------------------------------------------------------------------------------------


def test_byte_level_detected(byte_level_tok: PreTrainedTokenizerFast) -> None:
    assert detect_vocab_kind(byte_level_tok) == "byte_level"


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip(byte_level_tok: PreTrainedTokenizerFast, text: str) -> None:
    vocab = get_byte_vocab(byte_level_tok)
    assert len(vocab) == len(byte_level_tok)
    ids = byte_level_tok.encode(text, add_special_tokens=False)
    assert _join(vocab, ids) == text.encode()


def test_byte_level_matches_tokenizer_decode(byte_level_tok: PreTrainedTokenizerFast) -> None:
    """Every whole-character token decodes, on its own, to exactly its vocabulary bytes."""
    vocab = get_byte_vocab(byte_level_tok)
    checked = 0
    for i, b in enumerate(vocab):
        try:
            expected = b.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert byte_level_tok.decode([i]) == expected, i
        checked += 1
    assert checked > 500
    # The 256 single-byte tokens are all there: every byte value is some token's bytes.
    assert {b for b in vocab if len(b) == 1} == {bytes([x]) for x in range(256)}


def test_decode_fallback_agrees_with_direct_mapping(
    byte_level_tok: PreTrainedTokenizerFast,
) -> None:
    """The decode-based strategy agrees with the direct one wherever it can be exact."""
    direct = get_byte_vocab(byte_level_tok)
    decoded = _decode_vocab(byte_level_tok, len(byte_level_tok))
    for i, (a, b) in enumerate(zip(direct, decoded, strict=True)):
        if b"\xef\xbf\xbd" in b:  # U+FFFD: a token holding part of a character
            assert a.decode("utf-8", errors="replace") == b.decode(), i
        else:
            assert a == b, i


# --------------------------------------------------------------------------------------
# (b) Sentencepiece style
# --------------------------------------------------------------------------------------


def test_llama_style_detected(llama_style_tok: PreTrainedTokenizerFast) -> None:
    assert detect_vocab_kind(llama_style_tok) == "sentencepiece"


@pytest.mark.parametrize("text", TEXTS)
def test_llama_style_round_trip(llama_style_tok: PreTrainedTokenizerFast, text: str) -> None:
    """Joined bytes equal the text with the space the Metaspace scheme prepends (▁ = b" ")."""
    vocab = get_byte_vocab(llama_style_tok)
    ids = llama_style_tok.encode(text, add_special_tokens=False)
    assert _join(vocab, ids) == _sp_expected(text)


def test_llama_style_byte_fallback_exercised(llama_style_tok: PreTrainedTokenizerFast) -> None:
    vocab = get_byte_vocab(llama_style_tok)
    ids = llama_style_tok.encode("日本語 😀", add_special_tokens=False)
    tokens = llama_style_tok.convert_ids_to_tokens(ids)
    assert "<0xF0>" in tokens  # the emoji's first byte
    for i, piece in zip(ids, tokens, strict=True):
        if piece.startswith("<0x"):
            assert vocab[i] == bytes([int(piece[3:5], 16)])
    # Byte pieces stand for single bytes, ▁ for a space, specials for their text.
    for b in range(256):
        assert vocab[llama_style_tok.convert_tokens_to_ids(f"<0x{b:02X}>")] == bytes([b])
    assert vocab[llama_style_tok.convert_tokens_to_ids(SPIECE)] == b" "
    assert vocab[:3] == [b"<unk>", b"<s>", b"</s>"]


def test_unigram_metaspace_with_model_byte_fallback() -> None:
    """T5-style Unigram + Metaspace decoder; the model's byte_fallback enables <0xNN>."""
    trained = Tokenizer(models.Unigram())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE, prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=400, special_tokens=["<unk>"], unk_token="<unk>", show_progress=False
    )
    trained.train_from_iterator(_corpus()[:2], trainer)
    state = json.loads(trained.model.__getstate__())
    pieces = [(p, s) for p, s in state["vocab"] if p not in _byte_pieces()]
    pieces += [(p, -100.0) for p in _byte_pieces()]
    tok = Tokenizer(models.Unigram(pieces, 0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE, prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement=SPIECE, prepend_scheme="always")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")

    assert detect_vocab_kind(hf) == "sentencepiece"
    vocab = get_byte_vocab(hf)
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert _join(vocab, ids) == _sp_expected(text), text
    assert any(t.startswith("<0x") for t in hf.convert_ids_to_tokens(hf.encode("日本")))


def _slow_sentencepiece(spm_dir: Path) -> Any:
    """The tiny model behind transformers' slow (sentencepiece-backed) tokenizer class."""
    try:  # transformers >= 5
        from transformers.tokenization_utils_sentencepiece import SentencePieceBackend
    except ImportError:  # transformers 4: LlamaTokenizer is the slow class
        from transformers import LlamaTokenizer

        return LlamaTokenizer(vocab_file=str(spm_dir / "tokenizer.model"), legacy=True)
    return SentencePieceBackend(
        vocab_file=str(spm_dir / "tokenizer.model"),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


def _check_spm_tokenizer(tok: Any) -> None:
    vocab = get_byte_vocab(tok)
    assert len(vocab) == len(tok)
    assert vocab[:3] == [b"<unk>", b"<s>", b"</s>"]
    for b in range(256):
        assert vocab[3 + b] == bytes([b])
    fallback_seen = False
    for text in TEXTS:
        if text.startswith(" ") or not text:
            continue  # leading-space handling differs between sentencepiece wrappers
        ids = tok.encode(text, add_special_tokens=False)
        fallback_seen |= any(3 <= i < 259 for i in ids)
        assert _join(vocab, ids) == b" " + text.encode(), text
    assert fallback_seen


def test_real_sentencepiece_slow(spm_dir: Path) -> None:
    tok = _slow_sentencepiece(spm_dir)
    assert getattr(tok, "backend_tokenizer", None) is None
    assert detect_vocab_kind(tok) == "sentencepiece"
    _check_spm_tokenizer(tok)


def test_real_sentencepiece_fast(spm_dir: Path) -> None:
    try:
        from transformers import LlamaTokenizerFast
    except ImportError:  # pragma: no cover
        pytest.skip("no LlamaTokenizerFast")
    tok = LlamaTokenizerFast.from_pretrained(str(spm_dir))
    assert getattr(tok, "backend_tokenizer", None) is not None
    assert detect_vocab_kind(tok) == "sentencepiece"
    _check_spm_tokenizer(tok)


# --------------------------------------------------------------------------------------
# (c) Added and special tokens
# --------------------------------------------------------------------------------------


def test_added_tokens_byte_level() -> None:
    hf = PreTrainedTokenizerFast(tokenizer_object=_train_byte_level(), eos_token="<|endoftext|>")
    e_acute = hf.convert_tokens_to_ids("é")  # byte-level spelling of the byte 0xE9
    hf.add_tokens(["<|user|>", "a b", "<ü>", "é"])
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|end▁of▁turn|>"]})
    vocab = get_byte_vocab(hf)
    for text in ["<|user|>", "a b", "<ü>", "<|im_start|>", "<|end▁of▁turn|>", "<|endoftext|>"]:
        token_id = hf.convert_tokens_to_ids(text)
        assert token_id >= 0
        assert vocab[token_id] == text.encode(), text
    # Marking a token of the model's own vocabulary as added keeps the model's meaning.
    assert hf.convert_tokens_to_ids("é") == e_acute
    assert vocab[e_acute] == b"\xe9"
    # Texts containing added tokens still round-trip.
    for text in ["hi <|user|> there", "<|im_start|>user\nhello<|im_end|>", "x<ü>y"]:
        text = text.replace("<|im_end|>", "<|endoftext|>")
        ids = hf.encode(text, add_special_tokens=False)
        assert _join(vocab, ids) == text.encode(), text


def test_special_token_ids_are_the_ids_written_as_their_text() -> None:
    """Special tokens and added tokens that are not the model's own are listed; a token of the
    model's own vocabulary marked as added is not (it keeps its bytes' meaning)."""
    hf = PreTrainedTokenizerFast(tokenizer_object=_train_byte_level(), eos_token="<|endoftext|>")
    e_acute = hf.convert_tokens_to_ids("é")
    hf.add_tokens(["<|user|>", "é"])
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    ids = special_token_ids(hf)
    want = {hf.convert_tokens_to_ids(t) for t in ["<|endoftext|>", "<|user|>", "<|im_start|>"]}
    assert set(ids) == want and ids == sorted(ids) and e_acute not in ids
    vocab = get_byte_vocab(hf)
    assert all(vocab[i] for i in ids)  # written as their text in the byte vocabulary


def test_added_tokens_sentencepiece_style() -> None:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=_train_llama_style("first"),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )
    hf.add_tokens(["<|user|>"])
    hf.add_special_tokens({"additional_special_tokens": ["<|assistant|>"]})
    vocab = get_byte_vocab(hf)
    for text in ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]:
        assert vocab[hf.convert_tokens_to_ids(text)] == text.encode()
    ids = hf.encode("hello <|user|>world</s>", add_special_tokens=False)
    assert _join(vocab, ids) == b" hello <|user|>world</s>"
    assert _join(vocab, hf.encode("x", add_special_tokens=True)) == b" x"


# --------------------------------------------------------------------------------------
# pad_to, str vocabulary, other inputs
# --------------------------------------------------------------------------------------


def test_pad_to(byte_level_tok: PreTrainedTokenizerFast) -> None:
    n = len(byte_level_tok)
    plain = get_byte_vocab(byte_level_tok)
    padded = get_byte_vocab(byte_level_tok, pad_to=n + 37)
    assert len(padded) == n + 37
    assert padded[:n] == plain
    assert padded[n:] == [b""] * 37
    assert get_byte_vocab(byte_level_tok, pad_to=n) == plain
    with pytest.raises(ValueError):
        get_byte_vocab(byte_level_tok, pad_to=n - 1)
    strs = get_str_vocab(byte_level_tok, pad_to=n + 3)
    assert len(strs) == n + 3 and strs[n:] == ["", "", ""]


def test_unpadded_length(byte_level_tok: PreTrainedTokenizerFast) -> None:
    n = len(byte_level_tok)
    assert unpadded_length(get_byte_vocab(byte_level_tok, pad_to=n + 37), byte_level_tok) == n
    assert unpadded_length(get_str_vocab(byte_level_tok, pad_to=n + 3), byte_level_tok) == n
    assert unpadded_length(get_byte_vocab(byte_level_tok), byte_level_tok) == n
    assert unpadded_length([b"a", b"", b"", b"x", b""], [0, 0]) == 4  # only trailing empties
    assert unpadded_length([b"a", b""], [0, 0]) == 2  # an empty entry inside the tokenizer stays
    assert unpadded_length([b"a", b""], object()) == 2  # no len(tokenizer): nothing is cut


def test_str_vocab(byte_level_tok: PreTrainedTokenizerFast) -> None:
    byte_vocab = get_byte_vocab(byte_level_tok)
    replaced = get_str_vocab(byte_level_tok)
    lossless = get_str_vocab(byte_level_tok, errors="surrogateescape")
    assert len(replaced) == len(byte_vocab)
    for b, r, s in zip(byte_vocab, replaced, lossless, strict=True):
        assert r == b.decode("utf-8", errors="replace")
        assert s.encode("utf-8", errors="surrogateescape") == b
    hello = byte_level_tok.encode("Hello", add_special_tokens=False)
    assert "".join(replaced[i] for i in hello) == "Hello"
    assert replaced[byte_level_tok.convert_tokens_to_ids("é")] == "\ufffd"


def test_raw_tokenizers_object() -> None:
    tok = _train_byte_level()
    assert detect_vocab_kind(tok) == "byte_level"
    vocab = get_byte_vocab(tok)
    assert len(vocab) == tok.get_vocab_size()
    assert vocab[tok.token_to_id("<|endoftext|>")] == b"<|endoftext|>"
    for text in TEXTS:
        assert _join(vocab, tok.encode(text).ids) == text.encode()


def test_wordpiece_uses_decode_fallback() -> None:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=600, special_tokens=["[UNK]", "[CLS]"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]")
    assert detect_vocab_kind(hf) == "decode"
    vocab = get_byte_vocab(hf)
    assert len(vocab) == len(hf)
    assert vocab[hf.convert_tokens_to_ids("[CLS]")] == b"[CLS]"
    # Mid-text, a word-initial WordPiece token carries its separating space and a "##"
    # continuation does not.
    text = "return the unquoted tokenizer string"
    ids = hf.encode(text, add_special_tokens=False)
    assert any(t.startswith("##") for t in hf.convert_ids_to_tokens(ids))
    assert _join(vocab, ids) == b" " + text.encode()
    # The raw tokenizers.Tokenizer (whose decode takes no clean-up flag) gives the same.
    assert detect_vocab_kind(tok) == "decode"
    assert get_byte_vocab(tok) == vocab


def test_plain_and_unreadable_decoders() -> None:
    """A concatenating decoder reads tokens as text; a regex Replace falls back to decode."""
    tok = Tokenizer(models.WordLevel(vocab={"a": 0, "b c": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.Fuse()
    assert detect_vocab_kind(tok) == "plain"
    assert get_byte_vocab(tok) == [b"a", b"b c", b"[UNK]"]
    tok.decoder = decoders.Sequence(
        [decoders.Replace(tokenizers.Regex("c$"), "C"), decoders.Fuse()]
    )
    assert detect_vocab_kind(tok) == "decode"
    assert get_byte_vocab(tok) == [b"a", b"b C", b"[UNK]"]


# --------------------------------------------------------------------------------------
# Slow-tokenizer code paths, with small stand-ins (transformers 5 has no slow GPT-2)
# --------------------------------------------------------------------------------------


class _SlowStandIn:
    """A minimal slow-tokenizer-like object built on a byte-level fast tokenizer."""

    def __init__(self, fast: PreTrainedTokenizerFast, byte_decoder: bool, as_bytes: bool):
        self._fast = fast
        self._as_bytes = as_bytes
        self.added_tokens_decoder = fast.added_tokens_decoder
        self.vocab_size = fast.vocab_size
        if byte_decoder:
            self.byte_decoder = {c: b for b, c in bytes_to_unicode().items()}

    def __len__(self) -> int:
        return len(self._fast)

    def _token(self, i: int) -> Any:
        tok = self._fast.convert_ids_to_tokens(i)
        if self._as_bytes and i not in self.added_tokens_decoder:
            return bytes(unicode_to_bytes()[c] for c in tok)
        return tok

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        if isinstance(ids, int):
            return self._token(ids)
        return [self._token(i) for i in ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._fast.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self._fast.decode(ids, **kwargs)


@pytest.mark.parametrize(
    ("byte_decoder", "as_bytes", "kind"),
    [(True, False, "byte_level"), (False, True, "bytes"), (False, False, "byte_level")],
)
def test_slow_paths(
    byte_level_tok: PreTrainedTokenizerFast, byte_decoder: bool, as_bytes: bool, kind: str
) -> None:
    """byte_decoder attribute; bytes tokens (tiktoken style); vocabulary heuristic."""
    slow = _SlowStandIn(byte_level_tok, byte_decoder=byte_decoder, as_bytes=as_bytes)
    assert detect_vocab_kind(slow) == kind
    assert get_byte_vocab(slow) == get_byte_vocab(byte_level_tok)


# --------------------------------------------------------------------------------------
# mistral_common tokenizers (Tekken and sentencepiece), built locally
# --------------------------------------------------------------------------------------

_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@pytest.fixture(scope="module")
def tekken_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A v7 ``tekken.json`` whose ranks are the byte-level BPE's tokens, as raw bytes."""
    pytest.importorskip("mistral_common")
    pytest.importorskip("tiktoken")
    import base64

    ranks = [bytes([b]) for b in range(256)]  # Tekken requires these first, in order
    seen = set(ranks)
    tok = _train_byte_level()
    u2b = unicode_to_bytes()
    for token, _ in sorted(tok.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1]):
        if token == "<|endoftext|>":
            continue
        raw = bytes(u2b[c] for c in token)
        if raw not in seen:
            seen.add(raw)
            ranks.append(raw)
    num_special = 100
    data = {
        "config": {
            "pattern": _GPT2_PATTERN,
            "num_vocab_tokens": len(ranks),
            "default_vocab_size": len(ranks) + num_special,
            "default_num_special_tokens": num_special,
            "version": "v7",
        },
        "vocab": [
            {
                "rank": i,
                "token_bytes": base64.b64encode(raw).decode(),
                "token_str": raw.decode("utf-8", errors="replace"),
            }
            for i, raw in enumerate(ranks)
        ],
    }
    path = tmp_path_factory.mktemp("tekken") / "tekken.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_tekken(tekken_file: Path) -> None:
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    tk = Tekkenizer.from_file(tekken_file)
    assert detect_vocab_kind(tk) == "bytes"
    vocab = get_byte_vocab(tk)
    assert len(vocab) == tk.n_words
    assert vocab[tk.bos_id] == b"<s>" and vocab[tk.eos_id] == b"</s>"
    assert special_token_ids(tk) == list(range(tk.num_special_tokens))
    assert vocab[tk.num_special_tokens : tk.num_special_tokens + 256] == [
        bytes([b]) for b in range(256)
    ]
    for text in TEXTS:
        assert _join(vocab, tk.encode(text, bos=False, eos=False)) == text.encode(), text

    try:
        from transformers import MistralCommonBackend
    except ImportError:  # transformers 4
        return
    wrapped = MistralCommonBackend(tokenizer_path=str(tekken_file))
    assert detect_vocab_kind(wrapped) == "bytes"
    assert get_byte_vocab(wrapped) == vocab
    assert special_token_ids(wrapped) == special_token_ids(tk)
    assert get_byte_vocab(wrapped, pad_to=len(vocab) + 5)[-5:] == [b""] * 5
    for text in TEXTS:
        ids = wrapped.encode(text, add_special_tokens=False)
        assert _join(vocab, ids) == text.encode(), text


def test_mistral_sentencepiece(spm_dir: Path) -> None:
    pytest.importorskip("mistral_common")
    from mistral_common.tokens.tokenizers.base import TokenizerVersion
    from mistral_common.tokens.tokenizers.sentencepiece import SentencePieceTokenizer

    st = SentencePieceTokenizer(spm_dir / "tokenizer.model", tokenizer_version=TokenizerVersion.v1)
    assert detect_vocab_kind(st) == "sentencepiece"
    vocab = get_byte_vocab(st)
    assert vocab[:3] == [b"<unk>", b"<s>", b"</s>"]
    assert {0, 1, 2} <= set(special_token_ids(st)) and 3 not in special_token_ids(st)
    assert vocab[3:259] == [bytes([b]) for b in range(256)]
    for text in TEXTS:
        if text and not text.startswith(" "):
            ids = st.encode(text, bos=False, eos=False)
            assert _join(vocab, ids) == b" " + text.encode(), text
