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
Requests without the tag are not touched. The logits are returned unchanged, except the rows of
requests marked with :data:`FORCE_KEY` (particles of an ``lm.smc`` run on the requests path),
which the engine's forcer (:attr:`CaptureSink.forcer`) may rewrite to force a token.

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

import numpy as np
import torch

from .rowring import RING_ENV

TAG_KEY = "genlm_vlm_tag"
"""Key in ``SamplingParams.extra_args`` whose value (a str) marks a request for capture."""

FORCE_KEY = "genlm_vlm_particle"
"""Key in ``SamplingParams.extra_args`` whose value (a str, the request's id) marks a request whose
tokens are forced: a particle of an SMC run decoding as a running request. Its rows go to
:attr:`CaptureSink.forcer` (set by the engine), which may rewrite them in place."""


CPU_BLOCK_ENTRIES = 1 << 20
"""``logprob_rows(..., views=True)`` on the CPU computes rows in blocks of at most this many
entries (4 MiB of float32), one kernel per block."""


def logprob_rows(logits: torch.Tensor, rows: list[int], views: bool = False) -> list[torch.Tensor]:
    """``log_softmax(logits[r].float())`` for each ``r`` in ``rows``, as ordinary tensors (made
    with inference mode off). On an accelerator: views of one batched kernel's output. On the CPU:
    one compact tensor per row (one batched op over 256 x 32k rows page-faulted on its large
    allocation: 4x slower), or with ``views`` (for rows used and dropped within a step, as the
    forcer's are) views of one kernel's output per block of rows of at most
    :data:`CPU_BLOCK_ENTRIES` entries (consecutive rows read in place, others gathered first;
    rows wider than an eighth of a block still one by one). The kernel computes each row on its
    own, so a row has the same bits in a block or alone. Every path that hands rows to a
    controller makes them here, so they are the same bits wherever the row was computed."""
    with torch.inference_mode(False):
        if logits.device.type == "cpu":
            per_block = CPU_BLOCK_ENTRIES // max(1, int(logits.shape[-1]))
            if not views or per_block < 8 or len(rows) < 2:
                return [torch.log_softmax(logits[r].to(torch.float32), dim=-1) for r in rows]
            out: list[torch.Tensor] = []
            for start in range(0, len(rows), per_block):
                out.extend(logprob_matrix(logits, rows[start : start + per_block]).unbind(0))
            return out
        index = torch.as_tensor(rows, device=logits.device, dtype=torch.long)
        return list(torch.log_softmax(logits.index_select(0, index).to(torch.float32), dim=-1))


