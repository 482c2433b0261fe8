"""Test helpers: tiny local models and a transformers reference implementation.

Nothing in this module touches the network.  Models are built from scratch with
random (but seeded, hence deterministic) weights and a byte-level BPE tokenizer
trained on the Python standard library sources of the running interpreter, so
every machine can build them offline in a few seconds.

Public API
----------
* :data:`TINY_KINDS` -- the model kinds :func:`tiny_model_path` can build.
* :func:`tiny_model_path` -- build (once) and cache a tiny HF model directory
  loadable by both transformers and vLLM.
* :func:`hf_reference_logprobs` -- exact float32 next-token log-probabilities
  computed with transformers (optionally through a peft LoRA adapter).
* :func:`random_prompts` -- deterministic random token-id prompts.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import sysconfig
import tempfile
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TINY_KINDS",
    "hf_reference_logprobs",
    "random_prompts",
    "tiny_model_path",
]

#: Model kinds understood by :func:`tiny_model_path`.
TINY_KINDS: tuple[str, ...] = ("llama", "qwen2", "llama-32k")

#: Bumped whenever the build recipe changes, so stale caches are not reused.
_BUILD_VERSION = 1

#: Special tokens, in id order: ``<s>`` = 0 (bos), ``</s>`` = 1 (eos), ``<pad>`` = 2.
_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
_BOS_ID, _EOS_ID, _PAD_ID = 0, 1, 2

#: Pre-tokenization regex of Qwen2's tokenizer (as in transformers' ``Qwen2Tokenizer``).
_QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

#: Files whose presence marks a finished model directory.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

_SEED = 0
_INIT_STD = 0.2


@dataclass(frozen=True)
class _Spec:
    arch: str  # "llama", "qwen2" or "qwen3"
    tokenizer_vocab: int  # BPE training target (including special tokens)
    corpus_chars: int  # how many characters of stdlib source to train on
    model_vocab: int | None = None  # logit width; None -> len(tokenizer)
    hidden: int = 128
    layers: int = 2
    heads: int | None = None  # attention heads; None -> hidden // 64 (head_dim 64)
    kv_heads: int | None = None  # None -> heads
    intermediate: int | None = None  # MLP width; None -> 2 * hidden
    tie_embeddings: bool = False
    head_dim: int | None = None  # None -> hidden // heads (Qwen3 sets it apart)
    # Weights N(0, 1/fan_in) and biases 0 instead of N(0, _INIT_STD^2): keeps the residual stream
    # O(1) through many wide layers, so rows stay finite and far from one-hot in bfloat16 too.
    scaled_init: bool = False
    # Zero the embedding and output rows of the logit columns past the tokenizer, so padding gets
    # logit 0 and almost no mass (random rows there would carry most of it, as empty tokens).
    zero_padded_rows: bool = False


_SPECS: dict[str, _Spec] = {
    "llama": _Spec(arch="llama", tokenizer_vocab=512, corpus_chars=300_000),
    "qwen2": _Spec(arch="qwen2", tokenizer_vocab=400, corpus_chars=300_000),
    "llama-32k": _Spec(
        arch="llama", tokenizer_vocab=32768, corpus_chars=5_000_000, model_vocab=32768
    ),
    # Benchmarks only (not in TINY_KINDS): a mid-size model, 6 layers, hidden 512 (~50M params).
    "llama-32k-mid": _Spec(
        arch="llama", tokenizer_vocab=32768, corpus_chars=5_000_000, model_vocab=32768, hidden=512, layers=6
    ),
    # Benchmarks only: the same 6-layer, hidden-512 Llama with a 2,048-token vocabulary.
    "llama-2k-mid": _Spec(
        arch="llama", tokenizer_vocab=2048, corpus_chars=1_000_000, model_vocab=2048, hidden=512, layers=6
    ),
    # Benchmarks only: the same 6-layer model with 32,768 logit columns over the 2,048-token
    # tokenizer (the columns past it are zeroed padding, as in real models' padded vocabularies).
    "llama-2k-32kcols-mid": _Spec(
        arch="llama", tokenizer_vocab=2048, corpus_chars=1_000_000, model_vocab=32768, hidden=512, layers=6,
        zero_padded_rows=True,
    ),
    # Benchmarks only: Qwen2-0.5B's shape (24 layers, hidden 896, 14 heads of dim 64, 2 KV heads,
    # MLP 4864, tied embeddings, 151,936 logit columns) with random weights and a 32k tokenizer:
    # the logit columns past the tokenizer are padding, as in the real model (~494M params).
    "qwen2-0.5b-shape": _Spec(
        arch="qwen2", tokenizer_vocab=32768, corpus_chars=5_000_000, model_vocab=151936, hidden=896,
        layers=24, heads=14, kv_heads=2, intermediate=4864, tie_embeddings=True, zero_padded_rows=True,
    ),
    # Benchmarks only: Qwen3-0.6B's shape (28 layers, hidden 1024, 16 heads of dim 128, 8 KV heads,
    # q/k norms, MLP 3072, tied embeddings, 151,936 logit columns) with random weights and an 8k
    # tokenizer; the columns past it are zeroed padding (~600M params).
    "qwen3-0.6b-shape": _Spec(
        arch="qwen3", tokenizer_vocab=8192, corpus_chars=2_000_000, model_vocab=151936, hidden=1024,
        layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, tie_embeddings=True,
        zero_padded_rows=True, scaled_init=True,
    ),
}
assert set(TINY_KINDS) <= set(_SPECS)


# ---------------------------------------------------------------------------
# Building tiny models
# ---------------------------------------------------------------------------


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> pathlib.Path:
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    env = os.environ.get("GENLM_VLM_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "genlm_vlm"


def _is_complete(path: pathlib.Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def _training_corpus(max_chars: int) -> list[str]:
    """Top-level ``*.py`` files of the stdlib, sorted by name, up to ``max_chars``.

    Only top-level files are used (never ``site-packages``), so the corpus only
    depends on the Python installation, not on what else is installed.
    """
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"), key=lambda p: p.name)
    texts: list[str] = []
    total = 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not texts:  # pragma: no cover - every CPython install ships its stdlib
        raise RuntimeError(f"no Python sources found under {stdlib} to train a tokenizer")
    return texts


def _train_tokenizer(arch: str, vocab_size: int, corpus_chars: int) -> Any:
    return train_byte_level_bpe(_training_corpus(corpus_chars), vocab_size, arch=arch)


def train_byte_level_bpe(corpus: Iterable[str], vocab_size: int, *, arch: str = "llama") -> Any:
    """Train a byte-level BPE tokenizer on ``corpus``; returns a ``PreTrainedTokenizerFast``.

    Special tokens ``<s>``=0 (bos), ``</s>``=1 (eos), ``<pad>``=2; nothing is added when encoding.
    ``arch="qwen2"`` uses Qwen2's own pre-tokenizer so transformers' ``Qwen2Tokenizer`` agrees.
    Deterministic for a given corpus and ``tokenizers`` version.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if arch == "qwen2":
        # transformers >= 5 always loads a ``qwen2`` checkpoint's tokenizer as
        # ``Qwen2Tokenizer``, which keeps only vocab + merges and rebuilds this
        # exact pipeline; train with it so the saved tokenizer.json agrees.
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    for i, name in enumerate(_SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name!r} got id {tok.token_to_id(name)}, expected {i}")
    special: dict[str, str] = dict(
        bos_token=_SPECIAL_TOKENS[_BOS_ID],
        eos_token=_SPECIAL_TOKENS[_EOS_ID],
        pad_token=_SPECIAL_TOKENS[_PAD_ID],
    )
    if arch == "qwen2":
        # Qwen2Tokenizer defaults unk_token to "<|endoftext|>" and would append it
        # as a new token past the model's vocab; name an existing token instead
        # (byte-level BPE never produces unk anyway).
        special["unk_token"] = _SPECIAL_TOKENS[_PAD_ID]
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=512, **special)


