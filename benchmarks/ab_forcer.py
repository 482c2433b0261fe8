"""The requests path's forcer and the controller's draw, A/B in one process: how a forced token is
written, how many torch threads the forcer uses, and how the built-in controller calls the fused
CPU draw, alternating repetition by repetition on one engine.

Variants (each an ``lm.smc`` run of the ``bench`` command's ``smc`` cell on the requests path):

- ``fill-1``: rows filled with ``-inf`` but for a 0 at the token (the forcer before the eleventh
  session), one forcer thread;
- ``max-1``: the token's entry set to the dtype's largest finite value (``force_rows``), one thread;
- ``max-auto-propose``: the same with the sampler's own thread count (``FORCER_THREADS = None``)
  and the controller's draw through ``step.propose`` and ``step.to_host`` (before the twelfth
  session: checks and tensors around the fused kernel);
- ``max-auto``: the same with the draw's numpy arrays handed to the kernel directly (the default);
- ``bursts`` (``--bursts``): the same run as bursts.

The machine's speed moves between runs of a few seconds, so besides walls the script reports each
run's wall and vLLM sampler time divided by the model forward's time in the same run (the
runner's methods timed as in ``profile_step.py --timers``), and each variant's per-repetition
speed against ``fill-1``. The particles of every variant are checked identical in each repetition.

    python benchmarks/ab_forcer.py --n 128 --reps 6 --constraint steady
    python benchmarks/ab_forcer.py --model-shape qwen2-0.5b --n 64 --reps 2 --bursts
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def fill_rows(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """The old forcer: ``logits[rows[i]]`` becomes ``-inf`` but for a 0 at ``tokens[i]``."""
    at = torch.as_tensor(rows, device=logits.device, dtype=torch.long)
    logits.index_fill_(0, at, float("-inf"))
    logits[at, torch.as_tensor(tokens, device=logits.device, dtype=torch.long)] = 0.0


def main() -> None:
    import profile_step

    from genlm_vlm import demo_model_path
    from genlm_vlm.bench import harness
    from genlm_vlm.bench.cli import engine_options
    from genlm_vlm.bench.systems import genlm_system
    from genlm_vlm.engine import forcing
    from genlm_vlm.smc import step

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model path (default: the demo model)")
    p.add_argument("--model-shape", help="a shape of the bench command's --model-shape (qwen2-0.5b, 6-layer, ...)")
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--t", type=int, default=48)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--constraint", default="steady")
    p.add_argument("--bursts", action="store_true", help="add the bursts as a variant")
    args = p.parse_args()

    harness.setup_environment()
    model = args.model or demo_model_path()
    if args.model_shape:
        from genlm_vlm.bench.cli import SHAPES
        from genlm_vlm.testing import tiny_model_path

        model = str(tiny_model_path(SHAPES[args.model_shape]))
    system = genlm_system({"model": model, "engine_opts": engine_options(model, {})})
    new = forcing.force_rows
    direct = step.fused_inputs
    variants = {"fill-1": ("requests", fill_rows, 1, direct), "max-1": ("requests", new, 1, direct),
                "max-auto-propose": ("requests", new, None, lambda *a: None),
                "max-auto": ("requests", new, None, direct)}
    if args.bursts:
        variants["bursts"] = ("bursts", new, None, direct)

    def run(rep: int, path: str) -> dict:
        return system.run("smc", n=args.n, t=args.t, constraint=args.constraint, rep=rep, engine_path=path)

    run(0, "requests")
    if args.bursts:
        run(0, "bursts")
    timers = profile_step._wrap_runner(system.lm.llm)
    walls: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
    for rep in range(1, args.reps + 1):
        order = list(variants) if rep % 2 else list(reversed(variants))
        prints = set()
        for name in order:
            path, forcing.force_rows, forcing.FORCER_THREADS, step.fused_inputs = variants[name]
            for t in timers.values():
                t[:] = [0, 0.0, 0.0]
            r = run(rep, path)
            forward = max(timers["_model_forward"][1], 1e-9)
            walls[name].append((r["wall_s"], r["wall_s"] / forward, timers["sample_tokens"][1] / forward))
            prints.add(r["fingerprint"])
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1][0]:.3f} s" for k, v in walls.items())
              + ("" if len(prints) == 1 else "  PARTICLES DIFFER"), flush=True)
    forcing.force_rows, forcing.FORCER_THREADS, step.fused_inputs = new, None, direct
    system.close()
    print("| variant | median wall (s) | median wall / forward | median sampler / forward | speed / fill-1 (median per repetition) |")
    print("|---|---|---|---|---|")
    base = [w for w, _, _ in walls["fill-1"]]
    for name, v in walls.items():
        speed = statistics.median(b / w for b, (w, _, _) in zip(base, v, strict=True))
        print(f"| {name} | {statistics.median(w for w, _, _ in v):.3f} | {statistics.median(x for _, x, _ in v):.3f} "
              f"| {statistics.median(s for _, _, s in v):.3f} | {speed:.3f} |")


if __name__ == "__main__":
    main()
