"""How rows leave a tensor-parallel worker: genlm_vlm's shared ring vs vLLM's collective_rpc.

Builds the tiny test model with ``tensor_parallel_size=2`` (two worker processes), then, for
``--rows`` rows of ``--width`` float32 columns, prints per row:

* ``collective_rpc``: rank 0 returns the rows through ``LLM.collective_rpc`` (vLLM pickles them
  through its message queue); the time to make the rows on the worker is measured here and
  subtracted;
* the ring's write (``log_softmax`` computed in the slot, as the rank-0 capture does) and drain
  (the engine thread's copy out), both in this process on a ring file in ``/dev/shm``;
* an in-process ``torch.log_softmax`` per row (what the capture does without tensor parallel).

    .venv/bin/python benchmarks/bench_ring.py --rows 256 --width 32768
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a callable


def _rows_on_rank0(worker: object, n: int, v: int) -> object:
    import torch

    x = torch.randn(n, v)
    return x if torch.distributed.get_rank() == 0 else None


def _per_row(seconds: float, reps: int, n: int) -> float:
    return 1e6 * seconds / reps / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--width", type=int, default=32768)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import torch

    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.rowring import RowRing, new_ring_path
    from genlm_vlm.testing import tiny_model_path

    n, v, reps = args.rows, args.width, args.reps
    lm = AsyncVirtualLM.from_name(
        str(tiny_model_path("llama")),
        {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20, "tensor_parallel_size": 2},
    )
    try:
        llm = lm.llm
        for _ in range(2):
            llm.collective_rpc(_rows_on_rank0, args=(n, v))
        t = time.perf_counter()
        for _ in range(reps):
            llm.collective_rpc(_rows_on_rank0, args=(n, v))
        rpc = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(reps):
            torch.randn(n, v)
        make = time.perf_counter() - t
    finally:
        lm.cleanup()

    ring = RowRing.create(new_ring_path(), v, n)
    writer = RowRing.attach(ring.path)
    logits, tags, rows = torch.randn(n, v), [f"r{i}" for i in range(n)], list(range(n))
    out: dict[str, torch.Tensor] = {}
    try:
        for _ in range(2):  # warm-up: the ring file's pages and the allocator's free lists
            writer.write(tags, logits, rows)
            ring.drain(out)
        t = time.perf_counter()
        for _ in range(reps):
            writer.write(tags, logits, rows)
            ring.header[5] = 0  # the count word: discard without copying out
        write = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(reps):
            writer.write(tags, logits, rows)
            ring.drain(out)
        both = time.perf_counter() - t
    finally:
        writer.close()
        ring.close()
    for i in range(n):  # warm-up
        out[tags[i]] = torch.log_softmax(logits[i], -1)
    t = time.perf_counter()
    for _ in range(reps):
        for i in range(n):
            out[tags[i]] = torch.log_softmax(logits[i], -1)
    inproc = time.perf_counter() - t

    print(f"{n} rows x {v} float32 columns, microseconds per row (mean of {reps} repetitions):")
    print(f"  collective_rpc from rank 0:          {_per_row(rpc - make, reps, n):8.1f}")
    print(f"  ring write (log_softmax in slot):    {_per_row(write, reps, n):8.1f}")
    print(f"  ring drain (copy out):               {_per_row(both - write, reps, n):8.1f}")
    print(f"  in-process log_softmax (no TP):      {_per_row(inproc, reps, n):8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
