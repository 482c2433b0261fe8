"""Lifecycle: cleanup, context managers, __del__, rebuilds, shutdown under load, warm-up."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import ENGINE_OPTS, HeldEngine

from genlm_vlm import AsyncVirtualLM, ClosedError


def _build(model_paths, **opts):
    return AsyncVirtualLM.from_name(model_paths["llama"], {**ENGINE_OPTS, **opts})


async def test_cleanup_idempotent_and_every_later_call_raises(model_paths):
    lm = _build(model_paths)
    lm.next_token_logprobs_sync([5, 6])
    lm.cleanup()
    lm.cleanup()
    with pytest.raises(ClosedError):
        lm.next_token_logprobs_sync([5, 6])
    with pytest.raises(RuntimeError, match="cleaned up"):
        await lm.next_token_logprobs([5, 6])
    with pytest.raises(ClosedError):
        lm.batch_next_token_logprobs_sync([[5, 6]])
    with pytest.raises(ClosedError):
        await lm.batch_next_token_logprobs([[5, 6]])
    with pytest.raises(ClosedError):
        await lm.sample([5, 6], 3, [])
    with pytest.raises(ClosedError):
        lm.add_new_lora("/nonexistent", "x")
    with pytest.raises(ClosedError):
        _ = lm.llm


async def test_pending_awaiters_get_a_clear_error_on_cleanup(model_paths):
    lm = _build(model_paths)
    held = HeldEngine(lm)
    inflight = [asyncio.ensure_future(lm.next_token_logprobs([5, i])) for i in range(3, 6)]
    await held.wait_entered()
    queued = [asyncio.ensure_future(lm.next_token_logprobs([6, i])) for i in range(3, 6)]
    await asyncio.sleep(0)
    # cleanup waits for the engine thread: release it from another thread once cleanup started
    closer = threading.Thread(target=lm.cleanup)
    closer.start()
    with pytest.raises(ClosedError):  # arriving during shutdown: rejected, not lost
        await lm.next_token_logprobs([7, 7])
    held.release()
    await asyncio.get_running_loop().run_in_executor(None, closer.join, 60)
    results = await asyncio.gather(*inflight, *queued, return_exceptions=True)
    assert all(isinstance(r, ClosedError) for r in results), results


def test_sync_context_manager(model_paths):
    with _build(model_paths) as lm:
        assert lm.next_token_logprobs_sync([5]).shape == (lm.vocab_size,)
    with pytest.raises(ClosedError):
        lm.next_token_logprobs_sync([5])


async def test_async_context_manager(model_paths):
    async with _build(model_paths) as lm:
        assert (await lm.next_token_logprobs([5])).shape == (lm.vocab_size,)
    with pytest.raises(ClosedError):
        await lm.next_token_logprobs([5])


def test_two_models_one_after_the_other(model_paths):
    first = _build(model_paths)
    a = first.next_token_logprobs_sync([5, 6, 7])
    first.cleanup()
    second = AsyncVirtualLM.from_name(model_paths["qwen2"], dict(ENGINE_OPTS))
    second.next_token_logprobs_sync([5, 6, 7])
    second.cleanup()
    third = _build(model_paths)
    assert float((third.next_token_logprobs_sync([5, 6, 7]) - a).abs().max()) < 1e-6
    third.cleanup()


def test_cleaning_one_engine_leaves_the_others_working(model_paths):
    """vLLM's own teardown destroys process-global state; other live engines must survive it."""
    a = _build(model_paths)
    b = AsyncVirtualLM.from_name(model_paths["qwen2"], dict(ENGINE_OPTS))
    c = _build(model_paths)
    ra, rb = a.next_token_logprobs_sync([5, 6, 7]), b.next_token_logprobs_sync([5, 6, 7])
    a.cleanup()
    b.clear_cache()
    assert float((b.next_token_logprobs_sync([5, 6, 7]) - rb).abs().max()) < 1e-6
    b.cleanup()
    c.clear_cache()
    assert float((c.next_token_logprobs_sync([5, 6, 7]) - ra).abs().max()) < 1e-6
    c.cleanup()


def test_del_at_interpreter_shutdown_is_silent(model_paths, tmp_path):
    script = tmp_path / "leak.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio
            from genlm_vlm import AsyncVirtualLM
            lm = AsyncVirtualLM.from_name({model_paths["llama"]!r}, {ENGINE_OPTS!r})
            print(asyncio.run(lm.next_token_logprobs([5, 6])).shape)
            # no cleanup: __del__ / interpreter shutdown must not raise
            """
        )
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Exception ignored" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_warm_up_primes_prefix_cache(model_paths):
    with _build(model_paths, disable_log_stats=False) as lm:
        prefix = [3 + i % 200 for i in range(300)]
        row = lm.warm_up(prefix)
        assert row.shape == (lm.vocab_size,)
        before, sessions_before = lm.stats["prefix_cache"], lm.stats["sessions"]
        lm.batch_next_token_logprobs_sync([prefix + [5], prefix + [6, 7]])
        after, sessions_after = lm.stats["prefix_cache"], lm.stats["sessions"]
        # one extension continues the warm-up's session (no prefill at all); the other forks
        # and reuses the prefix's full KV blocks from the prefix cache
        assert sessions_after["continued"] - sessions_before["continued"] == 1
        assert sessions_after["forked"] - sessions_before["forked"] == 1
        block = lm.engine_info.block_size
        assert after["hits"] - before["hits"] >= (len(prefix) // block) * block
