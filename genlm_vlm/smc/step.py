"""The SMC proposal step where the rows are: masks applied, masked logsumexp, inverse-CDF draws.

:func:`propose` is stage 3 of the built-in controller (docs/DESIGN.md, "The shape of
smc/algorithm.py"): from the ``float32 [m, V]`` rows of ``m`` live particles on any torch device,
their token bitmasks (xgrammar's layout: ``int32 [m, ceil(V/32)]``, bit ``j % 32`` of word
``j // 32`` set where token ``j`` is allowed) and one uniform per particle, it returns ``m``
tokens and ``m`` log weight increments, computed on the rows' device. Only those ``2 m`` numbers
need to come back to the host.

Per row, with ``A`` the allowed tokens and ``t`` the temperature:

* ``t = 0`` (greedy): the allowed token of highest log-probability (the first one on ties);
  the increment is its log-probability;
* any other finite ``t > 0``, however small or large: the proposal is ``q(x) ∝ exp(row[x] / t)``
  on ``A``, drawn by inverse CDF from the particle's uniform ``u`` (the first ``x`` whose
  cumulative mass exceeds ``u`` times the total); the increment is ``row[x] - log q(x)``, which
  at ``t = 1`` is exactly ``logsumexp(row[A])``. Every path computes the exponent as
  ``(row[x] - s) / t`` with ``s`` a value of the row (its best allowed or usable entry): the
  shift is exact where the mass is, so small temperatures lose nothing to cancellation (``row / t
  - s / t`` in float32 was off by up to 0.06 nats at ``t = 1e-5``), and no temperature overflows
  (``row / t`` in float32 was ``-0`` or NaN past ``t = 3.4e38``);
* a row whose mask keeps no probability (no allowed token, or only ``-inf`` entries) gets token
  ``-1`` and increment ``-inf``: the particle dies.

Columns at or past ``width`` (the tokenizer's real vocabulary; the model's padding columns) are
never read, written or allowed.

On float32 CPU rows at temperatures ``t > 0``, where numba is installed (vLLM requires it), the
*fused* path runs (:func:`step_cpu.fused`): one compiled call per step, float64 to round-off, on
rows of at most :data:`step_cpu.FUSED_ALWAYS_UPTO` usable columns and on wider ones whose densest
mask allows at most a :data:`step_cpu.FUSED_DENSITY`-th of them. Otherwise two paths give the
same result up to float round-off, chosen by the masks' density (not by ``m x V``;
:func:`choose_path`): *dense* works over the full usable width; *gather* picks each row's allowed
entries and works over them (a ``[m, most allowed]`` buffer, float64 after the gather). The dense
path differs by device:

* on the CPU at ``t > 0`` (:func:`step_cpu.dense`) the rows are not written: float32
  exponentials of the rows shifted by their best usable entry (float64 ones at temperatures
  outside :data:`step_cpu.FLOAT32_TEMPERATURES`), times the mask as 0/1, summed in float64 per
  block of :data:`step_cpu.CPU_BLOCK` columns; the draw finds the block, then the column.
  Increments agree with a float64 computation to about 1e-6 relative (float32's ``exp``), at
  every temperature, and tokens agree away from targets that close to a boundary
  (tests/test_smc_step.py). Masked entries cost no ``-inf`` arithmetic and no branch: on this
  project's CPU both were slower than the rest of the step together;
* elsewhere (CUDA; greedy, ``t = 0``) the bitmask is applied to the rows in place (xgrammar's
  ``apply_token_bitmask_inplace`` where xgrammar is installed, else an equal torch op), then
  float64 exponentials and one cumulative sum per row.

Reductions are maxima (order-free), sums over fixed blocks and cumulative sums along rows, so on
the CPU the result does not depend on ``torch.get_num_threads()``. On CUDA the same code runs
with CUDA's kernels: torch does not promise that a floating-point ``cumsum`` there is bitwise
deterministic, and results agree with the CPU's within float tolerance (benchmarks/gpu/
controller_check.py measures both). The Python reference runs the same function on the same
device, so engine and reference agree to the bit on either.

This module imports torch and numpy only (xgrammar lazily, for its mask kernel): the GPU check
(benchmarks/gpu/controller_check.py) runs it without vLLM or transformers installed.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import numpy as np
import torch

from . import step_cpu

#: The gather path runs when the densest row allows at most ``width / GATHER_DENSITY`` tokens
#: (``GATHER_DENSITY_CPU`` on the CPU: measured crossovers near 1/8 of the width on the GPU path's
#: kernel count; near 1/10 on this project's CPU with the multiply-by-mask dense path, m = 32-128,
#: widths 2,048-151,646, random masks: benchmarks/bench_step.py, docs/BENCHMARKS.md fifth session).
GATHER_DENSITY = 8
GATHER_DENSITY_CPU = 10

_SHIFTS: dict[torch.device, torch.Tensor] = {}
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)
_kernel_lock = threading.Lock()
_XGR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what xgrammar's kernels take
_xgr_apply: Any = None  # xgrammar's apply_token_bitmask_inplace, once imported
_xgr_failed: dict[str, str] = {}  # device type -> why xgrammar's kernel is not used there

logger = logging.getLogger(__name__)


def words(width: int) -> int:
    """Bitmask words (int32) per row for ``width`` tokens: ``ceil(width / 32)``."""
    return (int(width) + 31) // 32


def pack(mask: Any) -> torch.Tensor:
    """Bool ``[m, V]`` (numpy array or tensor, any device) -> bitmask ``int32 [m, ceil(V/32)]``
    on the same device (bit ``j % 32`` of word ``j // 32`` is token ``j``)."""
    if isinstance(mask, np.ndarray):  # on the host: numpy packs it (no copy into torch first)
        if mask.dtype != np.bool_ or mask.ndim != 2:
            raise ValueError(f"pack() needs a bool [m, V] mask, got {mask.dtype} of shape {mask.shape}")
        m, v = mask.shape
        packed = np.packbits(mask, axis=1, bitorder="little")
        w = words(v)
        if packed.shape[1] != 4 * w:
            packed = np.pad(packed, ((0, 0), (0, 4 * w - packed.shape[1])))
        return torch.from_numpy(np.ascontiguousarray(packed).view("<i4").reshape(m, w))
    t = torch.as_tensor(mask)
    if t.dtype != torch.bool or t.dim() != 2:
        raise ValueError(f"pack() needs a bool [m, V] mask, got {t.dtype} of shape {tuple(t.shape)}")
    m, v = t.shape
    w = words(v)
    if v != w * 32:
        t = torch.nn.functional.pad(t, (0, w * 32 - v))
    weights = (torch.ones(32, dtype=torch.int64, device=t.device) << _shifts(t.device).long())
    out = (t.view(m, w, 32).long() * weights).sum(-1)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def unpack(bits: Any, width: int) -> torch.Tensor:
    """Bitmask ``int32 [m, W]`` -> bool ``[m, width]`` on the same device."""
    b = torch.as_tensor(bits)
    m = b.shape[0]
    if b.device.type == "cpu":  # numpy's unpacking is one fast pass
        a = np.ascontiguousarray(b.numpy()).view(np.uint8).reshape(m, -1)
        return torch.from_numpy(np.unpackbits(a, axis=1, bitorder="little")[:, :width].view(bool))
    out = ((b[:, :, None] >> _shifts(b.device)) & 1).bool().view(m, -1)
    return out[:, :width]


def popcounts(bits: Any) -> np.ndarray:
    """Allowed tokens per row of a bitmask (int64 numpy ``[m]``), computed on the host."""
    b = torch.as_tensor(bits)
    a = b.cpu().numpy() if b.device.type != "cpu" else b.numpy()
    a = np.ascontiguousarray(a)
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(a.view(np.uint32)).sum(axis=1, dtype=np.int64)
    return _POPCOUNT[a.view(np.uint8)].reshape(a.shape[0], -1).sum(axis=1)


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return s


def mask_kernel(device: Any, temperature: float = 0.0) -> str:
    """Which kernel the dense path of :func:`propose` uses to apply bitmasks on ``device`` at
    ``temperature``: ``"multiply"`` (the CPU at temperatures > 0: the mask as 0/1 times the
    exponentials, the rows untouched), ``"xgrammar"`` (``apply_token_bitmask_inplace``) or
    ``"torch"`` (an equal torch op: xgrammar is not installed, or its kernel failed once on this
    device type)."""
    dev = torch.device(device)
    if dev.type == "cpu" and temperature > 0.0:
        return "multiply"
    return "torch" if _xgrammar_apply(dev.type) is None else "xgrammar"


def mask_kernel_error(device: Any) -> str | None:
    """Why xgrammar's kernel is not used on ``device``'s type (None: it is, or was not tried)."""
    return _xgr_failed.get(torch.device(device).type)


def _xgrammar_apply(device_type: str) -> Any:
    global _xgr_apply
    if device_type in _xgr_failed:
        return None
    if _xgr_apply is None:
        with _kernel_lock:
            if _xgr_apply is None:
                try:
                    from xgrammar import apply_token_bitmask_inplace
                except Exception as e:  # noqa: BLE001 - not installed or broken: the torch op does the same
                    why = f"xgrammar is not importable: {e!r}"
                    _xgr_failed.setdefault(device_type, why)
                    logger.info("SMC step: %s; bitmasks are applied with a torch op", why)
                    return None
                _xgr_apply = apply_token_bitmask_inplace
    return _xgr_apply


def apply_bitmask(x: torch.Tensor, bits: torch.Tensor, width: int, kernel: str = "auto") -> str:
    """Set ``x[k, j] = -inf`` for ``j < width`` where bit ``j`` of ``bits[k]`` is 0, in place;
    columns at or past ``width`` are not touched. Returns the kernel used (see
    :func:`mask_kernel`); ``kernel="torch"`` forces the torch op."""
    dtype = x.device.type
    fn = None if kernel == "torch" or x.dtype not in _XGR_DTYPES else _xgrammar_apply(dtype)
    if fn is not None:
        try:
            fn(x, bits, vocab_size=width)
            return "xgrammar"
        except Exception as e:  # noqa: BLE001 - e.g. no triton compiler on this host: the torch op, from now on
            _xgr_failed[dtype] = f"xgrammar's kernel failed on {dtype}: {e!r}"
            logger.warning("SMC step: %s; using a torch op from now on", _xgr_failed[dtype])
    keep = unpack(bits, width)
    x[:, :width].masked_fill_(~keep, -math.inf)
    return "torch"


def _prepare_bits(bits: Any, m: int, width: int) -> torch.Tensor:
    """``bits`` checked, cut to ``ceil(width / 32)`` words and cleared past ``width`` (where it is)."""
    b = torch.as_tensor(bits)
    w = words(width)
    if b.dtype != torch.int32 or b.dim() != 2 or b.shape[0] != m or b.shape[1] < w:
        raise ValueError(f"bits must be int32 [{m}, >= {w}] (xgrammar's bitmask layout), got {b.dtype} "
                         f"of shape {tuple(b.shape)}")
    b = b[:, :w]
    if width % 32:  # bits past width in the last word can never be allowed
        b = b.clone()
        b[:, -1] &= (1 << (width % 32)) - 1
    return b.contiguous()


def _popcounts_device(bits: torch.Tensor) -> np.ndarray:
    v = bits.long() & 0xFFFFFFFF
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    v = ((v * 0x01010101) & 0xFFFFFFFF) >> 24
    return v.sum(dim=1).cpu().numpy()


#: torch intra-op threads for the step on the CPU (None: whatever the calling thread has). One
#: by default: the step's tensors are small (a few ms of work), and in a burst it runs on the
#: engine thread, where vLLM set torch to all the cores for the forward. Measured on this 2-core
#: machine while other work shared it (issue 36): with 2 threads every op above torch's grain
#: size waited at an OpenMP barrier for a worker thread that the OS had descheduled, and the
#: step's wall time in the engine was 2-20x its CPU time. The result does not depend on it.
CPU_STEP_THREADS: int | None = 1


def set_threads(n: int) -> None:
    """Torch's intra-op thread count (``torch._C.set_num_threads``: vLLM's CPU worker replaces
    ``torch.set_num_threads`` in the whole process by a no-op that logs a warning once an engine
    is built; the OpenMP count it sets is the calling thread's)."""
    torch._C.set_num_threads(int(n))


class _Threads:
    """Torch's intra-op thread count of the calling thread set to ``n`` for a block, then back
    (``omp_set_num_threads`` is per thread; other threads keep theirs)."""

    __slots__ = ("n", "before")

    def __init__(self, n: int | None) -> None:
        self.n = n
        self.before = 0

    def __enter__(self) -> None:
        if self.n is not None:
            self.before = torch.get_num_threads()
            if self.before != self.n:
                set_threads(self.n)

    def __exit__(self, *exc: Any) -> None:
        if self.n is not None and self.before != self.n:
            set_threads(self.before)


def propose(rows: torch.Tensor, bits: Any, uniforms: Any, temperature: float = 1.0, *,
            width: int | None = None, counts: Any = None, path: str = "auto",
            kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One proposal step (see the module docstring) on ``rows``' device.

    ``rows``: ``float32 [m, V]`` log-probabilities (the dense path writes ``-inf`` into their
    masked columns below ``width``). ``bits``: ``int32 [m, >= ceil(width/32)]`` bitmasks, any
    device. ``uniforms``: ``m`` floats in ``[0, 1)`` (numpy or tensor; used in float64).
    ``width``: columns that may ever be allowed (default ``V``). ``counts``: allowed tokens per
    row if the caller already knows them (else counted from ``bits``). ``path``: ``"auto"``,
    ``"fused"`` (float32 CPU rows at temperatures > 0, numba installed:
    :func:`step_cpu.fused`), ``"dense"`` or ``"gather"``; ``kernel``: ``"auto"`` or ``"torch"``
    (the dense path's mask kernel). Returns ``(tokens int64 [m], increments float64 [m])`` on the rows' device, token
    ``-1`` (increment ``-inf``) where the mask keeps no probability."""
    if rows.dim() != 2:
        raise ValueError(f"rows must be [m, V], got shape {tuple(rows.shape)}")
    m, v = rows.shape
    width = v if width is None else int(width)
    if not 0 < width <= v:
        raise ValueError(f"width must be in [1, {v}], got {width}")
    t = float(temperature)
    if not (t >= 0.0 and math.isfinite(t)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    device = rows.device
    b = _prepare_bits(bits, m, width)
    fusable = _fusable(device, t, rows.dtype)
    if path == "fused" and not fusable:
        raise ValueError("path='fused' runs on float32 CPU rows at temperatures > 0 with numba installed"
                         + (f" ({step_cpu.fused_error()})" if step_cpu.fused_error() else ""))
    narrow_fused = fusable and step_cpu.use_fused(width)  # choose_path needs no counts then
    if counts is None and (path == "gather" or (path == "auto" and not narrow_fused)):
        counts = popcounts(b) if b.device.type == "cpu" else _popcounts_device(b)
    b = b.to(device)
    u = torch.as_tensor(uniforms if torch.is_tensor(uniforms) else np.asarray(uniforms, dtype=np.float64),
                        dtype=torch.float64)
    if u.shape != (m,):
        raise ValueError(f"uniforms must hold {m} numbers, got shape {tuple(u.shape)}")
    if m and not bool(((u >= 0) & (u < 1)).all()):  # a target outside the mass could land on a masked token
        raise ValueError("uniforms must be numbers in [0, 1)")
    u = u.to(device)  # checked where they are (host uniforms: no device sync for the check)
    if m == 0:
        return torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.float64, device=device)
    if path == "auto":
        path = choose_path(counts, width, device, t, rows.dtype)
    if path == "fused":
        return step_cpu.fused(rows, b, u, t, width)
    if path not in ("dense", "gather"):
        raise ValueError(f"path must be 'auto', 'fused', 'dense' or 'gather', got {path!r}")
    with _Threads(CPU_STEP_THREADS if device.type == "cpu" else None):
        if path == "dense":
            return _dense(rows, b, u, t, width, kernel)
        return _gather(rows, b, u, t, width, counts)


def fused_inputs(rows: torch.Tensor, bits: Any, width: int, t: float,
                 counts: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """What :func:`propose`'s fused path hands :func:`step_cpu.fused_arrays` for these inputs
    (the rows as float32 numpy, the bitmask checked, cut and cleared by the same
    ``_prepare_bits``, as uint32 numpy), or None where ``propose`` would take another path. For a
    caller that makes its own uniforms in ``[0, 1)`` (the built-in controller's step) and so needs
    none of ``propose``'s other checks and tensors; a malformed bitmask raises ``propose``'s
    ``ValueError``."""
    if rows.dim() != 2 or not (_fusable(rows.device, t, rows.dtype) and step_cpu.use_fused(width, counts)):
        return None
    b = _prepare_bits(bits, rows.shape[0], width)
    if b.device.type != "cpu":
        return None
    return rows.numpy(), b.numpy().view(np.uint32)


def _fusable(device: torch.device, t: float, dtype: torch.dtype) -> bool:
    """Whether the fused CPU step can take rows of ``dtype`` on ``device`` at temperature ``t``."""
    return device.type == "cpu" and t > 0.0 and dtype == torch.float32 and step_cpu.fused_available()


def choose_path(counts: Any, width: int, device: Any, temperature: float = 1.0,
                dtype: torch.dtype = torch.float32) -> str:
    """The path ``propose(path="auto")`` takes: ``"fused"`` where the fused CPU step can take
    the rows (float32 on the CPU, a sampling temperature, numba installed) and
    :func:`step_cpu.use_fused` chooses it (``counts`` may be None when the width alone decides);
    else ``"gather"`` when the densest row allows at most ``width / GATHER_DENSITY`` tokens
    (``GATHER_DENSITY_CPU`` on the CPU), else ``"dense"``. A function of the masks, the device,
    the temperature and the dtype only, so every run of the same step takes the same path."""
    dev = torch.device(device)
    if _fusable(dev, temperature, dtype) and step_cpu.use_fused(width, counts):
        return "fused"
    limit = GATHER_DENSITY_CPU if dev.type == "cpu" else GATHER_DENSITY
    return "gather" if int(np.max(counts)) * limit <= width else "dense"


def _finish(alive: torch.Tensor, j: torch.Tensor, incr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.where(alive, j, torch.full_like(j, -1))
    return tokens, torch.where(alive, incr, torch.full_like(incr, -math.inf))


def _top(top: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    """The row's best allowed entry in float64 (0 for dead rows): the shift of the exponent."""
    top = top.double()
    return torch.where(alive, top, torch.zeros_like(top))


def _cumulative(vals: torch.Tensor, t: float, top: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``cumsum(exp((vals - top) / t))`` per row, float64 (into ``out`` if given). The shift comes
    before the division: ``vals / t - top / t`` would lose ``(vals - top) / t`` to cancellation
    at small ``t`` and overflow (``inf - inf``) at the smallest."""
    z = vals.to(torch.float64) if out is None else out.copy_(vals)  # exact upcast (a mixed-dtype op is slower)
    z.sub_(top[:, None])
    if t != 1.0:
        z.div_(t)
    return z.exp_().cumsum_(dim=1)


def _incr(xj: torch.Tensor, t: float, top: torch.Tensor, tot: torch.Tensor) -> torch.Tensor:
    """``x - log q(x)`` with ``q(x) = exp((x - top) / t) / tot`` (float64; at ``t = 1``:
    ``top + log(tot)``, the masked logsumexp)."""
    if t == 1.0:
        return top + torch.log(tot)
    x64 = xj.to(torch.float64)
    return x64 - ((x64 - top) / t - torch.log(tot))


def _dense(rows: torch.Tensor, bits: torch.Tensor, u: torch.Tensor, t: float, width: int,
           kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    if rows.device.type == "cpu" and t > 0.0:  # no mask kernel: a multiply by the mask
        j, tot, shift = step_cpu.dense(rows, bits, u, t, width)
        alive = tot > 0
        j = torch.where(alive, j, torch.zeros_like(j))
        return _finish(alive, j, _incr(rows[:, :width].gather(1, j[:, None]).squeeze(1), t, shift, tot))
    x = rows[:, :width]
    apply_bitmask(rows, bits, width, kernel)
    top = x.amax(dim=1)
    alive = top > -math.inf
    if t == 0.0:
        j = x.argmax(dim=1)
        return _finish(alive, j, x.gather(1, j[:, None]).squeeze(1).to(torch.float64))
    shift = _top(top, alive)
    j, tot = step_cpu.first_exceeding(_cumulative(x, t, shift), u)
    return _finish(alive, j, _incr(x.gather(1, j[:, None]).squeeze(1), t, shift, tot))


def _padded(rows: torch.Tensor, bits: torch.Tensor, width: int,
            counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's allowed entries, left-aligned in ``[m, most allowed]`` (``-inf`` after them),
    and their columns (0 after them); ascending columns within a row."""
    m, v = rows.shape
    n = max(counts)
    if rows.device.type == "cpu":  # indices from numpy's unpacking, two index ops, no per-row split
        a = np.ascontiguousarray(bits.numpy()).view(np.uint8).reshape(m, -1)
        keep = np.unpackbits(a, axis=1, bitorder="little")[:, :width].view(bool)
        r, col = np.divmod(np.flatnonzero(keep), width)
        start = np.cumsum(counts) - np.asarray(counts)
        dest = torch.from_numpy(r * n + (np.arange(r.size) - start[r]))
        vals = torch.full((m * n,), -math.inf, dtype=rows.dtype)
        vals[dest] = rows.contiguous().view(-1)[torch.from_numpy(r * v + col)]
        cols = torch.zeros(m * n, dtype=torch.int64)
        cols[dest] = torch.from_numpy(col)
        return vals.view(m, n), cols.view(m, n)
    keep = unpack(bits, width)
    flat, col = rows[:, :width][keep], keep.nonzero()[:, 1]
    pad = torch.nn.utils.rnn.pad_sequence
    return (pad(list(torch.split(flat, counts)), batch_first=True, padding_value=-math.inf),
            pad(list(torch.split(col, counts)), batch_first=True, padding_value=0))


def _gather(rows: torch.Tensor, bits: torch.Tensor, u: torch.Tensor, t: float, width: int,
            counts: Any) -> tuple[torch.Tensor, torch.Tensor]:
    m = rows.shape[0]
    device = rows.device
    c = [int(k) for k in np.asarray(counts, dtype=np.int64)]
    if max(c, default=0) == 0:  # nothing allowed anywhere: every row dies
        vals = torch.full((m, 1), -math.inf, device=device)
        cols = torch.zeros((m, 1), dtype=torch.int64, device=device)
    else:
        vals, cols = _padded(rows, bits, width, c)  # [m, most allowed]
    top = vals.amax(dim=1)
    alive = top > -math.inf
    if t == 0.0:
        j = vals.argmax(dim=1)
        tok = cols.gather(1, j[:, None]).squeeze(1)
        return _finish(alive, tok, vals.gather(1, j[:, None]).squeeze(1).to(torch.float64))
    shift = _top(top, alive)
    j, tot = step_cpu.first_exceeding(_cumulative(vals, t, shift), u)
    tok = cols.gather(1, j[:, None]).squeeze(1)
    return _finish(alive, tok, _incr(vals.gather(1, j[:, None]).squeeze(1), t, shift, tot))


def to_host(tokens: torch.Tensor, incr: torch.Tensor) -> tuple[list[int], np.ndarray]:
    """The step's result on the host in one transfer: tokens (list of int, -1 = dies) and
    increments (float64 numpy)."""
    if tokens.device.type == "cpu" and incr.device.type == "cpu":  # already here: no stack, no copy through float64
        return tokens.long().tolist(), incr.to(torch.float64).numpy().copy()
    both = torch.stack((tokens.to(torch.float64), incr)).cpu().numpy()
    return [int(k) for k in both[0]], both[1].copy()
