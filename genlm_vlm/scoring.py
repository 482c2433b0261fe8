"""Scoring records: next-token top-k and ``log p(continuation | prompt)``, from Python or a JSONL file.

Python::

    from genlm_vlm.scoring import score_records

    records = [
        {"id": "a", "prompt": "def f(x):", "continuation": "\\n    return x"},
        {"id": "b", "prompt": [0, 17, 42]},                  # token ids
        {"id": "c", "prompt": "import", "add_bos": True},   # prepend the BOS token
    ]
    for result in score_records(lm, records, top_k=5):
        print(result)

Command line (one JSON object per line in, one per line out, in input order)::

    python -m genlm_vlm score IN.jsonl OUT.jsonl [--model NAME_OR_PATH] [--top-k K]
        [--chunk-size N] [--engine-opt key=value ...] [--no-progress] [--quiet | --verbose]

Input record fields:

``prompt`` (required)
    A text, or a list of token ids. Text is tokenized with
    ``lm.tokenizer.encode(text, add_special_tokens=False)``: no BOS/EOS is added.
``continuation`` (optional)
    A text (tokenized the same way, on its own) or a list of token ids. Tokenizing prompt and
    continuation separately can split the text differently from tokenizing their concatenation;
    pass token ids where the exact split matters.
``add_bos`` (optional, default false)
    Prepend ``lm.tokenizer.bos_token_id`` to the prompt (also to a prompt given as ids).
``lora_name`` (optional)
    The registered LoRA adapter (``lm.add_new_lora(path, name)``) that scores this record;
    absent or ``null``: the ``lora_name`` given to :func:`score_records` (default None: the
    model's default adapter set with ``set_lora``, else the base model). An adapter that is not
    registered is an error for that record. The ``score`` command registers no adapter, so
    there a record naming one gets that error.
``id`` (optional)
    Copied to the output (``null`` when absent); any JSON value, so other data about the record
    can travel here.

Any other key is an error for that record (``unknown key 'contination' ... did you mean
'continuation'?``), so that a misspelled field is not silently ignored.

Output per record::

    {"id": ..., "line": n, "prompt_tokens": 3,
     "top_k": [{"token_id": 17, "token": "x", "logprob": -0.41}, ...],   # when top_k > 0
     "continuation_tokens": 2, "continuation_logprob": -5.3,           # with a continuation
     "token_logprobs": [-2.1, -3.2]}

``top_k`` lists the ``K`` most likely next tokens after the prompt, most likely first;
``token`` is the text the token contributes (:func:`genlm_vlm.vocab.get_str_vocab`).
``token_logprobs[t]`` is ``log p(c_t | prompt + c_<t)`` and ``continuation_logprob`` their sum
(an empty continuation scores 0). ``line`` is the record's 1-based position (the line number in
a JSONL file). A record that cannot be scored (not a JSON object, invalid JSON, an unknown key,
missing or empty prompt, wrong types, token ids outside the vocabulary, prompt + continuation
longer than the model's ``max_model_len``) gives ``{"id": ..., "line": n, "error": "..."}`` and the other
records are scored as usual.

How it runs: every record needs the rows of its prefixes ``prompt``, ``prompt + c_1``, ...,
``prompt + c_<n`` (the last continuation token needs no row of its own). Records are read
lazily; their prefixes are queued and sent to :meth:`AsyncVirtualLM.batch_next_token_logprobs_sync`
``chunk_size`` at a time, and each chunk of rows is reduced to the few numbers kept (top-k and
the continuation tokens' log-probabilities) before the next chunk is built. So memory stays
bounded by one chunk of ``[chunk_size, V]`` rows and about ``chunk_size`` records, whatever the
input size. Prefixes of one record share their KV blocks through vLLM's prefix cache (on by
default in genlm_vlm), so scoring a continuation costs about one forward pass over it.
The model's own output cache (``cache_size``) also keeps the rows it computes; a prompt that
appears in several records is computed once while its row stays cached.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from . import logs
from .cli import add_verbosity_options, verbosity_of

if TYPE_CHECKING:  # torch is imported where used: `score --help` stays light
    import torch

logger = logging.getLogger(__name__)

__all__ = ["default_model_path", "main", "read_jsonl", "score_records"]


def default_model_path() -> str:
    """The model the ``score`` command loads when ``--model`` is not given: the small model
    shipped in the package (the demo's; see ``genlm_vlm/data/demo-model/TRAINING.md``)."""
    from .demo import demo_model_path

    return demo_model_path()


# ---------------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class InvalidLine:
    """Stands for an input line that is not valid JSON (see :func:`read_jsonl`)."""

    message: str


class RecordError(ValueError):
    """A record that cannot be scored (the message goes to the output's ``error`` field)."""


#: The keys a record may have.
RECORD_KEYS = ("prompt", "continuation", "add_bos", "lora_name", "id")


def _unknown_keys(record: dict[str, Any]) -> str | None:
    """An error message naming the keys of ``record`` that are not :data:`RECORD_KEYS`."""
    unknown = [k for k in record if k not in RECORD_KEYS]
    if not unknown:
        return None
    import difflib

    parts = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), RECORD_KEYS, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        parts.append(f"{key!r}{hint}")
    noun = "key" if len(unknown) == 1 else "keys"
    return (
        f"unknown {noun} {', '.join(parts)}; a record accepts only {', '.join(RECORD_KEYS)} "
        "(put other data under 'id')"
    )


