"""genlm_vlm.mock.MockAsyncLM: the vLLM-free stand-in (no engine is built in this file)."""

from __future__ import annotations

import asyncio
import copy
import math
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from genlm_vlm import UnknownAdapterError
from genlm_vlm.base import ContextLimitWarning
from genlm_vlm.mock import MockAsyncLM, MockTokenizer, default_byte_vocab
from genlm_vlm.vocab import Token, token_class

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def lm() -> MockAsyncLM:
    return MockAsyncLM()


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_importing_the_mock_does_not_import_vllm():
    proc = _run(
        "import sys\n"
        "from genlm_vlm.mock import MockAsyncLM\n"
        "lm = MockAsyncLM()\n"
        "lm.next_token_logprobs_sync([0, 5]); lm.byte_vocab\n"
        "lm.cleanup()\n"
        "try:\n"
        "    lm.next_token_logprobs_sync([0])\n"
        "except Exception as e:\n"
        "    assert type(e).__name__ == 'ClosedError', e\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'genlm'))\n"
        "assert not bad, bad\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('genlm_vlm.vllm_lm', 'genlm_vlm.engine')))\n"
        "assert not bad, bad\n"
        "print(type(lm.byte_vocab[0]).__module__)\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["genlm_vlm.vocab"]


# ---------------------------------------------------------------------------------- rows
def test_rows_are_normalised_and_deterministic(lm):
    row = lm.next_token_logprobs_sync([0, 72, 105])
    assert row.dtype == torch.float32 and row.shape == (258,) and row.device.type == "cpu"
    assert math.isclose(float(torch.logsumexp(row.double(), 0)), 0.0, abs_tol=1e-5)
    assert torch.equal(row, MockAsyncLM().next_token_logprobs_sync([0, 72, 105]))
    assert torch.equal(row, lm.next_token_logprobs_sync(np.array([0, 72, 105])))
    assert torch.equal(row, lm.next_token_logprobs_sync(torch.tensor([0, 72, 105])))
    assert not torch.equal(row, lm.next_token_logprobs_sync([0, 72, 106]))
    assert not torch.equal(row, lm.next_token_logprobs_sync([72, 105]))
    assert not torch.equal(row, MockAsyncLM(seed=1).next_token_logprobs_sync([0, 72, 105]))
    # Rows are not near-uniform (logit_scale), and a scale of 0 gives the uniform row.
    assert float(row.max()) > math.log(10 / 258)
    flat = MockAsyncLM(logit_scale=0).next_token_logprobs_sync([0])
    assert torch.allclose(flat, torch.full((258,), -math.log(258)))


def test_the_same_rows_in_a_fresh_process(lm):
    proc = _run("from genlm_vlm.mock import MockAsyncLM; print(MockAsyncLM(seed=7).next_token_logprobs_sync([0, 1, 2]).tolist())")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.tensor(eval(proc.stdout)).equal(MockAsyncLM(seed=7).next_token_logprobs_sync([0, 1, 2]))


async def test_async_batch_and_sync_agree(lm):
    prompts = [[0], [0, 5, 6], [0, 5]]
    batch = await lm.batch_next_token_logprobs(prompts)
    assert batch.shape == (3, 258)
    assert torch.equal(batch, lm.batch_next_token_logprobs_sync(prompts, chunk_size=1))
    singles = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    assert torch.equal(batch, torch.stack(singles))
    assert (await lm.batch_next_token_logprobs([])).shape == (0, 258)
    assert lm.stats["calls"] == 9 and lm.stats["tokens"] == 18


def test_rows_are_the_callers_own(lm):
    row = lm.next_token_logprobs_sync([0])
    row.zero_()
    assert not torch.equal(row, lm.next_token_logprobs_sync([0]))


@pytest.mark.parametrize(
    ("ids", "error", "match"),
    [
        ([], ValueError, "token_ids is empty"),
        ("hello", TypeError, "tokenizer.encode"),
        ([0, 1.5], TypeError, r"token_ids\[1\] must be an int"),
        ([0, True], TypeError, r"token_ids\[1\] must be an int"),
        ([0, 258], ValueError, r"token id 258 at index 1, outside the vocabulary \[0, 258\)"),
        ([-1], ValueError, "token id -1"),
        (np.zeros((2, 2), dtype=int), ValueError, "must be 1-D"),
        (torch.tensor([0.0, 1.0]), TypeError, "must hold integers"),
        (list(range(10)), ValueError, "allows at most 7"),
    ],
)
def test_bad_prompts_say_what_is_wrong(ids, error, match):
    lm = MockAsyncLM(max_model_len=8)
    with pytest.raises(error, match=match):
        lm.next_token_logprobs_sync(ids)


async def test_a_bad_prompt_in_a_batch_is_named_before_any_row(lm):
    with pytest.raises(ValueError, match=r"token_ids_list\[1\]"):
        await lm.batch_next_token_logprobs([[0], [999]])
    assert lm.stats["calls"] == 0


# ---------------------------------------------------------------------------------- vocabulary
def test_default_vocabulary(lm):
    assert lm.vocab_size == len(lm.tokenizer) == 258
    assert lm.byte_vocab[:3] == [Token(0, b"<s>"), Token(1, b"</s>"), Token(2, b"\x00")]
    assert all(type(t) is token_class() and t.token_id == i for i, t in enumerate(lm.byte_vocab))
    assert [t.byte_string for t in lm.byte_vocab] == default_byte_vocab()
    assert lm.str_vocab[0] == "<s>" and lm.str_vocab[2 + ord("a")] == "a"
    tok = lm.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.all_special_ids) == (0, 1, [0, 1])
    ids = tok.encode("héllo")
    assert ids == [2 + b for b in "héllo".encode()]
    assert tok.decode([0, *ids, 1]) == "<s>héllo</s>" and tok.decode([0, *ids], skip_special_tokens=True) == "héllo"


