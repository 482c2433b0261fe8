"""CPU tests of benchmarks/gpu/gpu_check.py (the GPU correctness + benchmark driver).

* the realistic-shape configs (Qwen3-0.6B, Llama-3-8B) are right: parameter counts from a
  meta-device instantiation (no weights allocated) match the shapes and the published sizes;
* the build path (random init, tied embeddings, bf16 safetensors, local tokenizer) on a
  2-layer Qwen3 with the real 151936 vocab;
* the prompt set;
* ``gpu_check.py --cpu-smoke`` end to end in a subprocess: tiny model, float32, runner v1,
  correctness PASS under default and chunked-prefill scheduling, then ``bench_async.py --quick``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc_mod():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_realistic_shape_configs(gc_mod):
    q = gc_mod.make_config("qwen3-0.6b")
    assert q.architectures == ["Qwen3ForCausalLM"] and q.model_type == "qwen3"
    assert (q.hidden_size, q.num_hidden_layers, q.num_attention_heads, q.num_key_value_heads) == (
        1024,
        28,
        16,
        8,
    )
    assert (q.head_dim, q.intermediate_size, q.vocab_size, q.tie_word_embeddings) == (
        128,
        3072,
        151936,
        True,
    )

    ll = gc_mod.make_config("llama-8b")
    assert ll.architectures == ["LlamaForCausalLM"] and ll.model_type == "llama"
    assert (
        ll.hidden_size,
        ll.num_hidden_layers,
        ll.num_attention_heads,
        ll.num_key_value_heads,
    ) == (4096, 32, 32, 8)
    assert (ll.head_dim, ll.intermediate_size, ll.vocab_size, ll.tie_word_embeddings) == (
        128,
        14336,
        128256,
        False,
    )

    for kind, cfg, lo, hi in (("qwen3-0.6b", q, 0.55e9, 0.65e9), ("llama-8b", ll, 7.9e9, 8.1e9)):
        n = gc_mod.meta_param_count(cfg)  # meta device: nothing allocated
        assert n == gc_mod.analytic_param_count(kind) == gc_mod.EXPECTED_PARAMS[kind]
        assert lo < n < hi, (kind, n)


def test_build_qwen3_mini(gc_mod, tmp_path):
    """The GPU build recipe, on CPU, at a small shape: loads in transformers, tied, bf16."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gc_mod.build_model("qwen3-mini", tmp_path, "cpu")
    assert path == tmp_path / f"qwen3-mini-v{gc_mod.BUILD_VERSION}"
    meta = json.loads((path / gc_mod.BUILD_MARKER).read_text())
    assert meta["params"] == gc_mod.analytic_param_count("qwen3-mini")
    stats = meta["row_stats"]
    assert stats["finite"] and stats["entropy_mean"] < stats["log_vocab"] - 0.5  # not uniform
    assert stats["rows_differ_max"] > 1.0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys  # tied
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.config.vocab_size == 151936
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert 256 < len(tok) < model.config.vocab_size  # model vocab exceeds the tokenizer's
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"
    # a second call reuses the build
    assert gc_mod.build_model("qwen3-mini", tmp_path, "cpu") == path
    assert json.loads((path / gc_mod.BUILD_MARKER).read_text())["build_id"] == meta["build_id"]


def test_prompt_set(gc_mod):
    prompts = gc_mod.make_prompts(151936, 500)
    assert prompts == gc_mod.make_prompts(151936, 500)
    lens = [len(p) for p in prompts]
    assert min(lens) == 1 and max(lens) == 500 and 55 <= len(prompts) <= 65
    assert all(3 <= t < 151936 for p in prompts for t in p)
    uniq = gc_mod.unique_prompts(prompts)
    assert len(uniq) < len(prompts)  # duplicates
    as_set = set(uniq)
    ext = [p for p in uniq if any(p[:k] in as_set for k in range(1, len(p)))]
    assert len(ext) >= 8  # extensions of other prompts
    siblings = [p for p in uniq if p[:-1] in as_set]
    assert max(sum(q[:-1] == p[:-1] for q in siblings) for p in siblings) >= 4  # a resample's forks
    small = gc_mod.make_prompts(512, 100)
    assert max(map(len, small)) <= 100 and all(t < 512 for p in small for t in p)


@pytest.mark.slow
def test_cpu_smoke(tmp_path):
    pytest.importorskip("vllm")
    env = dict(os.environ)
    env.pop("OUT", None)  # outputs go to --out
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--cpu-smoke",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-4000:]}"

    summary = (out / "gpu_check_summary.txt").read_text()
    assert re.search(r"^tiny\s+float32\s+v1\s+default\s+\d+\s.*\bPASS\b", summary, re.M), summary
    assert re.search(r"^tiny\s+float32\s+v1\s+chunked\s+\d+\s.*\bPASS\b", summary, re.M), summary
    assert "FAIL" not in summary and "no failures in this invocation" in summary

    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["failures"] == []
    rows = {
        r["sched"]: r
        for r in doc["correctness"]
        if (r["model"], r["dtype"], r["runner"]) == ("tiny", "float32", "v1")
    }
    assert set(rows) == {"default", "chunked"}
    for r in rows.values():
        assert r["verdict"] == "PASS" and r["engine_runner"] == "v1"
        assert r["max_abs"] < 1e-3 and r["top1_agree"] == 1.0
    forks = rows["default"]["forks"]
    assert forks["enabled"] and forks["copied"] >= 3 and forks["reprefilled"] == 0, forks
    # the chunked engine (max_num_batched_tokens=256) really ran many more steps
    assert rows["chunked"]["capture_apply_calls"] > 3 * rows["default"]["capture_apply_calls"]
    bench = [b for b in doc["bench"] if (b["model"], b["runner"]) == ("tiny", "v1")]
    assert {(b["workload"], b["n"]) for b in bench} == {
        (w, n) for w in ("smc", "smc_resample", "unique") for n in (4, 16)
    }
    assert all(b["ours_over_generate"] > 0 and b["ours_over_logprobs"] > 0 for b in bench)
    assert (out / "gpu_check_logs.txt").is_file()
