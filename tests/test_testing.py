"""Tests for genlm_vlm.testing: tiny local models and the transformers reference (no vLLM)."""

from __future__ import annotations

import json
import pathlib
import shutil
import time
import unicodedata

import pytest
import torch

from genlm_vlm import testing
from genlm_vlm.testing import TINY_KINDS, hf_reference_logprobs, random_prompts, tiny_model_path

SAMPLE_TEXT = (
    "def foo(x: int) -> int:\n"
    '    """Add one."""\n'
    "    return x + 1  # héllo wörld, naïve café 日本語 🙂\n"
    "\n\tclass A:\n        pass\r\n"
)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> pathlib.Path:
    """One cache root, shared by the tests of this module, holding every kind."""
    root = tmp_path_factory.mktemp("genlm_vlm_cache")
    for kind in TINY_KINDS:
        tiny_model_path(kind, root)
    return root


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _load_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(pathlib.Path(path) / "model.safetensors"))


# ---------------------------------------------------------------------------
# tiny_model_path
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_layout_and_config(cache_root, kind):
    path = tiny_model_path(kind, cache_root)
    assert path == cache_root / "tiny" / f"{kind}-v1"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    # No leftover temporary build directories.
    assert sorted(p.name for p in (cache_root / "tiny").iterdir()) == sorted(
        f"{k}-v1" for k in TINY_KINDS
    )

    cfg = _load_config(path)
    expected_arch = "Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM"
    assert cfg.architectures == [expected_arch]
    assert cfg.hidden_size == 128
    assert cfg.num_hidden_layers == 2
    assert cfg.num_attention_heads == 2
    assert cfg.num_key_value_heads == 2
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    assert cfg.max_position_embeddings == 512
    assert cfg.tie_word_embeddings is False
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 2)
    if kind == "qwen2":
        assert cfg.use_sliding_window is False

    weights = _weights(path)
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert weights["lm_head.weight"].shape == (cfg.vocab_size, 128)
    assert weights["model.embed_tokens.weight"].shape == (cfg.vocab_size, 128)
    # Not the default (tiny-std) init: weights were drawn with a large std.
    assert 0.15 < weights["lm_head.weight"].std().item() < 0.25


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_vocab_sizes(cache_root, kind):
    path = tiny_model_path(kind, cache_root)
    cfg = _load_config(path)
    tok = _load_tokenizer(path)
    assert len(tok) <= cfg.vocab_size
    if kind == "llama-32k":
        assert cfg.vocab_size >= 32000
    else:
        assert len(tok) == cfg.vocab_size
        assert 300 <= cfg.vocab_size <= 600
    if kind == "qwen2":
        assert cfg.vocab_size != _load_config(tiny_model_path("llama", cache_root)).vocab_size


def test_cached_second_call_does_not_rebuild(cache_root, monkeypatch):
    path = tiny_model_path("llama", cache_root)
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(testing, "_build", boom)
    t0 = time.perf_counter()
    assert tiny_model_path("llama", cache_root) == path
    assert time.perf_counter() - t0 < 0.5
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_build_is_deterministic(cache_root, tmp_path, monkeypatch, kind):
    # Second build in a fresh root picked via $GENLM_VLM_CACHE.
    monkeypatch.setenv("GENLM_VLM_CACHE", str(tmp_path))
    other = tiny_model_path(kind)
    first = tiny_model_path(kind, cache_root)
    assert other == tmp_path / "tiny" / f"{kind}-v1"
    assert other != first

    w1, w2 = _weights(first), _weights(other)
    assert w1.keys() == w2.keys()
    for name in w1:
        assert torch.equal(w1[name], w2[name]), name
    tok1 = json.loads((first / "tokenizer.json").read_text())
    tok2 = json.loads((other / "tokenizer.json").read_text())
    assert tok1["model"]["vocab"] == tok2["model"]["vocab"]
    assert tok1["model"]["merges"] == tok2["model"]["merges"]
    assert tok1 == tok2
    assert json.loads((first / "config.json").read_text()) == json.loads(
        (other / "config.json").read_text()
    )


