"""The scoring path's decisions in the step loop, on a fake engine core (no vLLM; seconds).

Which requests a score job sends (a warm-up of the prompt's blocks, one-block segments), that
every value read was computed by its request whatever the prefix cache holds, dedup, the caps
that leave room for other work, cancellation, per-job errors, shutdown, and the model's
fallbacks to rows. Exactness on the real engine: tests/test_scoring_fast.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from fake_core import FakeCore, fake_row

from genlm_vlm import AsyncVirtualLM
from genlm_vlm.engine import EngineDriver
from genlm_vlm.engine.scoring import ScoreSpec

V = 64


def make(core: FakeCore | None = None) -> tuple[EngineDriver, FakeCore]:
    core = core or FakeCore()
    return EngineDriver("fake", core_factory=lambda: core), core


def expected(prompt: tuple[int, ...], cont: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([float(fake_row(prompt + cont[:t], V)[c]) for t, c in enumerate(cont)])


def seq(start: int, n: int) -> tuple[int, ...]:
    return tuple((start + 7 * i) % (V - 3) + 3 for i in range(n))


def score(driver: EngineDriver, *specs: ScoreSpec) -> list:
    return [f.result(timeout=10) for f in driver.submit_scores(list(specs))]


@pytest.fixture
def driver_core():
    driver, core = make()
    yield driver, core
    driver.shutdown()


CASES = [(1, 1), (3, 1), (4, 1), (4, 5), (5, 9), (7, 2), (8, 8), (13, 20), (2, 31)]


@pytest.mark.parametrize("k", [0, 3, 7])  # 7 > the fake's max_logprobs (5): from a captured row
@pytest.mark.parametrize("p,n", CASES)
def test_scores_are_the_rows_of_every_prefix(driver_core, p, n, k):
    driver, core = driver_core
    prompt, cont = seq(p, p), seq(100 + n, n)
    (res,) = score(driver, ScoreSpec(prompt, cont, k))
    assert res.logprobs.dtype == torch.float32 and res.logprobs.shape == (n,)
    assert torch.equal(res.logprobs, expected(prompt, cont))  # NaN (a row never computed) fails too
    if k:
        top = torch.topk(fake_row(prompt, V), k)
        assert res.top_ids.tolist() == top.indices.tolist() and torch.equal(res.top_logprobs, top.values)
        assert res.top_ids.dtype == torch.int64 and res.top_logprobs.dtype == torch.float32
    else:
        assert res.top_ids is None and res.top_logprobs is None
    # one-block segments after a warm-up of the prompt's full blocks
    bs = core.score_facts.block_size
    sent = [(toks, flags) for _, toks, flags in core.score_requests]
    ends = [len(t) for t, f in sent if f["prompt_logprobs"] is not None or len(t) >= p]
    w = (p - 1) // bs * bs
    assert all(len(t) <= w for t, f in sent if len(t) < p)  # the warm-up (and a top-k row of the prompt)
    assert all(b - a <= bs for a, b in zip(ends, ends[1:], strict=False)) and max(ends) == p + n - 1


@pytest.mark.parametrize("k", [0, 3, 7])
def test_top_k_alone(driver_core, k):
    driver, core = driver_core
    if k == 0:
        (res,) = score(driver, ScoreSpec((5, 6, 7), (), 0))
        assert res.logprobs.shape == (0,)
        return
    (res,) = score(driver, ScoreSpec((5, 6, 7), (), k))
    top = torch.topk(fake_row((5, 6, 7), V), k)
    assert res.top_ids.tolist() == top.indices.tolist() and torch.equal(res.top_logprobs, top.values)
    (_, toks, flags), = core.score_requests
    assert toks == (5, 6, 7) and flags["logprobs"] == (k if k <= 5 else None)  # vLLM's top-k where it can


def test_no_row_before_a_hit_is_ever_read(driver_core):
    """The same record three times: the later ones find every block cached, yet read only rows
    their own requests computed (the fake's unwritten rows are NaN)."""
    driver, core = driver_core
    spec = ScoreSpec(seq(1, 11), seq(50, 23), 3)
    first, *again = [score(driver, spec)[0] for _ in range(3)]
    for res in again:
        assert torch.equal(res.logprobs, first.logprobs) and torch.equal(res.top_ids, first.top_ids)
    stats = driver.stats()["scoring"]
    assert stats["rescored"] == 0 and stats["tokens_cached"] > 0 and stats["jobs"] == 3


def test_a_hit_past_the_first_row_is_sent_again_without_the_cache(driver_core):
    driver, core = driver_core
    core.hit_override = lambda toks: len(toks) - 1  # a cache that claims all but the last token
    prompt, cont = seq(3, 9), seq(30, 14)
    (res,) = score(driver, ScoreSpec(prompt, cont))
    assert torch.equal(res.logprobs, expected(prompt, cont))
    assert driver.stats()["scoring"]["rescored"] > 0
    assert any(not flags["read_cache"] for _, _, flags in core.score_requests)


def test_without_prefix_caching_a_job_is_one_request():
    core = FakeCore()
    core.score_facts = dataclasses.replace(core.score_facts, prefix_caching=False)
    driver, _ = make(core)
    try:
        prompt, cont = seq(2, 10), seq(9, 12)
        (res,) = score(driver, ScoreSpec(prompt, cont, 2))
        assert torch.equal(res.logprobs, expected(prompt, cont))
        (_, toks, flags), = core.score_requests
        assert toks == (prompt + cont)[:-1] and flags["prompt_logprobs"] == 2
    finally:
        driver.shutdown()


def test_a_shared_prompt_is_computed_once():
    """Multiple choice: 8 continuations of one prompt admitted together; the prompt's blocks are
    warmed once."""
    driver, core = make(FakeCore(max_num_seqs=64, token_budget=1000))
    prompt = seq(4, 21)
    conts = [seq(10 * i + 1, 5) for i in range(8)]
    results = score(driver, *(ScoreSpec(prompt, c) for c in conts))
    for c, res in zip(conts, results, strict=True):
        assert torch.equal(res.logprobs, expected(prompt, c))
    stats = driver.stats()["scoring"]
    assert stats["warmups"] == 1
    # the warm-up's 20 tokens, then per continuation a block from 20 and one token from 24
    assert core.score_computed == 20 + 8 * (4 + 1) < 8 * (21 + 5)
    assert stats["tokens_computed"] == core.score_computed and stats["tokens_scored"] == 40
    driver.shutdown()


def test_identical_queries_share_one_job():
    core = FakeCore(steps_per_request=3, gated=True)
    driver, _ = make(core)
    try:
        spec = ScoreSpec(seq(1, 6), seq(2, 5), 2)
        f1, f2 = driver.submit_scores([spec, spec])
        core.gate.release()
        core.wait_for(lambda: core.steps == 1)
        (f3,) = driver.submit_scores([spec])  # joins the job in flight
        core.gate.release(20)
        a, b, c = (f.result(timeout=10) for f in (f1, f2, f3))
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.logprobs, c.logprobs)
        assert a.logprobs is not b.logprobs and b.logprobs is not c.logprobs  # each its own tensors
        stats = driver.stats()["scoring"]
        assert (stats["jobs"], stats["dedup_joins"]) == (1, 2)
    finally:
        driver.shutdown()


