"""Moving delivered rows from the engine's device to ``output_device``.

From a CUDA engine to CPU output the rows go through one page-locked (pinned) host buffer with
an asynchronous copy, then the copying stream is synchronised before the rows are handed out:
a copy from device memory into pinned memory runs at the link's full rate, where a copy into
ordinary (pageable) memory is staged by the driver through a pinned bounce buffer. PyTorch's
caching host allocator recycles the pinned block once every row cut from it is dropped. Any
other pair of devices takes ``Tensor.to``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def pinned_copy_applies(source: torch.device, target: torch.device) -> bool:
    """Whether rows made on ``source`` go to ``target`` through pinned memory: CUDA to CPU."""
    return source.type == "cuda" and target.type == "cpu"


def pinned_host_copy(
    src: torch.Tensor,
    *,
    empty: Callable[..., torch.Tensor] = torch.empty,
    synchronize: Callable[[], None] | None = None,
) -> torch.Tensor:
    """A CPU copy of ``src`` in pinned memory, complete when this returns: an asynchronous copy
    on the current stream of ``src``'s device (the stream that made the rows, on the engine
    thread), then that stream is synchronised. ``empty`` and ``synchronize`` are replaceable
    for tests."""
    host = empty(tuple(src.shape), dtype=src.dtype, pin_memory=True)
    host.copy_(src, non_blocking=True)
    if synchronize is None:
        synchronize = torch.cuda.current_stream(src.device).synchronize
    synchronize()
    return host


def move_rows(rows: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``rows`` (1-D, one device) on ``device``, one tensor each (views of one stacked block)."""
    stacked = torch.stack(list(rows))
    if pinned_copy_applies(stacked.device, device):
        return pinned_host_copy(stacked).unbind(0)
    return stacked.to(device).unbind(0)
