#!/usr/bin/env python
"""Bursts against particles as running requests forced by a logits processor, on short steps.

The question: should engine SMC keep today's bursts (``lm.smc``: every particle resumed as a
streaming-input session at every step) or run particles as ordinary vLLM requests whose SMC draw
happens inside a logits processor (vLLM's own decode loop untouched)? Three systems, each in its
own process with the same engine options (genlm_vlm's CPU defaults plus ``ENGINE_OPTS``: block
size 32, float32, eager, prefix caching, batch-invariant attention), repetitions alternating,
the order rotating per repetition, after one warm-up each:

* ``burst``: ``await lm.smc(prompt, Regex(p), N, T, seed=s, ess_threshold=e)`` on
  ``AsyncVirtualLM.from_name(path, ENGINE_OPTS)``.
* ``decode``: a plain ``vllm.LLM`` sampling N distinct sequences (distinct last prompt token) of
  as many tokens as the burst computed rows per particle (``ignore_eos``, temperature 1).
* ``forced``: the same plain ``vllm.LLM`` built with ``logits_processors=[ForcedSMC]`` (the
  official hook; V1 runner) generating N requests of ``max_tokens=T`` (temperature 1, each
  tagged with its particle through ``SamplingParams.extra_args``). Per engine step the processor
  maps rows to particles (``update_state``'s ``BatchUpdate``), takes ``log_softmax`` of each
  live particle's row, calls genlm_vlm's own ``SMCController.step(rows, particles)`` (the bound
  ``Regex`` token automaton, the same seed: weights, states, the ESS and resampling live in the
  controller) and returns rows that are ``-inf`` everywhere but the drawn token (EOS where a
  particle ended). This is the second design with everything it needs per step except forks.

Forks: a ``generate`` cannot change a request's history. Where the controller resamples, the
stand-in counts the step and the particles whose history changed, and lets each request go on
with its own tokens (the controller's copies are then drawn from their parents' masks over the
wrong rows: the cost is right, the texts are not). Their cost is an ESTIMATE, measured apart,
outside the run's wall: each such step is replayed as a prefix-cached re-add of exactly the
forked particles' contexts (``generate(max_tokens=1)`` after the same contexts were run once,
so their full blocks are cached and their last partial block is recomputed) on the same engine
(``fork_est_s``; ``forced+forks`` adds it to the wall). A standalone call also pays one step's
fixed cost that forks joining the running batch would share: an upper estimate.

Checks of the work: particle-steps per system, distinct final texts, forced tokens equal to the
controller's (``forced_ok``), and ``forced`` against ``burst`` for the same seed (``identical``:
every particle's tokens and log weight bitwise equal; else the particles whose texts match and
the largest log-weight difference). Cells: ``steady`` (``[a-z ]{1000}``, ``ess_threshold=0``:
N live, distinct particles every step, no resampling) and ``resample`` (``[a-z ]+``,
``ess_threshold=0.5``: particles finish and resample). In ``resample`` the work differs in
shape: decode runs N sequences of (the burst's warm-up rows / N) tokens, the SMC systems a
batch that shrinks as particles finish, over T steps; and ``forced`` leaves out the steps of
particles that resampling made copies of live parents after their own request had ended
(``missing``). Compare ``forced`` with ``burst`` there.

Throughput is particle-steps per second; ``forced/decode`` and ``burst/decode`` are ratios of
medians within one run. On a shared machine a repetition can take several times longer when one
of an engine's threads waits for a core; such a repetition shows as a process CPU time near one
core's although the engine runs more threads. Also reported: the ratios over *clean* repetitions
only (CPU time at least 0.75 x threads x wall, with their counts), of the best repetitions, and
per CPU-second. The load average at the start and per repetition is recorded.

    .venv/bin/python benchmarks/ab_decode_smc.py --n 32 128 --t 48 --reps 3
    .venv/bin/python benchmarks/ab_decode_smc.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(_HERE.parent))

from benchmarks import harness  # noqa: E402

harness.setup_environment()  # before vLLM is imported

#: Options of all three engines (genlm_vlm's defaults go under them in the plain ones too).
ENGINE_OPTS: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "block_size": 32,
                               "kv_cache_memory_bytes": 256 << 20, "seed": 0}
PROMPT = '"""Return the words of a sentence in lower case.\n\n    Example: the quick brown fox jumps over the lazy dog and'
CELLS: dict[str, tuple[str, float]] = {"steady": (r"[a-z ]{1000}", 0.0), "resample": (r"[a-z ]+", 0.5)}
SYSTEMS = ("burst", "decode", "forced")
TAG = "ab_smc_particle"
RESULT = "@@AB_RESULT "


