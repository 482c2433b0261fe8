"""Faults stay with their caller (issue 25): one bad call never stops the model, and no command
loses a user's data.

One test (or a few) per item of the issue, each failing on the code before the fix (4428346):

1. a failure while routing, delivering or sampling one job fails that job only (fake core: a NaN
   row, a failing sink, a failing hand-over; real engine: ``temperature=1e-50`` next to normal
   calls); an engine loop that does stop says why to every later call; a Ray replica whose
   engine stopped reports itself unhealthy and is replaced;
2. ``score`` turns any unreadable line into an error record; 3. it refuses to write over its
   input, and writes through a temporary file (a crash leaves the old output as it was);
4. seeds outside torch's range fail at the call, and only that call;
6. ``cleanup()`` stops the engine even when its awaiters' event loop is closed, and tries again
   after a failure; 7. concurrent shutdowns and a call racing a shutdown return promptly;
8. stale row-ring files of dead processes are removed, and the ring's memory is reserved up front;
9. the health checker's back-off never overflows; 10. LoRA paths are made absolute and checked.

And a small fuzz on the real engine: for each of a few dozen bad options and inputs, that caller
gets a clear error while concurrent callers get exact rows and reproducible samples.
(Item 5, the output cache's byte budget with views, is covered by test_cache.py.)
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch
from conftest import ENGINE_OPTS, ForwardFault, max_abs_diff
from fake_core import FakeCore, fake_row

from genlm_vlm.engine import EngineDriver, SampleSpec


def make(core: FakeCore | None = None, **kwargs) -> tuple[EngineDriver, FakeCore]:
    core = core or FakeCore()
    return EngineDriver("fake", core_factory=lambda: core, **kwargs), core


def fake_lm(core: FakeCore | None = None):
    """An AsyncVirtualLM over the fake core (no vLLM)."""
    from genlm_vlm import AsyncVirtualLM

    driver, core = make(core)
    return AsyncVirtualLM(driver), core


# ================================================================ 1. engine-thread work, per job
def test_a_nan_row_fails_only_its_seeded_sample():
    core = FakeCore()
    core.row_fn = lambda toks, v: torch.full((v,), float("nan")) if toks[0] == 99 else fake_row(toks, v)
    driver, _ = make(core)
    try:
        bad, good = driver.submit_samples([SampleSpec((99, 1), 3, (), 1.0, 0), SampleSpec((7, 1), 3, (), 1.0, 0)])
        rows = driver.submit_logprobs([((4, 5), None), ((4, 6), None)])
        with pytest.raises(ValueError, match="NaN"):
            bad.result(timeout=10)
        assert len(good.result(timeout=10)) == 3
        assert all(torch.equal(f.result(timeout=10), fake_row(p, 64)) for f, p in zip(rows, [(4, 5), (4, 6)], strict=True))
        # the loop goes on
        (later,) = driver.submit_logprobs([((8, 9), None)])
        assert torch.equal(later.result(timeout=10), fake_row((8, 9), 64))
        assert driver.failure is None
    finally:
        driver.shutdown()


def test_a_failing_route_and_a_failing_hand_over_fail_only_their_jobs():
    core = FakeCore()
    real_pop = core.sink.pop

    def pop(tag):
        if any(t == tag and toks == (66, 1) for _, toks, t, _ in core.requests):
            raise RuntimeError("injected routing failure")
        return real_pop(tag)

    class BadClone(torch.Tensor):
        def clone(self, *args, **kwargs):
            raise RuntimeError("injected hand-over failure")

    core.sink.pop = pop
    core.row_fn = lambda toks, v: fake_row(toks, v).as_subclass(BadClone) if toks[0] == 77 else fake_row(toks, v)
    driver, _ = make(core)
    try:
        prompts = [(66, 1), (77, 1), (77, 1), (5, 6), (5, 7)]  # (77, 1) twice: one job, two waiters
        futs = driver.submit_logprobs([(p, None) for p in prompts])
        with pytest.raises(RuntimeError, match="injected routing failure"):
            futs[0].result(timeout=10)
        outcomes = []
        for f in futs[1:3]:
            try:
                outcomes.append(f.result(timeout=10))
            except RuntimeError as e:
                outcomes.append(e)
        assert any(isinstance(o, RuntimeError) and "hand-over" in str(o) for o in outcomes)
        for f, p in zip(futs[3:], prompts[3:], strict=True):
            assert torch.equal(f.result(timeout=10), fake_row(p, 64))
        (later,) = driver.submit_logprobs([((8, 9), None)])
        assert torch.equal(later.result(timeout=10), fake_row((8, 9), 64))
    finally:
        driver.shutdown()


def test_a_dead_engine_loop_says_why_to_every_later_call():
    driver, core = make()
    try:
        loop = driver._loop

        def broken():
            raise RuntimeError("injected loop failure")

        loop._admit = broken  # the next pass of the loop raises
        (pending,) = driver.submit_logprobs([((1, 2), None)])
        with pytest.raises(RuntimeError, match="injected loop failure"):
            pending.result(timeout=10)
        driver._thread.join(10)
        for call in (lambda: driver.submit_logprobs([((1, 3), None)]), driver.tokenizer,
                     lambda: driver.call(lambda: 1)):
            with pytest.raises(RuntimeError) as info:
                call()
            assert "injected loop failure" in str(info.value) and "cleanup() was called" not in str(info.value)
        assert core.released
    finally:
        driver.shutdown()  # returns at once: the thread is gone


@pytest.fixture(scope="module")
def own_lm(model_paths):
    """A private llama engine (a regression here must not break the shared ones)."""
    from genlm_vlm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(model_paths["llama"], dict(ENGINE_OPTS))
    yield lm
    lm.cleanup()


def _check_rows(path, prompts, rows) -> None:
    from genlm_vlm.testing import hf_reference_logprobs

    err = max_abs_diff(rows, hf_reference_logprobs(path, prompts))
    assert err < 1e-4, err


async def test_a_tiny_temperature_sample_next_to_others_on_the_real_engine(own_lm, model_paths):
    from genlm_vlm.testing import random_prompts

    lm = own_lm
    eos = [lm.tokenizer.eos_token_id]
    prompt = [5, 9, 17, 33]
    greedy = await lm.sample(prompt, 4, eos, temperature=0.0)
    seeded = await lm.sample(prompt, 4, eos, temperature=1.0, seed=5)
    prompts = random_prompts(8, lm.vocab_size, 2, 60, seed=2501)
    out = await asyncio.gather(
        lm.sample(prompt, 4, eos, temperature=1e-50, seed=0),
        lm.sample(prompt, 4, eos, temperature=1e-300),
        lm.sample(prompt, 4, eos, temperature=1.0),
        lm.sample(prompt, 4, eos, temperature=1.0, seed=5),
        *(lm.next_token_logprobs(p) for p in prompts),
        return_exceptions=True,
    )
    assert not [o for o in out if isinstance(o, BaseException)], out
    assert out[0] == greedy and out[1] == greedy  # below 1e-5 a temperature is greedy
    assert out[3] == seeded
    _check_rows(model_paths["llama"], prompts, out[4:])
    later = random_prompts(3, lm.vocab_size, 2, 60, seed=2502)
    _check_rows(model_paths["llama"], later, [await lm.next_token_logprobs(p) for p in later])
    assert lm._driver.failure is None


# ================================================================ 2, 3. the score command
@pytest.fixture
def mock_score(monkeypatch):
    """``score``'s model is a MockAsyncLM (no engine); returns run(argv) -> exit status."""
    from genlm_vlm import MockAsyncLM
    from genlm_vlm.scoring import main
    from genlm_vlm.vllm_lm import AsyncVirtualLM

    monkeypatch.setattr(AsyncVirtualLM, "from_name", staticmethod(lambda *a, **k: MockAsyncLM()))
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    return lambda *argv: main([*argv, "--quiet"])


