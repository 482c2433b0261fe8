"""The forcing seam driven directly (no engine): both model runners' capture processors map rows
of forced requests (``extra_args[FORCE_KEY]``) to request ids and hand them to the sink's forcer,
which is runner-agnostic (:class:`genlm_vlm.engine.forcing.ParticleHost`). Model Runner V2's
adapter is checked here with a fake ``ctx`` (slots recycled, rows re-sorted): the CPU build runs
the V1 runner only.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from genlm_vlm.capture import (
    FORCE_KEY,
    TAG_KEY,
    CaptureSink,
    GlobalLogprobsCapture,
    GlobalLogprobsCaptureV2,
    binding_sink,
)
from genlm_vlm.engine.forcing import ParticleHost
from genlm_vlm.engine.particles import Group


def _params(tag=None, forced=None):
    extra = {}
    if tag is not None:
        extra[TAG_KEY] = tag
    if forced is not None:
        extra[FORCE_KEY] = forced
    return SamplingParams(max_tokens=1, extra_args=extra or None)


def _update(removed=(), added=(), moved=(), size=0):
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def _logits(n, v=11, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed))


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, logits, rows, keys):
        self.calls.append((list(rows), list(keys)))
        return logits


def _v1(sink):
    with binding_sink(sink):
        return GlobalLogprobsCapture(None, torch.device("cpu"), False)


def _v2(sink):
    with binding_sink(sink):
        return GlobalLogprobsCaptureV2(None, None)


def test_v1_hands_forced_rows_to_the_forcer_through_moves_and_swaps():
    sink = CaptureSink()
    sink.forcer = rec = Recorder()
    cap = _v1(sink)
    cap.update_state(_update(added=[(0, _params(forced="p1"), [1], []), (1, _params("t"), [2], []),
                                    (2, _params(forced="p0"), [3], [])]))
    x = _logits(3)
    cap.apply(x)
    assert rec.calls == [([0, 2], ["p1", "p0"])]  # rows in order, each with its request id
    assert torch.equal(sink.pop("t"), torch.log_softmax(x[1], -1))  # captured rows are unaffected
    cap.update_state(_update(removed=[1], added=[(3, _params(forced="p2"), [4], [])],
                             moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL), (0, 3, MoveDirectionality.SWAP)]))
    assert cap.row_forced == {1: "p0", 3: "p1", 0: "p2"}
    cap.apply(_logits(4, seed=1))
    assert rec.calls[-1] == ([0, 1, 3], ["p2", "p0", "p1"])
    cap.update_state(_update(added=[(1, _params("u"), [5], [])]))  # an ordinary request takes row 1
    cap.apply(_logits(2, seed=2))  # rows past the batch are not handed over
    assert rec.calls[-1] == ([0], ["p2"])


def test_v2_maps_slots_to_request_ids_and_forgets_recycled_slots():
    sink = CaptureSink()
    sink.forcer = rec = Recorder()
    cap = _v2(sink)
    assert cap.add_request(4, _params(forced="p7")) is True
    assert cap.add_request(1, _params("t")) is True
    assert cap.add_request(6, _params(forced="p8")) is True
    assert cap.add_request(3, _params()) is False
    x = _logits(4, seed=3)
    out = cap.apply(x, SimpleNamespace(idx_mapping_np=np.array([6, 3, 1, 4], dtype=np.int32)))
    assert out is x
    assert rec.calls == [([0, 3], ["p8", "p7"])]
    assert torch.equal(sink.pop("t"), torch.log_softmax(x[2], -1))
    # slot 4 recycled for an ordinary request, slot 6 for another particle: no request id leaks
    assert cap.add_request(4, _params()) is False
    assert cap.add_request(6, _params(forced="p9")) is True
    cap.apply(_logits(3, seed=4), SimpleNamespace(idx_mapping_np=np.array([4, 6, 1])))
    assert rec.calls[-1] == ([1], ["p9"])
    assert cap.slot_forced == {6: "p9"}


class FakeRun:
    """Decides once every group has its row: each group takes its row's argmax."""

    def __init__(self, groups):
        self.groups, self.have, self.done, self.ending = groups, 0, False, None
        self.forced, self.counts = {}, {"early_rows": 0}

    def take(self, group, row):
        group.row = row
        self.have += 1
        return self.have == len(self.groups)

    def flat(self):
        return False  # rows one group at a time (take), as for groups of several particles

    def decide(self):
        self.forced = {g.rid: int(g.row.argmax()) for g in self.groups}


class FlatRun(FakeRun):
    """A run whose groups are one particle each (``flat``): particle ``i`` is group ``order[i]``;
    its rows come to ``decide`` at once, in particle order (into the forcer's reused buffer when
    ``borrows`` is set)."""

    def __init__(self, groups, order, borrows=False):
        super().__init__(groups)
        self.borrows_rows = borrows
        self.live = list(range(len(order)))
        self.group_of = [{i: groups[k] for i, k in enumerate(order)}]
        self.rows = None

    def flat(self):
        return True

    def decide(self, rows=None):
        assert rows is not None and self.have == len(self.groups)
        self.rows = rows
        self.forced = {self.group_of[0][i].rid: int(rows[i].argmax()) for i in self.live}


