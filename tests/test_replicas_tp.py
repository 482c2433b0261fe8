"""A tensor-parallel engine inside a Ray replica (CPU: one core per rank)."""

from __future__ import annotations

import os
import types

import pytest
from conftest import ENGINE_OPTS, max_abs_diff

from genlm_vlm.replicas import launch
from genlm_vlm.testing import hf_reference_logprobs


def _fake_ray(gpus: int = 0):
    return types.SimpleNamespace(cluster_resources=lambda: {"CPU": 2, "GPU": gpus} if gpus else {"CPU": 2})


def test_a_tp_replica_binds_one_core_group_per_rank():
    opts = launch.actor_options(_fake_ray(), {"tensor_parallel_size": 2}, None, [0, 1, 2, 3])
    env = opts["runtime_env"]["env_vars"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3" and env["OMP_NUM_THREADS"] == "2"
    assert opts["num_cpus"] == 4
    one = launch.actor_options(_fake_ray(), {}, None, [1])["runtime_env"]["env_vars"]
    assert one["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    with pytest.raises(ValueError, match="num_cpus"):
        launch.actor_options(_fake_ray(), {"tensor_parallel_size": 2}, None, [0])
    assert launch.actor_options(_fake_ray(gpus=8), {"tensor_parallel_size": 4}, None, None)["num_gpus"] == 4


@pytest.mark.ray
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")
def test_tensor_parallel_replica_rows_match_hf(model_paths):
    pytest.importorskip("ray")
    from genlm_vlm import ReplicaPool

    path = model_paths["llama"]
    with ReplicaPool.from_name(path, num_replicas=1, engine_opts={**ENGINE_OPTS, "tensor_parallel_size": 2}) as pool:
        assert len(pool.replica_info[0]["cpus"]) == 2  # one core per rank by default
        prompts = [[1, 5, 9], list(range(3, 90))]
        rows = pool.batch_next_token_logprobs_sync(prompts)
        assert max_abs_diff(rows, hf_reference_logprobs(path, prompts)) < 1e-4
        assert pool.stats["replicas"][0]["capture_apply_calls"] > 0  # rows came through the TP ring
