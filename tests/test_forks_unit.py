"""Forks in the step loop, on a fake engine core (no vLLM; seconds).

Which queries are sent as forks and of which parent, how many of the parent's tokens they share,
that a parent with forks in flight is spared by eviction while it can be, and the ``forks``
counters. That the engine then shares the parent's tail block, exactly, is test_forks.py's job.
"""

from __future__ import annotations

import pytest
import test_loop_unit as loop_unit
import torch
from fake_core import FakeCore, fake_row
from test_loop_unit import rows

from genlm_vlm.engine import EngineDriver


def make(core: FakeCore | None = None, **kwargs) -> tuple[EngineDriver, FakeCore]:
    """A driver on a fake core that takes fork markers."""
    return loop_unit.make(core or FakeCore(forks=True), **kwargs)


@pytest.fixture
def driver_core():
    driver, core = make()
    yield driver, core
    driver.shutdown()


def test_siblings_fork_the_session_their_first_sibling_continued(driver_core):
    driver, core = driver_core
    rows(driver, (1, 2, 3))
    parent = core.requests[0][0]
    out = rows(driver, (1, 2, 3, 7), (1, 2, 3, 8), (1, 2, 3, 9), (4, 4))
    assert [torch.equal(r, fake_row(p, 64)) for r, p in zip(out, [(1, 2, 3, 7), (1, 2, 3, 8), (1, 2, 3, 9), (4, 4)],
                                                               strict=True)] == [True] * 4
    # one sibling continues the parent (its chunk is one token), the other two fork it sharing 3 tokens
    assert [m for _, m in core.forked] == [(parent, 3), (parent, 3)]
    st = driver.stats()
    assert (st["sessions"]["continued"], st["sessions"]["forked"], st["sessions"]["opened"]) == (1, 2, 2)
    f = st["forks"]
    assert f["enabled"] and (f["copied"], f["aligned"], f["reprefilled"], f["saved_tokens"]) == (2, 0, 0, 6)


def test_a_fork_shares_whole_blocks_as_aligned(driver_core):
    driver, core = driver_core  # the fake's block size is 4
    rows(driver, (1, 2, 3, 4))
    rows(driver, (1, 2, 3, 4, 5), (1, 2, 3, 4, 6))
    f = driver.stats()["forks"]
    assert (f["copied"], f["aligned"], f["saved_tokens"]) == (0, 1, 0)


def test_a_late_sibling_forks_the_parent_after_it_moved_on(driver_core):
    """The parent was continued in an earlier group and is idle again, further along: a query
    that extends what it had computed before still forks it."""
    driver, core = driver_core
    rows(driver, (1, 2, 3))
    rows(driver, (1, 2, 3, 7))
    rows(driver, (1, 2, 3, 7, 8))  # continues again: its base is now (1, 2, 3, 7)
    rows(driver, (1, 2, 3, 7, 9))
    parent = core.requests[0][0]
    assert core.forked[-1][1] == (parent, 4)


def test_forks_of_forks(driver_core):
    driver, core = driver_core
    rows(driver, (1, 2, 3))
    rows(driver, (1, 2, 3, 7), (1, 2, 3, 8))
    child = core.forked[0][0]
    rows(driver, (1, 2, 3, 8, 5), (1, 2, 3, 8, 6))  # the fork is a parent in turn
    assert core.forked[-1][1] == (child, 4)
    f = driver.stats()["forks"]
    assert (f["copied"], f["aligned"]) == (1, 1)  # 3 shared tokens, then 4 (one whole block)


def test_identical_siblings_are_one_request(driver_core):
    driver, core = driver_core
    rows(driver, (1, 2, 3))
    n = len(core.requests)
    a, b, c = rows(driver, (1, 2, 3, 7), (1, 2, 3, 8), (1, 2, 3, 8))
    assert len(core.requests) - n == 2 and len(core.forked) == 1
    assert torch.equal(b, c) and b.data_ptr() != c.data_ptr()


def test_forks_never_cross_adapters(driver_core):
    driver, core = driver_core

    class Lora:
        def __init__(self, i: int) -> None:
            self.lora_int_id = i

    a = Lora(1)
    driver.submit_logprobs([((1, 2, 3), a)])[0].result(timeout=10)
    futs = driver.submit_logprobs([((1, 2, 3, 7), a), ((1, 2, 3, 8), None), ((1, 2, 3, 9), Lora(2))])
    [f.result(timeout=10) for f in futs]
    assert core.forked == []  # (1, 2, 3, 7) continued the adapter's session; the others are new
    futs = driver.submit_logprobs([((1, 2, 3, 5), a)])
    futs[0].result(timeout=10)
    assert len(core.forked) == 1


def test_a_released_parent_is_not_forked(driver_core):
    driver, core = driver_core
    rows(driver, (1, 2, 3))
    rows(driver, (1, 2, 3, 7))
    assert driver.release_sessions() == 1
    rows(driver, (1, 2, 3, 8))
    st = driver.stats()
    assert core.forked == [] and st["sessions"]["forked"] == 0 and core.requests[-1][1] == (1, 2, 3, 8)


