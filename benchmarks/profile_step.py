"""Profile one system of the ``bench`` command's ``smc`` cell with py-spy, and classify its stacks.

Run (one system per process; the profile starts after one warm-up run and covers ``--reps`` runs):

    python benchmarks/profile_step.py record --system requests --n 128 --t 48 --out prof-requests.txt
    python benchmarks/profile_step.py record --system decode --n 128 --t 48 --out prof-decode.txt
    python benchmarks/profile_step.py table prof-requests.txt prof-decode.txt

With particles that finish and resample (``--constraint regex``), ``record`` writes the live
counts of its warm-up run to ``OUT.steps.json``; ``--system decode --same-steps OUT.steps.json``
then decodes sequences that end where those counts drop (the same steps, of the same widths).
``--timers`` prints, per run, the SMC and engine steps, the requests path's new requests, forks,
re-adds and aborts, and the model runner's parts (calls, wall, thread CPU).

``requests`` is ``lm.smc(..., engine_path="requests")`` on the steady constraint (``bursts``: the
default path), ``decode`` the bench's vLLM-decode baseline of the same tokens; both are the bench's
own systems (:mod:`genlm_vlm.bench.systems`) with the bench's engine options. ``table`` prints the
share of each thread's busy samples (py-spy leaves idle samples out) per part of a step; the
engine loop's thread is the one with the most samples. py-spy (``--pyspy`` or ``$PYSPY``) must be
able to attach to this process.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time

# (label, frame substrings, any of which marks a sample); the first matching label, in this
# order, takes the sample: inner parts before the parts that call them.
PARTS = [
    ("controller step (smc/)", ("genlm_vlm/smc/",)),
    ("forcer: rows, -inf rewrite (forcing.py, logprob_rows)", ("genlm_vlm/engine/forcing.py", "logprob_rows")),
    ("capture processor (capture.py)", ("genlm_vlm/capture.py",)),
    ("model forward", ("_model_forward",)),
    ("sampler (rest)", ("vllm/v1/sample/",)),
    ("runner _update_states", ("_update_states",)),
    ("runner input prep", ("_prepare_inputs", "_prepare_input", "_get_cumsum_and_arange", "prepare_inputs")),
    ("runner (rest)", ("vllm/v1/worker/",)),
    ("vLLM scheduler update_from_output", ("update_from_output",)),
    ("vLLM scheduler schedule", ("schedule (",)),
    ("vLLM output processing", ("output_processor", "process_outputs")),
    ("vLLM request adds", ("preprocess_add_request", "add_request", "process_inputs")),
    ("genlm_vlm particles (particles.py)", ("genlm_vlm/engine/particles.py",)),
    ("genlm_vlm step loop (engine/)", ("genlm_vlm/engine/",)),
    ("vLLM engine core (rest)", ("vllm/v1/engine/", "vllm/v1/core/", "vllm/entrypoints/")),
]


def classify(stack: str) -> str:
    for label, keys in PARTS:
        if any(k in stack for k in keys):
            return label
    return "rest"


def read_raw(path: str) -> dict[str, collections.Counter[str]]:
    """``thread -> part -> samples`` from a py-spy ``-f raw --threads`` file."""
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            thread = stack.split(";", 1)[0]
            out[thread][classify(stack)] += int(count)
    return out


def table(paths: list[str]) -> str:
    cols = []
    for p in paths:
        threads = read_raw(p)
        main = max(threads.values(), key=lambda c: sum(c.values()))
        cols.append((os.path.basename(p), main))
    labels = [label for label, _ in PARTS] + ["rest"]
    lines = ["| | " + " | ".join(name for name, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for label in labels:
        cells = []
        for _, c in cols:
            total = sum(c.values())
            cells.append(f"{100 * c[label] / total:.1f} %" if c[label] else "-")
        if any(x != "-" for x in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| busy samples | " + " | ".join(str(sum(c.values())) for _, c in cols) + " |")
    return "\n".join(lines)


def _wrap_runner(llm):
    """Count calls, wall and thread CPU seconds of the model runner's parts (a profiling aid:
    instance attributes on this process's runner, nothing of vLLM's classes is changed)."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    timers: dict = {}

    def wrap(name: str) -> None:
        fn = getattr(runner, name)
        timers[name] = [0, 0.0, 0.0]

        def timed(*a, **k):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                t = timers[name]
                t[0] += 1
                t[1] += time.perf_counter() - w
                t[2] += time.thread_time() - c

        setattr(runner, name, timed)

    for name in ("execute_model", "_model_forward", "sample_tokens", "_update_states", "_prepare_inputs"):
        if hasattr(runner, name):
            wrap(name)
    return timers


