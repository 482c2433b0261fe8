"""A function compiled by numba on first use, once per process, or the reason it cannot be.

The built-in controller's compiled loops (the fused draw, :mod:`.step_cpu`; the automata's token
walk, :mod:`.walk_cpu`) are compiled when a controller is built, never inside an engine step, and
loaded from numba's disk cache after the first time. Where numba is missing or cannot compile
(vLLM requires numba, so an engine install has it), :meth:`Compiled.get` returns None and the
callers take their Python or torch paths; :attr:`Compiled.failed` says why.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Compiled:
    """``compile()`` run once, on the first :meth:`get` (thread-safe). ``what`` names the loop in
    the reason kept when compiling fails, ``otherwise`` what runs instead (logged)."""

    def __init__(self, compile: Callable[[], object], what: str, otherwise: str) -> None:
        self.compile = compile
        self.what = what
        self.otherwise = otherwise
        self.kernel: object = None
        #: Why the kernel is not available: empty while it is, or was not tried yet.
        self.failed: list[str] = []
        self._lock = threading.Lock()

    def get(self) -> object:
        """The compiled function, or None where it cannot be had."""
        if self.kernel is None and not self.failed:
            with self._lock:
                if self.kernel is None and not self.failed:
                    try:
                        self.kernel = self.compile()
                    except Exception as e:  # noqa: BLE001 - no numba, or it cannot compile: the other path
                        first = (str(e).strip().splitlines() or [""])[0]
                        self.failed.append(f"{self.what} is off: {type(e).__name__}: {first}")
                        logger.info("%s; %s", self.failed[0], self.otherwise)
        return self.kernel

    def error(self) -> str | None:
        """Why the kernel is not used (None: it is, or was not tried yet)."""
        return self.failed[0] if self.failed else None
