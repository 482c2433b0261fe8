"""Scoring records with a model, results yielded in input order (see "How it runs" in
:mod:`genlm_vlm.scoring`). Two paths: vLLM's prompt log-probabilities (one scoring query per
record, at most ``chunk_size`` records in flight; :meth:`_Scorer._score_direct`) where the model
has them, else rows (prefixes sent ``chunk_size`` at a time, each chunk of rows reduced to the
numbers kept before the next is built). Internal module of :mod:`genlm_vlm.scoring`, which
exports :func:`score_records`.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .records import RecordError, _check_adapter, _error, _Job, _prepare

if TYPE_CHECKING:  # torch is imported where used: `score --help` stays light
    import torch

logger = logging.getLogger(__name__)


_TOKEN_TEXT: weakref.WeakKeyDictionary[Any, Callable[[int], str]] = weakref.WeakKeyDictionary()


def _token_text(lm: Any) -> Callable[[int], str]:
    """``token id -> str`` for the top-k output (built once per model)."""
    try:
        return _TOKEN_TEXT[lm]
    except (KeyError, TypeError):
        pass
    tokenizer = lm.tokenizer
    try:
        from ..vocab import get_str_vocab

        table = get_str_vocab(tokenizer, pad_to=lm.vocab_size)

        def text(i: int) -> str:
            return table[i]
    except Exception as e:  # noqa: BLE001 - any tokenizer the vocab module cannot read
        logger.debug("get_str_vocab failed (%r); top-k token text falls back to decode", e)

        def text(i: int) -> str:
            try:
                return tokenizer.decode([i], skip_special_tokens=False)
            except Exception:  # noqa: BLE001 - an id beyond the tokenizer (padded logit column)
                return ""

    try:
        _TOKEN_TEXT[lm] = text
    except TypeError:  # not weak-referenceable: rebuilt on every call
        pass
    return text


# ---------------------------------------------------------------------------------- scoring
class _Scorer:
    def __init__(self, lm: Any, top_k: int | None, chunk_size: int, lora_name: str | None = None) -> None:
        if top_k is not None and (type(top_k) is not int or top_k < 0):
            raise ValueError(f"top_k must be a non-negative int or None, got {top_k!r}")
        if type(chunk_size) is not int or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if lora_name is not None:
            _check_adapter(lm, lora_name, TypeError)
        self.lm = lm
        self.lora_name = lora_name
        self.top_k = min(top_k or 0, int(lm.vocab_size))
        self.chunk_size = chunk_size
        self._text: Callable[[int], str] | None = None

    def _reduce(self, job: _Job, k: int, row: torch.Tensor) -> None:
        cont = job.continuation or ()
        if k == 0 and job.want_top:
            import torch

            if self._text is None:
                self._text = _token_text(self.lm)
            values, indices = torch.topk(row, self.top_k)
            job.top = [
                {"token_id": int(i), "token": self._text(int(i)), "logprob": float(v)}
                for v, i in zip(values.tolist(), indices.tolist(), strict=True)
            ]
        if k < len(cont):
            job.token_logprobs[k] = float(row[cont[k]])
        job.remaining -= 1

    def run(self, work: list[tuple[_Job, int]]) -> None:
        """Compute the rows of ``work`` (at most ``chunk_size`` prefixes): one call per adapter."""
        by_adapter: dict[str | None, list[tuple[_Job, int]]] = {}
        for job, k in work:
            if job.error is None:
                by_adapter.setdefault(job.lora_name, []).append((job, k))
        for lora_name, group in by_adapter.items():
            self._run(group, lora_name)

    def _rows(self, prefixes: list[tuple[int, ...]], lora_name: str | None) -> torch.Tensor:
        return self.lm.batch_next_token_logprobs_sync(prefixes, lora_name=lora_name, chunk_size=self.chunk_size)

    def _run(self, work: list[tuple[_Job, int]], lora_name: str | None) -> None:
        prefixes = [job.prompt + (job.continuation or ())[:k] for job, k in work]
        try:
            rows = self._rows(prefixes, lora_name)
        except (TypeError, ValueError) as e:
            # Records were validated one by one, so this should not happen (unless an adapter
            # was removed meanwhile); if the model still refuses a prompt, redo the chunk record
            # by record so that only that record fails.
            logger.warning("a chunk was refused (%s); scoring its records one at a time", e)
            del prefixes
            self._run_one_by_one(work, lora_name)
            return
        for (job, k), row in zip(work, rows, strict=True):
            self._reduce(job, k, row)

    def _run_one_by_one(self, work: list[tuple[_Job, int]], lora_name: str | None) -> None:
        by_job: dict[int, tuple[_Job, list[int]]] = {}
        for job, k in work:
            by_job.setdefault(id(job), (job, []))[1].append(k)
        for job, ks in by_job.values():
            prefixes = [job.prompt + (job.continuation or ())[:k] for k in ks]
            try:
                rows = self._rows(prefixes, lora_name)
            except (TypeError, ValueError) as e:
                job.error = str(e)
                continue
            for k, row in zip(ks, rows, strict=True):
                self._reduce(job, k, row)

    def score(self, numbered: Iterable[tuple[int, Any]]) -> Iterator[dict[str, Any]]:
        """Results for ``(line, record)`` pairs, in input order (see :func:`score_records`)."""
        hook = getattr(self.lm, "_score_futures", None)
        if callable(hook) and hook([], "auto") is not None:
            return self._score_direct(numbered)
        return self._score_rows(numbered)

    def _submit(self, batch: list[_Job]) -> None:
        """One scoring query per record of ``batch`` (prompt-logprobs path)."""
        if not batch:
            return
        items = [(j.prompt, j.continuation or (), j.lora_name, self.top_k if j.want_top else 0) for j in batch]
        for job, fut in zip(batch, self.lm._score_futures(items, "auto"), strict=True):
            job.future = fut
        batch.clear()

    def _take(self, job: _Job) -> None:
        """Wait for ``job``'s result and keep what the output needs (prompt-logprobs path).
        An invalid record's error (``ValueError``, ``TypeError``) is its own; any other error
        is raised."""
        try:
            found = job.future.result()
        except (TypeError, ValueError) as e:
            job.error = str(e)
            return
        if job.continuation is not None:
            job.token_logprobs = found.logprobs.tolist()
        if job.want_top:
            if self._text is None:
                self._text = _token_text(self.lm)
            job.top = [
                {"token_id": int(i), "token": self._text(int(i)), "logprob": float(v)}
                for i, v in zip(found.top_ids.tolist(), found.top_logprobs.tolist(), strict=True)
            ]
        job.remaining = 0

    def _score_direct(self, numbered: Iterable[tuple[int, Any]]) -> Iterator[dict[str, Any]]:
        """The prompt-logprobs path: records are submitted in small groups as they are read;
        at most ``chunk_size`` records (pending results, errors included) are held."""
        want_top = self.top_k > 0
        pending: deque[_Job | dict[str, Any]] = deque()
        batch: list[_Job] = []
        group = max(1, self.chunk_size // 8)

        def drain(wait: bool) -> Iterator[dict[str, Any]]:
            """Yield the finished heads; wait for an unfinished head while ``chunk_size`` records
            are held, or for every head with ``wait``."""
            while pending:
                head = pending[0]
                if isinstance(head, _Job) and head.remaining > 0:
                    must = wait or len(pending) >= self.chunk_size
                    if head.future is None:
                        if not must:
                            return
                        self._submit(batch)
                    elif not (must or head.future.done()):
                        return
                    self._take(head)
                pending.popleft()
                yield head.result() if isinstance(head, _Job) else head

        try:
            for line, record in numbered:
                job = self._read(line, record, want_top)
                pending.append(job)
                if isinstance(job, _Job) and job.remaining > 0:
                    batch.append(job)
                    if len(batch) >= group:
                        self._submit(batch)
                yield from drain(wait=False)
            self._submit(batch)
            yield from drain(wait=True)
        finally:  # an error, an interrupt or a consumer that stops early: abort the rest
            for item in pending:
                if isinstance(item, _Job) and item.future is not None:
                    item.future.cancel()

    def _read(self, line: int, record: Any, want_top: bool) -> _Job | dict[str, Any]:
        """The job for one input record, or (a record that cannot be scored) its error record."""
        try:
            return _prepare(self.lm, line, record, want_top, self.lora_name)
        except RecordError as e:
            rid = record.get("id") if isinstance(record, dict) else None
            return _error(rid, line, str(e))

    def _score_rows(self, numbered: Iterable[tuple[int, Any]]) -> Iterator[dict[str, Any]]:
        """The row path: prefixes sent ``chunk_size`` at a time."""
        want_top = self.top_k > 0
        pending: deque[_Job | dict[str, Any]] = deque()  # outputs not yet yielded, in order
        work: deque[tuple[_Job, int]] = deque()  # prefixes not yet computed

        def ready() -> Iterator[dict[str, Any]]:
            while pending:
                head = pending[0]
                if isinstance(head, _Job):
                    if head.remaining > 0 and head.error is None:
                        return
                    head = head.result()
                pending.popleft()
                yield head

        def flush(all_: bool) -> None:
            while len(work) >= self.chunk_size or (all_ and work):
                n = min(self.chunk_size, len(work))
                self.run([work.popleft() for _ in range(n)])

        for line, record in numbered:
            job = self._read(line, record, want_top)
            pending.append(job)
            if isinstance(job, _Job):
                work.extend((job, k) for k in job.prefix_lengths())
            flush(all_=len(pending) >= self.chunk_size)
            yield from ready()
        flush(all_=True)
        yield from ready()
        assert not pending, "scoring left records unfinished"


def score_records(
    lm: Any,
    records: Iterable[dict[str, Any]],
    *,
    top_k: int | None = 5,
    chunk_size: int = 256,
    show_progress: bool = False,
    lora_name: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Score ``records`` with ``lm`` (an :class:`~genlm_vlm.AsyncVirtualLM`), lazily, in order.

    Each record is a dict with ``prompt`` (text or token ids), optional ``continuation`` (text or
    token ids), optional ``add_bos``, optional ``lora_name`` and optional ``id``; see the module
    docstring for the exact fields of the results. One result is yielded per record, in input order; a record that
    cannot be scored (an unknown key among them: see :data:`RECORD_KEYS`) yields
    ``{"id", "line", "error"}`` instead. ``top_k=None`` or ``0`` leaves
    out the ``top_k`` field. At most ``chunk_size`` prefixes go to the engine per call, and
    records are consumed from ``records`` only as fast as they are scored.

    ``lora_name`` scores every record under that registered LoRA adapter, as the model's own
    methods do (None: the model's default adapter set with ``set_lora``, else the base model); a
    record's own ``"lora_name"`` key overrides it for that record, and a record naming an
    adapter that is not registered gets an error result. An unknown ``lora_name`` argument raises
    :class:`~genlm_vlm.UnknownAdapterError` at the call. Prefixes of different adapters go to
    the engine in separate calls.

    Text goes through ``lm.tokenizer.encode(text, add_special_tokens=False)``. Must be called
    from synchronous code (it uses the blocking API), not from inside a running event loop's
    thread if that loop is also awaiting ``lm``.
    """
    scorer = _Scorer(lm, top_k, chunk_size, lora_name)
    numbered: Iterable[tuple[int, Any]] = enumerate(records, start=1)
    if show_progress:
        from tqdm.auto import tqdm

        total = len(records) if isinstance(records, Sequence) else None
        numbered = enumerate(tqdm(records, total=total, desc="scoring", unit="record"), start=1)
    return scorer.score(numbered)
