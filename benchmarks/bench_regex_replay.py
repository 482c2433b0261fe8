"""The constraint's own work in `lm.smc` runs under `Regex` patterns, replayed alone (issue 48).

`record` runs `lm.smc` on the demo model (N particles, T tokens) under each pattern with seeds
0..R-1 and keeps, in order, every call the run made to its bound constraint (the states of each
mask gather, the states and tokens of each step's advances). `replay` makes them again with no
model, in a fresh process per checkout (`--against`: another checkout's root; the checkouts
alternate per pattern): the pattern bound to the demo vocabulary with an empty cache, then seed
0's calls (the first run: its states and rows made), then the later seeds' (the model's tables
kept, as in one process). Each is timed in the thread's CPU time, which the machine's other load
barely moves, and printed per step with the work counted (vocabulary walks, mask rows filled,
DFA states and rows made). `--freeze-gc` moves the process's objects out of the collector's
reach first (`gc.freeze()`): the time without the full collections that the process's other
objects make expensive.

    .venv/bin/python benchmarks/bench_regex_replay.py record --out /tmp/traces.pkl
    .venv/bin/python benchmarks/bench_regex_replay.py replay /tmp/traces.pkl --against /path/to/old/checkout
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import gc, pickle, sys, time
root, path, freeze, patterns = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4:]
sys.path.insert(0, root)
from transformers import AutoTokenizer
import genlm_vlm
from genlm_vlm.smc import Regex
from genlm_vlm.vocab import get_byte_vocab
with open(path, "rb") as f:
    traces = pickle.load(f)
tok = AutoTokenizer.from_pretrained(genlm_vlm.demo_model_path())
special = set(tok.all_special_ids)
vocab = [b"" if i in special else b for i, b in enumerate(get_byte_vocab(tok))]
eos = [tok.eos_token_id]
cache = {}
Regex(r"\w\s\d[a-z]").bind(vocab, eos, len(vocab), cache)  # class tables and the vocabulary walk, once
if freeze:
    gc.collect()
    gc.freeze()
for p in patterns:
    cache.pop("dfa-masks", None)
    seeds = sorted(s for q, s in traces if q == p)
    out = []
    for seed in seeds:
        calls = traces[(p, seed)]
        width = next(c[2] for c in calls if c[0] == "m")
        t0 = time.thread_time()
        bound = Regex(p).bind(vocab, eos, width, cache)
        t1 = time.thread_time()
        for kind, states, arg in calls:
            if kind == "m":
                bound.bitmasks_on(states, arg, None)
            else:
                bound.advance_many(states, arg)
        t2 = time.thread_time()
        steps = max(1, sum(c[0] == "m" for c in calls))
        out.append(f"{1e3 * (t2 - t1) / steps:6.2f}")
        if seed == seeds[0]:
            bind = t1 - t0
    m = bound.masks_table
    print(f"{p[:26]:26} bind {1e3 * bind:6.1f} ms | CPU ms/step by seed {' / '.join(out)} | walked {m.walked} "
          f"filled {m.filled} states {m.dfa.states_made} rows {m.dfa.rows_made}", flush=True)
"""


def record(out: str, patterns: list[str], n: int, t: int, seeds: int) -> None:
    import asyncio

    sys.path.insert(0, HERE)
    import genlm_vlm
    from genlm_vlm import AsyncVirtualLM
    from genlm_vlm.smc import Regex
    from genlm_vlm.smc import automaton as auto

    log: list[tuple[str, list[bytes], object]] = []
    masks, advances = auto.BoundAutomaton.bitmasks_on, auto.BoundAutomaton.advance_many

    def logged_masks(self, states, width, device):  # noqa: ANN001, ANN202 - a recording shim
        log.append(("m", list(states), width))
        return masks(self, states, width, device)

    def logged_advances(self, states, tokens):  # noqa: ANN001, ANN202
        log.append(("a", list(states), [int(x) for x in tokens]))
        return advances(self, states, tokens)

    auto.BoundAutomaton.bitmasks_on, auto.BoundAutomaton.advance_many = logged_masks, logged_advances
    lm = AsyncVirtualLM.from_name(genlm_vlm.demo_model_path())
    tok = lm.tokenizer
    prompt = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + tok.encode(
        "Write a line of text:\n", add_special_tokens=False)
    loop = asyncio.new_event_loop()
    traces = {}
    for p in patterns:
        for seed in range(seeds):
            log.clear()
            r = loop.run_until_complete(lm.smc(prompt, Regex(p), n, t, seed=seed))
            traces[(p, seed)] = list(log)
            print(f"{p[:26]:26} seed {seed}: {r.stats['steps']} steps, {len(log)} calls", flush=True)
    with open(out, "wb") as f:
        pickle.dump(traces, f)


def main() -> None:
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    from bench_regex_bind import PATTERNS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--out", required=True)
    rec.add_argument("--n", type=int, default=64)
    rec.add_argument("--t", type=int, default=48)
    rec.add_argument("--seeds", type=int, default=3)
    rec.add_argument("--pattern", action="append")
    rep = sub.add_parser("replay")
    rep.add_argument("traces")
    rep.add_argument("--against", default=None)
    rep.add_argument("--freeze-gc", action="store_true")
    rep.add_argument("--pattern", action="append")
    args = ap.parse_args()
    patterns = args.pattern or PATTERNS + [r"[a-z ]{1000}"]
    if args.cmd == "record":
        record(args.out, patterns, args.n, args.t, args.seeds)
        return
    roots = {"this": HERE} | ({"against": os.path.abspath(args.against)} if args.against else {})
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[:3]}")
    for p in patterns:
        for name, root in roots.items():
            got = subprocess.run([sys.executable, "-c", CHILD, root, args.traces, "1" if args.freeze_gc else "0", p],
                                 capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=root))
            lines = [x for x in got.stdout.splitlines() if x.strip()]
            print(f"{name:8} {lines[-1] if lines else got.stderr.strip().splitlines()[-1:]}", flush=True)
    with open("/proc/loadavg") as f:
        print(f"load average at end: {f.read().split()[:3]}")


if __name__ == "__main__":
    main()
