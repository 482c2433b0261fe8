"""gpu_check.py's verdicts and summary: tolerances (the bf16 noise-floor rule), the correctness
and benchmark tables, and the output files (a mixin of its ``Check``)."""

from __future__ import annotations

import json
import pathlib
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu.gpu_children import (  # noqa: E402
    compare_rows,
)
from benchmarks.gpu.gpu_models import (  # noqa: E402
    OUT_JSON,
    OUT_LOGS,
    OUT_SUMMARY,
)


class Report:
    """The summary side of ``gpu_check.Check`` (state: ``self.args``, ``self.state``, ...)."""

    def tolerance(self, dtype: str) -> tuple[float, float | None]:
        a = self.args
        if dtype == "float32":
            return a.tol_fp32, None
        return a.tol_bf16_max, a.tol_bf16_mean

    def correctness_rows(self, docs: Sequence[dict]) -> list[dict]:
        rows = []
        for doc in docs:
            res = doc.get("result") or {}
            scheds = res.get("scheds") or {}
            base = {
                "model": doc["model"],
                "dtype": doc["dtype"],
                "runner": doc["runner"],
                "eager": doc.get("eager"),
                "time": doc.get("time"),
            }
            tol_max, tol_mean = self.tolerance(doc["dtype"])
            if not scheds:
                rows.append(
                    base
                    | {
                        "sched": "-",
                        "verdict": "FAIL",
                        "reason": "subprocess failed",
                        "tol_max": tol_max,
                        "tol_mean": tol_mean,
                    }
                )
                continue
            for sched, r in scheds.items():
                row = base | {
                    "sched": sched,
                    "tol_max": tol_max,
                    "tol_mean": tol_mean,
                    "prompts": res.get("prompts"),
                    "engine_runner": r.get("engine_runner"),
                }
                for k in (
                    "max_abs",
                    "mean_abs",
                    "top1_agree",
                    "lse_max_abs",
                    "build_s",
                    "wall_s",
                    "capture_apply_calls",
                    "forks",
                ):
                    row[k] = r.get(k)
                row["vs_fp32"] = ((r.get("paths") or {}).get("sync") or {}).get("vs_fp32")
                reason, row["criterion"] = "", "abs"
                if "error" in r:
                    reason = r["error"]
                elif r.get("engine_runner") != doc["runner"]:
                    reason = f"runner {r.get('engine_runner')} != {doc['runner']}"
                elif not r.get("finite"):
                    reason = "non-finite rows"
                elif r["lse_max_abs"] > 1e-3:
                    reason = f"rows not normalised (|logsumexp| {r['lse_max_abs']:.2g})"
                elif r["max_abs"] > tol_max:
                    reason = f"max |d| {r['max_abs']:.3g} > {tol_max:g}"
                elif sched == "default" and (r.get("forks") or {}).get("enabled") and (
                    r["forks"]["copied"] + r["forks"]["aligned"] < 3
                ):
                    reason = f"forks enabled but the siblings did not share their parent's KV ({r['forks']})"
                elif tol_mean is not None and r["mean_abs"] > tol_mean:
                    reason = f"mean |d| {r['mean_abs']:.3g} > {tol_mean:g}"
                if reason.startswith(("max |d|", "mean |d|")) and doc["dtype"] == "bfloat16":
                    # bf16 rounding alone (HF bf16 vs HF fp32) may already exceed the absolute
                    # tolerance; a row within k x that floor is as good as bf16 gets.
                    k = self.args.bf16_floor_factor
                    fl = self.floor_for(doc.get("refs_key", ""))
                    row["floor"] = fl
                    if k > 0 and fl is not None:
                        if (
                            r["max_abs"] <= k * fl["max_abs"]
                            and r["mean_abs"] <= k * fl["mean_abs"]
                        ):
                            reason, row["criterion"] = "", f"{k:g}x floor"
                        else:
                            reason += (
                                f"; also above {k:g}x the bf16 noise floor (max "
                                f"{k * fl['max_abs']:.3g}, mean {k * fl['mean_abs']:.3g})"
                            )
                row["verdict"] = "FAIL" if reason else "PASS"
                row["reason"] = reason
                rows.append(row)
        return rows

    def floor_for(self, bf16_key: str) -> dict | None:
        """HF bf16 vs HF fp32 rows of one model / prompt set (None without both references)."""
        if "-bfloat16-" not in bf16_key:
            return None
        if bf16_key not in self._floors:
            f16 = self.state / "refs" / f"{bf16_key}.pt"
            f32 = self.state / "refs" / f"{bf16_key.replace('-bfloat16-', '-float32-')}.pt"
            if not (f16.is_file() and f32.is_file()):
                return None
            a = torch.load(f16, weights_only=False)
            b = torch.load(f32, weights_only=False)
            c = compare_rows(a["rows"], b["rows"])
            self._floors[bf16_key] = {
                "max_abs": c["max_abs"],
                "mean_abs": c["mean_abs"],
                "top1_agree": c["top1_agree"],
                "entropy_mean_fp32": b["meta"]["entropy_mean"],
                "log_vocab": b["meta"]["log_vocab"],
                "top_prob_mean_fp32": b["meta"]["top_prob_mean"],
            }
        return self._floors[bf16_key]

    def noise_floor(self) -> list[dict]:
        """HF bf16 vs HF fp32 on the same prompts: the size of bf16 rounding on each model."""
        out = []
        for f in sorted((self.state / "refs").glob("*-bfloat16-*.pt")):
            m = re.match(r"(.+)-[0-9a-f]{12}-bfloat16-[0-9a-f]{12}-(cpu|cuda)$", f.stem)
            fl = self.floor_for(f.stem) if m else None
            if fl is not None:
                out.append({"model": m.group(1), "device": m.group(2), "refs_key": f.stem} | fl)
        return out

    def bench_docs(self) -> list[dict]:
        docs = []
        for meta_file in sorted((self.state / "bench").glob("bench-*.meta.json")):
            meta = json.loads(meta_file.read_text())
            json_file = meta_file.with_name(meta_file.name.replace(".meta.json", ".json"))
            doc = (
                json.loads(json_file.read_text())
                if json_file.is_file() and meta["rc"] == 0
                else None
            )
            docs.append({"meta": meta, "doc": doc})
        return docs

    def summary(self) -> tuple[str, dict]:
        a = self.args
        docs = [
            json.loads(f.read_text()) for f in sorted((self.state / "correctness").glob("*.json"))
        ]
        rows = self.correctness_rows(docs)
        floor = self.noise_floor()
        bench = self.bench_docs()
        L: list[str] = []
        L.append(
            f"genlm_vlm gpu_check  started {self.started}  device {self.device}  "
            f"phase {a.phase}  models {' '.join(a.models)}  ({time.perf_counter() - self.t0:.0f}s so far)"
        )
        envs = [d["result"] for d in docs if d.get("result") and "vllm" in d["result"]]
        if envs:
            e = envs[-1]
            di = e.get("device_info", {})
            L.append(
                f"vLLM {e['vllm']} on {di.get('gpu', 'CPU')} (torch {di.get('torch')}"
                + (f", CUDA {di['torch_cuda']}" if di.get("torch_cuda") else "")
                + ")"
            )
        for kind, m in self.builds.items():
            if "params" in m:
                L.append(
                    f"model {kind}: {m['params'] / 1e9:.3f}B params, vocab {m['shape']['vocab_size']}, "
                    f"tokenizer {m['tokenizer_size']}, init logit std {m['logit_std']}, "
                    f"random-prompt row entropy {m['row_stats']['entropy_mean']:.2f} nats "
                    f"(uniform: {m['row_stats']['log_vocab']:.2f})"
                )
        L.append("")
        L.append("== correctness: genlm_vlm rows vs transformers forward of the same weights ==")
        L.append(
            "(max/mean |d| in nats over every prompt x vocab entry; worst of the sync batch, "
            "async gather, raw duplicate and forks paths; +cg = --compiled engines; "
            "* = earlier invocation)"
        )
        head = (
            f"{'model':<11} {'dtype':<9} {'runner':<6} {'sched':<8} {'prompts':>7} "
            f"{'max|d|':>9} {'mean|d|':>9} {'top1':>6} {'tolerance':<22} result"
        )
        L.append(head)
        L.append("-" * len(head))
        for r in rows:
            tol = f"max<={r['tol_max']:g}" + (
                f" mean<={r['tol_mean']:g}" if r["tol_mean"] is not None else ""
            )
            if r.get("criterion", "abs") != "abs":
                tol = r["criterion"]
            mark = (
                ""
                if f"correctness/{r['model']}-{r['dtype']}-{r['runner']}" in self.this_run
                else "*"
            )

            def f(x: Any, spec: str) -> str:
                return "-" if x is None else format(x, spec)

            sched = r["sched"] + ("+cg" if r.get("eager") is False else "")
            L.append(
                f"{r['model']:<11} {r['dtype']:<9} {r['runner']:<6} {sched:<8} "
                f"{f(r.get('prompts'), 'd'):>7} {f(r.get('max_abs'), '.2e'):>9} "
                f"{f(r.get('mean_abs'), '.2e'):>9} {f(r.get('top1_agree'), '.3f'):>6} "
                f"{tol:<22} {r['verdict']}{mark}"
                + (f"  ({r['reason']})" if r["reason"] else "")
                + (
                    f"  [vs HF fp32: max {r['vs_fp32']['max_abs']:.2e} mean "
                    f"{r['vs_fp32']['mean_abs']:.2e}]"
                    if r.get("vs_fp32")
                    else ""
                )
            )
        if not rows:
            L.append("(no correctness results yet)")
        agg: dict[tuple, dict] = {}
        for r in rows:
            k = (r["model"], r["dtype"], r["runner"])
            g = agg.setdefault(k, {"max": None, "ok": True})
            if r.get("max_abs") is not None:
                g["max"] = max(g["max"] or 0.0, r["max_abs"])
            g["ok"] &= r["verdict"] == "PASS"
        if agg:
            L.append("")
            L.append(
                "max |d| per (model, dtype, runner): "
                + "; ".join(
                    f"{m} {d} {rn}: {'-' if g['max'] is None else format(g['max'], '.2e')} "
                    f"{'PASS' if g['ok'] else 'FAIL'}"
                    for (m, d, rn), g in agg.items()
                )
            )
        for nf in floor:
            L.append(
                f"bf16 noise floor ({nf['model']}, {nf['device']}): HF bf16 vs HF fp32 max |d| "
                f"{nf['max_abs']:.2e}, mean |d| {nf['mean_abs']:.2e}, top1 {nf['top1_agree']:.3f}; "
                f"fp32 row entropy {nf['entropy_mean_fp32']:.2f} nats (uniform "
                f"{nf['log_vocab']:.2f}), mean top prob {nf['top_prob_mean_fp32']:.3f}"
            )
        L.append("")
        L.append("== benchmark: bench_async.py (rows/s, medians; ours = AsyncVirtualLM) ==")
        head = (
            f"{'model':<11} {'runner':<6} {'workload':<12} {'N':>5} {'ours':>10} {'generate':>10} "
            f"{'decode':>8} {'lp=-1':>8} {'ours/generate':>13} {'ours/decode':>11} {'ours/lp=-1':>10}"
        )
        L.append(head)
        L.append("-" * len(head))
        bench_rows = []
        for b in bench:
            meta, doc = b["meta"], b["doc"]
            mark = "" if f"bench/bench-{meta['model']}-{meta['runner']}" in self.this_run else "*"
            if doc is None:
                L.append(
                    f"{meta['model']:<11} {meta['runner']:<6} FAILED (exit {meta['rc']}){mark}"
                )
                continue
            by = {(r["workload"], r["n"], r["system"]): r["rows_per_s"] for r in doc["results"]}
            for ra in doc["ratios"]:
                w, n = ra["workload"], ra["n"]
                row = {
                    "model": meta["model"],
                    "runner": meta["runner"],
                    "workload": w,
                    "n": n,
                    "ours": by.get((w, n, "ours")),
                    "generate": by.get((w, n, "ceiling")),
                    "decode": by.get((w, n, "decode")),
                    "logprobs": by.get((w, n, "logprobs")),
                    "ours_over_generate": ra["ours_over_ceiling"],
                    "ours_over_decode": ra.get("ours_over_decode"),
                    "ours_over_logprobs": ra["ours_over_logprobs"],
                }
                bench_rows.append(row)

                def g(x: Any, spec: str, suffix: str = "") -> str:
                    return "-" if x is None else format(x, spec) + suffix

                L.append(
                    f"{row['model']:<11} {row['runner']:<6} {w:<12} {n:>5} {g(row['ours'], ',.0f'):>10} "
                    f"{g(row['generate'], ',.0f'):>10} {g(row['decode'], ',.0f'):>8} "
                    f"{g(row['logprobs'], ',.0f'):>8} {g(row['ours_over_generate'], '.2f', 'x'):>13} "
                    f"{g(row['ours_over_decode'], '.2f', 'x'):>11} "
                    f"{g(row['ours_over_logprobs'], '.1f', 'x'):>10}{mark}"
                )
        if not bench:
            L.append("(no benchmark results yet)")
        L.append("")
        if self.failures:
            L.append(f"FAILURES in this invocation ({len(self.failures)}):")
            L.extend(f"  - {x}" for x in self.failures)
        else:
            L.append("no failures in this invocation")
        text = "\n".join(L) + "\n"
        doc = {
            "started": self.started,
            "device": self.device,
            "args": vars(a),
            "wall_s": time.perf_counter() - self.t0,
            "builds": self.builds,
            "correctness": rows,
            "correctness_raw": docs,
            "noise_floor": floor,
            "bench": bench_rows,
            "bench_docs": bench,
            "failures": self.failures,
            "summary": text,
        }
        return text, doc

    def write_outputs(self) -> str:
        text, doc = self.summary()
        (self.out / OUT_SUMMARY).write_text(text)
        (self.out / OUT_JSON).write_text(json.dumps(doc, indent=2, default=str))
        logs = []
        for f in dict.fromkeys(self.failed_logs):
            if f.is_file():
                tail = f.read_text(errors="replace")[-60_000:]
                logs.append(f"===== {f.name} (last {len(tail)} chars) =====\n{tail}\n")
        (self.out / OUT_LOGS).write_text("".join(logs) or "no failed subprocesses\n")
        return text
