"""notebooks/quickstart.ipynb: committed with the outputs of one in-order run, and re-runnable.

``scripts/make_notebook.py`` holds the cells and writes the executed notebook. The fast tests read
the committed file (valid, executed in order, no errors or stderr, the generator's cells, the
results its text promises); the slow test runs it again in a fresh kernel of this interpreter and
compares the outputs of the cells tagged ``deterministic`` with the committed ones.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import pathlib
import re
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
GENERATOR = REPO / "scripts" / "make_notebook.py"
KERNEL = "genlm-vlm-test"
#: The SMC cell's constraint, as the printed texts show it ("the" + words + ".").
SMC_TEXT = re.compile(r"the( [a-z]+){3,6}\.")
FOX = "the quick brown fox jumps over the lazy dog."
_FLOAT = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


@pytest.fixture
def kernel_name(tmp_path, monkeypatch) -> str:
    """A kernelspec that runs ``sys.executable``, found only by this test (nothing is installed)."""
    from ipykernel.kernelspec import install

    spec_dir = pathlib.Path(install(kernel_name=KERNEL, prefix=str(tmp_path)))
    assert json.loads((spec_dir / "kernel.json").read_text())["argv"][0] == sys.executable
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    # the kernel inherits this environment: import genlm_vlm from this checkout
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    return KERNEL


def _read():
    return nbformat.read(NOTEBOOK, as_version=4)


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def _text(cell) -> str:
    """Everything a code cell printed or displayed as text (stream chunks joined)."""
    parts = []
    for o in cell.outputs:
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            parts.append(str(o.get("data", {}).get("text/plain", "")) + "\n")
    return "".join(parts)


def _outputs(nb) -> dict[str, str]:
    return {c.id: _text(c) for c in _code_cells(nb)}


def _problems(nb) -> list[str]:
    """Error outputs and stderr output, by cell."""
    found = []
    for c in _code_cells(nb):
        for o in c.outputs:
            if o.output_type == "error":
                found.append(f"{c.id}: {o.ename}: {o.evalue}")
            elif o.output_type == "stream" and o.name == "stderr":
                found.append(f"{c.id}: stderr: {o.text[:500]}")
    return found


def _line(text: str, prefix: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip().startswith(prefix)]
    assert len(lines) == 1, (prefix, text)
    return lines[0].strip()


def _number_after(text: str, prefix: str) -> float:
    return float(_line(text, prefix)[len(prefix) :].split()[0].rstrip(";,"))


def _check_results(out: dict[str, str]) -> None:
    """What the notebook's text says it shows, checked on its printed outputs."""
    rows = out["rows"]
    assert abs(_number_after(rows, "sum of exp(row):") - 1.0) < 1e-4, rows
    assert "row: shape (1536,), torch.float32, on cpu" in rows
    probs = [float(m) for m in re.findall(r"p = (\d\.\d+)", rows)]
    assert len(probs) == 5 and probs == sorted(probs, reverse=True) and 0 < probs[-1] <= probs[0] < 1, rows
    assert "next_token_logprobs_sync gives the same row: True" in rows

    gather = out["gather"]
    assert "64 awaits -> 1 engine call, 8 rows computed, 56 awaits shared a row" in gather, gather
    assert "batch: shape (8, 1536), 8 rows from the cache" in gather, gather

    score = out["score"]
    assert "sync rows equal the async ones: True" in score
    per_token = [float(m) for m in re.findall(r"^\s+'.*'\s+(-?\d+\.\d+)$", score, re.M)]
    total = _number_after(score, "log p(continuation | prompt) =")
    assert len(per_token) == 5 and all(lp < 0 for lp in per_token), score
    assert math.isclose(sum(per_token), total, abs_tol=0.01), score

    records = [ast.literal_eval(ln) for ln in out["records"].splitlines()]
    assert [r["id"] for r in records] == ["text", "ids", "typo"], records
    assert "contination" in records[2]["error"] and "continuation_logprob" not in records[2]
    # the token-id record scores the same tokens as the score cell; the text one lacks the EOS
    assert math.isclose(records[1]["continuation_logprob"], total, abs_tol=2e-3), (records[1], total)
    assert math.isclose(records[0]["continuation_logprob"], sum(per_token[:-1]), abs_tol=0.01), records[0]
    assert records[0]["top_k"] == records[1]["top_k"] and len(records[0]["top_k"]) == 2

    sample = out["sample"]
    assert "same seed, same tokens: True" in sample
    texts = [ast.literal_eval(ln.strip()) for ln in sample.splitlines() if ln.startswith("  ")]
    assert len(texts) == 3 and len(set(texts)) == 3 and all(t.startswith("the") for t in texts), sample

    smc = out["smc"]
    assert _number_after(smc, "estimated log P(constraint) =") < 0
    posterior = [(float(p), ast.literal_eval(t)) for p, t in re.findall(r"^\s+(\d\.\d+)\s+(['\"].*['\"])$", smc, re.M)]
    assert posterior, smc
    for _, text in posterior:
        assert SMC_TEXT.fullmatch(text), text
    assert math.isclose(sum(p for p, _ in posterior), 1.0, abs_tol=0.01), smc

    bridge = out["smc-bridge"]
    assert _number_after(bridge, "estimated log P(constraint) =") < 0
    posterior = [(float(p), ast.literal_eval(t)) for p, t in re.findall(r"^\s+(\d\.\d+)\s+(['\"].*['\"])$", bridge, re.M)]
    assert posterior and all(SMC_TEXT.fullmatch(t) for _, t in posterior), bridge

    engine = out["smc-engine"]
    assert "same particles and weights in Python: True" in engine, engine
    assert _number_after(engine, "estimated log P(constraint) =") < 0
    texts = [ast.literal_eval(t) for t in re.findall(r"^\s+\d\.\d+\s+(['\"].*['\"])$", engine, re.M)]
    assert texts and all(SMC_TEXT.fullmatch(t) for t in texts), engine

    assert "adapters: ['fox']" in out["lora-train"]
    assert _number_after(out["lora-train"], "training loss after 60 steps:") < 1.0

    lora = out["lora"]
    assert _number_after(lora, "after 'the': max |fox row - base row| =") > 0.5, lora
    base, fox = lora.split("lora_name='fox':")
    assert _line(fox, "greedy:") == f"greedy: {FOX!r}", lora
    assert _line(base, "greedy:") != f"greedy: {FOX!r}", lora
    assert _line(base, "likeliest after") != _line(fox, "likeliest after"), lora
    assert _number_after(fox, "log p(sentence) =") > _number_after(base, "log p(sentence) =") + 20, lora

    assert "sessions:" in out["stats"] and "engine:" in out["stats"]
    assert out["cleanup"].startswith("ClosedError: "), out["cleanup"]


