#!/usr/bin/env python
"""GPU check of the SMC controller step (issue 36): ``genlm_vlm.smc.step.propose`` on CUDA rows.

Needs torch only (xgrammar optional: its ``apply_token_bitmask_inplace`` kernel is used when it
imports, else an equal torch op); not vLLM, not transformers. Run from the repository root::

    python benchmarks/gpu/controller_check.py --device cuda --out DIR
    python benchmarks/gpu/controller_check.py --device cpu --out DIR --width 4096 --ms 4 8 --reps 3   # smoke

For each ``m`` (default 16, 64, 256) and mask kind (``dense``: ~90 % of the tokens allowed,
``mid``: ~10 %, ``sparse``: 50 tokens per row; row 0 of every cell allows nothing and must die),
on rows ``[m, width]`` (normalised ``log_softmax`` of random logits, made on the device; columns at
or past ``--vocab``, the tokenizer's real vocabulary, are padding and hold +10 so that a step
reading them would show), it records:

* ``step_ms``: the median (and min) over ``--reps`` of one step, CUDA-synchronised: the bitmasks
  (filled on the host) go to the device, ``propose`` runs, ``m`` tokens and ``m`` increments come
  back (the rows are cloned before each rep, outside the timing: the step writes into them);
* bytes crossing per step, to the device (bitmasks and uniforms) and to the host;
* the mask kernel (``xgrammar`` or ``torch``, with the reason xgrammar was not used) and the path
  (``dense`` / ``gather``);
* ``cpu``: the same step on the CPU on the same rows, bitmasks and uniforms: tokens that differ
  (``token_mismatch``; ``token_mismatch_not_tie``: those whose inverse-CDF target is not within
  1e-9 of the mass boundary between the two tokens) and the largest relative difference of the
  increments (``max_rel_err``; the check asks <= 1e-5);
* ``step_ms_torch_kernel`` (dense path): the same step with the torch op for the masks, and
  whether its result is bitwise the same (``torch_kernel_identical``);
* ``repeat_identical``: two device steps on the same inputs give bitwise the same result
  (torch does not promise it for a floating-point ``cumsum`` on CUDA);
* ``host_path_ms``: the old controller's path (before issue 36): rows ``.cpu()`` and the numpy
  float64 step on the host (bool masks given), median of ``--host-reps``.

Every cell catches its own errors (recorded under ``error``) and ``DIR/controller_check.json`` is
rewritten after each cell, so a killed run leaves what it measured. A summary table goes to
stdout. Exit status 1 if a comparison fails or a cell raised.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
import traceback
import types
from typing import Any

import numpy as np
import torch

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
KINDS = ("dense", "mid", "sparse")
SPARSE_TOKENS = 50
TIE_TOL = 1e-9
REL_TOL = 1e-5


def load_step() -> tuple[Any, str]:
    """``genlm_vlm.smc.step`` from this checkout: imported as a package module where the package
    imports, else loaded from its file alone (it needs torch and numpy only)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import genlm_vlm.smc.step as step

        return step, "genlm_vlm.smc.step"
    except Exception as e:  # noqa: BLE001 - e.g. a dependency of the package missing on this host
        path = ROOT / "genlm_vlm" / "smc" / "step.py"
        # a bare package around smc/ (not genlm_vlm's __init__): step.py imports step_cpu relatively
        pkg = types.ModuleType("genlm_vlm_smc")
        pkg.__path__ = [str(path.parent)]
        sys.modules[pkg.__name__] = pkg
        spec = importlib.util.spec_from_file_location("genlm_vlm_smc.step", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod, f"{path} (package import failed: {e!r})"


# ----------------------------------------------------------------------------- inputs
def make_masks(kind: str, m: int, vocab: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """Bool ``[m, width]``; columns >= vocab never allowed; row 0 allows nothing (dies)."""
    mask = np.zeros((m, width), dtype=bool)
    if kind == "dense":
        mask[:, :vocab] = rng.random((m, vocab)) < 0.9
    elif kind == "mid":
        mask[:, :vocab] = rng.random((m, vocab)) < 0.1
    elif kind == "sparse":
        for k in range(m):
            mask[k, rng.choice(vocab, SPARSE_TOKENS, replace=False)] = True
    else:
        raise ValueError(kind)
    mask[0] = False
    return mask


def make_rows(m: int, vocab: int, width: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn((m, vocab), generator=g, device=device) * 2.0
    rows = torch.full((m, width), 10.0, device=device)  # padding columns: huge, never to be drawn
    rows[:, :vocab] = torch.log_softmax(logits, dim=1)
    return rows


# ----------------------------------------------------------------------------- the old host path
def old_host_step(values: np.ndarray, masks: np.ndarray, u: np.ndarray, t: float) -> list[tuple[int, float]]:
    """The numpy float64 step the controller ran on the host before issue 36 (per row over its
    allowed tokens, as its path for large ``m x V``); ``u`` one uniform per row."""
    out = []
    for k in range(values.shape[0]):
        allowed = np.flatnonzero(masks[k])
        vals = values[k, allowed].astype(np.float64)
        top = float(vals.max()) if vals.size else -math.inf
        if not math.isfinite(top):
            out.append((-1, -math.inf))
            continue
        z, ztop = (vals, top) if t == 1.0 else (vals / t, top / t)
        cdf = np.cumsum(np.exp(z - ztop))
        total = float(cdf[-1])
        j = min(int(np.searchsorted(cdf, u[k] * total, side="right")), len(cdf) - 1)
        incr = ztop + math.log(total) if t == 1.0 else float(vals[j]) - (float(z[j]) - ztop - math.log(total))
        out.append((int(allowed[j]), incr))
    return out


def is_tie(row: np.ndarray, mask: np.ndarray, u: float, a: int, b: int, t: float) -> bool:
    """Whether the inverse-CDF target of ``row`` lies within round-off of the mass boundary
    between tokens ``a`` and ``b`` (then either draw is right)."""
    allowed = np.flatnonzero(mask)
    vals = row[allowed].astype(np.float64) / t
    cdf = np.cumsum(np.exp(vals - vals.max()))
    tot = float(cdf[-1])
    i = int(np.searchsorted(allowed, min(a, b)))
    return abs(float(cdf[i]) - u * tot) <= TIE_TOL * tot


# ----------------------------------------------------------------------------- one cell
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_cell(step: Any, device: torch.device, m: int, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed + 1000 * m + KINDS.index(kind))
    width, vocab, t = args.width, args.vocab, args.temperature
    cell: dict[str, Any] = {"m": m, "kind": kind, "width": width, "vocab": vocab, "temperature": t}
    masks = make_masks(kind, m, vocab, width, rng)
    cell["allowed_per_row_mean"] = float(masks.sum(1).mean())
    bits = step.pack(torch.from_numpy(masks))
    if device.type == "cuda":
        bits = bits.pin_memory()
    u = rng.random(m)
    rows = make_rows(m, vocab, width, device, args.seed + m)
    counts = step.popcounts(bits)
    cell["path"] = step.choose_path(counts, vocab, device, t)
    cell["bytes_to_device"] = int(bits[:, : step.words(vocab)].numel() * 4 + m * 8)
    cell["bytes_to_host"] = 16 * m

    def once() -> tuple[list[int], np.ndarray]:
        return step.to_host(*step.propose(work, bits, u, t, width=vocab, kernel=args.kernel))

    times = []
    for r in range(args.warmup + args.reps):
        work = rows.clone()
        sync(device)
        t0 = time.perf_counter()
        tokens, incr = once()
        sync(device)
        if r >= args.warmup:
            times.append(time.perf_counter() - t0)
    cell["step_ms"] = round(1000 * statistics.median(times), 4)
    cell["step_ms_min"] = round(1000 * min(times), 4)
    cell["mask_kernel"] = (f"none ({cell['path']} path)" if cell["path"] != "dense"
                           else "torch" if args.kernel == "torch" and device.type != "cpu" else step.mask_kernel(device, t))
    why = step.mask_kernel_error(device)
    if why:
        cell["mask_kernel_note"] = why
    cell["dead_row_died"] = bool(tokens[0] == -1 and incr[0] == -math.inf)
    cell["padding_never_drawn"] = bool(all(tok < vocab for tok in tokens))
    if cell["path"] == "dense" and args.kernel != "torch":  # the torch op instead: time, and the same bytes?
        tt = []
        for r in range(args.warmup + max(1, args.reps // 2)):
            work = rows.clone()
            sync(device)
            t0 = time.perf_counter()
            ttok, tinc = step.to_host(*step.propose(work, bits, u, t, width=vocab, kernel="torch"))
            sync(device)
            if r >= args.warmup:
                tt.append(time.perf_counter() - t0)
        cell["step_ms_torch_kernel"] = round(1000 * statistics.median(tt), 4)
        cell["torch_kernel_identical"] = bool(ttok == tokens and tinc.tobytes() == incr.tobytes())
    # the same inputs again: bitwise the same?
    work = rows.clone()
    tokens2, incr2 = once()
    cell["repeat_identical"] = bool(tokens2 == tokens and incr2.tobytes() == incr.tobytes())
    # the CPU on the same rows, bitmasks and uniforms
    rows_cpu = rows.cpu()
    values = rows_cpu.numpy().copy()
    if device.type != "cpu":
        t0 = time.perf_counter()
        ctok, cinc = step.to_host(*step.propose(rows_cpu.clone(), bits, u, t, width=vocab, kernel=args.kernel))
        cell["cpu_step_ms"] = round(1000 * (time.perf_counter() - t0), 3)
    else:
        ctok, cinc = step.to_host(*step.propose(rows_cpu.clone(), bits, u, t, width=vocab, path=(
            "dense" if cell["path"] == "gather" else "gather")))
        cell["cpu_compared_path"] = "the other path"
    mism = [k for k in range(m) if ctok[k] != tokens[k]]
    cell["token_mismatch"] = len(mism)
    cell["token_mismatch_not_tie"] = sum(
        not is_tie(values[k], masks[k], float(u[k]), ctok[k], tokens[k], t) for k in mism if ctok[k] >= 0 and tokens[k] >= 0
    ) + sum(1 for k in mism if min(ctok[k], tokens[k]) < 0)
    fin = [k for k in range(m) if math.isfinite(incr[k]) or math.isfinite(cinc[k])]
    both = [k for k in fin if math.isfinite(incr[k]) and math.isfinite(cinc[k]) and k not in mism]
    cell["finite_mismatch"] = len(fin) - len([k for k in fin if math.isfinite(incr[k]) and math.isfinite(cinc[k])])
    cell["max_rel_err"] = float(max((abs(incr[k] - cinc[k]) / max(abs(cinc[k]), 1e-12) for k in both), default=0.0))
    cell["max_abs_err"] = float(max((abs(incr[k] - cinc[k]) for k in both), default=0.0))
    # the old host path: rows to the host, numpy step
    host_times = []
    for _ in range(args.host_reps):
        sync(device)
        t0 = time.perf_counter()
        vals = rows.cpu().numpy()
        old = old_host_step(vals, masks, u, t)
        host_times.append(time.perf_counter() - t0)
    cell["host_path_ms"] = round(1000 * statistics.median(host_times), 3) if host_times else None
    cell["host_path_bytes_to_host"] = m * width * 4
    if host_times:
        cell["host_path_token_mismatch"] = sum(old[k][0] != tokens[k] for k in range(m))
    cell["ok"] = bool(cell["dead_row_died"] and cell["padding_never_drawn"] and cell["token_mismatch_not_tie"] == 0
                      and cell["finite_mismatch"] == 0 and cell["max_rel_err"] <= REL_TOL
                      and cell.get("torch_kernel_identical", True))
    return cell


# ----------------------------------------------------------------------------- main
def _jsonable(o: Any) -> Any:
    return o.item() if hasattr(o, "item") else str(o)


def write_json(out: pathlib.Path, result: dict[str, Any]) -> None:
    """Rewrite ``out/controller_check.json`` (never raises: a failed write is printed)."""
    try:
        (out / "controller_check.json").write_text(json.dumps(result, indent=1, default=_jsonable))
    except Exception as e:  # noqa: BLE001
        print(f"controller_check: could not write the JSON: {e!r}", flush=True)


def environment(device: torch.device, how: str, kernel: str) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "step_module": how,
                           "device": str(device), "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    if kernel == "torch":
        env["xgrammar"] = "not used (--kernel torch)"
        return env
    try:
        import xgrammar

        env["xgrammar"] = getattr(xgrammar, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        env["xgrammar"] = f"not importable: {e!r}"
    return env


def summary(result: dict[str, Any]) -> str:
    head = (f"{'m':>4} {'kind':>6} {'path':>6} {'kernel':>9} {'step ms':>8} {'host ms':>8} {'to dev B':>9} "
            f"{'to host B':>9} {'mism':>4} {'!tie':>4} {'max rel':>9} {'rep=':>4} ok")
    lines = [head]
    for c in result["cells"]:
        if "error" in c:
            lines.append(f"{c['m']:>4} {c['kind']:>6} ERROR {c['error'][:100]}")
            continue
        kern = c["mask_kernel"].split(" ")[0]
        lines.append(
            f"{c['m']:>4} {c['kind']:>6} {c['path']:>6} {kern:>9} {c['step_ms']:>8.3f} "
            f"{(c['host_path_ms'] or float('nan')):>8.1f} {c['bytes_to_device']:>9} {c['bytes_to_host']:>9} "
            f"{c['token_mismatch']:>4} {c['token_mismatch_not_tie']:>4} {c['max_rel_err']:>9.2e} "
            f"{'y' if c['repeat_identical'] else 'n':>4} {'yes' if c['ok'] else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--width", type=int, default=151936, help="row width (the model's logit columns)")
    p.add_argument("--vocab", type=int, default=None, help="the tokenizer's real vocabulary (default 151646, capped "
                                                            "at width); columns past it are padding")
    p.add_argument("--ms", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--host-reps", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", choices=["auto", "torch"], default="auto",
                   help="the dense path's mask kernel: auto (xgrammar's where it imports) or torch (never import xgrammar)")
    p.add_argument("--budget-s", type=float, default=150.0, help="skip the old host path's timing past this")
    args = p.parse_args(argv)
    if args.vocab is None:
        args.vocab = min(151646, args.width) if args.width >= 151646 else args.width - min(args.width // 64, 290)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result: dict[str, Any] = {"args": vars(args), "cells": []}
    status = 0
    try:
        device = torch.device(args.device)
        step, how = load_step()
        result["environment"] = environment(device, how, args.kernel)
    except Exception as e:  # noqa: BLE001 - record and stop: nothing can run
        result["error"] = traceback.format_exc()
        write_json(out, result)
        print(f"controller_check: setup failed: {e!r}", flush=True)
        return 1
    for m in args.ms:
        for kind in args.kinds:
            host_reps = args.host_reps
            if time.perf_counter() - start > args.budget_s:
                args.host_reps = 0
            try:
                cell = run_cell(step, device, m, kind, args)
            except Exception as e:  # noqa: BLE001 - one cell's failure is recorded; the rest still run
                cell = {"m": m, "kind": kind, "error": f"{e!r}", "traceback": traceback.format_exc()}
                status = 1
            args.host_reps = host_reps
            if not cell.get("ok", False):
                status = 1
            cell["elapsed_s"] = round(time.perf_counter() - start, 2)
            result["cells"].append(cell)
            write_json(out, result)
            print(f"[{cell['elapsed_s']:7.1f}s] m={m} {kind}: "
                  + (cell.get("error") or f"{cell['step_ms']:.3f} ms/step ({cell['path']}, {cell['mask_kernel']}), "
                     f"host path {cell['host_path_ms']} ms, ok={cell['ok']}"), flush=True)
    result["total_s"] = round(time.perf_counter() - start, 2)
    result["ok"] = status == 0
    write_json(out, result)
    text = summary(result)
    (out / "controller_check.txt").write_text(text + "\n")
    print(text)
    print(f"total {result['total_s']} s; {'all ok' if status == 0 else 'SOME CHECKS FAILED'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
