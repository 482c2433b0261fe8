"""Capture of full-vocabulary next-token log-probabilities inside vLLM's sampler.

Two logits processors with the same behaviour, one for each vLLM model runner:

* :class:`GlobalLogprobsCapture` for the V1 model runner (``vllm.v1.sample.logits_processor``
  interface: rows are tracked from ``BatchUpdate`` messages);
* :class:`GlobalLogprobsCaptureV2` for Model Runner V2 (``add_request`` per slot and
  ``ctx.idx_mapping_np[row] -> slot`` in ``apply``).

Both are passed to vLLM through its official ``LLM(..., logits_processors=[cls])`` argument.
They look at every request's ``SamplingParams.extra_args``; a request carrying the key
:data:`TAG_KEY` is ours and every row it occupies in an ``apply`` call is stored as
``log_softmax(row.float())`` under its tag. A later row for the same tag overwrites an earlier
one, so after the request finishes the stored row is the one from the step in which its prefill
completed (a partially prefilled request is sampled too, and that token is discarded by vLLM).
Requests without the tag are not touched, and the logits are always returned unchanged.

The processors declare themselves *not* argmax-invariant, which makes vLLM apply them to the raw
logits (before penalties and temperature) and never skip them for all-greedy batches.

Results go to a :class:`CaptureSink`. While :func:`binding_sink` is active, every capture
instance constructed in this process binds to that sink; the engine module uses this to hand
the instance(s) created inside ``vllm.LLM(...)`` to the caller without walking vLLM internals.
This module holds no engine code.
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .rowring import RING_ENV

TAG_KEY = "genlm_vlm_tag"
"""Key in ``SamplingParams.extra_args`` whose value (a str) marks a request for capture."""


class CaptureSink:
    """Where capture processors put rows: ``tag -> 1-D float32 log-probability tensor``.

    Rows stay on the device the logits were on (the engine's device). All mutation happens on the
    engine thread (inside ``LLM.generate``); :meth:`pop` is called on that same thread after
    ``generate`` returns, so no lock is needed on the hot path. A lock still guards ``instances``.
    """

    def __init__(self) -> None:
        self.rows: dict[str, torch.Tensor] = {}
        self.instances: list[Any] = []
        self.apply_calls = 0
        self.rows_captured = 0
        self._lock = threading.Lock()

    def register(self, processor: Any) -> None:
        with self._lock:
            self.instances.append(processor)

    def store(self, tags: list[str], logits: torch.Tensor, rows: list[int]) -> None:
        """Store ``log_softmax`` of ``logits[rows]`` (float32) under ``tags`` (same order).

        On CPU each row is computed into its own compact tensor (measured 4x faster than one
        batched op for 256 x 32k rows, which page-faults on its large allocation). On an
        accelerator one batched kernel runs and the stored rows are views of its output.

        vLLM runs the model (and so this) under ``torch.inference_mode``, where every new
        tensor is an *inference tensor*: outside that mode it refuses in-place edits and
        autograd. The rows are therefore made with inference mode off (reading the inference
        logits is allowed): each row is an ordinary tensor from the start, and the caller gets
        a tensor it can edit (``row[mask] = -inf``) without a second copy.
        """
        with torch.inference_mode(False):
            if logits.device.type == "cpu":
                for tag, r in zip(tags, rows, strict=True):
                    self.rows[tag] = torch.log_softmax(logits[r].to(torch.float32), dim=-1)
            else:
                index = torch.as_tensor(rows, device=logits.device, dtype=torch.long)
                logprobs = torch.log_softmax(logits.index_select(0, index).to(torch.float32), dim=-1)
                for tag, row in zip(tags, logprobs, strict=True):
                    self.rows[tag] = row
        self.apply_calls += 1
        self.rows_captured += len(tags)

    def pop(self, tag: str) -> torch.Tensor | None:
        return self.rows.pop(tag, None)

    remote: Any = None
    """A :class:`~genlm_vlm.rowring.RowRing` when the capture runs in tensor-parallel worker
    processes (rows arrive through it), else None."""

    def collect(self) -> None:
        """Bring rows written by worker processes since the last call into :attr:`rows`.

        Called by the engine thread after every engine step; a no-op for an in-process capture.
        """
        ring = self.remote
        if ring is not None:
            n = ring.drain(self.rows)
            if n:
                self.rows_captured += n
                self.apply_calls = ring.apply_calls

    def discard(self, tags: list[str]) -> None:
        for tag in tags:
            self.rows.pop(tag, None)


_binding_lock = threading.Lock()
_active_sink: CaptureSink | None = None


@contextlib.contextmanager
def binding_sink(sink: CaptureSink) -> Iterator[CaptureSink]:
    """Bind capture instances constructed inside this block to ``sink``.

    Only one engine can be built at a time in a process; a second concurrent build waits.
    """
    global _active_sink
    with _binding_lock:
        _active_sink = sink
        try:
            yield sink
        finally:
            _active_sink = None


def _claim_sink(processor: Any) -> CaptureSink:
    sink = _active_sink
    if sink is None and os.environ.get(RING_ENV):
        # In a tensor-parallel worker process: rank 0 writes rows to the engine's shared ring.
        from .rowring import RingWriterSink

        return RingWriterSink(os.environ[RING_ENV])  # type: ignore[return-value]
    if sink is None:
        # Built outside genlm_vlm's engine builder (e.g. a user passing the class to their own
        # LLM): still works, rows go to a private sink reachable as ``processor.sink``.
        sink = CaptureSink()
    sink.register(processor)
    return sink


def _tag_of(params: Any) -> str | None:
    extra = getattr(params, "extra_args", None)
    if not extra:
        return None
    tag = extra.get(TAG_KEY)
    return tag if isinstance(tag, str) else None


def _v1_base() -> type:
    try:
        from vllm.v1.sample.logits_processor import LogitsProcessor
    except ImportError:  # pragma: no cover - vLLM missing or older layout
        return object
    return LogitsProcessor


def _v2_base() -> type:
    try:
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor
    except ImportError:  # pragma: no cover - vLLM without Model Runner V2
        return object
    return LogitsProcessor


class _CaptureV1:
    """V1-runner logits processor that records the log-probabilities of tagged requests.

    Tracks ``row -> tag`` from vLLM's ``BatchUpdate`` (removed, then added, then moved/swapped)
    and on each ``apply(logits)`` stores ``log_softmax`` of every tagged row into :attr:`sink`.
    Never modifies the logits.
    """

    def __init__(self, vllm_config: Any = None, device: Any = None, is_pin_memory: bool = False):
        self.sink = _claim_sink(self)
        self.row_tags: dict[int, str] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:  # noqa: D102 - vLLM hook
        return None

    def is_argmax_invariant(self) -> bool:
        # False: run on raw logits, before temperature, and even when every request is greedy.
        return False

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        row_tags = self.row_tags
        for index in batch_update.removed:
            row_tags.pop(index, None)
        for added in batch_update.added:
            index, params = added[0], added[1]
            tag = _tag_of(params)
            if tag is None:
                row_tags.pop(index, None)
            else:
                row_tags[index] = tag
        for moved in batch_update.moved:
            src, dst, direction = moved[0], moved[1], moved[2]
            if _is_swap(direction):
                a, b = row_tags.pop(src, None), row_tags.pop(dst, None)
                if a is not None:
                    row_tags[dst] = a
                if b is not None:
                    row_tags[src] = b
            else:
                tag = row_tags.pop(src, None)
                if tag is None:
                    row_tags.pop(dst, None)
                else:
                    row_tags[dst] = tag

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.row_tags:
            num_rows = logits.shape[0]
            items = [(r, t) for r, t in self.row_tags.items() if r < num_rows]
            if items:
                self.sink.store([t for _, t in items], logits, [r for r, _ in items])
        return logits


def _is_swap(direction: Any) -> bool:
    return getattr(direction, "name", str(direction)).upper().endswith("SWAP")


class _CaptureV2:
    """Model Runner V2 twin of :class:`GlobalLogprobsCapture`.

    ``add_request(slot, params)`` records the slot's tag (or clears it for an untagged request,
    since slots are recycled); ``apply(logits, ctx)`` maps each row to its slot through
    ``ctx.idx_mapping_np`` and stores the tagged rows. Never modifies the logits.
    """

    def __init__(self, vllm_config: Any = None, req_states: Any = None):
        self.sink = _claim_sink(self)
        self.slot_tags: dict[int, str] = {}

    def add_request(self, slot: int, sampling_params: Any) -> bool:
        tag = _tag_of(sampling_params)
        if tag is None:
            self.slot_tags.pop(int(slot), None)
            return False
        self.slot_tags[int(slot)] = tag
        return True

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        if self.slot_tags:
            mapping = ctx.idx_mapping_np
            tags: list[str] = []
            rows: list[int] = []
            for row in range(min(logits.shape[0], len(mapping))):
                tag = self.slot_tags.get(int(mapping[row]))
                if tag is not None:
                    tags.append(tag)
                    rows.append(row)
            if rows:
                self.sink.store(tags, logits, rows)
        return logits


# The public classes subclass vLLM's LogitsProcessor interfaces, and importing those imports vLLM
# (seconds). They are defined on first access (module ``__getattr__``), so importing this module,
# or genlm_vlm, stays vLLM-free until an engine is built or a class is asked for.
_LAZY_CLASSES = {
    "GlobalLogprobsCapture": (_CaptureV1, _v1_base),
    "GlobalLogprobsCaptureV2": (_CaptureV2, _v2_base),
}
_define_lock = threading.Lock()

if TYPE_CHECKING:
    GlobalLogprobsCapture = _CaptureV1
    GlobalLogprobsCaptureV2 = _CaptureV2


def __getattr__(name: str) -> type:
    spec = _LAZY_CLASSES.get(name)
    if spec is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _define_lock:
        cls = globals().get(name)
        if cls is None:
            impl, base = spec

            def body(ns: dict[str, Any], impl: type = impl) -> None:
                ns.update(__module__=__name__, __qualname__=name, __doc__=impl.__doc__)

            cls = types.new_class(name, (impl, base()), exec_body=body)
            globals()[name] = cls
    return cls


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_CLASSES})
