"""bench_e2e's systems, each in its own process (``benchmarks/harness.py``'s SystemProcess): the
program (genlm-control's AWRS SMC, or the bridge) over ``ours``, ``bridge``, ``mock`` or
``transformers``, and the plain vLLM ``decode`` baseline. See bench_e2e.py's docstring."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
import threading
import time
import warnings
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
ROOT = _HERE.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402

harness.setup_environment()  # before vLLM is imported

#: Engine options of both vLLM engines (genlm_vlm's defaults go under them, see module doc).
ENGINE_OPTS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 256,
    "block_size": 32,
    "kv_cache_memory_bytes": 1 << 30,
    "seed": 0,
}

#: Benchmark name -> ``genlm_vlm.testing`` model kind.
MODELS: dict[str, str] = {"6-layer": "llama-2k-mid", "qwen2-0.5b": "qwen2-0.5b-shape", "demo": "demo"}
SYSTEMS = ("ours", "bridge", "mock", "decode", "transformers")
#: Environment variable the ``ours`` worker reads: "0" builds it with ``forks=False`` (``--forks off``).
FORKS_ENV = "GENLM_VLM_BENCH_FORKS"
PROGRAM_SYSTEMS = ("ours", "bridge", "mock", "transformers")
#: The decode baseline's second job when ``bridge`` runs: as many tokens as the bridge computed rows.
DECODE_BRIDGE = "decode_bridge"
#: Its third (a diagnostic): N sequences times the bridge's engine steps (its forward passes, full width).
DECODE_STEPS = "decode_steps"
#: Systems on a genlm_vlm engine (built the same way, stats read the same way).
ENGINE_SYSTEMS = ("ours", "bridge")

PROMPT = '"""Return the words of a sentence in lower case.\n\n    Example: the quick brown fox jumps over the lazy dog and'
PATTERN = r"[a-z ]+"
EOS_BYTE_STRINGS = [b"."]
EMAIL_PROMPT = "alice@example.com\nbob@mail.org\n"
EMAIL_PATTERN = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)"
#: Condition name -> (prompt, pattern, the PromptedLLM's eos_byte_strings, default T).
CONDITIONS: dict[str, tuple[str, str, list[bytes], int]] = {
    "words": (PROMPT, PATTERN, EOS_BYTE_STRINGS, 24),
    "email": (EMAIL_PROMPT, EMAIL_PATTERN, [b"\n"], 30),
}
ESS_THRESHOLD = 0.5

#: Targets: (model, condition, N) -> minimum of each ratio (issue 18: ours; issue 37: the bridge,
#: genlm-control's program through genlm_vlm.control.smc, on every cell that runs it).
TARGETS: dict[tuple[str, str, int], dict[str, float]] = {
    ("6-layer", "words", 32): {"ours_over_decode": 0.75, "ours_vs_transformers": 3.0},
}
BRIDGE_TARGETS = {"bridge_over_ours": 5.0, "bridge_over_decode": 0.95}

RESULT_TIMEOUT_S = 3600.0


# =========================================================================== worker side
class _Trace:
    """Counters patched into genlm-control's SMC (cheap; contexts only when ``contexts`` is on)."""

    def __init__(self) -> None:
        self.reset(False)

    def reset(self, contexts: bool) -> None:
        self.particle_steps = 0
        self.max_len = 0
        self.resamples = 0
        self.contexts_on = contexts
        self.contexts: dict[int, set] = {}


TRACE = _Trace()


def _install_trace() -> None:
    """Count particle-steps and resamplings, and (warm-up only) distinct contexts per step."""
    import genlm.control.sampler.smc as smc_mod

    cls = smc_mod.SequenceModel
    if getattr(cls, "_bench_e2e_traced", False):
        return
    step = cls.step

    async def traced_step(self: Any) -> Any:
        n = len(self.context)
        TRACE.particle_steps += 1
        TRACE.max_len = max(TRACE.max_len, n + 1)
        if TRACE.contexts_on:
            TRACE.contexts.setdefault(n, set()).add(tuple(self.context))
        return await step(self)

    cls.step = traced_step
    cls._bench_e2e_traced = True
    get_fn = smc_mod.get_resampling_fn

    def counted_get_resampling_fn(method: str) -> Any:
        fn = get_fn(method)

        def resample(weights: Any) -> Any:
            TRACE.resamples += 1
            return fn(weights)

        return resample

    smc_mod.get_resampling_fn = counted_get_resampling_fn


