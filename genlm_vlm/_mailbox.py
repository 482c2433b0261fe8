"""Completions from other threads carried to one asyncio event loop, one loop callback per burst
(the futures mode of :class:`~genlm_vlm.batching.AutoBatcher`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Mailbox"]


class Mailbox:
    """Carries engine-thread completions to one event loop, one loop callback per burst.

    An engine step that finishes 256 requests posts 256 items but wakes the loop once (each
    ``call_soon_threadsafe`` writes to the loop's self-pipe); the loop then handles them in
    order. A closed loop drops the items: nobody can be waiting on it any more.
    """

    __slots__ = ("handler", "items", "lock", "loop", "scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop, handler: Callable[..., None]) -> None:
        self.loop = loop
        self.handler = handler
        self.lock = threading.Lock()
        self.items: list[tuple[Any, ...]] = []
        self.scheduled = False

    def post(self, *item: Any) -> None:
        """Queue ``handler(*item)`` on the loop (any thread)."""
        with self.lock:
            self.items.append(item)
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed
            with self.lock:
                self.items.clear()
                self.scheduled = False

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, []
            self.scheduled = False
        for item in items:
            try:
                self.handler(*item)
            except BaseException as exc:  # noqa: BLE001 - reported, and the rest still delivered
                self.loop.call_exception_handler(
                    {"message": "genlm_vlm: delivering a result failed", "exception": exc}
                )
