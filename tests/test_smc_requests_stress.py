"""Adversarial cases for ``lm.smc(..., engine_path="requests")`` (:mod:`genlm_vlm.engine.particles`)
on the real CPU engine. Each run is compared with the per-token reference (``in_engine=False``,
same seed: tokens, log weights, ``log_marginal``, ESS history byte-identical), or checks that a
fault or a cancellation stays in its own run and leaves no request behind:

* a KV cache so small that vLLM preempts running particles mid-run (preemptions counted);
* prompts past a block boundary with resampling, beside per-token awaits, a burst and another
  run on the requests path;
* six concurrent runs, one of them cancelled mid-way; two runs whose particles share contexts;
* every particle cut by ``max_tokens``, a particle reaching ``max_model_len``, N = 1, forks of
  forks on a language with few strings, ``temperature``, ``force_eos``, EOS at the first step;
* a product of prompts and a LoRA adapter take the path (no fallback counted) and equal the reference.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import ENGINE_OPTS, _engine

from genlm_vlm.smc import Regex, TokenMask

pytestmark = pytest.mark.filterwarnings("ignore::genlm_vlm.smc.EmptyPosteriorWarning")

TIMEOUT = 180
TEXT = "def main():\n    return "

#: 10 KV blocks of 32 tokens: fewer than the particles of a run need once they diverge.
SMALL_KV_OPTS = {**ENGINE_OPTS, "max_model_len": 256, "block_size": 32, "kv_cache_memory_bytes": 10 * 32 * 2048}


def _prompt(lm, n: int) -> list[int]:
    """BOS and the first ``n - 1`` tokens of a repeated line of code."""
    tok = lm.tokenizer
    ids = tok.encode(TEXT * (2 + n // 4), add_special_tokens=False)
    assert len(ids) >= n - 1
    return [tok.bos_token_id, *ids[: n - 1]]


def _fingerprint(r) -> tuple:
    return ([(p.token_ids, p.log_weight, p.status) for p in r.particles], r.log_marginal, r.log_marginal_cut,
            r.ess, r.resampled_at, r.posterior)


def _same(a, b) -> None:
    assert _fingerprint(a) == _fingerprint(b)


def _idle(lm) -> None:
    s = lm.stats["particle_requests"]
    assert s["running"] == 0 and s["requests"] == 0, s


def _on_path(r) -> None:
    assert r.stats["engine_path"] == "requests", r.stats.get("engine_path_fallback")


# ------------------------------------------------------------------ 1. preemption


class Preemptions:
    """Counts the scheduler's preemptions (reads vLLM internals: in-process engine core)."""

    def __init__(self, lm) -> None:
        sched = lm._driver.llm.llm_engine.engine_core.engine_core.scheduler
        real = sched._preempt_request
        self.n = 0

        def counted(*args, **kwargs):
            self.n += 1
            return real(*args, **kwargs)

        sched._preempt_request = counted


@pytest.fixture(scope="module")
def small_kv_lm(model_paths):
    lm = _engine(model_paths["llama"], SMALL_KV_OPTS)
    lm.preemptions = Preemptions(lm)
    return lm


@pytest.mark.parametrize(("n", "steps", "ess"), [(6, 20, 0.0), (8, 24, 0.5)])
def test_preempted_particles_stay_exact(small_kv_lm, llama_lm, n, steps, ess):
    """A 60-token prompt (one shared block, one partial block per group): after four tokens every
    group needs a second block of its own and the cache has too few, so vLLM preempts running
    requests or leaves them waiting. The reference runs on an engine with room (rows are the same
    bits on any CPU engine; its per-token requests would not fit this cache at once)."""
    lm = small_kv_lm
    prompt = _prompt(lm, 60)
    args = dict(seed=3, ess_threshold=ess, temperature=2.0)
    before = lm.preemptions.n
    req = lm.smc_sync(prompt, Regex(r"[a-z ]+"), n, steps, engine_path="requests", **args)
    ref = llama_lm.smc_sync(prompt, Regex(r"[a-z ]+"), n, steps, in_engine=False, **args)
    _on_path(req)
    _same(req, ref)
    counts = req.stats["particle_requests"]
    assert counts["early_rows"] > 0 and counts["readded"] > 0  # vLLM did leave particles out
    if n == 6:
        assert lm.preemptions.n > before  # a running particle was preempted
    _idle(lm)


