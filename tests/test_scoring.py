"""``genlm_vlm.scoring``: score_records on the real engine, and the ``score`` command end to end."""

from __future__ import annotations

import itertools
import json
import math
import os
import pathlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ENGINE_OPTS

from genlm_vlm import demo_model_path
from genlm_vlm.scoring import main, read_jsonl, score_records
from genlm_vlm.vocab import get_str_vocab

REPO = pathlib.Path(__file__).resolve().parents[1]


def _ids(lm, text: str) -> list[int]:
    return list(lm.tokenizer.encode(text, add_special_tokens=False))


def _by_hand(lm, prompt: list[int], cont: list[int]) -> list[float]:
    """log p(c_t | prompt + c_<t), one ``next_token_logprobs_sync`` call per token."""
    return [float(lm.next_token_logprobs_sync(prompt + cont[:t])[c]) for t, c in enumerate(cont)]


class Spy:
    """Wraps a model and records the size of every ``batch_next_token_logprobs_sync`` call
    (``calls``: the row path) and of every group of scoring queries (``scored``: the
    prompt-logprobs path)."""

    def __init__(self, lm):
        self._lm = lm
        self.calls: list[int] = []
        self.scored: list[int] = []

    def __getattr__(self, name):
        return getattr(self._lm, name)

    def batch_next_token_logprobs_sync(self, prompts, **kwargs):
        self.calls.append(len(prompts))
        return self._lm.batch_next_token_logprobs_sync(prompts, **kwargs)

    def _score_futures(self, items, method="auto"):
        if items:
            self.scored.append(len(items))
        return self._lm._score_futures(items, method)


class RowsOnly(Spy):
    """The model as a model without the prompt-logprobs path sees it: rows only."""

    def _score_futures(self, items, method="auto"):
        return None


RECORDS = [
    {"id": "text", "prompt": "def main(argv):", "continuation": "\n    return 0\n"},
    {"id": "ids", "prompt": [5, 77, 300, 12], "continuation": [9, 400, 3, 3, 88]},
    {"id": "mixed", "prompt": "import os", "continuation": [10, 11, 12]},
    {"id": "bos", "prompt": "class A:", "add_bos": True, "continuation": " pass"},
    {"id": "no-cont", "prompt": [7, 8, 9]},
    {"id": "one", "prompt": "x", "continuation": [42]},
    {"id": "empty-cont", "prompt": "y", "continuation": ""},
    {"prompt": "import os", "continuation": [10, 11, 99]},  # no id; shares a prefix with "mixed"
]


def _approx(a: dict, b: dict, tol: float = 1e-5) -> None:
    """``a`` and ``b`` are the same result up to ``tol`` on every log-probability."""
    assert a.keys() == b.keys()
    for key in a:
        if key == "top_k":
            assert [t["token_id"] for t in a[key]] == [t["token_id"] for t in b[key]]
            assert [t["token"] for t in a[key]] == [t["token"] for t in b[key]]
            assert max((abs(x["logprob"] - y["logprob"]) for x, y in zip(a[key], b[key], strict=True)), default=0) <= tol
        elif key == "token_logprobs":
            assert len(a[key]) == len(b[key])
            assert max((abs(x - y) for x, y in zip(a[key], b[key], strict=True)), default=0) <= tol
        elif key == "continuation_logprob":
            assert a[key] == pytest.approx(b[key], abs=tol)
        else:
            assert a[key] == b[key], key


