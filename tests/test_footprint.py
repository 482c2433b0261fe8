"""A memory footprint that fits the model: the CPU engine's KV cache is sized to what the model
can use (``max_num_seqs`` sequences of ``max_model_len`` tokens) unless the caller sets a size."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from genlm_vlm.engine.options import (
    CPU_DEFAULT_MAX_NUM_SEQS,
    kv_bytes_per_token,
    model_kv_cache_bytes,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_footprint import run_example  # noqa: E402


def test_readme_example_on_the_demo_model_reserves_what_the_engine_can_use():
    """The README example on the demo model (benchmarks/bench_footprint.py prints its peak
    memory: about 1 GB, target under 2 GB; memory targets live in the benchmarks)."""
    got = run_example()
    assert got["kv_bytes"] is not None and got["kv_bytes"] < 1 << 30
    # room for every sequence at full length: what the engine can use, no less, and no more
    # than one block per sequence beyond it
    need = got["max_num_seqs"] * got["max_model_len"]
    assert need <= got["kv_tokens"] <= need + got["max_num_seqs"] * 64


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
