"""The SMC step's dense path on the CPU at temperatures > 0 (see genlm_vlm/smc/step.py).

:func:`dense` computes, for ``m`` rows of float32 log-probabilities, the inverse-CDF draw from
``q(x) ∝ exp(row[x] / t)`` on each row's allowed tokens without writing the rows: float32
exponentials of the rows shifted by their best usable entry, times the mask as 0/1, float64
masses per block of :data:`CPU_BLOCK` columns, then the block and the column. Two costs it
avoids, both measured on this project's CPU (docs/BENCHMARKS.md, fifth session): ``exp`` of
``-inf`` entries takes a slow path in the vectorised kernel, and ``masked_fill`` branches on every
entry (random masks: mispredictions); together they were more than half of the old step.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from .jit import Compiled

#: On the CPU the dense path works through the rows in chunks of about this many entries (buffers
#: that stay in cache and are allocated once per thread), not one ``[m, width]`` buffer.
CPU_CHUNK = 1 << 18
#: The CPU dense path's draw works in blocks of this many columns: each block's mass (one
#: vectorised sum), the cumulative mass over blocks, then the cumulative mass inside the one block
#: the target falls in. A cumulative sum over every column is a sequential scan and cost ~5x a sum.
CPU_BLOCK = 256
#: Rows at most this wide skip the blocks: one cumulative sum per row (fewer, larger ops).
CPU_FLAT_UPTO = 4096
#: Relative to the row's best usable token, an allowed mass below this is recomputed with the
#: allowed tokens' own maximum as the shift (float32 ``exp`` would lose those values to underflow).
CPU_RESHIFT_BELOW = 2.0**-40
#: The exponentials' dtype. float64 gives float64 increments and cost 1.5x on this CPU.
CPU_EXP_DTYPE = torch.float32
#: Temperatures at which :data:`CPU_EXP_DTYPE` float32 holds the exponent ``(x - shift) / t`` to
#: float32 round-off (``t`` well inside float32's normal range); outside them the exponentials are
#: float64 (float32 would turn ``t`` into 0 or ``inf``: ``0 / 0`` and ``-inf / inf`` are NaN).
FLOAT32_TEMPERATURES = (2.0**-60, 2.0**60)
_workspace = threading.local()


def _buffer(name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread scratch buffer of at least ``n`` entries (contents left from earlier use).
    Always an ordinary tensor, even when first made inside ``torch.inference_mode`` (a step run in
    vLLM's sampler, say): an inference tensor could not be written by a later step on the same
    thread outside that mode."""
    buf = getattr(_workspace, name, None)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        with torch.inference_mode(False):
            buf = torch.empty(n, dtype=dtype)
        setattr(_workspace, name, buf)
    return buf[:n]


def _keep(bits: torch.Tensor, r0: int, r1: int, width: int, out: torch.Tensor) -> None:
    """Rows ``r0:r1`` of the bitmask as 0/1 into ``out[:, :width]`` (numpy's unpacking)."""
    a = np.ascontiguousarray(bits[r0:r1].numpy()).view(np.uint8).reshape(r1 - r0, -1)
    out[:, :width].copy_(torch.from_numpy(np.unpackbits(a, axis=1, count=width, bitorder="little")))