#: ``--inner``: the sampler-side pieces of the requests path timed one by one: (module, owner (a
#: class name, or None for a module function), attribute). Each is replaced, in this process only,
#: by a wrapper that adds its calls, wall and thread CPU time (inclusive: a piece's time holds the
#: pieces it calls).
INNER = [
    ("genlm_vlm.capture", "_CaptureV1", "apply"),
    ("genlm_vlm.engine.forcing", "ParticleHost", "force"),
    ("genlm_vlm.engine.forcing", None, "logprob_rows"),
    ("genlm_vlm.engine.forcing", None, "logprob_matrix"),
    ("genlm_vlm.engine.forcing", None, "force_rows"),
    ("genlm_vlm.engine.particles", "RequestRun", "take"),
    ("genlm_vlm.engine.particles", "RequestRun", "decide"),
    ("genlm_vlm.smc.controller", None, "fold_rows"),
    ("genlm_vlm.smc.controller", None, "check_decision"),
    ("genlm_vlm.smc.controller", "ParticleSet", "apply"),
    ("genlm_vlm.smc.controller", "ParticleSet", "apply_checked"),
    ("genlm_vlm.smc.controller", "ParticleSet", "live"),
    ("genlm_vlm.engine.particles", "RequestRun", "_continue_singletons"),
    ("genlm_vlm.engine.particles", "RequestRun", "_regroup"),
    ("genlm_vlm.smc.algorithm", "SMCController", "step"),
    ("genlm_vlm.smc.prefetch", "StepMasks", "_bitmasks"),
    ("genlm_vlm.smc.step", None, "propose"),
    ("genlm_vlm.smc.step", None, "to_host"),
    ("genlm_vlm.smc.algorithm", "SMCController", "_take"),
    ("genlm_vlm.smc.automaton", "BoundAutomaton", "advance_many"),
    ("genlm_vlm.smc.algorithm", "SMCController", "_maybe_resample"),
    ("vllm.v1.sample.sampler", "Sampler", "forward"),  # vLLM's sampler: ours runs inside
    ("vllm.v1.sample.sampler", "Sampler", "apply_logits_processors"),
    ("vllm.v1.sample.sampler", "Sampler", "sample"),  # the draw itself (decode's; a greedy argmax for ours)
]


def _wrap_inner(pieces: list[tuple[str, str | None, str]] = INNER) -> dict:
    """Wrap ``pieces`` (:data:`INNER`'s form; a profiling aid for this process: see
    :data:`INNER`); returns ``{"Owner.attr": [calls, wall s, thread CPU s]}``, added to in place."""
    import importlib

    timers: dict = {}
    for mod_name, owner_name, attr in pieces:
        mod = importlib.import_module(mod_name)
        owner = mod if owner_name is None else getattr(mod, owner_name, None)
        fn = getattr(owner, attr, None) if owner is not None else None
        if fn is None:
            continue
        key = f"{owner_name}.{attr}" if owner_name else attr
        timers[key] = [0, 0.0, 0.0]

        def timed(*a, _fn=fn, _t=timers[key], **k):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                _t[0] += 1
                _t[1] += time.perf_counter() - w
                _t[2] += time.thread_time() - c

        setattr(owner, attr, timed)
    return timers


