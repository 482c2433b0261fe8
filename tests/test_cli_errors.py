"""Errors that say what to do, and a quiet vLLM (issue 10, items 2 and 3).

Option errors of the ``demo`` and ``score`` commands are caught before any engine is built:
``AsyncVirtualLM.from_name`` is replaced by a function that fails the test if called, and a
subprocess checks that vLLM is not even imported. The SMC outcome messages run on a fake
model; ``sample``'s context-limit warning and vLLM's log routing run on real engines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import genlm_vlm
from genlm_vlm import MockAsyncLM, cli, demo, logs, scoring
from genlm_vlm.base import ContextLimitWarning
from genlm_vlm.batching import AutoBatcher
from genlm_vlm.demo import cli as demo_cli
from genlm_vlm.vllm_lm import AsyncVirtualLM

REPO = pathlib.Path(__file__).resolve().parent.parent
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make building an engine fail the test; returns the names of models someone tried."""
    tried: list[str] = []

    def refuse(model, engine_opts=None, **kwargs):
        tried.append(str(model))
        raise AssertionError(f"an engine was built for {model}")

    monkeypatch.setattr(AsyncVirtualLM, "from_name", staticmethod(refuse))
    monkeypatch.setattr(demo_cli, "default_engine_opts", lambda: {"max_model_len": 512})
    return tried


# --------------------------------------------------------------------- demo: bad options
DEMO_BAD = [
    (["--regex", "["], ["--regex", "not a valid regular expression", "escape", r"\["]),
    (["--regex", "a(b"], ["--regex", "not a valid regular expression"]),
    (["--allowed-chars", ""], ["--allowed-chars is empty", "e.g. --allowed-chars"]),
    (["--particles", "0"], ["--particles must be >= 1", "got 0"]),
    (["--max-tokens", "0"], ["--max-tokens must be >= 1"]),
    (["--seed", "-3"], ["--seed must be >= 0", "got -3"]),
    (["--ess-threshold", "1.5"], ["--ess-threshold must be between 0", "and 1", "got 1.5"]),
    (["--ess-threshold", "nan"], ["--ess-threshold must be between 0"]),
    (["--max-tokens", "600"], ["--max-tokens 600", "max_model_len=512", "--engine-opt max_model_len="]),
    (
        ["--max-tokens", "100", "--engine-opt", "max_model_len=64"],
        ["max_model_len=64", "lower --max-tokens"],
    ),
    (["--engine-opt", "novalue"], ["--engine-opt expects key=value", "'novalue'"]),
]


