"""Forks on the real engine: a resampled particle's siblings share the parent's KV, tail block
included, and compute one token each; rows match an HF float32 forward on every path.

The loop's decisions (which query forks which parent) are test_forks_unit.py's; here vLLM's
copy-on-write does the sharing, and the tests count the tokens it computes.
"""

from __future__ import annotations

import asyncio
import random

from conftest import TIGHT_OPTS, _engine, max_abs_diff
from test_sessions import COUNT_OPTS, check_rows, smc

from genlm_vlm.testing import hf_reference_logprobs

#: Parent contexts: under one block, on a block boundary, and 1 and 31 tokens past one
#: (block size 32 on the CPU build).
LENGTHS = (1, 5, 31, 32, 33, 63, 64, 65, 95)


def _delta(after: dict, before: dict, *keys: str) -> tuple[int, ...]:
    return tuple(after[k] - before[k] for k in keys)


async def test_siblings_compute_one_token_each_and_match_hf(lm, model_paths, arch):
    """For each parent length: the parent's row, then 4 siblings (one continues the parent's
    session in the same step as 3 forks): 4 tokens computed in all, every row exact."""
    lm.clear_cache()
    assert lm.stats["forks"]["enabled"], lm.stats["forks"]["why"]
    rng = random.Random(7)
    vocab = len(lm.tokenizer)
    seen = {}
    for n in LENGTHS:
        parent = [rng.randrange(3, vocab) for _ in range(n)]
        seen[tuple(parent)] = await lm.next_token_logprobs(parent)
        before = lm.stats
        kids = [parent + [t] for t in rng.sample(range(3, vocab), 4)]
        rows = await asyncio.gather(*(lm.next_token_logprobs(k) for k in kids))
        after = lm.stats
        seen.update(zip(map(tuple, kids), rows, strict=True))
        shared = "aligned" if n % 32 == 0 else "copied"
        assert _delta(after["forks"], before["forks"], shared, "reprefilled") == (3, 0), n
        assert after["forks"]["saved_tokens"] - before["forks"]["saved_tokens"] == 3 * (n % 32), n
        assert _delta(after["sessions"], before["sessions"], "continued", "forked") == (1, 3), n
        assert after["tokens"]["scheduled"] - before["tokens"]["scheduled"] == 4, n
    check_rows(model_paths[arch], seen)


async def test_smc_with_resampling_shares_every_fork(lm, model_paths, arch):
    """Random SMC (1-3 new tokens a step, resampling: forks, forks of forks, duplicates, drops):
    every fork is served by the parent's KV, and every row is exact."""
    lm.clear_cache()
    before = lm.stats
    seen = await smc(lm, n=12, steps=9, prompt_len=45, seed=11)
    after = lm.stats
    check_rows(model_paths[arch], seen)
    forked = after["sessions"]["forked"] - before["sessions"]["forked"]
    shared = sum(_delta(after["forks"], before["forks"], "copied", "aligned"))
    assert forked > 5 and shared == forked, (forked, after["forks"])


async def test_forks_save_the_tokens_a_reprefill_computes(model_paths):
    """The same resampling run with forks off re-prefills each fork's tail: more tokens, the
    same rows."""
    counts = {}
    rows = {}
    for forks in (True, False):
        lm = _engine(model_paths["llama"], COUNT_OPTS, forks=forks)
        lm.clear_cache()
        before = lm.stats
        rows[forks] = await smc(lm, n=8, steps=6, prompt_len=50, seed=12, resample_every=2)
        after = lm.stats
        counts[forks] = (after["tokens"]["scheduled"] - before["tokens"]["scheduled"],
                         after["forks"]["reprefilled"] - before["forks"]["reprefilled"])
    assert rows[True].keys() == rows[False].keys()
    assert max_abs_diff(list(rows[True].values()), list(rows[False].values())) < 1e-4
    assert counts[False][1] > 0 and counts[True][1] == 0
    assert counts[True][0] < counts[False][0], counts
    check_rows(model_paths["llama"], rows[True])


async def test_a_released_parent_is_reprefilled(lm, model_paths, arch):
    """The parent's session is released before its sibling arrives: no fork, and the row is
    still exact (the prefix cache serves the full blocks)."""
    lm.clear_cache()
    rng = random.Random(13)
    parent = [rng.randrange(3, len(lm.tokenizer)) for _ in range(45)]
    await lm.next_token_logprobs(parent)
    await lm.next_token_logprobs(parent + [5])  # continues the parent
    lm.release_sessions()
    before = lm.stats
    row = await lm.next_token_logprobs(parent + [6])
    after = lm.stats
    assert _delta(after["sessions"], before["sessions"], "forked", "opened") == (0, 1)
    assert max_abs_diff([row], hf_reference_logprobs(model_paths[arch], [parent + [6]])) < 1e-4


