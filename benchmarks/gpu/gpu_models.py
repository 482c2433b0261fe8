"""gpu_check.py's models: realistic shapes (Qwen3-0.6B, Llama-3-8B) with seeded random weights,
their configs and parameter counts, and building them (see CHECK.md)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

#: Model kinds of ``--models``. ``qwen3-mini`` (a 2-layer Qwen3 with the real vocab) is for
#: CPU tests of the build path.
KINDS = ("qwen3-0.6b", "llama-8b", "tiny")
TEST_KINDS = ("qwen3-mini",)
RUNNERS = ("v2", "v1")
DTYPES = ("bfloat16", "float32")
#: Scheduling variants of the correctness engines (extra ``vllm.LLM`` options).
SCHEDS: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 256, "max_num_seqs": 8},
}

#: Bumped whenever the build recipe changes, so stale caches are not reused.
BUILD_VERSION = 1
BUILD_MARKER = "gpu_check_build.json"
INIT_SEED = 0
#: Std of the logits (lm_head init = LOGIT_STD / sqrt(hidden)); every other matrix is
#: N(0, 1/fan_in), so the residual stream stays O(1) through all layers.
LOGIT_STD = 1.5

OUT_SUMMARY = "gpu_check_summary.txt"
OUT_JSON = "gpu_check.json"
OUT_LOGS = "gpu_check_logs.txt"


@dataclass(frozen=True)
class Shape:
    arch: str  # "qwen3" or "llama"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tokenizer_vocab: int = 8192
    corpus_chars: int = 2_000_000


# fmt: off
SHAPES: dict[str, Shape] = {
    # Qwen/Qwen3-0.6B's config.json
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6, 1e-6, 40960),
    # meta-llama/Meta-Llama-3-8B's config.json
    "llama-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 5e5, 1e-5, 8192),
    # CPU tests only: Qwen3 layers (q/k norms, tied embeddings) with the real 151936 vocab
    "qwen3-mini": Shape("qwen3", 128, 2, 2, 1, 64, 256, 151936, True, 1e6, 1e-6, 2048,
                        tokenizer_vocab=1024, corpus_chars=300_000),
}
# fmt: on

#: Published parameter counts of the real models (tied embeddings counted once).
EXPECTED_PARAMS = {"qwen3-0.6b": 596_049_920, "llama-8b": 8_030_261_248}


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# =========================================================================== model configs
def make_config(kind: str) -> Any:
    """The transformers config of a realistic-shape kind (no weights are allocated)."""
    s = SHAPES[kind]
    common: dict[str, Any] = dict(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim,
        hidden_act="silu",
        max_position_embeddings=s.max_position_embeddings,
        rms_norm_eps=s.rms_norm_eps,
        rope_theta=s.rope_theta,
        tie_word_embeddings=s.tie_word_embeddings,
        attention_bias=False,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    if s.arch == "qwen3":
        from transformers import Qwen3Config

        config = Qwen3Config(use_sliding_window=False, **common)
        config.architectures = ["Qwen3ForCausalLM"]
    elif s.arch == "llama":
        from transformers import LlamaConfig

        config = LlamaConfig(mlp_bias=False, **common)
        config.architectures = ["LlamaForCausalLM"]
    else:  # pragma: no cover - guarded by SHAPES
        raise ValueError(s.arch)
    config.dtype = torch.bfloat16
    return config


def analytic_param_count(kind: str) -> int:
    """Parameter count from the shape alone (tied embeddings counted once)."""
    s = SHAPES[kind]
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * s.intermediate_size + 2 * h
    if s.arch == "qwen3":
        layer += 2 * s.head_dim  # q_norm, k_norm
    embed = s.vocab_size * h * (1 if s.tie_word_embeddings else 2)
    return embed + s.num_hidden_layers * layer + h


def meta_param_count(config: Any) -> int:
    """Parameters of the model ``config`` describes, instantiated on the meta device (free)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # shared (tied) parameters once


# =========================================================================== building
def _is_built(path: pathlib.Path) -> bool:
    return (path / BUILD_MARKER).is_file() and (path / "config.json").is_file()


