"""What one SMC step costs the runner's bookkeeping as the particles grow long.

:class:`genlm_vlm.smc.controller.ParticleSet` applies every decision of every runner (the requests
path inside vLLM's sampler, bursts, the Python reference). This times ``apply_checked`` alone, no
engine: ``--n`` particles, ``--t`` steps, every particle live, a resampling every ``--every`` steps
(parents drawn at random), and prints the median microseconds a step in windows of 100 steps
ending at a few lengths (median, and mean with the resampling steps). A step that copies each particle's history costs O(N * length); one that
extends in place stays flat.

    python benchmarks/bench_particle_set.py --n 128 --t 2000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from genlm_vlm.smc.controller import ParticleSet


def run(n: int, t: int, every: int, seed: int = 0) -> list[float]:
    """Seconds of each step's ``apply_checked``."""
    rng = random.Random(seed)
    ps = ParticleSet((1, 2, 3), n, vocab_size=50_000, max_len=t + 16)
    live = list(range(n))
    out = []
    for step in range(1, t + 1):
        tokens: list[int | None] = [rng.randrange(50_000) for _ in live]
        parents = [rng.randrange(n) for _ in range(n)] if step % every == 0 else None
        t0 = time.perf_counter()
        ps.apply_checked(tokens, parents, False, live)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--t", type=int, default=2000)
    p.add_argument("--every", type=int, default=10, help="resample every this many steps")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    runs = [run(a.n, a.t, a.every, seed) for seed in range(a.reps)]
    ends = sorted({min(a.t, e) for e in (100, 500, 1000, 2000, a.t)})
    print(f"N = {a.n}, resampling every {a.every} steps; us per step (median / mean, the mean with the "
          "resampling steps' copies) over the 100 steps ending at each length")
    print("| length | " + " | ".join(f"rep {i + 1}" for i in range(a.reps)) + " |")
    print("|---|" + "---|" * a.reps)
    for e in ends:
        win = [r[max(0, e - 100):e] for r in runs]
        print(f"| {e} | " + " | ".join(f"{statistics.median(w) * 1e6:.1f} / {statistics.mean(w) * 1e6:.1f}" for w in win)
              + " |")


if __name__ == "__main__":
    main()
