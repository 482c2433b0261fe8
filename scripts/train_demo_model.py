"""Train the small demo model shipped in ``genlm_vlm/data/demo-model/``.

The corpus is English prose every Python installation has: the docstrings of the standard
library (module, class and function docstrings of every ``.py`` file under
``sysconfig.get_paths()["stdlib"]``, excluding tests and ``site-packages``), normalised to
lowercase ASCII letters, spaces and a little punctuation, one paragraph per document.

A byte-level BPE tokenizer (``tokenizers``) is trained on it, then a small Llama-architecture
causal LM is trained with AdamW on CPU for a wall-clock budget. The result is saved in float16
safetensors (a few MB) together with the tokenizer and a ``TRAINING.md`` describing the run.

Usage::

    python scripts/train_demo_model.py            # ~8 minutes, writes genlm_vlm/data/demo-model
    python scripts/train_demo_model.py --minutes 2 --out /tmp/demo-model
"""

from __future__ import annotations

import argparse
import ast
import math
import pathlib
import platform
import random
import re
import shutil
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "genlm_vlm" / "data" / "demo-model"

BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

#: Directory names skipped when walking the stdlib (test suites are mostly code, not prose).
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
)

_NOT_KEPT = re.compile(r"[^a-z .,']+")
_SPACES = re.compile(r" +")
_SPACE_BEFORE_PUNCT = re.compile(r" ([.,])")
_REPEATED_PUNCT = re.compile(r"([.,'])[.,']+")


# ---------------------------------------------------------------------------------------- corpus
def stdlib_docstrings() -> list[str]:
    """Every module/class/function docstring of the stdlib, in a deterministic order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    docs: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old sources
        for path in files:
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(
                    node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
                ):
                    doc = ast.get_docstring(node)
                    if doc:
                        docs.append(doc)
    return docs


def _is_prose(paragraph: str) -> bool:
    """Heuristic: mostly letters and spaces, no doctest, no code-ish lines."""
    if ">>>" in paragraph or "::" in paragraph or len(paragraph) < 40:
        return False
    plain = sum(c.isalpha() or c == " " for c in paragraph)
    return plain / len(paragraph) >= 0.9


def normalise(paragraph: str) -> str:
    """Lowercase ASCII letters, single spaces and ``. , '`` only."""
    text = " ".join(paragraph.split()).lower()
    text = _NOT_KEPT.sub(" ", text)
    text = _REPEATED_PUNCT.sub(r"\1", text)
    text = _SPACES.sub(" ", text)
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    return text.strip(" ,'")


def build_corpus() -> list[str]:
    """Prose paragraphs of the stdlib docstrings, normalised, deduplicated, in a fixed order."""
    seen: set[str] = set()
    out: list[str] = []
    for doc in stdlib_docstrings():
        for para in re.split(r"\n\s*\n", doc):
            if not _is_prose(para):
                continue
            text = normalise(para)
            if len(text) >= 40 and sum(c.isalpha() for c in text) >= 30 and text not in seen:
                seen.add(text)
                out.append(text)
    return out


# ------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(corpus: list[str], vocab_size: int) -> Any:
    """Byte-level BPE with ``<s>``=0, ``</s>``=1, ``<pad>``=2; a ``PreTrainedTokenizerFast``."""
    from genlm_vlm.testing import train_byte_level_bpe

    return train_byte_level_bpe(corpus, vocab_size)


def token_stream(tokenizer: Any, corpus: list[str]) -> torch.Tensor:
    """All paragraphs as ``<s> text </s>``, concatenated into one long id tensor."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(corpus, add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------- model
def make_model(vocab_size: int, args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.hidden % args.heads or args.hidden // args.heads < 64:
        raise SystemExit(
            "head_dim (hidden / heads) must be an integer >= 64 for vLLM's CPU attention"
        )
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    return model.to(torch.float32)


def batches(
    stream: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator
) -> Iterator[torch.Tensor]:
    """Endless random windows of ``seq_len + 1`` tokens, ``batch`` at a time."""
    high = stream.numel() - seq_len - 1
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, high, (batch,), generator=gen)
        yield stream[starts[:, None] + offsets[None, :]]


def lr_at(progress: float, step: int, peak: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% over the time budget."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def eval_loss(
    model: torch.nn.Module, stream: torch.Tensor, seq_len: int, n_batches: int = 4
) -> float:
    """Mean loss over fixed windows of the held-out stream."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    it = batches(stream, seq_len, 32, gen)
    losses = []
    for _ in range(n_batches):
        x = next(it)
        losses.append(float(_loss(model, x)))
    model.train()
    return sum(losses) / len(losses)


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1)
    )