@dataclass(slots=True)
class _Job:
    line: int
    id: Any
    prompt: tuple[int, ...]
    continuation: tuple[int, ...] | None
    want_top: bool
    lora_name: str | None = None
    top: list[dict[str, Any]] | None = None
    token_logprobs: list[float] = field(default_factory=list)
    remaining: int = 0
    error: str | None = None

    def prefix_lengths(self) -> range:
        """Continuation lengths ``k`` whose prefix ``prompt + c[:k]`` needs a row."""
        n = len(self.continuation or ())
        if n == 0:
            return range(1 if self.want_top else 0)
        return range(n)

    def result(self) -> dict[str, Any]:
        if self.error is not None:
            return _error(self.id, self.line, self.error)
        out: dict[str, Any] = {"id": self.id, "line": self.line, "prompt_tokens": len(self.prompt)}
        if self.want_top:
            out["top_k"] = self.top
        if self.continuation is not None:
            out["continuation_tokens"] = len(self.continuation)
            out["continuation_logprob"] = float(sum(self.token_logprobs))
            out["token_logprobs"] = self.token_logprobs
        return out


def _error(id_: Any, line: int, message: str) -> dict[str, Any]:
    return {"id": id_, "line": line, "error": message}


def _encode(lm: Any, text: str) -> list[int]:
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(ids, "ids", ids))


def _check(lm: Any, ids: Any, what: str) -> tuple[int, ...]:
    try:
        return lm._check_ids(ids, what)
    except (TypeError, ValueError) as e:
        raise RecordError(str(e)) from None


def _tokens(lm: Any, value: Any, what: str) -> list[Any] | tuple[Any, ...]:
    """Text or token ids of a record field, as a list of ids (not yet checked against the model)."""
    if isinstance(value, str):
        return _encode(lm, value)
    ids = value.tolist() if hasattr(value, "tolist") and not isinstance(value, list | tuple) else value
    if isinstance(ids, list | tuple):
        return ids
    raise RecordError(f"{what} must be a string or a list of token ids, got {type(value).__name__}")


def _check_adapter(lm: Any, lora_name: Any, error: type[Exception]) -> None:
    """Raise ``error`` unless ``lora_name`` is a str naming an adapter registered on ``lm``."""
    if not isinstance(lora_name, str) or not lora_name:
        raise error(f"lora_name must be a non-empty string (a registered adapter's name), got {lora_name!r}")
    registry = getattr(lm, "_loras", None)
    if registry is None:  # a model without genlm_vlm's registry: its own calls will tell
        return
    try:
        registry.resolve(lora_name)
    except ValueError as e:  # UnknownAdapterError
        if error is RecordError:
            raise RecordError(str(e)) from None
        raise


