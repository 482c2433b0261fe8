#!/usr/bin/env python
"""Peak memory of the README's example on the shipped demo model, in a fresh process.

Runs the ``## Example`` block of README.md with the model name replaced by
``genlm_vlm.demo_model_path()`` and prints the KV cache genlm_vlm reserved
(``engine_info.kv_cache_bytes`` / ``kv_cache_tokens``) and the process's peak resident memory
(``ru_maxrss``), with PASS/FAIL against the target (under 2 GB)::

    .venv/bin/python benchmarks/bench_footprint.py
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGET_BYTES = 2 * 2**30

#: The README's example, run on the shipped model; prints the reservation and the peak RSS.
SNIPPET = r"""
import json, pathlib, re, resource
import genlm_vlm
text = pathlib.Path("README.md").read_text()
code = re.search(r"## Example\n\n```python\n(.*?)```", text, re.S).group(1)
assert '"Qwen/Qwen3-0.6B"' in code
code = code.replace('"Qwen/Qwen3-0.6B"', "genlm_vlm.demo_model_path()")
code = code.replace("lm.cleanup()", "INFO = lm.engine_info\nlm.cleanup()")
scope = {"genlm_vlm": genlm_vlm}
exec(compile(code, "README example", "exec"), scope)
info = scope["INFO"]
print(json.dumps({"kv_bytes": info.kv_cache_bytes, "kv_tokens": info.kv_cache_tokens,
                  "max_num_seqs": info.max_num_seqs, "max_model_len": info.max_model_len,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run_example() -> dict:
    """Run the README example in a fresh interpreter; its JSON summary."""
    proc = subprocess.run([sys.executable, "-c", SNIPPET], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the README example failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    got = run_example()
    verdict = "PASS" if got["peak_rss"] < TARGET_BYTES else "FAIL"
    print(f"KV cache reserved: {got['kv_bytes'] / 2**20:.0f} MiB ({got['kv_tokens']} tokens; "
          f"max_num_seqs {got['max_num_seqs']} x max_model_len {got['max_model_len']})")
    print(f"peak RSS: {got['peak_rss'] / 2**30:.2f} GiB (target < {TARGET_BYTES / 2**30:.0f} GiB): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
