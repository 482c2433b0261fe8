"""tensor_parallel_size=2 on the real CPU engine: rows come home from the rank-0 worker through
the shared ring and equal the HF float32 forward (single, batched, async, sessions, LoRA); the
ring's own contract and the CPU defaults without an engine."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from conftest import ENGINE_OPTS, max_abs_diff
from test_lora import _make_adapter
from test_sessions import smc

from genlm_vlm.engine.options import check_engine_opts, cpu_thread_binding
from genlm_vlm.rowring import RingWriterSink, RowRing, new_ring_path
from genlm_vlm.testing import hf_reference_logprobs, random_prompts

#: Chunked prefill and several steps per call (max_num_seqs=6 is also the ring's capacity).
TP_OPTS = {
    **ENGINE_OPTS,
    "tensor_parallel_size": 2,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 6,
    "enable_lora": True,
    "max_lora_rank": 8,
    "max_loras": 1,
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture(scope="module")
def adapter(model_paths, tmp_path_factory):
    return _make_adapter(model_paths["llama"], tmp_path_factory.mktemp("tp-lora") / "a", seed=1)


@pytest.fixture(scope="module")
def tp_lm(model_paths, llama_lm):
    """Built after another engine of this process has started (``llama_lm``): vLLM then caches
    its environment variables, and the TP build must still see the CPU binding it sets."""
    from genlm_vlm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(model_paths["llama"], dict(TP_OPTS))
    yield lm
    lm.cleanup()


def test_tp_rows_match_hf_single_and_batched(tp_lm, model_paths):
    prompts = random_prompts(10, len(tp_lm.tokenizer), 1, 150, seed=3)  # > 64 tokens: chunked
    rows = tp_lm.batch_next_token_logprobs_sync(prompts)
    ref = hf_reference_logprobs(model_paths["llama"], prompts)
    assert rows.shape == (len(prompts), tp_lm.vocab_size)
    assert max_abs_diff(rows, ref) < 1e-4
    one = tp_lm.next_token_logprobs_sync(prompts[0] + [5])
    assert max_abs_diff([one], hf_reference_logprobs(model_paths["llama"], [prompts[0] + [5]])) < 1e-4


def test_tp_rows_cross_the_shared_ring(tp_lm):
    ring = tp_lm._driver.sink.remote
    assert ring is not None and not tp_lm._driver.sink.instances  # no capture in this process
    before = ring.rows_written
    tp_lm.next_token_logprobs_sync([1, 2, 3, 4, 5, 6, 7])
    assert ring.rows_written > before and ring.overflowed == 0
    assert ring.writer_pid not in (0, os.getpid())  # written by the rank-0 worker process
    assert os.path.dirname(ring.path) in ("/dev/shm", os.path.dirname(new_ring_path()))


async def test_tp_async_queries_match_hf(tp_lm, model_paths):
    tp_lm.clear_cache()
    prompts = random_prompts(16, len(tp_lm.tokenizer), 1, 90, seed=4)
    rows = await asyncio.gather(*(tp_lm.next_token_logprobs(p) for p in prompts))
    assert max_abs_diff(rows, hf_reference_logprobs(model_paths["llama"], prompts)) < 1e-4


async def test_tp_smc_sessions_match_hf(tp_lm, model_paths):
    tp_lm.clear_cache()
    before = dict(tp_lm.stats["sessions"])
    seen = await smc(tp_lm, n=10, steps=8, prompt_len=40, seed=5)
    keys = list(seen)
    ref = hf_reference_logprobs(model_paths["llama"], [list(k) for k in keys])
    assert max_abs_diff([seen[k] for k in keys], ref) < 1e-4
    assert tp_lm.stats["mode"] == "sessions"
    assert tp_lm.stats["sessions"]["continued"] > before["continued"]  # one-token chunks, not prompts


def test_tp_lora_matches_hf_peft(tp_lm, adapter, model_paths):
    tp_lm.add_new_lora(adapter, "a")
    prompts = random_prompts(6, len(tp_lm.tokenizer), 1, 80, seed=6)
    rows = tp_lm.batch_next_token_logprobs_sync(prompts, lora_name="a")
    ref = hf_reference_logprobs(model_paths["llama"], prompts, lora_path=adapter)
    assert max_abs_diff(rows, ref) < 1e-4
    assert max_abs_diff(rows, hf_reference_logprobs(model_paths["llama"], prompts)) > 0.5


def test_tp_failed_step_leaves_no_rows_behind(tp_lm, model_paths):
    """A step that fails after the workers wrote its rows: the rows are taken out of the ring and
    dropped with the failed requests (not left for the next step to deliver)."""
    driver = tp_lm._driver
    core = driver.core
    real_step = core.step
    calls = {"n": 0}

    def step():
        result = real_step()
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom after the step")
        return result

    prompt = [1, 2, 3, 4, 9]
    core.step = step  # an instance attribute over CoreHandle.step, on the engine thread's next step
    try:
        with pytest.raises(RuntimeError, match="boom after the step"):
            tp_lm.next_token_logprobs_sync(prompt)
    finally:
        del core.step
    assert calls["n"] >= 1
    assert driver.sink.remote.drain({}) == 0 and driver.sink.rows == {}
    row = tp_lm.next_token_logprobs_sync(prompt)
    assert max_abs_diff([row], hf_reference_logprobs(model_paths["llama"], [prompt])) < 1e-4


def test_tp_cleanup_removes_workers_and_ring(model_paths):
    from genlm_vlm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(model_paths["llama"], {**ENGINE_OPTS, "tensor_parallel_size": 2})
    lm.next_token_logprobs_sync([1, 2, 3])
    ring = lm._driver.sink.remote
    path, worker = ring.path, ring.writer_pid
    assert os.path.exists(path) and _alive(worker)
    t0 = time.monotonic()
    lm.cleanup()
    took = time.monotonic() - t0
    assert not os.path.exists(path)
    assert not _alive(worker)
    print(f"tensor-parallel cleanup took {took:.2f} s")  # target < 3 s (vLLM alone: ~8 s)


# ---------------------------------------------------------------- without an engine
def test_ring_round_trip_keeps_the_last_row_per_tag():
    path = new_ring_path()
    ring = RowRing.create(path, width=7, capacity=4)
    try:
        writer = RowRing.attach(path)
        logits = torch.randn(3, 7)
        writer.write(["a", "b"], logits, [0, 2])
        writer.write(["a"], logits, [1])  # a later row for "a" (e.g. after a chunked prefill)
        rows: dict[str, torch.Tensor] = {}
        assert ring.drain(rows) == 3 and ring.drain(rows) == 0
        assert set(rows) == {"a", "b"}
        torch.testing.assert_close(rows["a"], torch.log_softmax(logits[1], -1))
        torch.testing.assert_close(rows["b"], torch.log_softmax(logits[2], -1))
        assert ring.apply_calls == 2 and ring.rows_written == 3 and ring.writer_pid == os.getpid()
        writer.write(["x"], logits, [0])
        got = rows["b"].clone()
        ring.drain(rows)
        assert torch.equal(rows["b"], got)  # drained rows own their memory: slots are reused
        with pytest.raises(RuntimeError, match="width 7"):
            writer.write(["y"], torch.randn(1, 8), [0])
        with pytest.raises(RuntimeError, match="longer than"):
            writer.write(["t" * 65], logits, [0])
        writer.close()
    finally:
        ring.close()
    assert not os.path.exists(path)


def test_ring_batched_write_equals_the_in_place_one():
    """The accelerator path (one kernel, one transfer into consecutive slots), run on CPU."""
    ring = RowRing.create(new_ring_path(), width=50, capacity=8)
    try:
        writer = RowRing.attach(ring.path)
        logits = torch.randn(5, 50, dtype=torch.float16)
        writer.write(["a", "b"], logits, [4, 1])
        writer.write(["c", "d", "e"], logits, [0, 2, 3], batched=True)
        rows: dict[str, torch.Tensor] = {}
        assert ring.drain(rows) == 5
        for tag, r in zip("abcde", [4, 1, 0, 2, 3], strict=True):
            torch.testing.assert_close(rows[tag], torch.log_softmax(logits[r].float(), -1))
    finally:
        ring.close()


def test_ring_counts_rows_it_cannot_hold():
    ring = RowRing.create(new_ring_path(), width=3, capacity=2)
    try:
        writer = RowRing.attach(ring.path)
        writer.write(["a", "b", "c"], torch.zeros(3, 3), [0, 1, 2])
        rows: dict[str, torch.Tensor] = {}
        assert ring.drain(rows) == 2 and ring.overflowed == 1 and set(rows) == {"a", "b"}
    finally:
        ring.close()


def test_attach_rejects_a_foreign_file(tmp_path):
    path = tmp_path / "not-a-ring"
    path.write_bytes(b"\0" * 4096)
    with pytest.raises(RuntimeError, match="not a genlm_vlm row ring"):
        RowRing.attach(str(path))


def test_writer_sink_writes_only_on_rank0(monkeypatch):
    ring = RowRing.create(new_ring_path(), width=4, capacity=2)
    try:
        sink = RingWriterSink(ring.path)
        sink._rank0 = False  # what a rank-1 worker decides from torch.distributed
        sink.store(["a"], torch.zeros(1, 4), [0])
        assert ring.drain({}) == 0 and sink._ring is None
        sink._rank0 = None  # no process group here: counts as rank 0
        sink.store(["a"], torch.zeros(1, 4), [0])
        assert ring.drain({}) == 1
    finally:
        ring.close()


def test_cpu_thread_binding_splits_cores_when_numa_nodes_are_short(monkeypatch):
    import genlm_vlm.engine.options as build

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(build, "_numa_nodes", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_thread_binding(2) == "0|1"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_thread_binding(2) == "0-7|8-15"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 4, 6})
    assert cpu_thread_binding(2) == "0,2|4,6"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND"):
        cpu_thread_binding(2)
    monkeypatch.setattr(build, "_numa_nodes", lambda: 2)
    assert cpu_thread_binding(2) is None  # vLLM's own NUMA binding works
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setattr(build, "_numa_nodes", lambda: 1)
    assert cpu_thread_binding(2) is None  # the user's choice stands


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline and data parallel"),
        ({"data_parallel_size": 2}, "pipeline and data parallel"),
        ({"tensor_parallel_size": 0}, "positive int"),
        ({"tensor_parallel_size": "2"}, "positive int"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}, "ReplicaPool"),
        ({"tensor_parallel_size": 2, "async_scheduling": True}, "steps must not overlap"),
    ],
)
def test_unsupported_parallel_options_fail_before_the_engine(opts, match):
    with pytest.raises(ValueError, match=match):
        check_engine_opts(opts)
    check_engine_opts({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"})


def test_failed_tp_build_from_a_script_says_to_add_the_main_guard(monkeypatch):
    import sys
    import types

    from genlm_vlm.engine.build import _add_tp_hint

    script = types.ModuleType("__main__")
    script.__file__ = "/somewhere/run_smc.py"
    monkeypatch.setitem(sys.modules, "__main__", script)
    err = Exception("WorkerProc initialization failed due to an exception in a background process")
    _add_tp_hint(err)
    assert any('if __name__ == "__main__":' in note for note in err.__notes__)
    other = AssertionError("Given number of CPU id list ['0,1'] doesn't match local world size 2.")
    _add_tp_hint(other)  # another cause: no misleading hint
    assert not getattr(other, "__notes__", None)
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a REPL / notebook
    quiet = Exception("WorkerProc initialization failed")
    _add_tp_hint(quiet)
    assert not getattr(quiet, "__notes__", None)
