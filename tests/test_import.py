"""Import hygiene and packaging: `import genlm_vlm` and `--help` stay vLLM-free; one version."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

import genlm_vlm

REPO = pathlib.Path(__file__).resolve().parent.parent


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, **kwargs)


def _imported(stderr: str) -> set[str]:
    """Top-level module names listed by ``-X importtime`` (PYTHONPROFILEIMPORTTIME=1)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def test_import_does_not_import_vllm_or_torch():
    code = (
        "import genlm_vlm, sys\n"
        "heavy = {'vllm', 'torch', 'transformers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "print(genlm_vlm.__version__)\n"
    )
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    imported = _imported(proc.stderr)
    assert "genlm_vlm" in imported  # the profile is really there
    assert not imported & {"vllm", "torch", "transformers", "triton"}, imported
    assert "Triton" not in proc.stderr.replace("import time:", "")
    assert proc.stdout.splitlines()[0] == genlm_vlm.__version__


def test_public_names_load_without_vllm():
    code = (
        "import sys\n"
        "from genlm_vlm import AsyncLM, AsyncVirtualLM, ClosedError, UnknownAdapterError, VLLMLayoutError\n"
        "from genlm_vlm.engine.build import VLLMLayoutError as E\n"
        "assert VLLMLayoutError is E and issubclass(E, RuntimeError)\n"
        "assert issubclass(AsyncVirtualLM, AsyncLM)\n"
        "print('vllm' in sys.modules)\n"
    )
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("how", ["-m", "cli.main"])
def test_help_does_not_import_vllm_or_torch(how):
    if how == "-m":
        args = [sys.executable, "-m", "genlm_vlm", "--help"]
    else:
        args = [sys.executable, "-c", "import sys; from genlm_vlm.cli import main; sys.exit(main(['--help']))"]
    proc = _run(args)
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout and "demo" in proc.stdout
    imported = _imported(proc.stderr)
    assert "genlm_vlm" in imported
    assert not imported & {"vllm", "torch", "transformers", "triton"}, imported


HEAVY = ("torch", "vllm", "transformers")


@pytest.mark.parametrize(
    "argv,code",
    [
        (["demo", "--help"], 0),
        (["score", "--help"], 0),
        (["eval", "--help"], 0),
        (["demo", "--no-such-option"], 2),  # argparse's error
        (["demo", "--particles", "0"], 2),  # demo's own option check
        (["score", "no-such-input.jsonl", "-"], 2),
        (["demo", "--model", "/no/such/dir"], 2),  # the path is checked before torch loads
        (["score", "-", "-", "--model", "./no-such-model"], 2),
    ],
    ids=["demo-help", "score-help", "eval-help", "demo-bad-option", "demo-bad-value", "score-no-input", "demo-no-model", "score-no-model"],
)
def test_command_help_and_option_errors_do_not_import_torch(argv, code):
    """`COMMAND --help` and option errors answer without importing torch, vLLM or transformers
    (they cost seconds). Counted from sys.modules, not timed."""
    snippet = (
        "import sys\n"
        "from genlm_vlm.cli import main\n"
        "try:\n"
        f"    rc = main({argv!r})\n"
        "except SystemExit as e:\n"
        "    rc = e.code\n"
        f"print('RC', rc, 'HEAVY', ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.splitlines()[-1].split()
    assert last[:2] == ["RC", str(code)], proc.stdout + proc.stderr
    assert last[2:] == ["HEAVY"], f"{argv} imported {last[3:]}"
    if code == 0:
        assert "usage: python -m genlm_vlm " + argv[0] in proc.stdout
    else:
        assert "error" in proc.stderr


def test_console_script_help_does_not_import_vllm():
    script = shutil.which("genlm-vlm", path=str(pathlib.Path(sys.executable).parent))
    if script is None:
        pytest.skip("the genlm-vlm console script is not installed in this environment")
    proc = _run([script, "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout
    assert not _imported(proc.stderr) & {"vllm", "torch"}


def test_lazy_names_are_listed_and_cached():
    assert set(genlm_vlm.__all__) <= set(dir(genlm_vlm))
    cls = genlm_vlm.UnknownAdapterError
    assert genlm_vlm.__dict__["UnknownAdapterError"] is cls  # resolved once, then a plain attribute
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        genlm_vlm.NoSuchThing  # noqa: B018


def test_package_docstring_lists_the_public_names_and_marks_the_rest_internal():
    import re

    doc = genlm_vlm.__doc__
    named = set(re.findall(r":(?:class|func):`(\w+)`", doc)) | ({"__version__"} if "``__version__``" in doc else set())
    assert named == set(genlm_vlm.__all__), named ^ set(genlm_vlm.__all__)
    assert set(genlm_vlm.__all__) == {*genlm_vlm._LAZY, "__version__", "load_model_by_name"}
    internal = doc.split("Everything else is internal", 1)[1]
    package = REPO / "genlm_vlm"
    modules = {p.stem for p in package.glob("*.py")} | {p.parent.name for p in package.glob("*/__init__.py")}
    public = {"__init__", "__main__", "vocab", "control", "logs", "testing", "scoring", "demo", "evaluation", "smc"}
    for name in sorted(modules - public):
        assert f"``{name}``" in internal, f"{name} is neither listed as public nor marked internal"
    for name in sorted(public - {"__init__", "__main__"}):
        assert f":mod:`genlm_vlm.{name}`" in doc, name


def test_capture_classes_resolve_to_one_class_each():
    from genlm_vlm import capture

    assert genlm_vlm.GlobalLogprobsCapture is capture.GlobalLogprobsCapture
    assert capture.GlobalLogprobsCapture.__name__ == "GlobalLogprobsCapture"
    assert capture.GlobalLogprobsCapture.__module__ == "genlm_vlm.capture"
    assert genlm_vlm.GlobalLogprobsCaptureV2 is capture.GlobalLogprobsCaptureV2
    assert {"GlobalLogprobsCapture", "GlobalLogprobsCaptureV2"} <= set(dir(capture))


def test_version_has_one_source():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "genlm_vlm._version.__version__"}
    from genlm_vlm._version import __version__

    assert genlm_vlm.__version__ == __version__
    assert f"## {__version__}" in (REPO / "CHANGELOG.md").read_text()


def test_packaging_files_ship():
    assert (REPO / "genlm_vlm" / "py.typed").is_file()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["genlm_vlm"]
    assert pyproject["project"]["license"] == "Apache-2.0"
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text


@pytest.mark.parametrize(
    ("setup", "env", "expected"),
    [
        ("", {}, "ERROR"),  # quiet by default: torch's NUMA notice is hidden (issue 29)
        ("", {"TORCH_CPP_LOG_LEVEL": "INFO"}, "INFO"),  # the user's own choice stands
        ("", {"GENLM_VLM_VERBOSE": "1"}, None),  # vLLM's full log asked for: torch's too
        ("import torch\n", {}, None),  # too late to change: torch read it already
    ],
)
def test_import_quiets_torchs_cpp_warnings_unless_told_otherwise(setup, env, expected):
    base = {k: v for k, v in os.environ.items() if k not in ("TORCH_CPP_LOG_LEVEL", "GENLM_VLM_VERBOSE")}
    code = f"{setup}import os, genlm_vlm\nprint(os.environ.get('TORCH_CPP_LOG_LEVEL'))\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**base, **env})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(expected)