def test_forks_off_send_no_marker_and_count_the_reprefills():
    driver, core = make(forks=False)
    try:
        rows(driver, (1, 2, 3))
        rows(driver, (1, 2, 3, 7), (1, 2, 3, 8))
        st = driver.stats()
        assert core.forked == [] and st["sessions"]["forked"] == 1
        assert (st["forks"]["enabled"], st["forks"]["why"]) == (False, "forks=False")
        assert st["forks"]["reprefilled"] == 1
    finally:
        driver.shutdown()


def test_a_core_without_forks_says_why():
    driver, core = make(FakeCore(forks=False))
    try:
        rows(driver, (1, 2, 3))
        rows(driver, (1, 2, 3, 7), (1, 2, 3, 8))
        st = driver.stats()["forks"]
        assert not st["enabled"] and "no forks" in st["why"] and st["reprefilled"] == 1
    finally:
        driver.shutdown()


def test_a_fork_whose_parent_is_gone_is_counted_as_reprefilled():
    """The parent is gone between the fork's admission and its step (the engine then computes
    the fork in full): the loop counts what the engine reports."""
    core = FakeCore(forks=True, gated=True)
    driver, _ = make(core)
    try:
        core.gate.release(2)
        rows(driver, (1, 2, 3))
        rows(driver, (1, 2, 3, 7))  # the parent moves on; its base is (1, 2, 3)
        (fut,) = driver.submit_logprobs([((1, 2, 3, 8), None)])
        core.wait_for(lambda: len(core.forked) == 1)  # admitted; the step waits at the gate
        core.abort([core.forked[0][1][0]])  # as if vLLM had lost the parent meanwhile
        core.gate.release(10)
        assert torch.equal(fut.result(timeout=10), fake_row((1, 2, 3, 8), 64))
        f = driver.stats()["forks"]
        assert (f["copied"], f["reprefilled"]) == (0, 1)
    finally:
        driver.shutdown()


def test_eviction_spares_a_parent_whose_forks_are_in_flight():
    """Over the idle cap, the least recently used idle session goes first, unless a fork in
    flight needs it: then the next one goes. Once the fork is done, the parent may go."""
    core = FakeCore(forks=True, max_per_step=1)  # one request per step, oldest first
    driver, _ = make(core, max_sessions=2)
    try:
        rows(driver, (1, 2, 3))
        rows(driver, (1, 2, 3, 7))  # the parent moves on; its base is (1, 2, 3)
        rows(driver, (5,))
        parent, other = core.requests[0][0], core.requests[-1][0]
        # two new sessions, then a fork of the parent (now the least recently used idle
        # session): as the new ones park, two idle sessions must go while the fork waits
        futs = driver.submit_logprobs([((6,), None), ((8,), None), ((1, 2, 3, 9), None)])
        [f.result(timeout=10) for f in futs]
        new = [rid for rid, *_ in core.requests[-3:-1]]
        assert core.aborted == [other, new[0], parent]
        assert driver.stats()["forks"]["copied"] == 1
    finally:
        driver.shutdown()


# ---------------------------------------------------------------- the scheduler override
class _Block:
    def __init__(self, i: int) -> None:
        self.block_id, self.is_null = i, False


class _Blocks:
    def __init__(self, blocks) -> None:
        self.blocks = blocks


class _Manager:
    enable_caching = True

    def __init__(self) -> None:
        self.by_request: dict[str, list] = {}

    def get_blocks(self, rid: str) -> _Blocks:
        return _Blocks((self.by_request[rid],))

    def create_kv_cache_blocks(self, blocks) -> _Blocks:
        return _Blocks(blocks)


class _Request:
    def __init__(self, rid, tokens, computed=0, fork=None, lora=None, salt=None) -> None:
        from types import SimpleNamespace

        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.num_tokens = len(tokens)
        self.num_computed_tokens = computed
        self.sampling_params = SimpleNamespace(extra_args=None if fork is None else {"genlm_vlm_fork": fork})
        self.lora_request = lora
        self.cache_salt = salt
        self.skip_reading_prefix_cache = False
        self.finished = False

    def is_finished(self) -> bool:
        return self.finished


class _FakeVLLMScheduler:
    """What ForkScheduler uses of vLLM's Scheduler, with 0.33's lookup signature (block size 4)."""

    def __init__(self, hit_blocks: int = 1) -> None:
        from types import SimpleNamespace

        from vllm.v1.kv_cache_interface import FullAttentionSpec

        spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
        self.block_size = 4
        self.connector = None
        self.requests: dict[str, _Request] = {}
        self.kv_cache_manager = _Manager()
        self.hit_blocks = hit_blocks
        self.lookups: list = []

    def _get_local_prefix_cache_hit(self, request, max_cache_hit_length=None):
        self.lookups.append(max_cache_hit_length)
        blocks = self.kv_cache_manager.by_request.get("parent", [])[: self.hit_blocks]
        return _Blocks((list(blocks),)), 4 * len(blocks), 0, False

    def schedule(self):
        from types import SimpleNamespace

        return SimpleNamespace(total_num_scheduled_tokens=7)