def _strict_json(line: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def test_score_turns_any_unreadable_line_into_an_error_record(mock_score, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        b'{"id": "a", "prompt": [5, 6]}',
        b'{"id": ' + b"9" * 5000 + b', "prompt": [5, 6]}',  # ValueError, not JSONDecodeError
        b'{"id": "c", "prompt": [5, 7]}',
        b'{"id": "\xff\xfe", "prompt": [5, 8]}',  # not UTF-8
        b"[" * 100_000 + b"]" * 100_000,  # RecursionError
        b'{"id": NaN, "prompt": [5, 9]}',  # parsed by Python, must be written as valid JSON
        b'{"id": "\\ud800", "prompt": [5, 10]}',  # a lone surrogate
        b'{"id": "f", "prompt": [5, 11], "continuation": [3]}',
    ]
    src.write_bytes(b"\n".join(lines) + b"\n")
    assert mock_score(str(src), str(dst)) == 1
    out = [_strict_json(line) for line in dst.read_text(encoding="utf-8").splitlines()]
    assert [r["line"] for r in out] == list(range(1, 9))
    assert [("error" in r) for r in out] == [False, True, False, True, True, False, False, False]
    assert "digits" in out[1]["error"] and "UTF-8" in out[3]["error"]
    assert out[5]["id"] == "NaN" and out[6]["id"] == "\ud800" and out[7]["id"] == "f"


def test_score_refuses_an_output_that_is_its_input(mock_score, tmp_path, monkeypatch, capsys):
    src = tmp_path / "in.jsonl"
    content = '{"id": "a", "prompt": [5, 6]}\n'
    src.write_text(content)
    os.symlink(src, tmp_path / "link.jsonl")
    os.link(src, tmp_path / "hard.jsonl")
    monkeypatch.chdir(tmp_path)
    for out in (str(src), "in.jsonl", "./sub/../in.jsonl", "link.jsonl", "hard.jsonl"):
        os.makedirs(tmp_path / "sub", exist_ok=True)
        assert mock_score(str(src), out) == 2, out
        assert "is the input" in capsys.readouterr().err
        assert src.read_text() == content
    assert mock_score(str(src), "out.jsonl") == 0


def test_score_writes_through_a_temporary_file(mock_score, tmp_path, monkeypatch):
    from genlm_vlm.scoring import scorer

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(f'{{"id": {i}, "prompt": [5, {6 + i}]}}\n' for i in range(4)))
    dst.write_text("the previous results\n")
    os.chmod(dst, 0o640)
    real = scorer._Scorer.score

    def crash_after_two(self, numbered):
        for i, result in enumerate(real(self, numbered)):
            if i == 2:
                raise RuntimeError("crash in the middle")
            yield result

    monkeypatch.setattr(scorer._Scorer, "score", crash_after_two)
    with pytest.raises(RuntimeError, match="crash in the middle"):
        mock_score(str(src), str(dst))
    assert dst.read_text() == "the previous results\n"
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl"]  # no temporary file left
    monkeypatch.setattr(scorer._Scorer, "score", real)
    assert mock_score(str(src), str(dst)) == 0
    assert [r["id"] for r in map(json.loads, dst.read_text().splitlines())] == [0, 1, 2, 3]
    assert os.stat(dst).st_mode & 0o777 == 0o640  # the file it replaced kept its permissions


