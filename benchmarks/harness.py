"""What the benchmark scripts share: environment, engine options, model builders, one process per
system, alternating repetitions, ratio tables and result files.

* :func:`setup_environment`: the variables every script sets before vLLM is imported (in-process
  engine core, quiet logs, no tokenizer threads) and the checkout on ``sys.path``.
* :func:`plain_engine_opts`: the options a plain ``vllm.LLM`` baseline gets, so that it runs
  with exactly what genlm_vlm gives its own engine (its defaults, plus the CPU build's).
* :func:`build_tiny_model`: a ``genlm_vlm.testing`` model built in a subprocess (cached).
* :class:`SystemProcess` and :func:`serve`: one system (an engine and what it runs) in its own
  process, driven by JSON lines; on CUDA two vLLM engines in one process break each other, so
  every system of a comparison lives in a process of its own. :func:`fake_system` is a system
  with no engine, for the harness's own tests.
* :func:`alternate`: a warm-up of every system, then repetitions whose order rotates.
* :func:`median_rate`, :func:`markdown_table`, :func:`append_jsonl`: summaries and files.

Run a system by hand: ``python benchmarks/harness.py --serve --factory MOD:FN --spec JSON``
(commands on stdin, results on ``--result-fd``; see :func:`serve`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import select
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
HARNESS = pathlib.Path(__file__).resolve()

#: Seconds a parent waits for one result line of a system (an engine build included).
RESULT_TIMEOUT_S = 1800.0


def setup_environment(root_on_path: bool = True) -> None:
    """Set what every benchmark sets before vLLM is imported (callers' own values win)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if root_on_path and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def child_env(extra: Mapping[str, str] | None = None, drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``, ``extra`` set and
    the names in ``drop`` removed (e.g. ``VLLM_USE_V2_MODEL_RUNNER``, as a fresh shell has it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for name in drop:
        env.pop(name, None)
    env.update(extra or {})
    return env


def plain_engine_opts(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """genlm_vlm's engine defaults (plus the CPU build's), then ``extra``: what a plain
    ``vllm.LLM`` baseline gets so that it runs with the options genlm_vlm's engine has."""
    from genlm_vlm.engine import CPU_ENGINE_OPTS, DEFAULT_ENGINE_OPTS, is_cpu_platform

    opts = dict(DEFAULT_ENGINE_OPTS)
    if is_cpu_platform():
        opts.update(CPU_ENGINE_OPTS)
    opts.update(extra or {})
    return opts


def build_tiny_model(kind: str) -> str:
    """Path of ``genlm_vlm.testing.tiny_model_path(kind)``, built (once; cached) in a
    subprocess so the caller stays small (``demo``: the model shipped in the package)."""
    if kind == "demo":
        return str(ROOT / "genlm_vlm" / "data" / "demo-model")
    code = "from genlm_vlm.testing import tiny_model_path; import sys; print(tiny_model_path(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, kind], capture_output=True, text=True,
                          env=child_env(), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"building model {kind!r} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


# =========================================================================== process per system
def load_factory(spec: str) -> Callable[[dict[str, Any]], Any]:
    """``"package.module:function"`` -> the function (the checkout is on ``sys.path``)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"factory must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def serve(factory: str, spec: dict[str, Any], result_fd: int, commands: Any = None) -> int:
    """The child side of :class:`SystemProcess`: build ``factory(spec)`` (an object with
    ``info() -> dict``, ``run(job: str, **kwargs) -> dict`` and ``close()``), answer
    ``{"ready": true, "info": ...}``, then one result line per command line read from
    ``commands`` (default stdin): ``{"op": "run", "job": ..., ...}`` or ``{"op": "quit"}``.
    Errors are sent as ``{"error": traceback}``; the system stays up for the next command."""
    out = os.fdopen(result_fd, "w", buffering=1)

    def send(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj, default=str) + "\n")
        out.flush()

    try:
        system = load_factory(factory)(spec)
        send({"ready": True, "info": system.info()})
    except BaseException:  # noqa: BLE001 - reported to the parent
        send({"error": traceback.format_exc()})
        return 1
    try:
        for line in commands if commands is not None else sys.stdin:
            cmd = json.loads(line)
            if cmd.pop("op", None) == "quit":
                break
            try:
                job = cmd.pop("job")
                t0 = time.perf_counter()
                res = system.run(job, **cmd)
                res.setdefault("job_s", time.perf_counter() - t0)
                send(res)
            except Exception:  # noqa: BLE001 - reported to the parent
                send({"error": traceback.format_exc()})
    finally:
        system.close()
    return 0


class SystemError_(RuntimeError):
    """A system's process failed (its build, a job, or the process itself)."""


class SystemProcess:
    """A system in its own process: commands on its stdin, one JSON result per line on a
    private pipe, its log in ``log_dir/<name>.log``. ``start()`` spawns it; ``wait_ready()``
    waits for the build (so several systems can build at once)."""

    def __init__(self, name: str, factory: str, spec: dict[str, Any], log_dir: pathlib.Path,
                 env: Mapping[str, str] | None = None, python: str | None = None) -> None:
        self.name, self.factory, self.spec = name, factory, dict(spec)
        self.log_path = pathlib.Path(log_dir) / f"{name}.log"
        self.env = dict(env) if env is not None else child_env()
        self.python = python or sys.executable
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self.ready_s: float | None = None

    def start(self) -> SystemProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        rfd, wfd = os.pipe()
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self._t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [self.python, str(HARNESS), "--serve", "--factory", self.factory, "--spec", json.dumps(self.spec),
             "--result-fd", str(wfd)],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, pass_fds=(wfd,), env=self.env,
            text=True, cwd=ROOT,
        )
        os.close(wfd)
        self._results = os.fdopen(rfd, "r")
        return self

    def wait_ready(self, timeout: float = RESULT_TIMEOUT_S) -> dict[str, Any]:
        self.info = self._read(timeout)["info"]
        self.ready_s = time.perf_counter() - self._t0
        return self.info

    def _read(self, timeout: float) -> dict[str, Any]:
        ready, _, _ = select.select([self._results], [], [], max(0.0, timeout))
        line = self._results.readline() if ready else ""
        if not line:
            code = self.proc.poll() if self.proc else None
            why = "timed out" if not ready else f"exit {code}"
            raise SystemError_(f"system {self.name} gave no result ({why}); log {self.log_path}:\n{self.tail()}")
        res = json.loads(line)
        if "error" in res:
            raise SystemError_(f"system {self.name} failed:\n{res['error']}\nlog tail:\n{self.tail()}")
        return res

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def run(self, job: str, timeout: float = RESULT_TIMEOUT_S, **kwargs: Any) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None, "start() first"
        self.proc.stdin.write(json.dumps({"op": "run", "job": job, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self, timeout: float = 120.0) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._results.close()
        self._log.close()
        self.proc = None


def start_systems(systems: Sequence[SystemProcess], *, together: bool = True,
                  timeout: float = RESULT_TIMEOUT_S) -> None:
    """Start every system and wait until each is built: all at once (``together``), or one
    after the other so that builds do not compete. A failure closes every system and raises."""
    try:
        if together:
            for s in systems:
                s.start()
            for s in systems:
                s.wait_ready(timeout)
        else:
            for s in systems:
                s.start().wait_ready(timeout)
    except BaseException:
        for s in systems:
            s.close(timeout=10)
        raise


# =========================================================================== repetitions
def rotation(labels: Sequence[str], rep: int) -> list[str]:
    """The order of repetition ``rep``: ``labels`` rotated by ``rep`` places."""
    k = rep % len(labels) if labels else 0
    return list(labels[k:]) + list(labels[:k])


def alternate(jobs: Mapping[str, Callable[[], dict[str, Any]]], reps: int, *, warmup: bool = True,
              deadline: float | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every job once untimed (``warmup``), then ``reps`` timed rounds, the jobs' order
    rotating from one round to the next. Returns ``{"warm": {label: result}, "runs": {label:
    [result, ...]}, "complete": bool}``; a round is not started after ``deadline``
    (``time.monotonic()`` value), which leaves ``complete`` False."""
    labels = list(jobs)
    warm: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    if warmup:
        for label in labels:
            warm[label] = jobs[label]()
    for rep in range(reps):
        if deadline is not None and time.monotonic() > deadline:
            return {"warm": warm, "runs": runs, "complete": False}
        for label in rotation(labels, rep):
            res = jobs[label]()
            runs[label].append(res)
            if log is not None:
                log(f"rep {rep + 1}/{reps} {label}: {res.get('wall_s', float('nan')):.3f}s")
    return {"warm": warm, "runs": runs, "complete": True}


def median_rate(results: Sequence[Mapping[str, Any]], work_key: str, time_key: str = "wall_s") -> float | None:
    """Median over results of ``work / time`` (None without results)."""
    rates = [r[work_key] / r[time_key] for r in results if r.get(time_key)]
    return statistics.median(rates) if rates else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str | tuple[str, str]]) -> str:
    """A markdown table of ``rows`` with ``columns`` (a key, or ``(key, header)``)."""
    cols = [(c, c) if isinstance(c, str) else c for c in columns]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)


def append_jsonl(path: pathlib.Path, obj: Mapping[str, Any]) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(obj, default=str) + "\n")


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    path = pathlib.Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill: the rest is still good
                continue
    return out


# =========================================================================== a system for tests
class _FakeSystem:
    """No engine: ``run("work", units=k)`` does ``k`` units of arithmetic and reports them;
    ``run("fail")`` raises; ``info()`` says which process it is in. Its ``spec`` may carry
    ``fail_build`` (raise while building) and ``scale`` (units of work per unit)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        if spec.get("fail_build"):
            raise RuntimeError("fake build failure (spec asked for it)")
        self.spec = spec
        self.calls = 0

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "spec": self.spec}

    def run(self, job: str, **kw: Any) -> dict[str, Any]:
        self.calls += 1
        if job == "fail":
            raise ValueError("fake job failure")
        units = int(kw.get("units", 1))
        t0 = time.perf_counter()
        acc = 0
        for i in range(units * int(self.spec.get("scale", 1000))):
            acc += i * i
        return {"wall_s": max(time.perf_counter() - t0, 1e-9), "units": units, "pid": os.getpid(),
                "calls": self.calls, "acc": acc % 97}

    def close(self) -> None:
        pass


def fake_system(spec: dict[str, Any]) -> _FakeSystem:
    return _FakeSystem(spec)


def _main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve one benchmark system (see SystemProcess).")
    p.add_argument("--serve", action="store_true", required=True)
    p.add_argument("--factory", required=True)
    p.add_argument("--spec", default="{}")
    p.add_argument("--result-fd", type=int, required=True)
    args = p.parse_args(argv)
    setup_environment()
    return serve(args.factory, json.loads(args.spec), args.result_fd)


if __name__ == "__main__":
    sys.exit(_main())