def test_custom_byte_vocabulary_with_duplicates_and_padding():
    vocab = [b"<s>", b"</s>", b"a", b"b", b"ab", b"\n", b"\n"]
    lm = MockAsyncLM(byte_vocab=vocab, bos_token_id=0, eos_token_id=1, vocab_size=9)
    assert lm.vocab_size == 9 and len(lm.byte_vocab) == 9 and lm.byte_vocab[7:] == [b"", b""]
    assert len(lm.str_vocab) == 9 and lm.str_vocab[5:] == ["\n", "\n", "", ""]
    assert lm.byte_vocab[5] == b"\n" and lm.byte_vocab[5] != lm.byte_vocab[6]
    assert len(set(lm.byte_vocab)) == 9
    assert lm.tokenizer.encode("aab\n") == [2, 4, 5]  # greedy longest match, first duplicate
    with pytest.raises(ValueError, match="has no token"):
        lm.tokenizer.encode("c")
    assert lm.next_token_logprobs_sync([0, 8]).shape == (9,)


def test_a_real_tokenizer(tmp_path):
    from genlm_vlm.testing import train_byte_level_bpe
    from genlm_vlm.vocab import get_byte_vocab

    tok = train_byte_level_bpe(["def f(x):\n    return x\n" * 50], 300)
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"vocab_size": 320}')
    lm = MockAsyncLM.from_name(tmp_path, seed=2)
    assert lm.vocab_size == 320 and len(lm.tokenizer) == len(tok)
    assert [t.byte_string for t in lm.byte_vocab[: len(tok)]] == get_byte_vocab(tok)
    assert lm.str_vocab[len(tok) :] == [""] * (320 - len(tok))
    assert MockAsyncLM(tok).vocab_size == len(tok)
    with pytest.raises(TypeError, match="MockTokenizer"):
        MockAsyncLM(tok, eos_token_id=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 10}, "vocab_size must be an int >= the vocabulary's length"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"logit_scale": float("nan")}, "logit_scale"),
        ({"batch_size": 0}, "batch_size"),
        ({"timeout": -1}, "timeout"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MockAsyncLM(**kwargs)


def test_mock_tokenizer_checks_its_special_ids():
    with pytest.raises(ValueError, match="eos_token_id=5 is outside"):
        MockTokenizer([b"a"], eos_token_id=5)


def test_batch_size_and_timeout_are_settable(lm):
    assert (lm.batch_size, lm.timeout) == (256, 0.0)
    lm.batch_size, lm.timeout = 8, 0.5
    assert (lm.batch_size, lm.timeout) == (8, 0.5)
    with pytest.raises(ValueError, match="batch_size"):
        lm.batch_size = 0
    with pytest.raises(ValueError, match="timeout"):
        lm.timeout = float("inf")


# ---------------------------------------------------------------------------------- scoring
async def test_score_is_the_sum_of_the_rows(lm):
    prompt, cont = [0, 72], [105, 33, 1]
    rows = lm.batch_next_token_logprobs_sync([prompt, prompt + cont[:1], prompt + cont[:2]])
    per_token = rows[torch.arange(3), torch.tensor(cont)]
    logps = await lm.continuation_logprobs(prompt, cont, chunk_size=2)
    assert logps.dtype == torch.float32 and torch.equal(logps, per_token)
    assert torch.equal(lm.continuation_logprobs_sync(prompt, cont, chunk_size=1), per_token)
    assert math.isclose(await lm.score(prompt, cont), float(per_token.double().sum()), rel_tol=1e-9)
    assert math.isclose(lm.score_sync(prompt, np.array(cont)), float(per_token.double().sum()), rel_tol=1e-9)
    assert await lm.score(prompt, []) == 0.0 and lm.continuation_logprobs_sync(prompt, []).shape == (0,)


def test_score_errors_name_the_argument():
    lm = MockAsyncLM(max_model_len=6)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        lm.score_sync([], [1])
    with pytest.raises(ValueError, match=r"continuation_ids holds token id 999 at index 1"):
        lm.score_sync([0], [1, 999])
    with pytest.raises(TypeError, match="continuation_ids must be a sequence of token ids"):
        lm.score_sync([0], "abc")
    with pytest.raises(ValueError, match=r"has 7 tokens \(2 \+ 5\); this model allows at most 6"):
        lm.score_sync([0, 1], [2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="chunk_size"):
        lm.continuation_logprobs_sync([0], [1], chunk_size=0)
    assert lm.stats["calls"] == 0


async def test_next_token_topk(lm):
    row = lm.next_token_logprobs_sync([0, 5])
    top = await lm.next_token_topk([0, 5], 5)
    assert top.token_ids.dtype == torch.int64 and top.logprobs.dtype == torch.float32
    assert torch.equal(top.logprobs, torch.sort(row, descending=True).values[:5])
    assert torch.equal(row[top.token_ids], top.logprobs)
    ids, logps = lm.next_token_topk_sync([0, 5], 258)
    assert sorted(ids.tolist()) == list(range(258)) and bool((logps[:-1] >= logps[1:]).all())
    for k in (0, 259, 1.0, True):
        with pytest.raises(ValueError, match=r"k must be an int in \[1, 258\]"):
            lm.next_token_topk_sync([0], k)


# ---------------------------------------------------------------------------------- sampling
async def test_sample_follows_the_rows(lm):
    greedy = await lm.sample([0], 5, [], temperature=0)
    ids = [0]
    for t in greedy:
        assert t == int(torch.argmax(lm.next_token_logprobs_sync(ids)))
        ids.append(t)
    assert len(greedy) == 5
    a = await lm.sample([0], 6, [1], seed=3)
    assert a == await lm.sample([0], 6, [1], seed=3)
    assert 1 not in a and 1 <= len(a) <= 6
    batch = await lm.batch_sample([[0], [0]], 6, [1], seed=3)
    assert batch[0] == a and batch[1] == await lm.sample([0], 6, [1], seed=4)


async def test_sample_stops_at_eos_and_at_the_context_limit():
    lm = MockAsyncLM(max_model_len=5)
    first = int(torch.argmax(lm.next_token_logprobs_sync([0])))
    assert await lm.sample([0], 3, [first], temperature=0) == []
    assert await lm.sample([0], 3, first, temperature=0) == []
    with pytest.warns(ContextLimitWarning, match="max_model_len=5 before max_tokens=10"):
        assert len(await lm.sample([0, 2], 10, [], temperature=0)) == 3  # 2 + 3 = max_model_len
    with pytest.warns(ContextLimitWarning, match=r"1 of 2 samples \(first: index 1\)"):
        await lm.batch_sample([[0], [0, 2, 3]], 3, [], temperature=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContextLimitWarning)
        assert len(await lm.sample([0, 2], 3, [], temperature=0)) == 3  # max_tokens reached first
    with pytest.raises(ValueError, match="max_tokens"):
        await lm.sample([0], 0, [])
    with pytest.raises(ValueError, match="temperature"):
        await lm.sample([0], 1, [], temperature=-1)
    with pytest.raises(TypeError, match="seed"):
        await lm.sample([0], 1, [], seed="1")
    with pytest.raises(ValueError, match=r"prompt_token_ids_list\[1\]"):
        await lm.batch_sample([[0], []], 1, [])


# ---------------------------------------------------------------------------------- LoRA, lifecycle
def test_lora_adapters_change_the_rows(lm):
    base = lm.next_token_logprobs_sync([0, 5])
    lm.add_new_lora("/adapters/a", "a")
    lm.add_new_lora("/adapters/a", "a2")
    lm.add_new_lora("/adapters/b", "b")
    assert lm.lora_names == ["a", "a2", "b"]
    a = lm.next_token_logprobs_sync([0, 5], lora_name="a")
    assert not torch.equal(a, base)
    assert torch.equal(a, lm.next_token_logprobs_sync([0, 5], lora_name="a2"))  # same path
    assert not torch.equal(a, lm.next_token_logprobs_sync([0, 5], lora_name="b"))
    lm.set_lora(lora_name="b")
    assert torch.equal(lm.next_token_logprobs_sync([0, 5]), lm.next_token_logprobs_sync([0, 5], lora_name="b"))
    lm.clear_lora()
    assert torch.equal(lm.next_token_logprobs_sync([0, 5]), base)
    lm.remove_lora("a")
    with pytest.raises(UnknownAdapterError, match="unknown LoRA adapter 'a'"):
        lm.next_token_logprobs_sync([0, 5], lora_name="a")
    with pytest.raises(UnknownAdapterError):
        lm.score_sync([0], [5], lora_name="a")


async def test_cleanup_closes_the_model():
    from genlm_vlm import ClosedError

    with MockAsyncLM() as lm:
        lm.next_token_logprobs_sync([0])
    with pytest.raises(ClosedError, match="cleaned up"):
        lm.next_token_logprobs_sync([0])
    async with MockAsyncLM() as lm2:
        await lm2.next_token_logprobs([0])
    with pytest.raises(ClosedError):
        await lm2.sample([0], 1, [])
    lm2.clear_cache()  # no-op, never raises
    for late in (lm2.batch_sample([], 1, []), lm2.batch_next_token_logprobs([])):
        with pytest.raises(ClosedError):  # even with nothing to do
            await late
    lm2.cleanup()  # idempotent


def test_closed_error_is_one_class_everywhere():
    import genlm_vlm
    from genlm_vlm import base, vllm_lm

    assert vllm_lm.ClosedError is base.ClosedError is genlm_vlm.ClosedError


async def test_batch_sample_checks_the_seed_before_adding_the_index(lm):
    with pytest.raises(TypeError, match="seed"):
        await lm.batch_sample([[0], [0]], 2, [], seed=True)  # True + i would pass as an int
    with pytest.raises(TypeError, match="seed"):
        await lm.batch_sample([[0]], 2, [], seed="1")
    a, b = await lm.batch_sample([[0], [0]], 4, [], seed=7)
    assert a == await lm.sample([0], 4, [], seed=7) and b == await lm.sample([0], 4, [], seed=8)


async def test_adapters_register_replace_and_remove(lm):
    lm.add_new_lora("/path/one", "x")
    row_one = lm.next_token_logprobs_sync([0, 5], lora_name="x")
    lm.add_new_lora("/path/two", "x")  # re-registered: its rows follow the new path
    assert not torch.equal(lm.next_token_logprobs_sync([0, 5], lora_name="x"), row_one)
    lm.set_lora(lora_name="x")
    assert lm.lora_names == ["x"] and torch.equal(lm.next_token_logprobs_sync([0, 5]), await lm.next_token_logprobs([0, 5], "x"))
    lm.remove_lora("x")  # removing the default adapter clears the default
    assert lm.lora_names == [] and not torch.equal(lm.next_token_logprobs_sync([0, 5]), row_one)
    with pytest.raises(UnknownAdapterError):
        lm.remove_lora("x")


# ---------------------------------------------------------------------------------- tokens
def test_token_semantics():
    a, b, c = Token(5, b"\n"), Token(6, b"\n"), Token(5, b"x")
    assert a != b and a == c and hash(a) == hash(c) == hash(5)
    assert len({a, b, c}) == 2
    assert a == b"\n" and b"\n" == a and a != b"x"  # against plain bytes: the bytes
    assert b"".join([a, b]) == b"\n\n" and a.decode() == "\n" and a[:1] == b"\n"
    assert type(a.byte_string) is bytes and a.byte_string == b"\n" and a.token_id == 5
    assert sorted([b, a]) == [a, b] and a < b and b >= a
    assert repr(a) == "Token(5, b'\\n')"
    assert pickle.loads(pickle.dumps(b)) == b and copy.deepcopy(b).byte_string == b"\n"
    assert Token(np.int64(3), bytearray(b"q")).token_id == 3
    with pytest.raises(TypeError, match="token_id must be an int"):
        Token("3", b"q")
    with pytest.raises(TypeError, match="byte_string must be bytes"):
        Token(3, "q")


def test_token_like_objects_count_as_tokens():
    class Other(bytes):  # behaves like genlm-backend's Token
        def __new__(cls, token_id, byte_string):
            obj = super().__new__(cls, byte_string)
            obj.token_id = token_id
            return obj

        def __eq__(self, other):
            return self.token_id == other.token_id if isinstance(other, Other) else NotImplemented

        def __hash__(self):
            return hash(self.token_id)

    other = Other(5, b"\n")
    assert isinstance(other, Token) and not isinstance(b"\n", Token)
    assert Token(5, b"z") == other and other == Token(5, b"z") and Token(6, b"\n") != other
    assert {Token(5, b"z"), other} == {other}
