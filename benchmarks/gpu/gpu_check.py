#!/usr/bin/env python
"""GPU check of genlm_vlm: correctness against transformers, then the throughput benchmark.

Runs on the GPU host (vLLM from ``install_offline.sh``; ``source /tmp/genlm_wheelhouse/env.sh``
first) from a checkout of this repository; nothing is downloaded. See benchmarks/gpu/CHECK.md.

Phases (``--phase``; each invocation may run one, results accumulate in ``--cache-dir``):

* ``build``: random-weight models of realistic shapes, written once to ``--cache-dir``
  (default ``/tmp/genlm_gpu_models``) as bf16 safetensors with a locally trained byte-level
  BPE tokenizer: ``qwen3-0.6b`` (Qwen3ForCausalLM, 0.6B params, vocab 151936, tied
  embeddings) and ``llama-8b`` (LlamaForCausalLM, 8.0B, vocab 128256). ``tiny`` is
  genlm_vlm.testing's tiny llama (float32).
* ``correctness``: for each model and model runner (``v2``: Model Runner V2, ``v1``), a fresh
  subprocess with ``VLLM_USE_V2_MODEL_RUNNER=1|0`` builds, for each dtype (bfloat16 /
  float32; ``--split-dtypes``: one subprocess per dtype), ``AsyncVirtualLM`` (asserting
  ``lm.engine_info.runner``) with default scheduling and again with
  ``max_num_batched_tokens=256, max_num_seqs=8`` (chunked prefill), scores ~56 prompts
  of lengths 1-500 (duplicates, extensions, a shared prefix family) through the sync batch
  path, the async path and one raw engine call with duplicates, and compares every row with a
  transformers forward of the same weights in the same dtype (GPU, one prompt at a time, no
  TF32, ``log_softmax`` in float32; computed once per model/dtype in its own subprocess and
  cached). Tolerances: float32 max |d| <= ``--tol-fp32`` (1e-3); bfloat16 max |d| <=
  ``--tol-bf16-max`` (0.25) and mean |d| <= ``--tol-bf16-mean`` (0.02), or, failing those,
  within ``--bf16-floor-factor`` (2) x the bf16 noise floor (HF bf16 vs HF fp32 on the same
  prompts: bf16 rounding alone). Every row must also be finite and normalised.
* ``bench``: ``benchmarks/bench_async.py`` per model and runner (subprocess), collecting its
  JSON; the summary tabulates ours/raw-generate and ours/logprobs=-1.

Outputs (``$OUT`` if set, else ``--out``): ``gpu_check_summary.txt``, ``gpu_check.json`` and
``gpu_check_logs.txt`` (log tails of failed subprocesses), rewritten after every step so a
killed run still leaves its partial results. Exit status 1 if any check of this invocation
failed. ``--cpu-smoke`` runs the whole pipeline on CPU with the tiny model, float32, runner v1
and ``bench_async.py --quick``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BENCH_SCRIPT = ROOT / "benchmarks" / "bench_async.py"

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


# =========================================================================== prompts
def make_prompts(vocab: int, max_len: int, n_random: int = 36, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts of lengths 1..max_len: ``n_random`` random ones (lengths 1, 2, 3
    and ``max_len`` among them), 6 exact duplicates, 10 extensions / truncations of earlier
    prompts and a family of 4 prompts sharing a long prefix; shuffled. Ids in [3, vocab)."""
    rng = random.Random(seed)

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    lens = [1, 2, 3, max_len][: max(0, n_random)]
    lens += [rng.randint(1, max_len) for _ in range(n_random - len(lens))]
    base = [rand(n) for n in lens]
    prompts = [list(p) for p in base]
    prompts += [list(base[i]) for i in rng.sample(range(len(base)), min(6, len(base)))]
    ext = max(1, min(32, max_len // 8))
    longs = [p for p in base if 2 <= len(p) <= max_len - ext] or base
    for k, n in ((4, 1), (2, 3), (2, ext)):
        for p in rng.sample(longs, min(k, len(longs))):
            prompts.append(p + rand(n))
    for p in rng.sample(longs, min(2, len(longs))):
        prompts.append(p[:-1] if len(p) > 1 else p + rand(1))
    shared = rand(max(1, min(300, max_len - 100)))
    for n in (1, 5, 17, 100):
        prompts.append(
            shared + rand(min(n, max_len - len(shared))) if len(shared) < max_len else shared
        )
    # a resampled particle: a parent whose context ends inside a KV block, and four one-token
    # siblings (the "forks" path awaits the parent first: one sibling continues its session,
    # three fork it and share its unfinished block)
    parent = rand(max(1, min(45, max_len - 1)))
    prompts += [parent] + [parent + rand(1) for _ in range(4)]
    rng.shuffle(prompts)
    assert all(1 <= len(p) <= max_len for p in prompts)
    return prompts


def unique_prompts(prompts: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    return list(dict.fromkeys(tuple(p) for p in prompts))


def prompts_hash(prompts: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest()[:12]


# =========================================================================== children
def _torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _device_info() -> dict:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["torch_cuda"] = torch.version.cuda
    return info


def child_build(spec: dict) -> dict:
    path = build_model(
        spec["kind"],
        pathlib.Path(spec["cache_dir"]),
        spec["device"],
        force=spec.get("force", False),
    )
    meta_file = path / BUILD_MARKER
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    return {"path": str(path), "meta": meta, "device_info": _device_info()}


def _load_hf(path: str, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    major_minor = tuple(int(x) for x in re.findall(r"\d+", _transformers_version())[:2])
    kw: dict[str, Any] = {"local_files_only": True}
    kw["dtype" if major_minor >= (4, 56) else "torch_dtype"] = dtype
    model = None
    if device != "cpu":
        try:
            model = AutoModelForCausalLM.from_pretrained(path, device_map=device, **kw)
        except (ImportError, ValueError) as e:  # no accelerate: load on CPU, then move
            log(f"device_map load failed ({e}); loading on CPU and moving")
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, **kw).to(device)
    return model.eval()


def child_hf(spec: dict) -> dict:
    """transformers reference rows (float32 log_softmax) of every distinct prompt, one file per
    dtype of ``spec["jobs"]``; the model is loaded (on the GPU) once per dtype."""
    device = spec["device"]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    prompts = [list(p) for p in json.loads(pathlib.Path(spec["prompts_file"]).read_text())]
    uniq = unique_prompts(prompts)
    out: dict[str, Any] = {"dtypes": {}}
    for job in spec["jobs"]:
        t0 = time.perf_counter()
        model = _load_hf(spec["model"], _torch_dtype(job["dtype"]), device)
        t_load = time.perf_counter() - t0
        vocab = int(model.config.vocab_size)
        rows = torch.empty((len(uniq), vocab), dtype=torch.float32)
        keep = True
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i, p in enumerate(uniq):
                ids = torch.tensor([p], dtype=torch.long, device=device)
                if keep:
                    try:
                        logits = model(input_ids=ids, logits_to_keep=1).logits
                    except TypeError:  # older transformers
                        keep = False
                if not keep:
                    logits = model(input_ids=ids).logits
                rows[i] = torch.log_softmax(logits[0, -1].float(), dim=-1).cpu()
        t_fwd = time.perf_counter() - t0
        attn = getattr(model.config, "_attn_implementation", None)
        del model
        _free_cuda()
        ent = -(rows.exp() * rows).sum(-1)
        meta = {
            "model": spec["model"],
            "dtype": job["dtype"],
            "device": device,
            "prompts": len(uniq),
            "vocab": vocab,
            "load_s": t_load,
            "forward_s": t_fwd,
            "attn_implementation": attn,
            "entropy_mean": float(ent.mean()),
            "entropy_min": float(ent.min()),
            "log_vocab": math.log(vocab),
            "top_prob_mean": float(rows.max(-1).values.exp().mean()),
            "transformers": _transformers_version(),
            "device_info": _device_info(),
        }
        dest = pathlib.Path(job["refs_file"])
        tmp = dest.with_suffix(".tmp")
        torch.save(
            {"key": job["key"], "prompts": [list(p) for p in uniq], "rows": rows, "meta": meta}, tmp
        )
        os.replace(tmp, dest)
        out["dtypes"][job["dtype"]] = meta
        log(f"HF {job['dtype']}: load {t_load:.0f}s, {len(uniq)} forwards {t_fwd:.1f}s")
    return out


def compare_rows(rows: torch.Tensor, refs: torch.Tensor) -> dict:
    d = (rows.float() - refs.float()).abs()
    per_prompt = d.amax(-1)
    lse = torch.logsumexp(rows.float(), dim=-1).abs()
    return {
        "max_abs": float(d.max()),
        "mean_abs": float(d.mean()),
        "top1_agree": float((rows.argmax(-1) == refs.argmax(-1)).float().mean()),
        "worst_prompt": int(per_prompt.argmax()),
        "lse_max_abs": float(lse.max()),
        "finite": bool(torch.isfinite(rows).all()),
    }


async def _gather_rows(lm: Any, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    import asyncio

    return list(await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts)))


def _score_all(
    lm: Any, prompts: list[list[int]], refs: torch.Tensor, fp32_refs: torch.Tensor | None = None
) -> dict[str, dict]:
    """Rows through four paths, each compared with the references (the sync path also with
    the float32 references, if given)."""
    import asyncio

    paths: dict[str, dict] = {}
    t1 = time.perf_counter()
    rows = lm.batch_next_token_logprobs_sync(prompts)  # deduplicated, one engine call
    paths["sync"] = compare_rows(rows, refs) | {"s": time.perf_counter() - t1}
    if fp32_refs is not None:
        c = compare_rows(rows, fp32_refs)
        paths["sync"]["vs_fp32"] = {k: c[k] for k in ("max_abs", "mean_abs", "top1_agree")}
    lm.clear_cache()  # the async pass recomputes (vLLM's prefix cache is warm now)
    t1 = time.perf_counter()
    rows = torch.stack(asyncio.run(_gather_rows(lm, prompts)))
    paths["async"] = compare_rows(rows, refs) | {"s": time.perf_counter() - t1}
    # duplicates inside one engine call (no dedup): the tags must keep them apart
    t1 = time.perf_counter()
    from genlm_vlm.engine import wait_all

    raw = wait_all(lm._driver.submit_logprobs([(tuple(p), None) for p in prompts]))
    rows = torch.stack([r.float().cpu() for r in raw])
    paths["raw_dups"] = compare_rows(rows, refs) | {"s": time.perf_counter() - t1}
    # forks: the prompts that others extend by one token first, then every prompt at once;
    # siblings of a parent fork its session (the engine copies its unfinished KV block)
    lm.clear_cache()
    t1 = time.perf_counter()
    as_set = {tuple(p) for p in prompts}
    parents = [p for p in as_set if any(len(q) == len(p) + 1 and q[:-1] == p for q in as_set)]
    before = lm.stats["forks"]
    asyncio.run(_gather_rows(lm, [list(p) for p in parents]))
    rows = torch.stack(asyncio.run(_gather_rows(lm, prompts)))
    after = lm.stats["forks"]
    paths["forks"] = compare_rows(rows, refs) | {
        "s": time.perf_counter() - t1,
        "enabled": after["enabled"],
        "why": after["why"],
        **{k: after[k] - before[k] for k in ("copied", "aligned", "reprefilled", "saved_tokens")},
    }
    return paths


def child_vllm(spec: dict) -> dict:
    """genlm_vlm rows under one runner, per dtype of ``spec["jobs"]`` and scheduling variant
    (one engine each, built one after the other in this process), compared with the refs."""
    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.engine import predict_v2_runner, vllm_version

    expected = spec["runner"]
    prompts = [list(p) for p in json.loads(pathlib.Path(spec["prompts_file"]).read_text())]
    on_gpu = torch.cuda.is_available() and spec["device"] != "cpu"
    out: dict[str, Any] = {
        "runner": expected,
        "env_VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        "predicted_v2": predict_v2_runner(),
        "vllm": vllm_version(),
        "device_info": _device_info(),
        "prompts": len(prompts),
        "dtypes": {},
    }
    for job in spec["jobs"]:
        dtype = job["dtype"]
        ref_doc = torch.load(job["refs_file"], weights_only=False)
        ref_index = {tuple(p): i for i, p in enumerate(ref_doc["prompts"])}
        refs = ref_doc["rows"][[ref_index[tuple(p)] for p in prompts]]
        fp32_refs = None  # for a bf16 job: the float32 reference too, when it exists
        if job.get("fp32_refs_file") and pathlib.Path(job["fp32_refs_file"]).is_file():
            doc32 = torch.load(job["fp32_refs_file"], weights_only=False)
            idx32 = {tuple(p): i for i, p in enumerate(doc32["prompts"])}
            fp32_refs = doc32["rows"][[idx32[tuple(p)] for p in prompts]]
            del doc32
        scheds: dict[str, dict] = {}
        out["dtypes"][dtype] = {"scheds": scheds, "unique_prompts": len(ref_index)}
        for sched in spec["scheds"]:
            res: dict[str, Any] = {"sched": sched}
            scheds[sched] = res
            opts: dict[str, Any] = {
                "dtype": dtype,
                "max_model_len": spec["max_model_len"],
                "seed": 0,
                "kv_cache_memory_bytes": int(spec["kv_cache_bytes"]),
                **SCHEDS[sched],
            }
            if on_gpu:
                free, total = torch.cuda.mem_get_info()
                res["gpu_free_gib_before"] = round(free / 2**30, 2)
                opts["gpu_memory_utilization"] = round(
                    min(spec["gpu_util"], free / total - 0.02), 3
                )
                if spec["eager"]:
                    opts["enforce_eager"] = True
            res["engine_opts"] = opts
            lm = None
            t0 = time.perf_counter()
            try:
                lm = AsyncVirtualLM.from_name(spec["model"], dict(opts))
                res["build_s"] = time.perf_counter() - t0
                res["engine_runner"] = lm.engine_info.runner
                res["vocab_size"] = lm.vocab_size
                if lm.engine_info.runner != expected:
                    raise AssertionError(
                        f"lm.engine_info.runner is {lm.engine_info.runner!r}, expected {expected!r}"
                    )
                if lm.vocab_size != refs.shape[1]:
                    raise AssertionError(
                        f"vLLM vocab {lm.vocab_size} != HF logit width {refs.shape[1]}"
                    )
                paths = _score_all(lm, prompts, refs, fp32_refs)
                res["paths"] = paths
                res["max_abs"] = max(p["max_abs"] for p in paths.values())
                res["mean_abs"] = max(p["mean_abs"] for p in paths.values())
                res["top1_agree"] = min(p["top1_agree"] for p in paths.values())
                res["lse_max_abs"] = max(p["lse_max_abs"] for p in paths.values())
                res["finite"] = all(p["finite"] for p in paths.values())
                stats = lm.stats
                res["engine_calls"] = stats["engine_calls"]
                res["capture_apply_calls"] = stats["capture_apply_calls"]
                res["forks"] = {k: v for k, v in paths["forks"].items() if k not in ("max_abs", "mean_abs")}
                log(
                    f"{dtype} {sched}: max |d| {res['max_abs']:.2e}, mean |d| {res['mean_abs']:.2e}, "
                    f"engine built in {res['build_s']:.0f}s"
                )
            except BaseException as e:  # noqa: BLE001 - recorded, reported as FAIL
                res["error"] = f"{type(e).__name__}: {e}"
                res["traceback"] = traceback.format_exc()[-4000:]
                log(f"{dtype} {sched}: {res['error']}")
            finally:
                if lm is not None:
                    try:
                        lm.cleanup()
                    except Exception:  # noqa: BLE001
                        pass
                lm = None
                _free_cuda()
                res["wall_s"] = time.perf_counter() - t0
                if on_gpu:
                    free, total = torch.cuda.mem_get_info()
                    res["gpu_free_gib_after"] = round(free / 2**30, 2)
    return out


CHILDREN = {"build": child_build, "hf": child_hf, "vllm": child_vllm}


def run_child_main(kind: str, spec_file: str, result_file: str) -> int:
    spec = json.loads(pathlib.Path(spec_file).read_text())
    try:
        result = CHILDREN[kind](spec)
        rc = 0
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        traceback.print_exc()
        rc = 1
    pathlib.Path(result_file).write_text(json.dumps(result, indent=2, default=str))
    sys.stdout.flush()
    # vLLM may leave non-daemon threads behind; the result is written, leave now.
    os._exit(rc)


# =========================================================================== orchestration
class Check:
    """One invocation: runs phases in subprocesses and keeps the summary up to date."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cache = pathlib.Path(args.cache_dir)
        self.state = self.cache / "results"
        for sub in ("correctness", "bench", "refs", "prompts", "logs", "specs"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        self.out = pathlib.Path(os.environ.get("OUT") or args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.t0 = time.perf_counter()
        self.failures: list[str] = []
        self.failed_logs: list[pathlib.Path] = []
        self.this_run: set[str] = set()
        self.builds: dict[str, dict] = {}
        self._floors: dict[str, dict] = {}
        self.skipped = False  # the last spawn() was skipped for lack of time

    # ---------------------------------------------------------------- subprocess plumbing
    def child_env(self, runner: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        env.setdefault("VLLM_FLOAT32_MATMUL_PRECISION", "highest")  # no TF32 in float32 runs
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        if self.device == "cuda":
            # compile caches where later invocations find them (/tmp persists on the host)
            env.setdefault("VLLM_CACHE_ROOT", str(self.cache / "vllm_cache"))
            env.setdefault("TRITON_CACHE_DIR", str(self.cache / "triton_cache"))
        if runner is not None:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
        return env

    def run_child(self, kind: str, name: str, spec: dict, runner: str | None = None) -> dict | None:
        spec_file = self.state / "specs" / f"{name}.json"
        result_file = self.state / "specs" / f"{name}.result.json"
        log_file = self.state / "logs" / f"{name}.log"
        spec_file.write_text(json.dumps(spec, indent=2))
        result_file.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            str(pathlib.Path(__file__).resolve()),
            "--_child",
            kind,
            "--_spec",
            str(spec_file),
            "--_result",
            str(result_file),
        ]
        t0 = time.perf_counter()
        log(f"start {name}")
        rc = self.spawn(cmd, self.child_env(runner), log_file)
        if rc is None:
            return None
        dt = time.perf_counter() - t0
        result = json.loads(result_file.read_text()) if result_file.is_file() else None
        if rc != 0 or result is None or "error" in result:
            why = (result or {}).get("error") or (
                "killed at its time limit" if rc == -9 else f"exit status {rc}"
            )
            self.fail(f"{name}: {why}", log_file)
            log(f"FAILED {name} after {dt:.0f}s: {why}")
            return None
        log(f"done {name} in {dt:.0f}s")
        return result

    def spawn(self, cmd: list[str], env: dict[str, str], log_file: pathlib.Path) -> int | None:
        """Run ``cmd`` (output to ``log_file``) within --child-timeout and what is left of
        --time-limit; its process group is killed at the limit (exit status -9). None: not
        started, too little time left (recorded as a failure)."""
        timeout = self.args.child_timeout
        self.skipped = False
        if self.args.time_limit:
            left = self.args.time_limit - (time.perf_counter() - self.t0) - 15
            if left < 30:
                self.skipped = True
                self.fail(
                    f"{log_file.stem}: skipped, --time-limit {self.args.time_limit:g}s reached"
                )
                log(f"skip {log_file.stem}: time limit")
                return None
            timeout = min(timeout, left)
        with open(log_file, "w") as fh:
            proc = subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, 9)  # the child and whatever it started
                except ProcessLookupError:
                    pass
                proc.wait()
                fh.write(f"\n[gpu_check] killed after {timeout:.0f}s\n")
                return -9
            except BaseException:
                os.killpg(proc.pid, 9)
                raise

    def fail(self, what: str, log_file: pathlib.Path | None = None) -> None:
        self.failures.append(what)
        if log_file is not None:
            self.failed_logs.append(log_file)

    # ---------------------------------------------------------------- phases
    def model_path(self, kind: str) -> pathlib.Path | None:
        path = built_model_path(kind, self.cache)
        if kind == "tiny" or _is_built(path):
            return path
        self.fail(f"{kind}: not built in {self.cache} (run --phase build first)")
        return None

    def phase_build(self) -> None:
        for kind in self.args.models:
            path = built_model_path(kind, self.cache)  # builds "tiny" (seconds, in-process)
            if kind == "tiny":
                log(f"tiny: genlm_vlm.testing llama at {path}")
                continue
            if _is_built(path) and not self.args.force_build:
                log(f"{kind}: already built at {path}")
                self.builds[kind] = json.loads((path / BUILD_MARKER).read_text())
                continue
            spec = {
                "kind": kind,
                "cache_dir": str(self.cache),
                "device": self.device,
                "force": self.args.force_build,
            }
            res = self.run_child("build", f"build-{kind}", spec)
            if res is not None:
                self.builds[kind] = res.get("meta") or {"path": res["path"]}
                if res.get("meta"):
                    m = res["meta"]
                    log(
                        f"{kind}: {m['params'] / 1e9:.3f}B params, built in {m['build_s']:.0f}s, "
                        f"row entropy {m['row_stats']['entropy_mean']:.2f} (log V = "
                        f"{m['row_stats']['log_vocab']:.2f})"
                    )
            self.write_outputs()

    def phase_correctness(self) -> None:
        a = self.args
        for kind in a.models:
            path = self.model_path(kind)
            if path is None:
                self.write_outputs()
                continue
            cfg = read_model_config(path)
            vocab = int(cfg["vocab_size"])
            max_model_len = min(
                a.max_model_len, int(cfg.get("max_position_embeddings") or a.max_model_len)
            )
            max_len = min(a.max_prompt_len, max_model_len - 1)
            prompts = make_prompts(vocab, max_len, a.num_prompts, a.prompt_seed)
            phash = prompts_hash(prompts)
            prompts_file = self.state / "prompts" / f"{kind}-{phash}.json"
            prompts_file.write_text(json.dumps(prompts))
            fp = model_fingerprint(path)
            log(
                f"{kind}: {len(prompts)} prompts ({len(unique_prompts(prompts))} distinct), "
                f"lengths {min(map(len, prompts))}-{max(map(len, prompts))}, vocab {vocab}"
            )
            jobs = []
            for dtype in a.dtypes:
                key = f"{kind}-{fp}-{dtype}-{phash}-{self.device}"
                jobs.append(
                    {
                        "dtype": dtype,
                        "key": key,
                        "refs_file": str(self.state / "refs" / f"{key}.pt"),
                    }
                )
            for j in jobs:  # bf16 rows are also compared with the fp32 reference, if any
                if j["dtype"] != "float32":
                    j["fp32_refs_file"] = j["refs_file"].replace(f"-{j['dtype']}-", "-float32-")
            missing = [j for j in jobs if not pathlib.Path(j["refs_file"]).is_file()]
            if missing:
                spec = {
                    "model": str(path),
                    "device": self.device,
                    "prompts_file": str(prompts_file),
                    "jobs": missing,
                }
                self.run_child("hf", f"hf-{kind}", spec)
            for j in jobs:
                if j not in missing:
                    log(
                        f"{kind} {j['dtype']}: HF reference cached ({pathlib.Path(j['refs_file']).name})"
                    )
            jobs = [j for j in jobs if pathlib.Path(j["refs_file"]).is_file()]
            if not jobs:
                self.write_outputs()
                continue
            groups = [[j] for j in jobs] if a.split_dtypes else [jobs]
            for runner in a.runners:
                for group in groups:
                    dts = "-".join(j["dtype"] for j in group)
                    spec = {
                        "model": str(path),
                        "runner": runner,
                        "device": self.device,
                        "prompts_file": str(prompts_file),
                        "jobs": group,
                        "scheds": a.scheds,
                        "max_model_len": max_model_len,
                        "kv_cache_bytes": int(a.kv_cache_gib * 2**30),
                        "gpu_util": a.gpu_util,
                        "eager": not a.compiled,
                    }
                    log_name = f"vllm-{kind}-{runner}-{dts}"
                    res = self.run_child("vllm", log_name, spec, runner=runner)
                    if self.skipped:
                        self.write_outputs()
                        continue
                    for j in group:
                        dtype = j["dtype"]
                        name = f"{kind}-{dtype}-{runner}"
                        sub = None
                        if res is not None and dtype in res.get("dtypes", {}):
                            sub = {k: v for k, v in res.items() if k != "dtypes"} | res["dtypes"][
                                dtype
                            ]
                        doc = {
                            "model": kind,
                            "dtype": dtype,
                            "runner": runner,
                            "refs_key": j["key"],
                            "model_path": str(path),
                            "eager": not a.compiled,
                            "time": self.started,
                            "child_ok": res is not None,
                            "log": log_name,
                            "result": sub,
                        }
                        (self.state / "correctness" / f"{name}.json").write_text(
                            json.dumps(doc, indent=2)
                        )
                        self.this_run.add(f"correctness/{name}")
                        for row in self.correctness_rows([doc]):
                            if row["verdict"] != "PASS":
                                self.fail(
                                    f"correctness {name} {row['sched']}: {row['reason']}",
                                    self.state / "logs" / f"{log_name}.log",
                                )
                    self.write_outputs()

    def phase_bench(self) -> None:
        a = self.args
        for kind in a.models:
            path = self.model_path(kind)
            if path is None:
                self.write_outputs()
                continue
            for runner in a.runners:
                name = f"bench-{kind}-{runner}"
                cmd = [
                    sys.executable,
                    str(BENCH_SCRIPT),
                    "--model",
                    str(path),
                    "--out",
                    str(self.state / "bench"),
                    "--tag",
                    name,
                    "--no-hf",
                ]
                if a.bench_quick:
                    cmd.append("--quick")
                else:
                    cmd += ["--n", *map(str, a.bench_n)]
                if self.device == "cuda":
                    opts = {
                        "dtype": a.bench_dtype,
                        "kv_cache_memory_bytes": None,
                        "gpu_memory_utilization": a.bench_gpu_util,
                    }
                    cmd += ["--engine-opts", json.dumps(opts)]
                cmd += shlex.split(a.bench_extra or "")
                log_file = self.state / "logs" / f"{name}.log"
                json_file = self.state / "bench" / f"{name}.json"
                json_file.unlink(missing_ok=True)
                log(f"start {name}: {shlex.join(cmd[1:])}")
                t0 = time.perf_counter()
                rc = self.spawn(cmd, self.child_env(runner), log_file)
                if rc is None:
                    self.write_outputs()
                    continue
                text = log_file.read_text(errors="replace")
                m = re.search(r"runner (v\d)", text)
                meta = {
                    "model": kind,
                    "runner": runner,
                    "rc": rc,
                    "wall_s": time.perf_counter() - t0,
                    "engine_runner": m.group(1) if m else None,
                    "time": self.started,
                    "command": shlex.join(cmd[1:]),
                }
                (self.state / "bench" / f"{name}.meta.json").write_text(json.dumps(meta, indent=2))
                self.this_run.add(f"bench/{name}")
                if rc != 0 or not json_file.is_file():
                    why = "killed at its time limit" if rc == -9 else f"exit status {rc}"
                    self.fail(f"{name}: bench_async.py {why}", log_file)
                    log(f"FAILED {name} (exit {rc})")
                elif meta["engine_runner"] != runner:
                    self.fail(
                        f"{name}: engine runner {meta['engine_runner']!r}, expected {runner!r}",
                        log_file,
                    )
                else:
                    log(f"done {name} in {meta['wall_s']:.0f}s")
                self.write_outputs()

    # ---------------------------------------------------------------- summary
    def tolerance(self, dtype: str) -> tuple[float, float | None]:
        a = self.args
        if dtype == "float32":
            return a.tol_fp32, None
        return a.tol_bf16_max, a.tol_bf16_mean

    def correctness_rows(self, docs: Sequence[dict]) -> list[dict]:
        rows = []
        for doc in docs:
            res = doc.get("result") or {}
            scheds = res.get("scheds") or {}
            base = {
                "model": doc["model"],
                "dtype": doc["dtype"],
                "runner": doc["runner"],
                "eager": doc.get("eager"),
                "time": doc.get("time"),
            }
            tol_max, tol_mean = self.tolerance(doc["dtype"])
            if not scheds:
                rows.append(
                    base
                    | {
                        "sched": "-",
                        "verdict": "FAIL",
                        "reason": "subprocess failed",
                        "tol_max": tol_max,
                        "tol_mean": tol_mean,
                    }
                )
                continue
            for sched, r in scheds.items():
                row = base | {
                    "sched": sched,
                    "tol_max": tol_max,
                    "tol_mean": tol_mean,
                    "prompts": res.get("prompts"),
                    "engine_runner": r.get("engine_runner"),
                }
                for k in (
                    "max_abs",
                    "mean_abs",
                    "top1_agree",
                    "lse_max_abs",
                    "build_s",
                    "wall_s",
                    "capture_apply_calls",
                    "forks",
                ):
                    row[k] = r.get(k)
                row["vs_fp32"] = ((r.get("paths") or {}).get("sync") or {}).get("vs_fp32")
                reason, row["criterion"] = "", "abs"
                if "error" in r:
                    reason = r["error"]
                elif r.get("engine_runner") != doc["runner"]:
                    reason = f"runner {r.get('engine_runner')} != {doc['runner']}"
                elif not r.get("finite"):
                    reason = "non-finite rows"
                elif r["lse_max_abs"] > 1e-3:
                    reason = f"rows not normalised (|logsumexp| {r['lse_max_abs']:.2g})"
                elif r["max_abs"] > tol_max:
                    reason = f"max |d| {r['max_abs']:.3g} > {tol_max:g}"
                elif sched == "default" and (r.get("forks") or {}).get("enabled") and (
                    r["forks"]["copied"] + r["forks"]["aligned"] < 3
                ):
                    reason = f"forks enabled but the siblings did not share their parent's KV ({r['forks']})"
                elif tol_mean is not None and r["mean_abs"] > tol_mean:
                    reason = f"mean |d| {r['mean_abs']:.3g} > {tol_mean:g}"
                if reason.startswith(("max |d|", "mean |d|")) and doc["dtype"] == "bfloat16":
                    # bf16 rounding alone (HF bf16 vs HF fp32) may already exceed the absolute
                    # tolerance; a row within k x that floor is as good as bf16 gets.
                    k = self.args.bf16_floor_factor
                    fl = self.floor_for(doc.get("refs_key", ""))
                    row["floor"] = fl
                    if k > 0 and fl is not None:
                        if (
                            r["max_abs"] <= k * fl["max_abs"]
                            and r["mean_abs"] <= k * fl["mean_abs"]
                        ):
                            reason, row["criterion"] = "", f"{k:g}x floor"
                        else:
                            reason += (
                                f"; also above {k:g}x the bf16 noise floor (max "
                                f"{k * fl['max_abs']:.3g}, mean {k * fl['mean_abs']:.3g})"
                            )
                row["verdict"] = "FAIL" if reason else "PASS"
                row["reason"] = reason
                rows.append(row)
        return rows

    def floor_for(self, bf16_key: str) -> dict | None:
        """HF bf16 vs HF fp32 rows of one model / prompt set (None without both references)."""
        if "-bfloat16-" not in bf16_key:
            return None
        if bf16_key not in self._floors:
            f16 = self.state / "refs" / f"{bf16_key}.pt"
            f32 = self.state / "refs" / f"{bf16_key.replace('-bfloat16-', '-float32-')}.pt"
            if not (f16.is_file() and f32.is_file()):
                return None
            a = torch.load(f16, weights_only=False)
            b = torch.load(f32, weights_only=False)
            c = compare_rows(a["rows"], b["rows"])
            self._floors[bf16_key] = {
                "max_abs": c["max_abs"],
                "mean_abs": c["mean_abs"],
                "top1_agree": c["top1_agree"],
                "entropy_mean_fp32": b["meta"]["entropy_mean"],
                "log_vocab": b["meta"]["log_vocab"],
                "top_prob_mean_fp32": b["meta"]["top_prob_mean"],
            }
        return self._floors[bf16_key]

    def noise_floor(self) -> list[dict]:
        """HF bf16 vs HF fp32 on the same prompts: the size of bf16 rounding on each model."""
        out = []
        for f in sorted((self.state / "refs").glob("*-bfloat16-*.pt")):
            m = re.match(r"(.+)-[0-9a-f]{12}-bfloat16-[0-9a-f]{12}-(cpu|cuda)$", f.stem)
            fl = self.floor_for(f.stem) if m else None
            if fl is not None:
                out.append({"model": m.group(1), "device": m.group(2), "refs_key": f.stem} | fl)
        return out

    def bench_docs(self) -> list[dict]:
        docs = []
        for meta_file in sorted((self.state / "bench").glob("bench-*.meta.json")):
            meta = json.loads(meta_file.read_text())
            json_file = meta_file.with_name(meta_file.name.replace(".meta.json", ".json"))
            doc = (
                json.loads(json_file.read_text())
                if json_file.is_file() and meta["rc"] == 0
                else None
            )
            docs.append({"meta": meta, "doc": doc})
        return docs

    def summary(self) -> tuple[str, dict]:
        a = self.args
        docs = [
            json.loads(f.read_text()) for f in sorted((self.state / "correctness").glob("*.json"))
        ]
        rows = self.correctness_rows(docs)
        floor = self.noise_floor()
        bench = self.bench_docs()
        L: list[str] = []
        L.append(
            f"genlm_vlm gpu_check  started {self.started}  device {self.device}  "
            f"phase {a.phase}  models {' '.join(a.models)}  ({time.perf_counter() - self.t0:.0f}s so far)"
        )
        envs = [d["result"] for d in docs if d.get("result") and "vllm" in d["result"]]
        if envs:
            e = envs[-1]
            di = e.get("device_info", {})
            L.append(
                f"vLLM {e['vllm']} on {di.get('gpu', 'CPU')} (torch {di.get('torch')}"
                + (f", CUDA {di['torch_cuda']}" if di.get("torch_cuda") else "")
                + ")"
            )
        for kind, m in self.builds.items():
            if "params" in m:
                L.append(
                    f"model {kind}: {m['params'] / 1e9:.3f}B params, vocab {m['shape']['vocab_size']}, "
                    f"tokenizer {m['tokenizer_size']}, init logit std {m['logit_std']}, "
                    f"random-prompt row entropy {m['row_stats']['entropy_mean']:.2f} nats "
                    f"(uniform: {m['row_stats']['log_vocab']:.2f})"
                )
        L.append("")
        L.append("== correctness: genlm_vlm rows vs transformers forward of the same weights ==")
        L.append(
            "(max/mean |d| in nats over every prompt x vocab entry; worst of the sync batch, "
            "async gather, raw duplicate and forks paths; +cg = --compiled engines; "
            "* = earlier invocation)"
        )
        head = (
            f"{'model':<11} {'dtype':<9} {'runner':<6} {'sched':<8} {'prompts':>7} "
            f"{'max|d|':>9} {'mean|d|':>9} {'top1':>6} {'tolerance':<22} result"
        )
        L.append(head)
        L.append("-" * len(head))
        for r in rows:
            tol = f"max<={r['tol_max']:g}" + (
                f" mean<={r['tol_mean']:g}" if r["tol_mean"] is not None else ""
            )
            if r.get("criterion", "abs") != "abs":
                tol = r["criterion"]
            mark = (
                ""
                if f"correctness/{r['model']}-{r['dtype']}-{r['runner']}" in self.this_run
                else "*"
            )

            def f(x: Any, spec: str) -> str:
                return "-" if x is None else format(x, spec)

            sched = r["sched"] + ("+cg" if r.get("eager") is False else "")
            L.append(
                f"{r['model']:<11} {r['dtype']:<9} {r['runner']:<6} {sched:<8} "
                f"{f(r.get('prompts'), 'd'):>7} {f(r.get('max_abs'), '.2e'):>9} "
                f"{f(r.get('mean_abs'), '.2e'):>9} {f(r.get('top1_agree'), '.3f'):>6} "
                f"{tol:<22} {r['verdict']}{mark}"
                + (f"  ({r['reason']})" if r["reason"] else "")
                + (
                    f"  [vs HF fp32: max {r['vs_fp32']['max_abs']:.2e} mean "
                    f"{r['vs_fp32']['mean_abs']:.2e}]"
                    if r.get("vs_fp32")
                    else ""
                )
            )
        if not rows:
            L.append("(no correctness results yet)")
        agg: dict[tuple, dict] = {}
        for r in rows:
            k = (r["model"], r["dtype"], r["runner"])
            g = agg.setdefault(k, {"max": None, "ok": True})
            if r.get("max_abs") is not None:
                g["max"] = max(g["max"] or 0.0, r["max_abs"])
            g["ok"] &= r["verdict"] == "PASS"
        if agg:
            L.append("")
            L.append(
                "max |d| per (model, dtype, runner): "
                + "; ".join(
                    f"{m} {d} {rn}: {'-' if g['max'] is None else format(g['max'], '.2e')} "
                    f"{'PASS' if g['ok'] else 'FAIL'}"
                    for (m, d, rn), g in agg.items()
                )
            )
        for nf in floor:
            L.append(
                f"bf16 noise floor ({nf['model']}, {nf['device']}): HF bf16 vs HF fp32 max |d| "
                f"{nf['max_abs']:.2e}, mean |d| {nf['mean_abs']:.2e}, top1 {nf['top1_agree']:.3f}; "
                f"fp32 row entropy {nf['entropy_mean_fp32']:.2f} nats (uniform "
                f"{nf['log_vocab']:.2f}), mean top prob {nf['top_prob_mean_fp32']:.3f}"
            )
        L.append("")
        L.append("== benchmark: bench_async.py (rows/s, medians; ours = AsyncVirtualLM) ==")
        head = (
            f"{'model':<11} {'runner':<6} {'workload':<12} {'N':>5} {'ours':>10} {'generate':>10} "
            f"{'decode':>8} {'lp=-1':>8} {'ours/generate':>13} {'ours/decode':>11} {'ours/lp=-1':>10}"
        )
        L.append(head)
        L.append("-" * len(head))
        bench_rows = []
        for b in bench:
            meta, doc = b["meta"], b["doc"]
            mark = "" if f"bench/bench-{meta['model']}-{meta['runner']}" in self.this_run else "*"
            if doc is None:
                L.append(
                    f"{meta['model']:<11} {meta['runner']:<6} FAILED (exit {meta['rc']}){mark}"
                )
                continue
            by = {(r["workload"], r["n"], r["system"]): r["rows_per_s"] for r in doc["results"]}
            for ra in doc["ratios"]:
                w, n = ra["workload"], ra["n"]
                row = {
                    "model": meta["model"],
                    "runner": meta["runner"],
                    "workload": w,
                    "n": n,
                    "ours": by.get((w, n, "ours")),
                    "generate": by.get((w, n, "ceiling")),
                    "decode": by.get((w, n, "decode")),
                    "logprobs": by.get((w, n, "logprobs")),
                    "ours_over_generate": ra["ours_over_ceiling"],
                    "ours_over_decode": ra.get("ours_over_decode"),
                    "ours_over_logprobs": ra["ours_over_logprobs"],
                }
                bench_rows.append(row)

                def g(x: Any, spec: str, suffix: str = "") -> str:
                    return "-" if x is None else format(x, spec) + suffix

                L.append(
                    f"{row['model']:<11} {row['runner']:<6} {w:<12} {n:>5} {g(row['ours'], ',.0f'):>10} "
                    f"{g(row['generate'], ',.0f'):>10} {g(row['decode'], ',.0f'):>8} "
                    f"{g(row['logprobs'], ',.0f'):>8} {g(row['ours_over_generate'], '.2f', 'x'):>13} "
                    f"{g(row['ours_over_decode'], '.2f', 'x'):>11} "
                    f"{g(row['ours_over_logprobs'], '.1f', 'x'):>10}{mark}"
                )
        if not bench:
            L.append("(no benchmark results yet)")
        L.append("")
        if self.failures:
            L.append(f"FAILURES in this invocation ({len(self.failures)}):")
            L.extend(f"  - {x}" for x in self.failures)
        else:
            L.append("no failures in this invocation")
        text = "\n".join(L) + "\n"
        doc = {
            "started": self.started,
            "device": self.device,
            "args": vars(a),
            "wall_s": time.perf_counter() - self.t0,
            "builds": self.builds,
            "correctness": rows,
            "correctness_raw": docs,
            "noise_floor": floor,
            "bench": bench_rows,
            "bench_docs": bench,
            "failures": self.failures,
            "summary": text,
        }
        return text, doc

    def write_outputs(self) -> str:
        text, doc = self.summary()
        (self.out / OUT_SUMMARY).write_text(text)
        (self.out / OUT_JSON).write_text(json.dumps(doc, indent=2, default=str))
        logs = []
        for f in dict.fromkeys(self.failed_logs):
            if f.is_file():
                tail = f.read_text(errors="replace")[-60_000:]
                logs.append(f"===== {f.name} (last {len(tail)} chars) =====\n{tail}\n")
        (self.out / OUT_LOGS).write_text("".join(logs) or "no failed subprocesses\n")
        return text

    def run(self) -> int:
        phase = self.args.phase
        log(f"device {self.device}; cache {self.cache}; outputs to {self.out}")
        if phase in ("build", "all"):
            self.phase_build()
        if phase in ("correctness", "all"):
            self.phase_correctness()
        if phase in ("bench", "all"):
            self.phase_bench()
        text = self.write_outputs()
        print()
        print(text, end="")
        log(
            f"wrote {self.out / OUT_SUMMARY}, {OUT_JSON}, {OUT_LOGS} "
            f"({time.perf_counter() - self.t0:.0f}s)"
        )
        return 1 if self.failures else 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--phase", choices=("build", "correctness", "bench", "all"), default="all")
    p.add_argument(
        "--models",
        nargs="+",
        choices=KINDS + TEST_KINDS,
        default=None,
        help="default: qwen3-0.6b (tiny with --cpu-smoke)",
    )
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS))
    p.add_argument(
        "--scheds",
        nargs="+",
        choices=tuple(SCHEDS),
        default=list(SCHEDS),
        help="correctness engines: default scheduling and/or chunked "
        "(max_num_batched_tokens=256, max_num_seqs=8)",
    )
    p.add_argument(
        "--cache-dir",
        default=os.environ.get("GENLM_GPU_CACHE", "/tmp/genlm_gpu_models"),
        help="models, HF references, per-step results and logs (persist between runs)",
    )
    p.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "results" / "gpu_check"),
        help="where the summary goes when $OUT is not set",
    )
    p.add_argument("--force-build", action="store_true", help="rebuild models even if present")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=36,
        help="random base prompts (duplicates, extensions and a prefix family are added)",
    )
    p.add_argument("--max-prompt-len", type=int, default=500)
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=4.0,
        help="kv_cache_memory_bytes of each correctness engine",
    )
    p.add_argument(
        "--gpu-util",
        type=float,
        default=0.85,
        help="cap on gpu_memory_utilization of correctness engines (lowered to the "
        "free fraction when an earlier engine's memory was not released)",
    )
    p.add_argument(
        "--split-dtypes",
        action="store_true",
        help="one vLLM subprocess per dtype (default: one per runner, engines built "
        "one after the other)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="correctness engines with vLLM's default torch.compile + CUDA graphs "
        "(default: enforce_eager=True, faster to start)",
    )
    p.add_argument("--tol-fp32", type=float, default=1e-3, help="float32: max |d| (nats)")
    p.add_argument("--tol-bf16-max", type=float, default=0.25, help="bfloat16: max |d| (nats)")
    p.add_argument("--tol-bf16-mean", type=float, default=0.02, help="bfloat16: mean |d| (nats)")
    p.add_argument(
        "--bf16-floor-factor",
        type=float,
        default=2.0,
        help="a bfloat16 row above the absolute tolerances still passes if its max and "
        "mean |d| are within this factor of the model's bf16 noise floor (HF bf16 "
        "vs HF fp32 on the same prompts; needs both dtypes); 0 disables",
    )
    p.add_argument("--bench-n", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--bench-dtype", choices=DTYPES, default="bfloat16")
    p.add_argument(
        "--bench-gpu-util",
        type=float,
        default=0.4,
        help="gpu_memory_utilization of each of bench_async's two vLLM engines",
    )
    p.add_argument(
        "--bench-extra",
        default="--logprobs-rows 32",
        help="extra bench_async.py arguments (one shell-quoted string)",
    )
    p.add_argument("--bench-quick", action="store_true", help="bench_async.py --quick")
    p.add_argument("--child-timeout", type=float, default=1800, help="seconds per subprocess")
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds for the whole invocation: a subprocess still running 15 s "
        "before it is killed (and reported), later steps are skipped, so the "
        "outputs are complete before an outside limit hits (default: 570 when "
        "$OUT is set, i.e. under the device tool's 10-minute limit; else none)",
    )
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="CPU self-test: tiny model, float32, runner v1, bench --quick",
    )
    p.add_argument("--_child", choices=tuple(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--_spec", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.models = args.models or ["tiny"]
        args.dtypes, args.runners = ["float32"], ["v1"]
        args.bench_quick = True
        args.bench_extra = ""
        args.kv_cache_gib = 0.25
        args.max_model_len = min(args.max_model_len, 512)
    args.models = args.models or ["qwen3-0.6b"]
    if args.time_limit is None:
        args.time_limit = 570.0 if os.environ.get("OUT") else 0.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args._child:
        return run_child_main(args._child, args._spec, args._result)
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
