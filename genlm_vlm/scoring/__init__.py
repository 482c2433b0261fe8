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

It writes every record's result, prints a summary (records scored, errors, records/s and
tokens/s) on stderr, then exits with status 0 when every record was scored, 1 when
any record failed (its output line has an ``error`` field) or the engine could not be built, and
2 for bad options (checked before the model is loaded).

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

How it runs: where the model has it (an :class:`~genlm_vlm.AsyncVirtualLM` on vLLM >= 0.32,
the default ``logprobs_mode``, no ``enable_lora``), every record is one scoring query computed
from vLLM's prompt log-probabilities (``continuation_logprobs``' path: no full rows; a prompt
shared by several records, as in multiple choice, is computed once). Records are read lazily and
submitted in small groups as they are read; at most ``chunk_size`` records are held (read, in
flight, or finished and waiting for an earlier one), so memory is bounded whatever the input
size. Elsewhere (or for a model without that path) every record needs the rows of its prefixes
``prompt``, ``prompt + c_1``, ..., ``prompt + c_<n`` (the last continuation token needs no row
of its own): they are queued and sent to
:meth:`AsyncVirtualLM.batch_next_token_logprobs_sync` ``chunk_size`` at a time, and each chunk of
rows is reduced to the few numbers kept (top-k and the continuation tokens' log-probabilities)
before the next chunk is built; prefixes of one record share their KV blocks through vLLM's
prefix cache, and the model's output cache keeps the rows it computes.

Module map (internal modules; the names below are the public ones): :mod:`.records` (fields
and their checks), :mod:`.scorer` (:func:`score_records`), :mod:`.cli` (JSONL files and the
``score`` command).
"""

from __future__ import annotations

from .cli import main, read_jsonl
from .records import RECORD_KEYS, InvalidLine, RecordError
from .scorer import score_records

__all__ = ["RECORD_KEYS", "InvalidLine", "RecordError", "main", "read_jsonl", "score_records"]
