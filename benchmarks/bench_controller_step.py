"""What the built-in SMC controller's step costs, alone: no engine, the same rows every run.

``lm.smc``'s controller (:class:`genlm_vlm.smc.SMCController`) runs inside vLLM's sampler on the
requests path; this times its ``step`` plus the runner's check and application of the decision
(``check_decision``, ``ParticleSet.apply_checked``), on the engine thread's clock (thread CPU),
with rows of the demo model's width drawn once (``3 * randn``, normalised) and a mock model's
vocabulary (the demo tokenizer's). ``--parts`` also times the step's pieces: the masks, the fused
draw, the particles' bookkeeping (of which the constraint's advances), the ESS and resampling.
The fingerprint hashes every particle's tokens, weight and status and the ESS trace: two versions
of the code that give the same fingerprint made the same run.

    python benchmarks/bench_controller_step.py --n 32 128 --reps 20
    python benchmarks/bench_controller_step.py --n 32 --pattern '[a-z]{1,9}( [a-z]{1,9}){0,6}' --parts

The first two runs of each N are warm-up (the automaton's states and masks are filled), the rest
timed; the machine's own speed moves between runs (benchmarks/speed_probe.py), so compare
versions in alternating processes.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch

from genlm_vlm.mock import MockAsyncLM
from genlm_vlm.smc import Regex
from genlm_vlm.smc.api import prepare
from genlm_vlm.smc.controller import ParticleSet, check_decision

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEMO = Path(__file__).resolve().parents[1] / "genlm_vlm" / "data" / "demo-model"
STEADY = r"[a-z ]{1000}"  # the bench's `steady`: no particle finishes, nothing resampled
#: ``--parts``: the step's pieces (profile_step.py's INNER form), and the names printed for them.
PARTS = [
    ("genlm_vlm.smc.prefetch", "StepMasks", "_bitmasks"),
    ("genlm_vlm.smc.step_cpu", None, "fused_arrays"),
    ("genlm_vlm.smc.algorithm", "SMCController", "_take"),
    ("genlm_vlm.smc.automaton", "BoundAutomaton", "advance_many"),
    ("genlm_vlm.smc.algorithm", "SMCController", "_maybe_resample"),
]
NAMES = {"StepMasks._bitmasks": "masks", "fused_arrays": "fused draw", "SMCController._take": "bookkeeping",
         "BoundAutomaton.advance_many": "- of which advances", "SMCController._maybe_resample": "ESS, resampling"}


def run(lm: MockAsyncLM, n: int, pattern: str, t: int, reps: int, temperature: float) -> tuple[list[float], str, int]:
    """Microseconds a step of each timed run, the fingerprint, and the steps of the last run."""
    torch.set_num_threads(1)
    width = lm.vocab_size
    g = torch.Generator().manual_seed(0)
    pool = [torch.log_softmax(3 * torch.randn(n, width, generator=g), -1) for _ in range(t)]
    ess = 0.0 if pattern == STEADY else 0.5
    fp = hashlib.sha1()
    times, steps = [], 0
    buf = torch.empty(n, width)
    for rep in range(reps + 2):
        _, ctl = prepare(lm, [1, 2, 3], Regex(pattern), n, t, seed=rep, ess_threshold=ess, temperature=temperature)
        ps = ParticleSet((1, 2, 3), n, vocab_size=width)
        spent, steps = 0, 0
        while live := ps.live():
            rows = buf[: len(live)]
            rows.copy_(pool[steps % t][: len(live)])
            c0 = time.thread_time_ns()
            d = ctl.step(rows, live)
            tokens, parents, stop = check_decision(d, len(live), ps.n, width)
            stop = ps.apply_checked(tokens, parents, stop, live)
            spent += time.thread_time_ns() - c0
            steps += 1
            if stop:
                break
        res = ctl.result(ps.generated)
        fp.update(repr([(p.token_ids, p.log_weight, p.status) for p in res.particles]).encode())
        fp.update(repr(res.ess).encode())
        if rep >= 2:
            times.append(spent / 1e3 / steps)
    return times, fp.hexdigest()[:12], steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--pattern", default=STEADY, help=f"the regex (default {STEADY!r}: every particle live, ESS 0)")
    ap.add_argument("--t", type=int, default=48, help="max_tokens (default 48)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--parts", action="store_true", help="also time the step's pieces (us a step)")
    args = ap.parse_args()
    lm = MockAsyncLM.from_name(str(DEMO))
    timers: dict = {}
    if args.parts:
        from profile_step import _wrap_inner

        timers = _wrap_inner(PARTS)
    for n in args.n:
        for t in timers.values():
            t[:] = [0, 0.0, 0.0]
        times, fp, steps = run(lm, n, args.pattern, args.t, args.reps, args.temperature)
        times.sort()
        line = (f"N={n} steps={steps}: {statistics.median(times):.0f} us a step (median; min {times[0]:.0f}, "
                f"max {times[-1]:.0f}) fingerprint {fp}")
        if args.parts:
            total = (args.reps + 2) * steps  # every run has the same steps (the same rows)
            line += " | " + ", ".join(f"{NAMES[k]} {1e6 * t[2] / total:.0f}" for k, t in timers.items())
        print(line, flush=True)
    lm.cleanup()


if __name__ == "__main__":
    main()