def _host(groups):
    host = ParticleHost(SimpleNamespace(count_fault=lambda kind: None))
    run = FakeRun(groups)
    for g in groups:
        host.by_rid[g.rid] = (run, g)
    return host, run


def _groups():
    out = []
    for i in range(3):
        g = Group(3)
        g.rid = f"p{i}"
        out.append(g)
    return out


def test_both_runners_force_the_same_tokens_through_one_core():
    """The same three particles seen by V1 (rows 0..2) and V2 (slots, rows re-sorted): the
    core makes each particle's token its row's one maximum, whichever row it sits in."""
    x = _logits(4, seed=5)
    forced = {}
    for runner in ("v1", "v2"):
        groups = _groups()
        host, run = _host(groups)
        sink = CaptureSink()
        sink.forcer = host.force
        if runner == "v1":
            cap = _v1(sink)
            cap.update_state(_update(added=[(0, _params(forced="p0"), [1], []), (1, _params(), [1], []),
                                            (2, _params(forced="p1"), [1], []), (3, _params(forced="p2"), [1], [])]))
            logits, where = x.clone(), {"p0": 0, "p1": 2, "p2": 3}
            out = cap.apply(logits)
        else:
            cap = _v2(sink)
            for slot, rid in ((9, "p0"), (5, "p1"), (2, "p2")):
                cap.add_request(slot, _params(forced=rid))
            cap.add_request(0, _params())
            logits = x[[3, 1, 2, 0]].clone()  # V2's rows: p2, the ordinary request, p1, p0
            where = {"p2": 0, "p1": 2, "p0": 3}
            out = cap.apply(logits, SimpleNamespace(idx_mapping_np=np.array([2, 0, 5, 9])))
        assert out is logits
        got = {}
        for rid, r in where.items():
            row = out[r]
            got[rid] = int(row.argmax())
            assert float(row[got[rid]]) == torch.finfo(row.dtype).max  # the one entry written
            assert int((row != x[{"p0": 0, "p1": 2, "p2": 3}[rid]]).sum()) == 1  # and no other
        ordinary = 1
        assert torch.equal(out[ordinary], x[1])  # the ordinary request's row is untouched
        forced[runner] = got
        assert run.have == 3
    assert forced["v1"] == forced["v2"] == {f"p{i}": int(x[r].argmax()) for i, r in enumerate((0, 2, 3))}


@pytest.mark.parametrize("borrows", [False, True])
def test_a_flat_run_gets_its_rows_in_particle_order_with_the_bits_of_rows_made_one_by_one(borrows):
    """Every group one particle and every row in this call: the run's rows come as one tensor in
    particle order (rows of the batch in another order, an ordinary request between them), each
    bitwise the row the capture makes alone; each request is forced to its particle's token. A
    run that borrows its rows gets them in the forcer's buffer, one that does not a tensor of its
    own."""
    from genlm_vlm.capture import logprob_rows

    groups = _groups()
    host = ParticleHost(SimpleNamespace(count_fault=lambda kind: None))
    run = FlatRun(groups, order=[2, 0, 1], borrows=borrows)  # particle 0 is p2, 1 is p0, 2 is p1
    for g in groups:
        host.by_rid[g.rid] = (run, g)
    x = _logits(5, v=300, seed=8) * 5
    with torch.inference_mode():  # as in vLLM's sampler
        logits = x.clone()
        out = host.force(logits, [0, 1, 3, 4], ["p1", "p2", "ordinary", "p0"])
    assert run.ending is None and out is logits
    rows = run.rows
    assert not rows.is_inference() and rows.shape == (3, 300) and rows.dtype == torch.float32
    where = {"p0": 4, "p1": 0, "p2": 1}
    for i, rid in enumerate(("p2", "p0", "p1")):
        assert torch.equal(rows[i], logprob_rows(x, [where[rid]])[0])
        row = out[where[rid]]
        assert int(row.argmax()) == int(x[where[rid]].argmax()) and int((row != x[where[rid]]).sum()) == 1
    assert torch.equal(out[[2, 3]], x[[2, 3]])  # rows of no forced request are untouched
    assert host.counts["forced_rows"] == 3 and all(g.row is None for g in groups)
    buf = host._rows_buf
    assert (buf is not None and rows.data_ptr() == buf.data_ptr()) if borrows else buf is None


