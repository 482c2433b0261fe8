#!/usr/bin/env python
"""Scaling benchmark: SMC throughput of one engine vs several, same total particles.

Workload (``smc``): ``--runs`` independent SMC runs, each from its own random prompt of
``--prompt-len`` tokens with ``n / runs`` particles, run concurrently (one asyncio task per run).
Each step awaits every particle of the run (``lm.next_token_logprobs``), then extends each by one
token sampled from its row (inverse CDF, seeded ``torch.Generator``); with ``--resample-every K`` a run
first replaces its particles by uniformly drawn ancestors before every K-th step (forks, drops).
Rate: particle-steps per second (one particle-step = one full-vocabulary row), over the wall
time of all runs.

Systems (``--systems``; each built once, repetitions interleaved across systems):

* ``replicas1``: ``ReplicaPool`` with one replica pinned to core 0;
* ``replicas2``: ``ReplicaPool`` with two replicas pinned to cores 0 and 1;
* ``local`` (not run by default): ``AsyncVirtualLM`` in this process, no Ray: what the Ray hop
  costs.

This process runs torch on one thread (its idle OpenMP threads would otherwise spin on the cores
the replicas are pinned to; ``local``'s engine then has one thread, like a replica). CPU seconds
per 1000 particle-steps are printed for this process (driver: routing, copies, the SMC loop, and
``local``'s engine) and for the replica processes.

Each repetition uses fresh prompts (the same for every system), after ``clear_cache()``, so no
system is served by an earlier repetition's prefix cache; one warm-up repetition first. Printed:
median particle-steps/s per system and the ratio of each pair in ``RATIOS`` (e.g.
replicas2/replicas1) measured in this run, plus the pools' routing counters.

Adding a system (the hook): write ``def build_x(args) -> System`` (an object with ``name``,
``lm`` — anything with the ``AsyncLM`` API and ``clear_cache()`` — ``info`` (a dict for the
output; ``info["replica_pids"]``: the processes counted as ``replicas`` CPU) and ``close()``),
register it in ``SYSTEMS`` and, for a ratio, add the pair to ``RATIOS``.
Tensor parallelism is measured by ``bench_tp.py`` instead: each configuration in a fresh process
(a TP=2 engine's worker processes pinned next to a live TP=1 engine would skew both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402

#: Engine options of every system: float32, a small KV cache per engine.
ENGINE_OPTS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 512,
    "kv_cache_memory_bytes": 512 << 20,
    "seed": 0,
}

log = logging.getLogger("bench_scale")


# --------------------------------------------------------------------------- systems
@dataclass
class System:
    name: str
    lm: Any
    close: Callable[[], None]
    info: dict[str, Any] = field(default_factory=dict)


def _pool(args: argparse.Namespace, name: str, cores: list[list[int]]) -> System:
    from genlm_vlm import ReplicaPool

    t0 = time.perf_counter()
    pool = ReplicaPool.from_name(
        args.model_path, len(cores), {**ENGINE_OPTS, **(args.engine_opts or {})},
        pin_cpus=cores,
        # Ray's CPUs are logical: every system of this run shares one local Ray instance.
        ray_init_opts={"num_cpus": 8},
        actor_options={"num_cpus": 1},
    )
    info = {"replicas": len(cores), "cores": cores, "start_s": time.perf_counter() - t0,
            "replica_pids": [i["pid"] for i in pool.replica_info]}
    return System(name, pool, pool.cleanup, info)


def build_replicas1(args: argparse.Namespace) -> System:
    return _pool(args, "replicas1", [[0]])


def build_replicas2(args: argparse.Namespace) -> System:
    return _pool(args, "replicas2", [[0], [1]])


def build_local(args: argparse.Namespace) -> System:
    """A reference without Ray: ``AsyncVirtualLM`` in this process (not pinned)."""
    from genlm_vlm import AsyncVirtualLM

    t0 = time.perf_counter()
    lm = AsyncVirtualLM.from_name(args.model_path, {**ENGINE_OPTS, **(args.engine_opts or {})})
    return System("local", lm, lm.cleanup, {"replicas": 0, "start_s": time.perf_counter() - t0})


#: name -> builder. Add tensor-parallel systems here (see the module docstring).
SYSTEMS: dict[str, Callable[[argparse.Namespace], System]] = {
    "replicas1": build_replicas1,
    "replicas2": build_replicas2,
    "local": build_local,
}
#: Systems run when ``--systems`` is not given.
DEFAULT_SYSTEMS = ["replicas1", "replicas2"]
#: (numerator, denominator) pairs printed as ratios when both systems ran.
RATIOS: list[tuple[str, str]] = [("replicas2", "replicas1"), ("replicas1", "local")]


# --------------------------------------------------------------------------- workload
async def _run(lm: Any, prompt: list[int], n: int, steps: int, seed: int, resample_every: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    particles = [list(prompt) for _ in range(n)]
    for step in range(steps):
        if resample_every and step and step % resample_every == 0:
            particles = [list(particles[a]) for a in torch.randint(n, (n,), generator=gen).tolist()]
        rows = torch.stack(await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles)))
        # inverse-CDF sampling: ~50x cheaper than torch.multinomial over 32k columns, so the
        # benchmark's own work stays small next to the system's
        cdf = rows.exp().cumsum(1)
        u = torch.rand((n, 1), generator=gen) * cdf[:, -1:]
        for p, tok in zip(particles, torch.searchsorted(cdf, u).clamp_(max=rows.shape[1] - 1).squeeze(1).tolist(), strict=True):
            p.append(int(tok))


def _prompts(args: argparse.Namespace, vocab: int, rep: int) -> list[list[int]]:
    from genlm_vlm.testing import random_prompts

    return random_prompts(args.runs, vocab, args.prompt_len, args.prompt_len, seed=10_007 * rep + args.seed)


def _cpu_seconds(pids: Sequence[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def measure(system: System, prompts: list[list[int]], args: argparse.Namespace,
            loop: asyncio.AbstractEventLoop, cpu: dict[str, list[float]] | None = None) -> float:
    """Seconds for all runs of one repetition; with ``cpu``, appends the CPU seconds this process
    (``driver``) and the replica processes (``replicas``) spent."""
    system.lm.clear_cache()
    per_run = args.n // args.runs

    async def all_runs() -> None:
        await asyncio.gather(*(
            _run(system.lm, p, per_run, args.steps, args.seed + i, args.resample_every)
            for i, p in enumerate(prompts)
        ))

    pids = system.info.get("replica_pids", [])
    c0, r0, t0 = time.process_time(), _cpu_seconds(pids), time.perf_counter()
    loop.run_until_complete(all_runs())
    dt = time.perf_counter() - t0
    if cpu is not None:
        cpu["driver"].append(time.process_time() - c0)
        cpu["replicas"].append(_cpu_seconds(pids) - r0)
    return dt


def _check(systems: Sequence[System], vocab: int) -> float:
    """Largest |row difference| between the systems on a few prompts (all serve one model)."""
    from genlm_vlm.testing import random_prompts

    probe = random_prompts(6, vocab, 4, 64, seed=99)
    rows = [s.lm.batch_next_token_logprobs_sync(probe) for s in systems]
    return max(float((r - rows[0]).abs().max()) for r in rows)


# --------------------------------------------------------------------------- driver
def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-32k",
                   help="a model directory, or a model kind of genlm_vlm.testing built locally "
                        "(default llama-32k: 2 layers, hidden 128, 32768 logits)")
    p.add_argument("--systems", nargs="+", choices=sorted(SYSTEMS), default=DEFAULT_SYSTEMS,
                   help=f"systems to time (default {' '.join(DEFAULT_SYSTEMS)})")
    p.add_argument("--n", type=int, default=64, help="total particles, over all runs (default 64)")
    p.add_argument("--runs", type=int, default=4, help="independent SMC runs / prompts (default 4)")
    p.add_argument("--steps", type=int, default=16, help="SMC steps per run (default 16)")
    p.add_argument("--prompt-len", type=int, default=200, help="tokens per prompt (default 200)")
    p.add_argument("--resample-every", type=int, default=0, help="resample before every K-th step (0: never)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-opts", type=json.loads, default=None, help="JSON dict merged over ENGINE_OPTS")
    p.add_argument("--quick", action="store_true", help="small smoke size (n 16, 2 runs, 4 steps, 1 rep)")
    p.add_argument("--out", default=str(_HERE / "results"), help="output directory")
    p.add_argument("--tag", default="bench_scale", help="file name stem of the JSON output")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.runs, args.steps, args.reps, args.prompt_len = 16, 2, 4, 1, 64
    if args.runs < 1 or args.n < args.runs or args.n % args.runs:
        p.error("--n must be a positive multiple of --runs")
    if min(args.steps, args.reps, args.prompt_len) < 1:
        p.error("--steps, --reps and --prompt-len must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from genlm_vlm.testing import _SPECS, tiny_model_path

    args.model_path = str(tiny_model_path(args.model)) if args.model in _SPECS else args.model
    # One intra-op thread here: idle OpenMP threads spinning in this process would take CPU from
    # the pinned replicas (and the ``local`` engine then runs on one thread, like a replica).
    torch.set_num_threads(1)
    wall0 = time.perf_counter()
    load0 = os.getloadavg()
    systems: list[System] = []
    loop = asyncio.new_event_loop()
    times: dict[str, list[float]] = {}
    cpu: dict[str, dict[str, list[float]]] = {}
    try:
        for name in args.systems:
            systems.append(SYSTEMS[name](args))
            log.info("built %s: %s", name, systems[-1].info)
        vocab = systems[0].lm.vocab_size
        check = _check(systems, vocab)
        times = {s.name: [] for s in systems}
        cpu = {s.name: {"driver": [], "replicas": []} for s in systems}
        for rep in range(args.reps + 1):  # rep 0: warm-up
            prompts = _prompts(args, vocab, rep)
            for s in systems:
                dt = measure(s, prompts, args, loop, cpu[s.name] if rep else None)
                if rep:
                    times[s.name].append(dt)
                log.info("%s rep %d: %.2fs%s", s.name, rep, dt, " (warm-up)" if rep == 0 else "")
        routing = {s.name: s.lm.stats["routing"] for s in systems if "routing" in s.lm.stats}
    finally:
        loop.close()
        for s in reversed(systems):
            s.close()

    work = args.n * args.steps
    rates = {name: work / statistics.median(ts) for name, ts in times.items()}
    ratios = {f"{a}/{b}": rates[a] / rates[b] for a, b in RATIOS if a in rates and b in rates}
    doc = {
        "config": {k: v for k, v in vars(args).items()},
        "environment": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                        "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
                        "torch": torch.__version__},
        "systems": {s.name: s.info for s in systems},
        "times_s": times, "cpu_s": cpu, "particle_steps_per_s": rates, "ratios": ratios,
        "max_abs_diff_between_systems": check, "routing": routing,
        "wall_s": time.perf_counter() - wall0,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.tag}.json"
    path.write_text(json.dumps(doc, indent=2, default=str))

    print()
    print(f"SMC: {args.runs} runs x {args.n // args.runs} particles, {args.steps} steps, prompt "
          f"{args.prompt_len} tokens, resample every {args.resample_every or '-'}; median of {args.reps}")
    print(f"{'system':<12} {'particle-steps/s':>17} {'times (s)':<20} {'CPU s/1000 steps: driver':>25} {'replicas':>9}")
    for name, ts in times.items():
        per = {k: 1000 * sum(v) / (work * len(ts)) for k, v in cpu[name].items()}
        print(f"{name:<12} {rates[name]:>17,.0f} {', '.join(f'{t:.2f}' for t in ts):<20} "
              f"{per['driver']:>25.2f} {per['replicas'] if per['replicas'] else float('nan'):>9.2f}")
    for key, r in ratios.items():
        print(f"ratio {key}: {r:.2f}x")
    for name, rt in routing.items():
        per = [{k: r[k] for k in ("routed", "session_hits", "prefix_hits", "by_load", "spilled")}
               for r in rt["replicas"]]
        print(f"routing {name}: {per}")
    print(f"max |row difference| between systems: {check:.1e}; load average {load0[0]:.2f} -> "
          f"{os.getloadavg()[0]:.2f}; wrote {path} ({doc['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