def _prepare(lm: Any, line: int, record: Any, want_top: bool, default_lora: str | None = None) -> _Job:
    """Validate one record against ``lm`` and tokenize it; raises :class:`RecordError`."""
    if isinstance(record, InvalidLine):
        raise RecordError(record.message)
    if not isinstance(record, dict):
        raise RecordError(f"a record must be a JSON object, got {type(record).__name__}")
    unknown = _unknown_keys(record)
    if unknown is not None:
        raise RecordError(unknown)
    if "prompt" not in record or record["prompt"] is None:
        raise RecordError("missing 'prompt' (a text or a list of token ids)")
    add_bos = record.get("add_bos", False)
    if not isinstance(add_bos, bool):
        raise RecordError(f"add_bos must be true or false, got {add_bos!r}")
    lora_name = record.get("lora_name")
    if lora_name is None:
        lora_name = default_lora
    else:
        _check_adapter(lm, lora_name, RecordError)

    prompt = list(_tokens(lm, record["prompt"], "prompt"))
    if isinstance(record["prompt"], str) and not prompt and not add_bos:
        raise RecordError("prompt is empty: the text encodes to no tokens (set \"add_bos\": true to score from BOS)")
    if add_bos:
        bos = getattr(lm.tokenizer, "bos_token_id", None)
        if bos is None:
            raise RecordError("add_bos is true but the tokenizer has no BOS token")
        prompt.insert(0, bos)
    prompt_ids = _check(lm, prompt, "prompt")

    continuation: tuple[int, ...] | None = None
    if record.get("continuation") is not None:
        cont = _tokens(lm, record["continuation"], "continuation")
        continuation = _check(lm, cont, "continuation") if len(cont) else ()
        total = len(prompt_ids) + len(continuation)
        if total > lm.max_model_len:
            raise RecordError(
                f"prompt + continuation has {total} tokens ({len(prompt_ids)} + {len(continuation)}); "
                f"this model allows at most {lm.max_model_len} (max_model_len)"
            )
    job = _Job(line, record.get("id"), prompt_ids, continuation, want_top, lora_name)
    job.token_logprobs = [0.0] * len(continuation or ())
    job.remaining = len(job.prefix_lengths())
    return job


# ---------------------------------------------------------------------------------- token text
_TOKEN_TEXT: weakref.WeakKeyDictionary[Any, Callable[[int], str]] = weakref.WeakKeyDictionary()


def _token_text(lm: Any) -> Callable[[int], str]:
    """``token id -> str`` for the top-k output (built once per model)."""
    try:
        return _TOKEN_TEXT[lm]
    except (KeyError, TypeError):
        pass
    tokenizer = lm.tokenizer
    try:
        from .vocab import get_str_vocab

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
            try:
                job = _prepare(self.lm, line, record, want_top, self.lora_name)
            except RecordError as e:
                rid = record.get("id") if isinstance(record, dict) else None
                pending.append(_error(rid, line, str(e)))
            else:
                pending.append(job)
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


# ---------------------------------------------------------------------------------- files
def read_jsonl(lines: Iterable[str]) -> Iterator[tuple[int, dict[str, Any] | InvalidLine]]:
    """``(line number, record)`` for each non-blank line; bad JSON gives :class:`InvalidLine`."""
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            yield n, json.loads(text)
        except json.JSONDecodeError as e:
            yield n, InvalidLine(f"invalid JSON: {e}")


