"""A memory footprint that fits the model: the CPU engine's KV cache is sized to what the model
can use (``max_num_seqs`` sequences of ``max_model_len`` tokens) unless the caller sets a size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from genlm_vlm.engine.options import (
    CPU_DEFAULT_MAX_NUM_SEQS,
    kv_bytes_per_token,
    model_kv_cache_bytes,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The README's example, run on the shipped model; prints the reservation and the peak RSS.
SNIPPET = r"""
import json, pathlib, re, resource
import genlm_vlm
text = pathlib.Path("README.md").read_text()
code = re.search(r"## Example\n\n```python\n(.*?)```", text, re.S).group(1)
assert '"Qwen/Qwen3-0.6B"' in code
code = code.replace('"Qwen/Qwen3-0.6B"', "genlm_vlm.demo_model_path()")
code = code.replace("lm.cleanup()", "INFO = lm.engine_info\nlm.cleanup()")
scope = {"genlm_vlm": genlm_vlm}
exec(compile(code, "README example", "exec"), scope)
info = scope["INFO"]
print(json.dumps({"kv_bytes": info.kv_cache_bytes, "kv_tokens": info.kv_cache_tokens,
                  "max_num_seqs": info.max_num_seqs, "max_model_len": info.max_model_len,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_readme_example_on_the_demo_model_peaks_under_2_gb():
    proc = subprocess.run([sys.executable, "-c", SNIPPET], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["kv_bytes"] is not None and got["kv_bytes"] < 1 << 30
    # room for every sequence at full length: what the engine can use, no less
    assert got["kv_tokens"] >= got["max_num_seqs"] * got["max_model_len"]
    assert got["peak_rss"] < 2 * 2**30, got


def _config(tmp_path, **overrides):
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
              "max_position_embeddings": 1024, "torch_dtype": "float32", "model_type": "llama"}
    config.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_kv_size_is_sequences_times_length_times_bytes_per_token(tmp_path):
    model = _config(tmp_path)
    per_token = kv_bytes_per_token(json.loads((tmp_path / "config.json").read_text()), None)
    assert per_token == 2 * 4 * 2 * 64 * 4  # K and V, layers, KV heads, head dim, float32
    want = model_kv_cache_bytes(model, {"block_size": 32}, 0.3)
    assert want == CPU_DEFAULT_MAX_NUM_SEQS * (1024 // 32 + 1) * 32 * per_token
    # the caller's max_model_len / max_num_seqs / dtype change the size
    assert model_kv_cache_bytes(model, {"block_size": 32, "max_model_len": 64, "max_num_seqs": 4}, 0.3) == 16 << 20
    assert model_kv_cache_bytes(model, {"block_size": 32, "dtype": "bfloat16"}, 0.3) == want // 2


def test_kv_size_falls_back_to_the_fraction_when_it_would_not_fit_or_is_unknown(tmp_path):
    assert model_kv_cache_bytes(_config(tmp_path, max_position_embeddings=10**7), {}, 0.3) is None  # too big
    assert model_kv_cache_bytes(_config(tmp_path, layer_types=["sliding_attention"]), {}, 0.3) is None
    assert model_kv_cache_bytes("org/hub-id", {}, 0.3) is None


@pytest.mark.parametrize("name,hint", [("maxmodellen", "max_model_len"), ("max_num_seq", "max_num_seqs")])
def test_unknown_engine_option_names_the_nearest_one(name, hint):
    from genlm_vlm.engine.options import check_option_names

    with pytest.raises(TypeError, match=rf"'{name}' \(did you mean '{hint}'\?\)"):
        check_option_names({name: 1, "dtype": "float32"}, {"max_model_len", "max_num_seqs", "dtype"})