def _cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its live child processes."""
    total = time.process_time()
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                t = child.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except ImportError:  # pragma: no cover - psutil ships with the dev extras
        pass
    return total


def _thread_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process, by native thread id."""
    try:
        import psutil

        return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
    except (ImportError, OSError):  # pragma: no cover
        return {}


def _thread_split(before: dict[int, float], after: dict[int, float], named: dict[str, int | None]) -> dict[str, float]:
    """CPU seconds spent between two :func:`_thread_cpu` snapshots by the ``named`` threads and
    by all others together (``other``: OpenMP workers, tokenizers, ...)."""
    delta = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    out = {name: round(delta.pop(tid, 0.0), 4) for name, tid in named.items() if tid is not None}
    out["other"] = round(sum(delta.values()), 4)
    return out


def _numeric_delta(after: Any, before: Any) -> Any:
    """``after - before`` for every number in two nested dicts of the same shape (others dropped)."""
    if isinstance(after, dict):
        out = {}
        for k, v in after.items():
            d = _numeric_delta(v, before.get(k) if isinstance(before, dict) else None)
            if d is not None and d != {}:
                out[k] = d
        return out
    if isinstance(after, bool) or not isinstance(after, (int, float)):
        return None
    b = before if isinstance(before, (int, float)) and not isinstance(before, bool) else 0
    d = after - b
    return round(d, 6) if isinstance(d, float) else d


def _engine_config(llm: Any) -> dict[str, Any]:
    """The effective vLLM configuration that decides an engine's speed (read back, not assumed)."""
    facts: dict[str, Any] = {}
    try:
        cfg = llm.llm_engine.vllm_config
    except Exception:  # noqa: BLE001 - layout changed; nothing to compare
        return facts
    for section, names in {
        "cache_config": ("block_size", "enable_prefix_caching", "num_gpu_blocks", "kv_cache_memory_bytes",
                         "cache_dtype"),
        "scheduler_config": ("max_num_seqs", "max_num_batched_tokens", "async_scheduling",
                             "enable_chunked_prefill"),
        "model_config": ("dtype", "max_model_len", "enforce_eager", "seed"),
        "parallel_config": ("tensor_parallel_size",),
    }.items():
        obj = getattr(cfg, section, None)
        for name in names:
            if obj is not None and hasattr(obj, name):
                v = getattr(obj, name)
                facts[f"{section}.{name}"] = v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
    return facts