# ------------------------------------------------------------------ 2. long prompts beside traffic


async def test_long_prompts_with_resampling_beside_other_traffic(llama_lm):
    lm = llama_lm
    long = _prompt(lm, 150)  # past the first KV block whatever the block size (32 or 128)
    other = _prompt(lm, 190)
    lm_args = dict(seed=7, ess_threshold=0.9, temperature=1.5)
    queries = [long[:k] for k in (120, 133, 150, 171)] + [other]
    got = await asyncio.wait_for(asyncio.gather(
        lm.smc(long, Regex(r"[a-z ]+"), 10, 14, engine_path="requests", **lm_args),
        lm.smc(other, Regex(r"[a-z_ ]+"), 6, 12, engine_path="requests", seed=8, ess_threshold=0.9),
        lm.smc(long, Regex(r"[a-z ]+"), 5, 10, seed=9, ess_threshold=0.9, engine_path="bursts"),  # a burst
        *(lm.next_token_logprobs(q) for q in queries),
    ), TIMEOUT)
    a, b, burst, *rows = got
    _on_path(a)
    _on_path(b)
    assert burst.stats["engine_path"] == "bursts"
    assert len(a.resampled_at) >= 1 and len(b.resampled_at) >= 1
    _same(a, await lm.smc(long, Regex(r"[a-z ]+"), 10, 14, in_engine=False, **lm_args))
    _same(b, await lm.smc(other, Regex(r"[a-z_ ]+"), 6, 12, in_engine=False, seed=8, ess_threshold=0.9))
    _same(burst, await lm.smc(long, Regex(r"[a-z ]+"), 5, 10, in_engine=False, seed=9, ess_threshold=0.9))
    for q, row in zip(queries, rows, strict=True):
        lm.clear_cache()
        assert bool((row == await lm.next_token_logprobs(q)).all())
    _idle(lm)


# ------------------------------------------------------------------ 3. many runs, one cancelled

RUNS = [  # (constraint, n, max_tokens, seed, ess, temperature)
    (r"[a-z ]+", 6, 12, 1, 0.9, 1.0),
    (r"[a-z ]+", 4, 10, 2, 0.0, 1.0),
    (r"(ab|ba){3}", 8, 8, 3, 0.9, 1.0),
    (r"[0-9]+( [0-9]+)*", 5, 9, 4, 0.5, 0.7),
    (r"return [a-z]+", 3, 11, 5, 0.9, 1.3),
    (r"[a-z ]+", 6, 12, 1, 0.9, 1.0),  # the first run again: identical contexts in two runs
]


async def test_many_concurrent_runs_and_one_cancelled(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm, 12)
    started = threading.Event()
    calls = {"n": 0}

    def mask(gens):
        import numpy as np

        calls["n"] += 1
        if calls["n"] == 3:  # inside the sampler, two steps in: the run's requests are running
            started.set()
        allow = np.ones((len(gens), lm.vocab_size), dtype=bool)
        allow[:, lm.tokenizer.eos_token_id] = False  # no particle finishes: only the cancel ends it
        return allow

    def run(spec, in_engine=True):
        pattern, n, t, seed, ess, temp = spec
        kw = dict(engine_path="requests") if in_engine else dict(in_engine=False)
        return lm.smc(prompt, Regex(pattern), n, t, seed=seed, ess_threshold=ess, temperature=temp, **kw)

    cancelled = lm.stats["bursts"]["cancelled"]
    victim = asyncio.ensure_future(lm.smc(prompt, TokenMask(mask, "all"), 6, 400, seed=0,
                                          engine_path="requests"))
    tasks = [asyncio.ensure_future(run(s)) for s in RUNS]
    await asyncio.get_running_loop().run_in_executor(None, started.wait, TIMEOUT)
    victim.cancel()
    done = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
    with pytest.raises(asyncio.CancelledError):
        await victim
    for spec, got in zip(RUNS, done, strict=True):
        _on_path(got)
        _same(got, await run(spec, in_engine=False))
    _same(done[0], done[-1])
    await lm.next_token_logprobs(prompt)  # one more engine step: anything left would show
    _idle(lm)
    assert lm.stats["bursts"]["running"] == 0 and lm.stats["bursts"]["cancelled"] == cancelled + 1


# ------------------------------------------------------------------ 4. edge cases

