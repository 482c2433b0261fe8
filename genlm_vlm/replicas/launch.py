"""Starting Ray and the replica actors: ``ray.init`` ownership, actor options, CPU pinning.

Only Ray's public API is used (``ray.init``/``shutdown``, ``ray.remote(...).options``,
``ray.get``/``kill``, ``cluster_resources``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

#: ``ray.init`` options used when the pool starts Ray itself (caller's ``ray_init_opts`` win).
LOCAL_RAY_INIT: dict[str, Any] = {"include_dashboard": False, "configure_logging": False}

# Ray instances started by a pool are shared by every pool of the process and shut down with the
# last of them; a Ray the caller started is never shut down by a pool.
_ray_lock = threading.Lock()
_ray_users = 0
_ray_ours = False


#: Loggers of Ray's start-up notices that a user cannot act on while the log is quiet: the
#: token-authentication notice of a new local cluster ("Token authentication is enabled for
#: this Ray cluster ..."). Ray logs it with ``logger.warning`` from the process that calls
#: ``ray.init`` (its child processes inherit ``RAY_AUTH_MODE`` and stay silent).
RAY_NOTICE_LOGGERS = ("ray._private.authentication.authentication_token_setup",)


@contextlib.contextmanager
def ray_notices_hidden() -> Iterator[None]:
    """Hide Ray's start-up notices (:data:`RAY_NOTICE_LOGGERS`: errors still show) while
    genlm_vlm's log is quiet (:func:`genlm_vlm.logs.vllm_log_level` above WARNING: the default
    from Python and with ``--quiet``). Only what is printed changes: authentication itself is
    left to Ray."""
    from ..logs import vllm_log_level

    if vllm_log_level() <= logging.WARNING:
        yield
        return
    loggers = [logging.getLogger(name) for name in RAY_NOTICE_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "ReplicaPool needs Ray: `pip install genlm-vlm[ray]` (or `pip install ray`)"
        ) from e
    return ray


def acquire_ray(ray: Any, address: str | None, init_opts: dict[str, Any] | None) -> bool:
    """Make sure Ray is initialised; returns True when this pool must release it
    (:func:`release_ray`), i.e. when a pool started it."""
    global _ray_users, _ray_ours
    with _ray_lock:
        if ray.is_initialized():
            if _ray_ours:
                _ray_users += 1
                return True
            if address is not None:
                logger.warning("Ray is already initialised; ray_address=%r is ignored", address)
            return False
        opts = {**LOCAL_RAY_INIT, **(init_opts or {})}
        # On a busy machine Ray's helper processes can miss their 30 s start-up window (its
        # raylet then aborts, "The current node timed out during startup"); a second start
        # finds their imports in the page cache.
        attempts = 2 if address is None else 1
        for attempt in range(attempts):
            try:
                with ray_notices_hidden():
                    ray.init(address=address, **opts)
                break
            except Exception as e:
                try:
                    ray.shutdown()
                except Exception:  # noqa: BLE001 - best effort before the retry
                    pass
                if attempt + 1 == attempts:
                    where = "a local Ray instance" if address is None else f"Ray at {address!r}"
                    raise RuntimeError(f"could not start {where} for the ReplicaPool: {e}") from e
                logger.warning("ray.init failed (%s); retrying once", e)
        _ray_ours, _ray_users = True, 1
        return True


def release_ray(ray: Any) -> None:
    """One pool that :func:`acquire_ray` returned True for is done; the last shuts Ray down."""
    global _ray_users, _ray_ours
    with _ray_lock:
        _ray_users -= 1
        if _ray_users <= 0 and _ray_ours:
            _ray_ours, _ray_users = False, 0
            if ray.is_initialized():
                ray.shutdown()


def cpu_lists(num_replicas: int, per_replica: int) -> list[list[int]]:
    """Replica ``i``'s cores: the ``per_replica`` cores after replica ``i - 1``'s, among this
    process's allowed cores (wrapping round when there are fewer cores than asked for)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if num_replicas * per_replica > len(cores):
        warnings.warn(
            f"{num_replicas} replicas x {per_replica} core(s) > the {len(cores)} cores available: "
            "replicas share cores (pass pin_cpus=False to leave placement to the OS)",
            RuntimeWarning,
            stacklevel=4,
        )
    return [[cores[(i * per_replica + k) % len(cores)] for k in range(per_replica)] for i in range(num_replicas)]


