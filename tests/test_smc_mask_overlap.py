"""``lm.smc(..., engine_path="requests", mask_overlap=True)``: each step's constraint masks are
computed on the engine's mask worker while vLLM runs the forward (:mod:`genlm_vlm.smc.prefetch`,
:mod:`genlm_vlm.engine.mask_overlap`).

* runs are byte-identical to the per-token reference and to the same path without the overlap,
  for every constraint kind, with resampling;
* a mask that raises on the worker fails only its run, at the step that would have used it, with
  the exception the synchronous path raises; a mask that calls the model from the worker is
  refused at once (no deadlock);
* cancelling a run whose masks are in flight leaves no work behind, and the engine's cleanup
  joins the thread;
* the option is checked like the others; the prefetch logic itself is tested on the controller
  alone (a key that does not match is dropped and recomputed, an exception is raised by the step).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading

import numpy as np
import pytest
from test_controller_seam import TIMEOUT
from test_smc import CONSTRAINTS
from test_smc_requests import _prompt, _same

from genlm_vlm.engine.mask_overlap import THREAD_NAME
from genlm_vlm.smc import Regex, TokenMask

pytestmark = pytest.mark.filterwarnings("ignore::genlm_vlm.smc.EmptyPosteriorWarning")


def _idle(lm) -> None:
    s = lm.stats["particle_requests"]
    assert s["running"] == 0 and s["requests"] == 0, s


def _every_third(lm):
    bits = np.zeros(lm.vocab_size, dtype=bool)
    bits[5:200:3] = True
    bits[lm.tokenizer.eos_token_id] = True
    return TokenMask(lambda gens: np.repeat(bits[None, :], len(gens), axis=0), "every third token")


@pytest.mark.parametrize("kind", ["json", "ebnf", "lark", "regex", "mask"])
def test_overlapped_masks_give_the_reference_run(llama_lm, kind):
    lm = llama_lm
    prompt = _prompt(lm)
    make = (lambda: _every_third(lm)) if kind == "mask" else CONSTRAINTS[kind]
    args = dict(seed=11, ess_threshold=0.9, force_eos=True, engine_path="requests")
    over = lm.smc_sync(prompt, make(), 12, 16, mask_overlap=True, **args)
    sync = lm.smc_sync(prompt, make(), 12, 16, **args)
    ref = lm.smc_sync(prompt, make(), 12, 16, in_engine=False, seed=11, ess_threshold=0.9, force_eos=True)
    assert over.stats["engine_path"] == "requests", over.stats.get("engine_path_fallback")
    _same(over, ref)
    _same(over, sync)
    assert over.resampled_at  # copies share their masks: the prefetch follows the resampled particles
    got = over.stats["mask_overlap"]
    # every step but the first takes the masks computed during its forward; none is dropped
    assert got["submitted"] == got["used"] == over.steps - 1 and got["discarded"] == 0, got
    assert "mask_overlap" not in sync.stats
    assert lm.stats["particle_requests"]["mask_overlap"]["thread"]
    _idle(lm)


def test_overlap_with_temperature_and_no_resampling(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm)
    args = dict(seed=3, ess_threshold=0.0, temperature=1.5, engine_path="requests")
    over = lm.smc_sync(prompt, CONSTRAINTS["json"](), 16, 20, mask_overlap=True, **args)
    ref = lm.smc_sync(prompt, CONSTRAINTS["json"](), 16, 20, in_engine=False, seed=3, ess_threshold=0.0,
                      temperature=1.5)
    _same(over, ref)
    assert over.stats["mask_overlap"]["used"] == over.steps - 1


def test_overlap_stays_exact_when_vllm_leaves_particles_out_of_a_step(llama_tight_lm):
    """max_num_seqs=4 and 16 particles: a run's step spans several engine steps (early rows,
    re-added requests); the masks computed ahead are still the next step's."""
    lm = llama_tight_lm
    prompt = _prompt(lm)
    args = dict(seed=3, ess_threshold=0.9)
    over = lm.smc_sync(prompt, CONSTRAINTS["ebnf"](), 16, 10, engine_path="requests", mask_overlap=True, **args)
    ref = lm.smc_sync(prompt, CONSTRAINTS["ebnf"](), 16, 10, in_engine=False, **args)
    _same(over, ref)
    counts = over.stats["particle_requests"]
    assert counts["early_rows"] > 0 and counts["readded"] > 0
    assert over.stats["mask_overlap"]["used"] == over.steps - 1
    _idle(lm)