@torch.no_grad()
def sample_text(
    model: torch.nn.Module, tokenizer: Any, prompt: str, n_tokens: int, seed: int
) -> str:
    """A short ancestral sample (temperature 1) for the log."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = [BOS_ID, *tokenizer.encode(prompt, add_special_tokens=False)]
    for _ in range(n_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if nxt == EOS_ID:
            break
        ids.append(nxt)
    model.train()
    return tokenizer.decode(ids[1:])


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=pathlib.Path, default=DEFAULT_OUT, help="output directory (replaced)"
    )
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (on a busy 2-core machine, 1 thread is several times faster than 2)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vocab", type=int, default=1536, help="BPE vocabulary size (incl. special tokens)"
    )
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument(
        "--dtype", choices=("float16", "bfloat16"), default="float16", help="saved weight dtype"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t0 = time.perf_counter()

    corpus = build_corpus()
    n_chars = sum(len(t) for t in corpus)
    print(
        f"corpus: {len(corpus)} paragraphs, {n_chars:,} characters ({time.perf_counter() - t0:.1f}s)",
        flush=True,
    )
    tokenizer = train_tokenizer(corpus, args.vocab)
    vocab_size = len(tokenizer)
    # Hold out every 50th paragraph for a validation loss.
    train_docs = [t for i, t in enumerate(corpus) if i % 50]
    valid_docs = [t for i, t in enumerate(corpus) if not i % 50]
    train_stream = token_stream(tokenizer, train_docs)
    valid_stream = token_stream(tokenizer, valid_docs)
    print(
        f"tokenizer: {vocab_size} tokens; train {train_stream.numel():,} tokens, valid {valid_stream.numel():,}",
        flush=True,
    )

    model = make_model(vocab_size, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_stream, args.seq_len, args.batch, gen)
    model.train()

    budget = args.minutes * 60.0
    t_train = time.perf_counter()
    step, ema = 0, None
    while True:
        elapsed = time.perf_counter() - t_train
        if elapsed >= budget:
            break
        lr = lr_at(elapsed / budget, step, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = _loss(model, next(data))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        value = loss.item()
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        if step % 50 == 0 or step == 1:
            print(
                f"step {step:5d}  {elapsed:6.0f}s  lr {lr:.2e}  loss {value:.3f}  ema {ema:.3f}",
                flush=True,
            )
    train_seconds = time.perf_counter() - t_train
    final_train = eval_loss(model, train_stream, args.seq_len)
    final_valid = eval_loss(model, valid_stream, args.seq_len)
    print(
        f"done: {step} steps in {train_seconds:.0f}s; train loss {final_train:.3f}, valid loss {final_valid:.3f}",
        flush=True,
    )
    samples = [
        sample_text(model, tokenizer, prompt, 30, args.seed + i)
        for i, prompt in enumerate(("the", "this function", "return a"))
    ]
    for s in samples:
        print("sample:", s, flush=True)

    dtype = getattr(torch, args.dtype)
    model = model.to(dtype).eval()
    model.config.dtype = dtype
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    gen_cfg = args.out / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()  # nothing in it the demo needs
    command = "python scripts/train_demo_model.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    (args.out / "TRAINING.md").write_text(
        training_md(
            args,
            len(corpus),
            n_chars,
            vocab_size,
            train_stream.numel(),
            n_params,
            step,
            train_seconds,
            final_train,
            final_valid,
            samples,
            command.strip(),
        ),
        encoding="utf-8",
    )
    total = sum(f.stat().st_size for f in args.out.iterdir())
    print(
        f"saved to {args.out} ({total / 1e6:.2f} MB); total time {time.perf_counter() - t0:.0f}s",
        flush=True,
    )
    return 0


def training_md(
    args: argparse.Namespace,
    n_docs: int,
    n_chars: int,
    vocab_size: int,
    n_tokens: int,
    n_params: int,
    steps: int,
    seconds: float,
    train_loss: float,
    valid_loss: float,
    samples: list[str],
    command: str,
) -> str:
    tokens_seen = steps * args.batch * args.seq_len
    lines = [
        "# genlm_vlm demo model",
        "",
        "A deliberately tiny Llama-architecture language model, trained on CPU in minutes, so that",
        "`python -m genlm_vlm demo` works on any machine without downloading anything. It writes",
        "English-looking text; it is not a useful language model.",
        "",
        "## Corpus",
        "",
        "Docstrings of the Python standard library (module, class and function docstrings of every",
        f'`.py` file under `sysconfig.get_paths()["stdlib"]` of Python {platform.python_version()},',
        "excluding test suites, `idlelib` and `site-packages`), split into paragraphs; paragraphs",
        "that look like code or doctests are dropped, the rest lowercased and reduced to ASCII",
        "letters, spaces and `. , '`, then deduplicated.",
        f"{n_docs:,} paragraphs, {n_chars:,} characters, {n_tokens:,} training tokens",
        "(every 50th paragraph held out for validation). Each paragraph is `<s> text </s>`.",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (`tokenizers`), {vocab_size} tokens; `<s>`=0 (bos), `</s>`=1 (eos),",
        "`<pad>`=2. Encoding does not add special tokens.",
        "",
        "## Model",
        "",
        f"`LlamaForCausalLM`: {args.layers} layers, hidden {args.hidden}, {args.heads} heads of",
        f"dim {args.hidden // args.heads}, MLP {args.intermediate}, {args.max_positions} positions,",
        f"tied embeddings; {n_params:,} parameters, saved in {args.dtype}.",
        "",
        "## Training",
        "",
        f"AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak lr {args.lr}, {args.warmup}",
        "warm-up steps then cosine decay to 10% over the wall-clock budget; gradient clipping 1.0;",
        f"random windows of {args.seq_len} tokens, batch {args.batch}; seed {args.seed};",
        f"`torch.set_num_threads({args.threads})`, torch {torch.__version__}, on CPU.",
        "",
        f"* steps: {steps} ({tokens_seen:,} tokens, {tokens_seen / max(n_tokens, 1):.1f} epochs)",
        f"* wall time: {seconds / 60:.1f} minutes (budget {args.minutes:g})",
        f"* final loss (nats/token, float32, 4 x 32 windows): train {train_loss:.3f}, validation {valid_loss:.3f}",
        "",
        "Samples (temperature 1, from the float32 weights before saving):",
        "",
        *[f"* `{s}`" for s in samples],
        "",
        "## Reproduce",
        "",
        "```",
        command,
        "```",
        "",
        "The number of steps depends on the machine's speed (the budget is wall-clock time), so",
        "the weights are not bit-for-bit reproducible across machines.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