def _parse_engine_opt(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--engine-opt wants key=value, got {item!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        lowered = raw.strip().lower()
        value = {"true": True, "false": False, "none": None}.get(lowered, raw)
    return key.strip(), value


def _count_lines(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m genlm_vlm score",
        description=(
            "Score a JSONL file: for every record {prompt, continuation?, id?, add_bos?}, the top-k "
            "next tokens after the prompt and log p(continuation | prompt). Text is tokenized with "
            "tokenizer.encode(text, add_special_tokens=False). Writes one JSON object per input "
            "record, in order; bad records get an 'error' field and the rest are scored."
        ),
    )
    p.add_argument("input", help="input JSONL file ('-' for stdin)")
    p.add_argument("output", help="output JSONL file ('-' for stdout)")
    p.add_argument("--model", default=None, help="HF hub name or local path (default: the embedded tiny model)")
    p.add_argument("--top-k", type=int, default=5, help="next tokens to list per record; 0 for none (default 5)")
    p.add_argument("--chunk-size", type=int, default=256, help="prefixes per engine call (default 256)")
    p.add_argument(
        "--engine-opt", action="append", default=[], type=_parse_engine_opt, metavar="KEY=VALUE",
        help="vllm.LLM option, repeatable; VALUE is parsed as JSON when it can be (dtype=float32, max_model_len=4096)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_verbosity_options(p, quiet_help="no progress bar and no 'scored N, errors M' line on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m genlm_vlm score``: 0 when the file was scored (errors in records are written
    to the output, not fatal), 1 when the engine could not be built, 2 for bad options (checked
    before the model is loaded)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    problem = None
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if args.top_k < 0:
        problem = f"--top-k must be >= 0 (0 leaves the top-k list out), got {args.top_k}"
    elif args.chunk_size < 1:
        problem = f"--chunk-size must be >= 1, got {args.chunk_size}"
    elif args.input != "-" and not os.path.isfile(args.input):
        problem = f"input file not found: {args.input} (give a JSONL file, or - for stdin)"
    elif args.output != "-" and not os.path.isdir(out_dir):
        problem = f"output directory not found: {out_dir} (create it, or give - for stdout)"
    if problem is not None:
        print(f"score: error: {problem}", file=sys.stderr)
        return 2

    # stdout may carry the results ('-'): vLLM's log (genlm_vlm.logs) and any stray print go
    # to stderr
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results_out = sys.stdout
    with logs.verbosity(verbosity_of(args)), contextlib.redirect_stdout(sys.stderr):
        counts = _score_file(args, results_out)
    if counts is None:
        return 1
    if not args.quiet:
        print(f"scored {counts[0]}, errors {counts[1]}", file=sys.stderr)
    return 0


def _score_file(args: argparse.Namespace, stdout: IO[str]) -> tuple[int, int] | None:
    """``(scored, errors)``; None (after a one-line message) when the engine cannot be built."""
    from tqdm.auto import tqdm

    from .vllm_lm import AsyncVirtualLM

    verbose = logs.vllm_log_level() <= logging.INFO
    # vLLM's weight-loading bar is off unless verbose: engine.build_llm decides (as for the API)
    engine_opts = dict(args.engine_opt)
    model = args.model or default_model_path()
    try:
        lm = AsyncVirtualLM.from_name(model, engine_opts)
    except Exception as e:
        if verbose:
            raise
        print(
            f"score: error: could not build the engine for {model}: {type(e).__name__}: {e} "
            "(--verbose shows vLLM's log and the traceback)",
            file=sys.stderr,
        )
        return None
    n_ok = n_err = 0
    src: IO[str] = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    dst: IO[str] = stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    try:
        total = None if args.input == "-" else _count_lines(args.input)
        bar = tqdm(
            total=total, desc="scoring", unit="record", disable=args.no_progress or args.quiet,
            file=sys.stderr,
        )
        for result in _Scorer(lm, args.top_k, args.chunk_size).score(read_jsonl(src)):
            dst.write(json.dumps(result, ensure_ascii=False) + "\n")
            if "error" in result:
                n_err += 1
            else:
                n_ok += 1
            bar.update(1)
        bar.close()
    finally:
        if src is not sys.stdin:
            src.close()
        if dst is stdout:
            dst.flush()
        else:
            dst.close()
        lm.cleanup()
    return n_ok, n_err
