"""Rows from a CUDA engine to CPU output go through pinned memory with an asynchronous copy
(genlm_vlm/engine/transfer.py). No GPU here: "CUDA" and the pinned allocation are stand-ins."""

from __future__ import annotations

import pytest
import torch
from fake_core import FakeCore, fake_row

from genlm_vlm.engine import EngineDriver, steps, transfer


def test_only_cuda_to_cpu_takes_the_pinned_path():
    assert transfer.pinned_copy_applies(torch.device("cuda", 0), torch.device("cpu"))
    assert not transfer.pinned_copy_applies(torch.device("cpu"), torch.device("cpu"))
    assert not transfer.pinned_copy_applies(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not transfer.pinned_copy_applies(torch.device("cpu"), torch.device("cuda", 0))


def test_pinned_copy_allocates_pinned_copies_asynchronously_then_synchronises():
    events: list[str] = []

    def empty(shape, dtype, pin_memory):
        events.append(f"empty pin_memory={pin_memory}")
        out = torch.empty(shape, dtype=dtype)
        real_copy = out.copy_

        def copy_(src, non_blocking=False):
            events.append(f"copy non_blocking={non_blocking}")
            return real_copy(src)

        out.copy_ = copy_  # type: ignore[method-assign]
        return out

    src = torch.randn(3, 7)
    host = transfer.pinned_host_copy(src, empty=empty, synchronize=lambda: events.append("synchronize"))
    assert torch.equal(host, src)
    assert events == ["empty pin_memory=True", "copy non_blocking=True", "synchronize"]


def test_move_rows_takes_the_pinned_path_when_it_applies(monkeypatch):
    rows = [torch.randn(5) for _ in range(3)]
    calls = []
    monkeypatch.setattr(transfer, "pinned_copy_applies", lambda s, t: True)  # stand-in: "the rows are on CUDA"
    monkeypatch.setattr(transfer, "pinned_host_copy", lambda src: calls.append(src.shape) or src.clone())
    moved = transfer.move_rows(rows, torch.device("cpu"))
    assert calls == [torch.Size([3, 5])]
    assert all(torch.equal(a, b) for a, b in zip(moved, rows, strict=True))
    monkeypatch.undo()
    plain = transfer.move_rows(rows, torch.device("meta"))  # any other pair: Tensor.to
    assert all(r.device.type == "meta" for r in plain)


def test_the_engine_delivers_rows_through_move_rows(monkeypatch):
    """The step loop moves rows that are not on output_device with move_rows (one call per
    delivery), and what it returns is what the callers get."""
    seen: list[tuple[int, str]] = []

    def recorder(rows, device):
        seen.append((len(rows), str(device)))
        return tuple(r.clone() for r in rows)

    monkeypatch.setattr(steps, "move_rows", recorder)
    driver = EngineDriver("fake", core_factory=lambda: FakeCore(), output_device="meta")
    try:
        futs = driver.submit_logprobs([((1, 2, 3), None), ((4, 5), None)])
        got = [f.result(timeout=10) for f in futs]
    finally:
        driver.shutdown()
    assert sum(n for n, _ in seen) == 2 and {d for _, d in seen} == {"meta"}
    assert torch.equal(got[0], fake_row((1, 2, 3), 64)) and torch.equal(got[1], fake_row((4, 5), 64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_copy_on_a_real_gpu():
    src = torch.randn(4, 1000, device="cuda")
    host = transfer.pinned_host_copy(src)
    assert host.is_pinned() and torch.equal(host, src.cpu())
