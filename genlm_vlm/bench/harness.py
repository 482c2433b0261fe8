"""The benchmark's machinery: one process per system, alternating repetitions, medians.

* :class:`SystemProcess`: a system (an engine and the jobs it runs) in a process of its own,
  driven by JSON lines. Two vLLM engines in one CUDA process break each other, and a vLLM
  baseline must not share a process with genlm-backend's import side effects, so every system of
  a comparison runs apart. The child side is :func:`serve` (``python -m
  genlm_vlm.bench.harness --factory MOD:FN --spec JSON --result-fd FD``).
* :func:`alternate`: one untimed warm-up of every job, then repetitions whose order rotates.
* :func:`median_rate`: the median of ``work / seconds`` over repetitions.
* :func:`fake_system`: a system without an engine, for tests of this module.

Nothing here imports torch or vLLM.
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

#: The directory that holds the ``genlm_vlm`` package (put first on a child's ``PYTHONPATH``).
PACKAGE_PARENT = pathlib.Path(__file__).resolve().parent.parent.parent

#: Seconds the parent waits for one result line of a system (an engine build included).
RESULT_TIMEOUT_S = 1800.0


def setup_environment() -> None:
    """What every benchmark process sets before vLLM is imported (the caller's values win):
    the engine core in this process, quiet logs, no tokenizer threads."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the package first on ``PYTHONPATH`` and ``extra`` set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), env.get("PYTHONPATH")]))
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(extra or {})
    return env


# ------------------------------------------------------------------------------ child side
def load_factory(spec: str) -> Callable[[dict[str, Any]], Any]:
    """``"package.module:function"`` -> the function."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"factory must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def serve(factory: str, spec: dict[str, Any], result_fd: int, commands: Any = None) -> int:
    """Build ``factory(spec)`` (an object with ``info() -> dict``, ``run(job, **kwargs) -> dict``
    and ``close()``), answer ``{"ready": true, "info": ...}``, then one result line per command
    line read from ``commands`` (default stdin): ``{"op": "run", "job": ..., ...}`` or
    ``{"op": "quit"}``. A failure is answered ``{"error": traceback}``; the system stays up."""
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
                res = system.run(cmd.pop("job"), **cmd)
                send(res)
            except Exception:  # noqa: BLE001 - reported to the parent
                send({"error": traceback.format_exc()})
    finally:
        system.close()
    return 0


# ------------------------------------------------------------------------------ parent side
class SystemFailed(RuntimeError):
    """A system's process failed: its build, a job, or the process itself."""


class SystemProcess:
    """A system in its own process: commands on its stdin, one JSON result per line on a private
    pipe, its output in ``log_dir/<name>.log``. ``start()`` spawns it, ``wait_ready()`` waits for
    its build (several systems may build at once), ``run()`` runs one job."""

    def __init__(self, name: str, factory: str, spec: Mapping[str, Any], log_dir: pathlib.Path,
                 env: Mapping[str, str] | None = None) -> None:
        self.name, self.factory, self.spec = name, factory, dict(spec)
        self.log_path = pathlib.Path(log_dir) / f"{name}.log"
        self.env = dict(env) if env is not None else child_env()
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self.ready_s: float | None = None

    def start(self) -> SystemProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        rfd, wfd = os.pipe()
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self._t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "genlm_vlm.bench.harness", "--factory", self.factory,
               "--spec", json.dumps(self.spec), "--result-fd", str(wfd)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                                     pass_fds=(wfd,), env=self.env, text=True)
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
            why = "timed out" if not ready else f"exit status {code}"
            raise SystemFailed(f"system {self.name} gave no result ({why}); its log {self.log_path} ends:\n"
                               f"{self.tail()}")
        res = json.loads(line)
        if "error" in res:
            raise SystemFailed(f"system {self.name} failed:\n{res['error']}")
        return res

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def run(self, job: str, timeout: float = RESULT_TIMEOUT_S, **kwargs: Any) -> dict[str, Any]:
        if self.proc is None or self.proc.stdin is None:
            raise SystemFailed(f"system {self.name} is not started")
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