def built_model_path(kind: str, cache_dir: pathlib.Path) -> pathlib.Path:
    if kind == "tiny":
        from genlm_vlm.testing import tiny_model_path

        return tiny_model_path("llama")  # cheap; cached under $GENLM_VLM_CACHE or ~/.cache
    return cache_dir / f"{kind}-v{BUILD_VERSION}"


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int, logit_std: float) -> None:
    """Seeded in-place init on the parameters' own device: norms 1, lm_head (and tied
    embeddings) N(0, logit_std^2 / hidden), untied embeddings N(0, 1), other matrices
    N(0, 1 / fan_in); biases 0."""
    hidden = model.config.hidden_size
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    embed_name = next(
        n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight
    )
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if "norm" in name:
            param.fill_(1.0)
            continue
        if param.ndim == 1:
            param.zero_()
            continue
        if name == embed_name:
            std = logit_std / math.sqrt(hidden) if tied else 1.0
        elif name.startswith("lm_head"):
            std = logit_std / math.sqrt(hidden)
        else:
            std = 1.0 / math.sqrt(param.shape[1])
        values = torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32)
        param.copy_(values.mul_(std))
        del values


@torch.no_grad()
def _row_stats(
    model: torch.nn.Module, vocab: int, device: str, n: int = 4, length: int = 32
) -> dict:
    """Entropy / top probability of a few random prompts (are distributions non-uniform?)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (n, length), generator=gen).to(device)
    logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return {
        "entropy_mean": float(ent.mean()),
        "log_vocab": math.log(vocab),
        "top_prob_mean": float(logp.max(-1).values.exp().mean()),
        "rows_differ_max": float((logp[0] - logp[1]).abs().max()),
        "finite": bool(torch.isfinite(logp).all()),
    }


def build_model(
    kind: str,
    cache_dir: pathlib.Path,
    device: str,
    *,
    force: bool = False,
    seed: int = INIT_SEED,
    logit_std: float = LOGIT_STD,
) -> pathlib.Path:
    """Build (once) a random-weight bf16 model of ``kind`` under ``cache_dir``; returns its path."""
    final = built_model_path(kind, cache_dir)
    if kind == "tiny":
        return final
    if _is_built(final) and not force:
        return final
    from transformers import AutoModelForCausalLM

    from genlm_vlm.testing import _train_tokenizer

    s = SHAPES[kind]
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    os.chmod(tmp, 0o755)
    t0 = time.perf_counter()
    try:
        tokenizer = _train_tokenizer(
            "qwen2" if s.arch == "qwen3" else "llama", s.tokenizer_vocab, s.corpus_chars
        )
        t_tok = time.perf_counter() - t0
        config = make_config(kind)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)  # dtype from config.dtype (bf16)
        model = model.to(torch.bfloat16).eval()
        if (
            s.tie_word_embeddings
            and model.get_output_embeddings().weight is not model.get_input_embeddings().weight
        ):
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
        init_weights(model, seed, logit_std)
        n_params = sum(p.numel() for p in model.parameters())
        stats = _row_stats(model, s.vocab_size, device)
        if not stats["finite"]:
            raise RuntimeError(f"{kind}: non-finite logits after init")
        model.save_pretrained(tmp, max_shard_size="4GB", safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        del model
        meta = {
            "kind": kind,
            "build_version": BUILD_VERSION,
            "build_id": uuid.uuid4().hex,
            "shape": asdict(s),
            "params": n_params,
            "dtype": "bfloat16",
            "seed": seed,
            "logit_std": logit_std,
            "tokenizer_size": len(tokenizer),
            "device": device,
            "build_s": time.perf_counter() - t0,
            "tokenizer_s": t_tok,
            "row_stats": stats,
            "torch": torch.__version__,
            "transformers": _transformers_version(),
        }
        (tmp / BUILD_MARKER).write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        _free_cuda()
    return final


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _free_cuda() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def model_fingerprint(path: pathlib.Path) -> str:
    """Identifies one build of a model directory (its config and weight files)."""
    marker = path / BUILD_MARKER
    if marker.is_file():
        return json.loads(marker.read_text())["build_id"][:12]
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def read_model_config(path: pathlib.Path) -> dict:
    return json.loads((path / "config.json").read_text())

