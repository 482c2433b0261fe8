"""genlm-control, genlm-bytes and llamppl on a plain ``AsyncVirtualLM`` (no wrapper).

The in-process tests import genlm's packages through the ``gc`` fixture, which restores the vLLM
environment variables genlm-backend sets on import so that engines built later in this test
session are not affected (genlm_vlm copes with them, see test_consumers_in_both_import_orders,
but other test files pin the model runner). The import-order tests run in subprocesses.
"""

from __future__ import annotations

import importlib.util
import json
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

PROMPT = "def main():\n    return"
LOWER = re.compile(rb"[a-z ]+")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def control():
    import genlm_vlm.control

    return genlm_vlm.control


def _prompt_ids(tokenizer, text: str = PROMPT) -> list[int]:
    return [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]


@pytest.fixture
def prompted(gc, llama_lm):
    return gc.PromptedLLM(llama_lm, prompt_ids=_prompt_ids(llama_lm.tokenizer))


def _expected_logws(llm, row: torch.Tensor) -> torch.Tensor:
    """``row`` re-indexed to ``llm.vocab_eos``: each token's own column, EOS from the eos ids."""
    ids = torch.tensor([t.token_id for t in llm.vocab])
    eos = torch.tensor(llm.token_maps.eos_idxs)
    return torch.cat([row[ids], torch.logsumexp(row[eos], dim=0, keepdim=True)])


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


# ---------------------------------------------------------------------------------- vocabulary
def test_byte_vocab_holds_genlm_backend_tokens(gc, llama_lm):
    from genlm.backend.tokenization import Token, decode_vocab

    from genlm_vlm.vocab import get_byte_vocab, token_class

    vocab = llama_lm.byte_vocab
    assert token_class() is Token
    assert len(vocab) == llama_lm.vocab_size
    assert all(type(t) is Token and t.token_id == i for i, t in enumerate(vocab))
    assert [t.byte_string for t in vocab] == get_byte_vocab(llama_lm.tokenizer)
    assert llama_lm.byte_vocab is vocab  # cached
    # The same table genlm-backend computes for this (byte-level BPE) tokenizer.
    theirs, _ = decode_vocab(llama_lm.tokenizer)
    assert [t.byte_string for t in vocab[: len(theirs)]] == [t.byte_string for t in theirs]
    assert vocab[: len(theirs)] == theirs  # equal by id


def test_control_module_does_not_import_genlm_backend():
    code = "import sys, genlm_vlm.control; assert 'genlm.backend' not in sys.modules, sorted(sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------- PromptedLLM
def test_prompted_llm_vocabulary(prompted, llama_lm):
    eos = llama_lm.tokenizer.eos_token_id
    assert prompted.model is llama_lm
    assert prompted.token_maps.eos_idxs == [eos]
    assert prompted.eos_byte_strings == [llama_lm.byte_vocab[eos].byte_string]
    assert len(prompted.vocab) == llama_lm.vocab_size - 1
    assert sorted(t.token_id for t in prompted.vocab) == [i for i in range(llama_lm.vocab_size) if i != eos]
    assert [t.token_id for t in prompted.prompt] == prompted.prompt_ids


async def test_logw_next_is_the_row_reindexed(prompted, llama_lm):
    context = prompted.tokenize(" x + y")
    assert context
    logws = await prompted.logw_next(context)
    row = await llama_lm.next_token_logprobs(prompted.prompt_ids + [t.token_id for t in context])
    got = torch.as_tensor(logws.weights)
    assert got.shape == (llama_lm.vocab_size,)  # V - 1 tokens + EOS
    assert torch.allclose(got, _expected_logws(prompted, row), atol=1e-5, rtol=0)
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
    want = await llama_lm.score(prompted.prompt_ids, ids)
    assert math.isclose(await prompted.prefix(context), want, abs_tol=1e-4)
    eos = llama_lm.tokenizer.eos_token_id
    assert math.isclose(
        await prompted.complete(context), await llama_lm.score(prompted.prompt_ids, [*ids, eos]), abs_tol=1e-4
    )


