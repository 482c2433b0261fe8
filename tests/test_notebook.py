"""Run every cell of notebooks/quickstart.ipynb in a fresh kernel of this interpreter."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
KERNEL = "genlm-vlm-test"


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


def _text(output) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    return str(output.get("data", {}).get("text/plain", ""))


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.slow
def test_quickstart_runs(kernel_name):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=600,
        startup_timeout=120,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "\n".join(_text(o) for o in outputs)
    assert "engine_calls" in text and "requests: 64" in text, text
    assert "64 rows of shape" in text
    assert "same as the async rows: True" in text
    assert "'continuation_logprob'" in text and "'error'" in text
