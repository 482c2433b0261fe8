"""bench_soak's probes: process memory (RSS, glibc's arenas, what a mapping has resident), the
engine's state (KV tensor, sessions, caches), Python object counts, and the checks of delivered
rows (normalised, finite, against transformers). See bench_soak.py's docstring."""

from __future__ import annotations

import ctypes
import gc
import math
import os
import pathlib
import sys
from collections import Counter
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(_HERE.parent))

from genlm_vlm.bench.harness import setup_environment  # noqa: E402

setup_environment()  # before vLLM is imported

import torch  # noqa: E402

MB = 1 << 20
LSE_TOL = 1e-4
HF_TOL = 1e-4


# ----------------------------------------------------------------------------- memory probes
def rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``, second field)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int | None:
    """``VmHWM``: the largest RSS this process has had."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]


def _libc() -> Any:
    try:
        return ctypes.CDLL(None)
    except OSError:  # pragma: no cover - not Linux
        return None


_LIBC = _libc()


def mallinfo() -> dict[str, int] | None:
    """glibc's ``mallinfo2()`` over every arena (MB): heap obtained with brk/arenas, bytes in use
    and free inside them, and bytes in mmap'd chunks. None where glibc is not available."""
    fn = getattr(_LIBC, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2
    m = fn()
    return {"arena_mb": m.arena / MB, "in_use_mb": m.uordblks / MB, "free_mb": m.fordblks / MB,
            "mmap_mb": m.hblkhd / MB, "top_pad_mb": m.keepcost / MB}


def malloc_trim() -> bool:
    fn = getattr(_LIBC, "malloc_trim", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_size_t]
    return bool(fn(0))


def mapping_resident(address: int) -> tuple[int, int] | None:
    """``(size, resident)`` bytes of the ``/proc/self/smaps`` mapping that holds ``address``."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            size = None
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                    size = hi - lo
                elif inside and head == "Rss:":
                    return size, int(line.split()[1]) * 1024  # type: ignore[return-value]
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------- engine probes
def _model_runner(lm: Any) -> Any:
    core = lm.llm.llm_engine.engine_core.engine_core
    worker = core.model_executor.driver_worker
    return getattr(worker, "worker", worker).model_runner


def kv_tensor(lm: Any) -> torch.Tensor | None:
    """The tensor behind vLLM's KV cache (first layer's view of the shared allocation)."""
    try:
        caches = _model_runner(lm).kv_caches
        return caches[0] if caches else None
    except (AttributeError, IndexError, TypeError):
        return None


def engine_state(lm: Any) -> dict[str, Any]:
    """Sizes of the engine thread's tables, read on the engine thread between steps."""
    driver = lm._driver

    def read() -> dict[str, Any]:
        loop = driver._loop
        core = driver.core
        out: dict[str, Any] = {
            "sink_rows": len(core.sink.rows),
            "idle_sessions": len(loop._table.idle),
            "live_sessions": len(loop._table.live),
            "session_index": len(loop._table._index),
            "by_rid": len(loop._by_rid),
            "by_key": len(loop._by_key),
            "queued": len(loop._queue),
            "templates": len(getattr(core, "_templates", {})),
        }
        sched = getattr(core, "_scheduler", None)
        if sched is not None:
            out["sched_requests"] = len(getattr(sched, "requests", {}))
            out["sched_waiting"] = len(getattr(sched, "waiting", ()))
            out["sched_running"] = len(getattr(sched, "running", ()))
            pool = getattr(getattr(sched, "kv_cache_manager", None), "block_pool", None)
            cached = getattr(pool, "cached_block_hash_to_block", None)
            if cached is not None:
                out["cached_blocks"] = len(getattr(cached, "_cache", cached))
            if pool is not None:
                out["free_blocks"] = pool.get_num_free_blocks()
            out["kv_usage"] = round(core.kv_usage(), 4)
        return out

    try:
        state = driver.call(read)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        state = {"error": repr(e)}
    batcher = lm._logprob_batcher
    state["batcher_pending"] = batcher.num_pending
    state["batcher_inflight"] = batcher.num_inflight
    state["cache_entries"] = len(lm.cache)
    return state


