"""The output cache as ``from_name``'s defaults run it: a row is kept once it has been asked for
twice, each caller owns its row, and the byte bound counts the bytes really kept.

On the fake engine core (no vLLM: rows are deterministic, and can be made views into one batched
``[N, V]`` tensor as an accelerator's capture gives) and on the real engine (rows checked against
a transformers float32 forward).
"""

from __future__ import annotations

import asyncio
import gc

import torch
from fake_core import FakeCore, fake_row

from genlm_vlm import AsyncVirtualLM
from genlm_vlm.engine import EngineDriver
from genlm_vlm.testing import hf_reference_logprobs, random_prompts

V = 64


class BatchedCore(FakeCore):
    """A fake core whose rows of one step are views into one ``[k, V]`` tensor (as the rows of a
    batched capture, or of a batch moved between devices in one transfer, are)."""

    def step(self):  # noqa: ANN201 - the fake's StepResult
        before = set(self.sink.rows)
        result = super().step()
        new = [t for t in self.sink.rows if t not in before]
        if new:
            batch = torch.stack([self.sink.rows[t] for t in new])
            for i, t in enumerate(new):
                self.sink.rows[t] = batch[i]
        return result


def model(core: FakeCore, **kwargs) -> AsyncVirtualLM:
    return AsyncVirtualLM(EngineDriver("fake", core_factory=lambda: core), **kwargs)


def owns_memory(row: torch.Tensor) -> bool:
    return row.storage_offset() == 0 and row.untyped_storage().nbytes() == row.numel() * row.element_size()


async def test_fake_core_rows_asked_once_are_neither_kept_nor_copied():
    """SMC: every context is new at every step. No row is kept, and each row reaches its caller
    as the engine made it (the sink's tensor: no copy)."""
    core = FakeCore(vocab=V, max_num_seqs=64, max_model_len=256)
    made: list[torch.Tensor] = []

    def row_fn(tokens, vocab):
        made.append(fake_row(tokens, vocab))
        return made[-1]

    core.row_fn = row_fn
    lm = model(core)
    try:
        parts = [[3, 4, 5 + i] for i in range(16)]
        for t in range(4):
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts))
            assert all(any(r is m for m in made) for r in rows)
            parts = [p + [(t + i) % V] for i, p in enumerate(parts)]
        cache = lm.stats["cache"]
        assert cache["entries"] == 0 and cache["nbytes"] == 0 and cache["not_admitted"] == 64
        assert lm.stats["logprobs"]["cache_hits"] == 0
    finally:
        lm.cleanup()


async def test_fake_core_views_are_kept_compact_and_the_byte_bound_holds():
    """Rows that are views into a batched step: each caller gets a compact row of its own, and the
    cache keeps compact copies within ``max_bytes``, counted in bytes really kept."""
    core = BatchedCore(vocab=V, max_num_seqs=64, max_model_len=256)
    row_bytes = V * 4
    lm = model(core, cache_opts={"max_bytes": 5 * row_bytes})
    try:
        prompts = [[3, 4, 5 + i] for i in range(32)]
        for _ in range(3):  # the second round is kept (within the bound), the third may hit
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
            for p, r in zip(prompts, rows, strict=True):
                assert owns_memory(r) and torch.equal(r, fake_row(tuple(p), V))
        rows.append(lm.next_token_logprobs_sync(prompts[-1]))
        assert lm.stats["logprobs"]["cache_hits"] >= 1
        with lm.cache._lock:
            kept = list(lm.cache._lru.values())
        assert 0 < len(kept) <= 5 and lm.cache.nbytes <= 5 * row_bytes
        storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in kept}
        assert sum(storages.values()) == lm.cache.nbytes <= lm.cache.max_bytes
    finally:
        lm.cleanup()


