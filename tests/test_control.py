"""genlm-control on top of genlm_vlm: ``PromptedLLM`` over :func:`genlm_vlm.control.as_genlm_backend`.

genlm-control is imported only inside fixtures and only after ``genlm_vlm.control`` (which keeps
genlm-backend's import from changing how later vLLM engines in this session are built).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ENGINE_OPTS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("genlm.control") is None,
    reason="genlm-control is not installed (pip install 'genlm-vlm[control]')",
)

_VLLM_ENV = (
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
)
#: The vLLM settings and whether genlm-backend was loaded when this module was collected.
_ENV_AT_COLLECTION = {name: os.environ.get(name) for name in _VLLM_ENV}
_BACKEND_LOADED_AT_COLLECTION = "genlm.backend" in sys.modules

PROMPT = "def main():\n    return"
LOWER = re.compile(rb"[a-z ]+")


@pytest.fixture(scope="module")
def control():
    import genlm_vlm.control

    return genlm_vlm.control


@pytest.fixture(scope="module")
def gc(control):
    import genlm.control

    return genlm.control


@pytest.fixture(scope="module")
def blm(llama_lm, control):
    return control.as_genlm_backend(llama_lm)


def _prompt_ids(tokenizer, text: str = PROMPT) -> list[int]:
    return [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]


@pytest.fixture
def prompted(gc, blm):
    llm = gc.PromptedLLM(blm)
    llm.prompt_ids = _prompt_ids(blm.tokenizer)
    return llm


def _expected_logws(llm, row: torch.Tensor) -> torch.Tensor:
    """``row`` re-indexed to ``llm.vocab_eos``: each token's own column, EOS from the eos ids."""
    ids = torch.tensor([t.token_id for t in llm.vocab])
    eos = torch.tensor(llm.token_maps.eos_idxs)
    return torch.cat([row[ids], torch.logsumexp(row[eos], dim=0, keepdim=True)])


# ---------------------------------------------------------------------------------- the adapter
def test_import_leaves_vllm_settings_alone(control):
    if _BACKEND_LOADED_AT_COLLECTION:
        pytest.skip("genlm.backend was imported before this module")
    assert {name: os.environ.get(name) for name in _VLLM_ENV} == _ENV_AT_COLLECTION


def test_adapter_is_a_genlm_backend_lm(llama_lm, blm, control):
    from genlm.backend.llm import AsyncLM
    from genlm.backend.tokenization import Token, decode_vocab

    assert isinstance(blm, AsyncLM)
    assert blm.lm is llama_lm and blm.tokenizer is llama_lm.tokenizer
    assert len(blm.byte_vocab) == len(blm.str_vocab) == llama_lm.vocab_size == blm.n_vocab
    assert all(type(t) is Token and t.token_id == i for i, t in enumerate(blm.byte_vocab))
    assert [t.byte_string for t in blm.byte_vocab] == list(llama_lm.byte_vocab)
    assert blm.str_vocab == list(llama_lm.str_vocab)
    # The same table genlm-backend computes for this (byte-level BPE) tokenizer.
    theirs, _ = decode_vocab(llama_lm.tokenizer)
    assert [t.byte_string for t in blm.byte_vocab[: len(theirs)]] == [t.byte_string for t in theirs]
    # Everything else is the wrapped model's.
    assert blm.vocab_size == llama_lm.vocab_size and "engine_calls" in blm.stats
    assert control.as_genlm_backend(blm).lm is llama_lm


async def test_adapter_rows_are_the_models_rows(llama_lm, blm):
    ids = _prompt_ids(llama_lm.tokenizer, "x = 1")
    row = await blm.next_token_logprobs(ids)
    assert torch.equal(row, await llama_lm.next_token_logprobs(ids))
    assert torch.equal(blm.next_token_logprobs_sync(ids), row)
    rows = await blm.batch_next_token_logprobs([ids, ids[:-1]])
    assert torch.equal(rows[0], row) and torch.equal(
        rows, blm.batch_next_token_logprobs_sync([ids, ids[:-1]])
    )


# ---------------------------------------------------------------------------------- PromptedLLM
def test_prompted_llm_vocabulary(prompted, llama_lm):
    eos = llama_lm.tokenizer.eos_token_id
    assert prompted.token_maps.eos_idxs == [eos]
    assert prompted.eos_byte_strings == [llama_lm.byte_vocab[eos]]
    assert len(prompted.vocab) == llama_lm.vocab_size - 1
    assert sorted(t.token_id for t in prompted.vocab) == [
        i for i in range(llama_lm.vocab_size) if i != eos
    ]
    assert [t.token_id for t in prompted.prompt] == prompted.prompt_ids


