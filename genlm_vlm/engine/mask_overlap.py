"""The engine's mask worker: one thread that computes the next step's constraint masks of runs on
the requests path while vLLM finishes the step and runs the next forward (``lm.smc(...,
mask_overlap=True)``; see :mod:`genlm_vlm.smc.prefetch` for what is computed and why the run
stays exact).

On the requests path an SMC step is: forward -> the capture processor -> the run's controller
(masks of the live particles' states, then the draw) -> forced tokens. The masks of step
``t + 1`` depend only on the tokens drawn at step ``t``, so once the controller has decided
(inside the sampler), :meth:`MaskWorker.prefetch` hands their computation to this thread; the
controller's next step takes the result. Runs whose controller does not offer
``prefetch_masks`` (any other :class:`~genlm_vlm.smc.Controller`), or did not ask for it, are
left alone.

The thread is made on first use and joined by :meth:`MaskWorker.close` (engine shutdown). A run
that ends, fails or is cancelled drops its work first (:meth:`MaskWorker.discard`: cancelled if
not started, else waited for), so no work outlives its run. The thread counts as the engine
thread for :meth:`~.loop.EngineDriver.refuse_engine_thread`: a mask function that calls the
model from it is refused at once (it would wait for the engine, which waits for it).

Engine thread only, except :meth:`MaskWorker.owns` (any thread).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any

THREAD_NAME = "genlm-vlm-masks"


class MaskWorker:
    """One engine's mask thread (see the module docstring)."""

    def __init__(self) -> None:
        self._pool: cf.ThreadPoolExecutor | None = None
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.counts = {"runs": 0, "submitted": 0}

    def attach(self, controller: Any) -> bool:
        """Whether ``controller`` (a new run's) asked for its masks ahead and can compute them
        so (``mask_overlap`` set, ``prefetch_masks`` offered); counted in ``runs``."""
        ok = getattr(controller, "mask_overlap", False) is True and callable(getattr(controller, "prefetch_masks", None))
        if ok:
            self.counts["runs"] += 1
        return ok

    def prefetch(self, controller: Any, particles: list[int]) -> None:
        """Start ``controller``'s masks for its next step's ``particles`` on the thread."""
        if controller.prefetch_masks(particles, self._submit):
            self.counts["submitted"] += 1

    def discard(self, controller: Any) -> None:
        """``controller``'s run ended: drop its work in flight (returns once none runs)."""
        drop = getattr(controller, "discard_prefetch", None)
        if drop is not None:
            drop()

    def owns(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` is this worker's (any thread may ask)."""
        return thread in self._threads

    def _submit(self, work: Callable[[], Any]) -> cf.Future:
        if self._closed:
            raise RuntimeError("the engine's mask worker was shut down")
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME,
                                               initializer=self._register)
        return self._pool.submit(work)

    def _register(self) -> None:
        self._threads.add(threading.current_thread())

    def close(self) -> None:
        """Stop the thread (work not started is cancelled; running work is waited for)."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._threads.clear()

    @property
    def alive(self) -> bool:
        """Whether the worker's thread exists (it is made on first use)."""
        return self._pool is not None

    def stats(self) -> dict[str, Any]:
        return dict(self.counts, thread=self.alive)