def logprob_matrix(logits: torch.Tensor, rows: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.stack(logprob_rows(logits, rows))`` made at once: one ``float32 [len(rows), V]``
    tensor (an ordinary tensor, made with inference mode off) whose row ``i`` is
    ``log_softmax(logits[rows[i]].float())``, the same bits as :func:`logprob_rows` gives (the
    kernel computes each row on its own; tested). Consecutive rows are read in place, others
    gathered first; no per-row tensor and no stacking copy. ``rows`` must not be empty.
    ``out``: None (a new tensor), or a contiguous ``float32 [len(rows), V]`` ordinary tensor on
    ``logits``' device to write the rows into and return (a buffer reused from step to step:
    the caller makes sure nobody still reads its previous rows)."""
    with torch.inference_mode(False):
        first = rows[0]
        if rows[-1] - first + 1 == len(rows) and rows == list(range(first, first + len(rows))):
            src = logits[first : first + len(rows)]
        else:
            at = (torch.from_numpy(np.asarray(rows, dtype=np.int64)) if logits.device.type == "cpu"
                  else torch.as_tensor(rows, device=logits.device, dtype=torch.long))
            src = logits.index_select(0, at)
        return torch.log_softmax(src.to(torch.float32), dim=-1, out=out)


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
        for tag, row in zip(tags, logprob_rows(logits, rows), strict=True):
            self.rows[tag] = row
        self.apply_calls += 1
        self.rows_captured += len(tags)

    def pop(self, tag: str) -> torch.Tensor | None:
        return self.rows.pop(tag, None)

    forcer: Any = None
    """None, or ``forcer(logits, rows, keys) -> logits``: called by the capture processors in
    every ``apply`` that holds rows of requests marked with :data:`FORCE_KEY` (``keys[i]``: the
    mark of row ``rows[i]``), after the tagged rows are stored; it may edit those rows in place.
    Set by the engine (:mod:`genlm_vlm.engine.forcing`)."""

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


def _tag_of(params: Any, key: str = TAG_KEY) -> str | None:
    extra = getattr(params, "extra_args", None)
    if not extra:
        return None
    tag = extra.get(key)
    return tag if isinstance(tag, str) else None


def _move(table: dict[int, str], src: int, dst: int, swap: bool) -> None:
    """One ``BatchUpdate.moved`` entry applied to a ``row -> mark`` table."""
    a = table.pop(src, None)
    b = table.pop(dst, None)
    if a is not None:
        table[dst] = a
    if swap and b is not None:
        table[src] = b


def _forward(sink: Any, logits: torch.Tensor, pairs: list[tuple[int, str]]) -> torch.Tensor:
    """Hand the forced rows of one ``apply`` to the sink's forcer (unchanged logits without one)."""
    forcer = sink.forcer
    if forcer is None or not pairs:
        return logits
    pairs.sort()
    return forcer(logits, [r for r, _ in pairs], [k for _, k in pairs])


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
    Rows of requests marked with :data:`FORCE_KEY` (tracked the same way, ``row_forced``) are
    handed to ``sink.forcer``, which may rewrite them; no other row is ever modified.
    """

    def __init__(self, vllm_config: Any = None, device: Any = None, is_pin_memory: bool = False):
        self.sink = _claim_sink(self)
        self.row_tags: dict[int, str] = {}
        self.row_forced: dict[int, str] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:  # noqa: D102 - vLLM hook
        return None

    def is_argmax_invariant(self) -> bool:
        # False: run on raw logits, before temperature, and even when every request is greedy.
        return False

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        row_tags, forced = self.row_tags, self.row_forced
        for index in batch_update.removed:
            row_tags.pop(index, None)
            forced.pop(index, None)
        for added in batch_update.added:
            index, params = added[0], added[1]
            for table, key in ((row_tags, TAG_KEY), (forced, FORCE_KEY)):
                tag = _tag_of(params, key)
                if tag is None:
                    table.pop(index, None)
                else:
                    table[index] = tag
        for moved in batch_update.moved:
            src, dst, swap = moved[0], moved[1], _is_swap(moved[2])
            _move(row_tags, src, dst, swap)
            if forced:
                _move(forced, src, dst, swap)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        num_rows = logits.shape[0]
        if self.row_tags:
            items = [(r, t) for r, t in self.row_tags.items() if r < num_rows]
            if items:
                self.sink.store([t for _, t in items], logits, [r for r, _ in items])
        if self.row_forced:
            logits = _forward(self.sink, logits, [(r, k) for r, k in self.row_forced.items() if r < num_rows])
        return logits


def _is_swap(direction: Any) -> bool:
    return getattr(direction, "name", str(direction)).upper().endswith("SWAP")


class _CaptureV2:
    """Model Runner V2 twin of :class:`GlobalLogprobsCapture`.

    ``add_request(slot, params)`` records the slot's tag (or clears it for an untagged request,
    since slots are recycled); ``apply(logits, ctx)`` maps each row to its slot through
    ``ctx.idx_mapping_np`` and stores the tagged rows. Forced requests (:data:`FORCE_KEY`) are
    tracked per slot too and their rows handed to ``sink.forcer``; no other row is modified.
    """

    def __init__(self, vllm_config: Any = None, req_states: Any = None):
        self.sink = _claim_sink(self)
        self.slot_tags: dict[int, str] = {}
        self.slot_forced: dict[int, str] = {}

    def add_request(self, slot: int, sampling_params: Any) -> bool:
        slot = int(slot)
        wanted = False
        for table, key in ((self.slot_tags, TAG_KEY), (self.slot_forced, FORCE_KEY)):
            tag = _tag_of(sampling_params, key)
            if tag is None:
                table.pop(slot, None)  # slots are recycled: forget the last request's mark
            else:
                table[slot] = tag
                wanted = True
        return wanted

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        if self.slot_tags or self.slot_forced:
            mapping = ctx.idx_mapping_np
            slot_tags, slot_forced = self.slot_tags, self.slot_forced
            tags: list[str] = []
            rows: list[int] = []
            pairs: list[tuple[int, str]] = []
            for row in range(min(logits.shape[0], len(mapping))):
                slot = int(mapping[row])
                tag = slot_tags.get(slot)
                if tag is not None:
                    tags.append(tag)
                    rows.append(row)
                mark = slot_forced.get(slot)
                if mark is not None:
                    pairs.append((row, mark))
            if rows:
                self.sink.store(tags, logits, rows)
            if pairs:
                logits = _forward(self.sink, logits, pairs)
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
