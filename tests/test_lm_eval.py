"""lm-evaluation-harness on genlm_vlm (genlm_vlm.evaluation): local YAML tasks over local JSONL
written here (no hub), compared request by request with lm-eval's own ``hf`` backend (float32,
same model) and, for greedy generation, its ``vllm`` backend with the same engine options."""

from __future__ import annotations

import gc
import inspect
import json
import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason="needs the eval extra (lm-eval)")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from conftest import ENGINE_OPTS  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from genlm_vlm import MockAsyncLM  # noqa: E402
from genlm_vlm.evaluation import GenlmVLMEval  # noqa: E402

TOL = 1e-3
MAX_MODEL_LEN = ENGINE_OPTS["max_model_len"]  # 512: the tiny models' positions
TASKS = ["tiny_mc", "tiny_ll", "tiny_ppl", "tiny_gen"]


def _text_source() -> str:
    import collections
    import json.decoder
    import string

    return "\n".join(inspect.getsource(m) for m in (collections, json.decoder, string))


def _lm_eval_windows(model, text: str) -> list[tuple[list[int], list[int]]]:
    """``(context, continuation)`` of each rolling window of ``text``, as lm-eval's ``hf``
    backend cuts them (windows of ``max_length``, one token of context)."""
    return list(map(make_disjoint_window, get_rolling_token_windows(
        token_list=model.tok_encode(text), prefix_token=model.prefix_token_id,
        max_seq_len=model.max_length, context_len=1)))


def _write_task(root: pathlib.Path, name: str, rows: list[dict], body: str) -> None:
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\n{body}"
    )


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory, llama_lm):
    """Four tasks: multiple choice (with greedy choices), a lambada-like loglikelihood task
    (acc from is_greedy), rolling perplexity over documents longer than max_model_len, and a
    greedy generate_until task."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    rng = random.Random(0)
    text = _text_source()
    lines = [ln for ln in text.splitlines() if len(ln.strip()) > 20]
    tok = llama_lm.tokenizer

    def greedy_text(context: str, n: int) -> str:
        ids = tok.encode(context)
        out = llama_lm.batch_sample([ids], max_tokens=n, eos_token_ids=[], temperature=0.0)
        return tok.decode(_wait(out)[0])

    mc, ll = [], []
    for i in range(12):
        q = " ".join(rng.sample(lines, 3))
        choices = [" " + rng.choice(lines).strip()[:rng.randint(5, 40)] for _ in range(3)]
        if i % 2 == 0:  # a choice the model itself would write
            choices.append(greedy_text(q, 3))
        else:
            choices.append(" " + rng.choice(lines).strip()[:12])
        mc.append({"question": q, "choices": choices, "label": rng.randrange(4)})
        ctx = rng.choice(lines)
        ll.append({"context": ctx, "target": greedy_text(ctx, 2) if i % 2 == 0 else " " + rng.choice(lines)[:10]})
    _write_task(root, "tiny_mc", mc, 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
                'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\ntarget_delimiter: ""\n'
                "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    _write_task(root, "tiny_ll", ll, 'output_type: loglikelihood\ndoc_to_text: "{{context}}"\n'
                'doc_to_target: "{{target}}"\ntarget_delimiter: ""\n'
                "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    start = [0, 30_000, 60_000]
    docs = [{"text": text[s : s + n]} for s, n in zip(start, (6000, 3500, 400), strict=True)]
    _write_task(root, "tiny_ppl", docs, 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
                'doc_to_target: "{{text}}"\n'
                "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    gen = [{"prompt": rng.choice(lines) + "\n", "answer": ""} for _ in range(6)]
    _write_task(root, "tiny_gen", gen, 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\n'
                'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n", ":"]\n'
                "  max_gen_toks: 40\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return root


def _wait(x):
    import asyncio

    return asyncio.run(x) if inspect.isawaitable(x) else x


def _evaluate(model, tasks_dir, tasks, **kw):
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=TaskManager(include_path=str(tasks_dir)),
                                   log_samples=True, **kw)


def _resps(results, task):
    return {s["doc_id"]: [r[0] for r in s["resps"]] for s in results["samples"][task]}


@pytest.fixture(scope="module")
def ours(llama_lm, tasks_dir):
    return _evaluate(GenlmVLMEval(llama_lm), tasks_dir, TASKS)


@pytest.fixture(scope="module")
def hf_results(model_paths, tasks_dir):
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=model_paths["llama"], dtype="float32", device="cpu", batch_size=4,
              max_length=MAX_MODEL_LEN - 1)
    out = _evaluate(hf, tasks_dir, TASKS[:3])
    del hf
    gc.collect()
    return out


def _metrics(results, task):
    return {k: v for k, v in results["results"][task].items() if "stderr" not in k and k not in ("alias", "name")}


@pytest.mark.parametrize("task", ["tiny_mc", "tiny_ll"])
def test_loglikelihood_equals_the_hf_backend(ours, hf_results, task):
    mine, theirs = _resps(ours, task), _resps(hf_results, task)
    assert mine.keys() == theirs.keys()
    greedy = []
    for doc, answers in theirs.items():
        for (ll, g), (ll2, g2) in zip(mine[doc], answers, strict=True):
            assert abs(ll - ll2) < TOL, (task, doc, ll, ll2)
            assert g == g2, (task, doc)
            greedy.append(g)
    assert any(greedy) and not all(greedy)  # both cases exercised
    a, b = _metrics(ours, task), _metrics(hf_results, task)
    assert a.keys() == b.keys()
    for key in a:  # accuracy identical; perplexity = exp(-mean log-likelihood) to float precision
        assert a[key] == (b[key] if key.startswith("acc") else pytest.approx(b[key], rel=1e-5)), key


def test_rolling_perplexity_equals_the_hf_backend(ours, hf_results, llama_lm, tasks_dir):
    mine, theirs = _resps(ours, "tiny_ppl"), _resps(hf_results, "tiny_ppl")
    longest = max(len(llama_lm.tokenizer.encode(json.loads(ln)["text"]))
                  for ln in (tasks_dir / "tiny_ppl.jsonl").read_text().splitlines())
    assert longest > 2 * MAX_MODEL_LEN  # several windows
    for doc, (value,) in theirs.items():
        assert abs(mine[doc][0] - value) < TOL, (doc, mine[doc][0], value)
    a, b = _metrics(ours, "tiny_ppl"), _metrics(hf_results, "tiny_ppl")
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-5), key


@pytest.fixture(scope="module")
def lm_eval_vllm(model_paths):
    """lm-eval's own vllm backend on the same model and engine options as ``llama_lm``."""
    from genlm_vlm.evaluation.baseline import lm_eval_vllm_class

    opts = {k: v for k, v in ENGINE_OPTS.items() if k != "max_model_len"}
    model = lm_eval_vllm_class()(pretrained=model_paths["llama"], max_model_len=MAX_MODEL_LEN, block_size=32,
                                 enforce_eager=True, enable_prefix_caching=True, **{**opts, "kv_cache_memory_bytes": 64 << 20})
    yield model
    del model
    gc.collect()