def start_systems(systems: Sequence[SystemProcess], timeout: float = RESULT_TIMEOUT_S) -> None:
    """Start every system, then wait until each is built; a failure closes them all and raises."""
    try:
        for s in systems:
            s.start()
        for s in systems:
            s.wait_ready(timeout)
    except BaseException:
        for s in systems:
            s.close(timeout=10)
        raise


# ------------------------------------------------------------------------------ repetitions
def rotation(labels: Sequence[str], rep: int) -> list[str]:
    """The order of repetition ``rep``: ``labels`` rotated by ``rep`` places."""
    k = rep % len(labels) if labels else 0
    return list(labels[k:]) + list(labels[:k])


def alternate(jobs: Mapping[str, Callable[[int], dict[str, Any]]], reps: int, *, warmup: bool = True,
              tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run every job once untimed (``warmup``, with repetition number 0), then ``reps`` rounds
    (numbers 1..reps), the jobs' order rotating from one round to the next; ``tick`` is called
    after each job. Returns ``{"warm": {label: result}, "runs": {label: [result, ...]},
    "order": [[label, ...] per round]}``."""
    labels = list(jobs)
    warm: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    order: list[list[str]] = []
    if warmup:
        for label in labels:
            warm[label] = jobs[label](0)
            if tick is not None:
                tick()
    for rep in range(reps):
        order.append(rotation(labels, rep))
        for label in order[-1]:
            runs[label].append(jobs[label](rep + 1))
            if tick is not None:
                tick()
    return {"warm": warm, "runs": runs, "order": order}


def median_rate(results: Sequence[Mapping[str, Any]], work_key: str, time_key: str = "wall_s") -> float | None:
    """Median over ``results`` of ``work / time`` (None without a timed result)."""
    rates = [r[work_key] / r[time_key] for r in results if r.get(time_key)]
    return statistics.median(rates) if rates else None


def round_ratios(main: Sequence[Mapping[str, Any]], other: Sequence[Mapping[str, Any]],
                 work_key: str) -> list[float]:
    """Per round (the i-th result of each system: the same round of :func:`alternate`), the
    first system's rate (``work / wall``) over the second's; rounds where either has no
    timed rate or no work are left out."""
    out = []
    for a, b in zip(main, other, strict=False):
        if a.get("wall_s") and b.get("wall_s") and a.get(work_key) and b.get(work_key):
            out.append((a[work_key] / a["wall_s"]) / (b[work_key] / b["wall_s"]))
    return out


# ------------------------------------------------------------------------------ a fake system
class _FakeSystem:
    """No engine: ``run("work", units=k)`` does ``k`` units of arithmetic and reports them;
    ``run("fail")`` raises. ``spec`` may carry ``fail_build`` and ``scale`` (loops per unit)."""

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
        acc = sum(i * i for i in range(units * int(self.spec.get("scale", 1000))))
        return {"wall_s": max(time.perf_counter() - t0, 1e-9), "units": units, "pid": os.getpid(),
                "calls": self.calls, "acc": acc % 97}

    def close(self) -> None:
        pass


def fake_system(spec: dict[str, Any]) -> _FakeSystem:
    """A :class:`_FakeSystem` (factory ``genlm_vlm.bench.harness:fake_system``)."""
    return _FakeSystem(spec)


def _main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve one benchmark system (see SystemProcess).")
    p.add_argument("--factory", required=True)
    p.add_argument("--spec", default="{}")
    p.add_argument("--result-fd", type=int, required=True)
    args = p.parse_args(argv)
    setup_environment()
    return serve(args.factory, json.loads(args.spec), args.result_fd)


if __name__ == "__main__":
    sys.exit(_main())