def object_counts() -> tuple[Counter[str], int, int]:
    """Python objects by type (gc), torch tensors and their bytes."""
    gc.collect()
    types: Counter[str] = Counter()
    tensors = tensor_bytes = 0
    for obj in gc.get_objects():
        types[type(obj).__name__] += 1
        try:
            if isinstance(obj, torch.Tensor):
                tensors += 1
                if obj.device.type == "cpu":
                    tensor_bytes += obj.element_size() * obj.nelement()
        except Exception:  # noqa: BLE001 - lazily initialised or odd objects
            continue
    return types, tensors, tensor_bytes


def check_rows(rows: list[torch.Tensor], vocab: int) -> list[str]:
    bad = []
    for r in rows:
        if r.shape != (vocab,) or r.dtype != torch.float32:
            bad.append(f"row of shape {tuple(r.shape)} {r.dtype}")
    if bad:
        return bad
    stacked = torch.stack(rows)
    if not bool(torch.isfinite(stacked).logical_or(stacked == -math.inf).all()):
        bad.append("row with NaN or +inf")
    lse = torch.logsumexp(stacked, dim=-1).abs().max().item()
    if not lse < LSE_TOL:
        bad.append(f"|logsumexp| = {lse:.3g}")
    return bad


def hf_check(path: str, sample: list[tuple[list[int], torch.Tensor]]) -> tuple[float, list[dict[str, Any]]]:
    """Compare sampled rows with transformers; returns the largest difference and, for each row
    off by ``HF_TOL`` or more, what the difference is made of."""
    from genlm_vlm.testing import hf_reference_logprobs

    if not sample:
        return 0.0, []
    refs = hf_reference_logprobs(path, [p for p, _ in sample])
    worst = 0.0
    bad = []
    for (prompt, row), ref in zip(sample, refs, strict=True):
        delta = (row - ref).abs()
        diff = delta.max().item()
        worst = max(worst, diff)
        if not diff < HF_TOL:
            at = int(delta.argmax())
            bad.append({
                "prompt": prompt, "diff": diff, "at_token": at, "ref_logprob_there": ref[at].item(),
                "max_ref_logprob": ref.max().item(), "same_argmax": int(row.argmax()) == int(ref.argmax()),
                # total variation distance between the two distributions
                "tv": 0.5 * (row.exp() - ref.exp()).abs().sum().item(),
                "ref": ref, "row": row,
            })
    return worst, bad


def reset_prefix_cache(lm: Any) -> bool:
    """Empty vLLM's prefix cache (on the engine thread, between steps); False if it could not."""
    try:
        driver = lm._driver
        return bool(driver.call(lambda: driver.core.llm.reset_prefix_cache()))
    except Exception:  # noqa: BLE001 - diagnostics only
        return False


async def explain_misses(lm: Any, misses: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Recompute each prompt whose row missed the transformers reference alone, from scratch
    (idle sessions released, prefix cache emptied), after the wave. A row that differs from its
    recomputation is a serving error; one that agrees with it (both off the reference by the
    same amount) is the kernels' arithmetic for that prompt: reported, not an error. Returns
    (errors, numeric misses)."""
    errors, numeric = [], []
    for m in misses:
        ref = m.pop("ref")
        row = m.pop("row")
        lm.clear_cache()
        m["prefix_cache_reset"] = reset_prefix_cache(lm)
        alone = await lm.next_token_logprobs(m["prompt"])
        m["alone_vs_ref"] = (alone - ref).abs().max().item()
        m["row_vs_alone"] = (row - alone).abs().max().item()
        text = (
            f"prompt of {len(m['prompt'])} tokens differs from transformers by {m['diff']:.3g} at token "
            f"{m['at_token']} (reference log-prob there {m['ref_logprob_there']:.2f}, top {m['max_ref_logprob']:.2f}; "
            f"same argmax {m['same_argmax']}; total variation {m['tv']:.2e}); recomputed alone from scratch: "
            f"{m['alone_vs_ref']:.3g} from transformers, {m['row_vs_alone']:.3g} from the served row"
        )
        if m["row_vs_alone"] < HF_TOL:
            m["kind"] = "numeric"
            numeric.append(text)
        else:
            m["kind"] = "serving"
            errors.append("HF check: " + text)
    return errors, numeric