def test_greedy_generation_equals_the_vllm_backend(ours, lm_eval_vllm, tasks_dir):
    theirs = _evaluate(lm_eval_vllm, tasks_dir, ["tiny_gen"])
    mine, other = _resps(ours, "tiny_gen"), _resps(theirs, "tiny_gen")
    assert mine == other
    texts = [t for v in mine.values() for t in v]
    assert any(texts) and len(set(texts)) > 1


def test_multiple_choice_also_equals_the_vllm_backend(ours, lm_eval_vllm, tasks_dir):
    theirs = _evaluate(lm_eval_vllm, tasks_dir, ["tiny_mc"])
    for doc, answers in _resps(theirs, "tiny_mc").items():
        for (ll, g), (ll2, g2) in zip(_resps(ours, "tiny_mc")[doc], answers, strict=True):
            assert abs(ll - ll2) < TOL and g == g2


def test_samples_keep_lm_evals_format_and_limit(llama_lm, tasks_dir):
    out = _evaluate(GenlmVLMEval(llama_lm), tasks_dir, ["tiny_mc"], limit=3)
    assert len(out["samples"]["tiny_mc"]) == 3
    sample = out["samples"]["tiny_mc"][0]
    assert {"doc_id", "arguments", "resps", "filtered_resps", "acc"} <= sample.keys()
    assert out["config"]["genlm_vlm_model"] == "AsyncVirtualLM"


