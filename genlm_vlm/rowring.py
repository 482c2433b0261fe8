"""A shared-memory ring that brings captured rows from a worker process to the engine thread.

With ``tensor_parallel_size > 1`` vLLM runs the model in worker processes, so the capture
processors live there. Every rank sees the full logits (vLLM all-gathers them before the
processors run); rank 0 writes the log-probabilities of each tagged row straight into a slot of
this ring (``log_softmax`` writes its output straight into the slot: no copy on the worker side), and
the engine thread, right after each engine step returns, copies the step's rows out into the
:class:`~genlm_vlm.capture.CaptureSink` (one copy per row, since slots are reused next step).

The ring is a file in ``/dev/shm`` (a tmpfs: memory, never disk) mapped by both processes. The
engine process creates it after the engine is built (it knows the logit width and vLLM's
``max_num_seqs``, the most rows one step can hold) and removes it when the engine is freed; the
worker maps it the first time it has a row to write (its path comes in the environment variable
:data:`RING_ENV`, which the workers inherit when vLLM spawns them).

Ordering: a worker writes during a step, and the engine process reads only after that step's
output has come back through vLLM's message queue, before it schedules the next step (genlm_vlm
builds tensor-parallel engines without async scheduling, so no step overlaps another). There
is no lock.

Layout (little-endian)::

    header   16 x int64: magic, layout version, width V, capacity C, tag bytes T, count,
             apply calls, rows written, overflowed rows, writer pid, (reserved)
    tags     C x T bytes, UTF-8, zero padded
    rows     C x V float32 (64-byte aligned)
"""

from __future__ import annotations

import atexit
import mmap
import os
import tempfile
import uuid
from typing import Any

import torch

RING_ENV = "GENLM_VLM_ROW_RING"
"""Environment variable naming the ring file for capture processors in worker processes."""

_MAGIC = 0x67656E6C6D726F77  # "genlmrow"
_VERSION = 1
_HEADER = 16  # int64 words
_TAG_BYTES = 64
(_W_MAGIC, _W_VERSION, _W_WIDTH, _W_CAP, _W_TAGB, _W_COUNT, _W_APPLY, _W_ROWS, _W_OVERFLOW, _W_PID) = range(10)


_owned: set[str] = set()  # ring files this process created and has not removed yet


@atexit.register
def _remove_owned() -> None:  # pragma: no cover - interpreter exit
    for path in list(_owned):
        try:
            os.unlink(path)
        except OSError:
            pass


def _layout(width: int, capacity: int) -> tuple[int, int, int]:
    tags_off = _HEADER * 8
    rows_off = tags_off + capacity * _TAG_BYTES
    rows_off = (rows_off + 63) // 64 * 64
    return tags_off, rows_off, rows_off + capacity * width * 4