async def test_prompted_llm_helper_and_several_eos_tokens(control, gc, llama_lm):
    tok = llama_lm.tokenizer
    newline = [t.token_id for t in llama_lm.byte_vocab if t == b"\n"]
    assert len(newline) == 1
    llm = control.prompted_llm(llama_lm, "x = 1", eos_byte_strings=[b"\n", b"</s>"])
    assert llm.model is llama_lm
    assert llm.prompt_ids == tok.encode("x = 1")
    assert llm.token_maps.eos_idxs == [newline[0], tok.eos_token_id]
    assert len(llm.vocab) == llama_lm.vocab_size - 2
    logws = await llm.logw_next([])
    row = await llama_lm.next_token_logprobs(llm.prompt_ids)
    assert torch.allclose(torch.as_tensor(logws.weights), _expected_logws(llm, row), atol=1e-5, rtol=0)
    ids = _prompt_ids(tok, "x = 1")
    assert control.prompted_llm(llama_lm, ids).prompt_ids == ids


async def test_temperature_is_applied_to_our_rows(gc, llama_lm):
    llm = gc.PromptedLLM(llama_lm, prompt_ids=_prompt_ids(llama_lm.tokenizer, "y ="), temperature=0.5)
    logws = await llm.logw_next([])
    row = torch.log_softmax(await llama_lm.next_token_logprobs(llm.prompt_ids) / 0.5, dim=-1)
    assert torch.allclose(torch.as_tensor(logws.weights), _expected_logws(llm, row), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------- SMC
async def test_awrs_smc_under_a_byte_constraint(gc, llama_lm):
    np.random.seed(0)
    llm = gc.PromptedLLM(llama_lm, prompt_ids=_prompt_ids(llama_lm.tokenizer, "# a comment in lower case:"))
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


async def test_direct_token_sampler_smc(gc, llama_lm):
    np.random.seed(1)
    llm = gc.PromptedLLM(llama_lm, prompt_ids=_prompt_ids(llama_lm.tokenizer, "import os"))
    calls = llama_lm.stats["engine_calls"]
    sequences = await gc.direct_token_sampler(llm).smc(n_particles=3, ess_threshold=0.5, max_tokens=4)
    assert llama_lm.stats["engine_calls"] > calls
    assert len(sequences.contexts) == 3 and np.all(np.isfinite(sequences.log_weights))


async def test_byte_llm(gc, llama_lm):
    from genlm.bytes import BeamParams

    byte_llm = gc.ByteLLM(llama_lm, BeamParams(K=2, eos_byte_strings=[b"</s>"], heal=False))
    try:
        byte_llm.set_prompt_from_str(PROMPT)
        assert np.isfinite(await byte_llm.prefix([b" ", b"x"]))
        logws = np.asarray((await byte_llm.logw_next([b" ", b"x"])).weights)
        assert math.isclose(float(np.logaddexp.reduce(logws)), 0.0, abs_tol=1e-4)
    finally:
        await byte_llm.cleanup()


# ---------------------------------------------------------------------------------- genlm-bytes
def _first_byte_logps(lm, row: torch.Tensor, eos_ids: set[int]) -> dict[int, float]:
    """``log P(first byte = b)`` from a token row: each non-EOS token's mass goes to its first byte."""
    buckets: dict[int, list[int]] = {}
    for t in lm.byte_vocab:
        if t.token_id not in eos_ids and len(t):
            buckets.setdefault(t[0], []).append(t.token_id)
    return {b: float(torch.logsumexp(row[ids].double(), 0)) for b, ids in buckets.items()}


async def test_byte_beam_reads_our_rows(gc, llama_lm):
    from genlm.bytes import BeamParams, ByteBeamState

    tok = llama_lm.tokenizer
    params = BeamParams(K=4, eos_byte_strings=[b"</s>"], heal=False)
    beam = await ByteBeamState.initial(llama_lm, params)
    try:
        got = (await beam.logp_next()).ps
        # genlm-bytes starts from [BOS]: each byte's mass is that of the tokens starting with it.
        row = await llama_lm.next_token_logprobs([tok.bos_token_id])
        expected = _first_byte_logps(llama_lm, row, {tok.eos_token_id})
        assert len(expected) > 50
        for b, value in expected.items():
            assert math.isclose(got[b], value, abs_tol=1e-4), (b, got[b], value)
        assert math.isclose(got[257], float(row[tok.eos_token_id]), abs_tol=1e-4)  # EOS

        for b in b"def":
            beam = (await (beam << b)).prune()
        assert len(beam) >= 1
        logps = (await beam.logp_next()).ps
        assert math.isclose(float(np.logaddexp.reduce(logps)), 0.0, abs_tol=1e-5)
        # The most likely state ends on a token boundary whose context our model scored.
        best = max(beam, key=lambda s: s.weight)
        consumed = b"".join(llama_lm.byte_vocab[i] for i in best.lm_state.context[1:])
        assert consumed + bytes(best.partial) == b"def"
    finally:
        await beam.cleanup()


# ---------------------------------------------------------------------------------- llamppl
def _lower_mask(lm) -> set[int]:
    return {i for i, s in enumerate(lm.str_vocab) if s and re.fullmatch(r"[a-z ]+", s)}


async def test_llamppl_cached_causal_lm(gc, llama_lm):
    llamppl = pytest.importorskip("llamppl")
    from genlm.backend.llm import AsyncVirtualLM as BackendVirtualLM

    assert isinstance(llama_lm, BackendVirtualLM)  # registered, not inherited
    assert not issubclass(BackendVirtualLM, type(llama_lm))
    cl = llamppl.CachedCausalLM(llama_lm)
    assert cl.backend == "vllm" and cl.model is llama_lm
    assert cl.str_vocab == llama_lm.str_vocab and cl.byte_vocab is llama_lm.byte_vocab
    ids = _prompt_ids(llama_lm.tokenizer, "x = 1")
    row = await llama_lm.next_token_logprobs(ids)
    assert np.array_equal(await cl.next_token_logprobs(ids), row.numpy())
    assert np.array_equal(cl.next_token_logprobs_unbatched(ids), row.numpy())
    assert cl.masks.EOS == {llama_lm.tokenizer.eos_token_id}


async def test_llamppl_smc_with_a_token_mask(gc, llama_lm):
    llamppl = pytest.importorskip("llamppl")
    cl = llamppl.CachedCausalLM(llama_lm)
    lower = _lower_mask(llama_lm)
    eos = llama_lm.tokenizer.eos_token_id

    class LowerCase(llamppl.Model):
        def __init__(self):
            super().__init__()
            self.context = llamppl.LMContext(cl, "# lower case words:")
            self.n = 0

        async def step(self):
            await self.observe(self.context.mask_dist(lower | {eos}), True)
            token = await self.sample(self.context.next_token())
            self.n += 1
            if token.token_id == eos or self.n >= 4:
                self.finish()

    np.random.seed(0)
    calls = llama_lm.stats["engine_calls"]
    particles = await llamppl.smc_standard(LowerCase(), 3)
    assert llama_lm.stats["engine_calls"] > calls
    assert len(particles) == 3
    for p in particles:
        assert np.isfinite(p.weight)
        generated = p.context.tokens[p.context.prompt_token_count :]
        assert generated and set(generated) <= lower | {eos}


# ---------------------------------------------------------------------------------- duplicates
def _byte_fallback_tokenizer():
    """Llama-2 style: ``<0xNN>`` byte pieces next to merged pieces with the same bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += ["\u2581", "a", "b", "c", " ", "\n", "\u2581a", "ab", "\u2581ab", "ca"]
    merges = [("\u2581", "a"), ("a", "b"), ("\u2581a", "b"), ("c", "a")]
    model = models.BPE(
        vocab={p: i for i, p in enumerate(pieces)}, merges=merges, unk_token="<unk>", byte_fallback=True
    )
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


async def test_duplicate_byte_strings_stay_distinct(gc):
    from genlm.backend.trie import TokenCharacterTrie
    from genlm.bytes import BeamParams, ByteBeamState

    from genlm_vlm.mock import MockAsyncLM

    lm = MockAsyncLM(_byte_fallback_tokenizer(), seed=3)
    vocab = lm.byte_vocab
    newlines = [t.token_id for t in vocab if t == b"\n"]
    assert newlines == [3 + 0x0A, 3 + 256 + 5]  # <0x0A> and the merged "\n"
    assert vocab[newlines[0]] != vocab[newlines[1]] and len(set(vocab)) == len(vocab)
    with pytest.raises(ValueError, match="Duplicate word"):  # what plain bytes gave
        TokenCharacterTrie([t.byte_string for t in vocab])
    TokenCharacterTrie(vocab)

    llm = gc.PromptedLLM(lm, prompt_ids=[1])
    assert {t.token_id for t in llm.vocab} >= set(newlines)
    condition = gc.BoolFSA.from_regex(r"[ab ]+").coerce(llm, f=b"".join)
    np.random.seed(0)
    sequences = await gc.AWRS(llm, condition, seed=0).smc(n_particles=3, ess_threshold=0.5, max_tokens=4)
    assert all(re.fullmatch(r"[ab ]+", s) for s in sequences.decoded_posterior)

    beam = await ByteBeamState.initial(lm, BeamParams(K=3, eos_byte_strings=[b"</s>"], heal=False))
    try:
        beam = await (beam << ord("\n"))
        # Both "\n" tokens end here: one extension (a new LM context) per token id.
        ends = {s.lm_state.context[-1] for s in await beam.extend(beam.logZ)}
        assert ends == set(newlines)
    finally:
        await beam.cleanup()


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
    max_model_len = 100

    def __init__(self, last: bytes = b"") -> None:
        self.byte_vocab = [b"<s>", b"</s>", b"a", b"b", b"", last]
        self.str_vocab = [b.decode() for b in self.byte_vocab]
        self.row = torch.log_softmax(torch.arange(6, dtype=torch.float32), dim=0)
        self.batch_size = 256
        self.cleaned = False

    async def next_token_logprobs(self, token_ids, lora_name=None):
        return self.row.clone()

    def next_token_logprobs_sync(self, token_ids, lora_name=None):
        return self.row.clone()

    async def batch_next_token_logprobs(self, token_ids_list, lora_name=None):
        return torch.stack([self.row] * len(token_ids_list))

    def batch_next_token_logprobs_sync(self, token_ids_list, lora_name=None):
        return torch.stack([self.row] * len(token_ids_list))

    def cleanup(self):
        self.cleaned = True


async def test_without_padding_leaves_out_padded_logits(control, gc):
    lm = _StubLM()
    view = control.without_padding(lm)
    assert isinstance(view, control.UnpaddedLM) and view.vocab_size == 4 and view.lm is lm
    assert [t.byte_string for t in view.byte_vocab] == lm.byte_vocab[:4] and view.str_vocab == lm.str_vocab[:4]
    row = await view.next_token_logprobs([0])
    assert torch.allclose(row, torch.log_softmax(lm.row[:4], dim=0))
    assert (await view.batch_next_token_logprobs([[0], [0, 2]])).shape == (2, 4)
    assert torch.equal(view.next_token_logprobs_sync([0]), row)
    assert math.isclose(view.score_sync([0], [2, 3]), float(row[2] + row[3]), abs_tol=1e-6)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        view.score_sync([0], [4])
    view.batch_size = 8
    assert lm.batch_size == 8 and view.batch_size == 8

    llm = gc.PromptedLLM(view, prompt_ids=[0])
    assert [t.byte_string for t in llm.vocab] == [b"<s>", b"a", b"b"]
    logws = torch.as_tensor((await llm.logw_next([])).weights)
    assert torch.allclose(logws, row[[0, 2, 3, 1]], atol=1e-6)

    assert control.without_padding(view) is view
    view.cleanup()
    assert lm.cleaned


def test_without_padding_is_the_model_itself_when_nothing_is_padded(control, llama_lm):
    assert control.without_padding(llama_lm) is llama_lm
    added = _StubLM(last=b"<extra>")  # an added token past len(tokenizer): nothing to cut
    assert control.without_padding(added) is added


def test_llamppl_needs_without_padding_on_a_padded_model(control, gc):
    llamppl = pytest.importorskip("llamppl")
    from genlm_vlm.mock import MockAsyncLM

    lm = MockAsyncLM(vocab_size=300)  # 258 tokens, 42 padded logit columns
    # llamppl 0.2.3's Masks read v[0] of every str_vocab entry; the padded entries' error says why
    with pytest.raises(IndexError, match=r"padded logit column \(ids 258\.\.299 .*without_padding\(lm\)"):
        llamppl.CachedCausalLM(lm)
    cl = llamppl.CachedCausalLM(control.without_padding(lm))
    assert cl.backend == "vllm" and len(cl.str_vocab) == 258
    assert llamppl.CachedCausalLM(MockAsyncLM()).backend == "mock"


def test_padded_entries_of_str_vocab_are_empty_text(control):
    import copy
    import pickle

    from genlm_vlm.mock import MockAsyncLM
    from genlm_vlm.vocab import PaddedText

    lm = MockAsyncLM(vocab_size=300)
    texts = lm.str_vocab
    assert len(texts) == len(lm.byte_vocab) == lm.vocab_size == 300
    assert not any(isinstance(t, PaddedText) for t in texts[:258])
    pad = texts[258]
    assert all(t is pad for t in texts[258:]) and isinstance(pad, str)
    assert pad == "" and hash(pad) == hash("") and len(pad) == 0 and not pad and pad[:3] == ""
    assert json.dumps(texts[257:259]) == json.dumps([texts[257], ""])
    assert pickle.loads(pickle.dumps(pad)) == "" and copy.deepcopy(pad) == ""
    with pytest.raises(IndexError, match="without_padding"):
        pad[0]
    assert not any(isinstance(t, PaddedText) for t in MockAsyncLM().str_vocab)  # nothing padded
    view = control.without_padding(lm)
    assert view.str_vocab == texts[:258] and not any(isinstance(t, PaddedText) for t in view.str_vocab)


async def test_a_padded_model_works_with_genlm_control_and_genlm_bytes_as_it_is(gc):
    """Rows, byte_vocab and str_vocab all have the logit width: genlm-bytes needs
    len(byte_vocab) == row length (genlm-backend 0.3.1's vLLM layout, vocabulary cut at the
    tokenizer, fails there), and genlm-control cuts rows to its vocabulary."""
    from genlm.bytes import BeamParams, ByteBeamState

    from genlm_vlm.mock import MockAsyncLM

    lm = MockAsyncLM(vocab_size=300, logit_scale=1.0)  # 258 tokens, 42 padded columns
    row = await lm.next_token_logprobs([0])
    assert row.shape == (300,) and len(lm.byte_vocab) == 300

    llm = gc.PromptedLLM(lm, prompt_ids=[0], eos_byte_strings=[b"."])
    logws = torch.as_tensor((await llm.logw_next([])).weights)
    assert torch.allclose(logws, _expected_logws(llm, row), atol=1e-5)
    condition = gc.BoolFSA.from_regex(r"[a-z ]+").coerce(llm, f=b"".join)
    np.random.seed(0)
    sequences = await gc.AWRS(llm, condition, seed=0).smc(n_particles=3, ess_threshold=0.5, max_tokens=4)
    assert len(sequences) == 3

    beam = await ByteBeamState.initial(lm, BeamParams(K=3, eos_byte_strings=[b"."], heal=False))
    try:
        beam = await (beam << ord("a"))
        assert len(beam) > 0
    finally:
        await beam.cleanup()


def test_pre_release_shims_are_gone(control):
    """0.1.0 was never released: the names kept for earlier development versions are removed."""
    assert not hasattr(control, "as_genlm_backend") and not hasattr(control, "GenlmBackendLM")
    assert set(control.__all__) == {"UnpaddedLM", "UntranslatableError", "prompted_llm", "smc", "without_padding"}


# ---------------------------------------------------------------------------------- import order
# Runs in a fresh interpreter: imports in the order given by argv[1], builds an engine, then uses
# it with no wrapper from genlm-control (PromptedLLM + AWRS SMC under a BoolFSA), genlm-bytes
# (ByteBeamState) and llamppl (CachedCausalLM + smc_standard). Prints the rows each consumer read
# as JSON, for the parent to compare with its own engine's rows.
_CONSUMERS = textwrap.dedent(
    """
    import asyncio, json, os, re, sys, warnings
    warnings.simplefilter("ignore")
    order, path, opts = sys.argv[1], sys.argv[2], eval(sys.argv[3])
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if order == "genlm_first":
        import genlm.control, genlm.bytes, llamppl
        from genlm_vlm import AsyncVirtualLM
        lm = AsyncVirtualLM.from_name(path, opts)
    else:
        from genlm_vlm import AsyncVirtualLM
        lm = AsyncVirtualLM.from_name(path, opts)
        import genlm.control, genlm.bytes, llamppl
    import numpy as np
    import torch
    from genlm.backend.tokenization import Token

    async def main():
        out = {"token_type": type(lm.byte_vocab[5]) is Token}
        tok = lm.tokenizer
        prompt = [tok.bos_token_id, *tok.encode("# a comment in lower case:", add_special_tokens=False)]
        llm = genlm.control.PromptedLLM(lm, prompt_ids=prompt)
        logws = torch.as_tensor((await llm.logw_next([])).weights)
        ids = torch.tensor([t.token_id for t in llm.vocab])
        row = await lm.next_token_logprobs(prompt)
        assert torch.allclose(logws[:-1], row[ids], atol=1e-5)
        out["prompted_row"] = row.tolist()
        np.random.seed(0)
        condition = genlm.control.BoolFSA.from_regex(r"[a-z ]+").coerce(llm, f=b"".join)
        seqs = await genlm.control.AWRS(llm, condition, seed=0).smc(n_particles=3, ess_threshold=0.5, max_tokens=4)
        out["smc"] = sorted(seqs.decoded_posterior)
        assert out["smc"] and all(re.fullmatch(r"[a-z ]+", s) for s in out["smc"])

        beam = await genlm.bytes.ByteBeamState.initial(lm, genlm.bytes.BeamParams(K=2, eos_byte_strings=[b"</s>"]))
        out["beam_first_byte"] = float((await beam.logp_next()).ps[ord("d")])
        out["bos_row"] = (await lm.next_token_logprobs([tok.bos_token_id])).tolist()

        cl = llamppl.CachedCausalLM(lm)
        out["llamppl_backend"] = cl.backend
        out["llamppl_row"] = (await cl.next_token_logprobs(prompt)).tolist()
        class Words(llamppl.Model):
            def __init__(self):
                super().__init__()
                self.context = llamppl.LMContext(cl, "import")
                self.n = 0
            async def step(self):
                await self.sample(self.context.next_token())
                self.n += 1
                if self.n >= 3:
                    self.finish()
        particles = await llamppl.smc_standard(Words(), 2)
        out["llamppl_particles"] = len(particles)
        print("RESULT " + json.dumps(out))

    try:
        asyncio.run(main())
    finally:
        lm.cleanup()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["genlm_first", "genlm_vlm_first"])
def test_consumers_in_both_import_orders(order, model_paths, llama_lm, gc):
    proc = subprocess.run(
        [sys.executable, "-c", _CONSUMERS, order, model_paths["llama"], repr(ENGINE_OPTS)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(line[len("RESULT ") :])
    tok = llama_lm.tokenizer
    prompt = [tok.bos_token_id, *tok.encode("# a comment in lower case:", add_special_tokens=False)]
    ours = llama_lm.next_token_logprobs_sync(prompt)
    assert out["token_type"] is True
    assert torch.allclose(torch.tensor(out["prompted_row"]), ours, atol=1e-5, rtol=0)
    assert torch.allclose(torch.tensor(out["llamppl_row"]), ours, atol=1e-5, rtol=0)
    bos_row = llama_lm.next_token_logprobs_sync([tok.bos_token_id])
    assert torch.allclose(torch.tensor(out["bos_row"]), bos_row, atol=1e-5, rtol=0)
    expected = _first_byte_logps(llama_lm, bos_row, {tok.eos_token_id})[ord("d")]
    assert math.isclose(out["beam_first_byte"], expected, abs_tol=1e-4)
    assert out["llamppl_backend"] == "vllm" and out["llamppl_particles"] == 2