def test_seeded_sampling_is_reproducible(llama_lm):
    model = GenlmVLMEval(llama_lm)
    kw = {"until": ["\n"], "max_gen_toks": 12, "do_sample": True, "temperature": 0.9, "seed": 5}
    reqs = [Instance("generate_until", {}, ("import os", dict(kw)), i) for i in range(3)]
    first, second = model.generate_until(reqs, disable_tqdm=True), model.generate_until(reqs, disable_tqdm=True)
    assert first == second


def test_requests_go_to_the_engine_together(llama_lm):
    """A call's requests are all submitted before any is waited for: the scoring queue sees
    them at once and a shared context's warm-up is shared (one warm-up for four choices)."""
    model = GenlmVLMEval(llama_lm)
    ctx = " ".join(["def function_name(argument):"] * 8)
    reqs = [Instance("loglikelihood", {}, (ctx, f" return {c}"), i) for i, c in enumerate("abcd")]
    before = dict(llama_lm.stats["scoring"])
    out = model.loglikelihood(reqs, disable_tqdm=True)
    after = llama_lm.stats["scoring"]
    assert len(out) == 4
    assert after["jobs"] - before["jobs"] == 4
    assert after["warmups"] - before["warmups"] == 1


def test_is_greedy_over_many_kv_blocks(llama_lm):
    """is_greedy from vLLM's top-1 of every prompt row of every segment and from the captured
    last row: a greedy continuation of 80 tokens (3 blocks) is greedy; one token changed (in the
    first segment, a middle one, the last position) is not."""
    model = GenlmVLMEval(llama_lm)
    ctx = llama_lm.tokenizer.encode("def main(argv):\n    return")
    cont = _wait(llama_lm.sample(ctx, max_tokens=80, eos_token_ids=[], temperature=0.0))
    assert len(cont) == 80
    items = [(ctx, list(cont))]
    for t in (0, 50, 79):
        bent = list(cont)
        bent[t] = 3 + (cont[t] - 3 + 1) % (len(llama_lm.tokenizer) - 3)
        items.append((ctx, bent))
    out = model._score(items, True, "", greedy=True)
    assert [g for _, g in out] == [True, False, False, False]
    for (c, x), (ll, _) in zip(items, out, strict=True):
        rows = llama_lm.batch_next_token_logprobs_sync([c + x[:t] for t in range(len(x))])
        assert ll == pytest.approx(float(rows.gather(1, torch.tensor(x)[:, None]).double().sum()), abs=TOL)


def test_rolling_windows_ask_for_no_top1(llama_lm, monkeypatch):
    """lm-eval reads no ``is_greedy`` from rolling windows: they go to the scoring path without
    the top-1 per position (``prompt_logprobs=0``: vLLM skips a top-k over every column), and the
    total is still the sum of the windows' rows."""
    model = GenlmVLMEval(llama_lm)
    asked: list[bool] = []
    real = llama_lm._score_futures

    def spy(items, method="auto", greedy=False):
        asked.append(greedy)
        return real(items, method, greedy=greedy)

    monkeypatch.setattr(llama_lm, "_score_futures", spy)
    text = _text_source()[:3000]
    (total,) = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    assert asked == [False]
    windows = _lm_eval_windows(model, text)
    assert len(windows) > 1
    want = 0.0
    for c, x in windows:
        rows = llama_lm.batch_next_token_logprobs_sync([list(c) + list(x[:t]) for t in range(len(x))])
        want += float(rows.gather(1, torch.tensor(x)[:, None]).double().sum())
    assert total == pytest.approx(want, abs=TOL * len(windows))


def test_chat_template_is_applied(model_paths, tasks_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_paths["llama"])
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    model = GenlmVLMEval(MockAsyncLM(tok, max_model_len=512))
    assert model.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi\n<assistant>"
    out = _evaluate(model, tasks_dir, ["tiny_gen"], limit=2, apply_chat_template=True)
    prompt = out["samples"]["tiny_gen"][0]["arguments"][0][0]
    assert prompt.startswith("<user>") and prompt.endswith("<assistant>")


# ---------------------------------------------------------------------------- the row path, errors
def _mock(**kw) -> MockAsyncLM:
    return MockAsyncLM(max_model_len=64, **kw)


