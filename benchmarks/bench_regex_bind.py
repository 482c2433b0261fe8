"""Bind time and memory of `Regex` patterns (issue 48), against another checkout of the package.

Each (checkout, pattern) runs in a fresh process: import the package from the checkout, read the
vocabulary, warm the Unicode class tables (`\\w`, `\\s`, `\\d`: read off `re` once per process),
then time `Regex(pattern)` and `.bind(...)` (the first mask included) and read the peak RSS added
(the peak RSS, reset just before, minus the RSS before), and the process's CPU time for both
(`cpu`: on a shared machine the wall times include waiting for a core; the CPU time much less). The checkouts alternate per pattern. A process past
`--timeout` seconds or `--mem-mb` of address space is reported as such.

    .venv/bin/python benchmarks/bench_regex_bind.py --vocab demo --vocab 32k --against /path/to/old/checkout

`--steps` measures the time per step instead: `lm.smc` on the demo model (one process, one engine)
under each pattern and under `[a-z ]+`, N particles, T tokens, the patterns alternating within
each repetition, repetition r seeded r. It prints each pattern's time per step against `[a-z ]+`'s
in the same repetition (the first repetition, which binds the pattern and makes its states and
mask rows, apart from the later ones, which mostly reuse them) and `stats["constraint_s"]` per step.

A run's time is a fixed part (the prompt, the first step's forks, the result) and a part per step;
a run whose particles all finish early (`\\w{30}`: about 20 steps) spreads the fixed part over
fewer steps. So each T-token run is followed by the same run with T = 1 (same pattern and seed,
after it: the states it makes are made), and the table also gives, against `[a-z ]+`:

* `step`: the time a step past the first adds, `(wall(T) - wall(1)) / (steps - 1)` (runs of one or
  two steps: none);
* `fixed`: `wall(1)`: the prompt, its one row sampled for every particle, the result (a run's first
  step samples every particle from the prompt's row, so it costs what the T = 1 run does);
* `p-step`: the wall time per particle-step, `wall(T) / stats["rows"]` (the rows the model gave).

    .venv/bin/python benchmarks/bench_regex_bind.py --steps --reps 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PATTERNS = [r"\w{30}", r"(?:\w{1,20}\s){1,40}", r".{1000}", r"[a-z]{20000}", r"(?:a|b?){2000}",
            r"(?:[a-z]{0,100}){0,100}", r"(a|b)*a(a|b){15}", r"[a-z ]+"]

CHILD = r"""
import json, resource, sys, time
root, pattern, vocab_kind, mem_mb = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if mem_mb:
    resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
sys.path.insert(0, root)
from transformers import AutoTokenizer
import genlm_vlm
from genlm_vlm.smc import Regex
from genlm_vlm.vocab import get_byte_vocab
if vocab_kind == "demo":
    path = genlm_vlm.demo_model_path()
else:
    from genlm_vlm.testing import tiny_model_path
    path = str(tiny_model_path("llama-32k"))
tok = AutoTokenizer.from_pretrained(path)
special = set(tok.all_special_ids)
vocab = [b"" if i in special else b for i, b in enumerate(get_byte_vocab(tok))]
eos = [tok.eos_token_id]
cache = {}  # the model's bind cache: the vocabulary's walk is laid out once per model
Regex(r"\w\s\d[a-z]").bind(vocab, eos, len(vocab), cache)  # class tables and the vocabulary walk, once
def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS (VmHWM) starts again from the RSS now
before = rss("VmRSS:")
t0, c0 = time.perf_counter(), time.process_time()
r = Regex(pattern)
t1, c1 = time.perf_counter(), time.process_time()
bound = r.bind(vocab, eos, len(vocab), cache)
t2, c2 = time.perf_counter(), time.process_time()
peak = rss("VmHWM:")
print(json.dumps({"compile_s": t1 - t0, "bind_s": t2 - t1, "cpu_s": c2 - c0, "added_mb": max(0, peak - before) / 2**20,
                  "engine": type(bound).__name__, "vocab": len(vocab)}))