def test_build_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    tiny_model_path("qwen2", tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_concurrent_builder_wins(cache_root, tmp_path, monkeypatch):
    """If another process renames its build into place first, ours is discarded."""
    real_build = testing._build
    final = tmp_path / "tiny" / "llama-v1"

    def racing_build(kind, out_dir):
        real_build(kind, out_dir)
        # Meanwhile "another process" finished and renamed its copy into place.
        shutil.copytree(tiny_model_path(kind, cache_root), final)
        (final / "theirs").write_text("")

    monkeypatch.setattr(testing, "_build", racing_build)
    assert tiny_model_path("llama", tmp_path) == final
    assert (final / "theirs").exists()
    assert sorted(p.name for p in final.parent.iterdir()) == ["llama-v1"]


def test_incomplete_directory_is_reported(tmp_path):
    final = tmp_path / "tiny" / "llama-v1"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="not a complete model"):
        tiny_model_path("llama", tmp_path)


def test_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        tiny_model_path("gpt2", tmp_path)
    assert not (tmp_path / "tiny").exists()


def test_default_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv("GENLM_VLM_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert testing._cache_root(None) == tmp_path / ".cache" / "genlm_vlm"
    monkeypatch.setenv("GENLM_VLM_CACHE", str(tmp_path / "env"))
    assert testing._cache_root(None) == tmp_path / "env"
    assert testing._cache_root(tmp_path / "arg") == tmp_path / "arg"


# ---------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tokenizer_round_trip(cache_root, kind):
    from tokenizers import Tokenizer

    path = tiny_model_path(kind, cache_root)
    tok = _load_tokenizer(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    # The qwen2 tokenizer NFC-normalizes (like the real Qwen2 tokenizer).
    text = unicodedata.normalize("NFC", SAMPLE_TEXT)

    ids = tok(text).input_ids
    assert ids == raw.encode(text).ids  # AutoTokenizer agrees with tokenizer.json
    assert tok.decode(ids) == text
    assert all(i >= 3 for i in ids)  # no bos/eos added, no special tokens produced
    assert len(ids) < len(text.encode())  # merges actually compress
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.decode([0, *ids, 1], skip_special_tokens=True) == text


# ---------------------------------------------------------------------------
# hf_reference_logprobs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_reference_logprobs(cache_root, kind):
    path = tiny_model_path(kind, cache_root)
    width = _load_config(path).vocab_size
    prompts = random_prompts(4, len(_load_tokenizer(path)), min_len=1, max_len=40, seed=1)
    rows = hf_reference_logprobs(path, prompts)
    assert len(rows) == len(prompts)
    for row in rows:
        assert row.shape == (width,)
        assert row.dtype == torch.float32
        assert row.device.type == "cpu"
        assert torch.isfinite(row).all()
        assert abs(torch.logsumexp(row.double(), -1).item()) < 1e-4
    # Far from uniform, and different prompts give clearly different rows.
    assert (rows[0].max() - rows[0].min()).item() > 3.0
    for a in range(len(rows)):
        for b in range(a + 1, len(rows)):
            assert (rows[a] - rows[b]).abs().max().item() > 0.5

    # Deterministic, and the loaded model is cached.
    again = hf_reference_logprobs(str(path), prompts[:2])
    assert all(torch.equal(x, y) for x, y in zip(rows[:2], again, strict=True))
    assert sum(1 for key in testing._HF_MODELS if key[0] == str(path.resolve())) == 1


def test_reference_matches_full_forward(cache_root):
    """Each row is the last position of a plain forward pass over the prompt."""
    path = tiny_model_path("llama", cache_root)
    prompt = random_prompts(1, 512, min_len=30, max_len=30, seed=5)[0]
    model = testing._load_hf_model(path, None)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0]
    full = torch.log_softmax(logits.float(), -1)
    # Prefixes of the prompt give the rows at earlier positions.
    rows = hf_reference_logprobs(path, [prompt[:10], prompt])
    # different sequence lengths take different kernels: float32 noise of ~1e-5 on logits ~10
    torch.testing.assert_close(rows[0], full[9], atol=5e-5, rtol=0)
    torch.testing.assert_close(rows[1], full[-1], atol=5e-5, rtol=0)


def test_reference_rejects_empty_prompt(cache_root):
    with pytest.raises(ValueError, match="non-empty"):
        hf_reference_logprobs(tiny_model_path("llama", cache_root), [[]])


def test_reference_with_lora(cache_root, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    path = tiny_model_path("llama", cache_root)
    base = AutoModelForCausalLM.from_pretrained(path)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    torch.manual_seed(0)
    lora_model = peft.get_peft_model(base, config)
    lora_dir = tmp_path / "lora"
    lora_model.save_pretrained(lora_dir)

    prompts = random_prompts(2, 512, max_len=30, seed=3)
    plain = hf_reference_logprobs(path, prompts)
    adapted = hf_reference_logprobs(path, prompts, lora_path=str(lora_dir))
    for p, a in zip(plain, adapted, strict=True):
        assert a.shape == p.shape
        assert abs(torch.logsumexp(a.double(), -1).item()) < 1e-4
        assert (a - p).abs().max().item() > 1e-3
    # The base model in the cache is still the plain one.
    assert all(
        torch.equal(x, y) for x, y in zip(plain, hf_reference_logprobs(path, prompts), strict=True)
    )


# ---------------------------------------------------------------------------
# random_prompts
# ---------------------------------------------------------------------------


def test_random_prompts():
    prompts = random_prompts(50, 100, min_len=2, max_len=9, seed=7)
    assert len(prompts) == 50
    assert prompts == random_prompts(50, 100, min_len=2, max_len=9, seed=7)
    assert prompts != random_prompts(50, 100, min_len=2, max_len=9, seed=8)
    assert all(2 <= len(p) <= 9 for p in prompts)
    assert all(3 <= t < 100 and isinstance(t, int) for p in prompts for t in p)
    assert {len(p) for p in prompts} == set(range(2, 10))
    assert random_prompts(0, 100) == []
    assert all(len(p) == 5 for p in random_prompts(5, 10, min_len=5, max_len=5))
    with pytest.raises(ValueError):
        random_prompts(1, 3)
    with pytest.raises(ValueError):
        random_prompts(1, 100, min_len=5, max_len=4)
    with pytest.raises(ValueError):
        random_prompts(1, 100, min_len=0)


def test_qwen3_0_6b_shape_config_without_building_it():
    """``--model-shape qwen3-0.6b`` (python -m genlm_vlm bench): Qwen3-0.6B's config.json shape,
    ~0.6B parameters counted on the meta device (nothing allocated, no tokenizer trained)."""
    from transformers import AutoModelForCausalLM

    from genlm_vlm.bench.cli import SHAPES
    from genlm_vlm.testing import _SPECS, _make_config

    assert set(SHAPES.values()) <= set(_SPECS)
    s = _SPECS[SHAPES["qwen3-0.6b"]]
    q = _make_config(s.arch, s.model_vocab, s.hidden, s.layers, s.heads, s.kv_heads, s.intermediate,
                     s.tie_embeddings, s.head_dim)
    assert q.architectures == ["Qwen3ForCausalLM"] and q.model_type == "qwen3"
    assert (q.hidden_size, q.num_hidden_layers, q.num_attention_heads, q.num_key_value_heads) == (1024, 28, 16, 8)
    assert (q.head_dim, q.intermediate_size, q.vocab_size, q.tie_word_embeddings) == (128, 3072, 151936, True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(q)
    n = sum(p.numel() for p in model.parameters())
    assert 0.55e9 < n < 0.65e9, n


def test_a_small_qwen3_builds_and_loads(tmp_path, monkeypatch):
    """The Qwen3 builder (q/k norms, head_dim apart from hidden / heads, Qwen2's tokenizer, weights
    scaled by fan-in) at a small size: it loads with transformers, its padded logit columns are
    zeroed and its logits are of order 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genlm_vlm import testing

    spec = testing._Spec(arch="qwen3", tokenizer_vocab=400, corpus_chars=100_000, model_vocab=1024, hidden=128,
                         layers=1, heads=2, kv_heads=1, head_dim=96, tie_embeddings=True, zero_padded_rows=True,
                         scaled_init=True)
    monkeypatch.setitem(testing._SPECS, "qwen3-test", spec)
    path = testing.tiny_model_path("qwen3-test", cache_dir=tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.head_dim == 96
    assert model.model.layers[0].self_attn.q_proj.out_features == 2 * 96
    ids = tok.encode("def f(x):\n    return x", add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert logits.shape == (1024,) and torch.all(logits[len(tok):] == 0)
    assert 0.3 < float(logits[: len(tok)].std()) < 3.0  # scaled_init: logits of order 1, rows far from one-hot