EDGES = {
    "every particle cut by max_tokens": (r"[a-z ]+", 5, 4, dict(ess_threshold=0.9)),
    "one particle": (r"[a-z ]+", 1, 10, dict(ess_threshold=0.9)),
    "forks of forks": (r"(ab|ba){3}", 24, 8, dict(ess_threshold=0.99, resampling="multinomial",
                                                       temperature=2.0)),
    "temperature 0.3": (r"[a-z ]+", 6, 10, dict(ess_threshold=0.9, temperature=0.3)),
    "temperature 3": (r"[a-z ]+", 6, 10, dict(ess_threshold=0.9, temperature=3.0)),
    "force_eos": (r"[a-z]{1,3}", 6, 6, dict(ess_threshold=0.9, force_eos=True)),
    "eos at the first step": (None, 4, 5, {}),  # a mask that allows EOS only
    "eos or one token": (r"(a)?", 6, 5, dict(ess_threshold=0.9)),
    "stratified, target temperature": (r"[a-z ]+", 6, 8, dict(ess_threshold=0.9, resampling="stratified",
                                                              target_temperature=0.5)),
}


@pytest.mark.parametrize("case", list(EDGES))
def test_edge_cases_equal_the_reference(llama_lm, case):
    lm = llama_lm
    pattern, n, t, kw = EDGES[case]
    prompt = _prompt(lm, 9)

    def make():
        if pattern is not None:
            return Regex(pattern)
        import numpy as np

        eos = np.zeros(lm.vocab_size, dtype=bool)
        eos[lm.tokenizer.eos_token_id] = True
        return TokenMask(lambda gens: np.repeat(eos[None, :], len(gens), axis=0), "EOS only")

    req = lm.smc_sync(prompt, make(), n, t, seed=12, engine_path="requests", **kw)
    ref = lm.smc_sync(prompt, make(), n, t, seed=12, in_engine=False, **kw)
    _on_path(req)
    _same(req, ref)
    if case == "every particle cut by max_tokens":
        assert all(p.status == "cut" and len(p.token_ids) == t for p in req.particles)
    if case == "forks of forks":
        # few distinct contexts: the groups split again after each resampling
        assert len(req.resampled_at) >= 2 and req.stats["particle_requests"]["forks"] >= 3
    if pattern is None:
        assert all(p.status == "finished" and p.token_ids == [] for p in req.particles)
    _idle(lm)


async def _outcome(coro):
    try:
        return await asyncio.wait_for(coro, TIMEOUT)
    except Exception as e:  # noqa: BLE001 - compared below
        return e


async def test_a_particle_reaching_max_model_len_fails_as_in_a_burst(llama_lm):
    """``smc`` refuses prompt + max_tokens past the limit up front; a controller of its own runs
    until a context would reach it: the same ControllerError as the burst and the reference."""
    from test_controller_seam import Argmax

    from genlm_vlm.smc import drive

    lm = llama_lm
    limit = ENGINE_OPTS["max_model_len"]
    prompt = _prompt(lm, limit - 5)
    req = await _outcome(lm.run_controller(prompt, Argmax(3, 100), engine_path="requests"))
    burst = await _outcome(lm.run_controller(prompt, Argmax(3, 100), engine_path="bursts"))
    ref = await _outcome(drive(lm, prompt, Argmax(3, 100)))
    assert isinstance(ref, Exception), ref
    assert type(req) is type(burst) is type(ref), (req, burst, ref)
    assert str(req) == str(burst) == str(ref)
    assert "max_model_len" in str(req)
    _idle(lm)
    # one step short of the limit: every particle's last token is computed and kept
    ok = await _outcome(lm.run_controller(prompt, Argmax(3, 4), engine_path="requests"))
    assert ok == await drive(lm, prompt, Argmax(3, 4))
    _idle(lm)


@pytest.mark.parametrize("start", [
    [[5], [5, 6], [5, 6, 7], [5, 6]],  # different lengths, two particles sharing one
    [[], [9] * 40, [9] * 40, [9] * 39],  # past a block boundary (32) on one side, nothing on the other
])
async def test_start_contexts_of_different_lengths(llama_lm, start):
    from test_controller_seam import Argmax

    from genlm_vlm.smc import drive

    lm = llama_lm
    prompt = _prompt(lm, 8)
    got = await asyncio.wait_for(lm.run_controller(prompt, Argmax(4, 6), start=start, engine_path="requests"),
                                 TIMEOUT)
    assert got == await drive(lm, prompt, Argmax(4, 6), start=start)
    _idle(lm)