def test_cancelling_a_score_job_aborts_its_requests():
    core = FakeCore(steps_per_request=3, gated=True)
    driver, _ = make(core)
    try:
        (fut,) = driver.submit_scores([ScoreSpec(seq(1, 9), seq(5, 12))])
        core.gate.release()
        core.wait_for(lambda: core.steps == 1)
        rids = {rid for rid, _, _ in core.score_requests}
        assert fut.cancel()
        core.gate.release(3)
        core.wait_for(lambda: rids <= set(core.aborted))  # the warm-up too: nobody else waits for it
        assert driver.stats()["scoring"]["cancelled"] == 1
        core.gate.release(50)
        prompt, cont = seq(3, 5), seq(7, 3)
        (f2,) = driver.submit_scores([ScoreSpec(prompt, cont)])
        core.gate.release(50)
        assert torch.equal(f2.result(timeout=10).logprobs, expected(prompt, cont))
        assert core.sink.rows == {}
    finally:
        driver.shutdown()


def test_a_refused_request_fails_its_job_only(driver_core):
    driver, core = driver_core
    core.refuse_token = 13
    good = ScoreSpec(seq(1, 5), (4, 5, 6))
    bad = ScoreSpec(seq(1, 5), (4, 13, 6))
    f_good, f_bad = driver.submit_scores([good, bad])
    with pytest.raises(ValueError, match="token 13 refused"):
        f_bad.result(timeout=10)
    assert torch.equal(f_good.result(timeout=10).logprobs, expected(good.prompt, good.continuation))
    assert driver.stats()["scoring"]["failed"] == 1 and core.sink.rows == {}


