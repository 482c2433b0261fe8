#!/usr/bin/env python
"""GPU check of genlm_vlm: correctness against transformers, then the throughput benchmark.

Runs on the GPU host (vLLM from ``install_offline.sh``; ``source /tmp/genlm_wheelhouse/env.sh``
first) from a checkout of this repository; nothing is downloaded. See benchmarks/gpu/CHECK.md.

Phases (``--phase``; each invocation may run one, results accumulate in ``--cache-dir``):

* ``build``: random-weight models of realistic shapes, written once to ``--cache-dir``
  (default ``/tmp/genlm_gpu_models``) as bf16 safetensors with a locally trained byte-level
  BPE tokenizer: ``qwen3-0.6b`` (Qwen3ForCausalLM, 0.6B params, vocab 151936, tied
  embeddings) and ``llama-8b`` (LlamaForCausalLM, 8.0B, vocab 128256). ``tiny`` is
  genlm_vlm.testing's tiny llama (float32).
* ``correctness``: for each model and model runner (``v2``: Model Runner V2, ``v1``), a fresh
  subprocess with ``VLLM_USE_V2_MODEL_RUNNER=1|0`` builds, for each dtype (bfloat16 /
  float32; ``--split-dtypes``: one subprocess per dtype), ``AsyncVirtualLM`` (asserting
  ``lm.engine_info.runner``) with default scheduling and again with
  ``max_num_batched_tokens=256, max_num_seqs=8`` (chunked prefill), scores ~56 prompts
  of lengths 1-500 (duplicates, extensions, a shared prefix family) through the sync batch
  path, the async path and one raw engine call with duplicates, and compares every row with a
  transformers forward of the same weights in the same dtype (GPU, one prompt at a time, no
  TF32, ``log_softmax`` in float32; computed once per model/dtype in its own subprocess and
  cached). Tolerances: float32 max |d| <= ``--tol-fp32`` (1e-3); bfloat16 max |d| <=
  ``--tol-bf16-max`` (0.25) and mean |d| <= ``--tol-bf16-mean`` (0.02), or, failing those,
  within ``--bf16-floor-factor`` (2) x the bf16 noise floor (HF bf16 vs HF fp32 on the same
  prompts: bf16 rounding alone). Every row must also be finite and normalised.
* ``bench``: ``benchmarks/bench_async.py`` per model and runner (subprocess), collecting its
  JSON; the summary tabulates ours/raw-generate and ours/logprobs=-1.

Outputs (``$OUT`` if set, else ``--out``): ``gpu_check_summary.txt``, ``gpu_check.json`` and
``gpu_check_logs.txt`` (log tails of failed subprocesses), rewritten after every step so a
killed run still leaves its partial results. Exit status 1 if any check of this invocation
failed. ``--cpu-smoke`` runs the whole pipeline on CPU with the tiny model, float32, runner v1
and ``bench_async.py --quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu.gpu_children import (  # noqa: E402
    CHILDREN,
    make_prompts,
    prompts_hash,
    run_child_main,
    unique_prompts,
)
from benchmarks.gpu.gpu_models import (  # noqa: E402
    BUILD_MARKER,
    DTYPES,
    KINDS,
    OUT_JSON,
    OUT_LOGS,
    OUT_SUMMARY,
    RUNNERS,
    SCHEDS,
    TEST_KINDS,
    _is_built,
    built_model_path,
    log,
    model_fingerprint,
    read_model_config,
)

BENCH_SCRIPT = ROOT / "benchmarks" / "bench_async.py"

# The model and prompt helpers, as gpu_check's own names (tests and CHECK.md use them from here).
from benchmarks.gpu.gpu_models import (  # noqa: E402,F401
    BUILD_VERSION,
    EXPECTED_PARAMS,
    SHAPES,
    analytic_param_count,
    build_model,
    make_config,
    meta_param_count,
)
from benchmarks.gpu.gpu_report import Report  # noqa: E402


# =========================================================================== orchestration
class Check(Report):
    """One invocation: runs phases in subprocesses and keeps the summary up to date."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cache = pathlib.Path(args.cache_dir)
        self.state = self.cache / "results"
        for sub in ("correctness", "bench", "refs", "prompts", "logs", "specs"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        self.out = pathlib.Path(os.environ.get("OUT") or args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.t0 = time.perf_counter()
        self.failures: list[str] = []
        self.failed_logs: list[pathlib.Path] = []
        self.this_run: set[str] = set()
        self.builds: dict[str, dict] = {}
        self._floors: dict[str, dict] = {}
        self.skipped = False  # the last spawn() was skipped for lack of time

    # ---------------------------------------------------------------- subprocess plumbing
    def child_env(self, runner: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        env.setdefault("VLLM_FLOAT32_MATMUL_PRECISION", "highest")  # no TF32 in float32 runs
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        if self.device == "cuda":
            # compile caches where later invocations find them (/tmp persists on the host)
            env.setdefault("VLLM_CACHE_ROOT", str(self.cache / "vllm_cache"))
            env.setdefault("TRITON_CACHE_DIR", str(self.cache / "triton_cache"))
        if runner is not None:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
        return env

    def run_child(self, kind: str, name: str, spec: dict, runner: str | None = None) -> dict | None:
        spec_file = self.state / "specs" / f"{name}.json"
        result_file = self.state / "specs" / f"{name}.result.json"
        log_file = self.state / "logs" / f"{name}.log"
        spec_file.write_text(json.dumps(spec, indent=2))
        result_file.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            str(pathlib.Path(__file__).resolve()),
            "--_child",
            kind,
            "--_spec",
            str(spec_file),
            "--_result",
            str(result_file),
        ]
        t0 = time.perf_counter()
        log(f"start {name}")
        rc = self.spawn(cmd, self.child_env(runner), log_file)
        if rc is None:
            return None
        dt = time.perf_counter() - t0
        result = json.loads(result_file.read_text()) if result_file.is_file() else None
        if rc != 0 or result is None or "error" in result:
            why = (result or {}).get("error") or (
                "killed at its time limit" if rc == -9 else f"exit status {rc}"
            )
            self.fail(f"{name}: {why}", log_file)
            log(f"FAILED {name} after {dt:.0f}s: {why}")
            return None
        log(f"done {name} in {dt:.0f}s")
        return result

    def spawn(self, cmd: list[str], env: dict[str, str], log_file: pathlib.Path) -> int | None:
        """Run ``cmd`` (output to ``log_file``) within --child-timeout and what is left of
        --time-limit; its process group is killed at the limit (exit status -9). None: not
        started, too little time left (recorded as a failure)."""
        timeout = self.args.child_timeout
        self.skipped = False
        if self.args.time_limit:
            left = self.args.time_limit - (time.perf_counter() - self.t0) - 15
            if left < 30:
                self.skipped = True
                self.fail(
                    f"{log_file.stem}: skipped, --time-limit {self.args.time_limit:g}s reached"
                )
                log(f"skip {log_file.stem}: time limit")
                return None
            timeout = min(timeout, left)
        with open(log_file, "w") as fh:
            proc = subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, 9)  # the child and whatever it started
                except ProcessLookupError:
                    pass
                proc.wait()
                fh.write(f"\n[gpu_check] killed after {timeout:.0f}s\n")
                return -9
            except BaseException:
                os.killpg(proc.pid, 9)
                raise

    def fail(self, what: str, log_file: pathlib.Path | None = None) -> None:
        self.failures.append(what)
        if log_file is not None:
            self.failed_logs.append(log_file)

    # ---------------------------------------------------------------- phases
    def model_path(self, kind: str) -> pathlib.Path | None:
        path = built_model_path(kind, self.cache)
        if kind == "tiny" or _is_built(path):
            return path
        self.fail(f"{kind}: not built in {self.cache} (run --phase build first)")
        return None

    def phase_build(self) -> None:
        for kind in self.args.models:
            path = built_model_path(kind, self.cache)  # builds "tiny" (seconds, in-process)
            if kind == "tiny":
                log(f"tiny: genlm_vlm.testing llama at {path}")
                continue
            if _is_built(path) and not self.args.force_build:
                log(f"{kind}: already built at {path}")
                self.builds[kind] = json.loads((path / BUILD_MARKER).read_text())
                continue
            spec = {
                "kind": kind,
                "cache_dir": str(self.cache),
                "device": self.device,
                "force": self.args.force_build,
            }
            res = self.run_child("build", f"build-{kind}", spec)
            if res is not None:
                self.builds[kind] = res.get("meta") or {"path": res["path"]}
                if res.get("meta"):
                    m = res["meta"]
                    log(
                        f"{kind}: {m['params'] / 1e9:.3f}B params, built in {m['build_s']:.0f}s, "
                        f"row entropy {m['row_stats']['entropy_mean']:.2f} (log V = "
                        f"{m['row_stats']['log_vocab']:.2f})"
                    )
            self.write_outputs()

    def phase_correctness(self) -> None:
        a = self.args
        for kind in a.models:
            path = self.model_path(kind)
            if path is None:
                self.write_outputs()
                continue
            cfg = read_model_config(path)
            vocab = int(cfg["vocab_size"])
            max_model_len = min(
                a.max_model_len, int(cfg.get("max_position_embeddings") or a.max_model_len)
            )
            max_len = min(a.max_prompt_len, max_model_len - 1)
            prompts = make_prompts(vocab, max_len, a.num_prompts, a.prompt_seed)
            phash = prompts_hash(prompts)
            prompts_file = self.state / "prompts" / f"{kind}-{phash}.json"
            prompts_file.write_text(json.dumps(prompts))
            fp = model_fingerprint(path)
            log(
                f"{kind}: {len(prompts)} prompts ({len(unique_prompts(prompts))} distinct), "
                f"lengths {min(map(len, prompts))}-{max(map(len, prompts))}, vocab {vocab}"
            )
            jobs = []
            for dtype in a.dtypes:
                key = f"{kind}-{fp}-{dtype}-{phash}-{self.device}"
                jobs.append(
                    {
                        "dtype": dtype,
                        "key": key,
                        "refs_file": str(self.state / "refs" / f"{key}.pt"),
                    }
                )
            for j in jobs:  # bf16 rows are also compared with the fp32 reference, if any
                if j["dtype"] != "float32":
                    j["fp32_refs_file"] = j["refs_file"].replace(f"-{j['dtype']}-", "-float32-")
            missing = [j for j in jobs if not pathlib.Path(j["refs_file"]).is_file()]
            if missing:
                spec = {
                    "model": str(path),
                    "device": self.device,
                    "prompts_file": str(prompts_file),
                    "jobs": missing,
                }
                self.run_child("hf", f"hf-{kind}", spec)
            for j in jobs:
                if j not in missing:
                    log(
                        f"{kind} {j['dtype']}: HF reference cached ({pathlib.Path(j['refs_file']).name})"
                    )
            jobs = [j for j in jobs if pathlib.Path(j["refs_file"]).is_file()]
            if not jobs:
                self.write_outputs()
                continue
            groups = [[j] for j in jobs] if a.split_dtypes else [jobs]
            for runner in a.runners:
                for group in groups:
                    dts = "-".join(j["dtype"] for j in group)
                    spec = {
                        "model": str(path),
                        "runner": runner,
                        "device": self.device,
                        "prompts_file": str(prompts_file),
                        "jobs": group,
                        "scheds": a.scheds,
                        "max_model_len": max_model_len,
                        "kv_cache_bytes": int(a.kv_cache_gib * 2**30),
                        "gpu_util": a.gpu_util,
                        "eager": not a.compiled,
                    }
                    log_name = f"vllm-{kind}-{runner}-{dts}"
                    res = self.run_child("vllm", log_name, spec, runner=runner)
                    if self.skipped:
                        self.write_outputs()
                        continue
                    for j in group:
                        dtype = j["dtype"]
                        name = f"{kind}-{dtype}-{runner}"
                        sub = None
                        if res is not None and dtype in res.get("dtypes", {}):
                            sub = {k: v for k, v in res.items() if k != "dtypes"} | res["dtypes"][
                                dtype
                            ]
                        doc = {
                            "model": kind,
                            "dtype": dtype,
                            "runner": runner,
                            "refs_key": j["key"],
                            "model_path": str(path),
                            "eager": not a.compiled,
                            "time": self.started,
                            "child_ok": res is not None,
                            "log": log_name,
                            "result": sub,
                        }
                        (self.state / "correctness" / f"{name}.json").write_text(
                            json.dumps(doc, indent=2)
                        )
                        self.this_run.add(f"correctness/{name}")
                        for row in self.correctness_rows([doc]):
                            if row["verdict"] != "PASS":
                                self.fail(
                                    f"correctness {name} {row['sched']}: {row['reason']}",
                                    self.state / "logs" / f"{log_name}.log",
                                )
                    self.write_outputs()

    def phase_bench(self) -> None:
        a = self.args
        for kind in a.models:
            path = self.model_path(kind)
            if path is None:
                self.write_outputs()
                continue
            for runner in a.runners:
                name = f"bench-{kind}-{runner}"
                cmd = [
                    sys.executable,
                    str(BENCH_SCRIPT),
                    "--model",
                    str(path),
                    "--out",
                    str(self.state / "bench"),
                    "--tag",
                    name,
                    "--no-hf",
                ]
                if a.bench_quick:
                    cmd.append("--quick")
                else:
                    cmd += ["--n", *map(str, a.bench_n)]
                if self.device == "cuda":
                    opts = {
                        "dtype": a.bench_dtype,
                        "kv_cache_memory_bytes": None,
                        "gpu_memory_utilization": a.bench_gpu_util,
                    }
                    cmd += ["--engine-opts", json.dumps(opts)]
                cmd += shlex.split(a.bench_extra or "")
                log_file = self.state / "logs" / f"{name}.log"
                json_file = self.state / "bench" / f"{name}.json"
                json_file.unlink(missing_ok=True)
                log(f"start {name}: {shlex.join(cmd[1:])}")
                t0 = time.perf_counter()
                rc = self.spawn(cmd, self.child_env(runner), log_file)
                if rc is None:
                    self.write_outputs()
                    continue
                text = log_file.read_text(errors="replace")
                m = re.search(r"runner (v\d)", text)
                meta = {
                    "model": kind,
                    "runner": runner,
                    "rc": rc,
                    "wall_s": time.perf_counter() - t0,
                    "engine_runner": m.group(1) if m else None,
                    "time": self.started,
                    "command": shlex.join(cmd[1:]),
                }
                (self.state / "bench" / f"{name}.meta.json").write_text(json.dumps(meta, indent=2))
                self.this_run.add(f"bench/{name}")
                if rc != 0 or not json_file.is_file():
                    why = "killed at its time limit" if rc == -9 else f"exit status {rc}"
                    self.fail(f"{name}: bench_async.py {why}", log_file)
                    log(f"FAILED {name} (exit {rc})")
                elif meta["engine_runner"] != runner:
                    self.fail(
                        f"{name}: engine runner {meta['engine_runner']!r}, expected {runner!r}",
                        log_file,
                    )
                else:
                    log(f"done {name} in {meta['wall_s']:.0f}s")
                self.write_outputs()

    # ---------------------------------------------------------------- summary
    def run(self) -> int:
        phase = self.args.phase
        log(f"device {self.device}; cache {self.cache}; outputs to {self.out}")
        if phase in ("build", "all"):
            self.phase_build()
        if phase in ("correctness", "all"):
            self.phase_correctness()
        if phase in ("bench", "all"):
            self.phase_bench()
        text = self.write_outputs()
        print()
        print(text, end="")
        log(
            f"wrote {self.out / OUT_SUMMARY}, {OUT_JSON}, {OUT_LOGS} "
            f"({time.perf_counter() - self.t0:.0f}s)"
        )
        return 1 if self.failures else 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--phase", choices=("build", "correctness", "bench", "all"), default="all")
    p.add_argument(
        "--models",
        nargs="+",
        choices=KINDS + TEST_KINDS,
        default=None,
        help="default: qwen3-0.6b (tiny with --cpu-smoke)",
    )
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS))
    p.add_argument(
        "--scheds",
        nargs="+",
        choices=tuple(SCHEDS),
        default=list(SCHEDS),
        help="correctness engines: default scheduling and/or chunked "
        "(max_num_batched_tokens=256, max_num_seqs=8)",
    )
    p.add_argument(
        "--cache-dir",
        default=os.environ.get("GENLM_GPU_CACHE", "/tmp/genlm_gpu_models"),
        help="models, HF references, per-step results and logs (persist between runs)",
    )
    p.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "results" / "gpu_check"),
        help="where the summary goes when $OUT is not set",
    )
    p.add_argument("--force-build", action="store_true", help="rebuild models even if present")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=36,
        help="random base prompts (duplicates, extensions and a prefix family are added)",
    )
    p.add_argument("--max-prompt-len", type=int, default=500)
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=4.0,
        help="kv_cache_memory_bytes of each correctness engine",
    )
    p.add_argument(
        "--gpu-util",
        type=float,
        default=0.85,
        help="cap on gpu_memory_utilization of correctness engines (lowered to the "
        "free fraction when an earlier engine's memory was not released)",
    )
    p.add_argument(
        "--split-dtypes",
        action="store_true",
        help="one vLLM subprocess per dtype (default: one per runner, engines built "
        "one after the other)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="correctness engines with vLLM's default torch.compile + CUDA graphs "
        "(default: enforce_eager=True, faster to start)",
    )
    p.add_argument("--tol-fp32", type=float, default=1e-3, help="float32: max |d| (nats)")
    p.add_argument("--tol-bf16-max", type=float, default=0.25, help="bfloat16: max |d| (nats)")
    p.add_argument("--tol-bf16-mean", type=float, default=0.02, help="bfloat16: mean |d| (nats)")
    p.add_argument(
        "--bf16-floor-factor",
        type=float,
        default=2.0,
        help="a bfloat16 row above the absolute tolerances still passes if its max and "
        "mean |d| are within this factor of the model's bf16 noise floor (HF bf16 "
        "vs HF fp32 on the same prompts; needs both dtypes); 0 disables",
    )
    p.add_argument("--bench-n", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--bench-dtype", choices=DTYPES, default="bfloat16")
    p.add_argument(
        "--bench-gpu-util",
        type=float,
        default=0.4,
        help="gpu_memory_utilization of each of bench_async's two vLLM engines",
    )
    p.add_argument(
        "--bench-extra",
        default="--logprobs-rows 32",
        help="extra bench_async.py arguments (one shell-quoted string)",
    )
    p.add_argument("--bench-quick", action="store_true", help="bench_async.py --quick")
    p.add_argument("--child-timeout", type=float, default=1800, help="seconds per subprocess")
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds for the whole invocation: a subprocess still running 15 s "
        "before it is killed (and reported), later steps are skipped, so the "
        "outputs are complete before an outside limit hits (default: 570 when "
        "$OUT is set, i.e. under a 10-minute limit per command; else none)",
    )
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="CPU self-test: tiny model, float32, runner v1, bench --quick",
    )
    p.add_argument("--_child", choices=tuple(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--_spec", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.models = args.models or ["tiny"]
        args.dtypes, args.runners = ["float32"], ["v1"]
        args.bench_quick = True
        args.bench_extra = ""
        args.kv_cache_gib = 0.25
        args.max_model_len = min(args.max_model_len, 512)
    args.models = args.models or ["qwen3-0.6b"]
    if args.time_limit is None:
        args.time_limit = 570.0 if os.environ.get("OUT") else 0.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args._child:
        return run_child_main(args._child, args._spec, args._result)
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