# ------------------------------------------------------------------ 5. fallbacks


def test_a_product_of_prompts_takes_the_path_and_equals_the_reference(llama_lm):
    lm = llama_lm
    p = _prompt(lm, 10)
    prompts = [p, p[:-2]]
    args = dict(seed=6, ess_threshold=0.9)
    before = dict(lm.stats["particle_requests"]["fallbacks"])
    req = lm.smc_sync(None, Regex(r"[a-z ]+"), 5, 6, prompts=prompts, engine_path="requests", **args)
    ref = lm.smc_sync(None, Regex(r"[a-z ]+"), 5, 6, prompts=prompts, in_engine=False, **args)
    _on_path(req)  # products of prompts run on the requests path: no fallback counted
    assert lm.stats["particle_requests"]["fallbacks"] == before
    _same(req, ref)


def test_lora_takes_the_path_and_equals_the_reference(model_paths, tmp_path_factory):
    from test_lora import LORA_OPTS, _make_adapter

    lm = _engine(model_paths["llama"], LORA_OPTS)
    lm.add_new_lora(_make_adapter(model_paths["llama"], tmp_path_factory.mktemp("lora") / "s", 4), "stress")
    prompt = [5, 9, 17, 33, 40]
    args = dict(seed=4, ess_threshold=0.9, lora_name="stress")
    req = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 8, engine_path="requests", **args)
    ref = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 8, in_engine=False, **args)
    _on_path(req)
    _same(req, ref)
    base = lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 8, engine_path="requests", seed=4, ess_threshold=0.9)
    _on_path(base)  # the same engine without an adapter takes the path too
    _same(base, lm.smc_sync(prompt, Regex(r"[a-z ]+"), 6, 8, in_engine=False, seed=4, ess_threshold=0.9))
    _idle(lm)


# ------------------------------------------------------------------ 6. runs that meet


async def test_identical_runs_started_mid_step_never_mix(llama_lm):
    """Two runs with the same prompt, constraint and seed share every context; a third starts
    while the first is inside its sampler step. Each equals the reference alone."""
    lm = llama_lm
    prompt = _prompt(lm, 14)
    inside, go = threading.Event(), threading.Event()
    calls = {"n": 0}
    import numpy as np

    allow = np.zeros(lm.vocab_size, dtype=bool)
    allow[3:400] = True

    def mask(gens):
        calls["n"] += 1
        if calls["n"] == 4:
            inside.set()
            go.wait(TIMEOUT)
        return np.repeat(allow[None, :], len(gens), axis=0)

    def run(f, seed, in_engine=True):
        kw = dict(engine_path="requests") if in_engine else dict(in_engine=False)
        return lm.smc(prompt, TokenMask(f, "ids 3..399"), 6, 10, seed=seed, ess_threshold=0.9, **kw)

    def plain(gens):
        return np.repeat(allow[None, :], len(gens), axis=0)

    first = asyncio.ensure_future(run(mask, 2))
    twin = asyncio.ensure_future(run(plain, 2))
    await asyncio.get_running_loop().run_in_executor(None, inside.wait, TIMEOUT)
    late = asyncio.ensure_future(run(plain, 3))  # submitted while the engine thread is in a step
    go.set()
    a, b, c = await asyncio.wait_for(asyncio.gather(first, twin, late), TIMEOUT)
    ref2 = await run(plain, 2, in_engine=False)
    for r in (a, b, c):
        _on_path(r)
    _same(a, ref2)
    _same(b, ref2)
    _same(c, await run(plain, 3, in_engine=False))
    _idle(lm)


# ------------------------------------------------------------------ 7. a tight engine (max_num_seqs=4, 64-token budget)


