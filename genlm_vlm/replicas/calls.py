"""The pool's actor calls: launching and collecting them, failure handling, sampling, LoRA,
restarts and shutdown (the :class:`~genlm_vlm.serving.ServingLM` hooks of the pool).

A mixin of :class:`~.pool.ReplicaPool` (kept apart so each file stays readable). Threading: the
router and the batcher's futures are thread-safe; completions of async row calls arrive on a Ray
thread and reach the event loop through the batcher's mailbox.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import logging
import numbers
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..base import ClosedError, SampleArgs
from ..engine.jobs import EngineDiedError
from ..lora import Adapter
from . import launch
from .routing import ReplicaDiedError

logger = logging.getLogger(__name__)

#: How long an automatic restart waits for the cluster to have room for the new actor (Ray
#: frees a dead actor's resources shortly after its death is reported).
RESOURCE_GRACE_S = 2.0


def _settle(fut: cf.Future, value: Any = None, exc: BaseException | None = None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
    except cf.InvalidStateError:  # cancelled by its awaiters meanwhile
        pass


class _RowCall:
    """One actor call of rows; cancelled (``ray.cancel``) once all its futures are."""

    __slots__ = ("futs", "gen", "pending", "ray", "ref", "replica")

    def __init__(self, ray: Any, replica: int, gen: int, ref: Any, futs: list[cf.Future]) -> None:
        self.ray, self.replica, self.gen, self.ref, self.futs = ray, replica, gen, ref, futs
        self.pending = len(futs)

    def on_future_done(self, fut: cf.Future) -> None:
        if not fut.cancelled():
            return
        self.pending -= 1
        if self.pending == 0:
            try:
                self.ray.cancel(self.ref)
            except Exception:  # noqa: BLE001 - the call may be over already
                pass


class CallMixin:
    """Everything that talks to the actors (see :class:`~.pool.ReplicaPool`)."""

    _ray: Any
    _actors: list[Any]
    _router: Any
    _batcher: Any
    _closed: bool
    _vocab_size: int
    _health: Any
    _closing: Any
    _restart_lock: Any
    _adapter_lock: Any
    _starting: set[int]

    # ------------------------------------------------------------------ errors
    def _translate(self, exc: BaseException, replica: int, gen: int) -> BaseException:
        """The error an awaiter of a failed call to ``replica`` gets."""
        ray = self._ray
        if self._closed:
            return ClosedError("this ReplicaPool was cleaned up while the call was pending")
        if isinstance(exc, ray.exceptions.TaskCancelledError):
            return asyncio.CancelledError()
        cause = launch.unwrap(ray, exc)
        engine_died = isinstance(cause, EngineDiedError)
        if isinstance(exc, ray.exceptions.RayActorError) or engine_died:
            # an actor whose engine stopped still answers, at once: it must leave routing, or
            # it would look least loaded and draw every new query
            what = "'s engine stopped" if engine_died else " of the ReplicaPool died"
            if self._router.mark_dead(replica, gen):
                logger.warning("genlm_vlm: replica %d%s (%s); routing to the others", replica, what, type(cause).__name__)
                if self._health is not None:
                    self._health.wake()  # restart it now if auto_restart
            live = self._router.live_replicas()
            detail = str(cause if engine_died else exc).strip().splitlines()
            then = ("the pool restarts it (auto_restart)" if self.auto_restart  # type: ignore[attr-defined]
                    else f"pool.restart_replica({replica}) starts a fresh one")
            err = ReplicaDiedError(
                f"replica {replica}{what} while this call was in flight "
                f"({type(cause if engine_died else exc).__name__}: {detail[0] if detail else ''}). The pool "
                f"goes on with {'replicas ' + str(live) if live else 'no live replica'}; {then}.",
                replica,
            )
            err.__cause__ = exc
            return err
        return cause

    def _actor_for(self, replica: int, gen: int) -> Any:
        if self._router.generation(replica) != gen:
            raise ReplicaDiedError(f"replica {replica} was restarted or died while this call was routed", replica)
        return self._actors[replica]

    def _remote(self, replica: int, method: str, *args: Any) -> Any:
        """``actor.method.remote(*args)``, or the exception that raised."""
        try:
            return getattr(self._actors[replica], method).remote(*args)
        except BaseException as e:  # noqa: BLE001 - reported to the call's waiters
            return e

    # ------------------------------------------------------------------ async rows
    def _launch_rows(self, replica: int, gen: int, lora: str | None, ids: list[tuple[int, ...]],
                     futs: list[cf.Future]) -> None:
        try:
            ref = self._actor_for(replica, gen).logprobs.remote(ids, lora)
        except BaseException as e:  # noqa: BLE001
            self._router.done(replica, gen, len(futs), failed=True)
            err = self._translate(e, replica, gen)
            for f in futs:
                _settle(f, exc=err)
            return
        call = _RowCall(self._ray, replica, gen, ref, futs)
        for f in futs:
            f.add_done_callback(call.on_future_done)
        ref.future().add_done_callback(functools.partial(self._finish_rows, call))

    def _finish_rows(self, call: _RowCall, done: cf.Future) -> None:
        """A row call ended (Ray thread): one row per future, or the error to all of them."""
        try:
            rows = done.result()
            if len(rows) != len(call.futs) or any(r.shape != (self._vocab_size,) for r in rows):
                raise RuntimeError(f"replica {call.replica} returned {len(rows)} rows for {len(call.futs)} queries")
        except BaseException as e:  # noqa: BLE001 - handed to this call's awaiters
            self._router.done(call.replica, call.gen, len(call.futs), failed=True)
            err = self._translate(e, call.replica, call.gen)
            for f in call.futs:
                _settle(f, exc=err)
            return
        self._router.done(call.replica, call.gen, len(call.futs))
        for f, row in zip(call.futs, rows, strict=True):
            _settle(f, row)

    # ------------------------------------------------------------------ blocking calls
    def _gather_sync(self, calls: list[tuple[int, int, Any, Any]]) -> list[tuple[int, int, Any, Any]]:
        """Wait for every ``(replica, gen, idx, ref)`` call; returns ``(replica, gen, idx,
        result)`` of each, or raises the first error once all are over. Ctrl-C cancels them."""
        ray = self._ray
        out, error, pending = [], None, list(calls)
        try:
            while pending:
                replica, gen, idx, ref = pending[0]
                try:
                    if isinstance(ref, BaseException):
                        raise ref
                    value = ray.get(ref)
                except KeyboardInterrupt:
                    raise
                except BaseException as e:  # noqa: BLE001
                    pending.pop(0)
                    self._router.done(replica, gen, len(idx), failed=True)
                    error = error or self._translate(e, replica, gen)
                    continue
                pending.pop(0)
                self._router.done(replica, gen, len(idx))
                out.append((replica, gen, idx, value))
        except KeyboardInterrupt:
            for replica, gen, idx, ref in pending:
                self._router.done(replica, gen, len(idx), failed=True)
                if not isinstance(ref, BaseException):
                    try:
                        ray.cancel(ref)
                    except Exception:  # noqa: BLE001
                        pass
            raise
        if error is not None:
            raise error
        return out

    def _call_live(self, method: str, *args: Any) -> dict[int, Any]:
        """``method(*args)`` on every live replica at once; ``{replica: result}``."""
        self._check_open()  # type: ignore[attr-defined]
        calls = []
        for i in self._router.live_replicas():
            calls.append((i, self._router.generation(i), (), self._remote(i, method, *args)))
        ray, out, error = self._ray, {}, None
        for i, gen, _, ref in calls:
            try:
                if isinstance(ref, BaseException):
                    raise ref
                out[i] = ray.get(ref)
            except BaseException as e:  # noqa: BLE001
                error = error or self._translate(e, i, gen)
        if error is not None:
            raise error
        return out

    # ------------------------------------------------------------------ async calls
    async def _await_call(self, replica: int, gen: int, n: int, method: str, *args: Any) -> Any:
        ok = False
        try:
            ref = getattr(self._actor_for(replica, gen), method).remote(*args)
        except BaseException as e:  # noqa: BLE001
            self._router.done(replica, gen, n, failed=True)
            raise self._translate(e, replica, gen) from None
        try:
            value = await asyncio.wrap_future(ref.future())
            ok = True
            return value
        except asyncio.CancelledError:
            try:
                self._ray.cancel(ref)
            except Exception:  # noqa: BLE001
                pass
            raise
        except BaseException as e:  # noqa: BLE001
            raise self._translate(e, replica, gen) from None
        finally:
            self._router.done(replica, gen, n, failed=not ok)

    async def _samples(self, specs: list[SampleArgs], adapter: Adapter | None) -> list[list[int]]:
        """Each sample on the replica its prompt routes to; one actor call per replica."""
        akey = 0 if adapter is None else adapter.int_id
        lora = None if adapter is None else adapter.name
        routes = self._router.route_many([(akey, s.ids) for s in specs], record=False)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, route in enumerate(routes):
            groups[route].append(i)
        keys = list(groups)
        results = await asyncio.gather(
            *(self._await_call(r, g, len(groups[(r, g)]), "sample", [tuple(specs[i]) for i in groups[(r, g)]], lora)
              for r, g in keys),
            return_exceptions=True,
        )
        outs: list[list[int]] = [[] for _ in specs]
        for key, res in zip(keys, results, strict=True):
            if isinstance(res, BaseException):
                raise res
            for i, o in zip(groups[key], res, strict=True):
                outs[i] = list(o)
        return outs

    # ------------------------------------------------------------------ controllers (genlm_vlm.smc)
    async def _on_one_replica(self, prompt: tuple[int, ...], lora_name: str | None, method: str, *args: Any) -> Any:
        """``actor.method(*args)`` on the replica ``prompt`` routes to (its session or cached prefix)."""
        adapter = self._loras.resolve(lora_name)  # type: ignore[attr-defined]
        akey = 0 if adapter is None else adapter.int_id
        [(replica, gen)] = self._router.route_many([(akey, prompt)], record=False)
        return await self._await_call(replica, gen, 1, method, *args)

    async def smc(self, prompt_ids: Any, constraint: Any, n_particles: int, max_tokens: int, **kwargs: Any) -> Any:
        """:meth:`~genlm_vlm.AsyncLM.smc` on one replica, where the whole run is a burst on its
        engine thread (``in_engine=False``: per token over the pool). The arguments are checked
        here first; the constraint travels as its description and is compiled there."""
        from ..checks import check_engine_path, check_flag
        from ..smc import api
        from ..smc.algorithm import warn_if_empty

        self._check_open()  # type: ignore[attr-defined]
        in_engine = check_flag(kwargs.get("in_engine", True), "in_engine")
        check_engine_path(kwargs.get("engine_path", "auto"))
        prompt, prompts, critic = api.check_options(self, prompt_ids, max_tokens, kwargs.pop("prompts", None),
                                                    kwargs.pop("critic", None), kwargs)  # the critic runs here
        prompt, controller = api.prepare(self, prompt, constraint, n_particles, max_tokens, build=not in_engine,
                                         **{k: v for k, v in kwargs.items() if k not in ("in_engine", "engine_path")})
        if controller is not None:
            return await api.run(self, prompt, controller, lora_name=kwargs.get("lora_name"), in_engine=False,
                                 prompts=prompts, critic=critic)
        # Checked here (compiled once per model); the replica builds the controller itself.
        if prompts is not None:
            kwargs["prompts"] = [list(p) for p in prompts]
        result = await self._on_one_replica(prompt, kwargs.get("lora_name"), "smc",
                                            None if prompts else list(prompt), constraint, n_particles,
                                            max_tokens, kwargs)
        if critic is not None:
            await api.criticise(result, critic)
        warn_if_empty(result)  # here, in the caller's process (the replica gives none)
        return result

    async def run_controller(self, prompt_ids: Any, controller: Any, *, lora_name: str | None = None,
                             start: Any = None, engine_path: str = "auto") -> Any:
        """Run a :class:`~genlm_vlm.smc.Controller` in one replica's engine (``engine_path``:
        as on :class:`~genlm_vlm.AsyncVirtualLM`); the controller travels there and back by
        pickle (Ray's), so it must pickle before its first step."""
        from ..checks import check_engine_path

        self._check_open()  # type: ignore[attr-defined]
        path = check_engine_path(engine_path)
        prompt = self._check_ids(prompt_ids, "prompt_ids")  # type: ignore[attr-defined]
        return await self._on_one_replica(prompt, lora_name, "run_controller", list(prompt), controller,
                                          lora_name, start, path)

    # ------------------------------------------------------------------ LoRA (ServingLM hooks)
    def _check_lora_support(self) -> None:
        if not self.engine_info.lora_enabled:  # type: ignore[attr-defined]
            raise self._lora_disabled("this pool's engines were")  # type: ignore[attr-defined]

    def _load_adapter(self, adapter: Adapter, previous: Adapter | None) -> None:
        """Register the adapter on every live replica; on a failure, the replicas that took it
        go back to ``previous`` (or drop the name)."""
        try:
            self._call_live("add_lora", adapter.path, adapter.name)
        except BaseException:
            for i in self._router.live_replicas():
                try:
                    if previous is None:
                        self._ray.get(self._actors[i].remove_lora.remote(adapter.name))
                    else:
                        self._ray.get(self._actors[i].add_lora.remote(previous.path, adapter.name))
                except Exception:  # noqa: BLE001 - best effort
                    logger.warning("could not roll back LoRA %r on replica %d", adapter.name, i)
            raise

    def _drop_adapter(self, adapter: Adapter, replaced_by: Adapter | None) -> None:
        """A removed name is removed on every live replica (a replaced one was re-registered)."""
        if replaced_by is None:
            self._call_live("remove_lora", adapter.name)

    # ------------------------------------------------------------------ housekeeping
    def warm_up(self, prefix_token_ids: Sequence[int], lora_name: str | None = None) -> torch.Tensor:
        """Prime every live replica's prefix cache with a shared prompt; returns its row."""
        q = self._query(prefix_token_ids, lora_name)  # type: ignore[attr-defined]
        rows = self._call_live("logprobs_sync", [q.ids], q.lora_name, 1)
        return torch.from_numpy(np.array(rows[min(rows)][0], dtype=np.float32))

    def clear_cache(self) -> None:
        """Every live replica drops its cached rows and idle sessions (prefix caches stay, and
        so does the routing table)."""
        if not self._closed:
            self._call_live("clear_cache")

    def release_sessions(self) -> int:
        """Release every replica's idle sessions; returns how many were released in all."""
        return sum(self._call_live("release_sessions").values())

    @property
    def stats(self) -> dict[str, Any]:
        """``replicas``: each slot's own ``AsyncVirtualLM.stats`` plus ``restarts`` (of the
        slot), ``node`` (Ray node id) and ``pid`` of its actor (None for a dead slot);
        ``routing``: per replica ``live``, ``inflight``, ``sessions`` (recorded), ``restarts``,
        ``routed``, ``session_hits`` (continued a recorded session), ``prefix_hits`` (longest
        cached prefix), ``by_load`` (new prompts), ``spilled`` (prefix hits sent elsewhere for
        balance), ``failed``; ``health``: the health checker's ``interval_s``,
        ``auto_restart``, ``running``, ``rounds``, ``pings``, ``deaths_found``, ``restarts``
        (by the checker), ``restart_failures``, ``last_error`` (None when checks are off);
        ``logprobs``: the driver batcher's counters."""
        replicas: list[Any] = [None] * len(self._actors)
        if not self._closed:
            refs = [(i, self._router.generation(i), self._remote(i, "stats")) for i in self._router.live_replicas()]
            for i, gen, ref in refs:
                try:
                    if isinstance(ref, BaseException):
                        raise ref
                    replicas[i] = self._ray.get(ref, timeout=60)
                except Exception as e:  # noqa: BLE001 - a dead replica has no stats
                    self._translate(e, i, gen)
        routing = self._router.snapshot()
        for i, r in enumerate(replicas):
            if r is not None:
                info = self.replica_info[i]  # type: ignore[attr-defined]
                r.update(restarts=routing["replicas"][i]["restarts"], node=info.get("node"), pid=info.get("pid"))
        return {
            "replicas": replicas,
            "routing": routing,
            "health": None if self._health is None else self._health.snapshot(),
            "logprobs": self._batcher.stats,
        }

    def restart_replica(self, index: int) -> None:
        """Replace slot ``index`` (dead or not) with a fresh actor and engine, same options, with
        the registered LoRA adapters; blocks until it serves. Calls in flight on the old actor
        fail with :class:`ReplicaDiedError`. From async code: ``await asyncio.to_thread(...)``.
        (With ``auto_restart=True`` the health checker does this for every dead replica.)"""
        self._check_open()  # type: ignore[attr-defined]
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < len(self._actors):
            raise ValueError(f"index must be a replica slot in [0, {len(self._actors)}), got {index!r}")
        self._replace(int(index))

    def _found_dead(self, replica: int, gen: int, exc: BaseException) -> bool:
        """The health checker found the actor of ``replica`` (generation ``gen``) dead: it
        leaves routing, as after a failed call. True if it was live until now."""
        if not self._router.mark_dead(replica, gen):
            return False
        detail = str(exc).strip().splitlines()
        logger.warning("genlm_vlm: replica %d was found dead by the health check (%s: %s); routing to the others",
                       replica, type(exc).__name__, detail[0] if detail else "")
        return True

    def _replace(self, index: int, *, auto: bool = False) -> bool:
        """Start a fresh actor in slot ``index`` (see :meth:`restart_replica`). ``auto`` (the
        health checker): only if the slot is still dead, and only if the cluster has room for
        it now (else ``ValueError`` at once). Returns whether a replica was started. Cleanup
        meanwhile cancels it (:class:`ClosedError`, the new actor killed)."""
        ray = self._ray
        with self._restart_lock:
            if self._closing.is_set():
                raise ClosedError("this ReplicaPool was cleaned up")
            if auto and self._router.is_live(index):
                return False  # restarted by someone else meanwhile
            self._router.mark_dead(index, self._router.generation(index))
            try:
                ray.kill(self._actors[index], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            if auto:  # fail now (retried later) rather than wait start_timeout for room
                opts = launch.actor_options(ray, self._engine_opts, self._user_opts, self._cpus[index])  # type: ignore[attr-defined]
                deadline = time.monotonic() + RESOURCE_GRACE_S
                while True:
                    try:
                        launch.check_fits(ray, opts, 1)
                        break
                    except ValueError:  # a dead actor's resources are freed a moment later
                        if self._closing.wait(0.05):
                            raise ClosedError("this ReplicaPool was cleaned up") from None
                        if time.monotonic() > deadline:
                            raise
            self._starting.add(index)
            try:
                [(actor, info)] = launch.start_actors(
                    ray, [index], self._make_actor, self._start_timeout, cancel=self._closing,  # type: ignore[attr-defined]
                )
            finally:
                self._starting.discard(index)
            try:
                with self._adapter_lock:  # no adapter is added or removed until it is routed to
                    for name in self._loras.names():  # type: ignore[attr-defined]
                        adapter = self._loras.get(name)  # type: ignore[attr-defined]
                        if adapter is not None:
                            ray.get(actor.add_lora.remote(adapter.path, name), timeout=self._start_timeout)  # type: ignore[attr-defined]
                    if self._closing.is_set():
                        raise ClosedError("this ReplicaPool was cleaned up while a replica was restarting")
                    self._actors[index] = actor
                    self.replica_info[index] = info  # type: ignore[attr-defined]
                    self._router.revive(index)
            except BaseException as e:
                ray.kill(actor)
                cause = launch.unwrap(ray, e)
                if cause is e:
                    raise
                raise cause from e
            return True

    def _close_impl(self) -> None:
        """Shut every replica down (engines freed, actors killed) and, if a pool started Ray,
        shut Ray down with the last such pool."""
        ray = self._ray
        try:
            # cleanup() set _closing: a restart in progress gives up; wait for it to have
            # killed its actor (or installed it) before killing the pool's actors
            with self._restart_lock:
                if ray.is_initialized():
                    refs = [r for r in (self._remote(i, "cleanup") for i in self._router.live_replicas())
                            if not isinstance(r, BaseException)]
                    if refs:
                        ray.wait(refs, num_returns=len(refs), timeout=60)
                    for a in self._actors:
                        try:
                            ray.kill(a)
                        except Exception:  # noqa: BLE001 - already gone
                            pass
        finally:
            if self._owns_ray:  # type: ignore[attr-defined]
                self._owns_ray = False
                launch.release_ray(ray)
