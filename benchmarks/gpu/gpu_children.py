"""gpu_check.py's prompt set and the work of its subprocesses: building a model, the
transformers references, and genlm_vlm's rows on vLLM compared with them."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import random
import re
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu.gpu_models import (  # noqa: E402
    BUILD_MARKER,
    SCHEDS,
    _free_cuda,
    _transformers_version,
    build_model,
    log,
)


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

