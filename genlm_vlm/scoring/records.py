"""Scoring records: what a record may hold, and turning one into token ids checked against the
model (:func:`_prepare`), or a :class:`RecordError` that names what is wrong with it. The fields
are described in :mod:`genlm_vlm.scoring`. Internal module of :mod:`genlm_vlm.scoring`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    future: Any = None
    """The prompt-logprobs path: the engine's future of this record, once submitted."""

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
