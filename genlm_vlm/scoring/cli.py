"""JSONL files and the ``score`` command: reading records line by line, writing one result per
line, the options and their checks before any model is loaded, and the exit status. Internal
module of :mod:`genlm_vlm.scoring` (run it as ``python -m genlm_vlm score``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import IO, Any

from .. import logs
from .._paths import demo_model_path
from ..cli import (
    UsageError,
    add_engine_opt_option,
    add_verbosity_options,
    parse_engine_opts,
    resolve_model_arg,
    verbosity_of,
)
from .records import InvalidLine
from .scorer import _Scorer


def read_jsonl(lines: Iterable[str | bytes]) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` for each non-blank line: ``str``, or ``bytes`` read as UTF-8
    (a byte-order mark on line 1 is skipped). A line that cannot be read, whatever the reason
    (not UTF-8, invalid JSON, an integer too long for Python, nesting too deep), gives
    :class:`InvalidLine` saying why, and the lines after it are read as usual."""
    for n, text in enumerate(lines, start=1):
        try:
            if isinstance(text, bytes | bytearray):
                text = bytes(text).decode("utf-8")
                if n == 1:
                    text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            record = json.loads(text)
        except UnicodeDecodeError as e:
            yield n, InvalidLine(f"the line is not valid UTF-8: {e}")
        except json.JSONDecodeError as e:
            yield n, InvalidLine(f"invalid JSON: {e}")
        except Exception as e:  # noqa: BLE001 - e.g. ValueError (a 5,000-digit int), RecursionError
            yield n, InvalidLine(f"the line cannot be read as JSON: {type(e).__name__}: {e}")
        else:
            yield n, record


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts and lists, at any depth) replaced by
    the string ``"Infinity"``, ``"-Infinity"`` or ``"NaN"`` (valid JSON; ``float()`` reads them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _write_result(dst: IO[str], result: dict[str, Any]) -> None:
    """One result as one line of valid JSON (non-finite numbers as strings, see :func:`_finite`;
    text the output cannot encode, e.g. a lone surrogate from a JSON escape, as ``\\u`` escapes)."""
    try:
        line = json.dumps(result, ensure_ascii=False, allow_nan=False)
    except ValueError:
        line = json.dumps(_finite(result), ensure_ascii=False, allow_nan=False)
    try:
        dst.write(line + "\n")
    except UnicodeEncodeError:  # nothing was written: the line is encoded before it is written
        dst.write(json.dumps(_finite(result), ensure_ascii=True, allow_nan=False) + "\n")


@contextlib.contextmanager
def _output(path: str, stdout: IO[str]) -> Iterator[IO[str]]:
    """The results' file: ``stdout`` for ``-``; otherwise a temporary file in the output's
    folder, renamed onto ``path`` (its target, if a link) once everything is written. On an
    error or an interrupt the temporary file is removed and ``path`` is left as it was."""
    if path == "-":
        try:
            yield stdout
        finally:
            stdout.flush()
        return
    target = os.path.realpath(path)
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    # 0o666 and the umask: the permissions open(path, "w") would give a new file
    f = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w", encoding="utf-8")
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        if os.path.exists(target):
            shutil.copymode(target, tmp)
        os.replace(tmp, target)
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _count_lines(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return None


class _Progress:
    """The progress bar and the summary line of ``score``: records and tokens per second, over
    the scoring itself (from the first record read, the engine's start-up excluded). Tokens are
    the prompt and continuation tokens of the records scored."""

    def __init__(self, total: int | None, disable: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="scoring", unit="record", disable=disable, file=sys.stderr)
        self.ok = self.errors = self.tokens = 0
        self.start = time.perf_counter()
        self._shown = self.start

    def add(self, result: dict[str, Any]) -> None:
        if "error" in result:
            self.errors += 1
        else:
            self.ok += 1
            self.tokens += int(result.get("prompt_tokens", 0)) + int(result.get("continuation_tokens", 0))
        self.bar.update(1)
        now = time.perf_counter()
        if now - self._shown >= 0.5:
            self._shown = now
            self.bar.set_postfix_str(f"{self.tokens / max(now - self.start, 1e-9):,.0f} tokens/s", refresh=False)

    def close(self) -> None:
        self.elapsed = time.perf_counter() - self.start
        self.bar.close()

    def summary(self) -> str:
        t = max(getattr(self, "elapsed", time.perf_counter() - self.start), 1e-9)
        return (
            f"scored {self.ok}, errors {self.errors} in {t:.1f} s: "
            f"{(self.ok + self.errors) / t:,.1f} records/s, {self.tokens / t:,.0f} tokens/s"
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m genlm_vlm score",
        description=(
            "Score a JSONL file: for every record {prompt, continuation?, id?, add_bos?, "
            "lora_name?}, the top-k next tokens after the prompt and log p(continuation | prompt). "
            "Text is tokenized with tokenizer.encode(text, add_special_tokens=False). Writes one "
            "JSON object per input record, in order; a record that cannot be scored gets an "
            "'error' field and the others are scored."
        ),
        epilog=(
            "exit status: 0 when every record was scored; 1 when any record failed (after every "
            "record's result is written, the failed ones with their 'error') or the engine could "
            "not be built; 2 for bad options (checked before the model is loaded)"
        ),
    )
    p.add_argument("input", help="input JSONL file ('-' for stdin)")
    p.add_argument("output", help="output JSONL file ('-' for stdout)")
    p.add_argument(
        "--model", default=None, help="HF hub name or local path (default: the shipped demo model)"
    )
    p.add_argument(
        "--top-k", type=int, default=5, help="next tokens to list per record; 0 for none (default 5)"
    )
    p.add_argument(
        "--chunk-size", type=int, default=256,
        help="records in flight (prefixes per engine call where rows are used) (default 256)",
    )
    add_engine_opt_option(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_verbosity_options(
        p,
        quiet_help="no progress bar and no 'scored N, errors M' line: nothing on stderr but "
        "errors (vLLM's included)",
    )
    return p


def _check(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """``(engine options, model)`` from the options; raises :class:`UsageError` before any
    model is loaded."""
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 leaves the top-k list out), got {args.top_k}")
    if args.chunk_size < 1:
        raise UsageError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.input != "-" and not os.path.isfile(args.input):
        raise UsageError(f"input file not found: {args.input} (give a JSONL file, or - for stdin)")
    if args.output != "-":
        out_dir = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(out_dir):
            raise UsageError(f"output directory not found: {out_dir} (create it, or give - for stdout)")
        if os.path.isdir(args.output):
            raise UsageError(f"the output {args.output} is a directory: give a file name")
        if args.input != "-" and _same_file(args.input, args.output):
            raise UsageError(
                f"the output {args.output} is the input file {args.input}: writing it would destroy "
                "the input; give another output path"
            )
    engine_opts = parse_engine_opts(args.engine_opt)
    model = demo_model_path() if args.model is None else resolve_model_arg(args.model)
    return engine_opts, model


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file: by name, through links, or the same inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m genlm_vlm score``: 0 when every record was scored; 1 when any record failed
    (every record's result is written first, the failed ones with their ``error``) or the engine
    could not be built; 2 for bad options (checked before torch and vLLM are imported)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    with logs.verbosity(verbosity_of(args)):
        logs.quiet_torch_cpp_log()
        try:
            engine_opts, model = _check(args)
        except UsageError as e:
            print(f"score: error: {e}", file=sys.stderr)
            return 2
        # stdout may carry the results ('-'): vLLM's log (genlm_vlm.logs) and any stray print
        # go to stderr
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        results_out = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            counts = _score_file(args, model, engine_opts, results_out)
    if counts is None:
        return 1
    if not args.quiet:
        print(counts.summary(), file=sys.stderr)
    return 1 if counts.errors else 0


def _score_file(
    args: argparse.Namespace, model: str, engine_opts: dict[str, Any], stdout: IO[str]
) -> _Progress | None:
    """The counts (scored, errors, tokens, time); None (after a one-line message) when the
    engine cannot be built."""
    from ..vllm_lm import AsyncVirtualLM

    verbose = logs.vllm_log_level() <= logging.INFO
    # vLLM's weight-loading bar is off unless verbose: engine.build_llm decides (as for the API)
    try:
        lm = AsyncVirtualLM.from_name(model, engine_opts)
    except Exception as e:
        if verbose:
            raise
        print(
            f"score: error: could not build the engine for {args.model or model}: "
            f"{type(e).__name__}: {e} (--verbose shows vLLM's log and the traceback)",
            file=sys.stderr,
        )
        return None
    # bytes: a line that is not UTF-8 becomes that line's error record (see read_jsonl); a
    # stdin without bytes (replaced by a text stream) gives str lines
    src: IO[Any] = getattr(sys.stdin, "buffer", sys.stdin) if args.input == "-" else open(args.input, "rb")
    try:
        with _output(args.output, stdout) as dst:
            total = None if args.input == "-" else _count_lines(args.input)
            progress = _Progress(total, disable=args.no_progress or args.quiet)
            for result in _Scorer(lm, args.top_k, args.chunk_size).score(read_jsonl(src)):
                _write_result(dst, result)
                progress.add(result)
            progress.close()
    finally:
        if args.input != "-":
            src.close()
        lm.cleanup()
    return progress
