"""The systems a benchmark compares, each built in a process of its own
(:class:`genlm_vlm.bench.harness.SystemProcess`; factories :func:`genlm_system`,
:func:`vllm_system`, :func:`lm_eval_vllm_system`).

Every job takes the repetition number ``rep`` (0: the warm-up), builds its inputs from
:mod:`genlm_vlm.bench.workloads`, times only the work, and returns ``wall_s`` with the work it
did counted from the outputs (rows returned, particle-steps, tokens scored), so the parent can
check that every system did the work it was asked for.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import platform
import time
from typing import Any

from . import workloads as W


def plain_engine_opts(extra: dict[str, Any]) -> dict[str, Any]:
    """genlm_vlm's engine defaults (plus the CPU build's), then ``extra``: what a plain
    ``vllm.LLM`` baseline gets, so that it runs with the options genlm_vlm's engine has (block
    size included: vLLM's CPU default is 128, genlm_vlm's 32). On the CPU build this process is
    also set up as genlm_vlm sets up its engine's (the caller's own settings win): split-KV
    attention off (:func:`genlm_vlm.engine.options.batch_invariant_attention`), oneDNN's
    primitive cache capped, glibc keeping freed memory (``tune_cpu_allocator``)."""
    from genlm_vlm.engine import CPU_ENGINE_OPTS, DEFAULT_ENGINE_OPTS, is_cpu_platform

    opts = dict(DEFAULT_ENGINE_OPTS)
    if is_cpu_platform():
        from genlm_vlm.engine.build import ONEDNN_PRIMITIVE_CACHE_CAPACITY
        from genlm_vlm.engine.options import batch_invariant_attention, tune_cpu_allocator

        opts.update(CPU_ENGINE_OPTS)
        batch_invariant_attention()
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE_CAPACITY))
        tune_cpu_allocator()
    opts.update(extra)
    return opts


def machine_info(llm: Any) -> dict[str, Any]:
    """Versions, device, runner, dtype and CUDA graphs of this process's engine ``llm``."""
    import torch
    import vllm

    cfg = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    eager = getattr(cfg, "enforce_eager", None)
    if torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    else:
        device = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    from genlm_vlm.engine.build import predict_v2_runner

    return {
        "vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
        "device": device, "dtype": str(getattr(cfg, "dtype", "unknown")).replace("torch.", ""),
        "runner": "V2" if predict_v2_runner() else "V1",
        "cuda_graphs": None if eager is None else not eager, "pid": os.getpid(),
        "cpu_attn_split_kv": os.environ.get("VLLM_CPU_ATTN_SPLIT_KV"),
        "onednn_cache": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
        "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def _fingerprint(particles: Any) -> str:
    data = [(list(map(int, p.token_ids)), round(float(p.log_weight), 9)) for p in particles]
    return hashlib.sha1(json.dumps(data).encode()).hexdigest()


def _prompt_ids(tok: Any, text: str = W.SMC_PROMPT) -> list[int]:
    ids = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return ids + tok.encode(text, add_special_tokens=False)


class GenlmSystem:
    """genlm_vlm's side: an ``AsyncVirtualLM`` built with the cell's engine options."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from genlm_vlm import AsyncVirtualLM

        self.loop = asyncio.new_event_loop()
        self.lm = AsyncVirtualLM.from_name(spec["model"], dict(spec["engine_opts"]))
        self.vocab = self.lm.vocab_size
        self.prompt = _prompt_ids(self.lm.tokenizer)
        self.prompts = [self.prompt, _prompt_ids(self.lm.tokenizer, W.PRODUCT_PROMPT)]  # --product
        self._evaluator: Any = None

    def info(self) -> dict[str, Any]:
        ei = self.lm.engine_info
        return {**machine_info(self.lm.llm), "vocab": self.vocab, "block_size": ei.block_size,
                "max_num_seqs": ei.max_num_seqs, "mode": ei.mode}

    def run(self, job: str, **kw: Any) -> dict[str, Any]:
        return getattr(self, f"job_{job.replace('-', '_')}")(**kw)

    def _fresh(self) -> None:
        self.lm.clear_cache()
        self.lm.release_sessions()

    def job_rows(self, n: int, rep: int, rounds: int = 1, batch: bool = False) -> dict[str, Any]:
        waves = W.rows_waves(n, rounds, self.vocab, rep)
        self._fresh()
        lm = self.lm

        async def go() -> list[Any]:
            out = []
            for prompts in waves:
                if batch:
                    out.extend(await lm.batch_next_token_logprobs(prompts))
                else:
                    out.extend(await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts)))
            return out

        t0 = time.perf_counter()
        rows = self.loop.run_until_complete(go())
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "rows": len(rows), "width": int(rows[0].shape[-1])}

    def job_smc(self, n: int, t: int, constraint: str, rep: int, in_engine: bool = True,
                engine_path: str = "auto", mask_overlap: bool = False, product: bool = False) -> dict[str, Any]:
        from genlm_vlm.smc import Grammar, JSONSchema, Regex

        c = {"regex": lambda: Regex(W.REGEX), "steady": lambda: Regex(W.STEADY), "json": lambda: JSONSchema(W.SCHEMA),
             "grammar": lambda: Grammar(W.GRAMMAR)}[constraint]()
        ess = 0.0 if constraint == "steady" else 0.5
        self._fresh()
        t0, c0 = time.perf_counter(), time.process_time()
        prompt, prompts = (None, self.prompts) if product else (self.prompt, None)
        r = self.loop.run_until_complete(self.lm.smc(prompt, c, n, t, seed=rep, in_engine=in_engine, prompts=prompts,
                                                     ess_threshold=ess, engine_path=engine_path,
                                                     mask_overlap=mask_overlap))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"wall_s": wall, "cpu_s": cpu, "particle_steps": r.stats["rows"], "steps": r.stats["steps"],
                "particles": len(r.particles), "distinct": len({tuple(p.token_ids) for p in r.particles}),
                "resamples": r.stats["resamples"], "rows_per_step": r.stats.get("rows_per_step"), "fingerprint": _fingerprint(r.particles),
                "engine_path": r.stats.get("engine_path"), "fallback": r.stats.get("engine_path_fallback"),
                "mask_s": r.stats.get("mask_s"), "controller_s": r.stats.get("controller_s"),
                "mask_overlap": r.stats.get("mask_overlap"), "particle_requests": r.stats.get("particle_requests")}

    def job_score(self, n: int, rep: int) -> dict[str, Any]:
        records = W.score_records(n, self.vocab, rep)
        self._fresh()
        lm = self.lm

        async def go() -> list[float]:
            return await asyncio.gather(*(lm.score(p, c) for p, c in records))

        t0 = time.perf_counter()
        scores = self.loop.run_until_complete(go())
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "tokens": sum(len(c) for _, c in records), "records": len(scores),
                "scores": [float(s) for s in scores]}

    def job_lmeval(self, n: int, rep: int) -> dict[str, Any]:
        from genlm_vlm.evaluation import GenlmVLMEval

        if self._evaluator is None:
            self._evaluator = GenlmVLMEval(self.lm)
        return _lmeval(self._evaluator, n, rep, self._fresh)

    def job_control(self, n: int, t: int, constraint: str, rep: int) -> dict[str, Any]:
        import numpy as np
        from genlm.control import AWRS, BoolFSA, PromptedLLM

        self._fresh()
        llm = PromptedLLM(self.lm, prompt_ids=list(self.prompt))
        cond = BoolFSA.from_regex(W.REGEX).coerce(llm, f=b"".join)
        np.random.seed(rep)
        t0 = time.perf_counter()
        seqs = self.loop.run_until_complete(AWRS(llm, cond, seed=rep).smc(n_particles=n, ess_threshold=0.5,
                                                                            max_tokens=t))
        wall = time.perf_counter() - t0
        texts = {b"".join(x for x in c if isinstance(x, bytes)) for c in seqs.contexts}
        return {"wall_s": wall, "particle_steps": sum(len(c) for c in seqs.contexts),
                "particles": len(seqs.contexts), "distinct": len(texts)}

    def close(self) -> None:
        self.lm.cleanup()


def _lmeval(model: Any, n: int, rep: int, fresh: Any) -> dict[str, Any]:
    from lm_eval.api.instance import Instance

    reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(W.mc_requests(n, rep))]
    fresh()
    t0 = time.perf_counter()
    out = model.loglikelihood(reqs)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "requests": len(out), "scores": [float(x[0]) for x in out]}


class VllmSystem:
    """vLLM's side: a plain ``vllm.LLM`` with the engine options genlm_vlm's engine gets, and
    ``max_logprobs=-1`` (a bound that vLLM only validates requests against)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM

        opts = plain_engine_opts(dict(spec["engine_opts"]))
        opts["max_logprobs"] = -1
        self.llm = LLM(model=spec["model"], **opts)
        self.tok = self.llm.get_tokenizer()
        self.vocab = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.prompt = _prompt_ids(self.tok)
        self.prompts = [self.prompt, _prompt_ids(self.tok, W.PRODUCT_PROMPT)]  # --product

    def info(self) -> dict[str, Any]:
        return {**machine_info(self.llm), "vocab": self.vocab}

    def run(self, job: str, **kw: Any) -> dict[str, Any]:
        return getattr(self, f"job_{job}")(**kw)

    def _generate(self, prompts: list[list[int]], params: Any) -> tuple[list[Any], float]:
        from vllm.inputs import TokensPrompt

        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        self.llm.reset_prefix_cache()
        t0, c0 = time.perf_counter(), time.process_time()
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        self.cpu_s = time.process_time() - c0  # this process's CPU seconds (every thread's)
        return outs, time.perf_counter() - t0

    def job_rows(self, n: int, rep: int, rounds: int = 1) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, logprobs=-1, detokenize=False)
        waves = [[TokensPrompt(prompt_token_ids=p) for p in w] for w in W.rows_waves(n, rounds, self.vocab, rep)]
        self.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = [o for w in waves for o in self.llm.generate(w, params, use_tqdm=False)]
        wall = time.perf_counter() - t0
        widths = [len(o.outputs[0].logprobs[0]) for o in outs if o.outputs[0].logprobs]
        return {"wall_s": wall, "rows": len(widths), "width": min(widths, default=0)}

    def job_decode(self, n: int, rep: int, tokens: int = 0, product: bool = False,
                   lengths: list[int] | None = None) -> dict[str, Any]:
        """``n`` sequences of ``tokens`` tokens, or of ``lengths[i]`` tokens each (``product``:
        ``n`` on each factor's prompt, one particle-step counted per pair of tokens)."""
        from vllm import SamplingParams

        prompts = self.prompts if product else [self.prompt]
        if lengths is None:
            params: Any = SamplingParams(max_tokens=tokens, temperature=1.0, detokenize=False, ignore_eos=True)
        else:
            params = [SamplingParams(max_tokens=lengths[i], temperature=1.0, detokenize=False, ignore_eos=True)
                      for _ in prompts for i in range(n)]
        outs, wall = self._generate([p + [3 + i % 500] for p in prompts for i in range(n)], params)
        k = len(prompts)
        return {"wall_s": wall, "cpu_s": self.cpu_s, "particle_steps": sum(len(o.outputs[0].token_ids) for o in outs) // k,
                "particles": len(outs) // k}

    def job_structured(self, n: int, t: int, constraint: str, rep: int, product: bool = False) -> dict[str, Any]:
        """``n`` constrained sequences of at most ``t`` tokens (``product``: ``n`` on each factor's
        prompt, one particle-step counted per pair of tokens)."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        so = {"regex": lambda: StructuredOutputsParams(regex=W.REGEX),
              "steady": lambda: StructuredOutputsParams(regex=W.STEADY),
              "json": lambda: StructuredOutputsParams(json=W.SCHEMA),
              "grammar": lambda: StructuredOutputsParams(grammar=W.GRAMMAR)}[constraint]()
        prompts = self.prompts if product else [self.prompt]
        k = len(prompts)
        params = [SamplingParams(max_tokens=t, temperature=1.0, detokenize=False, seed=rep * 100_003 + i,
                                 structured_outputs=so) for i in range(n * k)]
        outs, wall = self._generate([list(p) for p in prompts for _ in range(n)], params)
        toks = [tuple(o.outputs[0].token_ids) for o in outs]
        return {"wall_s": wall, "cpu_s": self.cpu_s, "particle_steps": sum(map(len, toks)) // k, "particles": len(toks) // k,
                "distinct": len(set(toks))}

    def job_score(self, n: int, rep: int) -> dict[str, Any]:
        from vllm import SamplingParams

        records = W.score_records(n, self.vocab, rep)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs, wall = self._generate([p + c for p, c in records], params)
        scores = []
        for (p, c), o in zip(records, outs, strict=True):
            entries = o.prompt_logprobs[len(p) :]
            scores.append(sum(e[tok].logprob for e, tok in zip(entries, c, strict=True)))
        return {"wall_s": wall, "tokens": sum(len(c) for _, c in records), "records": len(scores),
                "scores": scores}

    def close(self) -> None:
        pass


class LmEvalVllmSystem:
    """lm-eval's own ``vllm`` backend, built with the same engine options."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from genlm_vlm.evaluation.baseline import lm_eval_vllm_class

        opts = plain_engine_opts(dict(spec["engine_opts"]))
        max_len = opts.pop("max_model_len", None)
        self.model = lm_eval_vllm_class()(pretrained=spec["model"], max_model_len=max_len, batch_size="auto",
                                          **opts)

    def info(self) -> dict[str, Any]:
        return machine_info(self.model.model)

    def run(self, job: str, **kw: Any) -> dict[str, Any]:
        if job != "lmeval":
            raise ValueError(f"lm-eval-vllm runs only lmeval, not {job!r}")
        return _lmeval(self.model, kw["n"], kw["rep"], self.model.model.reset_prefix_cache)

    def close(self) -> None:
        pass


def genlm_system(spec: dict[str, Any]) -> GenlmSystem:
    """Factory of the ``genlm_vlm`` process."""
    return GenlmSystem(spec)


def vllm_system(spec: dict[str, Any]) -> VllmSystem:
    """Factory of the ``vllm`` process."""
    return VllmSystem(spec)


def lm_eval_vllm_system(spec: dict[str, Any]) -> LmEvalVllmSystem:
    """Factory of the ``lm-eval-vllm`` process."""
    return LmEvalVllmSystem(spec)


FACTORIES = {"genlm_vlm": "genlm_vlm.bench.systems:genlm_system", "vllm": "genlm_vlm.bench.systems:vllm_system",
             "lm-eval-vllm": "genlm_vlm.bench.systems:lm_eval_vllm_system"}
