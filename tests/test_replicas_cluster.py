"""ReplicaPool joining an existing two-node Ray cluster (``ray_address=``), started on this machine
with Ray's own ``ray.cluster_utils.Cluster``: a head node with 2 logical CPUs and one added node
with 1. The replicas ask for 1 CPU each and are spread (``scheduling_strategy="SPREAD"``): one per
node. Removing the added node mid-run fails only its replica's awaiters; with ``auto_restart`` the
replica comes back on the head node, which has room for it. Waits poll a condition with a
deadline.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import ENGINE_OPTS
from test_replicas_health import _check, _wait_for

from genlm_vlm import ReplicaDiedError
from genlm_vlm.testing import random_prompts

V = 512  # the tiny llama's vocabulary

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    worker = c.add_node(num_cpus=1)
    c.wait_for_nodes()
    try:
        yield c, worker
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


async def test_pool_across_two_nodes_survives_losing_one(cluster, model_paths):
    import ray

    from genlm_vlm import ReplicaPool

    c, worker = cluster
    path = model_paths["llama"]
    pool = ReplicaPool.from_name(path, 2, dict(ENGINE_OPTS), ray_address=c.address,
                                 actor_options={"scheduling_strategy": "SPREAD"},
                                 health_interval_s=0.2, auto_restart=True)
    try:
        head = ray.get_runtime_context().get_node_id()  # the driver joined through the head
        nodes = [r["node"] for r in pool.stats["replicas"]]
        assert sorted(nodes) == sorted([head, worker.node_id]), (nodes, head, worker.node_id)
        assert [s["node"] for s in pool.health["replicas"]] == nodes
        lost = nodes.index(worker.node_id)  # the replica on the node that will be removed
        kept = 1 - lost

        rng = random.Random(5)
        bases = [[rng.randrange(3, V) for _ in range(36)] for _ in range(2)]
        parts = [bases[i // 6] + [3 + i] for i in range(12)]
        rows = await asyncio.gather(*(pool.next_token_logprobs(p) for p in parts))  # a prompt per replica
        _check(path, parts, rows)

        # calls in flight on both replicas, then the worker node goes away
        victim = pool.actors[lost]
        ray.get(victim.hold.remote())
        parts = [p + [7] for p in parts]
        tasks = [asyncio.ensure_future(pool.next_token_logprobs(p)) for p in parts]
        await asyncio.wrap_future(victim.held.remote(1).future())
        c.remove_node(worker)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
        assert failed in ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]), (failed, results)
        for i in failed:
            assert isinstance(results[i], ReplicaDiedError) and results[i].replica == lost, results[i]
        ok = [i for i in range(12) if i not in failed]
        _check(path, [parts[i] for i in ok], [results[i] for i in ok])

        # auto_restart: the replica comes back on the node that is left (it has a free CPU)
        _wait_for(lambda: pool.health["replicas"][lost]["live"] and pool.health["replicas"][lost]["restarts"] == 1,
                  f"replica {lost} to come back")
        stats = pool.stats
        assert stats["replicas"][lost]["node"] == head and stats["replicas"][kept]["node"] == head
        assert stats["replicas"][kept]["restarts"] == 0
        parts = [p + [9] for p in parts]
        rows = await asyncio.gather(*(pool.next_token_logprobs(p) for p in parts))
        _check(path, parts, rows)
        fresh = random_prompts(6, V, 2, 50, seed=9)
        before = [r["routed"] for r in pool.stats["routing"]["replicas"]]
        rows = await asyncio.gather(*(pool.next_token_logprobs(p) for p in fresh))
        _check(path, fresh, rows)
        after = [r["routed"] for r in pool.stats["routing"]["replicas"]]
        assert after[lost] > before[lost]  # the new replica serves
    finally:
        pool.cleanup()
    assert not pool.health["checker"]["running"]
