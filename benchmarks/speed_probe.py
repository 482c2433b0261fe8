"""How steady this machine's speed is: a fixed pure-Python loop timed over successive windows.

A benchmark's ratio is only as steady as the machine under it. This runs the same loop for
``--windows`` windows of ``--window`` seconds on one thread and prints the work done in each
(millions of loop steps a second), their spread, and the CPU time the kernel reports as stolen
by the hypervisor over the whole probe (``/proc/stat``; Linux only). On the 2-core machine of
docs/BENCHMARKS.md (thirteenth session) the rate moved by up to 58 % between half-second windows
with no steal recorded: a round of `python -m genlm_vlm bench` lasts a few seconds, so single
rounds disagree by that much and only many rounds, alternating, give a ratio.

    python benchmarks/speed_probe.py --windows 20 --window 0.5
"""

from __future__ import annotations

import argparse
import statistics
import time


def _stat() -> list[int] | None:
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None


def window_rate(seconds: float) -> float:
    """Millions of loop steps a second over one window of ``seconds``."""
    start, steps, total = time.perf_counter(), 0, 0
    while time.perf_counter() - start < seconds:
        for i in range(10_000):
            total += i
        steps += 10_000
    return steps / (time.perf_counter() - start) / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=20)
    p.add_argument("--window", type=float, default=0.5, help="seconds per window")
    args = p.parse_args()
    before = _stat()
    rates = [window_rate(args.window) for _ in range(args.windows)]
    after = _stat()
    print("rates (M loop steps/s):", " ".join(f"{r:.1f}" for r in rates))
    print(f"min {min(rates):.1f}, median {statistics.median(rates):.1f}, max {max(rates):.1f}: "
          f"max / min = {max(rates) / min(rates):.2f}")
    if before and after and len(before) > 7:
        ticks = [b - a for a, b in zip(before, after, strict=False)]
        print(f"CPU ticks over the probe: steal {ticks[7]} of {sum(ticks)} (all cores)")


if __name__ == "__main__":
    main()