async def test_fake_core_mutating_a_row_never_reaches_another_caller_or_a_later_hit():
    core = FakeCore(vocab=V, max_num_seqs=64, max_model_len=256)
    lm = model(core)
    p = [3, 4, 5]
    want = fake_row(tuple(p), V)
    try:
        first = await lm.next_token_logprobs(p)  # asked once: not kept, the caller's own
        first.zero_()
        a, b = await asyncio.gather(lm.next_token_logprobs(p), lm.next_token_logprobs(p))
        a.numpy()[:] = 1.0  # through a numpy view
        b.add_(5.0)  # in place through torch
        for hit in (await lm.next_token_logprobs(p), lm.next_token_logprobs_sync(p),
                    (await lm.batch_next_token_logprobs([p, p]))[1]):
            assert torch.equal(hit, want)
            hit.numpy()[0] = 99.0
        assert lm.stats["logprobs"]["cache_hits"] == 3 and lm.stats["sync"]["cache_hits"] == 1
    finally:
        lm.cleanup()


async def test_fake_core_rows_leave_no_reference_cycles():
    """Everything an awaited row goes through (job, ticket, the batcher's entry, the query) is
    freed by reference counting once the row is handed over: nothing waits for the garbage
    collector, which would also keep a row alive until it runs."""
    core = FakeCore(vocab=V, max_num_seqs=64, max_model_len=256)
    lm = model(core)
    try:
        await lm.next_token_logprobs([3, 4])  # warm up
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            parts = [[3, 4, 5 + i] for i in range(8)]
            for t in range(3):
                await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts))
                parts = [p + [t] for p in parts]
            gc.collect()
            ours = [type(o).__name__ for o in gc.garbage
                    if type(o).__module__.startswith("genlm_vlm") or isinstance(o, torch.Tensor)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert ours == []
    finally:
        lm.cleanup()


# ---------------------------------------------------------------------------------- real engine
async def test_rows_are_each_callers_own_on_the_real_engine(llama_lm, model_paths):
    """Joined awaits, later hits (awaited, blocking, batched) and rows asked once: mutating any of
    them in place, through torch or a numpy view, changes no other caller's row or later hit."""
    lm = llama_lm
    lm.clear_cache()
    p, q = [5, 6, 7, 8, 9], [5, 6, 7, 8, 10]
    ref_p, ref_q = hf_reference_logprobs(model_paths["llama"], [p, q])
    hits = lm.stats["logprobs"]["cache_hits"]
    a, b = await asyncio.gather(lm.next_token_logprobs(p), lm.next_token_logprobs(p))  # asked twice: kept
    assert a.data_ptr() != b.data_ptr()
    a.zero_()
    b.numpy()[:] = 1.0
    c = await lm.next_token_logprobs(p)
    assert float((c - ref_p).abs().max()) < 1e-4
    c.numpy()[:] = 2.0
    d = lm.next_token_logprobs_sync(p)
    assert float((d - ref_p).abs().max()) < 1e-4
    d.add_(3.0)
    e = await lm.batch_next_token_logprobs([p, q])
    assert float((e[0] - ref_p).abs().max()) < 1e-4 and float((e[1] - ref_q).abs().max()) < 1e-4
    assert lm.stats["logprobs"]["cache_hits"] - hits == 2  # c and e[0]; e[1] (q) was computed
    e[1].zero_()  # q asked once so far: not kept, this caller's own
    f = await lm.next_token_logprobs(q)  # computed again, and kept
    f.numpy()[:] = 4.0
    g = await lm.next_token_logprobs(q)  # a hit
    assert float((g - ref_q).abs().max()) < 1e-4
    assert lm.stats["logprobs"]["cache_hits"] - hits == 3


async def test_repeated_queries_get_cache_hits_on_the_real_engine(llama_lm, model_paths):
    """The same 64 contexts asked 4 times: computed in the first two rounds (a row is kept the
    second time it is asked for), served from the cache in the last two, all exact."""
    lm = llama_lm
    lm.clear_cache()
    prompts = random_prompts(64, len(lm.tokenizer), 3, 40, seed=7)
    prompts = list({tuple(p): p for p in prompts}.values())
    refs = hf_reference_logprobs(model_paths["llama"], prompts)
    before = lm.stats
    for _ in range(4):
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        assert max(float((r - q).abs().max()) for r, q in zip(rows, refs, strict=True)) < 1e-4
    after = lm.stats
    n = len(prompts)
    assert after["logprobs"]["cache_hits"] - before["logprobs"]["cache_hits"] == 2 * n
    assert after["rows"] - before["rows"] == 2 * n  # the engine computed two rounds only
    assert after["cache"]["entries"] == n and after["cache"]["nbytes"] == n * lm.vocab_size * 4