def ring_dir() -> str:
    """``/dev/shm`` where it exists (memory-backed), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def new_ring_path() -> str:
    """A fresh file name for a ring (not created)."""
    return os.path.join(ring_dir(), f"genlm_vlm_rows_{os.getpid()}_{uuid.uuid4().hex[:12]}")


class RowRing:
    """A mapped ring file; :meth:`create` on the engine side, :meth:`attach` in the worker."""

    def __init__(self, path: str, mm: mmap.mmap, width: int, capacity: int, owner: bool) -> None:
        self.path = path
        self.width = width
        self.capacity = capacity
        self.owner = owner
        self._mm = mm
        tags_off, rows_off, _ = _layout(width, capacity)
        self._tags_off = tags_off
        self.header = memoryview(mm)[: _HEADER * 8].cast("q")
        #: ``[capacity, width]`` float32 view of the row slots (shared memory).
        self.rows = torch.frombuffer(mm, dtype=torch.float32, offset=rows_off, count=capacity * width).view(
            capacity, width
        )

    # ------------------------------------------------------------ engine side
    @classmethod
    def create(cls, path: str, width: int, capacity: int) -> RowRing:
        """Create and map the ring file (``width`` logits per row, ``capacity`` rows per step).

        Memory is committed only as slots are first written (the file is sparse).
        """
        if width <= 0 or capacity <= 0:
            raise ValueError(f"row ring needs a positive width and capacity, got {width} x {capacity}")
        size = _layout(width, capacity)[2]
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _owned.add(path)
        ring = cls(path, mm, width, capacity, owner=True)
        h = ring.header
        h[_W_WIDTH], h[_W_CAP], h[_W_TAGB], h[_W_VERSION] = width, capacity, _TAG_BYTES, _VERSION
        h[_W_MAGIC] = _MAGIC  # last: a worker that maps the file sees a complete header
        return ring

    def drain(self, into: dict[str, torch.Tensor]) -> int:
        """Copy the rows written since the last drain into ``into`` (tag -> own tensor).

        In slot order, so a tag written twice keeps its later row. Returns the number of rows.
        """
        h = self.header
        count = int(h[_W_COUNT])
        if count == 0:
            return 0
        mm, off, rows = self._mm, self._tags_off, self.rows
        for k in range(count):
            raw = mm[off + k * _TAG_BYTES : off + (k + 1) * _TAG_BYTES]
            into[raw.rstrip(b"\0").decode()] = rows[k].clone()
        h[_W_COUNT] = 0
        return count

    @property
    def apply_calls(self) -> int:
        return int(self.header[_W_APPLY])

    @property
    def rows_written(self) -> int:
        return int(self.header[_W_ROWS])

    @property
    def overflowed(self) -> int:
        """Rows dropped because a step produced more tagged rows than the ring holds."""
        return int(self.header[_W_OVERFLOW])

    @property
    def writer_pid(self) -> int:
        """Process id of the worker that writes rows (0 until it first writes)."""
        return int(self.header[_W_PID])

    def close(self) -> None:
        """Unmap; the owner also removes the file. Idempotent."""
        if self._mm is None:
            return
        self.rows = None  # type: ignore[assignment]
        self.header.release()
        try:
            self._mm.close()
        except BufferError:  # a row view still alive somewhere: leave the mapping to the GC
            pass
        self._mm = None  # type: ignore[assignment]
        if self.owner:
            _owned.discard(self.path)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------ worker side
    @classmethod
    def attach(cls, path: str) -> RowRing:
        """Map an existing ring file (worker side)."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        head = memoryview(mm)[: _HEADER * 8].cast("q")
        try:
            if head[_W_MAGIC] != _MAGIC or head[_W_VERSION] != _VERSION or head[_W_TAGB] != _TAG_BYTES:
                raise RuntimeError(f"{path} is not a genlm_vlm row ring of layout version {_VERSION}")
            width, capacity = int(head[_W_WIDTH]), int(head[_W_CAP])
        finally:
            head.release()
        return cls(path, mm, width, capacity, owner=False)

    def write(self, tags: list[str], logits: torch.Tensor, rows: list[int], batched: bool | None = None) -> None:
        """Write ``log_softmax(logits[r].float())`` for each tagged row into the next free slots.

        ``batched`` (default: the logits are on an accelerator) computes all rows in one kernel
        and copies them to the ring in one transfer; otherwise each slot is filled in place.
        """
        h = self.header
        if h[_W_PID] == 0:
            h[_W_PID] = os.getpid()
        if logits.shape[-1] != self.width:
            raise RuntimeError(f"row ring holds rows of width {self.width}, the logits have {logits.shape[-1]}")
        start = int(h[_W_COUNT])
        room = self.capacity - start
        if len(tags) > room:  # cannot happen with capacity = max_num_seqs; the reader reports it
            h[_W_OVERFLOW] += len(tags) - room
            tags, rows = tags[:room], rows[:room]
        mm, off = self._mm, self._tags_off
        if batched is None:
            batched = logits.device.type != "cpu"
        if not batched:  # straight into each slot: no temporary
            ring_rows = self.rows
            for k, r in enumerate(rows, start):
                torch.log_softmax(logits[r], dim=-1, dtype=torch.float32, out=ring_rows[k])
        elif tags:  # one kernel on the device, one copy to host memory
            index = torch.as_tensor(rows, device=logits.device, dtype=torch.long)
            logprobs = torch.log_softmax(logits.index_select(0, index).to(torch.float32), dim=-1)
            self.rows[start : start + len(rows)].copy_(logprobs)
        for k, tag in enumerate(tags, start):
            raw = tag.encode()
            if len(raw) > _TAG_BYTES:
                raise RuntimeError(f"capture tag longer than {_TAG_BYTES} bytes: {tag!r}")
            mm[off + k * _TAG_BYTES : off + (k + 1) * _TAG_BYTES] = raw.ljust(_TAG_BYTES, b"\0")
        h[_W_ROWS] += len(tags)
        h[_W_APPLY] += 1
        h[_W_COUNT] = start + len(tags)


class RingWriterSink:
    """Stands in for :class:`~genlm_vlm.capture.CaptureSink` inside a tensor-parallel worker.

    Rank 0 writes rows to the ring named by :data:`RING_ENV`; other ranks (which hold the same
    all-gathered logits) write nothing. The ring is mapped on the first write.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: dict[str, torch.Tensor] = {}  # unused: the interface of CaptureSink
        self._ring: RowRing | None = None
        self._rank0: bool | None = None

    def register(self, processor: Any) -> None:
        return None

    def _is_rank0(self) -> bool:
        if self._rank0 is None:
            dist = torch.distributed
            self._rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        return self._rank0

    def store(self, tags: list[str], logits: torch.Tensor, rows: list[int]) -> None:
        if not self._is_rank0():
            return
        if self._ring is None:
            self._ring = RowRing.attach(self.path)
        self._ring.write(tags, logits, rows)

    def discard(self, tags: list[str]) -> None:
        return None