def test_mask_overlap_is_checked_and_a_no_op_elsewhere(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm)
    with pytest.raises(TypeError, match="mask_overlap"):
        lm.smc_sync(prompt, Regex("[a-z]+"), 2, 2, mask_overlap="yes")
    with pytest.raises(TypeError, match="mask_overlap"):
        asyncio.run(lm.smc(prompt, Regex("[a-z]+"), 2, 2, mask_overlap=1))
    # bursts and the reference compute their masks in the step, as before
    burst = lm.smc_sync(prompt, CONSTRAINTS["ebnf"](), 4, 6, seed=1, mask_overlap=True, engine_path="bursts")
    ref = lm.smc_sync(prompt, CONSTRAINTS["ebnf"](), 4, 6, seed=1, mask_overlap=True, in_engine=False)
    _same(burst, ref)
    assert burst.stats["mask_overlap"]["submitted"] == 0 and ref.stats["mask_overlap"]["submitted"] == 0


async def test_a_mask_raising_on_the_worker_fails_its_run_at_that_step(llama_lm):
    """The exception the synchronous path raises, the same type and message, from the worker's
    thread, failing only that run; a good overlapped run beside it equals its reference."""
    lm = llama_lm
    prompt = _prompt(lm)
    allow = np.ones(lm.vocab_size, dtype=bool)
    where: list[str] = []

    def mask(generated):
        if any(len(g) >= 2 for g in generated):  # fine at bind and for two steps, then a bug
            where.append(threading.current_thread().name)
            raise ZeroDivisionError("the mask's own bug")
        return np.repeat(allow[None, :], len(generated), axis=0)

    before = lm.stats["faults"]["controller_errors"]
    good = lm.smc(prompt, CONSTRAINTS["json"](), 6, 8, seed=4, ess_threshold=0.9, engine_path="requests",
                  mask_overlap=True)
    bad = lm.smc(prompt, TokenMask(mask, "raises"), 4, 8, seed=4, engine_path="requests", mask_overlap=True)
    got, err = await asyncio.wait_for(asyncio.gather(good, bad, return_exceptions=True), TIMEOUT)
    assert isinstance(err, ZeroDivisionError) and str(err) == "the mask's own bug", err
    assert where and where[0].startswith(THREAD_NAME)  # raised on the worker, reported by the step
    assert lm.stats["faults"]["controller_errors"] == before + 1
    ref = await lm.smc(prompt, CONSTRAINTS["json"](), 6, 8, seed=4, ess_threshold=0.9, in_engine=False)
    _same(got, ref)
    where.clear()
    with pytest.raises(ZeroDivisionError, match="the mask's own bug"):  # the synchronous path: the same
        await asyncio.wait_for(lm.smc(prompt, TokenMask(mask, "raises"), 4, 8, seed=4, engine_path="requests"),
                               TIMEOUT)
    assert where and not where[0].startswith(THREAD_NAME)
    _idle(lm)


async def test_a_mask_calling_the_model_from_the_worker_is_refused(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm)
    allow = np.ones(lm.vocab_size, dtype=bool)

    def mask(generated):
        if any(len(g) >= 1 for g in generated):
            lm.next_token_logprobs_sync(prompt)  # would wait for the engine, which waits for this
        return np.repeat(allow[None, :], len(generated), axis=0)

    before = lm.stats["faults"]["blocking_calls"]
    with pytest.raises(RuntimeError, match="Do not block inside a controller or mask"):
        await asyncio.wait_for(lm.smc(prompt, TokenMask(mask, "blocks"), 3, 6, seed=2, engine_path="requests",
                                      mask_overlap=True), TIMEOUT)
    assert lm.stats["faults"]["blocking_calls"] == before + 1
    _idle(lm)