async def test_logw_next_is_the_row_reindexed(prompted, llama_lm):
    context = prompted.tokenize(" x + y")
    assert context
    logws = await prompted.logw_next(context)
    row = await llama_lm.next_token_logprobs(prompted.prompt_ids + [t.token_id for t in context])
    got = torch.as_tensor(logws.weights)
    assert got.shape == (llama_lm.vocab_size,)  # V - 1 tokens + EOS
    assert torch.allclose(got, _expected_logws(prompted, row), atol=1e-5, rtol=0)
    # Token-keyed lookups agree too.
    tok = prompted.vocab[17]
    assert math.isclose(logws[tok], float(row[tok.token_id]), abs_tol=1e-5)


async def test_batch_logw_next_prefix_and_complete(prompted, llama_lm):
    contexts = [prompted.tokenize(s) for s in (" a", " b + c", " len(x)")]
    batch = await prompted.batch_logw_next(contexts)
    rows = await llama_lm.batch_next_token_logprobs(
        [prompted.prompt_ids + [t.token_id for t in c] for c in contexts]
    )
    for i in range(len(contexts)):
        expected = _expected_logws(prompted, rows[i])
        assert torch.allclose(torch.as_tensor(batch.weights[i]), expected, atol=1e-5, rtol=0)

    context = contexts[1]
    ids = [t.token_id for t in context]
    prefix_rows = await llama_lm.batch_next_token_logprobs(
        [prompted.prompt_ids + ids[:i] for i in range(len(ids) + 1)]
    )
    want = sum(float(prefix_rows[i, t]) for i, t in enumerate(ids))
    assert math.isclose(await prompted.prefix(context), want, abs_tol=1e-4)
    eos = llama_lm.tokenizer.eos_token_id
    assert math.isclose(
        await prompted.complete(context), want + float(prefix_rows[-1, eos]), abs_tol=1e-4
    )


async def test_prompted_llm_helper_and_several_eos_tokens(control, llama_lm):
    tok = llama_lm.tokenizer
    newline = llama_lm.byte_vocab.index(b"\n")
    llm = control.prompted_llm(llama_lm, "x = 1", eos_byte_strings=[b"\n", b"</s>"])
    assert llm.prompt_ids == tok.encode("x = 1")
    assert llm.token_maps.eos_idxs == [newline, tok.eos_token_id]
    assert len(llm.vocab) == llama_lm.vocab_size - 2
    logws = await llm.logw_next([])
    row = await llama_lm.next_token_logprobs(llm.prompt_ids)
    assert torch.allclose(
        torch.as_tensor(logws.weights), _expected_logws(llm, row), atol=1e-5, rtol=0
    )
    ids = _prompt_ids(tok, "x = 1")
    assert control.prompted_llm(llama_lm, ids).prompt_ids == ids


async def test_temperature_is_applied_to_our_rows(gc, blm, llama_lm):
    llm = gc.PromptedLLM(blm, prompt_ids=_prompt_ids(blm.tokenizer, "y ="), temperature=0.5)
    logws = await llm.logw_next([])
    row = torch.log_softmax(await llama_lm.next_token_logprobs(llm.prompt_ids) / 0.5, dim=-1)
    assert torch.allclose(
        torch.as_tensor(logws.weights), _expected_logws(llm, row), atol=1e-5, rtol=0
    )


# ---------------------------------------------------------------------------------- SMC
async def test_awrs_smc_under_a_byte_constraint(gc, blm, llama_lm):
    np.random.seed(0)
    llm = gc.PromptedLLM(blm, prompt_ids=_prompt_ids(blm.tokenizer, "# a comment in lower case:"))
    condition = gc.BoolFSA.from_regex(r"[a-z ]+").coerce(llm, f=b"".join)
    sampler = gc.AWRS(llm, condition, seed=0)
    calls = llama_lm.stats["engine_calls"]

    sequences = await sampler.smc(n_particles=4, ess_threshold=0.5, max_tokens=6)

    assert llama_lm.stats["engine_calls"] > calls
    assert len(sequences.contexts) == 4
    assert np.all(np.isfinite(sequences.log_weights))
    for context in sequences.contexts:
        assert context[-1] is gc.EOS and 1 < len(context) <= 7
        text = b"".join(t.byte_string for t in context[:-1])
        assert LOWER.fullmatch(text), text
    posterior = sequences.decoded_posterior
    assert posterior and math.isclose(sum(posterior.values()), 1.0, abs_tol=1e-6)
    assert all(re.fullmatch(r"[a-z ]+", s) for s in posterior)