"""


def run(root: str, pattern: str, vocab: str, timeout: float, mem_mb: int) -> dict:
    env = dict(os.environ, PYTHONPATH=root)
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, root, pattern, vocab, str(mem_mb)], env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer in {timeout:.0f} s"}
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": last[:90]}
    return json.loads(out.stdout.strip().splitlines()[-1])


BASE = r"[a-z ]+"


def steps(patterns: list[str], n: int, t: int, reps: int) -> None:
    """The ``--steps`` mode (see the module docstring)."""
    import asyncio
    import statistics
    import time

    import genlm_vlm
    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.smc import Regex

    lm = AsyncVirtualLM.from_name(genlm_vlm.demo_model_path())
    tok = lm.tokenizer
    prompt = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + tok.encode(
        "Write a line of text:\n", add_special_tokens=False)
    loop = asyncio.new_event_loop()
    names = [BASE] + [p for p in patterns if p != BASE]
    # per run: wall s/step, CPU s/step, constraint s/step, steps, step s (or None), fixed s, wall s/particle-step
    got: dict[str, list[tuple[float, float, float, int, float | None, float | None, float]]] = {p: [] for p in names}

    def once(p: str, tokens: int, seed: int) -> tuple[float, float, object]:
        lm.clear_cache()
        t0, c0 = time.perf_counter(), time.process_time()
        r = loop.run_until_complete(lm.smc(prompt, Regex(p), n, tokens, seed=seed))
        return time.perf_counter() - t0, time.process_time() - c0, r

    for rep in range(reps):
        for p in names:
            wall, cpu, r = once(p, t, rep)
            wall1, _cpu1, _r1 = once(p, 1, rep)
            k = max(1, r.stats["steps"])
            step = (wall - wall1) / (k - 1) if k > 2 else None
            fixed = wall1
            tokens = max(1, r.stats["rows"])
            got[p].append((wall / k, cpu / k, r.stats["constraint_s"] / k, r.stats["steps"], step, fixed, wall / tokens))
            extra = f"step {1e3 * step:7.2f} ms, fixed {1e3 * fixed:7.1f} ms" if step is not None else "step n/a"
            print(f"  rep {rep} {p[:26]:26} {1e3 * wall / k:8.2f} ms/step, CPU {1e3 * cpu / k:8.2f} ms/step, "
                  f"constraint {1e3 * got[p][-1][2]:7.2f} ms/step, {r.stats['steps']} steps; {extra}, "
                  f"{1e6 * wall / tokens:7.1f} us/particle-step", flush=True)
        with open("/proc/loadavg") as f:
            print(f"repetition {rep} done, load average {f.read().split()[:3]}", flush=True)
    print(f"\nlm.smc, demo model, N = {n}, T = {t}; per step: wall ms and the process's CPU ms (every thread), "
          f"each as a ratio to {BASE!r} in the same repetition, and constraint_s in ms; then the time a step adds "
          "(ms), the run's fixed part (ms) and the wall per particle-step (us), each with its ratio")
    print(f"{'pattern':26} | {'':6} {'wall':>8} {'ratio':>5} {'cpu':>8} {'ratio':>5} {'constr':>7} | "
          f"{'step':>7} {'ratio':>5} {'fixed':>7} {'ratio':>5} {'p-step':>7} {'ratio':>5} | steps")

    def med_ratio(runs: list, base: list, i: int) -> tuple[float, float] | None:
        pairs = [(x[i], b[i]) for x, b in zip(runs, base, strict=True) if x[i] is not None and b[i] is not None]
        if not pairs:
            return None
        return statistics.median(x for x, _ in pairs), statistics.median(x / b for x, b in pairs)

    def cells(runs: list, base: list) -> str:
        if not runs:
            return ""
        out = []
        for i, scale, width in ((0, 1e3, 8), (1, 1e3, 8), (2, 1e3, 7), (4, 1e3, 7), (5, 1e3, 7), (6, 1e6, 7)):
            m = med_ratio(runs, base, i)
            if i == 2:
                out.append(f"{scale * m[0]:{width}.2f}" if m else f"{'n/a':>{width}}")
                out.append("|")
                continue
            out.append(f"{scale * m[0]:{width}.2f} {m[1]:5.2f}" if m else f"{'n/a':>{width}} {'':5}")
        return " ".join(out)

    for p in names:
        print(f"{p[:26]:26} | first: {cells(got[p][:1], got[BASE][:1])} | {'/'.join(str(x[3]) for x in got[p])}")
        print(f"{'':26} | later: {cells(got[p][1:], got[BASE][1:])} |", flush=True)


def main() -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", action="append", choices=["demo", "32k"], help="vocabularies (default: demo)")
    ap.add_argument("--against", default=None, help="another checkout's root (e.g. the eager build)")
    ap.add_argument("--pattern", action="append", help="patterns (default: issue 48's)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--mem-mb", type=int, default=6144, help="address-space cap per process (0: none)")
    ap.add_argument("--steps", action="store_true", help="time per step of lm.smc instead (see the docstring)")
    ap.add_argument("--n", type=int, default=64, help="--steps: particles")
    ap.add_argument("--t", type=int, default=48, help="--steps: max_tokens")
    ap.add_argument("--reps", type=int, default=4, help="--steps: repetitions (the first binds)")
    args = ap.parse_args()
    if args.steps:
        sys.path.insert(0, here)  # this checkout's package
        with open("/proc/loadavg") as f:
            print(f"load average at start: {f.read().split()[:3]}")
        steps(args.pattern or PATTERNS, args.n, args.t, args.reps)
        return
    roots = {"this": here} | ({"against": os.path.abspath(args.against)} if args.against else {})
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[:3]}")
    print(f"{'vocab':6} {'pattern':26} {'build':8} {'compile':>9} {'bind':>9} {'cpu':>9} {'added':>8}  engine")
    for vocab in args.vocab or ["demo"]:
        for pattern in args.pattern or PATTERNS:
            for name, root in roots.items():
                got = run(root, pattern, vocab, args.timeout, args.mem_mb)
                if "error" in got:
                    print(f"{vocab:6} {pattern[:26]:26} {name:8} {got['error']}", flush=True)
                    continue
                print(f"{vocab:6} {pattern[:26]:26} {name:8} {1e3 * got['compile_s']:7.1f}ms {1e3 * got['bind_s']:7.1f}ms "
                      f"{1e3 * got.get('cpu_s', float('nan')):7.1f}ms "
                      f"{got['added_mb']:6.1f}MB  {got['engine']}", flush=True)
    with open("/proc/loadavg") as f:
        print(f"load average at end: {f.read().split()[:3]}")


if __name__ == "__main__":
    main()