# ---------------------------------------------------------------------------------- engines
def plain_llm(path: str, processors: list[Any] | None = None) -> Any:
    """``vllm.LLM`` with the options and process settings ``AsyncVirtualLM.from_name`` uses."""
    from genlm_vlm.engine import build, options

    opts = dict(options.DEFAULT_ENGINE_OPTS)
    if build.is_cpu_platform():
        opts.update(options.CPU_ENGINE_OPTS)
        options.batch_invariant_attention()  # VLLM_CPU_ATTN_SPLIT_KV=0, as from_name sets it
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(build.ONEDNN_PRIMITIVE_CACHE_CAPACITY))
        options.tune_cpu_allocator()
    from vllm import LLM

    opts.update(ENGINE_OPTS)
    if processors:
        opts["logits_processors"] = processors
    return LLM(model=path, **opts)


def prompt_ids(tokenizer: Any) -> list[int]:
    ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return ids + tokenizer.encode(PROMPT, add_special_tokens=False)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def engine_facts(llm: Any) -> dict[str, Any]:
    cfg = llm.llm_engine.vllm_config
    return {"block_size": cfg.cache_config.block_size, "prefix_caching": cfg.cache_config.enable_prefix_caching,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "async_scheduling": cfg.scheduler_config.async_scheduling, "torch_threads": _threads(),
            "dtype": str(cfg.model_config.dtype), "enforce_eager": cfg.model_config.enforce_eager,
            "split_kv": os.environ.get("VLLM_CPU_ATTN_SPLIT_KV")}


# ---------------------------------------------------------------------------------- forced
class ForcedRun:
    """One ``forced`` generate: the controller and what the processor counted."""

    def __init__(self, controller: Any, prompt: list[int], eos: int) -> None:
        self.controller = controller
        self.prompt = prompt
        self.eos = eos
        self.apply_s = 0.0  # the processor's whole apply (controller included)
        self.rows_s = 0.0  # mapping rows to particles and their log_softmax
        self.step_s = 0.0  # SMCController.step, as the processor timed it
        self.steps = 0
        self.rows = 0  # live particles stepped (particle-steps)
        self.missing = 0  # live particles without a row in a step (their request ended)
        self.resample_steps = 0
        self.forked = 0  # particles whose history changed at a resampling step and stay live
        self.events: list[list[list[int]]] = []  # per resampling step: the forked particles' contexts


#: The run the processor serves (set around each ``generate``; one engine per process).
CURRENT: list[ForcedRun | None] = [None]
_PROCESSOR: list[Any] = []


