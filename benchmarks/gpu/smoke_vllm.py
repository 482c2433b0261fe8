"""End-to-end vLLM smoke test for the GPU host (after install_offline.sh).

    source /tmp/genlm_wheelhouse/env.sh
    python benchmarks/gpu/smoke_vllm.py --model /path/to/local/model

Loads the model with `vllm.LLM`, generates a few tokens with logprobs and
prints them. Exits non-zero on any failure. The model must already be on the
host (HF_HUB_OFFLINE=1 is set by env.sh).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local model folder or cached HF id")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--logprobs", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--compile", action="store_true", help="allow torch.compile / CUDA graphs")
    args = p.parse_args()

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    print(f"vllm {vllm.__version__} imported in {time.perf_counter() - t0:.1f}s", flush=True)
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=not args.compile,
    )
    print(f"engine up in {time.perf_counter() - t0:.1f}s", flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=args.logprobs)
    out = llm.generate([args.prompt], params)[0].outputs[0]
    print(f"text: {out.text!r}")
    for step, lp in enumerate(out.logprobs or []):
        top = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[: args.logprobs]
        shown = ", ".join(f"{kv[1].decoded_token!r}:{kv[1].logprob:.3f}" for kv in top)
        print(f"  step {step}: {shown}")
    ok = bool(out.token_ids) and out.logprobs is not None
    print("SMOKE OK" if ok else "SMOKE FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
