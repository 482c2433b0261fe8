"""Where the small model shipped in the package lives (internal; public as
``genlm_vlm.demo_model_path``). Imports nothing beyond the standard library, so the demo, the
``score`` command and ``import genlm_vlm`` can all ask for it cheaply.
"""

from __future__ import annotations

import pathlib

__all__ = ["demo_model_path"]


def demo_model_path() -> str:
    """Path of the small model shipped in the package, ``genlm_vlm/data/demo-model``.

    A tiny trained language model (Llama architecture, 2 layers, a 1536-token byte-level BPE
    tokenizer with ``<s>``/``</s>``; see ``TRAINING.md`` in that directory) that writes
    English-looking lowercase text. It loads offline, with no download and no Hugging Face hub
    access: ``AsyncVirtualLM.from_name(genlm_vlm.demo_model_path())``. The demo and the ``score``
    command use it when no ``--model`` is given. Also available as ``genlm_vlm.demo_model_path``.
    """
    return str(pathlib.Path(__file__).resolve().parent / "data" / "demo-model")