def test_a_failing_step_fails_its_score_jobs_and_the_loop_goes_on(driver_core):
    driver, core = driver_core
    core.fail_next = RuntimeError("boom")
    futs = driver.submit_scores([ScoreSpec(seq(1, 9), seq(2, 6)), ScoreSpec((3,), (4,))])
    for f in futs:
        with pytest.raises(RuntimeError, match="boom"):
            f.result(timeout=10)
    assert core.sink.rows == {}
    (res,) = score(driver, ScoreSpec((3,), (4, 5)))
    assert torch.equal(res.logprobs, expected((3,), (4, 5)))
    stats = driver.stats()["scoring"]
    assert (stats["active"], stats["waiting"]) == (0, 0)


def test_score_jobs_leave_room_for_rows():
    """A long scoring queue is admitted a step's token budget at a time: a row query sent after
    it is served at once, not after every score job."""
    core = FakeCore(gated=True, token_budget=16)
    driver, _ = make(core)
    try:
        score_futs = driver.submit_scores([ScoreSpec(seq(i, 8), seq(i + 1, 8)) for i in range(12)])
        (row_fut,) = driver.submit_logprobs([((1, 2, 3), None)])
        core.gate.release()
        assert torch.equal(row_fut.result(timeout=10), fake_row((1, 2, 3), V))
        assert sum(f.done() for f in score_futs) <= 1
        core.gate.release(200)
        for f in score_futs:
            f.result(timeout=10)
    finally:
        driver.shutdown()


def test_score_requests_hold_at_most_half_the_slots():
    core = FakeCore(max_num_seqs=8, token_budget=10**6)
    driver, _ = make(core)
    try:
        specs = [ScoreSpec((3, i % 50 + 3, 4), (5, 6)) for i in range(20)]  # one request each
        for spec, res in zip(specs, score(driver, *specs), strict=True):
            assert torch.equal(res.logprobs, expected(spec.prompt, spec.continuation))
        assert core.score_running_max == 4
    finally:
        driver.shutdown()


def test_shutdown_fails_waiting_and_running_score_jobs():
    # requests that never finish (a gated core would hold the engine thread inside its step)
    core = FakeCore(steps_per_request=10**9, token_budget=8)
    driver, _ = make(core)
    futs = driver.submit_scores([ScoreSpec(seq(i, 8), seq(i, 8)) for i in range(6)])
    core.wait_for(lambda: core.score_requests)
    driver.shutdown()
    for f in futs:
        with pytest.raises(RuntimeError, match="shut down"):
            f.result(timeout=10)


def test_a_core_without_scoring_says_so():
    driver, _ = make(FakeCore(scoring=False))
    try:
        assert not driver.scoring.supported
        (fut,) = driver.submit_scores([ScoreSpec((1, 2), (3,))])
        with pytest.raises(RuntimeError, match="prompt log-probabilities is off"):
            fut.result(timeout=10)
    finally:
        driver.shutdown()