@pytest.mark.parametrize("argv,needles", DEMO_BAD, ids=[" ".join(a) for a, _ in DEMO_BAD])
def test_demo_option_errors_before_the_model_loads(argv, needles, no_engine, capsys) -> None:
    assert demo.main([*argv, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("demo: error: "), captured.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert no_engine == []


def test_demo_quiet_and_verbose_exclude_each_other(no_engine, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--quiet", "--verbose"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert no_engine == []


def test_bad_regex_exits_at_once_without_importing_vllm() -> None:
    """The command itself, in a fresh interpreter: one line on stderr and vLLM never imported."""
    code = (
        "import sys\n"
        "from genlm_vlm.cli import main\n"
        "rc = main(['demo', '--regex', '['])\n"
        "print('vllm imported' if 'vllm' in sys.modules else 'vllm not imported')\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.strip() == "vllm not imported"
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "not a valid regular expression" in proc.stderr and "[rank0]" not in proc.stderr


def test_regex_constraint_names_a_bad_pattern() -> None:
    with pytest.raises(ValueError, match=r"not a valid regular expression.*escape"):
        demo.compile_regex("(")
    with pytest.raises(ValueError, match="allowed character set is empty.*e.g."):
        demo.CharSetConstraint("", [b"a"], 0)


def test_global_flags_before_the_command_are_passed_on(monkeypatch) -> None:
    from genlm_vlm import cli

    seen: list[list[str]] = []
    monkeypatch.setattr(demo_cli, "main", lambda argv: seen.append(list(argv)) or 0)
    assert cli.main(["--verbose", "demo", "--particles", "3"]) == 0
    assert seen == [["--particles", "3", "--verbose"]]
    assert "--quiet" in cli._usage() and "GENLM_VLM_VERBOSE" in cli._usage()


# ------------------------------------------------------------- demo: outcomes on a fake model
VOCAB = [b"<s>", b"</s>", b"a", b"b", b" ", b"ab", b".", b"\xc3"]


class FakeTokenizer:
    bos_token_id, eos_token_id, all_special_ids = 0, 1, [0, 1]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [VOCAB.index(c.encode()) for c in text]


class FakeModel(MockAsyncLM):
    """Stands for AsyncVirtualLM in the demo: fixed next-token probabilities (the mock's
    ``smc`` runs the same algorithm per token in Python)."""

    def __init__(self, probs: dict[int, float]) -> None:
        super().__init__(FakeTokenizer(), byte_vocab=VOCAB, max_model_len=64)
        p = torch.zeros(len(VOCAB), dtype=torch.float64)
        for i, v in probs.items():
            p[i] = v
        self.row = torch.log(p / p.sum()).float()
        self.opts: dict | None = None
        self.cleaned = False

    def _compute(self, ids, adapter) -> torch.Tensor:
        return self.row.clone()

    def cleanup(self) -> None:
        self.cleaned = True
        super().cleanup()


@pytest.fixture
def fake_model(monkeypatch):
    """Install a FakeModel factory: ``fake_model(probs)`` returns the model the demo will get."""
    holder: dict = {}

    def install(probs: dict[int, float]) -> FakeModel:
        model = FakeModel(probs)
        holder["model"] = model

        def from_name(name, engine_opts=None, **kwargs):
            model.opts = dict(engine_opts or {})
            model.level = logs.vllm_log_level()
            return model

        monkeypatch.setattr(AsyncVirtualLM, "from_name", staticmethod(from_name))
        monkeypatch.setattr(demo_cli, "default_engine_opts", lambda: {"max_model_len": 512})
        return model

    return install


def test_unsatisfiable_constraint_is_refused_before_smc(fake_model, capsys) -> None:
    model = fake_model({2: 0.5, 3: 0.5})
    rc = demo.main(["--allowed-chars", "a", "--regex", "b+", "--no-progress", "--prompt", "a"])
    captured = capsys.readouterr()
    assert rc == 2 and model.cleaned
    assert "empty language" in captured.err and "can start a text the constraint allows" in captured.err
    assert "Allow more characters (--allowed-chars) or loosen --regex" in captured.err
    assert "particles (" not in captured.out  # SMC never ran


def test_only_eos_allowed_is_refused_before_smc(fake_model, capsys) -> None:
    fake_model({2: 0.5, 1: 0.5})
    assert demo.main(["--allowed-chars", "z", "--no-progress", "--prompt", "a"]) == 2
    assert "allows only EOS right after the prompt" in capsys.readouterr().err


def test_all_particles_dying_is_said_plainly(fake_model, capsys) -> None:
    # "a" is allowed first, but the regex then needs "b", which --allowed-chars forbids.
    fake_model({2: 0.4, 3: 0.4, 1: 0.2})
    argv = ["--allowed-chars", "a", "--regex", "ab", "--particles", "4", "--prompt", "a"]
    rc = demo.main([*argv, "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "no particle can satisfy the constraint: all 4 died at step 2" in out
    assert "estimated log P(constraint) = -inf" in out and "Relax the constraint" in out
    rows = [line for line in out.splitlines() if re.match(r"^  \d\.\d{4}  x", line)]
    assert rows == ['  0.0000  x4   "a" + "a"  <dead>'], out


def test_no_particle_finishing_is_said_with_what_to_raise(fake_model, capsys) -> None:
    """No EOS has probability, so every particle is cut at --max-tokens: the report says that no
    particle finished (the posterior is empty) and to raise --max-tokens. Before, it printed a
    finite estimate as if the texts were complete."""
    fake_model({2: 0.5, 3: 0.5})
    rc = demo.main(["--allowed-chars", "ab", "--particles", "4", "--max-tokens", "3", "--prompt", "a"])
    out = capsys.readouterr().out
    assert rc == 0, out  # no error: the texts were cut, not refused
    assert "particles: 0 of 4 ended with EOS, 4 cut off by --max-tokens 3" in out
    assert "no particle ended with EOS within --max-tokens 3 (4 of 4 cut off)" in out
    assert "raise --max-tokens for complete texts" in out


def test_output_explains_weights_and_cut_off_particles(fake_model, capsys) -> None:
    fake_model({2: 0.45, 3: 0.45, 1: 0.05, 6: 0.05})
    rc = demo.main(["--allowed-chars", "ab", "--particles", "16", "--max-tokens", "3", "--prompt", "a"])
    captured = capsys.readouterr()
    assert rc == 0
    out = captured.out
    assert "weight: the particles' share of the normalised SMC weight" in out
    assert "<eos>: ended with EOS" in out and "no mark: cut off by --max-tokens" in out
    m = re.search(r"estimated log P\(constraint\) = (-?\d+\.\d+)", out)
    assert m and math.isfinite(float(m.group(1)))
    ended = re.search(r"^particles: (\d+) of 16 ended with EOS, (\d+) cut off by --max-tokens 3$", out, re.M)
    assert ended, out
    rows = [line for line in out.splitlines() if re.match(r"^  \d\.\d{4}  x", line)]
    unmarked = sum(int(re.search(r"x(\d+)", r).group(1)) for r in rows if not r.endswith(">"))
    eos = sum(int(re.search(r"x(\d+)", r).group(1)) for r in rows if r.endswith("<eos>"))
    assert int(ended.group(2)) == unmarked > 0 and int(ended.group(1)) == eos
    assert f"({unmarked} of 16 particles were cut off: their texts are unfinished" in out
    assert re.search(r"^SMC: \d+ steps, (resampled|never resampled)", out, re.M), out
    # the run is one burst: no progress bar, nothing on stderr
    assert "one burst" in out and captured.err == ""


def test_quiet_leaves_stderr_empty_and_verbose_shows_vllm(fake_model, capsys) -> None:
    model = fake_model({2: 0.5, 3: 0.4, 1: 0.1})
    assert demo.main(["--quiet", "--max-tokens", "2", "--allowed-chars", "ab", "--prompt", "a"]) == 0
    assert capsys.readouterr().err == ""
    # vLLM's weight-loading bar is build_llm's business (test_build_llm_hides_the_loading_bar...)
    assert model.level == logging.ERROR and "use_tqdm_on_load" not in model.opts
    model = fake_model({2: 0.5, 3: 0.4, 1: 0.1})
    argv = ["--verbose", "--max-tokens", "2", "--no-progress", "--allowed-chars", "ab", "--prompt", "a"]
    assert demo.main(argv) == 0
    assert model.level <= logging.INFO and "use_tqdm_on_load" not in model.opts
    assert logs._explicit is None  # the command's choice ends with it


def test_engine_failure_is_one_line_unless_verbose(monkeypatch, capsys, tmp_path) -> None:
    def broken(name, engine_opts=None, **kwargs):
        raise OSError("no config.json in the model folder")

    monkeypatch.setattr(AsyncVirtualLM, "from_name", staticmethod(broken))
    monkeypatch.setattr(demo_cli, "default_engine_opts", lambda: {})
    assert demo.main(["--model", str(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    assert f"could not build the engine for {tmp_path}: OSError: no config.json" in err
    assert "--verbose shows vLLM's log and the traceback" in err
    with pytest.raises(OSError, match="no config.json"):
        demo.main(["--model", str(tmp_path), "--no-progress", "--verbose"])


# ----------------------------------------------------------------------- score: records, CLI
class FakeScoringModel:
    """Enough of AsyncVirtualLM for score_records; counts the prefixes it is asked for."""

    vocab_size = 8
    max_model_len = 64

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.prefixes = 0
        self.opts: dict | None = None

    def _check_ids(self, ids, what="token_ids"):
        return tuple(int(i) for i in ids)

    def batch_next_token_logprobs_sync(self, prompts, **kwargs):
        self.prefixes += len(prompts)
        return torch.log_softmax(torch.arange(8, dtype=torch.float32), 0).expand(len(prompts), 8)

    def cleanup(self) -> None:
        pass


def test_unknown_record_key_is_an_error_naming_it() -> None:
    lm = FakeScoringModel()
    records = [
        {"id": "typo", "prompt": "ab", "contination": "a"},
        {"id": "two", "promt": "a", "extra": 1},
        {"id": "ok", "prompt": "ab", "continuation": "a"},
    ]
    typo, two, ok = scoring.score_records(lm, records, top_k=0)
    assert set(typo) == {"id", "line", "error"} and typo["id"] == "typo"
    assert "unknown key 'contination' (did you mean 'continuation'?)" in typo["error"]
    assert "accepts only prompt, continuation, add_bos, lora_name, id" in typo["error"]
    assert "unknown keys 'promt' (did you mean 'prompt'?), 'extra'" in two["error"]
    assert ok["continuation_tokens"] == 1 and "error" not in ok
    assert lm.prefixes == 1  # only the good record reached the model


SCORE_BAD = [
    (["--top-k", "-1"], ["--top-k must be >= 0", "got -1"]),
    (["--chunk-size", "0"], ["--chunk-size must be >= 1", "got 0"]),
]


@pytest.mark.parametrize("extra,needles", SCORE_BAD)
def test_score_option_errors_before_the_model_loads(extra, needles, tmp_path, no_engine, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n')
    assert scoring.main([str(src), str(tmp_path / "out.jsonl"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("score: error: ") and err.splitlines() == [err]
    for needle in needles:
        assert needle in err
    assert no_engine == [] and not (tmp_path / "out.jsonl").exists()


def test_score_quiet_and_verbose(tmp_path, monkeypatch, capsys) -> None:
    built: list[FakeScoringModel] = []

    def from_name(name, engine_opts=None, **kwargs):
        lm = FakeScoringModel()
        lm.opts = dict(engine_opts or {})
        lm.level = logs.vllm_log_level()
        built.append(lm)
        return lm

    monkeypatch.setattr(AsyncVirtualLM, "from_name", staticmethod(from_name))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt": "a", "continuation": "b"}\n{"prompt": "a", "contination": "b"}\n')

    assert scoring.main([str(src), str(dst), "--quiet"]) == 1  # a record failed
    assert capsys.readouterr().err == ""
    assert built[-1].level == logging.ERROR and built[-1].opts == {}
    assert "unknown key 'contination'" in dst.read_text().splitlines()[1]

    assert scoring.main([str(src), str(dst), "--verbose", "--no-progress"]) == 1
    assert "scored 1, errors 1" in capsys.readouterr().err
    assert built[-1].level <= logging.INFO and built[-1].opts == {}
    assert logs._explicit is None

    with pytest.raises(SystemExit):
        scoring.main([str(src), str(dst), "--quiet", "--verbose"])


def test_score_exit_status_says_whether_every_record_was_scored(tmp_path, monkeypatch, capsys) -> None:
    """1 when any record failed, after every record's result was written (the failed ones with
    their error); 0 when all were scored."""
    monkeypatch.setattr(AsyncVirtualLM, "from_name", staticmethod(lambda name, opts=None, **kw: FakeScoringModel()))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": 1, "prompt": "a"}\n{not json\n{"id": 3, "prompt": "ab", "continuation": "b"}\n')
    assert scoring.main([str(src), str(dst), "--no-progress"]) == 1
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["line"] for r in out] == [1, 2, 3]
    assert "error" not in out[0] and "invalid JSON" in out[1]["error"] and out[2]["continuation_tokens"] == 1
    assert "scored 2, errors 1" in capsys.readouterr().err
    src.write_text('{"id": 1, "prompt": "a"}\n')
    assert scoring.main([str(src), str(dst), "--no-progress", "--quiet"]) == 0
    assert "exit status: 0 when every record was scored; 1 when any record failed" in " ".join(
        scoring.cli._parser().format_help().split()
    )


def test_engine_opt_values_are_parsed_one_way_in_both_commands(tmp_path, monkeypatch, capsys) -> None:
    from genlm_vlm.engine import options

    monkeypatch.setattr(options, "vllm_option_names_from_source", lambda: None)  # names made up below
    items = ["a=1", "b=0.5", "c=true", "d=None", "e=float32", 'f={"x": [1, 2]}', 'g="7"', "h=x=y", "a=2"]
    want = {"a": 2, "b": 0.5, "c": True, "d": None, "e": "float32", "f": {"x": [1, 2]}, "g": "7", "h": "x=y"}
    assert cli.parse_engine_opts(items) == want
    argv = [arg for item in items for arg in ("--engine-opt", item)]
    seen: list[dict] = []

    def from_name(name, engine_opts=None, **kwargs):
        seen.append(dict(engine_opts or {}))
        raise RuntimeError("stop here")

    monkeypatch.setattr(AsyncVirtualLM, "from_name", staticmethod(from_name))
    monkeypatch.setattr(demo_cli, "default_engine_opts", lambda: {})
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n')
    assert demo.main([*argv, "--no-progress"]) == 1
    assert scoring.main([str(src), str(tmp_path / "out.jsonl"), *argv]) == 1
    assert seen == [want, want]
    capsys.readouterr()
    # ... and documented the same way
    helps = [" ".join(p.format_help().split()) for p in (demo.build_parser(), scoring.cli._parser())]
    for text in helps:
        assert " ".join(cli.ENGINE_OPT_HELP.split()) in text
    for bad in (demo.main, lambda a: scoring.main([str(src), "-", *a])):
        assert bad(["--engine-opt", "=3"]) == 2
        assert "--engine-opt expects key=value, got '=3'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "score", "bench"])
@pytest.mark.parametrize("model", ["/no/such/dir", "./missing-model", "no//hub-id"])
def test_missing_model_fails_in_well_under_a_second(command, model, tmp_path) -> None:
    """From the command line: one line naming the path, status 2, before torch or vLLM load."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n')
    args = {"demo": ["demo", "--model", model], "score": ["score", str(src), "-", "--model", model],
            "bench": ["bench", "--model", model, "--out", str(tmp_path / "out")]}[command]
    code = (
        "import sys\n"
        "from genlm_vlm.cli import main\n"
        f"rc = main({args!r})\n"
        "print('HEAVY', sorted({'torch', 'vllm', 'transformers'} & set(sys.modules)))\n"
        "sys.exit(rc)\n"
    )
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.strip() == "HEAVY []"
    err = proc.stderr.strip()
    assert err.splitlines() == [err] and err.startswith(f"{command}: error: --model: no such directory")
    assert elapsed < 1.0, f"{elapsed:.2f} s"


def test_cli_docstring_and_usage_name_the_real_commands() -> None:
    assert set(cli._COMMANDS) == {"demo", "score", "eval", "bench"}
    for name in cli._COMMANDS:
        assert f"``{name}``" in cli.__doc__ and f"  {name} " in cli._usage()
    assert "info" not in cli.__doc__ and "info" not in cli._usage()


# ----------------------------------------------------------------------------- logs module
@pytest.fixture
def clean_logs(monkeypatch):
    """Isolate genlm_vlm.logs: its state, the variables it writes, the vllm logger."""
    names = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", logs.ENV_VERBOSE)
    saved_env = {n: os.environ.get(n) for n in names}
    state = (logs._explicit, dict(logs._original_env), dict(logs._written_env))
    vllm_logger = logging.getLogger("vllm")
    saved_logger = (vllm_logger.level, list(vllm_logger.handlers))
    for n in names:
        os.environ.pop(n, None)
    logs._explicit = None
    logs._original_env.clear()
    logs._written_env.clear()
    with warnings.catch_warnings():  # restores the filters configure_vllm_logging changes
        yield vllm_logger
    for n, v in saved_env.items():
        if v is None:
            os.environ.pop(n, None)
        else:
            os.environ[n] = v
    logs._explicit = state[0]
    logs._original_env.clear()
    logs._original_env.update(state[1])
    logs._written_env.clear()
    logs._written_env.update(state[2])
    vllm_logger.setLevel(saved_logger[0])
    vllm_logger.handlers[:] = saved_logger[1]


def test_logs_default_is_errors_only_on_stderr(clean_logs) -> None:
    handler = logging.StreamHandler(sys.stdout)  # what vLLM's own configuration installs
    handler.set_name("vllm")
    clean_logs.handlers[:] = [handler]
    logs.configure_vllm_logging()
    assert logs.vllm_log_level() == logging.ERROR
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"
    assert clean_logs.level == logging.ERROR and handler.level == logging.ERROR
    assert handler.stream is sys.stderr
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        logs.configure_vllm_logging()  # re-adds its filter in front
        warnings.warn_explicit("old API", FutureWarning, "x.py", 1, module="vllm.triton_utils")
        warnings.warn_explicit("old API", FutureWarning, "x.py", 1, module="mypkg")
    assert [str(w.message) for w in caught] == ["old API"]  # only the user's own module's


def test_logs_verbose_env_and_user_settings(clean_logs, monkeypatch) -> None:
    monkeypatch.setenv(logs.ENV_VERBOSE, "1")
    assert logs.vllm_log_level() == logging.INFO
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's own: verbose shows it all
    assert logs.vllm_log_level() == logging.DEBUG
    monkeypatch.delenv(logs.ENV_VERBOSE)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")  # respected by default ...
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stdout")
    logs.configure_vllm_logging()
    assert logs.vllm_log_level() == logging.WARNING
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stdout"  # the user's choice stays
    with logs.verbosity(False):  # ... but not over an explicit choice
        assert logs.vllm_log_level() == logging.ERROR
        assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
        with logs.verbosity(True):
            assert logs.vllm_log_level() == logging.INFO
    assert logs.vllm_log_level() == logging.WARNING
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"  # given back
    logs.set_verbosity(None, level="warning")
    assert logs.vllm_log_level() == logging.WARNING
    with pytest.raises(ValueError, match="unknown log level 'loud': use DEBUG, INFO"):
        logs.set_verbosity(True, level="loud")
    with pytest.raises(TypeError, match="True, False or None"):
        logs.set_verbosity("yes")  # type: ignore[arg-type]


def test_build_llm_hides_the_loading_bar_unless_verbose(clean_logs, monkeypatch) -> None:
    """The one place engines are built (CLIs and AsyncVirtualLM.from_name alike) turns vLLM's
    weight-loading progress bar off while genlm_vlm is quiet; an explicit option wins."""
    import vllm

    from genlm_vlm.engine import build_llm

    class Built(Exception):
        pass

    seen: list[dict] = []

    def fake_llm(*args, **kwargs):
        seen.append(kwargs)
        raise Built

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    model = genlm_vlm.demo_model_path()
    for verbose, opts, want in [
        (None, {}, False),  # the default: quiet
        (False, {}, False),
        (True, {}, None),  # vLLM's default: the bar shows
        (False, {"use_tqdm_on_load": True}, True),  # the caller's choice wins
    ]:
        with logs.verbosity(verbose), pytest.raises(Built):
            build_llm(model, dict(opts))
        assert seen[-1].get("use_tqdm_on_load") is want, (verbose, opts, seen[-1])


def test_vllm_log_goes_to_stderr_quiet_then_verbose() -> None:
    """Two real engines in one process: the default shows none of vLLM's INFO/WARNING lines,
    set_verbosity(True) shows them (on an engine built after the first one, whose environment
    vLLM has cached by then); stdout stays empty throughout."""
    code = (
        "import sys\n"
        "from genlm_vlm import AsyncVirtualLM, demo_model_path, logs\n"
        "opts = {'dtype': 'float32', 'max_model_len': 64, 'kv_cache_memory_bytes': 32 << 20}\n"
        "for verbose in (None, True):\n"
        "    if verbose is not None:  # the first engine: build_llm applies the default\n"
        "        logs.set_verbosity(verbose)\n"
        "    print(f'=== verbose={verbose}', file=sys.stderr, flush=True)\n"
        "    lm = AsyncVirtualLM.from_name(demo_model_path(), dict(opts))\n"
        "    lm.next_token_logprobs_sync([1, 2])\n"
        "    lm.cleanup()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == ""
    quiet, verbose = proc.stderr.split("=== verbose=None", 1)[1].split("=== verbose=True", 1)
    vllm_line = re.compile(r"^\(\S+ pid=\d+\) (INFO|WARNING) ", re.M)
    assert not vllm_line.search(quiet), quiet
    assert "Triton is installed" not in quiet and "FutureWarning" not in quiet
    assert len(re.findall(r"^\(\S+ pid=\d+\) INFO ", verbose, re.M)) >= 3, verbose


# ------------------------------------------------------------------ sample at the context limit
async def test_sample_warns_when_the_context_limit_cuts_it(llama_lm) -> None:
    lm = llama_lm  # max_model_len 512
    long_prompt = [5] * 500
    for seed in (None, 7):
        with pytest.warns(ContextLimitWarning, match=r"max_model_len=512 before max_tokens=50") as w:
            out = await lm.sample(long_prompt, 50, [], seed=seed)
        assert len(long_prompt) + len(out) == 512, (seed, len(out))
        assert "Shorten the prompt" in str(w[0].message) and "'max_model_len'" in str(w[0].message)
        assert w[0].filename == __file__  # points at the caller
    with pytest.warns(ContextLimitWarning, match=r"1 of 2 samples \(first: index 1\)"):
        outs = await lm.batch_sample([[5, 6], long_prompt], 20, [], seed=3)
    assert len(outs[0]) == 20 and len(outs[1]) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContextLimitWarning)
        assert len(await lm.sample([5] * 400, 50, [], seed=1)) == 50  # fits: no warning


# ------------------------------------------------------------------- two event loops, one model
def test_second_event_loop_is_told_what_is_supported() -> None:
    started = threading.Event()
    hold = True
    pending: list[concurrent.futures.Future] = []

    def start(requests):
        futures = [concurrent.futures.Future() for _ in requests]
        if hold:  # the first loop's call stays in flight until the test lets it finish
            pending.extend(futures)
            started.set()
        else:
            for f in futures:
                f.set_result(0)
        return futures

    batcher = AutoBatcher(start=start, name="logprobs")
    first = threading.Thread(target=lambda: asyncio.run(batcher.submit(1)))
    first.start()
    try:
        assert started.wait(30)
        with pytest.raises(RuntimeError) as exc:
            asyncio.run(batcher.submit(2))
        message = str(exc.value)
        assert "busy on another event loop" in message
        assert "one event loop at a time" in message
        assert "*_sync methods (thread-safe)" in message
        assert "asyncio.run_coroutine_threadsafe" in message
        assert "once the old loop's calls have finished" in message
    finally:
        hold = False
        for f in pending:
            f.set_result(0)
        first.join(30)
    assert not first.is_alive()
    assert asyncio.run(batcher.submit(3)) == 0  # idle again: a new loop takes over
