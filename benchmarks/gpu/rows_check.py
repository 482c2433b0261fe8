"""The correctness half of the GPU check: genlm_vlm's rows against a transformers float32 forward.

Builds ``AsyncVirtualLM.from_name(model, {"dtype": DTYPE, ...})`` on whatever device vLLM runs on,
asks for the next-token rows of ``--prompts`` random prompts (all at once: they are batched), and
compares each with transformers' float32 ``log_softmax`` on the CPU (one prompt at a time, no
padding). A row passes when its largest absolute difference over the tokens with probability above
``1e-6`` is within ``--atol`` and the argmax agrees. Writes ``DIR/rows_check.json`` and
``DIR/rows_check.txt`` and exits 1 when a row fails. Run from the repository root::

    python benchmarks/gpu/rows_check.py --model-shape qwen3-0.6b --out DIR            # float32
    python benchmarks/gpu/rows_check.py --model-shape qwen3-0.6b --dtype bfloat16 --atol 0.25 --out DIR
    python benchmarks/gpu/rows_check.py --out DIR --prompts 8                         # the demo model, CPU

The runner is vLLM's choice (``VLLM_USE_V2_MODEL_RUNNER=0|1`` to pick one).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model folder (default: the shipped demo model)")
    ap.add_argument("--model-shape", help="a shape of `python -m genlm_vlm bench --model-shape`")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=200, help="longest prompt (tokens)")
    ap.add_argument("--atol", type=float, default=2e-3)
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (no CUDA graphs)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from genlm_vlm import AsyncVirtualLM, demo_model_path
    from genlm_vlm.bench.cli import SHAPES
    from genlm_vlm.bench.systems import machine_info
    from genlm_vlm.testing import hf_reference_logprobs, random_prompts, tiny_model_path

    model = str(tiny_model_path(SHAPES[args.model_shape])) if args.model_shape else args.model or demo_model_path()
    config = json.loads((pathlib.Path(model) / "config.json").read_text())
    max_len = min(args.max_len, int(config.get("max_position_embeddings", 512)) - 1)
    opts = {"dtype": args.dtype, "max_model_len": max_len + 1, "seed": 0}
    if args.eager:
        opts["enforce_eager"] = True
    t0 = time.perf_counter()
    lm = AsyncVirtualLM.from_name(model, opts)
    prompts = random_prompts(args.prompts, min(lm.vocab_size, len(lm.tokenizer)), 4, max_len, seed=0)
    try:
        rows = lm.batch_next_token_logprobs_sync(prompts).cpu()
        info = machine_info(lm.llm)
    finally:
        lm.cleanup()
    engine_s = time.perf_counter() - t0
    refs = hf_reference_logprobs(model, prompts)
    report = []
    for i, (row, ref) in enumerate(zip(rows, refs, strict=True)):
        mass = ref.exp() > 1e-6
        diff = (row.float() - ref)[mass].abs().max().item()
        top = int(row.argmax()) == int(ref.argmax())
        report.append({"prompt": i, "len": len(prompts[i]), "max_abs_diff": diff, "argmax_agrees": top,
                       "ok": diff <= args.atol and top})
    failed = [r for r in report if not r["ok"]]
    worst = max(r["max_abs_diff"] for r in report)
    doc = {"model": model, "engine_opts": opts, "info": info, "atol": args.atol, "prompts": len(prompts),
           "engine_s": engine_s, "worst_max_abs_diff": worst, "failed": len(failed), "rows": report}
    (out / "rows_check.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    verdict = "PASS" if not failed else f"FAIL ({len(failed)} of {len(report)} rows)"
    line = (f"rows_check {verdict}: {len(report)} rows, worst |diff| {worst:.3g} (atol {args.atol}), "
            f"dtype {info['dtype']}, runner {info['runner']}, "
            f"{'CUDA graphs' if info['cuda_graphs'] else 'eager'}, {info['device']}, vLLM {info['vllm']}, "
            f"torch {torch.__version__}")
    (out / "rows_check.txt").write_text(line + "\n")
    print(line, flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