# ------------------------------------------------------------------------------ the model's side
def fake_lm(core: FakeCore) -> AsyncVirtualLM:
    return AsyncVirtualLM(EngineDriver("fake", core_factory=lambda: core))


@pytest.mark.parametrize("scoring", [True, False])
def test_the_model_scores_through_the_loop_or_falls_back_to_rows(scoring):
    lm = fake_lm(FakeCore(scoring=scoring))
    try:
        prompt, cont = seq(1, 10), seq(20, 9)
        want = expected(prompt, cont)
        assert torch.equal(lm.continuation_logprobs_sync(prompt, cont), want)
        assert torch.equal(lm.continuation_logprobs_sync(prompt, cont, method="rows"), want)
        assert lm.score_sync(prompt, cont) == pytest.approx(float(want.double().sum()), abs=1e-9)
        got = asyncio.run(lm.continuation_logprobs(list(prompt), list(cont)))
        assert torch.equal(got, want)
        fallback = lm.stats["scoring"]["fallback"]
        assert fallback["rows_requested"] == 1
        assert fallback["unsupported"] == (0 if scoring else 3)
        # one job per call on the fast path (the sync and awaited continuation, score_sync):
        # scores are not kept in the output cache
        assert lm.stats["scoring"]["jobs"] == (3 if scoring else 0)
        with pytest.raises(ValueError, match="method must be one of"):
            lm.continuation_logprobs_sync(prompt, cont, method="fast")
    finally:
        lm.cleanup()


def test_topk_takes_a_cached_row_and_otherwise_asks_the_engine():
    core = FakeCore()
    lm = fake_lm(core)
    try:
        top = torch.topk(fake_row((4, 5), V), 3)
        got = lm.next_token_topk_sync((4, 5), 3)
        assert got.token_ids.tolist() == top.indices.tolist() and torch.equal(got.logprobs, top.values)
        assert lm.stats["scoring"]["jobs"] == 1 and lm.stats["rows"] == 0  # vLLM's top-k, no row
        # the output cache keeps a row asked for twice (docs/API.md, the output cache)
        lm.next_token_logprobs_sync((4, 5))
        lm.next_token_logprobs_sync((4, 5))
        got = asyncio.run(lm.next_token_topk((4, 5), 3))
        assert got.token_ids.tolist() == top.indices.tolist()
        assert lm.stats["scoring"]["fallback"]["topk_row_cached"] == 1 and lm.stats["scoring"]["jobs"] == 1
    finally:
        lm.cleanup()


def test_awaited_scores_are_batched_deduplicated_and_cancellable():
    core = FakeCore(steps_per_request=2, gated=True)
    lm = fake_lm(core)

    async def main() -> None:
        prompt, cont = seq(1, 7), seq(3, 6)
        tasks = [asyncio.ensure_future(lm.continuation_logprobs(prompt, cont)) for _ in range(3)]
        other = asyncio.ensure_future(lm.continuation_logprobs(prompt, seq(9, 6)))
        for _ in range(1000):  # yield to the batcher until it has handed the group over
            if core.score_requests:
                break
            await asyncio.sleep(0)
        core.wait_for(lambda: core.score_requests)
        other.cancel()
        while not other.done():  # its cancellation reaches the engine's inbox while the engine is held
            await asyncio.sleep(0)
        core.gate.release(100)
        got = await asyncio.gather(*tasks)
        assert all(torch.equal(g, expected(prompt, cont)) for g in got)
        assert len({id(g) for g in got}) == 3
        with pytest.raises(asyncio.CancelledError):
            await other

    try:
        asyncio.run(main())
        batcher = lm.stats["score"]
        assert batcher["dedup_joins"] == 2 and batcher["items"] == 2
        core.wait_for(lambda: lm.stats["scoring"]["cancelled"] == 1)
    finally:
        lm.cleanup()
