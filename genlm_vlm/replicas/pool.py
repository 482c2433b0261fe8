"""``ReplicaPool``: the :class:`~genlm_vlm.AsyncLM` API served by N Ray actors, one engine each.

Driver side: awaits of one event-loop pass are deduplicated and grouped by an
:class:`~genlm_vlm.batching.AutoBatcher` (streaming mode); each group is routed query by query
(:class:`~.routing.Router`) and sent as one actor call per (replica, adapter). A call's rows come
back as float32 numpy rows in one Ray object (written into the object store once by the actor,
read in place here); each awaiter gets its own torch copy of its row. Sync calls route the same way and block on
``ray.get``. A replica that dies fails the awaiters of its in-flight calls with
:class:`~.routing.ReplicaDiedError` and leaves routing until :meth:`ReplicaPool.restart_replica`
or, with ``auto_restart=True``, until the health checker (:mod:`.health`) has replaced it; the
checker's pings also find replicas that die while idle.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import numbers
import os
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..batching import AutoBatcher, KeyPlan
from ..serving import Query, ServingLM
from . import launch
from .calls import CallMixin
from .health import HealthChecker, check_interval
from .routing import ReplicaDiedError, Router

logger = logging.getLogger(__name__)


def _own_row(row: np.ndarray) -> torch.Tensor:
    """The awaiter's own tensor: a copy of its row of the (read-only, shared) Ray object."""
    return torch.from_numpy(np.array(row, dtype=np.float32, copy=True))