async def test_direct_token_sampler_smc(gc, blm, llama_lm):
    np.random.seed(1)
    llm = gc.PromptedLLM(blm, prompt_ids=_prompt_ids(blm.tokenizer, "import os"))
    calls = llama_lm.stats["engine_calls"]
    sequences = await gc.direct_token_sampler(llm).smc(
        n_particles=3, ess_threshold=0.5, max_tokens=4
    )
    assert llama_lm.stats["engine_calls"] > calls
    assert len(sequences.contexts) == 3 and np.all(np.isfinite(sequences.log_weights))


async def test_byte_llm_over_the_adapter(gc, blm):
    from genlm.bytes import BeamParams

    byte_llm = gc.ByteLLM(blm, BeamParams(K=2, eos_byte_strings=[b"</s>"], heal=False))
    try:
        byte_llm.set_prompt_from_str(PROMPT)
        assert np.isfinite(await byte_llm.prefix([b" ", b"x"]))
        logws = np.asarray((await byte_llm.logw_next([b" ", b"x"])).weights)
        assert math.isclose(float(np.logaddexp.reduce(logws)), 0.0, abs_tol=1e-4)
    finally:
        await byte_llm.cleanup()


# ---------------------------------------------------------------------------------- padding (no engine)
class _StubTokenizer:
    eos_token_id = 1
    bos_token_id = 0

    def __len__(self) -> int:
        return 4

    def encode(self, text, add_special_tokens=True):
        return [2 if c == "a" else 3 for c in text]


class _StubLM:
    """Four real tokens and a logit width of six (two padded ids, or one and an added token)."""

    tokenizer = _StubTokenizer()
    vocab_size = 6

    def __init__(self, last: bytes = b"") -> None:
        self.byte_vocab = [b"<s>", b"</s>", b"a", b"b", b"", last]
        self.str_vocab = [b.decode() for b in self.byte_vocab]
        self.row = torch.log_softmax(torch.arange(6, dtype=torch.float32), dim=0)

    async def next_token_logprobs(self, token_ids, lora_name=None):
        return self.row.clone()

    async def batch_next_token_logprobs(self, token_ids_list, lora_name=None):
        return torch.stack([self.row] * len(token_ids_list))


async def test_padded_logits_are_left_out(control, gc):
    lm = _StubLM()
    blm = control.as_genlm_backend(lm)
    assert blm.n_vocab == 4 and [t.byte_string for t in blm.byte_vocab] == lm.byte_vocab[:4]
    row = await blm.next_token_logprobs([0])
    assert torch.allclose(row, torch.log_softmax(lm.row[:4], dim=0))
    assert (await blm.batch_next_token_logprobs([[0], [0, 2]])).shape == (2, 4)

    llm = gc.PromptedLLM(blm, prompt_ids=[0])
    assert [t.byte_string for t in llm.vocab] == [b"<s>", b"a", b"b"]
    logws = torch.as_tensor((await llm.logw_next([])).weights)
    assert torch.allclose(logws, row[[0, 2, 3, 1]], atol=1e-6)

    full = control.as_genlm_backend(lm, trim_padding=False)
    assert full.n_vocab == 6 and torch.equal(await full.next_token_logprobs([0]), lm.row)


def test_an_added_token_past_the_tokenizer_length_is_kept(control):
    blm = control.as_genlm_backend(_StubLM(last=b"<extra>"))
    assert blm.n_vocab == 6 and blm.byte_vocab[5].byte_string == b"<extra>"


# ---------------------------------------------------------------------------------- import order
_IMPORT_FIRST = textwrap.dedent(
    """
    import os, sys, warnings
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    import genlm.control  # sets VLLM_USE_V2_MODEL_RUNNER=1 and loads numba/llvmlite
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from genlm_vlm.control import as_genlm_backend
    from vllm.triton_utils import HAS_TRITON
    if not HAS_TRITON:
        assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
        assert any("VLLM_USE_V2_MODEL_RUNNER" in str(w.message) for w in caught)
    from genlm_vlm import AsyncVirtualLM
    lm = AsyncVirtualLM.from_name(sys.argv[1], eval(sys.argv[2]))
    try:
        llm = genlm.control.PromptedLLM(as_genlm_backend(lm), prompt_ids=[0, 5, 6])
        print("ROW", lm.next_token_logprobs_sync([0, 5, 6]).shape[0], len(llm.vocab))
    finally:
        lm.cleanup()
    """
)


@pytest.mark.slow
def test_engine_builds_when_genlm_control_was_imported_first(model_paths, llama_lm):
    """genlm-backend's import-time side effects (V2 runner flag, llvmlite) do not stop an engine."""
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_FIRST, model_paths["llama"], repr(ENGINE_OPTS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    n = llama_lm.vocab_size
    assert f"ROW {n} {n - 1}" in proc.stdout
