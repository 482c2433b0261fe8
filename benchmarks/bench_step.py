"""The SMC proposal step alone (genlm_vlm.smc.step), on the CPU: its two paths across mask
densities, and the built-in controller's whole step on a model's tokenizer.

Part 1 (``--paths``): ``propose`` on random log-softmax rows ``[m, V]`` and random masks of a
given density over the usable width, the dense, gather and fused paths, medians of ``--reps``
timed calls after one warm-up; the crossovers set ``GATHER_DENSITY_CPU`` and
``step_cpu.FUSED_DENSITY``.

Part 2 (``--controller MODEL``): ``SMCController.step`` for the steady cell of
bench_smc_engine (the regex ``[a-z ]{1000}``, every particle live and distinct) on random rows
as wide as the model's logits, no engine: ms per step and the masks' share. ``--cold`` repeats it with a
forward-sized matmul between steps, as the engine's forward runs between them: that leaves the
caches cold, and it is what bench_smc_engine's "ctl ms/step" shows (the step's CPU time there
equals its wall time: nothing waits for a core).

Run from the repository root::

    .venv/bin/python benchmarks/bench_step.py --paths --controller llama-2k-32kcols-mid qwen2-0.5b-shape --cold

The step runs on one torch thread (``CPU_STEP_THREADS``), as in the engine. Say what else the
machine was doing: these are wall times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from genlm_vlm.smc import step

SHAPES = ((151936, 32000), (32768, 2048), (151936, 151646))  # (columns, usable width)
DENSITIES = (0.7, 0.5, 0.33, 0.25, 0.1, 0.03, 0.01, 0.003)
WIDTHS = {"llama-2k-32kcols-mid": 32768, "qwen2-0.5b-shape": 151936, "llama-2k-mid": 2048}


def timed(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def paths(ms: list[int], reps: int) -> None:
    from genlm_vlm.smc import step_cpu

    fused_ok = step_cpu.fused_available()
    print("| columns | usable | m | density | dense ms | gather ms | fused ms | auto chooses |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    for v, w in SHAPES:
        for m in ms:
            rows = torch.log_softmax(3 * torch.randn(m, v, generator=gen), dim=1)
            for d in DENSITIES:
                bits = step.pack(rng.random((m, w)) < d)
                u = rng.random(m)
                dense, gather, fused = (
                    timed(lambda p=p, r=rows, b=bits, u=u, w=w: step.propose(r, b, u, 1.0, width=w, path=p), reps)
                    if p != "fused" or fused_ok else float("nan") for p in ("dense", "gather", "fused"))
                auto = step.choose_path(step.popcounts(bits), w, "cpu")
                print(f"| {v:,} | {w:,} | {m} | {d} | {dense:.3f} | {gather:.3f} | {fused:.3f} | {auto} |", flush=True)


def controller(model: str, ms: list[int], steps: int, cold: bool = False) -> None:
    from transformers import AutoTokenizer

    from genlm_vlm.smc import Regex
    from genlm_vlm.smc.algorithm import SMCController
    from genlm_vlm.testing import tiny_model_path
    from genlm_vlm.vocab import get_byte_vocab

    v = WIDTHS[model]
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path(model)))
    vocab = (list(get_byte_vocab(tok)) + [b""] * v)[:v]
    eos = [tok.eos_token_id]
    gen = torch.Generator().manual_seed(0)
    big, w = torch.randn(2048, 4096, generator=gen), torch.randn(4096, 1024, generator=gen)
    for n in ms:
        bound = Regex("[a-z ]{1000}").bind(vocab, eos, v, {})
        ctl = SMCController(bound, n, 10 * steps, eos_ids=eos, byte_vocab=vocab, ess_threshold=0.0, seed=0)
        rows = [torch.log_softmax(2 * torch.randn(n, v, generator=gen), dim=1) for _ in range(4)]
        live = list(range(n))
        for s in range(3):
            ctl.step(rows[s % 4], live)
        m0, c0, wall = ctl.mask_seconds, ctl.seconds, 0.0
        for s in range(steps):
            if cold:  # a forward-sized matmul between steps, as the engine's forward (caches cold)
                big @ w
            t0 = time.perf_counter()
            ctl.step(rows[s % 4], live)
            wall += time.perf_counter() - t0
        wall /= steps
        masks = (ctl.mask_seconds - m0) / steps
        print(f"{model} N={n}{' (cold caches)' if cold else ''}: controller {1e3 * wall:.3f} ms/step (masks {1e3 * masks:.3f}, "
              f"rest {1e3 * ((ctl.seconds - c0) / steps - masks):.3f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", action="store_true", help="part 1: dense vs gather by density")
    ap.add_argument("--controller", nargs="*", default=[], choices=sorted(WIDTHS), help="part 2 on these models")
    ap.add_argument("--m", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cold", action="store_true", help="part 2 also with a forward-sized matmul between steps")
    args = ap.parse_args()
    step.set_threads(step.CPU_STEP_THREADS or torch.get_num_threads())
    if args.paths:
        paths(args.m, args.reps)
    for model in args.controller:
        controller(model, args.m, args.steps)
        if args.cold:
            controller(model, args.m, args.steps, cold=True)


if __name__ == "__main__":
    main()