def test_row_path_on_a_mock_equals_its_scores():
    lm = _mock()
    model = GenlmVLMEval(lm)
    reqs = [Instance("loglikelihood", {}, ("abc de", " fg"), 0), Instance("loglikelihood", {}, ("", "hello"), 1)]
    out = model.loglikelihood(reqs, disable_tqdm=True)
    ids = [model._encode_pair("abc de", " fg"), ([model.prefix_token_id], model.tok_encode("hello"))]
    for (ll, greedy), (ctx, cont) in zip(out, ids, strict=True):
        assert ll == pytest.approx(lm.score_sync(ctx, cont), abs=1e-5)
        rows = lm.batch_next_token_logprobs_sync([ctx + cont[:t] for t in range(len(cont))])
        assert greedy == bool((rows.argmax(1) == torch.tensor(cont)).all())
    text = "abc de fg " * 40  # rolling windows over a document longer than max_model_len
    (total,) = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    windows = _lm_eval_windows(model, text)
    assert len(windows) > 2 and all(len(c) + len(x) <= 64 for c, x in windows)
    assert total == pytest.approx(sum(lm.score_sync(c, x) for c, x in windows), abs=1e-3)


def test_bad_input_gets_clear_errors(model_paths, tmp_path):
    model = GenlmVLMEval(_mock())
    with pytest.raises(ValueError, match="continuation is empty"):
        model.loglikelihood([Instance("loglikelihood", {}, ("abc", ""), 0)])
    long = Instance("loglikelihood", {}, ("word " * 100, " end"), 0)
    with pytest.raises(ValueError, match=r"this model scores at most 64 .*truncation=True"):
        model.loglikelihood([long], disable_tqdm=True)
    with pytest.warns(UserWarning, match="cutting"):
        (ll, _), = GenlmVLMEval(_mock(), truncation=True).loglikelihood([long], disable_tqdm=True)
    assert ll < 0
    with pytest.raises(ValueError, match="max_gen_toks"):
        model.generate_until([Instance("generate_until", {}, ("word " * 40, {"max_gen_toks": 40}), 0)])
    with pytest.raises(ValueError, match="top_p=0.5 is not supported"):
        model.generate_until([Instance("generate_until", {}, ("abc", {"top_p": 0.5}), 0)])
    with pytest.raises(ValueError, match=r"unknown model_args for genlm_vlm: 'maxmodellen' \(did you mean 'max_model_len'\?\)"):
        GenlmVLMEval.create_from_arg_string(f"pretrained={model_paths['llama']},maxmodellen=64")
    with pytest.raises(FileNotFoundError, match="no such adapter folder"):
        GenlmVLMEval.create_from_arg_string(f"pretrained={model_paths['llama']},lora_local_path={tmp_path / 'nope'}")
    with pytest.raises(ValueError, match="for an existing model"):
        GenlmVLMEval(_mock(), dtype="float32")
    with pytest.raises(ValueError, match="needs a model"):
        GenlmVLMEval.create_from_arg_string("")
    with pytest.raises(ValueError, match="max_length must be"):
        GenlmVLMEval(_mock(), max_length=64)


# ---------------------------------------------------------------------------- command line
def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "genlm_vlm", "eval", *args], capture_output=True, text=True,
                          env=env, timeout=600, **kw)


def test_eval_command_runs_lm_evals_arguments(model_paths, tasks_dir, tmp_path):
    out = tmp_path / "out"
    args = f"pretrained={model_paths['llama']},dtype=float32,max_model_len=512,kv_cache_memory_bytes={64 << 20}"
    proc = _cli("--model_args", args, "--tasks", "tiny_mc", "--include_path", str(tasks_dir), "--limit", "3",
                "--log_samples", "--output_path", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "genlm_vlm" in proc.stdout and "tiny_mc" in proc.stdout
    results = list(out.rglob("results_*.json"))
    samples = list(out.rglob("samples_tiny_mc_*.jsonl"))
    assert len(results) == 1 and len(samples) == 1
    assert "acc,none" in json.loads(results[0].read_text())["results"]["tiny_mc"]
    assert len(samples[0].read_text().splitlines()) == 3


def test_eval_command_rejects_unknown_model_args_before_loading(model_paths, tasks_dir):
    proc = _cli("--model_args", f"pretrained={model_paths['llama']},maxmodellen=64", "--tasks", "tiny_mc",
                "--include_path", str(tasks_dir))
    assert proc.returncode != 0
    assert "did you mean 'max_model_len'" in proc.stderr
    assert _cli("--help").returncode == 0