def test_logprob_matrix_has_the_bits_of_rows_made_one_by_one():
    """``capture.logprob_matrix`` (the rows of a flat step in one tensor, made with the forcer's
    one or two threads) is bitwise the stack of the rows made one at a time with the other count, for
    consecutive and scattered rows, wide rows and half-precision logits."""
    from genlm_vlm.capture import logprob_matrix, logprob_rows
    from genlm_vlm.engine.forcing import FORCER_THREADS
    from genlm_vlm.smc.step import _Threads

    g = torch.Generator().manual_seed(4)
    for v, dtype in ((300, torch.float32), (32_000, torch.float32), (1_536, torch.bfloat16)):
        logits = (torch.randn(40, v, generator=g) * 7).to(dtype)
        logits[5, 17] = float("-inf")
        for rows in ([*range(3, 40)], [0, 2, 3, 9, 39], [7], [39, 5, 6, 0]):
            for threads in ({1, 2} | ({FORCER_THREADS} - {None})):
                with _Threads(threads):
                    got = logprob_matrix(logits, rows)
                with _Threads(3 - threads if threads <= 2 else 1):
                    alone = torch.stack(logprob_rows(logits, rows))
                assert got.dtype == torch.float32 and got.shape == (len(rows), v)
                assert torch.equal(got, alone)


def test_partial_prefills_and_early_rows_are_not_forced():
    groups = _groups()
    host, run = _host(groups)
    host._chunks = lambda: {"p1"}  # p1's row is a partial prefill this step
    x = _logits(3, seed=6)
    out = host.force(x.clone(), [0, 1, 2], ["p0", "p1", "p2"])
    assert torch.equal(out, x)  # the run is not complete: nothing forced
    assert groups[1].row is None and groups[0].stale and groups[2].stale  # p0, p2 wait for p1 (aborted after the step)
    assert run.counts["early_rows"] == 2


def test_block_rows_have_the_bits_of_rows_made_one_by_one():
    """The forcer's rows (``views=True``: one kernel per block of rows, consecutive rows read in
    place, others gathered) are bitwise the rows the capture makes one at a time, which are the
    rows the Python reference sees."""
    from genlm_vlm import capture
    from genlm_vlm.capture import logprob_rows

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 300, generator=g) * 7
    logits[5, 17] = float("-inf")
    for rows in ([*range(3, 40)], [0, 2, 3, 9, 39], [7], [4, 5, 6, 8, 9, 10]):
        alone = logprob_rows(logits, rows)
        saved = capture.CPU_BLOCK_ENTRIES
        try:
            for entries in (saved, 300 * 8, 300 * 9):  # one block; blocks of 8 and 9 rows
                capture.CPU_BLOCK_ENTRIES = entries
                blocked = logprob_rows(logits, rows, views=True)
                assert len(blocked) == len(rows)
                for a, b in zip(alone, blocked, strict=True):
                    assert a.dtype == b.dtype == torch.float32
                    assert torch.equal(a, b)
        finally:
            capture.CPU_BLOCK_ENTRIES = saved


def test_force_rows_makes_each_token_its_rows_only_maximum_and_touches_nothing_else():
    """The forced entry becomes the dtype's largest finite value (argmax takes it; a softmax of
    the row gives it probability 1, no NaN, even beside -inf entries); no other entry changes."""
    from genlm_vlm.engine.forcing import force_rows

    # float32 and float16 go through numpy on the CPU, bfloat16 through torch's index_put
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        base = (torch.randn(6, 11) * 50).to(dtype)
        base[2, 9] = float("-inf")
        for rows, tokens in (([1, 2, 3], [4, 0, 10]), ([5, 0, 2], [1, 1, 9]), ([4], [3])):
            logits = base.clone()
            force_rows(logits, rows, tokens)
            for r in range(6):
                if r in rows:
                    tok = tokens[rows.index(r)]
                    assert int(logits[r].argmax()) == tok and float(logits[r, tok]) == torch.finfo(dtype).max
                    p = torch.softmax(logits[r].float(), -1)
                    assert float(p[tok]) == 1.0 and not bool(p.isnan().any())
                    rest = torch.arange(11) != tok
                    assert torch.equal(logits[r][rest], base[r][rest])
                else:
                    assert torch.equal(logits[r], base[r])


def test_a_forced_request_that_vllm_sampled_otherwise_fails_its_run_only():
    """After the step, each forced request's sampled token is checked against the token forced
    (a row holding +inf or the largest float could tie): a mismatch fails that run before the
    token is computed; another run's requests, sampled as forced, go on."""
    groups = _groups()
    host, run = _host(groups)
    other_groups = [Group(3)]
    other_groups[0].rid = "q0"
    other = FlatRun(other_groups, order=[0])
    host.by_rid["q0"] = (other, other_groups[0])
    faults = []
    host.loop = SimpleNamespace(count_fault=faults.append)
    host._expect = {"p0": 4, "p1": 7, "q0": 2}
    out = lambda rid, tok: SimpleNamespace(request_id=rid, new_token_ids=[tok], finish_reason=None,  # noqa: E731
                                           prefill_stats=None)
    settled = []
    run.settle = lambda: settled.append("run")
    other.settle = lambda: settled.append("other")
    host.runs = {run, other}
    host.after_step([out("p0", 4), out("p1", 5), out("q0", 2)])
    how, exc, _ = run.ending
    assert how == "fail" and "sampled token 5 for particle request p1" in str(exc) and "drew 7" in str(exc)
    assert other.ending is None and faults == ["burst_errors"] and sorted(settled) == ["other", "run"]
    assert host._expect == {}