def actor_options(
    ray: Any,
    engine_opts: dict[str, Any],
    user: dict[str, Any] | None,
    cpus: list[int] | None,
) -> dict[str, Any]:
    """``.options(...)`` of one replica actor: one GPU per tensor-parallel rank where the
    cluster has GPUs, else ``len(cpus)`` (or 1) CPUs; pinning env vars; ``user`` options win
    (``runtime_env["env_vars"]`` merged key by key)."""
    user = dict(user or {})
    tp = int(engine_opts.get("tensor_parallel_size", 1) or 1)
    opts: dict[str, Any] = {"max_concurrency": 1000, "max_restarts": 0}
    if ray.cluster_resources().get("GPU", 0) > 0:
        opts.update(num_gpus=tp, num_cpus=1)
    else:
        opts["num_cpus"] = len(cpus) if cpus else 1
    env: dict[str, str] = {}
    if cpus:
        if len(cpus) < tp:
            raise ValueError(
                f"a replica with tensor_parallel_size={tp} needs at least {tp} CPU cores (one per rank), "
                f"it is pinned to {len(cpus)}: pass actor_options={{'num_cpus': {tp}}} or pin_cpus=False"
            )
        per = len(cpus) // tp  # one core group per rank, as vLLM's CPU workers expect
        groups = [cpus[r * per : (r + 1) * per] for r in range(tp)]
        env["OMP_NUM_THREADS"] = str(per)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
    runtime_env = dict(user.pop("runtime_env", None) or {})
    env.update(runtime_env.get("env_vars") or {})
    if env:
        runtime_env["env_vars"] = env
    if runtime_env:
        opts["runtime_env"] = runtime_env
    opts.update(user)
    return opts


def check_fits(ray: Any, per_actor: dict[str, Any], num_replicas: int) -> None:
    """Raise at once (not hang) when the cluster cannot hold ``num_replicas`` such actors."""
    total, free = ray.cluster_resources(), ray.available_resources()
    for res, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        need = float(per_actor.get(key) or 0) * num_replicas
        for have, what in ((total, "has"), (free, "has free")):
            if need > float(have.get(res, 0)):
                raise ValueError(
                    f"{num_replicas} replica(s) need {need:g} {res} in all but the Ray cluster "
                    f"{what} {float(have.get(res, 0)):g}: use fewer replicas, or ask less per "
                    f"replica (actor_options={{{key!r}: ...}}; Ray's CPUs are logical, 0 is allowed)"
                )


def unwrap(ray: Any, exc: BaseException) -> BaseException:
    """The exception a remote method raised (Ray wraps it in ``RayTaskError``)."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    return exc


def start_actors(
    ray: Any,
    indices: list[int],
    make: Any,
    timeout: float,
    cancel: threading.Event | None = None,
) -> list[tuple[Any, dict[str, Any]]]:
    """Create the actors of ``indices`` with ``make(i)`` and build their engines in parallel;
    returns ``(actor, start info)`` per index. On any failure every actor created here is
    killed and the first error is raised (a remote exception as itself). ``cancel`` set while
    they start (the pool is being cleaned up): :class:`~genlm_vlm.ClosedError`."""
    actors = [make(i) for i in indices]
    refs = [a.start.remote() for a in actors]
    try:
        if cancel is None:
            infos = ray.get(refs, timeout=timeout)
        else:
            deadline = time.monotonic() + timeout
            pending = list(refs)
            while pending:
                if cancel.is_set():
                    from ..base import ClosedError

                    raise ClosedError("the ReplicaPool was cleaned up while replicas were starting")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ray.exceptions.GetTimeoutError(f"replicas {indices} did not start")
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, 0.1))
            infos = ray.get(refs)
    except BaseException as e:
        for a in actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - best effort
                pass
        if isinstance(e, ray.exceptions.GetTimeoutError):
            raise TimeoutError(
                f"replicas {indices} did not start within {timeout:g} s: the Ray cluster may lack "
                "the resources they ask for (see actor_options), or the model is slow to load "
                "(raise start_timeout)"
            ) from e
        cause = unwrap(ray, e)
        if cause is e:
            raise
        raise cause from e
    return list(zip(actors, infos, strict=True))