class ReplicaPool(CallMixin, ServingLM):
    """N replicas of one model, each a Ray actor holding its own engine, behind one ``AsyncLM``.

    Same methods as :class:`~genlm_vlm.AsyncVirtualLM` (async and sync rows, scoring, top-k,
    sampling, LoRA, ``stats``, ``cleanup``, ``with`` / ``async with``). Rows are float32 CPU
    tensors ``[V]``; every caller gets its own copy (the batch array in Ray's object store is
    read-only and shared; a view would pin the whole batch for as long as one row lived).
    A query goes to the replica that holds its session or longest cached prefix (else the
    least loaded); a sample to the replica its prompt routes to. Blocking calls send at most
    ``chunk_size`` distinct prompts per round trip (each replica halves its share on
    out-of-memory, as ``AsyncVirtualLM`` does). Adapters are registered on every live replica
    and on replicas restarted later. Build with :meth:`from_name`.

    Args:
        model_name: HF name or local path, loaded by every replica.
        num_replicas: number of Ray actors, each with its own engine (which may itself be
            tensor parallel through ``engine_opts``).
        engine_opts: ``vllm.LLM`` options of every replica. On the CPU build a replica gets
            ``kv_cache_memory_bytes=1 GiB`` unless these set a KV size (vLLM's CPU default takes
            30% of the node per engine process).
        ray_address: ``None`` starts a local Ray instance (unless Ray is initialised already);
            an address (``"auto"``, ``"ray://host:10001"``, ...) joins that cluster.
        actor_options: options of every replica actor (``ray.remote(...).options``), over the
            defaults: ``num_cpus`` = its pinned cores (1), or ``num_gpus`` = tensor-parallel size
            where the cluster has GPUs; ``max_concurrency=1000``; ``runtime_env["env_vars"]``
            merged key by key.
        pin_cpus: ``True``: replica ``i`` is bound to its own core(s) (``num_cpus`` of them,
            ``sched_setaffinity`` on the actor process and ``VLLM_CPU_OMP_THREADS_BIND``);
            ``False``: no binding; a list: the cores of each replica; ``None`` (default): ``True``
            when the pool started a local Ray instance on a machine without GPUs.
        ray_init_opts: extra ``ray.init`` options when the pool starts Ray.
        start_timeout: seconds for the replicas to build their engines (a cluster without the
            resources they ask for raises ``TimeoutError`` then).
        max_routes, min_match, balance_threshold: routing table bound and policy, see
            :class:`~genlm_vlm.replicas.Router`.
        health_interval_s: seconds between health pings of the live replicas (one cheap actor
            call each, from one daemon thread per pool); a replica whose actor is found dead,
            idle or busy, leaves routing as if a call had failed on it. ``None``: no checks (an
            idle death is then noticed at the replica's next call). Default 5 s.
        auto_restart: replace every dead replica (found by a ping or by a failed call) with a
            fresh actor, as :meth:`restart_replica` does (same options, adapters registered
            again); a failed restart is logged and retried after a growing pause (up to 60 s).
            Needs ``health_interval_s``. Can be changed later through :attr:`auto_restart`.
        lm_kwargs: :meth:`AsyncVirtualLM.from_name` keywords (``sessions``, ``max_sessions``,
            ``batch_size``, ``cache_size``, ``chunk_size``, ...) for every replica;
            ``batch_size``, ``timeout`` and ``chunk_size`` also set the driver's grouping.
    """

    #: Accepted where genlm-backend's ``AsyncVirtualLM`` is (e.g. llamppl), as AsyncVirtualLM is.
    genlm_backend_class = "AsyncVirtualLM"
    _context_limit_hint = (
        "Shorten the prompt, or build the pool with a larger max_model_len "
        "(engine_opts={'max_model_len': N})."
    )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_name(
        cls,
        model_name: str | os.PathLike[str],
        num_replicas: int = 2,
        engine_opts: dict[str, Any] | None = None,
        ray_address: str | None = None,
        **kwargs: Any,
    ) -> ReplicaPool:
        """Start ``num_replicas`` Ray actors, each building ``AsyncVirtualLM.from_name(model_name,
        engine_opts, **lm_kwargs)`` in its own process; see :class:`ReplicaPool` for the options."""
        return cls(model_name, num_replicas, engine_opts, ray_address, **kwargs)

    def __init__(
        self,
        model_name: str | os.PathLike[str],
        num_replicas: int = 2,
        engine_opts: dict[str, Any] | None = None,
        ray_address: str | None = None,
        *,
        actor_options: dict[str, Any] | None = None,
        pin_cpus: bool | Sequence[Sequence[int]] | None = None,
        ray_init_opts: dict[str, Any] | None = None,
        start_timeout: float = 900.0,
        max_routes: int = 100_000,
        min_match: float = 0.5,
        balance_threshold: int = 32,
        health_interval_s: float | None = 5.0,
        auto_restart: bool = False,
        **lm_kwargs: Any,
    ) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, numbers.Integral) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        if engine_opts is not None and not isinstance(engine_opts, dict):
            raise TypeError(f"engine_opts must be a dict of vllm.LLM options, got {type(engine_opts).__name__}")
        n = int(num_replicas)
        interval = check_interval(health_interval_s)
        if auto_restart and interval is None:
            raise ValueError("auto_restart=True needs health checks: pass health_interval_s (seconds)")
        self._init_options(lm_kwargs)
        model = os.fspath(model_name)
        if ray_address is None:  # the model must be here: fail before Ray starts
            from ..engine.build import resolve_model

            resolve_model(model, (engine_opts or {}).get("revision"), (engine_opts or {}).get("download_dir"))
        self._router = Router(n, max_routes=max_routes, min_match=min_match, balance_threshold=balance_threshold)
        ray = self._ray = launch.import_ray()
        self._owns_ray = launch.acquire_ray(ray, ray_address, ray_init_opts)
        try:
            self._start(model, n, dict(engine_opts or {}), actor_options, pin_cpus, start_timeout,
                        ray_address is None)
        except BaseException:
            if self._owns_ray:
                launch.release_ray(ray)
            raise
        self._health = None if interval is None else HealthChecker(self, interval, bool(auto_restart))
        self._closed = False
        if self._health is not None:
            self._health.start()

    def _init_options(self, lm_kwargs: dict[str, Any]) -> None:
        from ..vllm_lm import AsyncVirtualLM

        replica_kwargs = dict(lm_kwargs)
        device = replica_kwargs.pop("output_device", "cpu")
        if str(device) != "cpu":
            raise ValueError(f"a ReplicaPool hands out CPU rows; output_device={device!r} is not supported")
        sub = {k: v for k, v in replica_kwargs.items() if k not in ("sessions", "max_sessions")}
        try:
            AsyncVirtualLM._check_options(sub)
        except TypeError as e:
            raise TypeError(
                f"ReplicaPool.from_name(): {e} (pool options: actor_options, pin_cpus, "
                "ray_init_opts, start_timeout, max_routes, min_match, balance_threshold)"
            ) from None
        # the driver waits for stragglers; replicas dispatch at once
        super().__init__(batch_size=replica_kwargs.get("batch_size", 256), timeout=replica_kwargs.pop("timeout", 0.0))
        self.chunk_size = int(replica_kwargs.get("chunk_size", 1024))
        self._lm_kwargs = replica_kwargs
        self._restart_lock = threading.Lock()  # one restart at a time; cleanup waits for it
        self._adapter_lock = threading.RLock()  # adapter changes vs a restart's registrations
        self._closing = threading.Event()  # set first by cleanup(): cancels a restart
        self._starting: set[int] = set()  # slots whose new actor is starting
        self._health: HealthChecker | None = None
        self._batcher: AutoBatcher[Query, torch.Tensor] = AutoBatcher(
            self._start_logprobs, batch_size=self.batch_size, timeout=self.timeout,
            deliver=_own_row, name="logprobs",
        )

    def _start(self, model: str, n: int, engine_opts: dict[str, Any], user_opts: dict[str, Any] | None,
               pin_cpus: Any, start_timeout: float, local: bool) -> None:
        ray = self._ray
        from .actor import ReplicaWorker

        gpus = ray.cluster_resources().get("GPU", 0) > 0
        tp = int(engine_opts.get("tensor_parallel_size", 1) or 1)
        # On CPU a tensor-parallel replica gets one core per rank unless told otherwise.
        per = int((user_opts or {}).get("num_cpus", 1 if gpus else tp) or 1)
        if pin_cpus is None:  # by default only where the pool started Ray here, on a CPU machine
            pin_cpus = self._owns_ray and local and not gpus
        if pin_cpus is True:
            cpus: list[list[int] | None] = list(launch.cpu_lists(n, max(1, per)))
        elif pin_cpus is False:
            cpus = [None] * n
        else:
            cpus = [list(map(int, c)) for c in pin_cpus]
            if len(cpus) != n:
                raise ValueError(f"pin_cpus has {len(cpus)} core lists for {n} replicas")
        self._cpus = cpus
        self._model, self._engine_opts = model, engine_opts
        self._user_opts = dict(user_opts or {})
        self._start_timeout = float(start_timeout)
        self._remote_cls = ray.remote(ReplicaWorker)
        launch.check_fits(ray, launch.actor_options(ray, engine_opts, self._user_opts, cpus[0]), n)
        started = launch.start_actors(ray, list(range(n)), self._make_actor, self._start_timeout)
        self._actors = [a for a, _ in started]
        self.replica_info = [info for _, info in started]
        first = started[0][1]
        from ..engine.build import ModelInfo

        self._info = ModelInfo(**first["info"])
        self._vocab_size = int(first["vocab_size"])
        self.max_model_len = int(first["max_model_len"])
        self._router.block_size = max(1, self._info.block_size or 32)
        try:
            vocab = ray.get(self._actors[0].vocabulary.remote(), timeout=self._start_timeout)
            self.tokenizer = _load_tokenizer(vocab)
            try:
                self.tokenizer.name_or_path = model
            except Exception:  # noqa: BLE001 - cosmetic only
                pass
            self.__dict__["_byte_strings"] = vocab["byte_strings"]  # AsyncLM's cached properties
            self.__dict__["_special_ids"] = tuple(vocab["special_ids"])
        except BaseException:
            for a in self._actors:
                ray.kill(a)
            raise

    def _make_actor(self, i: int) -> Any:
        opts = launch.actor_options(self._ray, self._engine_opts, self._user_opts, self._cpus[i])
        kw = dict(self._lm_kwargs)
        return self._remote_cls.options(**opts).remote(i, self._model, self._engine_opts, kw, self._cpus[i])

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_replicas(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list[Any]:
        """The replicas' Ray actor handles, by slot (a dead one stays until restarted)."""
        return list(self._actors)

    @property
    def live_replicas(self) -> list[int]:
        """Slots that are routed to (not known dead)."""
        return self._router.live_replicas()

    @property
    def auto_restart(self) -> bool:
        """Whether the health checker replaces dead replicas; settable (needs health checks)."""
        return self._health is not None and self._health.auto_restart

    @auto_restart.setter
    def auto_restart(self, value: bool) -> None:
        if self._health is None:
            raise ValueError("this pool has no health checks (health_interval_s=None): it cannot auto-restart")
        self._health.auto_restart = bool(value)

    @property
    def health(self) -> dict[str, Any]:
        """``checker``: the health checker's state (as ``stats["health"]``; None when checks are
        off); ``starting``: the slots whose fresh actor is being started; ``replicas``: per slot
        ``live``, ``restarts``, ``node`` and ``pid``. Read on the driver: no replica is called."""
        routing = self._router.snapshot()["replicas"]
        return {
            "checker": None if self._health is None else self._health.snapshot(),
            "starting": sorted(self._starting),
            "replicas": [
                {"live": r["live"], "restarts": r["restarts"], "node": info.get("node"), "pid": info.get("pid")}
                for r, info in zip(routing, self.replica_info, strict=True)
            ],
        }

    @property
    def engine_info(self) -> Any:
        """Replica 0's :class:`~genlm_vlm.engine.ModelInfo` (all replicas run the same engine)."""
        return self._info

    # ------------------------------------------------------------------ lifecycle
    def cleanup(self) -> None:
        """Stop the health checker (cancelling a restart in progress), then shut every replica
        down (engines freed, actors killed) and, if a pool started Ray, shut Ray down with the
        last such pool. Pending awaiters get :class:`~genlm_vlm.ClosedError`. Idempotent."""
        closing, health = getattr(self, "_closing", None), getattr(self, "_health", None)
        if closing is not None:  # None: __init__ failed before there was anything to stop
            closing.set()
        if health is not None:
            health.stop()
        super().cleanup()

    def add_new_lora(self, lora_path: str | os.PathLike[str], lora_name: str = "lora_1") -> None:
        with self._adapter_lock:  # a replica restarting meanwhile registers it, or gets it here
            super().add_new_lora(lora_path, lora_name)

    def remove_lora(self, lora_name: str) -> None:
        with self._adapter_lock:
            super().remove_lora(lora_name)

    add_new_lora.__doc__ = ServingLM.add_new_lora.__doc__
    remove_lora.__doc__ = ServingLM.remove_lora.__doc__

    # ------------------------------------------------------------------ rows (ServingLM hooks)
    def _batchers(self) -> tuple[AutoBatcher[Any, Any], ...]:
        return (self._batcher,)

    async def _row(self, query: Query) -> torch.Tensor:
        return await self._batcher.submit(query, query.key)

    def _start_logprobs(self, queries: list[Query]) -> list[cf.Future]:
        """AutoBatcher's ``start``: route the group, one actor call per (replica, adapter)."""
        futs: list[cf.Future] = [cf.Future() for _ in queries]
        try:
            self._check_open()
            routes = self._router.route_many([(q.akey, q.ids) for q in queries])
        except BaseException as e:  # noqa: BLE001 - handed to this group's awaiters
            for f in futs:
                f.set_exception(e)
            return futs
        groups: dict[tuple[int, int, str | None], list[int]] = defaultdict(list)
        for i, (q, (rep, gen)) in enumerate(zip(queries, routes, strict=True)):
            groups[(rep, gen, q.lora_name)].append(i)
        for (rep, gen, lora), idx in groups.items():
            self._launch_rows(rep, gen, lora, [queries[i].ids for i in idx], [futs[i] for i in idx])
        return futs

    def _rows_sync(self, queries: list[Query], chunk_size: int | None, show_progress: bool) -> torch.Tensor:
        """Blocking rows: each distinct prompt once (:class:`~genlm_vlm.batching.KeyPlan`; the
        replicas keep the cache), routed chunk by chunk, one actor call per (replica, adapter)."""
        chunk_size = chunk_size or self.chunk_size
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size!r}")
        if not queries:
            return self._no_rows()
        plan: KeyPlan[np.ndarray] = KeyPlan([q.key for q in queries])
        unique = [queries[i] for i in plan.todo.values()]
        bar = None
        if show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(unique), desc="scoring", unit="prompt")
        try:
            for start in range(0, len(unique), chunk_size):
                chunk = unique[start : start + chunk_size]
                self._check_open()
                routes = self._router.route_many([q.key for q in chunk])
                groups: dict[tuple[int, int, str | None], list[Query]] = defaultdict(list)
                for q, (rep, gen) in zip(chunk, routes, strict=True):
                    groups[(rep, gen, q.lora_name)].append(q)
                calls = [
                    (rep, gen, qs, self._remote(rep, "logprobs_sync", [q.ids for q in qs], lora, chunk_size))
                    for (rep, gen, lora), qs in groups.items()
                ]
                for _rep, _gen, qs, arr in self._gather_sync(calls):
                    for q, row in zip(qs, arr, strict=True):
                        plan.fill(q.key, row)
                if bar is not None:
                    bar.update(len(chunk))
        finally:
            if bar is not None:
                bar.close()
        return torch.from_numpy(np.stack(plan.results()).astype(np.float32, copy=False))


def _load_tokenizer(vocab: dict[str, Any]) -> Any:
    """Replica 0's tokenizer on the driver: from its saved files, else unpickled."""
    files = vocab.get("files")
    if files:
        import pathlib
        import tempfile

        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory() as tmp:
            for name, data in files.items():
                pathlib.Path(tmp, name).write_bytes(data)
            try:
                return AutoTokenizer.from_pretrained(tmp)
            except Exception:  # noqa: BLE001 - fall back to the pickled tokenizer if any
                if "pickle" not in vocab:
                    raise
    import pickle

    return pickle.loads(vocab["pickle"])


__all__ = ["ReplicaDiedError", "ReplicaPool"]