def forced_processor() -> type:
    """The V1 logits processor class (built on first use: vLLM is imported here)."""
    if _PROCESSOR:
        return _PROCESSOR[0]
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class ForcedSMC(LogitsProcessor):
        """Draws every tagged row's token with the run's SMC controller and forces it."""

        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            self.row_particle: dict[int, int] = {}

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            return None

        def is_argmax_invariant(self) -> bool:
            return False  # raw logits, before temperature

        def update_state(self, batch_update: Any) -> None:
            if batch_update is None:
                return
            rp = self.row_particle
            for index in batch_update.removed:
                rp.pop(index, None)
            for index, params, _prompt, _out in batch_update.added:
                tag = (params.extra_args or {}).get(TAG)
                if tag is None:
                    rp.pop(index, None)
                else:
                    rp[index] = int(tag)
            for src, dst, direction in batch_update.moved:
                a, b = rp.pop(src, None), rp.pop(dst, None)
                if a is not None:
                    rp[dst] = a
                if direction.name == "SWAP" and b is not None:
                    rp[src] = b

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            run = CURRENT[0]
            if run is None or not self.row_particle:
                return logits
            t0 = time.perf_counter()
            ctl, eos = run.controller, run.eos
            pairs = sorted((p, r) for r, p in self.row_particle.items() if r < logits.shape[0])
            live = [(p, r) for p, r in pairs if ctl.status[p] == "live"]
            rows_out, toks = [], []
            if live:
                particles = [p for p, _ in live]
                run.missing += sum(s == "live" for s in ctl.status) - len(live)
                index = torch.tensor([r for _, r in live])
                with torch.inference_mode(False):  # an ordinary tensor, as the burst's capture makes rows
                    rows = torch.log_softmax(logits.index_select(0, index).to(torch.float32), dim=-1)
                before = list(ctl.tokens)  # the lists _take appends to (resampling makes new ones)
                lens = [len(s) for s in before]
                t1 = time.perf_counter()
                decision = ctl.step(rows, particles)
                t2 = time.perf_counter()
                run.rows_s += t1 - t0
                run.step_s += t2 - t1
                for p, r in live:
                    seq = before[p]
                    rows_out.append(r)
                    toks.append(seq[-1] if len(seq) > lens[p] else eos)  # finished or dead: EOS ends it
                run.steps += 1
                run.rows += len(live)
                if decision.parents is not None:
                    par = decision.parents
                    moved = [i for i, p in enumerate(par) if before[p] != before[i] and ctl.status[i] == "live"]
                    run.resample_steps += 1
                    run.forked += len(moved)
                    run.events.append([run.prompt + list(ctl.tokens[i]) for i in moved])
            done = set(rows_out)
            for p, r in pairs:  # requests whose particle has ended (a resampled copy): end them
                if ctl.status[p] != "live" and r not in done:
                    rows_out.append(r)
                    toks.append(eos)
            if rows_out:
                logits.fill_(float("-inf"))
                logits[torch.tensor(rows_out), torch.tensor(toks)] = 0.0
            run.apply_s += time.perf_counter() - t0
            return logits

    _PROCESSOR.append(ForcedSMC)
    return ForcedSMC


# ---------------------------------------------------------------------------------- systems
class Burst:
    def __init__(self, path: str) -> None:
        from genlm_vlm import AsyncVirtualLM

        self.loop = asyncio.new_event_loop()
        self.lm = AsyncVirtualLM.from_name(path, dict(ENGINE_OPTS))
        self.prompt = prompt_ids(self.lm.tokenizer)

    def facts(self) -> dict[str, Any]:
        st = self.lm.stats
        return {"prompt_tokens": len(self.prompt), "batch_invariant": st.get("batch_invariant"),
                "split_kv": os.environ.get("VLLM_CPU_ATTN_SPLIT_KV"), "torch_threads": _threads()}

    def run(self, cell: str, n: int, t: int, seed: int, **_: Any) -> dict[str, Any]:
        from genlm_vlm.smc import Regex

        pattern, ess = CELLS[cell]
        lm = self.lm
        lm.clear_cache()
        before = lm.stats
        t0, c0 = time.perf_counter(), time.process_time()
        r = self.loop.run_until_complete(lm.smc(self.prompt, Regex(pattern), n, t, seed=seed, ess_threshold=ess))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        after = lm.stats
        steps = r.stats["steps"]
        return {"wall_s": wall, "cpu_s": cpu, "particle_steps": r.stats["rows"], "steps": steps, "resamples": r.stats["resamples"],
                "finished": r.stats["finished"], "distinct_texts": len({p.text for p in r.particles}),
                "forks_copied": after["forks"]["copied"] - before["forks"]["copied"],
                "controller_ms_per_step": 1e3 * r.stats["controller_s"] / max(1, steps),
                "mask_ms_per_step": r.stats["mask_ms_per_step"], "step_ms_per_step": r.stats["step_ms_per_step"],
                "controller_share": r.stats["controller_s"] / wall,
                "fingerprint": [[p.token_ids, p.log_weight] for p in r.particles]}

    def close(self) -> None:
        self.lm.cleanup()