def test_committed_notebook_was_executed_in_order_without_errors():
    nb = _read()
    nbformat.validate(nb)
    code = _code_cells(nb)
    assert len(code) >= 10
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "run every cell once, in order"
    problems = _problems(nb)
    assert not problems, problems
    for c in code:
        for o in c.outputs:
            if o.output_type == "execute_result":
                assert o.execution_count == c.execution_count, c.id
        assert "execution" not in c.metadata, f"{c.id}: timestamps in the committed notebook"
    assert nb.metadata.kernelspec.name == "python3"
    assert NOTEBOOK.stat().st_size < 60_000, "outputs should stay small"


def test_committed_notebook_has_the_generators_cells():
    spec = importlib.util.spec_from_file_location("make_notebook", GENERATOR)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)

    def cells(nb):
        return [(c.cell_type, c.id, c.source, c.metadata.get("tags", [])) for c in nb.cells]

    assert cells(_read()) == cells(generator.build()), "run scripts/make_notebook.py and commit its output"


def test_committed_outputs_show_the_promised_results():
    _check_results(_outputs(_read()))


@pytest.mark.slow
def test_quickstart_reruns_with_the_committed_outputs(kernel_name):
    committed = _read()
    nb = _read()
    for c in _code_cells(nb):
        c.outputs, c.execution_count = [], None
    client = nbclient.NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=600,
        startup_timeout=120,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    problems = _problems(nb)
    assert not problems, problems
    out = _outputs(nb)
    _check_results(out)
    old = _outputs(committed)
    deterministic = [c.id for c in _code_cells(nb) if "deterministic" in c.metadata.get("tags", [])]
    assert len(deterministic) >= 8
    for cell_id in deterministic:
        # same tokens, texts, ids and counts; printed floats may differ in their last digits
        assert _FLOAT.sub("<float>", out[cell_id]) == _FLOAT.sub("<float>", old[cell_id]), cell_id