# ================================================================ 4. seeds
async def test_a_seed_out_of_range_fails_at_the_call_and_only_there():
    lm, core = fake_lm()
    try:
        good = lm.sample([3, 4], 3, [], seed=1)
        out = await asyncio.gather(lm.sample([3, 5], 3, [], seed=2**64), good, lm.sample([3, 6], 3, [], seed=-(2**63) - 1),
                                   lm.next_token_logprobs([3, 7]), return_exceptions=True)
        assert isinstance(out[0], ValueError) and "2**64" in str(out[0])
        assert isinstance(out[2], ValueError)
        assert len(out[1]) == 3 and torch.equal(out[3], fake_row((3, 7), 64))
        with pytest.raises(ValueError, match=r"prompt_token_ids_list\[1\]"):
            await lm.batch_sample([[3, 4], [3, 5]], 2, [], seed=2**64 - 1)
        assert len(await lm.sample([3, 4], 2, [], seed=2**64 - 1)) == 2  # the largest seed torch takes
        assert await lm.sample([3, 4], 2, [], seed=-1) == await lm.sample([3, 4], 2, [], seed=2**64 - 1)
        # below the checks: a seed torch refuses fails its own job, not its group
        bad, ok = lm._driver.submit_samples([SampleSpec((3, 8), 2, (), 1.0, 2**70), SampleSpec((3, 9), 2, (), 1.0, 3)])
        with pytest.raises(ValueError, match="seed"):
            bad.result(timeout=10)
        assert len(ok.result(timeout=10)) == 2
    finally:
        lm.cleanup()