async def test_runs_in_lockstep_on_a_tight_engine_beside_each_other(llama_tight_lm):
    """Two runs of 8 particles, a 150-token prompt prefilled in chunks, on an engine that schedules
    at most 4 requests and 64 tokens a step: each run's groups are left out of steps (early rows,
    re-added requests) by the other's; both stay exact, and a third run whose mask fails mid-way
    fails alone."""
    import numpy as np

    lm = llama_tight_lm
    long = _prompt(lm, 150)
    short = _prompt(lm, 11)

    def bad_mask(gens):
        if any(len(g) >= 3 for g in gens):
            raise ZeroDivisionError("mask")
        return np.ones((len(gens), lm.vocab_size), dtype=bool)

    def run(prompt, seed, in_engine=True):
        kw = dict(engine_path="requests") if in_engine else dict(in_engine=False)
        return lm.smc(prompt, Regex(r"[a-z ]+"), 8, 10, seed=seed, ess_threshold=0.9, temperature=1.5, **kw)

    a, b, err = await asyncio.wait_for(asyncio.gather(
        run(long, 21), run(short, 22),
        lm.smc(short, TokenMask(bad_mask, "fails"), 5, 8, seed=1, engine_path="requests"),
        return_exceptions=True), TIMEOUT)
    assert isinstance(err, ZeroDivisionError), err
    for r in (a, b):
        assert not isinstance(r, BaseException), r
        _on_path(r)
    _same(a, await run(long, 21, in_engine=False))
    _same(b, await run(short, 22, in_engine=False))
    assert a.stats["particle_requests"]["early_rows"] + b.stats["particle_requests"]["early_rows"] > 0
    _idle(lm)


async def test_cancelling_a_run_in_lockstep_leaves_no_request(llama_tight_lm):
    """A run of 12 particles on max_num_seqs=4 is cancelled while some of its groups wait for a
    slot and others hold early rows; a run beside it finishes exactly."""
    import numpy as np

    lm = llama_tight_lm
    prompt = _prompt(lm, 20)
    started = threading.Event()
    calls = {"n": 0}

    def mask(gens):
        calls["n"] += 1
        if calls["n"] == 3:
            started.set()
        allow = np.ones((len(gens), lm.vocab_size), dtype=bool)
        allow[:, lm.tokenizer.eos_token_id] = False
        return allow

    victim = asyncio.ensure_future(lm.smc(prompt, TokenMask(mask, "no EOS"), 12, 300, seed=0, temperature=2.0,
                                          engine_path="requests"))
    other = asyncio.ensure_future(lm.smc(prompt, Regex(r"[a-z ]+"), 6, 8, seed=5, ess_threshold=0.9,
                                         engine_path="requests"))
    await asyncio.get_running_loop().run_in_executor(None, started.wait, TIMEOUT)
    victim.cancel()
    got = await asyncio.wait_for(other, TIMEOUT)
    with pytest.raises(asyncio.CancelledError):
        await victim
    _on_path(got)
    _same(got, await lm.smc(prompt, Regex(r"[a-z ]+"), 6, 8, seed=5, ess_threshold=0.9, in_engine=False))
    await lm.next_token_logprobs(prompt)
    _idle(lm)


async def test_runs_competing_for_a_small_kv_cache(small_kv_lm, llama_lm):
    """Two runs on the requests path, a burst and a seeded sample share a 10-block cache: vLLM
    preempts or holds back requests of each; every one still equals its reference, none hangs."""
    lm = small_kv_lm
    prompt = _prompt(lm, 40)
    args = [dict(seed=31, ess_threshold=0.9, temperature=2.0), dict(seed=32, ess_threshold=0.0, temperature=1.5)]
    a, b, burst, sample = await asyncio.wait_for(asyncio.gather(
        lm.smc(prompt, Regex(r"[a-z ]+"), 6, 16, engine_path="requests", **args[0]),
        lm.smc(prompt, Regex(r"[a-z ]+"), 5, 16, engine_path="requests", **args[1]),
        lm.smc(prompt, Regex(r"[a-z ]+"), 4, 12, seed=33, ess_threshold=0.9, engine_path="bursts"),
        lm.sample(prompt, max_tokens=20, eos_token_ids=[], seed=34),
    ), TIMEOUT)
    _on_path(a)
    _on_path(b)
    _same(a, await llama_lm.smc(prompt, Regex(r"[a-z ]+"), 6, 16, in_engine=False, **args[0]))
    _same(b, await llama_lm.smc(prompt, Regex(r"[a-z ]+"), 5, 16, in_engine=False, **args[1]))
    _same(burst, await llama_lm.smc(prompt, Regex(r"[a-z ]+"), 4, 12, seed=33, ess_threshold=0.9, in_engine=False))
    assert sample == await llama_lm.sample(prompt, max_tokens=20, eos_token_ids=[], seed=34)
    _idle(lm)