class Decode:
    def __init__(self, path: str) -> None:
        self.llm = plain_llm(path)
        self.prompt = prompt_ids(self.llm.get_tokenizer())

    def facts(self) -> dict[str, Any]:
        return {"prompt_tokens": len(self.prompt), **engine_facts(self.llm)}

    def run(self, cell: str, n: int, t: int, seed: int, tokens: int | None = None, **_: Any) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        per = max(1, round((tokens or n * t) / n))
        prompts = [TokensPrompt(prompt_token_ids=self.prompt[:-1] + [3 + i % 1000]) for i in range(n)]
        params = SamplingParams(max_tokens=per, temperature=1.0, detokenize=False, ignore_eos=True)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        seqs = [tuple(o.outputs[0].token_ids) for o in outs]
        return {"wall_s": wall, "cpu_s": cpu, "particle_steps": sum(map(len, seqs)), "distinct_texts": len(set(seqs))}

    def close(self) -> None:
        pass


class Forced(Decode):
    def __init__(self, path: str) -> None:
        self.llm = plain_llm(path, [forced_processor()])
        tok = self.llm.get_tokenizer()
        self.prompt = prompt_ids(tok)
        self.eos = int(tok.eos_token_id)
        from genlm_vlm.vocab import get_byte_vocab

        self.width = int(self.llm.llm_engine.vllm_config.model_config.get_vocab_size())
        self.byte_vocab = get_byte_vocab(tok)[: self.width]
        self.byte_vocab += [b""] * (self.width - len(self.byte_vocab))
        self.cache: dict[Any, Any] = {}  # the bound automaton's tables, kept per vocabulary as lm.smc keeps them

    def controller(self, cell: str, n: int, t: int, seed: int) -> Any:
        from genlm_vlm.smc import Regex
        from genlm_vlm.smc.algorithm import SMCController

        pattern, ess = CELLS[cell]
        bound = Regex(pattern).bind(self.byte_vocab, (self.eos,), self.width, cache=self.cache)
        return SMCController(bound, n, t, eos_ids=(self.eos,), byte_vocab=self.byte_vocab, ess_threshold=ess,
                             seed=seed)

    def run(self, cell: str, n: int, t: int, seed: int, **_: Any) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ctl = self.controller(cell, n, t, seed)  # built outside the wall, as lm.smc's prepare is
        run = ForcedRun(ctl, list(self.prompt), self.eos)
        prompts = [TokensPrompt(prompt_token_ids=list(self.prompt)) for _ in range(n)]
        params = [SamplingParams(max_tokens=t, temperature=1.0, detokenize=False, extra_args={TAG: i})
                  for i in range(n)]
        CURRENT[0] = run
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        finally:
            CURRENT[0] = None
        r = ctl.result([tuple(s) for s in ctl.tokens])
        got = [list(o.outputs[0].token_ids) for o in outs]
        ok = sum(g[: len(p.token_ids)] == p.token_ids for g, p in zip(got, r.particles, strict=True))
        fork_s, tails = self.replay(run.events)
        steps = max(1, run.steps)
        return {"wall_s": wall, "cpu_s": cpu, "particle_steps": run.rows, "engine_tokens": sum(map(len, got)), "steps": run.steps,
                "resamples": r.stats["resamples"], "resample_steps": run.resample_steps, "forked": run.forked,
                "missing": run.missing, "fork_est_s": fork_s, "fork_tail_tokens": tails,
                "finished": r.stats["finished"], "distinct_texts": len({p.text for p in r.particles}),
                "forced_ok": ok, "controller_ms_per_step": 1e3 * r.stats["controller_s"] / steps,
                "mask_ms_per_step": r.stats["mask_ms_per_step"], "step_ms_per_step": r.stats["step_ms_per_step"],
                "processor_ms_per_step": 1e3 * run.apply_s / steps, "rows_ms_per_step": 1e3 * run.rows_s / steps,
                "force_ms_per_step": 1e3 * (run.apply_s - run.rows_s - run.step_s) / steps,
                "wall_ms_per_step": 1e3 * wall / steps, "controller_share": r.stats["controller_s"] / wall,
                "fingerprint": [[p.token_ids, p.log_weight] for p in r.particles]}

    def replay(self, events: list[list[list[int]]]) -> tuple[float, int]:
        """Seconds to re-add each resampling step's forked contexts with their full blocks cached
        (see the module docstring), summed over the steps; and the tokens recomputed."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        total, tails = 0.0, 0
        params = SamplingParams(max_tokens=1, temperature=1.0, detokenize=False, ignore_eos=True)
        block = ENGINE_OPTS["block_size"]
        for contexts in events:
            if not contexts:
                continue
            prompts = [TokensPrompt(prompt_token_ids=c) for c in contexts]
            self.llm.generate(prompts, params, use_tqdm=False)  # their full blocks into the prefix cache
            t0 = time.perf_counter()
            self.llm.generate(prompts, params, use_tqdm=False)
            total += time.perf_counter() - t0
            tails += sum(len(c) - ((len(c) - 1) // block) * block for c in contexts)
        return total, tails


FACTORIES = {"burst": Burst, "decode": Decode, "forced": Forced}


# ---------------------------------------------------------------------------------- processes
def worker_main(system: str, path: str) -> int:
    """Serve ``run`` commands (JSON lines on stdin) for one system; answer on stdout."""
    sys_obj = FACTORIES[system](path)
    print(RESULT + json.dumps({"ready": True, "facts": sys_obj.facts()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        out = sys_obj.run(**cmd)
        out["load"] = os.getloadavg()[0]
        out["threads"] = _threads()
        print(RESULT + json.dumps(out), flush=True)
    sys_obj.close()
    return 0


class Worker:
    """One system in its own process."""

    def __init__(self, system: str, path: str, log_dir: pathlib.Path, env: dict[str, str] | None = None) -> None:
        self.system = system
        self.log = open(log_dir / f"{system}.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", system, "--model", path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, **(env or {})})
        self.facts = self._read()["facts"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        raise RuntimeError(f"the {self.system} worker ended (exit {self.proc.wait()}); see {self.log.name}")

    def run(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        self.log.close()


def _clean(r: dict[str, Any]) -> bool:
    """Whether a repetition kept its engine's threads on the CPUs (a shared machine can leave one
    thread of a parallel region waiting for a core: the run then takes several times longer at
    about one core's CPU time). Without the thread count, every repetition counts as clean."""
    threads = r.get("threads")
    return threads is None or threads <= 1 or r["cpu_s"] >= 0.75 * threads * r["wall_s"]