def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def test_cancelling_a_run_with_masks_in_flight_then_cleanup_joins_the_worker(fresh_lm):
    lm = fresh_lm
    prompt = _prompt(lm)
    allow = np.ones(lm.vocab_size, dtype=bool)
    entered, go = threading.Event(), threading.Event()

    def mask(generated):
        if any(len(g) >= 2 for g in generated):  # on the worker, during the forward
            entered.set()
            go.wait(TIMEOUT)
        return np.repeat(allow[None, :], len(generated), axis=0)

    before = set(_worker_threads())
    from genlm_vlm.smc import api

    _, controller = api.prepare(lm, prompt, TokenMask(mask, "held"), 4, 10, seed=0, mask_overlap=True)
    fut = lm._submit_burst(prompt, controller, None, None, None, "requests")
    assert entered.wait(TIMEOUT)
    assert fut.cancel()
    go.set()
    # the cancellation is read between steps; the run's work is dropped before its requests go
    _idle(lm)
    assert lm.stats["bursts"]["cancelled"] == 1 and lm.stats["bursts"]["running"] == 0
    assert not controller._prefetch.pending
    again = lm.smc_sync(prompt, CONSTRAINTS["json"](), 4, 6, seed=1, engine_path="requests", mask_overlap=True)
    ref = lm.smc_sync(prompt, CONSTRAINTS["json"](), 4, 6, seed=1, in_engine=False)
    _same(again, ref)
    mine = [t for t in _worker_threads() if t not in before]
    assert len(mine) == 1 and mine[0].is_alive()  # one worker per engine, made on first use
    lm.cleanup()
    assert not mine[0].is_alive()


# ------------------------------------------------------------------------------ the controller alone
def _controller(lm, **kw):
    from genlm_vlm.smc import api

    _, c = api.prepare(lm, _prompt(lm), CONSTRAINTS["ebnf"](), 6, 8, seed=5, ess_threshold=0.9, **kw)
    return c


def test_prefetched_masks_for_other_particles_are_dropped_and_recomputed():
    """Driven by hand over the mock model: work made for the wrong particles (or after a state
    changed) is waited for and dropped, the step computes its own, and the run is unchanged."""
    from genlm_vlm import MockAsyncLM
    from genlm_vlm.smc.controller import ParticleSet

    lm = MockAsyncLM(seed=1)
    pool = cf.ThreadPoolExecutor(1)
    try:
        runs = []
        for mode in ("off", "right", "wrong"):
            c = _controller(lm, mask_overlap=mode != "off")
            ps = ParticleSet(tuple(_prompt(lm)), c.n_particles)
            while live := ps.live():
                rows = lm.batch_next_token_logprobs_sync(ps.wanted(live))
                if ps.apply(c.step(rows, live), live):
                    break
                nxt = ps.live()
                if mode == "right":
                    c.prefetch_masks(nxt, pool.submit)
                elif mode == "wrong" and nxt:
                    c.prefetch_masks(nxt[:-1] or nxt + [nxt[0]], pool.submit)
            c.discard_prefetch()
            runs.append(c.result(ps.generated))
        off, right, wrong = runs
        assert right.steps >= 3
        _same(right, off)
        _same(wrong, off)
        assert right.stats["mask_overlap"]["used"] == right.steps - 1
        assert right.stats["mask_overlap"]["discarded"] == 0
        assert wrong.stats["mask_overlap"]["used"] == 0
        assert wrong.stats["mask_overlap"]["discarded"] == wrong.stats["mask_overlap"]["submitted"] > 0
    finally:
        pool.shutdown()
