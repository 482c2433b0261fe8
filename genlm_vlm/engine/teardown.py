"""Taking a vLLM engine apart (engine thread only): stopping tensor-parallel workers quickly and
freeing an in-process engine core without tearing down what a second engine in this process
still uses. Part of the engine package (reads vLLM internals); used by :mod:`.core`."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from .build import _layout_error

#: Seconds tensor-parallel workers get to exit after their death pipe closes, then after SIGTERM,
#: before the next signal (vLLM's own grace period is 5 s plus 4 s).
WORKER_EXIT_GRACE = (0.5, 1.0)


def stop_workers(llm: Any) -> int:
    """Stop a multiprocessing executor's worker processes quickly: close their death pipes,
    wait :data:`WORKER_EXIT_GRACE`, then SIGTERM, then SIGKILL. Returns how many workers there
    were (0 for an in-process executor). vLLM's own shutdown then finds them gone."""
    try:
        executor = llm.llm_engine.engine_core.engine_core.model_executor
    except AttributeError as e:
        raise _layout_error(f"cannot reach the engine's executor to stop its workers ({e})") from e
    workers = getattr(executor, "workers", None) or []
    procs = [w.proc for w in workers if getattr(w, "proc", None) is not None]
    if not procs:
        return 0
    for w in workers:
        if getattr(w, "death_writer", None) is not None:
            w.death_writer.close()
            w.death_writer = None
    for grace, signal_next in zip(WORKER_EXIT_GRACE, ("terminate", "kill"), strict=True):
        deadline = time.monotonic() + grace
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        for proc in alive:
            getattr(proc, signal_next)()
    for proc in procs:
        proc.join(1.0)
    return len(procs)


def release_engine(llm: Any, *, last: bool) -> None:
    """Free an engine. ``last``: no other engine lives in this process (full vLLM teardown).

    Otherwise the in-process EngineCore is taken apart like ``EngineCore.shutdown`` does, minus
    its final ``cleanup_dist_env_and_memory()``, and the client's finalizer (which would run the
    full shutdown when the client is collected) is detached.
    """
    client = llm.llm_engine.engine_core
    if last:
        client.shutdown()
        return
    try:
        core = client.engine_core
        finalizer = client._finalizer
        executor, scheduler = core.model_executor, core.scheduler
        structured = core.structured_output_manager
    except AttributeError as e:
        raise _layout_error(f"cannot reach the in-process EngineCore to free it ({e})") from e
    finalizer.detach()
    structured.clear_backend()
    if executor is not None:
        executor.shutdown()
    if scheduler is not None:
        scheduler.shutdown()
    core.model_executor = None
    core.scheduler = None
    gc.unfreeze()  # EngineCore gc.freeze()s its start-up objects; let them be collected
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
