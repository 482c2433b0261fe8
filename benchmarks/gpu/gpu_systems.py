"""The systems the GPU check's benchmark cells compare (benchmarks/gpu/check_all.py), each built
in a process of its own by ``benchmarks/harness.py``'s ``SystemProcess`` with the same engine
options (two vLLM engines in one CUDA process break each other):

* ``ours``: ``AsyncVirtualLM.from_name(model, engine_opts, output_device=...)``; jobs ``smc``
  (``lm.smc``: constrained SMC in the engine), ``identity`` (``lm.smc`` in the engine and its
  Python reference, ``in_engine=False``, same seed: byte-identical particles?), ``rows`` (N
  distinct prompts, one ``await lm.next_token_logprobs`` each under ``asyncio.gather``),
  ``async_smc`` (bench_async's smc workload: N particles, one awaited row each per step, tokens
  drawn from the rows) and ``e2e`` (genlm-control's AWRS program through
  ``genlm_vlm.control.smc``, skipped where genlm-control is not installed);
* ``plain``: ``vllm.LLM(model, **plain_engine_opts(engine_opts))``; jobs ``decode`` (N
  sequences of ``per`` tokens each, distinct last prompt token, ``ignore_eos``), ``structured``
  (vLLM's own structured outputs under the same regex, N samples of up to T tokens) and
  ``generate1`` (N distinct prompts, ``max_tokens=1``: the rows ceiling).

Every job returns ``wall_s`` and its work (``particle_steps`` or ``rows``). Prompts of ``rows``
and ``generate1`` depend only on (n, length, seed): the driver gives both systems the same seed
in a repetition and a new seed in the next one, so no repetition reads another's prefix cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from typing import Any

PROMPT = '"""Return the words of a sentence in lower case.\n\n    Example: the quick brown fox jumps over the lazy dog and'
#: No particle can finish within the benchmark's T, and with ess_threshold=0 none is resampled:
#: every step has N live, distinct particles (bench_smc_engine's ``steady``).
STEADY = r"[a-z ]{1000}"
REGEX = r"[a-z ]+"
E2E_PATTERN = r"[a-z ]+"


def _prompt_ids(tok: Any) -> list[int]:
    ids = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return ids + tok.encode(PROMPT, add_special_tokens=False)


def distinct_prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """``n`` random prompts of ``length`` ids in [3, vocab), pairwise different in their first
    token (so no two share a KV block), the same for every system given the same seed."""
    rng = random.Random(seed)
    firsts = rng.sample(range(3, vocab), n) if vocab - 3 >= n else [3 + i % (vocab - 3) for i in range(n)]
    return [[f] + [rng.randrange(3, vocab) for _ in range(length - 1)] for f in firsts]


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


class Ours:
    def __init__(self, spec: dict[str, Any]) -> None:
        from genlm_vlm import AsyncVirtualLM

        self.loop = asyncio.new_event_loop()
        t0 = time.perf_counter()
        self.lm = AsyncVirtualLM.from_name(spec["model"], dict(spec.get("engine_opts") or {}),
                                           output_device=spec.get("output_device", "cpu"))
        self.build_s = time.perf_counter() - t0
        self.prompt = _prompt_ids(self.lm.tokenizer)
        self.vocab = len(self.lm.tokenizer)

    def info(self) -> dict[str, Any]:
        import torch

        import genlm_vlm

        info = self.lm.engine_info
        stats = self.lm.stats
        return {"runner": info.runner, "mode": info.mode, "vllm": info.vllm_version, "block_size": info.block_size,
                "forks": stats.get("forks", {}).get("enabled"), "forks_why": stats.get("forks", {}).get("why"),
                "batch_invariant": stats.get("batch_invariant"), "build_s": self.build_s, "device": _device_name(),
                "torch": torch.__version__, "genlm_vlm": genlm_vlm.__version__, "pid": os.getpid()}

    def run(self, job: str, **kw: Any) -> dict[str, Any]:
        return getattr(self, f"_{job}")(**kw)

    def _fresh(self) -> None:
        self.lm.clear_cache()
        self.lm.release_sessions()

    def _smc(self, n: int, t: int, seed: int, kind: str = "steady", in_engine: bool = True) -> dict[str, Any]:
        from genlm_vlm.smc import Regex

        self._fresh()
        before = self.lm.stats
        ess = 0.0 if kind == "steady" else 0.5
        t0 = time.perf_counter()
        r = self.loop.run_until_complete(self.lm.smc(self.prompt, Regex(STEADY if kind == "steady" else REGEX), n, t,
                                                     seed=seed, in_engine=in_engine, ess_threshold=ess))
        wall = time.perf_counter() - t0
        after = self.lm.stats
        finger = repr([(p.token_ids, p.log_weight) for p in r.particles]).encode()
        return {"wall_s": wall, "particle_steps": r.stats["rows"], "steps": r.stats["steps"],
                "distinct_texts": len({p.text for p in r.particles}), "fingerprint": hashlib.sha256(finger).hexdigest(),
                "tokens": (after["tokens"]["scheduled"] or 0) - (before["tokens"]["scheduled"] or 0),
                "forks_copied": after["forks"]["copied"] - before["forks"]["copied"],
                "mask_ms_per_step": r.stats.get("mask_ms_per_step"), "step_ms_per_step": r.stats.get("step_ms_per_step"),
                "mode": after.get("mode")}

    def _identity(self, n: int, t: int, seed: int, kind: str = "steady") -> dict[str, Any]:
        eng = self._smc(n, t, seed, kind, True)
        ref = self._smc(n, t, seed, kind, False)
        return {"wall_s": eng["wall_s"], "python_wall_s": ref["wall_s"], "identical": eng["fingerprint"] == ref["fingerprint"],
                "particle_steps": eng["particle_steps"], "mode": eng["mode"]}

    def _rows(self, n: int, length: int, seed: int) -> dict[str, Any]:
        prompts = distinct_prompts(n, length, seed, self.vocab)
        self._fresh()

        async def go() -> list[Any]:
            return await asyncio.gather(*(self.lm.next_token_logprobs(p) for p in prompts))

        t0 = time.perf_counter()
        rows = self.loop.run_until_complete(go())
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "rows": len(rows), "row_device": str(rows[0].device)}

    def _async_smc(self, n: int, t: int, seed: int) -> dict[str, Any]:
        import torch

        gen = torch.Generator().manual_seed(seed)
        self._fresh()

        async def go() -> int:
            ctx = [list(self.prompt) for _ in range(n)]
            steps = 0
            for _ in range(t):
                rows = await asyncio.gather(*(self.lm.next_token_logprobs(c) for c in ctx))
                probs = torch.stack([r.float().cpu() for r in rows]).exp()
                toks = torch.multinomial(probs, 1, generator=gen).squeeze(1).tolist()
                for c, tok in zip(ctx, toks, strict=True):
                    c.append(int(tok))
                steps += n
            return steps

        t0 = time.perf_counter()
        steps = self.loop.run_until_complete(go())
        return {"wall_s": time.perf_counter() - t0, "particle_steps": steps}

    def _e2e(self, n: int, t: int, seed: int) -> dict[str, Any]:
        try:
            import numpy as np
            from genlm.control import AWRS, BoolFSA, PromptedLLM

            from genlm_vlm.control import smc as bridge_smc
        except ImportError as e:
            return {"skipped": f"genlm-control is not installed here ({e})", "wall_s": None}
        self._fresh()
        llm = PromptedLLM(self.lm, prompt_ids=list(self.prompt), eos_byte_strings=[b"."])
        cond = BoolFSA.from_regex(E2E_PATTERN).coerce(llm, f=b"".join)
        np.random.seed(seed)
        rows0 = self.lm.stats["rows"]
        t0 = time.perf_counter()
        seqs = self.loop.run_until_complete(bridge_smc(AWRS(llm, cond, seed=seed), n_particles=n, ess_threshold=0.5,
                                                       max_tokens=t, seed=seed))
        wall = time.perf_counter() - t0
        rows = self.lm.stats["rows"] - rows0
        return {"wall_s": wall, "particle_steps": rows, "engine_rows": rows, "contexts": len(seqs.contexts)}

    def close(self) -> None:
        self.lm.cleanup()
        self.loop.close()