@pytest.fixture
def fork_scheduler():
    from genlm_vlm.engine.forks import _fork_class

    sched = _fork_class(_FakeVLLMScheduler)()
    parent = _Request("parent", [1, 2, 3, 4, 5, 6], computed=6)
    sched.requests["parent"] = parent
    sched.kv_cache_manager.by_request["parent"] = [_Block(0), _Block(1)]
    return sched


def test_the_fork_scheduler_appends_the_parents_tail_block(fork_scheduler):
    sched = fork_scheduler
    assert sched.fork_support[0], sched.fork_support
    child = _Request("child", [1, 2, 3, 4, 5, 6, 9], fork=("parent", 6))
    blocks, n, *_ = sched._get_local_prefix_cache_hit(child, 6)  # 0.33 passes max_cache_hit_length
    assert n == 6 and [b.block_id for b in blocks.blocks[0]] == [0, 1] and sched.lookups == [6]
    assert sched.fork_counts["copied"] == 1 and sched.fork_counts["saved_tokens"] == 2
    sched.schedule()
    assert sched.fork_counts["scheduled_tokens"] == 7


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda s, c: setattr(s.requests["parent"], "finished", True), "parent_gone"),
        (lambda s, c: s.requests.pop("parent"), "parent_gone"),
        (lambda s, c: setattr(s.requests["parent"], "num_computed_tokens", 5), "parent_behind"),
        (lambda s, c: setattr(c, "cache_salt", "x"), "adapter"),
        (lambda s, c: setattr(c, "all_token_ids", [1, 2, 3, 4, 5, 7, 9]), "tokens"),
        (lambda s, c: setattr(c, "skip_reading_prefix_cache", True), "no_cache_read"),
        (lambda s, c: s.kv_cache_manager.by_request.__setitem__("parent", [_Block(0)]), "hit_mismatch"),
        (lambda s, c: setattr(s, "connector", object()), "disabled"),
    ],
)
def test_the_fork_scheduler_keeps_the_ordinary_hit_when_it_cannot_share(fork_scheduler, change, reason):
    from genlm_vlm.engine.forks import _fork_support

    sched = fork_scheduler
    child = _Request("child", [1, 2, 3, 4, 5, 6, 9], fork=("parent", 6))
    change(sched, child)
    sched.fork_support = _fork_support(sched)
    ordinary = _FakeVLLMScheduler._get_local_prefix_cache_hit(sched, child)
    blocks, n, *_ = sched._get_local_prefix_cache_hit(child)  # 0.32's signature
    assert n == ordinary[1] and len(blocks.blocks[0]) == len(ordinary[0].blocks[0])
    assert dict(sched.fork_fallbacks) == {reason: 1} and sched.fork_counts["copied"] == 0


@pytest.mark.parametrize("found", ["none", "another_copy"])
def test_a_fork_shares_the_parents_own_blocks_whatever_the_prefix_cache_found(fork_scheduler, found):
    """The prefix cache found fewer of the parent's full blocks, or other copies of them (the
    same tokens computed by an earlier request): the fork shares the parent's own blocks and tail,
    so it computes only its new tokens, as on a fresh engine."""
    sched = fork_scheduler
    child = _Request("child", [1, 2, 3, 4, 5, 6, 9], fork=("parent", 6))
    ordinary = (_Blocks(([],)), 0, 0, False) if found == "none" else (_Blocks(([_Block(7)],)), 4, 0, False)
    (blocks, n, *_), reason = sched._extend_hit(child, ordinary, ("parent", 6), None)
    assert reason is None and n == 6 and [b.block_id for b in blocks.blocks[0]] == [0, 1]
    assert sched.fork_counts["copied"] == 1


def test_the_fork_scheduler_leaves_other_requests_alone(fork_scheduler):
    sched = fork_scheduler
    plain = _Request("plain", [1, 2, 3, 4, 5, 6, 9])
    blocks, n, *_ = sched._get_local_prefix_cache_hit(plain)
    assert n == 4 and not sched.fork_fallbacks and sched.fork_counts["copied"] == 0


def test_the_fork_scheduler_refuses_what_it_does_not_support():
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from genlm_vlm.engine.forks import _fork_class

    sched = _fork_class(_FakeVLLMScheduler)()
    assert sched.fork_support[0]
    spec = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=8)
    sched.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    sched._init_forks()
    assert not sched.fork_support[0] and "SlidingWindowSpec" in sched.fork_support[1]
    sched.kv_cache_config = SimpleNamespace(kv_cache_groups=[1, 2])
    sched._init_forks()
    assert "2 KV cache groups" in sched.fork_support[1]
    sched.kv_cache_manager.enable_caching = False
    sched._init_forks()
    assert "prefix caching is off" in sched.fork_support[1]