def record(args: argparse.Namespace) -> None:
    from genlm_vlm import demo_model_path
    from genlm_vlm.bench import harness
    from genlm_vlm.bench.cli import engine_options

    harness.setup_environment()
    model = args.model or demo_model_path()
    spec = {"model": model, "engine_opts": engine_options(model, {})}
    if args.system == "decode":
        from genlm_vlm.bench.systems import vllm_system
        from genlm_vlm.bench.workloads import same_step_lengths

        system = vllm_system(spec)
        lengths = None
        if args.same_steps:  # the live counts a requests/bursts record wrote: the same steps, same widths
            with open(args.same_steps) as f:
                lengths = same_step_lengths(json.load(f)["rows_per_step"], args.n)

        def job(rep: int) -> dict:
            return system.run("decode", n=args.n, rep=rep, tokens=args.t, lengths=lengths)
    else:
        from genlm_vlm.bench.systems import genlm_system

        if args.forcer_threads is not None:  # the forcer's torch threads (FORCER_THREADS), this process only
            from genlm_vlm.engine import forcing

            forcing.FORCER_THREADS = args.forcer_threads
        system = genlm_system(spec)

        def job(rep: int) -> dict:
            return system.run("smc", n=args.n, t=args.t, constraint=args.constraint, rep=rep,
                              engine_path=args.system)
    warm = job(0)
    print("warm-up", warm, file=sys.stderr)
    if warm.get("rows_per_step"):  # for a decode record of the same steps (--same-steps)
        with open(args.out + ".steps.json", "w") as f:
            json.dump({"rows_per_step": warm["rows_per_step"]}, f)
    if args.timers:
        llm = system.llm if args.system == "decode" else system.lm.llm
        timers = _wrap_runner(llm)
        if args.inner:
            timers.update(_wrap_inner())
        import threading

        loop_thread = next((t for t in threading.enumerate() if t.name == "genlm-vlm-engine"),
                           threading.main_thread())
        clock = time.pthread_getcpuclockid(loop_thread.ident)
        engine = None if args.system == "decode" else system.lm
        for rep in range(1, args.reps + 1):
            p0, l0 = time.process_time(), time.clock_gettime(clock)
            e0 = engine.stats["engine_steps"] if engine is not None else 0
            r = job(rep)
            p1, l1 = time.process_time(), time.clock_gettime(clock)
            if args.inner:  # microseconds of thread CPU per engine step, per piece
                steps = max(1, timers["sample_tokens"][0]) if "sample_tokens" in timers else 1
                print(f"rep {rep} per step (calls, us thread CPU):",
                      {k: (n, round(1e6 * c / steps)) for k, (n, w, c) in timers.items()}, file=sys.stderr)
            if engine is not None:  # the run's counts: SMC steps, engine steps, new requests, aborts
                print(f"rep {rep}: rows {r['particle_steps']}, SMC steps {r['steps']}, engine steps "
                      f"{engine.stats['engine_steps'] - e0}, resamples {r['resamples']}, requests path "
                      f"{r.get('particle_requests')}", file=sys.stderr)
            print(f"rep {rep}: wall {r['wall_s']:.3f} s, process CPU {p1 - p0:.3f} s, loop thread CPU "
                  f"{l1 - l0:.3f} s, load {open('/proc/loadavg').read().split()[0]}; runner (calls, wall, "
                  "thread CPU):", {k: (n, round(w, 3), round(c, 3)) for k, (n, w, c) in timers.items()},
                  file=sys.stderr)
            for t in timers.values():
                t[:] = [0, 0.0, 0.0]  # in place: the wrappers hold these lists
        system.close()
        return
    spy = subprocess.Popen([args.pyspy, "record", "--pid", str(os.getpid()), "-r", "250", "-f", "raw",
                            "--threads", *(["--idle"] if args.idle else []), "-o", args.out], stdout=subprocess.DEVNULL)
    time.sleep(2.0)  # py-spy attaching (a profile tool, not a test)
    walls = []
    for rep in range(1, args.reps + 1):
        r = job(rep)
        walls.append(round(r["wall_s"], 3))
    spy.send_signal(signal.SIGINT)
    spy.wait()
    print(f"{args.system}: walls {walls}, load {open('/proc/loadavg').read().split()[:3]}", file=sys.stderr)
    system.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--system", choices=["requests", "bursts", "decode"], required=True)
    r.add_argument("--n", type=int, default=128)
    r.add_argument("--t", type=int, default=48)
    r.add_argument("--reps", type=int, default=5)
    r.add_argument("--constraint", default="steady")
    r.add_argument("--model")
    r.add_argument("--timers", action="store_true", help="time the runner's parts instead of profiling")
    r.add_argument("--inner", action="store_true", help="with --timers: time the requests path's "
                   "sampler-side pieces too (INNER), in microseconds of thread CPU per step")
    r.add_argument("--same-steps", help="decode: sequences ending where the live counts in this file "
                   "(OUT.steps.json of a requests or bursts record) drop")
    r.add_argument("--forcer-threads", type=int, help="requests: the forcer's torch threads "
                   "(genlm_vlm.engine.forcing.FORCER_THREADS; default: the sampler's own)")
    r.add_argument("--idle", action="store_true", help="keep idle samples (py-spy --idle)")
    r.add_argument("--out", required=True)
    r.add_argument("--pyspy", default=os.environ.get("PYSPY", "py-spy"))
    t = sub.add_parser("table")
    t.add_argument("paths", nargs="+")
    args = p.parse_args()
    if args.cmd == "record":
        record(args)
    else:
        print(table(args.paths))


if __name__ == "__main__":
    main()
