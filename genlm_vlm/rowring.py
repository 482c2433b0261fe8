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

The file's memory is reserved when it is created (``posix_fallocate``), so a ``/dev/shm`` too
small for it fails there, with a message naming the size needed, instead of killing a worker
with SIGBUS in the middle of a run. Its creator holds a shared ``flock`` on it for as long as it
lives; a ring file nobody holds whose creator's pid is gone (a process killed with ``kill -9``,
by the out-of-memory killer or by ``ray.kill``) is stale, and :meth:`RowRing.create` removes such
files first (:func:`remove_stale_rings`).

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
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import tempfile
import uuid
from typing import Any

import torch

RING_ENV = "GENLM_VLM_ROW_RING"
"""Environment variable naming the ring file for capture processors in worker processes."""

logger = logging.getLogger(__name__)

_PREFIX = "genlm_vlm_rows_"  # then the creator's pid, "_", a random part

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
    return os.path.join(ring_dir(), f"{_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process: it exists
        return True
    return True


def remove_stale_rings(folder: str | None = None) -> list[str]:
    """Remove the ring files in ``folder`` (default :func:`ring_dir`) left by processes that
    died without removing them: files of this user that no live process holds (``flock``) and
    whose creator's pid (in the name) is gone. Returns the paths removed."""
    folder = ring_dir() if folder is None else folder
    try:
        names = [n for n in os.listdir(folder) if n.startswith(_PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        try:
            pid = int(name[len(_PREFIX):].split("_", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its creator lives
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        logger.warning("removed %d stale genlm_vlm row ring file(s) of dead processes from %s", len(removed), folder)
    return removed


def _reserve(fd: int, path: str, size: int) -> None:
    """Give the ring file its ``size`` bytes of memory now (``ENOSPC``: a clear error)."""
    folder = os.path.dirname(path)
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate: stays sparse
            return
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        st = os.statvfs(folder)
        raise OSError(
            errno.ENOSPC,
            f"the tensor-parallel row ring needs {size / 2**20:.1f} MiB in {folder}, which has "
            f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free of {st.f_blocks * st.f_frsize / 2**20:.1f} MiB: "
            f"enlarge {folder} (e.g. docker run --shm-size=1g) or lower max_num_seqs in engine_opts "
            "(the ring holds max_num_seqs rows of the model's logit width in float32)",
        ) from e


class RowRing:
    """A mapped ring file; :meth:`create` on the engine side, :meth:`attach` in the worker."""

    def __init__(self, path: str, mm: mmap.mmap, width: int, capacity: int, owner: bool,
                 lock_fd: int | None = None) -> None:
        self.path = path
        self.width = width
        self.capacity = capacity
        self.owner = owner
        self._mm = mm
        self._lock_fd = lock_fd  # the owner's open descriptor, holding the file's flock
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
        """Create and map the ring file (``width`` logits per row, ``capacity`` rows per step),
        after removing stale ring files (:func:`remove_stale_rings`).

        Its memory is reserved now: too little room in its folder raises ``OSError`` (ENOSPC)
        naming the size needed. The file is created under a hidden name, locked, then renamed
        to ``path``, so a ring under its real name is always held by a live process.
        """
        if width <= 0 or capacity <= 0:
            raise ValueError(f"row ring needs a positive width and capacity, got {width} x {capacity}")
        remove_stale_rings(os.path.dirname(path))
        size = _layout(width, capacity)[2]
        folder, name = os.path.split(path)
        hidden = os.path.join(folder, f".{name}.init")
        fd = os.open(hidden, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held until close(), or until this process dies
            os.rename(hidden, path)
            _owned.add(path)
            _reserve(fd, path, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            for p in (hidden, path):
                with contextlib.suppress(OSError):
                    os.unlink(p)
            _owned.discard(path)
            os.close(fd)
            raise
        ring = cls(path, mm, width, capacity, owner=True, lock_fd=fd)
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
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

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