def compare(burst: list[Any], forced: list[Any]) -> dict[str, Any]:
    """``forced`` against ``burst`` for one seed (fingerprints: per particle, tokens and log weight)."""
    same_text = sum(a[0] == b[0] for a, b in zip(burst, forced, strict=True))
    diffs = [abs(a[1] - b[1]) for a, b in zip(burst, forced, strict=True) if a[0] == b[0]]
    return {"identical": burst == forced, "texts_match": same_text, "particles": len(burst),
            "max_abs_dlogw": max(diffs) if diffs else None}


def measure(workers: dict[str, Any], cell: str, n: int, t: int, reps: int) -> dict[str, Any]:
    """Warm-up then ``reps`` alternating repetitions of every system on one cell."""
    systems = [s for s in SYSTEMS if s in workers]
    tokens = None
    for s in systems:  # warm-up; burst first: decode matches its rows
        r = workers[s].run(cell=cell, n=n, t=t, seed=0, tokens=tokens)
        if s == "burst":
            tokens = r["particle_steps"]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for rep in range(reps):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        for s in order:
            runs[s].append(workers[s].run(cell=cell, n=n, t=t, seed=rep + 1, tokens=tokens))
    out: dict[str, Any] = {"cell": cell, "n": n, "t": t, "systems": {}}
    for s, rs in runs.items():
        summary = {k: statistics.median(r[k] for r in rs) for k in rs[0]
                   if isinstance(rs[0][k], int | float) and not isinstance(rs[0][k], bool)}
        summary["steps_per_s"] = statistics.median(r["particle_steps"] / r["wall_s"] for r in rs)
        summary["steps_per_cpu_s"] = statistics.median(r["particle_steps"] / r["cpu_s"] for r in rs)
        summary["best_steps_per_s"] = max(r["particle_steps"] / r["wall_s"] for r in rs)  # the least disturbed rep
        clean = [r for r in rs if _clean(r)]
        summary["clean_reps"] = len(clean)
        summary["clean_steps_per_s"] = statistics.median(r["particle_steps"] / r["wall_s"] for r in clean) if clean else None
        summary["walls"] = [round(r["wall_s"], 4) for r in rs]
        if s == "forced":
            summary["with_forks_steps_per_s"] = statistics.median(
                r["particle_steps"] / (r["wall_s"] + r["fork_est_s"]) for r in rs)
        out["systems"][s] = summary
    if "burst" in runs and "forced" in runs:
        out["same_seed"] = [compare(a["fingerprint"], b["fingerprint"]) for a, b in
                            zip(runs["burst"], runs["forced"], strict=True)]
    sy = out["systems"]
    dec = sy.get("decode", {}).get("steps_per_s")
    out["ratios"] = {}
    if dec:
        for s in ("burst", "forced"):
            if s in sy:
                out["ratios"][f"{s}/decode"] = sy[s]["steps_per_s"] / dec
        if "forced" in sy:
            out["ratios"]["forced+forks/decode"] = sy["forced"]["with_forks_steps_per_s"] / dec
        for s in ("burst", "forced"):
            if s in sy:
                out["ratios"][f"{s}/decode (best)"] = sy[s]["best_steps_per_s"] / sy["decode"]["best_steps_per_s"]
        for s in ("burst", "forced"):
            if s in sy and sy[s]["clean_steps_per_s"] and sy["decode"]["clean_steps_per_s"]:
                out["ratios"][f"{s}/decode (clean)"] = sy[s]["clean_steps_per_s"] / sy["decode"]["clean_steps_per_s"]
        for s in ("burst", "forced"):  # per CPU-second of each process: less sensitive to a shared machine
            if s in sy:
                out["ratios"][f"{s}/decode (CPU)"] = sy[s]["steps_per_cpu_s"] / sy["decode"]["steps_per_cpu_s"]
    if "burst" in sy and "forced" in sy:
        out["ratios"]["forced/burst"] = sy["forced"]["steps_per_s"] / sy["burst"]["steps_per_s"]
    return out