# ------------------------------------------------------------------------------ correctness
def test_continuation_logprob_matches_rows_by_hand(llama_lm):
    lm = llama_lm
    results = list(score_records(lm, RECORDS, top_k=5))
    assert [r.get("id") for r in results] == [r.get("id") for r in RECORDS]
    assert [r["line"] for r in results] == list(range(1, len(RECORDS) + 1))
    for rec, res in zip(RECORDS, results, strict=True):
        assert "error" not in res, res
        prompt = _ids(lm, rec["prompt"]) if isinstance(rec["prompt"], str) else list(rec["prompt"])
        if rec.get("add_bos"):
            prompt = [lm.tokenizer.bos_token_id] + prompt
        assert res["prompt_tokens"] == len(prompt)
        if "continuation" not in rec:
            assert "continuation_logprob" not in res and "token_logprobs" not in res
            continue
        cont = rec["continuation"]
        cont = _ids(lm, cont) if isinstance(cont, str) else list(cont)
        expected = _by_hand(lm, prompt, cont)
        assert res["continuation_tokens"] == len(cont)
        assert len(res["token_logprobs"]) == len(cont)
        assert max((abs(a - b) for a, b in zip(res["token_logprobs"], expected, strict=True)), default=0) < 1e-5
        assert res["continuation_logprob"] == pytest.approx(math.fsum(expected), abs=1e-5)
        assert res["continuation_logprob"] == pytest.approx(math.fsum(res["token_logprobs"]), abs=1e-9)
    assert results[6]["continuation_logprob"] == 0.0 and results[6]["token_logprobs"] == []


@pytest.mark.parametrize("k", [1, 5, 17])
def test_top_k_sorted_and_correct(llama_lm, k):
    lm = llama_lm
    vocab = get_str_vocab(lm.tokenizer, pad_to=lm.vocab_size)
    prompts = [[5, 77, 300, 12], _ids(lm, "for i in range(")]
    results = list(score_records(lm, [{"prompt": p} for p in prompts], top_k=k))
    for prompt, res in zip(prompts, results, strict=True):
        row = lm.next_token_logprobs_sync(prompt)
        top = res["top_k"]
        assert len(top) == k
        logprobs = [t["logprob"] for t in top]
        assert logprobs == sorted(logprobs, reverse=True)
        ref = torch.sort(row, descending=True)
        assert [t["token_id"] for t in top] == ref.indices[:k].tolist()
        for t in top:
            assert t["logprob"] == pytest.approx(float(row[t["token_id"]]), abs=1e-6)
            assert t["token"] == vocab[t["token_id"]]
        # nothing outside the list beats its last entry
        assert float(ref.values[k]) <= logprobs[-1]


def test_text_and_id_prompts_agree(llama_lm):
    lm = llama_lm
    text, cont = "while True:", "\n    break"
    p, c = _ids(lm, text), _ids(lm, cont)
    a, b, c_ = score_records(
        lm,
        [
            {"id": 1, "prompt": text, "continuation": cont},
            {"id": 1, "prompt": p, "continuation": c},
            {"id": 1, "prompt": tuple(p), "continuation": tuple(c)},
        ],
    )
    _approx({**a, "line": 0}, {**b, "line": 0}, tol=0.0)
    _approx({**a, "line": 0}, {**c_, "line": 0}, tol=0.0)


def test_add_bos_prepends_bos(llama_lm):
    lm = llama_lm
    bos = lm.tokenizer.bos_token_id
    a, b = score_records(lm, [{"prompt": "abc", "add_bos": True}, {"prompt": [bos] + _ids(lm, "abc")}])
    _approx({**a, "line": 0}, {**b, "line": 0}, tol=0.0)
    # add_bos alone (empty text) scores from BOS
    (c,) = score_records(lm, [{"prompt": "", "add_bos": True, "continuation": "x"}])
    assert c["prompt_tokens"] == 1 and "error" not in c


def test_top_k_none_or_zero_leaves_it_out(llama_lm):
    for k in (None, 0):
        (res,) = score_records(llama_lm, [{"prompt": [5, 6], "continuation": [7]}], top_k=k)
        assert "top_k" not in res and "continuation_logprob" in res
    # no top-k and no continuation: nothing to compute
    spy = Spy(llama_lm)
    (res,) = score_records(spy, [{"id": "x", "prompt": [5, 6]}], top_k=None)
    assert res == {"id": "x", "line": 1, "prompt_tokens": 2} and spy.calls == []