async def test_chunked_prefill_and_long_forks_under_a_tight_budget(model_paths):
    """A 200-token parent prefilled in chunks of 64 tokens, 6 siblings with max_num_seqs=4, and
    a fork that extends the parent by 70 tokens (its own prefill chunked too)."""
    lm = _engine(model_paths["llama"], TIGHT_OPTS)
    lm.clear_cache()
    rng = random.Random(14)
    vocab = len(lm.tokenizer)
    parent = [rng.randrange(3, vocab) for _ in range(200)]
    seen = {tuple(parent): await lm.next_token_logprobs(parent)}
    before = lm.stats
    kids = [parent + [t] for t in range(3, 9)] + [parent + [rng.randrange(3, vocab) for _ in range(70)]]
    rows = await asyncio.gather(*(lm.next_token_logprobs(k) for k in kids))
    after = lm.stats
    seen.update(zip(map(tuple, kids), rows, strict=True))
    check_rows(model_paths["llama"], seen)
    assert after["forks"]["copied"] - before["forks"]["copied"] >= 1


def test_the_scheduler_falls_back_when_the_parent_cannot_be_shared(fresh_lm, model_paths):
    """Forks sent straight to the core, past the step loop's own checks: the parent aborted
    before the fork is scheduled, a parent under another cache key (different tokens), and a
    parent that never existed. Each fork is computed in full (exact row) and the scheduler
    says why."""
    driver = fresh_lm._driver
    core = driver.core
    rng = random.Random(15)
    vocab = len(fresh_lm.tokenizer)
    parent = [rng.randrange(3, vocab) for _ in range(45)]
    other = [rng.randrange(3, vocab) for _ in range(45)]
    # "tokens": the other parent's first block (a prefix-cache hit), then a different tail
    kids = {"gone": parent + [7], "tokens": other[:32] + parent[32:] + [8], "unknown": parent + [9]}

    def run(rids: list[str]) -> dict:
        """Step the core until these requests finish (engine thread, no loop jobs in flight)."""
        done, cached = set(), {}
        for _ in range(50):
            for out in core.step().outputs:
                if out.request_id in rids and out.finish_reason is not None:
                    done.add(out.request_id)
                    if out.prefill_stats is not None:
                        cached[out.request_id] = out.prefill_stats.num_local_cached_tokens
            if done >= set(rids):
                return cached
        raise AssertionError(f"{set(rids) - done} did not finish in 50 steps")

    def scenario() -> tuple[dict, dict, dict]:
        core.add_rows("t-parent", list(parent), "t-parent.0", None, True)
        core.add_rows("t-other", list(other), "t-other.0", None, True)
        run(["t-parent", "t-other"])
        before = core.work()["fallback_reasons"]
        core.add_rows("t-gone", kids["gone"], "t-gone.0", None, True, ("t-parent", 45))
        core.abort(["t-parent"])  # before the fork's step
        core.add_rows("t-tokens", kids["tokens"], "t-tokens.0", None, True, ("t-other", 45))
        core.add_rows("t-unknown", kids["unknown"], "t-unknown.0", None, True, ("t-nobody", 45))
        cached = run(["t-gone", "t-tokens", "t-unknown"])
        rows = {k: core.sink.pop(f"t-{k}.0") for k in kids}
        core.abort(["t-other", "t-gone", "t-tokens", "t-unknown"])
        return cached, rows, {**before}

    cached, rows, before = driver.call(scenario)
    after = driver.call(lambda: core.work()["fallback_reasons"])
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert grew.get("parent_gone", 0) == 2 and grew.get("tokens", 0) == 1, grew
    assert cached == {"t-gone": 32, "t-tokens": 32, "t-unknown": 32}  # the first block, from the prefix cache
    ref = hf_reference_logprobs(model_paths["llama"], list(kids.values()))
    assert max_abs_diff([rows[k] for k in kids], ref) < 1e-4


def test_forks_false_uses_vllms_own_scheduler(model_paths):
    lm = _engine(model_paths["llama"], COUNT_OPTS, forks=False)
    scheduler = lm._driver.core._scheduler
    assert type(scheduler).__name__ == "Scheduler"
    assert lm.stats["forks"] == {**lm.stats["forks"], "enabled": False, "why": "forks=False"}