def table(cells: list[dict[str, Any]]) -> str:
    def f(x: Any, d: int = 2) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    lines = ["| cell | N | T | decode steps/s | burst/decode | forced/decode | forced+forks/decode | "
             "burst/decode, forced/decode: clean reps (b/d/f); best reps; per CPU-s | particle-steps b/d/f | distinct b/d/f | resample steps (forked) | same seed | forced ms/step: "
             "wall, processor, controller (masks, rest) | burst ctl ms/step | CPU/wall b/d/f |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        sy, r = c["systems"], c["ratios"]
        b, d, fo = sy.get("burst", {}), sy.get("decode", {}), sy.get("forced", {})
        same = c.get("same_seed") or []
        seed = "-" if not same else ("identical" if all(x["identical"] for x in same) else
                                     f"texts {min(x['texts_match'] for x in same)}/{same[0]['particles']}, "
                                     f"max dlogw {max((x['max_abs_dlogw'] or 0) for x in same):.1e}")
        lines.append(
            f"| {c['cell']} | {c['n']} | {c['t']} | {f(d.get('steps_per_s'), 0)} | {f(r.get('burst/decode'))} | "
            f"{f(r.get('forced/decode'))} | {f(r.get('forced+forks/decode'))} | "
            f"{f(r.get('burst/decode (clean)'))}, {f(r.get('forced/decode (clean)'))} "
            f"({'/'.join(str(x.get('clean_reps', '-')) for x in (b, d, fo))}); "
            f"{f(r.get('burst/decode (best)'))}, {f(r.get('forced/decode (best)'))}; "
            f"{f(r.get('burst/decode (CPU)'))}, {f(r.get('forced/decode (CPU)'))} | "
            f"{b.get('particle_steps', '-')}/{d.get('particle_steps', '-')}/{fo.get('particle_steps', '-')} | "
            f"{b.get('distinct_texts', '-')}/{d.get('distinct_texts', '-')}/{fo.get('distinct_texts', '-')} | "
            f"{fo.get('resample_steps', '-')} ({fo.get('forked', '-')}) | {seed} | "
            f"{f(fo.get('wall_ms_per_step'))}, {f(fo.get('processor_ms_per_step'))}, "
            f"{f(fo.get('controller_ms_per_step'))} ({f(fo.get('mask_ms_per_step'))}, {f(fo.get('step_ms_per_step'))}) | "
            f"{f(b.get('controller_ms_per_step'))} | "
            f"{'/'.join(f(x.get('cpu_s', 0) / x['wall_s']) if x else '-' for x in (b, d, fo))} |")
    return "\n".join(lines)


def model_path(name: str) -> str:
    if name == "demo":
        from genlm_vlm import demo_model_path

        return str(demo_model_path())
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo", help="'demo' (the shipped demo model) or a model directory")
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--n", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--t", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--threads-bind", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND for every engine (default: vLLM's own binding)")
    ap.add_argument("--quick", action="store_true", help="N = 4, T = 6, 1 rep")
    ap.add_argument("--out", default="benchmarks/results/ab_decode_smc.json")
    ap.add_argument("--worker", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    path = model_path(args.model)
    if args.worker:
        return worker_main(args.worker, path)
    if args.quick:
        args.n, args.t, args.reps = [4], 6, 1
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="ab_decode_smc-"))
    env = {} if args.threads_bind is None else {"VLLM_CPU_OMP_THREADS_BIND": args.threads_bind}
    workers: dict[str, Worker] = {}
    cells = []
    try:
        for s in args.systems:  # built one after another: builds do not compete
            workers[s] = Worker(s, path, log_dir, env)
        for cell in args.cells:
            for n in args.n:
                c = measure(workers, cell, n, args.t, args.reps)
                cells.append(c)
                print(json.dumps({k: v for k, v in c.items() if k != "systems"}), flush=True)
    finally:
        for w in workers.values():
            w.close()
    print(table(cells))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for c in cells:
        for s in c["systems"].values():
            s.pop("fingerprint", None)
    with open(out, "w") as fh:
        json.dump({"argv": sys.argv[1:], "machine": platform.platform(), "cpus": os.cpu_count(), "load_at_start": load,
                   "load_at_end": os.getloadavg(), "engine_opts": ENGINE_OPTS, "worker_env": env, "model": path,
                   "facts": {s: w.facts for s, w in workers.items()}, "cells": cells}, fh, indent=1, default=str)
    print(f"wrote {out} (worker logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