# ------------------------------------------------------------------------------ bad records
BAD = [
    ({"id": "no-prompt", "continuation": "x"}, "missing 'prompt'"),
    ({"id": "null-prompt", "prompt": None}, "missing 'prompt'"),
    ({"id": "empty-text", "prompt": ""}, "prompt is empty"),
    ({"id": "empty-ids", "prompt": []}, "prompt is empty"),
    ({"id": "big-id", "prompt": [5, 10**6]}, "outside the vocabulary"),
    ({"id": "neg-id", "prompt": [5, 6], "continuation": [-1]}, "continuation holds token id -1"),
    ({"id": "float-id", "prompt": [5, 2.5]}, r"prompt[1] must be an int"),
    ({"id": "bool-id", "prompt": [5, True]}, r"prompt[1] must be an int"),
    ({"id": "str-id", "prompt": [5, "6"]}, r"prompt[1] must be an int"),
    ({"id": "int-prompt", "prompt": 5}, "prompt must be a string or a list"),
    ({"id": "dict-cont", "prompt": [5], "continuation": {"a": 1}}, "continuation must be a string or a list"),
    ({"id": "bad-bos", "prompt": [5], "add_bos": "yes"}, "add_bos must be true or false"),
    ({"id": "long-prompt", "prompt": [5] * 600}, "at most 511"),
    ({"id": "long-total", "prompt": [5] * 500, "continuation": [6] * 13}, "prompt + continuation has 513 tokens"),
    ({"id": "typo", "prompt": [5, 6], "contination": [7]}, "unknown key 'contination' (did you mean 'continuation'?)"),
    ([1, 2, 3], "must be a JSON object"),
    ("text", "must be a JSON object"),
]


def test_bad_records_get_errors_and_good_ones_are_scored(llama_lm):
    lm = llama_lm
    good = [dict(r) for r in RECORDS]
    records: list = []
    for i, (bad, _) in enumerate(BAD):  # interleave: good, bad, good, bad, ...
        records.append(good[i % len(good)])
        records.append(bad)
    records.append({"id": "fits", "prompt": [5] * 500, "continuation": [6] * 12})  # exactly 512 tokens
    expected = {r["id"]: r for r in score_records(lm, good)}
    results = list(score_records(lm, records, chunk_size=4))
    assert [r["line"] for r in results] == list(range(1, len(records) + 1))
    for i, (bad, message) in enumerate(BAD):
        ok, err = results[2 * i], results[2 * i + 1]
        assert "error" not in ok
        if ok["id"] is not None:
            _approx({**ok, "line": 0}, {**expected[ok["id"]], "line": 0})
        assert set(err) == {"id", "line", "error"}
        assert message in err["error"], (message, err)
        assert err["id"] == (bad.get("id") if isinstance(bad, dict) else None)
    assert "error" not in results[-1] and results[-1]["continuation_tokens"] == 12


class Picky(RowsOnly):
    """A model that refuses (ValueError) any prompt holding token 13, which validation allows."""

    def batch_next_token_logprobs_sync(self, prompts, **kwargs):
        for i, p in enumerate(prompts):
            if 13 in p:
                raise ValueError(f"token_ids_list[{i}] refused")
        return super().batch_next_token_logprobs_sync(prompts, **kwargs)


def test_a_refused_chunk_is_rescored_record_by_record(llama_lm):
    records = [{"id": i, "prompt": [5, 6, 20 + i], "continuation": [7, 8]} for i in range(6)]
    records[2]["continuation"] = [7, 13, 9]  # prefix [5, 6, 22, 7, 13] is refused
    expected = list(score_records(llama_lm, records))
    results = list(score_records(Picky(llama_lm), records, chunk_size=4))
    assert [r["id"] for r in results] == list(range(6))
    assert "refused" in results[2]["error"] and set(results[2]) == {"id", "line", "error"}
    for i in (0, 1, 3, 4, 5):
        _approx(results[i], expected[i])


class PickyScores(Spy):
    """The prompt-logprobs path refusing (ValueError) any record holding token 13."""

    def _score_futures(self, items, method="auto"):
        import concurrent.futures as cf

        futures = super()._score_futures(items, method)
        for i, (prompt, cont, _, _) in enumerate(items):
            if 13 in prompt + cont:
                futures[i].cancel()
                futures[i] = cf.Future()
                futures[i].set_exception(ValueError(f"item {i} refused"))
        return futures


