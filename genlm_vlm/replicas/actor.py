"""One replica: an :class:`~genlm_vlm.AsyncVirtualLM` inside a Ray actor process.

:class:`ReplicaWorker` is a plain class; the pool wraps it with ``ray.remote`` (so importing this
module needs neither Ray nor vLLM). Every method is ``async``: Ray runs them on the actor's one
event loop, where the model's batcher merges the concurrent calls of all driver groups into
shared engine steps; blocking calls go to a thread. Rows leave as float32 numpy arrays, which
Ray writes into its object store once (the driver reads them there in place).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import pickle
import tempfile
import warnings
from typing import Any

#: KV cache per replica on the CPU build unless ``engine_opts`` size it (vLLM's CPU default,
#: ``gpu_memory_utilization=0.3`` of the node, would be claimed by every replica process).
CPU_REPLICA_KV_BYTES = 1 << 30


def pin_process(cpus: list[int]) -> None:
    """Bind every thread of this process (and the threads it starts later) to ``cpus``."""
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


class ReplicaWorker:
    """The actor body: builds the engine in :meth:`start`, then serves rows, samples, LoRA calls."""

    def __init__(self, index: int, model: str, engine_opts: dict[str, Any] | None,
                 lm_kwargs: dict[str, Any], cpus: list[int] | None = None) -> None:
        self.index = index
        self._model = model
        self._engine_opts = dict(engine_opts or {})
        self._lm_kwargs = dict(lm_kwargs)
        self._cpus = cpus
        self.lm: Any = None
        # Test hook (see hold/held/release): parks logprob calls until released.
        self._gate: asyncio.Event | None = None
        self._parked = 0
        self._parked_cond: asyncio.Condition | None = None

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with this
        return f"genlm_vlm-replica-{self.index}"

    # ------------------------------------------------------------------ lifecycle
    def _build(self) -> Any:
        if self._cpus:
            pin_process(self._cpus)
        from ..engine import is_cpu_platform
        from ..vllm_lm import AsyncVirtualLM

        opts = dict(self._engine_opts)
        if is_cpu_platform() and "kv_cache_memory_bytes" not in opts and "gpu_memory_utilization" not in opts:
            opts["kv_cache_memory_bytes"] = CPU_REPLICA_KV_BYTES
        return AsyncVirtualLM.from_name(self._model, opts, **self._lm_kwargs)

    async def start(self) -> dict[str, Any]:
        """Build the engine; returns what the driver needs to know about it."""
        self.lm = await asyncio.to_thread(self._build)
        return {
            "pid": os.getpid(),
            "node": _node_id(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "info": dataclasses.asdict(self.lm.engine_info),
            "vocab_size": self.lm.vocab_size,
            "max_model_len": self.lm.max_model_len,
        }

    async def vocabulary(self) -> dict[str, Any]:
        """The tokenizer (as its saved files, else pickled), each token id's bytes and the ids of
        the special and added tokens."""
        tok = self.lm.tokenizer
        out: dict[str, Any] = {"byte_strings": list(self.lm._byte_strings), "special_ids": list(self.lm._special_ids)}
        try:
            with tempfile.TemporaryDirectory() as tmp:
                tok.save_pretrained(tmp)
                out["files"] = {p.name: p.read_bytes() for p in pathlib.Path(tmp).iterdir() if p.is_file()}
        except Exception:  # noqa: BLE001 - a tokenizer that cannot save itself travels pickled
            out["pickle"] = pickle.dumps(tok)
        return out

    async def cleanup(self) -> None:
        if self.lm is not None:
            await asyncio.to_thread(self.lm.cleanup)

    async def pid(self) -> int:
        return os.getpid()

    async def ping(self) -> bool:
        """The pool's health check: answered on the actor's event loop, touches nothing but a
        flag. Raises :class:`~genlm_vlm.EngineDiedError` when the engine loop has
        stopped after an error, so the pool takes this replica for dead (and replaces it)."""
        driver = getattr(self.lm, "_driver", None)
        if driver is not None and driver.failure is not None:
            driver.check_alive()
        return True

    # ------------------------------------------------------------------ rows
    async def logprobs(self, queries: list[tuple[int, ...]], lora_name: str | None) -> list[Any]:
        """Rows of ``queries``: one float32 numpy ``[V]`` per query, each a view of the row the
        model handed out (its own copy), so Ray writes each straight into the object store as an
        out-of-band buffer: no stacking copy. Batched with concurrent calls."""
        if self._gate is not None and not self._gate.is_set():
            await self._park()
        rows = await asyncio.gather(*(self.lm.next_token_logprobs(q, lora_name) for q in queries))
        return [r.numpy() for r in rows]

    async def logprobs_sync(self, queries: list[tuple[int, ...]], lora_name: str | None, chunk_size: int) -> Any:
        """Rows through the model's blocking path (chunked, halves a chunk on out-of-memory)."""
        rows = await asyncio.to_thread(
            self.lm.batch_next_token_logprobs_sync, queries, lora_name, chunk_size=chunk_size
        )
        return rows.numpy()

    async def sample(self, specs: list[tuple[Any, ...]], lora_name: str | None) -> list[list[int]]:
        """``specs``: ``(ids, max_tokens, eos ids, temperature, seed)`` each; context-limit
        warnings are the driver's to give."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = await asyncio.gather(*(
                self.lm.sample(ids, max_tokens, list(eos), temperature, seed, lora_name)
                for ids, max_tokens, eos, temperature, seed in specs
            ))
        return [list(o) for o in outs]

    # ------------------------------------------------------------------ controllers
    async def smc(self, prompt: list[int], constraint: Any, n_particles: int, max_tokens: int,
                  kwargs: dict[str, Any]) -> Any:
        """``lm.smc(...)`` here: a burst on this replica's engine thread. An empty posterior's
        warning is the driver's to give (after its critic)."""
        from ..smc.algorithm import EmptyPosteriorWarning

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmptyPosteriorWarning)
            result = await self.lm.smc(prompt, constraint, n_particles, max_tokens, **kwargs)
        result.stats["replica"] = self.index
        return result

    async def run_controller(self, prompt: list[int], controller: Any, lora_name: str | None, start: Any,
                             engine_path: str = "auto") -> Any:
        return await self.lm.run_controller(prompt, controller, lora_name=lora_name, start=start,
                                            engine_path=engine_path)

    # ------------------------------------------------------------------ housekeeping
    async def add_lora(self, path: str, name: str) -> None:
        await asyncio.to_thread(self.lm.add_new_lora, path, name)

    async def remove_lora(self, name: str) -> None:
        if name in self.lm.lora_names:
            await asyncio.to_thread(self.lm.remove_lora, name)

    async def clear_cache(self) -> None:
        await asyncio.to_thread(self.lm.clear_cache)

    async def release_sessions(self) -> int:
        return await asyncio.to_thread(self.lm.release_sessions)

    async def stats(self) -> dict[str, Any]:
        return self.lm.stats

    # ------------------------------------------------------------------ test hook
    async def hold(self) -> None:
        """Park every later :meth:`logprobs` call until :meth:`release` (tests: in-flight calls)."""
        self._gate = asyncio.Event()
        self._parked_cond = asyncio.Condition()
        self._parked = 0

    async def held(self, n: int = 1) -> int:
        """Return once at least ``n`` calls are parked; returns how many."""
        assert self._parked_cond is not None, "call hold() first"
        async with self._parked_cond:
            await self._parked_cond.wait_for(lambda: self._parked >= n)
        return self._parked

    async def release(self) -> None:
        if self._gate is not None:
            self._gate.set()
            self._gate = None

    async def _park(self) -> None:
        gate, cond = self._gate, self._parked_cond
        assert gate is not None and cond is not None
        async with cond:
            self._parked += 1
            cond.notify_all()
        await gate.wait()


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - informational only
        return None