def dense(rows: torch.Tensor, bits: torch.Tensor, u: torch.Tensor, t: float,
          width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draw for ``rows`` (float32 ``[m, V]``, not written) under ``bits`` (int32 bitmasks,
    cleared past ``width``), uniforms ``u`` (float64 ``[m]``) and temperature ``t > 0``.
    Returns ``(column int64 [m], total float64 [m], shift float64 [m])``: the row's mass on its
    allowed tokens is ``total`` in units of ``exp((x - shift) / t)``; ``total == 0``: the row
    keeps no probability (its column is meaningless).

    Per row chunk, in per-thread buffers: ``e = exp((x - s) / t)`` in float32 (float64 at
    temperatures outside :data:`FLOAT32_TEMPERATURES`) with ``s`` the row's best usable
    log-probability (so ``e <= 1``, no overflow, and no ``-inf`` entries, which take a slow path
    in the vectorised ``exp``; the shift comes before the division, which ``x / t - s / t`` would
    lose to cancellation at small ``t``), times the mask as 0/1 (a multiply: a ``masked_fill``
    branches on every entry), then the masses per block of :data:`CPU_BLOCK` columns in float64.
    A row whose allowed mass is below :data:`CPU_RESHIFT_BELOW` is recomputed with the best
    *allowed* log-probability as ``s``. The draw: the first block whose cumulative
    mass exceeds ``u`` times the total, then the first column inside it (float64 cumulative sums;
    a target that rounds past the block's mass takes its last allowed column)."""
    m = rows.shape[0]
    x = rows[:, :width]
    block = width if width <= CPU_FLAT_UPTO else CPU_BLOCK  # narrow rows: one block, one scan
    nb = -(-width // block)
    wp = nb * block
    step = max(1, CPU_CHUNK // wp)
    shift = x.amax(dim=1).to(torch.float64)
    shift = torch.where(shift > -math.inf, shift, torch.zeros_like(shift))  # row of -inf: any shift
    lo, hi = FLOAT32_TEMPERATURES
    dtype = CPU_EXP_DTYPE if lo <= t <= hi else torch.float64
    masses = _buffer("masses", m * nb, torch.float64).view(m, nb)  # scratch: no fresh pages per step
    picks = _buffer("picks", m * block, torch.float64).view(m, block)
    j = torch.empty(m, dtype=torch.int64)
    tot = torch.empty(m, dtype=torch.float64)
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        k = r1 - r0
        keep = _buffer("keep", k * wp, dtype).view(k, wp)
        e = _buffer("e", k * wp, dtype).view(k, wp)
        if wp > width:  # the last block's columns past width: no mass (buffers are reused)
            keep[:, width:].zero_()
            e[:, width:].zero_()
        _keep(bits, r0, r1, width, keep)
        bm = masses[r0:r1]
        _masses(x[r0:r1], keep, shift[r0:r1], t, e, bm, block)
        low = bm.sum(dim=1) < CPU_RESHIFT_BELOW
        if bool(low.any()):  # rare: the allowed tokens' mass would underflow; shift by their own best
            for i in low.nonzero().flatten().tolist():
                best = torch.where(keep[i, :width] > 0, x[r0 + i], -math.inf).amax()
                if best > -math.inf:
                    shift[r0 + i] = best.double()
                    _masses(x[r0 + i:r0 + i + 1], keep[i:i + 1], shift[r0 + i:r0 + i + 1], t, e[i:i + 1],
                            bm[i:i + 1], block, clamp=True)
        if nb == 1:  # narrow rows: one cumulative sum over the row
            cum = torch.cumsum(e, dim=1, dtype=torch.float64, out=_buffer("cum", k * wp, torch.float64).view(k, wp))
            j[r0:r1], tot[r0:r1] = first_exceeding(cum, u[r0:r1])
        else:
            j[r0:r1], tot[r0:r1] = _draw_blocks(bm, e, u[r0:r1], picks[r0:r1], block)
    return j, tot, shift


def _masses(x: torch.Tensor, keep: torch.Tensor, shift: torch.Tensor, t: float, e: torch.Tensor,
            out: torch.Tensor, block: int, clamp: bool = False) -> None:
    """``e[:, :width] = exp((x - shift) / t) * keep`` in ``e``'s dtype (the exponent clamped to
    ``<= 0`` first where masked entries may exceed the shift) and ``out`` = float64 mass per block
    of ``e``. ``shift`` holds values of the rows (float32 ones), so ``x - shift`` is exact
    wherever the two are within a factor of 2: the entries near the shift, which carry the mass."""
    k, width = x.shape
    ev = e[:, :width]
    if ev.dtype == x.dtype:
        torch.sub(x, shift[:, None].to(ev.dtype), out=ev)
    else:  # float64 exponentials of float32 rows: the exact upcast first
        ev.copy_(x)
        ev.sub_(shift[:, None])
    if t != 1.0:
        ev.div_(t)
    if clamp:
        ev.clamp_(max=0.0)
    ev.exp_()
    e.mul_(keep)  # past width both are 0
    torch.sum(e.view(k, -1, block), dim=2, dtype=torch.float64, out=out)


def first_exceeding(cum: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse CDF per row of ``cum`` (float64 cumulative masses ``[k, n]``, any device): the
    first index whose mass exceeds ``u`` times the total, never past the first index that reaches
    the total (a product that rounds up to the total takes the last index with mass). Returns
    ``(index, total)``. Every path of the step draws with it (:mod:`.step` imports it)."""
    tot = cum[:, -1:].contiguous()
    i = torch.searchsorted(cum, u[:, None] * tot, right=True)
    return torch.minimum(i, torch.searchsorted(cum, tot, right=False)).squeeze(1), tot.squeeze(1)


def _draw_blocks(masses: torch.Tensor, e: torch.Tensor, u: torch.Tensor, picks: torch.Tensor,
                 block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse CDF in two levels (see :func:`dense`). ``masses``: float64 ``[k, blocks]``;
    ``e``: ``[k, blocks * block]``. Returns ``(column, total)``: the block by
    :func:`first_exceeding` on the blocks' cumulative masses, then the column inside it on the
    block's cumulative masses offset by the blocks before it."""
    k = masses.shape[0]
    cum = masses.cumsum(dim=1)
    b, tot = first_exceeding(cum, u)
    base = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(1), torch.zeros_like(tot))
    blocks = e.view(k, -1, block)[torch.arange(k), b]  # [k, block]
    inner = torch.cumsum(blocks, dim=1, dtype=torch.float64, out=picks).add_(base[:, None])
    target = (u * tot)[:, None]
    i = torch.searchsorted(inner, target, right=True)
    last = torch.searchsorted(inner, inner[:, -1:].contiguous(), right=False)
    return b * block + torch.minimum(i, last).squeeze(1), tot


# ---------------------------------------------------------------------- the fused step (numba)
#: The fused path runs on rows at most this wide whatever the masks' density, and on wider rows
#: when the densest row allows at most ``width / FUSED_DENSITY`` tokens. It computes one float64
#: ``exp`` per *allowed* entry, so on wide, dense masks torch's float32 ``exp`` over every column
#: can win. Measured on this project's CPU (docs/BENCHMARKS.md, sixth session): called back to back
#: on random rows (benchmarks/bench_step.py --paths) it is faster than both torch paths up to a
#: third of 32,000-151,646 columns allowed and even with the dense path at a half; in the engine,
#: where a step follows a forward and a call costs what the code it touches costs, it took the
#: proposal from 2.94 to 1.78 ms (N = 32) and 8.25 to 6.34 ms (N = 128) on the Qwen2-0.5B shape's
#: steady cell, 42 % of 32,768 columns allowed; on 2,048 columns 0.42 -> 0.30 ms at N = 32.
FUSED_ALWAYS_UPTO = 8192
FUSED_DENSITY = 2


def fused_available() -> bool:
    """Whether the fused kernel can run (numba importable and the kernel compiled; compiled once
    per process on first use, and cached on disk by numba)."""
    return _fused() is not None


def fused_error() -> str | None:
    """Why the fused kernel is not used (None: it is, or was not tried yet)."""
    return _FUSED.error()


def _fused() -> object:
    return _FUSED.get()


#: :func:`_kernel`'s exponential (float64, arguments ``z <= 0``): ``z = (64 k + j) ln(2) / 64 + h``
#: with ``ln(2) / 64`` split in two (Cody and Waite; the high part's low 32 bits are clear, so
#: ``kf * _LN2_64_HI`` is exact), then ``e ** z = 2 ** k * 2 ** (j / 64) * e ** h``: the middle factor
#: from :data:`_POW2_64` (each entry the float64 nearest to ``2 ** (j / 64)``), ``e ** h`` (``|h| <=
#: ln(2) / 128``) by its Taylor polynomial of degree 5 (truncation below 4e-17 relative), ``2 ** k``
#: built from its bits. Within two units in the last place of the exact value (0.27 on average),
#: plain float64 operations in a fixed order (no fused multiply-add): the same bits on every CPU. A
#: loop the compiler vectorises, 1.6-1.9x faster than the degree-13 polynomial without a table it
#: replaced (fifteenth session) and about 4x faster than libm's ``exp`` per entry.
_LN2_64_HI = 0.010830417275428772
_LN2_64_LO = 7.420820373486988e-09
_INV_LN2_64 = 92.33248261689366
_EXP_FLOOR = -708.0
_POW2_64 = np.array([
    1.0, 1.0108892860517005, 1.0218971486541166, 1.0330248790212284,
    1.0442737824274138, 1.0556451783605572, 1.0671404006768237, 1.0787607977571199,
    1.0905077326652577, 1.102382583307841, 1.1143867425958924, 1.1265216186082418,
    1.1387886347566916, 1.1511892299529827, 1.1637248587775775, 1.1763969916502812,
    1.189207115002721, 1.202156731452703, 1.215247359980469, 1.22848053610687,
    1.241857812073484, 1.255380757024691, 1.2690509571917332, 1.2828700160787783,
    1.2968395546510096, 1.3109612115247644, 1.3252366431597413, 1.339667524053303,
    1.3542555469368927, 1.3690024229745905, 1.383909881963832, 1.3989796725383112,
    1.4142135623730951, 1.42961333839197, 1.4451808069770467, 1.460917794180647,
    1.4768261459394993, 1.4929077282912648, 1.5091644275934228, 1.5255981507445384,
    1.5422108254079407, 1.559004400237837, 1.5759808451078865, 1.593142151342267,
    1.6104903319492543, 1.6280274218573478, 1.645755478153965, 1.6636765803267364,
    1.681792830507429, 1.7001063537185235, 1.718619298122478, 1.7373338352737062,
    1.7562521603732995, 1.7753764925265212, 1.7947090750031072, 1.8142521755003989,
    1.8340080864093424, 1.8539791250833855, 1.8741676341103, 1.8945759815869656,
    1.9152065613971474, 1.9360617934922943, 1.9571441241754002, 1.978456026387951,
])


def _taylor(r):  # pragma: no cover - inlined into the compiled kernel
    """``e ** r`` for ``|r| <= ln(2) / 128`` (Horner, degree 5)."""
    return 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6 + r * (1.0 / 24 + r * (1.0 / 120)))))


def _exp_parts(z):  # pragma: no cover - inlined into the compiled kernel
    """``e ** z`` for ``z <= 0`` as ``(bits of 2 ** k, 2 ** (j / 64) * e ** h)`` (see
    :data:`_POW2_64`): the product is ``e ** z`` (0 below ``e ** -708``: no mass)."""
    y = max(z, _EXP_FLOOR)
    kf = math.floor(y * _INV_LN2_64 + 0.5)
    h = (y - kf * _LN2_64_HI) - kf * _LN2_64_LO
    ki = np.int64(kf)
    return ((ki >> 6) + 1023) << 52, _POW2_64[ki & 63] * _taylor(h) if z >= _EXP_FLOOR else 0.0  # 2 ** k: normal


def _popcount(v):  # pragma: no cover - inlined into the compiled kernel
    """Set bits of ``v`` (an int64 holding 32 bits)."""
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    return (((v + (v >> 4)) & 0x0F0F0F0F) * 0x01010101 & 0xFFFFFFFF) >> 24


def _best(vals, n):  # pragma: no cover - inlined into the compiled kernel
    """``max(vals[:n])`` ignoring NaN (``-inf`` when empty), as ``top = max(top, v)`` in order
    gives it, in eight independent running maxima (a chain of dependent compares took a quarter
    of the kernel; the maximum of the same values is the same, whatever the order)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = -np.inf
    n8 = n - n % 8
    for k in range(0, n8, 8):
        v = vals[k]
        a0 = v if v > a0 else a0
        v = vals[k + 1]
        a1 = v if v > a1 else a1
        v = vals[k + 2]
        a2 = v if v > a2 else a2
        v = vals[k + 3]
        a3 = v if v > a3 else a3
        v = vals[k + 4]
        a4 = v if v > a4 else a4
        v = vals[k + 5]
        a5 = v if v > a5 else a5
        v = vals[k + 6]
        a6 = v if v > a6 else a6
        v = vals[k + 7]
        a7 = v if v > a7 else a7
    for k in range(n8, n):
        v = vals[k]
        a0 = v if v > a0 else a0
    return max(max(max(a0, a1), max(a2, a3)), max(max(a4, a5), max(a6, a7)))


def _kernel(x, bits, width, u, t, tok, incr, vals, cum, pow2):  # pragma: no cover - run compiled
    """:func:`fused`'s loop, compiled by numba (plain Python here: see :func:`_compile`)."""
    m, nw = bits.shape
    full = width // 32
    two = pow2.view(np.float64)
    for r in range(m):
        n = 0  # the row's allowed entries, compacted without a branch per column
        for w in range(nw):
            word = np.int64(bits[r, w])
            if word == 0:
                continue
            base = 32 * w
            for b in range(32 if w < full else width - base):
                vals[n] = x[r, base + b]
                n += (word >> b) & 1
        top = _best(vals, n)
        if top == -np.inf:  # nothing allowed, or only -inf entries: the particle dies
            tok[r] = -1
            incr[r] = -np.inf
            continue
        shift = np.float64(top)
        if t == 1.0:  # the same values without the division (by 1: exact), which costs a tenth here
            for k in range(n):
                pow2[k], cum[k] = _exp_parts(np.float64(vals[k]) - shift)
        else:
            for k in range(n):  # exp((x - shift) / t) <= 1, in one loop the compiler vectorises
                pow2[k], cum[k] = _exp_parts((np.float64(vals[k]) - shift) / t)  # shift first: exact, no inf - inf
        c = 0.0
        for k in range(n):
            c += cum[k] * two[k]
            cum[k] = c
        target = u[r] * c
        lo, hi = 0, n
        while lo < hi:  # the first entry whose cumulative mass exceeds the target
            mid = (lo + hi) >> 1
            if cum[mid] > target:
                hi = mid
            else:
                lo = mid + 1
        lo = min(lo, n - 1)
        while lo > 0 and cum[lo - 1] >= c:  # never past the first entry that reaches the total
            lo -= 1
        j = 0  # the column of the lo-th allowed entry: whole words by their bit counts, then bits
        for w in range(nw):
            word = np.int64(bits[r, w])
            k = _popcount(word)
            if lo < k:
                for b in range(32):
                    if (word >> b) & 1:
                        if lo == 0:
                            j = 32 * w + b
                            break
                        lo -= 1
                break
            lo -= k
        tok[r] = j
        if t == 1.0:
            incr[r] = shift + math.log(c)
        else:
            xj = np.float64(x[r, j])
            incr[r] = xj - ((xj - shift) / t - math.log(c))


def _compile() -> object:
    """:func:`_kernel` compiled by numba for one signature (rows of any strides), at once: 0.8 s
    the first time on this project's CPU, then loaded from numba's disk cache (0.5 s with
    numba's import). :class:`~genlm_vlm.smc.algorithm.SMCController` calls it when it is built,
    so no engine step pays for it."""
    import numba

    global _taylor, _exp_parts, _popcount, _best
    _taylor = numba.njit(inline="always")(_taylor)
    _exp_parts = numba.njit(inline="always")(_exp_parts)
    _popcount = numba.njit(inline="always")(_popcount)
    _best = numba.njit(inline="always")(_best)
    sig = ("void(float32[:, :], uint32[:, ::1], int64, float64[::1], float64, int64[::1], float64[::1], "
           "float32[::1], float64[::1], int64[::1])")
    return numba.njit(sig, cache=True, nogil=True)(_kernel)


#: The fused kernel, compiled on first use (:class:`~.jit.Compiled`).
_FUSED = Compiled(_compile, "the fused CPU step", "the torch paths run")


def use_fused(width: int, counts: object = None) -> bool:
    """Whether :func:`fused` should run for rows of ``width`` usable columns (``counts``: allowed
    tokens per row, needed only past :data:`FUSED_ALWAYS_UPTO`; without them a wider row is not
    chosen). A function of the width and masks only (``step.choose_path`` asks it)."""
    if width <= FUSED_ALWAYS_UPTO:
        return True
    return counts is not None and len(counts) > 0 and int(np.max(counts)) * FUSED_DENSITY <= width


def fused(rows: torch.Tensor, bits: torch.Tensor, u: torch.Tensor, t: float,
          width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole step in one compiled call, on the CPU at temperatures > 0: per row, the
    allowed entries compacted from the bitmask, the shift by their best entry, ``float64``
    ``exp((x - shift) / t)`` (a table and a vectorised polynomial, within two ulps: :func:`_exp_parts`)
    and its running sum, the inverse-CDF draw by bisection and the increment. The gather path's
    float64 arithmetic but for the exponential: tokens equal away from ties, increments within
    float64 round-off (tests/test_smc_step.py). No torch operation runs; the rows are not written;
    the result does not depend on torch's thread count.

    ``rows``: float32 ``[m, V]`` on the CPU (any strides); ``bits``: int32 ``[m, ceil(width/32)]``
    cleared past ``width``; ``u``: float64 ``[m]``. Returns ``(tokens int64 [m], increments
    float64 [m])`` (token -1, increment -inf where the mask keeps no probability)."""
    tok, incr = fused_arrays(rows.numpy(), bits.contiguous().numpy().view(np.uint32), u.contiguous().numpy(), t, width)
    return torch.from_numpy(tok), torch.from_numpy(incr)


def fused_arrays(x: np.ndarray, bits: np.ndarray, u: np.ndarray, t: float,
                 width: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`fused` on numpy arrays, with nothing checked or converted (the built-in
    controller's step, which makes its own uniforms and bitmasks, calls it directly): ``x``
    float32 ``[m, V]`` (any strides), ``bits`` uint32 ``[m, ceil(width/32)]`` C-contiguous and
    cleared past ``width``, ``u`` float64 ``[m]`` in ``[0, 1)``. Returns new arrays ``(tokens
    int64 [m], increments float64 [m])``; the same bits as :func:`fused`."""
    kernel = _fused()
    if kernel is None:
        raise RuntimeError(fused_error() or "the fused CPU step is not available")
    m = x.shape[0]
    n = 32 * bits.shape[1]
    tok = np.empty(m, dtype=np.int64)
    incr = np.empty(m, dtype=np.float64)
    kernel(x, bits, int(width), u, float(t), tok, incr, _buffer("vals", n, torch.float32).numpy(),
           _buffer("cum", n, torch.float64).numpy(), _buffer("pow2", n, torch.int64).numpy())
    return tok, incr