class Plain:
    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM

        from benchmarks.harness import plain_engine_opts

        t0 = time.perf_counter()
        self.opts = plain_engine_opts(spec.get("engine_opts"))
        self.llm = LLM(model=spec["model"], **self.opts)
        self.build_s = time.perf_counter() - t0
        tok = self.llm.get_tokenizer()
        self.prompt = _prompt_ids(tok)
        self.vocab = len(tok)

    def info(self) -> dict[str, Any]:
        import vllm

        cfg = self.llm.llm_engine.vllm_config
        runner = "v2" if getattr(cfg, "use_v2_model_runner", False) else "v1"
        return {"runner": runner, "vllm": vllm.__version__, "build_s": self.build_s, "device": _device_name(),
                "block_size": cfg.cache_config.block_size, "enforce_eager": cfg.model_config.enforce_eager,
                "pid": os.getpid()}

    def run(self, job: str, **kw: Any) -> dict[str, Any]:
        return getattr(self, f"_{job}")(**kw)

    def _generate(self, prompts: list[list[int]], params: Any) -> tuple[float, list[Any]]:
        from vllm.inputs import TokensPrompt

        self.llm.reset_prefix_cache()
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t0 = time.perf_counter()
        outs = self.llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t0, outs

    def _decode(self, n: int, per: int, seed: int = 0) -> dict[str, Any]:
        from vllm import SamplingParams

        prompts = [self.prompt + [3 + i % 500] for i in range(n)]
        params = SamplingParams(max_tokens=max(1, per), temperature=1.0, detokenize=False, ignore_eos=True)
        wall, outs = self._generate(prompts, params)
        return {"wall_s": wall, "particle_steps": sum(len(o.outputs[0].token_ids) for o in outs)}

    def _structured(self, n: int, t: int, seed: int, kind: str = "steady") -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        so = StructuredOutputsParams(regex=STEADY if kind == "steady" else REGEX)
        params = [SamplingParams(max_tokens=t, temperature=1.0, detokenize=False, seed=seed * 1000 + i,
                                 structured_outputs=so) for i in range(n)]
        wall, outs = self._generate([list(self.prompt) for _ in range(n)], params)
        toks = [tuple(o.outputs[0].token_ids) for o in outs]
        return {"wall_s": wall, "particle_steps": sum(map(len, toks)), "distinct_texts": len(set(toks))}

    def _generate1(self, n: int, length: int, seed: int) -> dict[str, Any]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        wall, outs = self._generate(distinct_prompts(n, length, seed, self.vocab), params)
        return {"wall_s": wall, "rows": len(outs)}

    def close(self) -> None:
        del self.llm


def ours(spec: dict[str, Any]) -> Ours:
    return Ours(spec)


def plain(spec: dict[str, Any]) -> Plain:
    return Plain(spec)
