"""What a benchmark prints and writes: the machine and versions, the ratio table, the JSON and a
plot of every ratio against N (matplotlib where it imports, else an SVG written here)."""

from __future__ import annotations

import json
import math
import pathlib
import platform
import statistics
from collections.abc import Sequence
from typing import Any


def header(result: dict[str, Any]) -> str:
    """The lines above the table: model, engine options, machine, versions, load."""
    sys_ = result.get("systems", {}).get("genlm_vlm", {})
    graphs = sys_.get("cuda_graphs")
    lines = [
        f"model: {result['model']}",
        f"engine options (every system): {json.dumps(result['engine_opts'], sort_keys=True)}",
        f"machine: {platform.node() or '?'} ({platform.system()} {platform.machine()}), device: {sys_.get('device', '?')}",
        f"versions: genlm_vlm {result.get('genlm_vlm', '?')}, vLLM {sys_.get('vllm', '?')}, "
        f"torch {sys_.get('torch', '?')}, Python {sys_.get('python', '?')}",
        f"runner: {sys_.get('runner', '?')}, dtype: {sys_.get('dtype', '?')}, "
        f"{'CUDA graphs' if graphs else 'eager' if graphs is False else 'CUDA graphs: ?'}",
    ]
    if result.get("load_start") is not None:
        lines.append(f"load average at start / end: {fmt_load(result['load_start'])} / "
                     f"{fmt_load(result.get('load_end'))}")
    return "\n".join(lines)


def fmt_load(load: Any) -> str:
    return "-" if not load else " ".join(f"{x:.2f}" for x in load)


def _num(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"


def middle_half(values: Sequence[float]) -> tuple[float, float] | None:
    """The 25th and 75th percentiles of ``values`` (None for fewer than four: too few to say)."""
    if len(values) < 4:
        return None
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def table(result: dict[str, Any]) -> str:
    """The ratio table (markdown): one line per cell and compared system. A ratio is genlm_vlm's
    median rate over the other system's (above 1: genlm_vlm did the same work faster); where the
    systems reported their process CPU seconds, the same ratio from those follows it ("CPU").
    The last column is the middle half (25th to 75th percentile) of the ratios of single rounds
    (each round runs every system once), where there were at least four rounds."""
    lines = ["| workload | N | ratio | value | rates (median) | checks | rounds: middle half |",
             "|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        main = c["main"]
        checks = "ok" if not c["problems"] else f"{len(c['problems'])} FAILED"
        if c.get("agreement") is not None:
            checks += f", max score diff {c['agreement']:.2g}"
        if c["workload"] in ("smc", "control"):
            d = [r.get("distinct") for r in c["runs"][main]]
            checks += f", distinct {min(d)}-{max(d)}/{c['n']}" if d and None not in d else ""
        for label, ratio in c["ratios"].items():
            rates = f"{_num(c['rates'][main])} / {_num(c['rates'][label])} {c['unit']}"
            cpu = c.get("cpu_ratios", {}).get(label)
            value = f"**{_num(ratio)}**" + (f" (CPU {_num(cpu)})" if cpu else "")
            half = middle_half(c.get("round_ratios", {}).get(label, []))
            spread = f"{_num(half[0])}-{_num(half[1])}" if half else "-"
            lines.append(f"| {c['workload']} | {c['n']} | {main} / {label} | {value} | {rates} | {checks} | {spread} |")
    return "\n".join(lines)


def series(result: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """``"workload: a / b"`` -> ``[(N, ratio), ...]`` (N ascending)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for c in result["cells"]:
        for label, ratio in c["ratios"].items():
            out.setdefault(f"{c['workload']}: {c['main']} / {label}", []).append((c["n"], ratio))
    return {k: sorted(v) for k, v in out.items()}


def plot(result: dict[str, Any], path: pathlib.Path) -> pathlib.Path:
    """Plot every ratio against N into ``path`` (``.png`` with matplotlib, else ``.svg``);
    returns the file written."""
    data = series(result)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _svg(data, path.with_suffix(".svg"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in data.items():
        ax.plot([n for n, _ in pts], [r for _, r in pts], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (rows, particles, records or questions)")
    ax.set_ylabel("genlm_vlm rate / other system's rate")
    ax.set_title(f"genlm_vlm bench: {pathlib.Path(result['model']).name}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _svg(data: dict[str, list[tuple[int, float]]], out: pathlib.Path) -> pathlib.Path:
    """A small line chart of ``data`` (log2 N across, ratio up) as hand-written SVG."""
    w, h, left, right, top, bottom = 640, 400, 60, 20, 20, 50
    pts = [p for v in data.values() for p in v]
    ns = [math.log2(n) for n, _ in pts] or [0.0]
    ys = [r for _, r in pts] + [1.0]
    x0, x1 = min(ns), max(ns) if max(ns) > min(ns) else min(ns) + 1
    y0, y1 = 0.0, max(ys) * 1.1

    def xy(n: int, r: float) -> tuple[float, float]:
        x = left + (math.log2(n) - x0) / (x1 - x0) * (w - left - right)
        return x, h - bottom - (r - y0) / (y1 - y0) * (h - top - bottom)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             'font-size="11">', f'<rect width="{w}" height="{h}" fill="white"/>']
    _, y_one = xy(2 ** int(x0), 1.0)
    parts.append(f'<line x1="{left}" y1="{y_one:.1f}" x2="{w - right}" y2="{y_one:.1f}" stroke="grey" '
                 'stroke-dasharray="4"/>')
    parts.append(f'<text x="4" y="{y_one:.1f}">1.0</text>')
    for n in sorted({n for n, _ in pts}):
        x, _ = xy(n, 0)
        parts.append(f'<text x="{x:.1f}" y="{h - bottom + 15}" text-anchor="middle">{n}</text>')
    parts.append(f'<text x="{w / 2}" y="{h - 10}" text-anchor="middle">N</text>')
    for i, (name, series_pts) in enumerate(data.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(n, r) for n, r in series_pts))
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts.append(f'<text x="{left + 5}" y="{top + 12 * (i + 1)}" fill="{colour}">{_escape(name)}</text>')
    parts.append("</svg>")
    out.write_text("\n".join(parts) + "\n")
    return out


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write(result: dict[str, Any], out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Write ``bench.json``, ``table.md`` and the plot under ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "bench.json", "table": out_dir / "table.md"}
    files["plot"] = plot(result, out_dir / "ratios")
    result["files"] = {k: str(v) for k, v in files.items()}
    files["json"].write_text(json.dumps(result, indent=1, default=str) + "\n")
    files["table"].write_text(f"{header(result)}\n\n{table(result)}\n")
    (out_dir / "partial.json").unlink(missing_ok=True)
    return files