def _make_config(
    arch: str,
    vocab_size: int,
    hidden: int = 128,
    layers: int = 2,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    tie_embeddings: bool = False,
    head_dim: int | None = None,
) -> Any:
    heads = heads or hidden // 64  # head_dim 64: vLLM's CPU attention rejects tiny head dims
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie_embeddings,
        initializer_range=_INIT_STD,
        bos_token_id=_BOS_ID,
        eos_token_id=_EOS_ID,
        pad_token_id=_PAD_ID,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        config = LlamaConfig(**common)
        config.architectures = ["LlamaForCausalLM"]
    elif arch == "qwen2":
        from transformers import Qwen2Config

        config = Qwen2Config(use_sliding_window=False, **common)
        config.architectures = ["Qwen2ForCausalLM"]
    elif arch == "qwen3":
        from transformers import Qwen3Config

        config = Qwen3Config(use_sliding_window=False, head_dim=head_dim or hidden // heads, **common)
        config.architectures = ["Qwen3ForCausalLM"]
    else:  # pragma: no cover - guarded by _SPECS
        raise ValueError(arch)
    config.dtype = torch.float32
    return config


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int, std: float, scaled: bool = False) -> None:
    """Re-initialize every parameter from a private, seeded generator.

    Independent of transformers' own init code (which changes between
    versions). Norm weights are 1; every other weight *and bias* is
    ``N(0, std**2)``. The large std keeps next-token distributions far from
    uniform, so log-prob comparisons are meaningful.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if "norm" in name:
            param.fill_(1.0)
        elif scaled:  # ``scaled``: N(0, 1/fan_in) for matrices, 0 for biases
            if param.dim() < 2:
                param.zero_()
            else:
                values = torch.randn(param.shape, generator=gen, dtype=torch.float32) / param.shape[1] ** 0.5
                param.copy_(values.to(param.dtype))
        else:
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.copy_(values.to(param.dtype))


def _build(kind: str, out_dir: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM

    spec = _SPECS[kind]
    # Qwen3 checkpoints load their tokenizer as Qwen2Tokenizer too
    tok_arch = "qwen2" if spec.arch == "qwen3" else spec.arch
    tokenizer = _train_tokenizer(tok_arch, spec.tokenizer_vocab, spec.corpus_chars)
    vocab_size = max(len(tokenizer), spec.model_vocab or 0)
    config = _make_config(
        spec.arch, vocab_size, spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.intermediate,
        spec.tie_embeddings, spec.head_dim,
    )
    # transformers' own init draws from the global RNG; keep the caller's state intact.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(torch.float32).eval()
    _init_weights(model, _SEED, _INIT_STD, scaled=spec.scaled_init)
    if spec.zero_padded_rows and vocab_size > len(tokenizer):
        with torch.no_grad():
            for emb in (model.get_input_embeddings(), model.get_output_embeddings()):
                emb.weight[len(tokenizer) :] = 0.0
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


_BUILD_LOCK = threading.Lock()


def tiny_model_path(
    kind: str = "llama", cache_dir: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """Return the directory of a tiny random-weight HF model, building it on first use.

    The directory holds a float32 ``model.safetensors`` + ``config.json`` and a
    byte-level BPE tokenizer (``tokenizer.json`` etc.); it loads with
    ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` and with vLLM.

    Kinds (all: 2 layers, hidden 128, 2 heads of dim 64, 2 KV heads,
    intermediate 256, 512 positions, untied embeddings):

    * ``"llama"`` -- ``LlamaForCausalLM``, vocab = tokenizer size (512).
    * ``"qwen2"`` -- ``Qwen2ForCausalLM`` (random q/k/v biases), its own
      tokenizer of 400 tokens, no sliding window.
    * ``"llama-32k"`` -- Llama with 32768 logit columns; the tokenizer is
      trained towards 32768 tokens and may come out smaller on small stdlibs
      (the model vocab is then larger than ``len(tokenizer)``).

    Token ids 0, 1, 2 are ``<s>`` (bos), ``</s>`` (eos) and ``<pad>``; the
    tokenizer does *not* add bos/eos when encoding. Weights are seeded, so a
    build is deterministic for a given machine (Python stdlib, torch and
    tokenizers versions).

    The cache root is ``cache_dir``, else ``$GENLM_VLM_CACHE``, else
    ``~/.cache/genlm_vlm``; the model lives in ``<root>/tiny/<kind>-v1``.
    Builds happen in a temporary sibling directory that is atomically renamed
    into place, so concurrent processes never see a half-written model (the
    first one to finish wins; the others discard their copy).
    """
    if kind not in _SPECS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {TINY_KINDS}")
    parent = _cache_root(cache_dir) / "tiny"
    final = parent / f"{kind}-v{_BUILD_VERSION}"
    if _is_complete(final):
        return final
    with _BUILD_LOCK:
        if _is_complete(final):
            return final
        if final.exists() and any(final.iterdir()):
            raise RuntimeError(f"{final} exists but is not a complete model; delete it to rebuild")
        parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
        try:
            _build(kind, tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                # Another process renamed its finished build into place first.
                if not _is_complete(final):
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------
# transformers reference
# ---------------------------------------------------------------------------

_HF_MODELS: dict[tuple[str, str | None], torch.nn.Module] = {}
_HF_LOCK = threading.Lock()


def _load_hf_model(model_path: str | os.PathLike[str], lora_path: str | None) -> torch.nn.Module:
    key = (str(pathlib.Path(model_path).resolve()), None if lora_path is None else str(lora_path))
    with _HF_LOCK:
        model = _HF_MODELS.get(key)
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(key[0], local_files_only=True)
            model = model.to(torch.float32)
            if lora_path is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, lora_path)
                model = model.to(torch.float32)
            model.eval()
            _HF_MODELS[key] = model
    return model


def hf_reference_logprobs(
    model_path: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    *,
    lora_path: str | None = None,
) -> list[torch.Tensor]:
    """Next-token log-probabilities after each prompt, computed with transformers.

    The model at ``model_path`` is loaded in float32 on CPU (and, if
    ``lora_path`` is given, wrapped with ``peft.PeftModel.from_pretrained``);
    loaded models are cached per ``(model_path, lora_path)`` for the life of
    the process. Each prompt (a non-empty sequence of token ids, used as-is:
    no bos is added) is run alone, without padding, so results are exact.

    Returns one 1-D float32 CPU tensor per prompt, of length equal to the
    model's logit width (``config.vocab_size``, which may exceed the
    tokenizer's length): ``log_softmax`` of the logits at the last position.
    """
    model = _load_hf_model(model_path, lora_path)
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError("prompts must be non-empty")
            input_ids = torch.tensor([ids], dtype=torch.long)
            logits = model(input_ids=input_ids).logits[0, -1]
            out.append(torch.log_softmax(logits.float(), dim=-1).cpu().clone())
    return out


# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------


def random_prompts(
    n: int, vocab_size: int, min_len: int = 1, max_len: int = 200, seed: int = 0
) -> list[list[int]]:
    """``n`` deterministic random prompts of token ids.

    Lengths are uniform in ``[min_len, max_len]`` and ids uniform in
    ``[3, vocab_size)`` (ids 0-2 are the special tokens of the tiny models).
    The same arguments always give the same prompts.
    """
    if vocab_size <= 3:
        raise ValueError("vocab_size must be > 3")
    if not 1 <= min_len <= max_len:
        raise ValueError("need 1 <= min_len <= max_len")
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        prompts.append([rng.randrange(3, vocab_size) for _ in range(length)])
    return prompts
