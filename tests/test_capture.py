"""Capture processors driven directly (no engine): row/slot bookkeeping and no logit changes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from genlm_vlm.capture import (
    TAG_KEY,
    CaptureSink,
    GlobalLogprobsCapture,
    GlobalLogprobsCaptureV2,
    binding_sink,
)


def _params(tag=None):
    return SamplingParams(max_tokens=1, extra_args=None if tag is None else {TAG_KEY: tag})


def _update(removed=(), added=(), moved=(), size=0):
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def _logits(n, v=11, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed))


def test_v1_tracks_rows_through_add_remove_move_swap():
    sink = CaptureSink()
    with binding_sink(sink):
        cap = GlobalLogprobsCapture(None, torch.device("cpu"), False)
    assert sink.instances == [cap]
    assert cap.is_argmax_invariant() is False
    cap.update_state(None)
    cap.update_state(_update(added=[(0, _params("a"), [1], []), (1, _params(), [2], []), (2, _params("b"), [3], [])]))
    x = _logits(3)
    out = cap.apply(x)
    assert out is x  # logits untouched, same tensor
    assert torch.allclose(sink.pop("a"), torch.log_softmax(x[0], -1))
    assert torch.allclose(sink.pop("b"), torch.log_softmax(x[2], -1))
    assert sink.rows == {}
    # "a" finishes; untagged row 1 moves into 0; "b" swaps with a new tagged "c" added at 1
    cap.update_state(
        _update(
            removed=[0],
            added=[(3, _params("c"), [4], [])],
            moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL), (2, 3, MoveDirectionality.SWAP)],
        )
    )
    assert cap.row_tags == {2: "c", 3: "b"}
    x = _logits(4, seed=1)
    cap.apply(x)
    assert torch.allclose(sink.pop("c"), torch.log_softmax(x[2], -1))
    assert torch.allclose(sink.pop("b"), torch.log_softmax(x[3], -1))
    # an untagged request replacing a tagged row clears it
    cap.update_state(_update(added=[(2, _params(), [5], [])]))
    assert cap.row_tags == {3: "b"}


def test_v1_last_row_wins_and_rows_beyond_batch_ignored():
    sink = CaptureSink()
    with binding_sink(sink):
        cap = GlobalLogprobsCapture(None, torch.device("cpu"), False)
    cap.update_state(_update(added=[(0, _params("a"), [1], []), (5, _params("z"), [1], [])]))
    first, second = _logits(2, seed=2), _logits(2, seed=3)
    cap.apply(first)  # partial prefill step
    cap.apply(second)  # step where the prefill finished
    assert torch.allclose(sink.pop("a"), torch.log_softmax(second[0], -1))
    assert sink.pop("z") is None  # row 5 not scheduled in a 2-row batch


def test_v2_slots_recycled_and_rows_resorted():
    sink = CaptureSink()
    with binding_sink(sink):
        cap = GlobalLogprobsCaptureV2(None, None)
    assert cap.add_request(4, _params("a")) is True
    assert cap.add_request(7, _params()) is False
    assert cap.add_request(2, _params("b")) is True
    x = _logits(3, seed=4)
    ctx = SimpleNamespace(idx_mapping_np=np.array([7, 2, 4], dtype=np.int32))
    assert cap.apply(x, ctx) is x
    assert torch.allclose(sink.pop("a"), torch.log_softmax(x[2], -1))
    assert torch.allclose(sink.pop("b"), torch.log_softmax(x[1], -1))
    # slot 4 recycled for an untagged request: nothing captured for it any more
    assert cap.add_request(4, _params()) is False
    cap.apply(_logits(2, seed=5), SimpleNamespace(idx_mapping_np=np.array([4, 2])))
    assert set(sink.rows) == {"b"}


def test_v2_is_a_vllm_v2_processor():
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2Base

    assert issubclass(GlobalLogprobsCaptureV2, V2Base)
    assert not issubclass(GlobalLogprobsCapture, V2Base)


def test_capture_outside_genlm_engine_gets_private_sink():
    cap = GlobalLogprobsCapture(None, torch.device("cpu"), False)
    assert isinstance(cap.sink, CaptureSink) and cap.sink.instances == [cap]


def test_rows_made_under_inference_mode_are_ordinary_tensors():
    """vLLM runs the capture under torch.inference_mode; the stored rows must still be tensors a
    caller can edit in place and differentiate (issue 29), on the CPU branch and the batched
    accelerator branch (exercised here on the meta device)."""
    for device in ("cpu", "meta"):
        sink = CaptureSink()
        with torch.inference_mode():
            sink.store(["a", "b"], torch.randn(3, 11, device=device), [0, 2])
        for tag in ("a", "b"):
            row = sink.pop(tag)
            assert row is not None and not row.is_inference(), device
            row[0] = -float("inf")
            row.requires_grad_()
