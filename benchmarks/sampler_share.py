"""vLLM's sampler (where the requests path's controller runs) as a share of the model forward's
time in the same run: a figure that compares two commits, or ``lm.smc`` with vLLM decode, across
processes.

This machine's speed moves by tens of percent between processes (benchmarks/speed_probe.py), so
per-step times from two processes cannot resolve a change of a few percent; the forward's time in
the same run moves with the machine and does not depend on what runs in the sampler. Each run of
the ``bench`` command's ``smc`` cell (``--system requests``: ``lm.smc`` on the requests path;
``--system decode``: the bench's vLLM decode lane of the same tokens) is timed by part on the
engine thread's clock (thread CPU): vLLM's ``Sampler.forward`` and the runner's ``_model_forward``,
``_prepare_inputs``, ``_update_states`` and ``execute_model``. Printed per N: the median over the
timed runs of sampler / forward (and its range), input preparation / forward, state update /
forward, and the rest of ``execute_model`` / forward.

    python benchmarks/sampler_share.py --system requests --n 32 128
    python benchmarks/sampler_share.py --system decode --n 32 128

To compare commits, run it from each checkout in alternating processes (``PYTHONPATH=<checkout>``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=["requests", "decode"], required=True)
    p.add_argument("--n", type=int, nargs="+", default=[32, 128])
    p.add_argument("--t", type=int, default=48)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--constraint", default="steady")
    args = p.parse_args()

    from genlm_vlm import demo_model_path
    from genlm_vlm.bench import harness
    from genlm_vlm.bench.cli import engine_options

    harness.setup_environment()
    model = demo_model_path()
    spec = {"model": model, "engine_opts": engine_options(model, {})}
    if args.system == "decode":
        from genlm_vlm.bench.systems import vllm_system

        system = vllm_system(spec)
    else:
        from genlm_vlm.bench.systems import genlm_system

        system = genlm_system(spec)
    from profile_step import _wrap_inner, _wrap_runner

    # thread CPU of the runner's parts (instance wrappers) and of vLLM's sampler, as profile_step.py
    timers = _wrap_runner(system.llm if args.system == "decode" else system.lm.llm)
    timers.update(_wrap_inner([("vllm.v1.sample.sampler", "Sampler", "forward")]))
    for n in args.n:
        def job(rep: int, n: int = n) -> dict:
            if args.system == "decode":
                return system.run("decode", n=n, rep=rep, tokens=args.t)
            return system.run("smc", n=n, t=args.t, constraint=args.constraint, rep=rep, engine_path="requests")

        job(0)  # warm-up
        shares = []
        for rep in range(1, args.reps + 1):
            for t in timers.values():
                t[:] = [0, 0.0, 0.0]  # in place: the wrappers hold these lists
            job(rep)
            cpu = {k: t[2] for k, t in timers.items()}
            f = max(cpu["_model_forward"], 1e-9)
            rest = cpu["execute_model"] - cpu["_model_forward"] - cpu["_prepare_inputs"] - cpu["_update_states"]
            shares.append((cpu["Sampler.forward"] / f, cpu["_prepare_inputs"] / f, cpu["_update_states"] / f, rest / f))
        s = sorted(x[0] for x in shares)
        print(f"{args.system} N={n}: sampler / forward {statistics.median(s):.3f} ({s[0]:.3f}-{s[-1]:.3f}), "
              f"input prep / forward {statistics.median(x[1] for x in shares):.3f}, state update / forward "
              f"{statistics.median(x[2] for x in shares):.3f}, rest of execute_model / forward "
              f"{statistics.median(x[3] for x in shares):.3f}", flush=True)
    system.close()


if __name__ == "__main__":
    main()