def test_a_refused_record_is_that_records_error(llama_lm):
    records = [{"id": i, "prompt": [5, 6, 20 + i], "continuation": [7, 8]} for i in range(6)]
    records[2]["continuation"] = [7, 13, 9]
    expected = list(score_records(llama_lm, records))
    spy = PickyScores(llama_lm)
    results = list(score_records(spy, records, chunk_size=4))
    assert spy.scored and spy.calls == []
    assert "refused" in results[2]["error"] and set(results[2]) == {"id", "line", "error"}
    for i in (0, 1, 3, 4, 5):
        _approx(results[i], expected[i])


def test_array_prompts(llama_lm):
    import numpy as np

    (a, b, c) = score_records(
        llama_lm,
        [
            {"prompt": np.array([5, 6, 7]), "continuation": torch.tensor([8, 9])},
            {"prompt": [5, 6, 7], "continuation": [8, 9]},
            {"prompt": torch.tensor([5.0, 6.0])},
        ],
    )
    _approx({**a, "line": 0}, {**b, "line": 0}, tol=0.0)
    assert "prompt[0] must be an int" in c["error"]


def test_invalid_json_lines():
    lines = ['{"prompt": [1, 2]}\n', "\n", "{not json\n", '  {"prompt": "a"}  \n', "[1]\n"]
    parsed = list(read_jsonl(lines))
    assert [n for n, _ in parsed] == [1, 3, 4, 5]
    assert parsed[0][1] == {"prompt": [1, 2]}
    assert "invalid JSON" in parsed[1][1].message


def test_invalid_json_line_is_an_error_record(llama_lm):
    from genlm_vlm.scoring.scorer import _Scorer

    lines = ['{"id": 1, "prompt": [5, 6]}', "{oops", '{"id": 3, "prompt": [5, 7]}']
    results = list(_Scorer(llama_lm, 3, 8).score(read_jsonl(lines)))
    assert [r.get("error", "").startswith("invalid JSON") for r in results] == [False, True, False]
    assert results[1] == {"id": None, "line": 2, "error": results[1]["error"]}


def test_argument_checks(llama_lm):
    with pytest.raises(ValueError, match="chunk_size"):
        score_records(llama_lm, [], chunk_size=0)
    with pytest.raises(ValueError, match="top_k"):
        score_records(llama_lm, [], top_k=-1)
    assert list(score_records(llama_lm, [])) == []