# ================================================================ 6. cleanup
def test_cleanup_stops_the_engine_when_the_awaiters_loop_is_closed(caplog):
    lm, core = fake_lm(FakeCore(gated=True))  # no step ends until the gate opens
    loop = asyncio.new_event_loop()
    task = loop.create_task(lm.next_token_logprobs([3, 4]))
    for _ in range(20):  # one loop pass at a time until the call is sent
        loop.run_until_complete(asyncio.sleep(0))
        if lm._logprob_batcher.num_inflight:
            break
    assert lm._logprob_batcher.num_inflight == 1
    loop.close()  # the awaiter's loop is gone with the call in flight
    core.gate.release(1000)
    with caplog.at_level(logging.WARNING, logger="genlm_vlm.serving"):
        lm.cleanup()
    assert core.released and not lm._driver._thread.is_alive()
    assert "could not resolve the pending awaiters" in caplog.text
    del task


def test_a_second_cleanup_finishes_what_a_failed_one_left():
    lm, core = fake_lm()
    real = lm._driver.shutdown
    calls = []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected shutdown failure")
        real()

    lm._driver.shutdown = failing_once
    with pytest.raises(RuntimeError, match="injected shutdown failure"):
        lm.cleanup()
    assert not core.released
    lm.cleanup()
    assert core.released and len(calls) == 2
    lm.cleanup()  # done: nothing more
    assert len(calls) == 2


# ================================================================ 7. concurrent shutdowns
class _Rendezvous(collections.deque):
    """The engine inbox, with a hook run before a message of a chosen type is appended."""

    hook = None

    def append(self, item):
        hook = type(self).hook
        if hook is not None:
            hook(item)
        super().append(item)