def _quiet_imports() -> None:
    warnings.filterwarnings("ignore", "vllm was imported before genlm.backend", RuntimeWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


class ProgramRunner:
    """Runs the program over ``ours``, ``mock`` or ``transformers``."""

    def __init__(self, system: str, path: str, engine_opts: dict[str, Any]) -> None:
        _quiet_imports()
        import numpy as np
        from genlm.control import AWRS, BoolFSA, PromptedLLM

        self.np, self.AWRS, self.BoolFSA, self.PromptedLLM = np, AWRS, BoolFSA, PromptedLLM
        _install_trace()
        self.system = system
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.mock_rows_s = 0.0
        t0 = time.perf_counter()
        if system in ENGINE_SYSTEMS:
            from genlm_vlm import AsyncVirtualLM

            # forks on (the default) unless --forks off (an extra row, never the headline)
            self.lm = AsyncVirtualLM.from_name(path, dict(engine_opts), forks=os.environ.get(FORKS_ENV, "1") != "0")
        elif system == "mock":
            import math

            import torch

            from genlm_vlm import MockAsyncLM
            from genlm_vlm.testing import _INIT_STD

            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                hidden = int(json.load(f)["hidden_size"])
            # The models' logits spread like a unit-RMS hidden state times N(0, std^2) weights.
            self.lm = MockAsyncLM.from_name(path, logit_scale=_INIT_STD * math.sqrt(hidden))
            compute = self.lm._compute
            known = len(self.lm.tokenizer)

            def timed_compute(*a: Any, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    row = compute(*a, **kw)
                    if known < row.shape[-1]:  # padded columns: next to no mass, as in the model
                        row[known:] = row[:known].max() - 30.0
                        row = torch.log_softmax(row, dim=-1)
                    return row
                finally:
                    self.mock_rows_s += time.perf_counter() - t

            self.lm._compute = timed_compute
        elif system == "transformers":
            from genlm.backend.llm import AsyncTransformer

            self.lm = AsyncTransformer.from_name(path, hf_opts={"device_map": "cpu"})
            self.lm.model.to("cpu")
        else:
            raise ValueError(system)
        self.build_s = time.perf_counter() - t0
        self.engine_tid = None
        self.bridge_result: Any = None
        if system == "bridge":
            import genlm_vlm.control
            import genlm_vlm.control.bridge as bridge_mod

            self.control = genlm_vlm.control
            to_sequences = bridge_mod.to_sequences

            def recorded(llm: Any, result: Any) -> Any:  # keep the run's SMCResult (its stats)
                self.bridge_result = result
                return to_sequences(llm, result)

            bridge_mod.to_sequences = recorded
        if system in ENGINE_SYSTEMS:
            try:  # private: the engine thread's id, to split CPU time by thread
                self.engine_tid = self.lm._driver.call(threading.get_native_id)
            except Exception:  # noqa: BLE001 - layout changed; the split then lacks "engine"
                pass
        tok = self.lm.tokenizer
        self.prompts = {c: [int(tok.bos_token_id), *tok.encode(v[0], add_special_tokens=False)]
                        for c, v in CONDITIONS.items()}
        self.prompt_ids = self.prompts["words"]

    # ------------------------------------------------------------------ helpers
    def info(self) -> dict[str, Any]:
        import torch

        info: dict[str, Any] = {
            "build_s": round(self.build_s, 2), "prompt_tokens": len(self.prompt_ids),
            "vocab_size": int(getattr(self.lm, "vocab_size", 0) or len(self.lm.byte_vocab)),
            "torch_threads": torch.get_num_threads(),
            "genlm_backend_imported": "genlm.backend" in sys.modules,
        }
        if self.system in ENGINE_SYSTEMS:
            info["engine_config"] = _engine_config(self.lm.llm)
            try:
                info["engine_info"] = {k: v for k, v in vars(self.lm.engine_info).items()
                                       if isinstance(v, (int, float, str, bool, type(None)))}
            except TypeError:
                info["engine_info"] = str(self.lm.engine_info)
        return info

    def _ours_stats(self) -> dict[str, Any]:
        stats = dict(self.lm.stats)
        if "engine_time" not in stats:
            stats["engine_time"] = self.lm._driver.stats().get("engine_time", {})
        return stats

    def _prepare(self, n: int) -> dict[str, Any]:
        notes: dict[str, Any] = {}
        if self.system in ENGINE_SYSTEMS:
            self.lm.clear_cache()  # rows, and idle sessions
            try:
                ok = self.lm._driver.call(self.lm.llm.reset_prefix_cache)
                notes["prefix_cache_reset"] = ok is not False
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                notes["prefix_cache_reset"] = f"failed: {e!r}"
        elif self.system == "transformers":
            self.lm.clear_cache()
            self.lm.reset_async_queries()
            self.lm.batch_size = n
        return notes

    # ------------------------------------------------------------------ one run
    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        np = self.np
        n, t, seed, trace = int(cmd["n"]), int(cmd["t"]), int(cmd["seed"]), bool(cmd.get("trace"))
        name = cmd.get("condition", "words")
        _, pattern, eos, _ = CONDITIONS[name]
        prompt_ids = self.prompts[name]
        notes = self._prepare(n)
        llm = self.PromptedLLM(self.lm, prompt_ids=prompt_ids, eos_byte_strings=eos)
        condition = self.BoolFSA.from_regex(pattern).coerce(llm, f=b"".join)
        TRACE.reset(trace)
        np.random.seed(seed)
        stats0 = self._ours_stats() if self.system in ENGINE_SYSTEMS else None
        rows0 = self.mock_rows_s
        self.bridge_result = None

        async def program() -> Any:
            if self.system == "bridge":  # the one changed line
                return await self.control.smc(self.AWRS(llm, condition, seed=seed), n_particles=n,
                                              ess_threshold=ESS_THRESHOLD, max_tokens=t, seed=seed)
            return await self.AWRS(llm, condition, seed=seed).smc(
                n_particles=n, ess_threshold=ESS_THRESHOLD, max_tokens=t)

        th0 = _thread_cpu()
        c0, w0 = _cpu_seconds(), time.perf_counter()
        if self.system == "transformers":
            # genlm-backend keeps KV only for prefixes given to cache_kv (PromptedLLM gives none):
            # the prompt's, as a user would, timed like ours' prefill of it.
            self.lm.cache_kv(prompt_ids)
        seqs = self.loop.run_until_complete(program())
        wall = time.perf_counter() - w0
        cpu = _cpu_seconds() - c0
        threads = _thread_split(th0, _thread_cpu(), {"main": threading.get_native_id(), "engine": self.engine_tid})

        texts = [b"".join(bytes(x) for x in c if isinstance(x, bytes)) for c in seqs.contexts]
        out: dict[str, Any] = {
            "wall_s": wall, "cpu_s": cpu, "cpu_per_wall": cpu / wall if wall > 0 else None,
            "particle_steps": TRACE.particle_steps, "steps": TRACE.max_len, "resamples": TRACE.resamples,
            "final_distinct_texts": len(set(texts)), "log_ml": float(seqs.log_ml), "ess": float(seqs.ess),
            "thread_cpu_s": threads, **notes,
        }
        if trace:
            per_step = [len(TRACE.contexts[k]) for k in sorted(TRACE.contexts)]
            out["distinct_contexts_per_step"] = per_step
            out["examples"] = [x.decode("utf-8", "replace") for x in sorted(set(texts))[:3]]
        if self.system in ENGINE_SYSTEMS:
            after = self._ours_stats()
            out["stats_delta"] = _numeric_delta(after, stats0)
            out["engine_time"] = _numeric_delta(after.get("engine_time", {}), stats0.get("engine_time", {}))
        if self.system == "bridge":
            # genlm-control's own SMC never ran: count the engine run's work instead. Particle-steps:
            # the run's live particles summed over its steps (SMCResult.stats['rows']); engine_rows:
            # the rows the engine computed for it (lm.stats['rows']: resampled copies share one row).
            res = self.bridge_result
            if res is None:
                raise RuntimeError("genlm_vlm.control.smc did not run in the engine (no SMCResult recorded)")
            rs = dict(res.stats)
            out["smc_stats"] = {k: v for k, v in rs.items() if isinstance(v, (int, float))}
            out["particle_steps"] = rs.get("rows", 0)
            out["engine_rows"] = out["stats_delta"].get("rows", 0)
            out["steps"] = rs.get("steps", 0)
            out["resamples"] = rs.get("resamples", 0)
            out.pop("distinct_contexts_per_step", None)
        if self.system == "mock":
            out["mock_rows_s"] = self.mock_rows_s - rows0
            out["program_s"] = wall - out["mock_rows_s"]
        return out

    def close(self) -> None:
        cleanup = getattr(self.lm, "cleanup", None)
        if self.system in ENGINE_SYSTEMS and cleanup is not None:
            cleanup()
        self.loop.close()


class DecodeRunner:
    """A plain ``vllm.LLM`` decoding the same number of tokens (never imports genlm.backend)."""

    def __init__(self, path: str, engine_opts: dict[str, Any]) -> None:
        if "genlm.backend" in sys.modules:
            raise RuntimeError("the decode baseline's process imported genlm.backend")
        from vllm import LLM
        from vllm.platforms import current_platform

        from genlm_vlm.engine.options import CPU_ENGINE_OPTS, DEFAULT_ENGINE_OPTS

        opts: dict[str, Any] = dict(DEFAULT_ENGINE_OPTS)
        if current_platform.is_cpu():
            opts.update(CPU_ENGINE_OPTS)
        opts.update(engine_opts)
        self.opts = opts
        t0 = time.perf_counter()
        self.llm = LLM(model=path, **opts)
        self.build_s = time.perf_counter() - t0
        tok = self.llm.get_tokenizer()
        self.prompts = {c: [int(tok.bos_token_id), *tok.encode(v[0], add_special_tokens=False)]
                        for c, v in CONDITIONS.items()}
        self.prompt_ids = self.prompts["words"]
        self.vocab = len(tok)

    def info(self) -> dict[str, Any]:
        import torch

        return {
            "build_s": round(self.build_s, 2), "prompt_tokens": len(self.prompt_ids), "engine_opts": self.opts,
            "engine_config": _engine_config(self.llm), "torch_threads": torch.get_num_threads(),
            "genlm_backend_imported": "genlm.backend" in sys.modules,
        }

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n, tokens, seed = int(cmd["n"]), int(cmd["tokens"]), int(cmd["seed"])
        base = self.prompts[cmd.get("condition", "words")][:-1]
        if n + 3 > self.vocab:
            raise ValueError(f"N={n} distinct last tokens do not fit a vocabulary of {self.vocab}")
        q, r = divmod(tokens, n)
        prompts, params = [], []
        for i in range(n):
            k = q + (1 if i < r else 0)
            if k == 0:
                continue
            prompts.append(TokensPrompt(prompt_token_ids=[*base, 3 + i]))
            params.append(SamplingParams(max_tokens=k, temperature=1.0, ignore_eos=True, detokenize=False,
                                         seed=seed * 100_003 + i))
        # Cold (not the ratio's baseline): prefix cache empty, every prompt prefilled whole.
        self.llm.reset_prefix_cache()
        w0 = time.perf_counter()
        self.llm.generate(prompts, params, use_tqdm=False)
        cold = time.perf_counter() - w0
        # The baseline: the shared prompt's full blocks already in the prefix cache (untimed).
        self.llm.reset_prefix_cache()
        warm = SamplingParams(max_tokens=1, temperature=1.0, detokenize=False)
        self.llm.generate([TokensPrompt(prompt_token_ids=list(base))], warm, use_tqdm=False)
        th0 = _thread_cpu()
        c0, w0 = _cpu_seconds(), time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - w0
        cpu = _cpu_seconds() - c0
        threads = _thread_split(th0, _thread_cpu(), {"main": threading.get_native_id()})
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        # tokens the engine computed: prompt tokens not found cached, plus each decoded token
        # after the first (fed back once); ours reports the same count (stats['tokens']['scheduled'])
        computed = sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) + len(o.outputs[0].token_ids) - 1
                       for o in outs)
        return {
            "wall_s": wall, "cpu_s": cpu, "cpu_per_wall": cpu / wall if wall > 0 else None,
            "cold_wall_s": cold, "particle_steps": made, "computed_tokens": computed, "tokens_requested": tokens,
            "prompts": len(prompts),
            "max_tokens_per_prompt": q + (1 if r else 0), "thread_cpu_s": threads,
            "genlm_backend_imported": "genlm.backend" in sys.modules,
        }

    def close(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class _System:
    """The harness's interface (``info``, ``run(job, **command)``, ``close``) over a runner."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def info(self) -> dict[str, Any]:
        return self.runner.info()

    def run(self, job: str, **cmd: Any) -> dict[str, Any]:
        return self.runner.run(cmd)

    def close(self) -> None:
        self.runner.close()


def system(spec: dict[str, Any]) -> _System:
    """``spec``: ``system`` (one of SYSTEMS), ``path`` (the model), ``engine_opts``."""
    if spec["system"] == "decode":
        return _System(DecodeRunner(spec["path"], spec["engine_opts"]))
    return _System(ProgramRunner(spec["system"], spec["path"], spec["engine_opts"]))