# ------------------------------------------------------------------------------ chunking, streaming
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7])
def test_small_chunks_give_the_same_results(llama_lm, chunk_size):
    lm = llama_lm
    records = RECORDS + [{"id": "long", "prompt": [5, 6], "continuation": list(range(20, 45))}]
    reference = list(score_records(lm, records, chunk_size=256))
    spy = Spy(lm)  # the prompt-logprobs path: at most chunk_size records in flight
    results = list(score_records(spy, records, chunk_size=chunk_size))
    assert spy.calls == [] and spy.scored and max(spy.scored) <= max(1, chunk_size // 8)
    for a, b in zip(results, reference, strict=True):
        _approx(a, b)
    lm.clear_cache()  # the row path: recompute every row in the new chunking
    spy = RowsOnly(lm)
    results = list(score_records(spy, records, chunk_size=chunk_size))
    assert spy.calls and max(spy.calls) <= chunk_size
    n_prefixes = sum(max(len(r["token_logprobs"]) if "token_logprobs" in r else 0, 1) for r in reference)
    assert sum(spy.calls) == n_prefixes
    for a, b in zip(results, reference, strict=True):
        _approx(a, b)


def test_records_are_streamed(llama_lm):
    """An endless input: results come out after reading about one chunk of records."""
    consumed = 0

    def endless():
        nonlocal consumed
        for i in itertools.count():
            consumed += 1
            yield {"id": i, "prompt": [5, 6, 3 + i % 400], "continuation": [7, 8]}

    chunk = 8
    it = score_records(llama_lm, endless(), chunk_size=chunk)
    first = next(it)
    assert first["id"] == 0 and consumed <= chunk  # at most chunk_size records held
    more = list(itertools.islice(it, 42))
    assert [r["id"] for r in more] == list(range(1, 43))
    assert consumed <= 43 + chunk
    it.close()  # the records in flight are abandoned (their requests aborted)
    stats = llama_lm.stats["scoring"]
    assert stats["active"] == 0 or stats["cancelled"] > 0


def test_errors_alone_are_streamed(llama_lm):
    """A long run of bad records behind a pending good one is still bounded by chunk_size."""
    consumed = 0

    def records():
        nonlocal consumed
        consumed += 1
        yield {"prompt": [5, 6]}
        for _ in itertools.count():
            consumed += 1
            yield {"prompt": []}

    it = score_records(llama_lm, records(), chunk_size=4)
    first = next(it)
    assert "top_k" in first
    assert consumed <= 4


# ------------------------------------------------------------------------------ LoRA
@pytest.fixture(scope="module")
def score_lora_lm(model_paths, tmp_path_factory):
    """The LoRA engine of test_lora.py (shared when both run) with one more adapter of its own."""
    pytest.importorskip("peft")
    from conftest import _engine
    from test_lora import LORA_OPTS, _make_adapter

    path = _make_adapter(model_paths["llama"], tmp_path_factory.mktemp("score-lora") / "adapter", seed=5)
    lm = _engine(model_paths["llama"], LORA_OPTS)
    lm.add_new_lora(path, "score-a")
    yield lm
    lm.remove_lora("score-a")


LORA_RECORDS = [{"id": i, "prompt": [5, 6, 20 + i], "continuation": [7, 8, 30 + i, 9]} for i in range(4)]


def test_lora_name_scores_every_record_under_the_adapter(score_lora_lm):
    lm = score_lora_lm
    base = list(score_records(lm, LORA_RECORDS, top_k=3))
    tuned = list(score_records(lm, LORA_RECORDS, top_k=3, lora_name="score-a"))
    for r, b, a in zip(LORA_RECORDS, base, tuned, strict=True):
        assert a["continuation_logprob"] == pytest.approx(
            lm.score_sync(r["prompt"], r["continuation"], lora_name="score-a"), abs=1e-5
        )
        expected = lm.continuation_logprobs_sync(r["prompt"], r["continuation"], lora_name="score-a").tolist()
        assert a["token_logprobs"] == pytest.approx(expected, abs=1e-5)
        top = lm.next_token_topk_sync(r["prompt"], 3, lora_name="score-a")
        assert [t["token_id"] for t in a["top_k"]] == top.token_ids.tolist()
        assert b["continuation_logprob"] == pytest.approx(lm.score_sync(r["prompt"], r["continuation"]), abs=1e-5)
        # the adapter really changes the rows
        assert max(abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"], strict=True)) > 0.1


def test_a_record_lora_name_overrides_the_argument(score_lora_lm):
    lm = score_lora_lm
    base = list(score_records(lm, LORA_RECORDS, top_k=2))
    tuned = list(score_records(lm, LORA_RECORDS, top_k=2, lora_name="score-a"))
    mixed = [{**r, "lora_name": "score-a"} if i % 2 else r for i, r in enumerate(LORA_RECORDS)]
    spy = Spy(lm)
    lm.clear_cache()  # the rows of both adapters are computed within the same chunks
    for i, result in enumerate(score_records(spy, mixed, top_k=2, chunk_size=6)):
        _approx(result, tuned[i] if i % 2 else base[i])
    assert max(spy.calls) <= 6
    # the argument applies to records without the key; "lora_name": null means the same
    null = [{**r, "lora_name": None} for r in LORA_RECORDS]
    for result, expected in zip(score_records(lm, null, top_k=2, lora_name="score-a"), tuned, strict=True):
        _approx(result, expected)


def test_lora_name_errors(score_lora_lm):
    from genlm_vlm import UnknownAdapterError

    lm = score_lora_lm
    records = [
        {"id": "ok", "prompt": [5, 6], "lora_name": "score-a"},
        {"id": "unknown", "prompt": [5, 6], "lora_name": "nope"},
        {"id": "type", "prompt": [5, 6], "lora_name": 3},
        {"id": "empty", "prompt": [5, 6], "lora_name": ""},
        {"id": "typo", "prompt": [5, 6], "lora_nmae": "score-a"},
    ]
    ok, unknown, type_, empty, typo = score_records(lm, records)
    assert "error" not in ok
    assert "unknown LoRA adapter 'nope'" in unknown["error"]
    assert "lora_name must be a non-empty string" in type_["error"] and "3" in type_["error"]
    assert "lora_name must be a non-empty string" in empty["error"]
    assert "unknown key 'lora_nmae' (did you mean 'lora_name'?)" in typo["error"]
    with pytest.raises(UnknownAdapterError, match="nope"):  # at the call, before any record is read
        score_records(lm, iter(()), lora_name="nope")
    with pytest.raises(TypeError, match="lora_name"):
        score_records(lm, [], lora_name=3)


def test_a_record_naming_an_adapter_on_a_model_without_lora(llama_lm):
    (result,) = score_records(llama_lm, [{"prompt": [5, 6], "lora_name": "a"}])
    assert "unknown LoRA adapter 'a'" in result["error"]


# ------------------------------------------------------------------------------ CLI
def test_demo_model_path_is_exported_and_light():
    import genlm_vlm
    from genlm_vlm import _paths, demo, scoring

    assert genlm_vlm.demo_model_path is _paths.demo_model_path
    # the pre-release aliases are gone; the commands use the shipped model through _paths
    assert not hasattr(demo, "default_model_path") and not hasattr(scoring, "default_model_path")
    assert "demo_model_path" in genlm_vlm.__all__ and "demo_model_path" in dir(genlm_vlm)
    assert "loads offline" in genlm_vlm.demo_model_path.__doc__
    path = Path(genlm_vlm.demo_model_path())
    assert path == (Path(genlm_vlm.__file__).resolve().parent / "data" / "demo-model")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in path.iterdir()}
    code = (
        "import sys, genlm_vlm\n"
        "print(genlm_vlm.demo_model_path())\n"
        "print(sorted({'torch', 'vllm', 'transformers'} & set(sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(path), "[]"]


def test_cli_rejects_missing_input(tmp_path, capsys):
    assert main([str(tmp_path / "nope.jsonl"), str(tmp_path / "out.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
    (tmp_path / "in.jsonl").write_text('{"prompt": [1]}\n')
    assert main([str(tmp_path / "in.jsonl"), str(tmp_path / "no-dir" / "out.jsonl")]) == 2
    assert "output directory not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "in.jsonl")])  # argparse: missing OUT


class NoCleanup(Spy):
    def cleanup(self):
        self.cleaned = True


def test_cli_stdin_stdout_in_process(llama_lm, monkeypatch, capsys):
    """`score - -`: results alone on stdout, in order; default model; engine options parsed."""
    import io

    from genlm_vlm.vllm_lm import AsyncVirtualLM

    built = []

    def fake_from_name(path, engine_opts=None, **kwargs):
        built.append((path, engine_opts))
        built.append(NoCleanup(llama_lm))
        return built[-1]

    monkeypatch.setattr(AsyncVirtualLM, "from_name", staticmethod(fake_from_name))
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # genlm_vlm.logs sets it; restore after
    lines = ['{"id": "a", "prompt": [5, 6], "continuation": [7, 8]}', "nope", '{"id": "c", "prompt": "x"}']
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    rc = main(["-", "-", "--top-k", "2", "--engine-opt", "max_model_len=512", "--engine-opt", "dtype=float32"])
    captured = capsys.readouterr()
    assert rc == 1  # the record "nope" failed (its error is written like any result)
    # the weight-loading bar is build_llm's business (tests/test_cli_errors.py), not the command's
    assert built[0] == (demo_model_path(), {"max_model_len": 512, "dtype": "float32"})
    assert built[1].cleaned
    out = [json.loads(line) for line in captured.out.splitlines()]  # nothing else on stdout
    assert [r["id"] for r in out] == ["a", None, "c"] and "error" in out[1]
    _approx(out[0], next(score_records(llama_lm, [json.loads(lines[0])], top_k=2)))
    assert "scored 2, errors 1" in captured.err


def test_score_quiet_on_the_shipped_model_prints_nothing_on_stderr(tmp_path):
    """`score --quiet` on the shipped model, from the command line: results in the file, exit 0,
    and not one byte on stderr (torch's C++ NUMA notice and vLLM's log included)."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": "a", "prompt": "the", "continuation": " cat"}\n{"id": "b", "prompt": [1, 5]}\n')
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CPP_LOG_LEVEL", "GENLM_VLM_VERBOSE")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "genlm_vlm", "score", str(src), str(dst), "--quiet",
         "--engine-opt", "max_model_len=64", "--engine-opt", "kv_cache_memory_bytes=33554432"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "" and proc.stdout == ""
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in out] == ["a", "b"] and all("error" not in r for r in out)
    assert math.isfinite(out[0]["continuation_logprob"]) and len(out[1]["top_k"]) == 5


@pytest.mark.slow
def test_cli_end_to_end(llama_lm, model_paths, tmp_path):
    records = RECORDS[:5] + [{"id": "bad", "prompt": [5, 10**6]}]
    lines = [json.dumps(r) for r in records]
    lines.insert(2, "{this is not json")
    lines.insert(4, "")
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    opts = [f"--engine-opt={k}={v}" for k, v in ENGINE_OPTS.items()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "genlm_vlm", "score", str(src), str(dst), "--model", model_paths["llama"],
         "--top-k", "4", "--chunk-size", "3", *opts],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # two records failed
    assert "scored 5, errors 2" in proc.stderr
    # vLLM's log is quiet by default (genlm_vlm.logs): none of its INFO or WARNING lines
    assert not re.search(r"^\(\S+ pid=\d+\) (INFO|WARNING) ", proc.stderr, re.M), proc.stderr[-3000:]
    assert proc.stdout == ""
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["line"] for r in out] == [1, 2, 3, 4, 6, 7, 8]
    assert "invalid JSON" in out[2]["error"]
    assert "outside the vocabulary" in out[-1]["error"]
    # same numbers as in-process scoring on the same model and options
    good = [r for r in out if "error" not in r]
    expected = list(score_records(llama_lm, records[:5], top_k=4))
    for a, b in zip(good, expected, strict=True):
        _approx({**a, "line": 0}, {**b, "line": 0})


# ------------------------------------------------------------------------------ --engine-opt names
@pytest.mark.parametrize("command", [["score", "IN", "OUT"], ["demo"]])
def test_a_misspelled_engine_opt_is_named_before_vllm_loads(tmp_path, command):
    """`--engine-opt maxmodellen=64`: exit status 2 naming max_model_len, in well under 2 s, without
    importing vLLM or torch (the names are read from vLLM's source)."""
    import time

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n')
    argv = [str(src) if a == "IN" else str(tmp_path / "out.jsonl") if a == "OUT" else a for a in command]
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from genlm_vlm.cli import main\n"
        f"rc = main({argv!r} + ['--engine-opt', 'maxmodellen=64', '--engine-opt', 'dtype=float32'])\n"
        "print(rc, round(time.perf_counter() - t, 3), sorted({'vllm', 'torch'} & set(sys.modules)))\n"
    )
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    wall = time.perf_counter() - t0
    rc, inside, loaded = proc.stdout.split(maxsplit=2)
    assert rc == "2" and loaded.strip() == "[]", proc.stdout + proc.stderr
    assert "'maxmodellen' (did you mean 'max_model_len'?)" in proc.stderr
    assert "'dtype'" not in proc.stderr  # a real name passes
    assert float(inside) < 2.0 and wall < 10  # the 2 s target is measured in docs/BENCHMARKS.md
    assert not (tmp_path / "out.jsonl").exists()


def test_from_name_names_a_misspelled_engine_opt_before_building(no_engine):
    from genlm_vlm import AsyncVirtualLM

    with pytest.raises(TypeError, match=r"'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        AsyncVirtualLM.from_name(demo_model_path(), {"max_num_seq": 4})