def _run(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_two_shutdowns_at_once_both_return(monkeypatch):
    from genlm_vlm.engine import loop as loop_module
    from genlm_vlm.engine.jobs import Stop

    class Inbox(_Rendezvous):
        pass

    barrier = threading.Barrier(2, timeout=2.0)

    def meet(item):
        # both shutdowns try to post a Stop together; with the lock, the second waits for the
        # first instead (the barrier times out: its bounded wait is for something that must not happen)
        if isinstance(item, Stop):
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass

    Inbox.hook = meet
    monkeypatch.setattr(loop_module, "deque", Inbox)
    driver, core = make()
    threads = [_run(driver.shutdown), _run(driver.shutdown)]
    for t in threads:
        t.join(15)
    assert not any(t.is_alive() for t in threads), "a shutdown hangs"
    assert core.released


def test_a_call_racing_a_shutdown_is_answered(monkeypatch):
    from genlm_vlm.engine import loop as loop_module
    from genlm_vlm.engine.jobs import PostJobs

    class Inbox(_Rendezvous):
        pass

    driver_box: list = []

    def shut_down_in_between(item):
        # the call passed the closed check; now a shutdown runs to its end (or, with the lock,
        # waits for this post: the bounded wait is for something that must not happen)
        if isinstance(item, PostJobs) and not driver_box[1]:
            driver_box[1] = True
            _run(driver_box[0].shutdown).join(2.0)

    Inbox.hook = shut_down_in_between
    monkeypatch.setattr(loop_module, "deque", Inbox)
    driver, core = make()
    driver_box[:] = [driver, False]
    (fut,) = driver.submit_logprobs([((1, 2), None)])
    try:  # answered either way: its row (computed before the Stop was read) or the shutdown's error
        assert torch.equal(fut.result(timeout=15), fake_row((1, 2), 64))
    except RuntimeError as e:
        assert "shut down" in str(e)
    assert fut.done()
    driver.shutdown()
    assert core.released


# ================================================================ 8. the row ring's shared memory
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_ring_files_of_dead_processes_are_removed(tmp_path):
    from genlm_vlm.rowring import RowRing

    stale = tmp_path / f"genlm_vlm_rows_{_dead_pid()}_0123456789ab"
    stale.write_bytes(b"\0" * 4096)
    alive = tmp_path / f"genlm_vlm_rows_{os.getppid()}_0123456789ab"  # a live process: kept
    alive.write_bytes(b"\0" * 4096)
    other = tmp_path / "unrelated_file"
    other.write_bytes(b"x")
    held = RowRing.create(str(tmp_path / f"genlm_vlm_rows_{os.getpid()}_aaaaaaaaaaaa"), 8, 2)
    try:
        assert not stale.exists() and alive.exists() and other.exists() and os.path.exists(held.path)
        again = RowRing.create(str(tmp_path / f"genlm_vlm_rows_{os.getpid()}_bbbbbbbbbbbb"), 8, 2)
        assert os.path.exists(held.path)  # a ring of this live process is never taken for stale
        again.close()
    finally:
        held.close()
    assert not os.path.exists(held.path)


def test_a_killed_process_leaves_no_ring_behind_for_long(tmp_path):
    """A process that creates a ring and is killed with SIGKILL: the next ring removes it."""
    from genlm_vlm.rowring import RowRing

    code = ("import os, sys; from genlm_vlm.rowring import RowRing, new_ring_path; "
            f"r = RowRing.create(os.path.join({str(tmp_path)!r}, os.path.basename(new_ring_path())), 8, 2); "
            "print(r.path, flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    path = proc.stdout.readline().strip()
    assert os.path.exists(path)
    fresh = RowRing.create(str(tmp_path / f"genlm_vlm_rows_{os.getpid()}_cccccccccccc"), 8, 2)
    assert os.path.exists(path)  # its creator is alive and holds it
    proc.kill()
    proc.wait()
    fresh.close()
    fresh = RowRing.create(str(tmp_path / f"genlm_vlm_rows_{os.getpid()}_dddddddddddd"), 8, 2)
    fresh.close()
    assert not os.path.exists(path)


def test_the_ring_reserves_its_memory_up_front_or_fails_at_once():
    from genlm_vlm.rowring import RowRing, new_ring_path, ring_dir

    ring = RowRing.create(new_ring_path(), 1024, 16)
    try:
        size = os.stat(ring.path).st_size
        assert os.stat(ring.path).st_blocks * 512 >= size  # committed now, not at the first write
    finally:
        ring.close()
    st = os.statvfs(ring_dir())
    if ring_dir() != "/dev/shm" or not st.f_blocks:
        pytest.skip("needs a size-limited /dev/shm")
    too_big = st.f_blocks * st.f_frsize // (1 << 20) + 64  # rows of 2**18 floats (1 MiB): more than it holds
    path = new_ring_path()
    with pytest.raises(OSError, match="MiB") as info:
        ring = RowRing.create(path, 1 << 18, too_big)
        ring.close()
    assert "shm-size" in str(info.value) or "max_num_seqs" in str(info.value)
    assert not os.path.exists(path) and not os.path.exists(os.path.join(ring_dir(), f".{os.path.basename(path)}.init"))


# ================================================================ 9. the health checker's back-off
def test_restart_back_off_never_overflows():
    from genlm_vlm.replicas.health import MAX_RETRY_S, HealthChecker

    class Router:
        def live_replicas(self):
            return []

    class Pool:
        _router = Router()
        _actors = [object()]
        _closing = threading.Event()

        def _replace(self, i, auto=False):
            raise ValueError("no room for the replica")

    pool = Pool()
    checker = HealthChecker(pool, 0.2, auto_restart=True)
    checker._fails[0] = 2000  # about 11 hours of failed restarts at 0.2 s
    before = time.monotonic()
    checker._restart_dead(pool)
    assert checker._fails[0] == 2001 and checker.counts["restart_failures"] == 1
    assert before + MAX_RETRY_S - 1 <= checker._retry_at[0] <= time.monotonic() + MAX_RETRY_S


# ================================================================ 10. LoRA paths
def test_lora_paths_are_absolute_and_checked(tmp_path, monkeypatch):
    from genlm_vlm import MockAsyncLM, ReplicaPool

    core = FakeCore()
    core.info = replace(core.info, lora_enabled=True, max_lora_rank=8)
    lm, _ = fake_lm(core)
    try:
        monkeypatch.chdir(tmp_path)
        (tmp_path / "adapter").mkdir()
        lm.add_new_lora("adapter", "a")
        assert lm._loras.get("a").path == str(tmp_path / "adapter")
        request = lm._lora_requests[lm._loras.get("a").int_id]
        assert request.lora_path == str(tmp_path / "adapter")
        with pytest.raises(FileNotFoundError, match="typo-adapter") as info:
            lm.add_new_lora("typo-adapter", "b")
        assert str(tmp_path / "typo-adapter") in str(info.value) and "'b'" in str(info.value)
        assert lm.lora_names == ["a"]
    finally:
        lm.cleanup()
    assert ReplicaPool._local_lora_paths  # the pool registers adapters through the same check
    mock = MockAsyncLM()
    mock.add_new_lora("/adapters/a", "a")  # the mock reads no adapter: any path is a name
    assert mock.lora_names == ["a"]


# ================================================================ fuzz: bad calls next to good ones
def _bad_calls(lm, V: int):
    """``(name, coroutine factory, expected exception type or None for "succeeds")``."""
    p = [5, 9, 17]
    return [
        ("temperature -1", lambda: lm.sample(p, 3, [], temperature=-1.0), ValueError),
        ("temperature nan", lambda: lm.sample(p, 3, [], temperature=float("nan")), ValueError),
        ("temperature inf", lambda: lm.sample(p, 3, [], temperature=float("inf"), seed=1), ValueError),
        ("temperature 10**400", lambda: lm.sample(p, 3, [], temperature=10**400), ValueError),
        ("temperature str", lambda: lm.sample(p, 3, [], temperature="1"), ValueError),
        ("temperature complex", lambda: lm.sample(p, 3, [], temperature=1j), ValueError),
        ("temperature 1e-50 seeded", lambda: lm.sample(p, 3, [], temperature=1e-50, seed=0), None),
        ("temperature 5e-324 seeded", lambda: lm.sample(p, 3, [], temperature=5e-324, seed=3), None),
        ("temperature 1e-6 unseeded", lambda: lm.sample(p, 3, [], temperature=1e-6), None),
        ("temperature 1e30 seeded", lambda: lm.sample(p, 3, [], temperature=1e30, seed=4), None),
        ("seed 2**64", lambda: lm.sample(p, 3, [], seed=2**64), ValueError),
        ("seed -2**63-1", lambda: lm.sample(p, 3, [], seed=-(2**63) - 1), ValueError),
        ("seed float", lambda: lm.sample(p, 3, [], seed=1.5), TypeError),
        ("seed bool", lambda: lm.sample(p, 3, [], seed=True), TypeError),
        ("batch seed overflow", lambda: lm.batch_sample([p, p], 2, [], seed=2**64 - 1), ValueError),
        ("max_tokens 0", lambda: lm.sample(p, 0, []), ValueError),
        ("max_tokens float", lambda: lm.sample(p, 1.5, []), ValueError),
        ("max_tokens huge seeded", lambda: lm.sample([3] * 505, 10**30, [], seed=5), None),
        ("eos outside", lambda: lm.sample(p, 3, [V]), ValueError),
        ("eos negative", lambda: lm.sample(p, 3, [-1]), ValueError),
        ("eos huge", lambda: lm.sample(p, 3, [10**30]), ValueError),
        ("eos text", lambda: lm.sample(p, 3, "x"), TypeError),
        ("prompt empty", lambda: lm.next_token_logprobs([]), ValueError),
        ("prompt outside", lambda: lm.next_token_logprobs([3, V]), ValueError),
        ("prompt huge id", lambda: lm.next_token_logprobs([3, 2**70]), ValueError),
        ("prompt text", lambda: lm.next_token_logprobs("text"), TypeError),
        ("prompt floats", lambda: lm.next_token_logprobs([1.5]), TypeError),
        ("prompt 2-D", lambda: lm.next_token_logprobs(torch.tensor([[3, 4]])), ValueError),
        ("prompt None", lambda: lm.next_token_logprobs(None), TypeError),
        ("prompt too long", lambda: lm.next_token_logprobs([3] * 512), ValueError),
        ("batch with a bad prompt", lambda: lm.batch_next_token_logprobs([[3, 4], []]), ValueError),
        ("unknown adapter", lambda: lm.next_token_logprobs([3, 4], lora_name="nope"), ValueError),
        ("adapter name type", lambda: lm.next_token_logprobs([3, 4], lora_name=3), TypeError),
        ("topk k=0", lambda: lm.next_token_topk([3, 4], 0), ValueError),
        ("topk k>V", lambda: lm.next_token_topk([3, 4], V + 1), ValueError),
        ("score outside", lambda: lm.score([3, 4], [V]), ValueError),
        ("score too long", lambda: lm.score([3] * 300, [4] * 300), ValueError),
    ]


@pytest.mark.filterwarnings("ignore::genlm_vlm.base.ContextLimitWarning")
async def test_fuzz_one_bad_caller_never_costs_the_others(own_lm, model_paths):
    from genlm_vlm.testing import random_prompts

    lm = own_lm
    V = lm.vocab_size
    cases = _bad_calls(lm, V)
    prompt = [5, 9, 17, 33]
    expected = await lm.sample(prompt, 3, [], seed=7)
    all_prompts, all_rows = [], []
    for i, (name, make_call, error) in enumerate(cases):
        prompts = random_prompts(2, V, 2, 40, seed=3000 + i)
        out = await asyncio.gather(make_call(), lm.sample(prompt, 3, [], seed=7),
                                   *(lm.next_token_logprobs(q) for q in prompts), return_exceptions=True)
        bad, sampled, rows = out[0], out[1], out[2:]
        if error is None:
            assert not isinstance(bad, BaseException), (name, bad)
        else:
            assert isinstance(bad, error), (name, bad)
            assert str(bad), name  # a message that says what is wrong
        assert sampled == expected, (name, sampled)
        assert not [r for r in rows if isinstance(r, BaseException)], (name, rows)
        all_prompts += prompts
        all_rows += rows
    _check_rows(model_paths["llama"], all_prompts, all_rows)
    assert lm._driver.failure is None


# ================================================================ fuzz: faults inside the forward pass
@pytest.mark.filterwarnings("ignore::genlm_vlm.base.ContextLimitWarning")
async def test_fuzz_faults_inside_the_forward_pass(own_lm, model_paths):
    """Issue 29: a decoder layer raises (RuntimeError, or torch's out-of-memory error) at a random
    forward pass of a random mix of calls (new prompts, session chunks, forks, scoring, seeded and
    unseeded samples). Only calls of the failed step fail, with that error; every row and score
    returned, then and afterwards (the same queries again), is exact, seeded samples are
    reproducible, and the engine loop never stops."""
    from genlm_vlm.testing import hf_reference_logprobs, random_prompts

    lm, path = own_lm, model_paths["llama"]
    V = lm.vocab_size
    rng = random.Random(2920)
    prompt = [5, 9, 17, 33]
    expected = await lm.sample(prompt, 3, [], seed=7)
    bases = random_prompts(4, V, 30, 90, seed=2921)
    await asyncio.gather(*(lm.next_token_logprobs(b) for b in bases))  # idle sessions
    faults_before = lm.stats["faults"]["failed_steps"]
    fired = 0
    all_prompts, all_rows, scored = [], [], []
    for round_ in range(6):
        picked = rng.sample(bases, 2)
        queries = [
            *random_prompts(3, V, 20, 120, seed=2930 + round_),  # new prompts (chunked prefill too)
            *(b + random_prompts(1, V, 1, 12, seed=2940 + round_ + i)[0] for i, b in enumerate(picked)),  # chunks
            *(b + [rng.randrange(3, V)] for b in picked),  # siblings of those chunks: forks
        ]
        sp, sc = random_prompts(2, V, 10, 40, seed=2950 + round_)
        fault = ForwardFault(lm, rng.choice([RuntimeError, torch.OutOfMemoryError]), at=rng.choice([0, 0, 1, 3]))
        with fault:
            out = await asyncio.gather(
                *(lm.next_token_logprobs(q) for q in queries), lm.continuation_logprobs(sp, sc),
                lm.sample(prompt, 3, [], seed=7), lm.sample(prompt, 3, [], temperature=1.0),
                return_exceptions=True,
            )
        fired += fault.fired
        for o in out:
            if isinstance(o, BaseException):
                assert fault.fired and "injected fault" in str(o), (round_, o)
        for q, o in zip(queries, out, strict=False):
            if not isinstance(o, BaseException):
                all_prompts.append(q)
                all_rows.append(o)
        if not isinstance(out[len(queries)], BaseException):
            scored.append((sp, sc, out[len(queries)]))
        if not isinstance(out[len(queries) + 1], BaseException):
            assert out[len(queries) + 1] == expected, round_
        # afterwards: the same calls all served, exactly
        again = await asyncio.gather(*(lm.next_token_logprobs(q) for q in queries))
        all_prompts += queries
        all_rows += again
        scored.append((sp, sc, await lm.continuation_logprobs(sp, sc)))
        assert await lm.sample(prompt, 3, [], seed=7) == expected
        bases = rng.sample(queries, 4)  # their sessions are idle now
    assert fired >= 2 and lm.stats["faults"]["failed_steps"] == faults_before + fired
    _check_rows(path, all_prompts, all_rows)
    for sp, sc, got in scored:
        refs = hf_reference_logprobs(path, [sp + sc[:t] for t in range(len(sc))])
        want = torch.stack([r[c] for r, c in zip(refs, sc, strict=True)])
        assert float((got - want).abs().max()) < 1e-4
    assert lm._driver.failure is None and not lm.stats["faults"]["prefix_cache_suspect"]


# ================================================================ 1. on a Ray pool
@pytest.mark.ray
async def test_a_replica_whose_engine_stopped_is_replaced(model_paths):
    pytest.importorskip("ray")
    import ray

    from genlm_vlm import ReplicaPool
    from genlm_vlm.testing import random_prompts

    path = model_paths["llama"]
    pool = ReplicaPool.from_name(path, num_replicas=2, engine_opts=dict(ENGINE_OPTS),
                                 health_interval_s=0.2, auto_restart=True)
    try:
        V = pool.vocab_size
        pid = pool.replica_info[0]["pid"]

        def stop_the_engine(worker):  # runs inside replica 0's actor
            driver = worker.lm._driver

            def broken():
                raise RuntimeError("injected engine failure")

            driver._loop._admit = broken
            driver._wake.set()
            driver._thread.join(30)
            return not driver._thread.is_alive()  # the actor lives on, its engine does not

        assert ray.get(pool.actors[0].__ray_call__.remote(stop_the_engine), timeout=60)
        deadline = time.monotonic() + 90
        while not (pool.health["replicas"][0]["restarts"] >= 1 and pool.live_replicas == [0, 1]):
            if time.monotonic() > deadline:
                pytest.fail("the replica whose engine stopped was never replaced")
            await asyncio.sleep(0.1)  # polling pause, not synchronisation
        assert pool.health["checker"]["deaths_found"] >= 1 and pool.replica_info[0]["pid"] != pid
        # a bad sample on the pool costs nobody else anything
        prompts = random_prompts(8, V, 2, 40, seed=2510)
        out = await asyncio.gather(pool.sample([5, 9], 3, [], temperature=1e-50, seed=0),
                                   *(pool.next_token_logprobs(q) for q in prompts), return_exceptions=True)
        assert not [o for o in out if isinstance(o, BaseException)], out
        _check_rows(path, prompts, out[1:])
        prompts = random_prompts(12, V, 2, 40, seed=2511)
        rows = await asyncio.gather(*(pool.next_token_logprobs(q) for q in prompts))
        _check_rows(path, prompts, rows)
    finally:
        pool.cleanup()
